"""The Hopper backward in Gluon: FA3's design, five block GEMMs a (query block, key block) pair.

Only ``@gluon.jit`` code lives here; ``kernels/hopper_bwd.py`` decides when it runs and launches
it. A program owns one block of ``BLOCK_N`` keys of one (batch, kv head) and walks the query blocks
of ``BLOCK_M`` rows that see them, for every query head of its GQA group, with three roles:

- a producer warp copies K_j and V_j once, then each step's Q_i and dO_i by TMA into two stages,
  a stage only once both consumers have released it;
- two consumer warpgroups, 64 keys each, recompute P from the saved LSE and accumulate dK_j and
  dV_j in registers, in base 2 with the scale folded in (``jit/flash_bwd.py`` has the equations):

      Sᵀ = K_j Q_iᵀ            Pᵀ = 2^(Sᵀ·scale·log2e - lse_i·log2e)
      dPᵀ = V_j dO_iᵀ          dV_j += Pᵀ dO_i
      dSᵀ = Pᵀ ∘ (dPᵀ - D_i)   dK_j += dSᵀ Q_i
      dQ_i += dS K_j           (both warpgroups' dSᵀ in shared memory; each takes half of D)

  Sᵀ rather than S puts the keys on the warpgroup's rows, so Pᵀ and dSᵀ are already the left
  operands of the dV and dK products, straight from registers;
- a writer warp per consumer takes its share of dQ_i from shared memory to a float32 dQ by one TMA
  reduce-add (``jit/gluon_ext.py``), so the consumer only stages it and goes on.

dQ_i gets a share from every key block. ``DETERMINISTIC`` orders the adds: a semaphore per (head,
query block, half of D) counts the shares added, and a writer adds its own only when the count
equals its rank in a fixed order (``_rank``) and releases the next only once its adds have landed,
so the sum is bit for bit the same on every run. The order is the one programs running side by
side reach the block in (non-causal: program j starts at query block j and wraps around; causal:
the later key blocks start nearer the diagonal), so programs in step seldom wait; and as the
writers wait, not the consumers, a wait costs the tensor cores nothing until the next share is
ready. Issuing a step's dQ GEMM ahead of the next step's Sᵀ and dPᵀ was slower at D 128: it keeps
dQ's accumulator live across the softmax, and the consumers spill (docs/benchmarks/kernels.md#backward).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_ext import bulk_wait_written, tma_reduce_add
from .gluon_fwd import _box

BLOCK_M = 64   # query rows a step
BLOCK_N = 128  # keys a program: two consumer warpgroups of 64


@gluon.jit
def _steps(j, N_Q, N_K, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """-> (first query block, query blocks) that key block j visits, per query head: every block
    (non-causal, from block j on, wrapping around), or the blocks from the first whose last row
    sees key j·BLOCK_N (bottom-right causal: row r sees keys <= r + N_K - N_Q)."""
    n_m = gl.cdiv(N_Q, BLOCK_M)
    if IS_CAUSAL:
        first = gl.maximum(j * BLOCK_N - (N_K - N_Q), 0) // BLOCK_M
        return first, gl.maximum(n_m - first, 0)
    else:
        return j % n_m, n_m


@gluon.jit
def _rank(j, i, n_j, N_Q, N_K, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """How many key blocks add to query block i's dQ before key block j does (``DETERMINISTIC``).

    Causal: the key blocks that see block i, from the last (jmax) down, as the later ones start
    nearer the diagonal. Non-causal: by the step (i - j) mod n_m at which j reaches i, then by j;
    the first term counts the blocks j' < n_j reaching i at the steps before (those with
    j' ≡ i - s mod n_m, for s < step), the last the ones at the same step."""
    if IS_CAUSAL:
        jmax = gl.minimum(n_j - 1, (i * BLOCK_M + BLOCK_M - 1 + N_K - N_Q) // BLOCK_N)
        return jmax - j
    else:
        n_m = gl.cdiv(N_Q, BLOCK_M)
        step = ((i - j) % n_m + n_m) % n_m
        per, extra = n_j // n_m, n_j % n_m  # residue c has per + (c < extra) key blocks
        lo = i - step + 1                     # the residues i - step + 1 ..= i, cyclically
        if lo >= 0:
            low = gl.maximum(gl.minimum(i, extra - 1) - lo + 1, 0)
        else:
            low = gl.minimum(i + 1, extra) + gl.maximum(extra - (n_m + lo), 0)
        return step * per + low + j // n_m


@gluon.jit
def _producer(desc_q, desc_k, desc_v, desc_do, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, q_empty,
              H_Q, H_KV, GROUP, N_Q, N_K, IS_CAUSAL: gl.constexpr):
    """One warp: K_j and V_j once, then Q_i and dO_i of each step into stage c % 2 (c counts the
    program's steps), once both consumers have released the step two before."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BN: gl.constexpr = k_smem.shape[0]
    j = gl.program_id(0)
    b = gl.program_id(1) // H_KV
    kvh = gl.program_id(1) % H_KV
    mbarrier.expect(kv_bar, 2 * desc_k.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [b, kvh, j * BN, 0], kv_bar, _box(k_smem, desc_k))
    tma.async_copy_global_to_shared(desc_v, [b, kvh, j * BN, 0], kv_bar, _box(v_smem, desc_v))
    first, n_steps = _steps(j, N_Q, N_K, IS_CAUSAL, ROWS, BN)
    n_m = gl.cdiv(N_Q, ROWS)
    c = 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        for t in range(n_steps):
            i = (first + t) % n_m
            stage = c % 2
            mbarrier.wait(q_empty.index(stage), phase=((c // 2) - 1) & 1, pred=c >= 2)
            mbarrier.expect(q_ready.index(stage), desc_q.block_type.nbytes + desc_do.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [b, h, i * ROWS, 0], q_ready.index(stage),
                                            _box(q_smem.index(stage), desc_q))
            tma.async_copy_global_to_shared(desc_do, [b, h, i * ROWS, 0], q_ready.index(stage),
                                            _box(do_smem.index(stage), desc_do))
            c += 1


@gluon.jit
def _stage_dq(dq, dq_s, dq_full, dq_empty, adds, scale):
    """This warpgroup's adds-th share of dQ (its half of D: dq, (ROWS, D / 2)) · scale into dq_s,
    for its writer warp, once the writer is done with the one before."""
    mbarrier.wait(dq_empty, phase=(adds - 1) & 1, pred=adds > 0)
    dq_s.store(dq * scale)
    fence_async_shared()
    gl.thread_barrier()  # every thread's share is in dq_s before the writer's copy reads it
    mbarrier.arrive(dq_full)


@gluon.jit
def _reduce_dq(dq_s, desc_dq, SEM, b, h, i, j, wg, n_j, n_m, H_Q, N_Q, N_K, IS_CAUSAL: gl.constexpr,
               DETERMINISTIC: gl.constexpr, BN: gl.constexpr):
    """dQ_i[:, this half of D] += dq_s by one TMA reduce-add (rows past N_Q are clipped); DETERMINISTIC:
    only once the semaphore says every key block before j in ``_rank``'s order has added its share,
    and landed in global memory before j's release."""
    ROWS: gl.constexpr = dq_s.shape[0]
    HALF: gl.constexpr = dq_s.shape[1]
    if DETERMINISTIC:
        sem = SEM + ((b * H_Q + h).to(gl.int64) * n_m + i) * 2 + wg
        rank = _rank(j, i, n_j, N_Q, N_K, IS_CAUSAL, ROWS, BN)
        while gl.atomic_add(sem, 0, sem="acquire", scope="gpu") != rank:
            pass
        tma_reduce_add(desc_dq, [b, h, i * ROWS, wg * HALF], _box(dq_s, desc_dq))
        bulk_wait_written(rank)
        gl.thread_barrier()
        gl.atomic_add(sem, 1, sem="release", scope="gpu")
    else:
        tma_reduce_add(desc_dq, [b, h, i * ROWS, wg * HALF], _box(dq_s, desc_dq))


@gluon.jit
def _dq_writer(wg, dq_smem, dq_full, dq_empty, desc_dq, SEM, H_Q, H_KV, GROUP, N_Q, N_K, IS_CAUSAL: gl.constexpr,
               DETERMINISTIC: gl.constexpr, BN: gl.constexpr):
    """One warp: consumer warpgroup wg's dQ shares, step by step, from dq_smem[wg] to the
    float32 dQ, so that the warpgroup neither waits its turn nor for the adds to land."""
    ROWS: gl.constexpr = dq_smem.shape[1]
    j = gl.program_id(0)
    b = gl.program_id(1) // H_KV
    kvh = gl.program_id(1) % H_KV
    n_j = gl.cdiv(N_K, BN)
    n_m = gl.cdiv(N_Q, ROWS)
    dq_s = dq_smem.index(wg)
    first, n_steps = _steps(j, N_Q, N_K, IS_CAUSAL, ROWS, BN)
    c = 0
    for g in range(GROUP):
        h = kvh * GROUP + g
        for t in range(n_steps):
            i = (first + t) % n_m
            mbarrier.wait(dq_full.index(wg), phase=c & 1)
            _reduce_dq(dq_s, desc_dq, SEM, b, h, i, j, wg, n_j, n_m, H_Q, N_Q, N_K, IS_CAUSAL, DETERMINISTIC, BN)
            tma.store_wait(pendings=0)  # dq_s is read
            mbarrier.arrive(dq_empty.index(wg))
            c += 1


@gluon.jit
def _consumer(wg, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready, q_empty, ds_ready,
              dq_full, dq_empty, LSE, DELTA, DK, DV, H_Q, H_KV, GROUP, N_Q, N_K, qk_scale, scale,
              IS_CAUSAL: gl.constexpr):
    """One warpgroup: keys [j·BLOCK_N + 64·wg, +64) against every step's query block; dK and dV
    of its keys stored at the end, its half of D of each step's dQ handed to its writer warp."""
    ROWS: gl.constexpr = q_smem.shape[1]     # query rows a step
    BN: gl.constexpr = k_smem.shape[0]
    KEYS: gl.constexpr = BN // 2             # this warpgroup's keys
    D: gl.constexpr = k_smem.shape[1]
    HALF: gl.constexpr = D // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    j = gl.program_id(0)
    b = gl.program_id(1) // H_KV
    kvh = gl.program_id(1) % H_KV
    n_m = gl.cdiv(N_Q, ROWS)
    off = N_K - N_Q
    key0 = j * BN + wg * KEYS
    k_w = k_smem.slice(wg * KEYS, KEYS, dim=0)
    v_w = v_smem.slice(wg * KEYS, KEYS, dim=0)
    k_half = k_smem.slice(wg * HALF, HALF, dim=1)
    dq_s = dq_smem.index(wg)
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([KEYS, D], dtype=gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, D], dtype=gl.float32, layout=kv_layout)
    s_zero = gl.zeros([KEYS, ROWS], dtype=gl.float32, layout=s_layout)
    dq_zero = gl.zeros([ROWS, HALF], dtype=gl.float32, layout=dq_layout)
    first, n_steps = _steps(j, N_Q, N_K, IS_CAUSAL, ROWS, BN)
    mbarrier.wait(kv_bar, phase=0)
    c = 0
    for g in range(GROUP):
        bh = b * H_Q + kvh * GROUP + g
        for t in range(n_steps):
            i = (first + t) % n_m
            stage = c % 2
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            rows = i * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
            lse = gl.load(LSE + bh.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=float("inf"))
            mbarrier.wait(q_ready.index(stage), phase=(c // 2) & 1)
            st = warpgroup_mma(k_w, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # a row that saw no key has lse -inf and o = 0: +inf makes its P 0
            lse = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
            # keys past N_K (a ragged last block; TMA read zeros there) and, causal, past a row's diagonal
            masked = key0 + KEYS > N_K
            if IS_CAUSAL:
                masked = masked | (key0 + KEYS - 1 > i * ROWS + off)
            if masked:
                keep = gl.expand_dims(keys < N_K, 1)
                if IS_CAUSAL:
                    keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + off)
                pt = gl.where(keep, pt, 0.0)
            pt16 = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt16, do_s, dv, is_async=True)
            # D_i only now, while dPᵀ runs: loaded with lse it would hold 16 more registers across
            # the softmax, where a consumer at D 128 has none to spare
            delta = gl.load(DELTA + bh.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
            ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            ds_buf = ds_smem.index(stage)
            ds_buf.slice(wg * KEYS, KEYS, dim=0).store(ds16)
            ds16 = gl.convert_layout(ds16, a_layout)
            dk = warpgroup_mma(ds16, q_s, dk, is_async=True)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(stage))  # both warpgroups' dSᵀ are in: dQ may read them
            mbarrier.wait(ds_ready.index(stage), phase=(c // 2) & 1)
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
            dq, dv, dk, pt16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dv, dk, pt16, ds16))
            mbarrier.arrive(q_empty.index(stage))  # Q_i, dO_i and this dSᵀ stage are free
            _stage_dq(dq, dq_s, dq_full.index(wg), dq_empty.index(wg), c, scale)
            c += 1
    # dK_j, dV_j of this warpgroup's keys (dK · scale: S = scale · Q Kᵀ)
    out_rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    out = (gl.program_id(1).to(gl.int64) * N_K + gl.expand_dims(out_rows, 1)) * D + gl.expand_dims(out_cols, 0)
    keep = gl.expand_dims(out_rows < N_K, 1) & gl.expand_dims(out_cols < D, 0)
    gl.store(DK + out, (dk * scale).to(dtype), mask=keep)
    gl.store(DV + out, dv.to(dtype), mask=keep)


@gluon.jit
def attn_bwd_ws(
    desc_q, desc_do,             # TMA descriptors over q, do (B, Hq, Nq, D), boxes (1, 1, BLOCK_M, D)
    desc_k, desc_v,              # k, v (B, Hkv, Nk, D), boxes (1, 1, BLOCK_N, D)
    LSE, DELTA,                  # fp32 (B, Hq, Nq) contiguous: forward lse (natural log), D_i = rowsum(dO ∘ O)
    desc_dq,                     # out: over fp32 (B, Hq, Nq, D), zeroed: dQ; boxes (1, 1, BLOCK_M, D / 2)
    SEM,                         # int32 (B, Hq, cdiv(Nq, BLOCK_M), 2), zeroed; unused unless DETERMINISTIC
    DK, DV,                      # out: (B, Hkv, Nk, D) contiguous, k's dtype
    H_Q, H_KV, GROUP, N_Q, N_K,
    qk_scale, scale,             # scale · log2(e); scale
    IS_CAUSAL: gl.constexpr,     # bottom-right: query i sees keys <= i + N_K - N_Q
    DETERMINISTIC: gl.constexpr,  # dQ's adds in a fixed order (module docstring)
    CONSUMER_REGS: gl.constexpr,  # registers per thread of a consumer warpgroup (the other warps get 24)
):
    """Grid (cdiv(Nk, BLOCK_N), B·Hkv): program (j, b·Hkv + kvh) owns keys [j·BLOCK_N, +BLOCK_N) of
    kv head kvh and sums over its GQA group's query heads. 4 warps (+ 4 + 1 + 1 + 1 in the partitions)."""
    ROWS: gl.constexpr = desc_q.block_type.shape[2]
    BN: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.block_type.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(dtype, [BN, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BN, D], row_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BN, ROWS], row_layout)
    f32_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS, D // 2], f32_layout)  # each warpgroup's dQ share
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(2):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)   # one arrival per consumer warpgroup
        mbarrier.init(ds_ready.index(s), count=2)
        mbarrier.init(dq_full.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (0, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready, q_empty, ds_ready,
                     dq_full, dq_empty, LSE, DELTA, DK, DV, H_Q, H_KV, GROUP, N_Q, N_K, qk_scale, scale, IS_CAUSAL)),
        (_consumer, (1, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready, q_empty, ds_ready,
                     dq_full, dq_empty, LSE, DELTA, DK, DV, H_Q, H_KV, GROUP, N_Q, N_K, qk_scale, scale, IS_CAUSAL)),
        (_producer, (desc_q, desc_k, desc_v, desc_do, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, q_empty,
                     H_Q, H_KV, GROUP, N_Q, N_K, IS_CAUSAL)),
        (_dq_writer, (0, dq_smem, dq_full, dq_empty, desc_dq, SEM, H_Q, H_KV, GROUP, N_Q, N_K, IS_CAUSAL,
                      DETERMINISTIC, BN)),
        (_dq_writer, (1, dq_smem, dq_full, dq_empty, desc_dq, SEM, H_Q, H_KV, GROUP, N_Q, N_K, IS_CAUSAL,
                      DETERMINISTIC, BN)),
    ], [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])
