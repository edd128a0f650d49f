#!/bin/sh
# tools.sh -- `make check`: the command-line tools of the build tree on
# crafted inputs (their installed copies are tried by tests/install.sh).
#
#   shardbfc-replay  a table it could not write (stdout closed) is exit 1;
#                    a trace whose free comes before its allocation: the
#                    table's skipped column counts it and stderr warns; a
#                    misspelt --config key is named with the reason;
#                    per-thread batches out of time order are replayed in
#                    time order (nothing skipped); a two-stream trace's
#                    measures (peak requested, reserved, allocated,
#                    overhead) equal figures worked out by hand; --json
#                    stays a list when a configuration is refused and
#                    when a spec holds bytes that are not UTF-8; signed
#                    or white-space-led numbers are malformed rows, and
#                    live sizes past 2^64 - 1 an error, not a wrapped sum;
#                    a gzip-compressed trace is named so, a NUL byte is
#                    an error; a TRACE of - reads standard input;
#   shardbfc-stat    --help / -h, an unknown option is a usage error (not a
#                    file name), a missing file is exit 1, and so is a
#                    report it could not write (stdout closed, /dev/full),
#                    and a file shaped wrong (no version, a shard that is
#                    not an object, regions that are not an array, a
#                    leading zero, a fragmentation past 1); strings are
#                    printed without their control characters;
#   shardbfc-view    --help, a missing -o and an unknown option are usage
#                    errors; a bad snapshot is exit 1 and leaves what -o
#                    names as it was (an older page, a device), a good one
#                    writes the page; a page it could not write is exit 1.
set -u

fail() { echo "tools.sh: $*" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/shardbfc-tools.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
replay=./tools/shardbfc-replay stat=./tools/shardbfc-stat view=./tools/shardbfc-view
# replay_ok WHAT ARGS...: replay --json ARGS into $tmp/out (stderr in
# $tmp/err), failing the test with WHAT when the replay fails.
replay_ok() {
    what=$1
    shift
    "$replay" --json "$@" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/out" "$tmp/err" >&2; fail "$what"; }
}
for t in "$replay" "$stat" "$view"; do [ -x "$t" ] || fail "$t not built"; done

# ----------------------------------------------------------- replay
# Thread 1's rows are out of time order (an edited file), so the file order
# is kept, and the free of 0x1000 comes before its allocation.
cat > "$tmp/bad.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,50,free,0x1000,4096,0x0
1,10,allocate,0x1000,4096,0x0
1,60,allocate,0x2000,8192,0x0
1,70,free,0x2000,8192,0x0
CSV
"$replay" "$tmp/bad.csv" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/out" "$tmp/err" >&2; fail "replay failed"; }
"$replay" "$tmp/bad.csv" >&- 2>/dev/null
[ $? -eq 1 ] || fail "shardbfc-replay with its output closed does not exit 1"
grep -q 'skipped' "$tmp/out" || fail "no skipped column: $(cat "$tmp/out")"
# config, peak_requested, peak_reserved, peak_allocated, overhead, frag, ooms, skipped, seconds
awk '$1 == "(defaults)" && $8 == 1 {ok = 1} END {exit !ok}' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "the table does not show 1 skipped event"; }
grep -q 'warning: 1 free of pointers no earlier allocate row returned was skipped' "$tmp/err" ||
    { cat "$tmp/err" >&2; fail "no warning about the skipped free"; }
grep -q 'in file order' "$tmp/out" || fail "the table does not say the file order was kept"
"$replay" --json "$tmp/bad.csv" 2>/dev/null | grep -q '"skipped":1,"unmatched_frees":1' ||
    fail "--json lacks skipped/unmatched_frees"

