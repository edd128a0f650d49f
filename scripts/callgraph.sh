#!/bin/sh
# callgraph.sh -- the calls between the files of src/, checked against the
# layers of the library and drawn as a picture.
#
#   scripts/callgraph.sh [--check] [--dot FILE] [--svg FILE] [--list]
#
# GNU cflow's cross-reference (cflow -x) lists, for every global symbol of
# src/, where it is defined and every place that refers to it.  A reference
# in file A to a symbol defined in file B is an edge A -> B (a call, or a use
# of a variable).  Static functions are file-local and never cross files, so
# they are left out; a static inline function in a header counts as part of
# that header's layer, so a call hidden in one is seen where it is written.
# X_inline.h (a module's hot functions, inline) is part of module X.
#
# The layers, bottom first (a file may use files of its own layer or below,
# never above; and no circle of files at all):
#   0 base      internal.h mutex rcu errors config meta
#   1 backend   backend backend_sim backend_cuda backend_host backend_vmm
#   2 memory    fence pool region regionmap trace obs
#   3 arena     chunk bins arena expand remote
#   4 shards    shard
#   5 context   ctx stats obs_oom host
#   6 api       api torch_plugin
# --check prints every edge that goes up a layer and every circle, and exits
# 1 if there is any.  --dot / --svg write the graph (--svg needs graphviz's
# dot), files grouped by layer, an edge going up drawn red.  --list prints
# the edges.  Needs cflow (Debian package cflow).
set -eu

top=$(cd "$(dirname "$0")/.." && pwd)
check=0 dot= svg= list=0
while [ $# -gt 0 ]; do
    case $1 in
    --check) check=1 ;;
    --dot) dot=$2; shift ;;
    --svg) svg=$2; shift ;;
    --list) list=1 ;;
    *) echo "usage: $0 [--check] [--dot FILE] [--svg FILE] [--list]" >&2; exit 2 ;;
    esac
    shift
done
command -v cflow >/dev/null 2>&1 || { echo "callgraph: cflow is not installed (apt-get install cflow)" >&2; exit 77; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$top"
# shellcheck disable=SC2046
cflow -x $(ls src/*.c src/*.h) > "$tmp/xref" 2>/dev/null

awk -v check="$check" -v list="$list" -v dotfile="$tmp/graph.dot" '
function mod(path,    m) {
    m = path
    sub(/^src\//, "", m)
    sub(/:[0-9]+$/, "", m)
    sub(/\.[ch]$/, "", m)
    sub(/_inline$/, "", m)
    return m
}
BEGIN {
    split("internal mutex rcu errors config meta", l0, " ");          for (i in l0) rank[l0[i]] = 0
    split("backend backend_sim backend_cuda backend_host backend_vmm", l1, " "); for (i in l1) rank[l1[i]] = 1
    split("fence pool region regionmap trace obs", l2, " ");          for (i in l2) rank[l2[i]] = 2
    split("chunk bins arena expand remote", l3, " ");                 for (i in l3) rank[l3[i]] = 3
    split("shard", l4, " ");                                          for (i in l4) rank[l4[i]] = 4
    split("ctx stats obs_oom host", l5, " ");                         for (i in l5) rank[l5[i]] = 5
    split("api torch_plugin", l6, " ");                               for (i in l6) rank[l6[i]] = 6
    names[0] = "base"; names[1] = "backend"; names[2] = "memory"; names[3] = "arena"
    names[4] = "shards"; names[5] = "context"; names[6] = "api"
}
# Only the library'"'"'s own names: bfc_ and bfc__ (cflow may take a macro
# such as BFC__UNLIKELY for a definition).
$1 !~ /^bfc_/ { next }
$2 == "*" { def[$1] = mod($3); files[mod($3)] = 1; next }
{ nref++; rsym[nref] = $1; rfile[nref] = mod($2); files[mod($2)] = 1 }
END {
    for (i = 1; i <= nref; i++) {
        s = rsym[i]; a = rfile[i]
        if (!(s in def)) continue
        b = def[s]
        if (a == b) continue
        e = a " -> " b
        if (!(e in edge)) { edge[e] = s; from[e] = a; to[e] = b; adj[a] = adj[a] " " b }
    }
    bad = 0
    for (f in files) if (!(f in rank)) { printf "callgraph: src/%s is in no layer (add it to scripts/callgraph.sh)\n", f; bad++ }
    for (e in edge) {
        if (list) printf "%s   (%s)\n", e, edge[e]
        if ((from[e] in rank) && (to[e] in rank) && rank[from[e]] < rank[to[e]]) {
            printf "callgraph: up a layer: %s (%s %s -> %s %s, via %s)\n", e, names[rank[from[e]]], from[e], \
                names[rank[to[e]]], to[e], edge[e]
            up[e] = 1
            bad++
        }
    }
    # Circles: a depth-first search over the files (three colours).
    for (f in files) colour[f] = 0
    for (f in files) if (colour[f] == 0) bad += dfs(f)
    # The picture.
    print "digraph src {" > dotfile
    print "  rankdir=BT; node [shape=box, fontname=\"Helvetica\", fontsize=10]; edge [arrowsize=0.6];" > dotfile
    for (r = 0; r <= 6; r++) {
        printf "  subgraph cluster_%d { label=\"%d %s\"; fontname=\"Helvetica\"; style=rounded; color=grey;", r, r, names[r] > dotfile
        for (f in files) if ((f in rank) && rank[f] == r) printf " \"%s\";", f > dotfile
        print " }" > dotfile
    }
    for (e in edge) printf "  \"%s\" -> \"%s\"%s;\n", from[e], to[e], (e in up) ? " [color=red, penwidth=2]" : "" > dotfile
    print "}" > dotfile
    if (check) {
        if (bad) { printf "callgraph: %d problem(s)\n", bad; exit 1 }
        n = 0; for (e in edge) n++
        m = 0; for (f in files) m++
        printf "callgraph: %d files, %d edges between them, every edge down or within a layer, no circle\n", m, n
    }
}
function dfs(f,    n, i, t, k, found) {
    colour[f] = 1; stack[++depth] = f; found = 0
    n = split(adj[f], t, " ")
    for (i = 1; i <= n; i++) {
        if (colour[t[i]] == 1) {
            printf "callgraph: circle:"
            for (k = 1; k <= depth; k++) if (started || stack[k] == t[i]) { started = 1; printf " %s ->", stack[k] }
            started = 0
            printf " %s\n", t[i]
            found++
        } else if (colour[t[i]] == 0) {
            found += dfs(t[i])
        }
    }
    colour[f] = 2; depth--
    return found
}
' "$tmp/xref"
rc=$?
if [ -n "$dot" ]; then cp "$tmp/graph.dot" "$dot"; fi
if [ -n "$svg" ]; then
    command -v dot >/dev/null 2>&1 || { echo "callgraph: graphviz's dot is not installed" >&2; exit 1; }
    dot -Tsvg "$tmp/graph.dot" -o "$svg"
fi
exit $rc
