"""Session benchmark: a decode step that sends only its new token, against the stateless call that
re-sends the whole context; a packed step of many sessions; a decode loop over SessionAttendStream.

    python -m bench.sessions                          # starts `python -m service` itself (--device auto)
    python -m bench.sessions --contexts 1024,8192,32768 --iters 200 --packed 64 --loop-layers 32

Rows (Hq 32, Hkv 8, D 128, bf16 on a GPU; smaller on the CPU):
  step C          one session holding C cached tokens: a step with q, k, v of one token (the context
                  grows by one token a step), over HTTP (POST /sessions/{id}/attend, safetensors) and
                  gRPC (SessionAttend); p50/p99 in ms, beside the kernel's own time for that step.
  stateless C     POST /attention with q of one token against all C keys and values.
  packed S        one POST /sessions/attend naming S sessions of mixed lengths, one token each,
                  beside the kernel's own time for the same paged launch (read off /metrics is not
                  possible per launch, so the kernel is timed in this process on the same lengths).
  loop S x L      S sessions decoding over one SessionAttendStream, L layers a token: each layer's
                  packed step waits for the one before (as a model's layers do); tokens per second.

This client process keeps freed memory for reuse as the server does (``--client-malloc``): with
glibc's defaults, a packed step's 800 KB message and its answer may page-fault fresh memory each
time (~1 ms a step on a small VM; no difference measured on an H100 host).
"""

from __future__ import annotations

import argparse
import http.client
import queue
import statistics
import sys
import time

import httpx
import safetensors.torch as st
import torch

from bench.http_latency import pct
from bench.local import local_server as bench_server
from service.allocator import reuse_freed_memory
from service.client import GrpcAttentionClient
from service.wire.tensors import ServerTiming

HAS_CUDA = torch.cuda.is_available()
HQ, HKV, D = (32, 8, 128) if HAS_CUDA else (8, 2, 64)
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
PREFILL_BYTES = 256 << 20  # the most q, k and v one prefill step of the decode loop sends
CHUNK = 2048  # prefill chunk: keeps each request well under the body limit


def _rand(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DTYPE)


def _body(**tensors: torch.Tensor) -> bytes:
    return st.save({k: v.contiguous() for k, v in tensors.items()})


def _post(client: httpx.Client, path: str, body: bytes, params: dict | None = None) -> httpx.Response:
    r = client.post(path, content=body, params=params, headers={"content-type": "application/x-safetensors"})
    if r.status_code >= 300:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
    return r


class Poster:
    """The timed HTTP calls' client: ``http.client`` over one keep-alive connection (the default,
    as ``bench.http_latency``: its own cost is ~0.1 ms a small call, so what is timed is the
    server's) or ``httpx`` (what most Python clients use; it adds ~1 ms a small call).
    ``post(path, body)`` -> (the answer's bytes, its Server-Timing header). A connection idle for
    ``IDLE_S`` is opened again before its next call: the server closes keep-alive connections idle
    for 5 s (uvicorn's default), e.g. while a row prefills its sessions."""

    IDLE_S = 3.0

    def __init__(self, kind: str, client: httpx.Client):
        self.kind, self.client = kind, client
        self.used = time.monotonic()
        if kind == "http.client":
            url = client.base_url
            self.conn = http.client.HTTPConnection(url.host, url.port, timeout=600)

    def post(self, path: str, body: bytes) -> tuple[bytes, str]:
        if self.kind == "httpx":
            r = _post(self.client, path, body)
            return r.content, r.headers.get("server-timing", "")
        if time.monotonic() - self.used > self.IDLE_S:
            self.conn.close()  # http.client connects again on the next request
        self.used = time.monotonic()
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/x-safetensors"})
        r = self.conn.getresponse()
        data = r.read()
        self.used = time.monotonic()
        if r.status >= 300:
            raise RuntimeError(f"{path}: {r.status} {data[:300]!r}")
        return data, r.getheader("server-timing", "")

    def close(self) -> None:
        if self.kind == "http.client":
            self.conn.close()


def create(client: httpx.Client, context: int, seed: int) -> str:
    """A session holding ``context`` tokens, prefilled in chunks (causal)."""
    r = client.post("/sessions", json={"layers": 1, "num_kv_heads": HKV, "head_dim": D,
                                       "dtype": str(DTYPE).removeprefix("torch.")})
    r.raise_for_status()
    sid = r.json()["session"]
    done = 0
    while done < context:
        n = min(CHUNK, context - done)
        _post(client, f"/sessions/{sid}/attend", _body(q=_rand(1, HQ, n, D, seed=seed + done),
                                                        k=_rand(1, HKV, n, D, seed=seed + done + 1),
                                                        v=_rand(1, HKV, n, D, seed=seed + done + 2)))
        done += n
    return sid


