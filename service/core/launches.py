"""One launch of a group of requests that share a launch key, and its answers: a ``Part`` holds
what the device still works on and how to split its output along B into one outcome per request.

Staging and copies come from the worker (``stage``, ``to_host``: ``service.core.staging`` on its
streams); the launcher thread builds parts, the finisher thread waits for them (``finish_all``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from service.core.types import AttentionRequest, AttentionResult, LayerRequest, LayerResult
from service.errors import DeadlineExceeded, ServiceError

Outcome = AttentionResult | LayerResult | ServiceError


@dataclass
class Part:
    """Consecutive requests of a batch, launched together (or failed together before launch).

    ``done`` (a CUDA event, or None) marks the device work complete; ``split`` then gives one
    outcome per request; ``keep`` holds the device tensors alive until then."""

    split: Callable[[], list[Outcome]]
    done: Any = None
    keep: tuple = ()
    requests: list = field(default_factory=list)
    on_error: Callable[[BaseException, Any], ServiceError] | None = None
    staged_at: float | None = None  # time.perf_counter() once its inputs were staged


def failed(errors: list[ServiceError]) -> Part:
    return Part(split=lambda: list(errors))


def launched(outcomes: list[Outcome]) -> int:
    """Requests of a launch that ran: all but those skipped as expired (the only
    DeadlineExceeded a launch gives)."""
    return sum(not isinstance(o, DeadlineExceeded) for o in outcomes)


def finish_all(parts: list[Part]) -> list[Outcome]:
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


def launch_attention(reqs: list[AttentionRequest], stage: Callable, to_host: Callable, lock: Any) -> Part:
    """One launch of ``kernels.attention`` over ``reqs`` (one launch key), concatenated along B."""
    first = reqs[0]
    dtype = first.q.dtype
    masks = first.spec.masks  # equal across the batch but for the slopes (part of its key)
    q, k, v, kv_lengths, alibi = stage(  # (ΣB, Hq, Nq, D), (ΣB, Hkv, Nk, D) x2, (ΣB,) or None, (ΣB, Hq) or None
        ([r.q for r in reqs], dtype),
        ([r.k for r in reqs], dtype),
        ([r.v for r in reqs], dtype),
        # kv_lengths presence is part of the batch key
        ([r.kv_lengths for r in reqs], torch.int32) if first.kv_lengths is not None else None,
        # so is the presence of slopes: each request's rows, stacked, so that every row keeps its own
        ([r.alibi_rows for r in reqs], torch.float32) if masks.alibi is not None else None,
    )
    staged_at = time.perf_counter()
    with lock:
        o, lse = kernels.attention(
            q,
            k,
            v,
            causal=first.causal,
            scale=first.scale,  # equal across the batch (part of its key); None: 1/sqrt(D)
            kv_lengths=kv_lengths,
            return_lse=True,
            kernel=first.kernel,
            window_size=(masks.left, masks.right),
            softcap=masks.softcap,
            alibi_slopes=alibi,
        )
    want_lse = any(r.return_lse for r in reqs)
    (o_host, lse_host), done = to_host([o, lse if want_lse else None])
    keep = (q, k, v, kv_lengths, alibi, o, lse)  # device memory stays ours until the copies are done

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

    return Part(split=split, done=done, keep=keep, staged_at=staged_at)


def launch_layer(reqs: list[LayerRequest], layer: Any, stage: Callable, to_host: Callable, lock: Any) -> Part:
    """One forward of ``layer`` (a DeviceLayer) over ``reqs`` (one launch key), concatenated along B."""
    first = reqs[0]
    x, positions, kv_lengths = stage(  # (ΣB, N, hidden), (ΣB, N) or None, (ΣB,) or None
        ([r.x for r in reqs], layer.info.dtype),
        ([r.positions for r in reqs], torch.int64) if first.positions is not None else None,
        ([r.kv_lengths for r in reqs], torch.int32) if first.kv_lengths is not None else None,
    )
    staged_at = time.perf_counter()
    with lock:
        y = layer.forward(x, causal=first.causal, positions=positions, kv_lengths=kv_lengths)
    (y_host,), done = to_host([y])
    keep = (x, positions, kv_lengths, y)

    def split() -> list[Outcome]:
        results: list[Outcome] = []
        b0 = 0
        for r in reqs:
            b1 = b0 + r.x.shape[0]
            results.append(LayerResult(y=y_host[b0:b1], request_id=r.request_id))
            b0 = b1
        return results

    return Part(split=split, done=done, keep=keep, staged_at=staged_at)
