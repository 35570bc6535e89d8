"""kernels/launch.py's off switch: with direct launches off (``ATTNSERVE_DIRECT_LAUNCH=0``, or
``set_direct_launch(False)``) every launch goes through Triton's public path, and the answers are
the same bits as with them on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import hopper, launch
from kernels.flash import flash_forward
from kernels.reference import reference_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
HAS_CUDA = torch.cuda.is_available()

# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths, forward kwargs)
CPU_CASES = {
    "prefill": (2, 4, 2, 40, 70, 32, True, [70, 33], {}),
    "split_decode": (2, 4, 2, 1, 600, 32, False, [600, 300], {"num_splits": 2}),  # attn_fwd, then attn_combine
    "packed_decode": (1, 8, 2, 2, 300, 64, False, None, {}),
    "tma": (1, 2, 2, 64, 96, 64, False, None, {"tma": True}),
}


def _inputs(case, dtype, device, seed=0):
    b, hq, hkv, n_q, n_k, d, causal, kvl, kwargs = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, hkv, n_k, d, generator=g).to(device, dtype) for _ in range(2))
    kvl = None if kvl is None else torch.tensor(kvl, dtype=torch.int32, device=device)
    return q, k, v, dict(causal=causal, scale=d ** -0.5, kv_lengths=kvl, **kwargs)


@pytest.fixture
def restore_direct():
    yield
    launch.set_direct_launch(True)


def _both_ways(q, k, v, kwargs):
    launch.set_direct_launch(True)
    on = flash_forward(q, k, v, **kwargs)
    launch.set_direct_launch(False)
    off = flash_forward(q, k, v, **kwargs)
    launch.set_direct_launch(True)
    return on, off


def test_switch_is_read_at_import():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    code = "import kernels.launch as l; print(l.direct_launch())"
    for value, expected in (("0", "False"), ("1", "True"), (None, "True")):
        env.pop("ATTNSERVE_DIRECT_LAUNCH", None)
        if value is not None:
            env["ATTNSERVE_DIRECT_LAUNCH"] = value
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == expected, value


def test_switching_forgets_the_recipes(restore_direct, monkeypatch):
    monkeypatch.setitem(hopper._recipes, ("a problem",), None)
    launch.set_direct_launch(False)
    assert not launch.direct_launch() and not hopper._recipes


@pytest.mark.skipif(not launch.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_same_bits_both_ways_under_the_interpreter(name, restore_direct):
    dtype = torch.float16 if name == "tma" else torch.float32
    q, k, v, kwargs = _inputs(CPU_CASES[name], dtype, "cpu")
    on, off = _both_ways(q, k, v, kwargs)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


@pytest.fixture
def compiled_mode(monkeypatch):
    """launch()'s GPU branches on the CPU: Triton's interpreter still runs each kernel, and every
    kernel runs its first pruned config (no tuning), whichever way it is launched."""
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    monkeypatch.setenv("ATTNSERVE_AUTOTUNE", "0")
    launch.freeze_autotuning(False)
    yield
    launch.set_direct_launch(True)


def _poison_private_api(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a launch used Triton's private API with direct launches off")

    for module, name in ((launch, "_run"), (launch, "_compiled_plain"), (launch, "_signature"),
                         (hopper, "_run"), (hopper, "_compiled_plain")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.skipif(not launch.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")
def test_prefill_same_bits_both_ways_through_launch(compiled_mode, monkeypatch):
    q, k, v, kwargs = _inputs((1, 2, 2, 16, 24, 32, True, None, {}), torch.float32, "cpu")
    launch.set_direct_launch(True)
    on = flash_forward(q, k, v, **kwargs)
    launch.set_direct_launch(False)
    _poison_private_api(monkeypatch)
    off = flash_forward(q, k, v, **kwargs)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


@pytest.mark.skipif(not launch.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")
def test_split_decode_off_uses_no_private_api(compiled_mode, monkeypatch):
    """With the switch off, a split decode and its merge launch through ``kernel[grid]`` alone."""
    launch.set_direct_launch(False)
    _poison_private_api(monkeypatch)
    q, k, v, kwargs = _inputs((2, 4, 2, 1, 600, 32, False, [600, 300], {"num_splits": 2}), torch.float32, "cpu")
    o, lse = flash_forward(q, k, v, **kwargs)
    o_ref, lse_ref = reference_attention(q.double(), k.double(), v.double(), causal=False, scale=kwargs["scale"],
                                         kv_lengths=kwargs["kv_lengths"])
    assert torch.allclose(o.double(), o_ref.double(), atol=1e-4)
    assert torch.allclose(lse.double(), lse_ref.double(), atol=1e-4)


# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths, kwargs), dtype: every kernel flash has, and the merge
GPU_CASES = {
    "attn_fwd": ((2, 4, 2, 97, 97, 64, True, [97, 40], {}), torch.float16),
    "attn_fwd_split_and_merge": ((2, 32, 8, 1, 3000, 96, False, [3000, 1234], {}), torch.float32),
    "attn_fwd_tma": ((2, 8, 2, 2100, 2500, 64, False, [2500, 1999], {"tma": True}), torch.bfloat16),
    "attn_fwd_ws": ((1, 8, 8, 1024, 1024, 128, False, None, {}), torch.bfloat16),
    "attn_fwd_ws_causal": ((1, 8, 8, 2100, 2100, 128, True, None, {}), torch.float16),
    "attn_decode_split_and_merge": ((2, 32, 8, 1, 8192, 128, False, [8192, 5000], {}), torch.bfloat16),
    "attn_decode_packed": ((4, 16, 2, 2, 300, 64, False, None, {}), torch.float16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_same_bits_both_ways(name, restore_direct, monkeypatch):
    case, dtype = GPU_CASES[name]
    q, k, v, kwargs = _inputs(case, dtype, "cuda")
    launch.set_direct_launch(True)
    flash_forward(q, k, v, **kwargs)  # compiled and tuned (or not) before either way runs
    on = flash_forward(q, k, v, **kwargs)
    launch.set_direct_launch(False)
    _poison_private_api(monkeypatch)
    off = flash_forward(q, k, v, **kwargs)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
