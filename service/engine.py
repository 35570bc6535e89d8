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

import kernels

from .batcher import Batcher, Pending
from .errors import InvalidInput, NotFound, PayloadTooLarge, ServiceError, Unavailable, from_kernel_error
from .metrics import Metrics
from .settings import Settings
from .types import AttentionRequest, AttentionResult, LayerRequest, LayerResult
from .worker import Worker, attention_memory, layer_memory, resolve_devices

log = logging.getLogger("attnserve.engine")


def _load_layers(settings: Settings) -> dict[str, Any]:
    """The model layers of ``--layer`` (service/layers.py; none when that module is absent)."""
    if not settings.layer:
        return {}
    try:
        from . import layers
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.layers":
            raise
        log.warning("--layer given but service/layers.py is not available: no layers are served")
        return {}
    return layers.load_layers(settings)


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.metrics_registry = self.metrics.registry
        self._layers: dict[str, Any] = {}
        self.workers: list[Worker] = []
        self.batcher: Batcher | None = None
        self._started = False
        self._draining = False

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
        self._layers = _load_layers(self.settings)
        self.workers = [Worker(d, self.settings, self.metrics, self._layers) for d in devices]
        self.batcher = Batcher(self.workers, self.settings, self.metrics)

    async def start(self) -> None:
        """Prepare (if not yet), start a worker per device and warm each (concurrently); then ready."""
        if not self.workers:
            await asyncio.to_thread(self.prepare)
        await asyncio.gather(*(w.start() for w in self.workers))
        if not self.settings.autotune_new_shapes:
            kernels.freeze_autotuning()  # no tuning on the request path from here on
        self.batcher.start()
        self._started = True
        self.metrics.ready.set(1)
        log.info(
            "engine ready on %s (batching %s, max batch tokens %d, max queue delay %.1f ms)",
            ", ".join(self.devices),
            "on" if self.settings.batching else "off",
            self.settings.max_batch_tokens,
            self.settings.max_queue_delay_ms,
        )

    @property
    def ready(self) -> bool:
        return self._started and not self._draining and all(w.ready for w in self.workers)

    def _check_accepting(self) -> None:
        if self._draining:
            raise Unavailable("the server is draining (shutting down); send the request to another replica")
        if not self.ready:
            raise Unavailable("the server is not ready (warming up its kernels); retry shortly")

    def _default_deadline(self, req: AttentionRequest | LayerRequest) -> None:
        if req.deadline is None:
            req.deadline = req.arrived + self.settings.request_timeout_ms / 1000.0

    def _check_memory(self, need: int, what: str) -> None:
        budget = min(w.memory_budget for w in self.workers)
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
            self.metrics.failure.labels(pending.kind, exc.code).inc()
            raise
        self.metrics.success_of[pending.kind].inc()
        self.metrics.request_duration_of[pending.kind].observe(time.monotonic() - t0)
        return result

    async def attend(self, req: AttentionRequest) -> AttentionResult:
        """Answer one attention request: validated here, batched, run on the least-loaded worker."""
        try:
            self._check_accepting()
            try:
                spec = kernels.check_inputs(
                    req.q, req.k, req.v, causal=req.causal, scale=req.scale, kv_lengths=req.kv_lengths
                )
            except kernels.AttentionInputError as exc:
                raise from_kernel_error(exc) from None
            if req.kernel not in kernels.KERNELS:
                raise InvalidInput(
                    f"unknown kernel {req.kernel!r}; choose one of {', '.join(kernels.KERNELS)}"
                )
            if req.layout not in ("bhnd", "bnhd"):
                raise InvalidInput(f"unknown layout {req.layout!r}; use 'bhnd' or 'bnhd'")
            memory = attention_memory(req, self.workers[0].device.type)
            self._check_memory(memory, "this attention request")
        except ServiceError as exc:
            self.metrics.failure.labels("attention", exc.code).inc()
            raise
        self._default_deadline(req)
        # Requests that can share a launch: equal after layout normalisation. kv_lengths presence is
        # part of the key (a padded launch differs from an unpadded one); layout and return_lse are not.
        key = (
            "attention",
            spec.dtype,
            spec.heads_q,
            spec.heads_kv,
            spec.n_q,
            spec.n_k,
            spec.head_dim,
            spec.causal,
            spec.scale,
            req.kernel,
            spec.has_kv_lengths,
        )
        pending = Pending(req, key, tokens=spec.batch * spec.n_q, memory=memory, kind="attention")
        return await self._submit(pending)

    async def call_layer(self, req: LayerRequest) -> LayerResult:
        """Run one model-layer call (x: (B, N, hidden)), batched with calls of the same layer and N."""
        try:
            self._check_accepting()
            layer = self._layers.get(req.layer)
            if layer is None:
                raise NotFound(f"unknown layer {req.layer!r}; GET /layers lists the loaded ones")
            hidden = layer.info.hidden_size
            x = req.x
            if x.dim() != 3 or x.shape[-1] != hidden or x.shape[0] < 1 or x.shape[1] < 1:
                raise InvalidInput(
                    f"x must have shape [B, N, {hidden}] for layer {req.layer!r}, got {list(x.shape)}"
                )
            if not x.is_floating_point():
                raise InvalidInput(f"x must be a float tensor, got {x.dtype}")
            b, n = x.shape[0], x.shape[1]
            if req.positions is not None and (
                req.positions.shape != (b, n) or req.positions.is_floating_point()
            ):
                raise InvalidInput(
                    f"positions must be int64 [B, N] = [{b}, {n}], got "
                    f"{req.positions.dtype} {list(req.positions.shape)}"
                )
            if req.kv_lengths is not None:
                kvl = req.kv_lengths
                if kvl.shape != (b,) or kvl.is_floating_point() or int(kvl.min()) < 0 or int(kvl.max()) > n:
                    raise InvalidInput(f"kv_lengths must be integers [B] = [{b}] within [0, {n}]")
            self._check_memory(layer_memory(req, hidden), f"this call of layer {req.layer!r}")
        except ServiceError as exc:
            self.metrics.failure.labels("layer", exc.code).inc()
            raise
        self._default_deadline(req)
        key = (
            "layer",
            req.layer,
            req.x.shape[1],
            bool(req.causal),
            req.positions is not None,
            req.kv_lengths is not None,
        )
        pending = Pending(
            req, key, tokens=req.x.shape[0] * req.x.shape[1], memory=layer_memory(req, hidden), kind="layer"
        )
        return await self._submit(pending)

    def layer_infos(self) -> list:
        return [layer.info for layer in self._layers.values()]

    async def drain(self) -> None:
        """Stop taking new work (503), report not-ready, finish everything held, stop the workers."""
        self._draining = True
        self.metrics.ready.set(0)
        if self.batcher is not None:
            await self.batcher.wait_idle()
            await self.batcher.stop()
        for w in self.workers:
            await asyncio.to_thread(w.close)
        log.info("engine drained")


__all__ = ["Engine"]
