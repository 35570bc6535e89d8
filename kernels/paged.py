"""Paged attention over a KV cache kept in fixed-size pages, and the append that fills it
(flash-attn's ``flash_attn_with_kvcache`` conventions, docs/api.md#ragged-and-paged-batches).

    from kernels import append_paged, attention_paged
    append_paged(k_pages, v_pages, block_table, cache_lens, k_new, v_new, cu_seqlens_new)
    o = attention_paged(q, k_pages, v_pages, block_table, cache_lens + n_new, cu_seqlens_q)

Pages are [P, page_tokens, Hkv, D]; key j of sequence s lives at page ``block_table[s, j //
page_tokens]``, row ``j % page_tokens``. Decode, chunked prefill and a mix of both go through one
call: ``kernels/ragged.py`` plans each sequence alone (batch invariance) and the kernels look the
pages up once a key block where page_tokens is a multiple of the block (``ragged.page_block``), else
key by key, so any page size works; slots past a sequence's length are never read.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import ShapeError
from .masks import check_masks
from .ragged import choose_ragged, flash_ragged, no_backward, on_device, reference_ragged
from .ragged_checks import (
    BlockTableError,
    SeqLensError,
    check_cu,
    check_heads,
    check_index,
    check_tensor3,
    host_ints,
)
from .spec import check_causal, check_scale


def _check_pages(k_pages: object, v_pages: object) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must have 4 dims [P, page_tokens, Hkv, D], got shape {list(t.shape)}")
        if t.shape[0] < 1 or t.shape[1] < 1:
            raise ShapeError(f"{name} needs at least one page of at least one token, got shape {list(t.shape)}")
    return k_pages, v_pages


def _check_table(block_table: object, cache_lens: object, n_seq: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    bt = check_index("block_table", block_table, 2, device, BlockTableError, "[S, max_pages]")
    cl = check_index("cache_lens", cache_lens, 1, device, SeqLensError, "[S]")
    if bt.shape[0] != n_seq or cl.shape[0] != n_seq:
        raise SeqLensError(f"block_table [S, max_pages] and cache_lens [S] must have S = {n_seq} rows (one per "
                           f"sequence of cu_seqlens), got {list(bt.shape)} and {list(cl.shape)}")
    return bt, cl


def _bad_entries(block_table: torch.Tensor, cache_lens: torch.Tensor, page: int, n_pages: int) -> torch.Tensor:
    """(S, max_pages) bool, on the table's device: the entries a sequence reads (its first
    cdiv(cache_lens[s], page)) that name no page. Computed where the table is, so that a GPU call
    learns whether any is bad in the one device-to-host copy it makes anyway (``host_ints``)."""
    need = (cache_lens.long().clamp(min=0) + page - 1) // page
    cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need[:, None]
    return cols & ((block_table < 0) | (block_table >= n_pages))


def _any_bad_host(block_table: torch.Tensor, lens: list[int], page: int, n_pages: int) -> bool:
    """Whether an entry a sequence reads names no page, for a CPU table: row by row for a few
    sequences (one numpy reduction a row, where a vectorised mask costs ten calls), else at once.
    Read as uint32, a negative index is at least 2**31, past any page count."""
    bt = block_table.numpy()
    need = [-(-max(n, 0) // page) for n in lens]
    if len(need) <= 16:
        unsigned = bt.view(np.uint32)
        return any(k and unsigned[s, :k].max() >= n_pages for s, k in enumerate(need))
    cols = np.arange(bt.shape[1])[None, :] < np.asarray(need)[:, None]
    return bool((cols & ((bt < 0) | (bt >= n_pages))).any())


def _check_coverage(lens: list[int], block_table: torch.Tensor, page: int, n_pages: int, what: str,
                    bad: torch.Tensor | None = None, any_bad: bool | None = None) -> None:
    """Every sequence's table row holds its first cdiv(lens[s], page) pages, and (``any_bad``, with
    ``_bad_entries``' mask ``bad``; for a CPU table computed here unless given) those entries name
    existing pages."""
    max_pages = block_table.shape[1]
    need = [-(-n // page) for n in lens]
    short = next((s for s, n in enumerate(need) if n > max_pages), None)
    if short is not None:
        raise BlockTableError(f"sequence {short} needs {need[short]} pages for {lens[short]} keys {what} "
                              f"(page_tokens {page}) but block_table has {max_pages} columns")
    if any_bad is None and block_table.device.type == "cpu" and need:
        bad = _bad_entries(block_table, torch.tensor(lens), page, n_pages)
        any_bad = bool(bad.any())
    if any_bad:
        s, j = bad.nonzero()[0].tolist()  # the error path only: its own copy
        raise BlockTableError(f"block_table[{s}, {j}] = {int(block_table[s, j])} names no page "
                              f"(there are {n_pages}, indices 0..{n_pages - 1})")


def attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    host_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of S sequences' newest query rows over their keys in a paged cache.

    q: (total_q, heads_q, headdim), sequence s being rows cu_seqlens_q[s]:cu_seqlens_q[s+1];
    k_pages, v_pages: (num_pages, page_tokens, heads_kv, headdim), any page_tokens >= 1;
    block_table: int32 (S, max_pages), page indices in any order (pages may be shared; entries past
    a sequence's last page are ignored); cache_lens: int32 (S,), every key of sequence s, its query
    rows' own included; cu_seqlens_q: int32 (S + 1,). All index tensors on q's device. The n_s query
    rows of sequence s are aligned bottom-right, as ``attention``'s: with causal, row i sees keys
    j <= i + cache_lens[s] - n_s (a query of more rows than keys, e.g. a q-only step against few
    cached keys, has first rows that see none). Slots past cache_lens[s] are never read.
    Returns o (total_q, heads_q, headdim) in q's dtype and, with return_lse, lse float32
    (heads_q, total_q); rows that see no key give o = 0 and lse = -inf. Each sequence's answer is
    bit for bit its answer alone. cu_seqlens_q and cache_lens are read on the host (one small copy,
    which also says whether a page index the call reads names no page: checked on every device).
    host_index: (cu_seqlens_q, cache_lens, block_table) as CPU tensors holding the same values as
    the ones on q's device, for a caller that keeps them on the host anyway (a KV cache's table):
    the call then checks and plans from these and reads nothing back from the device (no device
    sync; the plan, a function of each sequence's own lengths, is the same). With q on the CPU,
    host_index must equal the tensors (compared: a copy that differs is refused).
    kernel: "auto", "flash", "reference". No backward: with inputs that require grad, a backward
    through the answer raises.
    window_size, softcap, alibi_slopes: as ``kernels.attention``'s (docs/kernels.md#score-modifiers),
    row i of sequence s at position i + cache_lens[s] - n_s; alibi_slopes float32 (Hq,) or (S, Hq).
    """
    q = check_tensor3("q", q)
    k_pages, v_pages = _check_pages(k_pages, v_pages)
    _, _, d = check_heads(q, k_pages, v_pages, "k_pages, v_pages")
    scale, causal = check_scale(scale, d), check_causal(causal)
    cu_q = check_index("cu_seqlens_q", cu_seqlens_q, 1, q.device, SeqLensError, "[S + 1]")
    bt, cl = _check_table(block_table, cache_lens, cu_q.shape[0] - 1, q.device)
    masks = check_masks(window_size, softcap, alibi_slopes, rows=cu_q.shape[0] - 1, heads_q=q.shape[1],
                        device=q.device, causal=causal, rows_name="S")
    impl = choose_ragged("paged", q.device, q.dtype, kernel)
    page = k_pages.shape[1]
    if host_index is None:
        bad = _bad_entries(bt, cl, page, k_pages.shape[0])  # on a GPU: rides on the lengths' one copy
        cq, lens, flag = host_ints(cu_q, cl, bad.any().to(torch.int32).reshape(1))
        any_bad, checked = bool(flag[0]), bt
    else:
        h_cu, h_cl, checked = _check_host_index(host_index, cu_q, cl, bt)
        cq, lens = h_cu.tolist(), h_cl.tolist()
        any_bad = _any_bad_host(checked, lens, page, k_pages.shape[0])
        bad = _bad_entries(checked, h_cl, page, k_pages.shape[0]) if any_bad else None  # the error path's mask
    q_lens = check_cu("cu_seqlens_q", cq, q.shape[0], "query rows")
    neg = next((s for s, n in enumerate(lens) if n < 0), None)
    if neg is not None:
        raise SeqLensError(f"cache_lens[{neg}] = {lens[neg]}: a sequence's key count must be >= 0")
    _check_coverage(lens, checked, page, k_pages.shape[0], "", bad, any_bad)
    if host_index is not None and q.device.type == "cpu":  # what the kernels read is on the host too: compare
        for given, own, name in zip(host_index, (cu_q, cl, bt), ("cu_seqlens_q", "cache_lens", "block_table"),
                                    strict=True):
            if not torch.equal(given, own):
                error = BlockTableError if name == "block_table" else SeqLensError
                raise error(f"host_index's {name} does not hold the values of {name} (it must be their host copy)")
    with torch.no_grad():
        if impl == "flash":
            with on_device(q.device):
                o, lse = flash_ragged(q, k_pages, v_pages, q_lens, lens, causal=causal, scale=scale,
                                      block_table=bt, masks=masks)
        else:
            def keys(s: int) -> tuple[torch.Tensor, torch.Tensor]:
                return gather_pages(k_pages, bt[s], lens[s]), gather_pages(v_pages, bt[s], lens[s])

            o, lse = reference_ragged(q, q_lens, keys, causal=causal, scale=scale, masks=masks)
    o, lse = no_backward("attention_paged", o, lse, q, k_pages, v_pages, alibi_slopes)
    return (o, lse) if return_lse else o


