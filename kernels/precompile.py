"""Compile a warm-up's Triton kernels ahead of it, in parallel, into Triton's cache dir.

    from kernels import precompile, warmup
    precompile.ahead(lambda: warmup(shapes, dtypes, "cuda:0"), workers=16)  # compiles, in parallel
    warmup(shapes, dtypes, "cuda:0")  # as before, but every kernel it compiles is a cache hit

A cold warm-up compiles one kernel variant after another (each autotuned key compiles every config
it times), on one core. Here:

- ``record`` runs the warm-up once with Triton's ``jit_cache_hook`` answering "skip" to every
  compile: nothing is compiled or launched, and each variant (kernel, specialisation, options,
  target) the warm-up would compile is recorded, every config an autotuner would time among them
  (their timing is a no-op for that pass, their choices are forgotten after it, and
  ``autotune_cache`` is read, not written: a stored choice leaves only its own config to compile).
  Direct launches are off for the pass, so every launch goes through ``JITFunction.run``;
- ``missing`` drops the variants Triton's cache holds already (a warm start compiles nothing);
- ``compile_all`` compiles the rest with ``triton.compile`` (the JIT's own source, specialisation,
  options and target, hence its cache key) in worker processes (``python -m kernels.precompile``;
  they need no GPU: Triton compiles for a target with the ptxas its wheel ships) or in threads
  (much of a compile releases the GIL, its Python front end does not).

It only ever saves time: the real warm-up runs afterwards as it always did and compiles whatever
was missed (a variant recorded differently, a compile that failed here); readiness comes from it
alone. ``ahead`` never raises: on any failure it logs why and the warm-up compiles one by one.

Only for a single thread's warm-up: the hook is process-wide, so nothing else may launch Triton
kernels during ``record`` (the service warms its devices one at a time, before it is ready).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import logging
import os
import pickle
import pkgutil
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from triton import knobs

log = logging.getLogger("attnserve.kernels")

KINDS = ("processes", "threads")
MAX_WORKERS = 32
WORKER_BYTES = 1 << 30  # a worker process: ~0.3 GiB after its imports, ~0.4 GiB at its peak on a CPU
LOCK_NAME = "attnserve-precompile.lock"


@dataclasses.dataclass(eq=False)
class Variant:
    """One compile the warm-up would make: what ``JITFunction._do_compile`` hands ``triton.compile``."""

    module: str                 # the kernel's module and name (a module-level @triton.jit / @gluon.jit)
    qualname: str
    signature: dict
    constants: dict
    attrs: dict
    options: dict               # Triton's backend options (``specialization_data``'s, tuples restored)
    target: object              # triton.backends.compiler.GPUTarget

    @property
    def name(self) -> str:
        return f"{self.qualname}[warps {self.options.get('num_warps')}, stages {self.options.get('num_stages')}]"


@dataclasses.dataclass
class Report:
    recorded: int = 0           # variants the warm-up would compile
    cached: int = 0             # of them, already in Triton's cache
    compiled: int = 0           # compiled here
    failed: int = 0             # failed here (the warm-up compiles them itself)
    workers: int = 0
    kind: str = ""
    record_s: float = 0.0
    compile_s: float = 0.0
    compile_sum_s: float = 0.0  # the compiles' own durations, summed (compile_sum_s / compile_s: the speed-up)
    complete: bool = True       # False: the recording pass stopped early (logged)


def default_workers() -> int:
    """One per CPU core this process may use (its affinity, and its cgroup's CPU quota if any), at
    most one per ``WORKER_BYTES`` of available memory and at most ``MAX_WORKERS``."""
    count = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    if quota:
        count = min(count, quota)
    memory = _available_bytes()
    if memory:
        count = min(count, memory // WORKER_BYTES)
    return max(1, min(MAX_WORKERS, count))


def _cgroup_cpus() -> int | None:
    """cgroup v2's ``cpu.max`` quota in whole CPUs (rounded up), None where unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def _available_bytes() -> int | None:
    """The host's MemAvailable, or less where the cgroup's ``memory.max`` leaves less."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


# ---- recording -----------------------------------------------------------------------------------

def _autotuners() -> list:
    from triton.runtime.autotuner import Autotuner

    from . import jit

    found = []
    for mod in pkgutil.iter_modules(jit.__path__):
        for obj in vars(importlib.import_module(f"{jit.__name__}.{mod.name}")).values():
            if isinstance(obj, Autotuner) and obj not in found:
                found.append(obj)
    return found


def _no_timing(kernel_call, quantiles=None, **_):
    kernel_call()  # the recording hook answers "skip": nothing compiles or runs
    return [0.0] * len(quantiles or (0,))


def _options(specialization_data: str) -> dict:
    # as JITFunction.preload reads them back: JSON made the tuples lists
    return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(specialization_data)["options"].items()}


@contextlib.contextmanager
def _recording(found: dict) -> Iterator[None]:
    from . import autotune_cache, launch

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        jf = fn.jit_function
        target = jf.device_caches[compile["device"]][2]
        found.setdefault((fn.module, fn.name, str(key)), Variant(
            fn.module, fn.name, compile["signature"], compile["constants"], compile["configs"][0],
            _options(compile["specialization_data"]), target))
        return True  # Triton returns without compiling or launching

    tuners = _autotuners()
    saved = [(t, t.__dict__.get("do_bench"), dict(t.cache)) for t in tuners]
    hook_before, direct = knobs.runtime.jit_cache_hook, launch.direct_launch()
    for t in tuners:
        t.do_bench = _no_timing  # an instance attribute shadows Autotuner's cached_property
    knobs.runtime.jit_cache_hook = hook
    launch.set_direct_launch(False)
    try:
        with autotune_cache.read_only():
            yield
    finally:
        knobs.runtime.jit_cache_hook = hook_before
        for t, bench, cache in saved:
            if bench is None:
                t.__dict__.pop("do_bench", None)
            else:
                t.do_bench = bench
            t.cache = cache  # the pass's choices came from no timing at all
            t.nargs = None
        launch.set_direct_launch(direct)  # also empties the caches of launches worked out meanwhile


def record(run: Callable[[], object]) -> tuple[list[Variant], bool]:
    """(the variants ``run`` would compile, whether ``run`` ran to its end). An error in ``run``
    ends the pass early (logged); the variants recorded up to there are returned."""
    found: dict[tuple, Variant] = {}
    complete = True
    with _recording(found):
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - what was recorded is still worth compiling
            log.warning("precompile: the recording pass stopped early (%s: %s); the warm-up compiles the rest",
                        type(exc).__name__, exc)
            complete = False
    return list(found.values()), complete


# ---- compiling -----------------------------------------------------------------------------------

def _kernel(v: Variant):
    return getattr(importlib.import_module(v.module), v.qualname)


def _source(v: Variant):
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _kernel(v)
    return (GluonASTSource if fn.is_gluon() else ASTSource)(fn, v.signature, v.constants, v.attrs)


def cached(v: Variant) -> bool:
    """Whether Triton's cache holds this variant (``triton.compile``'s own lookup, without compiling)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src = _source(v)
    backend = make_backend(v.target)
    options = backend.parse_options(dict(v.options, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(f"{src.name[:150]}.json")
    return group is not None


def missing(variants: Sequence[Variant]) -> list[Variant]:
    return [v for v in variants if not cached(v)]


def compile_one(v: Variant) -> tuple[str, float, str | None]:
    """Compile ``v`` into this process's Triton cache dir: (name, seconds, error or None). Needs
    no GPU."""
    import triton

    t0 = time.perf_counter()
    try:
        triton.compile(_source(v), target=v.target, options=v.options)
    except Exception as exc:  # noqa: BLE001 - reported; the warm-up compiles it itself
        return v.name, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    return v.name, time.perf_counter() - t0, None


class _Workers:
    """``count`` worker processes (``python -m kernels.precompile``), each compiling the variants it
    is handed one at a time (pickled over its stdin and stdout), fed from one queue by a thread per
    worker. Plain subprocesses, not multiprocessing's: those import the parent's ``__main__`` (the
    whole server) again, and a fork of this process would inherit CUDA and the server's threads."""

    def __init__(self, count: int, cache_dir: str):
        root = str(Path(__file__).resolve().parent.parent)  # this checkout's kernels, not another's
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        env.pop("TRITON_INTERPRET", None)  # compiling needs the real JIT functions
        self.procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, cwd=root) for _ in range(count)]

    def map(self, variants: Sequence[Variant]) -> list[tuple[str, float, str | None]]:
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for v in variants:
            todo.put(v)
        results: list = []

        def drive(proc: subprocess.Popen) -> None:
            while True:
                try:
                    v = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    _send(proc.stdin, v)
                    results.append(_receive(proc.stdout))
                except (OSError, EOFError, pickle.UnpicklingError) as exc:
                    results.append((v.name, 0.0, f"worker {proc.pid} gone ({type(exc).__name__}: {exc})"))
                    return

        with ThreadPoolExecutor(len(self.procs), "attnserve-precompile") as ex:
            list(ex.map(drive, self.procs))
        while True:  # what no worker took (every one gone)
            try:
                results.append((todo.get_nowait().name, 0.0, "no worker left"))
            except queue.Empty:
                return results

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # a worker ends at the end of its input
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("end of stream")
    return pickle.loads(stream.read(int.from_bytes(header, "little")))


