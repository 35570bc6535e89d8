#!/usr/bin/env bash
# Device-machine script: GPU tests of the Triton kernels and/or the kernel benchmark, results in $OUT.
#   bash bench/gpu_check.sh [tests|bench|all]     (OUT defaults to ./gpu_out)
# The benchmark autotunes every kernel it runs (a few minutes of compiling): give it its own call.
set -u
MODE=${1:-all}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if [ "$MODE" != bench ]; then
  # first config per head dim, no autotuning: the tests check numerics, not speed
  ATTNSERVE_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-230} python3 -m pytest -m gpu -q --maxfail=6 -p no:cacheprovider \
    tests/test_triton_forward.py tests/test_backward.py 2>&1 | tail -40 > "$OUT/gpu_tests.txt"
  echo "tests rc=${PIPESTATUS[0]}"; tail -5 "$OUT/gpu_tests.txt"
fi
if [ "$MODE" != tests ]; then
  timeout ${BENCH_TIMEOUT:-560} python3 bench/kernels.py --out-dir "$OUT" --budget-s ${BENCH_BUDGET:-480} \
    > /dev/null 2>"$OUT/bench_err.txt"
  echo "bench rc=$?"; tail -5 "$OUT/bench_err.txt"; cat "$OUT/kernels.md" 2>/dev/null || tail -30 "$OUT/bench_log.txt"
fi
