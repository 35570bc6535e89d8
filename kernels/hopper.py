"""flash's Hopper (sm_90) paths: which problems the TMA and Gluon kernels take (``*_refusal``: None
when the kernel serves it, else why not; ``*_path``: the same rule as a bool), and the Gluon launches.

- ``tma_refusal``: ``attn_fwd_tma`` (Triton, TMA), non-causal 16-bit prefill at D 64 or 128;
- ``gluon_refusal``: ``attn_fwd_ws`` (Gluon, ``jit/gluon_fwd.py``), 16-bit prefill at D 72 to 256;
- ``decode_refusal``: ``attn_decode`` (Gluon, ``jit/gluon_decode.py``), packed or split 16-bit
  decode at D 64 or 128.

None depends on B (batched answers equal lone ones bit for bit): the strides they read are per row
and per head, and the service stages every request at 256-byte aligned offsets. A Gluon launch is
worked out once per problem (``_DecodeRecipe``, ``_GluonRecipe`` in ``_recipes``); later calls
allocate, point host TMA descriptors at their tensors and call ``launch._run``. With direct
launches off, ``_decode_plain`` and ``_gluon_plain`` launch through ``launch_plain`` instead.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .jit import flash_fwd as kern
from .jit import gluon_decode as kern_decode
from .jit import gluon_fwd as kern_gluon
from .launch import _COMPILED_MAX, _compiled_plain, _run, clear_on_switch, direct_launch, interpreting, launch_plain
from .masks import NO_MASKS, Masks
from .plan import _cdiv, _combine_launch, _num_sms, alibi_arg, kv_length_arg, tell

_16BIT = (torch.float16, torch.bfloat16)
TMA_MIN_N = 2048  # min(Nq, Nk) below which attn_fwd is as fast (see docs/benchmarks/kernels.md#prefill)
# min(Nq, Nk) below which the Triton kernels are as fast as attn_fwd_ws (docs/benchmarks/kernels.md#prefill)
GLUON_MIN_N = 256
GLUON_MIN_N_CAUSAL = 2048
# attn_fwd_ws by its tile's D (the descriptors' box; a head dim below it is padded with zeros):
# (keys per block, O out through the Q buffers, registers per consumer thread), the fastest of
# docs/benchmarks/kernels.md#prefill; at D 128, 64 keys a block is slower than 128
GLUON_TILES: dict[int, tuple[int, bool, int]] = {128: (128, False, 232), 256: (64, True, 240)}
GLUON_MIN_D = 72  # from D 64 down, attn_fwd_tma (D 64) and attn_fwd are as fast
# head dims whose tile runs its products over the head dim alone (attn_fwd_ws's SPLIT, ``split_cols``),
# not over the tile's columns of zeros too (docs/benchmarks/kernels.md#head-dims)
GLUON_SPLIT_DIMS: frozenset[int] = frozenset({80, 96, 144, 160, 192})
# tile Ds whose two consumer warpgroups take turns issuing their GEMMs (attn_fwd_ws's PINGPONG, FA3's
# scheduler barrier); `python -m bench.heads --tiles` times each tile with and without
GLUON_PINGPONG: set[int] = set()
_GLUON_BLOCK_N = GLUON_TILES[128][0]
_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
# attn_decode: keys per block, by D, and blocks in flight per program
DECODE_BLOCK_N = {64: 128, 128: 64}
DECODE_STAGES = 2

_DECODE_PLAN, _NOT_16BIT = "a decode plan (GQA rows packed or keys split)", "not float16/bfloat16"
_NOT_SM90, _NO_GLUON = "not sm_90", "Triton's interpreter cannot run Gluon"


@functools.cache
def _hopper(device: torch.device) -> bool:
    """sm_90 only: the configs are chosen for and checked on Hopper; Triton's warp specialisation
    works differently on Blackwell (sm_100+), where nothing here has run."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _tma_rows_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a contiguous last dim and 16-byte aligned base and row strides."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]))


