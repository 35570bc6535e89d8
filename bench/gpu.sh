#!/usr/bin/env bash
# The GPU tests and the benchmarks of attnserve on one GPU host; logs and tables under OUTDIR.
#
#   bash bench/gpu.sh [kernels|service|loadtest|soak|all] [OUTDIR]      (defaults: all, reports/)
#
# Runs from a checkout where the project is installed (`pip install -e '.[dev]'`, or an environment
# with the same packages: torch with CUDA, triton, the service's and Locust's packages). PYTHON
# picks the interpreter (default: python, else python3). Each part writes to its own folder:
#
#   kernels   the kernels' GPU tests (pytest -m gpu, ATTNSERVE_AUTOTUNE=0: numerics, not speed), then
#             python -m bench.kernels: forward (every provider on the anchor shapes), long N, decode,
#             backward, head dims (heads.md) -> OUTDIR/kernels/: tests.txt, kernels.md, kernels_tflops.png, bench_log.txt,
#             run.log
#   service   the engine's, batcher's, layers', processes' and server's GPU tests, then
#             python -m bench.service engine (batching on/off, large requests, two GPUs, two processes),
#             python -m bench.http_latency (the HTTP transport), python -m bench.grpc_latency,
#             python -m bench.grpc_floor (grpcio's own cost: an echo server, no engine),
#             python -m bench.sessions (session steps over HTTP and gRPC, packed steps, a decode loop)
#             -> OUTDIR/service/: tests.txt, service.md (engine and HTTP tables), engine.log, http.log,
#             grpc.txt, grpc_floor.md, sessions.md
#   loadtest  the Locust matrix {HTTP safetensors, gRPC} x {small, prefill} x {16, 64, 256 users}, one
#             python -m loadtest.run per cell, against `python -m service` with batching off, then on
#             -> OUTDIR/loadtest/: results.md, results.csv, plots (with matplotlib), bench.log,
#                server_batching_*.log, cells/ (each cell's Locust CSVs, *_summary.json, *_final.json)
#   soak      10 minutes of the mixed mix, HTTP safetensors + gRPC + OIP users, sampling the server's
#             resident memory, its /metrics GPU memory and nvidia-smi every SAMPLE_S s; the server's
#             RSS before the load and after IDLE_S s idle; then SESSION_S s of the sessions mix (64 users:
#             create, chunked prefill, decode, end), sampling the same series, and the sessions still
#             held after it (none should be) -> OUTDIR/soak/ (as loadtest/, plus *_memory.csv)
#   all       every GPU test (pytest -m gpu), then the benchmarks of all four parts, in that order
#
# Settings (environment), with their defaults:
#   tests     PYTEST_ARGS (none): more pytest arguments, e.g. "-x" or more test paths
#   kernels   KERNELS_BUDGET_S (480): bench.kernels starts no new shape after this; KERNELS_ARGS (none),
#             e.g. "--sections decode" or "--causal only"
#   service   ENGINE_ONLY (small,large,multi,procs), ENGINE_SECONDS (2), HTTP_ITERS (150),
#             HTTP_LARGE_ITERS (4), GRPC_ITERS (500), GRPC_STREAM_CALLS (3000), SESSION_ITERS (100)
#   loadtest  CELL_S (8 s a cell), PREFILL_CELL_S (45: a prefill call takes seconds under load, so
#             shorter cells at 256 users may finish no request), USERS ("16 64 256"), MIXES ("small
#             prefill"), TRANSPORTS ("st grpc"), BATCHING ("off on"), PROCESSES (4 Locust processes),
#             SERVER_ARGS ("--device cuda"), HTTP_PORT (8000), GRPC_PORT (8001), LOCUST_LOGLEVEL (INFO)
#   soak      SOAK_S (600; 0 skips it), SOAK_USERS (128), SOAK_MIX (mixed), SESSION_S (600; 0 skips it),
#             SESSION_USERS (64), SAMPLE_S (5), IDLE_S (25), SOAK_CELLS
#             (set to 1: the batching-on matrix after the soak, on the same server); e.g. the prefill
#             mix at 256 users after a soak (a round of 256 prefill calls can outlast the server's
#             default 60 s request timeout, hence the longer one):
#               SOAK_CELLS=1 MIXES=prefill USERS=256 PREFILL_CELL_S=150 \
#                 SERVER_ARGS="--device cuda --request-timeout-ms 600000" bash bench/gpu.sh soak
#
# Exits 1 when a test run or a benchmark failed (the summary at the end names its log), 2 on bad
# usage or a host without a CUDA device. A load-test cell with failed requests does not fail the
# script: its failures are in the table.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { echo "usage: bash bench/gpu.sh [kernels|service|loadtest|soak|all] [OUTDIR]" >&2; }
PART=${1:-all}
OUTDIR=${2:-reports}
case "$PART" in
  kernels | service | loadtest | soak | all) ;;
  -h | --help) usage; exit 0 ;;
  *) usage; exit 2 ;;
