"""The Hopper backward's host side: which problems ``attn_bwd_ws`` (``jit/gluon_bwd.py``) takes
(``bwd_refusal``: None when it serves the problem, else why not) and its launch.

``DETERMINISTIC`` (on by default; ``ATTNSERVE_BWD_DETERMINISTIC=0`` turns it off) orders dQ's
float32 adds so that gradients are bit for bit the same on every run and in any batch; off, the
adds land in whatever order the programs reach them (docs/kernels.md#backward).
"""

from __future__ import annotations

import os

import torch
from triton.experimental.gluon import language as gl

from . import hopper
from .jit import gluon_bwd as kern
from .launch import interpreting, launch_plain
from .masks import NO_MASKS, Masks
from .plan import _cdiv

# attn_bwd_ws serves the backwards bwd_refusal lets through while this is on (the switch for
# jit/gluon_ext.py too)
GLUON_BACKWARD = True
DETERMINISTIC = os.environ.get("ATTNSERVE_BWD_DETERMINISTIC", "1") != "0"
# the kernel takes D 64 and 128; at D 64 the Triton kernels are as fast or faster
# (docs/benchmarks/kernels.md#backward), so they keep it
BWD_HEAD_DIMS = (128,)
_F32_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)
CONSUMER_REGS = 240
# below this Nq or Nk the Triton kernels are faster (1x32x1024x128 ran slower on attn_bwd_ws, 2048
# faster: docs/benchmarks/kernels.md#backward); the tests lift it
BWD_MIN_N = 2048


def bwd_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor | None,
                masks: Masks = NO_MASKS, sizes: bool = True) -> str | None:
    """Why ``attn_bwd_ws`` does not serve this backward, or None when it does: 16-bit on Hopper at
    a D of BWD_HEAD_DIMS, no kv_lengths and no score modifiers (the Triton backward takes those), q, k and
    v that host TMA descriptors take. ``sizes=False`` skips the length threshold (tests)."""
    if not GLUON_BACKWARD:
        return "hopper_bwd.GLUON_BACKWARD is off"
    if masks.active:
        return "a window, softcap or ALiBi slopes"
    if kv_lengths is not None:
        return "kv_lengths"
    if q.dtype not in hopper._16BIT:
        return hopper._NOT_16BIT
    if q.shape[-1] not in BWD_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of BWD_HEAD_DIMS {BWD_HEAD_DIMS}"
    if q.numel() == 0 or k.numel() == 0:
        return "an empty tensor (a TMA descriptor has no empty dims)"
    if interpreting():
        return hopper._NO_GLUON
    if not hopper._hopper(q.device):
        return hopper._NOT_SM90
    if sizes and min(q.shape[2], k.shape[2]) < BWD_MIN_N:
        return "min(Nq, Nk) < BWD_MIN_N"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not hopper._descriptor_ok(t):
            return f"{name}: a descriptor not 16-byte aligned, or a stride TMA cannot say"
    return None


def _dq_descriptor(dq_acc: torch.Tensor):
    """A TMA descriptor over the float32 dQ (B, Hq, Nq, D), contiguous, in each consumer
    warpgroup's boxes of (1, 1, BLOCK_M, D / 2)."""
    return hopper._descriptor(dq_acc, kern.BLOCK_M, dq_acc.shape[-1] // 2, _F32_BOX_LAYOUT)


def gluon_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, *, causal: bool, scale: float,
                   deterministic: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (B, Hq, Nq, D), dk, dv (B, Hkv, Nk, D) by ``attn_bwd_ws``, where ``bwd_refusal`` is None;
    lse and delta = rowsum(do ∘ o) fp32 (B, Hq, Nq) contiguous."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    det = DETERMINISTIC if deterministic is None else deterministic
    if not hopper._descriptor_ok(do):
        do = do.contiguous()
    dq_acc = torch.zeros(b, hq, n_q, d, dtype=torch.float32, device=q.device)
    sem = torch.zeros(b * hq * _cdiv(n_q, kern.BLOCK_M) * 2 if det else 1, dtype=torch.int32, device=q.device)
    dk = torch.empty(b, hkv, n_k, d, dtype=k.dtype, device=q.device)
    dv = torch.empty(b, hkv, n_k, d, dtype=v.dtype, device=q.device)
    args = (hopper._descriptor(q, kern.BLOCK_M), hopper._descriptor(do, kern.BLOCK_M),
            hopper._descriptor(k, kern.BLOCK_N), hopper._descriptor(v, kern.BLOCK_N),
            lse, delta, _dq_descriptor(dq_acc), sem, dk, dv, hq, hkv, hq // hkv, n_q, n_k,
            scale * 1.4426950408889634, scale)
    grid = (_cdiv(n_k, kern.BLOCK_N), b * hkv)
    launch_plain(kern.attn_bwd_ws, grid, args,
                 dict(IS_CAUSAL=bool(causal), DETERMINISTIC=det, CONSUMER_REGS=CONSUMER_REGS), num_warps=4)
    return dq_acc.to(q.dtype), dk, dv
