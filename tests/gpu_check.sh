#!/bin/sh
# gpu_check.sh -- `make check` keeps scripts/gpu-check.sh and
# scripts/torch_check.py from rotting between GPU runs, in seconds:
#
#   - torch_check.py compiles (python3 -m py_compile; PyTorch is not
#     needed for that, nor installed here);
#   - gpu-check.sh refuses bad command lines with status 2;
#   - its perf step's summary of the steady-state run (steady_rows) reads
#     the harness's real table, and only that run's;
#   - `gpu-check.sh run --sim --quick --build .` over this build tree: the
#     pack folder's .debs unpacked into a scratch prefix with their
#     pkg-config files rewritten (when `scripts/gpu-check.sh pack` has made
#     the folder; otherwise that step says SKIP), then the GPU tests, the
#     PyTorch check and the perf harness as far as this machine allows --
#     every step that needs a device must say SKIP with its reason, and
#     none may FAIL.  The full build of the tarball and the suite are left
#     out: make check is running those.
set -u

srcdir=${top_srcdir:-..}
script="$srcdir/scripts/gpu-check.sh"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
fail=0

if command -v python3 >/dev/null 2>&1; then
    PYTHONPYCACHEPREFIX="$tmp/pycache" python3 -m py_compile "$srcdir/scripts/torch_check.py" ||
        { echo "gpu_check: scripts/torch_check.py does not compile"; fail=1; }
    echo "gpu_check: torch_check.py compiles"
else
    echo "gpu_check: no python3: torch_check.py not compiled"
fi

# Bad command lines: status 2, and nothing run.
for args in "" "bogus" "run --bogus" "run --quick" "run --sim --quick" \
            "run --jobs x" "run --skip nothing" "run --budget 1m" "pack --bogus"; do
    # shellcheck disable=SC2086  # each case is a word list
    bash "$script" $args >"$tmp/bad.out" 2>&1
    rc=$?
    if [ $rc -ne 2 ]; then
        echo "gpu_check: 'gpu-check.sh $args' exited $rc, expected 2:"
        cat "$tmp/bad.out"
        fail=1
    fi
done
echo "gpu_check: bad command lines refused"

# The perf step's summary of the steady-state run (steady_rows) reads the
# harness's real table: here a brief run of it on SIM, after a decoy run
# without --warmup whose rows must not be taken.
if [ -x ./perf/shardbfc-perf ]; then
    {
        echo "### perf/shardbfc-perf --backend cuda --threads 16"
        echo "== churn =="
        echo "   16 shardbfc         99.99M   1.00x       51      504      1008       376   17.72 GiB   16.65 GiB  1.065  100%        -      -     -    0.56      0.50   9.99/9.99"
        echo "### perf/shardbfc-perf --backend cuda --threads 16 --warmup 3"
        ./perf/shardbfc-perf --workload inference,churn --threads 16 --seconds 0.05 --warmup 0.05 \
            --allocators shardbfc --contexts both --baseline none 2>&1
    } >"$tmp/perf.log"
    rows=$(bash -c 'eval "$(sed -n "/^steady_rows() {/,/^}/p" "$1")"; steady_rows "$2"' _ \
        "$script" "$tmp/perf.log")
    echo "gpu_check: steady rows: $rows"
    n=$(echo "$rows" | tr ',' '\n' |
        grep -cE '^(inference|churn) shardbfc(-ctx)? [0-9.]+[kM]? [0-9.]+/[0-9.]+$')
    if [ "$n" -ne 4 ] || echo "$rows" | grep -q '99.99M'; then
        echo "gpu_check: steady_rows gave $n of 4 rows (or the decoy): $rows"
        fail=1
    fi
fi

bash "$script" run --sim --quick --build . --out "$tmp/out" --work "$tmp/work" \
    >"$tmp/run.out" 2>&1
rc=$?
cat "$tmp/run.out"
if [ $rc -ne 0 ]; then
    echo "gpu_check: gpu-check.sh run --sim --quick exited $rc"
    fail=1
fi
sum="$tmp/out/summary.txt"
if [ ! -f "$sum" ]; then
    echo "gpu_check: no summary.txt"
    fail=1
else
    steps=$(grep -cE '^  [a-z-]+ +(PASS|FAIL|SKIP) ' "$sum")
    [ "$steps" -eq 9 ] || { echo "gpu_check: $steps steps in the summary, expected 9"; fail=1; }
    if grep -qE '^  [a-z-]+ +FAIL ' "$sum"; then
        echo "gpu_check: a step failed"
        fail=1
    fi
    # A skipped step always says why.
    if grep -E '^  [a-z-]+ +SKIP ' "$sum" | grep -qE 'SKIP +[0-9.]+s *$'; then
        echo "gpu_check: a step was skipped without a reason"
        fail=1
    fi
fi
[ $fail -eq 0 ] && echo "gpu_check: 1 passed, 0 failed"
exit $fail
