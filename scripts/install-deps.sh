#!/usr/bin/env bash
# Installs every Debian 12 package kiln needs to build, test and run its demo.
# Idempotent: installs only what is missing. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libyaml-cpp-dev libspdlog-dev libfmt-dev libcpprest-dev libsystemd-dev libnuma-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
  libsqlite3-dev libssl-dev
  # kiln-controller's allocator.
  libjemalloc-dev
  # Boost.Beast (header-only) serves HTTP; nghttp2 the router's gRPC (HTTP/2).
  libboost-dev libnghttp2-dev
  # systemd-analyze checks the installed units in the tests; openssl makes the TLS tests' CA.
  systemd openssl
  # ip netns: a test runs a second node in a network namespace of its own.
  iproute2
  libtorch-dev python3-torch python3-fastapi python3-uvicorn python3-yaml
  # patchelf: the build links a copy of libtorch_cpu without the ~25 libraries it names but
  # never calls (scripts/trim-needed.sh); binutils' readelf checks what it calls.
  patchelf binutils
  # Debian's LibTorch calls the system BLAS (libblas.so.3); this makes it OpenBLAS (built
  # with OpenMP, like LibTorch) instead of the reference BLAS: about 7x faster on CPU.
  libopenblas0-openmp
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
