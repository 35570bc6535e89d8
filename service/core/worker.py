"""A worker per device: it warms the kernels, then runs batches off the event loop, in its own thread.

One launch of a batch (``Worker.submit``):
    requests (CPU tensors, maybe read-only views of request bytes; never written into)
      -> concatenated along B into one staging tensor (pinned host memory on a GPU)
      -> copied to the device (non-blocking, on the worker's own CUDA stream)
      -> one kernel launch (``kernels.attention``) or one layer forward
      -> copied back into pinned host memory, split along B: one answer per request.

A request that comes alone to an idle server may instead be answered at once on the event loop
(``Worker.run_now``): its shape's launch, captured once as a CUDA graph, is replayed.

Faults stay inside the batch: a device out-of-memory splits the batch in halves and retries each
(one oversized request cannot fail the others; alone it gets 503); any other error is retried
request by request, so that a bad request fails alone, and becomes a ``ServiceError`` with a safe
message. The worker stays usable afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from service.core.metrics import Metrics
from service.core.types import AttentionRequest, AttentionResult, LayerRequest, LayerResult, Stamps
from service.errors import DeadlineExceeded, InvalidInput, ServiceError, Unavailable, from_kernel_error
from service.settings import Settings
from service.wire.tensors import FLOAT_DTYPES

log = logging.getLogger("attnserve.worker")

# Triton's JIT and autotuner keep per-kernel state (first-call compile, ``Autotuner.nargs``,
# benchmarking a new key) that is not safe to drive from two threads at once: GPU workers enqueue
# their launches one at a time. A launch is asynchronous, so this costs little; the GPUs still
# run in parallel.
_LAUNCH_LOCK = threading.Lock()

SHARED_STAGING_MAX_BYTES = 1 << 20  # groups up to this size share one pinned buffer and one transfer
STAGING_ALIGN = 256  # each group's offset in a shared buffer (kernels want 16-byte aligned inputs)
SERIAL_COPY_MAX_BYTES = 4 << 20  # parts up to this size are staged by one memcpy each
GRAPHS_PER_WORKER = 64  # captured request shapes kept per device (each holds ~2 MiB of device memory)

Outcome = AttentionResult | LayerResult | ServiceError
Request = AttentionRequest | LayerRequest



def resolve_devices(spec: str) -> list[torch.device]:
    """'auto' (every visible GPU, else the CPU), 'cpu', 'cuda' (every GPU) or 'cuda:0,cuda:1'."""
    spec = spec.strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        devices = [torch.device(part.strip()) for part in spec.split(",") if part.strip()]
    except RuntimeError:
        raise ValueError(
            f"--device {spec}: use 'auto', 'cpu', 'cuda' or a list such as 'cuda:0,cuda:1'"
        ) from None
    for d in devices:
        if d.type == "cuda":
            if not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"--device {spec}: {d} is not visible")
        elif d.type != "cpu":
            raise ValueError(f"--device {spec}: only 'cpu' and 'cuda[:N]' are supported, got {d}")
    if not devices:
        raise ValueError("--device is empty")
    return [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in devices]


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'1x8x128x64,1x32x1024x128' -> [(B, H, N, D), ...]."""
    shapes = []
    for part in text.split(","):
        if part.strip():
            try:
                dims = tuple(int(x) for x in part.strip().lower().split("x"))
            except ValueError:
                dims = ()
            if len(dims) != 4 or min(dims) < 1:
                raise ValueError(f"warm-up shape {part.strip()!r} must be BxHxNxD, four positive integers")
            shapes.append(dims)
    return shapes