# Two threads' batches, out of order across threads only: time order, so
# every free matches and there is no warning.
cat > "$tmp/batches.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,10,allocate,0x1000,1048576,0x0
1,40,free,0x1000,1048576,0x0
2,20,allocate,0x2000,2097152,0x0
2,45,free,0x2000,2097152,0x0
CSV
"$replay" "$tmp/batches.csv" >"$tmp/out" 2>"$tmp/err" || fail "replay of batches failed"
[ ! -s "$tmp/err" ] || { cat "$tmp/err" >&2; fail "a warning for a well-formed trace"; }
awk '$1 == "(defaults)" && $2 == 3145728 && $4 == 3145728 && $8 == 0 {ok = 1} END {exit !ok}' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "batches not replayed in time order (peak requested and allocated should be 3 MiB)"; }

# The measures on a trace whose figures are known by hand.  Requested, live:
# 1000, 4000, 3000, 8000 (the peak), 3000, 0.  Allocated (256-byte chunks):
# 1024 + 3072, then 3072 + 5120 = 8192 at the peak, although the two
# streams' shards peak at 4096 and 5120 (their sum, 9216, is only a bound).
# Reserved: a 2 MiB region for each stream.  overhead = 4 MiB / 8000.
cat > "$tmp/measures.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,10,allocate,0x1000,1000,0x1
1,20,allocate,0x2000,3000,0x1
1,30,free,0x1000,1000,0x1
2,40,allocate,0x3000,5000,0x2
2,50,free,0x3000,5000,0x2
1,60,free,0x2000,3000,0x1
CSV
replay_ok "replay of measures.csv failed" "$tmp/measures.csv"
grep -q '"peak_requested":8000,"peak_reserved":4194304,"peak_allocated":8192,"overhead":524.288000,' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "measures of measures.csv wrong"; }
"$replay" --compare memory_limit=1G "allow_growth=false,memory_limit=64M" "$tmp/measures.csv" >"$tmp/out" 2>&1 ||
    { cat "$tmp/out" >&2; fail "--compare of measures.csv failed"; }
# The trace's peak requested is the same for every configuration.
[ "$(awk '$2 == 8000' "$tmp/out" | wc -l)" -eq 2 ] || { cat "$tmp/out" >&2; fail "peak_requested differs by configuration"; }

# Fragmentation is read at each new peak of allocated bytes, and the JSON
# names its largest so: here 0.25 at the peak (A, C and D live in a 2 MiB
# region: 1 MiB free, the largest piece 768 KiB), although after "free A"
# it is 1 - 1.25 MiB / 1.75 MiB = 0.286, which no peak sees.
cat > "$tmp/frag.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,10,allocate,0x1000,262144,0x10
1,20,allocate,0x2000,262144,0x10
1,30,allocate,0x3000,262144,0x10
1,40,free,0x2000,262144,0x10
1,50,allocate,0x4000,524288,0x10
1,60,free,0x4000,524288,0x10
1,65,allocate,0x5000,256,0x10
1,70,free,0x1000,262144,0x10
1,80,free,0x3000,262144,0x10
1,90,free,0x5000,256,0x10
CSV
replay_ok "replay of frag.csv failed" --config vmm=off "$tmp/frag.csv"
grep -q '"fragmentation":0.250000,"fragmentation_max_at_peaks":0.250000,' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "fragmentation at the peaks of frag.csv wrong"; }

# A TRACE of - reads standard input: the same table.
"$replay" "$tmp/batches.csv" >"$tmp/file.out" 2>&1 || fail "replay of batches.csv failed"
"$replay" - <"$tmp/batches.csv" >"$tmp/stdin.out" 2>&1 || { cat "$tmp/stdin.out" >&2; fail "replay of - failed"; }
sed 's/ *[0-9.]*$//' "$tmp/file.out" >"$tmp/file.cut"; sed 's/ *[0-9.]*$//' "$tmp/stdin.out" >"$tmp/stdin.cut"
cmp -s "$tmp/file.cut" "$tmp/stdin.cut" || { diff "$tmp/file.cut" "$tmp/stdin.cut" >&2; fail "replay of - differs from the file's"; }

# A trace still gzip-compressed (as tests/traces keeps them) is named so.
gzip -c "$tmp/batches.csv" >"$tmp/batches.csv.gz" || fail "gzip failed"
"$replay" "$tmp/batches.csv.gz" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "a gzip-compressed trace does not exit 1"
grep -q "gzip-compressed; gunzip it first" "$tmp/err" || { cat "$tmp/err" >&2; fail "a gzip-compressed trace not explained"; }

