#!/usr/bin/env bash
# Runs every kiln test: installs what is missing, builds, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
scripts/fetch-promtool.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 300
