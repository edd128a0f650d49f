#!/bin/sh
# pair_instructions.sh -- instructions per alloc+free pair on the fast path.
#
#   perf/pair_instructions.sh [PAIRS_PROGRAM] [N]
#
# Runs perf/pairs (see pairs.c) under callgrind twice, with N pairs
# (default 100000) and with none, and prints (Ir(N) - Ir(0)) / N: the
# instructions per pair, exact and repeatable.  That whole-loop figure
# includes the program's own step (its random index, the array load, the
# calls); the line after it splits off what runs inside the library: the
# inclusive cost of bfc_ctx_alloc and of bfc_ctx_free per call.  Needs
# valgrind (callgrind_annotate for the split).  Run it from the build
# directory (make perf-instructions does).
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
# Inclusive instructions of one API function in a callgrind profile.
incl() {
    # From a directory of its own: callgrind_annotate shortens file names
    # under the current directory, and then misses the inlined callees.
    (cd "$tmp" && callgrind_annotate --inclusive=yes --auto=no --threshold=100 "cg.$1" 2>/dev/null) |
        sed -n "s/^ *\([0-9,]*\) .*:$2 \[.*/\1/p" | tr -d , | head -1
}
base=$(ir 0)
full=$(ir "$n")
awk -v b="$base" -v f="$full" -v n="$n" 'BEGIN {
    printf "instructions per alloc+free pair: %.1f  (callgrind: %d pairs, %d vs %d instructions)\n", (f - b) / n, n, f, b }'
command -v callgrind_annotate >/dev/null 2>&1 || exit 0
a0=$(incl 0 bfc_ctx_alloc); a1=$(incl "$n" bfc_ctx_alloc)
f0=$(incl 0 bfc_ctx_free); f1=$(incl "$n" bfc_ctx_free)
[ -n "$a0" ] && [ -n "$a1" ] && [ -n "$f0" ] && [ -n "$f1" ] || { echo "pair_instructions: no split (callgrind_annotate found no bfc_ctx_alloc/free)" >&2; exit 0; }
awk -v a0="$a0" -v a1="$a1" -v f0="$f0" -v f1="$f1" -v n="$n" 'BEGIN {
    a = (a1 - a0) / n; f = (f1 - f0) / n
    printf "  inside the library: %.1f  (bfc_ctx_alloc %.1f + bfc_ctx_free %.1f, inclusive)\n", a + f, a, f }'
