#!/usr/bin/env bash
# kiln-agent on a real GPU host (NVML, no --fake-gpus), from the repository root:
#
#   BUILD_DIR=build-gpu OUT=/tmp/out bench/gpu/agent_power.sh
#
# 1. the GPU's draw with nothing of kiln's on it (nvidia-smi, SAMPLE_S seconds);
# 2. per run and mode: the agent runs one WARM replica of the demo encoder on GPU 0, then
#    the GPU's draw is sampled while it idles there, then the replica is promoted (assignment
#    file changed, SIGHUP) and the first inference it answers is timed; then a short closed
#    loop measures what the promoted replica serves at. Modes: `park` (--gpu-power dry-run:
#    the WARM replica runs with CUDA_DISABLE_PERF_BOOST=1, and warms up once on promotion;
#    no card setting is changed, the dry-run only logs its plan) and `noPark` (--gpu-power
#    off: nothing parked);
# 3. the cold baseline: the same replica added SERVING to an agent that has none (spawn,
#    CUDA context, load, warm-up, promote).
# The agent's log (its NVML discovery and power plan included) and /metrics are kept in OUT.
# Never changes a card setting. Not a test.
#
# Environment: BUILD_DIR (build-gpu), MODELS_DIR ($BUILD_DIR/models), OUT (/tmp/kiln-gpu-out),
# RUNS (2), SETTLE_S (5), SAMPLE_S (8), CPUS (2, the replica's), RESERVED (2, the agent's CPUs), AGENT_ARGS (more agent flags;
# `--fake-gpus 1:16Gi` tries the script on a machine without a GPU: no watts, nothing parked).
set -uo pipefail
# shellcheck source=bench/gpu/paths.sh
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
RUNS=${RUNS:-2}
SETTLE_S=${SETTLE_S:-5}
SAMPLE_S=${SAMPLE_S:-8}
CPUS=${CPUS:-2}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/kagp.XXXXXX)
AGENT_PID=""
cleanup() {
  if [ -n "$AGENT_PID" ]; then kill -TERM "$AGENT_PID" 2>/dev/null; wait "$AGENT_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
log() { printf '[agent-power %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/agent_power.txt" >&2; }
ms_now() { date +%s%3N; }

BODY='{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,4],"data":[1,2,3,4]},{"name":"attention_mask","datatype":"INT64","shape":[1,4],"data":[1,1,1,1]}]}'

# Mean, min and max watts of GPU 0 over $1 seconds (nvidia-smi every 250 ms); also kept raw.
sample_watts() {
  local name=$1 secs=$2 raw="$OUT/watts-$1.csv"
  if ! command -v nvidia-smi >/dev/null; then sleep "$secs"; echo "no nvidia-smi"; return; fi
  timeout "$secs" nvidia-smi -i 0 --query-gpu=timestamp,power.draw,clocks.sm,pstate,utilization.gpu,memory.used \
    --format=csv,noheader,nounits -lms 250 >"$raw" 2>&1
  awk -F', ' '$2+0>0 {n++; s+=$2; if (min==""||$2<min) min=$2; if ($2>max) max=$2; c+=$3}
    END {if (n) printf "%.1f W mean (%.1f-%.1f, %d samples), SM %.0f MHz mean", s/n, min, max, n, c/n; else print "no samples"}' "$raw"
}

replica_field() {  # $1 id, $2 field, $3 admin port: prints the field when the replica is in state $4
  curl -s "127.0.0.1:$3/v1/replicas" | python3 -c "
import json,sys
for r in json.load(sys.stdin)['replicas']:
    if r['id']=='$1' and r['state']=='$4': print(r['$2'])" 2>/dev/null
}

wait_state() {  # $1 id, $2 state, $3 admin port; bounded to 120 s
  local deadline=$(( $(date +%s) + 120 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ -n "$(replica_field "$1" id "$3" "$2")" ] && return 0
    kill -0 "$AGENT_PID" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# $1 id, $2 admin port, $3 the replica's REST port if known (a WARM replica's, taken before the
# SIGHUP: then only the inference is polled): ms timestamp of the first inference it answers.
first_answer() {
  local deadline=$(( $(date +%s) + 120 )) port=${3:-}
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ -n "${3:-}" ] || port=$(replica_field "$1" http_port "$2" SERVING)
    if [ -n "$port" ] && [ "$port" != 0 ] && [ "$(curl -s -o /dev/null -w '%{http_code}' -X POST \
        "127.0.0.1:$port/v2/models/encoder/infer" -d "$BODY")" = 200 ]; then
      ms_now; return 0
    fi
    sleep 0.002
  done
  echo timeout; return 1
}

agent_ms() {  # the agent's own log: SIGHUP received -> replica $2 promoted to SERVING
  python3 - "$1" "$2" <<'PY'
import re, sys, datetime
t = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) ", line)
    if not m:
        continue
    try:
        ts = datetime.datetime.fromisoformat(m.group(1))
    except ValueError:
        continue
    if "SIGHUP: reloading" in line: t["hup"] = ts
    if f"replica {sys.argv[2]}: promoted to SERVING" in line: t["up"] = ts
print(int((t["up"] - t["hup"]).total_seconds() * 1000) if len(t) == 2 else -1)
PY
}

write_assignment() {  # $1 state, or "none"
  if [ "$1" = none ]; then echo "replicas: []"; else
    echo "replicas:"
    echo "  - {id: w, model: encoder, version: \"2\", repository: $MODELS, gpu: 0, cpus: $CPUS, state: $1}"
  fi >"$WORK/a.yaml"
}

start_agent() {  # $1 --gpu-power mode, $2 log name
  rm -rf "$WORK/s"
  "$BUILD/agent/kiln-agent" --assignment-file "$WORK/a.yaml" --state-dir "$WORK/s" \
    --runtime-binary "$BUILD/runtime/kiln-runtime" --admin-bind 127.0.0.1 --admin-port 0 \
    --ingress-bind 127.0.0.1 --grpc-port 0 --http-port 0 --reserved-cpus "${RESERVED:-2}" --tick-ms 10 \
    --gpu-power "$1" --stop-replicas-on-exit ${AGENT_ARGS:-} >"$OUT/agent-$2.log" 2>&1 &
  AGENT_PID=$!
  for _ in $(seq 1 600); do grep -q "admin_port=" "$OUT/agent-$2.log" && break; sleep 0.05; done
  ADMIN=$(grep -o "admin_port=[0-9]*" "$OUT/agent-$2.log" | head -1 | cut -d= -f2)
}

stop_agent() {
  kill -TERM "$AGENT_PID" 2>/dev/null
  for _ in $(seq 1 300); do kill -0 "$AGENT_PID" 2>/dev/null || break; sleep 0.05; done
  kill -KILL "$AGENT_PID" 2>/dev/null
  wait "$AGENT_PID" 2>/dev/null
  AGENT_PID=""
}

served() {  # $1 admin port: closed loop, one in flight, against replica w's gRPC port
  local port
  port=$(replica_field w grpc_port "$1" SERVING)
  "$BUILD/bench/kiln-loadgen" --target grpc --raw --mode closed --concurrency 1 --seq-len 16 \
    --duration-s 3 --warmup-s 0 --address "127.0.0.1:$port" 2>&1 |
    grep -E "latency ms:|throughput:" | tr -s ' ' | tr '\n' ' '
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total,power.limit,power.min_limit,power.max_limit,persistence_mode,pstate \
  --format=csv >"$OUT/gpu_identity.csv" 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$OUT/gpu_apps_before.csv" 2>&1
log "GPU: $(tail -1 "$OUT/gpu_identity.csv" 2>/dev/null)"
log "nothing of kiln's on the GPU: $(sample_watts bare "$SAMPLE_S")"

for i in $(seq 1 "$RUNS"); do
  for mode in park noPark; do
    power=dry-run; [ "$mode" = noPark ] && power=off
    name="$mode-$i"
    write_assignment WARM
    start_agent "$power" "$name"
    if ! wait_state w WARM "$ADMIN"; then
      log "$name: the replica never reached WARM"; tail -20 "$OUT/agent-$name.log" >&2; stop_agent; continue
    fi
    if [ "$i" = 1 ]; then
      # The agent's own NVML telemetry, beside nvidia-smi's figures.
      curl -s "127.0.0.1:$ADMIN/metrics" >"$OUT/metrics-$mode.txt"
      log "$name: agent's GPU metrics: $(grep -E '^kiln_gpu_' "$OUT/metrics-$mode.txt" | sed 's/{[^}]*}//' | tr '\n' ' ')"
    fi
    sleep "$SETTLE_S"
    watts=$(sample_watts "$name" "$SAMPLE_S")
    rest=$(replica_field w http_port "$ADMIN" WARM)
    write_assignment SERVING
    t0=$(ms_now)
    kill -HUP "$AGENT_PID"
    t1=$(first_answer w "$ADMIN" "$rest")
    ams=$(agent_ms "$OUT/agent-$name.log" w)
    out="-1"; [ "$t1" != timeout ] && out=$(( t1 - t0 ))
    log "$name: WARM idle $watts; promote: agent log ${ams} ms, SIGHUP -> first answer ${out} ms; served after: $(served "$ADMIN")"
    [ "$i" = 1 ] && curl -s "127.0.0.1:$ADMIN/metrics" >"$OUT/metrics-$mode-serving.txt"
    stop_agent
  done
  # Cold: nothing running, then the replica asked for SERVING.
  write_assignment none
  start_agent off "cold-$i"
  for _ in $(seq 1 600); do grep -q "serving the assignment" "$OUT/agent-cold-$i.log" && break; sleep 0.05; done
  write_assignment SERVING
  t0=$(ms_now)
  kill -HUP "$AGENT_PID"
  t1=$(first_answer w "$ADMIN")
  ams=$(agent_ms "$OUT/agent-cold-$i.log" w)
  out="-1"; [ "$t1" != timeout ] && out=$(( t1 - t0 ))
  log "cold-$i: spawn -> promoted: agent log ${ams} ms, SIGHUP -> first answer ${out} ms"
  stop_agent
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >"$OUT/gpu_apps_after.csv" 2>&1
log "done"
