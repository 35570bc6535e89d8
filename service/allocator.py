"""glibc's malloc, tuned for big request bodies; the one module that changes another library's defaults
in the allocator.

What it changes (``mallopt``, at start-up, once):
    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = --max-body-mb (at most 1 GiB)
        freed blocks up to that size stay in the heap for reuse instead of being unmapped;
    M_ARENA_MAX = 1
        every thread allocates from the main arena.
and, while it is on, ``malloc_trim(0)`` (``trim_heap``) once the server has been idle for
--memory-trim-idle-s (``service.server.release_memory_when_idle``).

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

import ctypes
from typing import Any

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


def trim_heap() -> None:
    """``malloc_trim(0)``: hand glibc's freed heap back to the OS (what ``reuse_freed_memory`` keeps
    under load); nothing where the C library is not glibc."""
    malloc_trim = getattr(_glibc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
