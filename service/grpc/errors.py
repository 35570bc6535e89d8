"""The gRPC transport's one mapping of an exception to what a caller is told (docs/api.md#errors).

``error_status`` reads ``service.errors``' domain exceptions (their ``grpc_code``); anything else is
a bug: logged, and INTERNAL without a stack trace. ``abort`` ends a call with that status (the
interceptor in ``server`` does, for every rpc); a stream that answers a failed call in-band
(AttendStream, ModelStreamInfer) puts the same status into its answer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from service.errors import ServiceError

log = logging.getLogger("attnserve.grpc")


@dataclass(frozen=True)
class ErrorStatus:
    """What a caller is told about a failed call: gRPC status, service code, message, retry hint."""

    status: grpc.StatusCode
    code: str  # the service's stable code (service.errors), e.g. "invalid_input"
    message: str
    retry_after_s: float | None = None


def error_status(exc: Exception) -> ErrorStatus:
    """``exc``'s status: a ``ServiceError`` carries its own; anything else is logged, INTERNAL."""
    if isinstance(exc, ServiceError):
        return ErrorStatus(grpc.StatusCode[exc.grpc_code], exc.code, exc.message, exc.retry_after_s)
    log.error("unexpected error in a gRPC handler", exc_info=exc)
    return ErrorStatus(grpc.StatusCode.INTERNAL, "internal",
                       f"internal error ({type(exc).__name__}); see the server log")


async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with ``exc``'s status; trailers ``attnserve-error-code`` and ``retry-after``.
    A call that ended meanwhile (its deadline passed, its client went away) ends as cancelled: its
    status has nowhere to go, and grpc would log the failed send with a stack trace."""
    err = error_status(exc)
    trailers = [("attnserve-error-code", err.code)]
    if err.retry_after_s is not None:
        trailers.append(("retry-after", f"{err.retry_after_s:g}"))
    try:
        await context.abort(err.status, err.message, trailing_metadata=tuple(trailers))
    except grpc.aio.AbortError:
        raise
    except Exception:  # grpc's ExecuteBatchError: the core refused to send to a call that is over
        if not (context.cancelled() or context.done() or context.time_remaining() == 0):
            raise
        raise asyncio.CancelledError from None
