"""Service benchmarks: the engine in process (this module) and the HTTP transport (bench/http_latency.py).
Each section returns rows for one markdown table.

    python -m bench.service engine [--write reports/service/service.md]   # in-process engine
    python -m bench.service engine --only small,large,multi --seconds 3
    python -m bench.service http ...            # = python -m bench.http_latency ...
    bash bench/gpu.sh service                   # the service's GPU tests, then engine, HTTP and gRPC

Engine (in-process), no transport in the way:
  (a) small: 64 concurrent submitters of 1x8x128x64 fp16 requests, batching on vs off:
      throughput and latency percentiles (target: >= 5x the throughput, p99 <= 2x unbatched p99);
  (b) large: 1x32x8192x128 bf16 requests from host memory: worker throughput vs the kernel's own
      on device-resident inputs (target: >= 95%);
  (c) multi: the batched small-request run on two GPUs vs one (target: >= 1.9x): one process, a
      worker per GPU; with ``procs``, also two processes of one GPU each, as ``--processes 2`` serves
      (each its own engine and 64 submitters, measured over the same seconds; their rates summed).
Without a GPU the same runs use the CPU and smaller large-request shapes (for a smoke test only).
With --null-kernel the kernel only allocates its outputs: what is left is the engine's host path
(validation, batching, staging and copies, futures), i.e. the most any device could give it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

import torch

import kernels
from service.core.engine import Engine
from service.core.types import AttentionRequest
from service.settings import load_settings

SECTION = "## Engine (in-process)"
HAS_CUDA = torch.cuda.is_available()
SMALL = (1, 8, 128, 64)
LARGE = (1, 32, 8192, 128) if HAS_CUDA else (1, 8, 1024, 64)


def _pool(shape, dtype, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n distinct (q, k, v) host tensors: requests arrive as ordinary (pageable) host memory."""
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(*shape, generator=g).to(dtype) for _ in range(3)) for _ in range(n)]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def _load(
    device: str,
    batching: bool,
    shape,
    dtype,
    submitters: int,
    seconds: float,
    warmup_shapes: str,
    before_measure=None,
    **overrides,
) -> dict:
    """Closed loop: ``submitters`` coroutines each send one request, await it, send the next.
    ``before_measure`` (blocking, run in a thread) is waited for after the warm-up."""
    dtype_name = str(dtype).removeprefix("torch.")
    settings = load_settings(
        ["--device", device, "--warmup-shapes", warmup_shapes, "--warmup-dtypes", dtype_name],
        batching=batching,
        request_timeout_ms=600_000,
        **overrides,
    )
    engine = Engine(settings)
    await engine.start()
    pool = _pool(shape, dtype, 16)
    lat: list[float] = []
    state = {"measuring": False, "stop": False}

    async def submitter(i: int) -> None:
        j = i
        while not state["stop"]:
            q, k, v = pool[j % len(pool)]
            j += 1
            t0 = time.perf_counter()
            await engine.attend(AttentionRequest(q=q, k=k, v=v))
            if state["measuring"]:
                lat.append(time.perf_counter() - t0)

    tasks = [asyncio.create_task(submitter(i)) for i in range(submitters)]
    await asyncio.sleep(min(1.0, seconds / 3))  # warm: pinned pools, autotuning of batched shapes
    reg = engine.metrics_registry

    def totals() -> tuple[float, float, float]:
        """(launches, seconds in launches, seconds queued) so far."""
        per_dev = [
            (reg.get_sample_value("attnserve_inference_compute_duration_seconds_count", {"device": d}) or 0,
             reg.get_sample_value("attnserve_inference_compute_duration_seconds_sum", {"device": d}) or 0)
            for d in dict.fromkeys(engine.devices)  # two CPU workers share the label "cpu"
        ]  # fmt: skip
        queued = (
            reg.get_sample_value("attnserve_inference_queue_duration_seconds_sum", {"kind": "attention"}) or 0
        )
        return sum(c for c, _ in per_dev), sum(t for _, t in per_dev), queued

    if before_measure is not None:
        await asyncio.to_thread(before_measure)
    before = totals()
    state["measuring"] = True
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    state["measuring"] = False
    elapsed = time.perf_counter() - t0
    n = len(lat)
    after = totals()
    launches = after[0] - before[0]
    state["stop"] = True
    await asyncio.gather(*tasks)
    await engine.drain()
    return {
        "req_s": n / elapsed,
        "p50_ms": 1e3 * _pct(lat, 50),
        "p99_ms": 1e3 * _pct(lat, 99),
        "mean_batch": n / launches if launches else float("nan"),
        # where a request's time goes: waiting in the batcher vs its launch (copies + kernel + hops)
        "queue_ms": 1e3 * (after[2] - before[2]) / max(1, n),
        "launch_ms": 1e3 * (after[1] - before[1]) / max(1, launches),
    }


