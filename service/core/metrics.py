"""Prometheus metrics of the engine, in the spirit of Triton's ``nv_inference_*`` family.

The engine owns one ``CollectorRegistry`` (``engine.metrics_registry``); the HTTP ``/metrics`` route
renders it (with the HTTP registry) through ``render``. A private registry
(not the global one) keeps several engines in one process (tests) from colliding.

Under ``--processes`` (``PROMETHEUS_MULTIPROC_DIR`` set before this module is imported) every value
lives in a file of that folder, ``render`` sums them over the processes, and the gauges read from
callables are set by ``refresh`` (each process every second, and at a scrape), because a process
cannot call another's callables.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

# 100 µs .. 60 s in 1-2.5-5 steps
_TIME_BUCKETS = tuple(x * s for s in (1e-4, 1e-3, 1e-2, 1e-1, 1.0) for x in (1, 2.5, 5)) + (10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    """Every series the engine exports. ``kind`` is ``attention`` or ``layer``; ``device`` e.g. ``cuda:0``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.success = Counter(
            "attnserve_inference_request_success", "Requests answered successfully", ["kind"], registry=r
        )
        self.failure = Counter(
            "attnserve_inference_request_failure",
            "Requests that failed, by error code (docs/api.md#errors)",
            ["kind", "reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "attnserve_requests_cancelled",
            "Requests whose caller went away (HTTP client disconnected, gRPC call cancelled) before "
            "the answer: 'queued' ones were dropped unlaunched; 'launched' ones had been handed to a worker "
            "(skipped there unless already running)",
            ["kind", "stage"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "attnserve_inference_queue_depth",
            "Requests waiting in the batcher (not yet launched)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.pending = Gauge(
            "attnserve_inference_pending_requests",
            "Requests held: queued or running (bounded by --max-queue-size of each process)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_duration = Histogram(
            "attnserve_inference_queue_duration_seconds",
            "Time from entering the batcher's queue to launch",
            ["kind"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "attnserve_inference_request_duration_seconds",
            "Time from entering the batcher's queue to the answer",
            ["kind"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "attnserve_inference_compute_duration_seconds",
            "Time of one launch on a worker: host->device copy, kernel, device->host copy",
            ["device"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "attnserve_inference_batch_size",
            "Requests per launch",
            ["device"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.exec_count = Counter(
            "attnserve_inference_exec", "Launches (batches) run", ["device"], registry=r
        )
        self.graph_exec = Counter(
            "attnserve_inference_graph_exec",
            "Launches that replayed a captured CUDA graph at once on the event loop (--graph-max-kib)",
            ["device"],
            registry=r,
        )
        self.oom_splits = Counter(
            "attnserve_inference_oom_split",
            "Batches split in two after a device out-of-memory",
            ["device"],
            registry=r,
        )
        self.sessions = Gauge(
            "attnserve_sessions", "Sessions held (docs/api.md#sessions)", ["device"], registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_used = Gauge(
            "attnserve_kv_cache_used_bytes", "KV cache bytes in pages held by sessions", ["device"], registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_capacity = Gauge(
            "attnserve_kv_cache_capacity_bytes", "KV cache size (--kv-cache-mb)", ["device"], registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_pages_free = Gauge(
            "attnserve_kv_cache_pages_free", "KV cache pages allocated and not held by a session", ["device"],
            registry=r, multiprocess_mode="livesum",
        )
        self.session_queue_depth = Gauge(
            "attnserve_session_queue_depth", "Session steps waiting for a launch", ["device"], registry=r,
            multiprocess_mode="livesum",
        )
        self.session_expired = Counter(
            "attnserve_session_expired", "Sessions released after --session-idle-s without a step", registry=r
        )
        self.session_batch_size = Histogram(
            "attnserve_session_batch_size",
            "Session steps per paged launch (its count: the launches; its sum: the steps)",
            ["device"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.session_inline = Counter(
            "attnserve_session_inline",
            "Session steps that came alone and ran at once on the event loop (--session-inline-rows)",
            ["device"],
            registry=r,
        )
        self.session_graph_exec = Counter(
            "attnserve_session_graph_exec",
            "Session steps run at once by replaying a captured CUDA graph (--graph-max-kib)",
            ["device"],
            registry=r,
        )
        self.memory_used = Gauge(
            "attnserve_gpu_memory_used_bytes",
            "Device memory held by tensors (torch.cuda.memory_allocated)",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",  # processes that share a device: their sum
        )
        self.memory_reserved = Gauge(
            "attnserve_gpu_memory_reserved_bytes",
            "Device memory torch's caching allocator holds from the card (torch.cuda.memory_reserved): "
            "the tensors and the free blocks kept for reuse, given back once the server is idle "
            "(--memory-trim-idle-s)",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.memory_total = Gauge(
            "attnserve_gpu_memory_total_bytes", "Device memory of the card", ["device"], registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "attnserve_ready", "1 when every worker is warm and the engine is not draining (under "
            "--processes: in every process)", registry=r, multiprocess_mode="livemin",
        )
        self._sampled: list[tuple[Gauge, Callable[[], float]]] = []  # set by refresh (multiprocess)

        # Label children looked up once: ``labels()`` costs more than the observation itself.
        kinds = ("attention", "layer")
        self.success_of = {k: self.success.labels(k) for k in kinds}
        self.queue_duration_of = {k: self.queue_duration.labels(k) for k in kinds}
        self.request_duration_of = {k: self.request_duration.labels(k) for k in kinds}
        self._failure_of: dict[tuple[str, str], Counter] = {}  # (kind, reason) -> child, filled as seen

    def failed(self, kind: str, reason: str) -> None:
        """Count one failed request (under overload, QueueFull comes once per request)."""
        child = self._failure_of.get((kind, reason))
        if child is None:
            child = self._failure_of[kind, reason] = self.failure.labels(kind, reason)
        child.inc()

    def _sample(self, gauge: Gauge, fn: Callable[[], float]) -> None:
        # multiprocess: read from the first refresh on (not now: the owner may be under construction)
        if MULTIPROCESS:
            self._sampled.append((gauge, fn))
        else:
            gauge.set_function(fn)

    def refresh(self) -> None:
        """Set the sampled gauges now (multiprocess only: otherwise they are read at each scrape)."""
        for gauge, fn in self._sampled:
            gauge.set(fn())

    def track_queue(self, queued, held) -> None:
        """Read the batcher's counts (callables) at each scrape instead of setting them per request."""
        self._sample(self.queue_depth, queued)
        self._sample(self.pending, held)

    def track_sessions(self, device: str, held, used, capacity, pages_free, queued) -> None:
        """Read a worker's session count, KV cache counters and queued steps (callables) at each scrape."""
        self._sample(self.sessions.labels(device), held)
        self._sample(self.session_queue_depth.labels(device), queued)
        self._sample(self.kv_used.labels(device), used)
        self._sample(self.kv_capacity.labels(device), capacity)
        self._sample(self.kv_pages_free.labels(device), pages_free)

    def track_device_memory(self, device: str) -> None:
        """Sample a CUDA device's memory at each scrape (no polling thread)."""
        import torch

        index = torch.device(device).index or 0
        self._sample(self.memory_used.labels(device), lambda: torch.cuda.memory_allocated(index))
        self._sample(self.memory_reserved.labels(device), lambda: torch.cuda.memory_reserved(index))
        self.memory_total.labels(device).set(torch.cuda.get_device_properties(index).total_memory)


def render(*registries: CollectorRegistry) -> bytes:
    """Prometheus text of ``registries`` (one process), or under ``--processes`` of every process."""
    if MULTIPROCESS:
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
    return b"".join(generate_latest(r) for r in registries)
