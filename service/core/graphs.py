"""CUDA graphs of small attention launches: a request that comes alone to an idle GPU worker is
answered at once on the event loop by replaying the launch captured for its shape
(``Worker.run_now``, ``--graph-max-kib``).

The first request of a shape asks for a graph and takes the usual path; the worker's launcher
thread captures the graph after that launch. A replay runs the very kernels (same configs, same
split plan) that a launch of this shape runs, so its answer is bit for bit the usual one. It skips
the host time of a lone small launch: staging, the kernel launch in Python, two thread hand-offs
and the loop's wake-ups (see docs/benchmarks/service.md#latency).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from service.core.staging import aligned, copy_parts, fill_bytes, host_copy, stacked_nbytes
from service.core.types import AttentionRequest, Stamps

log = logging.getLogger("attnserve.worker")

GRAPHS_PER_WORKER = 64  # captured request shapes kept per device (each holds ~2 MiB of device memory)
WANTED_MAX = 8  # shapes waiting for a capture at once


def graph_key(req: AttentionRequest) -> tuple:
    """Requests of equal keys replay one graph: the batch key (every option the kernel sees and the
    shape but for B), extended with B."""
    return (*req.launch_key, req.q.shape[0])


def _inputs(req: AttentionRequest) -> list[tuple[torch.Tensor, torch.dtype]]:
    """(tensor, dtype it is staged as): q, k, v, kv_lengths as int32 when given, and the ALiBi
    slopes as float32 (B, Hq) when given. The slopes are an input, not part of the graph: a replay
    reads the request's own (their presence, the window and the cap are in the key)."""
    dtype = req.q.dtype
    inputs = [(req.q, dtype), (req.k, dtype), (req.v, dtype)]
    if req.kv_lengths is not None:
        inputs.append((req.kv_lengths, torch.int32))
    if req.alibi_rows is not None:
        inputs.append((req.alibi_rows, torch.float32))
    return inputs


def input_nbytes(req: AttentionRequest) -> int:
    return sum(stacked_nbytes([t], dtype) for t, dtype in _inputs(req))


def describe(req: AttentionRequest) -> str:
    return f"q {list(req.q.shape)} k {list(req.k.shape)} {req.q.dtype}"


@dataclass
class Graph:
    """One request shape's launch, captured: the kernels of ``kernels.attention`` reading static
    device inputs (``dev_in``, filled from the pinned ``host_in``) and writing static o and lse."""

    graph: Any  # torch.cuda.CUDAGraph
    host_in: torch.Tensor  # pinned uint8: q, k, v (, kv_lengths) at STAGING_ALIGN offsets
    host_views: list[torch.Tensor]  # typed views of host_in, one per input
    dev_in: torch.Tensor
    o: torch.Tensor  # (B, Hq, Nq, D) on the device, written by each replay
    lse: torch.Tensor  # (B, Hq, Nq) float32
    host_o: torch.Tensor  # pinned
    host_lse: torch.Tensor  # pinned
    done: Any  # torch.cuda.Event

    @classmethod
    def capture(cls, req: AttentionRequest, device: torch.device, stream: Any, lock: Any) -> Graph:
        """Launcher thread: capture ``req``'s launch on ``stream`` (whose captures record only this
        thread's work: the event loop may replay other graphs meanwhile)."""
        inputs = _inputs(req)
        offsets, total = [], 0
        for t, dtype in inputs:
            offsets.append(total)
            total += aligned(stacked_nbytes([t], dtype))
        host_in = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dev_in = torch.empty(total, dtype=torch.uint8, device=device)
        host_views, dev = [], []  # typed views of host_in and of dev_in, one per input
        for (t, dtype), off in zip(inputs, offsets, strict=True):
            host_views.append(fill_bytes(host_in, off, [t], dtype))
            dev.append(dev_in[off : off + host_views[-1].nbytes].view(dtype).view(t.shape))
        dev_in.copy_(host_in)

        masks = req.spec.masks
        kv_lengths = dev[3] if req.kv_lengths is not None else None
        alibi = dev[-1] if masks.alibi is not None else None

        def call():
            return kernels.attention(dev[0], dev[1], dev[2], causal=req.causal, scale=req.scale,
                                     kv_lengths=kv_lengths, return_lse=True, kernel=req.kernel,
                                     window_size=(masks.left, masks.right), softcap=masks.softcap,
                                     alibi_slopes=alibi)

        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(device))  # dev_in's copy
            with lock:
                call()  # outside the capture: anything compiled or tuned on first use happens here
            stream.synchronize()
            with lock:
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    o, lse = call()
                finally:
                    graph.capture_end()
        return cls(graph=graph, host_in=host_in, host_views=host_views, dev_in=dev_in, o=o, lse=lse,
                   host_o=torch.empty(o.shape, dtype=o.dtype, pin_memory=True),
                   host_lse=torch.empty(lse.shape, dtype=lse.dtype, pin_memory=True),
                   done=torch.cuda.Event())

    def run(self, req: AttentionRequest, stream: Any, t0: float) -> tuple[torch.Tensor, torch.Tensor | None, Stamps]:
        """Event loop: o (B, Hq, Nq, D) and lse (B, Hq, Nq) or None of ``req`` (of this graph's
        key), as new CPU tensors, and the stamps of its phases. Blocks until the device is done."""
        for (t, _), view in zip(_inputs(req), self.host_views, strict=True):
            copy_parts(view, [t])
        with torch.cuda.stream(stream):
            self.dev_in.copy_(self.host_in, non_blocking=True)
            inputs = time.perf_counter()
            self.graph.replay()
            self.host_o.copy_(self.o, non_blocking=True)
            if req.return_lse:
                self.host_lse.copy_(self.lse, non_blocking=True)
            self.done.record(stream)
        launched = time.perf_counter()
        self.done.synchronize()
        o = host_copy(self.host_o)
        lse = host_copy(self.host_lse) if req.return_lse else None
        return o, lse, (t0, inputs, launched, time.perf_counter())


