"""Sessions across processes (API.md §10; docs/architecture.md "Sessions across processes").

Under ``--processes N`` the kernel hands each connection to any of the N processes, but a session's
keys and values live in one of them. So:

- the owner of a session id is a pure function of the id and N, the same in every process:
  ``owner(id, N) = zlib.crc32(id.encode()) % N`` (``owner``); clients may compute it too;
- a server-made id is drawn until it lands on the process that makes it (``SessionIds``), so a
  ``POST /sessions`` without an id is never forwarded;
- each process also listens on private unix sockets in the supervisor's private folder
  (``<folder>/http-<i>.sock``, ``<folder>/grpc-<i>.sock``; the folder, i and N reach the process as
  ``--peers I/N@FOLDER``); a session call that reaches a non-owner is forwarded there: HTTP by
  ``HTTPRouter`` (an ASGI wrapper around the whole app, for ``/sessions`` paths only) streaming the
  body through, the owner's status, headers and body sent back unchanged (plus one header,
  ``x-attnserve-forwarded: <front>-><owner>``); gRPC by ``forward_grpc``, which a session rpc calls
  at its top when ``grpc_owner`` says another process holds its sessions;
- ``GET /sessions`` answers the union over every process (counts and bytes summed, ids joined),
  with ``"processes": N``;
- a packed step whose sessions all have one owner is forwarded whole; one naming sessions of
  several owners is a 422 that lists which sessions live together (a stack groups its packed
  steps by ``owner``);
- an Open Inference Protocol infer call with a ``sequence_id`` goes to the owner of its session
  (``str(sequence_id)``), over HTTP (the router reads only the call's JSON header) and gRPC
  (``ModelInfer``; ``ModelStreamInfer`` forwards each such message as a ``ModelInfer``).

A forwarded call carries ``x-attnserve-forwarded`` (HTTP) or metadata of that name (gRPC): the owner
serves it locally whatever it computes, so a call is forwarded at most once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from service.errors import InvalidInput, ServiceError
from service.wire import SESSION_HEADER

FORWARDED = "x-attnserve-forwarded"
PEER_AUTHORITY = "attnserve-peer"


def owner(session: str, processes: int) -> int:
    """The index of the process that holds ``session`` among ``processes``."""
    return zlib.crc32(session.encode("utf-8")) % processes if processes > 1 else 0


@dataclass(frozen=True)
class Peers:
    """This process's place among the supervisor's children."""

    index: int
    count: int
    folder: str

    @classmethod
    def parse(cls, value: str) -> Peers:
        """``I/N@FOLDER`` -> Peers; a ValueError that says what is wrong."""
        place, sep, folder = value.partition("@")
        index, sep2, count = place.partition("/")
        try:
            i, n = int(index), int(count)
        except ValueError:
            i = n = -1
        if not (sep and sep2 and folder and 0 <= i < n):
            raise ValueError(f"--peers {value!r}: expected INDEX/COUNT@FOLDER, e.g. 0/2@/tmp/attnserve-peers-x")
        return cls(i, n, folder)

    def owner(self, session: str) -> int:
        return owner(session, self.count)

    def http_path(self, i: int) -> str:
        return os.path.join(self.folder, f"http-{i}.sock")

    def grpc_path(self, i: int) -> str:
        return os.path.join(self.folder, f"grpc-{i}.sock")


@functools.lru_cache(maxsize=8)
def _parse(value: str) -> Peers:
    return Peers.parse(value)


def peers_of(settings: Any) -> Peers | None:
    """The Peers of a process started by ``--processes`` (with more than one process), else None."""
    value = getattr(settings, "peers", None)
    if not value:
        return None
    p = _parse(value)
    return p if p.count > 1 else None


def new_session_id(settings: Any) -> Callable[[], str]:
    """What a process draws server-made ids with: ids it owns (1/N of the draws land; a few draws)."""
    p = peers_of(settings)
    if p is None:
        return lambda: uuid.uuid4().hex

    def draw() -> str:
        while True:
            sid = uuid.uuid4().hex
            if p.owner(sid) == p.index:
                return sid

    return draw


def owners_of(p: Peers, sessions: Iterable[str]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for s in sessions:
        groups.setdefault(p.owner(s), []).append(s)
    return groups


def single_owner(p: Peers, sessions: list[str]) -> int:
    """The owner of all of ``sessions``, or an InvalidInput (422) that says which live together."""
    groups = owners_of(p, sessions)
    if len(groups) <= 1:
        return next(iter(groups), p.index)
    together = "; ".join(f"process {i}: {', '.join(ids)}" for i, ids in sorted(groups.items()))
    raise InvalidInput(
        f"a packed step's sessions must live in one process, and these live in {len(groups)} of the server's "
        f"{p.count} ({together}); send one packed step per process (a session's process is "
        f"zlib.crc32(id) % {p.count}, GET /sessions says 'processes')"
    )


# ---- private listeners ------------------------------------------------------------------------


def unix_listener(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (any stale file there removed), readable by us only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def http_listeners(settings: Any) -> list[socket.socket]:
    """The private HTTP listener of this process (none outside ``--processes``)."""
    p = peers_of(settings)
    return [] if p is None else [unix_listener(p.http_path(p.index))]


def add_grpc_port(server: Any, settings: Any) -> None:
    """Bind ``server`` also to this process's private gRPC socket (under ``--processes``)."""
    p = peers_of(settings)
    if p is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.grpc_path(p.index))
        server.add_insecure_port("unix:" + p.grpc_path(p.index))


