"""The OpenAPI document (``GET /docs``, ``/openapi.json``): the body schemas FastAPI cannot infer
from routes that read their bodies themselves (safetensors, JSON tensors, the Open Inference
Protocol's JSON and binary framing), the query options, headers and error answers of each route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

import kernels
from service.core.types import LAYOUTS
from service.wire.tensors import DTYPES, OIP_DTYPES


def error_schema(v2: bool = False) -> dict:
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
            "dtype": {"type": "string", "enum": list(DTYPES)},
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
            "layout": {"type": "string", "enum": list(LAYOUTS)},
            "return_lse": {"type": "boolean"},
            "kernel": {"type": "string", "enum": list(kernels.KERNELS)},
            "window_size": {"$ref": "#/components/schemas/WindowSize"},
            "softcap": {"type": "number", "minimum": 0},
            "alibi_slopes": {"$ref": "#/components/schemas/Tensor"},
        },
    },
    "WindowSize": {
        "description": "flash-attn's sliding window (left, right) in keys, -1 a side unbounded: "
                       "[L, R] or the string \"L,R\"",
        "anyOf": [
            {"type": "array", "items": {"type": "integer", "minimum": -1}, "minItems": 2, "maxItems": 2},
            {"type": "string", "pattern": r"^\s*-?\d+\s*,\s*-?\d+\s*$"},
        ],
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
    "SessionCreate": {
        "type": "object",
        "additionalProperties": False,
        "required": ["num_kv_heads", "head_dim"],
        "properties": {
            "session": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{1,128}$",
                        "description": "the id to give it; left out, the server makes one"},
            "layers": {"type": "integer", "minimum": 1, "default": 1},
            "num_kv_heads": {"type": "integer", "minimum": 1},
            "head_dim": {"type": "integer", "minimum": 1, "maximum": 256},
            "dtype": {"type": "string", "enum": ["float16", "bfloat16", "float32"], "default": "float16"},
        },
    },
    "SessionStepJSON": {
        "description": "one session's step: q [1, Hq, n, D], k and v [1, Hkv, n, D] or none (a q-only "
                       "step); options as in the query",
        "type": "object",
        "additionalProperties": False,
        "required": ["q"],
        "properties": {
            **{n: {"$ref": "#/components/schemas/Tensor"} for n in ("q", "k", "v", "alibi_slopes")},
            "layer": {"type": "integer", "minimum": 0},
            "causal": {"type": "boolean"},
            "scale": {"type": "number"},
            "layout": {"type": "string", "enum": list(LAYOUTS)},
            "return_lse": {"type": "boolean"},
            "end": {"type": "boolean"},
            "window_size": {"$ref": "#/components/schemas/WindowSize"},
            "softcap": {"type": "number", "minimum": 0},
        },
    },
    "PackedStepJSON": {
        "description": "many sessions' rows: q [T, Hq, D], k and v [T, Hkv, D] or none, q_lengths the rows "
                       "of each session in order",
        "type": "object",
        "additionalProperties": False,
        "required": ["sessions", "q", "q_lengths"],
        "properties": {
            "sessions": {"type": "array", "items": {"type": "string"}},
            "q_lengths": {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}},
                                    {"$ref": "#/components/schemas/Tensor"}]},
            **{n: {"$ref": "#/components/schemas/Tensor"} for n in ("q", "k", "v", "alibi_slopes")},
            "layer": {"type": "integer", "minimum": 0},
            "causal": {"type": "boolean"},
            "scale": {"type": "number"},
            "return_lse": {"type": "boolean"},
            "end": {"type": "boolean"},
            "window_size": {"$ref": "#/components/schemas/WindowSize"},
            "softcap": {"type": "number", "minimum": 0},
        },
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
            "datatype": {"type": "string", "enum": list(OIP_DTYPES)},
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
    str(s): {"description": d, **error_schema()}
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


# the score modifiers as query parameters (alibi_slopes is a tensor of the body: no query form)
MASK_QUERY = [
    {"name": "window_size", "in": "query", "schema": {"type": "string", "pattern": r"^\s*-?\d+\s*,\s*-?\d+\s*$"},
     "description": "sliding window \"L,R\" in keys (-1: unbounded; flash-attn's window_size)"},
    {"name": "softcap", "in": "query", "schema": {"type": "number", "minimum": 0},
     "description": "soft cap: scores become softcap·tanh(score/softcap); 0 is off"},
]

ATTENTION_OPENAPI = _body(
    "AttentionJSON",
    "AttentionJSONResult",
    [
        {"name": "causal", "in": "query", "schema": _BOOL_Q},
        {"name": "scale", "in": "query", "schema": {"type": "number"}},
        {"name": "layout", "in": "query", "schema": {"type": "string", "enum": list(LAYOUTS)}},
        {"name": "return_lse", "in": "query", "schema": _BOOL_Q},
        {"name": "kernel", "in": "query", "schema": {"type": "string", "enum": list(kernels.KERNELS)}},
        *MASK_QUERY,
    ],
)
LAYER_OPENAPI = _body("LayerJSON", "LayerJSONResult", [{"name": "causal", "in": "query", "schema": _BOOL_Q}])
_STEP_QUERY = [
    {"name": "layer", "in": "query", "schema": {"type": "integer", "minimum": 0}},
    {"name": "causal", "in": "query", "schema": _BOOL_Q},
    {"name": "scale", "in": "query", "schema": {"type": "number"}},
    {"name": "return_lse", "in": "query", "schema": _BOOL_Q},
    {"name": "end", "in": "query", "schema": _BOOL_Q},
    *MASK_QUERY,
]
SESSION_PARAMETER = {"name": "session", "in": "path", "required": True, "schema": {"type": "string"}}
STEP_OPENAPI = _body("SessionStepJSON", "AttentionJSONResult", [
    SESSION_PARAMETER, *_STEP_QUERY,
    {"name": "layout", "in": "query", "schema": {"type": "string", "enum": list(LAYOUTS)}}])
PACKED_STEP_OPENAPI = _body("PackedStepJSON", "AttentionJSONResult", [
    {"name": "sessions", "in": "query", "schema": {"type": "string"}, "description": "comma-separated ids"},
    {"name": "q_lengths", "in": "query", "schema": {"type": "string"}, "description": "comma-separated rows"},
    *_STEP_QUERY])
CREATE_SESSION_OPENAPI = {
    "requestBody": {"required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SessionCreate"}}}},
    "responses": ERRORS,
}


OIP_INFER_OPENAPI = {
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
            "description": "binary tensor data extension: length of the JSON part",
        }
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/OIPInferRequest"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "outputs (JSON, or JSON + binary tensor data)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OIPInferResponse"}}},
        },
        **{
            str(s): {"description": "error", **error_schema(v2=True)}
            for s in (400, 401, 404, 413, 422, 429, 503, 504)
        },
    },
}


def install_openapi(app: FastAPI) -> None:
    """The app's schema: FastAPI's from the routes, with SCHEMAS added; built on first use."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
