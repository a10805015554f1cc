#!/usr/bin/env bash
# What a router adds when it sends a call on to another node's router: agent A serves one
# SERVING replica of the demo encoder (no dynamic batching); agent B has no replica and routes
# the model to A's router (an assignment file's route endpoint, as the controller's routing
# table does across nodes). kiln-loadgen (closed loop, one request in flight) runs alternately
# against A's router (the baseline) and B's, ROUNDS times each. Prints one line per run. Not a
# test.
#   bench/router_forward.sh [ROUNDS]     (BUILD_DIR: the build, default build/; AGENT_B: another
#                                         kiln-agent binary for B, to compare builds)
# PROTOCOL=grpc (raw tensors, default) or rest (JSON).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
MODELS=${MODELS_DIR:-$ROOT/build/models}
AGENT_B=${AGENT_B:-$BUILD/agent/kiln-agent}
ROUNDS=${1:-2}
PROTOCOL=${PROTOCOL:-grpc}
DURATION_S=${DURATION_S:-5}
case "$PROTOCOL" in
  grpc) LOAD_ARGS=(--target grpc --raw) ;;
  rest) LOAD_ARGS=(--target rest) ;;
  *) echo "PROTOCOL: grpc or rest, got '$PROTOCOL'" >&2; exit 2 ;;
esac
WORK=$(mktemp -d /tmp/kforward.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/repo/encoder/1"
ln -s "$MODELS/encoder/1/model.pt" "$WORK/repo/encoder/1/model.pt"
python3 "$ROOT/bench/config_variant.py" "$MODELS/encoder/config.yaml" \
  "$WORK/repo/encoder/config.yaml" --no-batching

# start NAME BINARY: an agent on free ports, its assignment in $WORK/NAME.yaml.
start() {
  "$2" --assignment-file "$WORK/$1.yaml" --state-dir "$WORK/$1-state" --node-name "$1" \
    --runtime-binary "$BUILD/runtime/kiln-runtime" --admin-bind 127.0.0.1 --admin-port 0 \
    --ingress-bind 127.0.0.1 --grpc-port 0 --http-port 0 --reserved-cpus 0 \
    --stop-replicas-on-exit > "$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 600); do grep -q "router listening" "$WORK/$1.log" && return; sleep 0.05; done
  echo "agent $1 never listened"; cat "$WORK/$1.log"; exit 1
}
port_of() { grep -o "router listening grpc_port=[0-9]* http_port=[0-9]*" "$WORK/$1.log" | grep -o "$2=[0-9]*" | grep -o "[0-9]*$"; }

cat > "$WORK/a.yaml" <<YAML
replicas:
  - {id: r0, model: encoder, version: "1", repository: $WORK/repo, cpus: 1, state: SERVING}
YAML
start a "$BUILD/agent/kiln-agent"
A_GRPC=$(port_of a grpc_port)
A_HTTP=$(port_of a http_port)
cat > "$WORK/b.yaml" <<YAML
replicas: []
routes:
  - model: encoder
    versions: [{version: "1", weight: 1}]
    endpoints: [{node: a, version: "1", grpc: "127.0.0.1:$A_GRPC", http: "127.0.0.1:$A_HTTP"}]
YAML
start b "$AGENT_B"
if [ "$PROTOCOL" = rest ]; then A=$A_HTTP B=$(port_of b http_port); else A=$A_GRPC B=$(port_of b grpc_port); fi
# A serves once its replica does (SERVING and healthy), within 30 s.
ADMIN=$(grep -o "admin_port=[0-9]*" "$WORK/a.log" | grep -o "[0-9]*$" | head -1)
SERVING=""
for _ in $(seq 1 600); do
  SERVING=$(curl -s "127.0.0.1:$ADMIN/v1/replicas" | python3 -c "
import json,sys
print(any(r['state']=='SERVING' and r['healthy'] for r in json.load(sys.stdin)['replicas']))" \
    2>/dev/null || true)
  [ "$SERVING" = True ] && break
  sleep 0.05
done
[ "$SERVING" = True ] || { echo "node a's replica never served"; cat "$WORK/a.log"; exit 1; }
load() {
  "$BUILD/bench/kiln-loadgen" "${LOAD_ARGS[@]}" --mode closed --concurrency 1 --seq-len 16 \
    --duration-s "$DURATION_S" --warmup-s 1 --address "127.0.0.1:$1" 2>&1 |
    grep -E "requests:|throughput:|latency ms:" | tr -s ' ' | tr '\n' ' '
}
echo "node a router $PROTOCOL port $A, node b router $PROTOCOL port $B"
for i in $(seq 1 "$ROUNDS"); do
  echo "a (baseline) $i: $(load "$A")"
  echo "b -> a $i: $(load "$B")"
done