# A NUL byte in a row is an error, not the end of its field.
printf 'Thread,Time,Action,Pointer,Size\n1,1,allocate,0x10,40\00096\n' >"$tmp/nul.csv"
"$replay" "$tmp/nul.csv" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "a trace with a NUL byte does not exit 1"
grep -q "nul.csv:2: a NUL byte" "$tmp/err" || { cat "$tmp/err" >&2; fail "a trace with a NUL byte not explained"; }

# A bad SPEC, anywhere in a comparison, stops the replay before any run:
# exit 1, the reason on stderr, and no table (with a row missing) on stdout.
# refused WHAT REASON ARG...
refused() {
    what=$1 reason=$2
    shift 2
    "$replay" "$@" "$tmp/batches.csv" >"$tmp/out" 2>"$tmp/err"
    [ $? -eq 1 ] || fail "$what does not exit 1"
    [ ! -s "$tmp/out" ] || { cat "$tmp/out" >&2; fail "$what still printed a table"; }
    grep -q "$reason" "$tmp/err" || { cat "$tmp/err" >&2; fail "$what not explained"; }
}
refused "a bad --config" "memory_limt=1G: unknown key 'memory_limt'" --config memory_limt=1G
refused "a bad --compare SPEC" "unknown key 'memory_limt'" --compare vmm=off memory_limt=1G
refused "a --compare SPEC whose settings conflict" "vmm=on,allow_growth=false: vmm=on needs allow_growth=true" \
    --compare vmm=off vmm=on,allow_growth=false
# What only a context refuses (vmm=on and a limit without a granule), before
# the table too, with its SPEC named.
refused "a SPEC that no context can run" "memory_limit=1M,vmm=on: bfc_ctx_create refused it: .*granule" \
    --compare vmm=off memory_limit=1M,vmm=on
refused "an oom_dump= path that cannot be written" \
    "vmm=on,oom_dump=/nonexistent/x.json: bfc_ctx_create refused it: its oom_dump= path cannot be written" \
    --compare vmm=off vmm=on,oom_dump=/nonexistent/x.json

# retry_ms, trace= and backend=cuda in a SPEC are not used by a replay (one
# thread would only wait; --trace-out traces it; it runs on SIM): said on
# stderr, and a retry_ms of an hour costs nothing on a trace whose
# allocation fails for want of room (2 MiB with 1 MiB live in a 2 MiB
# limit; one larger than the limit would be refused before any wait).
timeout 30 "$replay" --config memory_limit=2M,retry_ms=3600000,trace=/nonexistent/t.csv,backend=cuda \
    "$tmp/batches.csv" >"$tmp/out" 2>"$tmp/err"
rs=$?
[ $rs -eq 0 ] || { cat "$tmp/out" "$tmp/err" >&2; fail "a replay with retry_ms=3600000 failed or hung ($rs)"; }
grep -q 'retry_ms is not used' "$tmp/err" && grep -q 'trace= is not used' "$tmp/err" &&
    grep -q 'backend=cuda is not used' "$tmp/err" ||
    { cat "$tmp/err" >&2; fail "replay drops retry_ms, trace= or backend=cuda without a word"; }

# A trace naming more streams than a run serves is refused before the
# table (every run failed after its header); an unknown single-dash option
# is a usage error, not a file name.
{
    echo "Thread,Time,Action,Pointer,Size,Stream"
    i=1
    while [ $i -le 2048 ]; do
        printf '1,%d,allocate,0x%x000,256,0x%x\n' $i $i $((i + 16))
        i=$((i + 1))
    done
} > "$tmp/streams.csv"
"$replay" "$tmp/streams.csv" >"$tmp/out" 2>"$tmp/err"
rs=$?
[ $rs -eq 1 ] && [ ! -s "$tmp/out" ] && grep -q 'names 2048 streams; a replay serves at most 2047' "$tmp/err" ||
    { cat "$tmp/out" "$tmp/err" >&2; fail "a trace of 2,048 streams: exit $rs, not refused before the table"; }
