"""Launcher of the seed's FlashAttention V1 (``kernels/jit/flash_v1.py``).

``flash_v1_forward(q, k, v, *, causal, scale, kv_lengths=None) -> (o, lse)``

q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D), any strides. Grid (B·Hq, S): one program per (batch,
query head) and key slice; O, m, l live in float32 HBM buffers of shape (S, B, Hq, Nq[, D]) between
outer iterations, as in the seed; ``combine`` merges the S slices by their LSE. S grows while one
batch element's Hq programs leave SMs idle (never with B, so batching does not change an answer),
up to ``MAX_SPLITS``.
"""

from __future__ import annotations

import torch
import triton

from .flash import combine
from .jit import flash_v1 as kern
from .launch import launch
from .plan import SPLIT_KEY_QUANTUM, _num_sms, block_d, kv_length_arg, split_keys

MAX_SPLITS = 8


def _splits(b: int, hq: int, n_q: int, n_k: int, d: int, device: torch.device,
            num_splits: int | None) -> tuple[int, int]:
    # The split count depends on one batch element only, never on b: a request batched with others
    # must sum its keys in the same order as alone (bit-identical answers). MAX_SPLITS bounds the
    # float32 partials to MAX_SPLITS x the output (in float32) whatever the batch.
    del b
    if num_splits is None:
        want = triton.cdiv(2 * _num_sms(device), hq)
        num_splits = max(1, min(want, n_k // (2 * SPLIT_KEY_QUANTUM), MAX_SPLITS))
    return split_keys(n_k, num_splits)


def flash_v1_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32 natural log."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype and k.shape == v.shape and hq % hkv == 0 and d <= 256
    dev = q.device
    splits, kps = _splits(b, hq, n_q, n_k, d, dev, num_splits)
    o_part = torch.zeros(splits, b, hq, n_q, d, dtype=torch.float32, device=dev)
    m_part = torch.full((splits, b, hq, n_q), float("-inf"), dtype=torch.float32, device=dev)
    l_part = torch.zeros(splits, b, hq, n_q, dtype=torch.float32, device=dev)
    kv_len = kv_length_arg(kv_lengths, n_k, dev)
    args = (
        q, k, v, o_part, m_part, l_part, kv_len,
        *q.stride(), *k.stride(), *v.stride(),
        b, hq, hq // hkv, n_q, n_k, float(scale), kps,
    )
    meta = dict(
        D=d, BLOCK_D=block_d(d), IS_CAUSAL=bool(causal), HAS_KV_LEN=kv_lengths is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )
    launch(kern.flash_v1_fwd_tuned, lambda cfg: (b * hq, splits), args, meta, q)
    o = torch.empty(b, hq, n_q, d, dtype=q.dtype, device=dev)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=dev)
    combine(o_part, m_part, o, lse)
    return o, lse
