#!/usr/bin/env bash
# The load-test matrix on one GPU host, in one call of at most ~9 minutes:
#
#   OUT=/some/dir bash loadtest/gpu_bench.sh            # matrix (batching off), matrix (batching on), short soak
#   OUT=/some/dir SOAK_S=540 bash loadtest/gpu_bench.sh soak    # only the soak, as long as one call allows
#
# Starts the server on the GPU with --no-batching and runs every cell
#   {HTTP safetensors, gRPC} x {small, prefill} x {16, 64, 256 users}, CELL_S seconds each,
# then restarts it with batching on (the default), runs the matrix again, and ends with a soak
# (mixed mix, HTTP + gRPC + OIP users, SOAK_USERS users, SOAK_S seconds or what the budget leaves)
# that samples the server's resident memory, its /metrics GPU memory and nvidia-smi every SAMPLE_S s.
# 24 cells of 8 s with Locust's start and stop take about 6 minutes; CELL_S=30 needs fewer cells
# (e.g. USERS="64 256" TRANSPORTS=st) or two calls (MIXES=small, then MIXES=prefill).
# Writes to $OUT: results.md (the table for docs/loadtest.md), results.csv, cells/ (every run's
# Locust CSVs, *_summary.json, *_final.json, the soak's *_memory.csv), server logs, env.txt, and
# PNG plots when matplotlib is importable. A cell that would overrun BUDGET_S is skipped (and said so).
#
# A true soak of >= 10 minutes does not fit in one device call (10 minutes, server start included):
# run it as its own call with SOAK_S as large as the call allows, or on a host without that limit.
#
# Needs python3 with torch (CUDA), numpy, safetensors, grpcio, and the project's Python packages
# (fastapi, uvicorn, locust, grpcio-tools, ...). If they are missing and WHEELS (default .whl) is a
# folder of wheels, they are installed from it (no index).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
OUT=${OUT:-reports/gpu_bench}
MODE=${1:-all}                       # all | matrix | matrix-on (its cells with batching on) | soak |
                                     # soak-cells (the soak, then the matrix's cells with batching on,
                                     # on the same server)
CELL_S=${CELL_S:-8}                  # seconds per cell
PREFILL_CELL_S=${PREFILL_CELL_S:-45} # seconds per prefill cell: a 128 MiB call takes seconds under load,
                                     # and 10 s cells at 256 users finished no request (H200, 2026-11-30)
USERS=${USERS:-"16 64 256"}
MIXES=${MIXES:-"small prefill"}
TRANSPORTS=${TRANSPORTS:-"st grpc"}
PROCESSES=${PROCESSES:-4}            # Locust worker processes (the server needs CPU too)
SOAK_S=${SOAK_S:-60}
SOAK_USERS=${SOAK_USERS:-128}
SOAK_MIX=${SOAK_MIX:-mixed}
SAMPLE_S=${SAMPLE_S:-5}
BUDGET_S=${BUDGET_S:-530}            # stop starting new cells after this many seconds
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
SERVER_ARGS=${SERVER_ARGS:-"--device cuda"}
WHEELS=${WHEELS:-.whl}

T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
mkdir -p "$OUT/cells"
LOG="$OUT/bench.log"
say() { echo "[$(elapsed)s] $*" | tee -a "$LOG"; }

# ---------------------------------------------------------------- dependencies
need="import fastapi, uvicorn, locust, grpc_tools, pydantic_settings, prometheus_client, orjson, grpc_health"
if ! "$PY" -c "$need" 2>/dev/null; then
  if [ -d "$WHEELS" ]; then
    say "installing the service's and Locust's packages from $WHEELS"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" fastapi starlette uvicorn pydantic \
      pydantic-settings prometheus-client orjson grpcio-tools grpcio-health-checking grpcio-reflection \
      protobuf httpx locust 2>&1 | tail -5 | tee -a "$LOG"
  fi
  "$PY" -c "$need" || { say "missing Python packages (see above); install them or set WHEELS"; exit 2; }
fi
"$PY" -m service.grpc.protogen --if-stale >>"$LOG" 2>&1

{
  echo "date: $(date -u +%FT%TZ)"; echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$PY" -c "import locust, grpc; print('locust', locust.__version__, '| grpcio', grpc.__version__)"
  echo "nproc: $(nproc)"; echo "cell ${CELL_S}s (prefill ${PREFILL_CELL_S}s), processes ${PROCESSES}, server args: ${SERVER_ARGS}"
} >"$OUT/env.txt" 2>&1

