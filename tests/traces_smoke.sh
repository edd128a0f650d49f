#!/bin/sh
# traces_smoke.sh -- `make check`: every trace under tests/traces/ (real
# PyTorch allocation logs, gzip-compressed) decompresses, matches its row in
# tests/traces/README.md (events and exact peak requested bytes, from
# scripts/trace_stats.sh, which also checks the trace's own consistency),
# and replays: tools/shardbfc-replay on the defaults exits 0, its own peak
# requested is the README's (two independent computations of the exact
# figure), and its overhead (peak reserved / peak requested) is at least 1,
# as it must be when no allocation failed.  One line per trace gives peak
# requested, peak reserved and overhead on the default configuration.  Then
# the overhead (peak reserved / the trace's exact peak requested) is printed
# for classic regions (vmm=off) and expandable arenas (vmm=auto, the
# default, on SIM), and the default's is checked against MAX_OVERHEAD: the
# target is 1.10; what every trace reaches today is 1.16 (decoder_gen,
# whose waste lies inside mapped granules).
#
# A trace with several streams is checked twice.  Under a memory limit of
# 1.05 x its exact peak requested it must replay with no failed
# allocation: at the limit, memory moves between the streams' shards as
# it would inside one allocator.  Without a limit, the free granules a
# shard keeps for its own churn (its slack) go as a loan to another
# shard's growth that would raise the peak reserved; its default overhead
# is held to MAX_OVERHEAD_STREAMS, the target (server2, whose streams swap
# a batch-16 and a batch-1 load: 1.012; server4 below: 1.031).
set -u

