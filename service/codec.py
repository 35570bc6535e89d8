"""Tensor <-> bytes conversions shared by every transport: dtype names of the native API, of the
Open Inference Protocol, and raw little-endian row-major buffers. No transport logic here.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import TYPE_CHECKING

import torch

from .errors import BadRequest, PayloadTooLarge

if TYPE_CHECKING:
    from .types import Stamps

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


def dtype_from_name(name: str, table: dict[str, torch.dtype] = DTYPES) -> torch.dtype:
    try:
        return table[name]
    except KeyError:
        raise BadRequest(f"unsupported dtype {name!r}; use one of {', '.join(table)}") from None


def tensor_from_bytes(data: bytes | bytearray | memoryview, shape: list[int], dtype: torch.dtype,
                      name: str = "tensor") -> torch.Tensor:
    """Little-endian row-major bytes -> tensor of ``shape`` (zero-copy view where the buffer allows).

    The result may share memory with ``data`` (read-only buffers give a tensor that must not be
    written in place; the kernels never do).
    """
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise BadRequest(f"{name}: shape must be a list of non-negative integers, got {shape}")
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
    view = memoryview(data)
    if not view.readonly:  # request bodies (bytearray): no warning to silence (~5 us per tensor)
        return torch.frombuffer(view, dtype=dtype).view(shape)
    with warnings.catch_warnings():  # read-only request bytes: the kernels never write inputs
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(view, dtype=dtype)
    return t.view(shape)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Tensor -> little-endian row-major bytes (one copy, from a contiguous CPU tensor)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def check_tensor_bytes(nbytes: int, limit: int, name: str) -> None:
    if nbytes > limit:
        raise PayloadTooLarge(f"{name} is {nbytes / 2**20:.1f} MiB, over the limit of {limit / 2**20:.0f} MiB")


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
        batcher, until a worker takes the launch), ``stage`` (the worker's launcher thread, or the
        loop with ``--inline-launch-kib``: the inputs copied into pinned memory and their
        host->device copies enqueued), ``launch`` (the kernel and the device->host copies
        enqueued), ``device`` (waiting for the device, answers split), ``return`` (back on the
        event loop, to this handler). They sum to the engine's whole time."""
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
