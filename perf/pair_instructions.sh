#!/bin/sh
# pair_instructions.sh -- instructions per alloc+free pair on the fast path.
#
#   perf/pair_instructions.sh [PAIRS_PROGRAM] [N]
#
# Runs perf/pairs (see pairs.c) under callgrind twice, with N pairs
# (default 100000) and with none, and prints (Ir(N) - Ir(0)) / N: the
# instructions the library executes per pair, exact and repeatable.  Needs
# valgrind.  Run it from the build directory (make perf-instructions does).
set -eu
prog=${1:-./perf/pairs}
n=${2:-100000}
command -v valgrind >/dev/null 2>&1 || { echo "pair_instructions: valgrind is not installed" >&2; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ir() {
    valgrind --tool=callgrind --callgrind-out-file="$tmp/cg.$1" "$prog" "$1" > "$tmp/log.$1" 2>&1 ||
        { cat "$tmp/log.$1" >&2; exit 1; }
    sed -n 's/^==[0-9]*== Collected : \([0-9]*\).*/\1/p' "$tmp/log.$1"
}
base=$(ir 0)
full=$(ir "$n")
awk -v b="$base" -v f="$full" -v n="$n" 'BEGIN {
    printf "instructions per alloc+free pair: %.1f  (callgrind: %d pairs, %d vs %d instructions)\n", (f - b) / n, n, f, b }'
