"""HTTP wire format <-> the internal request/result types, for the native routes (``http_app``) and
the Open Inference Protocol routes (``http_oip``). No kernel, queue or shape logic here: shapes and
dtypes are checked by the engine/kernels (422); this module refuses what it cannot decode (400) and,
before a layout transpose, q/k/v that are not 4-D (422, ``check_dims``).

Encodings of a tensor (API.md §2):
    safetensors   the body is a safetensors file; parsed without copying the tensor bytes
    list          JSON nested lists of numbers
    flat          JSON {"shape": [...], "dtype": "...", "data": [flat numbers]}
    base64        JSON {"shape": [...], "dtype": "...", "data": "<base64 of little-endian bytes>"}
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson
import torch
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

import kernels
from service.core.types import LAYOUTS, AttentionRequest, LayerRequest
from service.errors import BadRequest, InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.settings import Settings
from service.wire.numbers import check_numbers
from service.wire.tensors import (  # the safetensors format lives in codec: the client uses it too
    DTYPE_NAMES,
    MAX_DIMS,
    aligned,
    check_shape,
    dtype_from_name,
    parse_safetensors,
    safetensors_parts,
    tensor_from_bytes,
    tensor_to_bytes,
)

T = TypeVar("T")

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"

ATTENTION_OPTIONS = ("causal", "scale", "layout", "return_lse", "kernel")
LAYER_OPTIONS = ("causal",)
ATTENTION_TENSORS = ("q", "k", "v", "kv_lengths")
LAYER_TENSORS = ("x", "positions", "kv_lengths")
INT_TENSORS = ("kv_lengths", "positions")  # nested lists of these are integers

MAX_JSON_ELEMENTS = 1 << 27  # numbers in one JSON tensor
# Decoding/encoding goes to a thread (off the event loop) only when it costs more than the two
# thread hand-offs (~0.1-0.3 ms on the H200 host): JSON is parsed and printed number by number,
# binary tensors (safetensors, OIP binary data) are views or plain copies (~10 GB/s).
OFFLOAD_JSON_BYTES = 1 << 18
OFFLOAD_BINARY_BYTES = 16 << 20

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


# ---------------------------------------------------------------- body, deadline, engine call


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def read_body(request: Request, limit: int, flag: str = "--max-body-mb") -> bytearray | memoryview:
    """The request body, read chunk by chunk; 413 as soon as it passes ``limit`` bytes.

    The buffer grows with the bytes that actually arrive (not with what Content-Length claims), so
    a client that declares a large body and sends none of it holds no memory; growing a large
    bytearray is a ``realloc`` the allocator does in place (mremap), as cheap as preallocating.
    A body the server's protocol read whole (``http_protocol``: 1 MiB or more, with a
    Content-Length) comes as one piece, handed over as it is; its buffer was sized by the
    Content-Length, but ordinary memory is only touched as bytes arrive, and pinned buffers are
    bounded by ``--pinned-body-mb``.
    """
    too_large = PayloadTooLarge(
        f"the request body is over the limit of {limit / 2**20:g} MiB ({flag})"
        + ("; send large tensors as application/x-safetensors" if flag == "--max-json-mb" else "")
    )
    declared = request.headers.get("content-length")
    expected: int | None = None
    if declared is not None:
        try:
            expected = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not an integer") from None
        if expected > limit:
            raise too_large
    buf = bytearray()
    try:
        async for chunk in request.stream():
            if not chunk:  # Starlette ends the stream with b""
                continue
            end = len(buf) + len(chunk)
            if end > limit:
                raise too_large
            if expected is not None and end > expected:
                raise BadRequest("the body is longer than its Content-Length")
            if not buf and type(chunk) in (bytearray, memoryview):  # handed over, ours now (http_protocol)
                buf = chunk
            else:
                buf += chunk
    except ClientDisconnect:
        raise BadRequest("the client disconnected before sending the whole body") from None
    if expected is not None and len(buf) != expected:
        raise BadRequest(f"the body has {len(buf)} bytes, its Content-Length says {expected}")
    return buf


def deadline_from(header: str | None, settings: Settings, arrived: float) -> float:
    """``X-Request-Timeout-Ms`` (else ``--request-timeout-ms``) -> a ``time.monotonic()`` deadline."""
    ms: float = settings.request_timeout_ms
    if header is not None:
        try:
            ms = float(header)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms >= 0):
            raise BadRequest(
                f"X-Request-Timeout-Ms must be a non-negative number of milliseconds, got {header!r}"
            )
    return arrived + ms / 1000.0


def worth_offloading(body_bytes: int, json_bytes: int) -> bool:
    """Whether a body of ``body_bytes``, ``json_bytes`` of them JSON, is decoded (and its answer
    encoded) in a thread: JSON over OFFLOAD_JSON_BYTES, or any body over OFFLOAD_BINARY_BYTES."""
    return json_bytes > OFFLOAD_JSON_BYTES or body_bytes > OFFLOAD_BINARY_BYTES


async def offload(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """Run CPU-heavy decoding/encoding in a thread when the payload is big, inline otherwise."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


