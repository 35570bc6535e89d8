"""Runs the whole service in one process and one event loop: the engine (workers + batcher), the
HTTP server (uvicorn/FastAPI) and the gRPC server (grpc.aio), sharing the engine.

Start-up: configuration errors (devices, layers) stop the process with exit code 2 before any port
is bound; then both servers answer while the workers warm (/healthz alive, /readyz 503 until warm).
On SIGTERM/SIGINT: stop taking new work, report not-ready, finish what is held, then exit.

Two patches over other libraries are installed here, each with its off switch: glibc's malloc tuned
for big bodies (``service.allocator``, ``--no-tune-allocator``) and uvicorn's HTTP protocol reading
big bodies once (``service.http.uvicorn_patch``, ``--no-patch-uvicorn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import uvicorn

from service import allocator
from service.core import metrics
from service.core.engine import Engine
from service.http import forward
from service.http.limits import limited_protocol
from service.http.uvicorn_patch import UVICORN_HANDING_OVER, BodyBuffers, hand_over_request_bodies, http_protocol
from service.sessions import routing
from service.settings import Settings

log = logging.getLogger("attnserve")


async def _serve_http(http: uvicorn.Server, sockets: list[socket.socket] | None = None) -> bool:
    """Run uvicorn; False when it could not start (it calls sys.exit on a port it cannot bind)."""
    try:
        await http.serve(sockets=sockets)
    except SystemExit:
        return False
    return http.started


async def refresh_metrics(engine: Engine, every_s: float = 1.0) -> None:
    """Under ``--processes``: set this process's sampled gauges (queue depth, device memory) every
    ``every_s``, so that a scrape answered by another process sees them."""
    while True:
        engine.metrics.refresh()
        await asyncio.sleep(every_s)


async def release_memory_when_idle(engine: Engine, idle_s: float, bodies: BodyBuffers | None,
                                   trim_heap: bool) -> None:
    """Once ``engine`` has seen no request come or go for ``idle_s`` (checked every ``idle_s``: within
    2x of going idle), give back what the load left held: each GPU's free cached blocks (an ended
    session's KV pages: ``engine.release_cached_device_memory``), the free pinned body buffers and
    torch's cached pinned staging buffers (they count in the RSS), and with ``trim_heap`` (the
    allocator tuned, ``service.allocator``) glibc's freed heap. A body still being uploaded is not
    seen: a trim then costs it page faults, not correctness."""

    def release_host() -> None:
        if bodies is not None:  # its free pinned body buffers, before torch's host cache is emptied
            bodies.trim()
        engine.release_cached_host_memory()
        if trim_heap:
            allocator.trim_heap()

    seen = trimmed = engine.activity
    while True:
        await asyncio.sleep(idle_s)
        now = engine.activity
        if now == seen and now != trimmed and engine.idle:
            try:
                await engine.release_cached_device_memory()
            except Exception as exc:  # noqa: BLE001 - the host memory still goes back
                log.warning("giving cached device memory back failed: %r", exc)
            await asyncio.to_thread(release_host)  # off the loop
            trimmed = now
        seen = now


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
        if sockets is not None:  # and its private socket, for session calls other processes forward
            sockets += routing.http_listeners(settings)
    except (ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    if settings.http_fd is None:  # a lone server (a --processes child's ports are its supervisor's to check)
        from service.processes import bind_error

        for kind, port in (("HTTP", settings.http_port), ("gRPC", settings.grpc_port)):
            if port and (reason := bind_error(settings.host, port)):  # one line, before the warm-up
                log.error("cannot bind %s %s:%d: %s", kind, settings.host, port, reason)
                return 1  # (the host's state, not a setting: as --processes' supervisor answers it)
    reusing = allocator.install(settings)
    if reusing:
        log.debug("glibc keeps freed blocks up to %d MiB for reuse",
                  min(settings.max_body_bytes, allocator.MAX_KEPT_BYTES) >> 20)
    if settings.patch_uvicorn and not hand_over_request_bodies():
        log.debug("uvicorn %s: request bodies are copied once more (written for %s)", uvicorn.__version__,
                  UVICORN_HANDING_OVER)

    engine = Engine(settings)
    try:
        await asyncio.to_thread(engine.prepare)
    except ValueError as exc:  # LayerConfigError is a ValueError too
        log.error("cannot start: %s", exc)
        return 2
    # the workers warm (on their launcher threads) while the servers are built and bind their ports
    start_task = asyncio.create_task(engine.start())
    await asyncio.sleep(0)
    app = forward.wrap_http(create_app(engine, settings), settings)  # session calls reach their process
    bodies = None
    if settings.patch_uvicorn:
        bodies = BodyBuffers(engine.on_gpu, settings.pinned_body_bytes)
        protocol = http_protocol(settings.max_body_bytes, bodies)
    else:
        protocol = "httptools"  # uvicorn's own, as it is
        log.info("uvicorn's own HTTP protocol (--no-patch-uvicorn): big bodies are copied on their way in")
    config = uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level.lower(),
        http=limited_protocol(protocol, settings),
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

        try:
            grpc_server = create_server(engine, settings)
        except OSError as exc:
            log.error("%s", exc)
            start_task.cancel()
            await asyncio.gather(start_task, return_exceptions=True)
            _LEFT_WARMING.set()  # the workers may still be warming up: not waited for
            return 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if grpc_server is not None:
        await grpc_server.start()
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
    http_task = asyncio.create_task(_serve_http(http, sockets))
    stop_task = asyncio.create_task(stop.wait())
    refresh_task = asyncio.create_task(refresh_metrics(engine)) if metrics.MULTIPROCESS else None
    trim_task = None
    if settings.memory_trim_idle_s > 0:
        trim_task = asyncio.create_task(release_memory_when_idle(engine, settings.memory_trim_idle_s, bodies, reusing))

    exit_code = 0
    pending = {stop_task, http_task, start_task}
    while not stop.is_set():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if start_task in done and start_task.exception() is not None:
            exc = start_task.exception()
            if isinstance(exc, ValueError):  # a setting the devices cannot honour: the message says which
                log.error("cannot start: %s", exc)
                exit_code = 2
            else:
                log.error("start-up failed: %s", exc, exc_info=exc)
                exit_code = 1
            break
        if http_task in done:  # uvicorn stopped on its own: could not bind, or failed
            log.error("the HTTP server %s; shutting down", "stopped" if http.started else "could not start")
            exit_code = 1
            break

    stop_task.cancel()
    for task in (trim_task, refresh_task):
        if task is not None:
            task.cancel()
    if not start_task.done():  # stopped while warming up: nothing was accepted yet (not ready)
        # the warm-up runs on the workers' threads and cannot be interrupted; a cold one takes
        # minutes, past an orchestrator's grace period: stop the servers and leave without it
        log.info("stopped while warming up: exiting without waiting for the warm-up")
        start_task.cancel()
        await asyncio.gather(start_task, return_exceptions=True)
        if grpc_server is not None:
            await grpc_server.stop(0)
        http.should_exit = True
        await http_task
        _LEFT_WARMING.set()
        return exit_code
    log.info("shutting down: draining held requests")
    await engine.drain()  # not-ready from here; everything accepted is answered
    if grpc_server is not None:
        from service.grpc.server import shutdown

        await shutdown(grpc_server, grace=30)
    http.should_exit = True
    await http_task
    log.info("stopped")
    return exit_code


_LEFT_WARMING = threading.Event()  # serve() stopped while the workers were still warming up


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
    code = _run(serve(settings), settings.uvloop)
    if _LEFT_WARMING.is_set():  # the warm-up's threads are not waited for (interpreter exit joins them)
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def _run(main_coroutine, use_uvloop: bool) -> int:
    """Run the server's coroutine to its exit code on uvloop if asked and installed, else asyncio's loop."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: serving on asyncio's event loop")
        else:
            log.info("serving on uvloop %s", uvloop.__version__)
            return uvloop.run(main_coroutine)
    return asyncio.run(main_coroutine)