# 2,047 streams, and frees the replay skips (a nil pointer, a pointer no
# row allocated) on two more: they make no stream, so the trace runs.
{
    sed '$d' "$tmp/streams.csv"
    echo "1,5000,free,0x0,0,0x99999"
    echo "1,5001,free,0x77777000,256,0x99998"
} > "$tmp/streams2047.csv"
"$replay" --config vmm=off "$tmp/streams2047.csv" >"$tmp/out" 2>"$tmp/err" ||
    { cat "$tmp/err" >&2; fail "a trace of 2,047 streams was not replayed"; }
"$replay" -x "$tmp/batches.csv" >/dev/null 2>&1
rs=$?
[ $rs -eq 2 ] || fail "shardbfc-replay -x: exit $rs, not 2 (usage)"
"$replay" -x >/dev/null 2>&1
rs=$?
[ $rs -eq 2 ] || fail "shardbfc-replay -x alone: exit $rs, not 2 (usage)"
# Equal times within one thread are in order: the trace is replayed in time
# order (thread 2's block, at 5, is live when thread 1's comes at 10), not
# in file order (which would never hold both).
cat > "$tmp/ties.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,10,allocate,0x1000000,1048576,0x0
1,10,free,0x1000000,1048576,0x0
2,5,allocate,0x2000000,2097152,0x0
2,50,free,0x2000000,2097152,0x0
CSV
replay_ok "a trace with equal times in one thread was not replayed" "$tmp/ties.csv"
grep -q '"peak_requested": *3145728' "$tmp/out" ||
    { cat "$tmp/out" "$tmp/err" >&2; fail "equal times in one thread: not replayed in time order"; }

# The per-thread default stream's handle (0x2) is each thread's own stream:
# two threads' blocks on it are two shards (a region each), not one.
cat > "$tmp/perthread.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
11,100,allocate,0x1000000,1048576,0x2
11,200,free,0x1000000,1048576,0x2
12,300,allocate,0x2000000,1048576,0x2
12,400,free,0x2000000,1048576,0x2
CSV
replay_ok "replay of perthread.csv failed" --config vmm=off "$tmp/perthread.csv"
grep -q '"peak_reserved":4194304' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "two threads' per-thread streams were replayed as one stream"; }

# A trace with no events (the header alone) is a valid, empty trace: one
# row of zeros, exit 0 (its sort copied from a NULL array, which UBSan
# builds stop on).
printf 'Thread,Time,Action,Pointer,Size,Stream\n' >"$tmp/header.csv"
replay_ok "replay of a trace with no events failed" "$tmp/header.csv"
grep -q '"peak_requested":0' "$tmp/out" || { cat "$tmp/out" >&2; fail "an empty trace's peak is not 0"; }

# --json stays JSON when a run fails (exit 1, the reason on stderr): a
# trace the replay cannot write leaves an empty list, not a stray bracket
# or comma; a configuration the context refuses is refused before any run,
# with nothing on stdout.  A spec's bytes that are not UTF-8 (an oom_dump
# path) are written as U+FFFD.
"$replay" --json --trace-out /nonexistent/dir/t.csv "$tmp/header.csv" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "replay whose trace cannot be written does not exit 1"
grep -q 'bfc_ctx_trace_start(/nonexistent/dir/t.csv)' "$tmp/err" || { cat "$tmp/err" >&2; fail "replay does not say why the run failed"; }
[ "$(tr -d '\n' <"$tmp/out")" = '[]' ] || { cat "$tmp/out" >&2; fail "--json after a failed run is not a list"; }
"$replay" --json --compare memory_limit=1M,vmm=on vmm=off "$tmp/header.csv" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || fail "replay with a configuration the context refuses does not exit 1"
grep -q 'memory_limit=1M,vmm=on' "$tmp/err" || { cat "$tmp/err" >&2; fail "replay does not name the refused configuration"; }
[ ! -s "$tmp/out" ] || { cat "$tmp/out" >&2; fail "replay ran configurations beside one the context refuses"; }
replay_ok "replay with a non-UTF-8 oom_dump path failed" --config "oom_dump=$tmp/$(printf 'a\377b\303\251').json" "$tmp/header.csv"
grep -q "a\\\\ufffdb$(printf '\303\251').json\"" "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "--json copies a spec's non-UTF-8 bytes raw"; }

