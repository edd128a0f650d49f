/*
 * shardbfc-stat.c -- prints a libshardbfc snapshot (bfc_ctx_snapshot_json,
 * or an oom_dump file) as text: the context totals (its peaks that are
 * bounds marked "<= ... (bound)"), then per shard its statistics,
 * fragmentation, regions with their chunks in address order
 * (the layout of bfc_ctx_dump) and non-empty bins.
 *
 *   shardbfc-stat [--summary] SNAPSHOT.json      ("-" reads stdin)
 *   shardbfc-stat --help
 *
 * --summary leaves out regions, chunks and bins.  Exit status: 0, 1 on a
 * bad input, 2 on a usage error.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_read.h"
#include "toolutil.h"

/*
 * A peak: "peak N", or "peak <= N (bound)" where the snapshot names the
 * figure a bound (a context's peaks of allocated and requested bytes,
 * key "..._bound"; doc/snapshot.md).
 */
static void print_peak(const json_object *s, const char *key, bool bound)
{
    char bkey[64];
    snprintf(bkey, sizeof bkey, "%s_bound", key);
    if (bfc_json_get(s, bkey))
        printf("peak <= %" PRIu64 " (bound)", bfc_json_u64(s, bkey, 0));
    else if (bound)
        printf("peak <= %" PRIu64 " (bound)", bfc_json_u64(s, key, 0));
    else
        printf("peak %" PRIu64, bfc_json_u64(s, key, 0));
}

/* bound_peaks: the peaks are bounds under their bare names (a version 1
 * snapshot's totals: the sum of the shards' peaks). */
static void print_stats(const char *indent, const json_object *s, bool bound_peaks)
{
    printf("%sallocated %" PRIu64 " (", indent, bfc_json_u64(s, "bytes_in_use", 0));
    print_peak(s, "peak_bytes_in_use", bound_peaks);
    printf("), requested %" PRIu64 " (", bfc_json_u64(s, "bytes_requested", 0));
    print_peak(s, "peak_bytes_requested", bound_peaks);
    printf("), reserved %" PRIu64 " (peak %" PRIu64 "), limit %" PRIu64 "\n", bfc_json_u64(s, "bytes_reserved", 0),
           bfc_json_u64(s, "peak_bytes_reserved", 0), bfc_json_u64(s, "bytes_limit", 0));
    printf("%sfree %" PRIu64 ", largest free chunk %" PRIu64 ", fragmentation %.4f, pending %" PRIu64
           " blocks / %" PRIu64 " bytes\n",
           indent, bfc_json_u64(s, "bytes_free", 0), bfc_json_u64(s, "largest_free_chunk", 0),
           bfc_json_num(s, "fragmentation", 0), bfc_json_u64(s, "num_pending_frees", 0),
           bfc_json_u64(s, "bytes_pending", 0));
    printf("%sallocs %" PRIu64 ", frees %" PRIu64 " (remote %" PRIu64 "), OOMs %" PRIu64 ", regions %" PRIu64
           ", chunks %" PRIu64 ", largest alloc %" PRIu64 "\n",
           indent, bfc_json_u64(s, "num_allocs", 0), bfc_json_u64(s, "num_frees", 0),
           bfc_json_u64(s, "num_remote_frees", 0), bfc_json_u64(s, "num_ooms", 0),
           bfc_json_u64(s, "num_regions", 0), bfc_json_u64(s, "num_chunks", 0),
           bfc_json_u64(s, "largest_alloc_size", 0));
}

static void help(void)
{
    printf("usage: shardbfc-stat [--summary] SNAPSHOT.json\n"
           "\n"
           "Prints a libshardbfc snapshot (bfc_ctx_snapshot_json, or the file that\n"
           "SHARDBFC_CONF=oom_dump=PATH writes when an allocation fails) as text:\n"
           "the OOM report first when there is one (the diagnosis, the request, each\n"
           "shard's largest free chunk, the pool's free spans), the context totals\n"
           "(a peak that is an upper bound, not exact, reads \"peak <= N (bound)\"),\n"
           "the pool, then per shard its statistics, regions with their chunks in\n"
           "address order (the layout of bfc_ctx_dump) and non-empty bins.\n"
           "\n"
           "  --summary    leave out regions, chunks and bins\n"
           "  -h, --help   this text\n"
           "\n"
           "SNAPSHOT.json may be \"-\" (standard input).  Exit status: 0; 1 on a bad\n"
           "input; 2 on a usage error.  See shardbfc-stat(1) and snapshot.md\n"
           "(share/doc/shardbfc/doc).\n");
}