_CPU = torch.device("cpu")


def _check_host_index(host_index: object, cu_q: torch.Tensor, cl: torch.Tensor,
                      bt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``attention_paged``'s host_index: int32 CPU tensors of the device ones' shapes."""
    if not isinstance(host_index, (tuple, list)) or len(host_index) != 3:
        raise SeqLensError("host_index must be (cu_seqlens_q, cache_lens, block_table), CPU tensors")
    for t, like, name in zip(host_index, (cu_q, cl, bt), ("cu_seqlens_q", "cache_lens", "block_table"), strict=True):
        if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu" and t.shape == like.shape:
            continue  # the usual case; the messages below are built only for a bad one
        error = BlockTableError if name == "block_table" else SeqLensError
        check_index(f"host_index's {name}", t, like.dim(), _CPU, error, str(list(like.shape)))
        raise error(f"host_index's {name} has shape {list(t.shape)}, the device one {list(like.shape)}")
    return tuple(host_index)


def gather_pages(pages: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n keys of one sequence, (n, Hkv, D), from pages (P, page_tokens, Hkv, D)."""
    page = pages.shape[1]
    idx = table_row[: -(-n // page)].long()
    return pages.index_select(0, idx).reshape(-1, *pages.shape[2:])[:n]


def append_paged(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cu_seqlens_new: torch.Tensor,
    kernel: str = "auto",
) -> None:
    """Write new keys and values into the pages, in place, in one launch.

    k_new, v_new: (total_new, heads_kv, headdim), sequence s being rows
    cu_seqlens_new[s]:cu_seqlens_new[s+1] (possibly none); they go to positions cache_lens[s],
    cache_lens[s] + 1, ... of sequence s (key j at page block_table[s, j // page_tokens], row
    j % page_tokens). cache_lens is the length before the append and is not changed; no other slot
    is touched. k_pages, v_pages, block_table as for ``attention_paged``.
    On CUDA (and under TRITON_INTERPRET=1) one Triton kernel writes every row and reads no index on
    the host (no device sync): a position outside the table or a page index out of range is
    dropped there, not written. On the CPU the indices are checked first and one index_put per
    tensor writes the rows. kernel: "auto", "flash" (the Triton kernel), "reference" (index_put).
    """
    k_pages, v_pages = _check_pages(k_pages, v_pages)
    k_new, v_new = check_tensor3("k_new", k_new), check_tensor3("v_new", v_new)
    if tuple(v_new.shape) != tuple(k_new.shape) or tuple(k_new.shape[1:]) != tuple(k_pages.shape[2:]):
        raise ShapeError(f"k_new, v_new [T, Hkv, D] must match each other and the pages' [Hkv, D] = "
                         f"{list(k_pages.shape[2:])}, got {list(k_new.shape)} and {list(v_new.shape)}")
    check_heads(k_new, k_pages, v_pages, "k_pages, v_pages")
    check_heads(v_new, k_new, k_new, "k_new")
    dev = k_pages.device
    cu = check_index("cu_seqlens_new", cu_seqlens_new, 1, dev, SeqLensError, "[S + 1]")
    bt, cl = _check_table(block_table, cache_lens, cu.shape[0] - 1, dev)
    impl = choose_ragged("paged append", dev, k_pages.dtype, kernel)
    if cu.shape[0] < 1:
        raise SeqLensError("cu_seqlens_new must have S + 1 >= 1 entries")
    page, n_pages = k_pages.shape[1], k_pages.shape[0]
    if dev.type == "cpu":
        cn, lens = host_ints(cu, cl)
        new = check_cu("cu_seqlens_new", cn, k_new.shape[0], "new rows")
        if any(n < 0 for n in lens):
            raise SeqLensError(f"cache_lens must be >= 0, got {min(lens)}")
        _check_coverage([a + b for a, b in zip(lens, new, strict=True)], bt, page, n_pages, "after the append")
    if k_new.shape[0] == 0:
        return
    with torch.no_grad():
        if impl == "flash":
            with on_device(dev):
                _append_triton(k_pages, v_pages, bt, cl, k_new, v_new, cu)
        else:
            seq = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=dev), (cu[1:] - cu[:-1]).long())
            pos = cl.long()[seq] + torch.arange(k_new.shape[0], device=dev) - cu.long()[seq]
            pg, row = bt.long()[seq, pos // page], pos % page
            k_pages.index_put_((pg, row), k_new)
            v_pages.index_put_((pg, row), v_new)


def _append_triton(k_pages, v_pages, bt, cl, k_new, v_new, cu) -> None:
    from .jit.paged import paged_append
    from .ragged import plain_launcher

    n_seq = cu.shape[0] - 1
    hkv, d = k_new.shape[1], k_new.shape[2]
    args = (k_new, v_new, k_pages, v_pages, bt, cl, cu, *k_new.stride(), *v_new.stride(), *k_pages.stride(),
            *v_pages.stride(), *bt.stride(), n_seq, max(1, n_seq.bit_length()), bt.shape[1], k_pages.shape[0], hkv)
    consts = dict(D=d, BLOCK_H=1 << (hkv - 1).bit_length(), BLOCK_D=1 << (d - 1).bit_length(), PAGE=k_pages.shape[1])
    plain_launcher()(paged_append, (k_new.shape[0], 1, 1), args, consts, num_warps=4)
