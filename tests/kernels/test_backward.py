"""Gradients: the Triton backward (recomputation from the saved LSE) against float64 autograd of the
reference, on awkward shapes; the CPU and reference paths' autograd; determinism.

Error budget (STYLE.md §11): relative error ‖g - g64‖/‖g64‖ of each of dq, dk, dv at most 2x that of
plain PyTorch autograd in the same dtype, plus a small slack.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_forward import make

import kernels
from kernels.autograd import flash_attention_autograd, flash_v1_attention_autograd
from kernels.reference import cpu_attention, reference_attention
from tests.helpers import plain_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths)
CASES = {
    "gqa_odd_d": (2, 4, 2, 17, 17, 59, False, None),             # GQA: dK/dV summed over 2 heads
    "mqa_causal": (1, 5, 1, 33, 33, 40, True, None),             # 5 query heads on one kv head
    "causal_nq_lt_nk": (1, 2, 2, 17, 97, 72, True, None),        # bottom-right causal, Nq < Nk
    "causal_nq_gt_nk": (1, 2, 1, 70, 17, 40, True, None),        # rows with no key: zero gradients
    "kv_lengths": (3, 2, 2, 40, 97, 64, True, [0, 50, 97]),      # padding, an empty batch row
    "d256": (1, 1, 1, 33, 40, 256, False, None),                 # the largest head dim
    "single_row": (2, 4, 4, 1, 130, 111, False, [130, 7]),       # decode shape, odd D
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(fn, q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o = o[0] if isinstance(o, tuple) else o
    return torch.autograd.grad(o, (q, k, v), do)


def check_grads(fn, case, dtype, device=DEV, slack=1e-5):
    q, k, v, causal, scale, kvl = make(case, dtype, device)
    do = torch.randn_like(q)
    kw = dict(causal=causal, scale=scale, kv_lengths=kvl)
    got = grads(fn, q, k, v, do, **kw)
    want = grads(reference_attention, q.double(), k.double(), v.double(), do.double(), **kw)
    plain = grads(plain_attention, q, k, v, do, **kw)
    for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain, strict=True):
        assert g.shape == w.shape and g.dtype == dtype, name
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        err, err_plain = rel(g, w), rel(p, w)
        assert err <= 2 * err_plain + slack, f"{name}: error {err:.3g} > 2 x plain PyTorch {err_plain:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_flash_backward_fp32(name):
    check_grads(flash_attention_autograd, CASES[name], torch.float32)


@pytest.mark.parametrize("name", ["gqa_odd_d", "kv_lengths"])
def test_flash_v1_backward_fp32(name):
    check_grads(flash_v1_attention_autograd, CASES[name], torch.float32)


def test_public_attention_gradients():
    """attention(kernel="flash") and "reference" both carry gradients; flash's lse does not."""
    q, k, v, causal, scale, kvl = make(CASES["causal_nq_lt_nk"], torch.float32)
    do = torch.randn_like(q)
    for kernel in ("flash", "reference"):
        q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = kernels.attention(q1, k1, v1, causal=causal, return_lse=True, kernel=kernel)
        assert o.requires_grad and (kernel == "reference" or not lse.requires_grad)
        o.backward(do)
        assert all(torch.isfinite(x.grad).all() for x in (q1, k1, v1))


def test_backward_is_deterministic():
    q, k, v, causal, scale, kvl = make(CASES["mqa_causal"], torch.float32)
    do = torch.randn_like(q)
    a = grads(flash_attention_autograd, q, k, v, do, causal=causal, scale=scale)
    b = grads(flash_attention_autograd, q, k, v, do, causal=causal, scale=scale)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_path_backward(name):
    """The CPU "auto" path (torch's CPU flash kernel, blockwise where it cannot) under autograd."""
    check_grads(cpu_attention, CASES[name], torch.float32, device="cpu")


# ---------------------------------------------------------------- GPU

GPU_CASES = {
    **CASES,
    "n2k_d128_causal": (1, 8, 8, 2048, 2048, 128, True, None),
    "n2k_d64_gqa": (2, 16, 4, 2048, 2048, 64, False, None),
    "n1k_nq_lt_nk": (1, 8, 2, 1000, 1500, 128, True, [1500]),
}


GPU_RUNS = [("n2k_d128_causal", torch.bfloat16), ("n2k_d128_causal", torch.float16),
            ("n2k_d64_gqa", torch.bfloat16), ("n1k_nq_lt_nk", torch.bfloat16),
            ("kv_lengths", torch.float16), ("gqa_odd_d", torch.bfloat16), ("causal_nq_gt_nk", torch.bfloat16),
            ("d256", torch.bfloat16), ("kv_lengths", torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", GPU_RUNS)
def test_gpu_flash_backward(name, dtype):
    check_grads(flash_attention_autograd, GPU_CASES[name], dtype, "cuda",
                slack=1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.gpu
def test_gpu_auto_backward_and_determinism():
    q, k, v, causal, scale, kvl = make(GPU_CASES["n2k_d64_gqa"], torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    a = grads(kernels.attention, q, k, v, do, causal=True)
    b = grads(kernels.attention, q, k, v, do, causal=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