# ---------------------------------------------------------------- options


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
    raise BadRequest(f"option {name!r} must be a boolean (true/false), got {value!r}")


def parse_scale(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if isinstance(value, bool):
        raise BadRequest(f"option 'scale' must be a number, got {value!r}")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"option 'scale' must be a number, got {value!r}") from None
    if not math.isfinite(scale):
        raise BadRequest(f"option 'scale' must be finite, got {value!r}")
    return scale


def parse_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise BadRequest(f"option {name!r} must be one of {', '.join(choices)}; got {value!r}")
    return value


def attention_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Raw option values (query strings, metadata strings, JSON values) -> AttentionRequest kwargs."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in ("causal", "return_lse"):
            out[name] = parse_bool(name, value)
        elif name == "scale":
            out[name] = parse_scale(value)
        elif name == "layout":
            out[name] = parse_choice(name, value, LAYOUTS)
        elif name == "kernel":
            out[name] = parse_choice(name, value, kernels.KERNELS)
    return out


def merge_options(allowed: tuple[str, ...], *sources: Mapping[str, Any]) -> dict[str, Any]:
    """Merge option sources (later ones win); an unknown name is a 400, so typos are not ignored."""
    merged: dict[str, Any] = {}
    for source in sources:
        for name, value in source.items():
            if name not in allowed:
                raise BadRequest(f"unknown option {name!r}; the options are {', '.join(allowed)}")
            merged[name] = value
    return merged


# ---------------------------------------------------------------- safetensors


class PartsResponse(Response):
    """A response whose body is sent as several buffers, never joined: a tensor's bytes go from
    its own memory to the socket (the event loop keeps a view of what the socket has not taken).
    Joining a 64 MiB answer into one buffer took 17-19 ms on the H200 host (2026-11-30)."""

    def __init__(self, parts: Sequence[memoryview | bytes], media_type: str | None, headers: Mapping[str, str]):
        self.parts = [p for p in parts if len(p)]
        length = sum(len(p) for p in self.parts)
        super().__init__(b"", media_type=media_type, headers={**headers, "content-length": str(length)})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts or [b""]):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


def respond(
    body: Sequence[memoryview] | bytes | memoryview, media_type: str | None, headers: Mapping[str, str]
) -> Response:
    """A response for ``encode_result``'s body: buffers to send in turn, or one document."""
    if isinstance(body, list):
        return PartsResponse(body, media_type, headers)
    return Response(body, media_type=media_type, headers=dict(headers))


# ---------------------------------------------------------------- JSON tensors


