"""Where a lone small request's time goes, and how much of a short kernel's time is host launch
overhead (a diagnostic for the GPU, not a benchmark of record).

    python -m bench.diag_latency [--shape 1x8x128x64] [--iters 300] [--kernels [--sweep]] [--launch]

Part 1, one request at a time (1x8x128x64 fp16 by default), medians of --iters:
  kernel   ``kernels.attention`` on device-resident inputs + synchronize
  enqueue  host time of ``kernels.attention`` alone (no synchronize), and of ``flash_forward``
  worker   ``Worker._launch_all`` + ``_finish_all`` called directly (staging, copies, kernel, split)
           and each stage of it: staging q/k/v, the kernel call, the copies back, the wait
  engine   ``Engine.attend`` with one submitter (adds the batcher and the event-loop hops)
Part 2 (--kernels): forward time of short shapes through the normal launch path vs the same launch
replayed from a CUDA graph (no host work), for ``flash`` and SDPA's flash backend; with --sweep
also every forward config of the flash kernel timed alone on each shape (graph replay).
Part 3 (--launch, alone): host microseconds of each layer of one launch (attention(), the
autotuner, Triton's JIT call, the compiled kernel) and of the staging primitives.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from service.engine import Engine
from service.types import AttentionRequest

import kernels
from bench.timing import graph_ms
from kernels.flash import flash_forward
from kernels.jit import flash_fwd as kern
from service.settings import load_settings


def _med_ms(fn, iters: int, sync: bool = True) -> float:
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def part_request(shape: tuple[int, ...], iters: int) -> None:
    b, h, n, d = shape
    dev = torch.device("cuda", 0)
    qh, kh, vh = (torch.randn(b, h, n, d).half() for _ in range(3))
    q, k, v = (t.to(dev) for t in (qh, kh, vh))
    from kernels.autograd import flash_attention_autograd  # noqa: F401 - import cost out of the loop

    kernels.attention(q, k, v)
    torch.cuda.synchronize()
    print(f"shape {shape} fp16, medians of {iters}")
    print(f"  kernel (attention + sync)      {_med_ms(lambda: kernels.attention(q, k, v), iters):8.3f} ms")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        kernels.attention(q, k, v)
    t_enq = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        flash_forward(q, k, v, causal=False, scale=d ** -0.5)
    t_ff = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    print(f"  host enqueue: attention()      {1e3 * t_enq:8.3f} ms; flash_forward() {1e3 * t_ff:8.3f} ms")

    async def engine_part() -> None:
        settings = load_settings(["--device", "cuda:0", "--warmup-shapes", "x".join(map(str, shape)),
                                  "--warmup-dtypes", "float16"], request_timeout_ms=600_000)
        eng = Engine(settings)
        await eng.start()
        w = eng.workers[0] if hasattr(eng, "workers") else eng.batcher.workers[0]
        from service.worker import _finish_all

        req = AttentionRequest(q=qh, k=kh, v=vh)
        print(f"  worker launch+finish (direct)  {_med_ms(lambda: _finish_all(w._launch_all([req])), iters):8.3f} ms")
        stages = {"stage q,k,v": [], "attention": [], "to_host": [], "wait": []}
        with torch.no_grad():
            for _ in range(iters):
                with torch.cuda.stream(w._compute_stream):
                    t0 = time.perf_counter()
                    sq, sk, sv = w._stage(([qh], qh.dtype), ([kh], kh.dtype), ([vh], vh.dtype))
                    t1 = time.perf_counter()
                    o, lse = kernels.attention(sq, sk, sv, return_lse=True)
                    t2 = time.perf_counter()
                    (oh, _), done = w._to_host([o, lse])
                    t3 = time.perf_counter()
                    done.synchronize()
                    t4 = time.perf_counter()
                for key, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    dt and stages[key].append(dt)
        print("  worker stages: " + ", ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in stages.items())
              + " ms")
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await eng.attend(AttentionRequest(q=qh, k=kh, v=vh))
            ts.append(time.perf_counter() - t0)
        print(f"  engine.attend, one submitter   {1e3 * statistics.median(ts):8.3f} ms "
              f"(p90 {1e3 * sorted(ts)[int(0.9 * len(ts))]:.3f})")
        await _trace_engine(eng, lambda: AttentionRequest(q=qh, k=kh, v=vh), iters)
        await eng.drain()

    asyncio.run(engine_part())


async def _trace_engine(eng: Engine, make, iters: int) -> None:
    """Median gap between consecutive steps of one lone request through ``Engine.attend``: each
    step is stamped by wrapping the method that starts it (a few µs of wrapping cost included)."""
    import service.worker as worker_mod

    stamps: dict[str, float] = {}

    def stamp(name):
        stamps.setdefault(name, time.perf_counter())

    def wrap_sync(owner, attr, before, after=None):
        fn = getattr(owner, attr)

        def wrapped(*a, **kw):
            stamp(before)
            try:
                return fn(*a, **kw)
            finally:
                if after:
                    stamp(after)

        setattr(owner, attr, wrapped)
        return fn

    def wrap_async(owner, attr, before, after):
        fn = getattr(owner, attr)

        async def wrapped(*a, **kw):
            stamp(before)
            try:
                return await fn(*a, **kw)
            finally:
                stamp(after)

        setattr(owner, attr, wrapped)
        return fn

    w = eng.workers[0]
    saved = [
        (eng.batcher, "_dispatch", wrap_sync(eng.batcher, "_dispatch", "3 dispatcher runs")),
        (w, "submit", wrap_sync(w, "submit", "4 Worker.submit (launch handed over)")),
        (eng.batcher, "_run_batch", wrap_async(eng.batcher, "_run_batch", "5 batch task starts (awaits)",
                                               "9 answers given out (loop woken)")),
        (w, "_launch_all", wrap_sync(w, "_launch_all", "6 launcher thread starts", "7 launched (enqueued)")),
        (worker_mod, "_finish_all", wrap_sync(worker_mod, "_finish_all", "8a finisher thread starts",
                                               "8b device done, answers split")),
        (eng.batcher, "submit", wrap_async(eng.batcher, "submit", "2 Batcher.submit", "10 submit returns")),
    ]
    rows: dict[str, list[float]] = {}
    try:
        for _ in range(iters):
            stamps.clear()
            stamps["1 Engine.attend called"] = time.perf_counter()
            await eng.attend(make())
            stamps["11 attend returned"] = time.perf_counter()
            order = sorted(stamps.items(), key=lambda kv: kv[1])
            for (a, ta), (b_, tb) in zip(order, order[1:], strict=False):
                rows.setdefault(f"{a} -> {b_}", []).append(tb - ta)
    finally:
        for owner, attr, fn in saved:
            if owner is worker_mod:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr) if attr in vars(owner) else None
    print("  one lone request, step by step (median µs; steps in time order):")
    for name, xs in sorted(rows.items(), key=lambda kv: -len(kv[1])):
        if len(xs) >= iters // 2:
            print(f"    {1e6 * statistics.median(xs):8.1f}  {name}")


SHORT = [(torch.float16, 1, 32, 1024, 128, False), (torch.float16, 1, 32, 1024, 128, True),
         (torch.float16, 4, 32, 1024, 64, False), (torch.float16, 16, 16, 512, 64, False),
         (torch.float16, 64, 12, 128, 64, False), (torch.bfloat16, 64, 12, 128, 64, False),
         (torch.float16, 1, 32, 4096, 128, False)]
EXTRA = [(64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3), (128, 32, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3)]


def part_kernels(sweep: bool) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    print("\nshort shapes: ms via the normal launch path / via CUDA graph replay (TFLOP/s)")
    for dt, b, h, n, d, causal in SHORT:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt) for _ in range(3))
        fl = 4.0 * b * h * n * n * d / (2 if causal else 1)

        def ours(q=q, k=k, v=v, causal=causal):
            return flash_forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5)

        def sdpa(q=q, k=k, v=v, causal=causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        row = []
        for name, fn in (("flash", ours), ("sdpa_flash", sdpa)):
            fn()
            t_n = do_bench(fn, warmup=20, rep=80, return_mode="median")
            t_g = graph_ms(fn)
            row.append(f"{name} {t_n:.4f}/{t_g:.4f} ({fl / t_n / 1e9:.0f}/{fl / t_g / 1e9:.0f})")
        print(f"  {str(dt)[6:]} {b}x{h}x{n}x{d} causal={causal}: " + "; ".join(row))
        if not sweep:
            continue
        # every config alone (graph replay): is the tuner's choice the best one, and is any config
        # in reach of SDPA?
        dcls = kern._d_class(max(16, d))
        cands = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kern._PREFILL[dcls]]
        cands += [c for c in EXTRA if c not in cands]
        saved = kern._PREFILL[dcls]
        import os

        os.environ["ATTNSERVE_AUTOTUNE"] = "0"
        res = []
        try:
            for bm, bn, w, st in cands:
                kern._PREFILL[dcls] = [kern._cfg(bm, bn, w, st)]
                try:
                    t = graph_ms(ours)
                    res.append(f"{bm}/{bn}/w{w}/s{st} {fl / t / 1e9:.0f}")
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                    res.append(f"{bm}/{bn}/w{w}/s{st} fail:{type(exc).__name__}")
        finally:
            kern._PREFILL[dcls] = saved
            os.environ["ATTNSERVE_AUTOTUNE"] = "1"
        print("    configs (graph TFLOP/s): " + ", ".join(res))


def _host_us(fn, n: int = 400) -> float:
    """Host microseconds per call of fn (no synchronize inside; one at the end)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / n


