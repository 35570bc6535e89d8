"""Sessions over gRPC (docs/api.md#sessions): the session rpcs of attention.v1.AttentionService.

``SessionServicer`` is mixed into the AttentionService servicer (``server.py``). Each rpc handler is
a short function: message -> ``SessionStep`` (``session_step``) or manager call -> message, so that
a check (e.g. forwarding a call to the process that holds its session) can sit at its top.
Errors are raised as ``ServiceError``s and get their status code in the transport's one place
(``ServiceInterceptor``), except on SessionAttendStream, which answers a failed step in-band
(``AttendResponse.error``) as AttendStream does.

    CreateSession(CreateSessionRequest) -> SessionInfo           engine.sessions.create
    SessionAttend(SessionAttendRequest) -> AttendResponse        engine.sessions.step
    SessionAttendStream(stream ...) -> stream AttendResponse     engine.sessions.step, in stream order
    GetSession(GetSessionRequest) -> SessionInfo                 engine.sessions.describe
    DeleteSession(DeleteSessionRequest) -> DeleteSessionResponse engine.sessions.delete
"""

from __future__ import annotations

import asyncio
from typing import Any

from service.errors import BadRequest
from service.grpc import codec, forward
from service.grpc.codec import declared_bytes, offload, result_bytes
from service.sessions import SessionStep
from service.wire.options import parse_layer
from service.wire.tensors import DTYPE_NAMES, ServerTiming

pb = codec.pb
SERVICE = "/attention.v1.AttentionService/"
STREAM_WINDOW = 64  # steps one stream may have in flight (then flow control)


def session_step(msg, *, deadline: float | None, request_id: str | None = None) -> SessionStep:
    """attention.v1.SessionAttendRequest -> SessionStep: one session with a 4-D q and no q_lengths is
    a step; otherwise a packed step (3-D tensors and q_lengths)."""
    sessions = list(msg.sessions)
    if not sessions:
        raise BadRequest("a step names at least one session in 'sessions'")
    q = codec.tensor_from_pb(msg, "q")
    k, v = (codec.tensor_from_pb(msg, name, required=False) for name in ("k", "v"))
    options: dict[str, Any] = {
        "layer": parse_layer("layer", msg.layer), "causal": msg.causal if msg.HasField("causal") else True,
        "scale": codec.scale_of(msg), "return_lse": msg.return_lse, "end": msg.end,
        "deadline": deadline, **codec.mask_options(msg),
    }
    if msg.request_id or request_id:
        options["request_id"] = msg.request_id or request_id
    if len(sessions) == 1 and q.dim() == 4 and not msg.HasField("q_lengths"):
        return SessionStep.single(sessions[0], q, k, v, layout=msg.layout or "bhnd", **options)
    if not msg.HasField("q_lengths"):
        raise BadRequest("a packed step (several sessions, or 3-D tensors [T, H, D]) needs q_lengths "
                         "(INT32 [S], rows per session)")
    if msg.layout not in ("", "bhnd"):
        raise BadRequest("a packed step's tensors are [T, H, D]: it takes no layout")
    return SessionStep.packed(sessions, q, k, v, codec.tensor_from_pb(msg, "q_lengths"), **options)


def session_info(info: dict[str, Any]):
    """``engine.sessions.describe``'s dict -> attention.v1.SessionInfo."""
    return pb.SessionInfo(session=info["session"], layers=info["layers"], num_kv_heads=info["num_kv_heads"],
                          head_dim=info["head_dim"], dtype=codec.dtype_to_pb(info["dtype"]),
                          lengths=info["lengths"], kv_bytes=info["kv_bytes"], idle_s=info["idle_s"],
                          device=info["device"])


