"""The Open Inference Protocol's HTTP framing and routes (``/v2/...``, docs/api.md#open-inference-protocol), so that
``tritonclient.http`` works unchanged: JSON tensors and the binary tensor data extension
(``Inference-Header-Content-Length``, ``binary_data_size``, ``binary_data_output``).

Framing only: models, parameters, outputs and messages are ``service.wire.oip``'s. Errors here are
``{"error": "<message>"}`` (``errors.error_response`` picks that body for /v2).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

import orjson
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from service.errors import BadRequest, PayloadTooLarge, Unavailable, size_text
from service.http import body
from service.http.disconnect import unless_gone
from service.http.json_tensors import flat_tensor, parse_json
from service.http.openapi import OIP_INFER_OPENAPI
from service.sessions.routing import HOP_DEADLINE
from service.settings import Settings
from service.wire import oip
from service.wire.options import parse_bool
from service.wire.tensors import OIP_NAMES, tensor_parts

HEADER_LENGTH = "inference-header-content-length"
EXTENSIONS = ("binary_tensor_data",)

# ---------------------------------------------------------------- infer: decode


def _split_body(data: bytearray, header_length: str | None, json_limit: int) -> tuple[Any, memoryview]:
    """(JSON document, binary tensor data) of an infer request; 413 for a JSON part over
    ``json_limit`` (--max-json-mb), before it is parsed."""
    view = memoryview(data)
    n = len(data)
    if header_length is not None:
        n = int(header_length) if header_length.strip().isdigit() and header_length.isascii() else -1
        if not 0 <= n <= len(data):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length!r} does not fit the {len(data)}-byte body"
            )
    if n > json_limit:
        raise PayloadTooLarge(
            f"the JSON part of the request is {size_text(n)}, over the limit of {size_text(json_limit)} "
            "(--max-json-mb); send large tensors as binary tensor data"
        )
    doc = parse_json(view[:n], nonfinite=True)
    if not isinstance(doc, dict):
        raise BadRequest('the inference request must be a JSON object with "inputs"')
    return doc, view[n:]


def _object(value: Any, what: str) -> dict:
    value = value or {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be an object")
    return value


def _inputs(doc: dict, binary: memoryview, model: oip.Model) -> dict[str, torch.Tensor]:
    """The "inputs" of an infer request: JSON "data", or "binary_data_size" bytes of ``binary``."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise BadRequest('the inference request needs "inputs": a list of tensors')
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for item in inputs:
        if not isinstance(item, dict):
            raise BadRequest('each input needs a "name", a "shape" and a "datatype"')
        name = oip.check_input_name(model, item.get("name"), tensors)
        params = _object(item.get("parameters"), f"input {name!r}: parameters")
        oip.check_tensor_parameters(f"input {name!r}", params)
        if "binary_data_size" in params:
            if "data" in item:
                raise BadRequest(f"input {name!r} has both data and binary_data_size; send one of them")
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(binary):
                raise BadRequest(f"input {name!r}: binary_data_size {size} runs past the binary data "
                                 f"({len(binary) - offset} bytes left)")
            tensors[name] = oip.raw_tensor(name, item.get("datatype"), item.get("shape"),
                                           binary[offset : offset + size])  # fmt: skip
            offset += size
        elif "data" in item:
            shape = oip.input_shape(name, item.get("shape"))
            dtype = oip.input_dtype(name, item.get("datatype"))
            tensors[name] = flat_tensor(item["data"], shape, dtype, f"input {name!r}")
        else:
            raise BadRequest(f"input {name!r} has neither data nor binary_data_size")
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return tensors


def _requested(doc: dict, all_binary: bool) -> dict[str, bool] | None:
    """The "outputs" asked for: name -> send as binary? (None: the model's default outputs, as for
    an empty list)."""
    outputs = doc.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise BadRequest("outputs must be a list of {name, parameters}")
    if not outputs:
        return None
    wanted: dict[str, bool] = {}
    for out in outputs:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise BadRequest("each output needs a \"name\"")
        p = _object(out.get("parameters"), "output parameters")
        oip.check_tensor_parameters(f"output {out['name']!r}", p)
        wanted[out["name"]] = parse_bool("binary_data", p.get("binary_data", all_binary), "parameter")
    return wanted


def decode(
    model: oip.Model, doc: dict, binary: memoryview, *, request_id: str, deadline: float, arrived: float
) -> tuple[oip.Call, dict[str, bool]]:
    """An infer request -> (the call, output name -> send as binary?)."""
    tensors = _inputs(doc, binary, model)
    params = _object(doc.get("parameters"), "parameters")
    all_binary = parse_bool("binary_data_output", params.get("binary_data_output", False), "parameter")
    requested = _requested(doc, all_binary)
    call = oip.build_call(model, tensors, params, None if requested is None else list(requested),
                          request_id=request_id, deadline=deadline, arrived=arrived)  # fmt: skip
    return call, {n: all_binary if requested is None else requested[n] for n in call.outputs}


# ---------------------------------------------------------------- infer: encode


