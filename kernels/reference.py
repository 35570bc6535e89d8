"""Plain-PyTorch attention: the reference, and an exact blockwise CPU path with O(N) memory.

Both take q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D), accumulate in float32 (float64 stays float64)
and return (o, lse) with o in q's dtype and lse float32 (B, Hq, Nq). Both support autograd.
"""

from __future__ import annotations

import torch


def _expand_kv(k: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, Hkv*group, N, D): query head h reads kv head h // group."""
    return k if group == 1 else k.repeat_interleave(group, dim=1)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialises S (B, Hq, Nq, Nk): the plainest correct statement of the contract."""
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    n_q, n_k = q.shape[2], k.shape[2]
    qf, kf, vf = q.to(acc), _expand_kv(k, group).to(acc), _expand_kv(v, group).to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, Hq, Nq, Nk)
    mask = _mask(n_q, n_k, 0, 0, n_q, n_k, causal, kv_lengths, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    o, lse = _finish(s, vf)
    return o.to(q.dtype), lse.to(torch.float32)


def _mask(
    rows: int, cols: int, r0: int, c0: int, n_q: int, n_k: int, causal: bool,
    kv_lengths: torch.Tensor | None, device: torch.device,
) -> torch.Tensor | None:
    """Bool (B|1, 1, rows, cols) window at (r0, c0) of the (n_q, n_k) visibility mask, or None."""
    mask = None
    c = torch.arange(c0, c0 + cols, device=device)
    if causal:
        r = torch.arange(r0, r0 + rows, device=device)
        # bottom-right alignment: the last query sees every key
        mask = (c[None, :] <= r[:, None] + (n_k - n_q))[None, None]
    if kv_lengths is not None:
        pad = (c[None, :] < kv_lengths.to(device=device, dtype=torch.int64)[:, None])[:, None, None, :]
        mask = pad if mask is None else mask & pad
    return mask


def _finish(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax(s) @ v with fully masked rows giving o = 0, lse = -inf (never NaN)."""
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    o = torch.matmul(p, v) / l_safe
    lse = (m_safe + torch.log(l)).squeeze(-1)
    return o, lse


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    max_block_elems: int = 1 << 22,
    block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's tiling + online softmax in PyTorch: never holds more than one S block.

    Extra memory is O(B·H·(Nq·D + block)), with a block of at most ``max_block_elems`` scores.
    """
    acc = _acc_dtype(q.dtype)
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    group = hq // hkv
    block_k = min(n_k, block_k)
    block_q = max(1, min(n_q, max_block_elems // max(1, b * hq * block_k)))
    o = torch.empty(b, hq, n_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=q.device)
    outs, lses = [], []
    for r0 in range(0, n_q, block_q):
        qi = q[:, :, r0 : r0 + block_q].to(acc) * scale  # (B, Hq, bq, D)
        rows = qi.shape[2]
        m_i = torch.full((b, hq, rows, 1), float("-inf"), dtype=acc, device=q.device)
        l_i = torch.zeros((b, hq, rows, 1), dtype=acc, device=q.device)
        o_i = torch.zeros((b, hq, rows, v.shape[-1]), dtype=acc, device=q.device)
        for c0 in range(0, n_k, block_k):
            if causal and c0 > r0 + rows - 1 + (n_k - n_q):
                break  # every later key block is in every row's future
            kj = _expand_kv(k[:, :, c0 : c0 + block_k], group).to(acc)
            vj = _expand_kv(v[:, :, c0 : c0 + block_k], group).to(acc)
            s = torch.matmul(qi, kj.transpose(-1, -2))  # S_ij (B, Hq, bq, bk)
            mask = _mask(rows, kj.shape[2], r0, c0, n_q, n_k, causal, kv_lengths, q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            # online softmax, the seed's steps: m_new, alpha, p, l_new, O update
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m_i - m_safe)
            p = torch.exp(s - m_safe)
            l_i = alpha * l_i + p.sum(dim=-1, keepdim=True)
            o_i = alpha * o_i + torch.matmul(p, vj)
            m_i = m_new
        l_safe = torch.where(l_i > 0, l_i, torch.ones_like(l_i))
        m_safe = torch.where(torch.isfinite(m_i), m_i, torch.zeros_like(m_i))
        out_i = (o_i / l_safe).to(q.dtype)
        lse_i = (m_safe + torch.log(l_i)).squeeze(-1).to(torch.float32)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(out_i)
            lses.append(lse_i)
        else:
            o[:, :, r0 : r0 + rows] = out_i
            lse[:, :, r0 : r0 + rows] = lse_i
    if outs:
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    return o, lse
