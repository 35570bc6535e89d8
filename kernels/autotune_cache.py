"""The autotuner's choices kept across restarts, next to the compiled kernels in Triton's cache dir.

Without it a restarted server re-times every config of every key its warm-up tunes (seconds, even
with every kernel already compiled). With it, ``launch._choose_config`` looks a key up here before
tuning it and writes the choice after: ``<TRITON_CACHE_DIR>/attnserve-autotune/<kernel>-<hash>.json``.

What a choice is keyed on (the file name's hash): Triton's own key (its version and build), the
backend (ptxas version, arch), the kernel's source and everything it calls (``fn.cache_key``),
Triton's cache-invalidating environment variables, the GPU's name and compute capability, the
autotuning key (head dim, flags, length buckets, dtypes) and the pruned configs on offer. Change
any of them and the key is tuned anew. Triton's own ``cache_results`` keys on the arch only (an
H100's timings would be replayed on an H200), hence this store.

A stored choice is replayed as-is: the process that finds it runs that config for that key for
its whole life, exactly as if it had tuned it itself; only the timing is skipped. Batch
invariance holds as before (a key's config never changes within a process), and every replica
that shares the cache dir runs the same config per key. Only keys the process would tune are
looked up (not a key first seen after ``freeze_autotuning()``, which runs its default config).

``ATTNSERVE_AUTOTUNE_CACHE=0`` (read at import) or ``set_enabled(False)`` turns it off: every
start tunes anew and nothing is written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import triton
from triton import knobs

log = logging.getLogger("attnserve.kernels")

DIRNAME = "attnserve-autotune"
_enabled = os.environ.get("ATTNSERVE_AUTOTUNE_CACHE", "1") not in ("", "0")
_read_only = False


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool = True) -> None:
    global _enabled
    _enabled = bool(on)


@contextlib.contextmanager
def read_only() -> Iterator[None]:
    """Look choices up but write none (``precompile.record``'s pass, whose timings are not real)."""
    global _read_only
    before, _read_only = _read_only, True
    try:
        yield
    finally:
        _read_only = before


def directory() -> Path:
    """Where the choices live: a folder of Triton's cache dir (``TRITON_CACHE_DIR``)."""
    return Path(knobs.cache.dir) / DIRNAME


def _jit_function(tuned):
    fn = tuned.fn
    while not isinstance(fn, triton.runtime.JITFunction):
        fn = fn.fn
    return fn


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU model and compute capability (``cpu`` elsewhere): choices are timed on one model."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


@functools.cache
def _triton_parts(target) -> tuple[str, str]:
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    return triton_key() + "-" + make_backend(target).hash(), str(sorted(get_cache_invalidating_env_vars().items()))


def path(tuned, key: tuple, configs: Sequence[triton.Config], device: str, target=None) -> Path:
    """The file that holds ``tuned``'s choice for autotuning key ``key`` among ``configs`` (the
    pruned configs) on ``device`` (``device_name``), for the current (or the given) Triton target."""
    fn = _jit_function(tuned)
    target = target or triton.runtime.driver.active.get_current_target()
    versions, env = _triton_parts(target)
    parts = [versions, fn.cache_key, env, device, repr(tuple(key)), *(str(c) for c in configs)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]
    return directory() / f"{fn.__name__[:100]}-{digest}.json"


def _as_dict(cfg: triton.Config) -> dict:
    return {"kwargs": cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}


def load(tuned, key: tuple, configs: Sequence[triton.Config], device: str, target=None) -> triton.Config | None:
    """The stored choice (one of ``configs``, the very object) or None: none stored, the store off,
    or the file unreadable or naming a config not among them (both logged, then tuned anew)."""
    if not _enabled:
        return None
    file = path(tuned, key, configs, device, target)
    try:
        entry = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("autotune cache: cannot read %s (%s); tuning anew", file, exc)
        return None
    for cfg in configs:
        if _as_dict(cfg) == entry.get("config"):
            return cfg
    log.warning("autotune cache: %s names a config not on offer; tuning anew", file)
    return None


def save(tuned, key: tuple, configs: Sequence[triton.Config], device: str, chosen: triton.Config,
         timings: dict | None = None, target=None) -> Path | None:
    """Store ``chosen`` for this key (atomically: written to a temporary file, then renamed, so
    that replicas sharing the folder never read half a file). None when off, read-only or the
    folder is not writable (logged once per folder; the server runs on, tuning each start)."""
    if not _enabled or _read_only:
        return None
    file = path(tuned, key, configs, device, target)
    entry = {"kernel": _jit_function(tuned).__name__, "key": [str(k) for k in key], "device": device,
             "config": _as_dict(chosen),
             "timings_ms": [[str(c), t] for c, t in (timings or {}).items()]}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(entry, out)
        os.replace(tmp, file)
    except OSError as exc:
        _unwritable(str(file.parent), str(exc))
        return None
    return file


@functools.cache
def _unwritable(folder: str, why: str) -> None:
    log.warning("autotune cache: cannot write to %s (%s): choices are not kept across restarts", folder, why)
