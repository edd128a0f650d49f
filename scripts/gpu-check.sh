#!/usr/bin/env bash
# gpu-check.sh -- libshardbfc on a GPU machine in one command.
#
#   scripts/gpu-check.sh pack [--dir DIR] [--build DIR] [--with-perf]
#   scripts/gpu-check.sh run  [--dir DIR] [--out DIR] [--work DIR] [--jobs N]
#                             [--skip STEP,...] [--budget SECONDS] [--sim]
#                             [--quick --build DIR]
#
# The GPU machine has CUDA, compute-sanitizer and a python3 with PyTorch,
# but no Debian packages and no network: what the build needs must travel
# with the working tree.  So the work is split in two halves.
#
# pack (here, on the Debian machine): `make dist` in a configured build tree
# (DIR --build, default build/, configured first if it is not), then
# `apt-get download` of the libraries the build needs -- liburcu, jemalloc,
# hwloc, check, subunit -- and of the few things a stock GPU image may lack
# (libudev1 for hwloc, pkgconf, make), all into one folder, gpu-pack/ by
# default, which git ignores and which must stay under 64 MiB.  MANIFEST in
# it lists every file with its size and checksum.  --with-perf adds
# Debian's perf with the libraries it loads (gpu-pack/perf/, about 28 MiB)
# for the profile step.
#
# run (there): unpack the .debs with `dpkg -x` (or ar + tar where dpkg is
# missing) into a private prefix -- the optional ones only when the machine
# lacks what they provide --, rewrite their pkg-config files, whose prefix
# says /usr, to point into it, and put it on PKG_CONFIG_LIBDIR (the prefix
# alone: a missing package fails here, not later), CPATH, LIBRARY_PATH and
# LD_LIBRARY_PATH.  Then build the tarball with --with-cuda and run, most
# telling first (a device lease is short):
#
#   build      configure --with-cuda --disable-werror, make, make install
#              (into the work dir), and the test programs
#   gpu-tests  tests/test_gpu_streams and test_backend_cuda on the device
#   scaling    perf/shardbfc-perf on the SIM backend, 1..16 threads (the
#              machine's cores), one context and one per thread: churn,
#              cross, inference and arena beside the ALU, memory and ports
#              loops (perf-sim.json); then churn, inference and arena at 1
#              and 16 threads after a 2 s warm-up, the steady state past
#              the shards' growth (perf.log)
#   suite      the whole `make check` with SHARDBFC_CONF=backend=cuda
#   memcheck   compute-sanitizer --tool memcheck over both GPU test programs
#   torch      scripts/torch_check.py: a transformers model with PyTorch's
#              allocator and with the installed libshardbfc_torch.so,
#              identical results required, peaks reported
#   torch-shim perf/libshardbfc_perf_torch.so against the machine's libtorch
#   perf       perf/vmm_calls (the map and unmap calls' cost from 1..16
#              threads), then perf/shardbfc-perf on the CUDA backend, 1, 4
#              and 16 threads, against cudaMalloc, cudaMallocAsync and
#              PyTorch's allocator; then libshardbfc alone at 16 threads
#              after a 3 s warm-up (the steady state, past the growth)
#   profile    perf record (cpu-clock) of churn and arena, a context per
#              thread, at 1 thread and at the core count: each symbol's
#              share, and each source line's in bfc_ctx_alloc/free
#              (perf.log); needs `pack --with-perf` (the GPU image has no
#              perf), SKIP otherwise
#   racecheck  compute-sanitizer --tool racecheck over both (last: the test
#              kernels share no memory, so it guards against little)
#
# Results go to --out (default $OUT when set, else ./gpu-check-out), at most
# eight files, as the device tool brings back: summary.txt, suite.log,
# gpu.log, torch.log, torch_check.json, perf.log, perf-sim.json,
# perf-gpu.json.  The summary (also printed) has one line per step: PASS,
# FAIL or SKIP with the reason and the time taken; it is rewritten after
# every step, so a run cut short still says how far it got.  Exit status:
# 0 when no step failed, 1 otherwise, 2 on a bad command line.  On the GPU
# a step that finds no device FAILS: the point of the run is the device.
#
# --budget SECONDS: the whole run's time, for a lease that ends.  Each
# step's commands are stopped (timeout) when it is spent, and a step that
# would start after it says SKIP, "out of time"; the summary still has a
# line for every step.
#
# run --sim: the same path on a machine without a GPU -- the libshardbfc
# suite with SHARDBFC_CONF=backend=sim, every step that needs a device
# reported as SKIP with the reason.
#
# run --sim --quick --build DIR: what `make check` runs (tests/gpu_check.sh)
# so that this script cannot rot, in seconds: the argument handling, the
# unpacking and pkg-config rewriting on the pack folder when there is one,
# and the steps over an existing build tree instead of a fresh tarball
# build (no build, no suite: make check is running those).
# shellcheck disable=SC2054  # the commas in the argument arrays are inside option values
set -u -o pipefail

prog=gpu-check.sh
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    sed -n '3,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    echo "(see the comment at the top of scripts/gpu-check.sh)" >&2
    exit "${1:-2}"
}

die() {
    echo "$prog: $*" >&2
    exit 2
}

# Packages whose .debs travel.  Required: unpacked always.
required_debs=(liburcu-dev liburcu8 libjemalloc-dev libjemalloc2 libhwloc-dev libhwloc15
               check libsubunit-dev libsubunit0 libjson-c-dev libjson-c5)
# Optional: unpacked only where the machine lacks what they provide (see
# need_optional).  The -dev packages' other dependencies (libnuma-dev and
# libltdl-dev for hwloc, mawk for check's checkmk) are not needed to build.
optional_debs=(libudev1 pkgconf-bin libpkgconf3 make)
pack_limit=$((64 * 1024 * 1024))

