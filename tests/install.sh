#!/bin/sh
# install.sh -- `make check`: libshardbfc installed like a package.
#
#   1. `make install prefix=TMP` from this build tree (TMP is a fresh
#      temporary directory, removed at the end);
#   2. a program that uses the public API, built with
#      `pkg-config --cflags --libs shardbfc` from TMP/lib/pkgconfig, run with
#      LD_LIBRARY_PATH and, built again with an rpath, without it;
#   3. the same program linked against TMP/lib/libshardbfc.a with
#      `pkg-config --static --libs shardbfc` (which must name only libraries
#      that exist on the machine: no -ludev), and run: its malloc must
#      still be the C library's, not the library's jemalloc;
#   4. each installed tool: --help (exit 0, usage on stdout), its man page,
#      and real work on what the program left behind -- an oom_dump file
#      (shardbfc-stat, shardbfc-view) and a trace (shardbfc-replay);
#   5. nm -D of the installed library: bfc_ names only.
#
# Which libraries there must be comes from the build's libtool script
# (build_libtool_libs, build_old_libs): under --disable-shared steps 2 and 5
# are skipped and the static link of step 3 must work; under
# --disable-static step 3 is.
#
# Needs MAKE, CC and abs_top_builddir from the test environment (Makefile.am
# exports them).  Exit 77 (skip) when pkg-config is missing.
set -u

fail() { echo "install.sh: $*" >&2; exit 1; }

command -v pkg-config >/dev/null 2>&1 || { echo "install.sh: pkg-config not installed" >&2; exit 77; }
builddir=${abs_top_builddir:?abs_top_builddir not set (run through make check)}
make=${MAKE:-make}
cc=${CC:-cc}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/shardbfc-install.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

lt_var() { sed -n "s/^$1=//p" "$builddir/libtool" | head -n 1; }
[ -f "$builddir/libtool" ] || fail "$builddir/libtool not found"
shared=$(lt_var build_libtool_libs)
static=$(lt_var build_old_libs)
[ "$shared" = yes ] || [ "$static" = yes ] || fail "libtool builds neither a shared nor a static library"

# --------------------------------------------------------------- 1. install
# MAKEFLAGS from the outer make (-j, the jobserver, -k) is left out: this is
# one serial install of an up-to-date tree.
if ! env -u MAKEFLAGS -u MFLAGS $make -C "$builddir" install prefix="$prefix" >"$tmp/install.log" 2>&1; then
    tail -n 30 "$tmp/install.log" >&2
    fail "make install prefix=$prefix failed"
fi
echo "installed into a temporary prefix:"
(cd "$prefix" && find . -type f | sort | sed 's/^/  /')

libdir=$prefix/lib
export PKG_CONFIG_PATH="$libdir/pkgconfig"
pc_libdir=$(pkg-config --variable=libdir shardbfc) || fail "pkg-config does not find shardbfc.pc"
[ "$pc_libdir" = "$libdir" ] || fail "shardbfc.pc says libdir=$pc_libdir, installed in $libdir"
want_lib=
[ "$shared" = yes ] && want_lib="$libdir/libshardbfc.so"
[ "$static" = yes ] && want_lib="$want_lib $libdir/libshardbfc.a"
# shellcheck disable=SC2086
for f in "$prefix/include/shardbfc.h" "$prefix/include/shardbfc_sim.h" $want_lib \
         "$prefix/share/doc/shardbfc/README.md" "$prefix/share/doc/shardbfc/doc/trace.md" \
         "$prefix/share/doc/shardbfc/doc/snapshot.md" "$prefix/share/doc/shardbfc/doc/PERFORMANCE.md" \
         "$prefix/share/doc/shardbfc/doc/ARCHITECTURE.md"; do
    [ -f "$f" ] || fail "$f not installed"
done

