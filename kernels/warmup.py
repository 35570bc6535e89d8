"""Compile and autotune the kernels at start-up, so that no request pays for it.

    from kernels import warmup
    warmup(shapes=[(1, 8, 1024, 64), (1, 32, 1024, 128)], dtypes=[torch.float16], device="cuda:0")
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch

log = logging.getLogger("attnserve.kernels")


def warmup(
    shapes: Iterable[Sequence[int]],
    dtypes: Iterable[torch.dtype] = (torch.float16,),
    device: torch.device | str = "cuda",
    causal: Iterable[bool] = (False, True),
) -> float:
    """Run ``attention(kernel="auto")`` once per (B, H, N, D) shape × dtype × causal on ``device``.

    shapes: (batch, heads, seqlen, headdim) tuples (self-attention, Hq = Hkv, Nq = Nk). Each run
    compiles the Triton kernels for that head dim / dtype / mask and autotunes their block sizes
    (the autotuning key buckets N by powers of two, so a shape warms its neighbours too). Also
    warms the split-KV (decode, Nq = 1) path. On the CPU it only checks that the CPU path runs.
    Returns the seconds spent.
    """
    from . import attention

    t0 = time.perf_counter()
    device = torch.device(device)
    shapes = [tuple(int(x) for x in s) for s in shapes]
    dtypes = list(dtypes)
    causal = list(causal)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for b, h, n, d in shapes:
            for dtype in dtypes:
                q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device=device, dtype=dtype)
                           for _ in range(3))
                for c in causal:
                    attention(q, k, v, causal=c, return_lse=True)
                attention(q[:, :, -1:], k, v, causal=False, return_lse=True)  # decode (split-KV)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    log.info("kernels warm on %s in %.1fs (%d shapes, %d dtypes)", device, dt, len(shapes), len(dtypes))
    return dt
