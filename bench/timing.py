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