# What configure requires, read from configure.ac's BFC_REQUIRE_PKG lines
# so that the pack cannot fall behind the build: "module deb" per line.
configure_requires() {
    sed -n 's/^BFC_REQUIRE_PKG(\[[A-Z_]*\], *\[\([^] ]*\)[^]]*\], *\[\([^]]*\)\]).*/\1 \2/p' \
        "$top/configure.ac"
}

# ------------------------------------------------------------------ pack

do_pack() {
    local dir="$top/gpu-pack" build="$top/build" with_perf=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --dir) [ $# -ge 2 ] || die "--dir needs a value"; dir=$2; shift 2 ;;
            --build) [ $# -ge 2 ] || die "--build needs a value"; build=$2; shift 2 ;;
            --with-perf) with_perf=1; shift ;;
            -h | --help) usage 0 ;;
            *) die "pack: unknown argument $1" ;;
        esac
    done
    command -v apt-get >/dev/null || die "pack runs on the Debian machine (apt-get not found)"
    local mod deb
    while read -r mod deb; do
        case " ${required_debs[*]} " in
            *" $deb "*) ;;
            *) die "configure.ac requires $mod (Debian's $deb), which required_debs lacks" ;;
        esac
    done < <(configure_requires)
    mkdir -p "$dir/debs" || exit 1
    dir=$(cd "$dir" && pwd)

    echo "==> make dist (in $build)"
    if [ ! -f "$build/Makefile" ]; then
        [ -x "$top/configure" ] || (cd "$top" && ./autogen.sh) || exit 1
        mkdir -p "$build" || exit 1
        if ! (cd "$build" && "$top/configure" >configure.log 2>&1); then
            tail -20 "$build/configure.log"
            exit 1
        fi
    fi
    rm -f "$dir"/shardbfc-*.tar.gz
    (cd "$build" && make dist >"$dir/dist.log" 2>&1) || { tail -20 "$dir/dist.log"; exit 1; }
    mv "$build"/shardbfc-*.tar.gz "$dir/" || exit 1
    rm -f "$dir/dist.log"

    echo "==> apt-get download ${required_debs[*]} ${optional_debs[*]}"
    rm -f "$dir"/debs/*.deb
    # _apt cannot write to every folder; apt then warns and downloads as root.
    (cd "$dir/debs" && apt-get download "${required_debs[@]}" "${optional_debs[@]}" 2>&1 |
        grep -v 'Download is performed unsandboxed') || true
    for p in "${required_debs[@]}" "${optional_debs[@]}"; do
        ls "$dir/debs/${p}_"*.deb >/dev/null 2>&1 ||
            die "apt-get download did not fetch $p (apt-get update first?)"
    done

    rm -rf "$dir/perf"
    [ $with_perf -eq 0 ] || pack_perf "$dir/perf" || exit 1

    # shellcheck disable=SC2094  # MANIFEST itself is left out of the listing
    (cd "$dir" && {
        echo "# libshardbfc GPU pack: scripts/gpu-check.sh run unpacks it"
        echo "# made $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$top" rev-parse --short HEAD 2>/dev/null || echo '?')"
        echo "# required: ${required_debs[*]}"
        echo "# optional: ${optional_debs[*]}"
        find . -type f ! -name MANIFEST | sort | while read -r f; do
            printf '%s %10d %s\n' "$(sha256sum "$f" | cut -c1-16)" "$(stat -c %s "$f")" "$f"
        done
    } >MANIFEST)
    local total
    total=$(du -sb "$dir" | cut -f1)
    cat "$dir/MANIFEST"
    printf '==> %s: %d files, %d KiB (limit 64 MiB)\n' "$dir" \
        "$(find "$dir" -type f | wc -l)" "$((total / 1024))"
    if [ "$total" -ge "$pack_limit" ]; then
        echo "$prog: the pack is over 64 MiB" >&2
        exit 1
    fi
    echo "==> carry it: the device tool's carry list names '${dir#"$top"/}'; there run"
    echo "    scripts/gpu-check.sh run"
}

# pack --with-perf: Debian's perf and the libraries it loads beyond glibc's
# and the C++ runtime's (the GPU image has newer ones of those), for the
# profile step; about 28 MiB.  The GPU image has no perf of its own.
pack_perf() { # dest
    local pf lib
    pf=$(command -v perf) || die "--with-perf: no perf here (Debian's linux-perf package)"
    pf=$(readlink -f "$pf")
    head -c 4 "$pf" | grep -q ELF || die "--with-perf: $pf is not a program (a wrapper script?)"
    echo "==> $pf and its libraries into $1"
    mkdir -p "$1" && cp "$pf" "$1/perf" || return 1
    for lib in $(ldd "$pf" | awk '$3 ~ /^\// {print $3}'); do
        case $(basename "$lib") in
            libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux* | \
                libstdc++.so.* | libgcc_s.so.*) ;;
            *) cp -L "$lib" "$1/" || return 1 ;;
        esac
    done
}

# ------------------------------------------------------------------- run

sim=0 quick=0 jobs="" skip_list="" dir="" out="" work="" build="" budget=0 t_start=0
prefix="" cuda_dir=""
names=() results=() notes=() times=()

have_lib() {
    ldconfig -p 2>/dev/null | grep -q "[[:space:]]$1 " && return 0
    local d
    for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/lib; do
        [ -e "$d/$1" ] && return 0
    done
    return 1
}

# Whether an optional package must be unpacked on this machine.
# SHARDBFC_GPU_CHECK_UNPACK_ALL=1 unpacks them all (to test that path here).
need_optional() {
    [ "${SHARDBFC_GPU_CHECK_UNPACK_ALL:-0}" = 1 ] && return 0
    case "$1" in
        libudev1) ! have_lib libudev.so.1 ;;
        pkgconf-bin | libpkgconf3) ! command -v pkg-config >/dev/null ;;
        make) ! command -v make >/dev/null ;;
        *) return 0 ;;
    esac
}

extract_deb() { # deb dest
    if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$1" "$2"
        return
    fi
    # A .deb is an ar archive holding data.tar.{xz,zst,gz}.
    local member
    member=$(ar t "$1" | grep '^data\.tar') || return 1
    case "$member" in
        *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
        *.zst) ar p "$1" "$member" | tar --zstd -x -C "$2" ;;
        *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
        *) ar p "$1" "$member" | tar -x -C "$2" ;;
    esac
}

# Unpacks the pack's .debs into $prefix, rewrites their .pc files and
# exports the paths.  Prints what it did; non-zero on failure.
unpack() {
    local deb name multi=x86_64-linux-gnu pc unpacked=0 skipped=""
    rm -rf "$prefix" && mkdir -p "$prefix" || return 1
    for deb in "$dir"/debs/*.deb; do
        [ -e "$deb" ] || { echo "no .deb in $dir/debs"; return 1; }
        name=$(basename "$deb")
        name=${name%%_*}
        case " ${optional_debs[*]} " in
            *" $name "*)
                if ! need_optional "$name"; then
                    skipped="$skipped $name"
                    continue
                fi ;;
        esac
        extract_deb "$deb" "$prefix" || { echo "cannot unpack $deb"; return 1; }
        unpacked=$((unpacked + 1))
    done
    echo "unpacked $unpacked packages into $prefix${skipped:+ (not needed here:$skipped)}"
    # Debian's .pc files say prefix=/usr (and some name /usr/... directly).
    for pc in "$prefix/usr/lib/$multi/pkgconfig/"*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
        [ -e "$pc" ] || continue
        sed -i -E "s#(^|[=[:space:]])/usr(/|\$|[[:space:]])#\\1$prefix/usr\\2#g" "$pc" || return 1
    done
    export PKG_CONFIG_LIBDIR="$prefix/usr/lib/$multi/pkgconfig:$prefix/usr/share/pkgconfig"
    unset PKG_CONFIG_PATH
    export CPATH="$prefix/usr/include:$prefix/usr/include/$multi${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$prefix/usr/lib/$multi${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$prefix/usr/lib/$multi:$prefix/lib/$multi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$PATH:$prefix/usr/bin"
    if [ -x "$prefix/usr/bin/pkgconf" ]; then
        export PKG_CONFIG="$prefix/usr/bin/pkgconf"
    else
        export PKG_CONFIG=pkg-config
    fi
    local m mods
    mods=$(configure_requires | cut -d' ' -f1)
    [ -n "$mods" ] || { echo "no BFC_REQUIRE_PKG line read from $top/configure.ac"; return 1; }
    for m in $mods; do
        if ! "$PKG_CONFIG" --exists "$m"; then
            echo "pkg-config finds no $m in the prefix"
            return 1
        fi
        # (--cflags/--libs may print nothing: pkgconf leaves out the
        # directories CPATH and LIBRARY_PATH already name.)
        case "$("$PKG_CONFIG" --variable=libdir "$m")" in
            "$prefix"/*) ;;
            *) echo "pkg-config's $m does not point into the prefix:" \
                "libdir=$("$PKG_CONFIG" --variable=libdir "$m")"; return 1 ;;
        esac
    done
    echo "pkg-config ($PKG_CONFIG) finds liburcu-bp $("$PKG_CONFIG" --modversion liburcu-bp)," \
        "jemalloc $("$PKG_CONFIG" --modversion jemalloc), hwloc $("$PKG_CONFIG" --modversion hwloc)," \
        "check $("$PKG_CONFIG" --modversion check) in the prefix"
}

# ------------------------------------------------------------ bookkeeping

skipped() { case ",$skip_list," in *",$1,"*) return 0 ;; esac; return 1; }

# Seconds left of --budget (a large number without one).
left() {
    if [ "$budget" -eq 0 ]; then
        echo 999999
    else
        echo $((budget - ($(date +%s) - t_start)))
    fi
}

# limit CMD...: CMD, stopped when --budget is spent (status 124 then).
limit() {
    if [ "$budget" -eq 0 ]; then
        "$@"
        return
    fi
    local s
    s=$(left)
    [ "$s" -gt 0 ] || return 124
    timeout -k 5 "$s" "$@"
}

write_summary() {
    local i f="$out/summary.txt" nfail=0
    {
        echo "libshardbfc gpu-check: $mode_desc"
        echo "started $started; machine: $machine"
        for i in "${!names[@]}"; do
            printf '  %-10s %-4s %6ss  %s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}" \
                "${notes[$i]}"
            [ "${results[$i]}" = FAIL ] && nfail=$((nfail + 1))
        done
        if [ -n "${1:-}" ]; then
            echo "$nfail step(s) failed"
        fi
    } >"$f"
}

# step NAME FUNCTION: runs it; 0 = PASS, 77 = SKIP, anything else = FAIL.
# The function sets `note` (a one-line reason or result).
step() {
    local name=$1 fn=$2 rc t0 t1 res
    note=""
    if skipped "$name"; then
        names+=("$name") results+=(SKIP) times+=(0) notes+=("--skip")
        write_summary
        return 0
    fi
    if [ "$(left)" -lt 5 ]; then
        names+=("$name") results+=(SKIP) times+=(0) notes+=("out of time (--budget $budget s)")
        write_summary
        return 0
    fi
    echo "==> $name"
    t0=$(date +%s%N)
    "$fn"
    rc=$?
    t1=$(date +%s%N)
    case $rc in
        0) res=PASS ;;
        77) res=SKIP ;;
        *) res=FAIL ;;
    esac
    names+=("$name") results+=("$res") notes+=("$note")
    times+=("$(((t1 - t0) / 1000000000)).$((((t1 - t0) / 100000000) % 10))")
    echo "    $res${note:+: $note}"
    write_summary
    return 0
}

# In a real run a step that found no device fails: that run is for the GPU.
no_gpu() { # reason
    if [ $sim -eq 1 ]; then
        note="$1"
        return 77
    fi
    note="no GPU: $1"
    return 1
}

cap_log() { # file: keep the last 15 MiB (the device tool brings back 16 MiB a file)
    local f=$1
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((15 * 1024 * 1024)) ]; then
        tail -c $((15 * 1024 * 1024)) "$f" >"$f.tmp" && mv "$f.tmp" "$f"
    fi
}

# ------------------------------------------------------------------ steps

st_unpack() {
    if [ ! -d "$dir/debs" ]; then
        if [ $quick -eq 1 ]; then
            note="no pack folder at $dir (scripts/gpu-check.sh pack makes it)"
            return 77
        fi
        note="no pack folder at $dir: run scripts/gpu-check.sh pack first and carry it"
        return 1
    fi
    local rc
    # In this shell, not a subshell: unpack exports the prefix's paths.
    unpack >"$work/unpack.log" 2>&1
    rc=$?
    sed 's/^/    /' "$work/unpack.log"
    note=$(tail -n 1 "$work/unpack.log")
    return $rc
}

st_build() {
    local tarball src
    tarball=$(ls "$dir"/shardbfc-*.tar.gz 2>/dev/null | head -n 1)
    [ -n "$tarball" ] || { note="no shardbfc-*.tar.gz in $dir"; return 1; }
    rm -rf "$work/src" "$work/build" "$work/install"
    mkdir -p "$work/src" "$work/build" || return 1
    tar -xzf "$tarball" -C "$work/src" || { note="cannot unpack $tarball"; return 1; }
    src=$(ls -d "$work"/src/shardbfc-*/ | head -n 1)
    {
        echo "### configure --with-cuda=${cuda_dir:-guess} --prefix=$work/install"
        # --disable-werror: another distribution's compiler may warn where
        # Debian's does not, and this run is for the device; the warnings
        # stay in suite.log and the summary counts them.
        (cd "$work/build" && "$src/configure" --with-cuda="${cuda_dir:-guess}" \
            --disable-werror --prefix="$work/install" PKG_CONFIG="$PKG_CONFIG") &&
            echo "### make -j$jobs" && make -C "$work/build" -j"$jobs" &&
            echo "### make install" && make -C "$work/build" install &&
            echo "### make check TESTS= (the test programs: the GPU tests run before the suite)" &&
            make -C "$work/build" -j"$jobs" check TESTS=
    } >"$out/suite.log" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        note="build failed (suite.log)"
        tail -n 30 "$out/suite.log" | sed 's/^/    /'
        return 1
    fi
    build="$work/build"
    note="$(basename "$tarball"), $(grep -E '^  (CUDA backend|GPU test kernels):' "$out/suite.log" |
        sed 's/^ *//; s/  */ /g' | paste -sd ';' -); $(grep -c 'warning:' "$out/suite.log") warnings"
    return 0
}

