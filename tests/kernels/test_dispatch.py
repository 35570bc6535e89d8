"""Which backend ``attention()`` runs, tested apart from numerics (STYLE.md §14), and the numerics of
the CPU path that "auto" picks on a machine without a GPU (kernels.reference.cpu_attention)."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels
from kernels import dispatch, ragged
from kernels.errors import KernelUnavailableError
from kernels.reference import cpu_attention, reference_attention
from kernels.spec import AttnSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def spec(device="cpu", dtype=torch.float32, d=64):
    return AttnSpec(batch=1, heads_q=4, heads_kv=2, n_q=16, n_k=16, head_dim=d, dtype=dtype,
                    device=torch.device(device), causal=False, scale=d ** -0.5, has_kv_lengths=False)


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def recorded(monkeypatch):
    """Replace every backend by a recorder: which one ran, with what."""
    calls: list[str] = []

    def fake_load(name):
        def forward(q, k, v, *, causal, scale, kv_lengths=None):
            calls.append(name)
            return torch.zeros_like(q), torch.zeros(q.shape[:3])
        return forward

    monkeypatch.setattr(dispatch, "_load", fake_load)
    dispatch._choose.cache_clear()  # choices are memoised with the real backends in them
    yield calls
    dispatch._choose.cache_clear()


def test_auto_on_cuda_picks_flash_and_says_why_not_the_others():
    choice = dispatch.choose(spec("cuda"))
    assert choice.name == "flash"
    assert "faster" in choice.refused["flash_v1"]
    assert "N" in choice.refused["reference"]


def test_auto_on_cpu_without_interpreter_uses_the_cpu_path(no_interpreter):
    choice = dispatch.choose(spec("cpu"))
    assert choice.name == "cpu"
    assert "CUDA" in choice.refused["flash"] and "CUDA" in choice.refused["flash_v1"]


def test_auto_on_cpu_with_interpreter_uses_triton(interpreter):
    assert dispatch.choose(spec("cpu")).name == "flash"


def test_auto_refuses_bf16_under_the_interpreter(interpreter):
    choice = dispatch.choose(spec("cpu", torch.bfloat16))
    assert choice.name == "cpu"
    assert "interpreter" in choice.refused["flash"]


@pytest.mark.parametrize("kernel", ["flash", "flash_v1"])
def test_explicit_triton_kernel_in_bf16_under_the_interpreter_is_refused(kernel, interpreter):
    """Asked for by name, a Triton kernel in bfloat16 under the interpreter is refused as "auto"
    passes it over (it once answered numbers off by ~1e8)."""
    q = torch.randn(1, 2, 8, 16).bfloat16()
    with pytest.raises(KernelUnavailableError, match="bfloat16 is computed wrongly"):
        kernels.attention(q, q, q, kernel=kernel)
    with pytest.raises(KernelUnavailableError, match="bfloat16 is computed wrongly"):
        ragged.choose_ragged("paged", torch.device("cpu"), torch.bfloat16, "flash")


def test_explicit_triton_kernel_on_cpu_without_interpreter_is_refused(no_interpreter):
    with pytest.raises(KernelUnavailableError, match="CUDA"):
        dispatch.choose(spec("cpu"), "flash")
    with pytest.raises(KernelUnavailableError, match="CUDA"):
        dispatch.choose(spec("cpu"), "flash_v1")


def test_unknown_kernel_is_refused():
    with pytest.raises(KernelUnavailableError, match="unknown kernel"):
        dispatch.choose(spec("cpu"), "flash3")


@pytest.mark.parametrize("kernel,expected", [("reference", "reference"), ("flash", "flash"),
                                             ("flash_v1", "flash_v1"), ("auto", "flash")])
def test_attention_runs_the_chosen_backend(kernel, expected, recorded, interpreter):
    q = torch.randn(1, 2, 8, 16)
    kernels.attention(q, q, q, kernel=kernel)
    assert recorded == [expected]


def test_attention_auto_on_plain_cpu_runs_cpu_path(recorded, no_interpreter):
    q = torch.randn(1, 2, 8, 16)
    kernels.attention(q, q, q)
    assert recorded == ["cpu"]


def test_choice_is_logged_once(caplog, no_interpreter):
    dispatch._choose.cache_clear()
    with caplog.at_level(logging.INFO, logger="attnserve.kernels"):
        for _ in range(3):
            dispatch.choose(spec("cpu", torch.float16))
    lines = [r for r in caplog.records if "attention kernel" in r.getMessage()]
    assert len(lines) == 1 and "cpu" in lines[0].getMessage() and "refused" in lines[0].getMessage()


def test_real_backends_load():
    for name in ("reference", "cpu", "flash", "flash_v1"):
        assert callable(dispatch._load(name))


# ---------------------------------------------------------------- the CPU path's numerics

# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths)
CPU_CASES = [
    (2, 4, 2, 17, 17, 40, True, None),          # square causal: torch's own top-left == ours
    (1, 4, 1, 17, 97, 59, True, None),          # Nq < Nk: full keys + a causal square, merged by LSE
    (1, 2, 2, 97, 17, 72, True, None),          # Nq > Nk: the first 80 rows see nothing
    (3, 2, 2, 33, 50, 64, True, [0, 20, 50]),   # kv_lengths (one empty row) with causal
    (2, 8, 2, 1, 300, 111, False, [300, 5]),    # decode with padding, GQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_path_matches_reference(case, dtype):
    b, hq, hkv, n_q, n_k, d, causal, kvl = case
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, n_q, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n_k, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n_k, d, generator=g).to(dtype)
    kvl = None if kvl is None else torch.tensor(kvl, dtype=torch.int32)
    o, lse = cpu_attention(q, k, v, causal=causal, scale=d ** -0.5, kv_lengths=kvl)
    ro, rl = reference_attention(q.double(), k.double(), v.double(), causal=causal, scale=d ** -0.5,
                                 kv_lengths=kvl)
    assert o.dtype == dtype and lse.dtype == torch.float32 and torch.isfinite(o).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (o.double() - ro).abs().max() <= tol
    dead = torch.isinf(rl)
    assert torch.equal(torch.isneginf(lse), dead) and (o[dead] == 0).all()
    assert (lse[~dead].double() - rl[~dead]).abs().max() <= tol


def test_a_kernel_that_is_not_a_name_and_the_cpu_paths_gradient_warning(monkeypatch):
    """``kernel=["flash"]`` is refused as a kernel (it was a TypeError from the choice's cache); the
    CPU path's bound check on inputs that require grad warns nothing (torch warned of a tensor
    with requires_grad made a scalar, every call) and keeps the gradient."""
    import warnings

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 8, generator=g).requires_grad_()
    k, v = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    with pytest.raises(KernelUnavailableError, match="kernel must be a name"):
        kernels.attention(q, k, v, kernel=["flash"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = kernels.attention(q, k, v)
    o.sum().backward()
    assert q.grad is not None and bool(q.grad.abs().sum() > 0)
