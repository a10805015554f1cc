#!/usr/bin/env bash
# kiln's benchmark: kiln-runtime (dynamic batching on and off) against the FastAPI + uvicorn +
# PyTorch eager baseline, all driven by the same kiln-loadgen settings, plus kiln's served-path
# overhead (kiln-overhead-bench) and its lifecycle timings (spawn -> WARM, Promote -> first
# served request). Prints markdown tables; raw results stay in $RESULTS_DIR.
#
#   bench/run_bench.sh
#
# Environment (all optional):
#   BUILD_DIR=build  JOBS=<ninja -j>  CMAKE_ARGS="-DKILN_BUILD_TESTS=OFF"  SKIP_BUILD=1
#   DURATION_S=10  WARMUP_S=2  CONCURRENCY=16  SEQ_LEN=16  BATCH=1  LIFECYCLE_RUNS=3
#   FASTAPI_THREADS=0 (torch threads in the baseline, 0 = torch's default)
#   RESULTS_DIR=$BUILD_DIR/bench-results  PYTHON=/usr/bin/python3
#
# Not part of the test suite. Every process it starts is stopped on exit, every step is
# bounded in time, and all traffic stays on 127.0.0.1.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${BUILD_DIR:-build}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PYTHON=${PYTHON:-/usr/bin/python3}
DURATION_S=${DURATION_S:-10}
WARMUP_S=${WARMUP_S:-2}
CONCURRENCY=${CONCURRENCY:-16}
SEQ_LEN=${SEQ_LEN:-16}
BATCH=${BATCH:-1}
LIFECYCLE_RUNS=${LIFECYCLE_RUNS:-3}
FASTAPI_THREADS=${FASTAPI_THREADS:-0}
RESULTS_DIR=${RESULTS_DIR:-$BUILD/bench-results}

RUNTIME=$BUILD/runtime/kiln-runtime
LOADGEN=$BUILD/bench/kiln-loadgen
OVERHEAD=$BUILD/bench/kiln-overhead-bench
PROBE=$BUILD/bench/kiln-control-probe
DEMO=$BUILD/examples/kiln-demo-client

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kiln-bench.XXXXXX")
PIDS=()

log() { printf '[run_bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Stops every process this script started: SIGTERM, up to 10 s grace, then SIGKILL.
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 1 100); do
    local alive=0
    for pid in "${PIDS[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid ignored SIGTERM; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  if [[ -d "$WORK" ]]; then
    mkdir -p "$RESULTS_DIR/logs"
    cp "$WORK"/*.log "$RESULTS_DIR/logs/" 2>/dev/null || true
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

die() { log "ERROR: $*"; exit 1; }

# Removes a pid from PIDS once the process is known to be gone.
forget_pid() {
  local gone=$1 kept=() pid
  for pid in "${PIDS[@]}"; do
    [[ $pid == "$gone" ]] || kept+=("$pid")
  done
  PIDS=("${kept[@]}")
}

# stop_pid PID: SIGTERM, up to 10 s, then SIGKILL.
stop_pid() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  forget_pid "$pid"
}

# start_runtime LABEL REPO [ARGS...]: starts kiln-runtime on ephemeral ports and waits (up to
# 120 s) for its "grpc_port=N http_port=N" log line. Sets RT_PID, RT_GRPC, RT_HTTP.
start_runtime() {
  local label=$1 repo=$2
  shift 2
  local logf="$WORK/runtime-$label.log"
  "$RUNTIME" --model-repository "$repo" --model encoder --grpc-port 0 --http-port 0 \
    --bind-address 127.0.0.1 "$@" >"$logf" 2>&1 &
  RT_PID=$!
  PIDS+=("$RT_PID")
  RT_GRPC="" RT_HTTP=""
  for _ in $(seq 1 1200); do
    local ports
    ports=$(sed -n 's/.*grpc_port=\([0-9][0-9]*\).*http_port=\([0-9][0-9]*\).*/\1 \2/p' "$logf" |
      head -n 1)
    if [[ -n "$ports" ]]; then
      read -r RT_GRPC RT_HTTP <<<"$ports"
      break
    fi
    if ! kill -0 "$RT_PID" 2>/dev/null; then
      tail -n 30 "$logf" >&2 || true
      die "kiln-runtime ($label) exited during startup (log above)"
    fi
    sleep 0.1
  done
  if [[ -z "$RT_GRPC" || "$RT_GRPC" == 0 || -z "$RT_HTTP" || "$RT_HTTP" == 0 ]]; then
    tail -n 30 "$logf" >&2 || true
    die "kiln-runtime ($label) printed no grpc_port=/http_port= line within 120 s"
  fi
}