st_suite() {
    local conf=backend=cuda rc
    [ $sim -eq 1 ] && conf=backend=sim
    (
        echo "### SHARDBFC_CONF=$conf make -j$jobs check"
        SHARDBFC_CONF=$conf limit make -C "$build" -j"$jobs" check
        rc=$?
        echo "### test-suite.log"
        cat "$build/test-suite.log" 2>/dev/null
        for trs in "$build"/tests/*.trs; do
            log=${trs%.trs}.log
            # The Check summary, else (skips, scripts) the last line before
            # automake's own, which says why.
            line=$(grep -E '^[0-9]+%: Checks' "$log" | tail -n 1)
            [ -n "$line" ] || line=$(grep -vE '^(PASS|FAIL|SKIP|ERROR|XFAIL|XPASS) ' "$log" | tail -n 1)
            printf '%-26s %-5s %s\n' "$(basename "${trs%.trs}")" \
                "$(sed -n 's/^:test-result: //p' "$trs" | head -n 1)" "$line"
        done
        exit $rc
    ) >>"$out/suite.log" 2>&1
    rc=$?
    note="SHARDBFC_CONF=$conf: $(grep -E '^# (TOTAL|PASS|SKIP|FAIL|ERROR):' "$build/test-suite.log" 2>/dev/null |
        sed 's/^# //; s/  */ /g' | paste -sd ',' -)"
    cap_log "$out/suite.log"
    return $rc
}

gpu_programs=(tests/test_gpu_streams tests/test_backend_cuda)

st_gpu_tests() {
    local t rc worst=0 skip_reason=""
    for t in "${gpu_programs[@]}"; do
        [ -x "$build/$t" ] || { note="$t not built"; return 1; }
        echo "### $t" >>"$out/gpu.log"
        # --quick (make check, which runs these programs itself): the
        # control case only, to exercise this step in seconds.
        if [ $quick -eq 1 ]; then
            (cd "$build" && CK_VERBOSITY=normal CK_RUN_CASE=control "./$t") >>"$out/gpu.log" 2>&1
        else
            (cd "$build" && CK_VERBOSITY=normal limit "./$t") >>"$out/gpu.log" 2>&1
        fi
        rc=$?
        if [ $rc -eq 77 ]; then
            [ -n "$skip_reason" ] || skip_reason=$(tail -n 1 "$out/gpu.log")
        elif [ $rc -ne 0 ]; then
            worst=1
        fi
    done
    if [ $worst -ne 0 ]; then
        note="failed (gpu.log)"
        return 1
    fi
    if [ -n "$skip_reason" ]; then
        no_gpu "$skip_reason"
        return
    fi
    note="$(grep -cE ': ok \(' "$out/gpu.log") paths ok; $(grep -E '^[0-9]+%: Checks' "$out/gpu.log" |
        paste -sd ';' -)"
}

