# Sourced by the bench/gpu scripts: ROOT (the repository), BUILD (BUILD_DIR, default
# build-gpu/), MODELS (MODELS_DIR, default $BUILD/models) as absolute paths, and OUT (the
# results directory, default /tmp/kiln-gpu-out).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
MODELS=${MODELS_DIR:-$BUILD/models}
case "$MODELS" in /*) ;; *) MODELS="$PWD/$MODELS" ;; esac
OUT=${OUT:-/tmp/kiln-gpu-out}
