"""HTTP routes of sessions (docs/api.md#sessions): a thin adapter, wire -> ``SessionStep`` -> ``engine.sessions``.

    POST   /sessions                 JSON {"layers", "num_kv_heads", "head_dim", "dtype", "session"?} -> 201
    POST   /sessions/{id}/attend     a step: body as /attention (q, optionally k and v)
    POST   /sessions/attend          a packed step: q/k/v [T, H, D], sessions, q_lengths
    GET    /sessions/{id}            the session's description
    DELETE /sessions/{id}            -> 204
    GET    /sessions                 {"count", "kv_bytes_used", "kv_bytes_capacity", "sessions"}

Bodies, tensors, options and answers go through ``service.http.codec`` / ``body`` as for /attention
(option values through ``service.wire.options``): options
as query parameters (they win), safetensors metadata or JSON fields; an unknown option is a 400.
Errors are raised as ``ServiceError``s and answered by the app's one handler.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.errors import BadRequest, UnsupportedMediaType
from service.http import body as http_body
from service.http import codec
from service.http.disconnect import unless_gone
from service.http.json_tensors import json_tensor
from service.http.openapi import CREATE_SESSION_OPENAPI, PACKED_STEP_OPENAPI, STEP_OPENAPI
from service.http.routes import DirectRoute
from service.sessions import SessionStep
from service.sessions.routing import HOP_DEADLINE
from service.settings import Settings
from service.wire.options import parse_bool, parse_layer, parse_options
from service.wire.tensors import ServerTiming

STEP_TENSORS = ("q", "k", "v", "alibi_slopes")
STEP_OPTIONS = ("layer", "causal", "scale", "layout", "return_lse", "end", "window_size", "softcap")
PACKED_OPTIONS = (*STEP_OPTIONS, "sessions")
CREATE_FIELDS = ("session", "layers", "num_kv_heads", "head_dim", "dtype")


def step_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Raw option values (query strings, metadata strings, JSON values) -> SessionStep keywords."""
    out = parse_options({k: v for k, v in raw.items()
                         if k in ("causal", "scale", "layout", "return_lse", "window_size", "softcap")})
    if "layer" in raw:
        out["layer"] = parse_layer("layer", raw["layer"])
    if "end" in raw:
        out["end"] = parse_bool("end", raw["end"])
    return out


def _session_ids(value: Any) -> list[str]:
    if isinstance(value, str):
        if not value.strip():
            raise BadRequest("'sessions' is empty: a step names at least one session (comma-separated ids)")
        ids = [s.strip() for s in value.split(",")]
        if "" in ids:
            raise BadRequest(f"'sessions' holds an empty id (position {ids.index('')}, zero-based): give "
                             "comma-separated ids, each once")
        return ids
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise BadRequest("'sessions' must be a list of session ids (in safetensors metadata or a query string: "
                     "comma-separated)")


def decode_step(session: str, body: bytearray, mtype: str, query: Mapping[str, str],
                **ids: Any) -> tuple[SessionStep, str]:
    """A step's body -> (SessionStep, the answer's encoding)."""
    tensors, raw, encoding = codec.decode_tensors(body, mtype, STEP_TENSORS, STEP_OPTIONS, query)
    if "q" not in tensors:
        raise BadRequest("missing tensor q")
    opts = step_options(raw)
    layout = opts.pop("layout", "bhnd")
    return SessionStep.single(session, tensors["q"], tensors.get("k"), tensors.get("v"), layout=layout,
                              alibi_slopes=tensors.get("alibi_slopes"), **opts, **ids), encoding


