"""A loaded layer and its inputs: ``Layer`` (weights on the CPU), ``DeviceLayer`` (weights on one
device, what a worker runs) and ``check_call``, the one check of a call's inputs against a layer.

A layer computes ``y = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))`` with the checkpoint's
biases and GQA head counts, and RoPE on q and k for the Llama family. No residual, no norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import kernels
from service.errors import InvalidInput, from_kernel_error

if TYPE_CHECKING:
    from service.layers.families import Rope


class LayerConfigError(ValueError):
    """A layer cannot be loaded: the message names the spec, folder, file or tensor at fault."""


@dataclass(frozen=True)
class LayerInfo:
    name: str
    family: str  # "bert" | "llama"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype



@dataclass(frozen=True)
class Weights:
    """One block's linear maps, (out, in) as in nn.Linear.

    q: (Hq·D, hidden), k/v: (Hkv·D, hidden), o: (hidden, Hq·D); biases (out,) or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Weights:
        moved = {k: None if t is None else t.to(device=device, dtype=dtype) for k, t in vars(self).items()}
        return Weights(**moved)


class DeviceLayer:
    """A layer's weights on one device; ``forward`` is what a worker calls (no autograd)."""

    def __init__(self, info: LayerInfo, weights: Weights, rope: Rope | None, device: torch.device,
                 sliding_window: int | None = None):
        self.info = info
        self.device = device
        self.sliding_window = sliding_window
        self._w = weights
        self._rope = rope

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool = False,
        positions: torch.Tensor | None = None,
        kv_lengths: torch.Tensor | None = None,
        kernel: str = "auto",
    ) -> torch.Tensor:
        """x: (B, N, hidden) float -> y: (B, N, hidden) in the layer's dtype, on this device.

        positions: integer (B, N), default 0..N-1 in every row (feeds RoPE; the bert family has none).
        kv_lengths: integer (B,); keys at positions >= kv_lengths[b] are masked (padding).
        Raises ``errors.InvalidInput`` for inputs that do not fit the layer.
        """
        h, hkv, d = self.info.num_heads, self.info.num_kv_heads, self.info.head_dim
        check_call(self.info, self.sliding_window, x, positions, kv_lengths, causal=causal)
        x = x.to(device=self.device, dtype=self.info.dtype)
        b, n, _ = x.shape
        positions = self._check_positions(positions, b, n)
        kv_lengths = self._check_kv_lengths(kv_lengths, b)
        w = self._w
        with torch.no_grad():
            # (B, N, H·D) -> (B, N, H, D) -> (B, H, N, D)
            q = F.linear(x, w.q, w.q_bias).view(b, n, h, d).transpose(1, 2)
            k = F.linear(x, w.k, w.k_bias).view(b, n, hkv, d).transpose(1, 2)
            v = F.linear(x, w.v, w.v_bias).view(b, n, hkv, d).transpose(1, 2)
            if self._rope is not None:
                q, k = self._rope.apply(q, positions), self._rope.apply(k, positions)
            try:
                o = kernels.attention(q, k, v, causal=causal, kv_lengths=kv_lengths, kernel=kernel,
                                      window_size=window_of(self.sliding_window, causal))
            except kernels.AttentionInputError as exc:
                raise from_kernel_error(exc) from None
            o = o.transpose(1, 2).reshape(b, n, h * d)  # (B, H, N, D) -> (B, N, H·D)
            return F.linear(o, w.o, w.o_bias)

    __call__ = forward

    def _check_positions(self, positions: Any, b: int, n: int) -> torch.Tensor | None:
        if positions is None:
            return None if self._rope is None else torch.arange(n, device=self.device).expand(b, n)
        return positions.to(device=self.device, dtype=torch.int64)

    def _check_kv_lengths(self, kv_lengths: Any, b: int) -> torch.Tensor | None:
        return None if kv_lengths is None else kv_lengths.to(self.device)