esac
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python || command -v python3) || { echo "no python on PATH; set PYTHON" >&2; exit 2; }
fi
export PYTHONUNBUFFERED=1

read -r -a PYTEST_EXTRA <<< "${PYTEST_ARGS:-}"
read -r -a KERNELS_EXTRA <<< "${KERNELS_ARGS:-}"
KERNEL_TESTS=(tests/kernels/test_triton_forward.py tests/kernels/test_backward.py tests/kernels/test_flash_plan.py)
SERVICE_TESTS=(tests/service/test_batcher.py tests/service/test_engine.py tests/service/test_layers.py tests/service/test_processes.py
               tests/service/test_server.py)

CELL_S=${CELL_S:-8}
PREFILL_CELL_S=${PREFILL_CELL_S:-45}
USERS=${USERS:-"16 64 256"}
MIXES=${MIXES:-"small prefill"}
TRANSPORTS=${TRANSPORTS:-"st grpc"}
BATCHING=${BATCHING:-"off on"}
PROCESSES=${PROCESSES:-4}            # Locust processes (the server needs CPU too)
SOAK_S=${SOAK_S:-600}
SOAK_USERS=${SOAK_USERS:-128}
SOAK_MIX=${SOAK_MIX:-mixed}
SESSION_S=${SESSION_S:-600}
SESSION_USERS=${SESSION_USERS:-64}
SAMPLE_S=${SAMPLE_S:-5}
IDLE_S=${IDLE_S:-25}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
SERVER_ARGS=${SERVER_ARGS:-"--device cuda"}

T0=$(date +%s)
LOG=""                               # the current load-test folder's bench.log, once there is one
FAILED=()
say() {
  local line
  line="[$(( $(date +%s) - T0 ))s] $*"
  echo "$line"
  if [ -n "$LOG" ]; then echo "$line" >> "$LOG"; fi
}

step() {  # $1: name, $2: its log file, then the command (output shown and kept); a failure is recorded
  local name=$1 log=$2 rc
  shift 2
  say "$name: $*"
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name (exit $rc; $log)")
    say "$name failed (exit $rc)"
  fi
  return "$rc"
}

# ---------------------------------------------------------------- the host

preflight() {
  mkdir -p "$OUTDIR"
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "$PYTHON sees no CUDA device (or no torch): these are the GPU tests and benchmarks" >&2
    exit 2
  fi
  local need="import kernels, service, pytest, triton"
  if [ "$PART" != kernels ]; then
    need+=", fastapi, uvicorn, httpx, orjson, safetensors, grpc, grpc_tools, grpc_health, locust"
    need+=", pydantic_settings, prometheus_client"
  fi
  if ! "$PYTHON" -c "$need"; then
    echo "missing Python packages (above): install the project with pip install -e '.[dev]'" >&2
    exit 2
  fi
  if [ "$PART" != kernels ]; then
    "$PYTHON" -m service.grpc.protogen --if-stale > /dev/null || { echo "generating the gRPC stubs failed" >&2; exit 2; }
  fi
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "part: $PART; python: $PYTHON; nproc: $(nproc)"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null \
      || echo "nvidia-smi: not found"
    "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| triton', triton.__version__, '| GPUs', torch.cuda.device_count())"
    if [ "$PART" != kernels ]; then
      "$PYTHON" -c "import grpc, locust; print('grpcio', grpc.__version__, '| locust', locust.__version__)"
    fi
  } > "$OUTDIR/env.txt" 2>&1
  cat "$OUTDIR/env.txt"
}

gpu_tests() {  # $1: folder for tests.txt, then the test paths (none: every test)
  local dir=$1
  shift
  mkdir -p "$dir"
  step "GPU tests" "$dir/tests.txt" env ATTNSERVE_AUTOTUNE=0 "$PYTHON" -m pytest -q -m gpu "$@" "${PYTEST_EXTRA[@]}"
}

