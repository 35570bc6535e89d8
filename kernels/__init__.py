"""attnserve kernels: exact attention, O = softmax(Q Kᵀ · scale + mask) V, without an N×N matrix.

    from kernels import attention
    o = attention(q, k, v, causal=False, scale=None, kv_lengths=None, return_lse=False, kernel="auto",
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None)

Ragged and paged batches (docs/api.md#ragged-and-paged-batches): ``attention_varlen``, ``attention_paged``,
``append_paged``.
"""

from __future__ import annotations

import math

import torch

from .dispatch import KERNELS, choose
from .errors import (
    AttentionInputError,
    DeviceMismatchError,
    DTypeError,
    HeadDimError,
    KernelUnavailableError,
    KVLengthsError,
    OptionError,
    ShapeError,
)
from .masks import MaskError
from .mkl_vml import resolve_vml_dispatch
from .paged import append_paged, attention_paged
from .ragged_checks import BlockTableError, SeqLensError
from .spec import MAX_HEAD_DIM, SUPPORTED_DTYPES, AttnSpec, check_inputs
from .varlen import attention_varlen
from .warmup import warmup, warmup_ragged

resolve_vml_dispatch()  # before any caller's first big exp: see kernels/mkl_vml.py

__all__ = [
    "KERNELS",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "AttentionInputError",
    "AttnSpec",
    "BlockTableError",
    "DTypeError",
    "DeviceMismatchError",
    "HeadDimError",
    "KVLengthsError",
    "KernelUnavailableError",
    "MaskError",
    "OptionError",
    "SeqLensError",
    "ShapeError",
    "append_paged",
    "attention",
    "attention_paged",
    "attention_varlen",
    "check_inputs",
    "choose",
    "freeze_autotuning",
    "warmup",
    "warmup_ragged",
]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    kv_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact scaled-dot-product attention.

    q: (batch, heads_q, seqlen_q, headdim); k, v: (batch, heads_kv, seqlen_k, headdim), with
    heads_q % heads_kv == 0 (GQA/MQA). causal is bottom-right aligned (query i sees key j iff
    j <= i + seqlen_k - seqlen_q); kv_lengths (batch,) masks keys at positions >= kv_lengths[b]
    (values outside [0, seqlen_k] are refused for CPU tensors and clamped for CUDA ones, where
    checking them would synchronise the device).
    Returns o (batch, heads_q, seqlen_q, headdim) in q's dtype, and with return_lse also the
    float32 natural-log logsumexp (batch, heads_q, seqlen_q). Rows that see no key give o = 0 and
    lse = -inf.

    Score modifiers, as flash-attn defines them (docs/kernels.md#score-modifiers), with
    i_al = i + seqlen_k - seqlen_q: window_size (left, right) lets query i see key j only if
    i_al - left <= j <= i_al + right (-1: that side unbounded; causal bounds the right at 0);
    softcap > 0 turns the scaled score s into softcap · tanh(s / softcap); alibi_slopes, float32
    (heads_q,) or (batch, heads_q) on q's device, adds -slope · |i_al - j| after the cap. Every
    kernel but "flash_v1" takes them ("auto" never picks a kernel that cannot), gradients included.

    Gradients flow through every kernel: "flash"/"flash_v1" (and "auto" on CUDA) by the Triton
    backward that recomputes P block by block from the saved LSE (deterministic); "reference" and
    the CPU path by PyTorch autograd. lse itself carries no gradient.
    """
    spec = check_inputs(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths, window_size=window_size,
                        softcap=softcap, alibi_slopes=alibi_slopes, allow_empty=True)
    impl = choose(spec, kernel)
    if 0 in (spec.batch, spec.n_q, spec.n_k):  # no row, or rows that see no key: o = 0, lse = -inf
        o = _Empty.apply(q, k, v)
        return (o, torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)) if return_lse else o
    opts = dict(causal=spec.causal, scale=spec.scale, kv_lengths=kv_lengths)
    if spec.masks.active:  # a plain call passes what a plain backend takes
        opts["masks"] = spec.masks
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device (and its stream), wherever the tensors are
        with torch.cuda.device(q.device):
            o, lse = impl.forward(q, k, v, **opts)
    else:
        o, lse = impl.forward(q, k, v, **opts)
    # lse carries no gradient (docs/api.md): the Triton path marks it so, PyTorch's autograd would not
    return (o, lse.detach()) if return_lse else o


class _Empty(torch.autograd.Function):
    """The answer of attention with no row or no key: zeros of q's shape; zero gradients."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.shapes = (q, k, v)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.zeros_like(t) for t in ctx.shapes)


def freeze_autotuning(frozen: bool = True) -> None:
    """From now on, shapes the autotuner has not tuned run a default config instead of being tuned
    on the spot (a service calls this after its warm-up; see ``kernels.launch.freeze_autotuning``)."""
    from .launch import freeze_autotuning as freeze

    freeze(frozen)
