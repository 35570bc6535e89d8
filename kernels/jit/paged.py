"""Triton kernel of ``append_paged``: new keys and values written into a paged cache in one launch.

Only ``@triton.jit`` code lives here; ``kernels/paged.py`` checks and launches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_append(
    K_NEW, V_NEW,                # k_new, v_new (T, Hkv, D), any strides
    K_PAGES, V_PAGES,            # in/out: pages (P, PAGE, Hkv, D), any strides
    BT,                          # int32 block table (S, max_pages)
    CACHE_LENS,                  # int32 (S,): each sequence's length before the append
    CU,                          # int32 (S + 1,): sequence s owns new rows CU[s]:CU[s+1]
    stride_knt, stride_knh, stride_knd,
    stride_vnt, stride_vnh, stride_vnd,
    stride_kp, stride_kr, stride_kh, stride_kd,
    stride_vp, stride_vr, stride_vh, stride_vd,
    stride_btr, stride_btc,
    N_SEQ,                       # S
    SEARCH_STEPS,                # ceil(log2(S + 1)): steps of the binary search for a row's sequence
    MAX_PAGES, N_PAGES,          # the table's width and the pages there are: writes outside are dropped
    H_KV,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,          # page_tokens
):
    """Program t writes new row t (every kv head) at position CACHE_LENS[s] + t - CU[s] of its
    sequence s, found by binary search in CU (the last s with CU[s] <= t; empty sequences skipped)."""
    t = tl.program_id(0)
    lo = N_SEQ * 0
    hi = N_SEQ                   # invariant: CU[lo] <= t < CU[hi]
    for _ in range(0, SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(CU + mid) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    s = lo
    pos = tl.load(CACHE_LENS + s) + t - tl.load(CU + s)
    col = pos // PAGE
    col_ok = (col >= 0) & (col < MAX_PAGES)
    page = tl.load(BT + s.to(tl.int64) * stride_btr + tl.where(col_ok, col, 0) * stride_btc)
    ok = col_ok & (page >= 0) & (page < N_PAGES)
    page = page.to(tl.int64)
    row = (pos % PAGE).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = ok & (offs_h[:, None] < H_KV) & (offs_d[None, :] < D)
    t64 = t.to(tl.int64)
    k = tl.load(K_NEW + t64 * stride_knt + offs_h[:, None] * stride_knh + offs_d[None, :] * stride_knd, mask=m)
    v = tl.load(V_NEW + t64 * stride_vnt + offs_h[:, None] * stride_vnh + offs_d[None, :] * stride_vnd, mask=m)
    tl.store(K_PAGES + page * stride_kp + row * stride_kr + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
             k, mask=m)
    tl.store(V_PAGES + page * stride_vp + row * stride_vr + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
             v, mask=m)


__all__ = ["paged_append"]
