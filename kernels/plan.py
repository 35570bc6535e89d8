"""What flash decides about a problem before it launches anything: GQA packing, key splits, the
merge's row tile, padded head dims; and the log line that says which kernel it chose and why.

None of it depends on the batch size B: the service concatenates requests along B, and a request's
answer in a batch must be bit for bit its answer alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import triton

from .launch import interpreting

log = logging.getLogger("attnserve.kernels")

SPLIT_KEY_QUANTUM = 256  # keys per split are a multiple of this (a multiple of every BLOCK_N)


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its JIT wrapper (host time on every call)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` without its constexpr-function wrapper (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _bucket(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def block_d(d: int) -> int:
    """D padded to a power of two of at least 16 (the smallest tl.dot size)."""
    return max(16, _next_pow2(d))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter on a CPU: a small GPU, so that decode shapes take the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _no_lengths(device: torch.device) -> torch.Tensor:
    """A placeholder int32 pointer for kernels launched without kv_lengths."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def kv_length_arg(kv_lengths: torch.Tensor | None, n_k: int, device: torch.device) -> torch.Tensor:
    """The kernels' KV_LEN argument: int32 (B,) clamped to [0, Nk] on the device (``check_inputs``
    refuses out-of-range lengths only on the host, where reading them costs no device sync; the
    kernels' unmasked loop must never run past Nk), or a placeholder when there are none."""
    if kv_lengths is None:
        return _no_lengths(device)
    return kv_lengths.to(device=device, dtype=torch.int32).clamp(0, n_k).contiguous()


def alibi_arg(masks, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """The kernels' ALIBI argument and its (row, head) strides: the float32 slopes (rows, Hq), a
    stride of 0 between rows for one shared set, or a placeholder when there are none."""
    if masks.alibi is None:
        return _no_slopes(device), 0, 0
    slopes = masks.alibi
    return slopes, (0 if slopes.shape[0] == 1 else slopes.stride(0)), slopes.stride(1)


@functools.cache
def _no_slopes(device: torch.device) -> torch.Tensor:
    """A placeholder float32 pointer for kernels launched without ALiBi slopes."""
    return torch.zeros(1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=4096)  # on every call's path: memoised, as its Python costs host time
def plan(b: int, hq: int, hkv: int, n_q: int, n_k: int, device: torch.device,
         num_splits: int | None = None) -> tuple[int, int, int]:
    """(pack, splits, keys_per_split) for a problem: pack GQA groups when queries are few; split
    the key range of decode-like problems (few query rows) when one batch element's grid would leave
    SMs idle and there are enough keys to share.

    The plan never depends on the batch size ``b``: a different split count would sum the keys in
    another order, and a batched answer would differ from the lone one."""
    del b  # see above
    group = hq // hkv
    pack = group if (group > 1 and n_q * group <= 64) else 1
    if num_splits is None:
        decode_like = pack > 1 or n_q <= 64
        programs = (hq // pack) * triton.cdiv(pack * n_q, 16)  # per batch element
        # one wave of split programs per batch element: two waves are slower at every batch size
        # (see docs/benchmarks/kernels.md#decode)
        target = _num_sms(device)
        if not decode_like or programs >= target or n_k < 2 * SPLIT_KEY_QUANTUM:
            num_splits = 1
        else:
            num_splits = min(triton.cdiv(target, programs), n_k // SPLIT_KEY_QUANTUM, 64)
    return (pack, *split_keys(n_k, num_splits))


def split_keys(n_k: int, num_splits: int) -> tuple[int, int]:
    """(splits, keys_per_split) for about ``num_splits`` slices of n_k keys: whole multiples of
    SPLIT_KEY_QUANTUM keys each, 1 to 64 slices, none empty."""
    num_splits = max(1, min(num_splits, triton.cdiv(n_k, SPLIT_KEY_QUANTUM), 64))
    kps = triton.cdiv(triton.cdiv(n_k, num_splits), SPLIT_KEY_QUANTUM) * SPLIT_KEY_QUANTUM
    return triton.cdiv(n_k, kps), kps


def merge_rows_per_program(hq: int, n_q: int, d: int, device: torch.device) -> int:
    """Rows ``attn_combine`` merges per program: one while a batch element's Hq·Nq rows alone fill
    the GPU a few times over, else a few. Never from B: the row tile decides how each row's splits
    are summed (8 rows sum 16 splits in two chunks of 8), so a batched answer would differ from a
    lone one."""
    if interpreting():
        return 64
    return 1 if hq * n_q <= 16 * _num_sms(device) else max(1, min(8, 4096 // block_d(d)))


def _combine_launch(o_part, lse_part, o, lse, after_split_kernel: bool = False) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of attn_combine merging o_part (S, B, Hq, Nq, D) fp32 and lse_part
    (S, B, Hq, Nq) into o (B, Hq, Nq, D), lse (B, Hq, Nq). ``after_split_kernel``: launched as a
    programmatic dependent of the split kernel (``launch_pdl=True``), so it waits for it first."""
    s, b, hq, n_q, d = o_part.shape
    r = b * hq * n_q
    rows = merge_rows_per_program(hq, n_q, d, o.device)
    args = (o_part, lse_part, o, lse, *o.stride(), s, r, hq, n_q)
    return (_cdiv(r, rows),), args, dict(D=d, BLOCK_D=block_d(d), BLOCK_S=_next_pow2(s), RB=rows,
                                      PDL=after_split_kernel)


_told: set[tuple] = set()  # (problem class, kernel, refusals) already logged


def tell(q: torch.Tensor, k: torch.Tensor, causal: bool, has_kv_len: bool, pack: int, splits: int,
         kernel: str, refusals: Callable[[], dict[str, str]]) -> None:
    """Log (INFO, once per distinct line) which kernel flash chose for a problem class and why the
    faster ones refused it, as ``dispatch.choose`` logs its backend. Called only where a launch is
    worked out anew (a launch signature or a recipe seen for the first time), never on a cached
    call; ``refusals`` runs only when the line is logged. The class leaves out B, Nq and Nk, so a
    decode whose key count grows logs once."""
    if not log.isEnabledFor(logging.INFO):
        return
    hq, d = q.shape[1], q.shape[3]
    shape = ("prefill" if pack == 1 and splits == 1 else "decode ("
             + ", ".join(x for x, on in (("GQA rows packed", pack > 1), ("keys split", splits > 1)) if on) + ")")
    problem = (f"{str(q.dtype).replace('torch.', '')} Hq {hq} Hkv {k.shape[1]} D {d} {shape}"
               f"{' causal' if causal else ''}{' kv_lengths' if has_kv_len else ''} on {q.device.type}")
    refused = "; ".join(f"{name}: {why}" for name, why in refusals().items()) or "none"
    key = (problem, kernel, refused)
    if key in _told:
        return
    if len(_told) >= 4096:
        _told.clear()
    _told.add(key)
    log.info("flash kernel for %s: %s (refused: %s)", problem, kernel, refused)
