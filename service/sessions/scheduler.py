"""Session steps batched into paged launches, one scheduler per worker (docs/api.md#batching-policy, #sessions).

A ``Work`` is the part of a step that one worker runs: its sessions' rows (a step's sessions may be
held by several workers; each runs its own part). Works wait in their worker's FIFO; the policy is
the batcher's (``service.core.batcher``): a worker with nothing running never waits (the works that
arrived in the same loop iteration go together); while it is busy, works gather until they hold
``--max-batch-tokens`` query rows or the oldest has waited ``--max-queue-delay-ms``. A launch takes
the oldest launchable work's key (Hq, Hkv, D, dtype, causal, scale, the window and the cap and
whether ALiBi slopes are given: what the kernels see; each sequence's slopes are its own row of the
launch's; lse is always computed, so return_lse is not part of it) and every later work of that key.

Order: a work holds its (session, layer) pairs from launch until its step is answered (``done``);
a work with a pair held, or held by an earlier work still queued, waits. So steps on one (session,
layer) take effect in the order accepted, and a failed step can still be undone (``truncate``).

A work that comes alone (``--session-inline-rows``: at most that many rows, its worker idle, the
queue empty, its pairs free, no work accepted in the last ``ALONE_GAP_S``) does not queue: it runs at
once on the event loop (``Worker.run_inline``), as a lone stateless request replays its CUDA graph.

One launch (``launch_steps``, on the worker's launcher thread, or inline): reserve each work's pages (a work
that does not fit fails alone with 507, its sessions' lengths unchanged), stage q/k/v, one
``kernels.append_paged``, one ``kernels.attention_paged`` over the works' block tables, copy o and
lse back. If the launch raises, every reservation is rolled back; after a device out-of-memory
the works are retried one by one (alone, 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from service.core.batcher import ALONE_GAP_S
from service.core.staging import carve
from service.errors import DeadlineExceeded, NotFound, ServiceError, Unavailable, from_kernel_error
from service.sessions.cache import Geometry, KVCache, Reservation, SequenceKV
from service.sessions.graphs import StepGraphs
from service.sessions.packing import cat, pack
from service.sessions.step import SessionStep

log = logging.getLogger("attnserve.sessions")

STAGED_PER_WORKER = 2  # one launch running + one staged behind it, as the batcher
# On the CPU an inline step computes on the event loop (on a GPU it waits for microseconds of device
# work): past this many multiply-adds (~ms of a core) it goes to the launcher thread, so that one long
# context's step does not hold every other call, health probe and deadline timer meanwhile.
CPU_INLINE_MAX_MACS = 1 << 23


@dataclass(eq=False)
class Seq:
    """One session of a work: its layer's KV, and its rows in the step's q (and k, v)."""

    session: Any  # service.sessions.manager.Session
    kv: SequenceKV
    rows: tuple[int, int]
    index: int = 0  # its place among the step's sessions (its row of the step's ALiBi slopes)


@dataclass(eq=False)
class Work:
    step: SessionStep
    seqs: list[Seq]
    geometry: Geometry
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued: float = field(default_factory=time.monotonic)
    launched: bool = False  # taken from the queue (handed to the launcher thread, or run inline)
    claimed: str | None = None  # "run" by the launch that reached it, or "expired" by its deadline first
    before: list[int] = field(default_factory=list)  # each seq's length before the step (launcher thread)
    timer: asyncio.TimerHandle | None = None

    @functools.cached_property
    def key(self) -> Hashable:
        s = self.step
        return (s.heads_q, self.geometry, s.causal, s.scale, s.mask_key)

    @functools.cached_property
    def pairs(self) -> frozenset[tuple[str, int]]:
        layer = self.step.layer
        return frozenset((seq.session.id, layer) for seq in self.seqs)

    @functools.cached_property
    def tokens(self) -> int:
        return sum(s.rows[1] - s.rows[0] for s in self.seqs)


# ---------------------------------------------------------------- the launch (launcher thread)


_CLAIMS = threading.Lock()


def claim(work: Work, what: str) -> bool:
    """True for the first of the launcher thread ("run") and the deadline timer ("expired") to claim
    ``work``: a work handed to the launcher behind a running launch may still expire, at its deadline."""
    with _CLAIMS:
        if work.claimed is None:
            work.claimed = what
            return True
        return False


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@dataclass
class _Launched:
    works: list[Work]
    o: torch.Tensor  # host (ΣT, Hq, D)
    lse: torch.Tensor  # host (Hq, ΣT)
    staged: float = 0.0  # time.perf_counter() once q, k, v and the indices were staged
    enqueued: float = 0.0  # ... once the append, the attention and the copies back were enqueued
    replayed: bool = False  # by a CUDA graph (``service.sessions.graphs``)


def launch_steps(cache: KVCache, works: list[Work], lock: Any,
                 graphs: StepGraphs | None = None) -> tuple[tuple[list[_Launched], dict], Any]:
    """Launcher thread (or inline, with the ``graphs`` a lone work may replay): run ``works`` (one
    key) in one paged launch. Returns ((launched parts, {work: error}), the CUDA event after the
    last copy or None)."""
    failed: dict[Work, ServiceError] = {}
    now = time.monotonic()
    live: list[tuple[Work, Reservation]] = []
    for w in works:
        if not claim(w, "run"):
            continue  # its deadline passed while it waited for this thread: answered 504 already
        try:
            if w.step.deadline is not None and w.step.deadline <= now:
                raise DeadlineExceeded("the step's deadline passed before it could run; nothing was appended")
            live.append((w, _reserve(cache, w)))
        except ServiceError as exc:
            failed[w] = exc
    parts: list[_Launched] = []
    done = None
    if live:
        done = _launch_or_split(cache, live, lock, parts, failed, graphs)
    return (parts, failed), done


def _reserve(cache: KVCache, w: Work) -> Reservation:
    step = w.step
    grow = []
    w.before = []
    for seq in w.seqs:
        if seq.session.ended:
            raise NotFound(f"session {seq.session.id!r} ended before this step ran; nothing was appended")
        new = seq.rows[1] - seq.rows[0] if step.k is not None else 0
        w.before.append(seq.kv.length)
        grow.append((seq.kv, new))
    return cache.reserve(w.geometry, grow)


def _launch_or_split(cache, live, lock, parts, failed, graphs=None):
    try:
        if graphs is not None and len(live) == 1 and _replay(graphs, live[0][0], parts):
            return None
        return _enqueue(cache, [w for w, _ in live], lock, parts)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the works' outcome
        for _, r in reversed(live):
            cache.rollback(r)
        if _is_oom(exc):
            if cache.device.type == "cuda":
                torch.cuda.synchronize(cache.device)
                torch.cuda.empty_cache()
            if len(live) > 1:  # alone, each work gets its own chance
                done = None
                for w, _ in live:
                    try:
                        r = _reserve(cache, w)
                    except ServiceError as e:
                        failed[w] = e
                        continue
                    done = _launch_or_split(cache, [(w, r)], lock, parts, failed) or done
                return done
            error: ServiceError = Unavailable("the device ran out of memory for this step; nothing was "
                                              "appended; retry later or send fewer rows")
        elif isinstance(exc, ServiceError):
            error = exc
        elif isinstance(exc, kernels.AttentionInputError):
            error = from_kernel_error(exc)
        else:
            log.error("session launch of %d steps failed: %r", len(live), exc, exc_info=exc)
            error = ServiceError("internal error while running the step; nothing was appended")
        for w, _ in live:
            failed[w] = error
        return None


def _replay(graphs: StepGraphs, work: Work, parts: list[_Launched]) -> bool:
    """Run ``work`` (its pages reserved) by its key's CUDA graph, waiting for the device; False when
    it has none (it is asked for). A replay that raises drops its graph and fails the step."""
    try:
        got = graphs.replay(work)
    except Exception:
        graphs.drop(work)
        raise
    if got is None:
        return False
    o, lse, staged, enqueued = got
    parts.append(_Launched([work], o, lse, staged, enqueued, replayed=True))
    return True


def _enqueue(cache: KVCache, works: list[Work], lock: Any, parts: list[_Launched]) -> Any:
    """Stage, append, attend, copy back (asynchronously on a GPU). Lengths are already reserved."""
    device, cuda = cache.device, cache.device.type == "cuda"
    first = works[0].step
    arena = cache.arena(works[0].geometry)
    masks = first.masks  # equal across the launch but for the slopes (part of its key)
    packed = pack(works)
    n_seq, width = packed.n_seq, packed.width
    t_q, t_new = packed.rows, packed.flat[2 * n_seq + 1]
    hq, d, hkv = first.heads_q, first.head_dim, works[0].geometry.num_kv_heads
    dtype = first.q.dtype
    shapes = [(torch.int32, (packed.index_len(width),)), (dtype, (t_q, hq, d))]
    if packed.k_parts:
        shapes += [(dtype, (t_new, hkv, d)), (dtype, (t_new, hkv, d))]
    if packed.slopes:
        shapes.append((torch.float32, (n_seq, hq)))
    # on a GPU: one pinned buffer and one host->device copy for all of them (each copy costs host time)
    host_buf, host_t = carve(shapes, pin=cuda)
    host = host_t[0]
    packed.fill_index(host.numpy(), width)
    packed.fill_rows(host_t[1], *(host_t[2:4] if packed.k_parts else (None, None)))
    if packed.slopes:
        cat(packed.slopes, host_t[-1])
    dev_t = host_t
    if cuda:
        dev_t = carve(shapes, buffer=host_buf.to(device, non_blocking=True))[1]
    index, q = dev_t[0], dev_t[1]
    k, v = (dev_t[2], dev_t[3]) if packed.k_parts else (None, None)
    alibi = dev_t[-1] if packed.slopes else None
    s1 = n_seq + 1
    d_cu_q, d_cu_new = index[:s1], index[s1 : 2 * s1]
    d_before, d_after = index[2 * s1 : 2 * s1 + n_seq], index[2 * s1 + n_seq : 2 * s1 + 2 * n_seq]
    d_table = index[2 * s1 + 2 * n_seq :].view(n_seq, width)
    # the same indices on the host: the paged attention plans from them, reading nothing back from the device
    known = (host[:s1], host[2 * s1 + n_seq : 2 * s1 + 2 * n_seq], host[2 * s1 + 2 * n_seq :].view(n_seq, width))
    staged = time.perf_counter()
    with lock:
        if arena.k is None:  # no page of this geometry yet (q-only steps of empty sessions): no key anywhere
            o = torch.zeros_like(q)
            lse = torch.full((hq, t_q), -math.inf, dtype=torch.float32, device=q.device)
        else:
            if k is not None:
                kernels.append_paged(arena.k, arena.v, d_table, d_before, k, v, d_cu_new)
            o, lse = kernels.attention_paged(q, arena.k, arena.v, d_table, d_after, d_cu_q, causal=first.causal,
                                             scale=first.scale, return_lse=True, host_index=known,
                                             window_size=(masks.left, masks.right), softcap=masks.softcap,
                                             alibi_slopes=alibi)
    done = None
    if cuda:
        _, (o_host, lse_host) = carve([(o.dtype, tuple(o.shape)), (lse.dtype, tuple(lse.shape))], pin=True)
        o_host.copy_(o, non_blocking=True)
        lse_host.copy_(lse, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        o, lse = o_host, lse_host
    parts.append(_Launched(works, o, lse, staged, time.perf_counter()))
    return done


# ---------------------------------------------------------------- the scheduler (event loop)


class StepScheduler:
    """One worker's queue of works, dispatched by the policy in the module docstring."""

    def __init__(self, worker: Any, cache: KVCache, settings: Any, metrics: Any):
        self.worker, self.cache, self.settings = worker, cache, settings
        self.queue: deque[Work] = deque()
        self.tokens = 0  # query rows queued
        self.inflight = 0  # launches running
        self.busy: set[tuple[str, int]] = set()  # (session, layer) pairs of works launched, not yet done
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_arrival = float("-inf")  # time.monotonic() of the last work submitted
        self._batch_size = metrics.session_batch_size.labels(worker.name)
        self._inline = metrics.session_inline.labels(worker.name)
        self._graph_exec = metrics.session_graph_exec.labels(worker.name)
        # CUDA graphs of lone steps: on GPUs, unless --graph-max-kib is 0
        graph_bytes = int(settings.graph_max_kib * 1024) if cache.device.type == "cuda" else 0
        self.graphs = StepGraphs(worker.name, cache, graph_bytes) if graph_bytes else None

    def submit(self, work: Work, alone: bool = True) -> asyncio.Future:
        """Queue ``work`` (or run it now, when it comes ``alone`` and may: the module docstring);
        its future gives (o, lse, stamps) or the step's error."""
        since, self._last_arrival = self._last_arrival, work.enqueued
        if alone and self._may_run_now(work, work.enqueued - since) and self._run_now(work):
            self._last_arrival = time.monotonic()  # what arrives during the call came in a burst
            return work.future
        self.queue.append(work)
        self.tokens += work.tokens
        if work.step.deadline is not None:
            loop = asyncio.get_running_loop()
            work.timer = loop.call_at(loop.time() + work.step.deadline - time.monotonic(), self._expire, work)
        self._soon()
        return work.future

    def done(self, work: Work) -> None:
        """The step of ``work`` is answered (and undone if it failed): its pairs are free again. A
        work that never launched (expired or withdrawn in the queue) held none: its pairs may be
        held by an earlier work still running, whose undo a later step must not overtake."""
        if work.launched:
            self.busy -= work.pairs
        if work.timer is not None:
            work.timer.cancel()
        if not work.launched:
            self._drop(work)
        self._soon()

    def withdraw(self, work: Work, exc: Exception) -> bool:
        """Take back a queued work whose caller went away: True when it will never launch (its
        future then fails with ``exc``)."""
        if work.launched or work.future.done():
            return False
        self._drop(work)
        work.future.set_exception(exc)
        return True

    async def run(self, fn) -> Any:
        """Run ``fn(cache)`` on the worker's launcher thread, in order with the launches; its value."""
        value, _ = await self.worker.run_on_device(lambda lock: (fn(self.cache), None))
        return value

    def _drop(self, work: Work) -> None:
        with contextlib.suppress(ValueError):
            self.queue.remove(work)
            self.tokens -= work.tokens

    def _expire(self, work: Work) -> None:
        work.timer = None
        if work.future.done():
            return
        if not work.launched:
            self._drop(work)
            work.future.set_exception(DeadlineExceeded("the step's deadline passed while it was queued; "
                                                       "nothing was appended"))
        elif claim(work, "expired"):  # handed to the launcher thread, which has not reached it yet
            work.future.set_exception(DeadlineExceeded("the step's deadline passed before it could run; "
                                                       "nothing was appended"))

    def _soon(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        delay = self.settings.max_queue_delay_ms / 1000.0
        while self.queue and self.inflight < STAGED_PER_WORKER:
            idle = self.inflight == 0 and getattr(self.worker, "inflight", 0) == 0
            if not idle and self.settings.batching:
                waited = time.monotonic() - self.queue[0].enqueued
                if self.tokens < self.settings.max_batch_tokens and waited < delay:
                    self._timer = asyncio.get_running_loop().call_later(delay - waited, self._soon)
                    return
            batch = self._take()
            if not batch:
                return  # every queued work waits for a pair held by a running one: ``done`` wakes us
            self._launch(batch)

    def _take(self) -> list[Work]:
        claimed = set(self.busy)
        batch: list[Work] = []
        key, tokens, limit = None, 0, self.settings.max_batch_tokens
        for w in self.queue:
            pairs = w.pairs
            fits = not (pairs & claimed) and (key is None or (
                w.key == key and self.settings.batching and tokens + w.tokens <= limit))
            if fits:
                key = w.key
                batch.append(w)
                tokens += w.tokens
            claimed |= pairs  # a later work on these pairs waits (order of acceptance)
        for w in batch:
            self.queue.remove(w)
            w.launched = True
            self.busy |= w.pairs
        self.tokens -= tokens
        return batch

    def _may_run_now(self, work: Work, gap: float) -> bool:
        return (
            0 < work.tokens <= self.settings.session_inline_rows
            and (self.cache.device.type == "cuda" or _cpu_macs(work) <= CPU_INLINE_MAX_MACS)
            and gap >= ALONE_GAP_S
            and not self.queue
            and self.inflight == 0
            and not (work.pairs & self.busy)
            and self.worker.idle
        )

    def _run_now(self, work: Work) -> bool:
        """Run ``work`` inline and settle it; False (nothing done) when the worker cannot now."""
        work.launched = True
        self.busy |= work.pairs  # none of them was held (``_may_run_now``)
        self.inflight += 1
        handed = time.perf_counter()
        try:
            answers = self.worker.run_inline(lambda lock: launch_steps(self.cache, [work], lock, self.graphs))
        except Exception as exc:  # noqa: BLE001 - a device error after the launch: its work fails
            answers = exc
        if answers is None:  # the launch lock is held elsewhere: the work queues as usual
            work.launched = False
            self.busy -= work.pairs
            self.inflight -= 1
            return False
        self._batch_size.observe(1)
        self._inline.inc()
        if not isinstance(answers, Exception) and any(p.replayed for p in answers[0][0]):
            self._graph_exec.inc()
        if isinstance(answers, Exception):
            self._finished([work], lambda exc=answers: _raise(exc), handed)
        else:
            self._finished([work], lambda: answers, handed)
        if self.graphs is not None and self.graphs.wanted:  # captured after this step, in order with launches
            with contextlib.suppress(RuntimeError):  # the worker is shutting down: no capture
                self.worker.run_on_device(lambda lock: (self.graphs.capture_wanted(lock), None))
        return True

    def _launch(self, batch: list[Work]) -> None:
        self.inflight += 1
        self._batch_size.observe(len(batch))
        handed = time.perf_counter()
        answers = self.worker.run_on_device(lambda lock: launch_steps(self.cache, batch, lock))
        answers.add_done_callback(lambda f: self._finished(batch, f.result, handed))

    def _finished(self, batch: list[Work], answers: Callable[[], tuple], handed: float) -> None:
        """``answers()`` gives what ``launch_steps`` returned and when its event completed, or raises."""
        self.inflight -= 1
        try:
            (parts, failed), settled = answers()
        except Exception as exc:  # noqa: BLE001 - a device error after the launch: its works fail
            log.error("session launch on %s failed: %r", self.worker.name, exc, exc_info=exc)
            error = exc if isinstance(exc, ServiceError) else ServiceError("internal error while running the step")
            parts, failed = [], {w: error for w in batch}
        for w, exc in failed.items():
            if not w.future.done():
                w.future.set_exception(exc)
        for part in parts:
            stamps = (handed, part.staged, part.enqueued, settled)
            at = 0
            for w in part.works:
                n = w.tokens
                if not w.future.done():
                    w.future.set_result((part.o[at : at + n], part.lse[:, at : at + n], stamps))
                at += n
        self._soon()


def _cpu_macs(work: Work) -> int:
    """Multiply-adds of ``work``'s attention, about: each row over its session's keys, Hq x D x 2."""
    step = work.step
    new = step.k is not None
    keys = sum((s.rows[1] - s.rows[0]) * (s.kv.length + (s.rows[1] - s.rows[0] if new else 0)) for s in work.seqs)
    return 2 * keys * step.heads_q * step.head_dim


def _raise(exc: BaseException):
    raise exc
