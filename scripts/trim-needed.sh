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
for tool in readelf patchelf ldd ldconfig; do
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

drop=""
for needed in $(readelf -d "$src" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
  path=$(ldconfig -p | awk -v n="$needed" '$1 == n { print $NF; exit }')
  if [ -z "$path" ]; then
    # Not in the loader's cache (a private directory): keep it, as nothing can be checked.
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
# One patchelf run: each run rewrites the whole file.
# shellcheck disable=SC2086
patchelf $args "$work/copy"

ldd -r "$src" 2>&1 | grep 'undefined symbol' | sort >"$work/before" || true
ldd -r "$work/copy" 2>&1 | grep 'undefined symbol' | sed "s|$work/copy|$src|" | sort >"$work/after" || true
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
