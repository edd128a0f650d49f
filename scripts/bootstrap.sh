#!/usr/bin/env bash
# bootstrap.sh -- set up, build and run libshardbfc from a fresh clone.
#
#   scripts/bootstrap.sh demo    install what is missing, build, run the demo
#   scripts/bootstrap.sh check   install what is missing, build, run the tests
#
# Steps (each skipped when already done):
#   1. Debian packages: installed with apt-get only when dpkg-query says they
#      are absent (sudo is used only when not root).
#   2. ./autogen.sh when ./configure does not exist yet.
#   3. configure out of tree in build/ (re-used when build/Makefile exists;
#      extra configure switches come from $SHARDBFC_CONFIGURE_FLAGS, used only
#      when build/ is first configured).
#   4. make.
#   5. the demo, or `make check` followed by each test program's Check summary
#      line and the automake summary.  Exits non-zero when anything fails;
#      the logs of failing tests are printed in full.
set -euo pipefail

usage() {
    echo "usage: $0 demo|check" >&2
    exit 2
}

[ $# -eq 1 ] || usage
mode=$1
case "$mode" in
    demo | check) ;;
    *) usage ;;
esac

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
builddir="$top/build"
jobs=$(nproc 2>/dev/null || echo 2)

say() { printf '\n==> %s\n' "$*"; }

# ------------------------------------------------------------ 1. packages

packages=(
    build-essential
    autoconf
    automake
    libtool
    pkg-config
    liburcu-dev
    libjemalloc-dev
    libhwloc-dev
    check
    libjson-c-dev
    jq
    cflow
    graphviz
    gdb # test_hardening prints the stack of a fork child that hangs
    locales # test_obs builds de_DE.UTF-8 (a decimal comma) with localedef
)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -gt 0 ]; then
    say "installing missing packages: ${missing[*]}"
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "error: not root and sudo is not available; install as root: apt-get install ${missing[*]}" >&2
        exit 1
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "all required packages are installed"
fi

# -------------------------------------------------------- 2-4. build

cd "$top"
if [ ! -x configure ]; then
    say "generating ./configure (autogen.sh)"
    ./autogen.sh
fi

if [ -f config.status ]; then
    echo "error: the source tree itself is configured (./config.status exists);" >&2
    echo "       run 'make distclean' there first: this script builds in build/." >&2
    exit 1
fi

mkdir -p "$builddir"
if [ ! -f "$builddir/Makefile" ]; then
    say "configuring in build/ ${SHARDBFC_CONFIGURE_FLAGS:-}"
    # shellcheck disable=SC2086  # flags are meant to be split
    (cd "$builddir" && ../configure ${SHARDBFC_CONFIGURE_FLAGS:-})
else
    say "re-using build/ (remove it to configure afresh)"
fi

say "building (make -j$jobs)"
make -C "$builddir" -j"$jobs"

# ------------------------------------------------------------- 5. run

if [ "$mode" = demo ]; then
    say "running tools/shardbfc-demo"
    "$builddir/tools/shardbfc-demo"
    # The perf harness's default suite (~2 minutes; make perf runs the same).
    say "running perf/shardbfc-perf (default suite, about two minutes)"
    (cd "$builddir" && exec ./perf/shardbfc-perf --json perf-results.json --svg perf-results.svg)
    exit $?
fi

say "running the test suite (make check)"
status=0
make -C "$builddir" -j"$jobs" check || status=$?

say "Check summary of each test program"
shopt -s nullglob
for trs in "$builddir"/tests/*.trs; do
    log=${trs%.trs}.log
    name=$(basename "${trs%.trs}")
    result=$(sed -n 's/^:test-result: //p' "$trs" | head -n 1)
    lines=$(grep -E '^[0-9]+%: Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+' "$log" || true)
    if [ -n "$lines" ]; then
        while IFS= read -r l; do
            printf '  %-22s %-5s %s\n' "$name" "$result" "$l"
        done <<<"$lines"
    else
        # A skipped (77) or crashed program prints no Check summary: show
        # its last output line instead, which says why.
        last=$(grep -v '^\(PASS\|FAIL\|SKIP\|ERROR\|XFAIL\|XPASS\) ' "$log" | tail -n 1 || true)
        [ -n "$last" ] || last=$(tail -n 1 "$log")
        printf '  %-22s %-5s %s\n' "$name" "$result" "$last"
    fi
done

say "automake summary"
if [ -f "$builddir/test-suite.log" ]; then
    grep -E '^# (TOTAL|PASS|SKIP|XFAIL|FAIL|XPASS|ERROR):' "$builddir/test-suite.log" || true
fi

if [ "$status" -ne 0 ]; then
    for trs in "$builddir"/tests/*.trs; do
        if grep -qE '^:test-result: (FAIL|ERROR|XPASS)' "$trs"; then
            log=${trs%.trs}.log
            say "FAILED: $(basename "${trs%.trs}") -- full log ($log)"
            cat "$log"
        fi
    done
    say "make check failed (status $status)"
    exit "$status"
fi
say "all tests passed"
