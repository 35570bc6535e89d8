"""Input validation: one place that turns (q, k, v, kv_lengths) into a checked ``AttnSpec``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import DeviceMismatchError, DTypeError, HeadDimError, KVLengthsError, OptionError, ShapeError
from .masks import LOG2E, NO_MASKS, Masks, as_float32, check_masks, dense_masks, real

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttnSpec:
    """The checked problem: q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D)."""

    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float
    has_kv_lengths: bool
    masks: Masks = NO_MASKS     # window, softcap, ALiBi (``kernels/masks.py``)

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 = MHA, Hq = MQA)."""
        return self.heads_q // self.heads_kv


def check_scale(scale: object, d: int) -> float:
    """The scale: 1/sqrt(d) for None, else a real number (numpy's scalars included, a bool not) whose
    base-2 form, scale · log2(e), stays finite in float32, the kernels' arithmetic (docs/api.md)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    value = real(scale)
    if value is None:
        raise OptionError(f"scale must be a number, got {scale!r}")
    if not math.isfinite(as_float32(value * LOG2E)):  # the kernels fold log2(e) into the scale, in float32
        raise OptionError(f"scale must be finite and |scale| <= 2.3e38 (float32's range over log2(e), the "
                          f"kernels' base-2 softmax), got {scale!r}")
    return value


def check_causal(causal: object) -> bool:
    """causal, a bool (numpy's included): anything else is refused, as ``bool("false")`` is True."""
    if not isinstance(causal, bool | np.bool_):
        raise OptionError(f"causal must be a bool, got {causal!r}")
    return bool(causal)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_lengths: torch.Tensor | None = None,
    allow_float64: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    allow_empty: bool = False,
) -> AttnSpec:
    """Validate q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D), kv_lengths (B,) int32/int64, causal and scale
    (``check_causal``, ``check_scale``) and the score modifiers (``masks.check_masks``; a window side
    no row's keys reach is dropped).

    ``allow_empty``: B, Nq and Nk may be 0 (``attention`` answers those without a kernel).
    Raises a subclass of ``AttentionInputError`` whose message names the offending argument.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must have 4 dims [B, H, N, D], got shape {list(t.shape)}")
    allowed = SUPPORTED_DTYPES + ((torch.float64,) if allow_float64 else ())
    if q.dtype not in allowed:
        raise DTypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise DeviceMismatchError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, nq, d = q.shape
    bk, hkv, nk, dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ShapeError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if bk != b:
        raise ShapeError(f"q has batch {b} but k/v have batch {bk}")
    if dk != d:
        raise ShapeError(f"q has head dim {d} but k/v have head dim {dk}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise HeadDimError(f"head dim {d} is not supported; it must be between 1 and {MAX_HEAD_DIM}")
    if hq < 1 or hkv < 1 or min(b, nq, nk) < (0 if allow_empty else 1):
        raise ShapeError(
            f"every dim must be at least 1{' (B, Nq and Nk may be 0)' if allow_empty else ''}, "
            f"got q {list(q.shape)}, k {list(k.shape)}"
        )
    if hq % hkv != 0:
        raise ShapeError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA"
        )
    scale = check_scale(scale, d)
    causal = check_causal(causal)
    if kv_lengths is not None:
        if not isinstance(kv_lengths, torch.Tensor):
            raise KVLengthsError("kv_lengths must be a tensor of shape [B]")
        if kv_lengths.dim() != 1 or kv_lengths.shape[0] != b:
            raise KVLengthsError(f"kv_lengths must have shape [{b}], got {list(kv_lengths.shape)}")
        if kv_lengths.dtype not in (torch.int32, torch.int64):
            raise KVLengthsError(f"kv_lengths must be int32 or int64, got {kv_lengths.dtype}")
        if kv_lengths.device != q.device:
            raise DeviceMismatchError(f"kv_lengths is on {kv_lengths.device} but q is on {q.device}")
        # The range is checked on the host only: reading it on a GPU would synchronise the device
        # on every call (the service checks requests on the host before they move). On a GPU the
        # kernels clamp instead: a length above Nk sees every key, a negative one sees none.
        if kv_lengths.device.type == "cpu" and kv_lengths.numel():
            lo, hi = int(kv_lengths.min()), int(kv_lengths.max())
            if lo < 0 or hi > nk:
                raise KVLengthsError(f"kv_lengths must lie in [0, {nk}] (Nk), got values in [{lo}, {hi}]")
    masks = dense_masks(check_masks(window_size, softcap, alibi_slopes, rows=b, heads_q=hq, device=q.device,
                                    causal=causal), nq, nk)
    return AttnSpec(
        batch=b,
        heads_q=hq,
        heads_kv=hkv,
        n_q=nq,
        n_k=nk,
        head_dim=d,
        dtype=q.dtype,
        device=q.device,
        causal=causal,
        scale=scale,
        has_kv_lengths=kv_lengths is not None,
        masks=masks,
    )