def decode_packed(body: bytearray, mtype: str, query: Mapping[str, str], **ids: Any) -> tuple[SessionStep, str]:
    """A packed step's body -> (SessionStep, the answer's encoding)."""
    if mtype == codec.JSON:
        doc = codec.parse_json(body)
        if not isinstance(doc, dict):
            raise BadRequest('the JSON body must be an object such as {"sessions": [...], "q": ..., "q_lengths": ...}')
        doc = dict(doc)
        lengths = doc.pop("q_lengths", None)
        sessions = doc.pop("sessions", None)
        tensors, body_opts, encoding = codec.json_tensors(doc, STEP_TENSORS, STEP_OPTIONS)
        if sessions is not None:
            body_opts["sessions"] = sessions
        raw = codec.merge_options(PACKED_OPTIONS, body_opts, codec.query_options(query))
        if isinstance(lengths, dict):
            lengths = json_tensor(lengths, "q_lengths", torch.int64)[0]
    else:
        tensors, raw, encoding = codec.decode_tensors(body, mtype, (*STEP_TENSORS, "q_lengths"), PACKED_OPTIONS,
                                                      query)
        lengths = tensors.pop("q_lengths", None)
    missing = [n for n, present in (("q", "q" in tensors), ("q_lengths", lengths is not None),
                                    ("sessions", "sessions" in raw)) if not present]
    if missing:
        raise BadRequest(f"a packed step needs {', '.join(missing)} (one session's step goes to "
                         "POST /sessions/{id}/attend)")
    sessions = _session_ids(raw.pop("sessions"))
    opts = step_options(raw)
    if opts.pop("layout", "bhnd") != "bhnd":
        raise BadRequest("a packed step's tensors are [T, H, D]: it takes no layout")
    return SessionStep.packed(sessions, tensors["q"], tensors.get("k"), tensors.get("v"), lengths,
                              alibi_slopes=tensors.get("alibi_slopes"), **opts, **ids), encoding


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def create_router(engine: Any, settings: Settings) -> APIRouter:
    router = APIRouter(tags=["sessions"])
    limit, json_limit = settings.max_body_bytes, settings.max_json_bytes

    async def read(request: Request) -> tuple[Any, str, dict[str, Any]]:
        arrived = time.monotonic()
        ids = {
            "request_id": request.state.request_id,
            "deadline": http_body.deadline_from(request.headers.get("x-request-timeout-ms"), settings, arrived,
                                                request.headers.get(HOP_DEADLINE)),
            "arrived": arrived,
        }
        mtype = http_body.media_type(request)
        if mtype not in (codec.SAFETENSORS, codec.JSON):
            raise UnsupportedMediaType(
                f"unsupported Content-Type {mtype or '(none)'!r}; send {codec.SAFETENSORS} or {codec.JSON}"
            )
        if mtype == codec.SAFETENSORS:
            body = await http_body.read_body(request, limit)
        else:
            body = await http_body.read_body(request, json_limit, "--max-json-mb")
        return body, mtype, ids

    async def answer(request: Request, decode, *args) -> Response:
        timing = ServerTiming()
        body, mtype, ids = await read(request)
        timing.mark("read")
        big = http_body.worth_offloading(len(body), len(body) if mtype == codec.JSON else 0)
        step, encoding = await http_body.offload(big, lambda: decode(*args, body, mtype, request.query_params, **ids))
        timing.mark("decode")
        result = await unless_gone(request, engine.sessions.step(step))  # a step nobody reads is not launched
        timing.engine(result.stamps)
        tensors = {"o": result.o} if result.lse is None else {"o": result.o, "lse": result.lse}
        content, media = await codec.encode_answer(tensors, encoding, big)
        timing.mark("encode")
        return http_body.respond(content, media, {"Server-Timing": timing.value()})

    @router.post("/sessions", status_code=201, summary="create a session (its KV cache is kept on the server)",
                 openapi_extra=CREATE_SESSION_OPENAPI)
    async def create_session(request: Request) -> Response:
        if http_body.media_type(request) != codec.JSON:
            raise UnsupportedMediaType(f"send the session's description as {codec.JSON}")
        doc = codec.parse_json(await http_body.read_body(request, json_limit, "--max-json-mb"))
        if not isinstance(doc, dict):
            raise BadRequest('the body must be an object such as {"num_kv_heads": 8, "head_dim": 128}')
        unknown = set(doc) - set(CREATE_FIELDS)
        if unknown:
            raise BadRequest(f"unknown field {sorted(unknown)[0]!r}; the fields are {', '.join(CREATE_FIELDS)}")
        missing = [f for f in ("num_kv_heads", "head_dim") if f not in doc]
        if missing:
            raise BadRequest(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        session = doc.get("session")
        if session is not None and not isinstance(session, str):
            raise BadRequest("session must be a string id")
        dtype = doc.get("dtype", "float16")
        if not isinstance(dtype, str):
            raise BadRequest("dtype must be a string such as 'float16'")
        info = engine.sessions.create(session=session, layers=doc.get("layers", 1),
                                      num_kv_heads=doc["num_kv_heads"], head_dim=doc["head_dim"], dtype=dtype)
        return _json(info, 201)

    @router.get("/sessions", summary="the sessions held, and the KV cache's use")
    async def list_sessions() -> Response:
        return _json(engine.sessions.list())

    async def attend_packed(request: Request) -> Response:
        return await answer(request, decode_packed)

    async def attend(request: Request) -> Response:
        return await answer(request, decode_step, request.path_params["session"])

    # the steps are the hot path: DirectRoutes, their path parameter documented by hand
    router.add_api_route("/sessions/attend", attend_packed, methods=["POST"], response_class=Response,
                         summary="a packed step: many sessions' new tokens in one call",
                         openapi_extra=PACKED_STEP_OPENAPI, route_class_override=DirectRoute)
    router.add_api_route("/sessions/{session}/attend", attend, methods=["POST"], response_class=Response,
                         summary="a step: append k, v, then attend q over the session's keys",
                         openapi_extra=STEP_OPENAPI, route_class_override=DirectRoute)

    @router.get("/sessions/{session}", summary="a session's description")
    async def get_session(session: str) -> Response:
        return _json(engine.sessions.describe(session))

    @router.delete("/sessions/{session}", status_code=204, summary="end a session, returning its memory")
    async def delete_session(session: str) -> Response:
        await engine.sessions.delete(session)
        return Response(status_code=204)

    return router
