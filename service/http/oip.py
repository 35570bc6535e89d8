"""Open Inference Protocol (KServe v2) over HTTP, so that ``tritonclient.http`` works unchanged
(API.md §6): JSON tensors and the binary tensor data extension.

Models: ``attention`` (q, k, v [B, H, N, D] FP16/BF16/FP32, optional kv_lengths INT32 [B]; parameters
causal, scale, return_lse; outputs o, lse) and one model per loaded layer (x [+ positions] -> y).
Errors here are ``{"error": "<message>"}`` (``http_app.error_response`` picks that body for /v2).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import orjson
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.core.types import AttentionRequest, LayerRequest
from service.errors import BadRequest, NotFound, PayloadTooLarge, Unavailable
from service.http import codec
from service.http.disconnect import unless_gone
from service.settings import Settings
from service.wire.numbers import check_numbers
from service.wire.tensors import (
    OIP_DTYPES,
    OIP_NAMES,
    aligned,
    check_shape,
    dtype_from_name,
    tensor_from_bytes,
    tensor_parts,
)

ATTENTION = "attention"
HEADER_LENGTH = "inference-header-content-length"
ANY4 = [-1, -1, -1, -1]


def _oip_openapi() -> dict:
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OIPError"}}}}
    return {
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
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/OIPInferResponse"}}
                },
            },
            **{str(s): {"description": "error", **err} for s in (400, 401, 404, 413, 422, 429, 503, 504)},
        },
    }


def _model_metadata(name: str, engine: Any) -> dict:
    if name == ATTENTION:
        return {
            "name": ATTENTION,
            "versions": ["1"],
            "platform": "attnserve",
            "inputs": [{"name": n, "datatype": "FP16", "shape": ANY4} for n in ("q", "k", "v")]
            + [{"name": "kv_lengths", "datatype": "INT32", "shape": [-1]}],
            "outputs": [
                {"name": "o", "datatype": "FP16", "shape": ANY4},
                {"name": "lse", "datatype": "FP32", "shape": [-1, -1, -1]},
            ],
            "parameters": {
                "causal": "bool",
                "scale": "float",
                "return_lse": "bool",
                "datatypes": "q, k, v: FP16, BF16 or FP32 (o follows q)",
            },
        }
    info = next((i for i in engine.layer_infos() if i.name == name), None)
    if info is None:
        raise NotFound(f"unknown model {name!r}; the models are {', '.join(_model_names(engine))}")
    dt = OIP_NAMES.get(info.dtype, "FP32")
    return {
        "name": name,
        "versions": ["1"],
        "platform": f"attnserve-{info.family}",
        "inputs": [
            {"name": "x", "datatype": dt, "shape": [-1, -1, info.hidden_size]},
            {"name": "positions", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "kv_lengths", "datatype": "INT32", "shape": [-1]},
        ],
        "outputs": [{"name": "y", "datatype": dt, "shape": [-1, -1, info.hidden_size]}],
        "parameters": {"causal": "bool"},
    }


def _model_config(name: str, engine: Any) -> dict:
    """Triton's model configuration (``GET /v2/models/{m}/config``, read by perf_analyzer)."""
    meta = _model_metadata(name, engine)

    def tensors(items: list[dict]) -> list[dict]:
        return [{"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": t["shape"],
                 "optional": t["name"] in ("kv_lengths", "positions")} for t in items]  # fmt: skip

    return {"name": name, "platform": meta["platform"], "max_batch_size": 0,
            "input": tensors(meta["inputs"]), "output": tensors(meta["outputs"])}  # fmt: skip


def _model_names(engine: Any) -> list[str]:
    return [ATTENTION, *(i.name for i in engine.layer_infos())]


# ---------------------------------------------------------------- infer: decode


def _split_body(body: bytearray, header_length: str | None, json_limit: int) -> tuple[Any, memoryview]:
    """(JSON document, binary tensor data) of an infer request; 413 for a JSON part over
    ``json_limit`` (--max-json-mb), before it is parsed."""
    view = memoryview(body)
    n = len(body)
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length!r} does not fit the {len(body)}-byte body"
            )
    if n > json_limit:
        raise PayloadTooLarge(
            f"the JSON part of the request is {n / 2**20:.1f} MiB, over the limit of {json_limit / 2**20:g} MiB "
            "(--max-json-mb); send large tensors as binary tensor data"
        )
    doc = codec.parse_json(view[:n])
    if not isinstance(doc, dict):
        raise BadRequest('the inference request must be a JSON object with "inputs"')
    return doc, view[n:]


