"""The HTTP transport's one mapping of errors to status codes and bodies (docs/api.md#errors).

Every ``ServiceError`` (``service.errors``) gets its ``http_status``, request-validation errors 400,
unknown routes 404/405; anything else 500 without a stack trace (``internal_error_response``,
sent by ``edge`` for whatever a route lets out). Native
routes answer ``{"error": {"code", "message"}}``; ``/v2`` routes answer the Open Inference
Protocol's ``{"error": "<message>"}``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.errors import BadRequest, ServiceError


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
    if status == 429 and retry_after_s is not None and not path.startswith("/v2"):
        body["error"]["retry_after_s"] = round(retry_after_s, 3)  # the header holds whole seconds only
    headers = dict(headers or {})  # e.g. Allow on a 405
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s or 1)))
    if status == 413:  # the rest of the body is not read: what follows on the connection is not a request
        headers["Connection"] = "close"
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def service_error_response(path: str, exc: ServiceError) -> Response:
    return error_response(path, exc.http_status, exc.code, exc.message, exc.retry_after_s)


def internal_error_response(path: str) -> Response:
    """A bug's answer: 500, and nothing about it (the log has it)."""
    return error_response(path, 500, "internal", "internal server error")


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

    # Starlette answers a bug with this, then re-raises it to the edge, which logs it
    async def on_bug(request: Request, exc: Exception) -> Response:
        return internal_error_response(request.url.path)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(Exception, on_bug)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