def _launch_layers(shape: tuple[int, int, int, int], dev: torch.device) -> None:
    import triton

    from kernels import flash as fl
    from kernels.spec import check_inputs

    b, h, n, d = shape
    q, k, v = (torch.randn(*shape, device=dev, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device=dev, dtype=torch.float32)
    kv_len = fl.kv_length_arg(None, n, dev)
    args = (q, k, v, o, lse, kv_len, *q.stride(), *k.stride(), *v.stride(), 0, *o.stride(), 0, *lse.stride(),
            h, 1, n, n, d ** -0.5 * kern.LOG2E, n, fl._bucket(n), fl._bucket(n))
    meta = dict(D=d, BLOCK_D=fl.block_d(d), IS_CAUSAL=False, HAS_KV_LEN=False, PACK=1, DOT_PREC="tf32",
                SPLITS_FIRST=False)
    tuned = kern.attn_fwd_tuned

    def grid(cfg):
        return (triton.cdiv(n, cfg["BLOCK_M"]), b * h, 1)

    tuned[grid](*args, **meta)
    cfg = tuned.best_config
    ck = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    g = grid(cfg.kwargs)
    rows = {
        "attention()": lambda: kernels.attention(q, k, v),
        "check_inputs": lambda: check_inputs(q, k, v),
        "flash_forward": lambda: flash_forward(q, k, v, causal=False, scale=d ** -0.5),
        "autotuner[grid](...)": lambda: tuned[grid](*args, **meta),
        "jit[grid](..., cfg)": lambda: tuned.fn[g](*args, **meta, **ck),
        "torch.empty x2 (cuda)": lambda: (torch.empty_like(q), torch.empty(b, h, n, device=dev)),
    }
    try:
        compiled = tuned.fn.warmup(*args, grid=g, **meta, **ck)
        full = list(args) + [meta[k_] for k_ in ("D", "BLOCK_D")] + [ck["BLOCK_M"], ck["BLOCK_N"]] + \
            [meta[k_] for k_ in ("IS_CAUSAL", "HAS_KV_LEN", "PACK", "DOT_PREC", "SPLITS_FIRST")]
        o.fill_(float("nan"))
        compiled[g](*full)
        torch.cuda.synchronize()
        ref = kernels.attention(q, k, v, kernel="reference")
        print(f"  compiled direct launch: max err {(o.float() - ref.float()).abs().max().item():.2e} "
              f"(args {len(full)}; signature {len(compiled.src.signature) if hasattr(compiled, 'src') else '?'})")
        rows["compiled[grid](...)"] = lambda: compiled[g](*full)
    except Exception as exc:  # noqa: BLE001
        print(f"  compiled direct launch failed: {type(exc).__name__}: {str(exc)[:300]}")
    print(f"host us per call, {shape} fp16: " + ", ".join(f"{k_} {_host_us(f):.1f}" for k_, f in rows.items()))


def part_launch() -> None:
    """Host cost of each layer of a launch, and of the staging primitives the worker uses."""
    dev = torch.device("cuda", 0)
    for shape in ((1, 8, 128, 64), (1, 32, 1024, 128)):
        _launch_layers(shape, dev)
    x = torch.randn(64 * 1024).half()
    pinned = x.pin_memory()
    s2 = torch.cuda.Stream()
    ev = torch.cuda.Event()

    def stream_ctx():
        with torch.cuda.stream(s2):
            pass

    prim = {
        "empty 128KB pinned": lambda: torch.empty(64 * 1024, dtype=torch.float16, pin_memory=True),
        "empty 8MB pinned": lambda: torch.empty(4 << 20, dtype=torch.float16, pin_memory=True),
        "pageable.to(cuda)": lambda: x.to(dev),
        "pageable.to(cuda, nb)": lambda: x.to(dev, non_blocking=True),
        "pinned.to(cuda, nb)": lambda: pinned.to(dev, non_blocking=True),
        "stream ctx": stream_ctx,
        "event record": lambda: ev.record(),
    }
    print("host us per call: " + ", ".join(f"{k_} {_host_us(f):.1f}" for k_, f in prim.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x8x128x64")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="with --kernels: time every forward config alone")
    ap.add_argument("--launch", action="store_true", help="only the host cost of each layer of a launch")
    ap.add_argument("--no-request", action="store_true",
                    help="skip part 1 (its engine freezes autotuning: part 2 then runs untuned configs)")
    args = ap.parse_args()
    if args.launch:
        part_launch()
        return
    if not args.no_request:
        part_request(tuple(int(x) for x in args.shape.split("x")), args.iters)
    if args.kernels:
        part_kernels(args.sweep)


if __name__ == "__main__":
    main()
