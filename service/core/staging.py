"""Staging: a batch's request tensors concatenated along B into host memory (pinned on a GPU) and
copied to the device; the answers copied back into pinned host memory.

Request tensors may be read-only views of request bytes: they are read, never written.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import torch

SHARED_STAGING_MAX_BYTES = 1 << 20  # groups up to this size share one pinned buffer and one transfer
STAGING_ALIGN = 256  # each group's offset in a shared buffer (kernels want 16-byte aligned inputs)
SERIAL_COPY_MAX_BYTES = 4 << 20  # parts up to this size are staged by one memcpy each

Group = tuple[Sequence[torch.Tensor], torch.dtype]  # parts to concatenate along dim 0, and their dtype


def stage(
    groups: Sequence[Group | None], device: torch.device, copy_in: Any, compute: Any
) -> list[torch.Tensor | None]:
    """One tensor per group: its parts concatenated along dim 0, as its dtype, on ``device`` (None
    stays None). On the CPU (``copy_in`` None) a lone part of the right dtype is used as it is.

    On a GPU the parts are copied into pinned host memory and sent by DMA on the ``copy_in``
    stream (entered once per batch); the ``compute`` stream then waits for them. Small groups share
    one pinned buffer and one transfer, since each transfer and each pinned tensor costs host time;
    a big group gets its own, so that its transfer runs while the next group is staged
    (see docs/benchmarks/service.md#throughput).
    """
    if copy_in is None:
        return [None if g is None else concat(*g, pin=False) for g in groups]
    out: list[torch.Tensor | None] = [None] * len(groups)
    shared: list[tuple[int, int, Group]] = []  # (index, offset, group)
    shared_bytes = 0
    with torch.cuda.stream(copy_in):
        for i, g in enumerate(groups):
            if g is None:
                continue
            nbytes = stacked_nbytes(*g)
            if nbytes > SHARED_STAGING_MAX_BYTES:
                parts, dtype = g
                lone = parts[0] if len(parts) == 1 else None
                if lone is not None and lone.dtype == dtype and lone.is_contiguous() and lone.is_pinned():
                    out[i] = lone.to(device, non_blocking=True)  # a body read into pinned memory
                else:
                    out[i] = concat(*g, pin=True).to(device, non_blocking=True)
            else:
                shared.append((i, shared_bytes, g))
                shared_bytes += aligned(nbytes)
        if shared:
            host = torch.empty(shared_bytes, dtype=torch.uint8, pin_memory=True)
            views = [(i, off, fill_bytes(host, off, *g)) for i, off, g in shared]
            dev = host.to(device, non_blocking=True)
            for i, off, v in views:  # the same typed view of the device bytes
                out[i] = dev[off : off + v.nbytes].view(v.dtype).view(v.shape)
    compute.wait_stream(copy_in)
    return out


def to_host(tensors: Sequence[torch.Tensor | None], compute: Any, copy_out: Any) -> tuple[list, Any]:
    """Enqueue device->host copies into pinned memory on ``copy_out``, after the work so far on
    ``compute``; return the host tensors and an event that marks them complete. On the CPU
    (``copy_out`` None): the tensors as they are, and no event."""
    if copy_out is None:
        return list(tensors), None
    out = []
    copy_out.wait_stream(compute)
    with torch.cuda.stream(copy_out):
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            out.append(h)
        done = torch.cuda.Event()
        done.record(copy_out)
    return out, done


def release_pinned_memory() -> None:
    """Hand the pinned host blocks that torch's caching host allocator holds unused back to CUDA:
    it keeps every staging buffer (rounded up to a power of two) for reuse, and they count in
    the process's RSS."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)  # torch before torch.accelerator had it
    if empty is not None:
        empty()


def stacked_shape(parts: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The shape of ``parts`` concatenated along dim 0."""
    return (sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to STAGING_ALIGN: the room one input takes in a shared staging buffer."""
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def stacked_nbytes(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
    return math.prod(stacked_shape(parts)) * dtype.itemsize


def fill_bytes(buf: torch.Tensor, offset: int, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """parts concatenated along dim 0, as ``dtype``, written into the uint8 ``buf`` at ``offset``;
    returns that typed view."""
    shape = stacked_shape(parts)
    view = buf[offset : offset + stacked_nbytes(parts, dtype)].view(dtype).view(shape)
    copy_parts(view, parts)
    return view


def concat(parts: Sequence[torch.Tensor], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """parts concatenated along dim 0 as ``dtype``, in a new buffer (pinned host memory if
    ``pin``); a lone unpinned part of the right dtype is returned as it is."""
    if not pin and len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    buf = torch.empty(stacked_shape(parts), dtype=dtype, pin_memory=pin)
    copy_parts(buf, parts)
    return buf


def copy_parts(dst: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """dst[b0:b1] = part, for consecutive parts along dim 0 (dst: contiguous host memory).

    A small contiguous part of dst's dtype is one ``memmove`` (ctypes releases the GIL for it):
    ATen's copy forks and joins its OpenMP team per part, which costs more than the copy itself
    for small parts (see docs/benchmarks/service.md#throughput). Big parts keep ATen's parallel copy."""
    b0 = 0
    base = dst.data_ptr()
    row = math.prod(dst.shape[1:]) * dst.element_size()
    for p in parts:
        b1 = b0 + p.shape[0]
        if (
            p.dtype == dst.dtype
            and p.device.type == "cpu"
            and p.nbytes <= SERIAL_COPY_MAX_BYTES
            and p.is_contiguous()
        ):
            ctypes.memmove(base + b0 * row, p.data_ptr(), p.nbytes)
        else:
            dst[b0:b1].copy_(p)  # a converting copy when dtypes differ
        b0 = b1


def carve(shapes: list[tuple[torch.dtype, tuple[int, ...]]], pin: bool = False,
           buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 buffer (new, pinned if ``pin``, or ``buffer``) and a tensor of each (dtype, shape)
    in it, each starting at a multiple of 16 bytes."""
    offsets, end = [], 0
    for dt, shape in shapes:
        offsets.append(end)
        end += -(-math.prod(shape) * dt.itemsize // 16) * 16
    if buffer is None:
        buffer = torch.empty(max(end, 16), dtype=torch.uint8, pin_memory=pin)
    views = [buffer[at : at + math.prod(shape) * dt.itemsize].view(dt).view(shape)
             for at, (dt, shape) in zip(offsets, shapes, strict=True)]
    return buffer, views


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A new (pageable) CPU tensor equal to the contiguous host tensor ``t``: one memmove."""
    out = torch.empty(t.shape, dtype=t.dtype)
    ctypes.memmove(out.data_ptr(), t.data_ptr(), t.nbytes)
    return out
