"""The gRPC front end: attention.v1.AttentionService, the Open Inference Protocol's
inference.GRPCInferenceService (``oip``), grpc.health.v1.Health and server reflection, on one
``grpc.aio`` server in the service's event loop, sharing the engine with the HTTP server.

Handlers only convert messages <-> internal requests (``codec``) and await the engine. Every status
code is set in one place, ``ServiceInterceptor``: wrapped once around every method handler but
reflection's when it is registered (not a per-call grpc.aio interceptor), it checks the API key
(``authorization: Bearer KEY`` metadata; not for health probes) and ends a call that raised with
``errors.error_status``'s status (docs/api.md#errors). ``AttendStream`` and ``ModelStreamInfer`` send
that same status in-band for a call that failed, so that one bad call does not end a stream that
carries many.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.auth import check_api_key
from service.errors import BadRequest, NotFound
from service.grpc import codec, forward, oip
from service.grpc.codec import offload, result_bytes
from service.grpc.errors import abort, error_status
from service.grpc.protogen import attention_stubs
from service.grpc.sessions import SessionServicer
from service.processes import bind_error
from service.sessions import routing
from service.settings import Settings
from service.wire.tensors import ServerTiming

stubs = attention_stubs()
pb, pb_grpc = stubs.attention_pb2, stubs.attention_pb2_grpc

ATTENTION_SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
# Reachable without an API key: health probes (as /healthz, /readyz, /v2/health/*) and reflection.
REFLECTION_SERVICES = frozenset({reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})
KEY_EXEMPT_SERVICES = REFLECTION_SERVICES | {health.SERVICE_NAME}
KEY_EXEMPT_METHODS = frozenset(oip.HEALTH_METHODS)
STREAM_WINDOW = oip.STREAM_WINDOW  # calls one stream may have in flight (then flow control)


# ---- status codes: service.grpc.errors, applied by the interceptor -------------------------

def call_error(exc: Exception):
    """``exc`` as an in-band attention.v1.CallError (AttendStream): what ``abort`` would have sent."""
    err = error_status(exc)
    return pb.CallError(status=err.status.name, code=err.code, message=err.message,
                        retry_after_s=err.retry_after_s)


class _Malformed:
    """What a request that does not parse becomes, so that the handler wrapper can refuse it."""

    def __init__(self, exc: Exception):
        self.message = f"the request message does not parse as protobuf ({exc})"


class _Unparsed:
    """A big request's bytes, parsed in a thread by the handler wrapper: grpc calls the deserializer
    on the event loop, where parsing many large messages would stall every other call."""

    def __init__(self, data: bytes, deserialize):
        self.data, self.deserialize = data, deserialize


def _parse(deserialize, data: bytes):
    """``deserialize(data)``, or what a message that does not parse becomes (never raises: gRPC
    would answer UNKNOWN, where the caller's mistake is INVALID_ARGUMENT)."""
    try:
        return deserialize(data)
    except Exception as exc:  # DecodeError and friends
        return _Malformed(exc)


def _lenient(deserialize):
    """A request deserializer that never raises and leaves messages over OFFLOAD_BYTES unparsed."""
    if deserialize is None:
        return None

    def parse(data: bytes):
        if len(data) > codec.OFFLOAD_BYTES:
            return _Unparsed(data, deserialize)
        return _parse(deserialize, data)

    return parse


async def _parsed(request):
    if isinstance(request, _Unparsed):
        request = await asyncio.to_thread(_parse, request.deserialize, request.data)
    if isinstance(request, _Malformed):
        raise BadRequest(request.message)
    return request


async def _parsed_stream(requests):
    """A stream's requests; one that does not parse ends the stream (INVALID_ARGUMENT, naming its
    position): without its request_id, no in-band answer could be matched to it."""
    i = 0
    async for request in requests:
        try:
            yield await _parsed(request)
        except BadRequest as exc:
            raise BadRequest(f"stream message #{i} (zero-based): {exc}") from None
        i += 1


class ServiceInterceptor:
    """API key check and ServiceError -> status code, around every unary and bidi-stream handler;
    counts those RPCs while they run, so that a shutdown can wait for them (``shutdown``).

    Not a ``grpc.aio.ServerInterceptor``: grpc.aio runs those on every call (the handler looked up
    and wrapped anew each time). ``wrap`` wraps each method handler once, when it is registered
    (``_Registering``), and whether its method needs a key is decided then too."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _finished(self, _context) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until no RPC of ours runs (True), or ``timeout`` seconds (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _needs_key(self, method: str) -> bool:
        service = method.rpartition("/")[0].lstrip("/")  # "/pkg.Service/Method"
        return bool(self.settings.api_key) and method not in KEY_EXEMPT_METHODS \
            and service not in KEY_EXEMPT_SERVICES

    def _check_key(self, context) -> None:
        metadata = {key: value for key, value in (context.invocation_metadata() or ())}
        check_api_key(self.settings, metadata.get("authorization"), metadata.get("x-api-key"))

    def _started(self, context, keyed: bool) -> None:
        """A call begins: counted until its end (then its status is on its way), its key checked."""
        self.running += 1
        self._idle.clear()
        context.add_done_callback(self._finished)
        if keyed:
            self._check_key(context)

    def wrap(self, method: str, handler):
        """``handler`` (of ``method``, "/pkg.Service/Method") answering as described above: the
        request parsed leniently (``_lenient``), whatever the call raises ended as its status
        (``errors.abort``); cancellation and an abort already made pass."""
        if handler is None or method.rpartition("/")[0].lstrip("/") in REFLECTION_SERVICES:
            return handler  # grpc's own servicer, answering its own errors
        keyed = self._needs_key(method)
        started = self._started

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                try:
                    started(context, keyed)
                    return await behavior(await _parsed(request), context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary, _lenient(handler.request_deserializer),
                                                       handler.response_serializer)
        if handler.stream_stream is not None:
            behavior = handler.stream_stream

            async def bidi(request_iterator, context):
                try:
                    started(context, keyed)
                    async for response in behavior(_parsed_stream(request_iterator), context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await abort(context, exc)

            return grpc.stream_stream_rpc_method_handler(bidi, _lenient(handler.request_deserializer),
                                                         handler.response_serializer)
        return handler  # no unary-stream or stream-unary rpc of ours exists


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are ``ServiceInterceptor.wrap``'s, each wrapped on
    its first call (grpc asks a generic handler only for a method it has no registered handler of)."""

    def __init__(self, inner, rpcs: ServiceInterceptor):
        self.inner, self.rpcs, self.wrapped = inner, rpcs, {}

    def service(self, details: grpc.HandlerCallDetails):
        try:
            return self.wrapped[details.method]
        except KeyError:
            handler = self.wrapped[details.method] = self.rpcs.wrap(details.method, self.inner.service(details))
            return handler


class _Registering:
    """What the generated ``add_*_to_server`` functions are given in place of the server: every
    method handler they register is ``ServiceInterceptor.wrap``'s, made once here."""

    def __init__(self, server: grpc.aio.Server, rpcs: ServiceInterceptor):
        self.server, self.rpcs = server, rpcs

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.server.add_generic_rpc_handlers(tuple(_WrappedGeneric(h, self.rpcs) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.server.add_registered_method_handlers(
            service, {name: self.rpcs.wrap(f"/{service}/{name}", h) for name, h in handlers.items()})


# ---- attention.v1.AttentionService ------------------------------------------------------------

class AttentionServicer(SessionServicer, pb_grpc.AttentionServiceServicer):
    """Attend, AttendStream, CallLayer, ListLayers here; the session rpcs in ``service.grpc.sessions``."""

    in_band_error = staticmethod(lambda exc: call_error(exc))

    def __init__(self, engine):
        self.engine = engine

    async def _attend(self, request, deadline: float | None, request_id: str | None = None,
                      timing: ServerTiming | None = None):
        timing = ServerTiming() if timing is None else timing
        req = await offload(codec.declared_bytes(request), codec.attention_request, request, deadline=deadline,
                            request_id=request_id)
        codec.check_answer_fits(req, self.engine.settings)
        timing.mark("decode")
        res = await self.engine.attend(req)
        timing.engine(res.stamps)
        out = await offload(result_bytes(res.o, res.lse), codec.attend_response, res)
        timing.mark("encode")
        return out

    async def Attend(self, request, context):
        timing = ServerTiming()
        response = await self._attend(request, codec.deadline_of(context), timing=timing)
        context.set_trailing_metadata((("server-timing", timing.value()),))
        return response

    async def AttendStream(self, request_iterator, context):
        deadline = codec.deadline_of(context)

        async def one(i: int, request):
            rid = request.request_id or str(i)
            try:
                return await self._attend(request, deadline, rid)
            except Exception as exc:  # answered in-band; the stream goes on (cancelling still ends it)
                return pb.AttendResponse(request_id=rid, error=call_error(exc))

        async for response in codec.run_concurrently(request_iterator, one,
                                                     codec.stream_window(STREAM_WINDOW, self.engine.settings)):
            yield response

    async def CallLayer(self, request, context):
        req = await offload(codec.declared_bytes(request), codec.layer_request, request,
                            deadline=codec.deadline_of(context))
        res = await self.engine.call_layer(req)
        return await offload(result_bytes(res.y), codec.layer_response, res)

    async def ListLayers(self, request, context):
        return pb.ListLayersResponse(layers=[codec.layer_info(i) for i in self.engine.layer_infos()])


# ---- grpc.health.v1.Health, following the engine ----------------------------------------------

class EngineHealth(health_pb2_grpc.HealthServicer):
    """SERVING once the engine is ready (warm), NOT_SERVING before that and while draining.

    Read from the engine on every Check; Watch polls it. Once the server drains, Watch sends
    NOT_SERVING and ends, so that open watches do not hold the server's shutdown to its grace period.
    """

    SERVICES = ("", ATTENTION_SERVICE, oip.SERVICE_NAME)
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
            raise NotFound(f"unknown service {request.service!r}")
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

# After the last RPC ended, how long the server keeps its connections open before it closes them.
# An RPC "ends" once its status is handed to the transport. Closing a socket while the client's
# acknowledgements of that answer are still unread resets the connection, and the client then
# loses the answer's tail; a large answer at drain is the one exposed to that.
ANSWER_LINGER_S = 0.25


def create_server(engine, settings: Settings) -> grpc.aio.Server:
    """An unstarted grpc.aio server on settings.host:settings.grpc_port with every service added."""
    limit = codec.message_limit(settings)
    interceptor = ServiceInterceptor(settings)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # grpc binds with SO_REUSEPORT by default: a second server on the port would share it
            # silently; only the processes of one --processes server share it (service/processes.py)
            ("grpc.so_reuseport", 1 if settings.peers else 0),
        ],
    )
    ours = _Registering(server, interceptor)
    pb_grpc.add_AttentionServiceServicer_to_server(AttentionServicer(engine), ours)
    oip.add_to_server(engine, ours)
    health_pb2_grpc.add_HealthServicer_to_server(EngineHealth(engine), ours)
    reflection.enable_server_reflection(
        (ATTENTION_SERVICE, oip.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"[{settings.host}]:{settings.grpc_port}" if ":" in settings.host else \
        f"{settings.host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError:  # grpc says only "Failed to bind": a plain bind says why
        reason = bind_error(settings.host, settings.grpc_port) or "grpc could not bind it"
        raise OSError(f"cannot bind gRPC {address}: {reason}") from None
    routing.add_grpc_port(server, settings)  # under --processes: the private socket other processes forward to
    server.attnserve_rpcs = interceptor  # for shutdown()
    return server


async def shutdown(server: grpc.aio.Server, grace: float) -> None:
    """Stop ``server`` once the RPCs it is running have ended (at most ``grace`` seconds) and their
    answers have had ANSWER_LINGER_S to leave; then grpc's own ``stop(grace)``. Call it after the
    engine has drained: nothing new is accepted by then."""
    loop = asyncio.get_running_loop()
    end = loop.time() + grace
    rpcs: ServiceInterceptor | None = getattr(server, "attnserve_rpcs", None)
    if rpcs is not None and await rpcs.wait_idle(grace):
        await asyncio.sleep(ANSWER_LINGER_S)
    await server.stop(max(0.0, end - loop.time()))
    await forward.close_channels()  # the channels to the other processes, under --processes
