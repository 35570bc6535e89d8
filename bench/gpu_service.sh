#!/usr/bin/env bash
# Device-machine script: the service's GPU tests and benchmarks in one call, results under $OUT.
#   bash bench/gpu_service.sh [tests,profile,engine,http,grpc,diag,loadtest]   (default: all but diag, loadtest)
# Expects the wheels of .whl/ (../shared/tools/device-wheels.sh) carried beside the checkout.
# GPU_TESTS adds test paths to the GPU test step (pytest -m gpu ...), e.g.
#   GPU_TESTS="tests/test_triton_forward.py tests/test_backward.py"; a -k given there filters every
#   file of the step, so keep it out (one session's run selected nothing that way).
set -u
STEPS=${1:-tests,profile,engine,http,grpc}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'grpcio', grpc.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m service.grpc.protogen >/dev/null
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests; then
  t tests
  ATTNSERVE_AUTOTUNE=0 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batcher.py \
    tests/test_engine.py tests/test_layers.py tests/test_flash_plan.py tests/test_processes.py ${GPU_TESTS:-} 2>&1 | tail -12 | tee "$OUT/gpu_tests.txt"
fi
if has profile; then
  t profile
  timeout 150 python3 -m bench.profile_engine --seconds 2 > "$OUT/profile.txt" 2>&1
  head -6 "$OUT/profile.txt"; grep -A25 "yappi: top" "$OUT/profile.txt" | head -28; grep -A8 "yappi: threads" "$OUT/profile.txt"
fi
if has engine; then
  t engine
  timeout 240 python3 -m bench.service engine --only "${ENGINE_ONLY:-small,large,multi,procs}" --seconds 2 \
    --write "$OUT/service.md" 2>&1 | tail -20
fi
if has http; then
  t http
  timeout 150 python3 -m bench.service http --iters ${HTTP_ITERS:-150} --large-iters 4 --write "$OUT/service.md" \
    > "$OUT/http.log" 2>&1; echo "http rc=$?"; grep -A14 "## HTTP" "$OUT/service.md"
fi
if has grpc; then
  t grpc
  timeout 120 python3 -m bench.grpc_latency --iters 500 --stream-calls 3000 2>&1 | tail -14 | tee "$OUT/grpc.txt"
fi
if has diag; then
  t diag
  timeout 120 python3 -m bench.diag_latency --iters 200 2>&1 | tail -20 | tee "$OUT/diag.txt"
fi
if has loadtest; then
  t loadtest
  OUT="$OUT/load" CELL_S=${CELL_S:-8} BUDGET_S=${LOAD_BUDGET_S:-240} WHEELS=/nonexistent \
    bash loadtest/gpu_bench.sh matrix > "$OUT/load.log" 2>&1; echo "loadtest rc=$?"; cat "$OUT/load/results.md" 2>/dev/null
fi
t done
