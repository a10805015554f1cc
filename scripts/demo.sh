#!/usr/bin/env bash
# The kiln demo: installs what is missing, builds, generates the demo model, starts
# kiln-runtime on it (gRPC and REST on free loopback ports, a control socket), and sends
# real requests through both protocols, printing results and latencies. Then a local cluster:
# kiln-controller (SQLite store), two kiln-agents with fake GPUs, a ModelDeployment applied
# with kilnctl, requests through a node's router, a scale-up served from the warm pool, and a
# canary rollout v1 -> v2 under live traffic.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh

work=$(mktemp -d /tmp/kiln-demo.XXXXXX)
runtime_pid=""
cluster_pids=()
cleanup() {
  if [ -n "$runtime_pid" ] && kill -0 "$runtime_pid" 2>/dev/null; then
    kill -TERM "$runtime_pid" 2>/dev/null || true
    wait "$runtime_pid" 2>/dev/null || true
  fi
  # Agents first (they drain and stop their replicas), the controller last.
  for pid in "${cluster_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${cluster_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

echo "== starting kiln-runtime on the demo model (build/models/encoder)"
# As kiln-agent starts a replica: malloc's heap on transparent huge pages.
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 build/runtime/kiln-runtime --model-repository build/models --model encoder \
  --grpc-port 0 --http-port 0 --bind-address 127.0.0.1 \
  --control-socket "$work/control.sock" >"$work/runtime.log" 2>&1 &
runtime_pid=$!

# Bounded wait for the ports line and SERVING.
for _ in $(seq 1 300); do
  if grep -q "WARM -> SERVING" "$work/runtime.log" 2>/dev/null; then break; fi
  if ! kill -0 "$runtime_pid" 2>/dev/null; then
    cat "$work/runtime.log"; echo "kiln-runtime exited"; exit 1
  fi
  sleep 0.1
done
cat "$work/runtime.log"
grpc_port=$(grep -o 'grpc_port=[0-9]*' "$work/runtime.log" | head -1 | cut -d= -f2)
http_port=$(grep -o 'http_port=[0-9]*' "$work/runtime.log" | head -1 | cut -d= -f2)
if [ -z "$grpc_port" ] || [ -z "$http_port" ]; then echo "no ports reported"; exit 1; fi

echo
echo "== REST: curl http://127.0.0.1:$http_port/v2/models/encoder"
curl -s "http://127.0.0.1:$http_port/v2/models/encoder"; echo
echo
echo "== requests through gRPC and REST"
build/examples/kiln-demo-client --grpc "127.0.0.1:$grpc_port" --http "127.0.0.1:$http_port" \
  --model encoder
echo
echo "== stopping (SIGTERM drains, then exits)"
kill -TERM "$runtime_pid"; wait "$runtime_pid" || true; runtime_pid=""
tail -3 "$work/runtime.log"

echo
echo "== a local cluster: kiln-controller, two kiln-agents (fake GPUs), kilnctl"
ctl() { build/controller/kilnctl --server "http://127.0.0.1:$admin_port" "$@"; }
# Bounded wait for "KEY<number>" in a log; prints the number.
wait_number() {
  local n
  for _ in $(seq 1 300); do
    n=$(grep -o "$2[0-9]*" "$1" 2>/dev/null | head -1 | grep -o '[0-9]*$' || true)
    if [ -n "$n" ]; then echo "$n"; return 0; fi
    sleep 0.1
  done
  cat "$1" >&2; echo "timed out waiting for '$2' in $1" >&2; return 1
}
build/controller/kiln-controller --state-dir "$work/controller" --admin-port 0 \
  --listen 127.0.0.1:0 --observe-seconds 0.5 >"$work/controller.log" 2>&1 &
cluster_pids+=($!)
admin_port=$(wait_number "$work/controller.log" "admin=http://127.0.0.1:")
control_port=$(wait_number "$work/controller.log" "control=127.0.0.1:")
for node in n1 n2; do
  build/agent/kiln-agent --controller "127.0.0.1:$control_port" --node-name "$node" \
    --state-dir "$work/$node" --runtime-binary "$PWD/build/runtime/kiln-runtime" \
    --admin-bind 127.0.0.1 --admin-port 0 --fake-gpus 1:16Gi --reserved-cpus 0 \
    --ingress-bind 127.0.0.1 --grpc-port 0 --http-port 0 --stop-replicas-on-exit \
    >"$work/$node.log" 2>&1 &
  cluster_pids=($! "${cluster_pids[@]}")
done
router_grpc=$(wait_number "$work/n1.log" "router listening grpc_port=")
router_http=$(wait_number "$work/n1.log" "router listening grpc_port=[0-9]* http_port=")
printf '%s\n' "apiVersion: serving.kiln.dev/v1alpha1" "kind: ModelDeployment" \
  "metadata: {name: encoder}" "spec:" \
  "  model: {name: encoder, version: \"1\", uri: \"file://$PWD/build/models/encoder/1/model.pt\"}" \
  "  replicas: 1" "  warmPool: 2" "  resources: {gpus: 1, gpuMemory: 2Gi, cpus: 1}" \
  >"$work/encoder.yaml"
echo "\$ kilnctl apply -f encoder.yaml"
ctl apply -f "$work/encoder.yaml"
# Bounded wait until N replicas serve; prints how long it took.
wait_ready() {
  local t0 t1
  t0=$(date +%s%N)
  for _ in $(seq 1 600); do
    if ctl get deploy encoder -o json | grep -q "\"readyReplicas\": $1,"; then
      t1=$(date +%s%N)
      echo "$(( (t1 - t0) / 1000000 )) ms"
      return 0
    fi
    sleep 0.05
  done
  echo "timed out waiting for $1 ready replica(s)" >&2; return 1
}
echo "cold start: $(wait_ready 1) from apply to 1 ready replica as the controller sees it"
echo "  (spawn, load, warm-up and promote, plus up to a second for the agent's next report)"
sleep 1  # the warm-pool replica finishes loading
echo "\$ kilnctl get nodes"
ctl get nodes
echo
echo "== requests through node n1's router (to a replica on either node)"
build/examples/kiln-demo-client --grpc "127.0.0.1:$router_grpc" --http "127.0.0.1:$router_http" \
  --model encoder
echo
echo "\$ kilnctl scale encoder --replicas 3    (both warm replicas are promoted)"
ctl scale encoder --replicas 3
echo "scale-up from the warm pool: $(wait_ready 3) from scale to 3 ready as the controller sees it"
grep -h "promoted to SERVING" "$work"/n*.log | tail -2
echo "  (the promote itself is milliseconds; the rest is the agent's 1 s report period)"
echo "\$ kilnctl get deployments -o wide"
ctl get deployments -o wide
echo "\$ kilnctl get nodes"
ctl get nodes
echo
echo "== a canary rollout, version 1 -> 2, under live traffic"
sed -e 's#/encoder/1/model.pt#/encoder/2/model.pt#' -e 's/version: "1"/version: "2"/' \
  -e 's/replicas: 1/replicas: 3/' -e 's/warmPool: 2/warmPool: 0/' "$work/encoder.yaml" \
  >"$work/encoder-v2.yaml"
printf '%s\n' "  rollout:" "    steps: [{weight: 33, pause: 3s}]" \
  "    analysis: {minRequests: 50, maxErrorRate: 0.01, maxLatencyP99Ratio: 3}" \
  >>"$work/encoder-v2.yaml"
build/bench/kiln-loadgen --target grpc --raw --address "127.0.0.1:$router_grpc" \
  --model encoder --mode closed --concurrency 2 --seq-len 16 --warmup-s 0 --duration-s 12 \
  >"$work/loadgen.txt" 2>&1 &
loadgen_pid=$!
sleep 1
echo "\$ kilnctl apply -f encoder-v2.yaml"
ctl apply -f "$work/encoder-v2.yaml"
echo "\$ kilnctl rollout status encoder -w"
ctl rollout status encoder -w --timeout-seconds 60 || true
grep -h "rollout encoder" "$work/controller.log" | sed 's/^.*\] //'
wait "$loadgen_pid" || true
echo "traffic during the rollout (kiln-loadgen through node n1's router):"
grep -E "requests:|throughput:|latency" "$work/loadgen.txt"
echo "\$ kilnctl get deployments -o wide"
ctl get deployments -o wide
echo "\$ kilnctl describe deployment encoder"
ctl describe deployment encoder

echo
echo "== stopping the cluster (agents drain their replicas, then the controller stops)"
