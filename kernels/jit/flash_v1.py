"""Triton kernel of the seed's FlashAttention V1, in its loop order.

One program per (batch, query head) — and, when B·Hq is too small to fill the GPU, per slice of the
key range too (FA1 split the K/V loop the same way). Inside it:

    for each K/V block j            (outer: K_j, V_j read from HBM once, held on chip)
        for each Q block i          (inner: Q_i, O_i, m_i, l_i read from HBM, updated, written back)
            S_ij = Q_i K_jᵀ · scale                                   step 1
            m~_ij = rowmax(S_ij)                                      step 2
            m_new = max(m_i, m~_ij)                                   step 3
            alpha = e^(m_i - m_new);  l_new = alpha·l_i + rowsum(e^(S_ij - m_new))   step 4
            O_new = (alpha·l_i / l_new)·O_i + e^(S_ij - m_new) V_j / l_new           step 5

What differs from the printed kernel: O is carried in float32 (not rounded to the input dtype on
every pass), masks (bottom-right causal, kv_lengths, ragged ends, padded head dim) are applied as
-inf before step 2, and a row with no visible key keeps m = -inf, l = 0 without producing NaN.
A last pass turns (m, l) into lse = m + ln l for ``attn_combine`` (kernels/jit/flash_fwd.py),
which merges the key slices and writes o in the input dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import tuning

BASE2_LIMIT_K = tl.constexpr(3.4028234663852886e38 / 1.4426950408889634)  # kernels.masks.BASE2_LIMIT


@triton.jit
def flash_v1_fwd(
    Q, K, V,                     # q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D); any strides
    O_PART,                      # (S, B, Hq, Nq, D) fp32 contiguous, zeros: running O per key slice
    M_PART,                      # (S, B, Hq, Nq) fp32, -inf: running row max m; holds lse at the end
    L_PART,                      # (S, B, Hq, Nq) fp32, zeros: running row sum l
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    B, H_Q, GROUP,               # batch, query heads, query heads per kv head
    N_Q, N_K,
    scale,                       # softmax scale (natural-log units, as in the seed)
    KEYS_PER_SPLIT,              # keys of one program along grid axis 1
    D: tl.constexpr, BLOCK_D: tl.constexpr,   # head dim; padded to a power of two >= 16
    BLOCK_M: tl.constexpr,       # B_r: query rows per inner step
    BLOCK_N: tl.constexpr,       # B_c: keys per outer step
    IS_CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: b · stride_qb passes 2**31 in big tensors
    pid_s = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    kvh = h // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    row0 = ((pid_s * B + b) * H_Q + h) * N_Q        # first row of this (slice, b, h) in the partials
    if HAS_KV_LEN:
        kv_len = tl.load(KV_LEN + b)
    else:
        kv_len = N_K
    causal_off = N_K - N_Q
    k_lo = pid_s * KEYS_PER_SPLIT
    k_hi = tl.minimum(k_lo + KEYS_PER_SPLIT, kv_len)

    # ============ outer loop: K/V blocks (each read once) ============
    for kv_start in range(k_lo, k_hi, BLOCK_N):
        cols = kv_start + offs_n
        col_ok = cols < k_hi
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        q_first = 0
        if IS_CAUSAL:  # rows i < kv_start - (Nk - Nq) see none of this block: skip their Q blocks
            q_first = tl.maximum(kv_start - causal_off, 0) // BLOCK_M * BLOCK_M
        # ============ inner loop: Q blocks (Q_i, O_i, m_i, l_i re-read every outer step) ============
        for q_start in range(q_first, N_Q, BLOCK_M):
            rows = q_start + offs_m
            row_ok = rows < N_Q
            q = tl.load(q_base + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            o_ptrs = O_PART + (row0 + rows[:, None]) * D + offs_d[None, :]
            o_i = tl.load(o_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m_i = tl.load(M_PART + row0 + rows, mask=row_ok, other=float("-inf"))
            l_i = tl.load(L_PART + row0 + rows, mask=row_ok, other=0.0)

            # step 1: S_ij = Q_i K_jᵀ · scale, masked keys -> -inf
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
            # the other kernels work in log2 units, where a score past FLT_MAX / log2(e) is ±inf: so here
            s = tl.where(tl.abs(s) > BASE2_LIMIT_K, s * float("inf"), s)
            visible = col_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + causal_off)
            s = tl.where(visible, s, float("-inf"))
            # step 2: m~_ij = rowmax(S_ij);  step 3: m_new = max(m_i, m~_ij)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key seen yet: no NaN
            # step 4: alpha = e^(m_i - m_new);  l_new = alpha·l_i + rowsum(e^(S_ij - m_new))
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_new = alpha * l_i + tl.sum(p, 1)
            l_safe = tl.where(l_new != 0.0, l_new, 1.0)
            # step 5: O_new = (alpha·l_i / l_new)·O_i + P_ij V_j / l_new   (kept in float32)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            o_new = o_i * (alpha * l_i / l_safe)[:, None] + pv / l_safe[:, None]

            tl.store(o_ptrs, o_new, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(M_PART + row0 + rows, m_new, mask=row_ok)
            tl.store(L_PART + row0 + rows, l_new, mask=row_ok)
            # the next outer step re-reads these rows, maybe from other threads: order the accesses
            tl.debug_barrier()

    # ============ last pass: lse = m + ln l (-inf where no key was seen) ============
    for q_start in range(0, N_Q, BLOCK_M):
        rows = q_start + offs_m
        row_ok = rows < N_Q
        m_i = tl.load(M_PART + row0 + rows, mask=row_ok, other=float("-inf"))
        l_i = tl.load(L_PART + row0 + rows, mask=row_ok, other=0.0)
        seen = l_i != 0.0
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(M_PART + row0 + rows, lse, mask=row_ok)


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


_CONFIGS = {
    "small": [_cfg(64, 128, 4, 2), _cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2)],   # BLOCK_D <= 64
    "mid": [_cfg(64, 128, 8, 2), _cfg(64, 64, 4, 2), _cfg(128, 128, 8, 1)],     # BLOCK_D == 128
    "big": [_cfg(32, 64, 8, 1), _cfg(64, 64, 8, 1)],                            # BLOCK_D == 256 / fp32
}


def _prune(configs, nargs, **kw):
    if kw["BLOCK_D"] > 128 or nargs["Q"].dtype.itemsize == 4:
        return _CONFIGS["big"]
    return _CONFIGS["small" if kw["BLOCK_D"] <= 64 else "mid"]


# The kernel updates O/m/l in place: the autotuner restores them between trial runs.
flash_v1_fwd_tuned = triton.autotune(
    configs=[c for cs in _CONFIGS.values() for c in cs],
    key=["BLOCK_D", "IS_CAUSAL", "HAS_KV_LEN"],
    prune_configs_by={"early_config_prune": _prune},
    restore_value=["O_PART", "M_PART", "L_PART"], do_bench=tuning.bench,
)(flash_v1_fwd)
