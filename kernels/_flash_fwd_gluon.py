"""The Hopper prefill forward in Gluon: FA3's warp specialisation, written out by hand.

Only ``@gluon.jit`` code lives here; ``kernels/flash.py`` decides when it runs (``gluon_path``) and
launches it. One program owns a 128-row Q block of one (batch, head) and three roles run side by
side in it:

- a producer warp copies Q once, then K_j and V_j by TMA into two stages each, a stage only once
  both consumers have released it (``k_empty`` / ``v_empty``, one arrival per consumer);
- two consumer warpgroups, 64 rows each, run the online softmax of ``_flash_fwd_kernels.py``
  (base 2, scale folded in). Within a warpgroup the S_j = Q K_jᵀ of block j is issued before the
  P_{j-1} V_{j-1} of block j-1, so its softmax overlaps the tensor cores' second GEMM; the two
  warpgroups drift apart freely (no CTA-wide barrier in the loop), so one's softmax also
  overlaps the other's GEMMs.

What Triton's own ``warp_specialize`` of ``attn_fwd_tma`` could not express: that overlap inside a
warpgroup, and stages released per consumer (H200, fp16 1x32x4096x128: 546-565 TFLOP/s against
``attn_fwd_tma``'s 496; docs/benchmarks/kernels.md, eleventh session).
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

BLOCK_M = 128  # rows per program (the launcher's grid): attn_fwd_ws's two consumer warpgroups of 64


@gluon.jit
def _scores(s, qk_scale, start, kv_len, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """S = Q Kᵀ of the block of keys [start, start + BLOCK_N) in log2 units; keys >= kv_len (a
    ragged last block, or kv_lengths) -> -inf."""
    s = s * qk_scale
    if start + BLOCK_N > kv_len:
        cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(cols < kv_len, 0), s, float("-inf"))
    return s


@gluon.jit
def _consumer(wg, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, desc_o, lse_ptr,
              n_q, row0, kv_len, qk_scale):
    """One warpgroup: its 64 rows of the Q block against keys [0, kv_len)."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    n_blocks = gl.cdiv(kv_len, BLOCK_N)
    q = q_smem.index(wg)
    acc = gl.zeros([ROWS, D], dtype=gl.float32, layout=o_layout)
    m_i = gl.full([ROWS], float("-inf"), dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    if n_blocks > 0:
        mbarrier.wait(q_bar.index(wg), phase=0)
        # block 0: S_0 and its softmax; no P V before it
        mbarrier.wait(k_ready.index(0), phase=0)
        s = gl.zeros([ROWS, BLOCK_N], dtype=gl.float32, layout=s_layout)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = _scores(warpgroup_mma_wait(num_outstanding=0, deps=(s,)), qk_scale, 0, kv_len, BLOCK_N, s_layout)
        mbarrier.arrive(k_empty.index(0))
        m_i = gl.max(s, axis=1)
        p = gl.exp2(s - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, axis=1)
        for j in range(1, n_blocks):
            stage = j % 2
            prev = 1 - stage
            # S_j first, then P_{j-1} V_{j-1}: the softmax of S_j runs while the second is in flight
            mbarrier.wait(k_ready.index(stage), phase=(j // 2) & 1)
            s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), phase=((j - 1) // 2) & 1)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may run on
            s = _scores(s, qk_scale, j * BLOCK_N, kv_len, BLOCK_N, s_layout)
            mbarrier.arrive(k_empty.index(stage))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        last = (n_blocks - 1) % 2
        mbarrier.wait(v_ready.index(last), phase=((n_blocks - 1) // 2) & 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    # rows that saw no key (kv_len = 0) -> o = 0, lse = -inf, as the other kernels
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    q.store(o.to(dtype))  # this warpgroup is done with its Q rows: their smem takes O
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [row0 + wg * ROWS, 0], q)  # rows past N_Q are clipped
    rows = row0 + wg * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + rows, lse, mask=rows < n_q)
    tma.store_wait(pendings=0)


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              row0, kv_len):
    """One warp: both halves of the Q block, then K_i and V_i into stage i % 2, each once both
    consumers have released the block two before it."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    n_blocks = gl.cdiv(kv_len, BLOCK_N)
    if n_blocks > 0:
        for wg in gl.static_range(2):
            mbarrier.expect(q_bar.index(wg), desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [row0 + wg * ROWS, 0], q_bar.index(wg), q_smem.index(wg))
    for i in range(n_blocks):
        stage = i % 2
        reuse = i >= 2
        mbarrier.wait(k_empty.index(stage), phase=((i // 2) - 1) & 1, pred=reuse)
        mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [i * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase=((i // 2) - 1) & 1, pred=reuse)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [i * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def attn_fwd_ws(
    Q, K, V,                     # q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D): last dim contiguous, 16-byte rows
    O,                           # out: o (B, Hq, Nq, D), last dim contiguous
    LSE,                         # out: lse (B, Hq, Nq) fp32 natural log, contiguous
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H_Q, GROUP, N_Q, N_K,
    qk_scale,                    # scale · log2(e)
    D: gl.constexpr,             # head dim (128: a TMA box is a whole row)
    BLOCK_N: gl.constexpr,       # keys per block
    HAS_KV_LEN: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # registers per thread of a consumer warpgroup (the producer gets 24)
):
    """Non-causal prefill, grid (cdiv(Nq, 128), B·Hq), 4 warps (+ 4 + 1 in the partitions)."""
    ROWS: gl.constexpr = 64              # per consumer warpgroup: BLOCK_M / 2
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = (pid_bh // H_Q).to(gl.int64)
    h = (pid_bh % H_Q).to(gl.int64)
    kvh = h // GROUP
    # descriptors per (batch, head): a block past a head's last row reads zeros and stores nothing
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc_q = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N_Q, D],
                                        strides=[stride_qn, 1], block_shape=[ROWS, D], layout=row_layout)
    desc_o = tma.make_tensor_descriptor(O + b * stride_ob + h * stride_oh, shape=[N_Q, D],
                                        strides=[stride_on, 1], block_shape=[ROWS, D], layout=row_layout)
    desc_k = tma.make_tensor_descriptor(K + b * stride_kb + kvh * stride_kh, shape=[N_K, D],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, D], layout=row_layout)
    desc_v = tma.make_tensor_descriptor(V + b * stride_vb + kvh * stride_vh, shape=[N_K, D],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, D], layout=row_layout)
    if HAS_KV_LEN:
        kv_len = gl.load(KV_LEN + b)
    else:
        kv_len = N_K
    row0 = pid_m * 2 * ROWS
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], row_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    lse_ptr = LSE + pid_bh.to(gl.int64) * N_Q
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, desc_o, lse_ptr,
                     N_Q, row0, kv_len, qk_scale)),
        (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, desc_o, lse_ptr,
                     N_Q, row0, kv_len, qk_scale)),
        (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     row0, kv_len)),
    ], [4, 1], [CONSUMER_REGS, 24])