sanitizer() { # tool
    local tool=$1 cs t rc worst=0
    if [ $quick -eq 1 ]; then
        note="--quick: left to the full run (minutes under the sanitizer)"
        return 77
    fi
    cs=$(command -v compute-sanitizer || true)
    [ -n "$cs" ] || [ ! -x "$cuda_dir/bin/compute-sanitizer" ] || cs="$cuda_dir/bin/compute-sanitizer"
    if [ -z "$cs" ]; then
        if [ $sim -eq 1 ]; then
            note="compute-sanitizer not installed"
            return 77
        fi
        note="compute-sanitizer not found"
        return 1
    fi
    # The control case alone tells whether there is a device (77: none).
    (cd "$build" && CK_RUN_CASE=control ./tests/test_gpu_streams) >/dev/null 2>&1
    if [ $? -eq 77 ]; then
        no_gpu "no usable CUDA device (test_gpu_streams skips)"
        return
    fi
    local procs
    for t in "${gpu_programs[@]}"; do
        # test_backend_cuda's one child runs the toolkit's stub driver (no
        # device code) in an environment of its own: tracked by the
        # sanitizer, it died of SIGSEGV on the H200.  test_gpu_streams'
        # children run kernels: tracked.
        procs=all
        [ "$t" != tests/test_backend_cuda ] || procs=application-only
        echo "### compute-sanitizer --tool $tool --target-processes $procs $t" >>"$out/gpu.log"
        # The device-error test provokes a trap on purpose (BFC_GPU_NO_TRAP);
        # the backend tests provoke API errors on purpose (--report-api-errors
        # no); the spin is longer because instrumented kernels are slower.
        (cd "$build" && BFC_GPU_NO_TRAP=1 BFC_GPU_SPIN_MS=1000 CK_TIMEOUT_MULTIPLIER=10 \
            limit "$cs" --tool "$tool" --target-processes "$procs" --error-exitcode 99 \
            --report-api-errors no "./$t") >>"$out/gpu.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || worst=$rc
    done
    cap_log "$out/gpu.log"
    note="$(grep -E '^========= (ERROR SUMMARY|RACECHECK SUMMARY)' "$out/gpu.log" | tail -n 2 |
        sed 's/^========= //' | paste -sd ';' -)"
    [ $worst -eq 0 ] || { note="exit $worst: $note (gpu.log)"; return 1; }
}

