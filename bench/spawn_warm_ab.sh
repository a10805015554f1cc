#!/usr/bin/env bash
# spawn -> WARM of kiln-runtime on the demo encoder, four ways in alternation, one binary:
#   debian         LibTorch as Debian ships it (LD_LIBRARY_PATH puts it before the RUNPATH)
#   debian+thp     the same, malloc's heap on huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
#   trimmed        the build's libtorch_cpu without the libraries it never calls
#   trimmed+thp    both: how kiln-agent starts a replica
# Each run: spawn with --initial-state warm, kiln-control-probe waits for WARM, Promote, first
# served request, Shutdown. Prints one line per run and the median per way.
#   bench/spawn_warm_ab.sh [ROUNDS]     (BUILD_DIR=build by default)
set -euo pipefail
rounds=${1:-5}
build=${BUILD_DIR:-build}
runtime=$build/runtime/kiln-runtime
probe=$build/bench/kiln-control-probe
models=$build/models
torch_dir=$(dirname "$(ldconfig -p | awk '$1 ~ /^libtorch_cpu\.so/ {print $NF; exit}')")
for f in "$runtime" "$probe" "$models/encoder/config.yaml"; do
  [[ -e $f ]] || { echo "missing $f (build first)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() {  # run WAY: prints spawn->WARM ms, load ms, Promote->first served ms
  local way=$1 sock=$work/control.sock
  local -a env=()
  case $way in
    debian) env=(LD_LIBRARY_PATH="$torch_dir") ;;
    debian+thp) env=(LD_LIBRARY_PATH="$torch_dir" GLIBC_TUNABLES=glibc.malloc.hugetlb=1) ;;
    trimmed) env=() ;;
    trimmed+thp) env=(GLIBC_TUNABLES=glibc.malloc.hugetlb=1) ;;
  esac
  rm -f "$sock"
  local t0
  t0=$(date +%s%6N)
  env "${env[@]}" "$runtime" --model-repository "$models" --model encoder --grpc-port 0 \
    --http-port 0 --bind-address 127.0.0.1 --control-socket "$sock" --initial-state warm \
    --log-level warn >"$work/runtime.log" 2>&1 &
  local pid=$!
  timeout 120 "$probe" --socket "$sock" --wait-state WARM --since-unix-us "$t0" --promote \
    --model encoder --seq-len 16 --shutdown --json >"$work/probe.json" || true
  wait "$pid" || true
  local libs
  libs=$(env "${env[@]}" ldd "$runtime" | wc -l)
  /usr/bin/python3 - "$work/probe.json" "$way" "$libs" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]} {d['spawn_to_state_ms']:.0f} {d['load_time_ms']:.0f} "
      f"{d['promote_to_first_ok_ms']:.2f} {sys.argv[3]}")
EOF
}

ways=(debian debian+thp trimmed trimmed+thp)
echo "way spawn_to_warm_ms load_time_ms promote_to_first_ms shared_objects"
for ((i = 0; i < rounds; i++)); do
  for w in "${ways[@]}"; do run "$w" | tee -a "$work/all.txt"; done
done
echo "median spawn -> WARM (ms) over $rounds rounds:"
for w in "${ways[@]}"; do
  awk -v w="$w" '$1 == w {print $2}' "$work/all.txt" | sort -n |
    awk -v w="$w" '{a[NR] = $1} END {printf "  %-12s %s  (min %s, max %s)\n", w, a[int((NR + 1) / 2)], a[1], a[NR]}'
done
