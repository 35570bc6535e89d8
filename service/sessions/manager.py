"""Sessions held by the engine (docs/api.md#sessions): the table, creation, steps, release and idle expiry.

Interface (what every transport calls; ``engine.sessions``):
    info = manager.create(session=None, layers=1, num_kv_heads=..., head_dim=..., dtype="float16")
    manager.describe(id) -> dict    # {"session","layers","num_kv_heads","head_dim","dtype","lengths",
                                    #  "kv_bytes","idle_s","device"}
    manager.list() -> dict          # {"count","kv_bytes_used","kv_bytes_capacity","sessions"}
    await manager.delete(id)
    await manager.step(SessionStep) -> SessionResult
Raises only ``service.errors.ServiceError`` subclasses: NotFound (404), Conflict (409),
InsufficientStorage (507), InvalidInput (422), BadRequest (400), QueueFull (429), DeadlineExceeded
(504), Unavailable (503).

A session lives on one worker (the one with the most free cache when it is created); each layer is
a ``SequenceKV`` in that worker's ``KVCache``. The table lives on the event loop; lengths and pages
change only on the worker's launcher thread (``StepScheduler.run``, the launches), in order.

A step is atomic: each worker's part reserves its pages before its launch and rolls back on failure;
when a part fails after another succeeded (a packed step over sessions on two workers), or the step
finished after its deadline, the parts that ran are truncated back to their lengths before the step
(the sessions' pairs stay held until then, so no later step has built on them). ``end`` releases
the step's sessions once it succeeded; a failed step keeps them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service.errors import (
    BadRequest,
    Cancelled,
    Conflict,
    DeadlineExceeded,
    InsufficientStorage,
    InvalidInput,
    NotFound,
    QueueFull,
    ServiceError,
    size_text,
)
from service.sessions import routing
from service.sessions.cache import Geometry, KVCache, SequenceKV
from service.sessions.scheduler import Seq, StepScheduler, Work
from service.sessions.step import MAX_HEAD_DIM, STEP_DTYPES, SessionResult, SessionStep, check_session_id, shown_id
from service.wire.tensors import DTYPE_NAMES, DTYPES

log = logging.getLogger("attnserve.sessions")

CPU_KV_CACHE_MB = 256.0
GPU_KV_CACHE_SHARE = 0.5  # of what a GPU worker may use after its warm-up (the rest: stateless requests)
MAX_LAYERS = 4096  # layers are made at creation (one SequenceKV each): unbounded, one create could exhaust the host


@dataclass(eq=False)
class Session:
    id: str
    worker: int  # index into the manager's workers
    geometry: Geometry
    kv: list[SequenceKV]  # one per layer
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0  # steps accepted and not yet answered
    ended: bool = False

    @property
    def layers(self) -> int:
        return len(self.kv)


class SessionTable:
    """The ids and their sessions: creation rules, lookup, idle selection. Event loop only."""

    def __init__(self, max_sessions: int, idle_s: float):
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self.sessions: dict[str, Session] = {}
        self.per_worker: collections.Counter[int] = collections.Counter()  # sessions held by each worker
        self.make_id: Callable[[], str] = lambda: uuid.uuid4().hex  # routing.new_session_id under --processes

    def new_id(self, session: str | None) -> str:
        if session is None or session == "":
            return self.make_id()
        check_session_id(session)
        if session in self.sessions:
            raise Conflict(f"session {session!r} exists; choose another id, or leave it out")
        return session

    def add(self, s: Session) -> None:
        if len(self.sessions) >= self.max_sessions:
            raise InsufficientStorage(
                f"this process holds {len(self.sessions)} sessions (--max-sessions {self.max_sessions}, a limit "
                "of each process under --processes); 0 more can be created here until some end"
            )
        self.sessions[s.id] = s
        self.per_worker[s.worker] += 1

    def get(self, session: str) -> Session:
        s = self.sessions.get(session)
        if s is None:
            check_session_id(session)  # an id no session can have is the caller's mistake (400)
            raise NotFound(f"no session {shown_id(session)}: it was never created, has ended, or expired after "
                           f"{self.idle_s:g} s without a step (--session-idle-s)")
        return s

    def pop(self, session: str) -> Session:
        s = self.get(session)
        del self.sessions[session]
        self.per_worker[s.worker] -= 1
        s.ended = True
        return s

    def idle(self, now: float) -> list[Session]:
        """Sessions without a step for ``idle_s`` and none in progress."""
        return [s for s in self.sessions.values() if self.still_idle(s, now)]

    def still_idle(self, s: Session, now: float) -> bool:
        """Whether ``s`` is the session its id names, without a step for ``idle_s`` and none in progress."""
        return self.sessions.get(s.id) is s and s.active == 0 and now - s.last_used >= self.idle_s


def kv_cache_bytes(settings: Any, worker: Any) -> int:
    """``--kv-cache-mb``, else the default: 256 MiB on the CPU, GPU_KV_CACHE_SHARE of a GPU worker's
    memory budget after warm-up."""
    if settings.kv_cache_mb is not None:
        return int(settings.kv_cache_mb * 2**20)
    if worker.device.type == "cuda":
        return int(GPU_KV_CACHE_SHARE * worker.memory_budget)
    return int(CPU_KV_CACHE_MB * 2**20)


class SessionManager:
    def __init__(self, settings: Any, metrics: Any, workers: Sequence[Any],
                 accepting: Callable[[], None] = lambda: None, held_elsewhere: Callable[[], int] = lambda: 0):
        self.settings, self.metrics = settings, metrics
        self.workers = list(workers)
        self.table = SessionTable(settings.max_sessions, settings.session_idle_s)
        self.table.make_id = routing.new_session_id(settings)  # ids this process owns (sessions/routing.py)
        self.caches: list[KVCache] = []
        self.schedulers: list[StepScheduler] = []
        self._accepting, self._held_elsewhere = accepting, held_elsewhere
        self.held = 0  # steps accepted and not answered
        self.activity = 0  # sessions ended, steps accepted and answered, ever: moves while busy
        self._success = metrics.success.labels("session")  # looked up once: ``labels()`` costs more than inc()
        self._expiry: asyncio.Task | None = None
        self._geometries: dict[Geometry, Geometry] = {}
        self._stopped = False  # the steps are finished and the workers' launcher threads may be gone

    # ---- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Once the workers are warm: a cache and a scheduler per worker; the cache's bytes come out
        of the worker's budget for stateless requests; the idle-expiry task."""
        for i, w in enumerate(self.workers):
            cache = KVCache(w.device, kv_cache_bytes(self.settings, w), self.settings.kv_page_tokens)
            if w.device.type == "cuda":
                if cache.capacity_bytes >= w.memory_budget:  # stateless requests would get 413, every one
                    raise ValueError(
                        f"--kv-cache-mb {self.settings.kv_cache_mb:g} is not below what worker {w.name} may use "
                        f"after its warm-up ({w.memory_budget / 2**20:.0f} MiB, --memory-fraction): lower it")
                w.memory_budget = max(0, w.memory_budget - cache.capacity_bytes)
            self.caches.append(cache)
            scheduler = StepScheduler(w, cache, self.settings, self.metrics)
            self.schedulers.append(scheduler)
            self.metrics.track_sessions(
                w.name, lambda i=i: self.table.per_worker[i],
                lambda c=cache: c.used_bytes, lambda c=cache: c.capacity_bytes, lambda c=cache: c.pages_free,
                lambda s=scheduler: len(s.queue),
            )
            log.info("worker %s: KV cache of %.1f MiB for sessions, %d tokens a page", w.name,
                     cache.capacity_bytes / 2**20, cache.page_tokens)
        self._expiry = asyncio.create_task(self._expire_loop(), name="attnserve-session-expiry")

    async def stop(self) -> None:
        """Finish the steps held (sessions end with the process), stop the expiry task."""
        while self.held:
            await asyncio.sleep(0.01)
        self._stopped = True
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry

    async def _expire_loop(self) -> None:
        period = max(0.05, min(self.settings.session_idle_s / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            for s in self.table.idle(time.monotonic()):
                # each release waits for its worker's launches: a session of the list may since have
                # been ended, re-created under its id, or stepped
                if not self.table.still_idle(s, time.monotonic()):
                    continue
                with contextlib.suppress(NotFound):
                    await self._release(s.id)
                    self.metrics.session_expired.inc()
                    log.info("session %s expired after %.0f s idle", s.id, self.settings.session_idle_s)

    # ---- the table ------------------------------------------------------------------------------

    def create(self, session: str | None = None, layers: int = 1, num_kv_heads: int = 0, head_dim: int = 0,
               dtype: str | torch.dtype = "float16") -> dict[str, Any]:
        """A new session (no pages yet: they are taken as it grows); its description."""
        return self._info(self.create_session(session, layers, num_kv_heads, head_dim, dtype))

    def create_session(self, session: str | None = None, layers: int = 1, num_kv_heads: int = 0,
                       head_dim: int = 0, dtype: str | torch.dtype = "float16") -> Session:
        """``create``, giving the session itself: what ``delete(..., only=)`` takes."""
        self._accepting()
        for name, value in (("layers", layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadRequest(f"{name} must be an integer, got {value!r}")
        if not 1 <= layers <= MAX_LAYERS:
            raise InvalidInput(f"layers must be 1 to {MAX_LAYERS}, got {layers}")
        if num_kv_heads < 1:
            raise InvalidInput(f"num_kv_heads must be >= 1, got {num_kv_heads}")
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise InvalidInput(f"head_dim {head_dim} is not supported (1 to {MAX_HEAD_DIM})")
        if isinstance(dtype, str):
            if DTYPES.get(dtype) not in STEP_DTYPES:
                raise InvalidInput(f"dtype {dtype!r} is not supported; choose float16, bfloat16 or float32")
            dtype = DTYPES[dtype]
        elif dtype not in STEP_DTYPES:
            raise InvalidInput(f"dtype {dtype} is not supported; choose float16, bfloat16 or float32")
        g = Geometry(num_kv_heads, head_dim, dtype)
        self._check_fits(g)
        sid = self.table.new_id(session)
        held = self.table.per_worker  # (kept by the table: counting the sessions made a create O(sessions))
        # the most free cache, then the fewest sessions: a burst of new sessions (no pages yet) spreads
        worker = max(range(len(self.workers)), key=lambda i: (self.caches[i].free_bytes, -held[i], -i))
        g = self._geometries.setdefault(g, g)  # one object per geometry: a step's checks compare identities
        s = Session(sid, worker, g, [SequenceKV() for _ in range(layers)])
        self.table.add(s)
        return s

    def _check_fits(self, g: Geometry) -> None:
        """507 for a geometry whose one page is more than a worker's whole cache: such a session
        could never hold a key, and every step would fail."""
        cache = max(self.caches, key=lambda c: c.capacity_bytes)
        page = g.page_bytes(cache.page_tokens)
        if page > cache.capacity_bytes:
            raise InsufficientStorage(
                f"a session of {g.num_kv_heads} kv heads x head_dim {g.head_dim} in {DTYPE_NAMES[g.dtype]} takes "
                f"{size_text(page)} a page of {cache.page_tokens} tokens (keys and values), more than the "
                f"whole KV cache of {size_text(cache.capacity_bytes)} (--kv-cache-mb)")

    def describe(self, session: str) -> dict[str, Any]:
        return self._info(self.table.get(session))

    def list(self) -> dict[str, Any]:
        return {
            "count": len(self.table.sessions),
            "kv_bytes_used": sum(c.used_bytes for c in self.caches),
            "kv_bytes_capacity": sum(c.capacity_bytes for c in self.caches),
            "sessions": list(self.table.sessions),
        }

    async def delete(self, session: str, only: Session | None = None) -> None:
        """End a session; with ``only``, only while its id still names that session: a failed start's
        cleanup (the OIP's sequence_start) must not end a session another caller made under that id since."""
        await self._release(session, only)

    def _info(self, s: Session) -> dict[str, Any]:
        cache = self.caches[s.worker]
        g = s.geometry
        return {
            "session": s.id,
            "layers": s.layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "dtype": DTYPE_NAMES[g.dtype],
            "lengths": [kv.length for kv in s.kv],
            "kv_bytes": sum(cache.seq_bytes(g, kv) for kv in s.kv),
            "idle_s": 0.0 if s.active else round(time.monotonic() - s.last_used, 3),
            "device": self.workers[s.worker].name,
        }

    async def _release(self, session: str, only: Session | None = None) -> None:
        """End a session now (404 from here on) and return its pages, after the launches already
        enqueued on its worker; with ``only``, only while its id still names that session."""
        if only is not None and self.table.sessions.get(session) is not only:
            return
        s = self.table.pop(session)
        self.activity += 1
        if self._stopped:  # draining: no launch is left to order after, and the pages go with the process
            return
        await self.schedulers[s.worker].run(lambda cache: cache.release(s.geometry, s.kv))

    # ---- steps --------------------------------------------------------------------------------

    async def step(self, step: SessionStep) -> SessionResult:
        """Run one step (single or packed); atomic, ordered per (session, layer)."""
        try:
            self._accepting()
            held = self.held + self._held_elsewhere()
            if held >= self.settings.max_queue_size:
                raise QueueFull(f"the server holds {held} requests (--max-queue-size "
                                f"{self.settings.max_queue_size}); retry shortly", retry_after_s=1.0)
            works = self._works(step)
        except ServiceError as exc:
            self.metrics.failed("session", exc.code)
            raise
        if step.deadline is None:
            step.deadline = step.arrived + self.settings.request_timeout_ms / 1000.0
        self.held += 1
        self.activity += 1
        for w in works:
            for seq in w.seqs:
                seq.session.active += 1
        # shielded: a caller that goes away (a client disconnect) does not cut a step in half
        task = asyncio.ensure_future(self._run(step, works))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._abandoned(task, works)
            raise
        except ServiceError as exc:
            self.metrics.failed("session", exc.code)
            raise

    def _abandoned(self, task: asyncio.Future, works: list[Work]) -> None:
        """The caller went away (an HTTP client hung up, a gRPC call was cancelled): the step
        appends nothing. Parts not launched yet never launch; its deadline is set to the past, so
        that a part staged behind a running launch is skipped as expired (``launch_steps``) and a
        part that ran is undone (``_run``: a step that ends past its deadline fails whole)."""
        gone = Cancelled("the caller went away before the step was answered; nothing was appended")
        withdrawn = [self.schedulers[w.seqs[0].session.worker].withdraw(w, gone) for w in works]
        self.metrics.cancelled.labels("session", "queued" if any(withdrawn) else "launched").inc()
        works[0].step.deadline = float("-inf")  # (the works of a step share it)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it now

    def _works(self, step: SessionStep) -> list[Work]:
        by_worker: dict[int, list[Seq]] = {}
        geometry = None
        layer, dtype, head_dim, heads_kv, heads_q = step.layer, step.q.dtype, step.head_dim, step.heads_kv, step.heads_q
        for index, (sid, rows) in enumerate(zip(step.sessions, step.rows, strict=True)):
            s = self.table.get(sid)
            g = s.geometry
            if g is not geometry:  # sessions of one geometry share its object: checked once
                if dtype != g.dtype:
                    raise InvalidInput(f"q has dtype {dtype} but session {sid!r} holds {DTYPE_NAMES[g.dtype]}")
                if head_dim != g.head_dim:
                    raise InvalidInput(f"q has head dim {head_dim} but session {sid!r} holds {g.head_dim}")
                if heads_kv is not None and heads_kv != g.num_kv_heads:
                    raise InvalidInput(f"k, v have {heads_kv} heads but session {sid!r} holds {g.num_kv_heads}")
                if heads_q % g.num_kv_heads:
                    raise InvalidInput(f"q's {heads_q} heads must be a multiple of session {sid!r}'s "
                                       f"{g.num_kv_heads} kv heads (GQA)")
                if geometry is not None and g != geometry:
                    raise InvalidInput("the sessions of a packed step must share num_kv_heads, head_dim and dtype")
                geometry = g
            if layer >= s.layers:
                raise InvalidInput(f"layer {layer} is out of range: session {sid!r} has {s.layers} "
                                   f"layer{'s' if s.layers > 1 else ''} (0..{s.layers - 1})")
            by_worker.setdefault(s.worker, []).append(Seq(s, s.kv[layer], rows, index))
        return [Work(step, seqs, geometry) for seqs in by_worker.values()]

    async def _run(self, step: SessionStep, works: list[Work]) -> SessionResult:
        workers = [w.seqs[0].session.worker for w in works]
        try:
            alone = len(works) == 1  # a step over several workers runs on them in parallel, not one by one inline
            futures = [self.schedulers[i].submit(w, alone) for i, w in zip(workers, works, strict=True)]
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            error = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if error is None and time.monotonic() > step.deadline:
                error = DeadlineExceeded("the step's deadline passed while it ran; nothing was appended")
            if error is not None:
                for i, w, o in zip(workers, works, outcomes, strict=True):
                    if not isinstance(o, BaseException):  # this part ran: undo it
                        await self.schedulers[i].run(lambda cache, w=w: [
                            cache.truncate(w.geometry, seq.kv, c) for seq, c in zip(w.seqs, w.before, strict=True)])
                if not isinstance(error, ServiceError):  # a bug, not the caller's doing
                    log.error("session step failed: %r", error, exc_info=error)
                    error = ServiceError("internal error while running the step; nothing was appended")
                raise error
            result = self._assemble(step, works, outcomes)
        finally:
            now = time.monotonic()
            for i, w in zip(workers, works, strict=True):
                self.schedulers[i].done(w)
                for seq in w.seqs:
                    seq.session.active -= 1
                    seq.session.last_used = now
            self.held -= 1
            self.activity += 1
        self._success.inc()
        if step.end:  # the sessions it ran on: one deleted meanwhile, its id taken again, is another's
            for seq in (seq for w in works for seq in w.seqs):
                with contextlib.suppress(NotFound):
                    await self._release(seq.session.id, seq.session)
        return result

    def _assemble(self, step: SessionStep, works: list[Work], outcomes: list) -> SessionResult:
        new = step.k is not None  # (from what was held before: a DELETE after the launch may have released it since)
        lengths_of = {seq.session.id: c + (seq.rows[1] - seq.rows[0] if new else 0)
                      for w in works for seq, c in zip(w.seqs, w.before, strict=True)}
        lengths = [lengths_of[sid] for sid in step.sessions]
        stamps = max((o[2] for o in outcomes), key=lambda st: st[3])  # the part that finished last
        if len(works) == 1 and [s.session.id for s in works[0].seqs] == list(step.sessions):
            o, lse, _ = outcomes[0]
        else:  # parts from several workers: each session's rows back in their place
            t = step.q.shape[0]
            o = torch.empty(t, step.heads_q, step.head_dim, dtype=step.q.dtype)
            lse = torch.empty(step.heads_q, t, dtype=torch.float32)
            for w, (o_w, lse_w, _) in zip(works, outcomes, strict=True):
                at = 0
                for seq in w.seqs:
                    a, b = seq.rows
                    o[a:b], lse[:, a:b] = o_w[at : at + b - a], lse_w[:, at : at + b - a]
                    at += b - a
        return step.result(o, lse, lengths, stamps)