# ------------------------------------------------------ 2. a program, pkg-config
cat > "$tmp/prog.c" <<'PROG'
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <shardbfc.h>
#include <shardbfc_sim.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    /* Whose malloc the program got: the library's metadata allocator must
     * not become the program's (step 3). */
    Dl_info who;
    void *m = dlsym(RTLD_DEFAULT, "malloc");
    printf("prog: malloc from %s\n", m && dladdr(m, &who) && who.dli_fname ? who.dli_fname : "?");
    char err[512];
    bfc_config_t cfg;
    bfc_config_init(&cfg);
    if (bfc_config_parse_err(&cfg, "backend=sim,memory_limt=1G", err, sizeof err) != BFC_EINVAL ||
        !strstr(err, "memory_limt")) {
        fprintf(stderr, "prog: parse_err: %s\n", err);
        return 1;
    }
    char spec[600];
    snprintf(spec, sizeof spec, "backend=sim,vmm=off,memory_limit=8M,initial_region=8M%s%s%s%s",
             argc > 1 ? ",oom_dump=" : "", argc > 1 ? argv[1] : "", argc > 2 ? ",trace=" : "",
             argc > 2 ? argv[2] : "");
    if (bfc_config_parse_err(&cfg, spec, err, sizeof err) != BFC_OK) {
        fprintf(stderr, "prog: %s\n", err);
        return 1;
    }
    bfc_ctx_t *ctx;
    int st = bfc_ctx_create(&cfg, &ctx);
    if (st != BFC_OK) {
        fprintf(stderr, "prog: bfc_ctx_create: %s\n", bfc_strerror(st));
        return 1;
    }
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *big = bfc_ctx_alloc(ctx, a, 4 << 20);
    void *keep = bfc_ctx_alloc(ctx, a, 1024);
    if (!keep || !big || bfc_ctx_free(ctx, big, a) != BFC_OK)
        return 1;
    /* Stream b cannot have the memory stream a holds (a free chunk before a
     * live block; the free tail after it is too small): an OOM, reported. */
    if (bfc_ctx_alloc(ctx, b, 4 << 20) != NULL || bfc_last_error() != BFC_ENOMEM)
        return 1;
    bfc_oom_info_t why;
    if (bfc_ctx_oom_info(ctx, &why) != BFC_OK || why.cause != BFC_OOM_HELD)
        return 1;
    printf("prog: ok: %s\n", why.diagnosis);
    bfc_ctx_free(ctx, keep, a);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    return 0;
}
PROG

cflags=$(pkg-config --cflags shardbfc) || fail "pkg-config --cflags shardbfc"
libs=$(pkg-config --libs shardbfc) || fail "pkg-config --libs shardbfc"
echo "pkg-config --cflags --libs shardbfc: $cflags $libs"
# The build's own CFLAGS/LDFLAGS: a sanitizer build's library needs its
# runtime in the program too.
if [ "$shared" = yes ]; then
# shellcheck disable=SC2086
$cc ${BFC_TEST_CFLAGS:-} $cflags "$tmp/prog.c" ${BFC_TEST_LDFLAGS:-} $libs -o "$tmp/prog" 2>"$tmp/cc.log" ||
    { cat "$tmp/cc.log" >&2; fail "cannot build a program with pkg-config --cflags --libs shardbfc"; }
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/prog" "$tmp/oom.json" "$tmp/trace.csv" \
    >"$tmp/prog.out" 2>&1 || { cat "$tmp/prog.out" >&2; fail "the program built against the install failed"; }
cat "$tmp/prog.out"
grep -q 'held by other streams' "$tmp/prog.out" || fail "no OOM diagnosis from the installed library"
# shellcheck disable=SC2086
$cc ${BFC_TEST_CFLAGS:-} $cflags "$tmp/prog.c" ${BFC_TEST_LDFLAGS:-} $libs -Wl,-rpath,"$pc_libdir" \
    -o "$tmp/prog-rpath" 2>"$tmp/cc.log" || { cat "$tmp/cc.log" >&2; fail "cannot build with an rpath"; }
"$tmp/prog-rpath" >/dev/null 2>&1 || fail "the program with an rpath to the install failed"
else
    echo "libshardbfc.so not built (--disable-shared): the program is linked statically below"
fi

# --------------------------------------------------------- 3. static link
static_libs=$(pkg-config --static --libs shardbfc) || fail "pkg-config --static --libs shardbfc"
echo "pkg-config --static --libs shardbfc: $static_libs"
case " $static_libs " in
    *" -ludev "*) fail "pkg-config --static pulls -ludev (hwloc's private library)";;
