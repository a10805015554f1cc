#!/usr/bin/env bash
# The demo encoder served by kiln-runtime on a CUDA GPU, from the repository root:
#
#   BUILD_DIR=build-gpu OUT=/tmp/out bench/gpu/encoder_cuda.sh
#
# 1. per precision (fp32, fp16; dynamic batching on, as the demo config has it): spawn -> WARM
#    and Promote -> first served request (kiln-control-probe), the outputs against the CPU
#    FP32 reference (check_encoder.py), then kiln-loadgen: gRPC raw at one request in flight,
#    at 64 in flight, and REST JSON at one in flight (batch 1, 16 tokens);
# 2. per device (cpu with THREADS intra-op threads, cuda:0; fp32, no dynamic batching):
#    kiln-overhead-bench, the in-process forward beside the same request served over gRPC and
#    REST, and (cuda:0) 64 in flight without batching, the baseline for 1.
# Not a test; every process it starts is stopped on exit.
#
# Environment: BUILD_DIR (build-gpu), MODELS_DIR ($BUILD_DIR/models), OUT (/tmp/kiln-gpu-out),
# DURATION_S (4), PRECISIONS ("fp32 fp16"), DEVICES ("cpu cuda:0"), THREADS (4),
# BENCH_MIN_TIME (0.5), CUDA_DEVICE (cuda:0; cpu tries the script on a machine without a GPU).
set -uo pipefail
# shellcheck source=bench/gpu/paths.sh
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
DURATION_S=${DURATION_S:-4}
PRECISIONS=${PRECISIONS:-fp32 fp16}
DEVICES=${DEVICES:-cpu cuda:0}
THREADS=${THREADS:-4}
BENCH_MIN_TIME=${BENCH_MIN_TIME:-0.5}
CUDA_DEVICE=${CUDA_DEVICE:-cuda:0}
RT=$BUILD/runtime/kiln-runtime
LG=$BUILD/bench/kiln-loadgen
PROBE=$BUILD/bench/kiln-control-probe
OVERHEAD=$BUILD/bench/kiln-overhead-bench
GRPC=127.0.0.1:18101
HTTP=127.0.0.1:18100
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/kenc.XXXXXX)
SOCK=$WORK/control.sock
RT_PID=""
stop_runtime() {
  [ -n "$RT_PID" ] || return 0
  kill -TERM "$RT_PID" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$RT_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$RT_PID" 2>/dev/null
  wait "$RT_PID" 2>/dev/null
  RT_PID=""
}
cleanup() { stop_runtime; rm -rf "$WORK"; }
trap cleanup EXIT
log() { printf '[encoder-cuda %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/encoder_cuda.txt" >&2; }

# $1 repository, $2 device, $3 precision, $4 threads, $5 batching (on|off)
make_repo() {
  mkdir -p "$1/encoder"
  for v in 1 2; do
    mkdir -p "$1/encoder/$v"
    ln -sf "$MODELS/encoder/$v/model.pt" "$1/encoder/$v/model.pt"
  done
  local batching=()
  [ "$5" = off ] && batching=(--no-batching)
  python3 "$ROOT/bench/config_variant.py" "$MODELS/encoder/config.yaml" "$1/encoder/config.yaml" \
    --device "$2" --precision "$3" --threads "$4" "${batching[@]}"
}

# $1 repository, $2 initial state, $3 log name
start_runtime() {
  rm -f "$SOCK"
  T0=$(date +%s%6N)
  "$RT" --model-repository "$1" --model encoder --grpc-port "${GRPC##*:}" --http-port "${HTTP##*:}" \
    --control-socket "$SOCK" --initial-state "$2" >"$OUT/runtime-$3.log" 2>&1 &
  RT_PID=$!
}

wait_ready() {
  for _ in $(seq 1 1200); do
    curl -sf "http://$HTTP/v2/health/ready" >/dev/null 2>&1 && return 0
    kill -0 "$RT_PID" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

load() {  # $1 protocol, $2 concurrency, more loadgen flags after
  local target=$1 conc=$2 addr=$GRPC
  shift 2
  [ "$target" = rest ] && addr=$HTTP
  "$LG" --target "$target" --mode closed --concurrency "$conc" --seq-len 16 --batch 1 \
    --duration-s "$DURATION_S" --warmup-s 1 --address "$addr" "$@" 2>&1 |
    grep -E "requests:|throughput:|latency ms:|errors" | tr -s ' ' | tr '\n' ' '
}

command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,power.draw --format=csv | tee -a "$OUT/encoder_cuda.txt" >&2

for p in $PRECISIONS; do
  repo=$WORK/batch-$p
  make_repo "$repo" "$CUDA_DEVICE" "$p" 0 on
  start_runtime "$repo" warm "batch-$p"
  timeout 120 "$PROBE" --socket "$SOCK" --wait-state WARM --since-unix-us "$T0" --promote \
    --model encoder --seq-len 16 --timeout-s 100 --json >"$OUT/lifecycle-$p.json" 2>>"$OUT/probe.log"
  log "$CUDA_DEVICE $p lifecycle: $(cat "$OUT/lifecycle-$p.json")"
  if ! wait_ready; then
    log "$CUDA_DEVICE $p: the runtime never served"; tail -20 "$OUT/runtime-batch-$p.log" >&2; stop_runtime; continue
  fi
  tol=1e-4; [ "$p" = fp32 ] || tol=2e-2
  log "$CUDA_DEVICE $p check: $(python3 "$ROOT/bench/gpu/check_encoder.py" --http "$HTTP" \
    --reference "$MODELS/encoder/reference/v2.json" --tol "$tol" 2>&1 | tail -1)"
  log "$CUDA_DEVICE $p batching on, gRPC raw, 1 in flight: $(load grpc 1 --raw)"
  log "$CUDA_DEVICE $p batching on, gRPC raw, 64 in flight: $(load grpc 64 --raw)"
  log "$CUDA_DEVICE $p batching on, REST JSON, 1 in flight: $(load rest 1)"
  stop_runtime
done

for d in $DEVICES; do
  repo=$WORK/nobatch-${d/:/}
  t=0; [ "$d" = cpu ] && t=$THREADS
  make_repo "$repo" "$d" fp32 "$t" off
  start_runtime "$repo" serving "nobatch-${d/:/}"
  if ! wait_ready; then
    log "$d: the runtime never served"; tail -20 "$OUT/runtime-nobatch-${d/:/}.log" >&2; stop_runtime; continue
  fi
  [ "$d" = cpu ] || log "$d fp32 batching off, gRPC raw, 64 in flight: $(load grpc 64 --raw)"
  KILN_MODEL_REPO="$repo" KILN_GRPC_ADDRESS="$GRPC" KILN_HTTP_ADDRESS="$HTTP" \
    KILN_CONTROL_SOCKET="$SOCK" KILN_BENCH_THREADS="$t" timeout --kill-after=5 180 "$OVERHEAD" \
    --benchmark_min_time="$BENCH_MIN_TIME" --benchmark_repetitions=3 \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_out="$OUT/overhead-${d/:/}.json" --benchmark_out_format=json \
    >"$OUT/overhead-${d/:/}.log" 2>&1
  log "$d overhead (kiln-overhead-bench, medians):"
  grep -E "_median" "$OUT/overhead-${d/:/}.log" | tee -a "$OUT/encoder_cuda.txt" >&2
  stop_runtime
done
log "done"
