"""The Hopper decode forward in Gluon: split-KV with K/V streamed by TMA.

Only ``@gluon.jit`` code lives here; ``kernels/hopper.py`` decides when it runs (``decode_path``),
builds the K/V descriptors, launches it and merges the splits (``attn_combine``). A program is one
split of the keys of one (batch, head pack): up to 64 query rows (the GQA group of a kv head ×
Nq, or Nq rows of one head), padded to a wgmma's 64.

One thread asks the TMA engine for whole K and V blocks, ``STAGES`` ahead, and a stage is refilled
as soon as its GEMM is done (K right after S = Q Kᵀ, before the softmax; V after P V). It is faster
on the device than the Triton split kernel (``attn_fwd`` with ``PACK``, same plan and merge); more
stages or wider blocks are not (see docs/benchmarks/kernels.md#decode).

The online softmax is ``jit/flash_fwd.py``'s (base 2, scale folded in); each split stores its
O normalised by its own l, in fp32, with its lse, or, unsplit, the final o in q's dtype. Split, the
merge is launched as a programmatic dependent: each program lets it be scheduled once its key loop
is done (``SIGNAL_MERGE``), and the merge waits for the whole grid (``hopper._DecodeRecipe``).
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

from .gluon_fwd import _box, _finite

ROWS = gl.constexpr(64)  # query rows per program: the M of one wgmma


@gluon.jit
def _load(desc, smem, bar, b, kvh, key, pred):
    """Block [key, key + BLOCK_N) of kv head kvh of batch b into smem; bar counts its bytes."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [b, kvh, key, 0], bar, _box(smem, desc), pred=pred)