st_memcheck() { sanitizer memcheck; }
st_racecheck() { sanitizer racecheck; }

plugin_path() {
    if [ -f "$work/install/lib/libshardbfc_torch.so" ] && [ $quick -eq 0 ]; then
        echo "$work/install/lib/libshardbfc_torch.so"
    else
        echo "$build/.libs/libshardbfc_torch.so"
    fi
}

st_torch() {
    local rc py=${PYTHON:-python3}
    command -v "$py" >/dev/null || { no_gpu "no $py"; return; }
    PYTHONPYCACHEPREFIX="$work/pycache" "$py" -m py_compile "$top/scripts/torch_check.py" \
        >>"$out/torch.log" 2>&1 ||
        { note="scripts/torch_check.py does not compile"; return 1; }
    local args=(--plugin "$(plugin_path)" --out "$out")
    [ $quick -eq 1 ] && args+=(--dry)
    echo "### $py scripts/torch_check.py ${args[*]}" >>"$out/torch.log"
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 limit "$py" "$top/scripts/torch_check.py" "${args[@]}" \
        >>"$out/torch.log" 2>&1
    rc=$?
    cap_log "$out/torch.log"
    case $rc in
        0) note="$(grep -E 'peak reserved' "$out/torch.log" | tail -n 1 | sed 's/^ *//')" ;;
        77) no_gpu "$(tail -n 1 "$out/torch.log")"; return ;;
        *) note="$(grep -E 'FAIL|failed' "$out/torch.log" | head -n 1) (torch.log)" ;;
    esac
    return $rc
}

torch_dir=""

st_torch_shim() {
    local py=${PYTHON:-python3} abi
    if [ $quick -eq 1 ]; then
        note="--quick: left to the full run (a C++ build against libtorch)"
        return 77
    fi
    torch_dir=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)
    if [ -z "$torch_dir" ]; then
        no_gpu "PyTorch is not importable here: the perf harness lists torch as skipped"
        return
    fi
    abi=$("$py" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))' 2>/dev/null || echo 1)
    {
        echo "### make perf-torch TORCH_DIR=$torch_dir TORCH_CXX11_ABI=$abi"
        limit make -C "$build" perf-torch TORCH_DIR="$torch_dir" TORCH_CXX11_ABI="$abi"
    } >>"$out/perf.log" 2>&1 || { note="shim build failed (perf.log)"; return 1; }
    note="against $torch_dir"
}

