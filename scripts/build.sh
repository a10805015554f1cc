#!/usr/bin/env bash
# Configures and builds kiln (and generates the demo/test models) into ./build.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_TYPE="${KILN_BUILD_TYPE:-Release}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" >/dev/null
cmake --build build -j "$(nproc)"
