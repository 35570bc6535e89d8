"""The engine: what every transport calls. It owns the workers (one per device) and the batcher.

Interface (stable; transports rely on it):
    engine = Engine(settings); await engine.start()   # builds workers, compiles and warms kernels
    engine.ready -> bool            # every worker compiled and warm, and not draining
    await engine.attend(AttentionRequest) -> AttentionResult
    await engine.call_layer(LayerRequest) -> LayerResult
    engine.layer_infos() -> list[LayerInfo]
    await engine.drain()            # stop taking work (503), report not-ready, finish what is held
    engine.metrics_registry         # prometheus_client CollectorRegistry for GET /metrics
    engine.devices -> list[str]     # e.g. ["cuda:0", "cuda:1"] or ["cpu"]
    engine.on_gpu -> bool           # any worker on a CUDA device
    engine.requests_held -> int     # queued or running now
    engine.activity -> int          # moves whenever a request or step comes or goes, a session begins or ends
    engine.idle -> bool             # no request or session step queued or running
    engine.sessions                 # service.sessions.SessionManager: sessions and their steps (docs/api.md#sessions)
Raises only ``service.errors.ServiceError`` subclasses.

Deadlines: ``req.deadline`` is a ``time.monotonic()`` instant set by the transport (from
X-Request-Timeout-Ms or the gRPC deadline); when it is None the engine sets it to now +
``--request-timeout-ms``. A request is never launched once expired, and its caller gets
``DeadlineExceeded`` at the deadline. ``req.request_id`` comes back unchanged in the result.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import torch

import kernels
from service.core.batcher import Batcher, Pending
from service.core.devices import attention_memory, layer_memory, parse_dtypes, parse_shapes, resolve_devices
from service.core.metrics import Metrics
from service.core.staging import release_pinned_memory
from service.core.types import AttentionRequest, AttentionResult, LayerRequest, LayerResult
from service.core.worker import Worker
from service.errors import NotFound, PayloadTooLarge, ServiceError, Unavailable
from service.sessions import SessionManager
from service.settings import Settings

log = logging.getLogger("attnserve.engine")


def _load_layers(settings: Settings) -> dict[str, Any]:
    """The model layers of ``--layer`` (``service.layers``)."""
    if not settings.layer:
        return {}
    from service import layers

    return layers.load_layers(settings)


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.metrics_registry = self.metrics.registry
        self._layers: dict[str, Any] = {}
        self.workers: list[Worker] = []
        self.batcher: Batcher | None = None
        self.sessions: SessionManager | None = None
        self._started = False
        self._draining = False
        self._memory_budget = 0  # bytes: the least any worker may use (known once they are warm)

    @property
    def devices(self) -> list[str]:
        return [w.name for w in self.workers]

    def prepare(self) -> None:
        """Resolve the devices and load the layers: configuration errors (a bad ``--device``, a
        broken ``--layer``) raise here, before the server binds a port. Idempotent."""
        if self.workers:
            return
        sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1000.0)
        devices = resolve_devices(self.settings.device)
        parse_shapes(self.settings.warmup_shapes)  # a bad warm-up option fails here, before any port is bound
        parse_dtypes(self.settings.warmup_dtypes)
        self._layers = _load_layers(self.settings)
        self.workers = [Worker(d, self.settings, self.metrics, self._layers, name) for d, name in
                        zip(devices, worker_names(devices), strict=True)]
        self.batcher = Batcher(self.workers, self.settings, self.metrics)
        self.sessions = SessionManager(self.settings, self.metrics, self.workers, accepting=self._check_accepting,
                                       held_elsewhere=lambda: self.requests_held)

    async def start(self) -> None:
        """Prepare (if not yet), start a worker per device and warm each (concurrently); then ready."""
        if not self.workers:
            await asyncio.to_thread(self.prepare)
        await asyncio.gather(*(w.start() for w in self.workers))
        self.sessions.start()  # its KV caches come out of the workers' memory budgets
        self._memory_budget = min(w.memory_budget for w in self.workers)
        if not self.settings.autotune_new_shapes:
            kernels.freeze_autotuning()  # no tuning on the request path from here on
        self.batcher.start()
        self._started = True
        self.metrics.ready.set(1)
        log.info(
            "engine ready on %s (batching %s, max batch tokens %d, max batch work %.1f ms, max queue delay %.1f ms)",
            ", ".join(self.devices),
            "on" if self.settings.batching else "off",
            self.settings.max_batch_tokens,
            self.settings.max_batch_work_ms,
            self.settings.max_queue_delay_ms,
        )

    @property
    def requests_held(self) -> int:
        """Requests queued or running now."""
        return self.batcher.held if self.batcher is not None else 0

    @property
    def activity(self) -> int:
        """A count that moves whenever a request or a session step is submitted or finishes, or a
        session begins or ends (for idleness checks)."""
        return ((self.batcher.activity if self.batcher is not None else 0)
                + (self.sessions.activity if self.sessions is not None else 0))

    @property
    def idle(self) -> bool:
        """No request and no session step queued or running now."""
        return self.requests_held == 0 and (self.sessions is None or self.sessions.held == 0)

    @property
    def ready(self) -> bool:
        return self._started and not self._draining and all(w.ready for w in self.workers)

    def _check_accepting(self) -> None:
        if self._draining:
            raise Unavailable("the server is draining (shutting down); send the request to another replica")
        if not self._started:  # set once every worker is warm (start), so it stands for ``ready`` here
            raise Unavailable("the server is not ready (warming up its kernels); retry shortly")

    def _default_deadline(self, req: AttentionRequest | LayerRequest) -> None:
        if req.deadline is None:
            req.deadline = req.arrived + self.settings.request_timeout_ms / 1000.0

    def _check_memory(self, need: int, what: str) -> None:
        budget = self._memory_budget
        if need > budget:
            raise PayloadTooLarge(
                f"{what} needs about {need / 2**20:.0f} MiB of device memory, more than a "
                f"worker may use ({budget / 2**20:.0f} MiB); split it along the batch"
            )

    async def _submit(self, pending: Pending):
        t0 = pending.enqueued
        try:
            result = await self.batcher.submit(pending)
        except ServiceError as exc:
            self.metrics.failed(pending.kind, exc.code)
            raise
        self.metrics.success_of[pending.kind].inc()
        self.metrics.request_duration_of[pending.kind].observe(time.monotonic() - t0)
        return result

    async def attend(self, req: AttentionRequest) -> AttentionResult:
        """Answer one attention request: validated here, batched, run on the least-loaded worker."""
        try:
            self._check_accepting()
            spec = req.spec  # the request checks itself, once (types.AttentionRequest.spec)
            memory = attention_memory(req, self.workers[0].device.type)
            self._check_memory(memory, "this attention request")
        except ServiceError as exc:
            self.metrics.failed("attention", exc.code)
            raise
        self._default_deadline(req)
        rows_q, rows_kv = spec.batch * spec.heads_q * spec.n_q, spec.batch * spec.heads_kv * spec.n_k
        io_bytes = req.q.element_size() * 2 * spec.head_dim * (rows_q + rows_kv) + 4 * rows_q  # q,k,v,o + lse
        flops = 4.0 * rows_q * spec.n_k * spec.head_dim * (0.5 if spec.causal else 1.0)
        pending = Pending(req, memory=memory, io_bytes=io_bytes, flops=flops, kind="attention")
        return await self._submit(pending)

    async def call_layer(self, req: LayerRequest) -> LayerResult:
        """Run one model-layer call (x: (B, N, hidden)), batched with calls of the same layer and N."""
        try:
            self._check_accepting()
            layer = self._layers.get(req.layer)
            if layer is None:
                raise NotFound(f"unknown layer {req.layer!r}; GET /layers lists the loaded ones")
            layer.check_call(req.x, req.positions, req.kv_lengths, causal=req.causal)
            b, n = req.x.shape[0], req.x.shape[1]
            memory = layer_memory(req, layer.info.hidden_size)
            self._check_memory(memory, f"this call of layer {req.layer!r}")
        except ServiceError as exc:
            self.metrics.failed("layer", exc.code)
            raise
        self._default_deadline(req)
        h = layer.info.hidden_size
        io_bytes = 2 * b * n * h * req.x.element_size()  # x in, y out
        flops = 8.0 * b * n * h * h + 4.0 * b * n * n * h  # q/k/v/o projections + attention
        pending = Pending(req, memory=memory, io_bytes=io_bytes, flops=flops, kind="layer")
        return await self._submit(pending)

    @property
    def on_gpu(self) -> bool:
        """Whether any worker runs on a CUDA device (known once ``prepare`` has run)."""
        return any(w.device.type == "cuda" for w in self.workers)

    def release_cached_host_memory(self) -> None:
        """Free the pinned host buffers torch keeps cached for the GPU workers' staging (when
        idle: freeing pinned memory waits for the device)."""
        if self.on_gpu:
            release_pinned_memory()

    async def release_cached_device_memory(self) -> None:
        """Give each GPU the blocks torch's caching allocator keeps free (an ended session's KV
        pages return there), on the worker's launcher thread, in order with its launches and CUDA
        graph captures. For an idle server: nvidia-smi then shows what the tensors hold."""
        await asyncio.gather(*(w.run_on_device(_empty_device_cache) for w in self.workers
                               if w.device.type == "cuda"))

    def layer_infos(self) -> list:
        return [layer.info for layer in self._layers.values()]

    async def drain(self) -> None:
        """Stop taking new work (503), report not-ready, finish everything held, stop the workers."""
        self._draining = True
        self.metrics.ready.set(0)
        if self.batcher is not None:
            await self.batcher.wait_idle()
            await self.batcher.stop()
        if self.sessions is not None:
            await self.sessions.stop()  # after the steps it holds
        for w in self.workers:
            await asyncio.to_thread(w.close)
        log.info("engine drained")


def _empty_device_cache(lock: Any) -> tuple[None, None]:
    """``Worker.run_on_device``'s fn: free the launcher thread's device's cached blocks."""
    torch.cuda.empty_cache()
    return None, None


def worker_names(devices: list[torch.device]) -> list[str]:
    """Each worker's name: its device's ("cuda:1"); a device listed twice ("--device cpu,cpu") gets
    "cpu-0", "cpu-1", so that its workers' metrics do not share one label."""
    names = [str(d) for d in devices]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if names.count(n) > 1:
            seen[n] = seen.get(n, -1) + 1
            n = f"{n}-{seen[n]}"
        out.append(n)
    return out


__all__ = ["Engine"]
