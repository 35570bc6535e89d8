"""Launcher of the fast Triton forward (``kernels/jit/flash_fwd.py``): checks, allocates, grids.

``flash_forward(q, k, v, *, causal, scale, kv_lengths=None) -> (o, lse)``

q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D), any strides (a ``bnhd`` tensor transposed to ``bhnd`` is
read in place). Two paths:

- prefill: grid (Nq / BLOCK_M, B·Hq); each program holds one Q block and streams all K/V blocks;
- split-KV (flash-decoding): when B·Hq·Nq is too small to fill the GPU and Nk is long, the key
  range is split across grid axis 2, each split writes a partial (o, lse) in float32 and
  ``attn_combine`` merges them with their LSE. For GQA with few queries the program's rows are the
  whole group of query heads of one kv head, so each K/V block is read once per kv head.

On a Hopper GPU the Gluon kernels take the 16-bit problems they fit (``attn_fwd_ws``: prefill at
D 128, ``gluon_path``; ``attn_decode``: packed or split decode, ``decode_path``). Their launches are
worked out once per problem (``_DecodeRecipe``, ``_GluonRecipe``, keyed in ``_recipe``); every
cached launch goes straight to Triton's compiled launcher (``_run``). Host time is what an eager
decode waits on (docs/kernels.md, "Launch cache").
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.interpreter import InterpretedFunction

from .jit import flash_fwd as kern
from .jit import gluon_decode as kern_decode
from .jit import gluon_fwd as kern_gluon

_INTERPRET_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
SPLIT_KEY_QUANTUM = 256  # keys per split are a multiple of this (a multiple of every BLOCK_N)


def interpreting() -> bool:
    """True when Triton runs these kernels on the CPU. Triton decides it as it defines a kernel
    (``TRITON_INTERPRET=1`` at import), so this is read once, from the kernels themselves: an eager
    decode asks ~4 times, and reading the environment each time cost 2-10 us a decode (H200 hosts,
    2026-12-01: 112 -> 103 us of host time for a B = 1 decode with 8k keys)."""
    return _INTERPRETED


_INTERPRETED = isinstance(kern.attn_combine, InterpretedFunction)


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


# (kernel, device, dtypes, 16-byte alignments, int args, constexprs) -> (compiled kernel, config, constexprs)
_compiled: dict[tuple, tuple] = {}
_COMPILED_MAX = 4096  # distinct signatures kept (a service sees one per (Nq, Nk, ...) it serves)


def _remember(key: tuple, entry: tuple) -> tuple:
    if len(_compiled) >= _COMPILED_MAX:
        _compiled.clear()  # entries are cheap to rebuild (a lookup in Triton's own cache)
    _compiled[key] = entry
    return entry


def _grid3(grid: tuple) -> tuple:
    """A compiled kernel's launcher reads all three grid dims (``fn[grid]`` pads them itself)."""
    return grid if len(grid) == 3 else (*grid, 1, 1)[:3]


def _run(compiled, grid: tuple, args: tuple) -> None:
    """``compiled[grid](*args)`` (every argument, constexprs included, in signature order) through
    the compiled kernel's own launcher, called directly: ``CompiledKernel.__getitem__``'s runner and
    ``CudaLauncher.__call__`` build a closure, launch metadata and an allocator lookup on every
    launch. Host time of a whole call on an H200 host, same process (2026-12-01): B = 1 decode with
    8k keys (two launches) 131 -> 112 us, 1x8x128x64 prefill 35 -> 30 us. A kernel's global scratch
    (``attn_fwd_tma``'s device-side tensor descriptors) is allocated here, as Triton's launcher
    would: 1x32x4096x64 83 -> 78 us, 4x32x2048x64 102 -> 90 us into an idle GPU (FA2 97, 103).
    Kernels with profile scratch, or a profiler's launch hooks, go the usual way."""
    launcher = compiled.run  # loads the module on first use
    hooks = triton.knobs.runtime
    if (launcher.profile_scratch_size or launcher.global_scratch_align > 512
            or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls):
        compiled[_grid3(grid)](*args)  # a profiler's hooks also want the launch metadata
        return
    gx, gy, gz = _grid3(grid)
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    scratch = None
    if launcher.global_scratch_size:
        # per program, as CudaLauncher sizes it; torch's allocator aligns blocks to 512 bytes, more
        # than Triton asks (128 for a descriptor). Freed on return: the stream orders its reuse
        scratch = torch.empty(gx * gy * gz * launcher.num_ctas * launcher.global_scratch_size,
                              dtype=torch.int8, device=device)
    launcher.launch(gx, gy, gz, driver.get_current_stream(device), compiled.function,
                    launcher.launch_cooperative_grid, launcher.launch_pdl, scratch, None,
                    compiled.packed_metadata, None, None, None, *args)