# ---- HTTP ---------------------------------------------------------------------------------------

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection"}
# uvicorn adds its own date and server headers to every answer: the owner's would come twice
DROP_FROM_ANSWER = HOP_BY_HOP | {b"date", b"server"}
SAFETENSORS = "application/x-safetensors"


def _error(status: int, code: str, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class _Body:
    """The request body: what was read ahead to route it, then the rest from ``receive``."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self.receive, self.head, self.done = receive, bytearray(), False

    async def read_more(self) -> bool:
        if self.done:
            return False
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the client went away")
        self.head += message.get("body", b"")
        self.done = not message.get("more_body", False)
        return True

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
            if message["type"] == "http.disconnect":
                raise ConnectionResetError("the client went away")
            self.done = not message.get("more_body", False)
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
        self.app, self.peers = app, peers_of(settings)
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

    def _request_headers(self, scope: dict) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in scope.get("headers") or () if k not in HOP_BY_HOP and k != b"host"]
        out.append((FORWARDED.encode(), str(self.peers.index).encode()))
        return out

    async def _forward(self, target: int, scope: dict, body: _Body, send) -> None:
        import httpx

        url = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            url += b"?" + scope["query_string"]
        has_body = scope["method"] in ("POST", "PUT", "PATCH")
        request = self.client(target).build_request(
            scope["method"], url.decode("latin-1"), headers=self._request_headers(scope),
            content=body.chunks() if has_body else None,
        )
        try:
            answer = await self.client(target).send(request, stream=True)
        except httpx.HTTPError as exc:
            return await self._send(send, _error(
                503, "unavailable", f"this session lives on process {target} of {self.peers.count}, which did "
                f"not take the call ({type(exc).__name__}: {exc}); retry"))
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

        headers = self._request_headers(scope)

        async def one(i: int):
            return await self.client(i).get("/sessions", headers=headers)

        try:
            answers = await asyncio.gather(*(one(i) for i in range(self.peers.count)))
        except httpx.HTTPError as exc:
            return await self._send(send, _error(503, "unavailable", f"a process did not answer: {exc}; retry"))
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


# ---- gRPC ---------------------------------------------------------------------------------------


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
        return await call(request, metadata=metadata, timeout=context.time_remaining())
    except grpc.aio.AioRpcError as exc:
        raise owner_error(exc) from None


async def close_channels() -> None:
    channels = list(_channels.values())
    _channels.clear()
    for ch in channels:
        await ch.close()


__all__ = [
    "FORWARDED", "SESSION_HEADER", "HTTPRouter", "Peers", "add_grpc_port", "forward_grpc", "grpc_owner",
    "owner_error",
    "http_listeners", "new_session_id", "owner", "owners_of", "peers_of", "single_owner", "wrap_http",
]
