#!/usr/bin/env bash
# The Kubernetes manifests and the systemd options only use flags the binaries accept, and
# `kubectl kustomize` renders manifests/ (skipped, exit 77, where kubectl is not installed).
set -euo pipefail
src=$1 agent_bin=$2 controller_bin=$3
fail() { echo "FAIL: $*" >&2; exit 1; }
check_flags() {  # binary, files...
  local bin=$1; shift
  local help; help=$("$bin" --help)
  for flag in $(grep -ohE -- '--[a-z][a-z0-9-]+' "$@" | sort -u); do
    grep -qE -- "(^|[ ,])$flag([ =,]|$)" <<<"$help" || fail "$bin has no flag $flag (used in $*)"
  done
}
grep -A40 'command: \[/usr/bin/kiln-controller\]' "$src/manifests/controller.yaml" | sed -n '/args:/,/env:/p' > /tmp/kiln-ctl-args.$$
grep -A40 'command: \[/usr/bin/kiln-agent\]' "$src/manifests/agent.yaml" | sed -n '/args:/,/env:/p' > /tmp/kiln-agent-args.$$
trap 'rm -f /tmp/kiln-ctl-args.$$ /tmp/kiln-agent-args.$$' EXIT
[[ -s /tmp/kiln-ctl-args.$$ && -s /tmp/kiln-agent-args.$$ ]] || fail "no container args found in the manifests"
check_flags "$controller_bin" /tmp/kiln-ctl-args.$$ "$src/packaging/etc/controller.env"
check_flags "$agent_bin" /tmp/kiln-agent-args.$$ "$src/packaging/etc/agent.env"
grep -h '^ExecStart=' "$src/packaging/systemd/kiln-agent.service.in" > /tmp/kiln-agent-args.$$
check_flags "$agent_bin" /tmp/kiln-agent-args.$$
if ! command -v kubectl >/dev/null; then
  echo "flags OK; kubectl not installed: kustomize rendering skipped"
  exit 77
fi
rendered=$(kubectl kustomize "$src/manifests") || fail "kubectl kustomize manifests/ failed"
for kind in Namespace CustomResourceDefinition ServiceAccount Role RoleBinding Secret Deployment \
            Service PodDisruptionBudget DaemonSet; do
  grep -q "^kind: $kind$" <<<"$rendered" || fail "rendered manifests have no $kind"
done
echo "flags and kustomize rendering OK"