srcdir=${top_srcdir:-.}
dir="$srcdir/tests/traces"
readme="$dir/README.md"
replay=./tools/shardbfc-replay
stats="$srcdir/scripts/trace_stats.sh"
[ -x "$replay" ] || { echo "traces_smoke: $replay not built" >&2; exit 1; }
command -v gzip >/dev/null 2>&1 || { echo "traces_smoke: gzip is not installed" >&2; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/traces_smoke.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

MAX_OVERHEAD=${MAX_OVERHEAD:-1.16}
MAX_OVERHEAD_STREAMS=${MAX_OVERHEAD_STREAMS:-1.10}
failed=0
count=0
for gz in "$dir"/*.csv.gz; do
    [ -f "$gz" ] || continue
    name=$(basename "$gz")
    count=$((count + 1))
    csv="$tmp/${name%.gz}"
    if ! gzip -dc "$gz" >"$csv"; then
        echo "FAIL $name: does not decompress"
        failed=1
        continue
    fi
    # README row: | `NAME` | workload | batch | iterations | streams | events | peak | csv | gzip |
    row=$(grep -F "| \`$name\` |" "$readme" | head -n 1)
    want_events=$(printf '%s\n' "$row" | awk -F'|' '{gsub(/ /, "", $7); print $7}')
    want_peak=$(printf '%s\n' "$row" | awk -F'|' '{gsub(/ /, "", $8); print $8}')
    if [ -z "$row" ] || [ -z "$want_events" ]; then
        echo "FAIL $name: no row in tests/traces/README.md"
        failed=1
        continue
    fi
    got=$("$stats" "$csv") || { echo "FAIL $name: trace_stats.sh failed"; failed=1; continue; }
    echo "$got"
    events=$(printf '%s\n' "$got" | sed -n 's/.* events=\([0-9]*\).*/\1/p')
    peak=$(printf '%s\n' "$got" | sed -n 's/.* peak_requested=\([0-9]*\).*/\1/p')
    rows=$(($(wc -l <"$csv") - 1))
    if [ "$rows" != "$want_events" ] || [ "$events" != "$want_events" ]; then
        echo "FAIL $name: $rows rows, README says $want_events"
        failed=1
    fi
    if [ "$peak" != "$want_peak" ]; then
        echo "FAIL $name: peak requested $peak, README says $want_peak"
        failed=1
    fi
    case "$got" in
        *" unmatched_frees=0 size_mismatches=0 double_allocs=0") ;;
        *) echo "FAIL $name: the trace is inconsistent"; failed=1 ;;
    esac
    if ! "$replay" "$csv" >"$tmp/out.txt" 2>&1; then
        echo "FAIL $name: shardbfc-replay exited non-zero:"
        cat "$tmp/out.txt"
        failed=1
        continue
    fi
    cat "$tmp/out.txt"
    # config, peak_requested, peak_reserved, peak_allocated, overhead, frag, ooms, ...
    line=$(awk '$1 == "(defaults)" {print $2, $3, $5, $7}' "$tmp/out.txt")
    set -- $line
    if [ $# -ne 4 ]; then
        echo "FAIL $name: no (defaults) row in the replay's table"
        failed=1
        continue
    fi
    echo "measures $name: peak_requested=$1 peak_reserved=$2 overhead=$3"
    if [ "$1" != "$want_peak" ]; then
        echo "FAIL $name: the replay's peak requested $1, README says $want_peak"
        failed=1
    fi
    if [ "$4" != 0 ] || ! awk -v o="$3" 'BEGIN {exit !(o + 0 >= 1)}'; then
        echo "FAIL $name: overhead $3 below 1 with $4 failed allocations"
        failed=1
    fi
    streams=$(printf '%s\n' "$got" | sed -n 's/.* streams=\([0-9]*\).*/\1/p')
    max=$MAX_OVERHEAD
    if [ "${streams:-1}" -gt 1 ]; then
        max=$MAX_OVERHEAD_STREAMS
        limit=$(awk -v p="$peak" 'BEGIN {printf "%d", p * 1.05}')
        if ! "$replay" --config "memory_limit=$limit" "$csv" >"$tmp/lim.txt" 2>&1; then
            echo "FAIL $name: shardbfc-replay under memory_limit=$limit exited non-zero"
            failed=1
        else
            # config, peak_requested, peak_reserved, peak_allocated, overhead, frag, ooms
            ooms=$(awk -v c="memory_limit=$limit" '$1 == c {print $7}' "$tmp/lim.txt")
            echo "$name: under memory_limit=$limit (1.05 x peak requested): $ooms failed allocations"
            if [ "$ooms" != 0 ]; then
                cat "$tmp/lim.txt"
                echo "FAIL $name: $streams streams need more than 1.05 x their peak requested"
                failed=1
            fi
        fi
    fi
    if ! "$replay" --json --compare vmm=off vmm=auto "$csv" >"$tmp/cmp.json" 2>/dev/null; then
        echo "FAIL $name: shardbfc-replay --compare exited non-zero"
        failed=1
        continue
    fi
    # One object per configuration: "config":"...","peak_reserved":N,...
    line=$(tr '{' '\n' <"$tmp/cmp.json" | awk -F'[,:]' -v peak="$peak" -v max="$max" '
        /"config"/ {
            for (i = 1; i < NF; i++) if ($i == "\"peak_reserved\"") r = $(i + 1)
            c = $2; gsub(/"/, "", c)
            o = r / peak
            out = out sprintf(" %s=%.3f", c, o)
            if (c == "vmm=auto" && o > max) bad = 1
        }
        END { printf "overhead%s%s\n", out, bad ? " ABOVE" : "" }')
    echo "$name: $line"
    case "$line" in
        *ABOVE*) echo "FAIL $name: overhead with the defaults above $max"; failed=1 ;;
    esac
done
# Four streams: server2 and a copy of it half a run later on streams 0x3
# and 0x4 (threads, times and addresses moved apart).  Under a limit of 1.05
# x its exact peak requested it must replay with no failed allocation: no
# higher limit than one shared arena needs (which is more than the peak).
if [ -f "$dir/server2.csv.gz" ] && gzip -dc "$dir/server2.csv.gz" >"$tmp/s2.csv"; then
    half=$(awk -F, 'NR > 1 && $2 > m {m = $2} END {printf "%d", m / 2}' "$tmp/s2.csv")
    {
        head -n 1 "$tmp/s2.csv"
        {
            tail -n +2 "$tmp/s2.csv"
            tail -n +2 "$tmp/s2.csv" | awk -F, -v OFS=, -v sh="$half" \
                '{ $1 = $1 + 100; $2 = sprintf("%.0f", $2 + sh); sub(/^0x/, "0x1", $4); $6 = ($6 == "0x1") ? "0x3" : "0x4"; print }'
        } | sort -t, -k2,2n
    } >"$tmp/server4.csv"
    got=$("$stats" "$tmp/server4.csv") || { echo "FAIL server4: trace_stats.sh failed"; failed=1; got=""; }
    peak=$(printf '%s\n' "$got" | sed -n 's/.* peak_requested=\([0-9]*\).*/\1/p')
    if [ -n "$peak" ]; then
        limit=$(awk -v p="$peak" 'BEGIN {printf "%d", p * 1.05}')
        "$replay" --config "memory_limit=$limit" "$tmp/server4.csv" >"$tmp/lim.txt" 2>&1
        ooms=$(awk -v c="memory_limit=$limit" '$1 == c {print $7}' "$tmp/lim.txt")
        echo "server4 (server2 twice, half a run apart, 4 streams): peak_requested=$peak;" \
            "under memory_limit=$limit: ${ooms:-no result} failed allocations"
        if [ "$ooms" != 0 ]; then
            cat "$tmp/lim.txt"
            echo "FAIL server4: 4 streams need more than 1.05 x their peak requested"
            failed=1
        fi
        # (defaults): peak_requested, peak_reserved, peak_allocated, overhead, frag, ooms
        "$replay" "$tmp/server4.csv" >"$tmp/def.txt" 2>&1
        ovh=$(awk '$1 == "(defaults)" {print $5}' "$tmp/def.txt")
        echo "server4: overhead ${ovh:-no result} on the defaults"
        if [ -z "$ovh" ] || ! awk -v o="$ovh" -v m="$MAX_OVERHEAD_STREAMS" 'BEGIN {exit !(o + 0 <= m + 0)}'; then
            cat "$tmp/def.txt"
            echo "FAIL server4: overhead ${ovh:-?} above $MAX_OVERHEAD_STREAMS on the defaults"
            failed=1
        fi
    fi
fi
if [ "$count" -eq 0 ]; then
    echo "traces_smoke: no traces under $dir" >&2
    exit 1
fi
[ "$failed" -eq 0 ] && echo "traces_smoke: $count traces replayed"
exit "$failed"
