#!/usr/bin/env bash
# kiln's GPU benchmark, run on a CUDA host from the repository root (see
# ../shared/device/README.md for the carried Debian packages in .devdebs/):
#
#   bench/gpu/run_gpu_bench.sh
#
# 1. builds kiln-runtime, kiln-loadgen and kiln-control-probe against the host's CUDA LibTorch
#    (build-gpu/), while 2. bench/gpu/make_bge_m3.py builds and traces the bge-m3-shaped
#    encoder (fp16, 1.1 GB) into $MODELS;
# 3. cold start: spawn -> WARM -> Promote -> first served request, over the control socket,
#    with the runtime's own phase log (context, load, warm-up, graph capture);
# (step study) bench/gpu/attention_study.py: in-process, which attention kernel the traced
#    model runs and what each allowed set (instance.attention) costs, graphed as kiln does;
# 4. correctness: check_bge_m3.py against an fp32 reference on fresh random inputs;
# 5. the served path: batch 1 at 512 and 4096 tokens (closed loop, one in flight) and
#    128-token queries open loop at RATES, all gRPC with raw tensors; 4 and 5 once per
#    instance.attention set in ATTENTION_SETS;
# 6. the PyTorch anchors re-measured in the same run (pytorch_anchors.py);
# 7. (step aoti) the same model exported with torch.export and compiled by AOTInductor
#    (MODELS_AOTI, made by make_bge_m3.py --aoti-out in step model): one cold start, the
#    correctness check and the served path, through kiln's aotinductor backend.
#
# Environment: OUT (results dir, default /tmp/kiln-gpu-out), MODELS (/tmp/gpu-models),
# MODELS_AOTI (/tmp/gpu-models-aoti),
# RATES ("4000 4800 5600"), DURATION_S (10), BUDGET_S (seconds from the start past which no
# further study, served set or anchors step starts; one started before runs to its end;
# default no limit), STEPS ("build model cold check served anchors";
# "study" adds the attention study), ATTENTION_SETS ("default": LibTorch's choice; e.g.
# "default cudnn efficient"),
# ANCHOR_ARGS ("--compile"), RUNTIME_ARGS (extra kiln-runtime flags).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/kiln-gpu-out}
MODELS=${MODELS:-/tmp/gpu-models}
MODELS_AOTI=${MODELS_AOTI:-/tmp/gpu-models-aoti}
RATES=${RATES:-4000 4800 5600}
DURATION_S=${DURATION_S:-10}
STEPS=${STEPS:-build model cold check served anchors}
ANCHOR_ARGS=${ANCHOR_ARGS:---compile}
BUILD=$ROOT/build-gpu
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-100000}  # a served set or the anchors that would start past it are skipped
over_budget() { (($(date +%s) - START > BUDGET_S)); }
log() { printf '[gpu-bench %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/summary.txt" >&2; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap cleanup EXIT

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.draw \
  --format=csv | tee "$OUT/gpu.txt" >&2
rm -f /opt/deps/.unpacked  # unpack again: the carried set may have grown since
# shellcheck disable=SC1091
source .devdebs/device-env.sh

build_pid=
if has build; then
  (
    set -e
    t0=$(date +%s)
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$KILN_CMAKE_PREFIX" -DKILN_BUILD_TESTS=OFF \
      -DKILN_PYTHON_TORCH="$(command -v python3)" >"$OUT/cmake.log" 2>&1
    ninja -C "$BUILD" kiln-runtime kiln-loadgen kiln-control-probe >"$OUT/build.log" 2>&1
    echo "build: $(($(date +%s) - t0)) s" >>"$OUT/build.log"
  ) &
  build_pid=$!
fi
AOTI_ARGS=()
has aoti && AOTI_ARGS=(--aoti-out "$MODELS_AOTI")
if has model && [[ ! -f $MODELS/bge_m3/1/model.pt ]]; then
  log "making the model"
  python3 bench/gpu/make_bge_m3.py --out "$MODELS" "${AOTI_ARGS[@]}" 2>&1 |
    tee "$OUT/make_model.log" | tail -3 >&2
elif has model && has aoti && [[ ! -f $MODELS_AOTI/bge_m3/1/model.pt2 ]]; then
  log "exporting the AOTInductor package"
  python3 bench/gpu/make_bge_m3.py --out "$MODELS" "${AOTI_ARGS[@]}" --aoti-only 2>&1 |
    tee "$OUT/make_model.log" | tail -3 >&2
fi
[[ -f $MODELS/bge_m3/1/model.pt ]] &&
  python3 bench/gpu/make_bge_m3.py --out "$MODELS" "${AOTI_ARGS[@]}" --config-only
# $1: jit_optimize, $2: freeze, $3: warm-up iterations of the config's sample
set_jit() {
  sed -i -e "s/jit_optimize: .*/jit_optimize: $1/" -e "s/freeze: .*/freeze: $2/" \
    -e "s/batch_size: 1, iterations: [0-9]*/batch_size: 1, iterations: $3/" "$MODELS/bge_m3/config.yaml"
}
SERVE_JIT=${SERVE_JIT:-false false 1}
if [[ -n $build_pid ]]; then
  if ! wait "$build_pid"; then
    log "BUILD FAILED"
    tail -5 "$OUT/cmake.log" >&2
    grep -m 20 -E "error|Error" "$OUT/build.log" >&2
    STEPS="study anchors"
  else
    log "$(tail -1 "$OUT/build.log")"
  fi
fi

RT=$BUILD/runtime/kiln-runtime
LG=$BUILD/bench/kiln-loadgen
PROBE=$BUILD/bench/kiln-control-probe
GRPC=127.0.0.1:18001
HTTP=127.0.0.1:18000
SOCK=/tmp/kiln-gpu.sock

rt_pid=
start_runtime() {  # $1 = initial state, $2 = repository (default $MODELS)
  rm -f "$SOCK"
  T0=$(date +%s%6N)
  # shellcheck disable=SC2086
  "$RT" --model-repository "${2:-$MODELS}" --model bge_m3 --grpc-port 18001 --http-port 18000 \
    --control-socket "$SOCK" --initial-state "$1" ${RUNTIME_ARGS:-} \
    >>"$OUT/runtime.log" 2>&1 &
  rt_pid=$!
  PIDS+=("$rt_pid")
}
stop_runtime() {
  [[ -n $rt_pid ]] || return 0
  kill -TERM "$rt_pid" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$rt_pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$rt_pid" 2>/dev/null
  rt_pid=
}

if has cold; then
  # Page cache warm for the file, as on a node that has served the model before.
  cat "$MODELS/bge_m3/1/model.pt" >/dev/null
  for i in 1 2 3; do
    # Run 1: frozen, TorchScript's profiling optimiser on, 3 warm-up runs; runs 2 and 3: not
    # frozen, optimiser off, 1 warm-up run.
    if [[ $i == 1 ]]; then set_jit true true 3; else set_jit false false 1; fi
    start_runtime warm
    timeout 120 "$PROBE" --socket "$SOCK" --wait-state WARM --since-unix-us "$T0" --promote \
      --model bge_m3 --seq-len 128 --timeout-s 100 --json >"$OUT/cold$i.json" 2>>"$OUT/probe.log"
    log "cold start $i: $(cat "$OUT/cold$i.json")"
    grep "\] loaded /" "$OUT/runtime.log" | tail -1 | tee -a "$OUT/summary.txt" >&2
    # Graphs are captured in the background after WARM: wait for the line that says so.
    for _ in $(seq 1 300); do
      [[ $(grep -c "device preparation" "$OUT/runtime.log") -ge $i ]] && break
      sleep 0.2
    done
    grep "device preparation" "$OUT/runtime.log" | tail -1 | tee -a "$OUT/summary.txt" >&2
    stop_runtime
  done
fi

# $1: the kernel set for instance.attention ("default" = the key left out: LibTorch's choice)
set_attention() {
  sed -i -e '/^  attention: /d' "$MODELS/bge_m3/config.yaml"
  [[ $1 == default ]] ||
    sed -i -e "s/^instance:$/instance:\n  attention: [$1]/" "$MODELS/bge_m3/config.yaml"
}
run_lg() {  # name, args...
  local name=$1
  shift
  timeout 120 "$LG" --target grpc --raw --address "$GRPC" --model bge_m3 --json \
    --duration-s "$DURATION_S" --warmup-s 2 "$@" >"$OUT/lg_$name.json" 2>"$OUT/lg_$name.err"
  log "$name: $(cat "$OUT/lg_$name.json")"
}
serve_suite() {  # $1 = name prefix
  run_lg "$1b1_512" --mode closed --concurrency 1 --seq-len 512 --batch 1
  run_lg "$1b1_4096" --mode closed --concurrency 1 --seq-len 4096 --batch 1
  run_lg "$1b1_128" --mode closed --concurrency 1 --seq-len 128 --batch 1
  run_lg "$1b1_32" --mode closed --concurrency 1 --seq-len 32 --batch 1
  for r in $RATES; do
    run_lg "$1open128_$r" --mode open --rate "$r" --max-in-flight 4096 --seq-len 128 --batch 1 \
      --grpc-threads 4
  done
  curl -s "http://$HTTP/metrics" >"$OUT/$1metrics.txt" 2>/dev/null
}
if has study && over_budget; then
  log "budget spent: attention study skipped"
elif has study; then
  log "attention study (in-process)"
  timeout 300 python3 bench/gpu/attention_study.py --repo "$MODELS" --json "$OUT/study.json" \
    2>&1 | tee "$OUT/study.log" | grep -v Warning >&2
fi
# ATTENTION_SETS: the instance.attention values served in turn (each a comma-separated set).
for aset in ${ATTENTION_SETS:-default}; do
  has check || has served || break
  if over_budget; then log "budget spent: attention set $aset skipped"; continue; fi
  # shellcheck disable=SC2086
  set_jit $SERVE_JIT
  set_attention "$aset"
  if [[ $aset != default ]] && ! grep -q "^  attention: \[$aset\]$" "$MODELS/bge_m3/config.yaml"; then
    log "attention set $aset: not written into config.yaml; skipped"
    continue
  fi
  prefix=""
  [[ $aset == default ]] || prefix="${aset//,/_}_"
  log "serving with attention kernels: $aset"
  prep_before=$(grep -c "device preparation" "$OUT/runtime.log" 2>/dev/null)
  start_runtime serving
  for _ in $(seq 1 600); do
    curl -sf "http://$HTTP/v2/health/ready" >/dev/null 2>&1 && break
    kill -0 "$rt_pid" 2>/dev/null || break
    sleep 0.2
  done
  curl -sf "http://$HTTP/v2/health/ready" >/dev/null || { log "runtime not ready"; tail -20 "$OUT/runtime.log" >&2; stop_runtime; continue; }
  # Measure with every graph captured.
  for _ in $(seq 1 300); do
    [[ $(grep -c "device preparation" "$OUT/runtime.log") -gt ${prep_before:-0} ]] && break
    kill -0 "$rt_pid" 2>/dev/null || break
    sleep 0.2
  done
  grep "device preparation" "$OUT/runtime.log" | tail -1 | tee -a "$OUT/summary.txt" >&2
  if has check; then
    log "correctness ($aset)"
    python3 bench/gpu/check_bge_m3.py --repo "$MODELS" --http "$HTTP" 2>&1 |
      tee "$OUT/${prefix}check.log" | tail -3 >&2
  fi
  has served && serve_suite "$prefix"
  stop_runtime
done
stop_runtime
if has aoti && [[ -f $MODELS_AOTI/bge_m3/1/model.pt2 ]]; then
  log "aotinductor: cold start"
  prep_before=$(grep -c "device preparation" "$OUT/runtime.log" 2>/dev/null)
  start_runtime warm "$MODELS_AOTI"
  timeout 120 "$PROBE" --socket "$SOCK" --wait-state WARM --since-unix-us "$T0" --promote \
    --model bge_m3 --seq-len 128 --timeout-s 100 --json >"$OUT/aoti_cold.json" 2>>"$OUT/probe.log"
  log "aotinductor cold start: $(cat "$OUT/aoti_cold.json")"
  grep "\] loaded /" "$OUT/runtime.log" | tail -1 | tee -a "$OUT/summary.txt" >&2
  if ! kill -0 "$rt_pid" 2>/dev/null; then
    log "aotinductor: the runtime exited"
    tail -5 "$OUT/runtime.log" >&2
  fi
  for _ in $(seq 1 600); do
    kill -0 "$rt_pid" 2>/dev/null || break
    [[ $(grep -c "device preparation" "$OUT/runtime.log") -gt $prep_before ]] && break
    kill -0 "$rt_pid" 2>/dev/null || break
    sleep 0.2
  done
  grep "device preparation" "$OUT/runtime.log" | tail -1 | tee -a "$OUT/summary.txt" >&2
  log "aotinductor: correctness"
  python3 bench/gpu/check_bge_m3.py --repo "$MODELS_AOTI" --http "$HTTP" 2>&1 |
    tee "$OUT/aoti_check.log" >&2
  kill -0 "$rt_pid" 2>/dev/null && serve_suite aoti_
  stop_runtime
elif has aoti; then
  log "aotinductor: no package in $MODELS_AOTI (see make_model.log)"
fi
if has anchors && over_budget; then
  log "budget spent: anchors skipped"
elif has anchors; then
  log "pytorch anchors"
  # shellcheck disable=SC2086
  python3 bench/gpu/pytorch_anchors.py --repo "$MODELS" $ANCHOR_ARGS --json "$OUT/anchors.json" \
    2>&1 | tee "$OUT/anchors.log" | grep -v Warning >&2
fi
# At most 8 files come back from a device run: keep the summary and runtime log loose, pack
# the rest.
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz --exclude summary.txt \
  --exclude runtime.log . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name results.tgz ! -name summary.txt ! -name runtime.log \
  -delete
log "done"