st_perf() {
    local rc args vargs sargs
    [ -x "$build/perf/shardbfc-perf" ] || { note="perf/shardbfc-perf not built"; return 1; }
    # First what a map and an unmap call cost from 1..16 threads, one
    # backend shared and one per thread (seconds): where the calls wait.
    if [ $sim -eq 1 ]; then
        vargs=(--threads 1,2 --pairs 20)
    else
        vargs=(--backend cuda --threads 1,2,4,8,16 --pairs 300)
    fi
    # A failure here is reported at the end: the harness still runs.
    local vfail=""
    if [ -x "$build/perf/vmm_calls" ]; then
        echo "### perf/vmm_calls ${vargs[*]}" >>"$out/perf.log"
        (cd "$build" && limit ./perf/vmm_calls "${vargs[@]}") >>"$out/perf.log" 2>&1
        rc=$?
        # 77: no virtual memory on this backend (said in the log); else it must pass.
        [ $rc -eq 0 ] || [ $rc -eq 77 ] || vfail="vmm_calls exit $rc (perf.log)"
    fi
    if [ $sim -eq 1 ]; then
        # What can run here: the harness, with the CUDA allocators listed as
        # skipped (with their reasons) rather than failing.
        args=(--quick --seconds 0.05 --workload churn --threads 1
              --allocators shardbfc,cuda,cuda-async,torch)
    else
        args=(--backend cuda --workload churn,cross,inference --threads 1,4,16 --seconds 0.5
              --allocators shardbfc,cuda,cuda-async,torch --contexts both)
        # PyTorch's column needs the shim: built here when the torch-shim
        # step was skipped (a perf-only run), as that step builds it.
        if [ ! -f "$build/perf/libshardbfc_perf_torch.so" ]; then
            local n0=$note
            st_torch_shim || true
            note=$n0
        fi
    fi
    echo "### perf/shardbfc-perf ${args[*]}" >>"$out/perf.log"
    (cd "$build" && SHARDBFC_PERF_TORCH="$build/perf/libshardbfc_perf_torch.so" \
        limit ./perf/shardbfc-perf "${args[@]}" --json "$out/perf-gpu.json") \
        >>"$out/perf.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && [ $sim -eq 0 ]; then
        # The steady state at 16 threads: a 0.1 s warm-up does not cover
        # the shards' growth to their peak through the driver's serialised
        # map calls, so the rows above include it (their "window m/u"
        # column says how much).  libshardbfc alone, warmed up for 3 s
        # (perf.log only: the results stay at eight files).
        sargs=(--backend cuda --workload inference,churn --threads 16 --seconds 1 --warmup 3
               --allocators shardbfc --contexts both --baseline none)
        echo "### perf/shardbfc-perf ${sargs[*]}" >>"$out/perf.log"
        (cd "$build" && limit ./perf/shardbfc-perf "${sargs[@]}") >>"$out/perf.log" 2>&1
        rc=$?
    fi
    cap_log "$out/perf.log"
    [ $rc -eq 0 ] || { note="shardbfc-perf exit $rc (perf.log)${vfail:+; $vfail}"; return 1; }
    [ -z "$vfail" ] || { note="$vfail"; return 1; }
    # Every allocator asked for is in the JSON: measured, or skipped with
    # its reason (a device that is there measures them; none skips them).
    local a
    for a in shardbfc cuda cuda-async torch; do
        grep -qE "\"allocator\": \"$a\"" "$out/perf-gpu.json" ||
            { note="$a was neither measured nor listed as skipped"; return 1; }
    done
    if [ $sim -eq 1 ]; then
        if grep -qE 'skipped: cuda ' "$out/perf.log"; then
            note="CUDA allocators skipped here: $(grep -E 'skipped: torch' "$out/perf.log" |
                head -n 1 | sed 's/.*churn *//')"
            return 77
        fi
        note="measured briefly on the device (--sim): $(grep -cE '"workload"' "$out/perf-gpu.json") rows"
        return 0
    fi
    note="$(grep -E '^  cuda churn' "$out/perf.log" | sed 's/  */ /g; s/^ //' | paste -sd ';' -)"
    # And what 16 threads' map calls achieve against one thread's, both layouts.
    note="$note; vmm_calls 16 threads: $(grep -E '^  (shared|per-thread) +16 ' "$out/perf.log" |
        awk '{print $1, $NF}' | paste -sd ',' -)"
    # The steady state at 16 threads (the run after the 3 s warm-up): calls
    # per second and the window's map/unmap calls per 1,000 allocations.
    note="$note; steady 16 threads: $(steady_rows "$out/perf.log")"
}

# The 16-thread rows of the last shardbfc-perf run in a log (the one with
# --warmup): "workload allocator ops/s window-maps/unmaps", comma-separated.
steady_rows() {
    awk '/^### perf\/shardbfc-perf .*--warmup/ { on = 1; next }
         /^### / { on = 0 }
         on && /^== [a-z-]+ ==$/ { wl = $2 }
         on && NF > 10 && $1 == 16 && $2 ~ /^shardbfc/ { print wl, $2, $3, $NF }' "$1" |
        paste -sd ',' -
}