def compile_all(variants: Sequence[Variant], workers: int = 0, kind: str = "processes") -> tuple[int, int, float]:
    """Compile ``variants`` into Triton's cache dir on ``workers`` (0: ``default_workers()``)
    processes or threads: (compiled, failed, summed compile seconds). Failures are logged."""
    if kind not in KINDS:
        raise ValueError(f"precompile kind {kind!r}: one of {KINDS}")
    if not variants:
        return 0, 0, 0.0
    workers = min(workers or default_workers(), len(variants))
    cache_dir = str(knobs.cache.dir)
    if kind == "threads":
        with ThreadPoolExecutor(workers, "attnserve-precompile") as ex:
            results = list(ex.map(compile_one, variants))
    else:
        pool = _Workers(workers, cache_dir)
        try:
            results = pool.map(variants)
        finally:
            pool.close()
    failed = [(name, error) for name, _, error in results if error is not None]
    slowest = sorted(results, key=lambda r: -r[1])[:5]
    log.debug("precompile: slowest compiles: %s", ", ".join(f"{name} {seconds:.1f}s" for name, seconds, _ in slowest))
    for name, error in failed[:5]:
        log.warning("precompile: %s failed (%s); the warm-up compiles it", name, error)
    if len(failed) > 5:
        log.warning("precompile: %d more failed", len(failed) - 5)
    return len(results) - len(failed), len(failed), sum(seconds for _, seconds, _ in results)


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """One compiler per cache dir at a time: servers sharing the dir (``--processes``, pods on one
    volume) wait for the first, then find its kernels cached instead of compiling them again.
    Where the folder takes no lock (read-only, a filesystem without ``flock``), none is held."""
    try:
        folder = Path(knobs.cache.dir)
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / LOCK_NAME, "a")  # noqa: SIM115 - closed below
    except OSError as exc:
        log.info("precompile: no lock in the Triton cache dir (%s); compiling without one", exc)
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as exc:
            log.info("precompile: the Triton cache dir takes no lock (%s); compiling without one", exc)
        yield  # an unlocked file's close releases nothing; a locked one's releases the lock


