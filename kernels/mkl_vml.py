"""oneMKL's vector math (VML), resolved before any thread races to it; the one module that works
around oneMKL's lazy kernel dispatch.

What it does (``resolve_vml_dispatch``, once, when ``kernels`` is imported): calls each float unary
op that ATen hands to VML (exp, log, sqrt, tanh, sin, ...) on a one-element float32 and float64
tensor, on the importing thread.

Why: oneMKL 2024.2 (the build inside the torch CPU wheels) picks each VML function's kernel on its
first call. When that first call is a big tensor, ATen splits it over its intra-op threads, and a
thread that races the others through the choice can run a low-accuracy kernel on its whole chunk
(pytorch/pytorch#188792: errors of ~1,000 ulp, once per function per process; the next call is
right). The first sizable attention of a fresh process then gives softmax weights off in the 4th
digit: a CPU server's answer differs from the same request's answer a moment later, breaking the
promise that a batched answer is bit for bit the answer alone. A one-element call runs on one
thread and settles the choice; it costs under a millisecond at import.

How to turn it off: ``ATTNSERVE_VML_WARMUP=0``. Without MKL (``torch.backends.mkl``) nothing runs.
"""

from __future__ import annotations

import os

import torch

# The ops ATen's vml.h implements with oneMKL's vm{s,d}* functions; tanh serves softcap, exp and
# log the softmax, sin and cos rotary embeddings.
VML_OPS = (
    torch.abs, torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc, torch.exp,
    torch.expm1, torch.log, torch.log10, torch.log1p, torch.log2, torch.sin, torch.sqrt, torch.tan,
    torch.tanh, torch.trunc,
)


def enabled() -> bool:
    return os.environ.get("ATTNSERVE_VML_WARMUP", "1").strip().lower() not in ("0", "false", "no", "off")


resolved = False  # whether this process ran the calls


def resolve_vml_dispatch() -> bool:
    """Calls every op of ``VML_OPS`` once on one float32 and one float64 element, on this thread.

    Returns whether it ran (MKL present and not turned off)."""
    global resolved
    if not (enabled() and torch.backends.mkl.is_available()):
        return False
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)  # inside every op's domain
        for op in VML_OPS:
            op(x)
    resolved = True
    return True
