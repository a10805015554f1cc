#!/usr/bin/env bash
# scripts/trim-needed.sh on small libraries made here: it drops exactly the needed entries whose
# libraries define none of the object's undefined symbols, keeps the rest, makes a $ORIGIN search
# path absolute so the copy still finds its libraries, and leaves no copy behind when there is
# nothing to drop or a library it needs cannot be found.
set -euo pipefail
src=$(cd "$1" && pwd)
trim=$src/scripts/trim-needed.sh
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v patchelf >/dev/null || fail "patchelf is not installed (scripts/install-deps.sh)"
cc=${CC:-cc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"
mkdir lib out
echo 'int used(void) { return 40; }' >used.c
echo 'int unused(void) { return 2; }' >unused.c
echo 'int data_user = 2;' >data.c
"$cc" -shared -fPIC -o lib/libused.so used.c
"$cc" -shared -fPIC -o lib/libunused.so unused.c
"$cc" -shared -fPIC -o lib/libdata.so data.c
# libmain calls used() and reads data_user; it names libunused too but takes nothing from it.
cat >main.c <<'EOF'
int used(void);
extern int data_user;
int answer(void) { return used() + data_user; }
EOF
"$cc" -shared -fPIC -o lib/libmain.so main.c -Wl,--no-as-needed -Llib -lused -lunused -ldata \
  -Wl,-rpath,'$ORIGIN'
echo 'int answer(void); int main(void) { return answer() == 42 ? 0 : 1; }' >prog.c

dropped=$(sh "$trim" lib/libmain.so out/libmain.so) || fail "trim-needed failed on libmain.so"
[[ $dropped == "libunused.so" ]] || fail "dropped '$dropped', expected libunused.so alone"
needed=$(readelf -d out/libmain.so | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
[[ $needed == *libused.so* && $needed == *libdata.so* && $needed != *libunused.so* ]] ||
  fail "the copy needs: $needed"
[[ $(patchelf --print-rpath out/libmain.so) == "$dir/lib" ]] ||
  fail "the copy's search path is '$(patchelf --print-rpath out/libmain.so)', not $dir/lib"
[[ $(patchelf --print-soname out/libmain.so 2>/dev/null || true) == \
   $(patchelf --print-soname lib/libmain.so 2>/dev/null || true) ]] || fail "the SONAME changed"
# A program linked against the copy runs, its libraries found through the copy's search path.
"$cc" -o prog prog.c out/libmain.so -Wl,-rpath,"$dir/out"
./prog || fail "a program on the trimmed copy did not get 42"
! ldd ./prog | grep -q libunused || fail "the program still loads libunused.so"

# Nothing to drop: exit 3 and no copy.
"$cc" -shared -fPIC -o lib/libtight.so main.c -Wl,--no-as-needed -Llib -lused -ldata \
  -Wl,-rpath,'$ORIGIN'
rc=0
sh "$trim" lib/libtight.so out/libtight.so >/dev/null || rc=$?
[[ $rc == 3 ]] || fail "libtight.so: exit $rc, expected 3 (nothing to drop)"
[[ ! -e out/libtight.so ]] || fail "libtight.so: a copy was written with nothing to drop"

# A library it needs cannot be found: nothing can be checked, so nothing is dropped.
"$cc" -shared -fPIC -o lib/libgone.so unused.c
"$cc" -shared -fPIC -o lib/liblost.so main.c -Wl,--no-as-needed -Llib -lused -ldata -lgone \
  -Wl,-rpath,'$ORIGIN'
rm lib/libgone.so
rc=0
sh "$trim" lib/liblost.so out/liblost.so >/dev/null 2>&1 || rc=$?
[[ $rc == 3 ]] || fail "liblost.so: exit $rc, expected 3 (a missing library is kept)"
[[ ! -e out/liblost.so ]] || fail "liblost.so: a copy was written"

# Bad use: named, no copy.
rc=0
msg=$(sh "$trim" lib/nonexistent.so out/x.so 2>&1) || rc=$?
[[ $rc == 1 && $msg == *"cannot read lib/nonexistent.so"* ]] || fail "a missing SRC: exit $rc, '$msg'"
echo "trim-needed: drops the unused entry only, keeps the search path, refuses what it cannot check"