# ---------------------------------------------------------------- kernels and service benchmarks

bench_kernels() {
  local dir=$OUTDIR/kernels
  mkdir -p "$dir"
  # it prints its log (also in bench_log.txt) and, at the end, kernels.md; run.log adds stderr
  step "bench.kernels" "$dir/run.log" "$PYTHON" -m bench.kernels --out-dir "$dir" \
    --budget-s "${KERNELS_BUDGET_S:-480}" "${KERNELS_EXTRA[@]}"
}

bench_service() {
  local dir=$OUTDIR/service
  mkdir -p "$dir"
  step "bench.service engine" "$dir/engine.log" "$PYTHON" -m bench.service engine \
    --only "${ENGINE_ONLY:-small,large,multi,procs}" --seconds "${ENGINE_SECONDS:-2}" --write "$dir/service.md"
  step "bench.http_latency" "$dir/http.log" "$PYTHON" -m bench.http_latency \
    --iters "${HTTP_ITERS:-150}" --large-iters "${HTTP_LARGE_ITERS:-4}" --write "$dir/service.md"
  step "bench.grpc_latency" "$dir/grpc.txt" "$PYTHON" -m bench.grpc_latency \
    --iters "${GRPC_ITERS:-500}" --stream-calls "${GRPC_STREAM_CALLS:-3000}"
  step "bench.grpc_floor" "$dir/grpc_floor.md" "$PYTHON" -m bench.grpc_floor --iters "${GRPC_ITERS:-500}"
  step "bench.sessions" "$dir/sessions.md" "$PYTHON" -m bench.sessions --iters "${SESSION_ITERS:-100}"
}

# ---------------------------------------------------------------- load tests: the server

SERVER_PID=""
SERVER_DIR=""
start_server() {  # $1: batching on|off; the server's log goes to $SERVER_DIR
  local extra=() log=$SERVER_DIR/server_batching_$1.log
  if [ "$1" = off ]; then extra=(--no-batching); fi
  local args
  read -r -a args <<< "$SERVER_ARGS"
  say "starting the server (batching $1): ${args[*]}${extra[*]:+ ${extra[*]}}"
  "$PYTHON" -m service --host 127.0.0.1 --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" \
    "${args[@]}" "${extra[@]}" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      say "the server exited:"; tail -30 "$log"; SERVER_PID=""; return 1
    fi
    if "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$HTTP_PORT/readyz', timeout=1)" \
        2>/dev/null; then
      say "server ready"; return 0
    fi
    sleep 0.5
  done
  say "the server was not ready within 300 s"; stop_server; return 1
}

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

rss_mib() {  # the server and its children (--processes)
  "$PYTHON" -c "from loadtest.observe import tree_rss; print(int(tree_rss($SERVER_PID) / 2**20))" 2>/dev/null \
    || echo "?"
}

# ---------------------------------------------------------------- load tests: the runs

loadtest() {  # $1: the folder, then loadtest.run's arguments; failed requests are in the summary
  local dir=$1
  shift
  "$PYTHON" -m loadtest.run --host "http://127.0.0.1:$HTTP_PORT" --grpc-target "127.0.0.1:$GRPC_PORT" \
    --reports-dir "$dir/cells" --no-html --stop-timeout 5 --processes "$PROCESSES" \
    --locust-loglevel "${LOCUST_LOGLEVEL:-INFO}" "$@" >> "$LOG" 2>&1 \
    || say "  (exit $?: failures or no requests; see the summary)"
  # a Locust worker killed for memory leaves no trace in its own log
  dmesg 2>/dev/null | grep -iE "out of memory|oom-kill|killed process" | tail -5 | sed 's/^/  dmesg: /' >> "$LOG" \
    || true
}

last_summary() {  # the key lines of the last run's printed summary
  awk '/^== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$LOG" \
    | grep -E "^(throughput|failures|server batch|memory|  [0-9]+x)" || true
}

matrix() {  # $1: the folder, $2: batching on|off (the server's setting, for the tags)
  local dir=$1 batching=$2 mix t u cell
  for mix in $MIXES; do for t in $TRANSPORTS; do for u in $USERS; do
    cell=$CELL_S
    if [ "$mix" = prefill ]; then cell=$PREFILL_CELL_S; fi
    say "cell: mix $mix, $t, $u users, batching $batching, ${cell}s"
    loadtest "$dir" --mix "$mix" --user-class "$t" --users "$u" --spawn-rate "$u" --run-time "${cell}s" \
      --tag "${mix}_${t}_batching-${batching}_u$u" --label "batching=$batching"
    last_summary
  done; done; done
}

