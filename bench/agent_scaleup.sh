#!/usr/bin/env bash
# Scale-up latency at the agent, warm (promote a WARM replica) vs pre-started (hand a
# pre-started runtime the replica: load, warm up, promote) vs cold (spawn, load, warm up,
# promote), for the demo encoder. Two figures per run: from the agent's own log, SIGHUP
# received -> the replica promoted to SERVING; and from outside, SIGHUP sent -> the first
# inference the new replica answers (polled with curl; includes the polling). Not a test.
#   bench/agent_scaleup.sh [RUNS]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
RUNS=${1:-5}
WORK=$(mktemp -d /tmp/ksu.XXXXXX)
AGENT_PID=""
cleanup() {
  if [ -n "$AGENT_PID" ]; then kill -TERM "$AGENT_PID" 2>/dev/null || true; wait "$AGENT_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
REPO=${MODELS_DIR:-$BUILD/models}

replica() { echo "  - {id: $1, model: encoder, version: \"2\", repository: $REPO, cpus: 1, state: $2}"; }

ms_now() { date +%s%3N; }

BODY='{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,4],"data":[1,2,3,4]},{"name":"attention_mask","datatype":"INT64","shape":[1,4],"data":[1,1,1,1]}]}'

# Waits (bounded) until replica $1 answers an inference on its own REST port; prints the time.
first_answer() {
  local id=$1 admin=$2 deadline=$(( $(date +%s) + 60 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    local port
    port=$(curl -s "127.0.0.1:$admin/v1/replicas" | python3 -c "
import json,sys
for r in json.load(sys.stdin)['replicas']:
    if r['id']=='$id' and r['state']=='SERVING' and r['http_port']: print(r['http_port'])" 2>/dev/null || true)
    if [ -n "$port" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' -X POST \
        "127.0.0.1:$port/v2/models/encoder/infer" -d "$BODY")" = 200 ]; then
      ms_now; return 0
    fi
    sleep 0.002
  done
  echo "timeout"; return 1
}

run() {  # $1 = warm|prestarted|cold
  local kind=$1
  local pool=()
  [ "$kind" = prestarted ] && pool=(--prestart-cpu 1)
  rm -rf "$WORK/s"
  { echo "replicas:"; replica s0 SERVING; [ "$kind" = warm ] && replica extra WARM; } > "$WORK/a.yaml"
  "$BUILD/agent/kiln-agent" --assignment-file "$WORK/a.yaml" --state-dir "$WORK/s" \
    --runtime-binary "$BUILD/runtime/kiln-runtime" --admin-bind 127.0.0.1 --admin-port 0 \
    --ingress-bind 127.0.0.1 --grpc-port 0 --http-port 0 --reserved-cpus 0 --tick-ms 10 \
    --stop-replicas-on-exit "${pool[@]}" > "$WORK/agent.log" 2>&1 &
  AGENT_PID=$!
  for _ in $(seq 1 600); do grep -q "serving the assignment" "$WORK/agent.log" && break; sleep 0.05; done
  if [ "$kind" = prestarted ]; then
    for _ in $(seq 1 600); do grep -q "pre-started runtime prestart-1: ready" "$WORK/agent.log" && break; sleep 0.05; done
  fi
  local admin
  admin=$(grep -o "admin_port=[0-9]*" "$WORK/agent.log" | cut -d= -f2)
  { echo "replicas:"; replica s0 SERVING; replica extra SERVING; } > "$WORK/a.yaml"
  local t0
  t0=$(ms_now)
  kill -HUP "$AGENT_PID"
  local t1
  t1=$(first_answer extra "$admin")
  local agent_ms
  agent_ms=$(python3 - "$WORK/agent.log" <<'PY'
import re, sys, datetime
t = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) ", line)
    if not m:
        continue
    ts = datetime.datetime.fromisoformat(m.group(1))
    if "SIGHUP: reloading" in line: t["hup"] = ts
    if "replica extra: promoted to SERVING" in line: t["up"] = ts
print(int((t["up"] - t["hup"]).total_seconds() * 1000) if len(t) == 2 else -1)
PY
)
  echo "$agent_ms/$(( t1 - t0 ))"
  kill -TERM "$AGENT_PID"; wait "$AGENT_PID" 2>/dev/null || true; AGENT_PID=""
}

for kind in warm prestarted cold; do
  results=()
  for _ in $(seq 1 "$RUNS"); do results+=("$(run "$kind")"); done
  sorted=$(printf '%s\n' "${results[@]}" | sort -n | tr '\n' ' ')
  echo "$kind scale-up ms (agent log: SIGHUP -> SERVING / outside: SIGHUP -> first answer): $sorted"
done
