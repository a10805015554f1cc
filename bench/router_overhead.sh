#!/usr/bin/env bash
# What the agent's router adds to a gRPC inference: one SERVING replica of the demo encoder
# (no dynamic batching) under a kiln-agent, and kiln-loadgen (closed loop, one request in
# flight, raw tensors) run alternately against the replica's own gRPC port (the baseline) and
# the router's, ROUNDS times each. Prints one line per run. Not a test.
#   bench/router_overhead.sh [ROUNDS]          (BUILD_DIR: the build to run, default build/)
# AGENT_ARGS: more kiln-agent flags (say --router-busy-poll-us 1000). Each router line also gives
# the agent's CPU time over that run (user+system, ms) and its threads' context switches. PROTOCOL=rest: REST JSON instead of gRPC
# raw, against the replica's and the router's REST ports. CONCURRENCY=N: N requests in flight
# (default 1); BATCHING=1: the demo config's dynamic batching left on.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
MODELS=${MODELS_DIR:-$ROOT/build/models}
ROUNDS=${1:-2}
PROTOCOL=${PROTOCOL:-grpc}
case "$PROTOCOL" in
  grpc) PORT_FIELD=grpc_port LOAD_ARGS=(--target grpc --raw) ;;
  rest) PORT_FIELD=http_port LOAD_ARGS=(--target rest) ;;
  *) echo "PROTOCOL: grpc or rest, got '$PROTOCOL'" >&2; exit 2 ;;
esac
DURATION_S=${DURATION_S:-5}
CONCURRENCY=${CONCURRENCY:-1}
BATCHING=${BATCHING:-0}
WORK=$(mktemp -d /tmp/krouter.XXXXXX)
AGENT_PID=""
cleanup() {
  if [ -n "$AGENT_PID" ]; then kill -TERM "$AGENT_PID" 2>/dev/null || true; wait "$AGENT_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# The encoder without dynamic batching: each request runs as it comes.
mkdir -p "$WORK/repo/encoder/1"
ln -s "$MODELS/encoder/1/model.pt" "$WORK/repo/encoder/1/model.pt"
if [ "$BATCHING" = 1 ]; then
  cp "$MODELS/encoder/config.yaml" "$WORK/repo/encoder/config.yaml"
else
  python3 "$ROOT/bench/config_variant.py" "$MODELS/encoder/config.yaml" \
    "$WORK/repo/encoder/config.yaml" --no-batching
fi
cat > "$WORK/a.yaml" <<EOF
replicas:
  - {id: r0, model: encoder, version: "1", repository: $WORK/repo, cpus: 1, state: SERVING}
EOF
"$BUILD/agent/kiln-agent" --assignment-file "$WORK/a.yaml" --state-dir "$WORK/s" \
  --runtime-binary "$BUILD/runtime/kiln-runtime" --admin-bind 127.0.0.1 --admin-port 0 \
  --ingress-bind 127.0.0.1 --grpc-port 0 --http-port 0 --reserved-cpus 0 \
  --stop-replicas-on-exit ${AGENT_ARGS:-} > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
for _ in $(seq 1 600); do grep -q "serving the assignment" "$WORK/agent.log" && break; sleep 0.05; done
if [ "$PROTOCOL" = rest ]; then
  ROUTER=$(grep -o "router listening grpc_port=[0-9]* http_port=[0-9]*" "$WORK/agent.log" | grep -o "[0-9]*$")
else
  ROUTER=$(grep -o "router listening grpc_port=[0-9]*" "$WORK/agent.log" | grep -o "[0-9]*$")
fi
ADMIN=$(grep -o "admin_port=[0-9]*" "$WORK/agent.log" | grep -o "[0-9]*$" | head -1)
REPLICA=""
for _ in $(seq 1 600); do
  REPLICA=$(curl -s "127.0.0.1:$ADMIN/v1/replicas" | python3 -c "
import json,sys
for r in json.load(sys.stdin)['replicas']:
    if r['state']=='SERVING' and r['healthy'] and r['grpc_port']: print(r['$PORT_FIELD'])" 2>/dev/null || true)
  [ -n "$REPLICA" ] && break
  sleep 0.05
done
[ -n "$REPLICA" ] && [ -n "$ROUTER" ] || { echo "the replica never served"; cat "$WORK/agent.log"; exit 1; }
echo "replica $PROTOCOL port $REPLICA, router $PROTOCOL port $ROUTER"
load() {
  "$BUILD/bench/kiln-loadgen" "${LOAD_ARGS[@]}" --mode closed --concurrency "$CONCURRENCY" --seq-len 16 \
    --duration-s "$DURATION_S" --warmup-s 1 --address "127.0.0.1:$1" 2>&1 |
    grep -E "requests:|throughput:|latency ms:" | tr -s ' ' | tr '\n' ' '
}
# Context switches of all the agent's threads so far (voluntary + involuntary): each is a
# sleep and a wake-up, what the router's latency on a small VM is mostly made of.
agent_switches() {
  cat /proc/"$AGENT_PID"/task/*/status 2>/dev/null |
    awk '/ctxt_switches/ {n += $2} END {print n}'
}
# The agent's CPU time so far, ms (utime + stime, clock ticks).
agent_cpu_ms() {
  awk -v hz="$(getconf CLK_TCK)" '{print int(($14 + $15) * 1000 / hz)}' "/proc/$AGENT_PID/stat"
}
for i in $(seq 1 "$ROUNDS"); do
  echo "direct $i: $(load "$REPLICA")"
  before=$(agent_cpu_ms)
  switches=$(agent_switches)
  line=$(load "$ROUTER")
  echo "router $i: $line agent cpu ms: $(( $(agent_cpu_ms) - before )) agent switches: $(( $(agent_switches) - switches ))"
done