# Numbers are digits: a size after a vertical tab with a sign (strtoull
# skips the one and takes the other), a signed H:M:S time, and an hour past
# what 64-bit ns hold are malformed rows, not huge values; live sizes whose
# sum passes 2^64 - 1 are refused, not wrapped.
hdr='Thread,Time,Action,Pointer,Size,Stream'
printf '%s\n1,10,allocate,0x1000,\v-5,0x0\n' "$hdr" >"$tmp/vt.csv"
printf '%s\n1,-1:00:00,allocate,0x1000,100,0x0\n' "$hdr" >"$tmp/negtime.csv"
printf '%s\n1,9999999:00:00,allocate,0x1000,100,0x0\n' "$hdr" >"$tmp/bighour.csv"
printf '%s\n1,01:02:03.,allocate,0x1000,100,0x0\n' "$hdr" >"$tmp/nofrac.csv"
for f in vt:Size negtime:Time bighour:Time nofrac:Time; do
    "$replay" "$tmp/${f%%:*}.csv" >/dev/null 2>"$tmp/err"
    [ $? -eq 1 ] || fail "replay of ${f%%:*}.csv does not exit 1"
    grep -q "malformed ${f#*:}" "$tmp/err" || { cat "$tmp/err" >&2; fail "${f%%:*}.csv: no malformed ${f#*:}"; }
done
printf '%s\n1,01:02:03.5,allocate,0x1000,100,0x0\n1,01:02:04,free,0x1000,100,0x0\n' "$hdr" >"$tmp/hms.csv"
replay_ok "replay of an H:M:S trace failed" "$tmp/hms.csv"
grep -q '"peak_requested":100,' "$tmp/out" || { cat "$tmp/out" >&2; fail "an H:M:S trace's peak is not 100"; }
printf '%s\n1,10,allocate,0x1000,9223372036854775808,0x0\n1,11,allocate,0x2000,9223372036854775808,0x0\n' "$hdr" >"$tmp/wrap.csv"
"$replay" --json "$tmp/wrap.csv" >"$tmp/out" 2>"$tmp/err"
[ $? -eq 1 ] || { cat "$tmp/out" >&2; fail "replay of live sizes past 2^64 does not exit 1"; }
grep -q 'pass 2^64' "$tmp/err" || { cat "$tmp/err" >&2; fail "replay does not say the live sizes pass 2^64"; }

# -------------------------------------------------------------- stat
# An expandable shard's free figures in the OOM report are bounds, and are
# printed as such, with the exact largest block it could take unmapped; a
# classic shard's are exact.
cat >"$tmp/oom.json" <<'JSON'
{"version":2,"backend":"sim","shards":[],"oom":{"size":4194304,"rounded":4194304,"stream":"0x10",
 "cause":"fragmented","diagnosis":"d","shards":[
 {"stream_id":1,"stream":"0x10","requesting":true,"retired":false,"expandable":true,"free":3145728,
  "largest_free":2097152,"largest_ready":1048576,"pending":0,"in_use":1048576,"reserved":4194304},
 {"stream_id":2,"stream":"0x20","requesting":false,"retired":false,"expandable":false,"free":524288,
  "largest_free":262144,"largest_ready":262144,"pending":0,"in_use":0,"reserved":524288},
 {"stream_id":1,"stream":"0x10","requesting":false,"retired":true,"expandable":false,"free":0,
  "largest_free":0,"largest_ready":0,"pending":0,"in_use":1024,"reserved":1024}],"pool_spans":[]}}
