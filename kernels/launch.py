"""How flash's kernels are launched: the one module that touches Triton 3.6's private launch API.

What it replaces. ``kernel[grid](*args)`` binds every argument, and an autotuned kernel's
``Autotuner.run`` builds its key, on every call; ``CompiledKernel.__getitem__``'s runner and
``CudaLauncher.__call__`` then build a closure, launch metadata and an allocator lookup. Here:

- ``launch`` (autotuned kernels) and ``launch_plain`` (plain ``@jit`` ones) go through Triton's
  own path the first time a signature is seen (``_signature``: what Triton specialises on), keep
  the compiled kernel (``_compiled``), and from then on call it directly;
- ``_run`` calls a compiled kernel's C launcher itself, allocating the global scratch its
  device-side tensor descriptors need (``CudaLauncher`` would);
- ``_tuned_already`` and ``_choose_config`` rebuild the autotuner's key, so that a key first seen
  after ``freeze_autotuning()`` runs its first config instead of being tuned on the request path,
  and so that a key's choice is looked up in (and written to) ``autotune_cache`` instead of being
  timed again at every start.

Why: that host work costs more per call than a short kernel runs on the GPU, and an eager decode
waits on it (numbers: docs/benchmarks/kernels.md#launch-cache).

Pinned to triton==3.6.0: ``_run``'s argument list, ``_tuning_key``'s key and the launcher
fields read here are Triton internals that change between releases.

Off switch: ``ATTNSERVE_DIRECT_LAUNCH=0`` (read once, at import) or ``set_direct_launch(False)``
sends every launch through Triton's public path instead: ``kernel[grid](...)``, or the autotuner's
own ``run``. Same kernels, same configs, same bits; more host time per call.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.interpreter import InterpretedFunction

from . import autotune_cache
from .jit import flash_fwd as _kern

_INTERPRET_CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def interpreting() -> bool:
    """True when Triton runs these kernels on the CPU. Triton decides it as it defines a kernel
    (``TRITON_INTERPRET=1`` at import), so it is read once, from the kernels themselves: an eager
    decode asks several times, and reading the environment each time costs host time."""
    return _INTERPRETED


_INTERPRETED = isinstance(_kern.attn_combine, InterpretedFunction)


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


_direct = os.environ.get("ATTNSERVE_DIRECT_LAUNCH", "1") not in ("", "0")
_switch_clears: list[dict] = []  # caches of direct launches, emptied when the switch flips


def direct_launch() -> bool:
    """Whether cached launches call Triton's compiled launcher directly (the default)."""
    return _direct


def set_direct_launch(on: bool = True) -> None:
    """Turn the direct launches on or off (``ATTNSERVE_DIRECT_LAUNCH`` sets it at import)."""
    global _direct
    _direct = bool(on)
    for cache in _switch_clears:
        cache.clear()


def clear_on_switch(cache: dict) -> None:
    """Register a cache that holds direct launches (``hopper._recipes``): ``set_direct_launch``
    empties it, so that no launch worked out under one setting runs under the other."""
    _switch_clears.append(cache)


def _tuning_key(tuned, args: tuple, meta: dict) -> tuple:
    """``tuned``'s (a triton Autotuner) key for this launch, built exactly as triton 3.6's
    ``Autotuner.run`` builds it (key args, then every tensor's dtype)."""
    all_args = {**dict(zip(tuned.arg_names, args, strict=False)), **meta}  # as triton does
    named = {k: v for k, v in all_args.items() if k in tuned.arg_names}
    key = [named[k] for k in tuned.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def _tuned_already(tuned, args: tuple, meta: dict) -> bool:
    """Whether ``tuned`` has a config for this launch's key."""
    return _tuning_key(tuned, args, meta) in tuned.cache


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
    the compiled kernel's own launcher, called directly, without the closure, launch metadata and
    allocator lookup that ``CompiledKernel.__getitem__`` and ``CudaLauncher.__call__`` build on
    every launch. A kernel's global scratch (``attn_fwd_tma``'s device-side tensor descriptors) is
    allocated here, as Triton's launcher would. Kernels with profile scratch, or a profiler's
    launch hooks, go the usual way."""
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


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """``triton.set_allocator``'s allocator, for launches Triton makes itself (the interpreter, a
    profiler's hooks, ``ATTNSERVE_DIRECT_LAUNCH=0``): global memory for device-side descriptors."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def _signature(tuned, args: tuple, meta: dict, device: torch.device) -> tuple:
    """What decides which compiled kernel a launch needs: Triton specialises a kernel on each
    tensor's dtype and 16-byte alignment and on each integer's value class; our integer args also
    carry the autotuning key (head dim, length buckets). Floats are never specialised.

    On every launch's path: ``type() is`` first, ``isinstance`` only for what it misses (a tensor
    isinstance check goes through torch's metaclass, several times slower)."""
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


