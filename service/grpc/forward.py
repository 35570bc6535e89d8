"""Session rpcs (and OIP sequence calls) that reach the wrong process over gRPC, forwarded to the
one that holds the session (``service.sessions.routing`` says which): ``grpc_owner`` at the top of
each such rpc, then ``forward_grpc`` calls the same method on the owner's private socket with the
call's metadata and deadline, and the owner's status comes back as the ServiceError it was.
"""

from __future__ import annotations

import contextlib
from typing import Any

from service.errors import ServiceError
from service.grpc.codec import remaining_s
from service.sessions.routing import FORWARDED, Peers, peers_of, single_owner


def grpc_owner(settings: Any, sessions: list[str], context: Any) -> int | None:
    """Where a session rpc naming ``sessions`` must run: None for here, else the owner's index.
    Raises InvalidInput (INVALID_ARGUMENT) for sessions of several owners."""
    p = peers_of(settings)
    if p is None or not sessions:
        return None
    metadata = dict(context.invocation_metadata() or ())
    if FORWARDED in metadata:
        return None
    i = single_owner(p, list(sessions))
    return None if i == p.index else i


_channels: dict[tuple[str, int], Any] = {}


def _channel(p: Peers, i: int):
    import grpc

    key = (p.folder, i)
    ch = _channels.get(key)
    if ch is None:
        limit = 2**31 - 1
        ch = _channels[key] = grpc.aio.insecure_channel(
            "unix:" + p.grpc_path(i),
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
    return ch


def owner_error(exc: Any) -> ServiceError:
    """The owner's status (a ``grpc.aio.AioRpcError``) as the ServiceError it was raised as there: code,
    message, and the trailers ``attnserve-error-code`` and ``retry-after``, so that it is answered unchanged."""
    import grpc

    trailers = dict(exc.trailing_metadata() or ())
    err = ServiceError(exc.details() or "")
    err.grpc_code = exc.code().name
    err.code = trailers.get("attnserve-error-code", exc.code().name.lower())
    with contextlib.suppress(KeyError, ValueError):
        err.retry_after_s = float(trailers["retry-after"])
    if exc.code() == grpc.StatusCode.UNAVAILABLE and not trailers.get("attnserve-error-code"):
        err.code = "unavailable"
        err.message = f"the process that holds this session did not answer ({exc.details()}); retry"
    return err


async def forward_grpc(settings: Any, target: int, method: str, request: Any, context: Any,
                       response_type: Any) -> Any:
    """Call ``method`` (e.g. "/attention.v1.AttentionService/SessionAttend") with ``request`` on process
    ``target``, with the call's metadata and deadline: the owner's answer, or its status raised as a
    ServiceError (``owner_error``) for the transport's one error mapping."""
    import grpc

    p = peers_of(settings)
    call = _channel(p, target).unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString)
    metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if k != FORWARDED and not k.startswith(":")]
    metadata.append((FORWARDED, str(p.index)))
    try:
        # the call's deadline, else the server's default: a stalled owner must not hold the call forever
        timeout = remaining_s(context)
        if timeout is None:
            timeout = settings.request_timeout_ms / 1000.0
        return await call(request, metadata=metadata, timeout=timeout)  # (remaining_s keeps the hop's margin)
    except grpc.aio.AioRpcError as exc:
        raise owner_error(exc) from None


async def close_channels() -> None:
    channels = list(_channels.values())
    _channels.clear()
    for ch in channels:
        await ch.close()
