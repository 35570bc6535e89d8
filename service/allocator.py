"""glibc's malloc, tuned for big request bodies; the one module that changes another library's defaults
in the allocator.

What it changes (``mallopt``, at start-up, once):
    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = --max-body-mb (at most 1 GiB)
        freed blocks up to that size stay in the heap for reuse instead of being unmapped;
    M_ARENA_MAX = 1
        every thread allocates from the main arena.
and, while it is on, ``malloc_trim(0)`` once the server has been idle for --memory-trim-idle-s.

Why: a request body is a fresh buffer. With glibc's defaults anything over 32 MiB is mmap'd when it
arrives and unmapped when the request ends, so every big request page-faults its whole body in
again; reused, it is read several times faster (see docs/benchmarks/service.md#soak). A
thread's own arena grows in heaps of at most 64 MiB, so anything bigger that a worker or encoder
thread allocates would be mmap'd fresh each time whatever the threshold; one arena also lets
``malloc_trim`` give back nearly all of an idle server's heap. Small allocations barely contend:
glibc serves them from per-thread caches. The cost: while requests come, the RSS keeps the
high-water mark of big bodies, which the idle trim gives back.

How to turn it off: ``--no-tune-allocator`` (or ``ATTNSERVE_TUNE_ALLOCATOR=0``): glibc keeps its
defaults and nothing is trimmed. On a C library other than glibc nothing is changed either.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from typing import Any

log = logging.getLogger("attnserve")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MAX_KEPT_BYTES = 1 << 30  # the largest freed block kept for reuse, whatever --max-body-mb says


def _glibc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator decides
        return None


def install(settings: Any) -> bool:
    """Tune glibc as the module docstring says, unless ``settings.tune_allocator`` is off; True
    when tuned (and the idle trim should run)."""
    if not settings.tune_allocator:
        return False
    return reuse_freed_memory(settings.max_body_bytes)


def reuse_freed_memory(max_body_bytes: int) -> bool:
    """Let glibc keep freed blocks of up to ``max_body_bytes`` (at most MAX_KEPT_BYTES) for reuse,
    from one arena; True when it did (False: not glibc, its allocator decides)."""
    size = min(int(max_body_bytes), MAX_KEPT_BYTES)
    mallopt = getattr(_glibc(), "mallopt", None)
    return bool(
        mallopt
        and mallopt(M_ARENA_MAX, 1)
        and mallopt(M_MMAP_THRESHOLD, size)
        and mallopt(M_TRIM_THRESHOLD, size)
    )


async def trim_heap_when_idle(engine: Any, idle_s: float, bodies: Any = None) -> None:
    """Give freed heap back to the OS (``malloc_trim``) once ``engine`` has seen no request come or
    go for ``idle_s`` (checked every ``idle_s``: trimmed within 2x of going idle).

    An idle server should not keep the peak that ``reuse_freed_memory`` keeps under load. The free
    pinned body buffers (``bodies.trim()``, when given) and the GPU workers' cached pinned staging
    buffers (``engine.release_cached_host_memory``) go back too: they count in the RSS as well.
    A body still being uploaded is not seen: a trim then costs it page faults, not correctness.
    The GPUs get back the blocks torch's caching allocator keeps free as well
    (``engine.release_cached_device_memory``), so that the device memory an ended session held
    shows as free again.
    """
    malloc_trim = getattr(_glibc(), "malloc_trim", None)
    if malloc_trim is None:
        return

    def release() -> None:
        if bodies is not None:  # its free pinned body buffers, before torch's host cache is emptied
            bodies.trim()
        engine.release_cached_host_memory()
        malloc_trim(0)

    seen = trimmed = engine.activity
    while True:
        await asyncio.sleep(idle_s)
        now = engine.activity
        if now == seen and now != trimmed and engine.requests_held == 0:
            try:
                await engine.release_cached_device_memory()
            except Exception as exc:  # noqa: BLE001 - the host memory still goes back
                log.warning("giving cached device memory back failed: %r", exc)
            await asyncio.to_thread(release)  # off the loop
            trimmed = now
        seen = now
