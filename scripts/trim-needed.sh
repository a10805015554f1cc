#!/bin/sh
# trim-needed.sh SRC DEST: writes DEST, a copy of the shared object SRC without the DT_NEEDED
# entries SRC takes no symbol from.
#
# Why: Debian's libtorch_cpu.so names OpenCV, FFmpeg, LevelDB, LMDB, ZeroMQ and others as
# needed but calls none of them. The dynamic loader still maps and initialises them and the
# ~240 libraries they bring (Qt, GDAL, GStreamer...): half of kiln-runtime's start on a small
# VM (bench/RESULTS.md, 2026-11-28 session 9). The copy keeps SRC's code and SONAME; only its
# list of needed libraries is shorter.
#
# An entry is dropped only when the library it names defines none of SRC's undefined symbols
# (weak ones included). Then `ldd -r` must resolve the copy with no undefined symbol that SRC
# did not already have, or the copy is thrown away.
#
# Exit status: 0 DEST written (the dropped names on stdout, one per line); 3 nothing to drop (no
# DEST); 1 a tool is missing or the check failed (reason on stderr, no DEST).
set -eu

if [ $# -ne 2 ]; then
  echo "usage: trim-needed.sh SRC DEST" >&2
  exit 1
fi
src=$1
dest=$2
for tool in readelf patchelf ldd; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "trim-needed: $tool not found" >&2
    exit 1
  fi
done
if [ ! -r "$src" ]; then
  echo "trim-needed: cannot read $src" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The names SRC leaves undefined, versions stripped.
defined_by() {
  readelf -W --dyn-syms "$1" |
    awk 'NF >= 8 && $7 != "UND" && $5 != "LOCAL" { sub(/@.*/, "", $8); if ($8 != "") print $8 }' |
    sort -u
}
readelf -W --dyn-syms "$src" |
  awk 'NF >= 8 && $7 == "UND" { sub(/@.*/, "", $8); if ($8 != "") print $8 }' |
  sort -u >"$work/undefined"

readelf -V "$src" | sed -n 's/.*File: \([^ ]*\).*/\1/p' | sort -u >"$work/versioned"
# Where the loader finds each library for SRC (its own search path included).
ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' >"$work/found"
drop=""
for needed in $(readelf -d "$src" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
  path=$(awk -v n="$needed" '$1 == n { print $2; exit }' "$work/found")
  if [ -z "$path" ]; then
    # Not found at all: keep it, as nothing can be checked.
    continue
  fi
  # A library named in SRC's version needs is used, whatever the symbol tables say.
  if grep -qxF "$needed" "$work/versioned"; then
    continue
  fi
  if [ -z "$(defined_by "$path" | comm -12 "$work/undefined" -)" ]; then
    drop="$drop $needed"
  fi
done
if [ -z "$drop" ]; then
  exit 3
fi

cp -L "$src" "$work/copy"
args=""
for needed in $drop; do
  args="$args --remove-needed $needed"
done
# The copy lives elsewhere: a search path of SRC's relative to its own directory ($ORIGIN, as
# a wheel's LibTorch has) is made absolute, so the copy finds what SRC found.
rpath=$(patchelf --print-rpath "$src")
case $rpath in
  *'$ORIGIN'* | *'${ORIGIN}'*)
    origin=$(cd "$(dirname "$src")" && pwd -P)
    rpath=$(printf '%s' "$rpath" | sed -e "s|\${ORIGIN}|$origin|g" -e "s|\$ORIGIN|$origin|g")
    args="$args --set-rpath $rpath"
    ;;
esac
# One patchelf run: each run rewrites the whole file.
# shellcheck disable=SC2086
patchelf $args "$work/copy"
if ldd "$work/copy" | grep -q 'not found'; then
  echo "trim-needed: the trimmed copy cannot find a library SRC finds; keeping $src:" >&2
  ldd "$work/copy" | grep 'not found' | head -5 >&2
  exit 1
fi

# ldd -r relocates the copy as the loader would. It must succeed as for SRC, with no
# undefined symbol SRC did not have.
ldd -r "$src" >"$work/ldd-src" 2>&1 || true
ldd_rc=0
ldd -r "$work/copy" >"$work/ldd-copy" 2>&1 || ldd_rc=$?
if [ "$ldd_rc" -ne 0 ] || grep -q 'Inconsistency\|error' "$work/ldd-copy"; then
  echo "trim-needed: the trimmed copy does not load (ldd -r); keeping $src:" >&2
  grep -v '=>' "$work/ldd-copy" | head -5 >&2
  exit 1
fi
grep 'undefined symbol' "$work/ldd-src" | sed 's/[[:space:]]*(.*//' | sort >"$work/before" || true
grep 'undefined symbol' "$work/ldd-copy" | sed 's/[[:space:]]*(.*//' | sort >"$work/after" || true
if [ -n "$(comm -13 "$work/before" "$work/after")" ]; then
  echo "trim-needed: the trimmed copy leaves symbols undefined; keeping $src:" >&2
  comm -13 "$work/before" "$work/after" | head -5 >&2
  exit 1
fi

mkdir -p "$(dirname "$dest")"
mv "$work/copy" "$dest.tmp"
mv "$dest.tmp" "$dest"
for needed in $drop; do
  echo "$needed"
done
