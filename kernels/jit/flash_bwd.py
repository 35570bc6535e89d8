"""Triton backward kernels: gradients by recomputation (the seed's §6), no N×N tensor.

Saved from the forward: Q, K, V, O and the row LSE (natural log). With P recomputed block by
block as P_ij = exp(S_ij - lse_i) (here in base 2: 2^(S_ij·scale·log2e - lse_i·log2e)):

    D_i  = rowsum(dO_i ∘ O_i)                   bwd_preprocess
    dV_j = Σ_i P_ijᵀ dO_i                        bwd_dkdv   (one program per key block and kv
    dP   = dO_i V_jᵀ                                        head; GQA: sums over its query heads)
    dS   = P_ij ∘ (dP - D_i)
    dK_j = Σ_i dS_ijᵀ Q_i · scale
    dQ_i = Σ_j dS_ij K_j · scale                 bwd_dq     (one program per query block)

Every output element is written by exactly one program, summed in registers in a fixed order:
the backward is deterministic (bit-identical across runs), at the cost of recomputing S and dP
in bwd_dq (7 block GEMMs per (i, j) pair instead of the 5 of an atomic-add dQ).

Score modifiers (``kernels/masks.py``) are recomputed as the forward applies them: S capped
(S_c = c·tanh(S/c)) and biased before P; the window masks P and bounds the loops. The cap's
derivative carries dS back to the uncapped score: dS_raw = dS ∘ (1 - tanh²); the bias has none.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import tuning
from .softmax import key_range, tanh

LOG2E = 1.4426950408889634
LOG2E_K = tl.constexpr(LOG2E)  # the kernels' copy: a jit function reads only constexpr globals


@triton.jit
def bwd_preprocess(
    O, DO,                        # o, do (B, Hq, Nq, D), any strides
    DELTA,                        # out: D_i = rowsum(dO ∘ O), fp32 (B, Hq, Nq) contiguous
    stride_ob, stride_oh, stride_on, stride_od,
    stride_db, stride_dh, stride_dn, stride_dd,
    H_Q, N_Q,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets (b · stride_b may pass 2**31)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < N_Q) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :] * stride_od,
                mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dn + offs_d[None, :] * stride_dd,
                 mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh * N_Q + rows, tl.sum(o * do, 1), mask=rows < N_Q)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v,                 # running dK_j, dV_j (fp32); the K_j, V_j tiles
    q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_dn, stride_dd,
    start, end,                   # query rows [start, end), start a multiple of BLOCK_M
    cols, kv_len, causal_off, N_Q, qk_scale,
    win_left, win_right, slope, cap,   # window sides; this head's ALiBi slope, softcap (log2 units)
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        ld = (rows[:, None] < N_Q) & (offs_d[None, :] < D)
        q = tl.load(q_base + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=ld, other=0.0)
        do = tl.load(do_base + rows[:, None] * stride_dn + offs_d[None, :] * stride_dd, mask=ld, other=0.0)
        lse = tl.load(lse_base + rows, mask=rows < N_Q, other=0.0) * 1.4426950408889634
        lse = tl.where(lse == float("-inf"), 0.0, lse)          # rows that see no key: P is all masked
        delta = tl.load(delta_base + rows, mask=rows < N_Q, other=0.0)
        # recompute Pᵀ_ij = 2^(S_ijᵀ·scale·log2e - lse_i·log2e)   (BLOCK_N, BLOCK_M)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        if SOFTCAP:
            th = tanh(st / cap)
            st = cap * th
        if HAS_ALIBI:
            st = st - slope * tl.abs(rows[None, :] + causal_off - cols[:, None]).to(tl.float32)
        pt = tl.math.exp2(st - lse[None, :])
        if MASKED:
            visible = (cols[:, None] < kv_len) & (rows[None, :] < N_Q)
            if IS_CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :] + causal_off)
            if WINDOW:
                i_al = rows[None, :] + causal_off
                visible = visible & (cols[:, None] >= i_al - win_left) & (cols[:, None] <= i_al + win_right)
            pt = tl.where(visible, pt, 0.0)
        # dV_j += P_ijᵀ dO_i
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        # dPᵀ = V_j dO_iᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ - D_i)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - th * th)                         # through the cap
        # dK_j += dS_ijᵀ Q_i   (· scale at the end)
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def bwd_dkdv(
    Q, K, V, DO,                  # q, do (B, Hq, Nq, D); k, v (B, Hkv, Nk, D); any strides
    LSE, DELTA,                   # fp32 (B, Hq, Nq) contiguous: forward lse (natural log), D_i
    DK, DV,                       # out: (B, Hkv, Nk, D), contiguous, k's dtype
    KV_LEN,                       # int32 (B,), unused unless HAS_KV_LEN
    ALIBI,                        # fp32 ALiBi slopes (B, Hq), stride_ab 0 for one set; unused unless HAS_ALIBI
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dn, stride_dd,
    stride_ab, stride_ah,
    H_Q, H_KV, N_Q, N_K,
    scale, qk_scale,              # scale; scale·log2(e)
    win_left, win_right, cap,     # window sides (1 << 30: unbounded); softcap·log2(e)
    N_BUCKET,                     # autotuning key only
    GROUP,                        # query heads per kv head: dK, dV sum over all of them
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,        # query rows per inner step
    BLOCK_N: tl.constexpr,        # keys owned by this program
    IS_CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets (b · stride_b may pass 2**31)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if HAS_KV_LEN:
        kv_len = tl.load(KV_LEN + b)
    else:
        kv_len = N_K
    causal_off = N_K - N_Q
    ld = (cols[:, None] < kv_len) & (offs_d[None, :] < D)
    k = tl.load(K + b * stride_kb + kvh * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=ld, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=ld, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # query rows [0, N_Q); causal: rows i < n0 - off see none of these keys, rows i >= n0+BN-1-off
    # see all of them; the block is whole (unmasked) only if it lies inside kv_len
    lo = 0
    full_lo = 0
    if IS_CAUSAL:
        lo = tl.maximum(n0 - causal_off, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - causal_off, 0)
        full_lo = (full_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_hi = N_Q // BLOCK_M * BLOCK_M
    if n0 + BLOCK_N > kv_len:
        full_hi = 0                           # ragged or padded key block: mask every row
    full_lo = tl.minimum(tl.maximum(full_lo, lo), N_Q)
    full_hi = tl.maximum(full_hi, full_lo)
    row_end = N_Q
    if WINDOW:
        # rows whose window reaches these keys: i + off in [n0 - win_right, n0 + BLOCK_N - 1 + win_left];
        # every one of them masked (a band of rows is short, and its edges are ragged)
        lo = tl.maximum(lo, tl.maximum(n0 - win_right - causal_off, 0) // BLOCK_M * BLOCK_M)
        row_end = tl.maximum(tl.minimum(N_Q, n0 + BLOCK_N + win_left - causal_off), lo)
        full_lo = row_end
        full_hi = row_end
    if n0 < kv_len:
        for g in range(0, GROUP):
            h = kvh * GROUP + g
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_db + h * stride_dh
            lse_base = LSE + (b * H_Q + h) * N_Q
            delta_base = DELTA + (b * H_Q + h) * N_Q
            if HAS_ALIBI:
                slope = tl.load(ALIBI + b * stride_ab + h * stride_ah) * LOG2E_K
            else:
                slope = 0.0
            # diagonal rows (masked), whole rows (unmasked), ragged tail (masked)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qn, stride_qd, stride_dn, stride_dd, lo, full_lo,
                                 cols, kv_len, causal_off, N_Q, qk_scale, win_left, win_right, slope, cap,
                                 D, BLOCK_M, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qn, stride_qd, stride_dn, stride_dd, full_lo, full_hi,
                                 cols, kv_len, causal_off, N_Q, qk_scale, win_left, win_right, slope, cap,
                                 D, BLOCK_M, BLOCK_D, False, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qn, stride_qd, stride_dn, stride_dd, full_hi, row_end,
                                 cols, kv_len, causal_off, N_Q, qk_scale, win_left, win_right, slope, cap,
                                 D, BLOCK_M, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    dk = dk * scale
    out = (b * H_KV + kvh) * N_K * D + cols[:, None] * D + offs_d[None, :]
    st = (cols[:, None] < N_K) & (offs_d[None, :] < D)
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=st)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=st)


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta,        # running dQ_i (fp32); the Q_i, dO_i tiles; lse·log2e, D_i
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, rows, kv_len, causal_off, qk_scale,
    win_left, win_right, slope, cap,   # as _dkdv_inner's
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        ld = (cols[:, None] < kv_len) & (offs_d[None, :] < D)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=ld, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=ld, other=0.0)
        # recompute P_ij = 2^(S_ij·scale·log2e - lse_i·log2e)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if SOFTCAP:
            th = tanh(s / cap)
            s = cap * th
        if HAS_ALIBI:
            s = s - slope * tl.abs(rows[:, None] + causal_off - cols[None, :]).to(tl.float32)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            visible = cols[None, :] < kv_len
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + causal_off)
            if WINDOW:
                i_al = rows[:, None] + causal_off
                visible = visible & (cols[None, :] >= i_al - win_left) & (cols[None, :] <= i_al + win_right)
            p = tl.where(visible, p, 0.0)
        # dP = dO_i V_jᵀ;  dS = P ∘ (dP - D_i);  dQ_i += dS K_j   (· scale at the end)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - th * th)                           # through the cap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def bwd_dq(
    Q, K, V, DO,                  # as bwd_dkdv
    LSE, DELTA,
    DQ,                           # out: (B, Hq, Nq, D), contiguous, q's dtype
    KV_LEN,
    ALIBI,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dn, stride_dd,
    stride_ab, stride_ah,
    H_Q, GROUP, N_Q, N_K,
    scale, qk_scale,
    win_left, win_right, cap,
    N_BUCKET,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,        # query rows owned by this program
    BLOCK_N: tl.constexpr,        # keys per inner step
    IS_CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets (b · stride_b may pass 2**31)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    kvh = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ld = (rows[:, None] < N_Q) & (offs_d[None, :] < D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=ld, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dn + offs_d[None, :] * stride_dd,
                 mask=ld, other=0.0)
    lse = tl.load(LSE + pid_bh * N_Q + rows, mask=rows < N_Q, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + pid_bh * N_Q + rows, mask=rows < N_Q, other=0.0)
    if HAS_KV_LEN:
        kv_len = tl.load(KV_LEN + b)
    else:
        kv_len = N_K
    causal_off = N_K - N_Q
    i_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_Q) - 1
    lo, full_lo, full_end, hi = key_range(kv_len, causal_off, pid_m * BLOCK_M, i_hi, win_left, win_right,
                                          BLOCK_N, IS_CAUSAL, WINDOW)
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_ab + h * stride_ah) * LOG2E_K
    else:
        slope = 0.0
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    if WINDOW:  # the window's left edge: masked
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       lo, full_lo, rows, kv_len, causal_off, qk_scale, win_left, win_right, slope, cap,
                       D, BLOCK_N, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   full_lo, full_end, rows, kv_len, causal_off, qk_scale, win_left, win_right, slope, cap,
                   D, BLOCK_N, BLOCK_D, False, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   full_end, hi, rows, kv_len, causal_off, qk_scale, win_left, win_right, slope, cap,
                   D, BLOCK_N, BLOCK_D, True, IS_CAUSAL, WINDOW, SOFTCAP, HAS_ALIBI, DOT_PREC)
    dq = dq * scale
    tl.store(DQ + pid_bh * N_Q * D + rows[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=ld)


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


# two or three configs per class: the dK/dV kernel takes ~10 s to compile each
_DKDV = {64: [_cfg(64, 128, 8, 3), _cfg(32, 128, 4, 3), _cfg(64, 64, 4, 3)],
         128: [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 2)],
         256: [_cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2)]}
_DQ = {64: [_cfg(128, 64, 8, 3), _cfg(128, 32, 4, 3)],
       128: [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 2)],
       256: [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2)]}
_FP32 = [_cfg(32, 32, 4, 2), _cfg(32, 64, 4, 2)]


def _d_class(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


def _pruner(table):
    def prune(configs, nargs, **kw):
        if nargs["Q"].dtype.itemsize == 4:
            return _FP32
        return table[_d_class(kw["BLOCK_D"])]
    return prune


_KEY = ["BLOCK_D", "IS_CAUSAL", "HAS_KV_LEN", "WINDOW", "SOFTCAP", "HAS_ALIBI", "N_BUCKET"]
bwd_dkdv_tuned = triton.autotune(
    configs=[c for cs in _DKDV.values() for c in cs] + _FP32, key=_KEY + ["GROUP"],
    prune_configs_by={"early_config_prune": _pruner(_DKDV)}, do_bench=tuning.bench,
)(bwd_dkdv)
bwd_dq_tuned = triton.autotune(
    configs=[c for cs in _DQ.values() for c in cs] + _FP32, key=_KEY,
    prune_configs_by={"early_config_prune": _pruner(_DQ)}, do_bench=tuning.bench,
)(bwd_dq)
