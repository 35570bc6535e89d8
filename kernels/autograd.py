"""Gradients through the Triton kernels: a ``torch.autograd.Function`` whose forward runs
``flash_forward`` and saves only q, k, v, o and the row LSE, and whose backward recomputes P block
by block (``kernels/jit/flash_bwd.py``).

On Hopper ``attn_bwd_ws`` (``kernels/hopper_bwd.py``) takes the problems ``bwd_refusal`` lets
through (16-bit, D 128, 2048 rows and keys or more, no kv_lengths or score modifiers); the Triton
kernels take every other. Both are deterministic by default: the Triton kernels sum every
dQ/dK/dV element in one program's registers in a fixed order (no atomics), the Gluon kernel adds
dQ's shares in a fixed order.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from . import hopper_bwd
from .flash import flash_forward
from .jit import flash_bwd as kern
from .launch import launch
from .masks import NO_MASKS, Masks
from .plan import _bucket, alibi_arg, block_d, kv_length_arg


def flash_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, *, causal: bool, scale: float, kv_lengths: torch.Tensor | None = None,
    masks: Masks = NO_MASKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (B, Hq, Nq, D), dk, dv (B, Hkv, Nk, D) for o = attention(q, k, v) and upstream grad do
    (the slopes of ``masks`` get no gradient)."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    dev = q.device
    lse = lse.contiguous()
    delta = torch.empty(b, hq, n_q, dtype=torch.float32, device=dev)
    bd = block_d(d)
    kern.bwd_preprocess[(triton.cdiv(n_q, 64), b * hq)](
        o, do, delta, *o.stride(), *do.stride(), hq, n_q, D=d, BLOCK_D=bd, BLOCK_M=64)
    if hopper_bwd.bwd_refusal(q, k, v, kv_lengths, masks) is None:
        return hopper_bwd.gluon_backward(do, q, k, v, lse, delta, causal=causal, scale=scale)
    dq = torch.empty(b, hq, n_q, d, dtype=q.dtype, device=dev)
    dk = torch.empty(b, hkv, n_k, d, dtype=k.dtype, device=dev)
    dv = torch.empty(b, hkv, n_k, d, dtype=v.dtype, device=dev)
    kv_len = kv_length_arg(kv_lengths, n_k, dev)
    slopes, stride_ab, stride_ah = alibi_arg(masks, dev)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), stride_ab, stride_ah)
    meta = dict(D=d, BLOCK_D=bd, IS_CAUSAL=bool(causal), HAS_KV_LEN=kv_lengths is not None,
                WINDOW=masks.window, SOFTCAP=masks.softcap > 0, HAS_ALIBI=masks.alibi is not None,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, kv_len, slopes, *strides, hq, hkv, n_q, n_k,
                 float(scale), float(scale) * 1.4426950408889634, *masks.kernel_args(), _bucket(max(n_q, n_k)),
                 hq // hkv)
    dq_args = (q, k, v, do, lse, delta, dq, kv_len, slopes, *strides, hq, hq // hkv, n_q, n_k,
               float(scale), float(scale) * 1.4426950408889634, *masks.kernel_args(), _bucket(max(n_q, n_k)))
    grid_kv = lambda c: (triton.cdiv(n_k, c["BLOCK_N"]), b * hkv)
    grid_q = lambda c: (triton.cdiv(n_q, c["BLOCK_M"]), b * hq)
    launch(kern.bwd_dkdv_tuned, grid_kv, dkdv_args, meta, q)
    launch(kern.bwd_dq_tuned, grid_q, dq_args, meta, q)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """o, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, kv_lengths, forward_fn, masks);
    forward_fn is flash_forward or flash_v1_forward (the backward needs only o and lse; flash_v1
    takes no masks); lse carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kv_lengths, forward_fn=flash_forward, masks=NO_MASKS):
        if masks.active:
            o, lse = forward_fn(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths, masks=masks)
        else:
            o, lse = forward_fn(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
        ctx.save_for_backward(q, k, v, o, lse, kv_lengths)
        ctx.causal, ctx.scale, ctx.masks = causal, scale, masks
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable  # the backward kernels are not differentiable: a double backward raises, not 0
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, kv_lengths = ctx.saved_tensors
        dq, dk, dv = flash_backward(do, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale,
                                    kv_lengths=kv_lengths, masks=ctx.masks)
        return dq, dk, dv, None, None, None, None, None


def flash_attention_autograd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
    kv_lengths: torch.Tensor | None = None, masks: Masks = NO_MASKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_forward`` with gradients; the plain kernel when no input needs a gradient."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttentionFunction.apply(q, k, v, causal, scale, kv_lengths, flash_forward, masks)
    return flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths, masks=masks)


def flash_v1_attention_autograd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
    kv_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_v1_forward`` with gradients (the same recomputing backward)."""
    from .flash_v1 import flash_v1_forward

    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttentionFunction.apply(q, k, v, causal, scale, kv_lengths, flash_v1_forward)
    return flash_v1_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
