"""The HTTP transport (FastAPI): native routes (API.md §2), Open Inference Protocol routes (§6, in
``http_oip``), health, metrics and docs. A thin adapter: wire -> ``http_codec`` -> engine -> wire.

Errors map to status codes in one place, ``error_response``: every ``ServiceError`` by its
``http_status``, request-validation errors as 400, unknown routes 404/405, anything else 500 without
a stack trace. Native routes answer ``{"error": {"code", "message"}}``; ``/v2`` routes answer the
protocol's ``{"error": "<message>"}``.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import check_api_key
from service.core.metrics import render as render_metrics
from service.errors import BadRequest, ServiceError, Unavailable
from service.http import codec
from service.http.disconnect import unless_gone
from service.settings import Settings
from service.wire.tensors import DTYPE_NAMES, ServerTiming

log = logging.getLogger("attnserve.http")

VERSION = "0.1.0"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


# ---------------------------------------------------------------- errors: the one mapping


def error_response(
    path: str,
    status: int,
    code: str,
    message: str,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The error body of a route: ``{"error": {"code", "message"}}``, or ``{"error": msg}`` on /v2."""
    body: dict[str, Any] = (
        {"error": message} if path.startswith("/v2") else {"error": {"code": code, "message": message}}
    )
    headers = dict(headers or {})  # e.g. Allow on a 405
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s or 1)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def service_error_response(path: str, exc: ServiceError) -> Response:
    return error_response(path, exc.http_status, exc.code, exc.message, exc.retry_after_s)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: ServiceError) -> Response:
        return service_error_response(request.url.path, exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request.url.path, 400, BadRequest.code, _validation_message(exc))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return error_response(request.url.path, exc.status_code, code, message, headers=exc.headers)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


# ---------------------------------------------------------------- edge: auth, request id, metrics


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