def _kernel_rate(shape, dtype, device: str, seconds: float) -> float:
    """Requests/s of the kernel alone on device-resident inputs (no copies, no service)."""
    q, k, v = (t.to(device) for t in _pool(shape, dtype, 1)[0])
    for _ in range(3):
        kernels.attention(q, k, v)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            kernels.attention(q, k, v)
        n += 5
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def _copy_times(shape, dtype, device: str) -> dict[str, float]:
    """Seconds that moving one request takes, each step alone: the host copy into pinned memory,
    host->device of q, k, v, device->host of o. Empty off a GPU."""
    if not device.startswith("cuda"):
        return {}
    q, k, v = _pool(shape, dtype, 1)[0]
    src = torch.cat([q, k, v])
    pinned = torch.empty_like(src, pin_memory=True)
    dev = torch.empty_like(src, device=device)

    def seconds(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / 5

    return {
        "bytes": src.nbytes,
        "host": seconds(lambda: pinned.copy_(src)),
        "h2d": seconds(lambda: dev.copy_(pinned, non_blocking=True)),
        "d2h": seconds(lambda: pinned[: len(q)].copy_(dev[: len(q)], non_blocking=True)),
    }


def _copy_note(times: dict[str, float]) -> str:
    if not times:
        return ""
    nbytes = times["bytes"]
    return (f"per request: q,k,v = {nbytes / 2**20:.0f} MiB; host->pinned {1e3 * times['host']:.2f} ms "
            f"({nbytes / times['host'] / 1e9:.0f} GB/s), H2D {1e3 * times['h2d']:.2f} ms "
            f"({nbytes / times['h2d'] / 1e9:.0f} GB/s), "
            f"D2H of o {1e3 * times['d2h']:.2f} ms")  # fmt: skip


def _null_attention(q, k, v, causal=False, scale=None, kv_lengths=None, return_lse=False, kernel="auto"):
    """``kernels.attention``'s signature, no compute: o and lse allocated on q's device."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return (o, lse) if return_lse else o


def _proc_load(device: str, seconds: float, null_kernel: bool, barrier, results) -> None:
    """One process of the ``procs`` run: the batched small closed loop on ``device``."""
    os.environ.pop("TRITON_INTERPRET", None) if not HAS_CUDA else None
    if null_kernel:
        kernels.attention = _null_attention
    small = "x".join(map(str, SMALL))
    results.put(asyncio.run(_load(device, True, SMALL, torch.float16, 64, seconds, small,
                                  before_measure=barrier.wait)))


def _procs_load(devices: list[str], seconds: float, null_kernel: bool) -> dict:
    """The batched small closed loop in one process per device, measured over the same window, with
    the metrics shared as ``--processes`` shares them (files in a PROMETHEUS_MULTIPROC_DIR)."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(devices)), ctx.Queue()
    procs = [ctx.Process(target=_proc_load, args=(d, seconds, null_kernel, barrier, results)) for d in devices]
    with tempfile.TemporaryDirectory(prefix="attnserve-metrics-") as shared:
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared  # the spawned processes inherit it
        try:
            for p in procs:
                p.start()
        finally:
            if previous is None:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        outs = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    total = sum(o["req_s"] for o in outs)
    return {"req_s": total, "p50_ms": max(o["p50_ms"] for o in outs), "p99_ms": max(o["p99_ms"] for o in outs),
            "mean_batch": sum(o["mean_batch"] * o["req_s"] for o in outs) / total,
            "queue_ms": max(o["queue_ms"] for o in outs), "launch_ms": max(o["launch_ms"] for o in outs)}


def engine_rows(only: set[str], seconds: float, null_kernel: bool = False) -> list[tuple]:
    """The table: (run, devices, batching, shape, dtype, req/s, p50 ms, p99 ms, mean batch, note)."""
    rows: list[tuple] = []
    gpus = torch.cuda.device_count() if HAS_CUDA else 0
    one = "cuda:0" if gpus else "cpu"
    small_dtype = torch.float16
    small_warm = "x".join(map(str, SMALL))
    shape_s = "x".join(map(str, SMALL))
    res_on = res_off = None
    if "small" in only or "multi" in only or "procs" in only:
        res_on = asyncio.run(_load(one, True, SMALL, small_dtype, 64, seconds, small_warm))
        run = "(a) small, batched" if "small" in only else "(c) small, batched, 1 device"
        rows.append((run, one, "on", shape_s, "fp16", res_on, ""))
    if "small" in only:
        res_off = asyncio.run(_load(one, False, SMALL, small_dtype, 64, seconds, small_warm))
        speed = res_on["req_s"] / res_off["req_s"]
        p99 = res_on["p99_ms"] / res_off["p99_ms"]
        ok = "met" if speed >= 5 and p99 <= 2 else "NOT met"
        rows.append(
            ("(a) small, unbatched", one, "off", shape_s, "fp16", res_off,
             f"batched/unbatched: {speed:.1f}x req/s, p99 ratio {p99:.2f} (target >= 5x, <= 2): {ok}")
        )  # fmt: skip
    if "large" in only:
        dtype = torch.bfloat16
        shape_l = "x".join(map(str, LARGE))
        kernel = _kernel_rate(LARGE, dtype, one, seconds)
        times = _copy_times(LARGE, dtype, one)
        rows.append(("(b) large, kernel alone", one, "-", shape_l, "bf16",
                     {"req_s": kernel, "p50_ms": 1e3 / kernel, "p99_ms": float("nan"), "mean_batch": 1},
                     _copy_note(times)))  # fmt: skip
        res = asyncio.run(_load(one, True, LARGE, dtype, 4, seconds, shape_l))
        share = res["req_s"] / kernel
        ok = "met" if share >= 0.95 else "NOT met"
        note = f"{100 * share:.0f}% of the kernel's own (target >= 95%): {ok}"
        if times:  # staging, H2D, kernel and D2H overlap across requests at best: the slowest bounds
            slowest = max(times["host"], times["h2d"], times["d2h"], 1 / kernel)
            note += f"; {100 * res['req_s'] * slowest:.0f}% of the host-input ceiling ({1 / slowest:.0f} req/s)"
        rows.append(("(b) large, worker", one, "on", shape_l, "bf16", res, note))
    if "multi" in only:
        two = "cuda:0,cuda:1" if gpus >= 2 else "cpu,cpu"
        res_two = asyncio.run(_load(two, True, SMALL, small_dtype, 64, seconds, small_warm))
        ratio = res_two["req_s"] / res_on["req_s"]
        note = f"{ratio:.2f}x one device (target >= 1.9x): {'met' if ratio >= 1.9 else 'NOT met'}"
        if gpus < 2:
            note += "; no 2 GPUs here, two CPU workers shown"
        rows.append(("(c) small, batched, 2 devices", two, "on", shape_s, "fp16", res_two, note))
    if "procs" in only:
        devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cpu", "cpu"]
        res_procs = _procs_load(devices, seconds, null_kernel)
        ratio = res_procs["req_s"] / res_on["req_s"]
        note = (f"{ratio:.2f}x one device (target >= 1.9x): {'met' if ratio >= 1.9 else 'NOT met'}; "
                "p50/p99: the worse process")
        if gpus < 2:
            note += "; no 2 GPUs here, two CPU processes shown"
        rows.append(("(c) small, batched, 2 processes", " + ".join(devices), "on", shape_s, "fp16", res_procs, note))
    return rows


def render(rows: list[tuple], command: str) -> str:
    card = torch.cuda.get_device_name(0) if HAS_CUDA else f"CPU only ({os.cpu_count()} cores)"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "-"
    lines = [
        SECTION,
        "",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- card: {card}" + (f" (x{torch.cuda.device_count()} visible)" if HAS_CUDA else ""),
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, triton {triton_v}",
        f"- command: `{command}`",
        "- closed loop: each submitter sends a request, awaits its answer, sends the next; requests are",
        "  host tensors (as the transports hand them over); latency is the engine's, without a transport.",
        "- queued ms/req: mean time in the batcher before launch; ms/launch: mean time of one launch on a",
        "  worker (staging, host->device, kernel, device->host, thread hand-offs).",
        "",
        "| run | devices | batching | shape BxHxNxD | dtype | req/s | p50 ms | p99 ms | requests/launch "
        "| queued ms/req | ms/launch | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for run, devices, batching, shape, dtype, r, note in rows:
        lines.append(
            f"| {run} | {devices} | {batching} | {shape} | {dtype} | {r['req_s']:.0f} | {r['p50_ms']:.2f} "
            f"| {r['p99_ms']:.2f} | {r['mean_batch']:.1f} | {r.get('queue_ms', nan):.2f} "
            f"| {r.get('launch_ms', nan):.2f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this section of ``path`` (other sections, e.g. HTTP/gRPC, stay as they are)."""
    old = path.read_text() if path.exists() else "# attnserve service benchmarks\n\n"
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1 :] if nxt >= 0 else ""
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="section", required=True)
    eng = sub.add_parser("engine", help="the in-process engine: batching, large requests, two GPUs")
    eng.add_argument("--only", default="small,large,multi,procs",
                     help="comma-separated: small, large, multi, procs")
    eng.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    eng.add_argument("--write", type=Path, default=None, help="update this markdown file's engine section")
    eng.add_argument("--null-kernel", action="store_true",
                     help="a kernel that only allocates its outputs: the engine's host ceiling (validation, "
                          "batching, staging and copies, futures) with the compute taken away")
    from bench import http_latency  # the HTTP section lives in its own module

    http_latency.add_arguments(sub.add_parser("http", help="the HTTP transport: added latency, GB/s, JSON"))
    args = parser.parse_args(argv)
    if args.section == "http":
        http_latency.run(args, "python -m bench.service " + " ".join(sys.argv[1:] if argv is None else argv))
        return
    os.environ.pop("TRITON_INTERPRET", None) if not HAS_CUDA else None
    if args.null_kernel:
        kernels.attention = _null_attention  # the workers call kernels.attention through the module
    rows = []
    for section in args.only.split(","):  # one failing section does not lose the others' numbers
        try:
            rows += engine_rows({section}, args.seconds, args.null_kernel)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"section {section} failed: {exc!r}", file=sys.stderr)
            nan = float("nan")
            failed = {"req_s": nan, "p50_ms": nan, "p99_ms": nan, "mean_batch": nan}
            rows.append((f"{section}: FAILED", "-", "-", "-", "-", failed, repr(exc)[:200]))
    text = render(rows, "python -m bench.service " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(text)
    if args.write:
        write_section(args.write, text)


if __name__ == "__main__":
    main()
