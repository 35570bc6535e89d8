"""Which implementation runs: every backend exports ``forward(q, k, v, *, causal, scale,
kv_lengths) -> (o, lse)`` on checked (B, H, N, D) inputs, and ``choose()`` picks one, saying why
it refused the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import KernelUnavailableError
from .spec import AttnSpec

log = logging.getLogger("attnserve.kernels")

KERNELS = ("auto", "flash_v1", "flash", "reference")

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def triton_interpret() -> bool:
    """True when Triton runs its kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_refusal(spec: AttnSpec) -> str | None:
    """Why the Triton kernels cannot run for ``spec``, or None when they can."""
    if spec.device.type == "cuda":
        return None
    if spec.device.type == "cpu" and triton_interpret():
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU); inputs are on {spec.device}"


def _load(name: str) -> Forward:
    if name == "reference":
        from .reference import reference_attention

        return reference_attention
    if name == "cpu_blockwise":
        from .reference import blockwise_attention

        return blockwise_attention
    if name == "flash_v1":
        from .flash_v1 import flash_v1_forward

        return flash_v1_forward
    if name == "flash":
        from .flash import flash_forward

        return flash_forward
    raise KernelUnavailableError(f"unknown kernel {name!r}; choose one of {', '.join(KERNELS)}")


@dataclass(frozen=True)
class Choice:
    name: str
    forward: Forward
    refused: dict[str, str]  # kernel name -> why it was not chosen


_logged: set[tuple[str, str]] = set()


def choose(spec: AttnSpec, kernel: str = "auto") -> Choice:
    """Pick the implementation for ``spec``; raise ``KernelUnavailableError`` if ``kernel`` cannot run."""
    if kernel not in KERNELS:
        raise KernelUnavailableError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "reference":
        return Choice("reference", _load("reference"), {})
    triton_refusal = _triton_refusal(spec)
    if kernel in ("flash", "flash_v1"):
        if triton_refusal:
            raise KernelUnavailableError(f"kernel {kernel!r} cannot run: {triton_refusal}")
        return Choice(kernel, _load(kernel), {})
    # auto: the fastest correct one for the device and shape
    refused: dict[str, str] = {}
    if triton_refusal is None:
        name = "flash"
        refused["flash_v1"] = "flash is faster for every shape (Q blocks across the grid)"
    else:
        refused["flash"] = refused["flash_v1"] = triton_refusal
        name = "cpu_blockwise"
    key = (str(spec.device.type), name)
    if key not in _logged:
        _logged.add(key)
        log.info("attention kernel for %s: %s (refused: %s)", spec.device.type, name, refused or "none")
    return Choice(name, _load(name), refused)
