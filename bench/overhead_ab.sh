#!/usr/bin/env bash
# kiln's served overhead at batch 1, runtimes started different ways in alternation, one build:
# for each round and each way, a fresh kiln-runtime on the demo encoder without dynamic
# batching (bench/config_variant.py --no-batching), then kiln-overhead-bench against it
# (median of REPS interleaved repetitions; the in-process forward, gRPC through grpc++ and
# through the lean client, REST, and each client's transport floor).
#   bench/overhead_ab.sh [ROUNDS] [WAY...]     (BUILD_DIR=build by default)
# A WAY is the runtime's extra flags with commas for spaces: "-" for none (the default),
# "--idle-spin-us,300" for a 300 us idle spin. Default ways: - and --idle-spin-us,300.
# CLIENT_CPUS=LIST pins the benchmark (its clients and its in-process forward) to those CPUs in
# every way, e.g. away from a runtime's --model-cpus.
# Prints each run's medians (µs) and server_compute_us, one line per benchmark.
set -euo pipefail
rounds=${1:-2}
shift || true
ways=("$@")
[[ ${#ways[@]} -gt 0 ]] || ways=(- --idle-spin-us,300)
build=${BUILD_DIR:-build}
runtime=$build/runtime/kiln-runtime
bench=$build/bench/kiln-overhead-bench
here=$(cd "$(dirname "$0")" && pwd)
for f in "$runtime" "$bench" "$build/models/encoder/config.yaml"; do
  [[ -e $f ]] || { echo "missing $f (build first)" >&2; exit 1; }
done
pin=()
[[ -z ${CLIENT_CPUS:-} ]] || pin=(taskset -c "$CLIENT_CPUS")
work=$(mktemp -d)
trap 'kill "${pid:-}" 2>/dev/null || true; rm -rf "$work"' EXIT
cp -r "$build/models" "$work/models"
/usr/bin/python3 "$here/config_variant.py" "$build/models/encoder/config.yaml" \
  "$work/models/encoder/config.yaml" --no-batching

for ((r = 1; r <= rounds; r++)); do
  for way in "${ways[@]}"; do
    extra=()
    [[ $way == - ]] || IFS=, read -r -a extra <<<"$way"
    rm -f "$work/c.sock"
    # As kiln-agent starts a replica: malloc's heap on huge pages.
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 "$runtime" --model-repository "$work/models" \
      --model encoder --grpc-port 0 --http-port 0 --bind-address 127.0.0.1 \
      --control-socket "$work/c.sock" --initial-state serving "${extra[@]}" \
      >"$work/runtime.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
      grep -q 'WARM -> SERVING' "$work/runtime.log" && break
      kill -0 "$pid" 2>/dev/null || { cat "$work/runtime.log" >&2; exit 1; }
      sleep 0.1
    done
    gp=$(grep -oE 'grpc_port=[0-9]+' "$work/runtime.log" | head -1 | cut -d= -f2)
    hp=$(grep -oE 'http_port=[0-9]+' "$work/runtime.log" | head -1 | cut -d= -f2)
    echo "== round $r, runtime flags: ${extra[*]:-(none)}${CLIENT_CPUS:+, benchmark on cpus $CLIENT_CPUS}"
    KILN_MODEL_REPO=$work/models KILN_GRPC_ADDRESS=127.0.0.1:$gp \
      KILN_HTTP_ADDRESS=127.0.0.1:$hp KILN_CONTROL_SOCKET=$work/c.sock \
      timeout 600 "${pin[@]}" "$bench" --benchmark_min_time="${MIN_TIME:-1}" \
      --benchmark_repetitions="${REPS:-3}" --benchmark_enable_random_interleaving=true \
      --benchmark_report_aggregates_only=true \
      --benchmark_filter="${FILTER:-batch:1/seq:16|Floor}" 2>&1 |
      awk '/_median/ {name=$1; sub(/_median$/, "", name); comp="";
             for (i = 1; i <= NF; i++) if ($i ~ /^server_compute_us=/) comp = "  " $i;
             printf "%-66s %8s %s%s\n", name, $2, $3, comp}'
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