JSON
"$stat" "$tmp/oom.json" >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; fail "shardbfc-stat on an OOM report failed"; }
# An input without totals or pool says so, rather than print zeros as figures.
grep -q '^Totals: (not in the input)' "$tmp/out" || { cat "$tmp/out" >&2; fail "stat prints totals it was not given"; }
grep -q '^Pool: (not in the input)' "$tmp/out" || { cat "$tmp/out" >&2; fail "stat prints a pool it was not given"; }
# Nor a figure it was not given: the device and limit, and the OOM report's
# limit and pool figures, which this input leaves out, read '?'.
grep -q '^libshardbfc snapshot v2: backend sim, device ?, limit ?, 0 shards' "$tmp/out" &&
    grep -q '^  limit ?, reserved ?, unreserved ?, in use ?, pending ?$' "$tmp/out" &&
    grep -q '^  pool: ? free in ? spans, largest ?, fenced ?$' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "stat prints figures it was not given as zeros"; }
printf '%s\n' '{"version":2,"backend":"sim","totals":{"bytes_in_use":5},"shards":[{"stream_id":1,"stream":"0x1",' \
    '"stats":{},"regions":[{"base":"0x100","size":512,"chunks":[{"offset":0,"size":512,"state":"in_use"}]}]}]}' \
    >"$tmp/sparse.json"
"$stat" "$tmp/sparse.json" >"$tmp/sparse.out" 2>&1 || { cat "$tmp/sparse.out" >&2; fail "shardbfc-stat on a sparse snapshot failed"; }
grep -q '^  allocated 5 (peak ?), requested ? (peak ?),' "$tmp/sparse.out" &&
    grep -q 'fragmentation ?, pending ? blocks' "$tmp/sparse.out" &&
    grep -q '^    Chunk +0 size 512 in_use requested ? id ?$' "$tmp/sparse.out" ||
    { cat "$tmp/sparse.out" >&2; fail "stat prints a sparse snapshot's missing figures as numbers"; }
# An allocation id is printed exactly, also above 2^53, where a double
# would round it (9007199254740993 would read ...992).
printf '%s\n' '{"version":2,"backend":"sim","shards":[{"stream_id":1,"stream":"0x1","stats":{},"regions":[' \
    '{"base":"0x100","size":512,"chunks":[{"offset":0,"size":512,"state":"in_use","requested":500,' \
    '"allocation_id":9007199254740993}]}]}]}' >"$tmp/bigid.json"
"$stat" "$tmp/bigid.json" >"$tmp/bigid.out" 2>&1 && grep -q '^    Chunk +0 size 512 in_use requested 500 id 9007199254740993$' "$tmp/bigid.out" ||
    { cat "$tmp/bigid.out" >&2; fail "stat does not print an allocation id above 2^53 exactly"; }
grep -q 'stream=0x10 (requesting): mapped free <= 3145728 (bound), largest mapped free piece <= 2097152 (bound), largest block without a map 1048576,' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat prints an expandable shard's bounds as exact figures"; }
grep -q 'stream=0x20: free 524288, largest free chunk 262144,' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat misprints a classic shard's free figures"; }
# A retired shard has its successor's stream: its line says which it is.
grep -q 'stream=0x10 (retired): free 0, largest free chunk 0, pending 0, in use 1024,' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat's OOM report does not mark a retired shard"; }
[ "$(grep -c 'stream=0x10 (requesting):' "$tmp/out")" -eq 1 ] ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat's OOM report marks a retired shard as the requesting one"; }
# The report comes first (after the one-line header), before the totals.
oom_line=$(grep -n '^Out of memory' "$tmp/out" | head -1 | cut -d: -f1)
tot_line=$(grep -n '^Totals:' "$tmp/out" | head -1 | cut -d: -f1)
[ -n "$oom_line" ] && [ -n "$tot_line" ] && [ "$oom_line" -lt "$tot_line" ] ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat does not print the OOM report first"; }

