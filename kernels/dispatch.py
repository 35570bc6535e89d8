"""Which implementation runs: every backend exports ``forward(q, k, v, *, causal, scale,
kv_lengths, masks) -> (o, lse)`` on checked (B, H, N, D) inputs, and ``choose()`` picks one, saying
why it refused the others.

auto:
- CUDA: ``flash`` (Triton, FA2 order, split-KV for decode) for every shape the contract allows;
  ``flash_v1`` is slower everywhere (its grid is B·H, it rereads Q/O/m/l per K/V block) and
  ``reference`` materialises the Nq×Nk score matrix.
- CPU with ``TRITON_INTERPRET=1``: ``flash`` under the interpreter (except bfloat16, which the
  interpreter computes wrongly here: the CPU path then).
- CPU otherwise: ``cpu`` — torch's CPU flash kernel wrapped to keep the contract
  (``reference.cpu_attention``), falling back to the blockwise online-softmax loop.
Score modifiers (window, softcap, ALiBi; ``kernels/masks.py``): ``reference``, ``cpu`` (by its
blockwise loop) and ``flash`` (by ``attn_fwd``, split or not; its Hopper kernels refuse them)
take them; ``flash_v1`` does not, so "auto" passes it over and asking for it raises
``KernelUnavailableError``.
Every backend gives gradients: ``flash``/``flash_v1`` through ``autograd.FlashAttentionFunction``
(backward by recomputation), the others through plain PyTorch autograd.
"""

from __future__ import annotations

import functools
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


INTERPRETER_BF16 = "bfloat16 is computed wrongly by the Triton interpreter"


def triton_refusal(device_type: str, interpret: bool, dtype: torch.dtype | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device_type`` in ``dtype``, or None when they can."""
    if device_type == "cuda":
        return None
    if device_type == "cpu" and interpret:
        return INTERPRETER_BF16 if dtype == torch.bfloat16 else None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU); inputs are on {device_type}"


def _load(name: str) -> Forward:
    if name == "reference":
        from .reference import reference_attention

        return reference_attention
    if name == "cpu":
        from .reference import cpu_attention

        return cpu_attention
    if name == "flash_v1":
        from .autograd import flash_v1_attention_autograd

        return flash_v1_attention_autograd
    if name == "flash":
        from .autograd import flash_attention_autograd

        return flash_attention_autograd
    raise KernelUnavailableError(f"unknown kernel {name!r}; choose one of {', '.join(KERNELS)}")


@dataclass(frozen=True)
class Choice:
    name: str
    forward: Forward
    refused: dict[str, str]  # kernel name -> why it was not chosen


# why flash_v1 refuses a call with score modifiers
V1_NO_MASKS = "flash_v1 takes no window_size, softcap or alibi_slopes (flash and reference do)"
# what the cpu path does with them
CPU_MASKED = "torch's CPU flash kernel takes no window, cap or bias: the blockwise loop runs them"


def _auto(device_type: str, dtype: torch.dtype, interpret: bool, masked: bool) -> tuple[str, dict[str, str]]:
    refused = {"reference": "materialises the Nq x Nk score matrix (O(N^2) memory)"}
    t_refusal = triton_refusal(device_type, interpret, dtype)
    if t_refusal is not None:
        refused["flash"] = t_refusal
        refused["flash_v1"] = V1_NO_MASKS if masked else t_refusal
        if masked:
            refused["cpu:sdpa"] = CPU_MASKED
        return "cpu", refused
    refused["flash_v1"] = V1_NO_MASKS if masked else \
        "flash is faster for every shape (Q blocks across the grid, K/V streamed)"
    return "flash", refused


def choose(spec: AttnSpec, kernel: str = "auto") -> Choice:
    """Pick the implementation for ``spec``; raise ``KernelUnavailableError`` if ``kernel`` cannot run.

    The choice depends only on the device type, the dtype and TRITON_INTERPRET, so it is made once
    per combination, and whether score modifiers are on (it runs on every call)."""
    if not isinstance(kernel, str):  # the choice is cached by its arguments: a list would not hash
        raise KernelUnavailableError(f"kernel must be a name, one of {', '.join(KERNELS)}; got {kernel!r}")
    return _choose(spec.device.type, spec.dtype, kernel, triton_interpret(), spec.masks.active)


@functools.cache
def _choose(device_type: str, dtype: torch.dtype, kernel: str, interpret: bool, masked: bool = False) -> Choice:
    if kernel not in KERNELS:
        raise KernelUnavailableError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "reference":
        return Choice("reference", _load("reference"), {})
    if kernel == "flash_v1" and masked:
        raise KernelUnavailableError(f"kernel 'flash_v1' cannot run this call: {V1_NO_MASKS}")
    if kernel in ("flash", "flash_v1"):
        refusal = triton_refusal(device_type, interpret, dtype)
        if refusal:
            raise KernelUnavailableError(f"kernel {kernel!r} cannot run: {refusal}")
        return Choice(kernel, _load(kernel), {})
    name, refused = _auto(device_type, dtype, interpret, masked)
    log.info("attention kernel for %s %s%s: %s (refused: %s)", device_type, str(dtype).replace("torch.", ""),
             " with score modifiers" if masked else "", name,
             "; ".join(f"{k}: {v}" for k, v in refused.items()) or "none")
    return Choice(name, _load(name), refused)