def create_options(msg) -> dict[str, Any]:
    """attention.v1.CreateSessionRequest -> ``engine.sessions.create``'s keywords (0 layers: 1;
    DTYPE_UNSPECIFIED: float16)."""
    if msg.dtype == pb.DTYPE_UNSPECIFIED:
        dtype = "float16"
    elif msg.dtype in codec.DTYPE_OF_ENUM:
        dtype = DTYPE_NAMES[codec.DTYPE_OF_ENUM[msg.dtype]]
    else:
        raise BadRequest(f"dtype {msg.dtype} is unknown; use FLOAT16, BFLOAT16 or FLOAT32")
    return {"session": msg.session or None, "layers": msg.layers or 1, "num_kv_heads": msg.num_kv_heads,
            "head_dim": msg.head_dim, "dtype": dtype}


class SessionServicer:
    """The session rpcs; mixed into the servicer, which provides ``engine`` and ``in_band_error``
    (an exception -> attention.v1.CallError, what the call's status would have said)."""

    engine: Any

    @staticmethod
    def in_band_error(exc: Exception):  # pragma: no cover - the servicer provides it
        raise NotImplementedError

    async def _session_step(self, request, deadline: float | None, request_id: str | None = None,
                            inline: bool = False, timing: ServerTiming | None = None):
        timing = ServerTiming() if timing is None else timing
        nbytes = 0 if inline else declared_bytes(request)
        step = await offload(nbytes, session_step, request, deadline=deadline, request_id=request_id)
        codec.check_answer_fits(step, self.engine.settings)
        timing.mark("decode")
        res = await self.engine.sessions.step(step)
        timing.engine(res.stamps)
        out = await offload(result_bytes(res.o, res.lse), codec.attend_response, res)
        timing.mark("encode")
        return out

    async def _forward(self, target: int, method: str, request, context, response_type):
        return await forward.forward_grpc(self.engine.settings, target, SERVICE + method, request, context,
                                          response_type)

    async def CreateSession(self, request, context):
        target = forward.grpc_owner(self.engine.settings, [request.session] if request.session else [], context)
        if target is not None:  # under --processes: the call goes to the process that holds the session
            return await self._forward(target, "CreateSession", request, context, pb.SessionInfo)
        return session_info(self.engine.sessions.create(**create_options(request)))

    async def SessionAttend(self, request, context):
        target = forward.grpc_owner(self.engine.settings, list(request.sessions), context)
        if target is not None:
            return await self._forward(target, "SessionAttend", request, context, pb.AttendResponse)
        timing = ServerTiming()
        response = await self._session_step(request, codec.deadline_of(context), timing=timing)
        context.set_trailing_metadata((("server-timing", timing.value()),))
        return response

    async def SessionAttendStream(self, request_iterator, context):
        deadline = codec.deadline_of(context)
        in_order: dict[int, asyncio.Lock] = {}  # a step for another process: one at a time per process, in order

        async def one(i: int, request):
            rid = request.request_id or str(i)
            try:  # decoded inline: steps reach the manager in stream order
                target = forward.grpc_owner(self.engine.settings, list(request.sessions), context)
                if target is not None:
                    async with in_order.setdefault(target, asyncio.Lock()):
                        return await self._forward(target, "SessionAttend", request, context, pb.AttendResponse)
                return await self._session_step(request, deadline, rid, inline=True)
            except Exception as exc:  # answered in-band; the stream goes on (cancelling still ends it)
                return pb.AttendResponse(request_id=rid, error=self.in_band_error(exc))

        async for response in codec.run_concurrently(request_iterator, one,
                                                     codec.stream_window(STREAM_WINDOW, self.engine.settings)):
            yield response

    async def GetSession(self, request, context):
        target = forward.grpc_owner(self.engine.settings, [request.session], context)
        if target is not None:
            return await self._forward(target, "GetSession", request, context, pb.SessionInfo)
        return session_info(self.engine.sessions.describe(request.session))

    async def DeleteSession(self, request, context):
        target = forward.grpc_owner(self.engine.settings, [request.session], context)
        if target is not None:
            return await self._forward(target, "DeleteSession", request, context, pb.DeleteSessionResponse)
        await self.engine.sessions.delete(request.session)
        return pb.DeleteSessionResponse()