MARKER_DIR = "attnserve-precompile"


def _marker(warmup_key: str) -> Path:
    """Where a warm-up's marker lives: a file of Triton's cache dir named by the warm-up (``warmup_key``:
    its shapes, dtypes, layers), the kernels' sources, Triton's version and cache-invalidating
    environment variables and the visible GPU. Change any of them and the marker is another file."""
    import torch
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars

    h = hashlib.sha256()
    for part in (warmup_key, triton.__version__, repr(sorted(get_cache_invalidating_env_vars().items()))):
        h.update(part.encode() + b"\0")
    if torch.cuda.is_available():
        h.update(repr((torch.cuda.get_device_name(), torch.cuda.get_device_capability())).encode())
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):  # every kernel and its host code
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return Path(knobs.cache.dir) / MARKER_DIR / f"{h.hexdigest()}.json"


def ahead(run: Callable[[], object], workers: int = 0, kind: str = "processes",
          warmup_key: str | None = None) -> Report | None:
    """Record what ``run`` (a warm-up) would compile, and compile what Triton's cache lacks, in
    parallel; then the caller runs ``run`` for real. The Report, or None when it was skipped or
    something failed (logged: the warm-up then compiles whatever it needs itself, one by one).

    With ``warmup_key``, a start whose every variant ended up compiled leaves a marker (``_marker``);
    a later start of the same warm-up that finds it skips the recording pass, which costs as long as
    the warm-up itself and finds nothing to compile once Triton's cache is warm."""
    marker = None
    if warmup_key is not None:
        try:
            marker = _marker(warmup_key)
            if marker.is_file():
                log.info("precompile: skipped: this warm-up's kernels were all compiled by an earlier start (%s)",
                         marker.name[:16])
                return None
        except Exception as exc:  # noqa: BLE001 - without a marker, the pass runs as usual
            log.info("precompile: no marker (%s: %s)", type(exc).__name__, exc)
            marker = None
    report = Report(kind=kind)
    t0 = time.perf_counter()
    try:
        variants, report.complete = record(run)
        report.recorded = len(variants)
        report.record_s = time.perf_counter() - t0
        todo = missing(variants)
        if todo:
            with _cache_lock():
                todo = missing(todo)  # another server may have compiled them meanwhile
                report.workers = min(workers or default_workers(), len(todo))
                t1 = time.perf_counter()
                report.compiled, report.failed, report.compile_sum_s = compile_all(todo, report.workers, kind)
                report.compile_s = time.perf_counter() - t1
        report.cached = report.recorded - len(todo)
    except Exception as exc:  # noqa: BLE001 - the plain warm-up follows
        log.warning("precompile failed (%s: %s); the warm-up compiles its kernels one by one",
                    type(exc).__name__, exc, exc_info=True)
        return None
    log.info("precompile: %d kernel variants recorded in %.1fs, %d cached already, %d compiled on %d %s in %.1fs "
             "(%.1fs of compiling), %d failed", report.recorded, report.record_s, report.cached, report.compiled,
             report.workers, kind, report.compile_s, report.compile_sum_s, report.failed)
    if marker is not None and report.complete and not report.failed:
        with contextlib.suppress(OSError):  # a read-only cache keeps no marker: the pass runs each start
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"warmup": warmup_key, "variants": report.recorded}))
    return report


def _worker_main() -> None:
    """``python -m kernels.precompile``: compile each pickled Variant read from stdin, answer each
    with ``compile_one``'s pickled tuple on stdout (anything else printed goes to stderr)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            v = _receive(sys.stdin.buffer)
        except EOFError:
            return
        _send(out, compile_one(v))


if __name__ == "__main__":
    _worker_main()
