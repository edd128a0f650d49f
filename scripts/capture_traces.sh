#!/usr/bin/env bash
# capture_traces.sh -- records allocation traces of real PyTorch models on the
# CPU and stores them, gzip-compressed, under tests/traces/.
#
#   scripts/capture_traces.sh [NAME...]     default: every workload
#
# Needs Debian's python3-torch and python3-torchvision (CPU PyTorch) and a C
# compiler; neither the build nor the tests need them.  Each NAME is a
# workload of tools/capture/models.py (`python3 tools/capture/models.py
# --list`).  Steps:
#   1. build tools/capture/alloc_trace.c into an LD_PRELOAD library (in a
#      temporary directory; it is not part of libshardbfc);
#   2. run the workload under it (ALLOC_TRACE_START=0: the workload starts
#      and stops recording itself);
#   3. write tests/traces/NAME.csv.gz (gzip -9n: no name or time stamp in
#      the header, so an identical trace gives an identical file) and print
#      its events and exact peak requested bytes (scripts/trace_stats.sh).
# A workload whose interposer summary reports lost events fails the run.
set -euo pipefail

PYTHON=${PYTHON:-/usr/bin/python3} # Debian's, where python3-torch is installed
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$top/tests/traces"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/capture.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" -c 'import torch, torchvision' 2>/dev/null || {
    echo "capture_traces: needs python3-torch and python3-torchvision (apt-get install -y python3-torch python3-torchvision)" >&2
    exit 1
}

${CC:-cc} -std=gnu11 -O2 -Wall -Wextra -shared -fPIC -fvisibility=hidden \
    -o "$tmp/alloc_trace.so" "$top/tools/capture/alloc_trace.c" -ldl -pthread

if [ $# -eq 0 ]; then
    set -- $("$PYTHON" "$top/tools/capture/models.py" --list | cut -d: -f1)
fi

mkdir -p "$out"
for name in "$@"; do
    csv="$tmp/$name.csv"
    echo "==> $name"
    LD_PRELOAD="$tmp/alloc_trace.so" ALLOC_TRACE="$csv" ALLOC_TRACE_START=0 \
        "$PYTHON" "$top/tools/capture/models.py" "$name" 2>"$tmp/$name.err" || {
        cat "$tmp/$name.err" >&2
        exit 1
    }
    grep '^alloc_trace:' "$tmp/$name.err"
    if grep -q -E 'alloc_trace: .* [1-9][0-9]* lost' "$tmp/$name.err"; then
        echo "capture_traces: $name: events lost" >&2
        exit 1
    fi
    gzip -9n -c "$csv" >"$out/$name.csv.gz"
    printf '%s: %s bytes, %s bytes gzip\n' "$name" "$(wc -c <"$csv")" "$(wc -c <"$out/$name.csv.gz")"
    "$top/scripts/trace_stats.sh" "$csv"
done
