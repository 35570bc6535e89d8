"""Health and operations routes: ``GET /healthz`` (alive), ``GET /readyz`` (warm, not draining) and
``GET /metrics`` (Prometheus text: the engine's registry and the HTTP edge's)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from service.core.metrics import render as render_metrics
from service.errors import Unavailable
from service.http.edge import HttpMetrics
from service.http.openapi import error_schema
from service.wire.oip import NOT_READY


def add_ops_routes(app: FastAPI, engine: Any, metrics: HttpMetrics) -> None:
    # the probes answer HEAD too (load balancers' health checks send it): status and headers only
    @app.api_route("/healthz", methods=["GET", "HEAD"], summary="alive (the process answers)")
    async def healthz() -> dict:
        return {"status": "alive"}

    @app.api_route(
        "/readyz",
        methods=["GET", "HEAD"],
        summary="200 once every worker is warm; 503 before and while draining",
        responses={"503": {"description": "not ready", **error_schema()}},
    )
    async def readyz() -> dict:
        if not engine.ready:
            raise Unavailable(NOT_READY)
        return {"status": "ready"}

    @app.get("/metrics", summary="Prometheus text format", response_class=Response)
    async def prometheus() -> Response:
        refresh = getattr(getattr(engine, "metrics", None), "refresh", None)
        if refresh is not None:  # this process's sampled gauges, fresh (under --processes)
            refresh()
        registries = [r for r in (getattr(engine, "metrics_registry", None), metrics.registry) if r is not None]
        return Response(render_metrics(*registries), media_type=CONTENT_TYPE_LATEST)
