"""Run by tests/kernels/test_precompile.py in a fresh process (the kernels compiled, not
interpreted), with TRITON_CACHE_DIR a temporary folder: kernels/precompile.py and the autotune
cache on a CPU, Triton's JIT driven through the real project launch paths. No GPU: Triton's CUDA
driver is replaced by ``CpuStandIn``, which only names the device, stream and target (sm_90) that
``JITFunction.run`` asks for; nothing is launched (the recording hook, or a skip hook, answers
every compile). Prints one JSON line of findings; the test asserts on them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

TARGET = GPUTarget("cuda", 90, 32)


class CpuStandIn:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


def main() -> None:
    assert "TRITON_INTERPRET" not in os.environ
    driver.set_active(CpuStandIn())
    from kernels import autotune_cache, flash, launch, precompile
    from kernels.jit import flash_fwd as kern

    out: dict = {}
    q = torch.randn(1, 2, 16, 32)  # fp32 prefill: attn_fwd, autotuned among _PREFILL_FP32
    o_part, lse_part = torch.zeros(4, 1, 2, 1, 32), torch.zeros(4, 1, 2, 1)
    o, lse = torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1)

    def warm():
        flash.flash_forward(q, q, q, causal=False, scale=0.2)
        flash.combine(o_part, lse_part, o, lse)

    variants, complete = precompile.record(warm)
    out["complete"] = complete
    out["recorded"] = sorted(v.qualname for v in variants)
    out["fwd_blocks"] = sorted([v.constants[(kern.attn_fwd.arg_names.index("BLOCK_M"),)],
                                v.constants[(kern.attn_fwd.arg_names.index("BLOCK_N"),)]]
                               for v in variants if v.qualname == "attn_fwd")
    out["tuner_restored"] = (not kern.attn_fwd_tuned.cache and "do_bench" not in vars(kern.attn_fwd_tuned)
                             and knobs.runtime.jit_cache_hook is None and launch.direct_launch())
    out["missing_before"] = len(precompile.missing(variants))

    def merge():
        flash.combine(o_part, lse_part, o, lse)

    cold = precompile.ahead(merge, workers=2)  # record again, compile what is missing in a worker process
    out["cold"] = [cold.recorded, cold.cached, cold.compiled, cold.failed, cold.workers]
    out["missing_after"] = sorted(v.qualname for v in precompile.missing(variants))
    warm_start = precompile.ahead(merge, workers=2)
    out["warm"] = [warm_start.recorded, warm_start.cached, warm_start.compiled, warm_start.workers]
    # a warm-up named by a key leaves a marker once all it recorded is compiled; the next start of
    # the same warm-up skips the recording pass, another warm-up does not
    keyed = precompile.ahead(merge, workers=2, warmup_key="merge")
    again = precompile.ahead(merge, workers=2, warmup_key="merge")
    other = precompile.ahead(merge, workers=2, warmup_key="another warm-up")
    markers = list((Path(knobs.cache.dir) / precompile.MARKER_DIR).glob("*.json"))
    out["marker"] = [keyed is not None and keyed.recorded, again is None, other is not None, len(markers)]

    # the JIT's own compile of that launch (no hook: it compiles for real) is a cache hit
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    launch.set_direct_launch(False)
    flash_combine_compile(kern, o_part, lse_part, o, lse)
    knobs.compilation.listener = None
    out["jit_cache_hits"] = hits

    # the autotune cache: a stored choice (not the first config) is replayed, untimed
    captured = []
    real_launch = flash.launch
    flash.launch = lambda t, grid, args, meta, first, **kw: captured.append((t, grid, args, meta)) or True
    flash.flash_forward(q, q, q, causal=True, scale=0.2)
    flash.launch = real_launch
    tuned, grid, args, meta = captured[0]
    key = launch._tuning_key(tuned, args, meta)
    pruned = launch._pruned(tuned, args, meta)
    autotune_cache.device_name = lambda device: "stand-in sm_90"
    saved = autotune_cache.save(tuned, key, pruned, "stand-in sm_90", pruned[1], {pruned[1]: [0.5, 0.4, 0.6]})
    out["saved_under_cache_dir"] = str(saved).startswith(os.environ["TRITON_CACHE_DIR"])

    def no_timing(*a, **k):
        raise AssertionError("a stored choice must not be timed")

    tuned.do_bench = no_timing
    knobs.runtime.jit_cache_hook = lambda **kw: True  # compile and launch nothing
    cfg, launched = launch._choose_config(tuned, grid, args, meta, torch.device("cuda", 0))
    knobs.runtime.jit_cache_hook = None
    out["replayed"] = cfg == {**pruned[1].kwargs, "num_warps": pruned[1].num_warps,
                              "num_stages": pruned[1].num_stages} and launched and tuned.cache[key] is pruned[1]
    print(json.dumps(out))


def flash_combine_compile(kern, o_part, lse_part, o, lse):
    from kernels.plan import _combine_launch

    grid, args, consts = _combine_launch(o_part, lse_part, o, lse)
    kern.attn_combine.warmup(*args, grid=grid, **consts, num_warps=4)


if __name__ == "__main__":
    sys.exit(main())
