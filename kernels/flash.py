"""Launcher of the fast Triton forward (``kernels/_flash_fwd_kernels.py``): checks, allocates, grids.

``flash_forward(q, k, v, *, causal, scale, kv_lengths=None) -> (o, lse)``

q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D), any strides (a ``bnhd`` tensor transposed to ``bhnd`` is
read in place). Two paths:

- prefill: grid (Nq / BLOCK_M, B·Hq); each program holds one Q block and streams all K/V blocks;
- split-KV (flash-decoding): when B·Hq·Nq is too small to fill the GPU and Nk is long, the key
  range is split across grid axis 2, each split writes a partial (o, lse) in float32 and
  ``attn_combine`` merges them with their LSE. For GQA with few queries the program's rows are the
  whole group of query heads of one kv head, so each K/V block is read once per kv head.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from . import _flash_fwd_kernels as kern
from .dispatch import triton_interpret

_INTERPRET_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
SPLIT_KEY_QUANTUM = 256  # keys per split are a multiple of this (a multiple of every BLOCK_N)


def interpreting() -> bool:
    """True when Triton runs its kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return triton_interpret()


def autotune_enabled() -> bool:
    """ATTNSERVE_AUTOTUNE=0 runs each kernel's first config for its head dim instead of tuning
    (fast start-up, e.g. for tests); the default tunes once per key and caches it."""
    return os.environ.get("ATTNSERVE_AUTOTUNE", "1") not in ("", "0")


_frozen = False


def freeze_autotuning(frozen: bool = True) -> None:
    """After a service's warm-up: a key the autotuner has not tuned yet runs its first pruned config
    instead of being tuned on the request path (tuning compiles and times every config: seconds,
    while the requests behind it wait). Keys tuned at warm-up keep their tuned config."""
    global _frozen
    _frozen = frozen


def _tuned_already(tuned, args: tuple, meta: dict) -> bool:
    """Whether ``tuned`` (a triton Autotuner) has a config for this launch's key; the key is built
    exactly as triton 3.6's ``Autotuner.run`` builds it (key args, then every tensor's dtype)."""
    all_args = {**dict(zip(tuned.arg_names, args, strict=False)), **meta}  # as triton does
    named = {k: v for k, v in all_args.items() if k in tuned.arg_names}
    key = [named[k] for k in tuned.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key) in tuned.cache


def launch(tuned, grid, args: tuple, meta: dict, first_tensor: torch.Tensor) -> None:
    """Run an autotuned kernel: tuned (default), its first pruned config (ATTNSERVE_AUTOTUNE=0, or a
    key not tuned before ``freeze_autotuning()``), or one small config under the interpreter.
    ``grid`` maps a config's kwargs to the grid."""
    raw = tuned.fn
    if interpreting():
        raw[grid(_INTERPRET_CFG)](*args, **meta, **_INTERPRET_CFG)
    elif not autotune_enabled() or (_frozen and not _tuned_already(tuned, args, meta)):
        cfg = tuned.early_config_prune(tuned.configs, {"Q": first_tensor}, **meta)[0]
        raw[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)
    else:
        tuned[grid](*args, **meta)


def _bucket(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def block_d(d: int) -> int:
    """D padded to a power of two of at least 16 (the smallest tl.dot size)."""
    return max(16, triton.next_power_of_2(d))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
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


def plan(b: int, hq: int, hkv: int, n_q: int, n_k: int, device: torch.device,
         num_splits: int | None = None) -> tuple[int, int, int]:
    """(pack, splits, keys_per_split) for a problem: pack GQA groups when queries are few; split
    the key range of decode-like problems (few query rows) when one batch element's grid would leave
    SMs idle and there are enough keys to share.

    The plan never depends on the batch size ``b``: the service concatenates requests along B, and
    a request's answer in a batch must be bit for bit its answer alone (a different split count
    would sum the keys in another order)."""
    del b  # see above
    group = hq // hkv
    pack = group if (group > 1 and n_q * group <= 64) else 1
    if num_splits is None:
        decode_like = pack > 1 or n_q <= 64
        programs = (hq // pack) * triton.cdiv(pack * n_q, 16)  # per batch element
        target = 2 * _num_sms(device)
        if not decode_like or programs >= target or n_k < 2 * SPLIT_KEY_QUANTUM:
            num_splits = 1
        else:
            num_splits = min(triton.cdiv(target, programs), n_k // SPLIT_KEY_QUANTUM, 64)
    num_splits = max(1, min(num_splits, triton.cdiv(n_k, SPLIT_KEY_QUANTUM), 64))
    kps = triton.cdiv(triton.cdiv(n_k, num_splits), SPLIT_KEY_QUANTUM) * SPLIT_KEY_QUANTUM
    return pack, triton.cdiv(n_k, kps), kps


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32. ``num_splits`` forces the number
    of key splits (tests); None lets ``plan`` choose."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype and k.shape == v.shape and hq % hkv == 0 and d <= 256
    dev = q.device
    o = torch.empty(b, hq, n_q, d, dtype=q.dtype, device=dev)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=dev)
    kv_len = kv_length_arg(kv_lengths, n_k, dev)
    pack, splits, kps = plan(b, hq, hkv, n_q, n_k, dev, num_splits)
    bd = block_d(d)
    rows = pack * n_q
    if splits == 1:
        o_out, lse_out = o, lse
        so = (0, *o.stride())
        sl = (0, *lse.stride())
    else:
        o_out = torch.empty(splits, b, hq, n_q, d, dtype=torch.float32, device=dev)
        lse_out = torch.empty(splits, b, hq, n_q, dtype=torch.float32, device=dev)
        so, sl = o_out.stride(), lse_out.stride()
    args = (
        q, k, v, o_out, lse_out, kv_len,
        *q.stride(), *k.stride(), *v.stride(), *so, *sl,
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, kps, _bucket(n_q), _bucket(n_k),
    )
    meta = dict(
        D=d, BLOCK_D=bd, IS_CAUSAL=bool(causal), HAS_KV_LEN=kv_lengths is not None, PACK=pack,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )

    def grid(cfg):
        return (triton.cdiv(rows, cfg["BLOCK_M"]), b * (hq // pack), splits)

    tuned = kern.attn_fwd_tuned if splits == 1 and pack == 1 else kern.attn_fwd_split_tuned
    launch(tuned, grid, args, meta, q)
    if splits > 1:
        combine(o_out, lse_out, o, lse)
    return o, lse


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge per-split partials o_part (S, B, Hq, Nq, D) fp32 and lse_part (S, B, Hq, Nq) into o, lse.
    One row's splits are one load; a program takes a few rows once there are many."""
    s, b, hq, n_q, d = o_part.shape
    r = b * hq * n_q
    rows = 1 if r <= 16 * _num_sms(o.device) else 8
    if interpreting():
        rows = 64
    bs = triton.next_power_of_2(s)
    kern.attn_combine[(triton.cdiv(r, rows),)](
        o_part, lse_part, o, lse, *o.stride(), s, r, hq, n_q, rows,
        D=d, BLOCK_D=block_d(d), BLOCK_S=bs, num_warps=8 if bs * block_d(d) > 8192 else 4,
    )


def flops(b: int, hq: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """Forward FLOPs counted as 4·B·Hq·Nq·Nk·D (half of it when causal)."""
    f = 4.0 * b * hq * n_q * n_k * d
    return f / 2 if causal else f


__all__ = ["block_d", "combine", "flash_forward", "flops", "freeze_autotuning", "plan"]
