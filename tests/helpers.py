"""What the tests compare attention answers with: an independent float64 statement of the
attention semantics (``attention64``, one (batch, head) at a time), plain PyTorch in the inputs'
own dtype (the error budget's yardstick: ``plain_attention`` written out, ``plain_pytorch`` through
SDPA with an explicit mask, as a user would write either), flash-attn's score modifiers written out
(``masked64``: window, softcap, ALiBi, in float64 or any dtype), and the budget checks the transports'
tests share (``assert_close_to_reference``, ``assert_close_to_masked``: at most ~2x plain PyTorch's
error, STYLE item 11)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.reference import reference_attention


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


def plain_attention(q, k, v, *, causal, scale, kv_lengths=None):
    """Plain PyTorch in the inputs' own dtype (what a user would write): the error yardstick."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    n_q, n_k = q.shape[2], k.shape[2]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        mask = mask.tril(diagonal=n_k - n_q)
    mask = mask[None, None]
    if kv_lengths is not None:
        mask = mask & (torch.arange(n_k, device=q.device) < kv_lengths[:, None].to(q.device))[:, None, None]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def plain_pytorch(q, k, v, *, causal=False, scale=None, kv_lengths=None):
    """Plain PyTorch in q's dtype (SDPA with an explicit mask): the error budget's yardstick."""
    nq, nk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    j = torch.arange(nk)
    mask = torch.ones(q.shape[0], 1, nq, nk, dtype=torch.bool)
    if causal:
        mask &= (j[None, :] <= torch.arange(nq)[:, None] + nk - nq)[None, None]
    if kv_lengths is not None:
        mask &= (j[None, :] < kv_lengths[:, None].long())[:, None, None, :]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.nan_to_num(o, nan=0.0)


def masked64(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi=None, dtype=torch.float64):
    """(o, lse) of q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) computed in ``dtype``, straight from
    flash-attn's definitions: i_al = i + Nk - Nq; s = softcap·tanh(scale·q·k / softcap) - slope·|i_al - j|;
    key j visible iff causal j <= i_al and i_al - left <= j <= i_al + right (-1: unbounded).
    alibi: (Hq,) or (B, Hq). Rows that see no key: o = 0, lse = -inf."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i_al = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    if alibi is not None:
        slopes = alibi.to(dtype).reshape(-1, hq)[:, :, None, None]
        s = s - slopes * (i_al - j).abs().to(dtype)
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        ok &= j <= i_al
    if window[0] >= 0:
        ok &= j >= i_al - window[0]
    if window[1] >= 0:
        ok &= j <= i_al + window[1]
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v), lse


def assert_close_to_masked(o, q, k, v, **opts):
    """o against ``masked64`` in float64: at most 2x the error of the same formula in q's dtype, plus
    one output rounding (STYLE item 11). opts: causal, scale, window, softcap, alibi. Returns the
    reference (o, lse) for further checks."""
    ref, ref_lse = masked64(q, k, v, **opts)
    plain, _ = masked64(q, k, v, dtype=q.dtype, **opts)
    assert o.shape == q.shape and o.dtype == q.dtype
    err = (o.double() - ref).abs().max().item()
    ulp = torch.finfo(q.dtype).eps * ref.abs().max().item()
    budget = 2 * (plain.double() - ref).abs().max().item() + ulp
    assert err <= budget, f"max error {err:.3g} over budget {budget:.3g}"
    return ref, ref_lse


def assert_close_to_reference(o, q, k, v, *, causal=False, scale=None, kv_lengths=None, lse=None):
    """Error vs a float64 reference at most ~2x that of plain PyTorch in q's dtype (STYLE 11), plus one
    output rounding (the plain error can be near zero on small cases)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    opts = dict(causal=causal, scale=scale, kv_lengths=kv_lengths)
    ref64, lse64 = reference_attention(q.double(), k.double(), v.double(), **opts)
    plain, _ = reference_attention(q, k, v, **opts)
    assert o.shape == q.shape and o.dtype == q.dtype
    err = (o.double() - ref64).abs().max().item()
    ulp = torch.finfo(q.dtype).eps * ref64.abs().max().item()  # one rounding of the output, for tiny cases
    budget = 2 * (plain.double() - ref64).abs().max().item() + ulp
    assert err <= budget, f"max error {err:.3g} over budget {budget:.3g}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        torch.testing.assert_close(lse.double(), lse64.double(), atol=1e-4, rtol=1e-4)
