#!/bin/sh
# fakecuda.sh -- `make check`: the CUDA backend's GPU tests on the fake
# runtime (tests/fakecuda/libcudart.so.13, fake_cudart.c), with or without
# a GPU: tests/test_backend_cuda as built, and tests/test_gpu_streams.c
# built with host kernels (tests/fakecuda/test_gpu_streams_host), and
# tests/fakecuda/test_cuda_faults (the runtime's refusals, injected).
#
#   - the fake defines, under the version node libcudart.so.13, every
#     cudart symbol the programs import (nm -D), so none of them can
#     resolve to the real runtime nor be missing at a call;
#   - each program runs with the fake's directory first on LD_LIBRARY_PATH
#     (the programs' RUNPATH to the toolkit comes after it) and LD_DEBUG=libs:
#     the loader's log of the program's own process must show the fake, and
#     no other libcudart, initialised.  (test_backend_cuda's stub-driver
#     child replaces its environment: it runs on the real runtime with the
#     toolkit's stub driver, as it does anywhere else.)
#   - a program fails this test when it fails, when it skips (77: the fake
#     gives it a device, so nothing may be skipped), when it leaves out a
#     case the fake models (its SKIP, "checks not run", "not checked" and
#     "no expandable context" lines; a toolkit without a stub driver is no
#     fault of the fake), or when the fake reports a violation (a kernel
#     that found its memory unmapped or freed, an unmap under queued work:
#     on a GPU, a fault or a silent corruption).
#
# The spin that keeps a stream busy is 50 ms here (BFC_GPU_SPIN_MS, unless
# set), not the 200 ms a GPU's launch and synchronisation latencies call
# for: on the fake the calls between a spin and the allocations it must
# outlast take microseconds to a few milliseconds, sanitizers included.  (A
# spin that ended too early would leave a case blind, not failing.)  That
# makes the stream test 4 s instead of 10.  The device has 512 MiB
# (FAKE_CUDA_MEM, unless set), not the fake's default 1 GiB:
# test_backend_cuda maps granules until the device is full, and the fake
# fills every mapped page, so its peak memory is about the device's (five
# times that under ThreadSanitizer).  BFC_GPU_NO_TRAP is ignored
# (the fake's trap has no sanitizer to upset); FAKE_CUDA_* variables of the
# caller's pass through (see fake_cudart.c), FAKE_CUDA_TRACE=path for one.
# Exit 77 when the build has no CUDA backend.
set -u
LC_ALL=C
export LC_ALL

top=${abs_top_builddir:-.}
if ! grep -q '^#define BFC_HAVE_CUDA 1' "$top/src/config.h" 2>/dev/null; then
    echo "fakecuda: built without CUDA: no CUDA backend to test"
    exit 77
fi
fakedir=$(cd "$top/tests/fakecuda" 2>/dev/null && pwd) || {
    echo "fakecuda: $top/tests/fakecuda does not exist (make check builds it)"
    exit 1
}
fake=$fakedir/libcudart.so.13
progs="tests/test_backend_cuda tests/fakecuda/test_gpu_streams_host tests/fakecuda/test_cuda_faults"
for p in $fake $progs; do
    case $p in /*) f=$p ;; *) f=$top/$p ;; esac
    [ -f "$f" ] || { echo "fakecuda: $f is not built (make check builds it)"; exit 1; }
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fakecuda.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
fail=0
unset BFC_GPU_NO_TRAP
BFC_GPU_SPIN_MS=${BFC_GPU_SPIN_MS:-50}
FAKE_CUDA_MEM=${FAKE_CUDA_MEM:-512M}
export BFC_GPU_SPIN_MS FAKE_CUDA_MEM

# ------------------------------------------------------------ symbols
if command -v nm >/dev/null 2>&1; then
    # name@@version (the default version) defines name@version.
    nm -D --defined-only "$fake" | awk '{print $3}' | sed 's/@@/@/' | sort -u >"$tmp/defined"
    for p in $progs; do
        nm -D --undefined-only "$top/$p" | awk '$2 ~ /^cuda/ {print $2}'
    done | sort -u >"$tmp/imported"
    missing=$(comm -23 "$tmp/imported" "$tmp/defined")
    if [ -n "$missing" ]; then
        echo "fakecuda: imported by the GPU tests but not defined by the fake (name@version):"
        echo "$missing" | sed 's/^/    /'
        fail=1
    else
        echo "fakecuda: the fake defines the $(wc -l <"$tmp/imported") cudart symbols the programs import"
    fi
else
    echo "fakecuda: no nm: the imported symbols are not checked"
fi

# --------------------------------------------------------------- runs
run() { # name program
    name=$1 prog=$2
    start=$(date +%s)
    (cd "$top" &&
        LD_LIBRARY_PATH="$fakedir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_DEBUG=libs \
            LD_DEBUG_OUTPUT="$tmp/ld" CK_VERBOSITY=normal exec "./$prog") >"$tmp/$name.out" 2>&1 &
    pid=$!
    wait $pid
    rc=$?
    echo "### $prog (exit $rc, $(($(date +%s) - start)) s)"
    cat "$tmp/$name.out"
    ld="$tmp/ld.$pid"
    if ! grep -q "calling init: $fake\$" "$ld" 2>/dev/null; then
        echo "fakecuda: $prog: the loader did not initialise $fake:"
        grep 'libcudart' "$ld" 2>/dev/null | sed 's/^/    /'
        fail=1
    elif grep 'calling init: .*libcudart' "$ld" | grep -v -q -F "$fake"; then
        echo "fakecuda: $prog: another libcudart was initialised beside the fake:"
        grep 'calling init: .*libcudart' "$ld" | sed 's/^/    /'
        fail=1
    fi
    case $rc in
        0) ;;
        77) echo "fakecuda: $prog skipped on the fake runtime, which gives it a device"; fail=1 ;;
        *) echo "fakecuda: $prog failed on the fake runtime (exit $rc)"; fail=1 ;;
    esac
    if grep -q 'FAKE_CUDA VIOLATION' "$tmp/$name.out"; then
        echo "fakecuda: $prog: the fake reported violations (above)"
        fail=1
    fi
    left=$(grep -E 'SKIP|checks not run|not checked|no expandable context' "$tmp/$name.out" |
        grep -v -e 'no stub libcuda found' -e 'FAKE_CUDA VIOLATION')
    if [ -n "$left" ]; then
        echo "fakecuda: $prog left out cases the fake models:"
        echo "$left" | sed 's/^/    /'
        fail=1
    fi
}

# The loader's log of the program's own process is checked: the children
# it starts (test_gpu_streams' sticky-error and destroy children, which
# cannot start on anything but the fake either) write logs of their own.
run backend_cuda tests/test_backend_cuda
run gpu_streams tests/fakecuda/test_gpu_streams_host
run cuda_faults tests/fakecuda/test_cuda_faults

[ $fail -eq 0 ] && echo "fakecuda: the GPU test programs passed on the fake runtime"
exit $fail