# The allocator's own scaling where there are cores to show it: the SIM
# backend (no device calls), 1..16 threads, one context for all threads
# and one per thread, against the ALU loop timed beside each count.
st_scaling() {
    local rc args sargs
    [ -x "$build/perf/shardbfc-perf" ] || { note="perf/shardbfc-perf not built"; return 1; }
    if [ $quick -eq 1 ]; then
        args=(--quick --seconds 0.05 --workload churn --threads 1,2)
    elif [ $sim -eq 1 ]; then
        args=(--seconds 0.2 --workload churn,cross,inference,arena --threads 1,2)
    else
        args=(--seconds 0.5 --runs 3 --workload churn,cross,inference,arena --threads 1,2,4,8,16)
    fi
    # Three baselines: the register-only ALU loop; the loop touching 1 MiB
    # per thread, which shares what the cores share (caches); and ports,
    # eight chains per thread, which shares the physical core where the
    # machine's vCPUs are SMT siblings (a VM may not say so: lscpu first).
    args+=(--backend sim --allocators shardbfc --contexts both --baseline alu,mem,ports)
    { echo "### lscpu"; lscpu 2>&1 || grep -E '^(model name|siblings|cpu cores)' /proc/cpuinfo | sort | uniq -c; } \
        >>"$out/perf.log"
    echo "### perf/shardbfc-perf ${args[*]}" >>"$out/perf.log"
    (cd "$build" && limit ./perf/shardbfc-perf "${args[@]}" --json "$out/perf-sim.json") \
        >"$work/scaling.log" 2>&1
    rc=$?
    cat "$work/scaling.log" >>"$out/perf.log"
    cap_log "$out/perf.log"
    [ $rc -eq 0 ] || { note="shardbfc-perf exit $rc (perf.log)"; return 1; }
    # The speed-up at the largest count, for the summary line.
    note="$(scaling_note "$work/scaling.log")"
    [ -n "$note" ] || note="$(nproc) cores: $(grep -cE '"workload"' "$out/perf-sim.json") rows (perf.log)"
    [ $quick -eq 0 ] || return 0
    # The steady state: the same at 1 and 16 threads after a 2 s warm-up
    # (--sim: 1 and 2 threads, briefly).
    # With the default 0.1 s, the 16 shards' growth to their peak (and one
    # context's loans between them) falls partly inside the window: on the
    # H200 machine, inference with one context made 0.89 map calls per
    # 1,000 allocations in the window and its threads slept 26,000 times a
    # second, against 0.13 and 3,200 after 2 s (perf.log only: the results
    # stay at eight files).
    if [ $sim -eq 1 ]; then
        sargs=(--seconds 0.1 --warmup 0.3 --workload churn,inference,arena --threads 1,2)
    else
        sargs=(--seconds 0.5 --warmup 2 --runs 3 --workload churn,inference,arena --threads 1,16)
    fi
    sargs+=(--backend sim --allocators shardbfc --contexts both --baseline alu,mem,ports)
    echo "### perf/shardbfc-perf ${sargs[*]}" >>"$out/perf.log"
    (cd "$build" && limit ./perf/shardbfc-perf "${sargs[@]}") >"$work/steady.log" 2>&1
    rc=$?
    cat "$work/steady.log" >>"$out/perf.log"
    cap_log "$out/perf.log"
    [ $rc -eq 0 ] || { note="$note; steady state: shardbfc-perf exit $rc (perf.log)"; return 1; }
    local steady
    steady=$(scaling_note "$work/steady.log")
    [ -z "$steady" ] || note="$note; after a warm-up of ${sargs[3]} s: $steady"
    return 0
}

# A harness log's 16-thread speed-up lines, shortened ("" when it has none:
# a --sim run stops at 2 threads).
scaling_note() {
    { grep -E '^  (churn|cross|inference|arena) [0-9]+ threads: shardbfc(-ctx)? speed-up' "$1" || true; } |
        sed -E 's/^ +//; s/ \(x 1 thread; ALU ([0-9.]+)x(, ports [0-9.]+x)?\) +([0-9.]+) .*/ \3x (ALU \1x\2)/' |
        paste -sd ';' -
}

# Where the allocator's time goes, at one thread and at the machine's core
# count: perf record (cpu-clock: a VM has no hardware events) of churn and
# arena with a context per thread -- nothing shared, so a symbol or a
# source line whose share grows with the threads is what they contend on --,
# each symbol's share and, for the two entry points, each source line's
# (perf.log).  On the H200 machine this found the harness's own peak
# sampling at 15% of churn's time at 16 threads (1% at one).  perf comes
# from the pack (pack --with-perf; the GPU image has none), else, with
# --sim, from the PATH.  Diagnostic: SKIP, with the reason, where perf is
# missing or may not sample (perf_event_paranoid, a seccomp filter).
st_profile() {
    local perfx="$dir/perf/perf" plib="$dir/perf" n secs wl t data rc
    if [ $quick -eq 1 ]; then
        note="--quick: left to the full run"
        return 77
    fi
    [ -x "$build/perf/shardbfc-perf" ] || { note="perf/shardbfc-perf not built"; return 1; }
    if [ ! -x "$perfx" ]; then
        if [ $sim -eq 1 ] && command -v perf >/dev/null; then
            perfx=$(command -v perf)
            plib=""
        else
            note="no perf in the pack (scripts/gpu-check.sh pack --with-perf)"
            return 77
        fi
    fi
    if [ $sim -eq 1 ]; then
        n=2 secs=0.3
    else
        n=$(nproc) secs=2
    fi
    echo "### profile: $perfx record -e cpu-clock -F 1999, perf/shardbfc-perf --allocators" \
        "shardbfc-ctx --contexts per-thread --seconds $secs, 1 and $n threads" >>"$out/perf.log"
    note=""
    for wl in churn arena; do
        for t in 1 "$n"; do
            data="$work/profile-$wl-$t.data"
            (cd "$build" && LD_LIBRARY_PATH="${plib:+$plib:}${LD_LIBRARY_PATH:-}" limit "$perfx" record \
                -N -e cpu-clock -F 1999 -o "$data" -- ./perf/shardbfc-perf --workload "$wl" \
                --threads "$t" --allocators shardbfc-ctx --contexts per-thread --seconds "$secs" \
                --baseline none) >"$work/profile.log" 2>&1
            rc=$?
            if [ $rc -ne 0 ]; then
                tail -n 5 "$work/profile.log" >>"$out/perf.log"
                note="perf record exit $rc: $(grep -v '^\[' "$work/profile.log" | tail -n 1)"
                return 77
            fi
            profile_report "$perfx" "$plib" "$data" "$wl, $t thread(s)" >>"$out/perf.log"
            if [ "$t" = "$n" ]; then
                note="${note:+$note; }$wl $n threads: $(LD_LIBRARY_PATH="${plib:+$plib:}${LD_LIBRARY_PATH:-}" \
                    "$perfx" report -i "$data" --sort sym --stdio 2>/dev/null | grep -E '^ +[0-9.]+%' |
                    head -n 3 | awk '{print $NF, $1}' | paste -sd ',' -)"
            fi
        done
    done
    cap_log "$out/perf.log"
}

