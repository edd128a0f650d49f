#!/bin/sh
# stub_path.sh -- `make check`: tests/test_backend_cuda's stub-driver check
# (test_stub_driver) in a process whose own libraries are found only on
# LD_LIBRARY_PATH, as on a machine where they live in a private prefix
# (scripts/gpu-check.sh unpacks liburcu and jemalloc into one on the GPU
# machine; conda and spack installs are the same).
#
# The check re-executes the program with the toolkit's stub libcuda first on
# LD_LIBRARY_PATH; a child whose path no longer names the prefix cannot even
# start (status 127), and the check fails before it has checked anything.
# Here a copy of the program has one of its dependencies renamed (the same
# number of characters in its dynamic string table: libjemalloc.so.2 becomes
# lxbjemalloc.so.2) and a copy of that library under the new name sits in a
# folder only LD_LIBRARY_PATH names.  The copy must fail to start without the
# path (else this test proves nothing) and pass its selection checks with it.
#
# Exit 77 without CUDA, without a stub libcuda, or when none of the
# candidate libraries is a dependency of the program.
set -u
LC_ALL=C
export LC_ALL

top=${abs_top_builddir:-.}
if ! grep -q '^#define BFC_HAVE_CUDA 1' "$top/src/config.h" 2>/dev/null; then
    echo "stub_path: built without CUDA: no stub-driver check"
    exit 77
fi
prog=$top/tests/test_backend_cuda
[ -f "$prog" ] || { echo "stub_path: $prog is not built (make check builds it)"; exit 1; }
command -v ldd >/dev/null 2>&1 || { echo "stub_path: no ldd"; exit 77; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/stub_path.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

lib="" path=""
for cand in libjemalloc.so.2 liburcu-bp.so.8 libhwloc.so.15; do
    path=$(ldd "$prog" 2>/dev/null | awk -v l="$cand" '$1 == l && $3 ~ /^\// {print $3}')
    if [ -n "$path" ]; then
        lib=$cand
        break
    fi
done
if [ -z "$lib" ]; then
    echo "stub_path: the program needs none of libjemalloc, liburcu-bp, libhwloc (ldd): nothing to move"
    exit 77
fi
new="lxb${lib#lib}"
cp "$path" "$tmp/$new" || exit 1
sed "s/$lib/$new/g" "$prog" >"$tmp/test_backend_cuda" || exit 1
chmod +x "$tmp/test_backend_cuda"

# Without the folder on the path the copy must not start.  Both runs keep
# the inherited path (behind the folder): the program's other libraries may
# be found only there, as on the GPU machine, where libsubunit and json-c
# come from the private prefix too.
(cd "$tmp" && ./test_backend_cuda >"$tmp/without.out" 2>&1)
rc=$?
if [ $rc -ne 127 ] || ! grep -q "$new" "$tmp/without.out"; then
    echo "stub_path: the copy started without $new on the path (exit $rc): the test would prove nothing"
    cat "$tmp/without.out"
    exit 1
fi

(cd "$tmp" && LD_LIBRARY_PATH="$tmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CK_RUN_CASE=selection \
    CK_VERBOSITY=normal ./test_backend_cuda >"$tmp/with.out" 2>&1)
rc=$?
cat "$tmp/with.out"
if grep -q 'no stub libcuda found' "$tmp/with.out"; then
    echo "stub_path: no stub libcuda: not checked"
    exit 77
fi
if { [ $rc -eq 0 ] || [ $rc -eq 77 ]; } && grep -q 'Failures: 0, Errors: 0' "$tmp/with.out"; then
    echo "stub_path: with $lib found only on LD_LIBRARY_PATH (as $new), the stub-driver check passed"
    exit 0
fi
echo "stub_path: the selection checks failed (exit $rc) with $lib found only on LD_LIBRARY_PATH"
exit 1
