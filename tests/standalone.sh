#!/bin/sh
# standalone.sh -- `make check`: the sources and documents stand on their own.
#
#   1. Every file path that README.md, doc/*.md and perf/README.md name
#      (include/..., src/..., tests/..., perf/..., tools/..., doc/...,
#      scripts/..., m4/..., .ci/...) is in the source tree: a file or
#      directory, or a program built from PATH.c, PATH.sh or the sources
#      Makefile.am lists for it.  Under
#      `make distcheck` the source tree is the release tarball, so this is
#      also the check that the tarball ships every file the documents point
#      to.
#   2. No source, test, script or document refers to an issue tracker's
#      numbers or to design documents that live outside the repository: the
#      reasoning belongs in the text itself.
set -u

srcdir=${top_srcdir:-..}
[ -f "$srcdir/include/shardbfc.h" ] || { echo "standalone.sh: no source tree at $srcdir" >&2; exit 1; }
status=0

# ------------------------------------------------------------ 1. paths
docs="README.md doc/ARCHITECTURE.md doc/trace.md doc/snapshot.md doc/PERFORMANCE.md perf/README.md"
# A path starts the text or follows a character that cannot be part of one
# (so share/doc/shardbfc is not taken for doc/shardbfc).
paths=$(cd "$srcdir" && grep -ohE '(^|[^A-Za-z0-9_./-])(\.ci|include|src|tests|perf|tools|doc|scripts|m4)/[A-Za-z0-9_.{},/-]*[A-Za-z0-9_}]' \
        $docs | sed 's|^[^A-Za-z0-9_.]||' | sort -u)
for p in $paths; do
    case $p in
        *'{'*) # tools/x-{a,b}.c: each alternative
            pre=${p%%\{*} rest=${p#*\{} alts=${rest%%\}*} post=${rest#*\}}
            list=$(echo "$alts" | tr ',' ' ')
            expanded=
            for a in $list; do expanded="$expanded $pre$a$post"; done;;
        *) expanded=$p;;
    esac
    for q in $expanded; do
        if [ -e "$srcdir/$q" ] || [ -e "$srcdir/$q.c" ] || [ -e "$srcdir/$q.sh" ]; then
            continue
        fi
        # A program Makefile.am builds from other sources (NAME_SOURCES).
        canon=$(echo "$q" | tr '/.-' '___')
        if grep -q "^${canon}_SOURCES *=" "$srcdir/Makefile.am"; then
            continue
        fi
        echo "standalone.sh: $q is named in $(cd "$srcdir" && grep -l -F "$q" $docs | tr '\n' ' ')but is not in the source tree" >&2
        status=1
    done
done

# ---------------------------------------------------- 2. no outside refs
# The patterns are assembled so that this file does not match itself.
iss='[Ii]ssue''s? #?[0-9]'
ext="(API|DESIGN|STYLE)""\\.md|\\.\\./shared/|/work/""shared"
if [ -d "$srcdir/.git" ] || [ -f "$srcdir/.git" ]; then
    files=$(cd "$srcdir" && git ls-files 2>/dev/null | grep -v -E '^tests/fuzz/corpus/|^tests/standalone\.sh$')
else
    files=$(cd "$srcdir" && find include src tests perf tools doc scripts m4 .ci README.md Makefile.am \
            configure.ac autogen.sh shardbfc.pc.in -type f 2>/dev/null |
            grep -v -E '^tests/fuzz/corpus/|^tests/standalone\.sh$')
fi
hits=$(cd "$srcdir" && echo "$files" | xargs grep -n -E "$iss|$ext" 2>/dev/null || true)
if [ -n "$hits" ]; then
    echo "standalone.sh: references to issues or to documents outside the repository:" >&2
    echo "$hits" >&2
    status=1
fi
[ $status -eq 0 ] && echo "standalone.sh: $(echo "$paths" | wc -w) paths named by the documents exist; no outside references"
exit $status
