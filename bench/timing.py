"""Timing helpers shared by the benchmarks (no service imports: bench/kernels.py runs without them)."""

from __future__ import annotations

import torch


def graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph: its kernels' time without the host's launch
    work (``do_bench`` flushes L2 before each replay)."""
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=20, rep=80, return_mode="median")


def rotated_ms(fns, reps: int = 30) -> float:
    """Median ms of one call among ``fns`` (calls on distinct inputs, together several times the
    L2), all replayed from one CUDA graph with no flush in between: each call finds its inputs
    out of L2, as after a flush, but no other kernel's dirty lines to write back first.

    ``do_bench`` flushes by writing zeros over 256 MB, so the timed call starts with an L2 full of
    dirty lines and pays for their write-back: microseconds, a large share of a decode call
    (docs/benchmarks/kernels.md has the three timings side by side)."""
    import statistics

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:]) / len(fns)
