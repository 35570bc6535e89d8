"""Tensors in JSON (docs/api.md#http-api), both directions, for the native routes and the Open Inference
Protocol's JSON data. Refuses what it cannot decode (400) or what is too big to parse (413).

Encodings of a JSON tensor:
    list          nested lists of numbers
    flat          {"shape": [...], "dtype": "...", "data": [flat numbers]}
    base64        {"shape": [...], "dtype": "...", "data": "<base64 of little-endian bytes>"}
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import orjson
import torch

from service.errors import BadRequest, PayloadTooLarge
from service.wire.numbers import check_numbers
from service.wire.tensors import (
    DTYPE_NAMES,
    MAX_DIMS,
    aligned,
    check_shape,
    dtype_from_name,
    tensor_from_bytes,
    tensor_to_bytes,
)

MAX_JSON_ELEMENTS = 1 << 27  # numbers in one JSON tensor
INT_TENSORS = ("kv_lengths", "positions")  # nested lists of these are integers


def parse_json(body: bytes | bytearray | memoryview, nonfinite: bool = False) -> Any:
    """The JSON document of ``body``; with ``nonfinite``, numbers may also be written ``NaN``,
    ``Infinity`` and ``-Infinity`` (as Triton's clients write a non-finite number: the Open
    Inference Protocol's JSON data). A number past float64's range is refused either way."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if nonfinite and _NONFINITE.search(body):
            try:  # (the standard library reads those names; orjson does not)
                return json.loads(bytes(body), parse_float=_finite_float)
            except (ValueError, RecursionError) as exc2:
                raise BadRequest(f"the body is not valid JSON: {exc2}") from None
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


_NONFINITE = re.compile(rb"NaN|Infinity")


def _finite_float(text: str) -> float:
    x = float(text)
    if math.isinf(x):
        raise ValueError(f"the number {text[:40]} is past float64's range")
    return x


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


def _check_count(numel: int, name: str) -> None:
    if numel > MAX_JSON_ELEMENTS:
        raise PayloadTooLarge(f"{name}: more than {MAX_JSON_ELEMENTS} numbers in one JSON tensor")


def json_tensor(value: Any, name: str, default_dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """One JSON tensor (nested list, or {"shape","dtype","data"}) -> (tensor, its encoding)."""
    if isinstance(value, list):
        _check_count(_numel(_nested_shape(value, name)), name)
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
        _check_count(numel, name)
        if len(data) != numel:
            raise BadRequest(f"{name}: {len(data)} numbers in data do not match shape {shape} ({numel})")
        t = _list_to_tensor(data, name, dtype)
        if t.dim() != 1:
            raise BadRequest(f"{name}: data must be a flat list of numbers (row-major), not nested lists")
        return t.reshape(shape), "flat"
    raise BadRequest(f"{name}: data must be a flat list of numbers or a base64 string")


def flat_tensor(data: Any, shape: list[int], dtype: torch.dtype, name: str) -> torch.Tensor:
    """Open Inference Protocol JSON data: flat row-major numbers (nested lists are accepted too, as
    Triton accepts them) -> a tensor of ``shape`` and ``dtype``."""
    if not isinstance(data, list):
        raise BadRequest(f"{name}: data must be a list of numbers")
    check_numbers(data, f"{name}: data")  # before torch takes true/false as 1/0
    if data and isinstance(data[0], list):
        try:
            data = torch.tensor(data, dtype=torch.float64).reshape(-1).tolist()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise BadRequest(f"{name}: not a rectangular list of numbers ({exc})") from None
    return json_tensor({"shape": shape, "data": data}, name, dtype)[0]


def _list_to_tensor(data: list, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Nested list -> tensor of ``dtype``. Integer tensors take integers only, within ``dtype``'s
    range (no silent truncation of 1.5 or wrap-around of 2**40 into int32); a float past the
    float dtype's largest finite value is refused, not turned into inf (an infinity comes only as
    OIP JSON's ``Infinity``, ``parse_json(nonfinite=True)``)."""
    check_numbers(data, name)  # torch would take true/false as 1/0
    try:
        if dtype.is_floating_point:
            t = torch.tensor(data, dtype=torch.float32).to(dtype)
            over = torch.isinf(t)
            if bool(over.any()):  # (an infinity sent as one, OIP's -Infinity, stays one)
                over &= torch.isfinite(torch.tensor(data, dtype=torch.float64)).reshape(over.shape)
            if bool(over.any()):
                at = "".join(f"[{i}]" for i in over.nonzero()[0].tolist())
                raise BadRequest(f"{name}{at}: a number past the range of {DTYPE_NAMES.get(dtype, dtype)} (largest "
                                 f"finite {torch.finfo(dtype).max:g}); scale it down or send a wider dtype")
            return t
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
    """A native JSON request object -> (tensors, raw options, encoding of the first tensor)."""
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