@gluon.jit
def _softmax_start(BLOCK_N: gl.constexpr, D: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """The online softmax before its first key block: (acc (ROWS, D) zeros, m_i -inf, l_i zeros,
    s (ROWS, BLOCK_N), the scores' accumulator)."""
    acc = gl.zeros([ROWS, D], dtype=gl.float32, layout=o_layout)
    m_i = gl.full([ROWS], float("-inf"), dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    s = gl.zeros([ROWS, BLOCK_N], dtype=gl.float32, layout=s_layout)
    return acc, m_i, l_i, s


@gluon.jit
def _pv(p, v, acc, p_layout: gl.constexpr):
    """acc + P V_j, waited for: p (ROWS, BLOCK_N) float32, v (BLOCK_N, D) in shared memory."""
    p16 = gl.convert_layout(p.to(v.dtype), p_layout)
    acc = warpgroup_mma(p16, v, acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    return acc


@gluon.jit
def _softmax_block(s, m_i, l_i, acc, start, kv_len, first_diag, diag, s_layout: gl.constexpr,
                   o_layout: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """One key block of the online softmax: s (ROWS, BLOCK_N), the scaled scores of keys
    start..start + BLOCK_N, masked where a key is >= kv_len or, causal, past its row's diagonal
    (``diag``, (ROWS, 1); the smallest ``first_diag``); m_i, l_i and acc rescaled to the new row max.
    Returns (p, m_i, l_i, acc)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    last = start + BLOCK_N - 1
    if IS_CAUSAL:
        masked = (last >= kv_len) | (last > first_diag)
    else:
        masked = last >= kv_len
    if masked:  # keys >= kv_len (TMA reads zeros past N_K, pages hold anything), or past a row's diagonal
        cols = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        keep = cols < kv_len
        if IS_CAUSAL:
            keep = keep & (cols <= diag)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = _finite(m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p, m_new, l_i, acc


@gluon.jit
def attn_decode(
    Q,                           # q (B, Hq, Nq, D), any strides
    desc_k, desc_v,              # TMA descriptors over k, v (B, Hkv, Nk, D), boxes (1, 1, BLOCK_N, D)
    O,                           # out: per-split partials (S, B, Hq, Nq, D) fp32, or o (B, Hq, Nq, D)
    LSE,                         # out: per-split (S, B, Hq, Nq) fp32, or lse (B, Hq, Nq)
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_os, stride_ob, stride_oh, stride_on,   # stride_os 0: one split, o itself; O's last dim contiguous
    stride_ls, stride_lb, stride_lh, stride_ln,
    H_Q, GROUP, N_Q, N_K,
    qk_scale,                    # scale · log2(e)
    KEYS_PER_SPLIT,              # a multiple of BLOCK_N
    PACK: gl.constexpr,          # 1, or GROUP: a program's rows are the GROUP query heads of a kv head × Nq
    HAS_KV_LEN: gl.constexpr,
    IS_CAUSAL: gl.constexpr,     # bottom-right: query i sees keys <= i + N_K - N_Q
    STAGES: gl.constexpr,        # K/V blocks in flight per program
    SIGNAL_MERGE: gl.constexpr,  # let the merge, a programmatic dependent launch, be scheduled
):
    """Grid (splits, B·Hq/PACK), 4 warps. PACK·Nq <= 64 rows (``flash.plan`` packs only then)."""
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_k.block_type.shape[3]
    dtype: gl.constexpr = desc_k.block_type.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[4, 1], order=[1, 0])
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    pid_s = gl.program_id(0)
    pid_bh = gl.program_id(1)
    packs = H_Q // PACK
    b = pid_bh // packs
    hp = pid_bh % packs
    kvh = hp * PACK // GROUP
    if HAS_KV_LEN:
        kv_len = gl.load(KV_LEN + b)
    else:
        kv_len = N_K
    k0 = pid_s * KEYS_PER_SPLIT
    # causal: the last query row sees keys up to N_K - 1, so only kv_len bounds the split
    n_blocks = gl.cdiv(gl.maximum(gl.minimum(k0 + KEYS_PER_SPLIT, kv_len) - k0, 0), BLOCK_N)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    gl.thread_barrier()
    for i in gl.static_range(STAGES):  # the first blocks go out before Q is even read
        _load(desc_k, k_smem.index(i), k_ready.index(i), b, kvh, k0 + i * BLOCK_N, i < n_blocks)
        _load(desc_v, v_smem.index(i), v_ready.index(i), b, kvh, k0 + i * BLOCK_N, i < n_blocks)

    # Q: row r is query r % N_Q of head hp·PACK + r // N_Q; rows past PACK·N_Q are zeros
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    q_rows = b.to(gl.int64) * stride_qb + (hp * PACK + r // N_Q).to(gl.int64) * stride_qh \
        + (r % N_Q).to(gl.int64) * stride_qn
    q_ptrs = Q + gl.expand_dims(q_rows, 1) + gl.expand_dims(d.to(gl.int64) * stride_qd, 0)
    q_ok = gl.expand_dims(r < PACK * N_Q, 1) & gl.expand_dims(d < D, 0)
    # Q goes through shared memory, as attn_fwd_ws's does: read from registers, wgmma gives wrong
    # blocks after the first wherever BLOCK_N == D (Triton 3.6), where Q's register layout is P's
    q = gl.allocate_shared_memory(dtype, [ROWS, D], row_layout, gl.load(q_ptrs, mask=q_ok, other=0.0))
    fence_async_shared()

    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    diag = gl.expand_dims(rs % N_Q + N_K - N_Q, 1)  # causal: the last key each row sees
    acc, m_i, l_i, s = _softmax_start(BLOCK_N, D, s_layout, o_layout)
    for j in range(n_blocks):
        st = j % STAGES
        phase = (j // STAGES) & 1
        start = k0 + j * BLOCK_N
        refill = j + STAGES < n_blocks
        mbarrier.wait(k_ready.index(st), phase)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        gl.thread_barrier()  # every warp is done reading K_j: its stage takes K_{j+STAGES}
        _load(desc_k, k_smem.index(st), k_ready.index(st), b, kvh, start + STAGES * BLOCK_N, refill)
        p, m_i, l_i, acc = _softmax_block(s * qk_scale, m_i, l_i, acc, start, kv_len, N_K - N_Q, diag, s_layout,
                                          o_layout, IS_CAUSAL)
        mbarrier.wait(v_ready.index(st), phase)
        acc = _pv(p, v_smem.index(st), acc, p_layout)
        gl.thread_barrier()
        _load(desc_v, v_smem.index(st), v_ready.index(st), b, kvh, start + STAGES * BLOCK_N, refill)

    if SIGNAL_MERGE:
        # once every program is here the merge's programs may take SMs this grid no longer needs;
        # they wait (griddepcontrol.wait) for its end. Signalled at the kernel's start, they would
        # sit on SMs that splits still need (see docs/benchmarks/kernels.md#decode)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    # a row that saw no key (kv_len 0, an empty split, causal rows above the first key) -> 0, -inf
    seen = l_i != 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_rows = pid_s.to(gl.int64) * stride_os + b.to(gl.int64) * stride_ob \
        + (hp * PACK + ro // N_Q).to(gl.int64) * stride_oh + (ro % N_Q).to(gl.int64) * stride_on
    o_ok = gl.expand_dims(ro < PACK * N_Q, 1) & gl.expand_dims(do < D, 0)
    gl.store(O + gl.expand_dims(o_rows, 1) + gl.expand_dims(do, 0), o.to(O.dtype.element_ty), mask=o_ok)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    l_ptrs = LSE + pid_s.to(gl.int64) * stride_ls + b.to(gl.int64) * stride_lb \
        + (hp * PACK + rs // N_Q).to(gl.int64) * stride_lh + (rs % N_Q).to(gl.int64) * stride_ln
    gl.store(l_ptrs, lse, mask=rs < PACK * N_Q)
