"""How the autotuners time a config: ``triton.testing.do_bench`` over shorter windows than
Triton's defaults (25 ms of warm-up and 100 ms of repetitions a config).

A cold start's warm-up times every pruned config of every key it tunes once; at Triton's windows
that timing is most of the warm-up after the kernels are compiled. The warm-up's shapes run in
microseconds to a few milliseconds, so REP_MS still takes ten or more repetitions of the slowest,
each after an L2 flush, and the autotuner compares their medians.
"""

from __future__ import annotations

import triton.testing

WARMUP_MS = 5
REP_MS = 20


def bench(kernel_call, quantiles=None):
    """The autotuners' ``do_bench`` (``triton.autotune(..., do_bench=bench)``)."""
    return triton.testing.do_bench(kernel_call, warmup=WARMUP_MS, rep=REP_MS, quantiles=quantiles)
