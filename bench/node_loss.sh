#!/usr/bin/env bash
# The decision after a node loss, end to end: a fresh kiln-controller (SQLite store) and
# kiln-canary-sim --lose-nodes K with N simulated agents; from the end of the lost nodes' lease
# to the first (and the last) Assignment that places their replicas on other nodes. Then the
# controller's own kiln_controller_node_loss_decision_seconds from /metrics.
#
#   bench/node_loss.sh [NODES] [LOSE] [RUNS]      (defaults 1000 5 3)
#
# LOSE=0 measures a bad canary's rollback instead (kiln-canary-sim without --lose-nodes): five
# deployments rolled to version 2 one after the other, each failing half its requests after
# CLEAN_S (default 10) seconds of clean serving; from the first failing report to the first
# routing table without version 2.
#   BUILD_DIR=...   a build with kiln-controller and kiln-canary-sim (default ./build)
#   CONTROLLER_BUILD=...  another build's kiln-controller (a baseline), the simulator kept
#   KEEP_LOGS=DIR   keep each run's controller log there (DIR/controller-RUN.log)
#   LOST_S, NOT_READY_S  the controller's leases (defaults 15 and 5 s)
set -euo pipefail
cd "$(dirname "$0")/.."
NODES="${1:-1000}"
LOSE="${2:-5}"
RUNS="${3:-3}"
BUILD_DIR="${BUILD_DIR:-build}"
CONTROLLER_BUILD="${CONTROLLER_BUILD:-$BUILD_DIR}"
# Leases well above the simulator's 1 s report period (a NotReady lease of 1 s kept every node
# at its edge), short enough for a quick run.
LOST_S="${LOST_S:-15}"
NOT_READY_S="${NOT_READY_S:-5}"
for run in $(seq 1 "$RUNS"); do
  dir="$(mktemp -d)"
  port=$((17100 + run))
  "$CONTROLLER_BUILD/controller/kiln-controller" --state-dir "$dir" --admin-port 0 \
    --listen "127.0.0.1:$port" --observe-seconds 0 --node-not-ready-seconds "$NOT_READY_S" \
    --node-lost-seconds "$LOST_S" > "$dir/log" 2>&1 &
  pid=$!
  trap 'kill "$pid" 2>/dev/null || true' EXIT  # also when this script is cut short
  admin=""
  for _ in $(seq 1 200); do
    admin="$(grep -o 'admin=http://[0-9.:]*' "$dir/log" | head -1 | cut -d= -f2 || true)"
    [ -n "$admin" ] && break
    sleep 0.05
  done
  if [ -z "$admin" ]; then
    cat "$dir/log"
    kill "$pid"
    exit 1
  fi
  rc=0  # a run the simulator finds not valid still has its logs kept
  "$BUILD_DIR/bench/kiln-canary-sim" --controller "127.0.0.1:$port" --admin "$admin" \
    --nodes "$NODES" --replicas-per-node 5 --samples 5 --lose-nodes "$LOSE" \
    --node-lost-seconds "$LOST_S" --clean-seconds "${CLEAN_S:-10}" --timeout-seconds 60 \
    | tee "$dir/sim.json" || rc=$?
  curl -s "$admin/metrics" | grep -E '^kiln_controller_(node_loss_decision_seconds|loop_duration_seconds)_(sum|count)|^kiln_controller_rollbacks_total' || true
  grep -E 'lost: its replicas' "$dir/log" | head -"$LOSE" || true
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  trap - EXIT
  if [ -n "${KEEP_LOGS:-}" ]; then mkdir -p "$KEEP_LOGS" && cp "$dir/log" "$KEEP_LOGS/controller-$run.log"; fi
  rm -rf "$dir"
  [ "$rc" -eq 0 ] || exit "$rc"
done
