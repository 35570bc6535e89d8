"""Request bodies in, responses out, for every HTTP route: the media type, the body read under its
limit, the ``X-Request-Timeout-Ms`` deadline, heavy decoding moved off the event loop, and answers
sent as several buffers (``PartsResponse``).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType, size_text
from service.sessions.routing import hop_deadline
from service.settings import Settings

T = TypeVar("T")
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")

# Decoding/encoding goes to a thread (off the event loop) only when it costs more than the two
# thread hand-offs: JSON is parsed and printed number by number, binary tensors (safetensors, OIP
# binary data) are views or plain copies. The thresholds: docs/benchmarks/service.md#latency.
OFFLOAD_JSON_BYTES = 1 << 18
OFFLOAD_BINARY_BYTES = 16 << 20


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def read_body(request: Request, limit: int, flag: str = "--max-body-mb") -> bytearray | memoryview:
    """The request body, read chunk by chunk; 413 as soon as it passes ``limit`` bytes, 415 when it
    comes compressed (a Content-Encoding other than identity).

    The buffer grows with the bytes that actually arrive (not with what Content-Length claims), so
    a client that declares a large body and sends none of it holds no memory; growing a large
    bytearray is a ``realloc`` the allocator does in place (mremap), as cheap as preallocating.
    A body the server's protocol read whole (``uvicorn_patch.http_protocol``: 1 MiB or more, with a
    Content-Length) comes as one piece, handed over as it is; its buffer was sized by the
    Content-Length, but ordinary memory is only touched as bytes arrive, and pinned buffers are
    bounded by ``--pinned-body-mb``.
    """
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("identity", ""):  # the body would be parsed as the compressed bytes it is
        raise UnsupportedMediaType(f"Content-Encoding {coding!r} is not supported; send the body uncompressed")
    too_large = PayloadTooLarge(
        f"the request body is over the limit of {size_text(limit)} ({flag})"
        + ("; send large tensors as application/x-safetensors" if flag == "--max-json-mb" else "")
    )
    declared = request.headers.get("content-length")
    expected: int | None = None
    if declared is not None:
        try:
            expected = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not an integer") from None
        if expected > limit:
            raise too_large
    buf = bytearray()
    try:
        async for chunk in request.stream():
            if not chunk:  # Starlette ends the stream with b""
                continue
            end = len(buf) + len(chunk)
            if end > limit:
                raise too_large
            if expected is not None and end > expected:
                raise BadRequest("the body is longer than its Content-Length")
            if not buf and type(chunk) in (bytearray, memoryview):  # handed over, ours now (http_protocol)
                buf = chunk
            else:
                buf += chunk
    except ClientDisconnect:
        raise BadRequest("the client disconnected before sending the whole body") from None
    if expected is not None and len(buf) != expected:
        raise BadRequest(f"the body has {len(buf)} bytes, its Content-Length says {expected}")
    return buf


def deadline_from(header: str | None, settings: Settings, arrived: float, hop: str | None = None) -> float:
    """``X-Request-Timeout-Ms`` (else ``--request-timeout-ms``) -> a ``time.monotonic()`` deadline;
    the earlier of it and ``hop``, the deadline another process forwarded the call with
    (``routing.HOP_DEADLINE``)."""
    ms: float = settings.request_timeout_ms
    if header is not None:
        # a decimal number: float() also takes "1_000", "1e3", "0x" forms a client did not mean
        ms = float(header) if _DECIMAL.fullmatch(header.strip()) else math.nan
        if not (math.isfinite(ms) and ms >= 0):
            raise BadRequest(
                f"X-Request-Timeout-Ms must be a non-negative decimal number of milliseconds (digits and "
                f"one '.', e.g. 1000 or 2.5), got {header!r}"
            )
    deadline = arrived + ms / 1000.0
    forwarded = hop_deadline(hop)
    return deadline if forwarded is None else min(deadline, forwarded)


def worth_offloading(body_bytes: int, json_bytes: int) -> bool:
    """Whether a body of ``body_bytes``, ``json_bytes`` of them JSON, is decoded (and its answer
    encoded) in a thread: JSON over OFFLOAD_JSON_BYTES, or any body over OFFLOAD_BINARY_BYTES."""
    return json_bytes > OFFLOAD_JSON_BYTES or body_bytes > OFFLOAD_BINARY_BYTES


async def offload(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """Run CPU-heavy decoding/encoding in a thread when the payload is big, inline otherwise."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


class PartsResponse(Response):
    """A response whose body is sent as several buffers, never joined: a tensor's bytes go from
    its own memory to the socket (the event loop keeps a view of what the socket has not taken);
    joining a large answer into one buffer costs a copy of it (docs/benchmarks/service.md#latency)."""

    def __init__(self, parts: Sequence[memoryview | bytes], media_type: str | None, headers: Mapping[str, str]):
        self.parts = [p for p in parts if len(p)]
        length = sum(len(p) for p in self.parts)
        super().__init__(b"", media_type=media_type, headers={**headers, "content-length": str(length)})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts or [b""]):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


def respond(
    body: Sequence[memoryview] | bytes | memoryview, media_type: str | None, headers: Mapping[str, str]
) -> Response:
    """A response for an encoded answer: buffers to send in turn (a list), or one document."""
    if isinstance(body, list):
        return PartsResponse(body, media_type, headers)
    return Response(body, media_type=media_type, headers=dict(headers))
