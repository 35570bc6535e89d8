"""Compile and autotune the kernels at start-up, so that no request pays for it.

    from kernels import warmup
    warmup(shapes=[(1, 8, 1024, 64), (1, 32, 1024, 128)], dtypes=[torch.float16], device="cuda:0")

``kernels.precompile.ahead(lambda: warmup(...))`` first compiles, in parallel, every kernel variant
such a call would compile one after another; ``kernels.autotune_cache`` keeps the tuned choices.
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


def warmup_ragged(
    kv_heads_and_dims: Iterable[tuple[int, int]],
    dtypes: Iterable[torch.dtype] = (torch.float16,),
    page_tokens: int = 64,
    device: torch.device | str = "cuda",
) -> float:
    """Run ``append_paged``, ``attention_paged`` and ``attention_varlen`` once per (Hkv, D) × dtype
    on ``device``, so that a server's first session step (or packed stateless batch) compiles
    nothing: two sequences (a decode row and a 65-row prefill chunk, causal) over ``page_tokens``-
    token pages. The kernels specialise on D, the kv heads' power of two (the append), the page size
    and the dtype, not on the lengths or Hq. Returns the seconds spent."""
    from . import append_paged, attention_paged, attention_varlen

    t0 = time.perf_counter()
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens, new = [300, 65], [1, 65]  # each sequence's length after the append, and its new rows
    pages_each = [-(-n // page_tokens) for n in lens]
    table = torch.zeros(2, max(pages_each), dtype=torch.int32)
    table[0, : pages_each[0]] = torch.arange(pages_each[0])
    table[1, : pages_each[1]] = torch.arange(pages_each[0], sum(pages_each))
    table = table.to(device)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    before = cache_lens - torch.tensor(new, dtype=torch.int32, device=device)
    cu_new = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    count = 0
    with torch.no_grad():
        for hkv, d in sorted(set(kv_heads_and_dims)):
            for dtype in dtypes:
                def rand(*shape, dtype=dtype):
                    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

                pages = (sum(pages_each), page_tokens, hkv, d)
                k_pages, v_pages = rand(*pages), rand(*pages)
                append_paged(k_pages, v_pages, table, before, rand(sum(new), hkv, d), rand(sum(new), hkv, d), cu_new)
                q = rand(sum(new), hkv, d)
                attention_paged(q, k_pages, v_pages, table, cache_lens, cu_new, causal=True, return_lse=True)
                attention_varlen(q, rand(sum(lens), hkv, d), rand(sum(lens), hkv, d), cu_new, cu_k, causal=True,
                                 return_lse=True)
                count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    log.info("ragged and paged kernels warm on %s in %.1fs (%d head layouts x dtypes, %d-token pages)",
             device, dt, count, page_tokens)
    return dt
