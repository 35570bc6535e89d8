"""The fast forward, ``flash_forward(q, k, v, *, causal, scale, kv_lengths=None) -> (o, lse)``:
checks, allocates, picks a kernel and launches it.

q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D), any strides (a ``bnhd`` tensor transposed to ``bhnd`` is
read in place). ``plan`` (``kernels/plan.py``) decides the shape of the work:

- prefill: grid (Nq / BLOCK_M, B·Hq); each program holds one Q block and streams all K/V blocks;
- split-KV (flash-decoding): when B·Hq·Nq is too small to fill the GPU and Nk is long, the key
  range is split across grid axis 2, each split writes a partial (o, lse) in float32 and
  ``attn_combine`` merges them with their LSE. For GQA with few queries the program's rows are the
  whole group of query heads of one kv head, so each K/V block is read once per kv head.

Kernels, fastest first (``kernels/jit/``): on a Hopper GPU ``attn_decode`` (Gluon: packed or split
decode, ``hopper.decode_path``) or ``attn_fwd_ws`` (Gluon: 16-bit prefill at D 72 to 256,
``hopper.gluon_path``), then ``attn_fwd_tma`` (Triton with TMA: non-causal 16-bit prefill at D 64
or 128, ``hopper.tma_path``), else ``attn_fwd`` (Triton, every problem). Each predicate says why it
refuses (``hopper.*_refusal``), and the first launch of a problem class logs the kernel chosen and
those reasons (``plan.tell``). Launches go through ``kernels/launch.py``.
"""

from __future__ import annotations

import torch
import triton

from .hopper import (
    _16BIT,
    _recipe,
    decode_path,
    decode_refusal,
    gluon_box,
    gluon_path,
    gluon_refusal,
    gluon_sizes,
    tma_path,
    tma_refusal,
)
from .jit import flash_fwd as kern
from .launch import (  # noqa: F401 - freeze_autotuning, interpreting: public names of kernels.flash
    _scratch,
    freeze_autotuning,
    interpreting,
    launch,
    launch_plain,
)
from .masks import NO_MASKS, Masks
from .plan import (
    _bucket,
    _cdiv,
    _combine_launch,
    alibi_arg,
    block_d,
    kv_length_arg,
    merge_rows_per_program,
    plan,
    tell,
)

# why the Hopper kernels refuse a call with score modifiers: their loops have no place for them
NO_MASKS_HERE = "no window_size, softcap or alibi_slopes in this kernel"


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
    tma: bool | None = None,
    gluon: bool = True,
    masks: Masks = NO_MASKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32. ``num_splits`` forces the number
    of key splits and ``tma`` the TMA kernels on (where their layout rules allow, whatever the
    sizes) or off; ``gluon=False`` takes ``attn_fwd_tma`` where ``attn_fwd_ws`` would serve (tests,
    benchmarks). None lets ``plan`` and ``tma_path`` choose. ``masks`` (window, softcap, ALiBi)
    run on ``attn_fwd`` only, split or not: the Gluon and TMA kernels refuse them."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype and k.shape == v.shape and hq % hkv == 0 and d <= 256
    dev = q.device
    pack, splits, kps = plan(b, hq, hkv, n_q, n_k, dev, num_splits)
    # the Gluon kernels: decode (packed or split, unmasked) or, at its head dims in 16 bits, prefill
    # (windows, softcap and ALiBi included; a cheap superset of gluon_path's rules here; _recipe
    # checks them all once per problem)
    masked = masks.active
    split = pack > 1 or splits > 1
    if tma is not False and gluon and not interpreting() and (
            (split and not masked) or (not split and gluon_box(d) is not None
                                       and q.dtype in _16BIT and (tma or gluon_sizes(n_q, n_k, causal)))):
        recipe = _recipe(q, k, v, kv_lengths, causal, num_splits, tma, pack, splits, kps, masks)
        if recipe is not None:
            return recipe(q, k, v, kv_lengths, scale, masks)
    o = torch.empty(b, hq, n_q, d, dtype=q.dtype, device=dev)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=dev)
    kv_len = kv_length_arg(kv_lengths, n_k, dev)
    if tma is not False and not masked and tma_refusal(q, k, v, causal, scale, pack, splits,
                                                       sizes=tma is None) is None:
        # it builds its tensor descriptors on the device, in scratch that launch._run allocates,
        # or, where Triton launches it (the interpreter, a profiler's hooks, direct launches off),
        # from this allocator: a ContextVar, so set in the launching thread (the service launches
        # from worker threads)
        triton.set_allocator(_scratch)
        if _forward_tma(q, k, v, o, lse, kv_len, kv_lengths is not None, scale):
            tell(q, k, causal, kv_lengths is not None, pack, splits, "attn_fwd_tma",
                 lambda: _why_not(q, k, v, causal, scale, pack, splits, tma, gluon, "attn_fwd_tma"))
        return o, lse
    if splits == 1:  # o and lse themselves, as one split (a split stride of 0)
        out = (o, lse, (0, *o.stride()), (0, *lse.stride()))
    else:
        o_part = torch.empty(splits, b, hq, n_q, d, dtype=torch.float32, device=dev)
        lse_part = torch.empty(splits, b, hq, n_q, dtype=torch.float32, device=dev)
        out = (o_part, lse_part, o_part.stride(), lse_part.stride())
    if tma:  # attn_decode and attn_fwd_ws (above) take every problem of theirs TMA can describe
        why = NO_MASKS_HERE if masked else tma_refusal(q, k, v, causal, scale, pack, splits, sizes=False)
        raise ValueError(f"tma=True: this problem does not fit the TMA kernel: {why}")
    if _forward_triton(q, k, v, out, kv_len, kv_lengths is not None, scale, causal, pack, splits, kps, masks):
        tell(q, k, causal, kv_lengths is not None, pack, splits, "attn_fwd",
             lambda: _why_not(q, k, v, causal, scale, pack, splits, tma, gluon, "attn_fwd", masks))
    if splits > 1:
        combine(o_part, lse_part, o, lse)
    return o, lse


