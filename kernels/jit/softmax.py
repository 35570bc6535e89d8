"""What the dense (``flash_fwd``) and the varlen/paged (``varlen``) Triton kernels share: the key
range a row tile reads (``key_range``: causal and the window) and the online softmax's step for one
key block (the seed's steps 1-5, base 2, with the soft cap and ALiBi bias of ``kernels/masks.py``;
``online_softmax_block``). Each kernel finds the block's keys its own way
(contiguous, packed, or through a block table) and folds them in with this.

Only ``@triton.jit`` code lives here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in float32 from exp2 (Triton's interpreter has no tanh): (1 - e^(-2|x|)) / (1 + e^(-2|x|))
    with x's sign, and below |x| = 1/8, where 1 - e^(-2|x|) keeps too few digits, its Taylor series
    to x^7 (the next term is under 1e-9 of x there)."""
    ax = tl.abs(x)
    t = tl.math.exp2(-2.8853900817779268 * ax)          # e^(-2|x|)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    y = tl.where(ax < 0.125, small, (1.0 - t) / (1.0 + t))
    return tl.where(x < 0, -y, y)


@triton.jit
def online_softmax_block(
    acc, l_i, m_i, q,            # running O (fp32, unnormalised), l, m (log2 units); the Q tile
    kt_ptrs, v_ptrs,             # K_jᵀ (BLOCK_D, BLOCK_N) and V_j (BLOCK_N, BLOCK_D) of this key block
    cols,                        # the block's key indices
    n_k,                         # keys >= n_k are not there (masked)
    i_rows, causal_off,          # query index of each row; its aligned position is i + causal_off
    qk_scale,                    # scale · log2(e)
    win_left, win_right,         # window: row i sees keys i + causal_off - win_left ..= i + causal_off + win_right
    slopes,                      # (BLOCK_M,) each row's ALiBi slope · log2(e); unused unless HAS_ALIBI
    cap,                         # softcap · log2(e); unused unless SOFTCAP
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,        # False: every key of the block is visible to every row
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Steps 1-5 of the online softmax for one key block -> (acc, l_i, m_i); the callers find the
    block's keys (contiguous, varlen or paged) and this reads and folds them in."""
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(cols[None, :] < n_k) & (tl.arange(0, BLOCK_D)[:, None] < D), other=0.0)
    elif BLOCK_D != D:
        kt = tl.load(kt_ptrs, mask=tl.arange(0, BLOCK_D)[:, None] < D, other=0.0)
    else:
        kt = tl.load(kt_ptrs)
    # step 1: S_ij = Q_i K_jᵀ · scale, in log2 units; then the cap and the bias (flash-attn's order)
    s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
    if SOFTCAP:
        s = cap * tanh(s / cap)              # softcap · tanh(S / softcap), both sides in log2 units
    if HAS_ALIBI:
        dist = tl.abs(i_rows[:, None] + causal_off - cols[None, :]).to(tl.float32)   # |i_al - j|
        s = s - slopes[:, None] * dist
    if MASKED:
        if IS_CAUSAL or WINDOW:
            # each row's first and last visible key, worked out per row: one or two compares a score
            i_al = i_rows + causal_off
            right = i_al
            if WINDOW:
                right = i_al + win_right
                if IS_CAUSAL:
                    right = tl.minimum(right, i_al)
            visible = cols[None, :] <= tl.minimum(right, n_k - 1)[:, None]
            if WINDOW:
                visible = visible & (cols[None, :] >= (i_al - win_left)[:, None])
        else:
            visible = cols[None, :] < n_k
        s = tl.where(visible, s, float("-inf"))
    # steps 2-3: m_new = max(m_i, rowmax(S_ij))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet, masked or all its scores -inf (keys of -inf): subtract 0, not
    # -inf (-inf - -inf is NaN)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    # step 4: alpha = 2^(m_i - m_new); l_new = alpha·l_i + rowsum(P_ij)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # step 5: O_new = alpha·O_i + P_ij V_j
    if MASKED:
        v = tl.load(v_ptrs, mask=(cols[:, None] < n_k) & (tl.arange(0, BLOCK_D)[None, :] < D), other=0.0)
    elif BLOCK_D != D:
        v = tl.load(v_ptrs, mask=tl.arange(0, BLOCK_D)[None, :] < D, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def key_range(n_keys, causal_off, i_lo, i_hi, win_left, win_right, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """(lo, full_lo, full_end, hi) of a tile whose rows are i_lo..i_hi: it reads keys [lo, hi), of
    which [full_lo, full_end) (whole blocks) are visible to every row and need no mask, and
    [lo, full_lo), [full_end, hi) are masked. Row i sees the keys j < n_keys with, causal,
    j <= i + causal_off, and with the window i + causal_off - win_left <= j <= i + causal_off +
    win_right. lo, full_lo and full_end are multiples of BLOCK_N; without a window lo = full_lo = 0."""
    hi = n_keys
    full_end = n_keys
    lo = 0
    full_lo = 0
    if IS_CAUSAL:
        hi = tl.minimum(hi, i_hi + causal_off + 1)
        full_end = tl.minimum(full_end, i_lo + causal_off + 1)
    if WINDOW:
        hi = tl.minimum(hi, i_hi + causal_off + win_right + 1)
        full_end = tl.minimum(full_end, i_lo + causal_off + win_right + 1)
        # key blocks wholly left of the first row's window are never read
        lo = tl.maximum(i_lo + causal_off - win_left, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(i_hi + causal_off - win_left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_end = tl.maximum(tl.minimum(tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N, hi), lo)
    full_lo = tl.minimum(full_lo, full_end)
    return lo, full_lo, full_end, hi
