"""Session calls that reach the wrong process over HTTP, forwarded to the one that holds the
session (``service.sessions.routing`` says which; docs/architecture.md "Sessions across processes").

``HTTPRouter`` wraps the whole ASGI app under ``--processes``: it looks only at ``/sessions`` paths
and Open Inference Protocol infer calls, reads as little of the body as tells the session (a
packed step's ``sessions``, an OIP call's ``sequence_id``), and streams the call to the owner's
private socket; the owner's status, headers and body come back unchanged, plus
``x-attnserve-forwarded: <front>-><owner>``. ``GET /sessions`` is the union over every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from service.errors import BadRequest, InvalidInput, ServiceError
from service.http.body import deadline_from
from service.sessions.routing import (
    FORWARDED,
    HOP_DEADLINE,
    HOP_GRACE_S,
    UNION_PART,
    owners_of,
    peers_of,
    single_owner,
)

PEER_AUTHORITY = "attnserve-peer"

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
# uvicorn adds its own date and server headers to every answer: the owner's would come twice
DROP_FROM_ANSWER = HOP_BY_HOP | {b"date", b"server"}
SAFETENSORS = "application/x-safetensors"


def _error(status: int, code: str, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class _ClientGone(ConnectionResetError):
    """The client hung up: nobody reads an answer."""


class _NoAnswer(Exception):
    """Process ``process`` gave no answer to its part of a GET /sessions (``error`` says how)."""

    def __init__(self, process: int, error: Exception):
        super().__init__(process, error)
        self.process, self.error = process, error


class _Body:
    """The request body: what was read ahead to route it, then the rest from ``receive``."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self.receive, self.head, self.done = receive, bytearray(), False
        self.finished = asyncio.Event()  # the whole body was read

    def _end(self, message: dict) -> None:
        if message["type"] == "http.disconnect":
            raise _ClientGone("the client went away")
        self.done = not message.get("more_body", False)
        if self.done:
            self.finished.set()

    async def read_more(self) -> bool:
        if self.done:
            return False
        message = await self.receive()
        self._end(message)
        self.head += message.get("body", b"")
        return True

    async def gone(self) -> None:
        """Return once the client hangs up (after the whole body was read: ``receive`` then gives
        only the disconnect)."""
        await self.finished.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass

    async def read_all(self, limit: int) -> bytes:
        while await self.read_more():
            if len(self.head) > limit:
                break
        return bytes(self.head)

    async def chunks(self):
        if self.head:
            yield bytes(self.head)
        while not self.done:
            message = await self.receive()
            self._end(message)
            if message.get("body"):
                yield message["body"]

    def replay(self) -> Callable[[], Awaitable[dict]]:
        """A ``receive`` for the app that gives what was read ahead, then the rest."""
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": bytes(self.head), "more_body": not self.done}
            return await self.receive()

        return receive


def _query_sessions(query: bytes) -> list[str] | None:
    from urllib.parse import parse_qs

    values = parse_qs(query.decode("latin-1")).get("sessions")
    return None if not values else [s.strip() for s in values[-1].split(",") if s.strip()]