def _decode_inputs(doc: dict, binary: memoryview, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The "inputs" of an infer request; a name not in ``names``, or given twice, is a 400 (as
    Triton refuses an unexpected input: only unknown *parameters* are ignored)."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise BadRequest('the inference request needs "inputs": a list of tensors')
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for item in inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest('each input needs a "name", a "shape" and a "datatype"')
        name = item["name"]
        if name not in names or name in tensors:
            what = "given twice" if name in tensors else f"unknown; the inputs are {', '.join(names)}"
            raise BadRequest(f"input {name!r}: {what}")
        shape = check_shape(item.get("shape"), f"input {name!r}")
        datatype = item.get("datatype")
        if not isinstance(datatype, str):
            raise BadRequest(f"input {name!r}: datatype must be one of {', '.join(OIP_DTYPES)}")
        dtype = dtype_from_name(datatype, OIP_DTYPES)
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest(f"input {name!r}: parameters must be an object")
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise BadRequest(f"input {name!r}: binary_data_size {size!r} runs past the binary data")
            t = tensor_from_bytes(binary[offset : offset + size], shape, dtype, name)
            tensors[name] = aligned(t)
            offset += size
        elif "data" in item:
            data = item["data"]
            if not isinstance(data, list):
                raise BadRequest(f"input {name!r}: data must be a list of numbers")
            tensors[name], _ = codec.json_tensor({"shape": shape, "data": _flatten(data, name)}, name, dtype)
        else:
            raise BadRequest(f"input {name!r} has neither data nor binary_data_size")
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return tensors


def _flatten(data: list, name: str) -> list:
    """OIP JSON data is flat row-major; nested lists are accepted too (as Triton does)."""
    check_numbers(data, f"input {name!r}: data")  # before torch takes true/false as 1/0
    if not data or not isinstance(data[0], list):
        return data
    try:
        return torch.tensor(data, dtype=torch.float64).reshape(-1).tolist()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BadRequest(f"input {name!r}: not a rectangular list of numbers ({exc})") from None


def _outputs_wanted(doc: dict, allowed: tuple[str, ...], default: list[str]) -> dict[str, bool]:
    """Output name -> send as binary?  From "outputs" (or the default) and binary_data_output."""
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("parameters must be an object")
    all_binary = codec.parse_bool("binary_data_output", params.get("binary_data_output", False))
    outputs = doc.get("outputs")
    if outputs is None:
        return {n: all_binary for n in default}
    if not isinstance(outputs, list):
        raise BadRequest("outputs must be a list of {name, parameters}")
    wanted: dict[str, bool] = {}
    for out in outputs:
        if not isinstance(out, dict) or out.get("name") not in allowed:
            raise BadRequest(
                f"unknown output {out.get('name') if isinstance(out, dict) else out!r}; "
                f"the outputs are {', '.join(allowed)}"
            )
        p = out.get("parameters") or {}
        if not isinstance(p, dict):
            raise BadRequest("output parameters must be an object")
        wanted[out["name"]] = codec.parse_bool("binary_data", p.get("binary_data", all_binary))
    return wanted


def _params(doc: dict, names: tuple[str, ...]) -> dict[str, Any]:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("parameters must be an object")
    return {k: v for k, v in params.items() if k in names}  # unknown parameters are ignored (§6)


def decode_attention(
    model_doc: dict, binary: memoryview, *, request_id: str, deadline: float, arrived: float
) -> tuple[AttentionRequest, dict[str, bool]]:
    tensors = _decode_inputs(model_doc, binary, codec.ATTENTION_TENSORS)
    missing = [n for n in ("q", "k", "v") if n not in tensors]
    if missing:
        raise BadRequest(f"missing input{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    opts = codec.attention_options(_params(model_doc, ("causal", "scale", "return_lse", "kernel")))
    wanted = _outputs_wanted(model_doc, ("o", "lse"), ["o", "lse"] if opts.get("return_lse") else ["o"])
    opts["return_lse"] = "lse" in wanted
    codec.check_dims(tensors, ("q", "k", "v"), 4, "bhnd")
    req = AttentionRequest(
        q=tensors["q"],
        k=tensors["k"],
        v=tensors["v"],
        kv_lengths=codec.kv_lengths_int32(tensors.get("kv_lengths")),
        request_id=request_id,
        deadline=deadline,
        arrived=arrived,
        **opts,
    )
    return req, wanted


def decode_layer(
    model: str, doc: dict, binary: memoryview, *, request_id: str, deadline: float, arrived: float
) -> tuple[LayerRequest, dict[str, bool]]:
    tensors = _decode_inputs(doc, binary, codec.LAYER_TENSORS)
    if "x" not in tensors:
        raise BadRequest("missing input x")
    params = _params(doc, ("causal",))
    causal = codec.parse_bool("causal", params["causal"]) if "causal" in params else False
    req = LayerRequest(
        layer=model,
        x=tensors["x"],
        causal=causal,
        positions=tensors.get("positions"),
        kv_lengths=codec.kv_lengths_int32(tensors.get("kv_lengths")),
        request_id=request_id,
        deadline=deadline,
        arrived=arrived,
    )
    return req, _outputs_wanted(doc, ("y",), ["y"])


# ---------------------------------------------------------------- infer: encode


def encode_response(
    model: str, doc: dict, outputs: Mapping[str, torch.Tensor], wanted: dict[str, bool]
) -> tuple[bytes | list[memoryview], dict[str, str]]:
    """(body, headers): JSON, followed by the binary outputs when any is asked for as binary (then
    as buffers to send in turn: the JSON header, each output's own bytes)."""
    entries, blobs = [], []
    for name, binary in wanted.items():
        t = outputs[name].detach().to("cpu").contiguous()
        entry: dict[str, Any] = {"name": name, "datatype": OIP_NAMES[t.dtype], "shape": list(t.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": t.numel() * t.element_size()}
            blobs.append(t)
        else:  # JSON numbers (BF16 too); -inf/nan become null
            entry["data"] = (t.float() if t.dtype.is_floating_point else t).reshape(-1).numpy()
        entries.append(entry)
    resp: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": entries}
    if "id" in doc:
        resp["id"] = doc["id"]
    head = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, {"content-type": "application/json"}
    return tensor_parts(head, blobs), {  # the tensors' bytes are sent from their own memory
        "content-type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }


# ---------------------------------------------------------------- routes


def create_router(engine: Any, settings: Settings) -> APIRouter:
    router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])
    limit = settings.max_body_bytes

    def known(model: str) -> None:
        if model != ATTENTION and all(i.name != model for i in engine.layer_infos()):
            raise NotFound(f"unknown model {model!r}; the models are {', '.join(_model_names(engine))}")

    @router.get("", summary="server metadata")
    async def server_metadata() -> dict:
        return {"name": "attnserve", "version": "0.1.0", "extensions": ["binary_tensor_data"]}

    @router.get("/health/live", summary="server live")
    async def live() -> dict:
        return {"live": True}

    @router.get("/health/ready", summary="server ready")
    async def ready() -> dict:
        if not engine.ready:
            raise Unavailable("not ready: warming up or draining")
        return {"ready": True}

    @router.get("/models/{model}", summary="model metadata")
    @router.get("/models/{model}/versions/{version}", include_in_schema=False)
    async def model_metadata(model: str) -> dict:
        return _model_metadata(model, engine)

    @router.get("/models/{model}/config", summary="model configuration (Triton's extension)")
    @router.get("/models/{model}/versions/{version}/config", include_in_schema=False)
    async def model_config(model: str) -> dict:
        return _model_config(model, engine)

    @router.get("/models/{model}/ready", summary="model ready")
    @router.get("/models/{model}/versions/{version}/ready", include_in_schema=False)
    async def model_ready(model: str) -> dict:
        known(model)
        if not engine.ready:
            raise Unavailable("not ready: warming up or draining")
        return {"name": model, "ready": True}

    @router.post(
        "/models/{model}/infer",
        summary="inference (JSON or binary tensor data)",
        openapi_extra=_oip_openapi(),
        response_class=Response,
    )
    @router.post("/models/{model}/versions/{version}/infer", include_in_schema=False, response_class=Response)
    async def infer(model: str, request: Request) -> Response:
        arrived = time.monotonic()
        deadline = codec.deadline_from(request.headers.get("x-request-timeout-ms"), settings, arrived)
        known(model)
        if request.headers.get("content-encoding", "identity").lower() != "identity":
            raise codec.UnsupportedMediaType("compressed requests are not supported; send them uncompressed")
        body = await codec.read_body(request, limit)
        json_bytes = len(body)  # the JSON part: all of it, unless binary tensor data follows it
        with contextlib.suppress(TypeError, ValueError):  # a bad header: _split_body answers it
            json_bytes = min(json_bytes, int(request.headers.get(HEADER_LENGTH)))
        big = codec.worth_offloading(len(body), json_bytes)
        doc, binary = await codec.offload(
            big, _split_body, body, request.headers.get(HEADER_LENGTH), settings.max_json_bytes
        )
        oip_id = doc.get("id")  # cut to 128 characters, as X-Request-Id is (it reaches logs and messages)
        rid = oip_id[:128] if isinstance(oip_id, str) and oip_id else request.state.request_id
        if model == ATTENTION:
            req, wanted = await codec.offload(
                big, lambda: decode_attention(doc, binary, request_id=rid, deadline=deadline, arrived=arrived)
            )
            result = await unless_gone(request, engine.attend(req))
            outputs = {"o": result.o, "lse": result.lse}
        else:
            req, wanted = await codec.offload(
                big,
                lambda: decode_layer(model, doc, binary, request_id=rid, deadline=deadline, arrived=arrived),
            )
            result = await unless_gone(request, engine.call_layer(req))
            outputs = {"y": result.y}
        content, headers = await codec.offload(big, encode_response, model, doc, outputs, wanted)
        return codec.respond(content, None, headers)

    return router