def window_of(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """The kernels' window_size of a layer with HF's ``sliding_window`` W: a query sees itself and
    the W - 1 keys before it (Mistral's and Qwen2's meaning: HF masks key j of query i unless
    i - W < j <= i), so (W - 1, -1) with causal bounding the right; (-1, -1) without a window.
    A non-causal call gets no window: ``check_call`` admits one only while N <= W, where the window
    bounds nothing."""
    if sliding_window is None or not causal:
        return (-1, -1)
    return (sliding_window - 1, -1)


def check_call(info: LayerInfo, sliding_window: int | None, x: Any, positions: Any = None,
               kv_lengths: Any = None, *, causal: bool = True) -> None:
    """Raise ``errors.InvalidInput`` unless x (B, N, hidden) float, positions integer (B, N) and
    kv_lengths integer (B,) fit the layer, and a sliding-window layer's call longer than its window
    is causal (the window is defined over the keys before a query). Cheap and host-side: the engine
    calls it before queueing a request, and ``DeviceLayer.forward`` before computing (kv_lengths'
    range only for host tensors: reading it on a GPU would synchronise the device)."""

    def invalid(message: str) -> InvalidInput:
        return InvalidInput(f"layer {info.name!r}: {message}")

    hidden = info.hidden_size
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden:
        raise invalid(f"x must have shape [B, N, {hidden}] (hidden size {hidden}), got {_shape(x)}")
    b, n = x.shape[0], x.shape[1]
    if b < 1 or n < 1:
        raise invalid(f"x needs B >= 1 and N >= 1, got {list(x.shape)}")
    if not x.is_floating_point():
        raise invalid(f"x must be a float tensor, got {x.dtype}")
    if sliding_window is not None and n > sliding_window and not causal:
        raise invalid(
            f"the checkpoint uses causal sliding-window attention over {sliding_window} tokens: a call "
            f"longer than the window (N={n}) must be causal (causal=true); a non-causal one is exact up to "
            f"N={sliding_window}"
        )
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (b, n):
            raise invalid(f"positions must have shape [B, N] = [{b}, {n}], got {_shape(positions)}")
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise invalid(f"positions must be integers (int64), got {positions.dtype}")
    if kv_lengths is not None:
        if not isinstance(kv_lengths, torch.Tensor) or tuple(kv_lengths.shape) != (b,):
            raise invalid(f"kv_lengths must have shape [B] = [{b}], got {_shape(kv_lengths)}")
        if kv_lengths.dtype not in (torch.int32, torch.int64):
            raise invalid(f"kv_lengths must be int32 or int64, got {kv_lengths.dtype}")
        if kv_lengths.device.type == "cpu" and (int(kv_lengths.min()) < 0 or int(kv_lengths.max()) > n):
            raise invalid(f"kv_lengths must lie in [0, {n}] (N)")


def _shape(t: Any) -> Any:
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


class Layer:
    """A loaded layer, weights on the CPU in ``info.dtype``; ``to(device)`` gives what a worker runs."""

    def __init__(self, info: LayerInfo, weights: Weights, rope: Rope | None = None, *,
                 source: str = "", sliding_window: int | None = None):
        self.info = info
        self.source = source  # "DIR:INDEX", for logs
        self.sliding_window = sliding_window  # Mistral-style window W: window_size (W - 1, 0) when causal
        self._w = weights
        self._rope = rope

    def check_call(self, x: Any, positions: Any = None, kv_lengths: Any = None, *, causal: bool = True) -> None:
        """Validate a call's inputs on the host (``check_call``), before it is queued."""
        check_call(self.info, self.sliding_window, x, positions, kv_lengths, causal=causal)

    def to(self, device: torch.device | str) -> DeviceLayer:
        device = torch.device(device)
        rope = None if self._rope is None else self._rope.to(device)
        return DeviceLayer(self.info, self._w.to(device), rope, device, self.sliding_window)

    def __repr__(self) -> str:
        return f"Layer({self.info}, source={self.source!r})"