def tma_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                pack: int, splits: int, sizes: bool = True) -> str | None:
    """Why ``attn_fwd_tma`` does not serve this problem, or None when it does: non-causal 16-bit
    prefill at D 64 or 128 on Hopper (or the interpreter), TMA-compatible strides, a positive scale.
    ``sizes=False`` skips the length threshold (tests). On every call's path: constant reasons."""
    if causal:
        return "causal"
    if scale <= 0:
        return "scale <= 0 (its loop takes the row max before scaling)"
    if pack != 1 or splits != 1:
        return _DECODE_PLAN
    if q.dtype not in _16BIT:
        return _NOT_16BIT
    if q.shape[-1] not in (64, 128):
        return "head_dim is not 64 or 128"
    if not (interpreting() or _hopper(q.device)):
        return _NOT_SM90
    if sizes and min(q.shape[2], k.shape[2]) < TMA_MIN_N:
        return "min(Nq, Nk) < TMA_MIN_N"
    if not (_tma_rows_ok(q) and _tma_rows_ok(k) and _tma_rows_ok(v)):
        return "q, k or v not 16-byte aligned, or its last dim not contiguous"
    return None


def tma_path(q, k, v, causal: bool, scale: float, pack: int, splits: int, sizes: bool = True) -> bool:
    """Whether ``attn_fwd_tma`` serves this problem (``tma_refusal`` is None)."""
    return tma_refusal(q, k, v, causal, scale, pack, splits, sizes) is None


def gluon_box(d: int) -> int | None:
    """The tile D of ``attn_fwd_ws`` for head dim d, or None where it takes no such head dim (a
    16-byte row of 2-byte elements, at least ``GLUON_MIN_D``, at most the largest tile)."""
    if d % 8 or d < GLUON_MIN_D:
        return None
    return next((box for box in sorted(GLUON_TILES) if d <= box), None)


def split_cols(d: int) -> int:
    """attn_fwd_ws's SPLIT for head dim d: the columns past its tile's first half where d is half
    the tile plus a power of two from 16 (the K of a 16-bit wgmma) and is in ``GLUON_SPLIT_DIMS``;
    else 0, the products over the whole tile."""
    box = gluon_box(d)
    hi = d - box // 2 if box else 0
    return hi if d in GLUON_SPLIT_DIMS and 16 <= hi < box // 2 and hi & (hi - 1) == 0 else 0


def gluon_sizes(n_q: int, n_k: int, causal: bool) -> bool:
    """Whether a problem is long enough for ``attn_fwd_ws`` to beat the Triton kernels: both sides
    at least ``GLUON_MIN_N``; causal, also ``GLUON_MIN_N_CAUSAL`` keys (a short causal square gives
    each tile little work, where a chunked prefill of 256 rows against 4k keys gives it plenty)."""
    return min(n_q, n_k) >= GLUON_MIN_N and (not causal or n_k >= GLUON_MIN_N_CAUSAL)


def gluon_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, pack: int, splits: int,
                  sizes: bool = True, masks: Masks = NO_MASKS) -> str | None:
    """Why ``attn_fwd_ws`` does not serve this problem, or None when it does: 16-bit prefill on
    Hopper at a head dim ``gluon_box`` takes, causal or not, strides a host TMA descriptor takes
    (``_descriptor_ok``); a sliding window, softcap and ALiBi slopes.
    ``sizes=False`` skips the length thresholds (tests)."""
    if pack != 1 or splits != 1:
        return _DECODE_PLAN
    if q.dtype not in _16BIT:
        return _NOT_16BIT
    if gluon_box(q.shape[-1]) is None:
        return f"head_dim {q.shape[-1]} is not a multiple of 8 in {GLUON_MIN_D}..{max(GLUON_TILES)}"
    if q.numel() == 0 or k.numel() == 0:
        return "an empty tensor (a TMA descriptor has no empty dims)"
    if interpreting():
        return _NO_GLUON
    if not _hopper(q.device):
        return _NOT_SM90
    if sizes and not gluon_sizes(q.shape[2], k.shape[2], causal):
        return "causal and Nk < GLUON_MIN_N_CAUSAL or Nq < GLUON_MIN_N" if causal else "min(Nq, Nk) < GLUON_MIN_N"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _descriptor_ok(t):
            return f"{name}: a descriptor not 16-byte aligned, or a stride TMA cannot say"
    return None


def gluon_path(q, k, v, causal: bool, pack: int, splits: int, sizes: bool = True, masks: Masks = NO_MASKS) -> bool:
    """Whether ``attn_fwd_ws`` serves this problem (``gluon_refusal`` is None)."""
    return gluon_refusal(q, k, v, causal, pack, splits, sizes, masks) is None


