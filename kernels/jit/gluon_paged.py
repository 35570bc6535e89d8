"""The Hopper paged decode in Gluon: ``ragged_fwd``'s decode class with K/V pages streamed by TMA.

Only ``@gluon.jit`` code lives here; ``kernels/ragged.py`` plans the work items, decides when it
runs (``ragged.gluon_decode_refusal``), builds the descriptors and launches it and the merge.

A program is one work item of the decode class, (sequence, row tile, key split), for one kv head:
its rows are a tile of the GQA group × n_q query rows, padded to a wgmma's 64. The pages
[P, page_tokens, Hkv, D] are seen as [P, Hkv, page_tokens, D] (a view), so a key block is one TMA
box (1, 1, BLOCK_N, D) at (page, kv head, row in page, 0) where page_tokens is a multiple of
BLOCK_N. Pages smaller than a block (16, 32) are seen as [P · page_tokens, Hkv · D], and a block
is BLOCK_N / page_tokens boxes (page_tokens, D), each copied into its rows of the block's shared
memory. The pipeline is ``jit/gluon_decode.py``'s: one thread asks for K and V blocks ``STAGES``
ahead and refills a stage as soon as its GEMM is done; the page (or pages) of a block is read from
the block table one iteration before its load is issued, so the table's latency hides behind a block's work.

The plan is ``ragged_fwd``'s (same items, same split boundaries), and so are the outputs: an
unsplit item writes o in q's dtype and lse; a split writes its normalised float32 o and its lse
to the partial buffers, which ``ragged_merge`` combines. Slots of a page past the sequence's
length hold anything (pages are reused; never written slots may even be NaN): their scores are
masked and, in the one block that has them, V's rows are zeroed in shared memory before P V.
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

from .gluon_decode import ROWS, _load, _pv, _softmax_block, _softmax_start
from .gluon_ragged import _plan_item

WS_LOADER_REGS = gl.constexpr(24)  # paged_decode_ws's loader warp: page ids, their addresses, the copies


@gluon.jit
def _page(bt_row, stride_btc, key, end, PAGE: gl.constexpr, SUB: gl.constexpr, pred):
    """The pages of the block from key ``key``, as a tuple of four (0 where ``pred`` is false: that
    block is never loaded): its one page, or (SUB > 1, pages smaller than a block) the SUB pages of
    keys key, key + PAGE, ..., 0 for those at or past ``end`` (their table entries may be past the
    row's end). Scalars, loaded alike by every thread: picking an id out of a tensor is a reduction,
    and a reduction's barrier before each of a block's copies costs the short programs 10-15%."""
    first = bt_row + (key // PAGE) * stride_btc
    p0 = gl.load(first, mask=pred, other=0)
    p1 = gl.load(first + stride_btc, mask=pred & (SUB > 1) & (key + PAGE < end), other=0)
    p2 = gl.load(first + 2 * stride_btc, mask=pred & (SUB > 2) & (key + 2 * PAGE < end), other=0)
    p3 = gl.load(first + 3 * stride_btc, mask=pred & (SUB > 3) & (key + 3 * PAGE < end), other=0)
    return p0, p1, p2, p3


@gluon.jit
def _load_block(desc, smem, bar, page, kvh, key, PAGE: gl.constexpr, SUB: gl.constexpr, pred):
    """Key block [key, key + BLOCK_N) of kv head kvh into smem (``_page``'s page or pages): one box
    of the (P, Hkv, PAGE, D) view, or SUB boxes (PAGE, D) of the (P·PAGE, Hkv·D) view, each into its
    rows of the block; bar counts their bytes."""
    if SUB == 1:
        _load(desc, smem, bar, page[0], kvh, key % PAGE, pred)
    else:
        gl.static_assert(SUB <= 4, "a block spans at most four pages (_page's tuple)")
        D: gl.constexpr = desc.block_type.shape[1]
        mbarrier.expect(bar, desc.block_type.nbytes * SUB, pred=pred)
        for i in gl.static_range(SUB):
            tma.async_copy_global_to_shared(desc, [page[i] * PAGE, kvh * D], bar, smem.slice(i * PAGE, PAGE),
                                            pred=pred)


@gluon.jit
def _q_tile(Q, q0, n_q, tile, kvh, GROUP, stride_qt, stride_qh, stride_qd, ROW_TILE: gl.constexpr, D: gl.constexpr,
            layout: gl.constexpr):
    """(ROWS, D) in ``layout``: tile row r is row tile·ROW_TILE + r of the group × n_q rows, query
    (that % n_q) of head kvh·GROUP + that // n_q; rows past the tile or the group are zeros."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    rr = tile * ROW_TILE + r
    q_rows = (q0 + rr % n_q).to(gl.int64) * stride_qt + (kvh * GROUP + rr // n_q).to(gl.int64) * stride_qh
    q_ptrs = Q + gl.expand_dims(q_rows, 1) + gl.expand_dims(d.to(gl.int64) * stride_qd, 0)
    q_ok = gl.expand_dims((r < ROW_TILE) & (rr < GROUP * n_q), 1) & gl.expand_dims(d < D, 0)
    return gl.load(q_ptrs, mask=q_ok, other=0.0)


@gluon.jit
def _zero_rows_past(smem, start, n_k, layout: gl.constexpr):
    """Rows of the (BLOCK_N, D) block ``smem`` from key n_k on (the block starts at key ``start``)
    set to zeros, visible to the next wgmma."""
    rows = start + gl.arange(0, smem.shape[0], layout=gl.SliceLayout(1, layout))
    blk = smem.load(layout)
    smem.store(gl.where(gl.expand_dims(rows < n_k, 1), blk, gl.zeros_like(blk)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _store_out(acc, m_i, l_i, O, LSE, O_PART, LSE_PART, q0, n_q, tile, kvh, part, GROUP, H_Q, stride_ot, stride_oh,
               stride_od, stride_lh, stride_lt, ROW_TILE: gl.constexpr):
    """The tile's o = acc / l and lse (natural log) into o and lse, or, for a split (part >= 0),
    into the partial rows from ``part``; a row that saw no key (n_k 0, causal rows above the
    split's first key) gets 0 and -inf."""
    o_layout: gl.constexpr = acc.type.layout
    D: gl.constexpr = acc.shape[1]
    seen = l_i != 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    ro = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    rr_o = tile * ROW_TILE + ro
    head_o = (kvh * GROUP + rr_o // n_q).to(gl.int64)
    i_o = rr_o % n_q
    o_ok = gl.expand_dims((ro < ROW_TILE) & (rr_o < GROUP * n_q), 1) & gl.expand_dims(do < D, 0)
    rs = gl.arange(0, ROWS, layout=m_i.type.layout)
    rr_l = tile * ROW_TILE + rs
    head_l = (kvh * GROUP + rr_l // n_q).to(gl.int64)
    i_l = rr_l % n_q
    l_ok = (rs < ROW_TILE) & (rr_l < GROUP * n_q)
    if part < 0:
        tok_o = (q0 + i_o).to(gl.int64)
        o_ptrs = O + gl.expand_dims(tok_o * stride_ot + head_o * stride_oh, 1) + gl.expand_dims(do * stride_od, 0)
        gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_ok)
        gl.store(LSE + head_l * stride_lh + (q0 + i_l).to(gl.int64) * stride_lt, lse, mask=l_ok)
    else:
        prow_o = (part + i_o).to(gl.int64) * H_Q + head_o
        gl.store(O_PART + gl.expand_dims(prow_o * D, 1) + gl.expand_dims(do, 0), o, mask=o_ok)
        gl.store(LSE_PART + (part + i_l).to(gl.int64) * H_Q + head_l, lse, mask=l_ok)


@gluon.jit
def paged_decode(
    Q,                           # q (Tq, Hq, D), any strides
    desc_k, desc_v,              # TMA descriptors over the pages seen as (P, Hkv, PAGE, D), boxes (1, 1, BLOCK_N, D);
                                 # pages smaller than BLOCK_N: as (P·PAGE, Hkv·D), boxes (PAGE, D)
    O,                           # out: o (Tq, Hq, D), any strides
    LSE,                         # out: lse (Hq, Tq) fp32, any strides
    O_PART,                      # out: split partials (R, Hq, D) fp32 contiguous
    LSE_PART,                    # out: split partials (R, Hq) fp32 contiguous
    WORK,                        # int32 (n_work, 5): (sequence, row tile, key start, key end, partial row or -1)
    SEQ,                         # int32 (S, 4): (q start, n_q, k start, n_k)
    BT,                          # int32 block table (S, max_pages)
    stride_btr, stride_btc,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    H_Q, GROUP,
    qk_scale,                    # scale · log2(e)
    PAGE: gl.constexpr,          # page_tokens: a multiple of BLOCK_N, or a divisor
    ROW_TILE: gl.constexpr,      # the plan's rows a tile (the decode class's BLOCK_M), <= 64
    IS_CAUSAL: gl.constexpr,     # bottom-right: query i sees keys <= i + n_k - n_q
    STAGES: gl.constexpr,        # K/V blocks in flight per program
    BLOCK_N: gl.constexpr,       # keys a block
):
    """Grid (work items, Hkv), 4 warps."""
    SUB: gl.constexpr = BLOCK_N // PAGE if PAGE < BLOCK_N else 1  # pages a block
    D: gl.constexpr = desc_k.block_type.shape[-1]
    dtype: gl.constexpr = desc_k.block_type.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[4, 1], order=[1, 0])
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    kvh = gl.program_id(1)
    seq, tile, k0, k1, part, q0, n_q, _, n_k = _plan_item(WORK, SEQ, gl.program_id(0))
    bt_row = BT + seq.to(gl.int64) * stride_btr
    n_blocks = gl.cdiv(gl.maximum(k1 - k0, 0), BLOCK_N)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    gl.thread_barrier()
    for i in gl.static_range(STAGES):  # the first blocks go out before Q is even read
        key = k0 + i * BLOCK_N
        page = _page(bt_row, stride_btc, key, k1, PAGE, SUB, i < n_blocks)
        _load_block(desc_k, k_smem.index(i), k_ready.index(i), page, kvh, key, PAGE, SUB, i < n_blocks)
        _load_block(desc_v, v_smem.index(i), v_ready.index(i), page, kvh, key, PAGE, SUB, i < n_blocks)
    nxt = _page(bt_row, stride_btc, k0 + STAGES * BLOCK_N, k1, PAGE, SUB, STAGES < n_blocks)

    # through shared memory, as attn_decode's Q (wgmma from registers is wrong where BLOCK_N == D)
    q = gl.allocate_shared_memory(dtype, [ROWS, D], row_layout,
                                  _q_tile(Q, q0, n_q, tile, kvh, GROUP, stride_qt, stride_qh, stride_qd, ROW_TILE, D,
                                          ld_layout))
    fence_async_shared()

    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    diag = gl.expand_dims((tile * ROW_TILE + rs) % n_q + n_k - n_q, 1)  # causal: the last key each row sees
    acc, m_i, l_i, s = _softmax_start(BLOCK_N, D, s_layout, o_layout)
    for j in range(n_blocks):
        st = j % STAGES
        phase = (j // STAGES) & 1
        start = k0 + j * BLOCK_N
        refill = j + STAGES < n_blocks
        key = start + STAGES * BLOCK_N
        page = nxt
        nxt = _page(bt_row, stride_btc, key + BLOCK_N, k1, PAGE, SUB, j + STAGES + 1 < n_blocks)
        mbarrier.wait(k_ready.index(st), phase)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        gl.thread_barrier()  # every warp is done reading K_j: its stage takes K_{j+STAGES}
        _load_block(desc_k, k_smem.index(st), k_ready.index(st), page, kvh, key, PAGE, SUB, refill)
        p, m_i, l_i, acc = _softmax_block(s * qk_scale, m_i, l_i, acc, start, n_k, n_k - n_q, diag, s_layout,
                                          o_layout, IS_CAUSAL)
        mbarrier.wait(v_ready.index(st), phase)
        if start + BLOCK_N > n_k:  # 0 · NaN is NaN: the slots past n_k must hold zeros, not whatever they hold
            _zero_rows_past(v_smem.index(st), start, n_k, ld_layout)
        acc = _pv(p, v_smem.index(st), acc, p_layout)
        gl.thread_barrier()
        _load_block(desc_v, v_smem.index(st), v_ready.index(st), page, kvh, key, PAGE, SUB, refill)

    _store_out(acc, m_i, l_i, O, LSE, O_PART, LSE_PART, q0, n_q, tile, kvh, part, GROUP, H_Q, stride_ot, stride_oh,
               stride_od, stride_lh, stride_lt, ROW_TILE)


@gluon.jit
def _ws_loader(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, WORK, SEQ, BT, stride_btr,
               stride_btc, PAGE: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: K_j and V_j of the program's key range into stage j % STAGES once the consumer has
    released the block STAGES before it; block j + 1's pages are read while block j's copies go out."""
    SUB: gl.constexpr = BLOCK_N // PAGE if PAGE < BLOCK_N else 1
    kvh = gl.program_id(1)
    seq, tile, k0, k1, part, q0, n_q, _, n_k = _plan_item(WORK, SEQ, gl.program_id(0))
    bt_row = BT + seq.to(gl.int64) * stride_btr
    n_blocks = gl.cdiv(gl.maximum(k1 - k0, 0), BLOCK_N)
    nxt = _page(bt_row, stride_btc, k0, k1, PAGE, SUB, n_blocks > 0)
    for j in range(n_blocks):
        st = j % STAGES
        reuse = j >= STAGES
        phase = ((j // STAGES) - 1) & 1
        key = k0 + j * BLOCK_N
        page = nxt
        nxt = _page(bt_row, stride_btc, key + BLOCK_N, k1, PAGE, SUB, j + 1 < n_blocks)
        mbarrier.wait(k_empty.index(st), phase, pred=reuse)
        _load_block(desc_k, k_smem.index(st), k_ready.index(st), page, kvh, key, PAGE, SUB, True)
        mbarrier.wait(v_empty.index(st), phase, pred=reuse)
        _load_block(desc_v, v_smem.index(st), v_ready.index(st), page, kvh, key, PAGE, SUB, True)


@gluon.jit
def _ws_consumer(Q, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, O, LSE, O_PART, LSE_PART, WORK, SEQ,
                 stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_lh, stride_lt, H_Q, GROUP,
                 qk_scale, ROW_TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: the tile's rows against every block the loader brings, then o and lse."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[4, 1], order=[1, 0])
    kvh = gl.program_id(1)
    seq, tile, k0, k1, part, q0, n_q, _, n_k = _plan_item(WORK, SEQ, gl.program_id(0))
    n_blocks = gl.cdiv(gl.maximum(k1 - k0, 0), BLOCK_N)

    q_smem.store(_q_tile(Q, q0, n_q, tile, kvh, GROUP, stride_qt, stride_qh, stride_qd, ROW_TILE, D, ld_layout))
    fence_async_shared()
    gl.thread_barrier()

    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    diag = gl.expand_dims((tile * ROW_TILE + rs) % n_q + n_k - n_q, 1)  # causal: the last key each row sees
    acc, m_i, l_i, s = _softmax_start(BLOCK_N, D, s_layout, o_layout)
    for j in range(n_blocks):
        st = j % STAGES
        phase = (j // STAGES) & 1
        start = k0 + j * BLOCK_N
        mbarrier.wait(k_ready.index(st), phase)
        s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(st))  # K_j read: its stage may take K_{j+STAGES}
        p, m_i, l_i, acc = _softmax_block(s * qk_scale, m_i, l_i, acc, start, n_k, n_k - n_q, diag, s_layout,
                                          o_layout, IS_CAUSAL)
        mbarrier.wait(v_ready.index(st), phase)
        if start + BLOCK_N > n_k:  # 0 · NaN is NaN: the slots past n_k must hold zeros, not whatever they hold
            _zero_rows_past(v_smem.index(st), start, n_k, ld_layout)
        acc = _pv(p, v_smem.index(st), acc, p_layout)
        mbarrier.arrive(v_empty.index(st))

    _store_out(acc, m_i, l_i, O, LSE, O_PART, LSE_PART, q0, n_q, tile, kvh, part, GROUP, H_Q, stride_ot, stride_oh,
               stride_od, stride_lh, stride_lt, ROW_TILE)


@gluon.jit
def paged_decode_ws(
    Q, desc_k, desc_v, O, LSE, O_PART, LSE_PART, WORK, SEQ, BT, stride_btr, stride_btc,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_lh, stride_lt,
    H_Q, GROUP, qk_scale,
    PAGE: gl.constexpr, ROW_TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """``paged_decode``'s arguments and grid; a loader warp issues the copies (``_ws_loader``), so
    the consumer warpgroup meets no CTA barrier around each of a block's copies."""
    D: gl.constexpr = desc_k.block_type.shape[-1]
    dtype: gl.constexpr = desc_k.block_type.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, D], row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], row_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_consumer, (Q, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, O, LSE, O_PART, LSE_PART,
                        WORK, SEQ, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_lh,
                        stride_lt, H_Q, GROUP, qk_scale, ROW_TILE, IS_CAUSAL, STAGES)),
        (_ws_loader, (desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, WORK, SEQ, BT, stride_btr,
                      stride_btc, PAGE, STAGES, BLOCK_N)),
    ], [1], [WS_LOADER_REGS])


__all__ = ["paged_decode", "paged_decode_ws"]