def parse_dtypes(text: str) -> list[torch.dtype]:
    """'float16,bfloat16' -> [torch.float16, torch.bfloat16]."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in FLOAT_DTYPES:
            raise ValueError(f"warm-up dtype {name!r} is not supported; choose from {', '.join(FLOAT_DTYPES)}")
    return [FLOAT_DTYPES[name] for name in names]


def attention_memory(req: AttentionRequest, device_type: str) -> int:
    """Bytes of device memory one launch of ``req`` needs (inputs, outputs, kernel workspace)."""
    b, hq, nq, d = req.q.shape
    hkv, nk = req.k.shape[1], req.k.shape[2]
    es = req.q.element_size()
    need = es * (2 * b * hq * nq * d + 2 * b * hkv * nk * d) + 4 * b * hq * nq + 8 * b
    if req.kernel == "reference":  # materialises S and P in float32, expands k/v to Hq heads
        need += 4 * (3 * b * hq * nq * nk + 2 * b * hq * nk * d + 2 * b * hq * nq * d)
    elif req.kernel == "flash_v1":  # float32 O/m/l partials, one per key slice (kernels/flash_v1.py)
        from kernels.flash_v1 import MAX_SPLITS

        need += 4 * MAX_SPLITS * b * hq * nq * (d + 2)
    elif device_type == "cpu":  # the blockwise CPU path: float32 accumulators + one score block
        need += 4 * (3 * b * hq * nq * d + 3 * min(b * hq * nq * nk, 1 << 24))
    return need


def layer_memory(req: LayerRequest, hidden: int) -> int:
    """Bytes a layer call needs: x, q/k/v/o projections and y, in float32 at worst."""
    b, n = req.x.shape[0], req.x.shape[1]
    return 4 * b * n * hidden * 8


def release_pinned_memory() -> None:
    """Hand the pinned host blocks that torch's caching host allocator holds unused back to CUDA:
    it keeps every staging buffer (rounded up to a power of two) for reuse, and they count in
    the process's RSS."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)  # torch before torch.accelerator had it
    if empty is not None:
        empty()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


