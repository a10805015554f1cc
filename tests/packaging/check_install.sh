#!/usr/bin/env bash
# `cmake --install` into a scratch prefix lays out binaries, units, configuration, manifests and
# docs, and `systemd-analyze verify` accepts the installed units without a single complaint.
set -euo pipefail
build=$1
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
fail() { echo "FAIL: $*" >&2; exit 1; }
for f in bin/kiln-agent bin/kiln-runtime bin/kiln-controller bin/kilnctl \
         lib/systemd/system/kiln-agent.service lib/systemd/system/kiln-controller.service \
         lib/systemd/system/kiln-agent-grpc.socket lib/systemd/system/kiln-agent-http.socket \
         etc/kiln/agent.env etc/kiln/controller.env share/kiln/manifests/crd.yaml \
         share/kiln/examples/encoder.yaml share/doc/kiln/operator-guide.md; do
  [[ -e "$prefix/$f" ]] || fail "$f not installed"
done
agent=$prefix/lib/systemd/system/kiln-agent.service
controller=$prefix/lib/systemd/system/kiln-controller.service
sockets="$prefix/lib/systemd/system/kiln-agent-grpc.socket $prefix/lib/systemd/system/kiln-agent-http.socket"
grep -q "^FileDescriptorName=grpc" $prefix/lib/systemd/system/kiln-agent-grpc.socket || fail "grpc socket name"
grep -q "^FileDescriptorName=http" $prefix/lib/systemd/system/kiln-agent-http.socket || fail "http socket name"
grep -q "^Sockets=kiln-agent-grpc.socket kiln-agent-http.socket" "$agent" || fail "kiln-agent.service lacks Sockets="
grep -q "^ExecStart=$prefix/bin/kiln-agent " "$agent" || fail "agent ExecStart does not point into the prefix"
grep -q "^EnvironmentFile=-$prefix/etc/kiln/agent.env" "$agent" || fail "agent EnvironmentFile"
for d in Type=notify WatchdogSec= Restart=on-failure KillMode=process DeviceAllow=/dev/nvidiactl \
         DeviceAllow=char-nvidia-uvm DeviceAllow=char-nvidia-caps ProtectSystem=strict \
         ReadWritePaths= NoNewPrivileges=yes PrivateTmp=yes ProtectKernelTunables=yes; do
  grep -q "^$d" "$agent" || fail "kiln-agent.service lacks $d"
done
for d in PrivateDevices MemoryDenyWriteExecute; do
  ! grep -q "^$d" "$agent" || fail "kiln-agent.service must not set $d (it breaks the GPU)"
done
for d in Type=notify WatchdogSec= Restart=on-failure DynamicUser=yes ProtectSystem=strict; do
  grep -q "^$d" "$controller" || fail "kiln-controller.service lacks $d"
done
out=$(systemd-analyze verify "$agent" "$controller" $sockets 2>&1) || fail "systemd-analyze verify: $out"
[[ -z "$out" ]] || fail "systemd-analyze verify complained: $out"
# Where the build links a trimmed libtorch_cpu (cmake/Dependencies.cmake), it is installed
# beside the runtime and the installed binary finds it there, not in the build tree.
if compgen -G "$build/lib/libtorch_cpu.so.*" >/dev/null; then
  lib=$(ldd "$prefix/bin/kiln-runtime" | awk '/libtorch_cpu/{print $3}')
  [[ $(readlink -f "$lib") == "$(readlink -f "$prefix/lib/kiln")"/* ]] ||
    fail "the installed kiln-runtime loads libtorch_cpu from '$lib', not $prefix/lib/kiln"
fi
# A second install keeps the operator's configuration.
echo "# mine" >> "$prefix/etc/kiln/agent.env"
cmake --install "$build" --prefix "$prefix" >/dev/null
grep -q "^# mine" "$prefix/etc/kiln/agent.env" || fail "a reinstall overwrote etc/kiln/agent.env"
echo "install layout and units OK"
