#!/bin/sh
# perf_smoke.sh -- `make check` smoke test of the perf harness:
# runs `perf/shardbfc-perf --quick --json FILE --svg FILE` and validates
# the JSON with a real parser (jq, which scripts/bootstrap.sh installs;
# python3 -m json.tool when jq is missing): the `machine` and `results`
# contract other tools read, one result per measured (workload, allocator,
# threads), null overhead where an allocator cannot report it,
# latencies on the timed workloads and ns per pair on the counted arena
# one, the ALU loop timed beside every thread count and the scaling
# efficiency on every 2-thread row, libshardbfc's counters agreeing with
# the calls the harness made.  Also perf/vmm_calls, briefly on SIM: both
# layouts at 1 and 2 threads, and a bad command line refused; and the SIM
# driver model (--sim-vmm-cost) and --warmup applied, their bad values
# refused; libshardbfc's map calls of the whole run and of the window alone;
# perf/interleave briefly; cross at an odd thread count skipped, and its
# one-thread call rates timed inside the calls.
# Timings are not checked (the machine may be busy running other tests);
# missed targets never fail it.  Exit 77 (skip) only when neither parser is
# installed.
set -u

bin=./perf/shardbfc-perf
[ -x "$bin" ] || { echo "perf_smoke: $bin not built" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/perf_smoke.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT

# Under a sanitizer (make sanitize) compare libshardbfc with itself only:
# jemalloc and glibc's __libc_malloc next to the sanitizer's own malloc
# interposition give reports about them, not about this code.
set --
if nm "$bin" 2>/dev/null | grep -q -E '__(tsan|asan)_init'; then
    set -- --allocators shardbfc,single-lock
    echo "perf_smoke: sanitizer build: $*"
fi
if ! "$bin" --quick "$@" --json "$tmp/perf.json" --svg "$tmp/perf.svg" >"$tmp/out.txt" 2>"$tmp/err.txt"; then
    echo "perf_smoke: shardbfc-perf --quick failed:" >&2
    cat "$tmp/out.txt" "$tmp/err.txt" >&2
    exit 1
fi
tail -n 12 "$tmp/out.txt"

# --baseline's spellings, as --help gives them: both = alu,mem; a bad one is
# refused (status 2) before anything runs.
"$bin" --quick --seconds 0.02 --workload churn --threads 1 --allocators shardbfc \
    --baseline both >"$tmp/both.txt" 2>&1 &&
    grep -q '^  alu loop' "$tmp/both.txt" && grep -q '^  mem loop' "$tmp/both.txt" &&
    ! grep -q '^  ports loop' "$tmp/both.txt" ||
    { echo "perf_smoke: --baseline both did not time alu and mem alone:" >&2; cat "$tmp/both.txt" >&2; exit 1; }
# ports, the third loop, named alone: its line, and in the JSON its speed-up
# beside each 2-thread row.
"$bin" --quick --seconds 0.02 --workload churn --threads 1,2 --allocators shardbfc \
    --baseline ports --json "$tmp/ports.json" >"$tmp/ports.txt" 2>&1 &&
    grep -q '^  ports loop' "$tmp/ports.txt" && ! grep -q '^  alu loop' "$tmp/ports.txt" &&
    grep -q '"threads": 2, .*"ports_speedup": [0-9]' "$tmp/ports.json" &&
    grep -q '"kind": "ports"' "$tmp/ports.json" && ! grep -q '"kind": "alu"' "$tmp/ports.json" ||
    { echo "perf_smoke: --baseline ports:" >&2; cat "$tmp/ports.txt" >&2; exit 1; }
"$bin" --baseline alu,bogus >/dev/null 2>&1
[ $? -eq 2 ] || { echo "perf_smoke: --baseline alu,bogus was not refused with status 2" >&2; exit 1; }

# --sim-vmm-cost (the SIM driver model) and --warmup, announced in the
# parameters and in the JSON; values that are not nanoseconds or seconds are
# refused.
"$bin" --quick --seconds 0.05 --warmup 0.1 --workload inference --threads 2 --allocators shardbfc \
    --baseline none --sim-vmm-cost 20000 --json "$tmp/cost.json" >"$tmp/cost.txt" 2>&1 &&
    grep -q '^  SIM driver model: 20000 ns per granule' "$tmp/cost.txt" &&
    grep -q 'timed window 0.05 s after a 0.10 s warm-up' "$tmp/cost.txt" &&
    grep -q '"sim_vmm_cost_ns": 20000, "warmup_seconds": 0.100' "$tmp/cost.json" ||
    { echo "perf_smoke: --sim-vmm-cost 20000 --warmup 0.1 were not applied:" >&2; cat "$tmp/cost.txt" >&2; exit 1; }
for bad in "--sim-vmm-cost -1" "--sim-vmm-cost 1us" "--sim-vmm-cost 10000001" "--warmup -1" \
           "--warmup 1s" "--warmup 3601" "--seed -1" "--seed +5" "--threads 1,,2" "--threads ,1" \
           "--threads 1,"; do
    # shellcheck disable=SC2086 # an option and its value
    "$bin" $bad >/dev/null 2>&1
    [ $? -eq 2 ] || { echo "perf_smoke: $bad was not refused with status 2" >&2; exit 1; }
done

# perf/interleave: a row per pass and a summary, its own check passed
# (exit 0), and a bad command line refused.
il=./perf/interleave
[ -x "$il" ] || { echo "perf_smoke: $il not built" >&2; exit 1; }
"$il" --streams 3 --passes 2 --steps 24 --quantum 500 >"$tmp/il.txt" 2>&1 &&
    [ "$(grep -cE '^ +[12] +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ GiB +[0-9.]+ GiB +[0-9.]+$' "$tmp/il.txt")" -eq 2 ] &&
    grep -q '^summary: overhead [0-9.]*; map calls' "$tmp/il.txt" ||
    { echo "perf_smoke: interleave failed:" >&2; cat "$tmp/il.txt" >&2; exit 1; }
"$il" --streams 0 >/dev/null 2>&1
[ $? -eq 2 ] || { echo "perf_smoke: interleave --streams 0 was not refused with status 2" >&2; exit 1; }
echo "perf_smoke: interleave: $(grep '^summary' "$tmp/il.txt")"

# perf/vmm_calls: a row per layout and thread count, nothing failed.
vmm=./perf/vmm_calls
[ -x "$vmm" ] || { echo "perf_smoke: $vmm not built" >&2; exit 1; }
"$vmm" --threads 1,2 --pairs 20 >"$tmp/vmm.txt" 2>&1 ||
    { echo "perf_smoke: vmm_calls failed:" >&2; cat "$tmp/vmm.txt" >&2; exit 1; }
rows=$(grep -cE '^  (shared|per-thread) +[12] +[0-9]+ +[0-9.]+ +[0-9.]+x$' "$tmp/vmm.txt")
[ "$rows" -eq 4 ] ||
    { echo "perf_smoke: vmm_calls printed $rows rows, expected 4:" >&2; cat "$tmp/vmm.txt" >&2; exit 1; }
"$vmm" --threads 0 >/dev/null 2>&1
[ $? -eq 2 ] || { echo "perf_smoke: vmm_calls --threads 0 was not refused with status 2" >&2; exit 1; }
echo "perf_smoke: vmm_calls: 4 rows"

grep -q '^<svg ' "$tmp/perf.svg" && grep -q '</svg>' "$tmp/perf.svg" ||
    { echo "perf_smoke: the SVG is incomplete" >&2; exit 1; }

if command -v jq >/dev/null 2>&1; then
    # Every key of the contract, the right types, nulls only where allowed,
    # and the libshardbfc rows that must be there on any machine.
    jq -e '
      .baselines as $b
      | (.machine | (.cores | type == "number" and . >= 1)
                  and (.cpu | type == "string") and (.backend == "sim")
                  and has("gpu"))
      and (.results | type == "array" and length > 0)
      and all(.results[];
              (.workload | IN("churn", "cross", "inference", "host", "replay", "arena",
                              "arena-frag"))
              and (.allocator | type == "string")
              and (.threads | type == "number" and . >= 1)
              and (.ops_per_sec | type == "number" and . > 0)
              and (.peak_requested | type == "number" and . > 0)
              and has("peak_reserved") and has("overhead")
              and ((.overhead == null) == (.peak_reserved == null))
              and has("speedup") and has("alu_speedup") and has("efficiency")
              and (.runs | type == "array" and length == 1))
      and all(.results[] | select(.workload | startswith("arena") | not);
              (.p50_ns | type == "number") and (.p99_ns >= .p50_ns)
              and (.p999_ns >= .p99_ns))
      and all(.results[] | select(.workload | startswith("arena"));
              .p50_ns == null and .p99_ns == null
              and (.ns_per_pair | type == "number" and . > 0))
      and all(.results[] | select(.threads == 1); .efficiency == null)
      and all(.results[] | select(.threads == 2);
              (.speedup | type == "number" and . > 0)
              and (.alu_speedup | type == "number" and . > 0)
              and (.efficiency - .speedup / .alu_speedup | fabs) < 1e-3 * .efficiency + 1e-9)
      and ([.results[] | select(.allocator == "shardbfc")] | length) == 10
      and all(.results[] | select(.allocator == "shardbfc"); .overhead >= 1)
      and all(.results[] | select(.allocator == "shardbfc");
              (.maps_per_1k | type == "number" and . >= 0)
              and (.window_maps_per_1k | type == "number" and . >= 0)
              and (.window_unmaps_per_1k | type == "number" and . >= 0))
      and all(.results[] | select(.allocator == "jemalloc" or .allocator == "malloc");
              .window_maps_per_1k == null and .window_unmaps_per_1k == null)
      and all(.results[] | select(.allocator == "shardbfc" or .allocator == "single-lock");
              .verified == true)
      and (.baselines | type == "array")
      and ([.results[] | {workload, threads}] | unique | all(.[];
              . as $r | [$b[] | select(.workload == $r.workload
                                       and .threads == $r.threads and .kind == "alu")]
              | length == 1))
      and all(.results[] | select(.allocator == "jemalloc" or .allocator == "malloc");
              .overhead == null)
      and (.skipped | type == "array")
      and (.targets | type == "array" and length > 0)
    ' "$tmp/perf.json" >/dev/null || {
        echo "perf_smoke: the JSON does not follow the contract:" >&2
        cat "$tmp/perf.json" >&2
        exit 1
    }
    echo "perf_smoke: JSON valid (jq), $(jq '.results | length' "$tmp/perf.json") results"
