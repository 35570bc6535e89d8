"""A worker per device: it warms the kernels, then runs batches off the event loop, in its own thread.

One launch of a batch (``Worker.submit``):
    requests (CPU tensors, maybe read-only views of request bytes; never written into)
      -> concatenated along B into one staging tensor (pinned host memory on a GPU: ``staging``)
      -> copied to the device (non-blocking, on the worker's own CUDA stream)
      -> one kernel launch (``kernels.attention``) or one layer forward (``launches``)
      -> copied back into pinned host memory, split along B: one answer per request.

A request that comes alone to an idle server may instead be answered at once on the event loop
(``Worker.run_now``): its shape's launch, captured once as a CUDA graph, is replayed (``graphs``).

The worker counts what it holds itself (``inflight``, ``load``): ``submit`` counts a batch, and
un-counts it once its answers are settled; no other module writes a worker's fields.

Faults stay inside the batch: a device out-of-memory splits the batch in halves and retries each
(one oversized request cannot fail the others; alone it gets 503); any other error is retried
request by request, so that a bad request fails alone, and becomes a ``ServiceError`` with a safe
message. The worker stays usable afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import kernels
import kernels.autotune_cache
from kernels import precompile
from service.core import launches, staging
from service.core.devices import parse_dtypes, parse_shapes
from service.core.graphs import Graphs
from service.core.launches import Outcome, Part, failed
from service.core.metrics import Metrics
from service.core.types import AttentionRequest, AttentionResult, LayerRequest
from service.errors import DeadlineExceeded, InvalidInput, ServiceError, Unavailable, from_kernel_error
from service.settings import Settings

log = logging.getLogger("attnserve.worker")

# Triton's JIT and autotuner keep per-kernel state (first-call compile, ``Autotuner.nargs``,
# benchmarking a new key) that is not safe to drive from two threads at once: GPU workers enqueue
# their launches one at a time. A launch is asynchronous, so this costs little; the GPUs still
# run in parallel.
_LAUNCH_LOCK = threading.Lock()

Request = AttentionRequest | LayerRequest


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


class Worker:
    """Owns one device: its thread, its CUDA stream, its copies of the layers."""

    def __init__(self, device: torch.device, settings: Settings, metrics: Metrics, layers: dict[str, Any],
                 name: str | None = None):
        """``name``: its label in metrics and logs (default: the device's)."""
        self.device = device
        self.name = name or str(device)
        self.settings = settings
        self.metrics = metrics
        self._host_layers = layers
        self.layers: dict[str, Any] = {}  # name -> DeviceLayer
        self.ready = False
        self._inflight = 0  # batches submitted whose answers are not settled yet
        self._inflight_tokens = 0  # their query tokens
        # tasks handed to the launcher thread (written on the event loop only) and finished there
        # (written on the launcher thread only): equal, the thread is idle (``idle``)
        self._tasks_sent = 0
        self._tasks_done = 0
        self.memory_budget = 0
        # this device's series, looked up once (``labels()`` costs more than an observation)
        self._compute_duration = metrics.compute_duration.labels(self.name)
        self._batch_size = metrics.batch_size.labels(self.name)
        self._exec_count = metrics.exec_count.labels(self.name)
        self._cuda = device.type == "cuda"
        self._copy_in_stream = self._compute_stream = self._copy_out_stream = None
        # CUDA graphs of small request shapes (``run_now``): none on the CPU or with --graph-max-kib 0
        graph_bytes = int(settings.graph_max_kib * 1024) if self._cuda else 0
        self._graphs = Graphs(self.name, device, graph_bytes) if graph_bytes else None
        self._graph_exec = metrics.graph_exec.labels(self.name)
        init = (lambda: torch.cuda.set_device(device)) if self._cuda else None
        self._launcher = ThreadPoolExecutor(1, f"attnserve-launch-{self.name}", initializer=init)
        self._finisher = ThreadPoolExecutor(1, f"attnserve-finish-{self.name}", initializer=init)

    # ---- start-up -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Move the layers to the device, compile and warm the kernels; then ``ready``."""
        await asyncio.get_running_loop().run_in_executor(self._launcher, self._start)
        self.ready = True

    def _start(self) -> None:
        t0 = time.perf_counter()
        if self._cuda:
            self._copy_in_stream = torch.cuda.Stream(self.device)
            self._compute_stream = torch.cuda.Stream(self.device)
            self._copy_out_stream = torch.cuda.Stream(self.device)
            if self._graphs is not None:
                self._graphs.start()
            self.metrics.track_device_memory(self.name)
        for name, layer in self._host_layers.items():
            self.layers[name] = layer.to(self.device)
        with self._launch_lock():
            self._warmup()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            self.memory_budget = int(total * self.settings.memory_fraction) - torch.cuda.memory_allocated(
                self.device
            )
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.memory_budget = int(total * self.settings.memory_fraction)
        log.info(
            "worker %s warm in %.1fs (memory budget %.1f GiB)",
            self.name,
            time.perf_counter() - t0,
            self.memory_budget / 2**30,
        )

    def _warmup(self) -> None:
        """Compile (and autotune) the kernels for the configured shapes and for every layer, and the
        ragged and paged kernels for their head counts and dims at --kv-page-tokens. On a GPU the
        variants it would compile are first compiled in parallel (--precompile), then it runs."""
        kernels.autotune_cache.set_enabled(self.settings.autotune_cache)
        if self._cuda and self.settings.precompile != "off":
            what = repr((sorted((name, layer.info) for name, layer in self.layers.items()),
                         self.settings.warmup_shapes, self.settings.warmup_dtypes, self.settings.kv_page_tokens))
            precompile.ahead(self._warmup_kernels, self.settings.precompile_workers, self.settings.precompile,
                             warmup_key=what)
        self._warmup_kernels()

    def _warmup_kernels(self) -> None:
        with torch.no_grad():
            for layer in self.layers.values():  # the layer's head dim and dtype
                for causal in (False, True):  # a non-causal call is at most a sliding window long
                    n = 16 if causal or layer.sliding_window is None else min(16, layer.sliding_window)
                    layer.forward(torch.zeros(1, n, layer.info.hidden_size, device=self.device), causal=causal)
            shapes = parse_shapes(self.settings.warmup_shapes)
            dtypes = parse_dtypes(self.settings.warmup_dtypes) if self._cuda else [torch.float32]
            if not self._cuda:  # nothing to compile or tune on the CPU: check each head dim's path runs
                shapes = sorted({(1, 1, min(n, 64), d) for _, _, n, d in shapes})
            if shapes:
                kernels.warmup(shapes=shapes, dtypes=dtypes, device=self.device)
            if shapes and self._cuda:  # session steps and packed stateless batches: their kernels too
                kernels.warmup_ragged({(h, d) for _, h, _, d in shapes}, dtypes, self.settings.kv_page_tokens,
                                      self.device)

    # ---- running a batch ----------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        """Batches submitted to this worker whose answers are not settled yet."""
        return self._inflight

    @property
    def load(self) -> tuple[int, int]:
        """(batches in flight, their query tokens): the batcher hands work to the least loaded."""
        return self._inflight, self._inflight_tokens

    def submit(self, requests: Sequence[Request]) -> asyncio.Future[list[Outcome]]:
        """Start one launch of ``requests`` now; its future (on the running loop) gives one outcome
        per request, in order: a result or the ServiceError that request gets.

        Two stages, each in its own thread, so that consecutive batches overlap: the launcher
        stages the inputs and enqueues the copies and the kernel (on a GPU nothing waits there);
        the finisher waits for the device and splits the answers. The launcher hands its parts to
        the finisher itself, so the event loop wakes once per batch, when the answers are ready.
        Called on the loop, synchronously: the launcher starts while the caller goes on. The
        batch counts in ``load`` from here until its answers are settled (or the launcher refuses
        it: then this raises, and it never counted).
        """
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        answered: asyncio.Future[list[Outcome]] = loop.create_future()
        requests = list(requests)
        tokens = sum(r.tokens for r in requests)

        def settle(outcomes=None, exc=None) -> None:
            self._inflight -= 1
            self._inflight_tokens -= tokens
            launched = len(requests) if outcomes is None else launches.launched(outcomes)
            if launched:  # a launch whose requests had all expired ran nothing: not a launch
                self._compute_duration.observe(time.perf_counter() - t0)
                self._batch_size.observe(launched)
                self._exec_count.inc()
            if answered.done():  # the awaiting coroutine was cancelled
                return
            if exc is not None:
                answered.set_exception(exc)
            else:
                answered.set_result(outcomes)

        def finish(parts: list[Part], staged: float) -> None:
            try:
                outcomes = launches.finish_all(parts)
                inputs = max((p.staged_at for p in parts if p.staged_at), default=staged)
                stamps = (t0, inputs, staged, time.perf_counter())
                for outcome in outcomes:
                    if not isinstance(outcome, ServiceError):
                        outcome.stamps = stamps
                answer = (outcomes, None)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                answer = (None, exc)
            # The executor holds this call's arguments until it returns, and the parts hold the
            # pinned host buffers of the answers: let them go before the caller is answered, or an
            # idle release right after the answer finds them still in use.
            parts.clear()
            loop.call_soon_threadsafe(settle, *answer)

        def launch() -> None:
            try:
                parts = self._launch_all(requests)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                if self._cuda:
                    self._finisher.submit(finish, parts, time.perf_counter())
                else:  # the CPU computed in the launcher: nothing is left to wait for
                    finish(parts, time.perf_counter())

        self._inflight += 1
        self._inflight_tokens += tokens
        try:
            self._to_launcher(launch)
        except BaseException:  # e.g. the worker is shut down: the batch never ran
            self._inflight -= 1
            self._inflight_tokens -= tokens
            raise
        if self._graphs is not None and self._graphs.wanted:  # after this launch: its caller does not wait
            self._to_launcher(self._graphs.capture_wanted, self._launch_lock())
        return answered

    def run_on_device(self, fn: Callable[[Any], tuple[Any, Any]]) -> asyncio.Future:
        """Run ``fn(launch_lock)`` on this worker's launcher thread, in order with its batches, under
        ``torch.no_grad`` and on its compute stream; ``fn`` returns (value, a CUDA event or None).
        The future (on the running loop) gives (``value``, the ``time.perf_counter()`` instant the
        event was found complete) once it is (waited for on the finisher thread), or what ``fn``
        raised. The session steps' launches use it
        (``service.sessions``), and so do their KV cache's page bookkeeping and releases."""
        loop = asyncio.get_running_loop()
        answered: asyncio.Future = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if not answered.done():
                if exc is not None:
                    answered.set_exception(exc)
                else:
                    answered.set_result(value)

        def finish(value: Any, done: Any) -> None:
            try:
                if done is not None:
                    done.synchronize()
                answer = ((value, time.perf_counter()), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                answer = (None, exc)
            loop.call_soon_threadsafe(settle, *answer)

        def launch() -> None:
            try:
                with torch.no_grad(), self._on_compute_stream():
                    value, done = fn(self._launch_lock())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle, None, exc)
                return
            if done is not None:
                self._finisher.submit(finish, value, done)
            else:
                finish(value, None)

        self._to_launcher(launch)
        return answered

    @property
    def idle(self) -> bool:
        """Warm, with no batch in flight and nothing queued or running on the launcher thread: what
        ``run_inline`` needs. (Event loop.)"""
        return self.ready and self._inflight == 0 and self._tasks_sent == self._tasks_done

    def run_inline(self, fn: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, float] | None:
        """Event loop, only while ``idle``: what ``run_on_device(fn)`` would give, computed here and
        now, waiting for the device; or None, having run nothing, when another worker's thread holds
        the process's launch lock (it may be compiling a kernel: the loop must not wait for that).
        Nothing else can reach this device or its launcher thread meanwhile (only the loop hands
        them work), so ``fn`` may touch what the launcher thread owns (the sessions' page tables).
        It saves the two thread hand-offs and the loop's wake-up of a step that comes alone
        (``service.sessions.scheduler``)."""
        lock = self._launch_lock()
        if isinstance(lock, contextlib.nullcontext):
            held = lock
        elif lock.acquire(blocking=False):
            held = contextlib.nullcontext()  # fn's ``with lock`` then nests inside this hold
        else:
            return None
        try:
            device = torch.cuda.device(self.device) if self._cuda else contextlib.nullcontext()
            with torch.no_grad(), device, self._on_compute_stream():
                value, done = fn(held)
        finally:
            if held is not lock:
                lock.release()
        if done is not None:
            done.synchronize()
        return value, time.perf_counter()

    def _on_compute_stream(self):
        return torch.cuda.stream(self._compute_stream) if self._cuda else contextlib.nullcontext()

    def _to_launcher(self, fn: Callable, *args: Any) -> None:
        """Hand ``fn(*args)`` to the launcher thread, counted until it returns (``idle``)."""

        def counted() -> None:
            try:
                fn(*args)
            finally:
                self._tasks_done += 1

        self._launcher.submit(counted)
        self._tasks_sent += 1

    # ---- small requests at once: CUDA graphs --------------------------------------------------

    def run_now(self, req: Request) -> AttentionResult | None:
        """Event loop: answer ``req`` now, by replaying the CUDA graph captured for its shape; or
        None when it cannot (not on a GPU, not an attention request of at most --graph-max-kib,
        deadline passed, no graph yet): the caller then queues it as usual.

        This is the worker's one entry point besides ``submit``. The batcher calls it only while it
        holds no other request, so the device is idle and the loop waits for it briefly:
        host->pinned memcpy, one host->device copy, the graph, the device->host copies
        (``graphs``: the first request of a shape asks for a graph and takes the usual path)."""
        if self._graphs is None or not isinstance(req, AttentionRequest) or req.kernel == "reference":
            return None  # (the reference kernel reads kv_lengths on the host: it cannot be captured)
        replayed = self._graphs.replay(req)
        if replayed is None:
            return None
        o, lse, stamps = replayed
        self._compute_duration.observe(stamps[3] - stamps[0])
        self._batch_size.observe(1)
        self._exec_count.inc()
        self._graph_exec.inc()
        if req.layout == "bnhd":
            o = o.transpose(1, 2).contiguous()  # (B, Hq, Nq, D) -> (B, Nq, Hq, D)
        return AttentionResult(o=o, lse=lse, request_id=req.request_id, stamps=stamps)

    def _launch_all(self, requests: list[Request]) -> list[Part]:
        """Launcher thread: one ``Part`` per run of consecutive requests, covering all in order."""
        now = time.monotonic()
        parts: list[Part] = []
        live: list[Request] = []

        def flush() -> None:
            if live:
                parts.extend(self._run_group(list(live)))
                live.clear()

        for r in requests:
            if r.deadline is not None and r.deadline <= now:  # never launched once expired
                flush()
                parts.append(failed([DeadlineExceeded("the request's deadline passed before it could run")]))
            else:
                live.append(r)
        flush()
        return parts

    def _run_group(self, reqs: list[Request]) -> list[Part]:
        try:
            with torch.no_grad():
                if self._cuda:
                    with torch.cuda.stream(self._compute_stream):
                        part = self._launch(reqs)
                else:
                    part = self._launch(reqs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a per-request outcome
            if _is_oom(exc):
                self._after_oom()
                if len(reqs) == 1:
                    log.warning("worker %s: out of memory on one request (%s)", self.name, _describe(reqs[0]))
                    msg = "the device ran out of memory for this request; send a smaller one or retry later"
                    return [failed([Unavailable(msg)])]
                self.metrics.oom_splits.labels(self.name).inc()
                mid = len(reqs) // 2
                return self._run_group(reqs[:mid]) + self._run_group(reqs[mid:])
            if len(reqs) > 1:  # isolate the request that fails: the others must not pay for it
                return [p for r in reqs for p in self._run_group([r])]
            return [failed([self._error(exc, reqs[0])])]
        part.requests = reqs
        part.on_error = self._error
        return [part]

    def _error(self, exc: BaseException, req: Request) -> ServiceError:
        if isinstance(exc, ServiceError):
            return exc
        if isinstance(exc, kernels.AttentionInputError):
            return from_kernel_error(exc)
        log.error("worker %s: request %s failed: %r", self.name, req.request_id, exc, exc_info=exc)
        return ServiceError(
            f"internal error while computing the request (id {req.request_id}); "
            "it was not served, other requests are unaffected"
        )

    def _launch_lock(self):
        """The process-wide launch lock on a GPU; none on the CPU (its workers compute in parallel)."""
        return _LAUNCH_LOCK if self._cuda else contextlib.nullcontext()

    def _after_oom(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _launch(self, reqs: list[Request]) -> Part:
        if isinstance(reqs[0], AttentionRequest):
            return self._launch_attention(reqs)  # type: ignore[arg-type]
        return self._launch_layer(reqs)  # type: ignore[arg-type]

    def _stage(self, *groups: staging.Group | None) -> list[torch.Tensor | None]:
        """One tensor per group of parts, concatenated along dim 0 on the device (``staging.stage``)."""
        return staging.stage(groups, self.device, self._copy_in_stream, self._compute_stream)

    def _to_host(self, tensors: Sequence[torch.Tensor | None]) -> tuple[list, Any]:
        """Device->host copies after the compute so far, and their event (``staging.to_host``)."""
        return staging.to_host(tensors, self._compute_stream, self._copy_out_stream)

    def _launch_attention(self, reqs: list[AttentionRequest]) -> Part:
        return launches.launch_attention(reqs, self._stage, self._to_host, self._launch_lock())

    def _launch_layer(self, reqs: list[LayerRequest]) -> Part:
        layer = self.layers.get(reqs[0].layer)
        if layer is None:
            raise InvalidInput(f"layer {reqs[0].layer!r} is not loaded on {self.name}")
        return launches.launch_layer(reqs, layer, self._stage, self._to_host, self._launch_lock())

    def close(self) -> None:
        self._launcher.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        if self._graphs is not None:
            self._graphs.clear()


def _describe(r: Request) -> str:
    if isinstance(r, AttentionRequest):
        return f"q {list(r.q.shape)} k {list(r.k.shape)} {r.q.dtype}"
    return f"layer {r.layer} x {list(r.x.shape)}"