class Graphs:
    """One worker's graphs: captured by its launcher thread, replayed by the event loop. The state
    is in dicts and a set, so that each thread's step is one atomic operation under the GIL."""

    def __init__(self, name: str, device: torch.device, max_bytes: int):
        self.name, self.device, self.max_bytes = name, device, max_bytes
        self._graphs: dict[tuple, Graph] = {}
        self._wanted: dict[tuple, AttentionRequest] = {}  # key -> a request of that shape
        self._refused: set[tuple] = set()  # shapes whose capture or replay failed: never tried again
        # a stream being captured records whatever is launched on it, from any thread: one each
        self._capture_stream = self._replay_stream = None

    def start(self) -> None:
        """Launcher thread, once the device is set."""
        self._capture_stream = torch.cuda.Stream(self.device)
        self._replay_stream = torch.cuda.Stream(self.device)

    @property
    def wanted(self) -> bool:
        """Whether some shape waits for a capture."""
        return bool(self._wanted)

    def replay(self, req: AttentionRequest) -> tuple[torch.Tensor, torch.Tensor | None, Stamps] | None:
        """Event loop: (o, lse, stamps) of ``req`` from its shape's graph, or None when there is no
        graph for it (then its shape is asked for, if small enough), its deadline passed, or its
        replay failed."""
        key = graph_key(req)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._refused and len(self._wanted) < WANTED_MAX and input_nbytes(req) <= self.max_bytes:
                self._wanted.setdefault(key, req)
            return None
        if req.deadline is not None and req.deadline <= time.monotonic():
            return None  # the usual path answers DeadlineExceeded
        try:
            return graph.run(req, self._replay_stream, time.perf_counter())
        except Exception:  # noqa: BLE001 - the usual path serves this shape from now on
            log.exception("worker %s: replaying the CUDA graph of %s failed; dropping it", self.name, describe(req))
            self._graphs.pop(key, None)
            self._refused.add(key)
            return None

    def capture_wanted(self, lock: Any) -> None:
        """Launcher thread: capture a graph for each shape ``replay`` asked for."""
        while self._wanted:
            try:
                key, req = self._wanted.popitem()
            except KeyError:
                return
            if key in self._graphs or key in self._refused:
                continue
            t0 = time.perf_counter()
            try:
                graph = Graph.capture(req, self.device, self._capture_stream, lock)
            except Exception as exc:  # noqa: BLE001 - such requests keep the usual path
                self._refused.add(key)
                log.warning("worker %s: no CUDA graph for %s (%r); such requests take the usual path",
                            self.name, describe(req), exc)
                continue
            if len(self._graphs) >= GRAPHS_PER_WORKER:  # drop the oldest capture (list(): one step
                self._graphs.pop(list(self._graphs)[0], None)  # under the GIL, the loop may pop too)
            self._graphs[key] = graph
            log.debug("worker %s: captured a CUDA graph for %s in %.1f ms", self.name, describe(req),
                      1e3 * (time.perf_counter() - t0))

    def clear(self) -> None:
        """Let every graph go (their device memory pools and pinned buffers)."""
        self._graphs.clear()