esac
if [ "$static" = yes ]; then
    # libshardbfc.a itself, then everything else --static names (its own
    # -lshardbfc left out, so that the shared library cannot stand in).
    static_deps=$(echo " $static_libs " | sed 's/ -lshardbfc / /')
    # shellcheck disable=SC2086
    $cc ${BFC_TEST_CFLAGS:-} $cflags "$tmp/prog.c" "$libdir/libshardbfc.a" ${BFC_TEST_LDFLAGS:-} $static_deps \
        -o "$tmp/prog-static" 2>"$tmp/cc.log" ||
        { cat "$tmp/cc.log" >&2; fail "cannot link libshardbfc.a with pkg-config --static --libs shardbfc"; }
    # It must not need libshardbfc.so (the caller's LD_LIBRARY_PATH, which
    # may name where the dependencies live, never names this prefix).
    if command -v readelf >/dev/null 2>&1 &&
        readelf -d "$tmp/prog-static" | grep -q 'NEEDED.*libshardbfc'; then
        fail "the statically linked program needs libshardbfc.so"
    fi
    # Without a shared library, this program leaves step 4 its files.
    set --
    [ "$shared" = yes ] || set -- "$tmp/oom.json" "$tmp/trace.csv"
    "$tmp/prog-static" "$@" >"$tmp/static.out" 2>&1 ||
        { cat "$tmp/static.out" >&2; fail "the statically linked program failed"; }
    grep -q 'held by other streams' "$tmp/static.out" || fail "no OOM diagnosis from libshardbfc.a"
    # Debian's jemalloc exports malloc: a program that needs it before the C
    # library would have it as its own malloc (shardbfc.pc lists -lc first).
    grep -q '^prog: malloc from .*jemalloc' "$tmp/static.out" &&
        fail "linking libshardbfc.a made jemalloc the program's malloc: $(grep 'malloc from' "$tmp/static.out")"
    echo "static link against libshardbfc.a: ok"
else
    echo "libshardbfc.a not built (--disable-static): static link not tried"
fi

# ------------------------------------------------------------- 4. the tools
# The tools were linked (by libtool, at install) for the configured prefix,
# not this temporary one: like any program of a prefix outside the loader's
# path, they find the library through LD_LIBRARY_PATH.
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
for tool in shardbfc-replay shardbfc-view shardbfc-stat; do
    bin=$prefix/bin/$tool
    [ -x "$bin" ] || fail "$tool not installed in $prefix/bin"
    "$bin" --help >"$tmp/help.out" 2>&1 || { cat "$tmp/help.out" >&2; fail "$tool --help exits non-zero"; }
    grep -q "^usage: $tool" "$tmp/help.out" || fail "$tool --help prints no usage line"
    [ "$(wc -l < "$tmp/help.out")" -ge 8 ] || fail "$tool --help says too little"
    "$bin" -h >/dev/null 2>&1 || fail "$tool -h exits non-zero"
    [ -f "$prefix/share/man/man1/$tool.1" ] || fail "no man page for $tool"
    if command -v groff >/dev/null 2>&1; then
        groff -man -Tutf8 -ww -z "$prefix/share/man/man1/$tool.1" 2>"$tmp/groff.log" &&
            [ ! -s "$tmp/groff.log" ] || { cat "$tmp/groff.log" >&2; fail "$tool.1 does not format cleanly"; }
    fi
    echo "$tool: --help, -h and man page ok"
done
"$prefix/bin/shardbfc-stat" "$tmp/oom.json" >"$tmp/stat.out" 2>&1 ||
    { cat "$tmp/stat.out" >&2; fail "shardbfc-stat on the oom_dump file"; }
grep -q '^Out of memory: memory free but held by other streams' "$tmp/stat.out" ||
    { cat "$tmp/stat.out" >&2; fail "shardbfc-stat shows no OOM report"; }
"$prefix/bin/shardbfc-view" "$tmp/oom.json" -o "$tmp/oom.html" || fail "shardbfc-view on the oom_dump file"
grep -q '"diagnosis":"memory free but held by other streams' "$tmp/oom.html" || fail "the page lacks the report"
"$prefix/bin/shardbfc-replay" --config memory_limit=8M,initial_region=8M "$tmp/trace.csv" >"$tmp/replay.out" \
    2>&1 || { cat "$tmp/replay.out" >&2; fail "shardbfc-replay on the program's trace"; }
grep -q 'skipped' "$tmp/replay.out" || fail "shardbfc-replay prints no skipped column"
echo "tools on the program's oom_dump and trace: ok"

# ----------------------------------------------------------- 5. exports
if [ "$shared" = yes ] && command -v nm >/dev/null 2>&1; then
    bad=$(nm -D --defined-only "$libdir/libshardbfc.so" | awk '$2 ~ /^[TDBRVW]$/ {print $3}' |
          grep -v -E '^bfc_[a-z]' | grep -v -E '^(_init|_fini|_edata|_end|__bss_start)$' || true)
    [ -z "$bad" ] || fail "the installed library exports non-bfc_ symbols: $bad"
fi
echo "install.sh: ok"
