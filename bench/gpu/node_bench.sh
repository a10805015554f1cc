#!/usr/bin/env bash
# The demo encoder on a lent GPU host, for the runtime's and the agent's GPU figures, from the
# repository root (.devdebs/ carried, see ../shared/device/README.md):
#
#   MODELS_DIR=.gpu-models bench/gpu/node_bench.sh   (.gpu-models: a copy of build/models, carried)
#
# The packages to carry: fetch-debs.sh's list plus what cpprestsdk's CMake file, the
# controller's allocator and their libraries need:
#   KILN_EXTRA_DEBS="libjemalloc-dev libjemalloc2 libicu72 $(for c in random thread filesystem \
#     chrono atomic date-time regex; do echo libboost-${c}1.74-dev libboost-${c}1.74.0; done)" \
#     bash .devdebs/fetch-debs.sh
#
# builds kiln-runtime, kiln-agent, kiln-loadgen, kiln-control-probe and kiln-overhead-bench
# against the host's CUDA LibTorch (build-gpu/), then runs STEPS, in the order router, power,
# cuda, scaleup, each bounded, all results and logs in OUT:
#   router  bench/router_overhead.sh: the agent's router against the replica's own port, with
#           the router's busy-polling off and on (ROUTER_WINDOWS: --router-busy-poll-us values),
#           then REST; bench/router_forward.sh: a call sent on to another node's router;
#   power   bench/gpu/agent_power.sh: NVML discovery, idle watts with a WARM replica parked
#           and not parked, promote -> first response in each case, cold start beside them;
#   cuda    bench/gpu/encoder_cuda.sh: the encoder on cuda:0 in fp32 and fp16, and the served
#           path's overhead on this host (cpu and cuda:0);
#   scaleup bench/agent_scaleup.sh: warm vs pre-started vs cold scale-up on this host's CPUs.
# MODELS_DIR: a model repository made by scripts/make_models.py (default: make one here with
# the host's python3 and torch). Environment: OUT (/tmp/kiln-gpu-out), STEPS ("build power
# cuda router"), BUDGET_S (a step that would start past it is skipped; default 560).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
START=$(date +%s)
OUT=${OUT:-/tmp/kiln-gpu-out}
STEPS=${STEPS:-build power cuda router}
BUDGET_S=${BUDGET_S:-560}
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
mkdir -p "$OUT"
log() { printf '[node-bench %s +%ss] %s\n' "$(date +%H:%M:%S)" "$(( $(date +%s) - START ))" "$*" | tee -a "$OUT/summary.txt" >&2; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.draw,power.limit --format=csv
  nproc; lscpu | grep -E "Model name|NUMA node"; uptime
} >"$OUT/host.txt" 2>&1
cat "$OUT/host.txt" >&2

if has build; then
  rm -f /opt/deps/.unpacked  # unpack again: the carried set may have grown since
  # shellcheck disable=SC1091
  source .devdebs/device-env.sh
  # The carried libsystemd-dev's libsystemd.so points at libsystemd.so.0, which is the host's.
  lib=/opt/deps/usr/lib/x86_64-linux-gnu
  for d in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu; do
    [ -e "$lib/libsystemd.so.0" ] || [ ! -e "$d/libsystemd.so.0" ] || ln -sf "$d/libsystemd.so.0" "$lib/libsystemd.so.0"
  done
  t0=$(date +%s)
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$KILN_CMAKE_PREFIX" \
    -DKILN_BUILD_TESTS=OFF -DKILN_PYTHON_TORCH="$(command -v python3)" >"$OUT/cmake.log" 2>&1 ||
    { log "CMAKE FAILED"; tail -30 "$OUT/cmake.log" >&2; exit 1; }
  log "configured in $(( $(date +%s) - t0 )) s"
  ninja -C "$BUILD" -k 0 kiln-runtime kiln-agent kiln-loadgen kiln-control-probe kiln-overhead-bench \
    >"$OUT/build.log" 2>&1 || { log "BUILD FAILED (some targets)"; grep -m 30 -E "error|Error|FAILED" "$OUT/build.log" >&2; }
  log "built in $(( $(date +%s) - t0 )) s: $(cd "$BUILD" && ls runtime/kiln-runtime agent/kiln-agent bench/kiln-loadgen bench/kiln-control-probe bench/kiln-overhead-bench 2>&1 | tr '\n' ' ')"
else
  # shellcheck disable=SC1091
  [ -f /opt/deps/.unpacked ] && source .devdebs/device-env.sh
fi

MODELS=${MODELS_DIR:-}
case "$MODELS" in ""|/*) ;; *) MODELS="$ROOT/$MODELS" ;; esac
if [ -z "$MODELS" ]; then
  MODELS=$BUILD/models
  python3 scripts/make_models.py --out "$MODELS" >"$OUT/make_models.log" 2>&1 || log "make_models failed"
fi
export BUILD_DIR=$BUILD MODELS_DIR=$MODELS OUT

step() {  # $1 name, $2 seconds it needs at least, then the command
  local name=$1 need=$2
  shift 2
  has "$name" || return 0
  if [ "$(left)" -lt "$need" ]; then log "$name: skipped, $(left) s of the budget left"; return 0; fi
  log "$name: start"
  timeout --kill-after=10 "$(left)" "$@" >"$OUT/$name.out" 2>&1
  log "$name: rc $?"
  cat "$OUT/$name.out" >&2
}
[ -x "$BUILD/agent/kiln-agent" ] || { log "no kiln-agent: power, router and scaleup skipped"; STEPS=${STEPS//power/}; STEPS=${STEPS//router/}; STEPS=${STEPS//scaleup/}; }
[ -x "$BUILD/runtime/kiln-runtime" ] || { log "no kiln-runtime: nothing to run"; exit 1; }
# The router with its busy-polling off (0) and at other windows, alternately (ROUTER_WINDOWS).
# Then REST the same way (busy-polling off), and a call sent on to another node's router.
step router 60 env ROUTER_WINDOWS="${ROUTER_WINDOWS:-0 1000 0 1000}" bash -c '
  for w in $ROUTER_WINDOWS; do
    echo "--router-busy-poll-us $w:"
    AGENT_ARGS="--router-busy-poll-us $w" DURATION_S=3 bench/router_overhead.sh 1 | grep -E "^(direct|router)"
  done
  echo "REST:"
  PROTOCOL=rest DURATION_S=3 bench/router_overhead.sh 2 | grep -E "^(direct|router)"
  echo "forwarded to another router, REST then gRPC:"
  PROTOCOL=rest DURATION_S=3 bench/router_forward.sh 1 | grep -E "^(a |b )"
  PROTOCOL=grpc DURATION_S=3 bench/router_forward.sh 1 | grep -E "^(a |b )"'
step power 90 env RUNS="${RUNS:-2}" SETTLE_S="${SETTLE_S:-4}" SAMPLE_S="${SAMPLE_S:-6}" bench/gpu/agent_power.sh
step cuda 60 env DURATION_S="${DURATION_S:-3}" BENCH_MIN_TIME="${BENCH_MIN_TIME:-0.3}" bench/gpu/encoder_cuda.sh
step scaleup 40 bench/agent_scaleup.sh 3
log "done"