async def _packed_sessions(body: _Body, headers: dict[bytes, bytes], query: bytes, json_limit: int) -> list[str] | None:
    """The session ids a packed step names (query > body), reading only as much of the body as needed:
    a safetensors body's header, a JSON body whole; None when they cannot be found (the owner-less
    call is then served here, and says what is wrong)."""
    found = _query_sessions(query)
    if found is not None:
        return found
    mtype = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
    try:
        if mtype == SAFETENSORS:
            while len(body.head) < 8 and await body.read_more():
                pass
            if len(body.head) < 8:
                return None
            n = int.from_bytes(body.head[:8], "little")
            if n > 100 << 20:
                return None
            while len(body.head) < 8 + n and await body.read_more():
                pass
            meta = orjson.loads(bytes(body.head[8:8 + n])).get("__metadata__") or {}
            value = meta.get("sessions")
            return [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else None
        if mtype == "application/json":
            doc = orjson.loads(await body.read_all(json_limit))
            value = doc.get("sessions") if isinstance(doc, dict) else None
            return value if isinstance(value, list) and all(isinstance(s, str) for s in value) else None
    except (orjson.JSONDecodeError, AttributeError, ValueError):
        return None
    return None


async def _sequence_of(body: _Body, headers: dict[bytes, bytes], json_limit: int) -> str | None:
    """The session an Open Inference Protocol infer call steps (its ``sequence_id`` parameter),
    reading only its JSON header (the first Inference-Header-Content-Length bytes, else the whole
    JSON body); None for a plain call, or one that cannot be read here (served here, which says
    what is wrong)."""
    from service.wire.oip import sequence_id

    try:
        n = int(headers.get(b"inference-header-content-length", b"-1"))
        if n < 0:
            raw = await body.read_all(json_limit)
        else:
            while len(body.head) < min(n, json_limit) and await body.read_more():
                pass
            raw = bytes(body.head[:n])
        doc = orjson.loads(raw)
        params = doc.get("parameters") if isinstance(doc, dict) else None
        return sequence_id(params.get("sequence_id")) if isinstance(params, dict) else None
    except (orjson.JSONDecodeError, ValueError, ServiceError):
        return None


class HTTPRouter:
    """ASGI wrapper: session calls for another process go there over its private socket."""

    def __init__(self, app: Any, settings: Any):
        self.app, self.peers, self.settings = app, peers_of(settings), settings
        self.json_limit = getattr(settings, "max_json_bytes", 64 << 20)
        self._clients: dict[int, Any] = {}
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per forwarded call

    def client(self, i: int):
        c = self._clients.get(i)
        if c is None:
            import httpx

            transport = httpx.AsyncHTTPTransport(
                uds=self.peers.http_path(i),
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64, keepalive_expiry=30),
            )
            c = self._clients[i] = httpx.AsyncClient(
                transport=transport, base_url=f"http://{PEER_AUTHORITY}",
                timeout=httpx.Timeout(None, connect=10.0),
            )
        return c

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        with contextlib.suppress(_ClientGone):  # hung up while its body was read: nobody reads an answer
            await self._route(scope, receive, send)

    async def _route(self, scope: dict, receive, send) -> None:
        path = scope.get("path", "")
        oip_infer = path.startswith("/v2/models/") and path.endswith("/infer") and scope.get("method") == "POST"
        if scope["type"] != "http" or self.peers is None or not (
                path == "/sessions" or path.startswith("/sessions/") or oip_infer):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if FORWARDED.encode() in headers:  # forwarded here by another process: ours whatever we compute
            return await self.app(scope, receive, send)
        method, parts = scope["method"], path.split("/")  # "/sessions/x/attend" -> ["", "sessions", "x", "attend"]
        body = _Body(receive)
        target: int | None = None
        if oip_infer:
            sid = await _sequence_of(body, headers, self.json_limit)
            target = None if sid is None else self.peers.owner(sid)
        elif path == "/sessions" and method == "GET":
            return await self._union(scope, send)
        if path == "/sessions" and method == "POST":
            with contextlib.suppress(orjson.JSONDecodeError):
                doc = orjson.loads(await body.read_all(self.json_limit))
                sid = doc.get("session") if isinstance(doc, dict) else None
                if isinstance(sid, str) and sid:
                    target = self.peers.owner(sid)
        elif path == "/sessions/attend" and method == "POST":
            sessions = await _packed_sessions(body, headers, scope.get("query_string", b""), self.json_limit)
            if sessions:
                groups = owners_of(self.peers, sessions)
                if len(groups) > 1:
                    try:
                        single_owner(self.peers, sessions)
                    except InvalidInput as exc:
                        return await self._send(send, _error(422, exc.code, exc.message))
                target = next(iter(groups))
        elif len(parts) == 3 or (len(parts) == 4 and parts[3] == "attend"):
            target = self.peers.owner(parts[2])
        if target is None or target == self.peers.index:
            return await self.app(scope, body.replay(), send)
        await self._forward(target, scope, body, send)

    async def _lifespan(self, scope, receive, send) -> None:
        async def on_receive() -> dict:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message

        await self.app(scope, on_receive, send)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()

    def _deadline(self, scope: dict) -> float | None:
        """The call's deadline (``X-Request-Timeout-Ms``, else ``--request-timeout-ms``) as a
        ``time.monotonic()`` instant; None for a header the owner refuses (it says why)."""
        header = dict(scope.get("headers") or ()).get(b"x-request-timeout-ms")
        try:
            return deadline_from(None if header is None else header.decode("latin-1"), self.settings,
                                 time.monotonic())
        except BadRequest:
            return None

    def _request_headers(self, scope: dict, deadline: float | None = None) -> list[tuple[bytes, bytes]]:
        drop = HOP_BY_HOP | {b"host", HOP_DEADLINE.encode()}
        out = [(k, v) for k, v in scope.get("headers") or () if k not in drop]
        out.append((FORWARDED.encode(), str(self.peers.index).encode()))
        if deadline is not None:
            out.append((HOP_DEADLINE.encode(), repr(deadline).encode()))
        return out

    async def _forward(self, target: int, scope: dict, body: _Body, send) -> None:
        import httpx

        url = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            url += b"?" + scope["query_string"]
        has_body = scope["method"] in ("POST", "PUT", "PATCH")
        deadline = self._deadline(scope)
        request = self.client(target).build_request(
            scope["method"], url.decode("latin-1"), headers=self._request_headers(scope, deadline),
            content=body.chunks() if has_body else None,
        )
        sending = asyncio.ensure_future(self.client(target).send(request, stream=True))
        gone = asyncio.ensure_future(body.gone()) if has_body else None
        # the owner answers 504 itself at the deadline (it never launches a step past it, and undoes
        # one that ends past it); one that stays silent (stalled) gets HOP_GRACE_S more
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic()) + HOP_GRACE_S
        try:
            # a client that hangs up while the owner holds its call: the upstream connection is closed,
            # so the owner sees it go too (a queued step is then withdrawn, never appended)
            await asyncio.wait([t for t in (sending, gone) if t is not None], timeout=wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError, _ClientGone):
                    await sending
                if gone is None or not gone.done():  # the deadline passed: the client is still there
                    await self._send(send, _error(
                        504, "deadline_exceeded", f"process {target} of {self.peers.count}, which holds this "
                        "session, did not answer by the call's deadline; it never launches a step past its "
                        "deadline and undoes one that ends past it"))
                return
            answer = sending.result()
        except httpx.HTTPError as exc:
            return await self._send(send, _error(
                503, "unavailable", f"this session lives on process {target} of {self.peers.count}, which did "
                f"not take the call ({type(exc).__name__}: {exc}); retry"))
        finally:
            if gone is not None:
                gone.cancel()
        try:
            headers = [(k.lower(), v) for k, v in answer.headers.raw if k.lower() not in DROP_FROM_ANSWER]
            headers.append((FORWARDED.encode(), f"{self.peers.index}->{target}".encode()))
            await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await answer.aclose()

    async def _send(self, send, answer: tuple[int, list, bytes]) -> None:
        status, headers, body = answer
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _union(self, scope: dict, send) -> None:
        """``GET /sessions`` of every process, summed; the first answer that is not a 200 is the answer."""
        import httpx

        deadline = self._deadline(scope)
        headers = self._request_headers(scope, deadline)
        # the others' parts are marked: the client's one call is counted once, by this process's part
        part = [(k, v + UNION_PART.encode() if k == FORWARDED.encode() else v) for k, v in headers]
        # a process that does not answer by the deadline (stalled) must not hold the listing longer
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())

        async def one(i: int):
            try:
                return await self.client(i).get("/sessions", headers=headers if i == self.peers.index else part,
                                                timeout=httpx.Timeout(timeout, connect=10.0))
            except httpx.HTTPError as exc:
                raise _NoAnswer(i, exc) from None

        try:
            answers = await asyncio.gather(*(one(i) for i in range(self.peers.count)))
        except _NoAnswer as exc:
            return await self._send(send, _error(
                503, "unavailable", f"process {exc.process} of {self.peers.count} did not answer "
                f"({type(exc.error).__name__}: {exc.error}); retry"))
        for a in answers:
            if a.status_code != 200:
                keep = [(k.lower(), v) for k, v in a.headers.raw if k.lower() not in DROP_FROM_ANSWER]
                return await self._send(send, (a.status_code, keep, a.content))
        docs = [a.json() for a in answers]
        union = {
            "count": sum(d.get("count", 0) for d in docs),
            "kv_bytes_used": sum(d.get("kv_bytes_used", 0) for d in docs),
            "kv_bytes_capacity": sum(d.get("kv_bytes_capacity", 0) for d in docs),
            "sessions": [s for d in docs for s in d.get("sessions", [])],
            "processes": self.peers.count,
        }
        rid = answers[self.peers.index].headers.get("x-request-id")
        out = orjson.dumps(union)
        extra = [(b"x-request-id", rid.encode("latin-1"))] if rid else []
        await self._send(send, (200, [(b"content-type", b"application/json"),
                                      (b"content-length", str(len(out)).encode()), *extra], out))


def wrap_http(app: Any, settings: Any) -> Any:
    """``app`` itself, or under ``--processes`` the app behind an ``HTTPRouter``."""
    return app if peers_of(settings) is None else HTTPRouter(app, settings)