class EdgeMiddleware:
    """Pure ASGI middleware around every HTTP request: API key (except health probes), the
    ``X-Request-Id`` echo (generated when absent), per-route metrics, and a last-resort 500."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: HttpMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"x-request-id", b"authorization", b"x-api-key")
        }
        rid = headers.get("x-request-id", "")[:128] or uuid.uuid4().hex
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
            await self.app(scope, receive, send_with_id)
        except ServiceError as exc:  # the API key check (route errors are answered by the handlers)
            if not started:
                await service_error_response(path, exc)(scope, receive, send_with_id)
        except Exception:  # a bug: log it here, tell the client nothing about it
            log.exception("unhandled error on %s %s", scope["method"], path)
            if not started:
                await error_response(path, 500, "internal", "internal server error")(
                    scope, receive, send_with_id
                )
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(label, scope["method"], str(status)).inc()
            self.metrics.duration.labels(label).observe(time.perf_counter() - start)


# ---------------------------------------------------------------- OpenAPI: body schemas


def _error_schema(v2: bool = False) -> dict:
    ref = "#/components/schemas/OIPError" if v2 else "#/components/schemas/Error"
    return {"content": {"application/json": {"schema": {"$ref": ref}}}}


SCHEMAS: dict[str, Any] = {
    "NestedList": {
        "description": "a tensor as nested lists of numbers (row-major)",
        "type": "array",
        "maxItems": 64,
        "items": {"anyOf": [{"type": "number"}, {"$ref": "#/components/schemas/NestedList"}]},
    },
    "TensorObject": {
        "type": "object",
        "additionalProperties": False,
        "required": ["shape", "data"],
        "properties": {
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
            "dtype": {"type": "string", "enum": ["float16", "bfloat16", "float32", "int32", "int64"]},
            "data": {
                "anyOf": [
                    {"type": "array", "items": {"type": "number"}},
                    {"type": "string", "description": "base64 of little-endian row-major bytes"},
                ]
            },
        },
    },
    "Tensor": {
        "anyOf": [{"$ref": "#/components/schemas/NestedList"}, {"$ref": "#/components/schemas/TensorObject"}]
    },
    "AttentionJSON": {
        "type": "object",
        "additionalProperties": False,
        "required": ["q", "k", "v"],
        "properties": {
            "q": {"$ref": "#/components/schemas/Tensor"},
            "k": {"$ref": "#/components/schemas/Tensor"},
            "v": {"$ref": "#/components/schemas/Tensor"},
            "kv_lengths": {"$ref": "#/components/schemas/Tensor"},
            "causal": {"type": "boolean"},
            "scale": {"type": "number"},
            "layout": {"type": "string", "enum": ["bhnd", "bnhd"]},
            "return_lse": {"type": "boolean"},
            "kernel": {"type": "string", "enum": ["auto", "flash_v1", "flash", "reference"]},
        },
    },
    "AttentionJSONResult": {
        "type": "object",
        "required": ["o"],
        "properties": {
            "o": {"$ref": "#/components/schemas/Tensor"},
            "lse": {"$ref": "#/components/schemas/Tensor"},
        },
    },
    "LayerJSON": {
        "type": "object",
        "additionalProperties": False,
        "required": ["x"],
        "properties": {
            "x": {"$ref": "#/components/schemas/Tensor"},
            "positions": {"$ref": "#/components/schemas/Tensor"},
            "kv_lengths": {"$ref": "#/components/schemas/Tensor"},
            "causal": {"type": "boolean"},
        },
    },
    "LayerJSONResult": {
        "type": "object",
        "required": ["y"],
        "properties": {"y": {"$ref": "#/components/schemas/Tensor"}},
    },
    "LayerInfo": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "family": {"type": "string"},
            "hidden_size": {"type": "integer"},
            "num_heads": {"type": "integer"},
            "num_kv_heads": {"type": "integer"},
            "head_dim": {"type": "integer"},
            "dtype": {"type": "string"},
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
            }
        },
    },
    "OIPError": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "OIPTensor": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
            "datatype": {"type": "string", "enum": ["FP16", "BF16", "FP32", "INT32", "INT64"]},
            "parameters": {"type": "object"},
            "data": {"$ref": "#/components/schemas/NestedList"},
        },
    },
    "OIPInferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/OIPTensor"}, "maxItems": 8},
            "outputs": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                },
            },
        },
    },
    "OIPInferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/OIPTensor"}},
        },
    },
}

ERRORS = {
    str(s): {"description": d, **_error_schema()}
    for s, d in (
        (400, "malformed body, missing tensor, unknown or bad option"),
        (401, "API key missing or wrong"),
        (413, "body over --max-body-mb"),
        (415, "unknown Content-Type"),
        (422, "shapes or dtypes inconsistent, head dim > 256"),
        (429, "queue full; see Retry-After"),
        (503, "not ready or draining"),
        (504, "X-Request-Timeout-Ms deadline passed"),
    )
}

_BOOL_Q = {"type": "boolean"}
HEADERS = [
    {
        "name": "X-Request-Timeout-Ms",
        "in": "header",
        "required": False,
        "schema": {"type": "number", "minimum": 0},
        "description": "deadline of this request (default --request-timeout-ms)",
    },
    {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "echoed in the response",
    },
]


def _body(json_schema: str, result_schema: str, options: list[dict]) -> dict:
    return {
        "parameters": [*options, *HEADERS],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{json_schema}"}},
                "application/x-safetensors": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        "responses": {
            "200": {
                "description": "the result, in the encoding the request came in",
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{result_schema}"}},
                    "application/x-safetensors": {"schema": {"type": "string", "format": "binary"}},
                },
            },
            **ERRORS,
        },
    }


ATTENTION_OPENAPI = _body(
    "AttentionJSON",
    "AttentionJSONResult",
    [
        {"name": "causal", "in": "query", "schema": _BOOL_Q},
        {"name": "scale", "in": "query", "schema": {"type": "number"}},
        {"name": "layout", "in": "query", "schema": {"type": "string", "enum": ["bhnd", "bnhd"]}},
        {"name": "return_lse", "in": "query", "schema": _BOOL_Q},
        {
            "name": "kernel",
            "in": "query",
            "schema": {"type": "string", "enum": ["auto", "flash_v1", "flash", "reference"]},
        },
    ],
)
LAYER_OPENAPI = _body("LayerJSON", "LayerJSONResult", [{"name": "causal", "in": "query", "schema": _BOOL_Q}])


# ---------------------------------------------------------------- the app


class DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` alone and returns a ``Response``: called as it
    is, without FastAPI's per-call dependency solving and response handling, which cost a small
    call ~0.02 ms of the event loop (CPU box, 2026-11-30, in-process: 143 instead of 164 us a
    call). It is documented, routed and answered on errors like any other route."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        return self.endpoint


def layer_info_dict(info: Any) -> dict[str, Any]:
    out = {
        k: getattr(info, k, None)
        for k in ("name", "family", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "dtype")
    }
    out["dtype"] = DTYPE_NAMES.get(out["dtype"], str(out["dtype"]))
    return out


def create_app(engine: Any, settings: Settings) -> FastAPI:
    """The FastAPI app over ``engine`` (see ``service.core.engine`` for its interface)."""
    from service.http.oip import create_router

    app = FastAPI(title="attnserve", version=VERSION, summary="Exact attention as a service (API.md)")
    metrics = HttpMetrics()
    app.add_middleware(EdgeMiddleware, settings=settings, metrics=metrics)
    install_error_handlers(app)
    limit, json_limit = settings.max_body_bytes, settings.max_json_bytes

    def begin(request: Request) -> tuple[str, float, float]:
        arrived = time.monotonic()
        deadline = codec.deadline_from(request.headers.get("x-request-timeout-ms"), settings, arrived)
        return request.state.request_id, deadline, arrived

    async def read(request: Request) -> tuple[bytearray, str]:
        mtype = codec.media_type(request)
        if mtype not in (codec.SAFETENSORS, codec.JSON):
            raise codec.UnsupportedMediaType(
                f"unsupported Content-Type {mtype or '(none)'!r}; send {codec.SAFETENSORS} or {codec.JSON}"
            )
        if mtype == codec.SAFETENSORS:
            return await codec.read_body(request, limit), mtype
        return await codec.read_body(request, json_limit, "--max-json-mb"), mtype

    async def attention(request: Request) -> Response:
        request_id, deadline, arrived = begin(request)
        timing = ServerTiming()
        body, mtype = await read(request)
        timing.mark("read")
        big = codec.worth_offloading(len(body), len(body) if mtype == codec.JSON else 0)
        req, encoding = await codec.offload(  # a heavy body off the loop (JSON, misaligned safetensors copies)
            big,
            lambda: codec.decode_attention(
                body, mtype, request.query_params, request_id=request_id, deadline=deadline, arrived=arrived
            ),
        )
        timing.mark("decode")
        result = await unless_gone(request, engine.attend(req))
        timing.engine(result.stamps)
        tensors = {"o": result.o} if result.lse is None else {"o": result.o, "lse": result.lse}
        content, media = await codec.encode_answer(tensors, encoding, big)
        timing.mark("encode")
        return codec.respond(content, media, {"Server-Timing": timing.value()})

    app.router.add_api_route(  # the hot path: a DirectRoute
        "/attention",
        attention,
        methods=["POST"],
        summary="O = softmax(Q Kᵀ · scale + mask) V",
        openapi_extra=ATTENTION_OPENAPI,
        response_class=Response,
        route_class_override=DirectRoute,
    )

    @app.get("/layers", summary="the loaded model layers")
    async def list_layers() -> dict:
        return {"layers": [layer_info_dict(i) for i in engine.layer_infos()]}

    @app.post(
        "/layers/{name}",
        summary="y = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))",
        openapi_extra=LAYER_OPENAPI,
        response_class=Response,
    )
    async def call_layer(name: str, request: Request) -> Response:
        request_id, deadline, arrived = begin(request)
        timing = ServerTiming()
        body, mtype = await read(request)
        timing.mark("read")
        big = codec.worth_offloading(len(body), len(body) if mtype == codec.JSON else 0)
        req, encoding = await codec.offload(  # a heavy body off the loop (JSON, misaligned safetensors copies)
            big,
            lambda: codec.decode_layer(
                name,
                body,
                mtype,
                request.query_params,
                request_id=request_id,
                deadline=deadline,
                arrived=arrived,
            ),
        )
        timing.mark("decode")
        result = await unless_gone(request, engine.call_layer(req))
        timing.engine(result.stamps)
        content, media = await codec.encode_answer({"y": result.y}, encoding, big)
        timing.mark("encode")
        return codec.respond(content, media, {"Server-Timing": timing.value()})

    @app.get("/healthz", summary="alive (the process answers)")
    async def healthz() -> dict:
        return {"status": "alive"}

    @app.get(
        "/readyz",
        summary="200 once every worker is warm; 503 before and while draining",
        responses={"503": {"description": "not ready", **_error_schema()}},
    )
    async def readyz() -> dict:
        if not engine.ready:
            raise Unavailable("not ready: warming up or draining")
        return {"status": "ready"}

    @app.get("/metrics", summary="Prometheus text format", response_class=Response)
    async def prometheus() -> Response:
        refresh = getattr(getattr(engine, "metrics", None), "refresh", None)
        if refresh is not None:  # this process's sampled gauges, fresh (under --processes)
            refresh()
        registries = [r for r in (getattr(engine, "metrics_registry", None), metrics.registry) if r is not None]
        return Response(render_metrics(*registries), media_type=CONTENT_TYPE_LATEST)

    app.include_router(create_router(engine, settings))

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
