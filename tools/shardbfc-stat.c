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
/*
 * A figure as text: its decimal digits, or "?" where the input leaves it
 * out (a hand-made or older snapshot), never a 0 that reads as a figure.
 * Eight buffers in turn: one printf call uses at most eight of them.
 */
static const char *num(const json_object *o, const char *key)
{
    static char buf[8][24];
    static unsigned next;
    char *b = buf[next++ % 8];
    const json_object *v = bfc_json_get(o, key);
    if (!v || !json_object_is_type(v, json_type_int))
        return "?";
    snprintf(b, sizeof buf[0], "%" PRIu64, bfc_json_u64(o, key, 0));
    return b;
}

/* A string of the snapshot as it may reach a terminal: control
 * characters (an escape sequence, a newline that would fake a line of the
 * report) as '?'; "?" where the input leaves it out.  Four buffers in
 * turn, each the first 511 bytes. */
static const char *str(const json_object *o, const char *key)
{
    static char buf[4][512];
    static unsigned next;
    char *b = buf[next++ % 4];
    snprintf(b, sizeof buf[0], "%s", bfc_json_str(o, key, "?"));
    for (char *c = b; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    return b;
}

/* A fraction or a signed figure as text ("%.4f" or "%.0f"; "%.6g" where
 * that would not fit its buffer), or "?" where the input leaves it out.
 * Four buffers of its own, in turn. */
static const char *numf(const json_object *o, const char *key, int decimals)
{
    static char buf[4][40];
    static unsigned next;
    char *b = buf[next++ % 4];
    const json_object *v = bfc_json_get(o, key);
    if (!v || !(json_object_is_type(v, json_type_double) || json_object_is_type(v, json_type_int)))
        return "?";
    double x = bfc_json_num(o, key, 0);
    int w = snprintf(b, sizeof buf[0], "%.*f", decimals, x);
    if (w < 0 || (size_t)w >= sizeof buf[0]) /* never a figure cut short */
        snprintf(b, sizeof buf[0], "%.6g", x);
    return b;
}

/* A chunk's allocation id, exact (bfc_json_snapshot_check let through only
 * integers from -1 to 2^63 - 1), or "?". */
static const char *id_text(const json_object *c)
{
    static char b[24];
    const json_object *v = bfc_json_get(c, "allocation_id");
    if (!v || !json_object_is_type(v, json_type_int))
        return "?";
    snprintf(b, sizeof b, "%" PRId64, json_object_get_int64(v));
    return b;
}

static void print_peak(const json_object *s, const char *key, bool bound)
{
    char bkey[64];
    snprintf(bkey, sizeof bkey, "%s_bound", key);
    if (bfc_json_get(s, bkey))
        printf("peak <= %s (bound)", num(s, bkey));
    else if (bound)
        printf("peak <= %s (bound)", num(s, key));
    else
        printf("peak %s", num(s, key));
}

/* bound_peaks: the peaks are bounds under their bare names (a version 1
 * snapshot's totals: the sum of the shards' peaks). */
static void print_stats(const char *indent, const json_object *s, bool bound_peaks)
{
    printf("%sallocated %s (", indent, num(s, "bytes_in_use"));
    print_peak(s, "peak_bytes_in_use", bound_peaks);
    printf("), requested %s (", num(s, "bytes_requested"));
    print_peak(s, "peak_bytes_requested", bound_peaks);
    printf("), reserved %s (peak %s), limit %s\n", num(s, "bytes_reserved"),
           num(s, "peak_bytes_reserved"), num(s, "bytes_limit"));
    printf("%sfree %s, largest free chunk %s, fragmentation %s, pending %s"
           " blocks / %s bytes\n",
           indent, num(s, "bytes_free"), num(s, "largest_free_chunk"),
           numf(s, "fragmentation", 4), num(s, "num_pending_frees"),
           num(s, "bytes_pending"));
    printf("%sallocs %s, frees %s (remote %s), OOMs %s, regions %s"
           ", chunks %s, largest alloc %s\n",
           indent, num(s, "num_allocs"), num(s, "num_frees"),
           num(s, "num_remote_frees"), num(s, "num_ooms"),
           num(s, "num_regions"), num(s, "num_chunks"),
           num(s, "largest_alloc_size"));
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
    printf("Out of memory: %s\n", str(o, "diagnosis"));
    printf("  request %s bytes (%s chunk bytes) on stream %s; cause %s\n",
           num(o, "size"), num(o, "rounded"), str(o, "stream"),
           str(o, "cause"));
    printf("  limit %s, reserved %s, unreserved %s, in use %s"
           ", pending %s\n",
           num(o, "bytes_limit"), num(o, "bytes_reserved"),
           num(o, "bytes_unreserved"), num(o, "bytes_in_use"),
           num(o, "bytes_pending"));
    const json_object *sh = bfc_json_get(o, "shards");
    for (size_t i = 0; i < bfc_json_len(sh); i++) {
        const json_object *s = bfc_json_at(sh, i);
        /* A retired shard (released by its stream, kept by live blocks) has
         * the stream of its successor: the mark tells the two apart. */
        printf("  shard stream_id=%s stream=%s%s%s: ", num(s, "stream_id"),
               str(s, "stream"), bfc_json_bool(s, "requesting", false) ? " (requesting)" : "",
               bfc_json_bool(s, "retired", false) ? " (retired)" : "");
        /* An expandable shard's free figures are bounds (doc/snapshot.md). */
        if (bfc_json_bool(s, "expandable", false))
            printf("mapped free <= %s (bound), largest mapped free piece <= %s"
                   " (bound), largest block without a map %s",
                   num(s, "free"), num(s, "largest_free"),
                   num(s, "largest_ready"));
        else
            printf("free %s, largest free chunk %s", num(s, "free"),
                   num(s, "largest_free"));
        printf(", pending %s, in use %s, reserved %s\n", num(s, "pending"),
               num(s, "in_use"), num(s, "reserved"));
    }
    const json_object *sp = bfc_json_get(o, "pool_spans");
    printf("  pool: %s free in %s spans, largest %s, fenced %s\n",
           num(o, "pool_free"), num(o, "num_pool_spans"),
           num(o, "pool_largest_span"), num(o, "pool_fenced"));
    for (size_t i = 0; i < bfc_json_len(sp); i++) {
        const json_object *s = bfc_json_at(sp, i);
        bool fenced = bfc_json_bool(s, "fenced", false);
        printf("    span %s size %s%s", str(s, "base"), num(s, "size"),
               fenced ? " fenced by stream_id " : "\n");
        if (fenced)
            printf("%s\n", num(s, "stream_id"));
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
    printf("libshardbfc snapshot v%s: backend %s%s, device %s, limit %s, %zu shards",
           num(v, "version"), str(v, "backend"),
           bfc_json_bool(v, "host", false) ? " (host)" : "", num(v, "device"),
           num(v, "limit"), bfc_json_len(shards) - retired);
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
        printf("Pool: held %s (peak %s), lent to shards %s, free %s\n",
               num(pool, "held"), num(pool, "peak_held"), num(pool, "committed"),
               num(pool, "free"));
    else
        printf("Pool: (not in the input)\n");
    for (size_t i = 0; i < bfc_json_len(shards); i++) {
        const json_object *s = bfc_json_at(shards, i);
        printf("Shard stream_id=%s stream=%s%s\n", num(s, "stream_id"),
               str(s, "stream"), bfc_json_bool(s, "retired", false) ? " (retired)" : "");
        print_stats("  ", bfc_json_get(s, "stats"), false);
        if (summary)
            continue;
        const json_object *regions = bfc_json_get(s, "regions");
        for (size_t j = 0; j < bfc_json_len(regions); j++) {
            const json_object *r = bfc_json_at(regions, j);
            printf("  Region %s size %s%s\n", str(r, "base"), num(r, "size"),
                   bfc_json_bool(r, "large", false) ? " (large)" : "");
            const json_object *chunks = bfc_json_get(r, "chunks");
            for (size_t k = 0; k < bfc_json_len(chunks); k++) {
                const json_object *c = bfc_json_at(chunks, k);
                const char *state = str(c, "state");
                printf("    Chunk +%s size %s %s", num(c, "offset"),
                       num(c, "size"), state);
                if (strcmp(state, "free") != 0)
                    printf(" requested %s id %s", num(c, "requested"), id_text(c));
                putchar('\n');
            }
        }
        const json_object *bins = bfc_json_get(s, "bins");
        printf("  Bins:");
        for (size_t j = 0; j < bfc_json_len(bins); j++) {
            const json_object *b = bfc_json_at(bins, j);
            if (bfc_json_u64(b, "count", 0))
                printf(" [%s: %s chunks, %s bytes, >= %s]",
                       num(b, "bin"), num(b, "count"), num(b, "bytes"),
                       num(b, "min_size"));
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
