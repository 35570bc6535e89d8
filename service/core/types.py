"""The one internal request type and its results: what every transport builds and the batcher takes.

Tensors are host (CPU) torch tensors already decoded from the wire. Layout is normalised here, once:
requests carry q/k/v as (B, H, N, D) views, and ``layout`` says how to return ``o``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field

import torch

from service.errors import BadRequest, InvalidInput

LAYOUTS = ("bhnd", "bnhd")

# time.perf_counter() when the launch that answered a request was handed to its worker, when its
# inputs were staged (copied to pinned memory, host->device copies enqueued), when its kernel and
# device->host copies were enqueued, and when the device was done and the answers split
Stamps = tuple[float, float, float, float]


_ID_PREFIX = uuid.uuid4().hex[:12]  # unique per process; a counter makes the rest unique within it
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """A unique id without a syscall per request (uuid4 reads os.urandom every time)."""
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


@dataclass
class AttentionRequest:
    """q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D) (bhnd views), kv_lengths: int32 (B,) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    scale: float | None = None
    layout: str = "bhnd"
    return_lse: bool = False
    kv_lengths: torch.Tensor | None = None
    kernel: str = "auto"
    request_id: str = field(default_factory=new_request_id)
    deadline: float | None = None  # time.monotonic() after which the request must not launch
    arrived: float = field(default_factory=time.monotonic)

    @classmethod
    def from_layout(cls, q, k, v, *, layout: str = "bhnd", **options) -> AttentionRequest:
        """Build from tensors in ``layout`` ("bhnd" or flash-attn's "bnhd" = (B, N, H, D))."""
        if layout not in LAYOUTS:
            raise BadRequest(f"unknown layout {layout!r}; use 'bhnd' (the default) or 'bnhd' (flash-attn's)")
        if layout == "bnhd":
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.dim() != 4:
                    raise InvalidInput(f"{name} must have 4 dims [B, N, H, D] (layout bnhd), got {list(t.shape)}")
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D) -> (B, H, N, D), a view
        return cls(q=q, k=k, v=v, layout=layout, **options)


@dataclass
class AttentionResult:
    """o: in the request's layout and q's dtype; lse: float32 (B, Hq, Nq) when asked for."""

    o: torch.Tensor
    lse: torch.Tensor | None = None
    request_id: str = ""
    stamps: Stamps | None = None


@dataclass
class LayerRequest:
    """x: (B, N, hidden); positions: int64 (B, N) or None (= 0..N-1); kv_lengths: (B,) or None."""

    layer: str
    x: torch.Tensor
    causal: bool = False
    positions: torch.Tensor | None = None
    kv_lengths: torch.Tensor | None = None
    request_id: str = field(default_factory=new_request_id)
    deadline: float | None = None
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class LayerResult:
    """y: (B, N, hidden) in the layer's dtype."""

    y: torch.Tensor
    request_id: str = ""
    stamps: Stamps | None = None
