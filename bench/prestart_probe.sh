#!/usr/bin/env bash
# Cold start against a pre-started runtime, side by side: spawn -> WARM for a cold
# `kiln-runtime --initial-state warm`, and Load -> WARM for a `kiln-runtime --prestart` handed the
# same command line over RuntimeControl Load; then Promote -> first served request for both.
#
#   RUNS=3 bench/prestart_probe.sh          (after scripts/build.sh; models from the build)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
RUNS=${RUNS:-3}
REPO=${MODEL_REPO:-$BUILD/models}
RUNTIME=$BUILD/runtime/kiln-runtime
PROBE=$BUILD/bench/kiln-control-probe
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kiln-prestart.XXXXXX")
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$WORK"' EXIT
for bin in "$RUNTIME" "$PROBE"; do [[ -x $bin ]] || { echo "missing $bin (build first)" >&2; exit 1; }; done
[[ -f $REPO/encoder/config.yaml ]] || { echo "no models in $REPO (build first)" >&2; exit 1; }

args() {
  echo "--model-repository $REPO --model encoder --version 1 --grpc-port 0 --http-port 0 \
--bind-address 127.0.0.1 --control-socket $1 --initial-state warm"
}
for i in $(seq 1 "$RUNS"); do
  sock=$WORK/cold$i.sock
  t0=$(date +%s%6N)
  # shellcheck disable=SC2046
  "$RUNTIME" $(args "$sock") >"$WORK/cold$i.log" 2>&1 &
  echo "cold $i $("$PROBE" --socket "$sock" --wait-state WARM --since-unix-us "$t0" --promote \
    --shutdown --json)"
  wait
  sock=$WORK/pre$i.sock
  "$RUNTIME" --prestart --control-socket "$sock" >"$WORK/pre$i.log" 2>&1 &
  for _ in $(seq 1 600); do grep -q "pre-started in" "$WORK/pre$i.log" && break; sleep 0.05; done
  grep -q "pre-started in" "$WORK/pre$i.log" || { cat "$WORK/pre$i.log" >&2; exit 1; }
  echo "prestarted $i $(grep -o 'pre-started in [0-9]* ms' "$WORK/pre$i.log") \
$("$PROBE" --socket "$sock" --load-args "$(args "$sock")" --wait-state WARM --promote \
    --shutdown --json)"
  wait
done