elif command -v python3 >/dev/null 2>&1; then
    python3 -m json.tool "$tmp/perf.json" >/dev/null ||
        { echo "perf_smoke: the JSON does not parse" >&2; exit 1; }
    echo "perf_smoke: JSON parses (python3 -m json.tool)"
else
    echo "perf_smoke: neither jq nor python3 is installed: cannot validate" >&2
    exit 77
fi
# cross runs producer/consumer pairs: an odd thread count above 1 is
# skipped and said (it ran n - 1 threads labelled n - 1 beside an ALU loop
# timed on n, and --threads 1,2,3 printed two rows of 2).
if "$bin" --workload cross --threads 1,3 --allocators shardbfc --baseline alu --seconds 0.05 --runs 1 \
        >"$tmp/cross3.txt" 2>&1; then
    grep -q 'skipped: \* *cross *3 threads: cross runs producer/consumer pairs' "$tmp/cross3.txt" ||
        { cat "$tmp/cross3.txt" >&2; echo "perf_smoke: cross at 3 threads is not skipped" >&2; exit 1; }
    if grep -q '^ *2 shardbfc' "$tmp/cross3.txt"; then
        cat "$tmp/cross3.txt" >&2; echo "perf_smoke: cross at 3 threads ran as 2" >&2; exit 1
    fi