def _nested_shape(value: Any, name: str) -> list[int]:
    """Shape of a nested list read along its first elements (torch checks that it is rectangular)."""
    shape: list[int] = []
    while isinstance(value, list):
        shape.append(len(value))
        if len(shape) > MAX_DIMS:
            raise BadRequest(f"{name}: nested lists deeper than {MAX_DIMS} dims")
        if not value:
            break
        value = value[0]
    return shape


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def json_tensor(value: Any, name: str, default_dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """One JSON tensor (nested list, or {"shape","dtype","data"}) -> (tensor, its encoding)."""
    if isinstance(value, list):
        shape = _nested_shape(value, name)
        if _numel(shape) > MAX_JSON_ELEMENTS:
            raise PayloadTooLarge(f"{name}: more than {MAX_JSON_ELEMENTS} numbers in one JSON tensor")
        return _list_to_tensor(value, name, default_dtype), "list"
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a nested list of numbers or an object {{shape, dtype, data}}")
    unknown = set(value) - {"shape", "dtype", "data"}
    if unknown or "shape" not in value or "data" not in value:
        raise BadRequest(f"{name}: a tensor object has exactly the keys shape, dtype (optional), data")
    shape = check_shape(value["shape"], name)
    dtype_name = value.get("dtype")
    if dtype_name is not None and not isinstance(dtype_name, str):
        raise BadRequest(f"{name}: dtype must be a string such as 'float16'")
    dtype = default_dtype if dtype_name is None else dtype_from_name(dtype_name)
    data = value["data"]
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{name}: data is not valid base64") from None
        return aligned(tensor_from_bytes(raw, shape, dtype, name)), "base64"
    if isinstance(data, list):
        numel = _numel(shape)
        if numel > MAX_JSON_ELEMENTS:
            raise PayloadTooLarge(f"{name}: more than {MAX_JSON_ELEMENTS} numbers in one JSON tensor")
        if len(data) != numel:
            raise BadRequest(f"{name}: {len(data)} numbers in data do not match shape {shape} ({numel})")
        t = _list_to_tensor(data, name, dtype)
        if t.dim() != 1:
            raise BadRequest(f"{name}: data must be a flat list of numbers (row-major), not nested lists")
        return t.reshape(shape), "flat"
    raise BadRequest(f"{name}: data must be a flat list of numbers or a base64 string")


def _list_to_tensor(data: list, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Nested list -> tensor of ``dtype``. Integer tensors take integers only, within ``dtype``'s
    range (no silent truncation of 1.5 or wrap-around of 2**40 into int32)."""
    check_numbers(data, name)  # torch would take true/false as 1/0
    try:
        if dtype.is_floating_point:
            return torch.tensor(data, dtype=torch.float32).to(dtype)
        t = torch.tensor(data)  # int64 when every number is an integer
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise BadRequest(f"{name}: not a rectangular list of numbers ({exc})") from None
    if t.numel() == 0:
        return t.to(dtype)
    if t.is_floating_point():  # 3.0 is fine, 1.5 is not
        t = torch.tensor(data, dtype=torch.float64)
        if not bool((t == t.trunc()).all()):
            raise BadRequest(f"{name}: must hold integers, got a number with a fraction")
    info = torch.iinfo(dtype)
    if int(t.min()) < info.min or int(t.max()) > info.max:
        raise BadRequest(f"{name}: numbers outside the range of {DTYPE_NAMES.get(dtype, dtype)}")
    return t.to(dtype)


def json_tensors(
    doc: Any, tensor_names: tuple[str, ...], options: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """A JSON request object -> (tensors, raw options, encoding of the first tensor)."""
    if not isinstance(doc, dict):
        raise BadRequest('the JSON body must be an object such as {"q": ..., "k": ..., "v": ...}')
    tensors: dict[str, torch.Tensor] = {}
    raw_options: dict[str, Any] = {}
    encoding = "list"
    for key, value in doc.items():
        if key in tensor_names:
            if value is None:
                continue
            default = torch.int64 if key in INT_TENSORS else torch.float32
            tensors[key], enc = json_tensor(value, key, default)
            if key == tensor_names[0]:
                encoding = enc
        elif key in options:
            raw_options[key] = value
        else:
            raise BadRequest(f"unknown field {key!r}; the fields are {', '.join(tensor_names + options)}")
    return tensors, raw_options, encoding


def parse_json(body: bytes | bytearray | memoryview) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


def encode_json_tensor(t: torch.Tensor, encoding: str) -> Any:
    """A result tensor in the request's JSON encoding (orjson writes -inf/nan as null)."""
    t = t.detach().to("cpu").contiguous()
    if encoding == "base64":
        return {
            "shape": list(t.shape),
            "dtype": DTYPE_NAMES[t.dtype],
            "data": base64.b64encode(tensor_to_bytes(t)).decode("ascii"),
        }
    arr = (t.float() if t.dtype.is_floating_point else t).numpy()
    if encoding == "flat":
        return {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "data": arr.reshape(-1)}
    return arr


def encode_json(tensors: Mapping[str, torch.Tensor], encoding: str) -> bytes:
    return orjson.dumps(
        {k: encode_json_tensor(t, encoding) for k, t in tensors.items()}, option=orjson.OPT_SERIALIZE_NUMPY
    )


# ---------------------------------------------------------------- native requests


def _require(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise BadRequest(f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)}")


def check_dims(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], ndim: int, layout: str) -> None:
    for n in names:
        if tensors[n].dim() != ndim:
            dims = "[B, N, H, D]" if layout == "bnhd" else "[B, H, N, D]"
            raise InvalidInput(f"{n} must have {ndim} dims {dims}, got shape {list(tensors[n].shape)}")


def kv_lengths_int32(t: torch.Tensor | None) -> torch.Tensor | None:
    """kv_lengths arrive int32 or int64; the request carries int32 (the kernels check the range)."""
    if t is None or t.dtype != torch.int64 or t.numel() == 0:
        return t
    if int(t.min()) < -(2**31) or int(t.max()) >= 2**31:  # not t.abs(): abs(-2**63) overflows
        return t
    return t.to(torch.int32)


def decode_tensors(
    body: bytearray,
    mtype: str,
    tensor_names: tuple[str, ...],
    options: tuple[str, ...],
    query: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """Body + query string -> (tensors, merged raw options (query wins), response encoding)."""
    q_opts = merge_options(options, dict(query))
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
    opts = attention_options(raw)
    layout = opts.pop("layout", "bhnd")
    check_dims(tensors, ("q", "k", "v"), 4, layout)
    req = AttentionRequest.from_layout(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        layout=layout,
        kv_lengths=kv_lengths_int32(tensors.get("kv_lengths")),
        request_id=request_id,
        deadline=deadline,
        arrived=arrived,
        **opts,
    )
    return req, encoding


def decode_layer(
    name: str,
    body: bytearray,
    mtype: str,
    query: Mapping[str, str],
    *,
    request_id: str,
    deadline: float,
    arrived: float,
) -> tuple[LayerRequest, str]:
    tensors, raw, encoding = decode_tensors(body, mtype, LAYER_TENSORS, LAYER_OPTIONS, query)
    _require(tensors, ("x",))
    causal = parse_bool("causal", raw["causal"]) if "causal" in raw else False
    req = LayerRequest(
        layer=name,
        x=tensors["x"],
        causal=causal,
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
    buffers to send one after another (``PartsResponse``), JSON as one document."""
    if encoding == "safetensors":
        return safetensors_parts(tensors), SAFETENSORS
    return encode_json(tensors, encoding), JSON