"$stat" --help >"$tmp/out" 2>&1 || fail "shardbfc-stat --help exits non-zero"
grep -q '^usage: shardbfc-stat' "$tmp/out" || fail "shardbfc-stat --help prints no usage"
"$stat" --bogus >/dev/null 2>&1
[ $? -eq 2 ] || fail "shardbfc-stat --bogus is not a usage error"
"$stat" "$tmp/none.json" >/dev/null 2>&1
[ $? -eq 1 ] || fail "shardbfc-stat on a missing file does not exit 1"
printf '{"version":1,"backend":"sim","shards":[]}\n' >"$tmp/empty.json"
"$stat" "$tmp/empty.json" >"$tmp/out" 2>&1 || fail "shardbfc-stat on a snapshot with no shards fails"
grep -q '0 shards' "$tmp/out" || fail "shardbfc-stat: $(cat "$tmp/out")"
# A version 1 snapshot's context peaks were bounds under their bare names
# (the sum of the shards' peaks): printed as bounds (the figures it leaves
# out as ?); a version this tool does not know is said on stderr.
printf '{"version":1,"backend":"sim","totals":{"peak_bytes_in_use":4096,"peak_bytes_requested":1000},"shards":[]}\n' >"$tmp/v1.json"
"$stat" --summary "$tmp/v1.json" >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; fail "shardbfc-stat on a version 1 snapshot fails"; }
grep -q 'allocated ? (peak <= 4096 (bound)), requested ? (peak <= 1000 (bound))' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat prints a version 1 snapshot's bounded peaks as exact"; }
printf '{"version":99,"backend":"sim","shards":[]}\n' >"$tmp/v99.json"
"$stat" --summary "$tmp/v99.json" >/dev/null 2>"$tmp/err" || fail "shardbfc-stat on a newer snapshot fails"
grep -q 'snapshot version 99 is newer than this tool' "$tmp/err" ||
    { cat "$tmp/err" >&2; fail "shardbfc-stat reads a newer snapshot version silently"; }
# A retired shard (listed, kept by live blocks) is not counted as a shard, as
# the totals' num_shards does not count it; the header line says it apart.
printf '{"version":2,"backend":"sim","totals":{"num_shards":1},"shards":[{"stream_id":1,"stream":"0x10","retired":false},{"stream_id":2,"stream":"0x20","retired":true}]}\n' >"$tmp/retired.json"
"$stat" --summary "$tmp/retired.json" >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; fail "shardbfc-stat on a retired shard fails"; }
grep -q ', 1 shards and 1 retired (released by their streams, kept by live blocks)$' "$tmp/out" ||
    { cat "$tmp/out" >&2; fail "shardbfc-stat counts a retired shard as a shard"; }
# Strings reach the terminal without their control characters.
# Fragmentation 1 is a fraction.
printf '{"version":2,"backend":"sim\\u001b[2J\\u007f\\nTotals:","shards":[],"totals":{"fragmentation":1},' >"$tmp/ctrl.json"
printf '"oom":{"diagnosis":"d\\u001b[2J","stream":"0x1\\u007f","cause":"held\\u001b]0;t\\u0007"}}\n' >>"$tmp/ctrl.json"
"$stat" "$tmp/ctrl.json" >"$tmp/out" 2>&1 || { cat "$tmp/out" >&2; fail "shardbfc-stat on control characters failed"; }
grep -q '^libshardbfc snapshot v2: backend sim?\[2J??Totals:,' "$tmp/out" && grep -q 'Out of memory: d?\[2J$' "$tmp/out" &&
    ! grep -q "$(printf '[\033\177\007]')" "$tmp/out" ||
    { cat -A "$tmp/out" >&2; fail "shardbfc-stat printed a string's control characters"; }
