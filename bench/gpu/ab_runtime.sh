#!/usr/bin/env bash
# One kiln-runtime change against its baseline on the GPU host, in one run, from the
# repository root (.devdebs/ carried, see ../shared/device/README.md):
#
#   BASE_SRC=build-base-src bench/gpu/ab_runtime.sh
#
# BASE_SRC: the baseline's source tree (`git archive BASE | tar -x -C build-base-src`, carried).
# Builds kiln-runtime and kiln-loadgen from this tree (build-gpu/) and from BASE_SRC
# (build-gpu-base/) side by side while make_bge_m3.py makes the bge-m3-shaped encoder, then
# serves it with each binary in turn (ORDER, default "base new"), the same config, every graph
# captured, and drives 128-token queries open loop at RATES (gRPC raw) and batch 1 at 512
# tokens closed loop. Results and logs in OUT (default /tmp/kiln-gpu-out).
# Environment: MODELS (/tmp/gpu-models), RATES ("4400 4800 5200"), DURATION_S (3).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-/tmp/kiln-gpu-out}
MODELS=${MODELS:-/tmp/gpu-models}
RATES=${RATES:-4400 4800 5200}
DURATION_S=${DURATION_S:-3}
ORDER=${ORDER:-base new}
BASE_SRC=${BASE_SRC:?the baseline source tree}
mkdir -p "$OUT"
log() { printf '[ab %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/summary.txt" >&2; }
rm -f /opt/deps/.unpacked
# shellcheck disable=SC1091
source .devdebs/device-env.sh >/dev/null
build() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$KILN_CMAKE_PREFIX" \
    -DKILN_BUILD_TESTS=OFF -DKILN_PYTHON_TORCH="$(command -v python3)" >"$OUT/cmake_$3.log" 2>&1 &&
    ninja -C "$2" kiln-runtime kiln-loadgen >"$OUT/build_$3.log" 2>&1
}
build . build-gpu new &
new_pid=$!
build "$BASE_SRC" build-gpu-base base &
base_pid=$!
[[ -f $MODELS/bge_m3/1/model.pt ]] ||
  python3 bench/gpu/make_bge_m3.py --out "$MODELS" >"$OUT/make_model.log" 2>&1
python3 bench/gpu/make_bge_m3.py --out "$MODELS" --config-only
wait "$new_pid" || { log "new build failed"; grep -m5 error "$OUT/build_new.log" >&2; exit 1; }
wait "$base_pid" || { log "base build failed"; grep -m5 error "$OUT/build_base.log" >&2; exit 1; }
log "built"
GRPC=127.0.0.1:18001
for which in $ORDER; do
  dir=build-gpu
  [[ $which == base ]] && dir=build-gpu-base
  rm -f /tmp/kiln-ab.sock
  "$dir/runtime/kiln-runtime" --model-repository "$MODELS" --model bge_m3 --grpc-port 18001 \
    --http-port 18000 --control-socket /tmp/kiln-ab.sock --initial-state serving \
    >"$OUT/runtime_$which.log" 2>&1 &
  rt=$!
  for _ in $(seq 1 400); do
    grep -q "device preparation" "$OUT/runtime_$which.log" && break
    kill -0 "$rt" 2>/dev/null || break
    sleep 0.2
  done
  grep "device preparation" "$OUT/runtime_$which.log" | tee -a "$OUT/summary.txt" >&2
  for r in $RATES; do
    timeout 60 "$dir/bench/kiln-loadgen" --target grpc --raw --address "$GRPC" --model bge_m3 \
      --json --duration-s "$DURATION_S" --warmup-s 2 --mode open --rate "$r" \
      --max-in-flight 4096 --seq-len 128 --batch 1 --grpc-threads 4 >"$OUT/${which}_open$r.json" 2>&1
    log "$which open $r: $(tail -1 "$OUT/${which}_open$r.json")"
  done
  timeout 60 "$dir/bench/kiln-loadgen" --target grpc --raw --address "$GRPC" --model bge_m3 \
    --json --duration-s "$DURATION_S" --warmup-s 2 --mode closed --concurrency 1 --seq-len 512 \
    --batch 1 >"$OUT/${which}_b1_512.json" 2>&1
  log "$which b1 512: $(tail -1 "$OUT/${which}_b1_512.json")"
  kill -TERM "$rt"
  wait "$rt"
done
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz --exclude summary.txt . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name results.tgz ! -name summary.txt -delete
log "done"
