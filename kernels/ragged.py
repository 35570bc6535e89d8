"""Host side of ragged (varlen) and paged attention: the per-sequence plan, the launches, the CPU
path and the kernel choice (the input checks: ``kernels/ragged_checks.py``). ``kernels/varlen.py`` and
``kernels/paged.py`` are the public entry points; the device code is ``kernels/jit/varlen.py``.

One call covers S sequences of any lengths. The host reads the sequences' lengths (one small
device-to-host copy of the index tensors), plans every sequence alone, and packs the plans into
one work list: a work item is (sequence, row tile, key split), and one launch per class runs them
all, so no sequence is padded to the longest.

- "decode" sequences, whose GQA group × n_q query rows fit in ``PACK_ROWS``: a program's rows are
  the whole group of query heads of one kv head (K/V read once per kv head), BLOCK_M 16; a
  program per (item, kv head).
- "prefill" sequences (more rows): a program is BLOCK_M query rows of one head, a program per
  (item, head); causal tiles skip the key blocks in their future.
- "chunk" sequences: prefill rows against at least twice as many keys (a chunked prefill against
  its cache), the same program with smaller tiles, which the H200 runs faster on that shape.

A launch's grid is one axis, heads fastest (program p: item p // heads, head p % heads): the plan
lists prefill and chunk items longest first, so all heads of the longest items start first.

On Hopper the decode items of a paged call run ``paged_decode`` and the prefill and chunk items
``ragged_prefill`` (Gluon, TMA; both tiles 128 rows), where they take the call (``gluon_*_refusal``);
else ``ragged_fwd`` (Triton) runs every class.

A sequence whose programs alone would leave SMs idle (few query rows, many keys) is split along its
keys (flash-decoding): each split writes a float32 partial (o, lse), and ``ragged_merge`` combines
a token's splits in order.

Batch invariance (docs/api.md#batching-policy): a sequence's plan — its class, tile sizes, number of splits and
split boundaries — depends only on its own n_q and n_k and on static configuration (head counts,
head dim, dtype, the device's SM count), never on S or on the other sequences; and every program
computes rows of one sequence only. So a sequence's o and lse are bit for bit the same whatever
shares the launch. Where work items sit in the launch (their order) changes no bits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .dispatch import triton_interpret, triton_refusal
from .errors import (
    KernelUnavailableError,
)
from .masks import NO_MASKS, Masks

log = logging.getLogger("attnserve.kernels")

RAGGED_KERNELS = ("auto", "flash", "reference")
PACK_ROWS = 64            # a sequence whose GQA group × n_q rows fit here is planned as decode
SPLIT_KEY_QUANTUM = 256   # split boundaries are multiples of this many keys (a multiple of every BLOCK_N)
MAX_SPLITS = 64
SPLIT_WAVES = 1           # a short sequence is split into about this many waves of programs over the SMs
GLUON_DECODE = True       # paged decode items on Hopper run paged_decode (Gluon) where it takes them
GLUON_DECODE_BLOCK_N = 64  # paged_decode's keys a block: page_tokens a multiple, or a divisor of at least
GLUON_DECODE_MIN_PAGE = 16  # ... this many tokens (a block is then one TMA copy per page)
GLUON_DECODE_STAGES = 2   # paged_decode's K/V blocks in flight per program, as attn_decode's
# pages of at most this many tokens run paged_decode_ws: a loader warp issues a block's copies, one
# a page, with no CTA barrier around each; from pages of 64 (one copy a block) paged_decode is as fast.
# Its 8 warps (the loader's warpgroup padded) at WS_MAXNREG registers a thread keep two programs an SM
GLUON_DECODE_LOADER = 32
WS_MAXNREG = 128
GLUON_PREFILL = True      # prefill and chunk items on Hopper run ragged_prefill (Gluon) where it takes them
GLUON_ROWS = 128          # ragged_prefill's query rows a tile: the plan's prefill and chunk BLOCK_M under it


# ---- the plan ----

@dataclass(frozen=True)
class Config:
    """A static launch config of ``ragged_fwd``: chosen by class, head dim and dtype only."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def block_d(d: int) -> int:
    """D padded to a power of two of at least 16 (the smallest tl.dot size)."""
    return max(16, 1 << (d - 1).bit_length())


CLASSES = ("decode", "prefill", "chunk")


def kernel_config(cls: str, d: int, dtype: torch.dtype, interpret: bool, gluon: bool = False) -> Config:
    """Tiles of one class (``CLASSES``), the fastest of ``python -m bench.paged --sweep`` on the
    H200 at D = 128 (docs/benchmarks/kernels.md): decode packs up to 16 rows (the smallest tl.dot
    M) and streams 64-key blocks with two warps; prefill takes 128 x 128 tiles, a chunk 64 x 64.
    Float32 tiles take twice the shared memory. The interpreter's tiles are small (CPU time) and
    differ per class, so the CPU tests run every class's shape. ``gluon`` (``gluon_plans``): the
    prefill and chunk items are planned in ``ragged_prefill``'s 128-row tiles, and where it then
    refuses a call (ALiBi, unaligned tensors) ``ragged_fwd`` runs them at 128 rows too."""
    if interpret:
        return {"decode": Config(16, 32, 4, 1), "prefill": Config(32, 32, 4, 1), "chunk": Config(16, 32, 4, 1)}[cls]
    bd = block_d(d)
    if dtype == torch.float32:
        return Config(16 if cls == "decode" else 64, 64 if bd <= 128 else 32, 4, 2)
    if cls == "decode":
        return Config(16, 64, 2, 3) if bd <= 128 else Config(16, 64, 4, 2)
    if cls == "chunk" and not gluon:
        return Config(64, 64, 4, 3) if bd <= 128 else Config(64, 64, 4, 2)
    if bd <= 64:
        return Config(128, 64, 4, 3)
    if bd <= 128:
        return Config(128, 128, 8, 3)
    return Config(128, 64, 8, 2)


