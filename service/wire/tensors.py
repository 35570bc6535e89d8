"""Tensor <-> bytes conversions shared by every transport: dtype names of the native API, of the
Open Inference Protocol, and raw little-endian row-major buffers; safetensors files; shape checks.
No transport logic here.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
import torch

from service.errors import BadRequest, InvalidInput, PayloadTooLarge, size_text

if TYPE_CHECKING:
    from service.core.types import Stamps

# native API (JSON "dtype", safetensors, attention.v1 DType enum names lower-cased)
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# the dtypes attention computes in (settings such as --warmup-dtypes and --layer-dtype name these)
FLOAT_DTYPES: dict[str, torch.dtype] = {k: v for k, v in DTYPES.items() if v.is_floating_point}

# The wire is little-endian and tensors are read and written as raw host memory (no byte swapping).
if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("attnserve's tensor codec needs a little-endian host")

# Open Inference Protocol (KServe v2) datatypes
OIP_DTYPES: dict[str, torch.dtype] = {
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "INT32": torch.int32,
    "INT64": torch.int64,
}
OIP_NAMES: dict[torch.dtype, str] = {v: k for k, v in OIP_DTYPES.items()}


MAX_DIMS = 8  # deepest tensor we decode; also bounds nested-list recursion
MAX_DIM = 2**31 - 1  # largest single dim of a decoded tensor (the kernels index in int32)
MAX_EXTENT = 2**40  # largest product of a shape's dims, zero dims counted as 1 (see check_extent)
MAX_SAFETENSORS_HEADER = 1 << 20  # q, k, v, kv_lengths and option strings need < 1 KiB
SAFETENSORS_IGNORED_METADATA = ("format",)  # written by transformers/safetensors tools ("pt")

# safetensors dtype names (the kernels refuse the ones they do not run, with a 422)
ST_DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}


def dtype_from_name(name: str, table: dict[str, torch.dtype] = DTYPES) -> torch.dtype:
    try:
        return table[name]
    except KeyError:
        raise BadRequest(f"unsupported dtype {name!r}; use one of {', '.join(table)}") from None


def tensor_from_bytes(data: bytes | bytearray | memoryview, shape: list[int], dtype: torch.dtype,
                      name: str = "tensor", checked: bool = False) -> torch.Tensor:
    """Little-endian row-major bytes -> tensor of ``shape`` (zero-copy view where the buffer allows).

    The result may share memory with ``data`` (read-only buffers give a tensor that must not be
    written in place; the kernels never do). ``checked``: the caller has passed ``shape`` through
    ``check_shape`` already.
    """
    if not checked:
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            raise BadRequest(f"{name}: shape must be a list of non-negative integers, got {shape}")
        check_extent(shape, name)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = dtype.itemsize
    if len(data) != numel * itemsize:
        raise BadRequest(
            f"{name}: {len(data)} bytes do not match shape {shape} of {DTYPE_NAMES.get(dtype, dtype)} "
            f"({numel * itemsize} bytes expected)"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    global _readonly_warned
    view = memoryview(data)
    if not view.readonly or _readonly_warned:  # bytearray bodies, or torch's warning already spent
        return torch.frombuffer(view, dtype=dtype).view(shape)
    with warnings.catch_warnings():  # read-only request bytes: the kernels never write inputs
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(view, dtype=dtype)
    _readonly_warned = True
    return t.view(shape)


# torch warns of a read-only buffer once a process (TORCH_WARN_ONCE): silenced on that first call,
# later calls skip catch_warnings, a few µs a tensor (and not thread-safe).
_readonly_warned = False


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Tensor -> little-endian row-major bytes (one copy, from a contiguous CPU tensor)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def check_tensor_bytes(nbytes: int, limit: int, name: str) -> None:
    if nbytes > limit:
        raise PayloadTooLarge(f"{name} is {size_text(nbytes)}, over the limit of {size_text(limit)}")


class ServerTiming:
    """The phases of one call in W3C ``Server-Timing`` syntax (durations in ms): ``read`` (an HTTP
    body), ``decode``, the engine's ``queue``, ``stage``, ``launch``, ``device`` and ``return`` (see
    ``engine``), ``encode``. HTTP sends it as the
    ``Server-Timing`` header, gRPC as the ``server-timing`` trailing metadata of a unary call."""

    __slots__ = ("_last", "_phases")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._phases: list[tuple[str, float]] = []  # (name, seconds): formatted only by value()

    def mark(self, name: str, at: float | None = None) -> None:
        """A phase that ended ``at`` (a ``time.perf_counter()`` instant; default now)."""
        now = time.perf_counter() if at is None else max(at, self._last)
        self._phases.append((name, now - self._last))
        self._last = now

    def engine(self, stamps: Stamps | None) -> None:
        """The engine's time, split by a result's ``stamps``: ``queue`` (validation and the
        batcher, until a worker takes the launch), ``stage`` (the worker's launcher thread: the
        inputs copied into pinned memory and their host->device copies enqueued), ``launch`` (the
        kernel and the device->host copies enqueued), ``device`` (waiting for the device, answers
        split), ``return`` (back on the event loop, to this handler). They sum to the engine's
        whole time."""
        if stamps is None:
            self.mark("engine")
            return
        for name, at in zip(("queue", "stage", "launch", "device"), stamps, strict=True):
            self.mark(name, at)
        self.mark("return")

    def value(self) -> str:
        return ", ".join(f"{name};dur={1e3 * s:.3f}" for name, s in self._phases)

    @staticmethod
    def parse(value: str) -> dict[str, float]:
        """``"decode;dur=0.1, engine;dur=1.0"`` -> ``{"decode": 0.1, "engine": 1.0}`` (ms)."""
        out = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, _, dur = part.partition(";dur=")
            out[name] = float(dur)
        return out


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize  # (NULL, n): not zeroed
_new_bytearray.restype, _new_bytearray.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)


def uninitialized_bytearray(n: int) -> bytearray:
    """``n`` writable bytes, not zeroed: a buffer about to be filled whole (a body read from a
    socket) need not be written twice."""
    return _new_bytearray(None, n)


# ---------------------------------------------------------------- shapes and safetensors files


def check_shape(shape: Any, name: str, extent: bool = True) -> list[int]:
    """A shape given in JSON (native tensor objects, OIP inputs): at most MAX_DIMS integers >= 0
    (and, with ``extent``, within ``check_extent``'s bounds)."""
    if type(shape) is not list or len(shape) > MAX_DIMS or not _naturals(shape):
        raise BadRequest(f"{name}: shape must be a list of at most {MAX_DIMS} non-negative integers")
    if extent:
        check_extent(shape, name)
    return shape


def _naturals(values: list) -> bool:
    """Every value an int >= 0 (not a bool: ``type() is int`` excludes it; int subclasses too)."""
    for d in values:
        if type(d) is not int or d < 0:
            return False
    return True


def check_dims(tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], ndim: int, layout: str) -> None:
    """Each of ``names`` has ``ndim`` dims (422 otherwise), before a layout transpose needs them."""
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


