"""kernels/precompile.py and kernels/autotune_cache.py on a CPU.

precompile_check.py runs the project's launch paths with Triton's JIT (not the interpreter) in a
fresh process: the recording pass lists every config the autotuner would time (and leaves the
autotuner as it was), ``ahead`` compiles a variant for sm_90 in a worker process into the cache
dir (and, run again, finds it cached), the JIT's own compile of that launch then is a cache hit,
and a stored autotune choice is replayed without timing. The rest checks the autotune store's
files here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from kernels import autotune_cache, precompile
from kernels.jit import flash_fwd
from tests.conftest import ROOT

TARGET = GPUTarget("cuda", 90, 32)


def test_record_compile_ahead_and_replay(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    run = subprocess.run([sys.executable, "-m", "tests.kernels.precompile_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["complete"]
    # fp32 prefill: the three fp32 configs an autotuner times, then the split merge
    assert found["recorded"] == ["attn_combine", "attn_fwd", "attn_fwd", "attn_fwd"]
    assert found["fwd_blocks"] == sorted([c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]] for c in flash_fwd._PREFILL_FP32)
    assert found["tuner_restored"], "the recording pass leaves the autotuner, the hook and direct launches as they were"
    assert found["missing_before"] == 4
    assert found["cold"] == [1, 0, 1, 0, 1], "recorded, cached, compiled, failed, workers"
    assert found["missing_after"] == ["attn_fwd"] * 3, "only what was compiled leaves the missing list"
    assert found["warm"] == [1, 1, 0, 0], "a warm start compiles nothing and starts no worker"
    assert found["marker"] == [1, True, True, 2], "recorded once, then skipped; another warm-up has its own marker"
    assert found["jit_cache_hits"] == [True], "the JIT must find the precompiled kernel under its own cache key"
    assert found["saved_under_cache_dir"] and found["replayed"]
    assert list((tmp_path / "triton").glob("*/attn_combine.cubin"))


def _kernel_src(X, N: tl.constexpr):
    tl.store(X + tl.arange(0, N), 1.0)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    configs = [triton.Config({"N": 16}, num_warps=4), triton.Config({"N": 32}, num_warps=8, num_stages=2)]
    # a JITFunction made directly: under the interpreter @triton.jit would give an interpreted one
    tuned = triton.autotune(configs=configs, key=["N"])(triton.runtime.JITFunction(_kernel_src))
    autotune_cache.set_enabled(True)
    yield tuned, configs
    autotune_cache.set_enabled(True)


def test_autotune_store_round_trip(store, tmp_path):
    tuned, configs = store
    key = (16, "torch.float16")
    assert autotune_cache.load(tuned, key, configs, "GPU sm_90", TARGET) is None
    file = autotune_cache.save(tuned, key, configs, "GPU sm_90", configs[1], {configs[1]: [0.1, 0.1, 0.1]}, TARGET)
    assert file.parent == tmp_path / autotune_cache.DIRNAME and file.name.startswith("_kernel_src-")
    assert autotune_cache.load(tuned, key, configs, "GPU sm_90", TARGET) is configs[1]
    # keyed on the GPU model, the autotuning key and the configs on offer
    assert autotune_cache.load(tuned, key, configs, "other GPU sm_90", TARGET) is None
    assert autotune_cache.load(tuned, (32, "torch.float16"), configs, "GPU sm_90", TARGET) is None
    assert autotune_cache.load(tuned, key, configs[:1], "GPU sm_90", TARGET) is None
    with autotune_cache.read_only():
        assert autotune_cache.save(tuned, (32,), configs, "GPU sm_90", configs[0], None, TARGET) is None
    autotune_cache.set_enabled(False)
    assert autotune_cache.load(tuned, key, configs, "GPU sm_90", TARGET) is None


def test_autotune_store_ignores_broken_and_stale_files(store):
    tuned, configs = store
    file = autotune_cache.path(tuned, (16,), configs, "GPU sm_90", TARGET)
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    assert autotune_cache.load(tuned, (16,), configs, "GPU sm_90", TARGET) is None
    file.write_text(json.dumps({"config": {"kwargs": {"N": 64}, "num_warps": 4, "num_stages": 3,
                                           "num_ctas": 1, "maxnreg": None}}))
    assert autotune_cache.load(tuned, (16,), configs, "GPU sm_90", TARGET) is None


def test_ahead_falls_back_when_recording_fails(caplog):
    """A warm-up that raises ends the recording pass; ``ahead`` reports it (or None) and never raises."""
    def broken():
        raise RuntimeError("boom")

    report = precompile.ahead(broken, workers=1)
    assert report is not None and not report.complete and report.recorded == 0
    assert "stopped early" in caplog.text
    with pytest.raises(ValueError):
        precompile.compile_all([], kind="fork")
    assert precompile.default_workers() >= 1