class Worker:
    """Owns one device: its thread, its CUDA stream, its copies of the layers."""

    def __init__(self, device: torch.device, settings: Settings, metrics: Metrics, layers: dict[str, Any]):
        self.device = device
        self.name = str(device)
        self.settings = settings
        self.metrics = metrics
        self._host_layers = layers
        self.layers: dict[str, Any] = {}  # name -> DeviceLayer
        self.ready = False
        self.inflight = 0  # batches handed to this worker and not finished (the batcher counts)
        self.inflight_tokens = 0
        self.memory_budget = 0
        # this device's series, looked up once (``labels()`` costs more than an observation)
        self._compute_duration = metrics.compute_duration.labels(self.name)
        self._batch_size = metrics.batch_size.labels(self.name)
        self._exec_count = metrics.exec_count.labels(self.name)
        self._cuda = device.type == "cuda"
        self._copy_in_stream = self._compute_stream = self._copy_out_stream = None
        # CUDA graphs of small request shapes (``run_now``), captured by the launcher thread after
        # a launch, replayed by the event loop; dicts, so that each thread's step is atomic
        self._graph_bytes = int(settings.graph_max_kib * 1024) if self._cuda else 0
        self._graphs: dict[tuple, _Graph] = {}
        self._graph_wanted: dict[tuple, AttentionRequest] = {}  # key -> a request of that shape
        self._graph_refused: set[tuple] = set()  # shapes whose capture failed: never tried again
        self._graph_exec = metrics.graph_exec.labels(self.name)
        self._capture_stream = self._replay_stream = None
        init = (lambda: torch.cuda.set_device(device)) if self._cuda else None
        self._launcher = ThreadPoolExecutor(1, f"attnserve-launch-{self.name}", initializer=init)
        self._finisher = ThreadPoolExecutor(1, f"attnserve-finish-{self.name}", initializer=init)

    # ---- start-up -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Move the layers to the device, compile and warm the kernels; then ``ready``."""
        await asyncio.get_running_loop().run_in_executor(self._launcher, self._start)
        self.ready = True

    def _start(self) -> None:
        t0 = time.perf_counter()
        if self._cuda:
            self._copy_in_stream = torch.cuda.Stream(self.device)
            self._compute_stream = torch.cuda.Stream(self.device)
            self._copy_out_stream = torch.cuda.Stream(self.device)
            # two more: a stream being captured records whatever is launched on it, from any thread
            self._capture_stream = torch.cuda.Stream(self.device)
            self._replay_stream = torch.cuda.Stream(self.device)
            self.metrics.track_device_memory(self.name)
        for name, layer in self._host_layers.items():
            self.layers[name] = layer.to(self.device)
        with self._launch_lock():
            self._warmup()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            self.memory_budget = int(total * self.settings.memory_fraction) - torch.cuda.memory_allocated(
                self.device
            )
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.memory_budget = int(total * self.settings.memory_fraction)
        log.info(
            "worker %s warm in %.1fs (memory budget %.1f GiB)",
            self.name,
            time.perf_counter() - t0,
            self.memory_budget / 2**30,
        )

    def _warmup(self) -> None:
        """Compile (and autotune) the kernels for the configured shapes and for every layer."""
        with torch.no_grad():
            for layer in self.layers.values():  # the layer's head dim and dtype
                x = torch.zeros(1, 16, layer.info.hidden_size, device=self.device)
                for causal in (False, True):
                    layer.forward(x, causal=causal)
            shapes = parse_shapes(self.settings.warmup_shapes)
            dtypes = parse_dtypes(self.settings.warmup_dtypes) if self._cuda else [torch.float32]
            if not self._cuda:  # nothing to compile or tune on the CPU: check each head dim's path runs
                shapes = sorted({(1, 1, min(n, 64), d) for _, _, n, d in shapes})
            if shapes:
                kernels.warmup(shapes=shapes, dtypes=dtypes, device=self.device)

    # ---- running a batch ----------------------------------------------------------------------

    def submit(self, requests: Sequence[Request]) -> asyncio.Future[list[Outcome]]:
        """Start one launch of ``requests`` now; its future (on the running loop) gives one outcome
        per request, in order: a result or the ServiceError that request gets.

        Two stages, each in its own thread, so that consecutive batches overlap: the launcher
        stages the inputs and enqueues the copies and the kernel (on a GPU nothing waits there);
        the finisher waits for the device and splits the answers. The launcher hands its parts to
        the finisher itself, so the event loop wakes once per batch, when the answers are ready.
        Called on the loop, synchronously: the launcher starts while the caller goes on.

        Staging on the event loop instead of the launcher thread was tried (H200 host, 2026-11-30)
        and dropped: the engine alone answered a lone small request ~0.15 ms sooner, but through
        HTTP the stage phase took 0.40-0.41 ms either way and the call's p50 did not fall.
        """
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        answered: asyncio.Future[list[Outcome]] = loop.create_future()
        requests = list(requests)

        def settle(outcomes=None, exc=None) -> None:
            launched = len(requests) if outcomes is None else _launched(outcomes)
            if launched:  # a launch whose requests had all expired ran nothing: not a launch
                self._compute_duration.observe(time.perf_counter() - t0)
                self._batch_size.observe(launched)
                self._exec_count.inc()
            if answered.done():  # the awaiting coroutine was cancelled
                return
            if exc is not None:
                answered.set_exception(exc)
            else:
                answered.set_result(outcomes)

        def finish(parts: list[_Part], staged: float) -> None:
            try:
                outcomes = _finish_all(parts)
                inputs = max((p.staged_at for p in parts if p.staged_at), default=staged)
                stamps = (t0, inputs, staged, time.perf_counter())
                for outcome in outcomes:
                    if not isinstance(outcome, ServiceError):
                        outcome.stamps = stamps
                answer = (outcomes, None)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                answer = (None, exc)
            # The executor holds this call's arguments until it returns, and the parts hold the
            # pinned host buffers of the answers: let them go before the caller is answered, or an
            # idle release right after the answer finds them still in use (H200, 2026-11-30).
            parts.clear()
            loop.call_soon_threadsafe(settle, *answer)

        def launch() -> None:
            try:
                parts = self._launch_all(requests)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                if self._cuda:
                    self._finisher.submit(finish, parts, time.perf_counter())
                else:  # the CPU computed in the launcher: nothing is left to wait for
                    finish(parts, time.perf_counter())

        self._launcher.submit(launch)
        if self._graph_wanted:  # after this launch, not before it: its caller does not wait for a capture
            self._launcher.submit(self._capture_wanted)
        return answered

    # ---- small requests at once: CUDA graphs --------------------------------------------------

    def run_now(self, req: Request) -> AttentionResult | None:
        """Event loop: answer ``req`` now, by replaying the CUDA graph captured for its shape; or
        None when it cannot (not on a GPU, not an attention request of at most --graph-max-kib,
        deadline passed, no graph yet): the caller then queues it as usual.

        The batcher calls this only while it holds no other request, so the device is idle and the
        loop waits for it briefly: host->pinned memcpy, one host->device copy, the graph, the
        device->host copies. That skips what makes a lone small launch cost ~1 ms of host time
        (H200 host, 2026-11-30: stage 0.41-0.56 ms, launch 0.22-0.32 ms, then two thread hand-offs
        and the loop's wake-ups). The graph replays the very kernels (same configs, same split
        plan) that a launch of this shape runs, so the answer is bit for bit the usual one.

        The first request of a shape asks for a graph and takes the usual path; the launcher
        thread captures the graph after that launch."""
        if not self._graph_bytes or not isinstance(req, AttentionRequest) or req.kernel == "reference":
            return None  # (the reference kernel reads kv_lengths on the host: it cannot be captured)
        key = _graph_key(req)
        graph = self._graphs.get(key)
        if graph is None:
            if (
                key not in self._graph_refused
                and len(self._graph_wanted) < 8
                and _graph_input_nbytes(req) <= self._graph_bytes
            ):
                self._graph_wanted.setdefault(key, req)
            return None
        if req.deadline is not None and req.deadline <= time.monotonic():
            return None  # the usual path answers DeadlineExceeded
        t0 = time.perf_counter()
        try:
            o, lse, stamps = graph.run(req, self._replay_stream, t0)
        except Exception:  # noqa: BLE001 - the usual path serves this shape from now on
            log.exception("worker %s: replaying the CUDA graph of %s failed; dropping it", self.name, _describe(req))
            self._graphs.pop(key, None)
            self._graph_refused.add(key)
            return None
        self._compute_duration.observe(stamps[3] - t0)
        self._batch_size.observe(1)
        self._exec_count.inc()
        self._graph_exec.inc()
        if req.layout == "bnhd":
            o = o.transpose(1, 2).contiguous()  # (B, Hq, Nq, D) -> (B, Nq, Hq, D)
        return AttentionResult(o=o, lse=lse, request_id=req.request_id, stamps=stamps)

    def _capture_wanted(self) -> None:
        """Launcher thread: capture a graph for each shape ``run_now`` asked for."""
        while self._graph_wanted:
            try:
                key, req = self._graph_wanted.popitem()
            except KeyError:
                return
            if key in self._graphs or key in self._graph_refused:
                continue
            t0 = time.perf_counter()
            try:
                graph = _Graph.capture(req, self.device, self._capture_stream, self._launch_lock())
            except Exception as exc:  # noqa: BLE001 - such requests keep the usual path
                self._graph_refused.add(key)
                log.warning("worker %s: no CUDA graph for %s (%r); such requests take the usual path",
                            self.name, _describe(req), exc)
                continue
            if len(self._graphs) >= GRAPHS_PER_WORKER:  # drop the oldest capture (list(): one step
                self._graphs.pop(list(self._graphs)[0], None)  # under the GIL, the loop may pop too)
            self._graphs[key] = graph
            log.debug("worker %s: captured a CUDA graph for %s in %.1f ms", self.name, _describe(req),
                      1e3 * (time.perf_counter() - t0))

    def _launch_all(self, requests: list[Request]) -> list[_Part]:
        """Launcher thread: one ``_Part`` per run of consecutive requests, covering all in order."""
        now = time.monotonic()
        parts: list[_Part] = []
        live: list[Request] = []

        def flush() -> None:
            if live:
                parts.extend(self._run_group(list(live)))
                live.clear()

        for r in requests:
            if r.deadline is not None and r.deadline <= now:  # never launched once expired
                flush()
                parts.append(_failed([DeadlineExceeded("the request's deadline passed before it could run")]))
            else:
                live.append(r)
        flush()
        return parts

    def _run_group(self, reqs: list[Request]) -> list[_Part]:
        try:
            with torch.no_grad():
                if self._cuda:
                    with torch.cuda.stream(self._compute_stream):
                        part = self._launch(reqs)
                else:
                    part = self._launch(reqs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a per-request outcome
            if _is_oom(exc):
                self._after_oom()
                if len(reqs) == 1:
                    log.warning("worker %s: out of memory on one request (%s)", self.name, _describe(reqs[0]))
                    msg = "the device ran out of memory for this request; send a smaller one or retry later"
                    return [_failed([Unavailable(msg)])]
                self.metrics.oom_splits.labels(self.name).inc()
                mid = len(reqs) // 2
                return self._run_group(reqs[:mid]) + self._run_group(reqs[mid:])
            if len(reqs) > 1:  # isolate the request that fails: the others must not pay for it
                return [p for r in reqs for p in self._run_group([r])]
            return [_failed([self._error(exc, reqs[0])])]
        part.requests = reqs
        part.on_error = self._error
        return [part]

    def _error(self, exc: BaseException, req: Request) -> ServiceError:
        if isinstance(exc, ServiceError):
            return exc
        if isinstance(exc, kernels.AttentionInputError):
            return from_kernel_error(exc)
        log.error("worker %s: request %s failed: %r", self.name, req.request_id, exc, exc_info=exc)
        return ServiceError(
            f"internal error while computing the request (id {req.request_id}); "
            "it was not served, other requests are unaffected"
        )

    def _launch_lock(self):
        """The process-wide launch lock on a GPU; none on the CPU (its workers compute in parallel)."""
        return _LAUNCH_LOCK if self._cuda else contextlib.nullcontext()

    def _after_oom(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _launch(self, reqs: list[Request]) -> _Part:
        if isinstance(reqs[0], AttentionRequest):
            return self._launch_attention(reqs)  # type: ignore[arg-type]
        return self._launch_layer(reqs)  # type: ignore[arg-type]

    def _stage(self, *groups: tuple[Sequence[torch.Tensor], torch.dtype] | None) -> list[torch.Tensor | None]:
        """One tensor per group of parts: the parts concatenated along dim 0, as ``dtype``, on the
        device (None stays None). Request bytes are read, never written.

        On a GPU the parts are copied into pinned host memory and sent by DMA on the copy-in stream
        (entered once: entering costs ~10-20 us); the compute stream then waits for them. Small
        groups share one pinned buffer and one transfer (each transfer and each pinned tensor costs
        ~10 us of host time, a pageable copy ~15-25 us); a big group gets its own, so that its
        transfer runs while the next group is staged (H200: a 1x32x8192x128 bf16 request ran at
        17% of the kernel's rate with pageable copies, 21-23% with pinned staging). On the CPU a
        lone part is used as it is.
        """
        if not self._cuda:
            return [None if g is None else _concat(*g, pin=False) for g in groups]
        out: list[torch.Tensor | None] = [None] * len(groups)
        shared: list[tuple[int, int, tuple[Sequence[torch.Tensor], torch.dtype]]] = []  # (index, offset, group)
        shared_bytes = 0
        with torch.cuda.stream(self._copy_in_stream):
            for i, g in enumerate(groups):
                if g is None:
                    continue
                nbytes = _stacked_nbytes(*g)
                if nbytes > SHARED_STAGING_MAX_BYTES:
                    parts, dtype = g
                    lone = parts[0] if len(parts) == 1 else None
                    if lone is not None and lone.dtype == dtype and lone.is_contiguous() and lone.is_pinned():
                        out[i] = lone.to(self.device, non_blocking=True)  # a body read into pinned memory
                    else:
                        out[i] = _concat(*g, pin=True).to(self.device, non_blocking=True)
                else:
                    shared.append((i, shared_bytes, g))
                    shared_bytes += _aligned(nbytes)
            if shared:
                host = torch.empty(shared_bytes, dtype=torch.uint8, pin_memory=True)
                views = [(i, off, _fill_bytes(host, off, *g)) for i, off, g in shared]
                dev = host.to(self.device, non_blocking=True)
                for i, off, v in views:  # the same typed view of the device bytes
                    out[i] = dev[off : off + v.nbytes].view(v.dtype).view(v.shape)
        self._compute_stream.wait_stream(self._copy_in_stream)
        return out

    def _to_host(self, tensors: Sequence[torch.Tensor | None]) -> tuple[list, Any]:
        """Enqueue device->host copies into pinned memory after the compute so far; return the host
        tensors and an event that marks them complete (None on the CPU)."""
        if not self._cuda:
            return list(tensors), None
        out = []
        self._copy_out_stream.wait_stream(self._compute_stream)
        with torch.cuda.stream(self._copy_out_stream):
            for t in tensors:
                if t is None:
                    out.append(None)
                    continue
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                out.append(h)
            done = torch.cuda.Event()
            done.record(self._copy_out_stream)
        return out, done

    def _launch_attention(self, reqs: list[AttentionRequest]) -> _Part:
        first = reqs[0]
        dtype = first.q.dtype
        q, k, v, kv_lengths = self._stage(  # (ΣB, Hq, Nq, D), (ΣB, Hkv, Nk, D) x2, (ΣB,) or None
            ([r.q for r in reqs], dtype),
            ([r.k for r in reqs], dtype),
            ([r.v for r in reqs], dtype),
            # kv_lengths presence is part of the batch key
            ([r.kv_lengths for r in reqs], torch.int32) if first.kv_lengths is not None else None,
        )
        staged_at = time.perf_counter()
        with self._launch_lock():
            o, lse = kernels.attention(
                q,
                k,
                v,
                causal=first.causal,
                scale=first.scale,  # equal across the batch (part of its key); None: 1/sqrt(D)
                kv_lengths=kv_lengths,
                return_lse=True,
                kernel=first.kernel,
            )
        want_lse = any(r.return_lse for r in reqs)
        (o_host, lse_host), done = self._to_host([o, lse if want_lse else None])
        keep = (q, k, v, kv_lengths, o, lse)  # device memory stays ours until the copies are done

        def split() -> list[Outcome]:
            results: list[Outcome] = []
            b0 = 0
            for r in reqs:
                b1 = b0 + r.q.shape[0]
                o_r = o_host[b0:b1]  # (B, Hq, Nq, D), a view
                if r.layout == "bnhd":
                    o_r = o_r.transpose(1, 2).contiguous()  # -> (B, Nq, Hq, D)
                lse_r = lse_host[b0:b1] if r.return_lse else None
                results.append(AttentionResult(o=o_r, lse=lse_r, request_id=r.request_id))
                b0 = b1
            return results

        return _Part(split=split, done=done, keep=keep, staged_at=staged_at)

    def _launch_layer(self, reqs: list[LayerRequest]) -> _Part:
        first = reqs[0]
        layer = self.layers.get(first.layer)
        if layer is None:
            raise InvalidInput(f"layer {first.layer!r} is not loaded on {self.name}")
        x, positions, kv_lengths = self._stage(  # (ΣB, N, hidden), (ΣB, N) or None, (ΣB,) or None
            ([r.x for r in reqs], layer.info.dtype),
            ([r.positions for r in reqs], torch.int64) if first.positions is not None else None,
            ([r.kv_lengths for r in reqs], torch.int32) if first.kv_lengths is not None else None,
        )
        staged_at = time.perf_counter()
        with self._launch_lock():
            y = layer.forward(x, causal=first.causal, positions=positions, kv_lengths=kv_lengths)
        (y_host,), done = self._to_host([y])
        keep = (x, positions, kv_lengths, y)

        def split() -> list[Outcome]:
            results: list[Outcome] = []
            b0 = 0
            for r in reqs:
                b1 = b0 + r.x.shape[0]
                results.append(LayerResult(y=y_host[b0:b1], request_id=r.request_id))
                b0 = b1
            return results

        return _Part(split=split, done=done, keep=keep, staged_at=staged_at)

    def close(self) -> None:
        self._launcher.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        self._graphs.clear()  # their device memory pools and pinned buffers


def _stacked_shape(parts: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The shape of ``parts`` concatenated along dim 0."""
    return (sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to STAGING_ALIGN: the room one input takes in a shared staging buffer."""
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def _stacked_nbytes(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
    return math.prod(_stacked_shape(parts)) * dtype.itemsize


def _fill_bytes(buf: torch.Tensor, offset: int, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """parts concatenated along dim 0, as ``dtype``, written into the uint8 ``buf`` at ``offset``;
    returns that typed view."""
    shape = _stacked_shape(parts)
    view = buf[offset : offset + _stacked_nbytes(parts, dtype)].view(dtype).view(shape)
    _copy_parts(view, parts)
    return view


def _concat(parts: Sequence[torch.Tensor], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """parts concatenated along dim 0 as ``dtype``, in a new buffer (pinned host memory if
    ``pin``); a lone unpinned part of the right dtype is returned as it is."""
    if not pin and len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    buf = torch.empty(_stacked_shape(parts), dtype=dtype, pin_memory=pin)
    _copy_parts(buf, parts)
    return buf


def _copy_parts(dst: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """dst[b0:b1] = part, for consecutive parts along dim 0 (dst: contiguous host memory).

    A small contiguous part of dst's dtype is one ``memmove`` (ctypes releases the GIL for it):
    ATen's copy forks and joins its OpenMP team per part, which made a 64-part batch's staging
    cost 2.7 ms on a 32-core H200 host (3 GB/s). Big parts keep ATen's parallel copy."""
    b0 = 0
    base = dst.data_ptr()
    row = math.prod(dst.shape[1:]) * dst.element_size()
    for p in parts:
        b1 = b0 + p.shape[0]
        if (
            p.dtype == dst.dtype
            and p.device.type == "cpu"
            and p.nbytes <= SERIAL_COPY_MAX_BYTES
            and p.is_contiguous()
        ):
            ctypes.memmove(base + b0 * row, p.data_ptr(), p.nbytes)
        else:
            dst[b0:b1].copy_(p)  # a converting copy when dtypes differ
        b0 = b1


def _graph_key(req: AttentionRequest) -> tuple:
    """Requests of equal keys replay one graph: their shapes and every option the kernel sees."""
    return (tuple(req.q.shape), tuple(req.k.shape), req.q.dtype, req.causal, req.scale, req.kernel,
            req.kv_lengths is not None)


def _graph_inputs(req: AttentionRequest) -> list[tuple[torch.Tensor, torch.dtype]]:
    """(tensor, dtype it is staged as): q, k, v, and kv_lengths as int32 when given."""
    dtype = req.q.dtype
    inputs = [(req.q, dtype), (req.k, dtype), (req.v, dtype)]
    if req.kv_lengths is not None:
        inputs.append((req.kv_lengths, torch.int32))
    return inputs


def _graph_input_nbytes(req: AttentionRequest) -> int:
    return sum(_stacked_nbytes([t], dtype) for t, dtype in _graph_inputs(req))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A new (pageable) CPU tensor equal to the contiguous host tensor ``t``: one memmove."""
    out = torch.empty(t.shape, dtype=t.dtype)
    ctypes.memmove(out.data_ptr(), t.data_ptr(), t.nbytes)
    return out


@dataclass
class _Graph:
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
    def capture(cls, req: AttentionRequest, device: torch.device, stream: Any, lock: Any) -> _Graph:
        """Launcher thread: capture ``req``'s launch on ``stream`` (whose captures record only this
        thread's work: the event loop may replay other graphs meanwhile)."""
        inputs = _graph_inputs(req)
        offsets, total = [], 0
        for t, dtype in inputs:
            offsets.append(total)
            total += _aligned(_stacked_nbytes([t], dtype))
        host_in = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dev_in = torch.empty(total, dtype=torch.uint8, device=device)
        host_views, dev = [], []  # typed views of host_in and of dev_in, one per input
        for (t, dtype), off in zip(inputs, offsets, strict=True):
            host_views.append(_fill_bytes(host_in, off, [t], dtype))
            dev.append(dev_in[off : off + host_views[-1].nbytes].view(dtype).view(t.shape))
        dev_in.copy_(host_in)

        def call():
            return kernels.attention(dev[0], dev[1], dev[2], causal=req.causal, scale=req.scale,
                                     kv_lengths=dev[3] if len(dev) > 3 else None, return_lse=True,
                                     kernel=req.kernel)

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
        for (t, _), view in zip(_graph_inputs(req), self.host_views, strict=True):
            _copy_parts(view, [t])
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
        o = _host_copy(self.host_o)
        lse = _host_copy(self.host_lse) if req.return_lse else None
        return o, lse, (t0, inputs, launched, time.perf_counter())


def _describe(r: Request) -> str:
    if isinstance(r, AttentionRequest):
        return f"q {list(r.q.shape)} k {list(r.k.shape)} {r.q.dtype}"
    return f"layer {r.layer} x {list(r.x.shape)}"


@dataclass
class _Part:
    """Consecutive requests of a batch, launched together (or failed together before launch).

    ``done`` (a CUDA event, or None) marks the device work complete; ``split`` then gives one
    outcome per request; ``keep`` holds the device tensors alive until then."""

    split: Callable[[], list[Outcome]]
    done: Any = None
    keep: tuple = ()
    requests: list = field(default_factory=list)
    on_error: Callable[[BaseException, Any], ServiceError] | None = None
    staged_at: float | None = None  # time.perf_counter() once its inputs were staged


def _launched(outcomes: list[Outcome]) -> int:
    """Requests of a launch that ran: all but those ``_launch_all`` skipped as expired (the only
    DeadlineExceeded a launch gives)."""
    return sum(not isinstance(o, DeadlineExceeded) for o in outcomes)


def _failed(errors: list[ServiceError]) -> _Part:
    return _Part(split=lambda: list(errors))


def _finish_all(parts: list[_Part]) -> list[Outcome]:
    """Finisher thread: wait for each part's device work, then split its answers."""
    outcomes: list[Outcome] = []
    for part in parts:
        try:
            if part.done is not None:
                part.done.synchronize()
            out = part.split()
        except Exception as exc:  # noqa: BLE001 - an asynchronous device error fails this part only
            assert part.on_error is not None
            out = [part.on_error(exc, r) for r in part.requests]
        if part.requests and len(out) != len(part.requests):
            raise RuntimeError(f"a launch gave {len(out)} answers for {len(part.requests)} requests")
        part.keep = ()
        outcomes.extend(out)
    return outcomes