def timed(call, iters: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        call()
    xs = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        xs.append((time.perf_counter() - t0) * 1e3)
    return xs


def step_row(client: httpx.Client, grpc_client: GrpcAttentionClient, c: int, iters: int, poster: Poster) -> tuple:
    """(context, step bytes, step p50, p99, stateless bytes, stateless p50, p99, stateless/step,
    gRPC step p50, p99, kernel ms, {Server-Timing phase: median ms of the HTTP steps}); the timed
    HTTP calls go through ``poster``."""
    sid = create(client, c, seed=c)
    tokens = [(_rand(1, HQ, 1, D, seed=i), _rand(1, HKV, 1, D, seed=i + 1), _rand(1, HKV, 1, D, seed=i + 2))
              for i in range(8)]
    bodies = [_body(q=q, k=k, v=v) for q, k, v in tokens]
    it = iter(range(10**9))
    phases: dict[str, list[float]] = {}

    def http_step():
        _, timing = poster.post(f"/sessions/{sid}/attend", bodies[next(it) % 8])
        for name, ms in ServerTiming.parse(timing).items():
            phases.setdefault(name, []).append(ms)

    step = timed(http_step, iters)
    grpc_step = timed(lambda: grpc_client.step(sid, *tokens[next(it) % 8]), iters)
    client.delete(f"/sessions/{sid}")
    stateless_body = _body(q=_rand(1, HQ, 1, D, seed=0), k=_rand(1, HKV, c, D, seed=1), v=_rand(1, HKV, c, D, seed=2))
    stateless = timed(lambda: poster.post("/attention", stateless_body), max(5, iters // 10), warmup=2)
    s50, a50 = statistics.median(step), statistics.median(stateless)
    return (c, len(bodies[0]), s50, pct(step, 99), len(stateless_body), a50, pct(stateless, 99), a50 / s50,
            statistics.median(grpc_step), pct(grpc_step, 99), kernel_ms([c]) if HAS_CUDA else float("nan"),
            {name: statistics.median(xs) for name, xs in phases.items()})


def loop_row(client: httpx.Client, grpc_client: GrpcAttentionClient, sessions: int, layers: int, context: int,
             tokens: int) -> tuple:
    """(sessions, layers, context, tokens/s, ms a layer step): ``sessions`` sessions of ``context``
    cached tokens on every layer decode ``tokens`` tokens over one SessionAttendStream, one packed
    step a layer, each sent once the layer before has answered."""
    ids = []
    for _ in range(sessions):
        r = client.post("/sessions", json={"layers": layers, "num_kv_heads": HKV, "head_dim": D,
                                           "dtype": str(DTYPE).removeprefix("torch.")})
        r.raise_for_status()
        ids.append(r.json()["session"])
    # every layer prefilled with ``context`` tokens, a packed step of as many sessions as fit in
    # PREFILL_BYTES (a protobuf message holds less than 2 GiB)
    per = max(1, min(sessions, PREFILL_BYTES // (context * (HQ + 2 * HKV) * D * DTYPE.itemsize)))
    q, k, v = _rand(per * context, HQ, D, seed=4), _rand(per * context, HKV, D, seed=5), \
        _rand(per * context, HKV, D, seed=6)
    for layer in range(layers):
        for i in range(0, sessions, per):
            group = ids[i:i + per]
            rows = len(group) * context
            grpc_client.packed_step(group, q[:rows], k[:rows], v[:rows], [context] * len(group), layer=layer)
    q1, k1, v1 = _rand(sessions, HQ, D, seed=7), _rand(sessions, HKV, D, seed=8), _rand(sessions, HKV, D, seed=9)
    answered: queue.Queue = queue.Queue()

    def requests():
        for _ in range(tokens):
            for layer in range(layers):
                yield {"sessions": ids, "q": q1, "k": k1, "v": v1, "q_lengths": [1] * sessions, "layer": layer}
                answered.get()  # the next layer's q depends on this layer's answer

    t0 = time.perf_counter()
    for _, result in grpc_client.session_stream(requests()):
        if isinstance(result, Exception):
            raise result
        answered.put(None)
    elapsed = time.perf_counter() - t0
    for sid in ids:
        client.delete(f"/sessions/{sid}")
    return sessions, layers, context, sessions * tokens / elapsed, elapsed / (tokens * layers) * 1e3


def packed_row(client: httpx.Client, sessions: int, max_context: int, iters: int, poster: Poster) -> tuple:
    lengths = [max(1024, int(max_context * (i + 1) / sessions)) for i in range(sessions)]
    ids = [create(client, n, seed=7 * i) for i, n in enumerate(lengths)]
    q, k, v = _rand(sessions, HQ, D, seed=1), _rand(sessions, HKV, D, seed=2), _rand(sessions, HKV, D, seed=3)
    body = st.save({"q": q, "k": k, "v": v, "q_lengths": torch.ones(sessions, dtype=torch.int32)},
                   metadata={"sessions": ",".join(ids)})
    phases: dict[str, list[float]] = {}

    def post():
        _, timing = poster.post("/sessions/attend", body)
        for name, ms in ServerTiming.parse(timing).items():
            phases.setdefault(name, []).append(ms)

    xs = timed(post, iters)
    for sid in ids:
        client.delete(f"/sessions/{sid}")
    return sessions, min(lengths), max(lengths), len(body), statistics.median(xs), pct(xs, 99), \
        kernel_ms(lengths) if HAS_CUDA else float("nan"), {name: statistics.median(x) for name, x in phases.items()}


def kernel_ms(lengths: list[int], page: int = 64) -> float:
    """Device ms of the paged decode launches alone (append + attention) for these lengths, on this
    process's GPU, launched as the sessions launch them (``host_index``: no device-to-host read);
    replayed from a CUDA graph (``bench.timing.graph_ms``: L2 flushed before each replay)."""
    import kernels

    dev = torch.device("cuda")
    s = len(lengths)
    pages_per = [(n + 1 + page - 1) // page for n in lengths]
    table = torch.zeros(s, max(pages_per), dtype=torch.int32)
    p = 0
    for i, np_ in enumerate(pages_per):
        table[i, :np_] = torch.arange(p, p + np_, dtype=torch.int32)
        p += np_
    kp = torch.randn(p, page, HKV, D, device=dev, dtype=DTYPE)
    vp = torch.randn_like(kp)
    table = table.to(dev)
    before = torch.tensor(lengths, dtype=torch.int32, device=dev)
    after = before + 1
    cu = torch.arange(s + 1, dtype=torch.int32, device=dev)
    q = torch.randn(s, HQ, D, device=dev, dtype=DTYPE)
    kn, vn = torch.randn(s, HKV, D, device=dev, dtype=DTYPE), torch.randn(s, HKV, D, device=dev, dtype=DTYPE)

    host = (cu.cpu(), after.cpu(), table.cpu())

    def launch():  # as a session step launches: the lengths' host copies passed, nothing read back
        kernels.append_paged(kp, vp, table, before, kn, vn, cu)
        kernels.attention_paged(q, kp, vp, table, after, cu, host_index=host)

    launch()  # compiles
    torch.cuda.synchronize()
    from bench.timing import graph_ms

    return graph_ms(launch)  # replayed from a CUDA graph: eager, the launches' ~0.2 ms of host work is what is timed


def render(steps: list[tuple], packed: tuple | None, loop: tuple | None, command: str,
           http_client: str = "http.client") -> str:
    dev = torch.cuda.get_device_name() if HAS_CUDA else "CPU"
    out = [f"{time.strftime('%Y-%m-%d')}, {dev}, torch {torch.__version__}; `{command}`", "",
           f"Decode step, Hq {HQ} / Hkv {HKV} / D {D}, {str(DTYPE).removeprefix('torch.')}, ms (HTTP "
           f"safetensors from {http_client}; gRPC SessionAttend; kernel: the device time of the step's "
           "append + attention):",
           "", "| context | step bytes | HTTP p50 | HTTP p99 | gRPC p50 | gRPC p99 | kernel | gRPC p50 - kernel "
           "| stateless bytes | stateless p50 | stateless p99 | stateless / HTTP step |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, sb, s50, s99, ab, a50, a99, ratio, g50, g99, kms, _ in steps:
        out.append(f"| {c} | {sb} | {s50:.3f} | {s99:.3f} | {g50:.3f} | {g99:.3f} | {kms:.3f} | {g50 - kms:.3f} "
                   f"| {ab} | {a50:.2f} | {a99:.2f} | {ratio:.1f}x |")
    timed_rows = [(str(c), s50, ph) for c, _, s50, *_, ph in steps]
    if packed:
        timed_rows.append((f"packed {packed[0]}", packed[4], packed[-1]))
    names = list(dict.fromkeys(n for *_, ph in timed_rows for n in ph))
    if names:  # where an HTTP step's time goes on the server (its Server-Timing, medians)
        out += ["", "HTTP steps, the server's phases (Server-Timing medians, ms); `outside` is the p50 less their "
                "sum (the client, the socket, uvicorn and the middleware):", "",
                "| context | " + " | ".join(names) + " | outside |", "|---|" + "---|" * (len(names) + 1)]
        for c, s50, ph in timed_rows:
            out.append(f"| {c} | " + " | ".join(f"{ph.get(n, float('nan')):.3f}" for n in names)
                       + f" | {s50 - sum(ph.values()):.3f} |")
    if packed:
        s, lo, hi, nb, p50, p99, kms, _ = packed
        out += ["", f"Packed step: {s} sessions of {lo}..{hi} cached tokens, one token each:", "",
                "| sessions | body bytes | p50 ms | p99 ms | kernel ms (append + attention) | p50 / kernel |",
                "|---|---|---|---|---|---|", f"| {s} | {nb} | {p50:.3f} | {p99:.3f} | {kms:.3f} | {p50 / kms:.2f} |"]
    if loop:
        s, layers, c, tps, ms = loop
        out += ["", f"Decode loop over one SessionAttendStream: {s} sessions of {c} cached tokens, {layers} layers, "
                "one packed step a layer, each after the one before:", "",
                "| sessions | layers | context | tokens/s | ms a layer step |", "|---|---|---|---|---|",
                f"| {s} | {layers} | {c} | {tps:.1f} | {ms:.3f} |"]
    return "\n".join(out)


def local_server(device: str):
    """A server of this benchmark's own, warmed for its geometry (its paged kernels too)."""
    return bench_server("--device", device, "--processes", "1", "--request-timeout-ms", "600000",
                        "--warmup-shapes", f"1x{HKV}x128x{D}", "--warmup-dtypes", str(DTYPE).removeprefix("torch."))


def _progress(what: str, fn, *args):
    """``fn(*args)``, its row and seconds on stderr as it finishes (the tables come at the end)."""
    t0 = time.perf_counter()
    row = fn(*args)
    print(f"{what}: {time.perf_counter() - t0:.1f} s: {row}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--grpc-target", help="the running server's gRPC host:port (default: the URL's host, 8001)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--contexts", default="1024,8192,32768" if HAS_CUDA else "256,1024")
    ap.add_argument("--iters", type=int, default=200 if HAS_CUDA else 20)
    ap.add_argument("--packed", type=int, default=64 if HAS_CUDA else 4, help="sessions in the packed row (0: none)")
    ap.add_argument("--loop-sessions", type=int, default=64 if HAS_CUDA else 4,
                    help="sessions of the decode loop row (0: none)")
    ap.add_argument("--loop-layers", type=int, default=32 if HAS_CUDA else 2)
    ap.add_argument("--loop-context", type=int, default=4096 if HAS_CUDA else 64)
    ap.add_argument("--loop-tokens", type=int, default=16 if HAS_CUDA else 3)
    ap.add_argument("--http-client", choices=("http.client", "httpx"), default="http.client",
                    help="the timed HTTP calls' client (see Poster)")
    ap.add_argument("--client-malloc", choices=("reuse", "glibc"), default="reuse",
                    help="reuse: this client process keeps freed blocks for reuse, as the server does "
                         "(service.allocator; docs/grpc.md#big-messages-from-python); glibc: its defaults")
    args = ap.parse_args(argv)
    if args.client_malloc == "reuse":
        reuse_freed_memory(1 << 30)
    command = "python -m bench.sessions " + " ".join(argv if argv is not None else sys.argv[1:])
    contexts = [int(x) for x in args.contexts.split(",") if x]

    def go(url: str, target: str) -> str:
        with httpx.Client(base_url=url, timeout=600) as client, GrpcAttentionClient(target, timeout=600) as g:
            poster = Poster(args.http_client, client)
            steps = [_progress(f"step at {c}", step_row, client, g, c, args.iters, poster) for c in contexts]
            packed = _progress("packed", packed_row, client, args.packed, max(contexts),
                               max(5, args.iters // 4), poster) if args.packed else None
            poster.close()
            loop = _progress("loop", loop_row, client, g, args.loop_sessions, args.loop_layers, args.loop_context,
                             args.loop_tokens) if args.loop_sessions else None
        return render(steps, packed, loop, command, args.http_client)

    if args.url:
        from urllib.parse import urlparse

        print(go(args.url, args.grpc_target or f"{urlparse(args.url).hostname}:8001"))
    else:
        with local_server(args.device) as s:
            print(go(s.url, s.grpc_target))


if __name__ == "__main__":
    main()