def gluon_plans(d: int, dtype: torch.dtype, device: torch.device, interpret: bool) -> bool:
    """Whether a call's prefill and chunk items are planned for ``ragged_prefill``: on by
    ``GLUON_PREFILL``, 16-bit on a Hopper GPU, a head dim ``hopper.gluon_box`` takes. Call-level
    facts only, so a sequence's plan stays its own (batch invariance)."""
    if not GLUON_PREFILL or interpret or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    from . import hopper

    return hopper.gluon_box(d) is not None and hopper._hopper(device)


def page_block(block_n: int, page: int) -> bool:
    """Whether a paged launch streaming ``block_n`` keys a block reads one block-table entry a block:
    where page_tokens is a multiple of block_n, every key block lies in one page (block starts are
    multiples of block_n, split starts multiples of ``SPLIT_KEY_QUANTUM``), so its rows sit at one
    stride from one page's base, as contiguous keys do; else the kernel looks a page up per key.
    BLOCK_N itself stays the class's (paged and contiguous keys give the same bits)."""
    return page % block_n == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: a small GPU, so that decode shapes take the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def sequence_class(n_q: int, n_k: int, group: int) -> int:
    """The index in ``CLASSES`` of a sequence of n_q rows against n_k keys (GQA group size ``group``)."""
    if n_q * group <= PACK_ROWS:
        return 0
    return 2 if n_k >= 2 * n_q else 1