def _pruned(tuned, args: tuple, meta: dict) -> list:
    """The configs ``tuned``'s autotuner would time for this launch (its ``prune_configs``)."""
    named = dict(zip(tuned.arg_names, args, strict=False))  # what the autotuner's prune sees
    return tuned.early_config_prune(tuned.configs, named, **meta) if tuned.early_config_prune else tuned.configs


def _choose_config(tuned, grid, args: tuple, meta: dict, device: torch.device) -> tuple[dict, bool]:
    """(config kwargs, launched): the tuned config, launched through the autotuner (which tunes a
    new key first, unless ``autotune_cache`` holds its choice: then that one is replayed, untimed);
    or the first pruned config, not launched (ATTNSERVE_AUTOTUNE=0, or a key not tuned before
    ``freeze_autotuning()``)."""
    if not autotune_enabled() or (_frozen and not _tuned_already(tuned, args, meta)):
        cfg, launched = _pruned(tuned, args, meta)[0], False
    else:
        key = _tuning_key(tuned, args, meta)
        tune = (key not in tuned.cache and len(tuned.configs) > 1 and device.type == "cuda"
                and autotune_cache.enabled())
        if tune:
            pruned, name = _pruned(tuned, args, meta), autotune_cache.device_name(device)
            stored = autotune_cache.load(tuned, key, pruned, name)
            if stored is not None:
                tuned.cache[key] = stored  # the autotuner runs it without timing anything
                tune = False
        tuned[grid](*args, **meta)
        cfg, launched = tuned.best_config, True
        if tune:
            autotune_cache.save(tuned, key, pruned, name, cfg, getattr(tuned, "configs_timings", None))
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, launched


def _run_config(raw, grid, args: tuple, meta: dict, cfg: dict) -> None:
    """``raw[grid](...)`` with ``cfg`` (from ``_choose_config``), the way Triton launches it."""
    consts = {**meta, **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}}
    raw[grid(cfg)](*args, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def launch(tuned, grid, args: tuple, meta: dict, first_tensor: torch.Tensor,
           interpret_cfg: dict | None = None) -> bool:
    """Run an autotuned kernel; ``grid`` maps a config's kwargs to the grid. True when this was the
    first launch of its signature (always, where nothing is cached).

    A launch whose signature was seen before goes straight to the compiled kernel, skipping
    Triton's autotuner and argument binder. Under the interpreter: one small config, no cache."""
    raw = tuned.fn
    if interpreting():
        cfg = interpret_cfg or _INTERPRET_CFG
        raw[grid(cfg)](*args, **meta, **cfg)
        return True
    if not _direct:
        cfg, launched = _choose_config(tuned, grid, args, meta, first_tensor.device)
        if not launched:
            _run_config(raw, grid, args, meta, cfg)
        return True
    dev = first_tensor.device
    key = _signature(tuned, args, meta, dev)
    hit = _compiled.get(key)
    if hit is not None:
        compiled, cfg, tail = hit
        _run(compiled, grid(cfg), (*args, *tail))
        return False
    cfg, launched = _choose_config(tuned, grid, args, meta, dev)
    consts = {**meta, **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}}
    compiled = raw.warmup(*args, grid=grid(cfg), **meta, **cfg)  # after the autotuner: a cache lookup
    if compiled is None:  # Triton's interpreter compiles nothing (tests that take this branch on a CPU)
        if not launched:
            _run_config(raw, grid, args, meta, cfg)
        return True
    tail = tuple(consts[name] for name in raw.arg_names[len(args):])
    _remember(key, (compiled, cfg, tail))
    if not launched:
        _run(compiled, grid(cfg), (*args, *tail))
    return True


def launch_plain(fn, grid: tuple, args: tuple, consts: dict, **options) -> None:
    """Run a plain ``@triton.jit`` (or ``@gluon.jit``) kernel through the same compiled-kernel
    cache as ``launch``; ``consts`` are its constexpr args, ``options`` launch options such as
    num_warps."""
    if interpreting() or not _direct:
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
