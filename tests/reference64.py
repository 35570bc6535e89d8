"""An independent float64 statement of API.md §1, one (batch, head) at a time, for tests."""

from __future__ import annotations

import math

import torch


def attention64(q, k, v, *, causal=False, scale=None, kv_lengths=None):
    """q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> (o float64 (B, Hq, Nq, D), lse float64 (B, Hq, Nq))."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(b, hq, nq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float64)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    for bi in range(b):
        visible = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            visible &= j <= i + (nk - nq)
        if kv_lengths is not None:
            visible &= j < int(kv_lengths[bi])
        for h in range(hq):
            kh = h // (hq // hkv)
            s = q[bi, h].double().cpu() @ k[bi, kh].double().cpu().T * scale
            s = s.masked_fill(~visible, float("-inf"))
            for r in range(nq):
                if visible[r].any():
                    lse[bi, h, r] = torch.logsumexp(s[r], 0)
                    o[bi, h, r] = torch.softmax(s[r], 0) @ v[bi, kh].double().cpu()
    return o, lse