# Near-garbage is not a snapshot: exit 1, the fault named (what the page's
# script would stop on; test_obs tries each shape through the viewer).
printf '{"shards":[1,"x",null]}\n' >"$tmp/garbage.json"
printf '{"version":2,"shards":[{"regions":5}]}\n' >"$tmp/regions5.json"
# JSON.parse refuses what json-c's strict mode lets through (00, -01); a
# fragmentation is a fraction.
printf '{"version":2,"shards":[],"limit":00}\n' >"$tmp/lead0.json"
printf '{"version":2,"shards":[],"x":[1,-01]}\n' >"$tmp/leadneg.json"
printf '{"version":2,"shards":[],"totals":{"fragmentation":1e40}}\n' >"$tmp/frag.json"
printf '{"version":2,"shards":[],"totals":{"fragmentation":"0.5"}}\n' >"$tmp/fragstr.json"
for f in garbage:version regions5:'shards\[0\]\.regions is not an array' lead0:'a number with a leading zero' \
    leadneg:'a number with a leading zero' frag:'totals.fragmentation is not a fraction from 0 to 1' \
    fragstr:'totals.fragmentation is not a fraction from 0 to 1'; do
    "$stat" "$tmp/${f%%:*}.json" >/dev/null 2>"$tmp/err"
    [ $? -eq 1 ] || fail "shardbfc-stat on ${f%%:*}.json does not exit 1"
    grep -q "${f#*:}" "$tmp/err" || { cat "$tmp/err" >&2; fail "shardbfc-stat on ${f%%:*}.json does not say what is wrong"; }
done
"$stat" "$tmp/empty.json" >&- 2>/dev/null
[ $? -eq 1 ] || fail "shardbfc-stat with its output closed does not exit 1"
if [ -c /dev/full ]; then
    "$stat" "$tmp/empty.json" >/dev/full 2>/dev/null
    [ $? -eq 1 ] || fail "shardbfc-stat writing to a full device does not exit 1"
fi

# -------------------------------------------------------------- view
"$view" --help >"$tmp/out" 2>&1 || fail "shardbfc-view --help exits non-zero"
grep -q '^usage: shardbfc-view' "$tmp/out" || fail "shardbfc-view --help prints no usage"
"$view" "$tmp/none.json" >/dev/null 2>&1
[ $? -eq 2 ] || fail "shardbfc-view without -o is not a usage error"
"$view" --bogus -o "$tmp/page.html" >/dev/null 2>&1
[ $? -eq 2 ] || fail "shardbfc-view --bogus is not a usage error"
[ ! -e "$tmp/page.html" ] || fail "shardbfc-view --bogus wrote a page"
"$view" "$tmp/empty.json" -o "$tmp/page.html" 2>"$tmp/err" || { cat "$tmp/err" >&2; fail "shardbfc-view on a snapshot with no shards fails"; }
grep -q '</html>' "$tmp/page.html" || fail "shardbfc-view wrote no whole page"
# A bad snapshot must not cost the page already there.
echo 'an older page' >"$tmp/page.html"
printf '{"version":1,"shards":' >"$tmp/cut.json"
"$view" "$tmp/cut.json" -o "$tmp/page.html" >/dev/null 2>&1
[ $? -eq 1 ] || fail "shardbfc-view on a cut snapshot does not exit 1"
[ "$(cat "$tmp/page.html" 2>/dev/null)" = 'an older page' ] ||
    fail "shardbfc-view on a cut snapshot removed or changed the page -o names"
"$view" "$tmp/cut.json" -o "$tmp/new.html" >/dev/null 2>&1
[ ! -e "$tmp/new.html" ] || fail "shardbfc-view on a cut snapshot made a page"
# Through a link, so that a regression removes the link, not the device.
if [ -c /dev/full ] && ln -s /dev/full "$tmp/full"; then
    "$view" "$tmp/cut.json" -o "$tmp/full" >/dev/null 2>&1
    [ -L "$tmp/full" ] || fail "shardbfc-view on a cut snapshot removed the device -o names"
    "$view" "$tmp/empty.json" -o "$tmp/full" >/dev/null 2>&1
    [ $? -eq 1 ] || fail "shardbfc-view writing to a full device does not exit 1"
    [ -L "$tmp/full" ] || fail "shardbfc-view after a write error removed what -o names"
fi
"$view" "$tmp/empty.json" -o - >&- 2>/dev/null
[ $? -eq 1 ] || fail "shardbfc-view with its output closed does not exit 1"
echo "tools.sh: ok"