def _signature(tuned, args: tuple, meta: dict, device: torch.device) -> tuple:
    """What decides which compiled kernel a launch needs: Triton specialises a kernel on each
    tensor's dtype and 16-byte alignment and on each integer's value class; our integer args also
    carry the autotuning key (head dim, length buckets). Floats are never specialised.

    On every launch's path: ``type() is`` first, ``isinstance`` only for what it misses (a tensor
    isinstance check goes through torch's metaclass): ~2.5x faster over the ~50 args of a forward."""
    sig = [id(tuned), device.index]  # tuned: an Autotuner, or a plain JITFunction
    for a in args:
        t = type(a)
        if t is int or t is bool:
            sig.append(a)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is TensorDescriptor:  # specialised on its dtype and box (its layout is fixed)
            sig.append((a.base.dtype, *a.block_shape))
        elif isinstance(a, int):  # e.g. a numpy integer
            sig.append(int(a))
    sig.extend(meta.values())
    return tuple(sig)


def _choose_config(tuned, grid, args: tuple, meta: dict) -> tuple[dict, bool]:
    """(config kwargs, launched): the tuned config, launched through the autotuner (which tunes a
    new key first); or the first pruned config, not launched (ATTNSERVE_AUTOTUNE=0, or a key not
    tuned before ``freeze_autotuning()``)."""
    if not autotune_enabled() or (_frozen and not _tuned_already(tuned, args, meta)):
        named = dict(zip(tuned.arg_names, args, strict=False))  # what the autotuner's prune sees
        cfg, launched = tuned.early_config_prune(tuned.configs, named, **meta)[0], False
    else:
        tuned[grid](*args, **meta)
        cfg, launched = tuned.best_config, True
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, launched


def launch(tuned, grid, args: tuple, meta: dict, first_tensor: torch.Tensor,
           interpret_cfg: dict | None = None) -> None:
    """Run an autotuned kernel. ``grid`` maps a config's kwargs to the grid.

    A launch whose signature was seen before goes straight to the compiled kernel: Triton's
    autotuner and argument binder cost 55-90 us of host time per call, more than a short
    kernel runs (a 1x8x128x64 forward takes ~10 us on the GPU). Under the interpreter: one small
    config, no cache."""
    raw = tuned.fn
    if interpreting():
        cfg = interpret_cfg or _INTERPRET_CFG
        raw[grid(cfg)](*args, **meta, **cfg)
        return
    dev = first_tensor.device
    key = _signature(tuned, args, meta, dev)
    hit = _compiled.get(key)
    if hit is not None:
        compiled, cfg, tail = hit
        _run(compiled, grid(cfg), (*args, *tail))
        return
    cfg, launched = _choose_config(tuned, grid, args, meta)
    consts = {**meta, **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}}
    compiled = raw.warmup(*args, grid=grid(cfg), **meta, **cfg)  # after the autotuner: a cache lookup
    if compiled is None:  # Triton's interpreter compiles nothing (tests that take this branch on a CPU)
        if not launched:
            raw[grid(cfg)](*args, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return
    tail = tuple(consts[name] for name in raw.arg_names[len(args):])
    _remember(key, (compiled, cfg, tail))
    if not launched:
        _run(compiled, grid(cfg), (*args, *tail))


def launch_plain(fn, grid: tuple, args: tuple, consts: dict, **options) -> None:
    """Run a plain ``@triton.jit`` kernel through the same compiled-kernel cache as ``launch``;
    ``consts`` are its constexpr args, ``options`` launch options such as num_warps."""
    if interpreting():
        fn[grid](*args, **consts, **options)
        return
    compiled, tail = _compiled_plain(fn, grid, args, consts, **options)
    _run(compiled, grid, (*args, *tail))


def _compiled_plain(fn, grid: tuple, args: tuple, consts: dict, **options) -> tuple:
    """(compiled kernel, its constexpr args in signature order) for ``launch_plain``'s launch."""
    first = args[0].base if type(args[0]) is TensorDescriptor else args[0]
    key = _signature(fn, args, {**consts, **options}, first.device)
    hit = _compiled.get(key)
    if hit is None:
        compiled = fn.warmup(*args, grid=grid, **consts, **options)
        hit = _remember(key, (compiled, None, tuple(consts[name] for name in fn.arg_names[len(args):])))
    return hit[0], hit[2]


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its JIT wrapper (2-3 us a call from Python)."""
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


@functools.lru_cache(maxsize=4096)  # ~11 us of Python per call otherwise, on every launch
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
        # one wave per batch element: on the H200, 16 splits beat 32 at B = 16 (8k-64k keys, +1-2%)
        # and at B = 1 from 8k to 64k keys (CUDA-graph replay), where 32 split programs of 8 kv
        # heads each read too little to cover their start
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


TMA_MIN_N = 2048  # attn_fwd_tma; at 1024, attn_fwd was as fast or faster (372 vs 363 TFLOP/s, 332 vs 315 at D=64)


@functools.cache
def _hopper(device: torch.device) -> bool:
    """sm_90 only: the configs were chosen and checked on an H200; Triton's warp specialisation
    works differently on Blackwell (sm_100+), where nothing here has run."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _tma_rows_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a contiguous last dim and 16-byte aligned base and row strides."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]))


