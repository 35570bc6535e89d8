"""Runs the whole service in one process and one event loop: the engine (workers + batcher), the
HTTP server (uvicorn/FastAPI) and the gRPC server (grpc.aio), sharing the engine.

Start-up: configuration errors (devices, layers) stop the process with exit code 2 before any port
is bound; then both servers answer while the workers warm (/healthz alive, /readyz 503 until warm).
On SIGTERM/SIGINT: stop taking new work, report not-ready, finish what is held, then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import sys
from collections.abc import Sequence

import uvicorn

from service.core import metrics
from service.core.engine import Engine
from service.http.limits import limited_protocol
from service.http.uvicorn_patch import UVICORN_HANDING_OVER, BodyBuffers, hand_over_request_bodies, http_protocol
from service.settings import Settings

log = logging.getLogger("attnserve")


async def _serve_http(http: uvicorn.Server, sockets: list[socket.socket] | None = None) -> bool:
    """Run uvicorn; False when it could not start (it calls sys.exit on a port it cannot bind)."""
    try:
        await http.serve(sockets=sockets)
    except SystemExit:
        return False
    return http.started


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator decides
        return None


def reuse_freed_memory(max_body_bytes: int) -> bool:
    """Let glibc keep freed blocks of up to ``max_body_bytes`` (at most 1 GiB) for reuse instead of
    unmapping them; True when it did (False: not glibc, its allocator decides).

    A request body is a fresh buffer. With glibc's defaults anything over 32 MiB is mmap'd when it
    arrives and unmapped when the request ends, so every big request page-faults its whole body in
    again: on the CPU box a 256 MiB upload was read at ~0.9 GB/s that way, at 1.4-2.6 GB/s with the
    memory reused (2026-11-30; the first big request still faults it in). The cost: while requests
    come, the RSS keeps the high-water mark of big bodies; ``trim_heap_when_idle`` gives it back.

    Every thread allocates from the main arena (``M_ARENA_MAX`` 1). A thread's own arena grows in
    heaps of at most 64 MiB, so anything bigger that a thread allocates (a bnhd answer made
    contiguous by a worker, a JSON answer encoded off the loop) was mmap'd fresh each time whatever
    the threshold: joining a 64 MiB answer into one buffer off the loop took 41 ms, 7-14 ms from
    the main arena (CPU box, 2026-11-30). And ``malloc_trim`` empties it well: after a CPU soak the
    idle RSS came back to within 4 MiB of its start, where one arena per thread kept 300-370 MiB.
    Small allocations barely contend: glibc serves them from per-thread caches.
    """
    size = min(int(max_body_bytes), 1 << 30)
    mallopt = getattr(_glibc(), "mallopt", None)
    return bool(
        mallopt
        and mallopt(M_ARENA_MAX, 1)
        and mallopt(M_MMAP_THRESHOLD, size)
        and mallopt(M_TRIM_THRESHOLD, size)
    )


async def trim_heap_when_idle(engine: Engine, idle_s: float, bodies: BodyBuffers | None = None) -> None:
    """Give freed heap back to the OS (glibc's ``malloc_trim``) once the engine has seen no request
    come or go for ``idle_s`` (checked every ``idle_s``: trimmed within 2x of going idle).

    ``reuse_freed_memory`` keeps the memory of big bodies for the next ones; under load that is the
    point, but an idle server should not keep its peak: a 10-minute soak on the H200 host ended
    with the RSS 848 MiB above its start (2026-11-30). The GPU workers' pinned staging buffers,
    which torch caches, go back too (``Engine.release_cached_host_memory``): after another soak
    the idle RSS was still 3.2 GiB above its start with only the heap trimmed.
    A body still being uploaded is not seen: a trim then costs it page faults, not correctness.
    """
    malloc_trim = getattr(_glibc(), "malloc_trim", None)
    if malloc_trim is None:
        return

    def release() -> None:
        if bodies is not None:  # its free pinned body buffers, before torch's host cache is emptied
            bodies.trim()
        engine.release_cached_host_memory()
        malloc_trim(0)

    seen = trimmed = engine.activity
    while True:
        await asyncio.sleep(idle_s)
        now = engine.activity
        if now == seen and now != trimmed and engine.requests_held == 0:
            await asyncio.to_thread(release)  # off the loop
            trimmed = now
        seen = now


async def refresh_metrics(engine: Engine, every_s: float = 1.0) -> None:
    """Under ``--processes``: set this process's sampled gauges (queue depth, device memory) every
    ``every_s``, so that a scrape answered by another process sees them."""
    while True:
        engine.metrics.refresh()
        await asyncio.sleep(every_s)


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket ``--http-fd`` names (under ``--processes`` the supervisor's), or a
    ValueError that says what is wrong with it."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"--http-fd {fd}: not an open socket ({exc.strerror})") from None
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()  # not ours to close
        raise ValueError(f"--http-fd {fd}: the socket is not listening")
    return sock


async def serve(settings: Settings) -> int:
    """Serve until a signal (or a failure); the process exit code."""
    from service.http.app import create_app

    try:
        # under --processes the supervisor bound the port: accept on its socket, shared with the others
        sockets = None if settings.http_fd is None else [inherited_listener(settings.http_fd)]
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    reusing = reuse_freed_memory(settings.max_body_bytes)
    if not hand_over_request_bodies():
        log.debug("uvicorn %s: request bodies are copied once more (written for %s)", uvicorn.__version__,
                  UVICORN_HANDING_OVER)
    if reusing:
        log.debug("glibc keeps freed blocks up to %d MiB for reuse", min(settings.max_body_bytes, 1 << 30) >> 20)

    engine = Engine(settings)
    try:
        await asyncio.to_thread(engine.prepare)
    except ValueError as exc:  # LayerConfigError is a ValueError too
        log.error("cannot start: %s", exc)
        return 2
    app = create_app(engine, settings)
    bodies = BodyBuffers(engine.on_gpu, settings.pinned_body_bytes)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level.lower(),
        http=limited_protocol(http_protocol(settings.max_body_bytes, bodies), settings),
        lifespan="on", timeout_graceful_shutdown=30, timeout_keep_alive=settings.http_keep_alive_s,
        access_log=settings.access_log,
    )
    http = uvicorn.Server(config)
    # Signals are handled below, for both servers: left to uvicorn (>= 0.29 captures SIGTERM/SIGINT in
    # serve()), it would close its listener at once — no 503 from /readyz while draining — and cut
    # requests still running after timeout_graceful_shutdown.
    http.capture_signals = contextlib.nullcontext
    grpc_server = None
    if settings.grpc_port:
        from service.grpc.server import create_server

        grpc_server = create_server(engine, settings)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if grpc_server is not None:
        await grpc_server.start()
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
    http_task = asyncio.create_task(_serve_http(http, sockets))
    start_task = asyncio.create_task(engine.start())
    stop_task = asyncio.create_task(stop.wait())
    refresh_task = asyncio.create_task(refresh_metrics(engine)) if metrics.MULTIPROCESS else None
    trim_task = None
    if reusing and settings.memory_trim_idle_s > 0:
        trim_task = asyncio.create_task(trim_heap_when_idle(engine, settings.memory_trim_idle_s, bodies))

    exit_code = 0
    pending = {stop_task, http_task, start_task}
    while not stop.is_set():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if start_task in done and start_task.exception() is not None:
            log.error("start-up failed: %s", start_task.exception(), exc_info=start_task.exception())
            exit_code = 1
            break
        if http_task in done:  # uvicorn stopped on its own: could not bind, or failed
            log.error("the HTTP server stopped; shutting down")
            exit_code = 1
            break

    log.info("shutting down: draining held requests")
    stop_task.cancel()
    for task in (trim_task, refresh_task):
        if task is not None:
            task.cancel()
    if not start_task.done():  # stopped while warming up: nothing was accepted yet
        start_task.cancel()
        await asyncio.gather(start_task, return_exceptions=True)
    await engine.drain()  # not-ready from here; everything accepted is answered
    if grpc_server is not None:
        from service.grpc.server import shutdown

        await shutdown(grpc_server, grace=30)
    http.should_exit = True
    await http_task
    log.info("stopped")
    return exit_code


def main(settings: Settings, argv: Sequence[str] = ()) -> None:
    """Serve in this process, or start several (``--processes``, by default one per GPU; ``argv``:
    the command line they are given, with their own devices and the shared HTTP socket)."""
    from service.processes import process_count, supervise

    processes = 1 if settings.http_fd is not None else process_count(settings)
    several = processes > 1 or settings.http_fd is not None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s " + ("[%(process)d] " if several else "") + "%(name)s: %(message)s",
    )
    if processes > 1:
        sys.exit(supervise(settings, argv, processes))
    sys.exit(asyncio.run(serve(settings)))