profile_report() { # perf libdir data title
    local perfx=$1 plib=$2 data=$3 s
    echo "#### $4: symbols"
    LD_LIBRARY_PATH="${plib:+$plib:}${LD_LIBRARY_PATH:-}" "$perfx" report -i "$data" --sort dso,sym \
        --stdio 2>/dev/null | grep -E '^ +[0-9.]+%' | head -n 25
    for s in bfc_ctx_alloc bfc_ctx_free; do
        echo "#### $4: $s by source line"
        LD_LIBRARY_PATH="${plib:+$plib:}${LD_LIBRARY_PATH:-}" "$perfx" annotate -i "$data" --stdio -l \
            -s "$s" 2>/dev/null | awk '/^ +[0-9.]+ +:/ { exit } /^ +[0-9]+\.[0-9]+ / { print }' | head -n 15
    done
}

do_run() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --dir) [ $# -ge 2 ] || die "--dir needs a value"; dir=$2; shift 2 ;;
            --out) [ $# -ge 2 ] || die "--out needs a value"; out=$2; shift 2 ;;
            --work) [ $# -ge 2 ] || die "--work needs a value"; work=$2; shift 2 ;;
            --build) [ $# -ge 2 ] || die "--build needs a value"; build=$2; shift 2 ;;
            --jobs) [ $# -ge 2 ] || die "--jobs needs a value"; jobs=$2; shift 2 ;;
            --skip) [ $# -ge 2 ] || die "--skip needs a value"; skip_list=$2; shift 2 ;;
            --budget) [ $# -ge 2 ] || die "--budget needs a value"; budget=$2; shift 2 ;;
            --sim) sim=1; shift ;;
            --quick) quick=1; shift ;;
            -h | --help) usage 0 ;;
            *) die "run: unknown argument $1" ;;
        esac
    done
    case "$jobs" in
        "") jobs=$(nproc 2>/dev/null || echo 2) ;;
        *[!0-9]* | 0) die "--jobs expects a positive number" ;;
    esac
    case "$budget" in
        *[!0-9]* | "") die "--budget expects whole seconds (0: none)" ;;
    esac
    t_start=$(date +%s)
    local s
    for s in ${skip_list//,/ }; do
        case "$s" in
            unpack | build | gpu-tests | scaling | suite | memcheck | racecheck | torch | \
                torch-shim | perf | profile) ;;
            *) die "--skip: unknown step $s" ;;
        esac
    done
    if [ $quick -eq 1 ]; then
        [ $sim -eq 1 ] || die "--quick goes with --sim (it runs no GPU step)"
        [ -n "$build" ] || die "--quick needs --build DIR (an existing build tree)"
    fi
    if [ -n "$build" ]; then
        [ -f "$build/Makefile" ] || die "--build $build: not a configured build tree"
        build=$(cd "$build" && pwd)
        [ $quick -eq 1 ] || die "--build goes with --quick (a full run builds the tarball)"
    fi
    dir=${dir:-$top/gpu-pack}
    out=${out:-${OUT:-$PWD/gpu-check-out}}
    work=${work:-${TMPDIR:-/tmp}/shardbfc-gpu-check}
    mkdir -p "$out" "$work" || exit 1
    out=$(cd "$out" && pwd)
    work=$(cd "$work" && pwd)
    [ -d "$dir" ] && dir=$(cd "$dir" && pwd)
    prefix="$work/prefix"
    rm -f "$out/summary.txt" "$out/suite.log" "$out/gpu.log" "$out/torch.log" \
        "$out/torch_check.json" "$out/perf.log" "$out/perf-sim.json" "$out/perf-gpu.json"

    if [ -n "${CUDA_HOME:-}" ]; then
        cuda_dir=$CUDA_HOME
    elif command -v nvcc >/dev/null; then
        cuda_dir=$(dirname "$(dirname "$(command -v nvcc)")")
    elif [ -d /usr/local/cuda ]; then
        cuda_dir=/usr/local/cuda
    fi
    if [ $sim -eq 0 ] && [ -z "$cuda_dir" ]; then
        echo "$prog: no CUDA toolkit (set CUDA_HOME)" >&2
    fi

    mode_desc="run$([ $sim -eq 1 ] && echo ' --sim')$([ $quick -eq 1 ] && echo ' --quick')"
    mode_desc="$mode_desc; pack $dir; out $out; work $work; jobs $jobs"
    [ "$budget" -eq 0 ] || mode_desc="$mode_desc; budget $budget s"
    started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    tpc=$(lscpu 2>/dev/null | sed -nE 's/^Thread\(s\) per core: +//p' | head -n 1)
    machine="$(nproc 2>/dev/null) cores${tpc:+ ($tpc thread(s) per core as the OS reports it)}, $(uname -m)"
    machine="$machine; CUDA ${cuda_dir:-none}"
    if command -v nvidia-smi >/dev/null; then
        machine="$machine; $(nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv,noheader 2>/dev/null | head -n 1)"
    fi
    echo "$prog: $mode_desc"
    echo "$prog: $machine"

    step unpack st_unpack
    if [ $quick -eq 0 ]; then
        if [ "${results[0]}" != PASS ]; then
            write_summary final
            cat "$out/summary.txt"
            return 1
        fi
        step build st_build
        if [ "${results[${#results[@]} - 1]}" != PASS ]; then
            write_summary final
            cat "$out/summary.txt"
            return 1
        fi
    fi
    step gpu-tests st_gpu_tests
    step scaling st_scaling
    [ $quick -eq 1 ] || step suite st_suite
    step memcheck st_memcheck
    step torch st_torch
    step torch-shim st_torch_shim
    step perf st_perf
    step profile st_profile
    step racecheck st_racecheck
    write_summary final
    echo
    cat "$out/summary.txt"
    for s in "${results[@]}"; do
        [ "$s" != FAIL ] || return 1
    done
    return 0
}

[ $# -ge 1 ] || usage 2
cmd=$1
shift
case "$cmd" in
    pack) do_pack "$@" ;;
    run) do_run "$@" ;;
    -h | --help | help) usage 0 ;;
    *) echo "$prog: unknown command $cmd" >&2; usage 2 ;;
esac