def tma_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             pack: int, splits: int, sizes: bool = True) -> bool:
    """Whether ``attn_fwd_tma`` serves this problem: non-causal 16-bit prefill at D 64 or 128 on a
    Hopper GPU (or the interpreter), TMA-compatible strides, a positive scale (its loop takes the
    row max before scaling). ``sizes=False`` skips the sequence-length threshold (tests).

    Never depends on B (batched answers equal lone ones bit for bit): the strides it reads are
    per-row and per-head, and the service stages every request at 256-byte aligned offsets."""
    if causal or scale <= 0 or pack != 1 or splits != 1 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] not in (64, 128) or not (interpreting() or _hopper(q.device)):
        return False
    if sizes and min(q.shape[2], k.shape[2]) < TMA_MIN_N:
        return False
    return _tma_rows_ok(q) and _tma_rows_ok(k) and _tma_rows_ok(v)


# below these (min(Nq, Nk)) the Triton kernels are as fast (H200, D 128, TFLOP/s Gluon vs Triton,
# CUDA-graph replay: 356 vs 253 at fp16 64x16x256, 361 vs 253 at bf16 32x32x256, 254 vs 201 at fp16
# 16x16x256 (eager there 136-143 vs 192-204: four descriptors' host work); 66 vs 142 at 64x12x128
# before the persistent schedule; causal 211 vs 213 at 1x32x1024, 420 vs 329 at 1x32x2048)
GLUON_MIN_N = 256
GLUON_MIN_N_CAUSAL = 2048


def gluon_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, pack: int, splits: int,
               sizes: bool = True) -> bool:
    """Whether ``attn_fwd_ws`` (Gluon, ``jit/gluon_fwd.py``) serves this problem: 16-bit prefill
    at D 128 on a Hopper GPU, causal or not, strides a host TMA descriptor takes (16-byte multiples,
    none 0 on a dim longer than 1). At D 64 it was no faster than ``attn_fwd_tma`` on the H200 (412
    vs 408 TFLOP/s, fp16 4x32x4096x64), and Triton's interpreter cannot run Gluon. ``sizes=False``
    skips the sequence-length thresholds (tests). Never depends on B, as ``tma_path``."""
    if pack != 1 or splits != 1 or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != 128:
        return False
    if q.numel() == 0 or k.numel() == 0:  # a TMA descriptor has no empty dims
        return False
    if interpreting() or not _hopper(q.device):
        return False
    if sizes and min(q.shape[2], k.shape[2]) < (GLUON_MIN_N_CAUSAL if causal else GLUON_MIN_N):
        return False
    return all(_descriptor_ok(t) for t in (q, k, v))


