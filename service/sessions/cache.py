"""The paged KV cache of one worker: pages of keys and values on its device, under a byte budget.

    cache = KVCache(device, capacity_bytes=256 << 20, page_tokens=64)
    kv = SequenceKV()                                   # one layer of one session: length 0, no pages
    r = cache.reserve(geometry, [(kv, n_new)])          # pages for C + n keys; kv.length = C + n
    ... append_paged / attention_paged over cache.arena(geometry).k, .v and kv.pages ...
    cache.rollback(r)                                   # on failure: kv.length = C, new pages returned
    cache.release(geometry, [kv, ...])                  # the session ended: every page returned

Arenas. Sequences of one geometry (num_kv_heads, head_dim, dtype) share one pair of tensors
``k``, ``v``: (P, page_tokens, Hkv, D), so that the steps of all of them can go through one
``kernels.append_paged`` and one ``kernels.attention_paged`` launch. Sequence s's key j lives at
page ``kv.pages[j // page_tokens]``, row ``j % page_tokens``; slots past its length hold anything.

Growth. An arena that has too few free pages is reallocated (``_resize``): a new pair of tensors at
about twice the size (at least what is needed, at most what the budget allows), the pages in use
copied over, the sequences' page indices remapped. The budget bounds the tensors allocated over every
geometry (``allocated_bytes <= capacity_bytes``): when an arena cannot grow because others hold
allocated but free pages, those others are first shrunk to their pages in use (the same repacking).
So a step is refused (``NoRoom``, 507) exactly when the pages in use plus the step's new pages would
pass the budget, and no sequence is ever evicted to make room. An arena whose last page is returned
drops its tensors. Free pages are taken lowest index first, so that shrinking rarely moves pages.

Threads. Every method here runs on the worker's launcher thread (``Worker.run_on_device``), in order
with its launches: a resize (a device copy on the worker's stream) comes after the launches enqueued
before it, so no launch reads a page that is being moved or reused. The event loop only reads the
counters (``used_bytes``, ``kv.length``) for descriptions and metrics.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass, field

import torch

from service.errors import InsufficientStorage, size_text

MIN_ARENA_PAGES = 16  # the first allocation of a geometry


@dataclass(frozen=True)
class Geometry:
    """What sessions must share to share an arena (and a launch)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one page of keys plus one of values."""
        return 2 * page_tokens * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(eq=False, slots=True)
class SequenceKV:
    """One layer of one session: its length C and the pages holding its keys 0..C-1, in order (int32,
    the block table's type: a launch copies the row as it is)."""

    length: int = 0
    pages: array = field(default_factory=lambda: array("i"))


@dataclass(eq=False)
class Arena:
    geometry: Geometry
    k: torch.Tensor | None = None  # (size, page_tokens, Hkv, D)
    v: torch.Tensor | None = None
    size: int = 0
    free: list[int] = field(default_factory=list)  # a heap of free page indices
    seqs: set[SequenceKV] = field(default_factory=set)  # sequences holding pages here

    @property
    def used(self) -> int:
        return self.size - len(self.free)


@dataclass
class Reservation:
    """What ``reserve`` did, for ``rollback``: (sequence, length before, pages taken) each."""

    geometry: Geometry
    entries: list[tuple[SequenceKV, int, int]]


class NoRoom(InsufficientStorage):
    """The step's new keys do not fit in the cache (507)."""


class KVCache:
    def __init__(self, device: torch.device | str, capacity_bytes: int, page_tokens: int):
        if page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")
        self.device = torch.device(device)
        self.capacity_bytes = int(capacity_bytes)
        self.page_tokens = int(page_tokens)
        self.arenas: dict[Geometry, Arena] = {}
        self.used_bytes = 0  # pages in use, over every geometry
        self.allocated_bytes = 0  # arena tensors, over every geometry (<= capacity_bytes)

    # ---- reading ------------------------------------------------------------------------------

    def arena(self, geometry: Geometry) -> Arena:
        a = self.arenas.get(geometry)
        if a is None:
            a = self.arenas[geometry] = Arena(geometry)
        return a

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_tokens)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def pages_free(self) -> int:
        """Allocated pages not in use, over every geometry."""
        return sum(len(a.free) for a in self.arenas.values())

    def seq_bytes(self, geometry: Geometry, kv: SequenceKV) -> int:
        return len(kv.pages) * geometry.page_bytes(self.page_tokens)

    # ---- taking and returning pages ---------------------------------------------------------------

    def reserve(self, geometry: Geometry, grow: list[tuple[SequenceKV, int]]) -> Reservation:
        """Pages for ``n`` more keys of each sequence; each ``kv.length`` becomes C + n. All or
        nothing: raises ``NoRoom`` (nothing changed) when the pages in use would pass the budget."""
        pt = self.page_tokens
        need = [max(0, -(-(kv.length + n) // pt) - len(kv.pages)) for kv, n in grow]
        total = sum(need)
        page_bytes = geometry.page_bytes(self.page_tokens)
        if self.used_bytes + total * page_bytes > self.capacity_bytes:
            raise NoRoom(
                f"no room in the KV cache on {self.device}: this step needs {size_text(total * page_bytes)} "
                f"more ({total} pages of {self.page_tokens} tokens), {size_text(self.free_bytes)} of "
                f"{size_text(self.capacity_bytes)} are free (--kv-cache-mb); end sessions you no longer "
                "need (DELETE /sessions/{id} or end=true) or retry later"
            )
        arena = self.arena(geometry)
        if total:
            self._ensure_free(arena, total)
        entries = []
        held = arena.seqs
        for (kv, n), k in zip(grow, need, strict=True):
            if k:
                for _ in range(k):
                    kv.pages.append(heapq.heappop(arena.free))
                held.add(kv)
            entries.append((kv, kv.length, k))
            kv.length += n
        self.used_bytes += total * page_bytes
        return Reservation(geometry, entries)

    def rollback(self, r: Reservation) -> None:
        """Undo ``reserve``: each length back, the pages it took returned."""
        arena = self.arena(r.geometry)
        for kv, length, taken in reversed(r.entries):
            self._give_back(arena, kv, taken)
            kv.length = length

    def truncate(self, geometry: Geometry, kv: SequenceKV, length: int) -> None:
        """Shorten a sequence to ``length`` keys (undoing a step that succeeded on this worker
        while its packed step failed on another), returning the pages past it."""
        arena = self.arena(geometry)
        self._give_back(arena, kv, len(kv.pages) - self.pages_for(length))
        kv.length = length

    def release(self, geometry: Geometry, seqs: list[SequenceKV]) -> None:
        """Return every page of ``seqs`` (their session ended); an emptied arena drops its tensors."""
        arena = self.arena(geometry)
        for kv in seqs:
            self._give_back(arena, kv, len(kv.pages))
            kv.length = 0

    def _give_back(self, arena: Arena, kv: SequenceKV, count: int) -> None:
        for _ in range(max(0, count)):
            heapq.heappush(arena.free, kv.pages.pop())
        self.used_bytes -= max(0, count) * arena.geometry.page_bytes(self.page_tokens)
        if not kv.pages:
            arena.seqs.discard(kv)
        if arena.size and arena.used == 0:
            self._drop(arena)

    # ---- growing and shrinking arenas -----------------------------------------------------------------

    def _ensure_free(self, arena: Arena, count: int) -> None:
        if len(arena.free) >= count:
            return
        page_bytes = arena.geometry.page_bytes(self.page_tokens)
        want = arena.used + count
        room = (self.capacity_bytes - (self.allocated_bytes - arena.size * page_bytes)) // page_bytes
        if room < want:  # other geometries hold free pages: shrink them to what they use
            for other in list(self.arenas.values()):
                if other is not arena and other.free:
                    self._resize(other, other.used)
            room = (self.capacity_bytes - (self.allocated_bytes - arena.size * page_bytes)) // page_bytes
        size = min(max(want, 2 * arena.size, MIN_ARENA_PAGES), room)
        assert size >= want, "reserve checked the budget"
        self._resize(arena, size)

    def _resize(self, arena: Arena, size: int) -> None:
        """Reallocate ``arena`` at ``size`` pages (>= its pages in use), keeping every page in use
        (remapped when it lies past the new size)."""
        if size == 0:
            self._drop(arena)
            return
        g = arena.geometry
        shape = (size, self.page_tokens, g.num_kv_heads, g.head_dim)
        k = torch.empty(shape, dtype=g.dtype, device=self.device)
        v = torch.empty(shape, dtype=g.dtype, device=self.device)
        keep = min(size, arena.size)
        if keep:
            k[:keep].copy_(arena.k[:keep])
            v[:keep].copy_(arena.v[:keep])
        free = sorted(arena.free)
        if size < arena.size:  # move the pages in use past the end into free slots before it
            free_set = set(free)
            moved = [p for p in range(size, arena.size) if p not in free_set]
            slots = [p for p in free if p < size][: len(moved)]
            if moved:
                src, dst = torch.tensor(moved, device=self.device), torch.tensor(slots, device=self.device)
                k[dst] = arena.k[src]
                v[dst] = arena.v[src]
                remap = dict(zip(moved, slots, strict=True))
                for kv in arena.seqs:
                    kv.pages = array("i", [remap.get(p, p) for p in kv.pages])
            new_free = [p for p in free if p < size and p not in set(slots)]
        else:
            new_free = free + list(range(arena.size, size))
        heapq.heapify(new_free)
        page_bytes = g.page_bytes(self.page_tokens)
        self.allocated_bytes += (size - arena.size) * page_bytes
        arena.k, arena.v, arena.size, arena.free = k, v, size, new_free

    def _drop(self, arena: Arena) -> None:
        self.allocated_bytes -= arena.size * arena.geometry.page_bytes(self.page_tokens)
        arena.k = arena.v = None
        arena.size = 0
        arena.free = []
        self.arenas.pop(arena.geometry, None)