else
    cat "$tmp/cross3.txt" >&2; echo "perf_smoke: shardbfc-perf --workload cross --threads 1,3 failed" >&2; exit 1
fi
# At one thread cross's per-call rates are time inside the calls only, as
# in the pipeline: the two calls of a block take less than the block (the
# clock reads and the loop are outside).  Chained timestamps made the two
# add up to the whole block exactly.  One run in three suffices: a long
# preemption inside a call can bring one run near 1 (0.97 seen under
# load), while chained timestamps give 1 in every run.
if command -v jq >/dev/null 2>&1; then
    ok=no
    for try in 1 2 3; do
        "$bin" --workload cross --threads 1 --allocators shardbfc --baseline none --seconds 0.05 --runs 1 \
            --json "$tmp/cross1.json" >/dev/null 2>&1 || { echo "perf_smoke: cross at 1 thread failed" >&2; exit 1; }
        if jq -e '.results[0] | (1 / .frees_per_sec_per_consumer + 1 / .allocs_per_sec_per_producer)
                  < 0.99 / .blocks_per_sec' "$tmp/cross1.json" >/dev/null; then
            ok=yes
            break
        fi
    done
    [ $ok = yes ] ||
        { jq '.results[0]' "$tmp/cross1.json" >&2;
          echo "perf_smoke: cross at 1 thread times more than its calls (3 runs)" >&2; exit 1; }
