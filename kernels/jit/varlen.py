"""Triton kernels of ragged (varlen) and paged attention: one launch covers every sequence.

Only ``@triton.jit`` code lives here; ``kernels/ragged.py`` plans, allocates and launches.

``ragged_fwd``: each program runs one work item, a (sequence, row tile, key split) triple built on
the host from the sequences' lengths, for one head (or, packed, one kv head and its GQA group of
query heads). Keys come either from one [Tk, Hkv, D] tensor (varlen) or from pages
[P, page_tokens, Hkv, D] through the sequence's block-table row (paged): one entry per key block when
page_tokens is a multiple of BLOCK_N (the block is rows of one page), else one entry per key. The
online softmax is ``_flash_fwd_kernels.py``'s (base 2, scale·log2(e) folded into S; full key
blocks unmasked, the diagonal and the ragged end masked; rows that see no key give o = 0 and
lse = -inf). An unsplit item writes o in q's dtype and lse; a split writes its own normalised o
in float32 and its lse to partial buffers, which ``ragged_merge`` combines.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .softmax import key_range, online_softmax_block

LOG2E = 1.4426950408889634
LOG2E_K = tl.constexpr(LOG2E)  # the kernels' copy: a jit function reads only constexpr globals
WORK_FIELDS = 5   # WORK rows: sequence, row tile, key start, key end, partial row (-1: unsplit)
SEQ_FIELDS = 4    # SEQ rows: q start, n_q, k start (varlen; 0 when paged), n_k
MERGE_FIELDS = 4  # MERGE rows: token, partial row of split 0, n_q (rows between splits), splits


@triton.jit
def _attend(
    acc, l_i, m_i, q,            # running O (fp32, unnormalised), l, m (log2 units); the Q tile
    k_head, v_head,              # K, V pointers at the kv head (page 0 / token 0)
    BT_ROW, stride_btc,          # the sequence's block-table row; unused unless PAGED
    k_tok0,                      # varlen: the sequence's first key row in K, V
    stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
    start, end,                  # key range [start, end), start a multiple of BLOCK_N
    n_k,                         # the sequence's keys; keys >= n_k are never read
    i_rows, causal_off,          # query index of each row in its sequence; n_k - n_q
    qk_scale,                    # scale · log2(e)
    win_left, win_right, slopes, cap,   # window, ALiBi slopes, soft cap (``online_softmax_block``)
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr,   # paged addressing and its page_tokens
    PAGE_BLOCK: tl.constexpr,    # PAGED with PAGE % BLOCK_N == 0: one table entry a key block
    MASKED: tl.constexpr,        # False: every key of every block in [start, end) is visible
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if PAGE_BLOCK:  # PAGE % BLOCK_N == 0 and start_n % BLOCK_N == 0: the block is rows of one page
            page = tl.load(BT_ROW + (start_n // PAGE) * stride_btc).to(tl.int64)  # start_n < n_k: a used entry
            slot = (start_n % PAGE + offs_n).to(tl.int64)
            k_rows = page * stride_kp + slot * stride_kt
            v_rows = page * stride_vp + slot * stride_vt
        elif PAGED:  # key j: page BT_ROW[j // PAGE], row j % PAGE
            if MASKED:
                page = tl.load(BT_ROW + (cols // PAGE) * stride_btc, mask=cols < n_k, other=0)
            else:
                page = tl.load(BT_ROW + (cols // PAGE) * stride_btc)
            page = page.to(tl.int64)
            slot = (cols % PAGE).to(tl.int64)
            k_rows = page * stride_kp + slot * stride_kt
            v_rows = page * stride_vp + slot * stride_vt
        else:
            tok = (k_tok0 + cols).to(tl.int64)
            k_rows = tok * stride_kt
            v_rows = tok * stride_vt
        kt_ptrs = k_head + k_rows[None, :] + offs_d[:, None] * stride_kd   # K_jᵀ (BLOCK_D, BLOCK_N)
        v_ptrs = v_head + v_rows[:, None] + offs_d[None, :] * stride_vd    # V_j (BLOCK_N, BLOCK_D)
        acc, l_i, m_i = online_softmax_block(acc, l_i, m_i, q, kt_ptrs, v_ptrs, cols, n_k, i_rows, causal_off,
                                             qk_scale, win_left, win_right, slopes, cap, D, BLOCK_D, MASKED,
                                             IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def ragged_fwd(
    Q,                           # q (Tq, Hq, D), any strides
    K, V,                        # varlen: k, v (Tk, Hkv, D); paged: pages (P, PAGE, Hkv, D); any strides
    O,                           # out: o (Tq, Hq, D), any strides
    LSE,                         # out: lse (Hq, Tq) fp32, any strides
    O_PART,                      # out: split partials (R, Hq, D) fp32 contiguous (normalised o of one split)
    LSE_PART,                    # out: split partials (R, Hq) fp32 contiguous
    WORK,                        # int32 (n_work, WORK_FIELDS): this launch's work items; program p runs item
                                 # p // heads for head p % heads (kv heads where PACK)
    SEQ,                         # int32 (S, SEQ_FIELDS): each sequence's offsets and lengths
    BT,                          # int32 block table (S, max_pages); unused unless PAGED
    ALIBI,                       # fp32 ALiBi slopes (S, Hq) (stride_as 0: one set for all); unused unless HAS_ALIBI
    stride_btr, stride_btc,
    stride_as, stride_ah,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kt, stride_kh, stride_kd,   # stride_kp: between pages (0 for varlen)
    stride_vp, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    H_Q,                         # query heads
    GROUP,                       # query heads per kv head: q head h reads kv head h // GROUP
    qk_scale,                    # scale · log2(e)
    win_left, win_right,         # window sides in keys (1 << 30: unbounded); unused unless WINDOW
    cap,                         # softcap · log2(e); unused unless SOFTCAP
    D: tl.constexpr,             # head dim
    BLOCK_D: tl.constexpr,       # D padded to a power of two (>= 16); columns >= D are masked
    BLOCK_M: tl.constexpr,       # rows per program
    BLOCK_N: tl.constexpr,       # keys per inner step; divides every split's start
    PACK: tl.constexpr,          # rows are the GROUP query heads of one kv head × the sequence's n_q
                                 # queries (decode: K/V read once per kv head); grid axis 1 is Hkv
    PAGED: tl.constexpr,         # keys from pages through the block table
    PAGE: tl.constexpr,          # page_tokens (1 when not PAGED)
    PAGE_BLOCK: tl.constexpr,    # PAGED and PAGE % BLOCK_N == 0: a key block lies in one page (one
                                 # table entry a block, rows at one stride); else a lookup per key
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,        # a sliding window bounds the keys of each row
    SOFTCAP: tl.constexpr,       # scores capped: softcap · tanh(S / softcap)
    HAS_ALIBI: tl.constexpr,     # scores biased by -slope · |i + n_k - n_q - j|
    DOT_PREC: tl.constexpr,      # "ieee" for float32 inputs, "tf32" (ignored) for 16-bit
):
    # one grid axis, heads fastest: the plan lists items longest first, so every head of the longest
    # items starts first (tail balance), and heads sharing a kv head run side by side (L2)
    if PACK:
        n_h = H_Q // GROUP
    else:
        n_h = H_Q
    w = (tl.program_id(0) // n_h).to(tl.int64)
    hp = tl.program_id(0) % n_h
    seq = tl.load(WORK + w * 5 + 0)
    tile = tl.load(WORK + w * 5 + 1)
    k0 = tl.load(WORK + w * 5 + 2)
    k1 = tl.load(WORK + w * 5 + 3)
    part = tl.load(WORK + w * 5 + 4)
    q0 = tl.load(SEQ + seq * 4 + 0)
    n_q = tl.load(SEQ + seq * 4 + 1)
    k_tok0 = tl.load(SEQ + seq * 4 + 2)
    n_k = tl.load(SEQ + seq * 4 + 3)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK:
        head = hp * GROUP + rows // n_q
        i_rows = rows % n_q
        kvh = hp
        row_ok = rows < GROUP * n_q
        i_lo = 0                             # rows of several heads: the widest bounds
        i_hi = n_q - 1
    else:
        head = hp + rows * 0
        i_rows = rows
        kvh = hp // GROUP
        row_ok = rows < n_q
        i_lo = tile * BLOCK_M
        i_hi = tl.minimum(tile * BLOCK_M + BLOCK_M, n_q) - 1

    # the key range: [0, full_end) needs no mask, [full_end, hi) is masked
    causal_off = n_k - n_q
    lo, full_lo, full_end, hi = key_range(n_k, causal_off, i_lo, i_hi, win_left, win_right, BLOCK_N,
                                          IS_CAUSAL, WINDOW)

    tok = (q0 + i_rows).to(tl.int64)
    q_ptrs = Q + tok[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    bt_row = BT + seq.to(tl.int64) * stride_btr

    if HAS_ALIBI:                            # each row's head's slope, in log2 units
        slopes = tl.load(ALIBI + seq * stride_as + head * stride_ah, mask=row_ok, other=0.0) * LOG2E_K
    else:
        slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:  # the window's left edge: masked
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, k_head, v_head, bt_row, stride_btc, k_tok0,
            stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
            tl.maximum(k0, lo), tl.minimum(k1, full_lo), n_k, i_rows, causal_off, qk_scale,
            win_left, win_right, slopes, cap,
            D, BLOCK_N, BLOCK_D, PAGED, PAGE, PAGE_BLOCK, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_head, v_head, bt_row, stride_btc, k_tok0,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
        tl.maximum(k0, full_lo), tl.minimum(k1, full_end), n_k, i_rows, causal_off, qk_scale,
        win_left, win_right, slopes, cap,
        D, BLOCK_N, BLOCK_D, PAGED, PAGE, PAGE_BLOCK, False, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_head, v_head, bt_row, stride_btc, k_tok0,
        stride_kp, stride_kt, stride_kd, stride_vp, stride_vt, stride_vd,
        tl.maximum(k0, full_end), tl.minimum(k1, hi), n_k, i_rows, causal_off, qk_scale,
        win_left, win_right, slopes, cap,
        D, BLOCK_N, BLOCK_D, PAGED, PAGE, PAGE_BLOCK, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)

    # epilogue: O = O / l, lse = (m + log2 l)·ln2; rows with no key -> 0, -inf
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    d_ok = offs_d[None, :] < D
    head64 = head.to(tl.int64)
    final = row_ok & (part < 0)
    o_ptrs = O + tok[:, None] * stride_ot + head64[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=final[:, None] & d_ok)
    tl.store(LSE + head64 * stride_lh + tok * stride_lt, lse, mask=final)
    split = row_ok & (part >= 0)
    prow = (part + i_rows).to(tl.int64) * H_Q + head64          # (partial row, head)
    tl.store(O_PART + prow[:, None] * D + offs_d[None, :], o, mask=split[:, None] & d_ok)
    tl.store(LSE_PART + prow, lse, mask=split)


@triton.jit
def ragged_merge(
    O_PART,                      # (R, Hq, D) fp32 contiguous: each split's normalised o
    LSE_PART,                    # (R, Hq) fp32 contiguous: each split's lse (-inf: saw no key)
    O,                           # out: o (Tq, Hq, D), any strides
    LSE,                         # out: lse (Hq, Tq) fp32, any strides
    MERGE,                       # int32 (n_merge, MERGE_FIELDS): one row per token of a split sequence
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    H_Q,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,       # splits loaded at once: always MAX_SPLITS (a launch's other sequences never
                                 # change the reduction's shape, so a token's bits are its own)
):
    """lse = log Σ_s e^{lse_s}; o = Σ_s e^{lse_s - lse} o_s for one (token, head): every split's
    lse and o are loaded in one go (one memory latency, not one per split), then reduced over a
    fixed BLOCK_S-wide axis, so a token's answer depends only on its own sequence's splits."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.load(MERGE + r * 4 + 0).to(tl.int64)
    base = tl.load(MERGE + r * 4 + 1)
    n_q = tl.load(MERGE + r * 4 + 2)
    n_splits = tl.load(MERGE + r * 4 + 3)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < D
    prow = (base + offs_s * n_q).to(tl.int64) * H_Q + h      # (partial row of split j, head h)
    lse_s = tl.load(LSE_PART + prow, mask=s_ok, other=float("-inf"))
    o_s = tl.load(O_PART + prow[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_use)                                # 0 for padding splits and splits that saw no key
    acc = tl.sum(w[:, None] * o_s, 0)
    w_sum = tl.sum(w, 0)
    seen = w_sum != 0.0
    w_safe = tl.where(seen, w_sum, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_d * stride_od, (acc / w_safe).to(O.dtype.element_ty),
             mask=d_ok)
    tl.store(LSE + h * stride_lh + t * stride_lt, tl.where(seen, m_use + tl.log(w_safe), float("-inf")))


__all__ = ["LOG2E", "MERGE_FIELDS", "SEQ_FIELDS", "WORK_FIELDS", "ragged_fwd", "ragged_merge"]
