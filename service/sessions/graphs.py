"""CUDA graphs of lone session steps: a step that runs inline (``--session-inline-rows``), of one
session or a packed step of many, replays a captured append + paged attention instead of launching
them from Python.

A graph is captured per ``StepGraphs.key``: what the kernels see (heads, geometry, causal, scale,
window, cap), the step's sessions and rows and whether it appends, its block table's width rounded
up to a power of two, the shape of its plan (``kernels.ragged.PlanLayout``: how many work items of
each class, how many partial rows) and the arena's tensors. The values that change from step to
step (the lengths, the table rows, q, k, v, the plan's work items) are inputs: each replay copies
them into the graph's static buffer in one host-to-device copy, laid out as ``packing`` lays out a
launch's. A decode step of growing sessions keeps its key for many steps: a session's split count
stops changing past a few thousand keys, its table width doubles rarely; the layers of one
decode step share theirs.

A replay runs the kernels that ``kernels.append_paged`` and ``kernels.attention_paged`` launch
for this step, over the same plan (``kernels.ragged.plan_layout`` of its own lengths), so its
answer is bit for bit the usual one, and each session's the same as in any other launch (batch
invariance). The first step of a key takes the usual path and asks for a capture, which the
worker's launcher thread makes after it, in order with its launches. Steps with ALiBi slopes, or
over ``--graph-max-kib``, take the usual path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from kernels.masks import check_masks
from kernels.ragged import Plan, PlanLayout, launch_plan, plan_layout
from kernels.spec import check_scale
from service.core.staging import carve, host_copy
from service.sessions.cache import KVCache
from service.sessions.packing import pack

log = logging.getLogger("attnserve.sessions")

GRAPHS_PER_WORKER = 64  # captured step keys kept per worker (they share one memory pool)
def table_width(pages: int) -> int:
    """The block table's width in a graph: a power of two >= 8, so that a growing session keeps its
    graph while its page count doubles (entries past its pages are never read)."""
    return max(8, 1 << (max(pages, 1) - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def _layout(q_lens: tuple[int, ...], k_lens: tuple[int, ...], hq: int, hkv: int, d: int, dtype: torch.dtype,
            device: torch.device, causal: bool) -> PlanLayout:
    """The plan of sequences of q_lens rows over k_lens keys, as ``attention_paged`` plans them (the
    layers of a decode step, and the steps of one session, repeat their lengths)."""
    return plan_layout(q_lens, k_lens, None, hq, hkv, d, dtype, device, causal, False)


@dataclass(frozen=True)
class Recipe:
    """What a capture needs of the step that asked for it (the step's tensors are not kept)."""

    geometry: Any  # service.sessions.cache.Geometry
    heads_q: int
    seqs: int
    rows: int
    appends: bool
    width: int
    layout: PlanLayout
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float


def _shapes(r: Recipe) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """index int32, q, (k, v,) plan int32: the graph's inputs, in its static buffer's order."""
    g, n = r.geometry, r.rows
    shapes = [(torch.int32, (4 * r.seqs + 2 + r.seqs * r.width,)), (g.dtype, (n, r.heads_q, g.head_dim))]
    if r.appends:
        shapes += [(g.dtype, (n, g.num_kv_heads, g.head_dim))] * 2
    shapes.append((torch.int32, (max(1, len(r.layout.flat)),)))
    return shapes


class StepGraph:
    """One key's captured append + paged attention over static device inputs (``dev_in``, filled
    from the pinned ``host_in``), writing static o (n, Hq, D) and lse (Hq, n)."""

    def __init__(self, recipe: Recipe, arena: Any, device: torch.device, stream: Any, pool: Any, lock: Any):
        shapes = _shapes(recipe)
        self.host_in, self.host = carve(shapes, pin=True)
        self.index = self.host[0].numpy()
        self.plan = self.host[-1].numpy()
        self.width = recipe.width
        self.dev_in, dev = carve(shapes, buffer=torch.empty_like(self.host_in, device=device))
        index, q = dev[0], dev[1]  # packing's index: cu_q (read through the plan), cu_new, before, after, table
        n_seq = recipe.seqs
        cu_new, before = index[n_seq + 1 : 2 * n_seq + 2], index[2 * n_seq + 2 : 3 * n_seq + 2]
        table = index[4 * n_seq + 2 :].view(n_seq, recipe.width)
        plan = Plan.over(dev[-1], recipe.layout)
        masks = check_masks(recipe.window, recipe.softcap, None, rows=n_seq, heads_q=recipe.heads_q, device=device,
                            causal=recipe.causal, rows_name="S")
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.stream(stream), lock:
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                if recipe.appends:
                    kernels.append_paged(arena.k, arena.v, table, before, dev[2], dev[3], cu_new)
                self.o, self.lse = launch_plan(q, arena.k, arena.v, plan, causal=recipe.causal, scale=recipe.scale,
                                               block_table=table, masks=masks)
            finally:
                self.graph.capture_end()
        self.host_o = torch.empty(self.o.shape, dtype=self.o.dtype, pin_memory=True)
        self.host_lse = torch.empty(self.lse.shape, dtype=self.lse.dtype, pin_memory=True)
        self.done = torch.cuda.Event()
        self.appends = recipe.appends

    def run(self, work: Any, flat: Any) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Event loop, on the worker's compute stream, the device idle: ``work``'s (o (T, Hq, D),
        lse (Hq, T)) as new CPU tensors, and when the inputs were staged and the work enqueued;
        ``flat`` its plan's values."""
        packed = pack([work])
        packed.fill_index(self.index, self.width)
        self.plan[: len(flat)] = flat
        packed.fill_rows(self.host[1], *(self.host[2:4] if self.appends else (None, None)))
        staged = time.perf_counter()
        self.dev_in.copy_(self.host_in, non_blocking=True)
        self.graph.replay()
        self.host_o.copy_(self.o, non_blocking=True)
        self.host_lse.copy_(self.lse, non_blocking=True)
        self.done.record()
        enqueued = time.perf_counter()
        self.done.synchronize()
        return host_copy(self.host_o), host_copy(self.host_lse), staged, enqueued


class StepGraphs:
    """One worker's step graphs: replayed on the event loop (inline steps), captured on the
    launcher thread. The state is in dicts, so that each thread's step is one atomic operation."""

    def __init__(self, name: str, cache: KVCache, max_bytes: int):
        self.name, self.cache, self.max_bytes = name, cache, max_bytes
        self._graphs: OrderedDict[tuple, StepGraph] = OrderedDict()
        self._wanted: dict[tuple, Recipe] = {}
        self._refused: set[tuple] = set()
        self._stream = self._pool = None

    @property
    def wanted(self) -> bool:
        return bool(self._wanted)

    def _plan(self, work: Any) -> tuple[tuple, Recipe, Any] | None:
        """(key, recipe, the plan's values) of a lone work a graph may run, else None."""
        step = work.step
        masks = step.masks
        if masks.alibi is not None:
            return None
        arena = self.cache.arenas.get(work.geometry)  # (read only: the launcher thread owns the cache)
        if arena is None or arena.k is None:
            return None
        g = work.geometry
        n = work.tokens
        appends = step.k is not None
        if (n * step.heads_q + (2 * n * g.num_kv_heads if appends else 0)) * g.head_dim * g.dtype.itemsize \
                > self.max_bytes:
            return None
        seqs = work.seqs
        q_lens = tuple(s.rows[1] - s.rows[0] for s in seqs)
        k_lens = tuple(s.kv.length for s in seqs)
        causal = step.causal
        layout = _layout(q_lens, k_lens, step.heads_q, g.num_kv_heads, g.head_dim, g.dtype, self.cache.device, causal)
        width = table_width(max(len(s.kv.pages) for s in seqs))
        key = (work.key, len(seqs), n, appends, width, layout.shapes, layout.part_rows, arena.k.data_ptr(),
               arena.v.data_ptr(), arena.size)
        recipe = Recipe(g, step.heads_q, len(seqs), n, appends, width, layout, causal,
                        check_scale(step.scale, g.head_dim), (masks.left, masks.right), masks.softcap)
        return key, recipe, layout.flat

    def replay(self, work: Any) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """Event loop, inline: (o, lse, staged, enqueued) of ``work`` (its pages reserved) from its
        key's graph; or None (then it takes the usual path, and its key is asked for)."""
        planned = self._plan(work)
        if planned is None:
            return None
        key, recipe, flat = planned
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._refused:
                self._wanted.setdefault(key, recipe)
            return None
        with contextlib.suppress(KeyError):  # (a capture may have dropped it meanwhile)
            self._graphs.move_to_end(key)
        return graph.run(work, flat)

    def drop(self, work: Any) -> None:
        """A replay of ``work``'s key failed: that key takes the usual path from now on."""
        planned = self._plan(work)
        if planned is not None:
            self._graphs.pop(planned[0], None)
            self._refused.add(planned[0])

    def capture_wanted(self, lock: Any) -> None:
        """Launcher thread (its device current): capture a graph for each key asked for, over the
        arena of that key (one resized since is skipped: its next step asks again)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.cache.device)
            self._pool = torch.cuda.graph_pool_handle()
        while self._wanted:
            try:
                key, recipe = self._wanted.popitem()
            except KeyError:
                return
            arena = self.cache.arenas.get(recipe.geometry)
            if arena is None or arena.k is None or key in self._graphs or key in self._refused \
                    or key[-3:] != (arena.k.data_ptr(), arena.v.data_ptr(), arena.size):
                continue
            t0 = time.perf_counter()
            try:
                graph = StepGraph(recipe, arena, self.cache.device, self._stream, self._pool, lock)
            except Exception as exc:  # noqa: BLE001 - such steps keep the usual path
                self._refused.add(key)
                log.warning("worker %s: no CUDA graph for session steps of %d rows (%r); they take the usual path",
                            self.name, recipe.rows, exc)
                continue
            while len(self._graphs) >= GRAPHS_PER_WORKER:
                self._graphs.popitem(last=False)
            self._graphs[key] = graph
            log.debug("worker %s: captured a session step graph (%d rows, table width %d) in %.1f ms",
                      self.name, recipe.rows, recipe.width, 1e3 * (time.perf_counter() - t0))