def _descriptor_ok(t: torch.Tensor) -> bool:
    """Whether ``_descriptor`` can describe t: TMA's 16-byte rules (``_tma_rows_ok``), and no
    stride 0 over a dim longer than 1 (an expanded tensor), which a TMA descriptor cannot say."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    for st, n in zip(strides[:-1], t.shape[:-1], strict=True):
        if st * size % 16 or (st == 0 and n > 1):
            return False
    return True


def decode_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: int, splits: int) -> str | None:
    """Why ``attn_decode`` does not serve this problem, or None when it does (``_decode_check``)."""
    return _decode_check(q, k, v, pack, splits)[1]


def decode_path(q, k, v, pack: int, splits: int) -> bool:
    """Whether ``attn_decode`` serves this problem (``decode_refusal`` is None)."""
    return decode_descriptors(q, k, v, pack, splits) is not None


def decode_descriptors(q, k, v, pack: int, splits: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """``attn_decode``'s K and V descriptors where ``decode_path`` holds, else None."""
    return _decode_check(q, k, v, pack, splits)[0]


def _decode_check(q, k, v, pack: int, splits: int) -> tuple[tuple | None, str | None]:
    """(K and V descriptors, None) where ``attn_decode`` serves the problem, else (None, why not):
    a decode-like plan (GQA rows packed, or keys split; at most ``ROWS`` rows a program), 16-bit at
    D 64 or 128 on a Hopper GPU, K and V that host TMA descriptors take (q is read through
    pointers, any strides). The stride rules are checked on the lists the descriptors hold."""
    if pack == 1 and splits == 1:
        return None, "not a decode plan (no GQA rows packed, no keys split)"
    n_q, d = q.shape[2:]
    if pack * n_q > kern_decode.ROWS.value:
        return None, f"more than {kern_decode.ROWS.value} rows a program (GQA group x Nq)"
    if d not in (64, 128):
        return None, "head_dim is not 64 or 128"
    if q.dtype not in _16BIT:
        return None, _NOT_16BIT
    if 0 in q.shape or 0 in k.shape:
        return None, "an empty tensor (a TMA descriptor has no empty dims)"
    if interpreting():
        return None, _NO_GLUON
    if not _hopper(q.device):
        return None, _NOT_SM90
    descs = (_descriptor(k, DECODE_BLOCK_N[d]), _descriptor(v, DECODE_BLOCK_N[d]))
    for name, desc in zip("kv", descs, strict=True):
        # 16-byte multiples of 2-byte elements; a dim of 1 has a canonical stride by now, so a 0
        # left is an expanded dim, which a descriptor cannot say
        *outer, last = desc.strides
        if last != 1 or desc.base.data_ptr() % 16 or any(st % 8 or st == 0 for st in outer):
            return None, f"{name}: a descriptor not 16-byte aligned, or a stride TMA cannot say"
    return descs, None


