#!/usr/bin/env bash
# Runs every kiln test: installs what is missing, builds, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
scripts/fetch-promtool.sh
# The binaries the tests start keep Abseil's lock-order checks (common/cli.h).
export KILN_LOCK_CHECKS=1
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 300
