"""uvicorn, patched for big request bodies and for answers: each byte of a body copied once on its
way from the socket to the tensors that view it, the handler woken once per body, and an answer's
pieces sent with one write.

These reach into uvicorn's httptools protocol; they are installed only on the uvicorn version they
were read from (``UVICORN_HANDING_OVER``), and on another uvicorn its own code runs as it is.
Off switch: ``--no-patch-uvicorn`` (``ATTNSERVE_PATCH_UVICORN=0``): service/server.py installs none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from service.wire.tensors import uninitialized_bytearray

log = logging.getLogger("attnserve.http")

Body = bytearray | memoryview  # what the app receives: a request body, writable, the app's to keep

DIRECT_READ_MIN_BYTES = 1 << 20  # bodies declared at least this big are read straight into one buffer
PINNED_MIN_BYTES = 1 << 20  # pinned body buffers come in powers of two from here


def heap_buffer(n: int) -> bytearray:
    """``n`` writable bytes from the heap, not zeroed (``allocator.reuse_freed_memory`` has glibc keep
    big freed blocks for the next body, so they come without page faults)."""
    return uninitialized_bytearray(n)


class BodyBuffers:
    """Where direct reads put request bodies: page-locked memory for GPU workers, else the heap.

    A body in pinned memory goes to the GPU from where it lies: the worker skips its copy into a
    pinned staging buffer (a large share of a big request's launch: docs/benchmarks/service.md#latency).
    Pinning memory is slow (``cudaHostAlloc`` locks every page) and must not stall the event loop, so
    buffers are kept here for reuse, in power-of-two sizes, and made in a thread: a body that finds
    no free buffer of its size reads into the heap, and one of that size is made for the next.
    Buffers, free or holding a body, stay within ``budget`` bytes; ``trim`` lets the free ones go
    (the idle trim).
    """

    def __init__(self, pinned: bool, budget: int):
        self.pinned = pinned and budget > 0
        self.budget = budget
        self._free: dict[int, list] = {}  # size -> free pinned tensors (torch.uint8) of that size
        self._total = 0  # bytes of pinned buffers, free or in use (and being made)
        self._making: set[int] = set()
        # re-entrant: a body's last view can die in a garbage collection that runs while this
        # thread holds the lock, and its finalizer gives the buffer back
        self._lock = threading.RLock()
        self._maker = ThreadPoolExecutor(1, "attnserve-pin") if self.pinned else None

    def __call__(self, n: int) -> Body:
        """``n`` writable bytes, not zeroed, for one body."""
        if not self.pinned:
            return heap_buffer(n)
        size = max(PINNED_MIN_BYTES, 1 << (n - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is None and size not in self._making and self._total + size <= self.budget:
                self._making.add(size)
                self._total += size
                self._maker.submit(self._make, size)
        if block is None:
            return heap_buffer(n)
        array = block[:n].numpy()
        weakref.finalize(array, self._give_back, size, block)  # when no view of the body is left
        return memoryview(array)

    def _make(self, size: int) -> None:
        import torch

        try:
            block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # no pinned memory to be had: bodies stay on the heap from now on
            log.warning("cannot pin %d MiB for request bodies (%s); they are read into ordinary memory",
                        size >> 20, exc)
            block = None
        with self._lock:
            self._making.discard(size)
            if block is None:
                self._total -= size
                self.pinned = False
            else:
                self._free.setdefault(size, []).append(block)

    def _give_back(self, size: int, block) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(block)

    def trim(self) -> None:
        """Let every free buffer go (torch's host cache keeps them until it is emptied)."""
        with self._lock:
            for size, blocks in self._free.items():
                self._total -= size * len(blocks)
            self._free.clear()

    @property
    def pinned_bytes(self) -> int:
        return self._total


UVICORN_HANDING_OVER = "0.54.0"  # the uvicorn whose httptools cycle ``hand_over_request_bodies`` knows


def hand_over_request_bodies() -> bool:
    """Let uvicorn hand the bytes it has gathered of a request body to the app as they are,
    instead of copying them into a new ``bytes`` for each ASGI message; True when installed.

    Its httptools cycle collects a body into a bytearray and answers ``receive()`` with
    ``bytes(self.body)``: one more copy of every byte, on the event loop. Handing the bytearray
    over (and starting a new one) saves that copy (docs/benchmarks/service.md#latency). The
    receive below is uvicorn's own but for that line, so it is installed only on the uvicorn version
    it was read from; on another, bodies are copied as uvicorn copies them.
    """
    from uvicorn.protocols.http import httptools_impl as impl

    if uvicorn.__version__ != UVICORN_HANDING_OVER:
        return False
    if getattr(impl.RequestResponseCycle, "hands_over_bodies", False):
        return True

    class HandingOverCycle(impl.RequestResponseCycle):
        hands_over_bodies = True

        async def receive(self):
            if self.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False
            if not self.disconnected and not self.response_complete:
                self.flow.resume_reading()
                await self.message_event.wait()
                self.message_event.clear()
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            body, self.body = self.body, bytearray()  # uvicorn: bytes(self.body)
            return {"type": "http.request", "body": body, "more_body": self.more_body}

    impl.RequestResponseCycle = HandingOverCycle
    return True


class ResponseWrites:
    """A request cycle's transport that sends an answer's pieces (the status line and headers, then
    each body part) with one ``writelines`` when the answer is complete or the event loop turns,
    instead of a send each: uvloop sends every ``write`` at once, so a safetensors answer cost three
    syscalls, each waking the client. Writes before the answer starts (``100 Continue``) go at once."""

    __slots__ = ("_transport", "_cycle", "_held", "_scheduled")

    def __init__(self, transport: asyncio.Transport, cycle):
        self._transport, self._cycle = transport, cycle
        self._held: list = []
        self._scheduled = False

    def write(self, data) -> None:
        if not self._cycle.response_started:
            self.flush()
            self._transport.write(data)
            return
        self._held.append(data)
        if not self._scheduled:  # an answer streamed over several turns of the loop still flows
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._held:
            return
        held, self._held = self._held, []
        if self._transport.is_closing():
            return
        if len(held) == 1:
            self._transport.write(held[0])
        else:
            self._transport.writelines(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def http_protocol(gather_bytes: int, allocate: Callable[[int], Body] | None = None) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol, waking the app once per request body (or once per
    ``gather_bytes`` of it) instead of once per socket read, and reading a big declared body
    straight into one buffer from ``allocate``; on a uvicorn other than the one it was read from,
    uvicorn's own ("httptools").

    uvicorn sets the app's receive event for every piece the socket gives (256 KiB at most, often
    less) and stops reading past 64 KiB until the app has taken it: a big body comes as hundreds of
    pieces, each a wake-up of the handler and one more copy of the piece into its buffer. Gathered,
    the handler wakes once and takes the whole body as it is (``hand_over_request_bodies``: no
    copy). Reading on without the app holds no more memory than before: the handler keeps every
    byte of a body anyway, up to ``--max-body-mb``, which is what ``gather_bytes`` is. What it
    saves in the read phase: docs/benchmarks/service.md#latency.

    Direct reads: each piece of a body still costs three copies on the way (the socket's into a
    new ``bytes``, httptools' ``on_body`` into another, that one into the gathered buffer). A body
    of at least DIRECT_READ_MIN_BYTES with a Content-Length (not chunked, not JSON, not pipelined
    behind another request) is instead read by ``_BodyReader``, a buffered protocol that the transport
    fills with ``recv_into``: one copy, the kernel's. The parser, which never saw those bytes, is
    replaced by a fresh one for the next request on the connection.
    """
    if uvicorn.__version__ != UVICORN_HANDING_OVER:
        return "httptools"
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GatheringProtocol(HttpToolsProtocol):
        direct = 0  # the body length to read directly, set by the request's headers

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self.direct = self._direct_length() if allocate is not None else 0
            cycle = self.cycle
            cycle.transport = corked = ResponseWrites(self.transport, cycle)
            answered = cycle.on_response

            def on_response() -> None:  # the answer's held writes go out before anything after it
                corked.flush()
                answered()

            cycle.on_response = on_response

        def _direct_length(self) -> int:
            if self.pipeline or (self.parser.should_upgrade() and self._should_upgrade()):
                return 0
            length = 0
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return 0
                if name == b"content-type" and value.lower().startswith(b"application/json"):
                    return 0  # parsed as text, held to --max-json-mb: nothing to gain, pinned memory to waste
                if name == b"content-length":
                    length = int(value) if value.isdigit() else 0
            return length if DIRECT_READ_MIN_BYTES <= length <= gather_bytes else 0

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            n, self.direct = self.direct, 0
            cycle = self.cycle
            if not n or self.parser is None or self.transport.is_closing() or cycle.response_complete:
                return
            got = len(cycle.body)
            if got < n:  # else the whole body came with the headers: the parser has it all
                buf = allocate(n)
                buf[:got] = cycle.body
                cycle.body = bytearray()
                self.transport.set_protocol(_BodyReader(self, buf, got))

        def on_body(self, body: bytes) -> None:  # uvicorn's own, but for when the app is woken
            if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
                return
            self.cycle.body += body
            if len(self.cycle.body) >= gather_bytes:
                self.flow.pause_reading()
                self.cycle.message_event.set()

        def body_read(self, body: Body) -> None:
            """The rest of the body came through ``_BodyReader``: back to parsing HTTP."""
            self.transport.set_protocol(self)
            self.parser = httptools.HttpRequestParser(self)
            with contextlib.suppress(AttributeError):  # as uvicorn's __init__ does
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            if not self.cycle.response_complete:
                self.cycle.body = body
                self.cycle.more_body = False
                self.cycle.message_event.set()

    class _BodyReader(asyncio.BufferedProtocol):
        """Stands in for the HTTP protocol while the rest of one body is read into ``buf``."""

        def __init__(self, http: GatheringProtocol, buf: Body, got: int):
            self.http, self.buf, self.got = http, buf, got
            self.view = memoryview(buf)

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.view[self.got :]  # never past this body: what follows is the next request

        def buffer_updated(self, nbytes: int) -> None:
            self.got += nbytes
            if self.got == len(self.view):
                self.view.release()
                self.http.body_read(self.buf)

        def connection_lost(self, exc: Exception | None) -> None:
            self.http.connection_lost(exc)

        def eof_received(self) -> bool | None:
            return self.http.eof_received()

        def pause_writing(self) -> None:
            self.http.pause_writing()

        def resume_writing(self) -> None:
            self.http.resume_writing()

    return GatheringProtocol
