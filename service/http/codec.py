"""The native routes' wire format (docs/api.md#http-api) <-> the internal request/result types.

A request is a safetensors file (its tensors viewed in the body, not copied) or a JSON object
(``json_tensors``); options come from the query string, the file's ``__metadata__`` or the JSON
object, and are parsed by ``service.wire.options``. An answer goes back in the encoding its
request came in. No kernel, queue or shape logic here: shapes and dtypes are checked by the
engine/kernels (422); this module refuses what it cannot decode (400) and, before a layout
transpose, q/k/v that are not 4-D (422, ``check_dims``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from service.core.types import AttentionRequest, LayerRequest
from service.errors import BadRequest, UnsupportedMediaType
from service.http.body import offload
from service.http.json_tensors import encode_json, json_tensors, parse_json
from service.wire.options import parse_options
from service.wire.tensors import check_dims, kv_lengths_int32, parse_safetensors, safetensors_parts

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"

ATTENTION_OPTIONS = ("causal", "scale", "layout", "return_lse", "kernel", "window_size", "softcap")
LAYER_OPTIONS = ("causal",)
ATTENTION_TENSORS = ("q", "k", "v", "kv_lengths", "alibi_slopes")
LAYER_TENSORS = ("x", "positions", "kv_lengths")


def merge_options(allowed: tuple[str, ...], *sources: Mapping[str, Any]) -> dict[str, Any]:
    """Merge option sources (later ones win); an unknown name is a 400, so typos are not ignored."""
    merged: dict[str, Any] = {}
    for source in sources:
        for name, value in source.items():
            if name not in allowed:
                raise BadRequest(f"unknown option {name!r}; the options are {', '.join(allowed)}")
            merged[name] = value
    return merged


def query_options(query: Mapping[str, str]) -> dict[str, str]:
    """A query string's options; a name given twice is a 400 (which one was meant is a guess)."""
    items = query.multi_items() if hasattr(query, "multi_items") else query.items()
    out: dict[str, str] = {}
    for name, value in items:
        if name in out:
            raise BadRequest(f"option {name!r} is given twice in the query string; give it once")
        out[name] = value
    return out


def _require(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise BadRequest(f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)}")


def decode_tensors(
    body: bytearray,
    mtype: str,
    tensor_names: tuple[str, ...],
    options: tuple[str, ...],
    query: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """Body + query string -> (tensors, merged raw options (query wins), response encoding)."""
    q_opts = merge_options(options, query_options(query))
    if mtype == SAFETENSORS:
        tensors, metadata = parse_safetensors(body)
        unknown = set(tensors) - set(tensor_names)
        if unknown:
            raise BadRequest(
                f"unknown tensor {sorted(unknown)[0]!r}; the tensors are {', '.join(tensor_names)}"
            )
        return tensors, merge_options(options, metadata, q_opts), "safetensors"
    if mtype == JSON:
        tensors, body_opts, encoding = json_tensors(parse_json(body), tensor_names, options)
        return tensors, merge_options(options, body_opts, q_opts), encoding
    raise UnsupportedMediaType(
        f"unsupported Content-Type {mtype or '(none)'!r}; send {SAFETENSORS} or {JSON}"
    )


def decode_attention(
    body: bytearray, mtype: str, query: Mapping[str, str], *, request_id: str, deadline: float, arrived: float
) -> tuple[AttentionRequest, str]:
    tensors, raw, encoding = decode_tensors(body, mtype, ATTENTION_TENSORS, ATTENTION_OPTIONS, query)
    _require(tensors, ("q", "k", "v"))
    opts = parse_options(raw)
    layout = opts.pop("layout", "bhnd")
    check_dims(tensors, ("q", "k", "v"), 4, layout)
    req = AttentionRequest.from_layout(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        layout=layout,
        kv_lengths=kv_lengths_int32(tensors.get("kv_lengths")),
        alibi_slopes=tensors.get("alibi_slopes"),
        request_id=request_id,
        deadline=deadline,
        arrived=arrived,
        **opts,
    )
    return req, encoding


def decode_layer(
    name: str, body: bytearray, mtype: str, query: Mapping[str, str], *, request_id: str, deadline: float,
    arrived: float,
) -> tuple[LayerRequest, str]:
    tensors, raw, encoding = decode_tensors(body, mtype, LAYER_TENSORS, LAYER_OPTIONS, query)
    _require(tensors, ("x",))
    req = LayerRequest(
        layer=name,
        x=tensors["x"],
        causal=parse_options(raw).get("causal", False),
        positions=tensors.get("positions"),
        kv_lengths=kv_lengths_int32(tensors.get("kv_lengths")),
        request_id=request_id,
        deadline=deadline,
        arrived=arrived,
    )
    return req, encoding


async def encode_answer(
    tensors: Mapping[str, torch.Tensor], encoding: str, big: bool
) -> tuple[list[memoryview] | bytes, str]:
    """``encode_result``, in a thread when ``big`` and JSON: a safetensors answer is views of the
    tensors (no work worth a thread hand-off), a JSON one is printed number by number."""
    return await offload(big and encoding != "safetensors", encode_result, tensors, encoding)


def encode_result(tensors: Mapping[str, torch.Tensor], encoding: str) -> tuple[list[memoryview] | bytes, str]:
    """Result tensors -> (body, media type) in the encoding the request came in: safetensors as
    buffers to send one after another (``body.PartsResponse``), JSON as one document."""
    if encoding == "safetensors":
        return safetensors_parts(tensors), SAFETENSORS
    return encode_json(tensors, encoding), JSON