soak() {  # $1: the folder; the server runs with batching on
  local dir=$1
  say "server RSS before the load: $(rss_mib) MiB"
  if [ "$SOAK_S" -gt 0 ]; then
    say "soak: mix $SOAK_MIX, st+grpc+oip, $SOAK_USERS users, ${SOAK_S}s, memory every ${SAMPLE_S}s"
    loadtest "$dir" --mix "$SOAK_MIX" --user-class st,grpc,oip --users "$SOAK_USERS" --spawn-rate 64 \
      --run-time "${SOAK_S}s" --tag "soak_${SOAK_MIX}_u${SOAK_USERS}_${SOAK_S}s" --label batching=on \
      --sample-memory "$SERVER_PID" --sample-memory "http://127.0.0.1:$HTTP_PORT" --sample-memory nvidia-smi \
      --sample-interval "$SAMPLE_S"
    last_summary
    # Under load RSS keeps the high-water mark of the bodies in flight (docs/http.md); idle for
    # --memory-trim-idle-s (10 s by default) the server gives it back: what is left then is what grew.
    sleep "$IDLE_S"
    say "server RSS after ${IDLE_S}s idle: $(rss_mib) MiB"
  fi
  if [ "$SESSION_S" -gt 0 ]; then
    say "sessions: mix sessions, $SESSION_USERS users, ${SESSION_S}s, memory every ${SAMPLE_S}s"
    loadtest "$dir" --mix sessions --users "$SESSION_USERS" --spawn-rate 64 --run-time "${SESSION_S}s" \
      --tag "sessions_u${SESSION_USERS}_${SESSION_S}s" --label batching=on \
      --sample-memory "http://127.0.0.1:$HTTP_PORT" --sample-memory nvidia-smi --sample-interval "$SAMPLE_S"
    last_summary
    say "sessions held after the run: $("$PYTHON" -c "import json, urllib.request as u; \
print(json.load(u.urlopen('http://127.0.0.1:$HTTP_PORT/sessions'))['count'])" 2>/dev/null || echo '?')"
  fi
}

load_part() {  # $1: loadtest | soak
  local dir=$OUTDIR/$1 b
  mkdir -p "$dir/cells"
  SERVER_DIR=$dir
  LOG=$dir/bench.log
  : > "$LOG"
  cp "$OUTDIR/env.txt" "$dir/env.txt"
  echo "cell ${CELL_S}s (prefill ${PREFILL_CELL_S}s), Locust processes ${PROCESSES}, server args: ${SERVER_ARGS}" \
    >> "$dir/env.txt"
  if [ "$1" = loadtest ]; then
    for b in $BATCHING; do
      if start_server "$b"; then matrix "$dir" "$b"; stop_server; else FAILED+=("$1: server (batching $b)"); fi
    done
  elif start_server on; then
    soak "$dir"
    if [ -n "${SOAK_CELLS:-}" ]; then matrix "$dir" on; fi
    stop_server
    grep -E "RSS|failures|memory" "$LOG" | tail -12
  else
    FAILED+=("$1: server (batching on)")
  fi
  "$PYTHON" -m loadtest.report "$dir/cells" --out "$dir" >> "$LOG" 2>&1 || FAILED+=("$1: loadtest.report ($LOG)")
  cat "$dir/results.md" 2>/dev/null || true
  LOG=""
}

# ---------------------------------------------------------------- the parts

preflight
case "$PART" in
  kernels) gpu_tests "$OUTDIR/kernels" "${KERNEL_TESTS[@]}"; bench_kernels ;;
  service) gpu_tests "$OUTDIR/service" "${SERVICE_TESTS[@]}"; bench_service ;;
  loadtest | soak) load_part "$PART" ;;
  all)
    gpu_tests "$OUTDIR"
    bench_kernels
    bench_service
    load_part loadtest
    load_part soak
    ;;
esac

say "done; results in $OUTDIR"
if [ "${#FAILED[@]}" -gt 0 ]; then
  printf 'failed: %s\n' "${FAILED[@]}"
  exit 1
fi
