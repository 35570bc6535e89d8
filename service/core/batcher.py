"""The dynamic batcher (docs/api.md#batching-policy), in Ray Serve's shape (``serve/batching.py``).

Each request waits as a ``Pending`` (its request, its batch key, a future). Requests of one key
can share a launch: they are concatenated along B. One dispatcher task hands batches to workers:

- a worker that is idle never waits: the oldest queued request's key goes at once, with every
  request of that key queued so far (up to ``max_batch_tokens``), to the least-loaded idle worker;
  so a lone request pays no batching delay. With several idle workers the batch is split evenly
  among them only when each share still holds about ``SHARE_MIN_S`` of device work (bytes to move,
  FLOPs to compute): a small batch stays whole, since a second launch costs more host time than
  it saves (see docs/benchmarks/service.md#batching);
- while every worker is busy, arrivals gather; a batch closes (and is staged on the least-loaded
  worker, behind its running launch) once it holds ``max_batch_tokens`` query tokens or
  ``max_batch_work_ms`` of estimated device work, or its oldest request has waited
  ``max_queue_delay_ms``;
- a batch never grows past ``max_batch_work_ms`` (a request above it runs alone). docs/api.md#batching-policy caps
  batches by tokens only; but a request that already keeps the GPU busy for milliseconds gains
  nothing from sharing a launch, and joining big requests serialises their staging behind one
  launch, where one per launch lets one launch's copies overlap another's kernel
  (see docs/benchmarks/service.md#batching);
- keys are served oldest first, so one key cannot starve another;
- a request that finds the server holding nothing else, ALONE_GAP_S or more after the previous
  arrival, may skip the queue: its worker answers it at once on the event loop when it has a CUDA
  graph for its shape (``Worker.run_now``, ``--graph-max-kib``). Requests that come in bursts, or
  while others are held, batch as above: answered at once one by one, a closed loop of callers
  would never form a batch.

A batch step resolves exactly one future per request, fans an error out to exactly the requests
it concerns, and checks the count of answers. Each batch goes to ``Worker.submit``, which counts it
in the worker's ``load`` until its answers are settled; the batcher only reads that load. The
queue is bounded (``max_queue_size`` requests queued or running): beyond it ``submit`` refuses at
once with ``QueueFull``.

Deadlines (``service.core.deadlines``): one heap of every waiting request's deadline and one
timer armed at the earliest; when it fires, each request past its deadline gets
``DeadlineExceeded`` (a queued one is dropped from its queue; a launched one is answered now and
its launch's outcome is ignored). This costs a heap push per request, where an ``asyncio.timeout``
per request would cost a timer and a context each.

The queue, the dispatch policy and the batch step stay in this one module: they share the per-key
queues and counts, and read best as one story in the order a request meets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from service.core.deadlines import Deadlines
from service.core.metrics import Metrics
from service.core.types import AttentionRequest, LayerRequest
from service.core.worker import Worker
from service.errors import QueueFull, ServiceError, Unavailable
from service.settings import Settings

log = logging.getLogger("attnserve.batcher")

STAGED_PER_WORKER = 2  # one launch running + one batch closed and waiting behind it

# A request that arrives this soon after the previous one (or after the end of the previous one's
# answer at once) may have company (a burst, a closed loop of callers): it is queued and may batch,
# even on an idle server. Longer gaps (a lone caller's round trip through HTTP is several times
# this) let a worker answer it at once (``_answer_now``).
ALONE_GAP_S = 2.5e-4

# Idle workers split a batch only when each share holds at least this much estimated device time,
# reckoned with these rough speeds: (host->device bytes/s, FLOP/s) per device type.
SHARE_MIN_S = 1e-3
DEVICE_SPEED = {"cuda": (50e9, 300e12), "cpu": (float("inf"), 50e9)}


@dataclass(eq=False, slots=True)
class Pending:
    """A request waiting for its answer: exactly one of set_result/set_exception ever happens."""

    request: AttentionRequest | LayerRequest
    memory: int  # device bytes a launch of this request alone needs
    io_bytes: int  # bytes it moves host -> device -> host (inputs and outputs)
    flops: float  # its compute, roughly (io_bytes and flops: whether splitting a batch pays)
    kind: str  # "attention" or "layer" (metrics label)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued: float = field(default_factory=time.monotonic)
    launched: bool = False
    released: bool = False  # no longer counted as held
    work: float = 0.0  # estimated device seconds (set by the batcher, which knows the device)
    key: Hashable = field(init=False)  # the request's launch_key: requests of equal keys may share a launch
    tokens: int = field(init=False)  # the request's query tokens (what --max-batch-tokens counts)

    def __post_init__(self) -> None:
        self.key = self.request.launch_key
        self.tokens = self.request.tokens

    def resolve(self, outcome) -> None:
        if self.future.done():  # the caller gave up (deadline, disconnect): nothing to tell
            return
        if isinstance(outcome, BaseException):
            self.future.set_exception(outcome)
        else:
            self.future.set_result(outcome)


class Batcher:
    def __init__(self, workers: Sequence[Worker], settings: Settings, metrics: Metrics):
        self.workers = list(workers)
        self.settings = settings
        self.metrics = metrics
        metrics.track_queue(lambda: self._queued, lambda: self._held)
        self._queues: dict[Hashable, deque[Pending]] = {}  # key -> FIFO of its pending requests
        self._tokens: dict[Hashable, int] = {}  # key -> query tokens queued (kept, not re-summed per pass)
        self._work: dict[Hashable, float] = {}  # key -> estimated device seconds queued
        self._max_work = settings.max_batch_work_ms / 1000.0 or float("inf")
        self._speed = DEVICE_SPEED.get(self.workers[0].device.type, DEVICE_SPEED["cuda"])
        self._queued = 0
        self._held = 0  # queued + running
        self.activity = 0  # requests submitted plus requests finished, ever: moves while busy
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._latency_ema = 0.01  # seconds a launch takes, for Retry-After
        self._last_arrival = float("-inf")  # time.monotonic() of the last submit
        self._deadlines = Deadlines()

    # ---- the caller's side ----------------------------------------------------------------------

    @property
    def held(self) -> int:
        return self._held

    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_loop(), name="attnserve-batcher")

    async def submit(self, pending: Pending):
        """Queue ``pending`` and await its answer (or its error)."""
        if self._held >= self.settings.max_queue_size:
            retry = min(30.0, max(0.05, self._latency_ema * self._held / max(1, len(self.workers))))
            raise QueueFull(
                f"the server holds {self._held} requests (--max-queue-size "
                f"{self.settings.max_queue_size}); retry after {retry:.2f}s",
                retry_after_s=retry,
            )
        since, self._last_arrival = self._last_arrival, pending.enqueued
        if self._held == 0 and pending.enqueued - since >= ALONE_GAP_S:  # a worker may answer it at once
            result = self._answer_now(pending)
            self._last_arrival = time.monotonic()  # what arrives during the call came in a burst
            if result is not None:
                return result
        bandwidth, rate = self._speed
        pending.work = pending.io_bytes / bandwidth + pending.flops / rate
        self._queues.setdefault(pending.key, deque()).append(pending)
        self._tokens[pending.key] = self._tokens.get(pending.key, 0) + pending.tokens
        self._work[pending.key] = self._work.get(pending.key, 0.0) + pending.work
        self._queued += 1
        self._held += 1
        self.activity += 1
        self._idle.clear()
        entry = self._deadlines.add(pending)
        # The dispatcher runs on the next loop iteration, not here: the requests that arrive in
        # this one (e.g. every submitter a finished batch answered) then close as one batch;
        # dispatched inline, the first arrival would go to an idle worker alone
        # (see docs/benchmarks/service.md#batching).
        self._wake.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._abandoned(pending)
            raise
        finally:
            if entry is not None:
                self._deadlines.forget(entry)
            if not pending.launched:  # deadline passed or caller cancelled while queued: drop it
                pending.future.cancel()
                self._remove_queued(pending)
                self._release(pending)

    def _abandoned(self, pending: Pending) -> None:
        """The caller went away (its task was cancelled: an HTTP client hung up, a gRPC call was
        cancelled). Queued, it is dropped (``submit``'s ``finally``, as for a deadline); staged
        behind a running launch, its deadline is set to the past, so that the worker skips it as
        expired; already running, its launch goes on and the answer is dropped."""
        self.metrics.cancelled.labels(pending.kind, "launched" if pending.launched else "queued").inc()
        if pending.launched and not pending.released:
            pending.request.deadline = float("-inf")

    def _answer_now(self, pending: Pending):
        """A request that arrives while the server holds no other: its result from the worker the
        dispatcher would pick (``Worker.run_now``: a captured CUDA graph, replayed on this thread),
        or None when that worker cannot answer it at once."""
        result = self._least_loaded(self.workers).run_now(pending.request)
        if result is not None:
            pending.launched = True
            self.activity += 2  # submitted and finished (what idleness checks watch)
            self.metrics.queue_duration_of[pending.kind].observe(0.0)
        return result

    def _remove_queued(self, pending: Pending) -> None:
        q = self._queues.get(pending.key)
        if q is not None and pending in q:
            q.remove(pending)
            self._queued -= 1
            self._tokens[pending.key] -= pending.tokens
            self._work[pending.key] -= pending.work
            if not q:
                del self._queues[pending.key], self._tokens[pending.key], self._work[pending.key]

    def _release(self, pending: Pending) -> None:
        """Count a request as no longer held (once: when answered, or dropped before launch)."""
        if pending.released:
            return
        pending.released = True
        self._held -= 1
        self.activity += 1
        if self._held == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (used by drain)."""
        await self._idle.wait()

    async def stop(self) -> None:
        self._deadlines.stop()
        if self._task is not None:
            # Python 3.11's wait_for drops a cancel that comes as its wait ends (the dispatcher was
            # woken, say by a launch that just finished): the dispatcher then waits for ever
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pendings in self._queues.values():
            for p in pendings:
                p.resolve(Unavailable("the server is shutting down"))
        self._queues.clear()
        self._tokens.clear()
        self._work.clear()
        self._queued = 0

    # ---- the dispatcher ---------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                timeout = self._dispatch()
            except Exception:  # a bug here must not stop every later request: log, fail the queue
                log.exception("the batcher's dispatch failed; failing the queued requests")
                for pendings in self._queues.values():
                    for p in pendings:
                        p.resolve(ServiceError("internal error in the batcher; the request was not served"))
                timeout = None
            if timeout is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)

    def _dispatch(self) -> float | None:
        """Hand out every batch the policy allows now; return how long until the next may close."""
        batching = self.settings.batching
        delay = self.settings.max_queue_delay_ms / 1000.0
        while self._queues:
            now = time.monotonic()
            idle = [w for w in self.workers if w.inflight == 0]
            if idle:
                key = self._oldest_key()
                n = len(idle) if len(idle) > 1 and self._worth_sharing(key, len(idle)) else 1
                share = -(-self._tokens[key] // n)  # ceil
                self._launch(self._least_loaded(idle), self._take(key, share))
                continue
            free = [w for w in self.workers if w.inflight < STAGED_PER_WORKER]
            if not free:
                return None  # a finishing launch wakes us
            if not batching:  # one request per launch: stage the oldest at once
                self._launch(self._least_loaded(free), self._take(self._oldest_key()))
                continue
            wait = None
            for key in self._keys_oldest_first():
                q = self._queues[key]
                waited = now - q[0].enqueued
                full = self._tokens[key] >= self.settings.max_batch_tokens or self._work[key] >= self._max_work
                if full or waited >= delay:
                    self._launch(self._least_loaded(free), self._take(key))
                    break
                wait = delay - waited if wait is None else min(wait, delay - waited)
            else:
                return wait
        return None

    def _worth_sharing(self, key: Hashable, workers: int) -> bool:
        """Whether the batch ``key``'s queue would form keeps each of ``workers`` busy for at least
        SHARE_MIN_S of estimated device work."""
        tokens = work = 0
        for p in self._queues[key]:
            if tokens and (tokens + p.tokens > self.settings.max_batch_tokens or work + p.work > self._max_work):
                break
            tokens += p.tokens
            work += p.work
        return work / workers >= SHARE_MIN_S

    def _oldest_key(self) -> Hashable:
        return min(self._queues, key=lambda k: self._queues[k][0].enqueued)

    def _keys_oldest_first(self) -> list[Hashable]:
        return sorted(self._queues, key=lambda k: self._queues[k][0].enqueued)

    @staticmethod
    def _least_loaded(workers: list[Worker]) -> Worker:
        return min(workers, key=lambda w: w.load)

    def _take(self, key: Hashable, max_tokens: int | None = None) -> list[Pending]:
        """Pop the head of ``key``'s queue: up to ``max_tokens`` (default and at most
        max_batch_tokens), max_batch_work_ms and the worker's memory budget; always at least one
        request."""
        limit = min(max_tokens or self.settings.max_batch_tokens, self.settings.max_batch_tokens)
        q = self._queues[key]
        batch: list[Pending] = []
        tokens = memory = work = 0
        budget = min((w.memory_budget for w in self.workers), default=0) or None
        while q:
            p = q[0]
            if batch and (
                not self.settings.batching
                or tokens + p.tokens > limit
                or work + p.work > self._max_work
                or (budget is not None and memory + p.memory > budget)
            ):
                break
            q.popleft()
            batch.append(p)
            tokens += p.tokens
            memory += p.memory
            work += p.work
        self._tokens[key] -= tokens
        self._work[key] -= work
        if not q:
            del self._queues[key], self._tokens[key], self._work[key]
        self._queued -= len(batch)
        return batch

    def _launch(self, worker: Worker, batch: list[Pending]) -> None:
        now = time.monotonic()
        for p in batch:
            p.launched = True
            self.metrics.queue_duration_of[p.kind].observe(now - p.enqueued)
        try:  # the worker starts now (and counts the batch as its load); the task only awaits its answers
            answers = worker.submit([p.request for p in batch])
        except Exception as exc:  # noqa: BLE001 - e.g. a worker already shut down: this batch fails
            answers = asyncio.get_running_loop().create_future()
            answers.set_exception(exc)
        task = asyncio.create_task(self._run_batch(worker, batch, answers))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_batch(self, worker: Worker, batch: list[Pending], answers: asyncio.Future) -> None:
        """The batch step: exactly one answer per request, errors only to the requests they concern."""
        t0 = time.monotonic()
        try:
            outcomes = await answers
            if len(outcomes) != len(batch):
                raise RuntimeError(
                    f"worker {worker.name} gave {len(outcomes)} answers for {len(batch)} requests"
                )
        except Exception as exc:  # noqa: BLE001 - a worker-level failure fails its batch only
            log.exception("batch of %d on %s failed", len(batch), worker.name)
            error = (
                exc
                if isinstance(exc, ServiceError)
                else ServiceError("internal error while running a batch; the request was not served")
            )
            outcomes = [error] * len(batch)
        finally:
            self._latency_ema = 0.9 * self._latency_ema + 0.1 * (time.monotonic() - t0)
            self._wake.set()
        for p, outcome in zip(batch, outcomes, strict=True):
            p.resolve(outcome)
            self._release(p)
