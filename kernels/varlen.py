"""Ragged (varlen) attention: S sequences of different lengths packed along one token axis, each
attended alone, in one launch (flash-attn's ``flash_attn_varlen_func`` conventions,
docs/api.md#ragged-and-paged-batches).

    from kernels import attention_varlen
    o, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, return_lse=True)
"""

from __future__ import annotations

import torch

from .masks import check_masks
from .ragged import choose_ragged, flash_ragged, no_backward, on_device, reference_ragged
from .ragged_checks import (
    SeqLensError,
    check_cu,
    check_heads,
    check_index,
    check_max_seqlen,
    check_tensor3,
    host_ints,
)
from .spec import check_causal, check_scale


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of each of S packed sequences alone.

    q: (total_q, heads_q, headdim); k, v: (total_k, heads_kv, headdim), heads_q % heads_kv == 0;
    cu_seqlens_q, cu_seqlens_k: int32 (S + 1,) on q's device, sequence s being rows
    cu[s]:cu[s+1] of each (0 first, non-decreasing, ending at total_q / total_k; a sequence may be
    empty). causal is bottom-right aligned within each sequence: query i of a sequence with n_q
    queries and n_k keys sees key j iff j <= i + n_k - n_q. Returns o (total_q, heads_q, headdim)
    in q's dtype, and with return_lse also lse float32 (heads_q, total_q); rows that see no key
    give o = 0 and lse = -inf. Each sequence's o and lse are bit for bit those of the sequence
    alone (``kernels/ragged.py``). The lengths are read on the host: one small device-to-host copy.
    kernel: "auto", "flash" (Triton; CUDA or TRITON_INTERPRET=1) or "reference" (one PyTorch call
    per sequence). No backward: with inputs that require grad, a backward through the answer raises.
    window_size, softcap, alibi_slopes: as ``kernels.attention``'s (docs/kernels.md#score-modifiers),
    with each sequence's own n_q and n_k aligning its rows; alibi_slopes float32 (Hq,) or (S, Hq).
    max_seqlen_q, max_seqlen_k: flash-attn's bounds on the longest sequence, for code written for
    ``flash_attn_varlen_func``; the plan reads the lengths themselves, so a bound is only checked
    (one under the longest sequence is a SeqLensError: flash-attn would skip rows past it).
    """
    q, k, v = check_tensor3("q", q), check_tensor3("k", k), check_tensor3("v", v)
    _, _, d = check_heads(q, k, v)
    scale, causal = check_scale(scale, d), check_causal(causal)
    cu_q = check_index("cu_seqlens_q", cu_seqlens_q, 1, q.device, SeqLensError, "[S + 1]")
    cu_k = check_index("cu_seqlens_k", cu_seqlens_k, 1, q.device, SeqLensError, "[S + 1]")
    if cu_q.shape != cu_k.shape:
        raise SeqLensError(f"cu_seqlens_q and cu_seqlens_k must both have S + 1 entries, got "
                           f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    masks = check_masks(window_size, softcap, alibi_slopes, rows=cu_q.shape[0] - 1, heads_q=q.shape[1],
                        device=q.device, causal=causal, rows_name="S")
    impl = choose_ragged("varlen", q.device, q.dtype, kernel)
    cq, ck = host_ints(cu_q, cu_k)
    q_lens = check_cu("cu_seqlens_q", cq, q.shape[0], "query rows")
    k_lens = check_cu("cu_seqlens_k", ck, k.shape[0], "key rows")
    check_max_seqlen("max_seqlen_q", max_seqlen_q, q_lens)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, k_lens)
    with torch.no_grad():
        if impl == "flash":
            with on_device(q.device):
                o, lse = flash_ragged(q, k, v, q_lens, k_lens, causal=causal, scale=scale, k_starts=ck[:-1],
                                      masks=masks)
        else:
            o, lse = reference_ragged(q, q_lens, lambda s: (k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]),
                                      causal=causal, scale=scale, masks=masks)
    o, lse = no_backward("attention_varlen", o, lse, q, k, v, alibi_slopes)
    return (o, lse) if return_lse else o

