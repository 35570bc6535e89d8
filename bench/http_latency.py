"""HTTP transport benchmark: what a small call pays above the kernel, and a large call's throughput,
with the JSON encodings beside safetensors.

    python -m bench.http_latency                        # starts `python -m service` itself (--device auto)
    python -m bench.http_latency --url http://HOST:8000 # against a running server (same machine for "added")
    python -m bench.http_latency --iters 500 --large-iters 10 --write docs/benchmarks/service.md
    python -m bench.service http ...                    # the same, as a section of the service benchmarks
    bash bench/gpu.sh service                           # with the engine and gRPC benchmarks, into reports/service/

Rows:
  kernel                 kernels.attention on --device in this process, inputs already there: the floor.
  small safetensors      1x8x128x64 fp16 POST /attention, one call in flight, body built once:
                         p50/p90/p99 and the p50 *added* above the kernel (HTTP + decode + queue + copies).
  ... bare socket        the same call written to and read from a socket directly: without the
                         client library's own time (http.client's ~0.1 ms).
  small AttentionClient  the same through service.client.http (tensor packing/unpacking included).
  small JSON base64      {"shape","dtype","data": base64} in and out.
  small JSON lists       nested lists in and out (float32 on the wire).
  large safetensors      1x32x8192x128 bf16 (1x8x1024x64 without a GPU): end-to-end GB/s counted as
                         request + response bytes per second of wall time, beside the kernel alone.
  large AttentionClient  the large call through service.client.http (torch tensors in and out).
  large JSON base64      the same call as base64 JSON.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client as http_client
import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path

import orjson
import safetensors.torch as st
import torch

import kernels
from bench.local import local_server as bench_server
from service.client import AttentionClient
from service.wire.tensors import ServerTiming

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## HTTP transport"
HAS_CUDA = torch.cuda.is_available()
SMALL = (1, 8, 128, 64)
LARGE = (1, 32, 8192, 128) if HAS_CUDA else (1, 8, 1024, 64)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def tensors(shape, dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*shape, generator=g).to(dtype) for n in ("q", "k", "v")}


def kernel_times(shape, dtype, device: str, iters: int) -> list[float]:
    """Seconds per kernels.attention call on device-resident inputs (synchronised per call)."""
    q, k, v = (t.to(device) for t in tensors(shape, dtype).values())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        kernels.attention(q, k, v)
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        kernels.attention(q, k, v)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _json_body(ts: dict[str, torch.Tensor], encoding: str) -> bytes:
    if encoding == "lists":
        return orjson.dumps({n: t.float().numpy() for n, t in ts.items()}, option=orjson.OPT_SERIALIZE_NUMPY)
    doc = {}
    for n, t in ts.items():
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        doc[n] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "data": base64.b64encode(raw).decode(),
        }
    return orjson.dumps(doc)


def http_times(
    http: http_client.HTTPConnection, body: bytes, ctype: str, iters: int, phases: dict | None = None
) -> tuple[list[float], int]:
    """Seconds per POST /attention (one in flight, keep-alive) and the response size; with
    ``phases``, each call's Server-Timing durations (ms) are appended there by phase name.

    The standard library's client, so that the client's own cost stays out of the server's
    number: httpx takes several times as long as http.client on a large call, and adds a fraction
    of a millisecond to a small one (docs/benchmarks/service.md)."""
    headers = {"Content-Type": ctype}

    timing = ""

    def post() -> bytes:
        nonlocal timing
        http.request("POST", "/attention", body=body, headers=headers)
        r = http.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"POST /attention: {r.status} {data[:300]!r}")
        timing = r.getheader("server-timing", "")
        return data

    size = 0
    for _ in range(3):
        size = len(post())
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        post()
        out.append(time.perf_counter() - t0)
        if phases is not None:
            for name, dur in ServerTiming.parse(timing).items():
                phases.setdefault(name, []).append(dur)
    return out, size


def raw_times(host: str, port: int, body: bytes, ctype: str, iters: int, phases: dict,
              warmup: int = 3) -> tuple[list[float], int]:
    """Seconds per POST /attention from a bare socket (the request written once, the answer read
    into a buffer made once): the server's share without a client library's (http.client's own
    time is about a tenth of a millisecond per small call). Returns the times and the answer's
    size."""
    head = (f"POST /attention HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    request = head + body
    buf = bytearray(len(body) + (1 << 20))  # an attention answer is no bigger than its request
    view = memoryview(buf)
    out = []
    length = 0
    with socket.create_connection((host, port), timeout=600) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(iters + warmup):
            t0 = time.perf_counter()
            s.sendall(request)
            n = end = 0
            while (end := buf.find(b"\r\n\r\n", 0, n)) < 0:
                got = s.recv_into(view[n:])
                if not got:
                    raise RuntimeError("the server closed the connection")
                n += got
            headers = bytes(buf[:end]).decode("latin-1").lower().split("\r\n")
            if " 200 " not in headers[0] + " ":
                raise RuntimeError(f"POST /attention: {headers[0]}")
            fields = dict(line.split(": ", 1) for line in headers[1:] if ": " in line)
            length = int(fields["content-length"])
            while n - end - 4 < length:
                n += s.recv_into(view[n:])
            if i >= warmup:
                out.append(time.perf_counter() - t0)
                for name, dur in ServerTiming.parse(fields.get("server-timing", "")).items():
                    phases.setdefault(name, []).append(dur)
    return out, length


def client_times(url: str, ts: dict[str, torch.Tensor], iters: int, warmup: int = 3) -> list[float]:
    with AttentionClient(url, timeout=600) as c:
        for _ in range(warmup):
            c.attention(**ts)
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            c.attention(**ts)
            out.append(time.perf_counter() - t0)
    return out


def row(name, shape, dtype, xs, kernel_p50=None, nbytes=None, note="") -> dict:
    p50 = pct(xs, 50)
    return {
        "run": name,
        "shape": "x".join(map(str, shape)),
        "dtype": dtype,
        "p50": 1e3 * p50,
        "p90": 1e3 * pct(xs, 90),
        "p99": 1e3 * pct(xs, 99),
        "added": None if kernel_p50 is None else 1e3 * (p50 - kernel_p50),
        "gbs": None if nbytes is None else nbytes / p50 / 1e9,
        "note": note,
    }


def split_note(xs: list[float], phases: dict[str, list[float]], client: bool = True) -> str:
    """The server's Server-Timing medians and what the call took beyond their sum."""
    split = ", ".join(f"{name} {pct(ds, 50):.3f}" for name, ds in phases.items())
    outside = 1e3 * pct(xs, 50) - sum(pct(ds, 50) for ds in phases.values())
    return (f"server p50 ms: {split}; outside the handler (uvicorn, sockets{', client' if client else ''}) "
            f"~{outside:.3f}")


