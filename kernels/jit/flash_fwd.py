"""Triton forward kernels (FlashAttention-2 order): Q blocks across the grid, K/V streamed.

Only ``@triton.jit`` code and its autotuning lives here; ``kernels/flash.py`` checks, allocates
and launches. The seed's online softmax (steps 1-5) in base 2, with scale·log2(e) folded into S:

    S_ij   = Q_i K_jᵀ · scale · log2(e)                    (step 1, log2 units)
    m_new  = max(m_i, rowmax(S_ij))                        (steps 2-3)
    alpha  = 2^(m_i - m_new)                               (step 4, the correction factor)
    P_ij   = 2^(S_ij - m_new)
    l_new  = alpha · l_i + rowsum(P_ij)                    (step 4)
    O_new  = alpha · O_i + P_ij V_j                        (step 5, left unnormalised: FA2 divides
                                                            by l once at the end)
    lse    = (m + log2 l) · ln 2                           (natural log, what the API returns)

A row that sees no key keeps m = -inf and l = 0: it is written as o = 0, lse = -inf. A NaN or
+inf score makes l NaN: the epilogue tests l != 0 (not l > 0), so that row is written as NaN, the
IEEE answer, instead of passing for a row with no key.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from . import tuning
from .softmax import key_range, online_softmax_block

LOG2E = 1.4426950408889634
LOG2E_K = tl.constexpr(LOG2E)  # the kernels' copy: a jit function reads only constexpr globals


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,            # running O (fp32, unnormalised), l, m (log2 units); the Q tile
    k_base, v_base,              # K, V pointers at (batch, kv head)
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end,                  # key range [start, end), start a multiple of BLOCK_N
    kv_len,                      # keys >= kv_len are padding (masked)
    i_rows, causal_off,          # query index of each row; Nk - Nq (bottom-right causal)
    qk_scale,                    # scale · log2(e)
    win_left, win_right, slopes, cap,   # window, ALiBi slopes, soft cap (``online_softmax_block``)
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,        # False: every key of every block in [start, end) is visible
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd  # K_jᵀ (BLOCK_D, BLOCK_N)
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd   # V_j (BLOCK_N, BLOCK_D)
        acc, l_i, m_i = online_softmax_block(acc, l_i, m_i, q, kt_ptrs, v_ptrs, cols, kv_len, i_rows, causal_off,
                                             qk_scale, win_left, win_right, slopes, cap, D, BLOCK_D, MASKED,
                                             IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V,                     # q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D); any strides
    O,                           # out: o (B, Hq, Nq, D), or per-split partials (S, B, Hq, Nq, D) fp32
    LSE,                         # out: lse (B, Hq, Nq) fp32 natural log, or per-split (S, B, Hq, Nq)
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    ALIBI,                       # fp32 ALiBi slopes (B, Hq) (stride_ab 0: one set for all); unused unless HAS_ALIBI
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ab, stride_ah,
    stride_os, stride_ob, stride_oh, stride_on, stride_od,   # stride_os: between splits (0: one split)
    stride_ls, stride_lb, stride_lh, stride_ln,
    H_Q,                         # query heads
    GROUP,                       # query heads per kv head (Hq / Hkv): q head h reads kv head h // GROUP
    N_Q, N_K,                    # query and key lengths
    qk_scale,                    # scale · log2(e)
    win_left, win_right,         # window sides in keys (1 << 30: unbounded); unused unless WINDOW
    cap,                         # softcap · log2(e); unused unless SOFTCAP
    KEYS_PER_SPLIT,              # keys handled by one program along grid axis 2 (split-KV)
    N_Q_BUCKET, N_K_BUCKET,      # autotuning key only (log2 buckets of N_Q, N_K)
    D: tl.constexpr,             # head dim
    BLOCK_D: tl.constexpr,       # D padded to a power of two (>= 16); columns >= D are masked
    BLOCK_M: tl.constexpr,       # rows (queries) per program
    BLOCK_N: tl.constexpr,       # keys per inner step
    IS_CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    WINDOW: tl.constexpr,        # a sliding window bounds the keys of each row
    SOFTCAP: tl.constexpr,       # scores capped: softcap · tanh(S / softcap)
    HAS_ALIBI: tl.constexpr,     # scores biased by -slope · |i + Nk - Nq - j|
    PACK: tl.constexpr,          # 1, or GROUP: the rows of one program are the GROUP query heads of
                                 # one kv head × N_Q queries (decode: K/V read once per kv head)
    DOT_PREC: tl.constexpr,      # "ieee" for float32 inputs (exact), "tf32" (ignored) for 16-bit
    SPLITS_FIRST: tl.constexpr,  # grid (splits, B·Hq/PACK, row blocks), not (row blocks, B·Hq/PACK, splits)
):
    # ---- which rows this program owns ----
    if SPLITS_FIRST:                         # programs that run together read one head's neighbouring keys
        n_pid_m = tl.num_programs(2)
        pid_m = tl.program_id(2)
        pid_s = tl.program_id(0)
    else:
        n_pid_m = tl.num_programs(0)
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(2)             # split of the key range
    if IS_CAUSAL:
        pid_m = n_pid_m - 1 - pid_m          # the longest rows first: better tail balance
    # 64-bit from here: b · stride_qb passes 2**31 in a tensor of more elements (int32 strides wrap)
    pid_bh = tl.program_id(1).to(tl.int64)   # batch × (Hq / PACK)
    heads_per_prog = H_Q // PACK
    b = pid_bh // heads_per_prog
    hp = pid_bh % heads_per_prog
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK == 1:
        head = hp + rows * 0                 # (BLOCK_M,) all the same head
        i_rows = rows                        # query index of each row
        kvh = hp // GROUP
        row_ok = rows < N_Q
        i_lo = pid_m * BLOCK_M
        i_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_Q) - 1
    else:
        head = hp * PACK + rows // N_Q
        i_rows = rows % N_Q
        kvh = hp
        row_ok = rows < PACK * N_Q
        i_lo = 0                             # rows of several heads: take the widest bounds
        i_hi = N_Q - 1

    # ---- the key range: [0, full_end) needs no mask, [full_end, hi) is masked ----
    if HAS_KV_LEN:
        kv_len = tl.load(KV_LEN + b)
    else:
        kv_len = N_K
    causal_off = N_K - N_Q
    lo, full_lo, full_end, hi = key_range(kv_len, causal_off, i_lo, i_hi, win_left, win_right, BLOCK_N,
                                          IS_CAUSAL, WINDOW)
    k0 = pid_s * KEYS_PER_SPLIT
    k1 = k0 + KEYS_PER_SPLIT

    # ---- load Q_i once ----
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + i_rows[:, None] * stride_qn \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    if HAS_ALIBI:                            # each row's head's slope, in log2 units
        slopes = tl.load(ALIBI + b * stride_ab + head * stride_ah, mask=row_ok, other=0.0) * LOG2E_K
    else:
        slopes = tl.zeros([BLOCK_M], dtype=tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:
        # the window's left edge: masked
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            tl.maximum(k0, lo), tl.minimum(k1, full_lo), kv_len, i_rows, causal_off, qk_scale,
            win_left, win_right, slopes, cap,
            D, BLOCK_N, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    # blocks every row sees whole: no mask
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        tl.maximum(k0, full_lo), tl.minimum(k1, full_end), kv_len, i_rows, causal_off, qk_scale,
        win_left, win_right, slopes, cap,
        D, BLOCK_N, BLOCK_D, False, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    # the diagonal / the window's right edge / padding / ragged-end blocks: masked
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        tl.maximum(k0, full_end), tl.minimum(k1, hi), kv_len, i_rows, causal_off, qk_scale,
        win_left, win_right, slopes, cap,
        D, BLOCK_N, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)

    # ---- epilogue: O = O / l, lse = (m + log2 l)·ln2; rows with no key -> 0, -inf ----
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + pid_s.to(tl.int64) * stride_os + b * stride_ob + head[:, None] * stride_oh \
        + i_rows[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
    l_ptrs = LSE + pid_s.to(tl.int64) * stride_ls + b * stride_lb + head * stride_lh + i_rows * stride_ln
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def attn_fwd_tma(
    Q, K, V,                     # q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D); last dim contiguous, rows 16-byte aligned
    O,                           # out: o (B, Hq, Nq, D), last dim contiguous
    LSE,                         # out: lse (B, Hq, Nq) fp32 natural log, last dim contiguous
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    H_Q, GROUP, N_Q, N_K,
    qk_scale,                    # scale · log2(e), > 0 (the max is taken before scaling)
    N_Q_BUCKET, N_K_BUCKET,      # autotuning key only
    D: tl.constexpr,             # head dim: 64 or 128 (a TMA box is a whole row)
    HAS_KV_LEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WS: tl.constexpr,            # Triton's Hopper warp specialisation of the key loop
):
    """The non-causal prefill of ``attn_fwd`` for Hopper: Q, K, V and O move by TMA (tensor
    descriptors built per (batch, head), so a block past a head's last row reads zeros instead of
    the next head), and the full key blocks run in one loop that Triton may warp-specialise
    (producer warps issue the copies while consumer warp groups do the GEMMs and the softmax).
    The last, partial block is masked outside that loop."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_Q).to(tl.int64)
    h = (pid_bh % H_Q).to(tl.int64)
    kvh = h // GROUP
    dtype = Q.dtype.element_ty
    desc_q = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N_Q, D],
                                       strides=[stride_qn, 1], block_shape=[BLOCK_M, D])
    desc_k = tl.make_tensor_descriptor(K + b * stride_kb + kvh * stride_kh, shape=[N_K, D],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, D])
    desc_v = tl.make_tensor_descriptor(V + b * stride_vb + kvh * stride_vh, shape=[N_K, D],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, D])
    desc_o = tl.make_tensor_descriptor(O + b * stride_ob + h * stride_oh, shape=[N_Q, D],
                                       strides=[stride_on, 1], block_shape=[BLOCK_M, D])
    if HAS_KV_LEN:
        kv_len = tl.load(KV_LEN + b)
    else:
        kv_len = N_K
    full_end = kv_len // BLOCK_N * BLOCK_N

    q = desc_q.load([pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    # full blocks: every key visible; m_new stays -inf only while a row's scores are all -inf (keys
    # of -inf), and then 0 is subtracted (-inf - -inf is NaN)
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WS):
        s = tl.dot(q, desc_k.load([start_n, 0]).T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_use[:, None])   # scale and shift in one FMA
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(dtype), desc_v.load([start_n, 0]), acc)
        m_i = m_new
    if full_end < kv_len:
        # the ragged end: keys >= kv_len masked (TMA reads zeros past N_K, kv_len may end sooner)
        cols = full_end + tl.arange(0, BLOCK_N)
        s = tl.dot(q, desc_k.load([full_end, 0]).T) * qk_scale
        s = tl.where(cols[None, :] < kv_len, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(dtype), desc_v.load([full_end, 0]), acc)
        m_i = m_new

    # epilogue as attn_fwd's: rows that saw no key (kv_len = 0) -> 0, -inf
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    desc_o.store([pid_m * BLOCK_M, 0], (acc / l_safe[:, None]).to(dtype))   # rows past N_Q clipped
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + b * stride_lb + h * stride_lh + rows, lse, mask=rows < N_Q)


