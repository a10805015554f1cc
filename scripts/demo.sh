#!/usr/bin/env bash
# The kiln demo: installs what is missing, builds, generates the demo model, starts
# kiln-runtime on it (gRPC and REST on free loopback ports, a control socket), and sends
# real requests through both protocols, printing results and latencies.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh

work=$(mktemp -d /tmp/kiln-demo.XXXXXX)
runtime_pid=""
cleanup() {
  if [ -n "$runtime_pid" ] && kill -0 "$runtime_pid" 2>/dev/null; then
    kill -TERM "$runtime_pid" 2>/dev/null || true
    wait "$runtime_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== starting kiln-runtime on the demo model (build/models/encoder)"
build/runtime/kiln-runtime --model-repository build/models --model encoder \
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
