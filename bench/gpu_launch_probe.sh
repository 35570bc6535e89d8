#!/usr/bin/env bash
# Device-machine script: where a small HTTP call's "launch" time goes inside the server (a sweep of
# server settings, not a benchmark of record). The H200 host's server spent 0.64-0.74 ms in the
# launch phase (Server-Timing) of a 1x8x128x64 call, against 0.33-0.49 ms for the same worker call
# made directly in a bare process (2026-11-30). Each line below starts a server with one setting
# changed (ATTNSERVE_* reaches the server that bench.http_latency starts) and prints its small row.
#   [PROBES="defaults gil5"] [NO_DIAG=1] bash bench/gpu_launch_probe.sh   (expects the wheels of .whl/ carried beside the checkout)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m service.grpc.protogen >/dev/null
probe() {  # $1: label; the rest: VAR=value settings for the server
  local label=$1; shift
  echo "== $label"
  env "$@" timeout 120 python3 -m bench.http_latency --small-only --iters "${ITERS:-400}" 2>&1 \
    | grep -E "^\| (kernel|small safetensors)"
}
# PROBES picks some (default: all): defaults gil5 gil005 omp1
for p in ${PROBES:-defaults gil5 gil005 omp1}; do
  case $p in
    defaults) probe "defaults" ;;
    gil5) probe "GIL switch interval 5 ms (Python's default)" ATTNSERVE_GIL_SWITCH_INTERVAL_MS=5 ;;
    gil005) probe "GIL switch interval 0.05 ms" ATTNSERVE_GIL_SWITCH_INTERVAL_MS=0.05 ;;
    omp1) probe "one OpenMP thread" OMP_NUM_THREADS=1 ;;
    *) echo "unknown probe $p" ;;
  esac
done
[ -n "${NO_DIAG:-}" ] || python3 -m bench.diag_latency --iters 200 2>&1 | head -8
