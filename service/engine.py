"""The engine: what every transport calls. It owns the workers and the batcher.

Interface (stable; transports rely on it):
    engine = Engine(settings); await engine.start()
    engine.ready -> bool            # every worker compiled and warm, not draining
    await engine.attend(AttentionRequest) -> AttentionResult
    await engine.call_layer(LayerRequest) -> LayerResult
    engine.layer_infos() -> list[LayerInfo]
    await engine.drain()            # stop taking work, finish what is held
Raises only ``service.errors.ServiceError`` subclasses.

PLACEHOLDER implementation (one synchronous kernel call per request in a thread); the worker and
batcher issue replaces it behind the same interface.
"""

from __future__ import annotations

import asyncio

import kernels

from .errors import InvalidInput, NotFound, Unavailable, from_kernel_error
from .settings import Settings
from .types import AttentionRequest, AttentionResult, LayerRequest, LayerResult


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._ready = False
        self._draining = False

    async def start(self) -> None:
        self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready and not self._draining

    async def attend(self, req: AttentionRequest) -> AttentionResult:
        if not self.ready:
            raise Unavailable("the server is not ready (warming up or draining); retry shortly")
        try:
            out = await asyncio.to_thread(
                kernels.attention, req.q, req.k, req.v, causal=req.causal, scale=req.scale,
                kv_lengths=req.kv_lengths, return_lse=True, kernel=req.kernel,
            )
        except kernels.AttentionInputError as exc:
            raise from_kernel_error(exc) from None
        o, lse = out
        if req.layout == "bnhd":
            o = o.transpose(1, 2)
        return AttentionResult(o=o.contiguous(), lse=lse if req.return_lse else None, request_id=req.request_id)

    async def call_layer(self, req: LayerRequest) -> LayerResult:
        raise NotFound(f"unknown layer {req.layer!r}; GET /layers lists the loaded ones")

    def layer_infos(self) -> list:
        return []

    async def drain(self) -> None:
        self._draining = True


__all__ = ["Engine", "InvalidInput"]