# wait_http_ready PORT LABEL: GET /v2/health/ready until 200 (up to 120 s).
wait_http_ready() {
  local port=$1 label=$2
  for _ in $(seq 1 1200); do
    if curl -sf -m 2 -o /dev/null "http://127.0.0.1:$port/v2/health/ready"; then
      return 0
    fi
    sleep 0.1
  done
  die "$label is not ready on 127.0.0.1:$port after 120 s"
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# load LABEL ADDRESS TARGET [ARGS...]: one kiln-loadgen run; its JSON line lands in
# $RESULTS_DIR/load-LABEL.json.
load() {
  local label=$1 address=$2 target=$3
  shift 3
  log "loadgen: $label ($target $address, closed loop, concurrency $CONCURRENCY, ${DURATION_S}s)"
  timeout --kill-after=5 $((DURATION_S + WARMUP_S + 60)) "$LOADGEN" --target "$target" \
    --address "$address" --model encoder --mode closed --concurrency "$CONCURRENCY" \
    --seq-len "$SEQ_LEN" --batch "$BATCH" --duration-s "$DURATION_S" --warmup-s "$WARMUP_S" \
    --json "$@" >"$RESULTS_DIR/load-$label.json" 2>"$WORK/load-$label.log" || true
  cat "$WORK/load-$label.log" >&2
}

# --- build ---------------------------------------------------------------------------------
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  log "building in $BUILD"
  # shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$BUILD" ${JOBS:+-j "$JOBS"} --target kiln-runtime kiln-loadgen \
    kiln-overhead-bench kiln-control-probe kiln-demo-client
fi
for bin in "$RUNTIME" "$LOADGEN" "$OVERHEAD" "$PROBE" "$DEMO"; do
  [[ -x "$bin" ]] || die "$bin is missing (build it, or unset SKIP_BUILD)"
done
mkdir -p "$RESULTS_DIR"
rm -f "$RESULTS_DIR"/load-*.json "$RESULTS_DIR"/lifecycle-*.json "$RESULTS_DIR"/overhead.json

# --- models --------------------------------------------------------------------------------
# Only encoder version 1 is kept so that kiln and the baseline (which rebuilds version 1's
# weights in eager mode) serve exactly the same model.
log "generating models in $WORK/models"
timeout 300 "$PYTHON" "$ROOT/scripts/make_models.py" --out "$WORK/models" >"$WORK/make_models.log"
rm -rf "$WORK/models/encoder/2"
cp -r "$WORK/models" "$WORK/models-nobatch"
"$PYTHON" "$ROOT/bench/config_variant.py" "$WORK/models/encoder/config.yaml" \
  "$WORK/models-nobatch/encoder/config.yaml" --no-batching ||
  die "could not remove dynamic_batching from the no-batching config"

# --- servers -------------------------------------------------------------------------------
log "starting kiln-runtime (dynamic batching)"
start_runtime batch "$WORK/models" --initial-state serving
B_PID=$RT_PID B_GRPC=$RT_GRPC B_HTTP=$RT_HTTP
wait_http_ready "$B_HTTP" "kiln-runtime (batching)"
log "starting kiln-runtime (no batching)"
start_runtime nobatch "$WORK/models-nobatch" --initial-state serving \
  --control-socket "$WORK/nobatch-control.sock"
N_PID=$RT_PID N_GRPC=$RT_GRPC N_HTTP=$RT_HTTP
wait_http_ready "$N_HTTP" "kiln-runtime (no batching)"

FA_PORT=$(free_port)
log "starting FastAPI baseline on 127.0.0.1:$FA_PORT"
FA_ARGS=(--port "$FA_PORT" --host 127.0.0.1 --model-repository "$WORK/models")
if [[ "$FASTAPI_THREADS" != 0 ]]; then FA_ARGS+=(--threads "$FASTAPI_THREADS"); fi
"$PYTHON" "$ROOT/bench/fastapi_server.py" "${FA_ARGS[@]}" >"$WORK/fastapi.log" 2>&1 &
FA_PID=$!
PIDS+=("$FA_PID")
wait_http_ready "$FA_PORT" "FastAPI baseline"
grep -q "same-model check.*OK" "$WORK/fastapi.log" ||
  die "the FastAPI baseline did not prove it serves the same model: $(cat "$WORK/fastapi.log")"
log "kiln batching: pid $B_PID grpc $B_GRPC http $B_HTTP; no batching: pid $N_PID grpc $N_GRPC" \
  "http $N_HTTP; FastAPI: pid $FA_PID http $FA_PORT"

# --- correctness smoke: the demo client ------------------------------------------------------
DEMO_KILN=FAIL DEMO_CROSS=FAIL
if timeout 60 "$DEMO" --grpc "127.0.0.1:$B_GRPC" --http "127.0.0.1:$B_HTTP" --model encoder \
  >"$WORK/demo-kiln.log" 2>&1; then DEMO_KILN=OK; fi
# kiln over gRPC against the baseline over REST: the same model must give the same numbers.
if timeout 60 "$DEMO" --grpc "127.0.0.1:$N_GRPC" --http "127.0.0.1:$FA_PORT" --model encoder \
  >"$WORK/demo-cross.log" 2>&1; then DEMO_CROSS=OK; fi
cat "$WORK/demo-kiln.log" >&2
[[ $DEMO_CROSS == OK ]] || cat "$WORK/demo-cross.log" >&2
log "demo client: kiln gRPC vs kiln REST $DEMO_KILN; kiln gRPC vs FastAPI REST $DEMO_CROSS"

# --- load ------------------------------------------------------------------------------------
load kiln-batch-rest "127.0.0.1:$B_HTTP" rest
load kiln-nobatch-rest "127.0.0.1:$N_HTTP" rest
load fastapi-rest "127.0.0.1:$FA_PORT" rest
load kiln-batch-grpc "127.0.0.1:$B_GRPC" grpc --raw
load kiln-nobatch-grpc "127.0.0.1:$N_GRPC" grpc --raw
stop_pid "$FA_PID"
stop_pid "$B_PID"

# --- served-path overhead ----------------------------------------------------------------------
# Against the runtime without batching: with it, a lone synchronous client would wait out the
# batcher's max_queue_delay on every request.
log "kiln-overhead-bench (served = kiln-runtime without batching)"
KILN_MODEL_REPO="$WORK/models" KILN_GRPC_ADDRESS="127.0.0.1:$N_GRPC" \
  KILN_HTTP_ADDRESS="127.0.0.1:$N_HTTP" KILN_CONTROL_SOCKET="$WORK/nobatch-control.sock" timeout --kill-after=5 600 "$OVERHEAD" \
  --benchmark_min_time=1 --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true \
  --benchmark_report_aggregates_only=true --benchmark_out="$RESULTS_DIR/overhead.json" \
  --benchmark_out_format=json >"$WORK/overhead.log" 2>&1 || true
cat "$WORK/overhead.log" >&2
stop_pid "$N_PID"

# --- lifecycle ---------------------------------------------------------------------------------
for i in $(seq 1 "$LIFECYCLE_RUNS"); do
  sock="$WORK/control-$i.sock"
  log "lifecycle run $i: spawn (--initial-state warm) -> WARM -> Promote -> first served"
  # The probe starts right away and polls the control socket; it takes the inference port
  # from GetState, so nothing waits on the runtime's log.
  t0=$(date +%s%6N)
  # Spawned as kiln-agent spawns a replica: malloc's heap on huge pages (GLIBC_TUNABLES below;
  # RUNTIME_TUNABLES= measures without).
  GLIBC_TUNABLES="${RUNTIME_TUNABLES-glibc.malloc.hugetlb=1}" \
  "$RUNTIME" --model-repository "$WORK/models" --model encoder --grpc-port 0 --http-port 0 \
    --bind-address 127.0.0.1 --initial-state warm --control-socket "$sock" \
    >"$WORK/runtime-lifecycle-$i.log" 2>&1 &
  L_PID=$!
  PIDS+=("$L_PID")
  timeout --kill-after=5 150 "$PROBE" --socket "$sock" --wait-state WARM --since-unix-us "$t0" \
    --promote --model encoder --timeout-s 120 --json >"$RESULTS_DIR/lifecycle-$i.json" \
    2>"$WORK/probe-$i.log" || log "probe run $i failed: $(cat "$WORK/probe-$i.log")"
  stop_pid "$L_PID"
done

# --- report ------------------------------------------------------------------------------------
"$PYTHON" - "$RESULTS_DIR" "$DEMO_KILN" "$DEMO_CROSS" <<'EOF' | tee "$RESULTS_DIR/results.md"
import glob, json, os, statistics, sys

res, demo_kiln, demo_cross = sys.argv[1], sys.argv[2], sys.argv[3]

def load(path):
    try:
        with open(path) as f:
            lines = [l for l in f.read().splitlines() if l.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

runs = [
    ("kiln-batch-rest", "kiln-runtime, dynamic batching", "REST JSON"),
    ("kiln-nobatch-rest", "kiln-runtime, no batching", "REST JSON"),
    ("fastapi-rest", "FastAPI + uvicorn + PyTorch eager", "REST JSON"),
    ("kiln-batch-grpc", "kiln-runtime, dynamic batching", "gRPC raw"),
    ("kiln-nobatch-grpc", "kiln-runtime, no batching", "gRPC raw"),
]
first = next((load(f"{res}/load-{k}.json") for k, _, _ in runs if load(f"{res}/load-{k}.json")), None)
if first:
    print(f"### Throughput and latency (closed loop, concurrency {first['concurrency']}, "
          f"batch {first['batch']}, seq {first['seq_len']}, {first['duration_s']:g} s after "
          f"{first['warmup_s']:g} s warm-up)\n")
print("| server | protocol | req/s | seq/s | p50 ms | p90 ms | p99 ms | max ms | errors |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
notes = []
for key, server, proto in runs:
    r = load(f"{res}/load-{key}.json")
    if r is None:
        print(f"| {server} | {proto} | n/a | | | | | | run failed |")
        continue
    l = r["latency_ms"]
    print(f"| {server} | {proto} | {r['throughput_rps']:.0f} | {r['throughput_seq_per_s']:.0f} | "
          f"{l['p50']:.2f} | {l['p90']:.2f} | {l['p99']:.2f} | {l['max']:.2f} | {r['errors']} |")
    if r.get("first_error"):
        notes.append(f"- {server} ({proto}) first error: {r['first_error']}")
print()
for n in notes:
    print(n)
if notes:
    print()

try:
    with open(f"{res}/overhead.json") as f:
        ob = json.load(f)
except (OSError, ValueError):
    ob = None
print("### Served-path overhead (kiln-overhead-bench, median of 3 interleaved repetitions; "
      "served = kiln-runtime without batching, one synchronous client)\n")
if ob:
    rows = {}
    for b in ob.get("benchmarks", []):
        # Medians of the repetitions (plain runs when the binary ran without repetitions).
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b["name"].split("/")[0]
        idle = int(b["name"].split("idle_us:")[1].split("/")[0]) if "idle_us:" in b["name"] else 0
        if idle:
            name += f" ({idle} µs idle before each)"
        batch = int(b["name"].split("batch:")[1].split("/")[0]) if "batch:" in b["name"] else 0
        unit = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b.get("time_unit", "us")]
        rows[(name, batch)] = None if b.get("error_occurred") else b["real_time"] * unit
        if b.get("error_occurred"):
            rows[(name, batch)] = "error: " + b.get("error_message", "")
    # Served rows are compared with the in-process forward run back to back (the target's
    # baseline) and, at batch 1, with the same forward after an idle wait, as a server's model
    # runs between a lone client's requests.
    print("| benchmark | batch | µs / request | overhead vs in-process | vs in-process after idle |")
    print("|---|---:|---:|---:|---:|")
    for (name, batch), v in sorted(rows.items(), key=lambda kv: (kv[0][1], not kv[0][0].startswith("BM_InProcessForward"), kv[0][0])):
        base = rows.get(("BM_InProcessForward", batch))
        idle_base = next((x for (n, bt), x in rows.items()
                          if bt == batch and n.startswith("BM_InProcessForward (")), None)
        if isinstance(v, str):
            print(f"| {name} | {batch} | {v} | | |")
            continue
        served = not name.startswith("BM_InProcessForward") and "Floor" not in name
        over = f"{v - base:+.0f} µs" if isinstance(base, float) and served else ""
        over_idle = f"{v - idle_base:+.0f} µs" if isinstance(idle_base, float) and served else ""
        print(f"| {name} | {batch} | {v:.0f} | {over} | {over_idle} |")
else:
    print("overhead benchmark did not produce results")
print()

print("### Lifecycle (encoder, --initial-state warm, control socket)\n")
print("| run | spawn → WARM ms | runtime load_time ms | Promote RPC ms | Promote → first served ms | inference while WARM |")
print("|---:|---:|---:|---:|---:|---|")
warm, served = [], []
for path in sorted(glob.glob(f"{res}/lifecycle-*.json")):
    r = load(path)
    i = path.rsplit("-", 1)[1].split(".")[0]
    if r is None or "error" in r:
        print(f"| {i} | failed: {(r or {}).get('error', 'no output')} | | | | |")
        continue
    warm.append(r["spawn_to_state_ms"])
    served.append(r["promote_to_first_ok_ms"])
    print(f"| {i} | {r['spawn_to_state_ms']:.0f} | {r['load_time_ms']:.0f} | "
          f"{r['promote_rpc_ms']:.2f} | {r['promote_to_first_ok_ms']:.2f} | "
          f"{r.get('infer_before_promote', '')} |")
if warm:
    print(f"| median | {statistics.median(warm):.0f} | | | {statistics.median(served):.2f} | |")
print()
print(f"Demo client: kiln gRPC vs kiln REST **{demo_kiln}**; kiln gRPC vs FastAPI REST (same "
      f"model, tolerance 1e-5) **{demo_cross}**.")
EOF
log "results: $RESULTS_DIR/results.md"
