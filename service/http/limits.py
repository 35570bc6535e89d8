"""The HTTP server's own limits, enforced in uvicorn's httptools protocol before the app sees a
request: the size and count of request header fields (``--max-header-kb``, ``--max-headers``),
the URL's length (``--max-url-kb``), how long a request head may take to arrive
(``--header-timeout-s``) and how long a body may stop arriving (``--body-timeout-s``).

uvicorn bounds none of these: httptools gathers a header field that never ends in memory (four
connections each sending an unfinished 64 MiB header grew a server run with ``--max-body-mb 8``
by 256 MiB), and a client that stops sending holds its connection and its buffers forever.
Refusals answer 431, 414 or 408 with the JSON error body of the route (``{"error": {"code",
"message"}}``, ``{"error": "..."}`` on /v2) and close the connection; so does every request
httptools cannot parse (uvicorn's own answer is a plain-text 400).

``LimitedProtocol`` also tells the app when a client hangs up while its request is being
answered (``service.http.disconnect``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from service.http.disconnect import client_gone, watch_request
from service.settings import Settings

log = logging.getLogger("attnserve.http")

CODES = {400: "bad_request", 408: "request_timeout", 414: "uri_too_long", 431: "header_too_large"}
REASONS = {400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long",
           431: "Request Header Fields Too Large"}


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the refusal is in ``LimitedProtocol._refusal``."""


def limited_protocol(base: type[asyncio.Protocol] | str, settings: Settings) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's httptools protocol, or a subclass such as ``http_protocol``'s) with the
    limits of ``settings``."""
    if isinstance(base, str):  # "httptools": uvicorn's own
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base  # noqa: N806

    max_head = int(settings.max_header_kb * 1024)
    max_url = int(settings.max_url_kb * 1024)
    max_headers = settings.max_headers
    header_timeout, body_timeout = settings.header_timeout_s, settings.body_timeout_s

    class LimitedProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refusal: tuple[int, str] | None = None
            self._head = 0  # bytes of the current request head, as parsed (URL, header fields)
            self._fields = 0  # header fields of the current request
            self._partial = 0  # bytes received while a head was incomplete
            self._heads = 0  # request heads completed on this connection
            self._phase = "head"  # "head" (arriving), "body" (arriving), "idle" (between requests)
            self._since = 0.0  # loop time the head began, or the body last made progress
            self._progress = -1  # what the body timer last saw of a direct read
            self._timer: asyncio.TimerHandle | None = None
            self._deferred: tuple[int, str] | None = None  # a refusal waiting for the answer in flight

        # ---- the limits, checked as the parser goes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start("head")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head = self._fields = 0
            watch_request(self.scope)
            if self._phase == "idle":
                self._start("head")

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._head += len(url)
            if len(self.url) > max_url:
                self._stop(414, f"the URL is over {max_url // 1024} KiB (--max-url-kb); send options in the body")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head += len(name) + len(value) + 4
            self._fields += 1
            if self._fields > max_headers:
                self._stop(431, f"the request has more than {max_headers} header fields (--max-headers)")
            if self._head > max_head:
                self._stop(431, f"the request head is over {max_head // 1024} KiB (--max-header-kb)")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._partial = 0
            self._heads += 1
            self._start("body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._phase = "idle"

        def body_read(self, body: Any) -> None:  # http_protocol's direct read is done: so is the body
            super().body_read(body)
            self._phase = "idle"

        def data_received(self, data: bytes) -> None:
            heads, phase = self._heads, self._phase
            if phase == "body":
                self._since = self._loop_time()
            super().data_received(data)
            if phase != "body" != self._phase and self._heads == heads and not self.transport.is_closing():
                # a head still incomplete: httptools holds its unfinished field; count what came
                self._partial += len(data)
                if self._partial > max_head:
                    self._refuse(431, f"the request head is over {max_head // 1024} KiB (--max-header-kb)")

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)
            if cycle is not None and not cycle.response_complete:
                client_gone(cycle.scope)

        # ---- refusals

        def _stop(self, status: int, message: str) -> None:
            """In a parser callback: refuse, and stop the parser (uvicorn then calls send_400_response)."""
            self._refusal = (status, message)
            raise _Refused(message)

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to what does not parse
            status, message = self._refusal or (400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})")
            self._refuse(status, message)

        def _refuse(self, status: int, message: str) -> None:
            """Answer ``status`` with the JSON error body of the request's route, and close."""
            if self.transport.is_closing():
                return
            cycle = self.cycle
            answering = cycle is not None and not cycle.response_complete
            log.info("refused a request from %s with %d: %s", self.client, status, message)
            if answering and self._phase != "body":
                # a bad head pipelined behind a request being answered (a body longer than its
                # Content-Length, say): that answer goes out first, then this refusal
                self._deferred = (status, message)
                self.flow.pause_reading()
                return
            if not answering or not cycle.response_started:
                self._write_refusal(status, message)
            if answering:  # the app is reading the body: it sees a disconnect, its answer goes nowhere
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def _write_refusal(self, status: int, message: str) -> None:
            url = self.url if isinstance(getattr(self, "url", None), bytes) else b""
            body = orjson.dumps({"error": message} if url.startswith(b"/v2") else
                                {"error": {"code": CODES.get(status, "bad_request"), "message": message}})
            self.transport.write(
                f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode("latin-1") + body
            )

        def on_response_complete(self) -> None:
            if self._deferred is None or self.pipeline or self.transport.is_closing():
                super().on_response_complete()  # requests pipelined before the bad head go first
                return
            self.server_state.total_requests += 1
            self._write_refusal(*self._deferred)
            self._deferred = None
            self.transport.close()

        # ---- the timers: one per connection, re-armed from its own callback

        def _loop_time(self) -> float:
            return asyncio.get_running_loop().time()

        def _start(self, phase: str) -> None:
            self._phase, self._since, self._progress = phase, self._loop_time(), -1
            # a body is looked at within a quarter of its timeout: it may be read directly (below)
            self._arm(self._since + (header_timeout if phase == "head" else body_timeout / 4))

        def _arm(self, when: float) -> None:
            if self._timer is not None:
                if self._timer.when() <= when:
                    return  # it fires first and re-arms
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(when, self._check)

        def _check(self) -> None:
            self._timer = None
            if self.transport is None or self.transport.is_closing():
                return
            now = self._loop_time()
            cycle = self.cycle
            if self._phase == "head":
                if cycle is not None and not cycle.response_complete:
                    self._since = now  # pipelined behind a request being answered: not yet its turn
                if now - self._since >= header_timeout:
                    self._refuse(408, f"the request head did not arrive within {header_timeout:g} s "
                                      "(--header-timeout-s)")
                    return
                self._arm(self._since + header_timeout)
            elif self._phase == "body" and cycle is not None and cycle.more_body:
                reader = self.transport.get_protocol()  # a direct read (http_protocol) fills its own buffer
                progress = getattr(reader, "got", -1) if reader is not self else -1
                if progress != self._progress or self.flow.read_paused:  # paused: the app holds it up
                    self._progress, self._since = progress, now
                if now - self._since >= body_timeout:
                    self._refuse(408, f"the request body stopped arriving for {body_timeout:g} s "
                                      "(--body-timeout-s)")
                    return
                self._arm(self._since + body_timeout if progress == -1 else now + body_timeout / 4)
            else:  # idle: uvicorn's keep-alive timeout applies; look again later
                self._phase = "idle"
                self._arm(now + min(header_timeout, body_timeout))

    return LimitedProtocol
