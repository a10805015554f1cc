#!/usr/bin/env bash
# Puts Prometheus's `promtool` at build/tools/promtool (the agent's tests lint its /metrics
# with `promtool check metrics`). Debian ships promtool only inside the `prometheus` package,
# whose install would also start a Prometheus server; so the package is downloaded and only
# promtool is taken out of it. Nothing to do when promtool is on the PATH or already there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=build/tools/promtool
if command -v promtool >/dev/null 2>&1 || [ -x "$DEST" ]; then
  exit 0
fi
mkdir -p build/tools
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
download() { (cd "$WORK" && apt-get download -q prometheus >/dev/null 2>&1); }
if ! download; then
  $SUDO apt-get update -q >/dev/null
  download || { echo "fetch-promtool: cannot download Debian's prometheus package" >&2; exit 1; }
fi
dpkg-deb -x "$WORK"/prometheus_*.deb "$WORK/x"
install -m 0755 "$WORK/x/usr/bin/promtool" "$DEST"
echo "fetch-promtool: $("$DEST" --version 2>&1 | head -n 1) at $DEST"
