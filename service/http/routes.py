"""The native routes (docs/api.md#http-api, #layer-calls): ``POST /attention``, ``GET /layers``,
``POST /layers/{name}``.

Each reads its body (``body``), decodes it (``codec``; a heavy body in a thread), awaits the engine
and answers in the encoding the request came in, with the call's phases in ``Server-Timing``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from service.errors import UnsupportedMediaType
from service.http import body, codec
from service.http.disconnect import unless_gone
from service.http.openapi import ATTENTION_OPENAPI, LAYER_OPENAPI
from service.settings import Settings
from service.wire.tensors import DTYPE_NAMES, ServerTiming


class DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` alone and returns a ``Response``: called as it
    is, without FastAPI's per-call dependency solving and response handling, straight from
    ``edge.EdgeMiddleware`` (before the other routes: a DirectRoute's path must match no earlier
    route's). It is documented and answered on errors like any other route (what that saves a
    small call: docs/benchmarks/service.md#latency)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        return self.endpoint


def layer_info_dict(info: Any) -> dict[str, Any]:
    out = {
        k: getattr(info, k, None)
        for k in ("name", "family", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "dtype")
    }
    out["dtype"] = DTYPE_NAMES.get(out["dtype"], str(out["dtype"]))
    return out


def add_native_routes(app: FastAPI, engine: Any, settings: Settings) -> None:
    limit, json_limit = settings.max_body_bytes, settings.max_json_bytes

    async def serve(request: Request, decode: Callable[..., tuple[Any, str]], run: Callable[[Any], Awaitable[dict]]):
        """Read, decode (``decode(body, media type, query, request_id=, deadline=, arrived=)``),
        ``run`` the request on the engine (-> (tensors, stamps)), encode, answer."""
        arrived = time.monotonic()
        deadline = body.deadline_from(request.headers.get("x-request-timeout-ms"), settings, arrived)
        timing = ServerTiming()
        mtype = body.media_type(request)
        if mtype not in (codec.SAFETENSORS, codec.JSON):
            raise UnsupportedMediaType(
                f"unsupported Content-Type {mtype or '(none)'!r}; send {codec.SAFETENSORS} or {codec.JSON}"
            )
        if mtype == codec.SAFETENSORS:
            data = await body.read_body(request, limit)
        else:
            data = await body.read_body(request, json_limit, "--max-json-mb")
        timing.mark("read")
        big = body.worth_offloading(len(data), len(data) if mtype == codec.JSON else 0)
        req, encoding = await body.offload(  # a heavy body off the loop (JSON, misaligned safetensors copies)
            big,
            lambda: decode(data, mtype, request.query_params, request_id=request.state.request_id,
                           deadline=deadline, arrived=arrived),
        )  # fmt: skip
        timing.mark("decode")
        tensors, stamps = await unless_gone(request, run(req))  # a client that hangs up is not computed for
        timing.engine(stamps)
        content, media = await codec.encode_answer(tensors, encoding, big)
        timing.mark("encode")
        return body.respond(content, media, {"Server-Timing": timing.value()})

    async def run_attention(req) -> tuple[dict, Any]:
        result = await engine.attend(req)
        tensors = {"o": result.o} if result.lse is None else {"o": result.o, "lse": result.lse}
        return tensors, result.stamps

    async def run_layer(req) -> tuple[dict, Any]:
        result = await engine.call_layer(req)
        return {"y": result.y}, result.stamps

    async def attention(request: Request) -> Response:
        return await serve(request, codec.decode_attention, run_attention)

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
        return await serve(request, lambda *args, **kw: codec.decode_layer(name, *args, **kw), run_layer)
