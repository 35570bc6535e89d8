"""The Hopper ragged prefill in Gluon: ``ragged_fwd``'s prefill and chunk classes run by
``attn_fwd_ws``'s warp-specialised tile, keys contiguous per sequence (varlen) or in pages.

Only ``@gluon.jit`` code lives here; ``kernels/ragged.py`` plans the work items, decides when it
runs (``ragged.gluon_prefill_refusal``), builds the descriptors and launches it and the merge.

A program is one work item, (sequence, row tile, key split), for one query head: 128 query rows,
two consumer warpgroups of 64 and a producer warp, as in ``jit/gluon_fwd.py`` (``_attend`` is its
loop), but one tile a program, as the plan lists them. The producer copies the tile's Q and then
its key blocks by TMA:

- q (Tq, Hq, D) is seen as (1, Hq, Tq, D): the tile's rows start at (0, head, q start + row, 0);
  rows past the sequence are another sequence's (their answers are not stored) or zeros past Tq;
- varlen k, v (Tk, Hkv, D) as (1, Hkv, Tk, D), block j at (0, kv head, k start + key, 0);
- pages (P, page_tokens, Hkv, D) as (P, Hkv, page_tokens, D), block j at (page, kv head, row in
  page, 0), the page read from the block table, where page_tokens is a multiple of BLOCK_N;
  smaller pages (16 to 64, contiguous, D the box's) as (P · page_tokens, Hkv · D), a box per page
  copied into its rows of the block, so that pages of 64 still stream 128-key blocks at D 128.

Keys past the item's end (another sequence's, the next split's, page slots never written) are
masked out of S and, in the one block that has them, zeroed in V before P V. O and lse leave by
plain stores, clipped to the sequence's rows (a TMA store would write over the next sequence's):
an unsplit item writes o in q's dtype and lse, a split its normalised float32 o and lse to the
partial buffers, which ``ragged_merge`` combines, as ``ragged_fwd``'s.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .gluon_fwd import _attend, _box, _slope


@gluon.jit
def _plan_item(WORK, SEQ, w):
    """Work item w of the plan (``ragged.Plan``) ->
    (sequence, row tile, first key, key end, partial row or -1, q start, n_q, k start, n_k)."""
    w = w.to(gl.int64)
    seq = gl.load(WORK + w * 5 + 0)
    tile = gl.load(WORK + w * 5 + 1)
    k0 = gl.load(WORK + w * 5 + 2)
    k1 = gl.load(WORK + w * 5 + 3)
    part = gl.load(WORK + w * 5 + 4)
    q0 = gl.load(SEQ + seq * 4 + 0)
    n_q = gl.load(SEQ + seq * 4 + 1)
    k_start = gl.load(SEQ + seq * 4 + 2)
    n_k = gl.load(SEQ + seq * 4 + 3)
    return seq, tile, k0, k1, part, q0, n_q, k_start, n_k


@gluon.jit
def _head_item(H_Q):
    """This program's (query head, work item): one grid axis, heads fastest, so every head of the
    plan's longest items starts first (tail balance) and heads sharing a kv head run side by side."""
    pid = gl.program_id(0)
    return pid % H_Q, pid // H_Q


