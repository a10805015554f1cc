#!/usr/bin/env bash
# The Dockerfile cannot be built here (no container daemon, no registry), so this checks what
# would break it: its build stage runs the README's own scripts (which CI runs on a clean
# Debian 12), and its runtime stage installs every package that provides a shared library
# the four binaries load, directly or through the listed packages' dependencies (apt's view of
# Debian 12). Exit 77 (skipped) where apt has no package lists.
set -euo pipefail
src=$1; shift
fail() { echo "FAIL: $*" >&2; exit 1; }
dockerfile=$src/Dockerfile
grep -q '^FROM debian:12 AS build$' "$dockerfile" || fail "the build stage is not FROM debian:12"
for s in scripts/install-deps.sh scripts/build.sh; do
  grep -q "$s" "$dockerfile" || fail "the build stage does not run $s (the README's commands)"
  [[ -x $src/$s ]] || fail "$s is not an executable in the repository"
done
grep -q 'cmake --install build --prefix /usr' "$dockerfile" || fail "the build stage does not install into /usr"
for b in kiln-controller kilnctl kiln-agent kiln-runtime; do
  grep -q "/usr/bin/$b" "$dockerfile" || fail "the image does not copy /usr/bin/$b"
done
# The runtime's trimmed libtorch_cpu (lib/kiln, no package's) travels with the binaries.
for bin in "$@"; do
  if ldd "$bin" | awk '/libtorch_cpu/{print $3}' | grep -q '/lib/libtorch_cpu'; then
    grep -q 'COPY --from=build /usr/lib/kiln ' "$dockerfile" ||
      fail "$(basename "$bin") links the build's trimmed libtorch_cpu; the image does not copy /usr/lib/kiln"
  fi
done
if ! apt-cache show libc6 >/dev/null 2>&1; then
  echo "apt has no package lists: the runtime-stage check is skipped"
  exit 77
fi
# The runtime stage's apt-get line, its $(...) evaluated as the image build would.
runtime=$(awk '/^FROM debian:12$/{rt=1} rt' "$dockerfile" | sed -n '/apt-get install/,/rm -rf/p' |
          tr '\\' ' ' | tr -s ' \n' ' ')
absl=$(apt-cache depends libabsl-dev | awk '/Depends: libabsl2/{print $2}')
listed=$(grep -oE '(lib[a-z0-9.+-]+|ca-certificates)' <<<"$runtime" | grep -v '^libabsl-dev$' | sort -u)
listed="$listed $absl"
# Everything the listed packages bring, as apt resolves it.
closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
            --no-replaces --no-enhances $listed 2>/dev/null | grep -vE '^\s' | sed 's/:any$//' | sort -u)
# Each shared object the binaries load, once, and the package that owns it.
declare -A user_of
for bin in "$@"; do
  for lib in $(ldd "$bin" | awk '/=> \//{print $3}'); do
    user_of[$(readlink -f "$lib")]=$(basename "$bin")
  done
done
missing=()
while IFS= read -r line; do
  pkg=${line%%:*}
  path=${line##*: }
  grep -qx "$pkg" <<<"$closure" || missing+=("$pkg ($(basename "$path") for ${user_of[$path]:-?})")
done < <(dpkg -S "${!user_of[@]}" 2>/dev/null | sed 's/:amd64:/:/')
if ((${#missing[@]})); then
  printf 'FAIL: the runtime stage lacks %s\n' "${missing[@]}" | sort -u >&2
  exit 1
fi
echo "Dockerfile: README build, $(wc -w <<<"$listed") runtime packages cover every library the binaries load"