@functools.lru_cache(maxsize=65536)
def sequence_plan(n_q: int, n_k: int, hq: int, hkv: int, block_ms: tuple[int, int, int],
                  sms: int) -> tuple[int, int, int, int]:
    """(class, row tiles, splits, keys per split) of one sequence, ``block_ms`` the BLOCK_M of each
    of ``CLASSES``: from its own lengths and the static configuration only (module docstring, batch
    invariance). A sequence is split when its programs alone fill less than one wave of SMs and it
    has at least two quanta of keys; the splits are whole quanta, at most ``MAX_SPLITS``, none empty."""
    group = hq // hkv
    cls = sequence_class(n_q, n_k, group)
    decode = cls == 0
    tiles = _cdiv(n_q * group if decode else n_q, block_ms[cls])
    programs = tiles * (hkv if decode else hq)
    splits = 1
    if (decode or n_q <= 64) and programs < sms and n_k >= 2 * SPLIT_KEY_QUANTUM:
        splits = min(_cdiv(SPLIT_WAVES * sms, programs), n_k // SPLIT_KEY_QUANTUM, MAX_SPLITS)
    if splits == 1:
        return cls, tiles, 1, n_k
    kps = _cdiv(_cdiv(n_k, splits), SPLIT_KEY_QUANTUM) * SPLIT_KEY_QUANTUM
    return cls, tiles, _cdiv(n_k, kps), kps


def sequence_plans(n_q: np.ndarray, n_k: np.ndarray, hq: int, hkv: int, block_ms: tuple[int, int, int],
                   sms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``sequence_plan`` of every sequence at once, as int64 arrays (class, row tiles, splits, keys
    per split); a sequence of no query rows gets (1, 0, 1, 0), as ``plan_layout`` gives it."""
    group = hq // hkv
    decode = n_q * group <= PACK_ROWS
    cls = np.where(decode, 0, np.where(n_k >= 2 * n_q, 2, 1))
    tiles = -(-np.where(decode, n_q * group, n_q) // np.asarray(block_ms, dtype=np.int64)[cls])
    programs = np.maximum(tiles * np.where(decode, hkv, hq), 1)
    can = (decode | (n_q <= 64)) & (programs < sms) & (n_k >= 2 * SPLIT_KEY_QUANTUM)
    want = np.minimum(np.minimum(-(-(SPLIT_WAVES * sms) // programs), n_k // SPLIT_KEY_QUANTUM), MAX_SPLITS)
    splits = np.where(can, want, 1)
    per_split = -(-n_k // splits)
    kps = -(-per_split // SPLIT_KEY_QUANTUM) * SPLIT_KEY_QUANTUM
    split = splits > 1
    kps = np.where(split, kps, n_k)
    splits = np.where(split, -(-n_k // np.maximum(kps, 1)), 1)
    empty = n_q <= 0
    return (np.where(empty, 1, cls), np.where(empty, 0, tiles), np.where(empty, 1, splits), np.where(empty, 0, kps))


@dataclass
class Plan:
    """One call's work, packed into one int32 device buffer (one host-to-device copy)."""

    seq: torch.Tensor          # (S, SEQ_FIELDS)
    decode: torch.Tensor       # (n, WORK_FIELDS) work items of decode sequences
    prefill: torch.Tensor      # (n, WORK_FIELDS) work items of prefill sequences
    chunk: torch.Tensor        # (n, WORK_FIELDS) work items of chunk sequences
    merge: torch.Tensor        # (n, MERGE_FIELDS) tokens of split sequences
    part_rows: int             # rows of the partial buffers
    cfgs: tuple[Config, Config, Config]   # each of CLASSES' config

    def launches(self) -> list[tuple[torch.Tensor, Config, bool]]:
        """(work items, config, packed) of each class's launch, in ``CLASSES`` order."""
        return [(self.decode, self.cfgs[0], True), (self.prefill, self.cfgs[1], False),
                (self.chunk, self.cfgs[2], False)]

    @classmethod
    def over(cls, buf: torch.Tensor, layout: PlanLayout) -> Plan:
        """The plan whose int32 rows are ``buf`` (the flat list of ``layout``, copied there)."""
        views, at = [], 0
        for rows, width in layout.shapes:
            views.append(buf[at:at + rows * width].view(rows, width))
            at += rows * width
        return cls(*views, part_rows=layout.part_rows, cfgs=layout.cfgs)


@dataclass(frozen=True)
class PlanLayout:
    """A plan before it is on a device: its int32 values, flat (seq rows, then each class's work
    items, then the merge rows), the (rows, width) of each of those parts, the partial rows and the
    classes' configs. Two calls of equal ``shapes`` and ``cfgs`` launch the same grids; only the
    values differ (a CUDA graph captured over one replays the other with its values copied in)."""

    flat: Sequence[int] | np.ndarray
    shapes: tuple[tuple[int, int], ...]
    part_rows: int
    cfgs: tuple[Config, Config, Config]


SMALL_PLAN_ITEMS = 256  # up to this many work items a plan is listed in plain Python (numpy's per-call cost dominates)
SMALL_PLAN_SEQS = 16  # past this many sequences their plans are worked out with numpy, all at once


def plan_layout(q_lens: Sequence[int], k_lens: Sequence[int], k_starts: Sequence[int] | None,
                hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, causal: bool,
                interpret: bool) -> PlanLayout:
    """Plan every sequence alone (``sequence_plan``) and list the work items: per sequence, its row
    tiles by its key splits, in that order; prefill and chunk items are then ordered longest first
    (better tail balance; the order changes no bits). This runs on every call whose lengths are new
    (a decode step's are, each step): a plan of at most ``SMALL_PLAN_ITEMS`` items is listed in
    plain Python, a larger one (a step of many long sequences has hundreds of split items) with
    numpy over every item at once; both give the same plan. A step of more than
    ``SMALL_PLAN_SEQS`` sequences that all decode takes the plan of an earlier step with the same
    rows, tiles and splits and writes its key counts into it (``_decode_template``)."""
    gluon = gluon_plans(d, dtype, device, interpret)
    cfgs = tuple(kernel_config(c, d, dtype, interpret, gluon) for c in CLASSES)
    block_ms = tuple(c.block_m for c in cfgs)
    sms = num_sms(device)
    nq_l = [int(x) for x in q_lens]
    nk_l = [int(x) for x in k_lens]
    if len(nq_l) != len(nk_l):
        raise ValueError(f"{len(nq_l)} query lengths but {len(nk_l)} key lengths")
    if len(nq_l) > SMALL_PLAN_SEQS:
        nk_a = np.asarray(nk_l, dtype=np.int64)
        arrays = sequence_plans(np.asarray(nq_l, dtype=np.int64), nk_a, hq, hkv, block_ms, sms)
        if k_starts is None and not arrays[0].any() and min(nq_l) > 0:  # every sequence decodes
            cls, tiles, splits, kps = arrays
            template = _decode_template(tuple(nq_l), tiles.tobytes(), splits.tobytes(),
                                        np.where(splits > 1, kps, 0).tobytes(), block_ms)
            flat = template.flat.copy()
            flat[template.at] = nk_a[template.seq]
            return PlanLayout(flat, template.shapes, template.part_rows, cfgs)
        small = int((arrays[1] * arrays[2]).sum()) <= SMALL_PLAN_ITEMS
        plans = list(zip(*(a.tolist() for a in arrays), strict=True)) if small else None
    else:
        plans = [sequence_plan(a, b, hq, hkv, block_ms, sms) if a > 0 else (1, 0, 1, 0)
                 for a, b in zip(nq_l, nk_l, strict=True)]
        small = sum(p[1] * p[2] for p in plans) <= SMALL_PLAN_ITEMS
        arrays = None if small else tuple(np.asarray(plans, dtype=np.int64).reshape(-1, 4).T)
    if small:
        flat, shapes, part_rows = _list_plan(nq_l, nk_l, k_starts, plans, block_ms, causal)
    else:
        flat, shapes, part_rows = _numpy_plan(nq_l, nk_l, k_starts, arrays, block_ms, causal)
    return PlanLayout(flat, tuple(tuple(int(x) for x in sh) for sh in shapes), part_rows, cfgs)


@dataclass(frozen=True)
class _Template:
    """The plan of decode sequences of given row counts, tiles and key splits, whatever their key
    counts: each key count ``nk[s]`` goes at the ``flat`` positions ``at`` where ``seq == s``."""

    flat: np.ndarray
    shapes: tuple[tuple[int, int], ...]
    part_rows: int
    at: np.ndarray
    seq: np.ndarray


@functools.lru_cache(maxsize=256)  # (~20 KB each for 64 long sequences)
def _decode_template(nq: tuple[int, ...], tiles_b: bytes, splits_b: bytes, kps_b: bytes,
                     block_ms: tuple[int, ...]) -> _Template:
    """``plan_layout`` of decode sequences (none empty, keys from 0), less their key counts, which
    enter it in two places only: a sequence's row (q0, n_q, 0, n_k) and the end (k1) of each of its
    row tiles' last split; every other value follows from n_q, the tiles, the splits and the keys a
    split (the splits of a sequence end at multiples of that, its last at n_k). A decode step repeats
    these for many steps as its sequences grow: only the key counts are written."""
    tiles = np.frombuffer(tiles_b, dtype=np.int64)
    splits = np.frombuffer(splits_b, dtype=np.int64)
    kps = np.frombuffer(kps_b, dtype=np.int64)
    n_seq = len(nq)
    nk = np.where(splits > 1, splits * kps, 1)  # key counts with these plans (a split's last ends at n_k)
    plans = (np.zeros(n_seq, np.int64), tiles, splits, np.where(splits > 1, kps, nk))
    flat, shapes, part_rows = _numpy_plan(list(nq), nk.tolist(), None, plans, block_ms, False)
    per = tiles * splits  # work items of each sequence: its tiles by its splits, split fastest
    s_of = np.repeat(np.arange(n_seq), per)
    j = (np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)) % splits[s_of]
    last = np.flatnonzero(j == splits[s_of] - 1)
    rows_at = 4 * n_seq  # the sequences' rows come first, then the decode items (5 values each)
    at = np.concatenate([4 * np.arange(n_seq) + 3, rows_at + 5 * last + 3])
    seq = np.concatenate([np.arange(n_seq), s_of[last]])
    return _Template(np.asarray(flat, dtype=np.int32), tuple(tuple(int(x) for x in sh) for sh in shapes),
                     part_rows, at, seq)


def build_plan(q_lens: Sequence[int], k_lens: Sequence[int], k_starts: Sequence[int] | None,
               hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, causal: bool,
               interpret: bool) -> Plan:
    """``plan_layout``'s plan in one int32 buffer on ``device`` (one host-to-device copy)."""
    layout = plan_layout(q_lens, k_lens, k_starts, hq, hkv, d, dtype, device, causal, interpret)
    # on a GPU pinned and copied in stream order (a pageable copy would wait for the device)
    cuda = device.type == "cuda"
    host = torch.empty(max(1, len(layout.flat)), dtype=torch.int32, pin_memory=cuda)
    host.numpy()[: len(layout.flat)] = layout.flat
    buf = host.to(device, non_blocking=True) if cuda else host
    return Plan.over(buf, layout)


def _list_plan(nq: list[int], nk: list[int], k_starts: Sequence[int] | None, plans: list[tuple[int, ...]],
               block_ms: tuple[int, ...], causal: bool) -> tuple[list[int], list[tuple[int, int]], int]:
    """``build_plan``'s buffer as one flat list: seq rows, decode, prefill, chunk items, merge rows,
    with their (rows, width); and the partial rows."""
    seq_rows: list[int] = []
    work: list[list[tuple[int, ...]]] = [[] for _ in CLASSES]
    cost: list[list[int]] = [[] for _ in CLASSES]
    merge: list[int] = []
    part_rows = q0 = 0
    for s, (n_q, n_k) in enumerate(zip(nq, nk, strict=True)):
        seq_rows += (q0, n_q, 0 if k_starts is None else int(k_starts[s]), n_k)
        if n_q > 0:
            cls, tiles, splits, kps = plans[s]
            base = -1
            if splits > 1:
                base, part_rows = part_rows, part_rows + splits * n_q
                for i in range(n_q):
                    merge += (q0 + i, base + i, n_q, splits)
            for tile in range(tiles):
                for j in range(splits):
                    k0 = j * kps
                    k1 = min(k0 + kps, n_k)
                    work[cls].append((s, tile, k0, k1, base + j * n_q if splits > 1 else -1))
                    if cls > 0:
                        hi = min(k1, (tile + 1) * block_ms[cls] + n_k - n_q) if causal else k1
                        cost[cls].append(k0 - hi)
        q0 += n_q
    flat = seq_rows
    shapes = [(len(nq), 4)]
    for c, items in enumerate(work):
        if c > 0 and items:  # row tiles: longest first (a stable sort, as numpy's below)
            items = [items[i] for i in sorted(range(len(items)), key=cost[c].__getitem__)]
        for item in items:
            flat += item
        shapes.append((len(items), 5))
    flat += merge
    shapes.append((len(merge) // 4, 4))
    return flat, shapes, part_rows


def _numpy_plan(nq_l: list[int], nk_l: list[int], k_starts: Sequence[int] | None, plans: tuple[np.ndarray, ...],
                block_ms: tuple[int, ...], causal: bool) -> tuple[np.ndarray, list[tuple[int, int]], int]:
    """``_list_plan``'s buffer, built with numpy over every item at once; ``plans`` the sequences'
    (class, tiles, splits, keys per split) as arrays."""
    n_seq = len(nq_l)
    nq = np.asarray(nq_l, dtype=np.int64).reshape(-1)
    nk = np.asarray(nk_l, dtype=np.int64).reshape(-1)
    q0 = np.concatenate([[0], np.cumsum(nq)[:-1]]) if n_seq else np.zeros(0, np.int64)
    ks = np.zeros(n_seq, np.int64) if k_starts is None else np.asarray(k_starts, dtype=np.int64).reshape(-1)
    cls, tiles, splits, kps = plans
    # partial rows: a split sequence takes splits x n_q rows, in sequence order
    part = np.where(splits > 1, splits * nq, 0)
    base = np.concatenate([[0], np.cumsum(part)[:-1]]) if n_seq else np.zeros(0, np.int64)
    part_rows = int(part.sum())
    # work items: (s, tile, k0, k1, partial row or -1), tile-major then split within a sequence
    per = tiles * splits
    s_of = np.repeat(np.arange(n_seq), per)
    within = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    sp = splits[s_of]
    tile, j = within // sp, within % sp
    k0 = j * kps[s_of]
    k1 = np.minimum(k0 + kps[s_of], nk[s_of])
    row = np.where(sp > 1, base[s_of] + j * nq[s_of], -1)
    items = np.stack([s_of, tile, k0, k1, row], axis=1).astype(np.int32).reshape(-1, 5)
    item_cls = cls[s_of]
    work = []
    for c in range(len(CLASSES)):
        mask = item_cls == c
        got = items[mask]
        if c > 0 and len(got):  # row tiles: longest first
            ps, pt, pk0, pk1 = s_of[mask], tile[mask], k0[mask], k1[mask]
            hi = np.minimum(pk1, (pt + 1) * block_ms[c] + nk[ps] - nq[ps]) if causal else pk1
            got = got[np.argsort(pk0 - hi, kind="stable")]
        work.append(got)
    # merge rows: each query row of a split sequence, (its row, its first partial row, n_q, splits)
    split_seq = np.flatnonzero(splits > 1)
    m_s = np.repeat(split_seq, nq[split_seq])
    m_i = np.arange(len(m_s)) - np.repeat(np.cumsum(nq[split_seq]) - nq[split_seq], nq[split_seq])
    merge = np.stack([q0[m_s] + m_i, base[m_s] + m_i, nq[m_s], splits[m_s]], axis=1).astype(np.int32).reshape(-1, 4)
    seq_rows = np.stack([q0, nq, ks, nk], axis=1).astype(np.int32).reshape(-1, 4)
    parts = [seq_rows, *work, merge]
    return np.concatenate([p.reshape(-1) for p in parts]), [p.shape for p in parts], part_rows


@functools.lru_cache(maxsize=256)
def cached_plan(q_lens: tuple[int, ...], k_lens: tuple[int, ...], k_starts: tuple[int, ...] | None, hq: int, hkv: int,
                d: int, dtype: torch.dtype, device: torch.device, causal: bool, interpret: bool,
                stream: int | None = None, gluon_prefill: bool = True) -> Plan:
    """``build_plan``, kept for lengths seen before (a repeated batch skips the host work and the
    host-to-device copy; the device buffers are only ever read). Kept per CUDA ``stream`` (its id):
    the plan's copy is ordered on the stream it was built on, so only launches on that stream may
    read it without waiting. ``gluon_prefill`` is ``GLUON_PREFILL`` at the call, part of the key
    only: the plan's row tiles follow it (``gluon_plans``)."""
    return build_plan(q_lens, k_lens, k_starts, hq, hkv, d, dtype, device, causal, interpret)


# ---- no backward ----

class _NoBackward(torch.autograd.Function):
    """The answer of a ragged or paged call whose inputs require grad: its backward raises, where
    a detached answer would leave attention's share out of the gradient without a word."""

    @staticmethod
    def forward(ctx, name, o, lse, *inputs):  # noqa: ANN001, ARG004 - autograd's signature
        ctx.name = name
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ARG004
        raise NotImplementedError(f"{ctx.name} has no backward (its answer is computed without gradients): train "
                                  "with kernels.attention, one sequence a call, or call it under torch.no_grad()")


def no_backward(name: str, o: torch.Tensor, lse: torch.Tensor, *inputs: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse), tied to ``inputs`` by ``_NoBackward`` where grad mode is on and one requires grad."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _NoBackward.apply(name, o, lse, *(t for t in inputs if t is not None))
    return o, lse


# ---- launches ----

def plain_launcher() -> Callable:
    """The project's cached launcher of plain ``@triton.jit`` kernels (``launch.launch_plain``)."""
    from .launch import launch_plain

    return launch_plain


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for pointer arguments a launch does not read."""
    return torch.zeros(1, dtype=dtype, device=device)


def flash_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Sequence[int],
                 k_lens: Sequence[int], *, causal: bool, scale: float, k_starts: Sequence[int] | None = None,
                 block_table: torch.Tensor | None = None,
                 masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """o (Tq, Hq, D) in q's dtype and lse (Hq, Tq) float32 by ``ragged_fwd`` (and ``ragged_merge``);
    ``masks``' ALiBi slopes are (1 or S, Hq).

    Varlen (``block_table`` None): k, v (Tk, Hkv, D), sequence s's keys at rows
    k_starts[s] : k_starts[s] + k_lens[s]. Paged: k, v (P, page_tokens, Hkv, D), key j of sequence
    s at page block_table[s, j // page_tokens], row j % page_tokens."""
    t_q, hq, d = q.shape
    dev = q.device
    if t_q == 0:
        return (torch.empty(t_q, hq, d, dtype=q.dtype, device=dev),
                torch.empty(hq, t_q, dtype=torch.float32, device=dev))
    interpret = triton_interpret() and dev.type == "cpu"
    stream = torch.cuda.current_stream(dev).stream_id if dev.type == "cuda" else None
    plan = cached_plan(tuple(q_lens), tuple(k_lens), None if k_starts is None else tuple(k_starts), hq,
                       k.shape[-2], d, q.dtype, dev, bool(causal), interpret, stream, GLUON_PREFILL)
    return launch_plan(q, k, v, plan, causal=causal, scale=scale, block_table=block_table, masks=masks)


def launch_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, *, causal: bool, scale: float,
                block_table: torch.Tensor | None = None,
                masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_ragged``'s launches over a plan already on q's device (of the call's lengths): reads
    nothing on the host, so a CUDA graph can capture it over a plan buffer that each replay fills."""
    from .jit import varlen as jit

    t_q, hq, d = q.shape
    hkv = k.shape[-2]
    dev = q.device
    o = torch.empty(t_q, hq, d, dtype=q.dtype, device=dev)
    lse = torch.empty(hq, t_q, dtype=torch.float32, device=dev)
    part_rows = max(plan.part_rows, 1)
    o_part = torch.empty(part_rows, hq, d, dtype=torch.float32, device=dev) if plan.part_rows else \
        _placeholder(dev, torch.float32)
    lse_part = torch.empty(part_rows, hq, dtype=torch.float32, device=dev) if plan.part_rows else o_part
    paged = block_table is not None
    if paged:
        page = k.shape[1]
        kst, vst = k.stride(), v.stride()
        bt, bt_strides = block_table, block_table.stride()
    else:
        page = 1
        kst, vst = (0, *k.stride()), (0, *v.stride())
        bt, bt_strides = _placeholder(dev, torch.int32), (0, 0)
    from .plan import alibi_arg

    slopes, stride_as, stride_ah = alibi_arg(masks, dev)
    launch = plain_launcher()
    bd = block_d(d)
    for work, cfg, decode in plan.launches():
        if work.shape[0] == 0:
            continue
        descs = gluon_decode_descriptors(q, k, v, paged, cfg, masks) if decode and paged else None
        if descs is not None:
            from .jit.gluon_paged import paged_decode, paged_decode_ws

            args = (q, *descs, o, lse, o_part, lse_part, work, plan.seq, bt, *bt_strides, *q.stride(), *o.stride(),
                    *lse.stride(), hq, hq // hkv, scale * jit.LOG2E)
            ws = page <= GLUON_DECODE_LOADER
            fn, options = (paged_decode_ws, dict(maxnreg=WS_MAXNREG)) if ws else (paged_decode, {})
            launch(fn, (work.shape[0], hkv, 1), args,
                   dict(PAGE=page, ROW_TILE=cfg.block_m, IS_CAUSAL=bool(causal), STAGES=GLUON_DECODE_STAGES,
                        BLOCK_N=GLUON_DECODE_BLOCK_N),
                   num_warps=4, **options)
            continue
        prefill = None if decode else gluon_prefill_check(q, k, v, paged, cfg, masks)
        if prefill is not None and prefill[0] is not None:
            from .jit.gluon_ragged import ragged_prefill

            descs, regs, block_n = prefill[0]
            args = (*descs, o, lse, o_part, lse_part, work, plan.seq, bt, *bt_strides, o.stride(0), o.stride(1),
                    *lse.stride(), hq, hq // hkv, d, scale * jit.LOG2E, *masks.kernel_args(), slopes, stride_as,
                    stride_ah)
            launch(ragged_prefill, (work.shape[0] * hq, 1, 1), args,
                   dict(PAGED=paged, PAGE=page, BLOCK_N=block_n, IS_CAUSAL=bool(causal), CONSUMER_REGS=regs,
                        WINDOW=masks.window, SOFTCAP=masks.softcap > 0, ALIBI=masks.alibi is not None), num_warps=4)
            continue
        args = (q, k, v, o, lse, o_part, lse_part, work, plan.seq, bt, slopes, *bt_strides, stride_as, stride_ah,
                *q.stride(), *kst, *vst, *o.stride(), *lse.stride(), hq, hq // hkv, scale * jit.LOG2E,
                *masks.kernel_args())
        consts = dict(D=d, BLOCK_D=bd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PACK=decode, PAGED=paged,
                      PAGE=page, PAGE_BLOCK=paged and page_block(cfg.block_n, page), IS_CAUSAL=bool(causal),
                      WINDOW=masks.window, SOFTCAP=masks.softcap > 0, HAS_ALIBI=masks.alibi is not None,
                      DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
        launch(jit.ragged_fwd, (work.shape[0] * (hkv if decode else hq), 1, 1), args, consts,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan.merge.shape[0]:
        args = (o_part, lse_part, o, lse, plan.merge, *o.stride(), *lse.stride(), hq)
        launch(jit.ragged_merge, (plan.merge.shape[0], hq, 1), args,
               dict(D=d, BLOCK_D=bd, BLOCK_S=MAX_SPLITS), num_warps=4 if bd <= 128 else 8)
    return o, lse


def gluon_decode_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool, cfg: Config,
                         masks: Masks = NO_MASKS) -> str | None:
    """Why ``paged_decode`` (Gluon, ``jit/gluon_paged.py``) does not run a call's decode items, or
    None when it does: paged keys whose page_tokens is a multiple of ``GLUON_DECODE_BLOCK_N`` or a
    divisor of it from ``GLUON_DECODE_MIN_PAGE`` (then the pages contiguous), 16-bit
    q, k, v at D 64 or 128, no score modifier, a Hopper GPU, pages a host TMA descriptor takes."""
    return _gluon_decode_check(q, k, v, paged, cfg, masks)[1]


def gluon_decode_descriptors(q, k, v, paged: bool, cfg: Config, masks: Masks = NO_MASKS) -> tuple | None:
    """``paged_decode``'s K and V descriptors where ``gluon_decode_refusal`` is None, else None."""
    descs, why = _gluon_decode_check(q, k, v, paged, cfg, masks)
    _tell_decode("paged_decode (Gluon)" if why is None else "ragged_fwd", why, str(q.dtype), q.shape[-1],
                 k.shape[1] if paged else 0)
    return descs


def _gluon_decode_check(q, k, v, paged: bool, cfg: Config, masks: Masks) -> tuple[tuple | None, str | None]:
    from . import hopper

    if not paged:
        return None, "varlen keys (no pages)"
    if not GLUON_DECODE:
        return None, "ragged.GLUON_DECODE is off"
    if masks.active:
        return None, "a window, softcap or ALiBi (ragged_fwd has them)"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return None, "not float16/bfloat16"
    d, page = q.shape[-1], k.shape[1]
    if d not in (64, 128):
        return None, "head_dim is not 64 or 128"
    small = page < GLUON_DECODE_BLOCK_N
    if page % GLUON_DECODE_BLOCK_N and (GLUON_DECODE_BLOCK_N % page or page < GLUON_DECODE_MIN_PAGE):
        return None, (f"page_tokens {page} is neither a multiple of {GLUON_DECODE_BLOCK_N} nor one of its "
                      f"divisors from {GLUON_DECODE_MIN_PAGE}")
    if cfg.block_m > 64:
        return None, "more than 64 rows a tile"
    if triton_interpret():
        return None, "Triton's interpreter cannot run Gluon"
    if not hopper._hopper(q.device):
        return None, "not sm_90"
    if small:
        # pages (P, page, Hkv, D) seen as (P·page, Hkv·D): a block is 64 / page boxes (page, D)
        if not (k.is_contiguous() and v.is_contiguous()):
            return None, "pages smaller than a block must be contiguous"
        descs = tuple(hopper._descriptor_2d(t.view(-1, k.shape[2] * d), page, d) for t in (k, v))
    else:
        # pages (P, page, Hkv, D) seen as (P, Hkv, page, D): a block is one (1, 1, BLOCK_N, D) box
        descs = tuple(hopper._descriptor(t.permute(0, 2, 1, 3), GLUON_DECODE_BLOCK_N) for t in (k, v))
    for name, desc in zip("kv", descs, strict=True):
        *outer, last = desc.strides
        if last != 1 or desc.base.data_ptr() % 16 or any(st % 8 or st == 0 for st in outer):
            return None, f"{name}_pages: not 16-byte aligned, or a stride TMA cannot say"
    return descs, None


def gluon_prefill_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool, cfg: Config,
                          masks: Masks = NO_MASKS) -> str | None:
    """Why ``ragged_prefill`` (Gluon, ``jit/gluon_ragged.py``) does not run a call's prefill or
    chunk items, or None when it does: 16-bit q, k, v at a head dim ``hopper.gluon_box`` takes,
    items planned in its 128-row tiles (``gluon_plans``), no ALiBi, a Hopper GPU, tensors host TMA
    descriptors take; pages a multiple of the key block, or of 64 keys (then 64-key blocks), or
    contiguous pages of 16 to 64 at the box's own head dim (a TMA copy per page)."""
    return _gluon_prefill_check(q, k, v, paged, cfg, masks)[1]


def gluon_prefill_check(q, k, v, paged: bool, cfg: Config, masks: Masks = NO_MASKS) -> tuple:
    """(((q, k, v descriptors), consumer registers, keys a block) or None, why not): ``gluon_prefill_refusal``'s
    rule, the choice logged once per combination."""
    got = _gluon_prefill_check(q, k, v, paged, cfg, masks)
    _tell_prefill("ragged_prefill (Gluon)" if got[1] is None else "ragged_fwd", got[1], str(q.dtype), q.shape[-1],
                  k.shape[1] if paged else 0)
    return got


def _gluon_prefill_check(q, k, v, paged: bool, cfg: Config, masks: Masks) -> tuple[tuple | None, str | None]:
    from . import hopper

    if not GLUON_PREFILL:
        return None, "ragged.GLUON_PREFILL is off"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return None, "not float16/bfloat16"
    d = q.shape[-1]
    box = hopper.gluon_box(d)
    if box is None:
        return None, f"head_dim {d} is not a multiple of 8 in {hopper.GLUON_MIN_D}..{max(hopper.GLUON_TILES)}"
    if cfg.block_m != GLUON_ROWS:
        return None, f"the plan's row tiles are {cfg.block_m} rows, not {GLUON_ROWS}"
    if k.numel() == 0:
        return None, "no keys (a TMA descriptor has no empty dims)"
    if triton_interpret():
        return None, "Triton's interpreter cannot run Gluon"
    if not hopper._hopper(q.device):
        return None, "not sm_90"
    block_n, _, regs = hopper.GLUON_TILES[box]
    page = k.shape[1] if paged else 0
    if paged and page % block_n:
        # pages smaller than a block: a box (page, D) per page of the (P·page, Hkv·D) view, which
        # has no room for a padded head dim
        per_page = (block_n % page == 0 and page >= GLUON_DECODE_MIN_PAGE and d == box and k.is_contiguous()
                    and v.is_contiguous())
        if not per_page:
            if page % GLUON_DECODE_BLOCK_N:
                return None, (f"page_tokens {page} is not a multiple of {GLUON_DECODE_BLOCK_N}, nor a divisor of "
                              f"{block_n} from {GLUON_DECODE_MIN_PAGE} (contiguous pages, head_dim {box})")
            block_n = GLUON_DECODE_BLOCK_N  # whole 64-key blocks in each page
    if paged and page < block_n:
        kv_descs = [hopper._descriptor_2d(t.view(-1, k.shape[2] * d), page, d) for t in (k, v)]
    else:
        # (P, Hkv, page, D), or varlen (1, Hkv, Tk, D)
        kv = [t.permute(0, 2, 1, 3) if paged else t.permute(1, 0, 2).unsqueeze(0) for t in (k, v)]
        kv_descs = [hopper._descriptor(t, block_n, box) for t in kv]
    descs = (hopper._descriptor(q.permute(1, 0, 2).unsqueeze(0), GLUON_ROWS // 2, box), *kv_descs)
    for name, desc in zip("qkv", descs, strict=True):
        *outer, last = desc.strides
        if last != 1 or desc.base.data_ptr() % 16 or any(st % 8 or st == 0 for st in outer):
            return None, f"{name}: not 16-byte aligned, or a stride TMA cannot say"
    return (descs, regs, block_n), None


@functools.cache
def _tell_prefill(kernel: str, why: str | None, dtype: str, d: int, page: int) -> None:
    """Logged once per combination: which kernel runs prefill and chunk items, and why not the other."""
    log.info("ragged prefill items (%s, D %d, page_tokens %d): %s%s", dtype.replace("torch.", ""), d, page, kernel,
             "" if why is None else f" (ragged_prefill refused: {why})")


@functools.cache
def _tell_decode(kernel: str, why: str | None, dtype: str, d: int, page: int) -> None:
    """Logged once per combination: which kernel runs paged decode items, and why not the other."""
    log.info("paged decode items (%s, D %d, page_tokens %d): %s%s", dtype.replace("torch.", ""), d, page, kernel,
             "" if why is None else f" (paged_decode refused: {why})")


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device (and its stream), wherever the tensors are."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# ---- the CPU path ----

def sequence_attention(q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, *, causal: bool,
                       scale: float, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence by the project's O(N)-memory PyTorch attention: q_s (n_q, Hq, D), k_s/v_s
    (n_k, Hkv, D) -> o (n_q, Hq, D), lse (Hq, n_q). ``cpu_attention`` on the CPU (torch's CPU flash
    kernel), ``blockwise_attention`` elsewhere."""
    from .reference import blockwise_attention, cpu_attention

    n_q, hq, d = q_s.shape
    if k_s.shape[0] == 0:
        return q_s.new_zeros(n_q, hq, d), torch.full((hq, n_q), float("-inf"), dtype=torch.float32,
                                                     device=q_s.device)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q_s, k_s, v_s))
    fn = cpu_attention if q_s.device.type == "cpu" else blockwise_attention
    o, lse = fn(q4, k4, v4, causal=causal, scale=scale, masks=masks)
    return o[0].transpose(0, 1), lse[0]


def reference_ragged(q: torch.Tensor, q_lens: Sequence[int], keys: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                     *, causal: bool, scale: float, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
    """o (Tq, Hq, D), lse (Hq, Tq): each sequence alone through ``sequence_attention``;
    ``keys(s)`` gives sequence s's k, v (n_k, Hkv, D); ``masks``' ALiBi slopes are (1 or S, Hq)."""
    t_q, hq, d = q.shape
    o = torch.empty(t_q, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, t_q, dtype=torch.float32, device=q.device)
    q0 = 0
    for s, n_q in enumerate(q_lens):
        if n_q:
            k_s, v_s = keys(s)
            # a fresh copy: the CPU's matmuls round by the operand's address (an 8-byte-aligned q gives
            # other bits than a 64-byte-aligned one), so a row's answer must not depend on where it
            # lies in the packed q, or in the request's buffer
            q_s = q[q0:q0 + n_q].clone(memory_format=torch.contiguous_format)
            o_s, lse_s = sequence_attention(q_s, k_s, v_s, causal=causal, scale=scale, masks=masks.sliced(s, s + 1))
            o[q0:q0 + n_q], lse[:, q0:q0 + n_q] = o_s, lse_s
        q0 += n_q
    return o, lse


# ---- which implementation ----

def choose_ragged(what: str, device: torch.device, dtype: torch.dtype, kernel: str) -> str:
    """"flash" (the Triton kernels) or "reference" (the per-sequence PyTorch loop) for ``what``
    ("varlen", "paged"); raises ``KernelUnavailableError`` where ``kernel`` cannot run. "auto": the
    Triton kernels on CUDA and under TRITON_INTERPRET=1 (except bfloat16, which the interpreter
    computes wrongly), else the CPU loop. Logged once per combination, with the reasons."""
    return _choose(what, device.type, dtype, kernel, triton_interpret())


@functools.cache
def _choose(what: str, device_type: str, dtype: torch.dtype, kernel: str, interpret: bool) -> str:
    if kernel not in RAGGED_KERNELS:
        extra = " (flash_v1 has no ragged or paged form)" if kernel == "flash_v1" else ""
        raise KernelUnavailableError(f"unknown kernel {kernel!r} for {what} attention{extra}; "
                                     f"choose one of {', '.join(RAGGED_KERNELS)}")
    if kernel == "reference":
        return "reference"
    refusal = triton_refusal(device_type, interpret, dtype)
    if kernel == "flash":
        if refusal:
            raise KernelUnavailableError(f"kernel 'flash' cannot run: {refusal}")
        return "flash"
    name = "reference" if refusal else "flash"
    refused = {"flash": refusal} if refusal else {
        "reference": "one PyTorch call per sequence (S launches, no paged reads)"}
    log.info("%s attention kernel for %s %s: %s (refused: %s)", what, device_type, str(dtype).replace("torch.", ""),
             name, "; ".join(f"{k}: {v}" for k, v in refused.items()))
    return name
