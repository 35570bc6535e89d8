"""Plain-PyTorch attention: the reference, and an exact blockwise CPU path with O(N) memory.

Both take q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D), accumulate in float32 (float64 stays float64)
and return (o, lse) with o in q's dtype and lse float32 (B, Hq, Nq). Both support autograd, and
the score modifiers of ``kernels/masks.py`` (window, softcap, ALiBi).
"""

from __future__ import annotations

import math

import torch

from .masks import BASE2_LIMIT, NO_MASKS, Masks, as_float32, modify_scores, visible


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
    masks: Masks = NO_MASKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialises S (B, Hq, Nq, Nk): the plainest correct statement of the contract."""
    acc = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    n_q, n_k = q.shape[2], k.shape[2]
    qf = q.to(acc)
    kf = _zero_padding(_expand_kv(k, group).to(acc), kv_lengths, 0)
    vf = _zero_padding(_expand_kv(v, group).to(acc), kv_lengths, 0)
    s = _as_kernels_see(torch.matmul(qf, kf.transpose(-1, -2)) * scale)  # (B, Hq, Nq, Nk)
    if masks.softcap > 0 or masks.alibi is not None:
        r, c = torch.arange(n_q, device=q.device), torch.arange(n_k, device=q.device)
        s = modify_scores(s, r, c, n_q, n_k, masks)
        if masks.alibi is not None:  # a bias may push a score past the kernels' range too
            s = _as_kernels_see(s)
    mask = _mask(n_q, n_k, 0, 0, n_q, n_k, causal, kv_lengths, q.device, masks)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    o, lse = _finish(s, vf)
    return o.to(q.dtype), lse.to(torch.float32)


def _as_kernels_see(s: torch.Tensor) -> torch.Tensor:
    """Scaled scores as the Triton kernels see them: they work in log2 units, where a score past
    ±BASE2_LIMIT (~2.36e38, finite in float32) is ±inf, so here too (docs/api.md: the infinity rules)."""
    if s.numel() == 0:
        return s
    low, high = torch.aminmax(s)  # one pass, no |s| copy (a NaN fails both tests: left as it is)
    if not bool((high > BASE2_LIMIT) | (low < -BASE2_LIMIT)):
        return s
    return s.masked_fill(s > BASE2_LIMIT, math.inf).masked_fill(s < -BASE2_LIMIT, -math.inf)


def _mask(
    rows: int, cols: int, r0: int, c0: int, n_q: int, n_k: int, causal: bool,
    kv_lengths: torch.Tensor | None, device: torch.device, masks: Masks = NO_MASKS,
) -> torch.Tensor | None:
    """Bool (B|1, 1, rows, cols) tile at (r0, c0) of the (n_q, n_k) visibility mask, or None."""
    c = torch.arange(c0, c0 + cols, device=device)
    # bottom-right alignment (causal and the window): the last query sees the last key
    mask = visible(torch.arange(r0, r0 + rows, device=device), c, n_q, n_k, causal, masks)
    if mask is not None:
        mask = mask[None, None]
    if kv_lengths is not None:
        pad = (c[None, :] < kv_lengths.to(device=device, dtype=torch.int64)[:, None])[:, None, None, :]
        mask = pad if mask is None else mask & pad
    return mask


def _zero_padding(v: torch.Tensor, kv_lengths: torch.Tensor | None, c0: int) -> torch.Tensor:
    """v (or k) (B, H, n, D), keys c0.. of the call, with the rows at positions >= kv_lengths[b]
    set to 0: padding may hold anything (``torch.empty``, NaN), and a masked key's p = 0 times NaN
    would still be NaN in p @ v; in the backward, a masked score's dS = 0 times a NaN key would be
    NaN in dQ = dS K (and a soft cap's tanh of a NaN score NaN in dK)."""
    if kv_lengths is None:
        return v
    c = torch.arange(c0, c0 + v.shape[2], device=v.device)
    pad = c[None, :] >= kv_lengths.to(device=v.device, dtype=torch.int64)[:, None]  # (B, n)
    return v.masked_fill(pad[:, None, :, None], 0.0)


def _finish(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax(s) @ v with fully masked rows giving o = 0, lse = -inf (never NaN)."""
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
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
    masks: Masks = NO_MASKS,
    max_block_elems: int = 1 << 22,
    block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's tiling + online softmax in PyTorch: never holds more than one S block per batch
    element. Key blocks outside every row's causal range or window are never visited.

    Extra memory is O(B·H·(Nq·D + block)), with a block of at most ``max_block_elems`` scores
    per batch element. The tiles never depend on B: a batched answer is the answer alone.
    """
    acc = _acc_dtype(q.dtype)
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    group = hq // hkv
    block_k = min(n_k, block_k)
    block_q = max(1, min(n_q, max_block_elems // max(1, hq * block_k)))
    off = n_k - n_q  # row i's aligned position is i + off
    modify = masks.softcap > 0 or masks.alibi is not None
    o = torch.empty(b, hq, n_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=q.device)
    outs, lses = [], []
    for r0 in range(0, n_q, block_q):
        qi = q[:, :, r0 : r0 + block_q].to(acc)  # (B, Hq, bq, D)
        rows = qi.shape[2]
        m_i = torch.full((b, hq, rows, 1), float("-inf"), dtype=acc, device=q.device)
        l_i = torch.zeros((b, hq, rows, 1), dtype=acc, device=q.device)
        o_i = torch.zeros((b, hq, rows, v.shape[-1]), dtype=acc, device=q.device)
        # the keys some row of the block sees: [c_lo, c_hi)
        c_lo = max(0, r0 + off - masks.left) if masks.left >= 0 else 0
        c_hi = n_k
        if causal or masks.right >= 0:
            c_hi = min(n_k, r0 + rows - 1 + off + (0 if causal else masks.right) + 1)
        for c0 in range(c_lo // block_k * block_k, max(c_hi, 0), block_k):
            kj = _zero_padding(_expand_kv(k[:, :, c0 : c0 + block_k], group).to(acc), kv_lengths, c0)
            vj = _zero_padding(_expand_kv(v[:, :, c0 : c0 + block_k], group).to(acc), kv_lengths, c0)
            # scaled after the product, as the other kernels: q · scale alone may pass float32's range
            s = _as_kernels_see(torch.matmul(qi, kj.transpose(-1, -2)).mul_(scale))  # S_ij (B, Hq, bq, bk)
            if modify:
                s = modify_scores(s, torch.arange(r0, r0 + rows, device=q.device),
                                  torch.arange(c0, c0 + kj.shape[2], device=q.device), n_q, n_k, masks)
                if masks.alibi is not None:  # a bias may push a score past the kernels' range too
                    s = _as_kernels_see(s)
            mask = _mask(rows, kj.shape[2], r0, c0, n_q, n_k, causal, kv_lengths, q.device, masks)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            # online softmax, the seed's steps: m_new, alpha, p, l_new, O update
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m_i - m_safe)
            p = torch.exp(s - m_safe)
            l_i = alpha * l_i + p.sum(dim=-1, keepdim=True)
            o_i = alpha * o_i + torch.matmul(p, vj)
            m_i = m_new
        l_safe = torch.where(l_i > 0, l_i, torch.ones_like(l_i))
        m_safe = torch.where(m_i == float("-inf"), torch.zeros_like(m_i), m_i)
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


def _sdpa_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash kernel (O(N) memory, GQA native); ``causal`` is top-left aligned."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return o, lse.to(torch.float32)


def _empty_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) = (0, -inf) of ``rows`` rows that see no key: o (B, H, rows, D), lse (B, H, rows)."""
    b, h, _, d = q.shape
    o = q.new_zeros(b, h, rows, d)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # a graph to q, k, v with zero gradients (as flash's), so that a call in which no row sees a key
        # still differentiates: sums over empty slices are exactly 0, whatever q, k, v hold
        o = o + (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum())
    return o, torch.full((b, h, rows), float("-inf"), dtype=torch.float32, device=q.device)


def _sdpa_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, off: int | None, scale: float,
                 grad: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows i see keys j <= i + off (off None: every key). None when it needs an LSE merge under
    autograd (torch's CPU kernel gives no gradient through its lse)."""
    n_q, n_k = q.shape[2], k.shape[2]
    if n_k == 0:
        return _empty_rows(q, k, v, n_q)
    if off is None or off >= n_k - 1:
        return _sdpa_cpu(q, k, v, False, scale)
    r0 = min(max(-off, 0), n_q)           # rows that see no key at all
    parts = [_empty_rows(q, k, v, r0)] if r0 else []
    if r0 < n_q:
        qr, off = q[:, :, r0:], off + r0      # now off >= 0
        if off >= n_k - 1:
            parts.append(_sdpa_cpu(qr, k, v, False, scale))
        elif off == 0:
            parts.append(_sdpa_cpu(qr, k, v, True, scale))
        else:
            if grad:
                return None
            # keys [0, off) are seen by every row; keys [off, Nk) form a top-left causal square
            o1, l1 = _sdpa_cpu(qr, k[:, :, :off], v[:, :, :off], False, scale)
            o2, l2 = _sdpa_cpu(qr, k[:, :, off:], v[:, :, off:], True, scale)
            m = torch.maximum(l1, l2)
            w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
            o = (w1 * o1.float() + w2 * o2.float()) / (w1 + w2)
            parts.append((o.to(q.dtype), m + torch.log(w1 + w2).squeeze(-1)))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied to a fresh (64-byte-aligned, contiguous) tensor when it starts elsewhere or its
    last dim has a stride other than 1. The CPU's matmuls round by the operand's address, so a view
    into a request body (safetensors puts tensors at any 8-byte offset) would give other bits than the
    same numbers sent over another transport; torch's CPU kernel reads the last dim as if its stride
    were 1 (``F.scaled_dot_product_attention`` copies before it, the private op does not). Autograd
    carries the gradients back through the copy."""
    if t.numel() == 0 or (t.data_ptr() % 64 == 0 and t.stride(-1) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    masks: Masks = NO_MASKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU "auto" path: torch's CPU flash kernel (faster than ``blockwise_attention``; see
    docs/kernels.md#the-cpu-path-referencecpu_attention), made to keep the contract —
    bottom-right causal, kv_lengths (each batch element's keys cut to its length), rows with no
    key -> (0, -inf), batch invariance (one call per batch element, from 64-byte-aligned copies).
    Falls back to ``blockwise_attention`` where that kernel cannot (a causal Nq != Nk split under autograd,
    a causal scale <= 0 in float32, the kernel's arithmetic: its mask's -inf times the scale is NaN or
    +inf, and the score modifiers: torch's kernel takes no window, cap or bias short of an Nq x Nk mask)."""
    # torch's kernel masks before it scales: -inf * 0 is NaN (1e-46 is 0 in its float32)
    if masks.active or (causal and not as_float32(scale) > 0):
        return _blockwise_each(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths, masks=masks)
    if q.shape[0] > 1:  # torch's kernel rounds an element by where it lies in the batch: one call each
        outs = [cpu_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=causal, scale=scale,
                              kv_lengths=None if kv_lengths is None else kv_lengths[b:b + 1])
                for b in range(q.shape[0])]
        return torch.cat([o for o, _ in outs], dim=0), torch.cat([lse for _, lse in outs], dim=0)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return blockwise_attention(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    n_q, n_k = q.shape[2], k.shape[2]
    off = (n_k - n_q) if causal else None
    if kv_lengths is None or bool((kv_lengths >= n_k).all()):
        out = _sdpa_offset(q, k, v, off, scale, grad)
    else:
        rows = []
        for b, length in enumerate(kv_lengths.tolist()):
            sl = slice(b, b + 1)
            rows.append(_sdpa_offset(q[sl], k[sl, :, :length], v[sl, :, :length], off, scale, grad))
        out = None if any(r is None for r in rows) else (
            torch.cat([r[0] for r in rows], dim=0), torch.cat([r[1] for r in rows], dim=0))
    if out is None:
        return blockwise_attention(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
    return _nonfinite_again(out, q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)


def _nonfinite_again(out: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     causal: bool, scale: float,
                     kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` of one batch element (B = 1), answered again by ``blockwise_attention`` when its q, or
    its k, v up to kv_lengths (padding may hold anything), hold a non-finite value, or when a score
    may leave float32 (|q|·|k|·D·|scale| past 1e38): torch's CPU kernel answers a row whose scores
    meet a NaN with o = 0, lse = 0 over a few keys (the contract says NaN), and a row whose only
    score overflowed to -inf with lse = 0 (the contract: no key seen, -inf)."""
    n = k.shape[2] if kv_lengths is None else int(kv_lengths[0])
    qd, kd = q.detach(), k.detach()  # a bound only (no gradient, no warning about one)
    q_max, k_max = float(qd.abs().amax()) if q.numel() else 0.0, float(kd[:, :, :n].abs().amax()) if n else 0.0
    if math.isfinite(q_max) and math.isfinite(k_max) and bool(torch.isfinite(v.detach()[:, :, :n]).all()) \
            and q_max * k_max * q.shape[-1] * abs(scale) < 1e38:
        return out
    return blockwise_attention(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)


def _blockwise_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                    kv_lengths: torch.Tensor | None, masks: Masks) -> tuple[torch.Tensor, torch.Tensor]:
    """``blockwise_attention`` one batch element at a time, each from fresh copies: the CPU's
    matmuls round by the operand's address, so an element's bits must not depend on where it sits
    in the batch (an element alone starts at offset 0)."""
    outs = []
    for b in range(q.shape[0]):
        sl = slice(b, b + 1)
        q_b, k_b, v_b = (t[sl].clone(memory_format=torch.contiguous_format) for t in (q, k, v))
        outs.append(blockwise_attention(q_b, k_b, v_b, causal=causal, scale=scale,
                                        kv_lengths=None if kv_lengths is None else kv_lengths[sl],
                                        masks=masks.sliced(b, b + 1)))
    if len(outs) == 1:
        return outs[0]
    return torch.cat([o for o, _ in outs], dim=0), torch.cat([lse for _, lse in outs], dim=0)