def check_extent(shape: list[int], name: str) -> None:
    """422 unless ``shape`` (integers >= 0) has at most MAX_DIMS dims, each at most MAX_DIM, whose
    product with zero dims counted as 1 is at most MAX_EXTENT: checked before any allocation, since
    torch sizes even an empty tensor's strides from the other dims ([2**63, 0] overflows int64)."""
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"{name}: shape {shape} has {len(shape)} dims, more than {MAX_DIMS}")
    extent = 1
    for d in shape:
        if d > MAX_DIM:
            raise InvalidInput(f"{name}: shape {shape} has a dim over {MAX_DIM} (2**31 - 1)")
        extent *= max(d, 1)
    if extent > MAX_EXTENT:
        raise InvalidInput(
            f"{name}: shape {shape} is too large (its non-zero dims multiply to {extent}, over 2**40)"
        )


def aligned(t: torch.Tensor) -> torch.Tensor:
    """A view into a request buffer at an odd offset is copied, so kernels see aligned memory."""
    return t if t.numel() == 0 or t.data_ptr() % t.element_size() == 0 else t.clone()


def parse_safetensors(body: bytearray | bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file -> (tensors viewing ``body``, string metadata). Never copies tensor bytes
    (unless misaligned); never executes anything from the body."""
    if len(body) < 8:
        raise BadRequest("the body is not a safetensors file (shorter than its 8-byte header length)")
    (hlen,) = struct.unpack_from("<Q", body, 0)
    if hlen > len(body) - 8:
        raise BadRequest("the body is not a safetensors file (header length past the end of the body)")
    if hlen > MAX_SAFETENSORS_HEADER:  # parsed JSON takes ~10x its size in Python objects
        raise PayloadTooLarge(f"the safetensors header is over {MAX_SAFETENSORS_HEADER} bytes")
    try:
        header = orjson.loads(memoryview(body)[8 : 8 + hlen])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadRequest("the safetensors header must be a JSON object")
    check_unique_names(memoryview(body)[8 : 8 + hlen], header)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadRequest("safetensors __metadata__ must map names to strings")
    data = memoryview(body)[8 + hlen :]
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = check_shape(info["shape"], name)
            begin, end = check_shape(info["data_offsets"], name, extent=False)  # two integers >= 0
        except (KeyError, TypeError, ValueError, BadRequest):  # not 'shape': "12" as [1, 2], [1.9] as [1]
            raise BadRequest(
                f"safetensors entry {name!r} needs a known dtype ({', '.join(ST_DTYPES)}), a shape (a list "
                f"of at most {MAX_DIMS} integers >= 0) and data_offsets [begin, end]"
            ) from None
        if not begin <= end <= len(data):
            raise BadRequest(f"safetensors entry {name!r}: data_offsets {[begin, end]} lie outside the body")
        tensors[name] = aligned(tensor_from_bytes(data[begin:end], shape, dtype, name, checked=True))
    check_data_offsets(header, len(data))
    return tensors, {k: v for k, v in metadata.items() if k not in SAFETENSORS_IGNORED_METADATA}


def check_unique_names(raw: memoryview, parsed: dict | None = None) -> None:
    """400 when the header names an entry (or a key inside one) twice: JSON parsers let the last
    win, safetensors forbids it. orjson keeps no trace of duplicates. Where the raw header has no
    backslash, no string in it holds a quote, so every ``"`` followed by a colon ends a key:
    counting those against the keys orjson kept (``parsed``, two levels deep) proves there is no
    duplicate in a few µs. Otherwise (escapes, deeper objects, a mismatch) the header is read once
    more by the standard library, whose pairs hook sees every key."""
    text = bytes(raw)
    if parsed is not None and b"\\" not in text:
        kept = len(parsed) + sum(len(v) for v in parsed.values() if type(v) is dict)
        if len(_KEY_END.findall(text)) == kept:
            return

    def unique(pairs: list[tuple[str, Any]]) -> None:
        names: set[str] = set()
        for name, _ in pairs:
            if name in names:
                raise _Duplicate(name)
            names.add(name)

    try:
        json.loads(text, object_pairs_hook=unique)
    except _Duplicate as dup:
        raise BadRequest(f"the safetensors header names {dup.args[0]!r} twice") from None
    except (ValueError, RecursionError):  # orjson read it, so only the standard library's limits
        raise BadRequest("the safetensors header is not valid JSON (too deeply nested)") from None


class _Duplicate(Exception):
    pass


_KEY_END = re.compile(rb'"[ \t\n\r]*:')  # a key's closing quote and its colon (JSON whitespace between)


def check_data_offsets(header: dict, size: int) -> None:
    """400 unless the entries' ``data_offsets`` tile the ``size`` bytes after the header exactly,
    in some order: no overlap (one tensor reading another's bytes), no gap, nothing past the end
    (the safetensors format's rule, as its own library checks it)."""
    spans = []
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
            raise BadRequest(f"safetensors entry {name!r}: data_offsets must be [begin, end], "
                             f"integers with 0 <= begin <= end, got {offsets!r}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    at, last = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise BadRequest(f"safetensors entry {name!r}: data_offsets {[begin, end]} overlap those of {last!r}")
        if begin > at:
            where = f"after {last!r}" if last is not None else "at the start of the data"
            raise BadRequest(f"safetensors entry {name!r}: data_offsets {[begin, end]} leave a gap {where} "
                             f"(bytes {at} to {begin})")
        at, last = end, name
    if at > size:
        raise BadRequest(f"safetensors entry {last!r}: data_offsets end at byte {at}, past the "
                         f"{size} bytes of data")
    if at < size:
        raise BadRequest(f"the safetensors data has {size - at} bytes after the last tensor"
                         + (f" ({last!r})" if last is not None else "") + " that no entry claims")


def safetensors_parts(tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
    """Tensors -> a safetensors file as buffers: its header, then each tensor's own bytes (views,
    no copy; they keep their tensors alive)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = orjson.dumps(header)
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writers do
    return tensor_parts(struct.pack("<Q", len(head)) + head, tensors.values())


def tensor_parts(head: bytes, tensors: Iterable[torch.Tensor]) -> list[memoryview]:
    """``head``, then each tensor's little-endian row-major bytes as a view of its own memory (a
    safetensors file, or an OIP response with binary outputs, without copying the data)."""
    parts = [memoryview(head)]
    for t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            if flat.stride(0) != 1:  # one element: torch calls any stride contiguous (expand(1), x[::2])
                flat = flat.clone(memory_format=torch.contiguous_format)
            parts.append(memoryview(flat.view(torch.uint8).numpy()))
    return parts