def encode_response(
    model: str, doc: dict, outputs: Mapping[str, torch.Tensor], wanted: dict[str, bool]
) -> tuple[bytes | list[memoryview], dict[str, str]]:
    """(body, headers): JSON, followed by the binary outputs when any is asked for as binary (then
    as buffers to send in turn: the JSON header, each output's own bytes)."""
    entries, blobs = [], []
    finite = True
    for name, t in outputs.items():
        t = t.detach().to("cpu").contiguous()
        entry: dict[str, Any] = {"name": name, "datatype": OIP_NAMES[t.dtype], "shape": list(t.shape)}
        if wanted[name]:
            entry["parameters"] = {"binary_data_size": t.numel() * t.element_size()}
            blobs.append(t)
        else:  # JSON numbers (BF16 too)
            entry["data"] = (t.float() if t.dtype.is_floating_point else t).reshape(-1).numpy()
            finite = finite and (not t.dtype.is_floating_point or bool(torch.isfinite(t).all()))
        entries.append(entry)
    resp: dict[str, Any] = {"model_name": model, "model_version": oip.VERSION, "outputs": entries}
    if "id" in doc:
        resp["id"] = doc["id"]
    if finite:
        head = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    else:  # NaN, Infinity, -Infinity as Triton writes them (orjson would write null, read back as NaN)
        for entry in entries:
            if "data" in entry:
                entry["data"] = entry["data"].tolist()
        head = json.dumps(resp, separators=(",", ":"), allow_nan=True).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return tensor_parts(head, blobs), {  # the tensors' bytes are sent from their own memory
        "content-type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }


# ---------------------------------------------------------------- routes


def _refusal(feature: str):
    """A route's endpoint refusing Triton's ``feature`` extension (501)."""

    async def unsupported() -> None:
        raise oip.unsupported_extension(feature)

    return unsupported


def create_router(engine: Any, settings: Settings) -> APIRouter:
    router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])

    def ready() -> None:
        if not engine.ready:
            raise Unavailable(oip.NOT_READY)

    def find(request: Request) -> oip.Model:  # the path's model (and version, on .../versions/{v}/...)
        return oip.find_model(engine, request.path_params["model"], request.path_params.get("version", ""))

    @router.get("", summary="server metadata")
    async def server_metadata() -> dict:
        return oip.server_metadata(EXTENSIONS)

    @router.api_route("/health/live", methods=["GET", "HEAD"], summary="server live")
    async def live() -> dict:
        return {"live": True}

    @router.api_route("/health/ready", methods=["GET", "HEAD"], summary="server ready")
    async def server_ready() -> dict:
        ready()
        return {"ready": True}

    # Triton's extensions the server lacks: a 501 that says so, not a 404 "no route" (and "stats"
    # is no model: these come before /models/{model})
    for path, feature, methods in (
        ("/models/stats", "statistics", ["GET"]),
        ("/models/{model}/stats", "statistics", ["GET"]),
        ("/models/{model}/versions/{version}/stats", "statistics", ["GET"]),
        ("/repository/index", "model repository", ["POST"]),
        ("/repository/models/{model}/{action}", "model repository", ["POST"]),
        ("/trace/setting", "trace", ["GET", "POST"]),
        ("/models/{model}/trace/setting", "trace", ["GET", "POST"]),
        ("/logging", "logging", ["GET", "POST"]),
        ("/systemsharedmemory/{rest:path}", "system shared memory", ["GET", "POST"]),
        ("/cudasharedmemory/{rest:path}", "CUDA shared memory", ["GET", "POST"]),
    ):
        router.add_api_route(path, _refusal(feature), methods=methods, include_in_schema=False)

    @router.get("/models/{model}", summary="model metadata")
    @router.get("/models/{model}/versions/{version}", include_in_schema=False)
    async def model_metadata(model: str, request: Request) -> dict:
        return find(request).metadata()

    @router.get("/models/{model}/config", summary="model configuration (Triton's extension)")
    @router.get("/models/{model}/versions/{version}/config", include_in_schema=False)
    async def model_config(model: str, request: Request) -> dict:
        return find(request).config()

    @router.get("/models/{model}/ready", summary="model ready")
    @router.get("/models/{model}/versions/{version}/ready", include_in_schema=False)
    async def model_ready(model: str, request: Request) -> dict:
        find(request)
        ready()
        return {"name": model, "ready": True}

    @router.post(
        "/models/{model}/infer",
        summary="inference (JSON or binary tensor data)",
        openapi_extra=OIP_INFER_OPENAPI,
        response_class=Response,
    )
    @router.post("/models/{model}/versions/{version}/infer", include_in_schema=False, response_class=Response)
    async def infer(model: str, request: Request) -> Response:
        arrived = time.monotonic()
        deadline = body.deadline_from(request.headers.get("x-request-timeout-ms"), settings, arrived,
                                      request.headers.get(HOP_DEADLINE))
        spec = find(request)
        data = await body.read_body(request, settings.max_body_bytes)
        json_bytes = len(data)  # the JSON part: all of it, unless binary tensor data follows it
        with contextlib.suppress(TypeError, ValueError):  # a bad header: _split_body answers it
            json_bytes = min(json_bytes, int(request.headers.get(HEADER_LENGTH)))
        big = body.worth_offloading(len(data), json_bytes)
        doc, binary = await body.offload(
            big, _split_body, data, request.headers.get(HEADER_LENGTH), settings.max_json_bytes
        )
        if not isinstance(doc.get("id", ""), str):  # echoed as sent: the protocol's id is a string
            raise BadRequest(f'"id" must be a string, got {type(doc["id"]).__name__}')
        rid = oip.call_id(doc.get("id"), request.state.request_id)
        call, wanted = await body.offload(
            big, lambda: decode(spec, doc, binary, request_id=rid, deadline=deadline, arrived=arrived)
        )
        outputs = await unless_gone(request, oip.infer(engine, call))
        content, headers = await body.offload(big, encode_response, model, doc, outputs, wanted)
        return body.respond(content, None, headers)

    return router