/* The OOM report of an oom_dump file (or any snapshot after a failure). */
static void print_oom(const json_object *o)
{
    if (!json_object_is_type(o, json_type_object))
        return;
    printf("Out of memory: %s\n", bfc_json_str(o, "diagnosis", "?"));
    printf("  request %" PRIu64 " bytes (%" PRIu64 " chunk bytes) on stream %s; cause %s\n",
           bfc_json_u64(o, "size", 0), bfc_json_u64(o, "rounded", 0), bfc_json_str(o, "stream", "?"),
           bfc_json_str(o, "cause", "?"));
    printf("  limit %" PRIu64 ", reserved %" PRIu64 ", unreserved %" PRIu64 ", in use %" PRIu64
           ", pending %" PRIu64 "\n",
           bfc_json_u64(o, "bytes_limit", 0), bfc_json_u64(o, "bytes_reserved", 0),
           bfc_json_u64(o, "bytes_unreserved", 0), bfc_json_u64(o, "bytes_in_use", 0),
           bfc_json_u64(o, "bytes_pending", 0));
    const json_object *sh = bfc_json_get(o, "shards");
    for (size_t i = 0; i < bfc_json_len(sh); i++) {
        const json_object *s = bfc_json_at(sh, i);
        /* A retired shard (released by its stream, kept by live blocks) has
         * the stream of its successor: the mark tells the two apart. */
        printf("  shard stream_id=%" PRIu64 " stream=%s%s%s: ", bfc_json_u64(s, "stream_id", 0),
               bfc_json_str(s, "stream", "?"), bfc_json_bool(s, "requesting", false) ? " (requesting)" : "",
               bfc_json_bool(s, "retired", false) ? " (retired)" : "");
        /* An expandable shard's free figures are bounds (doc/snapshot.md). */
        if (bfc_json_bool(s, "expandable", false))
            printf("mapped free <= %" PRIu64 " (bound), largest mapped free piece <= %" PRIu64
                   " (bound), largest block without a map %" PRIu64,
                   bfc_json_u64(s, "free", 0), bfc_json_u64(s, "largest_free", 0),
                   bfc_json_u64(s, "largest_ready", 0));
        else
            printf("free %" PRIu64 ", largest free chunk %" PRIu64, bfc_json_u64(s, "free", 0),
                   bfc_json_u64(s, "largest_free", 0));
        printf(", pending %" PRIu64 ", in use %" PRIu64 ", reserved %" PRIu64 "\n", bfc_json_u64(s, "pending", 0),
               bfc_json_u64(s, "in_use", 0), bfc_json_u64(s, "reserved", 0));
    }
    const json_object *sp = bfc_json_get(o, "pool_spans");
    printf("  pool: %" PRIu64 " free in %" PRIu64 " spans, largest %" PRIu64 ", fenced %" PRIu64 "\n",
           bfc_json_u64(o, "pool_free", 0), bfc_json_u64(o, "num_pool_spans", 0),
           bfc_json_u64(o, "pool_largest_span", 0), bfc_json_u64(o, "pool_fenced", 0));
    for (size_t i = 0; i < bfc_json_len(sp); i++) {
        const json_object *s = bfc_json_at(sp, i);
        bool fenced = bfc_json_bool(s, "fenced", false);
        printf("    span %s size %" PRIu64 "%s", bfc_json_str(s, "base", "?"), bfc_json_u64(s, "size", 0),
               fenced ? " fenced by stream_id " : "\n");
        if (fenced)
            printf("%" PRIu64 "\n", bfc_json_u64(s, "stream_id", 0));
    }
}

