"""The gRPC front end: attention.v1.AttentionService, the Open Inference Protocol's
inference.GRPCInferenceService (``grpc_oip``), grpc.health.v1.Health and server reflection, on one
``grpc.aio`` server in the service's event loop, sharing the engine with the HTTP server.

Handlers only convert messages <-> internal requests (``grpc_codec``) and await the engine. Every
status code is set in one place, ``ServiceInterceptor``: it checks the API key (``authorization:
Bearer KEY`` metadata) and turns ``service.errors.ServiceError`` into the status of API.md §7.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import grpc_codec, grpc_oip
from .auth import check_api_key
from .errors import BadRequest, ServiceError
from .grpc_codec import offload, result_bytes
from .protogen import attention_stubs
from .settings import Settings

log = logging.getLogger("attnserve.grpc")

stubs = attention_stubs()
pb, pb_grpc = stubs.attention_pb2, stubs.attention_pb2_grpc

ATTENTION_SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
# Reachable without an API key: health probes (as /healthz, /readyz, /v2/health/*) and reflection.
KEY_EXEMPT_SERVICES = frozenset({
    health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection",
})
KEY_EXEMPT_METHODS = frozenset(grpc_oip.HEALTH_METHODS)
STREAM_WINDOW = grpc_oip.STREAM_WINDOW  # calls one stream may have in flight (then flow control)
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's own ceiling for a message-size option


# ---- one place for status codes ---------------------------------------------------------------

async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Turn an exception into the call's final status (API.md §7); never leaks a stack trace."""
    if isinstance(exc, ServiceError):
        trailers = [("attnserve-error-code", exc.code)]
        if exc.retry_after_s is not None:
            trailers.append(("retry-after", f"{exc.retry_after_s:g}"))
        await context.abort(grpc.StatusCode[exc.grpc_code], exc.message, trailing_metadata=tuple(trailers))
    log.error("unexpected error in a gRPC handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error ({type(exc).__name__}); see the server log")


class _Malformed:
    """What a request that does not parse becomes, so that the handler wrapper can refuse it."""

    def __init__(self, exc: Exception):
        self.message = f"the request message does not parse as protobuf ({exc})"


def _lenient(deserialize):
    """A request deserializer that never raises (gRPC would answer UNKNOWN): INVALID_ARGUMENT instead."""
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError and friends
            return _Malformed(exc)

    return parse


def _parsed(request):
    if isinstance(request, _Malformed):
        raise BadRequest(request.message)
    return request


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """API key check and ServiceError -> status code, around every unary and bidi-stream handler."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def _check_key(self, details: grpc.HandlerCallDetails) -> None:
        if not self.settings.api_key or details.method in KEY_EXEMPT_METHODS:
            return
        metadata = {key: value for key, value in (details.invocation_metadata or ())}
        check_api_key(self.settings, metadata.get("authorization"), metadata.get("x-api-key"))

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        if details.method.rpartition("/")[0].lstrip("/") in KEY_EXEMPT_SERVICES:  # "/pkg.Service/Method"
            return handler
        check = self._check_key

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                try:
                    check(details)
                    return await behavior(_parsed(request), context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary, _lenient(handler.request_deserializer),
                                                       handler.response_serializer)
        if handler.stream_stream is not None:
            behavior = handler.stream_stream

            async def bidi(request_iterator, context):
                try:
                    check(details)
                    requests = (_parsed(request) async for request in request_iterator)
                    async for response in behavior(requests, context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc)

            return grpc.stream_stream_rpc_method_handler(bidi, _lenient(handler.request_deserializer),
                                                         handler.response_serializer)
        return handler  # no unary-stream or stream-unary rpc of ours exists


# ---- attention.v1.AttentionService ------------------------------------------------------------

class AttentionServicer(pb_grpc.AttentionServiceServicer):
    def __init__(self, engine):
        self.engine = engine

    async def _attend(self, request, deadline: float | None, request_id: str | None = None):
        req = await offload(request.ByteSize(), grpc_codec.attention_request, request, deadline=deadline,
                            request_id=request_id)
        res = await self.engine.attend(req)
        return await offload(result_bytes(res.o, res.lse), grpc_codec.attend_response, res)

    async def Attend(self, request, context):
        return await self._attend(request, grpc_codec.deadline_of(context))

    async def AttendStream(self, request_iterator, context):
        deadline = grpc_codec.deadline_of(context)

        async def one(i: int, request):
            rid = request.request_id or str(i)
            try:
                return await self._attend(request, deadline, rid)
            except ServiceError as exc:  # the stream ends with this call's status; say which call
                message = f"request_id {rid!r}: {exc.message}"
                raise type(exc)(message, retry_after_s=exc.retry_after_s) from None

        async for response in grpc_codec.run_concurrently(request_iterator, one, STREAM_WINDOW):
            yield response

    async def CallLayer(self, request, context):
        req = await offload(request.ByteSize(), grpc_codec.layer_request, request,
                            deadline=grpc_codec.deadline_of(context))
        res = await self.engine.call_layer(req)
        return await offload(result_bytes(res.y), grpc_codec.layer_response, res)

    async def ListLayers(self, request, context):
        return pb.ListLayersResponse(layers=[grpc_codec.layer_info(i) for i in self.engine.layer_infos()])


# ---- grpc.health.v1.Health, following the engine ----------------------------------------------

class EngineHealth(health_pb2_grpc.HealthServicer):
    """SERVING once the engine is ready (warm), NOT_SERVING before that and while draining.

    Read from the engine on every Check; Watch polls it. Once the server drains, Watch sends
    NOT_SERVING and ends, so that open watches do not hold the server's shutdown to its grace period.
    """

    SERVICES = ("", ATTENTION_SERVICE, grpc_oip.SERVICE_NAME)
    POLL_S = 0.25

    def __init__(self, engine):
        self.engine = engine
        self._served = False  # ready once: not-ready after that means draining

    def status(self, service: str):
        if service not in self.SERVICES:
            return None
        if self.engine.ready:
            self._served = True
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    @property
    def draining(self) -> bool:
        return self._served and not self.engine.ready

    async def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self.draining:
                return
            await asyncio.sleep(self.POLL_S)


# ---- the server -------------------------------------------------------------------------------

def create_server(engine, settings: Settings) -> grpc.aio.Server:
    """An unstarted grpc.aio server on settings.host:settings.grpc_port with every service added."""
    limit = min(settings.max_body_bytes, MAX_MESSAGE_BYTES)
    server = grpc.aio.server(
        interceptors=[ServiceInterceptor(settings)],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    pb_grpc.add_AttentionServiceServicer_to_server(AttentionServicer(engine), server)
    grpc_oip.add_to_server(engine, server)
    health_pb2_grpc.add_HealthServicer_to_server(EngineHealth(engine), server)
    reflection.enable_server_reflection(
        (ATTENTION_SERVICE, grpc_oip.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{settings.host}]:{settings.grpc_port}" if ":" in settings.host else \
        f"{settings.host}:{settings.grpc_port}"
    server.add_insecure_port(address)
    return server
