#!/bin/sh
# trace_stats.sh -- exact figures of an allocation trace (doc/trace.md's CSV,
# plain or .gz): events, allocations, frees, streams, and the peak of
# requested bytes, the sum of the sizes of live blocks taken in time order
# (rows sorted by Time, file order among equal times; a free counts only
# when its pointer is live; an allocation of a live pointer replaces it).  Columns are found by name in the header.
#
#   scripts/trace_stats.sh TRACE[.gz]...
#
# One line per trace:
#   NAME events=N allocs=N frees=N streams=N peak_requested=BYTES live_at_end=BYTES
#        unmatched_frees=N size_mismatches=N double_allocs=N
# The last three count rows that break the trace's own consistency: a free
# of a pointer that is not live, a free whose Size is not its allocation's,
# an allocation of a pointer that is already live (0 in a sound trace).
set -eu

[ $# -ge 1 ] || { echo "usage: $0 TRACE..." >&2; exit 2; }
for f in "$@"; do
    case "$f" in
        *.gz) cat_cmd="gzip -dc" ;;
        *) cat_cmd="cat" ;;
    esac
    $cat_cmd "$f" | awk -F, -v name="$(basename "$f")" '
        NR == 1 {
            for (i = 1; i <= NF; i++) col[$i] = i
            if (!("Action" in col) || !("Pointer" in col) || !("Size" in col)) {
                print name ": header lacks Action, Pointer or Size" > "/dev/stderr"
                bad = 1
                exit 1
            }
            next
        }
        { t = ("Time" in col) ? $col["Time"] : 0; print t "," NR "," $col["Action"] "," $col["Pointer"] "," $col["Size"] "," (("Stream" in col) ? $col["Stream"] : "0x0") }
        END { if (bad) exit 1 }
    ' | sort -t, -k1,1n -k2,2n | awk -F, -v name="$(basename "$f")" '
        {
            n++
            if ($3 == "allocate") {
                a++
                if ($4 in live) { dup++; cur -= live[$4] }
                live[$4] = $5; cur += $5; if (cur > peak) peak = cur
                s[$6] = 1
            } else if ($3 == "free") {
                fr++
                if ($4 in live) {
                    if (live[$4] != $5) sizes++
                    cur -= live[$4]; delete live[$4]
                } else {
                    unmatched++
                }
            }
        }
        END {
            ns = 0; for (k in s) ns++
            printf "%s events=%d allocs=%d frees=%d streams=%d peak_requested=%.0f live_at_end=%.0f unmatched_frees=%d size_mismatches=%d double_allocs=%d\n",
                name, n, a, fr, ns, peak, cur, unmatched, sizes, dup
        }'
done