int main(int argc, char **argv)
{
    bool summary = false;
    const char *in = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            help();
            return 0;
        }
        if (strcmp(argv[i], "--summary") == 0)
            summary = true;
        else if (argv[i][0] == '-' && argv[i][1] != '\0')
            in = NULL, i = argc; /* an unknown option: usage, not a file name */
        else if (!in)
            in = argv[i];
        else
            in = NULL, i = argc;
    }
    if (!in) {
        fprintf(stderr, "usage: shardbfc-stat [--summary] SNAPSHOT.json\n");
        return 2;
    }
    FILE *f = strcmp(in, "-") == 0 ? stdin : fopen(in, "rb");
    if (!f) {
        perror(in);
        return 1;
    }
    size_t n = 0;
    char *buf = tool_read_all(f, &n);
    if (f != stdin)
        fclose(f);
    if (!buf) {
        fprintf(stderr, "shardbfc-stat: cannot read %s\n", in);
        return 1;
    }
    char err[256];
    json_object *v;
    int rc = bfc_json_parse(buf, n, &v, err, sizeof(err));
    free(buf);
    if (rc == 0)
        rc = bfc_json_snapshot_check(v, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "shardbfc-stat: %s: %s\n", in, err);
        json_object_put(v);
        return 1;
    }
    const json_object *shards = bfc_json_get(v, "shards");
    /* The shards listed include retired ones (kept by live blocks), which
     * the totals' num_shards does not count: say how many. */
    size_t retired = 0;
    for (size_t i = 0; i < bfc_json_len(shards); i++)
        retired += bfc_json_bool(bfc_json_at(shards, i), "retired", false);
    printf("libshardbfc snapshot v%" PRIu64 ": backend %s%s, device %" PRIu64 ", limit %" PRIu64 ", %zu shards",
           bfc_json_u64(v, "version", 0), bfc_json_str(v, "backend", "?"),
           bfc_json_bool(v, "host", false) ? " (host)" : "", bfc_json_u64(v, "device", 0),
           bfc_json_u64(v, "limit", 0), bfc_json_len(shards) - retired);
    if (retired)
        printf(" and %zu retired (released by their streams, kept by live blocks)", retired);
    printf("\n");
    print_oom(bfc_json_get(v, "oom")); /* first: why the snapshot was taken */
    uint64_t version = bfc_json_u64(v, "version", 0);
    if (version > 2)
        fprintf(stderr, "shardbfc-stat: %s: snapshot version %" PRIu64 " is newer than this tool (2): "
                        "a figure whose meaning changed may be printed under its old name\n",
                in, version);
    /* A hand-made input may leave parts out: say so rather than print
     * zeros as figures. */
    const json_object *totals = bfc_json_get(v, "totals");
    printf("Totals:%s\n", totals ? "" : " (not in the input)");
    if (totals)
        print_stats("  ", totals, version < 2);
    const json_object *pool = bfc_json_get(v, "pool");
    if (pool)
        printf("Pool: held %" PRIu64 " (peak %" PRIu64 "), lent to shards %" PRIu64 ", free %" PRIu64 "\n",
               bfc_json_u64(pool, "held", 0), bfc_json_u64(pool, "peak_held", 0), bfc_json_u64(pool, "committed", 0),
               bfc_json_u64(pool, "free", 0));
    else
        printf("Pool: (not in the input)\n");
    for (size_t i = 0; i < bfc_json_len(shards); i++) {
        const json_object *s = bfc_json_at(shards, i);
        printf("Shard stream_id=%" PRIu64 " stream=%s%s\n", bfc_json_u64(s, "stream_id", 0),
               bfc_json_str(s, "stream", "?"), bfc_json_bool(s, "retired", false) ? " (retired)" : "");
        print_stats("  ", bfc_json_get(s, "stats"), false);
        if (summary)
            continue;
        const json_object *regions = bfc_json_get(s, "regions");
        for (size_t j = 0; j < bfc_json_len(regions); j++) {
            const json_object *r = bfc_json_at(regions, j);
            printf("  Region %s size %" PRIu64 "%s\n", bfc_json_str(r, "base", "?"), bfc_json_u64(r, "size", 0),
                   bfc_json_bool(r, "large", false) ? " (large)" : "");
            const json_object *chunks = bfc_json_get(r, "chunks");
            for (size_t k = 0; k < bfc_json_len(chunks); k++) {
                const json_object *c = bfc_json_at(chunks, k);
                const char *state = bfc_json_str(c, "state", "?");
                printf("    Chunk +%" PRIu64 " size %" PRIu64 " %s", bfc_json_u64(c, "offset", 0),
                       bfc_json_u64(c, "size", 0), state);
                if (strcmp(state, "free") != 0)
                    printf(" requested %" PRIu64 " id %.0f", bfc_json_u64(c, "requested", 0),
                           bfc_json_num(c, "allocation_id", -1));
                putchar('\n');
            }
        }
        const json_object *bins = bfc_json_get(s, "bins");
        printf("  Bins:");
        for (size_t j = 0; j < bfc_json_len(bins); j++) {
            const json_object *b = bfc_json_at(bins, j);
            if (bfc_json_u64(b, "count", 0))
                printf(" [%" PRIu64 ": %" PRIu64 " chunks, %" PRIu64 " bytes, >= %" PRIu64 "]",
                       bfc_json_u64(b, "bin", 0), bfc_json_u64(b, "count", 0), bfc_json_u64(b, "bytes", 0),
                       bfc_json_u64(b, "min_size", 0));
        }
        putchar('\n');
    }
    json_object_put(v);
    /* A full disk or closed pipe must not read as success. */
    if (fflush(stdout) != 0 || ferror(stdout)) {
        perror("shardbfc-stat: writing the report");
        return 1;
    }
    return 0;
}
