"""The HTTP transport (FastAPI), wired: native routes (docs/api.md#http-api, ``routes``), Open
Inference Protocol routes (docs/api.md#open-inference-protocol, ``oip``), health and metrics
(``ops``), the OpenAPI document (``openapi``).
A thin adapter: wire -> ``codec`` -> engine -> wire.

Every request passes ``edge.EdgeMiddleware`` (API key, request id, metrics, last-resort 500);
errors map to status codes in one place, ``errors``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service import __version__
from service.http.edge import EdgeMiddleware, HttpMetrics
from service.http.errors import install_error_handlers
from service.http.oip import create_router
from service.http.openapi import install_openapi
from service.http.ops import add_ops_routes
from service.http.routes import DirectRoute, add_native_routes
from service.settings import Settings


def create_app(engine: Any, settings: Settings) -> EdgeMiddleware:
    """The ASGI app over ``engine`` (see ``service.core.engine`` for its interface): the edge, and
    behind it the FastAPI app (``.app``). The edge is outside FastAPI's own middleware, so the hot
    routes it calls pass none of it."""
    app = FastAPI(title="attnserve", version=__version__, summary="Exact attention as a service (docs/api.md)")
    metrics = HttpMetrics()
    direct: list[DirectRoute] = []  # the hot routes, called from the edge (filled below)
    install_error_handlers(app)
    add_native_routes(app, engine, settings)
    add_ops_routes(app, engine, metrics)
    app.include_router(create_router(engine, settings))
    routes = list(app.router.routes)
    if hasattr(engine, "sessions"):  # docs/api.md#sessions (an engine stand-in without sessions serves none)
        from service.http.sessions import create_router as create_sessions_router

        sessions = create_sessions_router(engine, settings)
        app.include_router(sessions)
        routes += sessions.routes
    direct += [r for r in routes if isinstance(r, DirectRoute)]
    install_openapi(app)
    return EdgeMiddleware(app, settings=settings, metrics=metrics, direct=direct)