@triton.jit
def attn_combine(
    O_PART,                      # (S, R, D) fp32: each split's normalised output, R = B·Hq·Nq rows, contiguous
    LSE_PART,                    # (S, R) fp32: each split's natural-log lse (-inf: saw no key)
    O,                           # out: o (B, Hq, Nq, D), any strides
    LSE,                         # out: lse (B, Hq, Nq) contiguous fp32
    stride_ob, stride_oh, stride_on, stride_od,
    N_SPLITS, R, H_Q, N_Q,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,       # N_SPLITS padded to a power of two
    RB: tl.constexpr,            # rows per program
    PDL: tl.constexpr,           # launched as a programmatic dependent of the split kernel
):
    """The merge after a split-KV launch, RB rows per program: flash-decoding's reduction
    lse = log Σ_s e^{lse_s}; o = Σ_s e^{lse_s - lse} o_s. All splits of all RB rows are loaded at
    once where the tile fits."""
    if PDL:  # the split kernel's grid may still run: wait for it to finish and its writes to land
        gdc_wait()
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    r_ok = r < R
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    r64 = r.to(tl.int64)
    s_ok = offs_s < N_SPLITS
    lse_s = tl.load(LSE_PART + offs_s[:, None].to(tl.int64) * R + r64[None, :],
                    mask=s_ok[:, None] & r_ok[None, :], other=float("-inf"))
    m = tl.max(lse_s, 0)                                     # (RB,)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp(lse_s - m_use[None, :]), 0)        # 0 for splits that saw no key
    # (CHUNK, RB, BLOCK_D) tiles of at most 8192 values where RB·BLOCK_D allows: 64 registers a
    # thread at 4 warps
    CHUNK: tl.constexpr = min(BLOCK_S, max(1, 8192 // (RB * BLOCK_D)))
    acc = tl.zeros([RB, BLOCK_D], dtype=tl.float32)
    for s0 in tl.static_range(0, BLOCK_S, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        c_ok = (offs_c < N_SPLITS)[:, None] & r_ok[None, :]
        w_c = tl.exp(tl.load(LSE_PART + offs_c[:, None].to(tl.int64) * R + r64[None, :], mask=c_ok,
                             other=float("-inf")) - m_use[None, :])
        o_c = tl.load(O_PART + (offs_c[:, None, None].to(tl.int64) * R + r64[None, :, None]) * D
                      + offs_d[None, None, :],
                      mask=c_ok[:, :, None] & (offs_d[None, None, :] < D), other=0.0)
        acc += tl.sum(w_c[:, :, None] * o_c, 0)
    seen = w_sum != 0.0
    w_safe = tl.where(seen, w_sum, 1.0)
    b = r64 // (H_Q * N_Q)
    h = (r64 // N_Q) % H_Q
    n = r64 % N_Q
    tl.store(O + (b * stride_ob + h * stride_oh + n * stride_on)[:, None] + offs_d[None, :] * stride_od,
             (acc / w_safe[:, None]).to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + r64, tl.where(seen, m_use + tl.log(w_safe), float("-inf")), mask=r_ok)


# ---- autotuning: a handful of configs per head-dim class, keyed on what changes the best one ----

def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


_PREFILL = {
    64: [_cfg(128, 128, 8, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 4, 3), _cfg(64, 64, 4, 4),
         _cfg(64, 128, 4, 3),
         # short sequences (N <= 1k): narrower key blocks win (see docs/benchmarks/kernels.md#prefill)
         _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 3), _cfg(128, 32, 4, 3)],
    128: [_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3), _cfg(128, 128, 8, 2),
          _cfg(64, 64, 4, 3), _cfg(64, 128, 4, 3)],   # BLOCK_M 64: more programs for short N
    256: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(128, 32, 8, 2), _cfg(64, 32, 4, 3)],
}
_PREFILL_FP32 = [_cfg(64, 64, 4, 2), _cfg(64, 32, 4, 2), _cfg(32, 64, 4, 2)]
# Split-KV (decode) at D <= 128, 16-bit: one config, not tuned. The autotuning key cannot hold B
# (plan() never depends on it), so a tuned config would come from whichever batch size was tuned
# first; this one is the best or near it at every B (see docs/benchmarks/kernels.md#decode).
_SPLIT_16BIT = [_cfg(16, 64, 4, 3)]
_SPLIT_D256 = [_cfg(16, 64, 4, 4), _cfg(32, 64, 4, 3), _cfg(64, 64, 4, 3)]
_SPLIT = _SPLIT_16BIT + _SPLIT_D256
_SPLIT_FP32 = [_cfg(16, 64, 4, 2), _cfg(32, 32, 4, 2)]


def _d_class(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


# Fewer than 512 keys at D <= 64: only these, the fastest there, the first the default, so that an
# untuned launch (ATTNSERVE_AUTOTUNE=0, a key unseen when frozen) runs a narrow-key config
# (see docs/benchmarks/kernels.md#prefill).
_SHORT_64 = [_cfg(128, 32, 4, 3), _cfg(64, 32, 4, 3), _cfg(64, 64, 4, 2)]
_SHORT_KEYS_BUCKET = 8  # N_K_BUCKET = floor(log2 Nk): Nk < 512


def _prune_prefill(configs, nargs, **kw):
    if nargs["Q"].dtype.itemsize == 4:  # fp32 tiles take twice the shared memory
        return _PREFILL_FP32
    if kw["BLOCK_D"] <= 64 and nargs["N_K_BUCKET"] <= _SHORT_KEYS_BUCKET:
        return _SHORT_64
    return _PREFILL[_d_class(kw["BLOCK_D"])]


def _prune_split(configs, nargs, **kw):
    if nargs["Q"].dtype.itemsize == 4:
        return _SPLIT_FP32
    return _SPLIT_16BIT if kw["BLOCK_D"] <= 128 else _SPLIT_D256


_KEY = ["BLOCK_D", "IS_CAUSAL", "HAS_KV_LEN", "WINDOW", "SOFTCAP", "HAS_ALIBI", "PACK", "N_Q_BUCKET", "N_K_BUCKET"]
_ALL_PREFILL = [c for cs in _PREFILL.values() for c in cs] + _PREFILL_FP32  # _SHORT_64 is among them


def _tma_cfg(bm, bn, w, s, ws):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": ws}, num_warps=w, num_stages=s)


# A config is listed only once seen correct and fast inside this kernel on the GPU (some that are
# fast alone are slow here, one warp-specialised config gives NaN; tests/kernels/test_triton_forward.py
# checks each one alone; see docs/benchmarks/kernels.md#prefill).
TMA_CONFIGS = {
    64: [_tma_cfg(128, 64, 8, 3, False), _tma_cfg(128, 64, 4, 3, False)],
    128: [_tma_cfg(128, 64, 4, 2, True), _tma_cfg(128, 128, 8, 3, False)],
}


def _prune_tma(configs, nargs, **kw):
    return TMA_CONFIGS[kw["D"]]


attn_fwd_tma_tuned = triton.autotune(
    configs=[c for cs in TMA_CONFIGS.values() for c in cs],
    key=["D", "HAS_KV_LEN", "N_Q_BUCKET", "N_K_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_tma}, do_bench=tuning.bench,
)(attn_fwd_tma)

attn_fwd_tuned = triton.autotune(
    configs=_ALL_PREFILL, key=_KEY, prune_configs_by={"early_config_prune": _prune_prefill},
    do_bench=tuning.bench,
)(attn_fwd)
attn_fwd_split_tuned = triton.autotune(
    configs=_SPLIT + _SPLIT_FP32, key=_KEY, prune_configs_by={"early_config_prune": _prune_split},
    do_bench=tuning.bench,
)(attn_fwd)