# ---------------------------------------------------------------- the server
SERVER_PID=""
start_server() {  # $1: batching on|off
  local extra=""; [ "$1" = off ] && extra="--no-batching"
  say "starting the server (batching $1): $SERVER_ARGS $extra"
  # shellcheck disable=SC2086
  "$PY" -m service --host 127.0.0.1 --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" $SERVER_ARGS $extra \
    >"$OUT/server_batching_$1.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then say "server exited:"; tail -30 "$OUT/server_batching_$1.log"; exit 3; fi
    if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$HTTP_PORT/readyz', timeout=1)" 2>/dev/null; then
      say "server ready"; return 0
    fi
    sleep 0.5
  done
  say "server not ready in time"; exit 3
}
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

# ---------------------------------------------------------------- runs
loadtest() {  # extra args to loadtest.run; never fails the script (failures are in the summary)
  "$PY" -m loadtest.run --host "http://127.0.0.1:$HTTP_PORT" --grpc-target "127.0.0.1:$GRPC_PORT" \
    --reports-dir "$OUT/cells" --no-html --stop-timeout 5 --processes "$PROCESSES" \
    --locust-loglevel "${LOCUST_LOGLEVEL:-INFO}" "$@" >>"$LOG" 2>&1 \
    || say "  (exit $?: failures or no requests; see the summary)"
  # a Locust worker killed for memory leaves no trace in its own log (a gRPC prefill cell at 256
  # users lost every worker within seconds, H200 host, 2026-11-30)
  dmesg 2>/dev/null | grep -iE "out of memory|oom-kill|killed process" | tail -5 | sed 's/^/  dmesg: /' >>"$LOG" || true
}

last_summary() {  # the key lines of the last run's printed summary
  awk '/^== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$LOG" \
    | grep -E "^(throughput|failures|server batch|memory|  [0-9]+x)" || true
}

matrix() {  # $1: batching on|off
  for mix in $MIXES; do for t in $TRANSPORTS; do for u in $USERS; do
    local cell=$CELL_S; [ "$mix" = prefill ] && cell=$PREFILL_CELL_S
    if [ $(( $(elapsed) + cell + 25 )) -gt "$BUDGET_S" ]; then say "SKIPPED $mix $t u$u batching $1 (budget)"; continue; fi
    say "cell: mix $mix, $t, $u users, batching $1, ${cell}s"
    loadtest --mix "$mix" --user-class "$t" --users "$u" --spawn-rate "$u" --run-time "${cell}s" \
      --tag "${mix}_${t}_batching-$1_u$u" --label "batching=$1"
    last_summary
  done; done; done
}

soak() {
  local left=$(( BUDGET_S - $(elapsed) - 20 )) s=$SOAK_S
  [ "$s" -gt "$left" ] && s=$left
  if [ "$s" -lt 20 ]; then say "SKIPPED soak (budget)"; return; fi
  say "soak: mix $SOAK_MIX, st+grpc+oip, $SOAK_USERS users, ${s}s, memory every ${SAMPLE_S}s"
  say "server RSS before the load: $(rss_mib) MiB"
  loadtest --mix "$SOAK_MIX" --user-class st,grpc,oip --users "$SOAK_USERS" --spawn-rate 64 --run-time "${s}s" \
    --tag "soak_${SOAK_MIX}_u${SOAK_USERS}_${s}s" --label batching=on \
    --sample-memory "$SERVER_PID" --sample-memory "http://127.0.0.1:$HTTP_PORT" --sample-memory nvidia-smi \
    --sample-interval "$SAMPLE_S"
  last_summary
  # Under load RSS keeps the high-water mark of the bodies in flight (docs/http.md); idle for
  # --memory-trim-idle-s (10 s by default) the server gives it back: what is left then is what grew.
  sleep "${IDLE_S:-25}"
  say "server RSS after ${IDLE_S:-25}s idle: $(rss_mib) MiB"
}

rss_mib() {  # the server and its children (--processes)
  "$PY" -c "from loadtest.run import _tree_rss; print(int(_tree_rss($SERVER_PID) / 2**20))" 2>/dev/null || echo "?"
}

case "$MODE" in
  all)    start_server off; matrix off; stop_server; start_server on; matrix on; soak ;;
  matrix) start_server off; matrix off; stop_server; start_server on; matrix on ;;
  matrix-on) start_server on; matrix on ;;  # the cells with batching on only
  soak)   start_server on; soak ;;
  soak-cells) start_server on; soak; matrix on ;;  # then cells on the same server (batching on)
  *) echo "usage: $0 [all|matrix|matrix-on|soak|soak-cells]"; exit 2 ;;
esac
stop_server

"$PY" -m loadtest.report "$OUT/cells" --out "$OUT" >>"$LOG" 2>&1 || say "report failed"
cat "$OUT/results.md" 2>/dev/null || true
say "done in $(elapsed)s; results in $OUT"
