"""Shared helpers of the ragged and paged attention tests: packed inputs, paged caches with
poisoned free slots, and the per-sequence checks against kernels.attention and float64."""

from __future__ import annotations

import math

import torch

from kernels import attention
from kernels.reference import reference_attention
from tests.helpers import plain_attention

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def cu_of(lens, device=DEV) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def randn(g, *shape, dtype, device=DEV) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def packed(q_lens, k_lens, hq, hkv, d, dtype, seed=0, device=DEV):
    """q (Tq, Hq, D), k, v (Tk, Hkv, D) and cu_seqlens_q, cu_seqlens_k of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    q = randn(g, sum(q_lens), hq, d, dtype=dtype, device=device)
    k = randn(g, sum(k_lens), hkv, d, dtype=dtype, device=device)
    v = randn(g, sum(k_lens), hkv, d, dtype=dtype, device=device)
    return q, k, v, cu_of(q_lens, device), cu_of(k_lens, device)


def split_rows(t: torch.Tensor, lens) -> list[torch.Tensor]:
    out, at = [], 0
    for n in lens:
        out.append(t[at:at + n])
        at += n
    return out


def paginate(k_seqs, v_seqs, page: int, seed=0, share_prefix_pages=0, spare=3):
    """Pages (P, page, Hkv, D) holding each sequence's keys in shuffled pages, every other slot NaN,
    and the int32 block table (S, max_pages) whose entries past each sequence's pages are garbage.
    With share_prefix_pages = m, sequence 1 reads sequence 0's first m pages (the caller made their
    keys equal) instead of its own."""
    g = torch.Generator().manual_seed(seed)
    ref = k_seqs[0] if k_seqs else None
    dev, dtype = (ref.device, ref.dtype)
    hkv, d = ref.shape[1], ref.shape[2]
    need = [math.ceil(k.shape[0] / page) for k in k_seqs]
    n_pages = sum(need) + spare
    perm = torch.randperm(n_pages, generator=g).tolist()
    k_pages = torch.full((n_pages, page, hkv, d), float("nan"), dtype=dtype, device=dev)
    v_pages = torch.full_like(k_pages, float("nan"))
    width = max(need + [1]) + 2
    table = torch.full((len(k_seqs), width), -1, dtype=torch.int32)
    table[:, 1::2] = n_pages + 1000  # garbage past each sequence's last page: never read
    at = 0
    for s, (k, v) in enumerate(zip(k_seqs, v_seqs, strict=True)):
        for j in range(need[s]):
            if s == 1 and j < share_prefix_pages:
                table[s, j] = table[0, j]
                continue
            p = perm[at]
            at += 1
            table[s, j] = p
            rows = slice(j * page, min((j + 1) * page, k.shape[0]))
            n = rows.stop - rows.start
            k_pages[p, :n], v_pages[p, :n] = k[rows], v[rows]
    return k_pages, v_pages, table.to(dev)


def four(t: torch.Tensor) -> torch.Tensor:
    """(N, H, D) -> (1, H, N, D)."""
    return t.transpose(0, 1).unsqueeze(0)


def check_sequences(o, lse, q, k_seqs, v_seqs, q_lens, *, causal, scale, abs_slack=1e-5, against_attention=True):
    """Each sequence's rows of o (Tq, Hq, D) and lse (Hq, Tq) against float64 (error at most 2x
    plain PyTorch's in the same dtype, plus abs_slack) and against kernels.attention alone."""
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), "o has NaN/inf (an unwritten row, or a poisoned slot read)"
    assert not torch.isnan(lse).any()
    at = 0
    for s, n_q in enumerate(q_lens):
        if n_q == 0:
            continue
        o_s, lse_s, q_s = o[at:at + n_q], lse[:, at:at + n_q], q[at:at + n_q]
        at += n_q
        k_s, v_s = k_seqs[s], v_seqs[s]
        if k_s.shape[0] == 0:
            assert (o_s == 0).all() and torch.isneginf(lse_s).all(), f"sequence {s} has no key: o 0, lse -inf"
            continue
        ref_o, ref_lse = reference_attention(four(q_s).double(), four(k_s).double(), four(v_s).double(),
                                             causal=causal, scale=scale)
        ref_o, ref_lse = ref_o[0].transpose(0, 1), ref_lse[0].to(torch.float64)
        plain = plain_attention(four(q_s), four(k_s), four(v_s), causal=causal, scale=scale)[0].transpose(0, 1)
        err = (o_s.double() - ref_o).abs().max().item()
        err_plain = (plain.double() - ref_o).abs().max().item()
        assert err <= 2 * err_plain + abs_slack, f"sequence {s}: error {err:.3g} > 2 x plain {err_plain:.3g}"
        dead = torch.isinf(ref_lse)
        assert torch.equal(torch.isneginf(lse_s), dead), f"sequence {s}: lse -inf exactly where no key is seen"
        assert (o_s.transpose(0, 1)[dead] == 0).all()
        if (~dead).any():
            lse_err = (lse_s.double()[~dead] - ref_lse[~dead]).abs().max().item()
            assert lse_err <= (1e-5 if q.dtype == torch.float32 else 1e-3), f"sequence {s}: lse error {lse_err}"
        if against_attention:
            a_o, a_lse = attention(four(q_s), four(k_s), four(v_s), causal=causal, scale=scale, return_lse=True)
            tol = 1e-5 if q.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(o_s, a_o[0].transpose(0, 1), atol=tol, rtol=tol)
            live = ~dead
            torch.testing.assert_close(lse_s[live], a_lse[0][live], atol=tol, rtol=tol)


def nan_empty(monkeypatch):
    """Every torch.empty starts as NaN: an element the kernels forget to write stays NaN."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