def _descriptor_ok(t: torch.Tensor) -> bool:
    """Whether ``_descriptor`` can describe t: TMA's 16-byte rules (``_tma_rows_ok``), and no
    stride 0 over a dim longer than 1 (an expanded tensor), which a TMA descriptor cannot say."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    for st, n in zip(strides[:-1], t.shape[:-1], strict=True):
        if st * size % 16 or (st == 0 and n > 1):
            return False
    return True


_16BIT = (torch.float16, torch.bfloat16)


def decode_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: int, splits: int) -> bool:
    """Whether ``attn_decode`` (Gluon, ``jit/gluon_decode.py``) serves this problem: a
    decode-like plan (GQA rows packed, or keys split; at most 64 rows a program), 16-bit at D 64 or
    128 on a Hopper GPU, K and V that host TMA descriptors take (q is read through pointers, any
    strides). Never depends on B, as ``tma_path``."""
    return decode_descriptors(q, k, v, pack, splits) is not None


def decode_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: int,
                       splits: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """``attn_decode``'s K and V descriptors where ``decode_path`` holds, else None. The stride
    rules are checked on the lists the descriptors hold anyway: an eager decode at B = 1 waits on
    the host, and reading each tensor's strides once saved ~7 us a call on the H200's host."""
    if pack == 1 and splits == 1:
        return None
    n_q, d = q.shape[2:]
    if pack * n_q > kern_decode.ROWS.value or d not in (64, 128) or q.dtype not in _16BIT:
        return None
    if 0 in q.shape or 0 in k.shape or interpreting() or not _hopper(q.device):
        return None
    descs = (_descriptor(k, DECODE_BLOCK_N[d]), _descriptor(v, DECODE_BLOCK_N[d]))
    for desc in descs:
        # 16-byte multiples of 2-byte elements; a dim of 1 has a canonical stride by now, so a 0
        # left is an expanded dim, which a descriptor cannot say
        *outer, last = desc.strides
        if last != 1 or desc.base.data_ptr() % 16 or any(st % 8 or st == 0 for st in outer):
            return None
    return descs


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A host TMA descriptor over a whole (B, H, N, D) tensor, in boxes of (1, 1, rows, D). A dim
    of length 1 gets the stride it would have if contiguous (its own may be anything, even 0).

    Built without ``TensorDescriptor.__post_init__``: its checks are ``gluon_path``'s, made once
    per call, and cost ~3 us a descriptor on the launch path (tests run them on what this builds)."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), strides
    desc.block_shape, desc.layout, desc.padding = [1, 1, rows, t.shape[-1]], _BOX_LAYOUT, "zero"
    return desc


_GLUON_BLOCK_N = 128  # keys per block of attn_fwd_ws (64: 536-562 TFLOP/s against 568-639)
_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the kernels' device-side tensor descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


_TMA_INTERPRET_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "WS": False, "num_warps": 4, "num_stages": 1}


def _forward_tma(q, k, v, o, lse, kv_len, has_kv_len: bool, scale: float) -> None:
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    args = (
        q, k, v, o, lse, kv_len,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, _bucket(n_q), _bucket(n_k),
    )

    def grid(cfg):
        return (_cdiv(n_q, cfg["BLOCK_M"]), b * hq)

    launch(kern.attn_fwd_tma_tuned, grid, args, dict(D=d, HAS_KV_LEN=has_kv_len), q,
           interpret_cfg=_TMA_INTERPRET_CFG)


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def causal_heads_per_group(k: torch.Tensor, heads: int, group: int) -> int:
    """How many of the ``heads`` (batch, query head)s a causal ``attn_fwd_ws`` grid schedules
    together, in groups of even size: as many as have their K and V fit in twice the L2 (GQA:
    ``group`` query heads share a kv head's). All heads' longest row blocks first balances the tail,
    but once their K/V outgrow L2 each program reads its blocks from HBM. H200 (60 MB of L2 as torch
    reports it), fp16 causal TFLOP/s, all heads first vs head by head: 417-419 vs 367-368 at
    1x32x2048 (34 MB of K/V in all), 478-480 vs 455-462 at 1x32x4096 (67 MB), 413-419 vs 466-477 at
    4x32x4096 (268 MB), 476-505 vs 564-569 at 1x8x131072."""
    per_head = 2 * k.shape[2] * k.shape[3] * k.element_size() / group
    fit = max(1, int(2 * _l2_bytes(k.device) // per_head))
    return _cdiv(heads, _cdiv(heads, fit))


# attn_decode: keys per block, by D, and blocks in flight per program
DECODE_BLOCK_N = {64: 128, 128: 64}
DECODE_STAGES = 2


def _decode_launch(q, k, descs, out, kv_len, has_kv_len: bool, scale: float, causal: bool,
                   pack: int, splits: int, kps: int) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of attn_decode with ``decode_descriptors``' descs into out = (o,
    lse, their strides with a split stride first): the per-split partials (S, B, Hq, Nq, D) and
    (S, B, Hq, Nq), or o and lse themselves with a split stride of 0."""
    b, hq, n_q, _ = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    o_out, lse_out, so, sl = out
    args = (
        q, *descs, o_out, lse_out, kv_len,
        *q.stride(), *so[:4], *sl,
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, kps,
    )
    consts = dict(PACK=pack, HAS_KV_LEN=has_kv_len, IS_CAUSAL=bool(causal), STAGES=DECODE_STAGES,
                  SIGNAL_MERGE=splits > 1)
    return (splits, b * (hq // pack)), args, consts


class _DecodeRecipe:
    """Everything of an ``attn_decode`` call (and its merge) that follows from the problem's
    shapes, strides, dtype, device and flags, worked out on its first call: later calls allocate
    the outputs, point two descriptors at the new K and V and launch. Host time of a whole eager
    decode, one H200 host, same process (2026-12-01): B = 1, 8k keys 63 -> 42 us (FA2 48); B = 4,
    Hq 16 / Hkv 2, Nq 2, 300 keys 55 -> 40 us (FA2 72); so an eager B = 1 decode no longer waits
    on the host."""

    __slots__ = ("device", "dtype", "o_shape", "lse_shape", "part_shapes", "n_k", "k_desc", "v_desc",
                 "decode", "decode_static", "kps", "decode_tail", "merge", "merge_grid", "merge_static",
                 "merge_tail")

    def __init__(self, q, k, v, kv_lengths, causal: bool, pack: int, splits: int, kps: int):
        b, hq, n_q, d = q.shape
        self.device, self.dtype, self.n_k, self.kps = q.device, q.dtype, k.shape[2], kps
        self.o_shape, self.lse_shape = (b, hq, n_q, d), (b, hq, n_q)
        self.part_shapes = ((splits, b, hq, n_q, d), (splits, b, hq, n_q)) if splits > 1 else None
        o, lse, out, o_part, lse_part = self._outputs()
        descs = decode_descriptors(q, k, v, pack, splits)
        # templates without a tensor: a recipe kept must not keep its first call's K and V alive
        self.k_desc, self.v_desc = (_rebased(desc, None) for desc in descs)
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        grid, args, consts = _decode_launch(q, k, descs, out, kv_len, kv_lengths is not None, 1.0, causal,
                                            pack, splits, kps)
        compiled, self.decode_tail = _compiled_plain(kern_decode.attn_decode, grid, args, consts, num_warps=4)
        self.decode = (compiled, grid)
        self.decode_static = args[6:-2]  # between kv_len and the scale
        self.merge = None
        if splits > 1:
            # the merge as a programmatic dependent launch: scheduled once every split has reached
            # its epilogue (SIGNAL_MERGE), it waits in griddepcontrol.wait for the whole split grid
            # and its writes. H200, same bits: -0.3 us at B = 1, 8k keys, -0.8 us at B = 16, 8k
            # keys (rotated), host time unchanged (docs/benchmarks/kernels.md, sixteenth session)
            self.merge_grid, args, consts = _combine_launch(o_part, lse_part, o, lse, after_split_kernel=True)
            self.merge, self.merge_tail = _compiled_plain(kern.attn_combine, self.merge_grid, args, consts,
                                                          num_warps=4, launch_pdl=True)
            self.merge_static = args[4:]

    def _outputs(self):
        """o, lse, the kernel's out (``_decode_launch``) and the split partials (or None)."""
        o = torch.empty(self.o_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        if self.part_shapes is None:  # o and lse themselves, as one split (a split stride of 0)
            return o, lse, (o, lse, (0, *o.stride()), (0, *lse.stride())), None, None
        o_part = torch.empty(self.part_shapes[0], dtype=torch.float32, device=self.device)
        lse_part = torch.empty(self.part_shapes[1], dtype=torch.float32, device=self.device)
        return o, lse, (o_part, lse_part, o_part.stride(), lse_part.stride()), o_part, lse_part

    def __call__(self, q, k, v, kv_lengths, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse, out, o_part, lse_part = self._outputs()
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        descs = (_rebased(self.k_desc, k), _rebased(self.v_desc, v))
        _forward_decode(q, descs, out, kv_len, scale, self)
        if self.merge is not None:
            _run(self.merge, self.merge_grid, (o_part, lse_part, o, lse, *self.merge_static, *self.merge_tail))
        return o, lse


def _forward_decode(q, descs, out, kv_len, scale: float, recipe: _DecodeRecipe) -> None:
    """attn_decode as ``recipe`` (and ``_decode_launch``) says."""
    compiled, grid = recipe.decode
    _run(compiled, grid, (q, *descs, out[0], out[1], kv_len, *recipe.decode_static, scale * kern.LOG2E,
                          recipe.kps, *recipe.decode_tail))


def _rebased(desc: TensorDescriptor, t: torch.Tensor | None) -> TensorDescriptor:
    """``desc`` (from ``_descriptor``) over t, a tensor of the same shape and strides."""
    new = object.__new__(TensorDescriptor)
    new.base, new.shape, new.strides = t, desc.shape, desc.strides
    new.block_shape, new.layout, new.padding = desc.block_shape, desc.layout, desc.padding
    return new


# problems -> their _DecodeRecipe or _GluonRecipe, or None where neither Gluon kernel serves them
_recipes: dict[tuple, _DecodeRecipe | _GluonRecipe | None] = {}


def _recipe(q, k, v, kv_lengths, causal: bool, num_splits: int | None, tma: bool | None, pack: int,
            splits: int, kps: int) -> _DecodeRecipe | _GluonRecipe | None:
    """The recipe of a problem one of the Gluon kernels serves (``decode_path``, or ``gluon_path``
    for what ``plan`` neither packs nor splits), built on its first call. Keyed on what decides
    every launch argument but the data: shapes, strides, dtype, device, the flags, and the 16-byte
    alignment Triton specialises q on and TMA needs of q, k, v."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal,
           kv_lengths is None, num_splits, tma, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    try:
        return _recipes[key]
    except KeyError:
        pass
    recipe = None
    if pack > 1 or splits > 1:
        if decode_path(q, k, v, pack, splits):
            recipe = _DecodeRecipe(q, k, v, kv_lengths, causal, pack, splits, kps)
    elif gluon_path(q, k, v, causal, pack, splits, sizes=tma is None):
        recipe = _GluonRecipe(q, k, v, kv_lengths, causal)
    if len(_recipes) >= _COMPILED_MAX:
        _recipes.clear()
    _recipes[key] = recipe
    return recipe


def _gluon_launch(q, k, v, o, lse, kv_len, has_kv_len: bool, scale: float, causal: bool) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of attn_fwd_ws writing o and lse."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rows = kern_gluon.BLOCK_M // 2
    tiles = _cdiv(n_q, kern_gluon.BLOCK_M) * b * hq
    args = (
        _descriptor(q, rows), _descriptor(k, _GLUON_BLOCK_N), _descriptor(v, _GLUON_BLOCK_N),
        _descriptor(o, rows), lse, kv_len, hq, hq // hkv, n_q, n_k, b * hq, scale * kern.LOG2E,
        causal_heads_per_group(k, b * hq, hq // hkv) if causal else 1,
    )
    # non-causal: persistent, one program an SM (its shared memory allows no second), so a tile's
    # Q load and O store overlap its neighbours' work. Causal: a program a tile, as tiles differ in
    # length and the hardware's scheduler balances them better than a fixed stride (H200, fp16
    # 1x32x16384 causal: 522-527 TFLOP/s against 491-492 persistent; 1x32x1024: 434-441 vs 409-410)
    programs = tiles if causal else min(tiles, _num_sms(q.device))
    return (programs,), args, dict(HAS_KV_LEN=has_kv_len, IS_CAUSAL=bool(causal), CONSUMER_REGS=232)


class _GluonRecipe:
    """``attn_fwd_ws``'s launch worked out on a problem's first call, as ``_DecodeRecipe``'s: later
    calls allocate o and lse, point four descriptors at q, k, v, o and launch. Host time of one
    call into an idle H200 (2026-12-01): 1x32x1024x128 79.5 -> 44.8 us (FA2 60.2), 1x32x4096x128
    causal 99.9 -> 62.5 us (FA2 90.4)."""

    __slots__ = ("device", "dtype", "o_shape", "lse_shape", "n_k", "descs", "launch", "static", "heads", "tail")

    def __init__(self, q, k, v, kv_lengths, causal: bool):
        b, hq, n_q, d = q.shape
        self.device, self.dtype, self.n_k = q.device, q.dtype, k.shape[2]
        self.o_shape, self.lse_shape = (b, hq, n_q, d), (b, hq, n_q)
        o, lse = self._outputs()
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        grid, args, consts = _gluon_launch(q, k, v, o, lse, kv_len, kv_lengths is not None, 1.0, causal)
        compiled, self.tail = _compiled_plain(kern_gluon.attn_fwd_ws, grid, args, consts, num_warps=4)
        self.launch = (compiled, grid)
        self.descs = tuple(_rebased(desc, None) for desc in args[:4])  # templates: no tensor kept
        self.static, self.heads = args[6:11], args[12]  # hq .. b·hq, then the causal head groups

    def _outputs(self):
        return (torch.empty(self.o_shape, dtype=self.dtype, device=self.device),
                torch.empty(self.lse_shape, dtype=torch.float32, device=self.device))

    def __call__(self, q, k, v, kv_lengths, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = self._outputs()
        kv_len = kv_length_arg(kv_lengths, self.n_k, self.device)
        dq, dk, dv, do = self.descs
        descs = (_rebased(dq, q), _rebased(dk, k), _rebased(dv, v), _rebased(do, o))
        _forward_gluon(q, descs, lse, kv_len, scale, self)
        return o, lse


def _forward_gluon(q, descs, lse, kv_len, scale: float, recipe: _GluonRecipe) -> None:
    """attn_fwd_ws as ``recipe`` (and ``_gluon_launch``) says."""
    compiled, grid = recipe.launch
    _run(compiled, grid, (*descs, lse, kv_len, *recipe.static, scale * kern.LOG2E, recipe.heads, *recipe.tail))


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kv_lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
    tma: bool | None = None,
    gluon: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32. ``num_splits`` forces the number
    of key splits and ``tma`` the TMA kernels on (where their layout rules allow, whatever the
    sizes) or off; ``gluon=False`` takes ``attn_fwd_tma`` where ``attn_fwd_ws`` would serve (tests,
    benchmarks). None lets ``plan`` and ``tma_path`` choose."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype and k.shape == v.shape and hq % hkv == 0 and d <= 256
    dev = q.device
    pack, splits, kps = plan(b, hq, hkv, n_q, n_k, dev, num_splits)
    # the Gluon kernels: decode (packed or split) or, at D 128 in 16 bits, prefill (a cheap
    # superset of gluon_path's rules here; _recipe checks them all once per problem)
    if tma is not False and gluon and not interpreting() and (
            pack > 1 or splits > 1 or (d == 128 and q.dtype in _16BIT and (
                tma or min(n_q, n_k) >= (GLUON_MIN_N_CAUSAL if causal else GLUON_MIN_N)))):
        recipe = _recipe(q, k, v, kv_lengths, causal, num_splits, tma, pack, splits, kps)
        if recipe is not None:
            return recipe(q, k, v, kv_lengths, scale)
    o = torch.empty(b, hq, n_q, d, dtype=q.dtype, device=dev)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=dev)
    kv_len = kv_length_arg(kv_lengths, n_k, dev)
    if tma is not False and tma_path(q, k, v, causal, scale, pack, splits, sizes=tma is None):
        # it builds its tensor descriptors on the device, in scratch that _run allocates, or, where
        # Triton launches it (the interpreter, a profiler's hooks), from this allocator: a
        # ContextVar, so set in the launching thread (the service launches from worker threads)
        triton.set_allocator(_scratch)
        _forward_tma(q, k, v, o, lse, kv_len, kv_lengths is not None, scale)
        return o, lse
    if splits == 1:  # o and lse themselves, as one split (a split stride of 0)
        out = (o, lse, (0, *o.stride()), (0, *lse.stride()))
    else:
        o_part = torch.empty(splits, b, hq, n_q, d, dtype=torch.float32, device=dev)
        lse_part = torch.empty(splits, b, hq, n_q, dtype=torch.float32, device=dev)
        out = (o_part, lse_part, o_part.stride(), lse_part.stride())
    if tma:  # attn_decode and attn_fwd_ws (above) take every problem of theirs TMA can describe
        raise ValueError("tma=True: this problem does not fit the TMA kernel (see tma_path)")
    _forward_triton(q, k, v, out, kv_len, kv_lengths is not None, scale, causal, pack, splits, kps)
    if splits > 1:
        combine(o_part, lse_part, o, lse)
    return o, lse


def _forward_triton(q, k, v, out, kv_len, has_kv_len: bool, scale: float, causal: bool,
                    pack: int, splits: int, kps: int) -> None:
    """attn_fwd into ``out`` as ``_decode_launch``'s."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    bd = block_d(d)
    rows = pack * n_q
    o_out, lse_out, so, sl = out
    args = (
        q, k, v, o_out, lse_out, kv_len,
        *q.stride(), *k.stride(), *v.stride(), *so, *sl,
        hq, hq // hkv, n_q, n_k, scale * kern.LOG2E, kps, _bucket(n_q), _bucket(n_k),
    )
    # split-KV: the splits of one head side by side in the grid, so that the programs running
    # together read neighbouring keys (H200, B = 16 decode: +0.8% at 8k keys, +0.1% at 64k)
    meta = dict(
        D=d, BLOCK_D=bd, IS_CAUSAL=bool(causal), HAS_KV_LEN=has_kv_len, PACK=pack,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLITS_FIRST=splits > 1,
    )

    def grid(cfg):
        if splits > 1:
            return (splits, b * (hq // pack), _cdiv(rows, cfg["BLOCK_M"]))
        return (_cdiv(rows, cfg["BLOCK_M"]), b * (hq // pack), splits)

    tuned = kern.attn_fwd_tuned if splits == 1 and pack == 1 else kern.attn_fwd_split_tuned
    launch(tuned, grid, args, meta, q)


def merge_rows_per_program(hq: int, n_q: int, d: int, device: torch.device) -> int:
    """Rows ``attn_combine`` merges per program: one while a batch element's Hq·Nq rows alone fill
    the GPU a few times over, else a few. Never from B: the row tile decides how each row's splits
    are summed (8 rows sum 16 splits in two chunks of 8), so a batched answer would differ from a
    lone one. It was chosen from B·Hq·Nq before: 67 or more decodes of 32 heads on the H200."""
    if interpreting():
        return 64
    return 1 if hq * n_q <= 16 * _num_sms(device) else max(1, min(8, 4096 // block_d(d)))


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge per-split partials o_part (S, B, Hq, Nq, D) fp32 and lse_part (S, B, Hq, Nq) into o, lse."""
    grid, args, consts = _combine_launch(o_part, lse_part, o, lse)
    launch_plain(kern.attn_combine, grid, args, consts, num_warps=4)


def _combine_launch(o_part, lse_part, o, lse, after_split_kernel: bool = False) -> tuple[tuple, tuple, dict]:
    """(grid, args, constexprs) of ``combine``'s attn_combine; ``after_split_kernel``: launched as a
    programmatic dependent of the split kernel (``launch_pdl=True``), so it waits for it first."""
    s, b, hq, n_q, d = o_part.shape
    r = b * hq * n_q
    rows = merge_rows_per_program(hq, n_q, d, o.device)
    args = (o_part, lse_part, o, lse, *o.stride(), s, r, hq, n_q)
    return (_cdiv(r, rows),), args, dict(D=d, BLOCK_D=block_d(d), BLOCK_S=_next_pow2(s), RB=rows,
                                      PDL=after_split_kernel)


def flops(b: int, hq: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """Forward FLOPs counted as 4·B·Hq·Nq·Nk·D (half of it when causal)."""
    f = 4.0 * b * hq * n_q * n_k * d
    return f / 2 if causal else f


__all__ = ["block_d", "combine", "flash_forward", "flops", "freeze_autotuning", "gluon_path",
           "merge_rows_per_program", "plan", "tma_path"]
