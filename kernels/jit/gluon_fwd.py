"""The Hopper prefill forward in Gluon: FA3's warp specialisation, written out by hand.

Only ``@gluon.jit`` code lives here; ``kernels/hopper.py`` decides when it runs (``gluon_path``),
builds its TMA descriptors and launches it. A tile is a 128-row Q block of one (batch, head); a
program works through its tiles (``_work`` gives their order) with three roles side by side:

- a producer warp copies each tile's Q once both consumers are done with the last one's, then K_j
  and V_j by TMA into two stages each, a stage only once both consumers have released it
  (``k_empty`` / ``v_empty``, one arrival per consumer). Its ring runs on across tiles;
- two consumer warpgroups, 64 rows each, run the online softmax of ``jit/flash_fwd.py``
  (base 2, scale folded in). Within a warpgroup the S_j = Q K_jᵀ of block j is issued before the
  P_{j-1} V_{j-1} of block j-1, so its softmax overlaps the tensor cores' second GEMM; the two
  warpgroups drift apart freely (no CTA-wide barrier in the loop), so one's softmax also
  overlaps the other's GEMMs. O leaves through a staging buffer of its own by TMA, while the next
  tile's Q is already coming in.

Causal (bottom-right) tiles load no key block past their last row's diagonal and mask only the
blocks that cross a warpgroup's diagonal; a sliding window (``WINDOW``) bounds the loaded blocks
on both sides alike, and softcap (``SOFTCAP``) caps each score before any mask. What Triton's own
``warp_specialize`` of ``attn_fwd_tma`` could not express: that overlap inside a warpgroup, stages
released per consumer, and a pipeline that runs across tiles; hence it is faster than both at
D 128 (see docs/benchmarks/kernels.md#prefill).

Head dims: the tile's D is the descriptors' box (64, 128 or 256); a head dim below it (80, 96,
192, ...) is read with zeros past its end (TMA fills a box past the tensor with zeros) and its O
store is clipped there, so the padded columns add zeros to S and write nothing. ``SPLIT`` runs a
head dim of half the tile plus a power of two (80 = 64 + 16 and 96 = 64 + 32 in the 128 tile,
192 = 128 + 64 in the 256 one) without the padded columns' work: Q Kᵀ and P V as two GEMMs each,
over the tile's first half and the SPLIT columns after it (``hopper.split_cols``). At a box of 256
two Q tiles, two O tiles and two K and V stages do not fit in shared memory, so O leaves through
its warpgroup's Q buffer (``O_IN_Q``): the next tile's Q then loads only once O has left.
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

BLOCK_M = 128  # query rows per tile: attn_fwd_ws's two consumer warpgroups of 64


@gluon.jit
def _tanh(x):
    """tanh in float32 by the special-function unit's one instruction (``tanh.approx.f32``, at most
    ~5e-4 off), as flash-attn's softcap computes it: written from exp2 and a division it takes
    three of that unit's slots a score, where the softmax's exp2 already keeps it half busy at D 128
    (docs/benchmarks/kernels.md#score-modifiers)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _scores(s, qk_scale, start, kv_len, diag, win_left, win_right, cap, slope, IS_CAUSAL: gl.constexpr,
            WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """S = Q Kᵀ of the block of keys [start, start + BLOCK_N) in log2 units, capped first (SOFTCAP:
    cap · tanh(S / cap), cap in log2 units too, flash-attn's order), biased (ALIBI: - slope ·
    |row's aligned position - key|, slope in log2 units: every block pays), then masked to -inf where a
    key is >= kv_len (a ragged last block, or kv_lengths), causal, past its row's diagonal, or
    outside its row's window: row r of the warpgroup is at diag + r and sees keys
    diag + r - win_left ..= diag + r + win_right. Only the blocks that need it pay for a mask."""
    ROWS: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    s_layout: gl.constexpr = s.type.layout
    s = s * qk_scale
    if SOFTCAP:
        s = cap * _tanh(s * (1.0 / cap))
    if ALIBI:
        keys = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        at = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)), 1) + diag
        s = s - slope * gl.abs(at - keys).to(gl.float32)
    last = start + BLOCK_N - 1
    masked = last >= kv_len
    if IS_CAUSAL:
        masked = masked | (last > diag)
    if WINDOW:
        masked = masked | (last > diag + win_right) | (start < diag + ROWS - 1 - win_left)
    if masked:
        cols = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        if IS_CAUSAL or WINDOW:
            # One bound per row, then one compare per element: the last key a row sees.
            rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) + diag
            right = rows
            if WINDOW:
                right = rows + win_right
                if IS_CAUSAL:
                    right = gl.minimum(right, rows)
            keep = cols <= gl.expand_dims(gl.minimum(right, kv_len - 1), 1)
            if WINDOW:
                keep = keep & (cols >= gl.expand_dims(rows - win_left, 1))
        else:
            keep = cols < kv_len
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _finite(m):
    """The row max to subtract: 0 for a row that has seen no key yet (-inf - -inf is NaN): masked
    (causal, window) or with every score so far -inf (keys of -inf)."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _work(t, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, win_left, win_right, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, HAS_KV_LEN: gl.constexpr, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """Tile t of the schedule -> (batch·head, b, h, kv head, first row, kv_len, first key block, key blocks).

    Non-causal: the row blocks of one head side by side, so the programs working together share its
    K/V in L2. Causal: heads in groups of HEADS_PER_GROUP (flash.causal_heads_per_group), and within
    a group the longest row blocks of all its heads first, then the next longest (tail balance)."""
    n_m = gl.cdiv(N_Q, BLOCK_M)
    if IS_CAUSAL:
        per_group = HEADS_PER_GROUP * n_m
        g0 = t // per_group * HEADS_PER_GROUP
        heads = gl.minimum(HEADS_PER_GROUP, N_HEADS - g0)
        within = t % per_group
        pid_m = n_m - 1 - within // heads
        pid_bh = g0 + within % heads
    else:
        pid_m = t % n_m
        pid_bh = t // n_m
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    if HAS_KV_LEN:
        kv_len = gl.load(KV_LEN + b)
    else:
        kv_len = N_K
    row0 = pid_m * BLOCK_M
    # keys past the diagonal of the block's last row (causal), or past its window, are never
    # loaded, nor (window) blocks wholly left of its first row's window
    last_row = gl.minimum(row0 + BLOCK_M, N_Q) - 1 + N_K - N_Q
    hi = kv_len
    if IS_CAUSAL:
        hi = gl.minimum(hi, last_row + 1)
    first = 0
    if WINDOW:
        hi = gl.minimum(hi, last_row + win_right + 1)
        first = gl.maximum(row0 + N_K - N_Q - win_left, 0) // BLOCK_N
    n_blocks = gl.maximum(gl.cdiv(gl.maximum(hi, 0), BLOCK_N) - first, 0)
    return pid_bh, b, h, h // GROUP, row0, kv_len, first, n_blocks


@gluon.jit
def _zero_rows_from(tile, valid):
    """Rows >= valid of a (BLOCK_N, D) K or V tile in shared memory set to zero, by this warpgroup,
    16 rows at a time (a whole tile in registers would not fit beside a consumer's accumulator):
    P is 0 for such a key, but 0 · NaN is NaN, and a ragged block's rows past its end belong to
    another sequence, or to pages never written."""
    BLOCK_N: gl.constexpr = tile.shape[0]
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[4, 1], order=[1, 0])
    for c in gl.static_range(BLOCK_N // CHUNK):
        if (c + 1) * CHUNK > valid:
            part = tile.slice(c * CHUNK, CHUNK, dim=0)
            rows = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            x = part.load(layout)
            part.store(gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_empty, it, n_blocks, first_key, kv_len, diag,
            qk_scale, win_left, win_right, cap, slope, IS_CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
            SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, RELEASE_Q: gl.constexpr, ZERO_TAIL: gl.constexpr,
            SPLIT: gl.constexpr = 0, PINGPONG: gl.constexpr = False, turn=None, wg=0, turns=0):
    """One warpgroup's rows (q, (ROWS, D) in shared memory) against a tile's n_blocks key blocks
    from key first_key, the blocks counted from ``it`` in the two-stage ring; -> (acc (ROWS, D),
    acc_hi, m_i, l_i), acc not yet divided by l_i. RELEASE_Q: arrive on q_empty once every S is done (the
    next tile's Q may come in). ZERO_TAIL: V rows at or past kv_len in the last block are zeroed
    before P V (``_zero_rows_from``). SPLIT (> 0: the head dim is half the tile D plus SPLIT):
    both products run over the tile's first half and the SPLIT columns after it, as two GEMMs
    each, and acc is (ROWS, D / 2) with acc_hi (ROWS, SPLIT) the rest; else acc_hi is unused.
    PINGPONG: the two warpgroups take turns issuing their GEMMs (``_turn``), ``turns`` being this
    warpgroup's issues before this tile (a tile of n blocks issues n + 1 times)."""
    ROWS: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = _lo_cols(q.shape[1], SPLIT)
    HI: gl.constexpr = _hi_cols(SPLIT)
    dtype: gl.constexpr = q.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    hi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HI, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_hi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hi_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([ROWS, D], dtype=gl.float32, layout=o_layout)
    acc_hi = gl.zeros([ROWS, HI], dtype=gl.float32, layout=hi_layout)
    m_i = gl.full([ROWS], float("-inf"), dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], dtype=gl.float32, layout=gl.SliceLayout(1, s_layout))
    if n_blocks > 0:
        # block 0: S_0 and its softmax; no P V before it
        st = it % 2
        mbarrier.wait(k_ready.index(st), phase=(it // 2) & 1)
        s = gl.zeros([ROWS, BLOCK_N], dtype=gl.float32, layout=s_layout)
        _turn(turn, wg, turns, PINGPONG)
        s = _qk(q, k_smem.index(st), s, SPLIT)
        _turn_over(turn, wg, PINGPONG)
        s = _scores(warpgroup_mma_wait(num_outstanding=0, deps=(s,)), qk_scale, first_key, kv_len, diag,
                    win_left, win_right, cap, slope, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)
        mbarrier.arrive(k_empty.index(st))
        m_i = gl.max(s, axis=1)
        p = gl.exp2(s - gl.expand_dims(_finite(m_i), 1))
        l_i = gl.sum(p, axis=1)
        for j in range(1, n_blocks):
            c = it + j
            stage = c % 2
            prev = 1 - stage
            # S_j first, then P_{j-1} V_{j-1}: the softmax of S_j runs while the second is in flight
            mbarrier.wait(k_ready.index(stage), phase=(c // 2) & 1)
            if PINGPONG:  # both products issued in one turn: P_{j-1} ready before it
                mbarrier.wait(v_ready.index(prev), phase=((c - 1) // 2) & 1)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                _turn(turn, wg, turns + j, PINGPONG)
                s = _qk(q, k_smem.index(stage), s, SPLIT)
            else:
                s = _qk(q, k_smem.index(stage), s, SPLIT)
                mbarrier.wait(v_ready.index(prev), phase=((c - 1) // 2) & 1)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
            if SPLIT:
                p16_hi = gl.convert_layout(p16, p_hi_layout)
                acc = warpgroup_mma(p16, v_smem.index(prev).slice(0, D, dim=1), acc, is_async=True)
                acc_hi = warpgroup_mma(p16_hi, v_smem.index(prev).slice(D, HI, dim=1), acc_hi, is_async=True)
                _turn_over(turn, wg, PINGPONG)
                s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may run on
            else:
                acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                _turn_over(turn, wg, PINGPONG)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may run on
            s = _scores(s, qk_scale, first_key + j * BLOCK_N, kv_len, diag, win_left, win_right, cap, slope,
                        IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)
            mbarrier.arrive(k_empty.index(stage))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = _finite(m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            if SPLIT:
                acc, acc_hi, p16, p16_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_hi, p16, p16_hi))
                acc_hi = acc_hi * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, hi_layout)), 1)
            else:
                acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        if RELEASE_Q:
            mbarrier.arrive(q_empty)  # every S of this tile is done: the next tile's Q may come in
        c = it + n_blocks - 1
        last = c % 2
        mbarrier.wait(v_ready.index(last), phase=(c // 2) & 1)
        if ZERO_TAIL:
            tail = first_key + (n_blocks - 1) * BLOCK_N
            if tail + BLOCK_N > kv_len:
                _zero_rows_from(v_smem.index(last), kv_len - tail)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        _turn(turn, wg, turns + n_blocks, PINGPONG)
        if SPLIT:
            p16_hi = gl.convert_layout(p16, p_hi_layout)
            acc = warpgroup_mma(p16, v_smem.index(last).slice(0, D, dim=1), acc, is_async=True)
            acc_hi = warpgroup_mma(p16_hi, v_smem.index(last).slice(D, HI, dim=1), acc_hi, is_async=True)
            _turn_over(turn, wg, PINGPONG)
            acc, acc_hi, p16, p16_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_hi, p16, p16_hi))
        else:
            acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
            _turn_over(turn, wg, PINGPONG)
            acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(last))
    return acc, acc_hi, m_i, l_i


@gluon.jit
def _turn(turn, wg, k, PINGPONG: gl.constexpr):
    """PINGPONG: wait until the other warpgroup has issued its GEMMs of the turn before this
    warpgroup's k-th (FA3's scheduler barrier): the tensor cores then run one warpgroup's products
    while the other runs its softmax. Warpgroup 0 goes first: its k-th issue follows the other's
    (k - 1)-th, warpgroup 1's k-th follows warpgroup 0's k-th."""
    if PINGPONG:
        mbarrier.wait(turn.index(wg), phase=(k + wg - 1) & 1, pred=k + wg > 0)


@gluon.jit
def _turn_over(turn, wg, PINGPONG: gl.constexpr):
    """PINGPONG: this warpgroup's GEMMs of the turn are issued: the other's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - wg))


@gluon.constexpr_function
def _lo_cols(d, split):
    """The columns of a tile of d's first part: half of a split tile, else all d."""
    return d // 2 if split else d


@gluon.constexpr_function
def _hi_cols(split):
    """The columns of a split tile's second part (a placeholder width where nothing is split)."""
    return split if split else 16


@gluon.jit
def _qk(q, k, s, SPLIT: gl.constexpr):
    """S = Q Kᵀ issued, not waited for (q (ROWS, D), k (BLOCK_N, D) in shared memory); SPLIT: over
    the tile's first half and the SPLIT columns after it only, the rest left out (zeros)."""
    if SPLIT:
        LO: gl.constexpr = q.shape[1] // 2
        s = warpgroup_mma(q.slice(0, LO, dim=1), k.slice(0, LO, dim=1).permute((1, 0)), s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q.slice(LO, SPLIT, dim=1), k.slice(LO, SPLIT, dim=1).permute((1, 0)), s,
                          is_async=True)
    else:
        s = warpgroup_mma(q, k.permute((1, 0)), s, use_acc=False, is_async=True)
    return s


@gluon.jit
def _consumer(wg, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, desc_o,
              LSE, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, qk_scale, win_left, win_right,
              cap, SLOPES, stride_as, stride_ah, HAS_KV_LEN: gl.constexpr, IS_CAUSAL: gl.constexpr,
              O_IN_Q: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
              SPLIT: gl.constexpr, PINGPONG: gl.constexpr, turn):
    """One warpgroup: its 64 rows of each of the program's tiles against the tile's key blocks."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _lo_cols(D, SPLIT), 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q = q_smem.index(wg)
    o_tile = o_smem.index(wg)
    n_tiles = gl.cdiv(N_Q, 2 * ROWS) * N_HEADS
    it = 0  # key blocks consumed so far: block it sits in stage it % 2, in that stage's (it // 2)-th fill
    qc = 0  # Q tiles consumed so far
    turns = 0  # GEMM issues so far (PINGPONG)
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_bh, b, h, kvh, row0, kv_len, first, n_blocks = _work(
            t, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, win_left, win_right, 2 * ROWS, BLOCK_N,
            HAS_KV_LEN, IS_CAUSAL, WINDOW)
        r0 = row0 + wg * ROWS
        diag = r0 + N_K - N_Q  # the last key this warpgroup's first row may see (causal)
        loads_q = (n_blocks > 0) | O_IN_Q  # O_IN_Q: every tile's O goes out through its Q buffer
        if loads_q:
            mbarrier.wait(q_bar.index(wg), phase=qc & 1)
        slope = _slope(SLOPES, b, h, stride_as, stride_ah, ALIBI)
        acc, acc_hi, m_i, l_i = _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_empty.index(wg),
                                        it, n_blocks, first * BLOCK_N, kv_len, diag, qk_scale, win_left, win_right,
                                        cap, slope, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI, not O_IN_Q, False, SPLIT,
                                        PINGPONG, turn, wg, turns)
        turns += gl.where(n_blocks > 0, n_blocks + 1, 0)
        it += n_blocks
        if loads_q:
            qc += 1
        # rows that saw no key (kv_len = 0, or causal rows above the first key) -> o = 0, lse = -inf
        seen = l_i != 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
        tma.store_wait(pendings=0)  # the previous tile's O has left o_tile
        if SPLIT:  # the tile's columns past the head dim are never written: the store clips them
            o_tile.slice(0, D // 2, dim=1).store(o.to(dtype))
            o_hi = acc_hi / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, acc_hi.type.layout)), 1)
            o_tile.slice(D // 2, SPLIT, dim=1).store(o_hi.to(dtype))
        else:
            o_tile.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_o, [b, h, r0, 0], _box(o_tile, desc_o))  # rows past N_Q are clipped
        if O_IN_Q:
            tma.store_wait(pendings=0)  # O has left the Q buffer: the next tile's Q may come in
            mbarrier.arrive(q_empty.index(wg))
        rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + pid_bh.to(gl.int64) * N_Q + rows, lse, mask=rows < N_Q)
    tma.store_wait(pendings=0)


@gluon.jit
def _slope(SLOPES, row, h, stride_as, stride_ah, ALIBI: gl.constexpr):
    """The ALiBi slope of (batch element or sequence ``row``, head h) in log2 units; 0.0 unless ALIBI."""
    if ALIBI:
        return gl.load(SLOPES + row.to(gl.int64) * stride_as + h * stride_ah) * 1.4426950408889634
    else:
        return 0.0


@gluon.jit
def _box(tile, desc):
    """A (rows, D) tile of shared memory seen as the descriptor's (1, 1, rows, D) box: the same
    bytes, as the leading dims are 1."""
    return tile._reinterpret(tile.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
              KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, win_left, win_right,
              HAS_KV_LEN: gl.constexpr, IS_CAUSAL: gl.constexpr, O_IN_Q: gl.constexpr, WINDOW: gl.constexpr):
    """One warp, over the program's tiles: both halves of the tile's Q block once each consumer
    is done with the last one, then K_i and V_i into stage i % 2 (i counted over all tiles), each
    once both consumers have released the block two before it."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    n_tiles = gl.cdiv(N_Q, 2 * ROWS) * N_HEADS
    it = 0
    qc = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_bh, b, h, kvh, row0, kv_len, first, n_blocks = _work(
            t, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, win_left, win_right, 2 * ROWS, BLOCK_N,
            HAS_KV_LEN, IS_CAUSAL, WINDOW)
        if (n_blocks > 0) | O_IN_Q:
            for wg in gl.static_range(2):
                mbarrier.wait(q_empty.index(wg), phase=(qc - 1) & 1, pred=qc > 0)
                mbarrier.expect(q_bar.index(wg), desc_q.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_q, [b, h, row0 + wg * ROWS, 0], q_bar.index(wg),
                                                _box(q_smem.index(wg), desc_q))
            qc += 1
        for i in range(n_blocks):
            c = it + i
            stage = c % 2
            reuse = c >= 2
            mbarrier.wait(k_empty.index(stage), phase=((c // 2) - 1) & 1, pred=reuse)
            mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_k, [b, kvh, (first + i) * BLOCK_N, 0], k_ready.index(stage),
                                            _box(k_smem.index(stage), desc_k))
            mbarrier.wait(v_empty.index(stage), phase=((c // 2) - 1) & 1, pred=reuse)
            mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_v, [b, kvh, (first + i) * BLOCK_N, 0], v_ready.index(stage),
                                            _box(v_smem.index(stage), desc_v))
        it += n_blocks


@gluon.jit
def attn_fwd_ws(
    desc_q,                      # TMA descriptors over q (B, Hq, Nq, D), boxes (1, 1, 64, D),
    desc_k, desc_v,              # k, v (B, Hkv, Nk, D), boxes (1, 1, BLOCK_N, D),
    desc_o,                      # and the output o (B, Hq, Nq, D), boxes (1, 1, 64, D)
    LSE,                         # out: lse (B, Hq, Nq) fp32 natural log, contiguous
    KV_LEN,                      # int32 (B,) key lengths; unused unless HAS_KV_LEN
    H_Q, GROUP, N_Q, N_K,
    N_HEADS,                     # B·Hq
    qk_scale,                    # scale · log2(e)
    HEADS_PER_GROUP,             # causal: (batch, head)s scheduled together (order only, see _work)
    win_left, win_right,         # window sides in keys (1 << 30: unbounded); unused unless WINDOW
    cap,                         # softcap · log2(e); unused unless SOFTCAP
    SLOPES,                      # fp32 ALiBi slopes (B, Hq) (stride_as 0: one set for all); unused unless ALIBI
    stride_as, stride_ah,
    HAS_KV_LEN: gl.constexpr,
    IS_CAUSAL: gl.constexpr,     # bottom-right: query i sees keys <= i + N_K - N_Q
    CONSUMER_REGS: gl.constexpr,  # registers per thread of a consumer warpgroup (the producer gets 24)
    O_IN_Q: gl.constexpr = False,  # O leaves through the Q buffers (a box of D 256: module docstring)
    WINDOW: gl.constexpr = False,  # a sliding window bounds the keys of each row
    SOFTCAP: gl.constexpr = False,  # scores capped: softcap · tanh(S / softcap)
    ALIBI: gl.constexpr = False,  # scores biased by -slope · |i + N_K - N_Q - j|
    SPLIT: gl.constexpr = 0,     # > 0: the head dim is D / 2 + SPLIT, the products run over it alone
    PINGPONG: gl.constexpr = False,  # the consumers take turns issuing their GEMMs (``_turn``)
):
    """Prefill; a tile = 128 query rows of one (batch, head). Grid (programs,): program p takes
    tiles p, p + programs, ... in ``_work``'s order; the launcher gives min(tiles, SMs) programs
    (persistent) to non-causal problems and one a tile to causal ones. 4 warps (+ 4 + 1 in the
    partitions).

    The descriptors are built on the host over the whole 4-D tensors, so any batch and head
    strides work (bnhd included) and a box past a head's last row reads zeros and stores nothing."""
    ROWS: gl.constexpr = desc_q.block_type.shape[2]   # per consumer warpgroup: BLOCK_M / 2
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.block_type.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    if O_IN_Q:
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)  # so the next Q may load early
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], row_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], row_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)  # the other consumer warpgroup's issue
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # its own consumer warpgroup
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (0, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, desc_o,
                     LSE, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, qk_scale, win_left, win_right,
                     cap, SLOPES, stride_as, stride_ah, HAS_KV_LEN, IS_CAUSAL, O_IN_Q, WINDOW, SOFTCAP, ALIBI,
                     SPLIT, PINGPONG, turn)),
        (_consumer, (1, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, desc_o,
                     LSE, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, qk_scale, win_left, win_right,
                     cap, SLOPES, stride_as, stride_ah, HAS_KV_LEN, IS_CAUSAL, O_IN_Q, WINDOW, SOFTCAP, ALIBI,
                     SPLIT, PINGPONG, turn)),
        (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                     v_empty, KV_LEN, H_Q, GROUP, N_Q, N_K, N_HEADS, HEADS_PER_GROUP, win_left, win_right,
                     HAS_KV_LEN, IS_CAUSAL, O_IN_Q, WINDOW)),
    ], [4, 1], [CONSUMER_REGS, 24])
