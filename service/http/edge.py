"""What wraps every HTTP request before a route sees it: the API key (except health probes), the
``X-Request-Id`` echo (generated when absent), per-route Prometheus metrics, and a last-resort 500.

The edge is the outermost ASGI app (``app.create_app``), FastAPI behind it. The hot routes
(``routes.DirectRoute``: the attention call and the session steps) are called from here, past
FastAPI's own middleware and router: for a small call those layers cost more host
time than what they do for these routes (nothing: their errors are ``ServiceError``s, answered here
as the app's handlers answer them; docs/benchmarks/service.md#latency).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import check_api_key
from service.core.types import new_request_id
from service.errors import ServiceError
from service.http.errors import internal_error_response, service_error_response
from service.sessions.routing import FORWARDED, UNION_PART
from service.settings import Settings

FORWARDED_HEADER = FORWARDED.encode()

log = logging.getLogger("attnserve.http")

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "attnserve_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "attnserve_http_request_duration_seconds",
            "HTTP request time, body read to last byte sent",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        # label children looked up once per (route, method, status): ``labels()`` costs more than
        # the observation itself
        self._children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        children = self._children.get((route, method, status))
        if children is None:
            children = self._children[route, method, status] = (
                self.requests.labels(route, method, str(status)), self.duration.labels(route))
        children[0].inc()
        children[1].observe(seconds)


class EdgeMiddleware:
    """Pure ASGI middleware around every HTTP request: API key (except health probes), the
    ``X-Request-Id`` echo (generated when absent), per-route metrics, and a last-resort 500."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: HttpMetrics, direct: Sequence[Any] = ()):
        """``direct``: the routes to call from here (``routes.DirectRoute``s; the app fills the list
        once it has all its routes)."""
        self.app, self.settings, self.metrics = app, settings, metrics
        self.direct = direct

    def _direct_route(self, scope: Scope) -> Any:
        """The DirectRoute that serves this request, its path parameters put in ``scope``; or None."""
        return _matching(self.direct, scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"x-request-id", b"authorization", b"x-api-key", FORWARDED_HEADER)
        }
        rid = headers.get("x-request-id", "")[:128] or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))],
                }
            await send(message)

        path = scope["path"]
        try:
            if path not in PUBLIC_PATHS:
                check_api_key(self.settings, headers.get("authorization"), headers.get("x-api-key"))
            route = self._direct_route(scope)
            if route is None:
                await self.app(scope, receive, send_with_id)
            else:
                try:
                    response = await route.endpoint(Request(scope, receive))
                except ServiceError as exc:  # as the app's handler (``errors``) answers it
                    response = service_error_response(path, exc)
                await response(scope, receive, send_with_id)
        except ServiceError as exc:  # the API key check (route errors are answered by the handlers)
            self._match_route(scope)  # (the refusal is counted under the route it was for)
            if not started:
                await service_error_response(path, exc)(scope, receive, send_with_id)
        except Exception:  # a bug: log it here, tell the client nothing about it
            log.exception("unhandled error on %s %s", scope["method"], path)
            if not started:
                await internal_error_response(path)(scope, receive, send_with_id)
        finally:
            if not headers.get(FORWARDED, "").endswith(UNION_PART):  # (counted by the front's part)
                route = scope.get("route")
                label = getattr(route, "path", None) or "unmatched"
                self.metrics.observe(label, scope["method"], status, time.perf_counter() - start)

    def _match_route(self, scope: Scope) -> None:
        """``scope["route"]`` for a request refused before routing (the app's routes, matched as its
        router matches them), so that its metrics name the route; unknown paths stay unmatched."""
        _matching(getattr(getattr(self.app, "router", None), "routes", ()), scope)


def _matching(routes: Sequence[Any], scope: Scope) -> Any:
    """The first of ``routes`` that matches this request whole, its match put in ``scope``; or None."""
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL:
            scope.update(child)
            return route
    return None