def _forward_triton(q, k, v, out, kv_len, has_kv_len: bool, scale: float, causal: bool,
                    pack: int, splits: int, kps: int, masks: Masks = NO_MASKS) -> bool:
    """attn_fwd into ``out`` (as ``hopper._decode_launch``'s); True when ``launch`` worked it out anew."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    bd = block_d(d)
    rows = pack * n_q
    o_out, lse_out, so, sl = out
    slopes, stride_ab, stride_ah = alibi_arg(masks, q.device)
    args = (
        q, k, v, o_out, lse_out, kv_len, slopes,
        *q.stride(), *k.stride(), *v.stride(), stride_ab, stride_ah, *so, *sl,
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, *masks.kernel_args(), kps, _bucket(n_q), _bucket(n_k),
    )
    # split-KV: the splits of one head side by side in the grid, so that the programs running
    # together read neighbouring keys (see docs/benchmarks/kernels.md#decode)
    meta = dict(
        D=d, BLOCK_D=bd, IS_CAUSAL=bool(causal), HAS_KV_LEN=has_kv_len, WINDOW=masks.window,
        SOFTCAP=masks.softcap > 0, HAS_ALIBI=masks.alibi is not None, PACK=pack,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLITS_FIRST=splits > 1,
    )

    def grid(cfg):
        if splits > 1:
            return (splits, b * (hq // pack), _cdiv(rows, cfg["BLOCK_M"]))
        return (_cdiv(rows, cfg["BLOCK_M"]), b * (hq // pack), splits)

    tuned = kern.attn_fwd_tuned if splits == 1 and pack == 1 else kern.attn_fwd_split_tuned
    return launch(tuned, grid, args, meta, q)


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge per-split partials o_part (S, B, Hq, Nq, D) fp32 and lse_part (S, B, Hq, Nq) into o, lse."""
    grid, args, consts = _combine_launch(o_part, lse_part, o, lse)
    launch_plain(kern.attn_combine, grid, args, consts, num_warps=4)


_TMA_INTERPRET_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "WS": False, "num_warps": 4, "num_stages": 1}


def _forward_tma(q, k, v, o, lse, kv_len, has_kv_len: bool, scale: float) -> bool:
    """attn_fwd_tma into o (B, Hq, Nq, D) and lse (B, Hq, Nq); True when ``launch`` worked it out anew."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    args = (
        q, k, v, o, lse, kv_len,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, _bucket(n_q), _bucket(n_k),
    )

    def grid(cfg):
        return (_cdiv(n_q, cfg["BLOCK_M"]), b * hq)

    return launch(kern.attn_fwd_tma_tuned, grid, args, dict(D=d, HAS_KV_LEN=has_kv_len), q,
                  interpret_cfg=_TMA_INTERPRET_CFG)


def _why_not(q, k, v, causal: bool, scale: float, pack: int, splits: int, tma: bool | None, gluon: bool,
             kernel: str, masks: Masks = NO_MASKS) -> dict[str, str]:
    """Why each kernel faster than ``kernel`` (one of the Triton two) refused this problem, in
    ``flash_forward``'s order; for ``plan.tell``'s log line."""
    sizes = tma is None
    refused = {}
    gluon_off = "tma=False" if tma is False else None if gluon else "gluon=False"
    if pack > 1 or splits > 1:
        refused["attn_decode"] = NO_MASKS_HERE if masks.active else gluon_off or decode_refusal(q, k, v, pack, splits)
    else:
        refused["attn_fwd_ws"] = gluon_off or gluon_refusal(q, k, v, causal, pack, splits, sizes, masks)
        if kernel == "attn_fwd":
            refused["attn_fwd_tma"] = ("tma=False" if tma is False else NO_MASKS_HERE if masks.active
                                       else tma_refusal(q, k, v, causal, scale, pack, splits, sizes))
    return refused


def flops(b: int, hq: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """Forward FLOPs counted as 4·B·Hq·Nq·Nk·D (half of it when causal)."""
    f = 4.0 * b * hq * n_q * n_k * d
    return f / 2 if causal else f


__all__ = ["block_d", "combine", "decode_path", "flash_forward", "flops", "freeze_autotuning", "gluon_path",
           "kv_length_arg", "merge_rows_per_program", "plan", "tma_path"]
