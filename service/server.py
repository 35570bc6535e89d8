"""Runs the whole service in one process and one event loop: the engine (workers + batcher), the
HTTP server (uvicorn/FastAPI) and the gRPC server (grpc.aio), sharing the engine.

On SIGTERM/SIGINT: stop taking new work, report not-ready, finish what is held, then exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from .engine import Engine
from .settings import Settings

log = logging.getLogger("attnserve")


async def serve(settings: Settings) -> None:
    from .grpc_server import create_server
    from .http_app import create_app

    engine = Engine(settings)
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.http_port, log_level=settings.log_level.lower(),
        lifespan="on", timeout_graceful_shutdown=30,
    )
    http = uvicorn.Server(config)
    http.install_signal_handlers = lambda: None  # signals are handled below, for both servers
    grpc_server = create_server(engine, settings) if settings.grpc_port else None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if grpc_server is not None:
        await grpc_server.start()
        log.info("gRPC listening on %s:%d", settings.host, settings.grpc_port)
    http_task = asyncio.create_task(http.serve())
    # Warm-up runs while the servers already answer /healthz (alive) and /readyz (503 until warm).
    start_task = asyncio.create_task(engine.start())

    done, _ = await asyncio.wait({asyncio.create_task(stop.wait()), http_task, start_task},
                                 return_when=asyncio.FIRST_COMPLETED)
    if start_task in done and start_task.exception() is not None:
        log.error("start-up failed: %s", start_task.exception())
        stop.set()
    if not stop.is_set() and start_task in done:
        await asyncio.wait({asyncio.create_task(stop.wait()), http_task}, return_when=asyncio.FIRST_COMPLETED)

    log.info("shutting down: draining held requests")
    if not start_task.done():  # stopped while warming up: nothing was accepted yet
        start_task.cancel()
        await asyncio.gather(start_task, return_exceptions=True)
    await engine.drain()  # not-ready from here; everything accepted is answered
    if grpc_server is not None:
        await grpc_server.stop(grace=30)
    http.should_exit = True
    await http_task
    log.info("stopped")


def main(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(settings))
