"""Input checks of the ragged and paged entry points (``kernels.varlen``, ``kernels.paged``): the
errors they raise, and the one device-to-host copy that reads a call's lengths."""

from __future__ import annotations

import numpy as np
import torch

from .errors import (
    AttentionInputError,
    DeviceMismatchError,
    DTypeError,
    HeadDimError,
    KVLengthsError,
    ShapeError,
)
from .spec import MAX_HEAD_DIM, SUPPORTED_DTYPES


class SeqLensError(KVLengthsError):
    """cu_seqlens or cache_lens of the wrong shape, dtype, device or values."""


class BlockTableError(AttentionInputError):
    """A block table of the wrong shape, dtype or device, too short for its sequence, or naming a
    page that does not exist."""


def check_tensor3(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ShapeError(f"{name} must have 3 dims [T, H, D], got shape {list(t.shape)}")
    return t


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_name: str = "k, v") -> tuple[int, int, int]:
    """(Hq, Hkv, D) of q (.., Hq, D) and k/v (.., Hkv, D): dtypes, devices, head counts, head dim."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"q and {kv_name} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise DeviceMismatchError(f"q and {kv_name} must be on one device, got {q.device}, {k.device}, {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ShapeError(f"{kv_name} must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dk = k.shape[-2], k.shape[-1]
    if dk != d:
        raise ShapeError(f"q has head dim {d} but {kv_name} have head dim {dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise HeadDimError(f"head dim {d} is not supported; it must be between 1 and {MAX_HEAD_DIM}")
    if hq < 1 or hkv < 1 or hq % hkv != 0:
        raise ShapeError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv}) for GQA/MQA")
    return hq, hkv, d


def check_index(name: str, t: object, dim: int, device: torch.device, error: type[AttentionInputError],
                shape: str) -> torch.Tensor:
    """An int32 index tensor of ``dim`` dims on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise error(f"{name} must be an int32 tensor of shape {shape}, got {type(t).__name__}")
    if t.dim() != dim:
        raise error(f"{name} must have shape {shape}, got {list(t.shape)}")
    if t.dtype != torch.int32:
        raise error(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise DeviceMismatchError(f"{name} is on {t.device} but q is on {device}")
    return t


def host_ints(*tensors: torch.Tensor) -> list[list[int]]:
    """Each tensor's values as a Python list, read in one device-to-host copy."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
    values = flat.cpu().tolist()
    out, at = [], 0
    for t in tensors:
        out.append(values[at:at + t.numel()])
        at += t.numel()
    return out


def check_max_seqlen(name: str, bound: object, lens: list[int]) -> None:
    """flash-attn's ``max_seqlen_*``: None, or an int at least the longest of ``lens``."""
    if bound is None:
        return
    if isinstance(bound, torch.Tensor) and bound.numel() == 1 and not bound.is_floating_point():
        bound = int(bound.item())  # (flash-attn code sometimes passes a 0-d tensor)
    if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)):
        raise SeqLensError(f"{name} must be an int (the longest sequence's length), got {type(bound).__name__}")
    longest = max(lens, default=0)
    if bound < longest:
        raise SeqLensError(f"{name} is {int(bound)}, but a sequence has {longest} rows; pass at least the longest "
                           "length, or leave it out (the lengths come from the cu_seqlens)")


def check_cu(name: str, cu: list[int], total: int, rows_name: str) -> list[int]:
    """Lengths from cumulative offsets: cu[0] = 0, non-decreasing, ending at ``total``."""
    if not cu:
        raise SeqLensError(f"{name} must have S + 1 >= 1 entries")
    if cu[0] != 0:
        raise SeqLensError(f"{name} must start at 0, got {cu[0]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    bad = next((s for s, n in enumerate(lens) if n < 0), None)
    if bad is not None:
        raise SeqLensError(f"{name} must be non-decreasing; it falls from {cu[bad]} to {cu[bad + 1]} at sequence {bad}")
    if cu[-1] != total:
        raise SeqLensError(f"{name} must end at the number of {rows_name} ({total}), got {cu[-1]}")
    return lens
