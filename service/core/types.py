"""The one internal request type and its results: what every transport builds and the batcher takes.

Tensors are host (CPU) torch tensors already decoded from the wire. Layout is normalised here, once:
requests carry q/k/v as (B, H, N, D) views, and ``layout`` says how to return ``o``.

An attention request checks itself, once, in one place (``AttentionRequest.spec``: shapes, dtypes,
kv_lengths, kernel, layout), and carries the one key of the launches it can share
(``launch_key``): the batcher groups requests by it, the CUDA-graph cache extends it with B. The
engine reads ``spec`` on admission, after its own draining check, so that a draining server still
answers 503 first and every refusal is counted in its metrics. A layer call's inputs depend on its
layer (hidden size, window): ``service.layers.check_call`` checks them, and ``LayerRequest``
carries its ``launch_key`` likewise.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property

import torch

import kernels
from kernels.dispatch import V1_NO_MASKS
from service.errors import BadRequest, InvalidInput, from_kernel_error

LAYOUTS = ("bhnd", "bnhd")

# kernels that take no score modifiers, and why (the dispatch's own reason)
MASKLESS_KERNELS = {"flash_v1": V1_NO_MASKS}

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
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # float32 (Hq,) or (B, Hq)
    request_id: str = field(default_factory=new_request_id)
    deadline: float | None = None  # time.monotonic() after which the request must not launch
    arrived: float = field(default_factory=time.monotonic)

    @classmethod
    def from_layout(cls, q, k, v, *, layout: str = "bhnd", **options) -> AttentionRequest:
        """Build from tensors in ``layout`` ("bhnd" or flash-attn's "bnhd" = (B, N, H, D))."""
        _check_layout(layout)
        if layout == "bnhd":
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.dim() != 4:
                    raise InvalidInput(f"{name} must have 4 dims [B, N, H, D] (layout bnhd), got {list(t.shape)}")
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, H, D) -> (B, H, N, D), a view
        return cls(q=q, k=k, v=v, layout=layout, **options)

    @cached_property
    def spec(self) -> kernels.AttnSpec:
        """The checked problem (computed once): raises ``InvalidInput`` for shapes, dtypes or
        kv_lengths or score modifiers the kernels refuse (a masked call asked of a kernel that takes
        no modifiers included, with the dispatch's reason), ``BadRequest`` for an unknown kernel or
        layout."""
        try:
            spec = kernels.check_inputs(
                self.q, self.k, self.v, causal=self.causal, scale=self.scale, kv_lengths=self.kv_lengths,
                window_size=self.window_size, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
            )
        except kernels.AttentionInputError as exc:
            raise from_kernel_error(exc) from None
        if self.kernel not in kernels.KERNELS:  # a bad option value: 400, as docs/api.md#errors says
            raise BadRequest(f"unknown kernel {self.kernel!r}; choose one of {', '.join(kernels.KERNELS)}")
        _check_layout(self.layout)
        if spec.masks.active and self.kernel in MASKLESS_KERNELS:
            # refused here, on admission, rather than by the launch that would raise it
            raise InvalidInput(f"kernel {self.kernel!r} cannot run this call ({spec.masks.describe()}): "
                               f"{MASKLESS_KERNELS[self.kernel]}")
        return spec

    @cached_property
    def launch_key(self) -> tuple:
        """Requests of equal keys can share a launch: equal after layout normalisation but for B.
        kv_lengths presence is part of it (a padded launch differs from an unpadded one); layout
        and return_lse are not (they only shape the answer). The score modifiers are, as the kernel
        sees them (a window side no key reaches already dropped): the window, the cap and whether
        ALiBi slopes are given; the slopes themselves are not, since a launch stacks them per row
        (``alibi_rows``)."""
        s = self.spec
        m = s.masks
        return ("attention", s.dtype, s.heads_q, s.heads_kv, s.n_q, s.n_k, s.head_dim, s.causal, s.scale,
                self.kernel, s.has_kv_lengths, m.left, m.right, m.softcap, m.alibi is not None)

    @property
    def alibi_rows(self) -> torch.Tensor | None:
        """float32 (B, Hq) slopes, one row per batch element (a shared set expanded, not copied),
        or None: what a launch stacks along B."""
        return self.spec.masks.alibi_for(self.spec.batch)

    @cached_property
    def tokens(self) -> int:
        """Query tokens, B·Nq (what --max-batch-tokens counts)."""
        return self.spec.batch * self.spec.n_q


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise BadRequest(f"unknown layout {layout!r}; use 'bhnd' (the default) or 'bnhd' (flash-attn's)")


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

    @cached_property
    def launch_key(self) -> tuple:
        """Calls of equal keys can share a launch: one layer, one N, the same options (read once
        ``service.layers.check_call`` has passed the inputs)."""
        return ("layer", self.layer, self.x.shape[1], bool(self.causal), self.positions is not None,
                self.kv_lengths is not None)

    @cached_property
    def tokens(self) -> int:
        """Tokens, B·N (what --max-batch-tokens counts)."""
        return self.x.shape[0] * self.x.shape[1]


@dataclass
class LayerResult:
    """y: (B, N, hidden) in the layer's dtype."""

    y: torch.Tensor
    request_id: str = ""
    stamps: Stamps | None = None