@gluon.jit
def _item(WORK, SEQ, H_Q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, win_left, win_right,
          IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """This program's work item -> (sequence, q start, n_q, k start, n_k, first row, key end, partial
    row or -1, first key, key blocks): its blocks start at the split's first key (or, windowed, the
    block of its first row's window) and stop at the split's end, or causal, at the tile's last
    row's diagonal (windowed, also its window's right edge)."""
    seq, tile, k0, k1, part, q0, n_q, k_start, n_k = _plan_item(WORK, SEQ, _head_item(H_Q)[1])
    row0 = tile * BLOCK_M
    last_row = gl.minimum(row0 + BLOCK_M, n_q) - 1 + n_k - n_q
    hi = k1
    if IS_CAUSAL:
        hi = gl.minimum(hi, last_row + 1)
    first = k0
    if WINDOW:
        hi = gl.minimum(hi, last_row + win_right + 1)
        first = gl.maximum(first, gl.maximum(row0 + n_k - n_q - win_left, 0) // BLOCK_N * BLOCK_N)
    n_blocks = gl.cdiv(gl.maximum(hi - first, 0), BLOCK_N)
    return seq, q0, n_q, k_start, n_k, row0, k1, part, first, n_blocks


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, WORK, SEQ,
              BT, stride_btr, stride_btc, H_Q, GROUP, win_left, win_right, PAGED: gl.constexpr, PAGE: gl.constexpr,
              IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """One warp: both halves of the tile's Q, then K_i and V_i into stage i % 2, each once both
    consumers have released the block two before it."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    h = _head_item(H_Q)[0]
    kvh = h // GROUP
    seq, q0, n_q, k_start, n_k, row0, k1, part, first, n_blocks = _item(WORK, SEQ, H_Q, 2 * ROWS, BLOCK_N, win_left,
                                                                        win_right, IS_CAUSAL, WINDOW)
    if n_blocks > 0:
        for wg in gl.static_range(2):
            mbarrier.expect(q_bar.index(wg), desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [0, h, q0 + row0 + wg * ROWS, 0], q_bar.index(wg),
                                            _box(q_smem.index(wg), desc_q))
    bt_row = BT + seq.to(gl.int64) * stride_btr
    for i in range(n_blocks):
        stage = i % 2
        reuse = i >= 2
        key = first + i * BLOCK_N
        mbarrier.wait(k_empty.index(stage), phase=((i // 2) - 1) & 1, pred=reuse)
        _load_block(desc_k, k_smem.index(stage), k_ready.index(stage), bt_row, stride_btc, k_start, key, k1, kvh,
                    PAGED, PAGE)
        mbarrier.wait(v_empty.index(stage), phase=((i // 2) - 1) & 1, pred=reuse)
        _load_block(desc_v, v_smem.index(stage), v_ready.index(stage), bt_row, stride_btc, k_start, key, k1, kvh,
                    PAGED, PAGE)


@gluon.jit
def _load_block(desc, smem, bar, bt_row, stride_btc, k_start, key, end, kvh, PAGED: gl.constexpr,
                PAGE: gl.constexpr):
    """Key block [key, key + BLOCK_N) of kv head kvh into smem, bar counting its bytes: one box of
    the (1, Hkv, Tk, D) or (P, Hkv, PAGE, D) view, or, pages smaller than the block, one box
    (PAGE, D) of the (P·PAGE, Hkv·D) view per page, each into its rows of the block (the table's
    entries at or past ``end`` are not read: they may lie past the row's end)."""
    BLOCK_N: gl.constexpr = smem.shape[0]
    if PAGED and PAGE < BLOCK_N:
        D: gl.constexpr = desc.block_type.shape[1]
        mbarrier.expect(bar, desc.block_type.nbytes * (BLOCK_N // PAGE))
        for j in gl.static_range(BLOCK_N // PAGE):
            page = gl.load(bt_row + (key // PAGE + j) * stride_btc, mask=key + j * PAGE < end, other=0)
            tma.async_copy_global_to_shared(desc, [page * PAGE, kvh * D], bar, smem.slice(j * PAGE, PAGE))
    else:
        if PAGED:
            page = gl.load(bt_row + (key // PAGE) * stride_btc)
            row = key % PAGE
        else:
            page = 0
            row = k_start + key
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [page, kvh, row, 0], bar, _box(smem, desc))


@gluon.jit
def _consumer(wg, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, O_PART, LSE_PART,
              WORK, SEQ, stride_ot, stride_oh, stride_lh, stride_lt, H_Q, D_HEAD, qk_scale, win_left, win_right,
              cap, SLOPES, stride_as, stride_ah, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """One warpgroup: its 64 rows of the tile, then their o and lse (rows of the sequence only)."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    h = _head_item(H_Q)[0].to(gl.int64)
    seq, q0, n_q, k_start, n_k, row0, k1, part, first, n_blocks = _item(WORK, SEQ, H_Q, 2 * ROWS, BLOCK_N, win_left,
                                                                        win_right, IS_CAUSAL, WINDOW)
    r0 = row0 + wg * ROWS
    if n_blocks > 0:
        mbarrier.wait(q_bar.index(wg), phase=0)
    slope = _slope(SLOPES, seq, h, stride_as, stride_ah, ALIBI)
    acc, _, m_i, l_i = _attend(q_smem.index(wg), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                               q_bar.index(wg), 0, n_blocks, first, k1, r0 + n_k - n_q, qk_scale, win_left,
                               win_right, cap, slope, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI, False, True)
    # rows that saw no key (n_k 0, causal rows above the split's first key) -> o = 0, lse = -inf
    seen = l_i != 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    i_o = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_ok = gl.expand_dims(i_o < n_q, 1) & gl.expand_dims(d_o < D_HEAD, 0)
    i_l = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    if part < 0:
        rows = (q0 + i_o).to(gl.int64) * stride_ot + h * stride_oh
        gl.store(O + gl.expand_dims(rows, 1) + gl.expand_dims(d_o, 0), o.to(O.dtype.element_ty), mask=o_ok)
        gl.store(LSE + h * stride_lh + (q0 + i_l).to(gl.int64) * stride_lt, lse, mask=i_l < n_q)
    else:
        rows = ((part + i_o).to(gl.int64) * H_Q + h) * D_HEAD
        gl.store(O_PART + gl.expand_dims(rows, 1) + gl.expand_dims(d_o, 0), o, mask=o_ok)
        gl.store(LSE_PART + (part + i_l).to(gl.int64) * H_Q + h, lse, mask=i_l < n_q)


@gluon.jit
def ragged_prefill(
    desc_q,                      # TMA descriptors over q seen as (1, Hq, Tq, D), boxes (1, 1, 64, box D),
    desc_k, desc_v,              # k, v as (1, Hkv, Tk, D) or pages as (P, Hkv, PAGE, D), boxes (1, 1, BLOCK_N, box D);
                                 # pages smaller than BLOCK_N as (P·PAGE, Hkv·D), boxes (PAGE, D)
    O,                           # out: o (Tq, Hq, D_HEAD), last dim contiguous
    LSE,                         # out: lse (Hq, Tq) fp32, any strides
    O_PART,                      # out: split partials (R, Hq, D_HEAD) fp32 contiguous
    LSE_PART,                    # out: split partials (R, Hq) fp32 contiguous
    WORK,                        # int32 (n_work, 5): (sequence, row tile, key start, key end, partial row or -1)
    SEQ,                         # int32 (S, 4): (q start, n_q, k start, n_k)
    BT,                          # int32 block table (S, max_pages); unused unless PAGED
    stride_btr, stride_btc,
    stride_ot, stride_oh,
    stride_lh, stride_lt,
    H_Q, GROUP,
    D_HEAD,                      # the head dim (the box's D pads it with zeros)
    qk_scale,                    # scale · log2(e)
    win_left, win_right,         # window sides in keys; unused unless WINDOW
    cap,                         # softcap · log2(e); unused unless SOFTCAP
    SLOPES,                      # fp32 ALiBi slopes (S, Hq) (stride_as 0: one set for all); unused unless ALIBI
    stride_as, stride_ah,
    PAGED: gl.constexpr,
    PAGE: gl.constexpr,          # page_tokens (PAGED): a multiple of BLOCK_N, or a divisor
    BLOCK_N: gl.constexpr,       # keys a block
    IS_CAUSAL: gl.constexpr,     # bottom-right within each sequence: query i sees keys <= i + n_k - n_q
    CONSUMER_REGS: gl.constexpr,  # registers per thread of a consumer warpgroup (the producer gets 24)
    WINDOW: gl.constexpr = False,
    SOFTCAP: gl.constexpr = False,
    ALIBI: gl.constexpr = False,  # scores biased by -slope · |i + n_k - n_q - j|
):
    """Grid (work items · Hq,), 4 warps (+ 4 + 1 in the partitions); the plan's row tiles are 128 rows."""
    ROWS: gl.constexpr = desc_q.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.block_type.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
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
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, O_PART, LSE_PART,
                     WORK, SEQ, stride_ot, stride_oh, stride_lh, stride_lt, H_Q, D_HEAD, qk_scale, win_left,
                     win_right, cap, SLOPES, stride_as, stride_ah, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)),
        (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, O_PART, LSE_PART,
                     WORK, SEQ, stride_ot, stride_oh, stride_lh, stride_lt, H_Q, D_HEAD, qk_scale, win_left,
                     win_right, cap, SLOPES, stride_as, stride_ah, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)),
        (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     WORK, SEQ, BT, stride_btr, stride_btc, H_Q, GROUP, win_left, win_right, PAGED, PAGE, IS_CAUSAL,
                     WINDOW)),
    ], [4, 1], [CONSUMER_REGS, 24])


__all__ = ["ragged_prefill"]