def _descriptor(t: torch.Tensor, rows: int, box_d: int | None = None, layout=_BOX_LAYOUT) -> TensorDescriptor:
    """A host TMA descriptor over a whole t (B, H, N, D), in boxes of (1, 1, rows, box_d or D): a
    box past D reads zeros there and stores nothing. A dim of length 1 gets the stride it would
    have if contiguous (its own may be anything, even 0). ``layout``: the box's shared-memory
    layout (16-bit elements unless given).

    Built without ``TensorDescriptor.__post_init__``: its checks are ``gluon_path``'s, made once
    per problem, and would cost host time on every launch (tests run them on what this builds)."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), strides
    desc.block_shape, desc.layout, desc.padding = [1, 1, rows, box_d or t.shape[-1]], layout, "zero"
    return desc


def _descriptor_2d(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A host TMA descriptor over a 2-D t (rows contiguous) in boxes of (rows, cols), built as
    ``_descriptor``'s."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    desc.block_shape, desc.layout, desc.padding = [rows, cols], _ROW_LAYOUT, "zero"
    return desc


def _rebased(desc: TensorDescriptor, t: torch.Tensor | None) -> TensorDescriptor:
    """``desc`` (from ``_descriptor``) over t, a tensor of the same shape and strides."""
    new = object.__new__(TensorDescriptor)
    new.base, new.shape, new.strides = t, desc.shape, desc.strides
    new.block_shape, new.layout, new.padding = desc.block_shape, desc.layout, desc.padding
    return new


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def causal_heads_per_group(k: torch.Tensor, heads: int, group: int) -> int:
    """How many of the ``heads`` (batch, query head)s a causal ``attn_fwd_ws`` grid schedules
    together, in groups of even size: as many as have their K and V fit in twice the L2 (GQA:
    ``group`` query heads share a kv head's). All heads' longest row blocks first balances the tail,
    but once their K/V outgrow L2 each program reads its blocks from HBM
    (see docs/benchmarks/kernels.md#prefill)."""
    per_head = 2 * k.shape[2] * k.shape[3] * k.element_size() / group
    fit = max(1, int(2 * _l2_bytes(k.device) // per_head))
    return _cdiv(heads, _cdiv(heads, fit))


def _outputs(o_shape: tuple, lse_shape: tuple, part_shapes: tuple | None, dtype, device) -> tuple:
    """o, lse, attn_decode's out (``_decode_launch``) and the split partials (or None)."""
    o = torch.empty(o_shape, dtype=dtype, device=device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
    if part_shapes is None:  # o and lse themselves, as one split (a split stride of 0)
        return o, lse, (o, lse, (0, *o.stride()), (0, *lse.stride())), None, None
    o_part = torch.empty(part_shapes[0], dtype=torch.float32, device=device)
    lse_part = torch.empty(part_shapes[1], dtype=torch.float32, device=device)
    return o, lse, (o_part, lse_part, o_part.stride(), lse_part.stride()), o_part, lse_part


def _decode_launch(q, k, descs, out, kv_len, has_kv_len: bool, scale: float, causal: bool,
                   pack: int, splits: int, kps: int) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of attn_decode with ``decode_descriptors``' descs into out = (o,
    lse, their strides with a split stride first): the per-split partials (S, B, Hq, Nq, D) and
    (S, B, Hq, Nq), or o and lse themselves with a split stride of 0."""
    b, hq, n_q, _ = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    o_out, lse_out, so, sl = out
    args = (
        q, *descs, o_out, lse_out, kv_len,
        *q.stride(), *so[:4], *sl,
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, kps,
    )
    consts = dict(PACK=pack, HAS_KV_LEN=has_kv_len, IS_CAUSAL=bool(causal), STAGES=DECODE_STAGES,
                  SIGNAL_MERGE=splits > 1)
    return (splits, b * (hq // pack)), args, consts


def _part_shapes(q, splits: int) -> tuple | None:
    return ((splits, *q.shape), (splits, *q.shape[:3])) if splits > 1 else None


class _DecodeRecipe:
    """Everything of an ``attn_decode`` call (and its merge) that follows from the problem's
    shapes, strides, dtype, device and flags, worked out on its first call: later calls allocate
    the outputs, point two descriptors at the new K and V and launch, so that an eager decode does
    not wait on the host (docs/benchmarks/kernels.md#launch-cache)."""

    __slots__ = ("device", "dtype", "o_shape", "lse_shape", "part_shapes", "n_k", "k_desc", "v_desc",
                 "decode", "decode_static", "kps", "decode_tail", "merge", "merge_grid", "merge_static",
                 "merge_tail")

    def __init__(self, q, k, v, kv_lengths, causal: bool, pack: int, splits: int, kps: int):
        b, hq, n_q, d = q.shape
        self.device, self.dtype, self.n_k, self.kps = q.device, q.dtype, k.shape[2], kps
        self.o_shape, self.lse_shape, self.part_shapes = (b, hq, n_q, d), (b, hq, n_q), _part_shapes(q, splits)
        o, lse, out, o_part, lse_part = _outputs(self.o_shape, self.lse_shape, self.part_shapes, self.dtype,
                                                 self.device)
        descs = decode_descriptors(q, k, v, pack, splits)
        # templates without a tensor: a recipe kept must not keep its first call's K and V alive
        self.k_desc, self.v_desc = (_rebased(desc, None) for desc in descs)
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        grid, args, consts = _decode_launch(q, k, descs, out, kv_len, kv_lengths is not None, 1.0, causal,
                                            pack, splits, kps)
        compiled, self.decode_tail = _compiled_plain(kern_decode.attn_decode, grid, args, consts, num_warps=4)
        self.decode = (compiled, grid)
        self.decode_static = args[6:-2]  # between kv_len and the scale
        self.merge = None
        if splits > 1:
            # the merge as a programmatic dependent launch: scheduled once every split has reached
            # its epilogue (SIGNAL_MERGE), it waits in griddepcontrol.wait for the whole split grid
            # and its writes (docs/benchmarks/kernels.md#decode)
            self.merge_grid, args, consts = _combine_launch(o_part, lse_part, o, lse, after_split_kernel=True)
            self.merge, self.merge_tail = _compiled_plain(kern.attn_combine, self.merge_grid, args, consts,
                                                          num_warps=4, launch_pdl=True)
            self.merge_static = args[4:]

    def __call__(self, q, k, v, kv_lengths, scale: float, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse, out, o_part, lse_part = _outputs(self.o_shape, self.lse_shape, self.part_shapes, self.dtype,
                                                 self.device)
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        descs = (_rebased(self.k_desc, k), _rebased(self.v_desc, v))
        _forward_decode(q, descs, out, kv_len, scale, self)
        if self.merge is not None:
            _run(self.merge, self.merge_grid, (o_part, lse_part, o, lse, *self.merge_static, *self.merge_tail))
        return o, lse


def _forward_decode(q, descs, out, kv_len, scale: float, recipe: _DecodeRecipe) -> None:
    """attn_decode as ``recipe`` (and ``_decode_launch``) says."""
    compiled, grid = recipe.decode
    _run(compiled, grid, (q, *descs, out[0], out[1], kv_len, *recipe.decode_static, scale * kern.LOG2E,
                          recipe.kps, *recipe.decode_tail))


def _decode_plain(causal: bool, pack: int, splits: int, kps: int, q, k, v, kv_lengths,
                  scale: float, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """``_DecodeRecipe``'s launches through ``launch_plain``, worked out anew (direct launches off)."""
    o, lse, out, o_part, lse_part = _outputs(q.shape, q.shape[:3], _part_shapes(q, splits), q.dtype, q.device)
    kv_len = kv_length_arg(kv_lengths, k.shape[2], q.device)
    grid, args, consts = _decode_launch(q, k, decode_descriptors(q, k, v, pack, splits), out, kv_len,
                                        kv_lengths is not None, scale, causal, pack, splits, kps)
    launch_plain(kern_decode.attn_decode, grid, args, consts, num_warps=4)
    if splits > 1:
        grid, args, consts = _combine_launch(o_part, lse_part, o, lse, after_split_kernel=True)
        launch_plain(kern.attn_combine, grid, args, consts, num_warps=4, launch_pdl=True)
    return o, lse


def _gluon_launch(q, k, v, o, lse, kv_len, has_kv_len: bool, scale: float, causal: bool,
                  masks: Masks = NO_MASKS) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of attn_fwd_ws writing o and lse, with ``masks``' window, cap and slopes."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rows = kern_gluon.BLOCK_M // 2
    tiles = _cdiv(n_q, kern_gluon.BLOCK_M) * b * hq
    box = gluon_box(d)
    block_n, o_in_q, regs = GLUON_TILES[box]
    args = (
        _descriptor(q, rows, box), _descriptor(k, block_n, box), _descriptor(v, block_n, box),
        _descriptor(o, rows, box), lse, kv_len, hq, hq // hkv, n_q, n_k, b * hq, scale * kern.LOG2E,
        causal_heads_per_group(k, b * hq, hq // hkv) if causal else 1, *masks.kernel_args(),
        *alibi_arg(masks, q.device),
    )
    # non-causal: persistent, one program an SM (its shared memory allows no second), so a tile's
    # Q load and O store overlap its neighbours' work. Causal: a program a tile, as tiles differ in
    # length and the hardware's scheduler balances them better than a fixed stride
    # (docs/benchmarks/kernels.md#prefill)
    programs = tiles if causal else min(tiles, _num_sms(q.device))
    return (programs,), args, dict(HAS_KV_LEN=has_kv_len, IS_CAUSAL=bool(causal), CONSUMER_REGS=regs,
                                   O_IN_Q=o_in_q, WINDOW=masks.window, SOFTCAP=masks.softcap > 0,
                                   ALIBI=masks.alibi is not None, SPLIT=split_cols(d),
                                   PINGPONG=box in GLUON_PINGPONG)


class _GluonRecipe:
    """``attn_fwd_ws``'s launch worked out on a problem's first call, as ``_DecodeRecipe``'s: later
    calls allocate o and lse, point four descriptors at q, k, v, o and launch."""

    __slots__ = ("device", "dtype", "o_shape", "lse_shape", "n_k", "descs", "launch", "static", "heads", "tail")

    def __init__(self, q, k, v, kv_lengths, causal: bool, masks: Masks = NO_MASKS):
        b, hq, n_q, d = q.shape
        self.device, self.dtype, self.n_k = q.device, q.dtype, k.shape[2]
        self.o_shape, self.lse_shape = (b, hq, n_q, d), (b, hq, n_q)
        o, lse = self._outputs()
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        grid, args, consts = _gluon_launch(q, k, v, o, lse, kv_len, kv_lengths is not None, 1.0, causal, masks)
        compiled, self.tail = _compiled_plain(kern_gluon.attn_fwd_ws, grid, args, consts, num_warps=4)
        self.launch = (compiled, grid)
        self.descs = tuple(_rebased(desc, None) for desc in args[:4])  # templates: no tensor kept
        self.static, self.heads = args[6:11], args[12]  # hq .. b·hq, then the causal head groups

    def _outputs(self):
        return (torch.empty(self.o_shape, dtype=self.dtype, device=self.device),
                torch.empty(self.lse_shape, dtype=torch.float32, device=self.device))

    def __call__(self, q, k, v, kv_lengths, scale: float, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = self._outputs()
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        dq, dk, dv, do = self.descs
        descs = (_rebased(dq, q), _rebased(dk, k), _rebased(dv, v), _rebased(do, o))
        _forward_gluon(q, descs, lse, kv_len, scale, self, masks)
        return o, lse


def _forward_gluon(q, descs, lse, kv_len, scale: float, recipe: _GluonRecipe, masks: Masks = NO_MASKS) -> None:
    """attn_fwd_ws as ``recipe`` (and ``_gluon_launch``) says; the window, cap and slopes are the call's."""
    compiled, grid = recipe.launch
    _run(compiled, grid, (*descs, lse, kv_len, *recipe.static, scale * kern.LOG2E, recipe.heads,
                          *masks.kernel_args(), *alibi_arg(masks, q.device), *recipe.tail))


def _gluon_plain(causal: bool, q, k, v, kv_lengths, scale: float,
                 masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """``_GluonRecipe``'s launch through ``launch_plain``, worked out anew (direct launches off)."""
    o, lse, *_ = _outputs(q.shape, q.shape[:3], None, q.dtype, q.device)
    kv_len = kv_length_arg(kv_lengths, k.shape[2], q.device)
    grid, args, consts = _gluon_launch(q, k, v, o, lse, kv_len, kv_lengths is not None, scale, causal, masks)
    launch_plain(kern_gluon.attn_fwd_ws, grid, args, consts, num_warps=4)
    return o, lse


# problems -> the launch of the Gluon kernel that serves them, or None where neither does
_recipes: dict[tuple, object] = {}
clear_on_switch(_recipes)


def _recipe(q, k, v, kv_lengths, causal: bool, num_splits: int | None, tma: bool | None, pack: int,
            splits: int, kps: int, masks: Masks = NO_MASKS):
    """``(q, k, v, kv_lengths, scale, masks) -> (o, lse)`` for a problem a Gluon kernel serves
    (``decode_path`` unmasked, or ``gluon_path`` for what ``plan`` neither packs nor splits), built
    on its first call; None where neither does. Keyed on what decides every launch argument but the
    data: shapes, strides, dtype, device, flags, and the 16-byte alignments Triton and TMA depend
    on; of the masks, which are on and how Triton specialises the window's integers and the slopes'
    strides and pointer (1, multiples of 16), since the call passes their values."""
    left, right, _ = masks.kernel_args()
    slopes, stride_as, stride_ah = alibi_arg(masks, q.device)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal,
           kv_lengths is None, num_splits, tma, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
           masks.window, masks.softcap > 0, masks.alibi is None, left == 1, left % 16, right == 1, right % 16,
           slopes.data_ptr() % 16, stride_as in (0, 1), stride_as % 16, stride_ah == 1, stride_ah % 16,
           split_cols(q.shape[-1]))
    try:
        return _recipes[key]
    except KeyError:
        pass
    recipe, kernel, direct = None, None, direct_launch()
    if pack > 1 or splits > 1:
        if not masks.active and decode_path(q, k, v, pack, splits):
            kernel = "attn_decode"
            recipe = (_DecodeRecipe(q, k, v, kv_lengths, causal, pack, splits, kps) if direct
                      else functools.partial(_decode_plain, causal, pack, splits, kps))
    elif gluon_path(q, k, v, causal, pack, splits, sizes=tma is None, masks=masks):
        kernel = "attn_fwd_ws"
        recipe = _GluonRecipe(q, k, v, kv_lengths, causal, masks) if direct else functools.partial(_gluon_plain, causal)
    if kernel is not None:  # else flash_forward's Triton launch says what it chose
        tell(q, k, causal, kv_lengths is not None, pack, splits, kernel, dict)
    if len(_recipes) >= _COMPILED_MAX:
        _recipes.clear()
    _recipes[key] = recipe
    return recipe