fi
# A run whose allocation fails (a 64 MiB limit under churn's live set) has
# no figures: exit 1, a FAILED row in the table, and in the JSON an object
# that says failed and carries nothing else (it gave warm-up latencies and
# a 0 rate as figures, and an 'other load' warning).
"$bin" --workload churn --threads 1 --allocators shardbfc --seconds 0.05 --conf memory_limit=64M \
    --json "$tmp/failed.json" >"$tmp/failed.txt" 2>&1
[ $? -eq 1 ] || { cat "$tmp/failed.txt" >&2; echo "perf_smoke: a failed run does not exit 1" >&2; exit 1; }
grep -q '^    1 shardbfc     FAILED: ' "$tmp/failed.txt" && ! grep -q 'WARNING: shardbfc 1 thr' "$tmp/failed.txt" ||
    { cat "$tmp/failed.txt" >&2; echo "perf_smoke: a failed run's row shows figures" >&2; exit 1; }
if command -v jq >/dev/null 2>&1; then
    jq -e '.results == [{"workload":"churn","allocator":"shardbfc","threads":1,"failed":true}]' \
        "$tmp/failed.json" >/dev/null ||
        { jq '.results' "$tmp/failed.json" >&2; echo "perf_smoke: a failed run's JSON carries figures" >&2; exit 1; }
fi
# A run too short to go once through its program (inference: about 0.1 s a
# pass here; 0.01 s and no warm-up) has peaks of the part it reached: '*'
# on peak req and ovhd, the legend, and program_cycles 0 in the JSON.
"$bin" --workload inference --threads 1 --allocators shardbfc --warmup 0 --seconds 0.01 --baseline none \
    --json "$tmp/part.json" >"$tmp/part.txt" 2>&1 || { cat "$tmp/part.txt" >&2; echo "perf_smoke: a short inference run failed" >&2; exit 1; }
grep -q '^    1 shardbfc .* \*[0-9.]* [KMG]iB \*[0-9.]* ' "$tmp/part.txt" &&
    grep -q '^  \* peak req, ovhd: the run did not go once through its program' "$tmp/part.txt" ||
    { cat "$tmp/part.txt" >&2; echo "perf_smoke: a partial program's peaks are not marked" >&2; exit 1; }
if command -v jq >/dev/null 2>&1; then
    jq -e '.results[0].program_cycles == 0' "$tmp/part.json" >/dev/null ||
        { jq '.results[0]' "$tmp/part.json" >&2; echo "perf_smoke: program_cycles of a partial run is not 0" >&2; exit 1; }
fi
exit 0