def minor_faults(pid: int | None) -> int | None:
    """Minor page faults of process ``pid`` so far (/proc/PID/stat field 10); None if unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def measure(url: str, device: str, iters: int, large_iters: int, small_only: bool = False,
            server_pid: int | None = None) -> list[dict]:
    rows = []
    small = tensors(SMALL, torch.float16)
    k_times = kernel_times(SMALL, torch.float16, device, iters)
    k_small = pct(k_times, 50)
    rows.append(row("kernel", SMALL, "fp16", k_times, note=f"on {device}, inputs resident"))
    parsed = urllib.parse.urlsplit(url)
    http = http_client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    try:
        st_body = st.save(small)
        phases: dict[str, list[float]] = {}
        xs, _ = http_times(http, st_body, "application/x-safetensors", iters, phases)
        rows.append(row("small safetensors", SMALL, "fp16", xs, k_small,
                        note=f"{len(st_body) / 1024:.0f} KiB in; {split_note(xs, phases)}"))  # fmt: skip
        raw_phases: dict[str, list[float]] = {}
        xs, _ = raw_times(parsed.hostname, parsed.port, st_body, "application/x-safetensors", iters, raw_phases)
        rows.append(row("small safetensors, bare socket", SMALL, "fp16", xs, k_small,
                        note=split_note(xs, raw_phases, client=False)))
        if small_only:
            return rows
        rows.append(row("small AttentionClient", SMALL, "fp16", client_times(url, small, iters), k_small))
        for enc in ("base64", "lists"):
            body = _json_body(small if enc == "base64" else {n: t.float() for n, t in small.items()}, enc)
            xs, _ = http_times(
                http, body, "application/json", max(10, iters // (1 if enc == "base64" else 5))
            )
            rows.append(row(f"small JSON {enc}", SMALL, "fp16" if enc == "base64" else "fp32", xs, k_small,
                            note=f"{len(body) / 1024:.0f} KiB in"))  # fmt: skip
        large = tensors(LARGE, torch.bfloat16)
        k_large = kernel_times(LARGE, torch.bfloat16, device, large_iters)
        in_bytes = sum(t.numel() * 2 for t in large.values())
        rows.append(row("large kernel", LARGE, "bf16", k_large, nbytes=in_bytes + in_bytes // 3,
                        note="GB/s here: the same bytes over the kernel's own time"))  # fmt: skip
        for name, body, ctype in (
            ("large safetensors", st.save(large), "application/x-safetensors"),
            ("large JSON base64", _json_body(large, "base64"), "application/json"),
        ):
            phases = {}
            faults = minor_faults(server_pid)
            xs, out_size = http_times(http, body, ctype, large_iters, phases)
            if faults is not None:  # fresh memory the server touched: 4 KiB a fault
                faulted = (minor_faults(server_pid) - faults) / (large_iters + 3)  # http_times warms up with 3
                faults_note = f"; server page faults {faulted:,.0f} a call (~{faulted * 4 / 1024:,.0f} MiB)"
            else:
                faults_note = ""
            rows.append(
                row(
                    name,
                    LARGE,
                    "bf16",
                    xs,
                    pct(k_large, 50),
                    nbytes=len(body) + out_size,
                    note=f"{len(body) / 2**20:.0f} MiB in, {out_size / 2**20:.0f} MiB out; {split_note(xs, phases)}"
                         + faults_note,
                )
            )
            if ctype == "application/x-safetensors":
                phases = {}
                xs, out_size = raw_times(parsed.hostname, parsed.port, body, ctype, large_iters, phases, warmup=1)
                rows.append(row(f"{name}, bare socket", LARGE, "bf16", xs, pct(k_large, 50),
                                nbytes=len(body) + out_size,
                                note=split_note(xs, phases, client=False)))
                rows.append(row("large AttentionClient", LARGE, "bf16", client_times(url, large, large_iters, warmup=1),
                                pct(k_large, 50), nbytes=len(body) + out_size,
                                note="torch tensors in and out: packing and unpacking included"))
    finally:
        http.close()
    return rows


def render(rows: list[dict], command: str) -> str:
    card = torch.cuda.get_device_name(0) if HAS_CUDA else f"CPU only ({os.cpu_count()} cores)"
    lines = [
        SECTION,
        "",
        f"- card: {card}; torch {torch.__version__}",
        f"- command: `{command}`",
        "- one call in flight over a keep-alive connection (http.client; the AttentionClient row: urllib3); "
        "added = p50 of the call - p50 of the kernel",
        "",
        "| run | shape BxHxNxD | dtype | p50 ms | p90 ms | p99 ms | added p50 ms | GB/s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"

    for r in rows:
        lines.append(
            f"| {r['run']} | {r['shape']} | {r['dtype']} | {f(r['p50'])} | {f(r['p90'])} | {f(r['p99'])} "
            f"| {f(r['added'])} | {f(r['gbs'])} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def local_server(device: str):
    """A server on ``device`` (one process) for the bench: yields (url, pid)."""
    with bench_server(
        "--device", device,
        "--processes", "1",  # one server process, whose page faults the large rows count
        "--request-timeout-ms", "600000",
        # the large JSON row sends ~260 MiB of base64: above the default JSON limit (64 MiB)
        "--max-json-mb", "1024",
        # tune exactly what is measured (other shapes would run a default config: --autotune-new-shapes)
        "--warmup-shapes", "x".join(map(str, SMALL)) + "," + "x".join(map(str, LARGE)),
        "--warmup-dtypes", "float16,bfloat16", grpc=False,
    ) as s:  # fmt: skip
        yield s.url, s.pid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server; default: start one here")
    parser.add_argument(
        "--device",
        default="cuda:0" if HAS_CUDA else "cpu",
        help="device of the kernel-alone rows (and of the server started here)",
    )
    parser.add_argument("--iters", type=int, default=300, help="calls per small row")
    parser.add_argument("--large-iters", type=int, default=10 if HAS_CUDA else 3, help="calls per large row")
    parser.add_argument("--small-only", action="store_true",
                        help="only the kernel and small safetensors rows (for sweeps of server settings)")
    parser.add_argument("--write", type=Path, default=None, help="update this markdown file's HTTP section")


def run(args: argparse.Namespace, command: str) -> str:
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, None) if args.url else stack.enter_context(local_server(args.device))
        text = render(measure(url, args.device, args.iters, args.large_iters, args.small_only, pid), command)
    print(text)
    if args.write:
        write_section(args.write, text)
    return text


def write_section(path: Path, text: str) -> None:
    """Replace this section of ``path`` (the engine's and gRPC's sections stay as they are)."""
    old = path.read_text() if path.exists() else "# attnserve service benchmarks\n\n"
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        nxt = rest.find("\n## ")
        new = head + text + ("\n" + rest[nxt + 1 :] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http_latency", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    run(args, "python -m bench.http_latency " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
