/*
 * test_obs.c -- observability: the JSON snapshot against the
 * statistics, the fragmentation metric, the OOM callback (size, stream,
 * summary, one retry) and oom_dump, the config paths, the allocation trace
 * (round trip through tools/trace_csv.c, fenced frees, threads, RMM edge
 * cases), replay (same peaks, same addresses), and the HTML viewer.
 *
 * Everything runs on the SIM backend, with files in a private temporary
 * directory removed at the end of each test.  The library writes its JSON
 * itself; json-c is the oracle: every snapshot and oom_dump file must parse
 * with it, strictly (tools/json_read.c), and be exactly json-c's own
 * compact rendering of what it read (see json_canonical), and, when jq is
 * installed, also parse with jq.
 */
#include "testutil.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include "json_read.h"
#include "replay.h"
#include "trace_csv.h"
#include "view.h"


/* ------------------------------------------------------------ helpers */

static char tmpdir[256];

static void tmp_setup(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_obs_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void tmp_teardown(void)
{
    DIR *d = opendir(tmpdir);
    if (!d)
        return;
    struct dirent *e;
    char p[600];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(tmpdir);
}

static void tmp_path(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", tmpdir, name);
}

/* tmp_path, and the file there opened for writing. */
static FILE *tmp_create(char *buf, size_t len, const char *name)
{
    tmp_path(buf, len, name);
    FILE *f = fopen(buf, "w");
    ck_assert_msg(f != NULL, "%s: %s", buf, strerror(errno));
    return f;
}

static bfc_ctx_t *mkctx(const char *spec)
{
    bfc_config_t c;
    bfc_config_init(&c);
    /* Classic regions (vmm=off): the reports checked here name regions,
     * region tails and pool spans. */
    ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,vmm=off"), BFC_OK);
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
    bfc_ctx_t *ctx = NULL;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_OK);
    return ctx;
}

static bfc_stats_t stats(bfc_ctx_t *ctx)
{
    bfc_stats_t s;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &s), BFC_OK);
    return s;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(buf);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/*
 * The oracle for the library's JSON: text[0..len) parses with json-c,
 * strictly (tools/json_read.c), and is byte for byte json-c's own compact
 * rendering of what it read, followed by one newline.  So beyond being
 * JSON, the writer put no byte there that json-c would have written
 * otherwise: no space, no raw control character or other re-coded string
 * content, no single quote for a double one, no duplicate member, no
 * number in another spelling than json-c keeps.  True with the tree in
 * *out (json_object_put it), or false with why.
 */
static bool canonical(const char *text, size_t len, json_object **out, char *why, size_t whylen)
{
    if (bfc_json_parse(text, len, out, why, whylen) != 0)
        return false;
    const char *again = json_object_to_json_string_ext(*out, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE);
    size_t n = strlen(again), i = 0;
    while (i < n && i < len && text[i] == again[i])
        i++;
    if (i == n && len == n + 1 && text[n] == '\n')
        return true;
    snprintf(why, whylen, "not json-c's compact rendering and a newline from offset %zu: %.60s | json-c: %.60s", i,
             text + i, again + i);
    json_object_put(*out);
    *out = NULL;
    return false;
}

/* The tree of text, which the library wrote: canonical or the test fails. */
static json_object *json_canonical(const char *text, size_t len)
{
    json_object *v;
    char why[400];
    ck_assert_msg(canonical(text, len, &v, why, sizeof why), "%s\n%.400s", why, text);
    return v;
}

/* obj[key], which must be an array / a boolean. */
static const json_object *array_of(const json_object *obj, const char *key)
{
    const json_object *a = bfc_json_get(obj, key);
    ck_assert_msg(json_object_is_type(a, json_type_array), "\"%s\" is not an array", key);
    return a;
}

static bool bool_of(const json_object *obj, const char *key)
{
    const json_object *b = bfc_json_get(obj, key);
    ck_assert_msg(json_object_is_type(b, json_type_boolean), "\"%s\" is not a boolean", key);
    return json_object_get_boolean(b);
}

/* The snapshot of ctx, parsed (and checked by jq when available).  Its file
 * is its own: callers need not have made the test's directory (a test
 * without one wrote /snap.json, and under CK_FORK=no it found the
 * directory an earlier test had removed). */
static json_object *snapshot(bfc_ctx_t *ctx)
{
    char path[400];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/test_obs_snap_XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    FILE *f = fdopen(fd, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    ck_assert_int_eq(fclose(f), 0);
    size_t len;
    char *text = read_file(path, &len);
    ck_assert_ptr_nonnull(text);
    json_object *v = json_canonical(text, len);
    free(text);
    if (system("command -v jq >/dev/null 2>&1") == 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "jq -e '.shards | length' '%s'", path);
        FILE *p = popen(cmd, "r");
        ck_assert_ptr_nonnull(p);
        unsigned long nsh = 0;
        ck_assert_int_eq(fscanf(p, "%lu", &nsh), 1);
        ck_assert_int_eq(pclose(p), 0);
        ck_assert_uint_eq(nsh, bfc_json_len(array_of(v, "shards")));
    }
    unlink(path);
    return v;
}

/* A context's figures that are upper bounds, not exact: the snapshot must
 * call them so (key + "_bound"), and never by the bare name. */
static bool is_ctx_bound(const char *name)
{
    return strcmp(name, "peak_bytes_in_use") == 0 || strcmp(name, "peak_bytes_requested") == 0;
}

/* Every bfc_stats_t field of a JSON stats object equals *s; a context's
 * (totals) names its bounds as such, a shard's figures are all exact. */
static void assert_stats_equal(const json_object *j, const bfc_stats_t *s, bool context)
{
    ck_assert_ptr_nonnull(j);
    /* Every field of the table, so a field added to it is checked too. */
#define F(name, combine, desc)                                                                                 \
    do {                                                                                                       \
        bool bound = context && is_ctx_bound(#name);                                                           \
        const char *key = bound ? #name "_bound" : #name;                                                      \
        ck_assert_msg(bfc_json_u64(j, key, UINT64_MAX) == s->name, "%s: json %" PRIu64 " stats %" PRIu64, key, \
                      bfc_json_u64(j, key, UINT64_MAX), (uint64_t)s->name);                                    \
        if (bound)                                                                                             \
            ck_assert_msg(bfc_json_get(j, #name) == NULL, "%s: a bound under the exact name", #name);          \
    } while (0);
    BFC_STATS_FIELDS(F)
#undef F
    double fj = bfc_json_num(j, "fragmentation", -1);
    ck_assert_msg(fabs(fj - bfc_stats_fragmentation(s)) < 1e-6, "fragmentation %f vs %f", fj,
                  bfc_stats_fragmentation(s));
}

static const json_object *shard_of(const json_object *snap, bfc_stream_t s)
{
    char want[32];
    snprintf(want, sizeof want, "0x%" PRIxPTR, (uintptr_t)s);
    const json_object *shards = array_of(snap, "shards");
    for (size_t i = 0; i < bfc_json_len(shards); i++)
        if (strcmp(bfc_json_str(bfc_json_at(shards, i), "stream", ""), want) == 0)
            return bfc_json_at(shards, i);
    return NULL;
}

/* ------------------------------------------------------ fragmentation */

START_TEST(test_fragmentation_formula)
{
    bfc_stats_t s;
    memset(&s, 0, sizeof s);
    ck_assert(bfc_stats_fragmentation(NULL) == 0.0);
    ck_assert(bfc_stats_fragmentation(&s) == 0.0); /* nothing free */
    s.bytes_free = 1024;
    s.largest_free_chunk = 1024;
    ck_assert(bfc_stats_fragmentation(&s) == 0.0); /* one chunk */
    s.largest_free_chunk = 256;
    ck_assert(fabs(bfc_stats_fragmentation(&s) - 0.75) < 1e-12);
    s.bytes_free = 3 * MiB;
    s.largest_free_chunk = 1 * MiB;
    ck_assert(fabs(bfc_stats_fragmentation(&s) - 2.0 / 3.0) < 1e-12);
}
END_TEST

/* Eight 1 MiB blocks fill an 8 MiB region exactly; freeing every other one
 * leaves four separate 1 MiB holes: 1 - 1/4.  Freeing block 1 merges 0-2:
 * 5 MiB free, largest 3 MiB: 1 - 3/5. */
START_TEST(test_fragmentation_live)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,initial_region=8M");
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *p[8];
    for (int i = 0; i < 8; i++)
        p[i] = xalloc(ctx, s, MiB);
    bfc_stats_t st = stats(ctx);
    ck_assert_uint_eq(st.bytes_free, 0);
    ck_assert(bfc_stats_fragmentation(&st) == 0.0);
    for (int i = 0; i < 8; i += 2)
        xfree(ctx, p[i], s);
    st = stats(ctx);
    ck_assert_uint_eq(st.bytes_free, 4 * MiB);
    ck_assert_uint_eq(st.largest_free_chunk, MiB);
    ck_assert(fabs(bfc_stats_fragmentation(&st) - 0.75) < 1e-12);
    xfree(ctx, p[1], s);
    bfc_stats_t ss;
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, s, &ss), BFC_OK);
    ck_assert_uint_eq(ss.bytes_free, 5 * MiB);
    ck_assert_uint_eq(ss.largest_free_chunk, 3 * MiB);
    ck_assert(fabs(bfc_stats_fragmentation(&ss) - 0.4) < 1e-12);

    /* A second shard with one free 8 MiB tail: the context figure is the
     * largest chunk of any shard over all free bytes. */
    void *q = xalloc(ctx, t, 4 * MiB); /* region of 8 MiB: 4 MiB free after it */
    bfc_stats_t ts;
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, t, &ts), BFC_OK);
    ck_assert_uint_eq(ts.bytes_free, 4 * MiB);
    ck_assert(bfc_stats_fragmentation(&ts) == 0.0);
    st = stats(ctx);
    ck_assert_uint_eq(st.bytes_free, 9 * MiB);
    ck_assert_uint_eq(st.largest_free_chunk, 4 * MiB);
    ck_assert(fabs(bfc_stats_fragmentation(&st) - (1.0 - 4.0 / 9.0)) < 1e-12);
    xfree(ctx, q, t);
    for (int i = 3; i < 8; i += 2)
        xfree(ctx, p[i], s);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, s);
    bfc_sim_stream_destroy(ctx, t);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ----------------------------------------------------------- snapshot */

/* ---------------------------------------------------- exact or bound */

/*
 * Two streams that peak one after the other.  Each shard's peaks are exact;
 * the context's are the sum of its shards' peaks capped by what it held:
 * never below the true peak, never above the limit.  Stream a holds a
 * 40 MiB block (a region of its own) and frees it; the region goes back to
 * the pool, and stream b's 40 MiB reuses it.  The true peak is 40 MiB, the
 * shards' peaks sum to 80 MiB, more than the 64 MiB limit.
 */
START_TEST(test_peaks_exact_or_bound)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=64M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    const size_t n = 40 * MiB - 1000;
    void *p = xalloc(ctx, a, n);
    size_t asz = bfc_ctx_allocated_size(ctx, p);
    ck_assert_uint_ge(asz, n);
    xfree(ctx, p, a);
    void *q = xalloc(ctx, b, n);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), asz);

    bfc_stats_t sa, sb, st = stats(ctx);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, a, &sa), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, b, &sb), BFC_OK);
    ck_assert_uint_eq(sa.peak_bytes_requested, n);
    ck_assert_uint_eq(sa.peak_bytes_in_use, asz);
    ck_assert_uint_eq(sb.peak_bytes_requested, n);
    ck_assert_uint_eq(sb.peak_bytes_in_use, asz);
    /* One region of 40 MiB served both: what the context held is exact. */
    ck_assert_uint_eq(st.peak_bytes_reserved, 40 * MiB);
    /* The bounds: at least the true peak, at most what was held. */
    ck_assert_uint_ge(st.peak_bytes_in_use, asz);
    ck_assert_uint_le(st.peak_bytes_in_use, st.peak_bytes_reserved);
    ck_assert_uint_le(st.peak_bytes_in_use, st.bytes_limit);
    ck_assert_uint_ge(st.peak_bytes_requested, n);
    ck_assert_uint_le(st.peak_bytes_requested, st.peak_bytes_in_use);

    /* Cleared, the peaks are the current figures, requested ones too. */
    ck_assert_int_eq(bfc_ctx_clear_peaks(ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, a, &sa), BFC_OK);
    ck_assert_uint_eq(sa.peak_bytes_requested, 0);
    ck_assert_uint_eq(sa.peak_bytes_in_use, 0);
    xfree(ctx, q, b);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, b, &sb), BFC_OK);
    ck_assert_uint_eq(sb.peak_bytes_requested, n);
    ck_assert_uint_eq(sb.bytes_requested, 0);
    st = stats(ctx);
    ck_assert_uint_eq(st.peak_bytes_requested, n);
    ck_assert_uint_eq(st.peak_bytes_in_use, asz);

    /* The dump says which figures are bounds. */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_dump(ctx, f), BFC_OK);
    fclose(f);
    ck_assert_msg(strstr(text, " peak_bytes_in_use_bound ") && strstr(text, " peak_bytes_requested_bound ") &&
                      strstr(text, " peak_bytes_reserved "),
                  "%s", text);
    free(text);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_snapshot_matches_stats)
{
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=256M,initial_region=4M,large_alloc=16M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *pa[6], *pb[3];
    for (int i = 0; i < 6; i++)
        pa[i] = xalloc(ctx, a, (size_t)1000 << i);
    for (int i = 0; i < 3; i++)
        pb[i] = xalloc(ctx, b, (size_t)5000 * (size_t)(i + 1));
    void *big = xalloc(ctx, a, 20 * MiB); /* a large region of its own */
    xfree(ctx, pa[1], a);
    xfree(ctx, pa[3], a);
    /* A fenced free that stays pending: b is busy. */
    bfc_sim_stream_hold(ctx, b);
    xfree(ctx, pa[4], b);
    (void)bfc_ctx_alloc(ctx, a, 256); /* drains a's queue: pa[4] becomes pending */

    json_object *v = snapshot(ctx);
    bfc_stats_t tot = stats(ctx);
    ck_assert_uint_eq(bfc_json_u64(v, "version", 0), 2);
    ck_assert_str_eq(bfc_json_str(v, "backend", ""), "sim");
    ck_assert_uint_eq(bfc_json_u64(v, "limit", 0), 256 * MiB);
    assert_stats_equal(bfc_json_get(v, "totals"), &tot, true);
    ck_assert_uint_eq(tot.num_pending_frees, 1);
    const json_object *pool = bfc_json_get(v, "pool");
    ck_assert_uint_eq(bfc_json_u64(pool, "held", 0), tot.bytes_reserved);

    const json_object *shards = array_of(v, "shards");
    ck_assert_uint_eq(bfc_json_len(shards), 2);
    uint64_t region_total = 0;
    bool seen_pending = false, seen_large = false, seen_big = false;
    bfc_stream_t ss[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        const json_object *sh = shard_of(v, ss[k]);
        ck_assert_msg(sh != NULL, "no shard for stream %d", k);
        bfc_stats_t st;
        ck_assert_int_eq(bfc_ctx_stream_stats(ctx, ss[k], &st), BFC_OK);
        assert_stats_equal(bfc_json_get(sh, "stats"), &st, false);
        uint64_t sid = bfc_json_u64(sh, "stream_id", UINT64_MAX);
        uint64_t in_use = 0, requested = 0, pending = 0, freeb = 0, chunks = 0, reserved = 0;
        const json_object *regions = array_of(sh, "regions");
        for (size_t i = 0; i < bfc_json_len(regions); i++) {
            const json_object *r = bfc_json_at(regions, i);
            ck_assert_uint_eq(bfc_json_u64(r, "owner", UINT64_MAX), sid);
            uint64_t size = bfc_json_u64(r, "size", 0), off = 0;
            uintptr_t base = (uintptr_t)strtoull(bfc_json_str(r, "base", "0"), NULL, 16);
            ck_assert_uint_ne(base, 0);
            reserved += size;
            if (bool_of(r, "large"))
                seen_large = true;
            const json_object *cs = array_of(r, "chunks");
            for (size_t j = 0; j < bfc_json_len(cs); j++) {
                const json_object *c = bfc_json_at(cs, j);
                ck_assert_uint_eq(bfc_json_u64(c, "offset", UINT64_MAX), off); /* chunks tile the region */
                uint64_t csz = bfc_json_u64(c, "size", 0);
                const char *state = bfc_json_str(c, "state", "?");
                off += csz;
                chunks++;
                void *ptr = (void *)(base + (uintptr_t)bfc_json_u64(c, "offset", 0));
                if (strcmp(state, "in_use") == 0) {
                    in_use += csz;
                    requested += bfc_json_u64(c, "requested", 0);
                    /* Allocation id and sizes are those of the live block. */
                    ck_assert_int_eq((int64_t)bfc_json_num(c, "allocation_id", -2), bfc_ctx_allocation_id(ctx, ptr));
                    ck_assert_uint_eq(bfc_json_u64(c, "requested", 0), bfc_ctx_requested_size(ctx, ptr));
                    ck_assert_uint_eq(csz, bfc_ctx_allocated_size(ctx, ptr));
                    if (ptr == big)
                        seen_big = true;
                } else if (strcmp(state, "pending") == 0) {
                    pending += csz;
                    ck_assert_ptr_eq(ptr, pa[4]);
                    seen_pending = true;
                } else if (strcmp(state, "free") == 0) {
                    freeb += csz;
                    ck_assert_int_eq((int64_t)bfc_json_num(c, "allocation_id", 0), -1);
                } else {
                    ck_abort_msg("unexpected state %s", state);
                }
            }
            ck_assert_uint_eq(off, size);
        }
        ck_assert_uint_eq(in_use, st.bytes_in_use);
        ck_assert_uint_eq(requested, st.bytes_requested);
        ck_assert_uint_eq(pending, st.bytes_pending);
        ck_assert_uint_eq(freeb, st.bytes_free);
        ck_assert_uint_eq(chunks, st.num_chunks);
        ck_assert_uint_eq(reserved, st.bytes_reserved);
        ck_assert_uint_eq(bfc_json_len(regions), st.num_regions);
        /* Bins account for every free byte. */
        const json_object *bins = array_of(sh, "bins");
        uint64_t bin_bytes = 0;
        for (size_t i = 0; i < bfc_json_len(bins); i++)
            bin_bytes += bfc_json_u64(bfc_json_at(bins, i), "bytes", 0);
        ck_assert_uint_eq(bin_bytes, st.bytes_free);
        region_total += reserved;
    }
    ck_assert(seen_pending && seen_large && seen_big);
    ck_assert_uint_eq(region_total, bfc_json_u64(pool, "committed", 0));
    json_object_put(v);

    bfc_sim_stream_drain(ctx, b);
    for (int i = 0; i < 6; i++)
        if (i != 1 && i != 3 && i != 4)
            xfree(ctx, pa[i], a);
    for (int i = 0; i < 3; i++)
        xfree(ctx, pb[i], b);
    xfree(ctx, big, a);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* ---------------------------------------------------------------- OOM */

struct oom_rec {
    int calls;
    size_t size;
    bfc_stream_t stream;
    bfc_stats_t summary;
    int ret;
    void *to_free;             /* freed by the callback (on free_stream) */
    bfc_stream_t free_stream;
};

/* num_ooms: allocations that failed (a retry for the callback is part of
 * its allocation, not another one). */
static uint64_t ooms_of(bfc_ctx_t *ctx)
{
    bfc_stats_t x;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &x), BFC_OK);
    return x.num_ooms;
}

static int oom_cb(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream, const bfc_stats_t *summary, void *arg)
{
    struct oom_rec *r = arg;
    r->calls++;
    r->size = size;
    r->stream = stream;
    r->summary = *summary;
    if (r->to_free) {
        /* No lock is held: freeing from here must work. */
        ck_assert_int_eq(bfc_ctx_free(ctx, r->to_free, r->free_stream), BFC_OK);
        r->to_free = NULL;
    }
    return r->ret;
}

START_TEST(test_oom_callback_args_and_no_retry)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,allow_growth=false");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    struct oom_rec r = {0};
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, oom_cb, &r), BFC_OK);
    ck_assert_int_eq(bfc_ctx_set_oom_callback(NULL, oom_cb, &r), BFC_EINVAL);

    /* Successful allocations never call it. */
    void *a = xalloc(ctx, s, 5 * MiB);
    ck_assert_int_eq(r.calls, 0);

    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 4 * MiB + 1));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(r.calls, 1);
    ck_assert_uint_eq(r.size, 4 * MiB + 1);
    ck_assert_ptr_eq(r.stream, s);
    /* 5 MiB of an 8 MiB region is not split (the leftover is < 5 MiB and
     * < 128 MiB): the chunk is the whole region, as in TensorFlow. */
    ck_assert_uint_eq(r.summary.bytes_in_use, bfc_ctx_allocated_size(ctx, a));
    ck_assert_uint_eq(r.summary.bytes_requested, 5 * MiB);
    ck_assert_uint_eq(r.summary.bytes_limit, 8 * MiB);
    ck_assert_uint_eq(r.summary.num_ooms, 1);
    ck_assert_uint_eq(ooms_of(ctx), 1);

    /* Asking for a retry without freeing anything: one retry, no second
     * call; one more failed allocation, not two. */
    r.ret = 1;
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 4 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(r.calls, 2);
    ck_assert_uint_eq(r.summary.num_ooms, 2);
    ck_assert_uint_eq(ooms_of(ctx), 2);

    /* Larger than the limit: reported too (size as asked), retried, and
     * counted once. */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 64 * MiB));
    ck_assert_int_eq(r.calls, 3);
    ck_assert_uint_eq(r.size, 64 * MiB);
    ck_assert_ptr_null(r.stream);
    ck_assert_uint_eq(ooms_of(ctx), 3);

    /* Removed: not called. */
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, NULL, NULL), BFC_OK);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 4 * MiB));
    ck_assert_int_eq(r.calls, 3);
    ck_assert_uint_eq(ooms_of(ctx), 4);

    xfree(ctx, a, s);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* A callback that allocates, and fails again: its own context's callback
 * is not called again (it would recurse until the stack ran out), another
 * context's is; each failure is counted and reported. */
struct nest_rec {
    int calls;
    bfc_ctx_t *other;   /* NULL: allocate on the callback's own context */
    size_t inner_size;  /* asked for from inside */
    void *inner;        /* what the inner allocation returned */
    int inner_err;
    uint64_t info_size; /* bfc_ctx_oom_info after the inner failure */
};

static int nest_cb(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream, const bfc_stats_t *summary, void *arg)
{
    (void)size, (void)stream, (void)summary;
    struct nest_rec *r = arg;
    if (++r->calls > 8)
        return 0; /* recursing: the test fails on the count */
    r->inner = bfc_ctx_alloc(r->other ? r->other : ctx, NULL, r->inner_size);
    r->inner_err = bfc_last_error();
    bfc_oom_info_t i;
    r->info_size = bfc_ctx_oom_info(ctx, &i) == BFC_OK ? i.size : 0;
    return 1;
}

START_TEST(test_oom_callback_nested)
{
    bfc_ctx_t *a = mkctx("memory_limit=8M,allow_growth=false");
    bfc_ctx_t *b = mkctx("memory_limit=8M,allow_growth=false");
    struct nest_rec ra = {.inner_size = 16 * MiB}, rb = {.inner_size = 32 * MiB};
    ck_assert_int_eq(bfc_ctx_set_oom_callback(a, nest_cb, &ra), BFC_OK);
    ck_assert_int_eq(bfc_ctx_set_oom_callback(b, nest_cb, &rb), BFC_OK);

    /* a's callback allocates on a, which fails: one call, and the retry. */
    ck_assert_ptr_null(bfc_ctx_alloc(a, NULL, 9 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(ra.calls, 1);
    ck_assert_ptr_null(ra.inner);
    ck_assert_int_eq(ra.inner_err, BFC_ENOMEM);
    ck_assert_uint_eq(ra.info_size, 9 * MiB); /* the callback's own report */
    ck_assert_uint_eq(ooms_of(a), 2);         /* the outer and the inner */
    bfc_oom_info_t i;
    ck_assert_int_eq(bfc_ctx_oom_info(a, &i), BFC_OK); /* outside: the latest, the inner one */
    ck_assert_uint_eq(i.size, 16 * MiB);

    /* a's callback allocates on b, whose callback allocates on a: b's is
     * called once, a's not again. */
    ra = (struct nest_rec){.other = b, .inner_size = 16 * MiB};
    rb = (struct nest_rec){.other = a, .inner_size = 32 * MiB};
    ck_assert_ptr_null(bfc_ctx_alloc(a, NULL, 10 * MiB));
    ck_assert_int_eq(ra.calls, 1);
    ck_assert_int_eq(rb.calls, 1);
    ck_assert_int_eq(ra.inner_err, BFC_ENOMEM);
    ck_assert_int_eq(rb.inner_err, BFC_ENOMEM);
    ck_assert_uint_eq(ra.info_size, 10 * MiB);
    ck_assert_uint_eq(rb.info_size, 16 * MiB);
    ck_assert_uint_eq(ooms_of(a), 4);
    ck_assert_uint_eq(ooms_of(b), 1);

    /* Outside any callback, a fresh failure calls it again. */
    ra = (struct nest_rec){.inner_size = 16 * MiB};
    ck_assert_ptr_null(bfc_ctx_alloc(a, NULL, 9 * MiB));
    ck_assert_int_eq(ra.calls, 1);
    bfc_ctx_destroy(a);
    bfc_ctx_destroy(b);
}
END_TEST

START_TEST(test_oom_callback_frees_and_retry_succeeds)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,allow_growth=false");
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    struct oom_rec r = {0};
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, oom_cb, &r), BFC_OK);
    void *a = xalloc(ctx, s, 6 * MiB);
    r.ret = 1;
    r.to_free = a;
    r.free_stream = s;
    void *b = bfc_ctx_alloc(ctx, s, 4 * MiB);
    ck_assert_msg(b != NULL, "retry after the callback freed memory failed: %s", bfc_strerror(bfc_last_error()));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_int_eq(r.calls, 1);
    ck_assert_uint_eq(r.size, 4 * MiB);
    ck_assert_uint_eq(r.summary.bytes_requested, 6 * MiB); /* the state that failed */
    /* The callback saw the failure counted; the retry that served it is
     * part of the same allocation: counted once, never taken back. */
    ck_assert_uint_eq(r.summary.num_ooms, 1);
    ck_assert_uint_eq(ooms_of(ctx), 1);

    /* The same from a failing stream t whose shard holds nothing: the
     * callback frees s's block; the retry takes memory from s's shard. */
    r.calls = 0;
    r.to_free = b;
    r.free_stream = s;
    void *c = bfc_ctx_alloc(ctx, t, 7 * MiB);
    ck_assert_msg(c != NULL, "cross-shard retry failed: %s", bfc_strerror(bfc_last_error()));
    ck_assert_int_eq(r.calls, 1);
    ck_assert_ptr_eq(r.stream, t);
    ck_assert_uint_eq(ooms_of(ctx), 2);
    bfc_stats_t ts;
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, t, &ts), BFC_OK);
    ck_assert_uint_eq(ts.num_ooms, 1);
    xfree(ctx, c, t);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, s);
    bfc_sim_stream_destroy(ctx, t);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* Files of tmpdir whose name starts with prefix. */
static int dump_leftovers(const char *prefix)
{
    DIR *d = opendir(tmpdir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

START_TEST(test_oom_dump)
{
    tmp_setup();
    char path[400], spec[600];
    tmp_path(path, sizeof path, "oom.json");
    snprintf(spec, sizeof spec, "memory_limit=4M,oom_dump=%s", path);
    bfc_ctx_t *ctx = mkctx(spec);
    bfc_config_t got;
    ck_assert_int_eq(bfc_ctx_config(ctx, &got), BFC_OK);
    ck_assert_str_eq(got.oom_dump, path);
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    void *a = xalloc(ctx, s, 3 * MiB);
    struct stat sb;
    ck_assert_int_ne(stat(path, &sb), 0); /* no OOM, no file */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 2 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    size_t len;
    char *text = read_file(path, &len);
    ck_assert_msg(text != NULL, "oom_dump file %s not written", path);
    json_object *v = json_canonical(text, len);
    const json_object *tot = bfc_json_get(v, "totals");
    ck_assert_uint_ge(bfc_json_u64(tot, "num_ooms", 0), 1);
    ck_assert_uint_eq(bfc_json_u64(tot, "bytes_requested", 0), 3 * MiB);
    ck_assert_uint_eq(bfc_json_u64(tot, "bytes_in_use", 0), bfc_ctx_allocated_size(ctx, a));
    json_object_put(v);
    free(text);
    ck_assert_int_eq(dump_leftovers("oom.json.tmp"), 0); /* renamed into place */

    /* Rate limit: a second OOM within the second writes nothing. */
    unlink(path);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 2 * MiB));
    ck_assert_int_ne(stat(path, &sb), 0);

    xfree(ctx, a, s);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* An oom_dump path that can never be written fails the context's creation,
 * as an uncreatable trace= path does: a missing directory, a path that is
 * a directory, and (not as root, whom access() lets write anywhere) a
 * directory without write permission.  A relative name is in the working
 * directory. */
static int create_with(const char *spec)
{
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, "backend=sim"), BFC_OK);
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
    bfc_ctx_t *ctx = NULL;
    int st = bfc_ctx_create(&c, &ctx);
    ck_assert((st == BFC_OK) == (ctx != NULL));
    bfc_ctx_destroy(ctx);
    return st;
}

START_TEST(test_oom_dump_path_checked_at_create)
{
    tmp_setup();
    char path[400], spec[600];
    tmp_path(path, sizeof path, "missing/oom.json");
    snprintf(spec, sizeof spec, "oom_dump=%s", path);
    ck_assert_int_eq(create_with(spec), BFC_EINVAL);
    tmp_path(path, sizeof path, "adir");
    ck_assert_int_eq(mkdir(path, 0700), 0);
    snprintf(spec, sizeof spec, "oom_dump=%s", path);
    ck_assert_int_eq(create_with(spec), BFC_EINVAL); /* rename over a directory fails */
    snprintf(spec, sizeof spec, "oom_dump=%s/oom.json", path);
    ck_assert_int_eq(create_with(spec), BFC_OK);
    if (geteuid() != 0) {
        ck_assert_int_eq(chmod(path, 0500), 0);
        int st = create_with(spec);
        ck_assert_int_eq(chmod(path, 0700), 0);
        ck_assert_int_eq(st, BFC_EINVAL);
    }
    /* A trailing '/' names a directory rename cannot make. */
    snprintf(spec, sizeof spec, "oom_dump=%s/oom.json/", path);
    ck_assert_int_eq(create_with(spec), BFC_EINVAL);
    /* A symbolic link to a directory is replaced by the rename: allowed. */
    char link[500];
    tmp_path(link, sizeof link, "alink");
    ck_assert_int_eq(symlink(path, link), 0);
    snprintf(spec, sizeof spec, "oom_dump=%s", link);
    ck_assert_int_eq(create_with(spec), BFC_OK);
    ck_assert_int_eq(unlink(link), 0);
    ck_assert_int_eq(rmdir(path), 0);
    /* Relative: against the working directory (restored before any
     * assertion, for runs without Check's fork).  And PATH.tmp.PID.N must
     * fit NAME_MAX: a 229-byte name does, 230 not. */
    char cwd[400], name[240], spec2[260];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
    ck_assert_int_eq(chdir(tmpdir), 0);
    int here = create_with("oom_dump=oom.json");
    int missing = create_with("oom_dump=missing/oom.json");
    int named[2];
    for (int n = 229; n <= 230; n++) {
        memset(name, 'b', (size_t)n);
        name[n] = '\0';
        snprintf(spec2, sizeof spec2, "oom_dump=%s", name);
        named[n - 229] = create_with(spec2);
    }
    ck_assert_int_eq(chdir(cwd), 0);
    ck_assert_int_eq(here, BFC_OK);
    ck_assert_int_eq(missing, BFC_EINVAL);
    ck_assert_int_eq(named[0], BFC_OK);
    ck_assert_int_eq(named[1], BFC_EINVAL);
    tmp_teardown();
}
END_TEST

/* A dump that fails after creation (its directory removed) is said on
 * stderr once per context, with the path and the reason -- not once per
 * OOM -- and the allocation fails as ever. */
START_TEST(test_oom_dump_failure_said_once)
{
    tmp_setup();
    char dir[400], path[500], spec[600], errpath[500];
    tmp_path(dir, sizeof dir, "gone");
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    snprintf(path, sizeof path, "%s/oom.json", dir);
    snprintf(spec, sizeof spec, "memory_limit=4M,oom_dump=%s", path);
    bfc_ctx_t *ctx = mkctx(spec);
    ck_assert_int_eq(rmdir(dir), 0);
    tmp_path(errpath, sizeof errpath, "stderr.txt");
    fflush(stderr);
    int saved = dup(2);
    ck_assert_int_ge(saved, 0);
    int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    /* Results kept, and stderr restored before any assertion (for runs
     * without Check's fork). */
    void *got[2];
    int why[2];
    for (int i = 0; i < 2; i++) {
        if (i)
            usleep(1100 * 1000); /* past the one-dump-a-second limit */
        got[i] = bfc_ctx_alloc(ctx, s, 8 * MiB);
        why[i] = bfc_last_error();
    }
    fflush(stderr);
    int restored = dup2(saved, 2);
    close(saved);
    ck_assert_int_eq(restored, 2);
    for (int i = 0; i < 2; i++) {
        ck_assert_ptr_null(got[i]);
        ck_assert_int_eq(why[i], BFC_ENOMEM);
    }
    size_t len;
    char *text = read_file(errpath, &len);
    ck_assert_ptr_nonnull(text);
    char want[700];
    snprintf(want, sizeof want, "libshardbfc: oom_dump=%s: the snapshot could not be written (%s)", path,
             strerror(ENOENT));
    char *first = strstr(text, want);
    ck_assert_msg(first != NULL, "stderr: '%s'", text);
    char *eol = strchr(first, '\n');
    ck_assert_ptr_nonnull(eol);
    ck_assert_msg(strstr(eol, "oom_dump=") == NULL, "said twice: '%s'", text);
    free(text);
    bfc_stats_t st;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_uint_eq(st.num_ooms, 2);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* A temporary name taken already -- left by a killed process that had this
 * pid (a restarted container's pid 1) -- is skipped, not the dump: with
 * O_EXCL on one name, the first dump was lost. */
START_TEST(test_oom_dump_stale_tmp)
{
    tmp_setup();
    char path[400], spec[600], stale[500];
    tmp_path(path, sizeof path, "oom.json");
    for (int k = 0; k < 4; k++) {
        snprintf(stale, sizeof stale, "%s.tmp.%ld.%d", path, (long)getpid(), k);
        FILE *f = fopen(stale, "w");
        ck_assert_ptr_nonnull(f);
        ck_assert_int_eq(fclose(f), 0);
    }
    snprintf(spec, sizeof spec, "memory_limit=4M,oom_dump=%s", path);
    bfc_ctx_t *ctx = mkctx(spec);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 8 * MiB));
    size_t len;
    char *text = read_file(path, &len);
    ck_assert_msg(text != NULL, "the first dump was lost to a stale temporary file");
    json_object_put(json_canonical(text, len));
    free(text);
    ck_assert_int_eq(dump_leftovers("oom.json.tmp"), 4); /* the stale ones, untouched */
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/*
 * Contexts that share an oom_dump path -- the service makes one per device
 * from one SHARDBFC_CONF -- and fail at once: the file is one complete
 * snapshot after every round.  With one shared PATH.tmp, the second open
 * truncated the file the first was writing and both wrote into it (a
 * snapshot followed by the tail of the other, most rounds).  Meanwhile a
 * third thread looks at the process's descriptors: a dump's file is
 * close-on-exec (a program the server execs does not inherit it).
 */
struct dump_racer {
    bfc_ctx_t *ctx;
    bfc_stream_t s;
    pthread_barrier_t *go;
};

static void *dump_race_fail(void *arg)
{
    struct dump_racer *r = arg;
    pthread_barrier_wait(r->go);
    void *p = bfc_ctx_alloc(r->ctx, r->s, 8 * MiB); /* fails: a dump */
    ck_assert_ptr_null(p);
    return NULL;
}

struct fd_watch {
    _Atomic bool stop;
    _Atomic int seen, inheritable;
};

static void *dump_fd_watch(void *arg)
{
    struct fd_watch *w = arg;
    char link[300], target[600];
    while (!atomic_load(&w->stop)) {
        DIR *d = opendir("/proc/self/fd");
        if (!d)
            return NULL;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
            ssize_t n = readlink(link, target, sizeof target - 1);
            if (n <= 0)
                continue;
            target[n] = '\0';
            if (strncmp(target, tmpdir, strlen(tmpdir)) != 0 || !strstr(target, "/shared.json.tmp"))
                continue;
            int flags = fcntl(atoi(e->d_name), F_GETFD);
            if (flags < 0)
                continue; /* closed meanwhile */
            /* The number may have been closed and taken by another file
             * (the main thread's read_file, say) between readlink and
             * fcntl: the flags are the dump's only if the number still
             * names the same file.  Each dump's name is its own (pid and
             * sequence number), so the same name is the same open. */
            char again[600];
            ssize_t m = readlink(link, again, sizeof again - 1);
            if (m != n || memcmp(again, target, (size_t)n) != 0)
                continue;
            atomic_fetch_add(&w->seen, 1);
            if (!(flags & FD_CLOEXEC))
                atomic_fetch_add(&w->inheritable, 1);
        }
        closedir(d);
    }
    return NULL;
}

START_TEST(test_oom_dump_shared_path)
{
    tmp_setup();
    char path[400], spec[600];
    tmp_path(path, sizeof path, "shared.json");
    /* 1,000 and 3,000 live blocks: snapshots of different sizes, long to
     * write. */
    snprintf(spec, sizeof spec, "memory_limit=4M,initial_region=4M,oom_dump=%s", path);
    struct fd_watch w = {0};
    pthread_t watcher;
    ck_assert_int_eq(pthread_create(&watcher, NULL, dump_fd_watch, &w), 0);
    for (int round = 0; round < 8; round++) {
        pthread_barrier_t go;
        ck_assert_int_eq(pthread_barrier_init(&go, NULL, 2), 0);
        struct dump_racer r[2];
        pthread_t t[2];
        enum { NB = 3000 };
        static void *blk[2][NB];
        for (int k = 0; k < 2; k++) {
            r[k].ctx = mkctx(spec);
            r[k].s = bfc_sim_stream_create(r[k].ctx);
            r[k].go = &go;
            for (int i = 0; i < NB; i++)
                blk[k][i] = i < NB / 3 || k == 1 ? xalloc(r[k].ctx, r[k].s, 256) : NULL;
        }
        for (int k = 0; k < 2; k++)
            ck_assert_int_eq(pthread_create(&t[k], NULL, dump_race_fail, &r[k]), 0);
        for (int k = 0; k < 2; k++)
            ck_assert_int_eq(pthread_join(t[k], NULL), 0);
        pthread_barrier_destroy(&go);
        size_t len;
        char *text = read_file(path, &len);
        ck_assert_msg(text != NULL, "round %d: no dump", round);
        json_object *v = json_canonical(text, len); /* fails the test unless one whole snapshot */
        /* one of the two, whole (they differ in size, so that one
         * written over the other does not read as either) */
        uint64_t na = bfc_json_u64(bfc_json_get(v, "totals"), "num_allocs", 0);
        ck_assert_msg(na == NB || na == NB / 3, "round %d: %" PRIu64 " allocations", round, na);
        json_object_put(v);
        free(text);
        ck_assert_int_eq(dump_leftovers("shared.json.tmp"), 0);
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < NB; i++)
                if (blk[k][i])
                    xfree(r[k].ctx, blk[k][i], r[k].s);
            bfc_sim_stream_destroy(r[k].ctx, r[k].s);
            bfc_ctx_destroy(r[k].ctx);
        }
        unlink(path);
    }
    atomic_store(&w.stop, true);
    ck_assert_int_eq(pthread_join(watcher, NULL), 0);
    /* The watcher may miss every dump on a loaded machine; what it saw
     * must be close-on-exec. */
    ck_assert_msg(atomic_load(&w.inheritable) == 0, "%d of %d looks at a dump's file found it inheritable",
                  atomic_load(&w.inheritable), atomic_load(&w.seen));
    fprintf(stderr, "test_oom_dump_shared_path: the watcher saw a dump's file open %d times\n",
            atomic_load(&w.seen));
    tmp_teardown();
}
END_TEST

START_TEST(test_fenced_free_counted_when_issued)
{
    /* The header and doc/snapshot.md say the same thing, and this holds
     * them to it: a fenced free is in num_frees as soon as bfc_ctx_free
     * returns, while its block is still pending. */
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=64M");
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *p = xalloc(ctx, s, 4096);
    bfc_sim_stream_hold(ctx, t);
    xfree(ctx, p, t);
    bfc_stats_t st = stats(ctx);
    ck_assert_uint_eq(st.num_frees, 1);
    ck_assert_uint_eq(st.num_pending_frees, 1);
    json_object *v = snapshot(ctx);
    ck_assert_uint_eq(bfc_json_u64(bfc_json_get(v, "totals"), "num_frees", 0), 1);
    ck_assert_uint_eq(bfc_json_u64(bfc_json_get(shard_of(v, s), "stats"), "num_frees", 0), 1);
    json_object_put(v);
    /* Completing the fence does not count it again. */
    bfc_sim_stream_drain(ctx, t);
    st = stats(ctx);
    ck_assert_uint_eq(st.num_frees, 1);
    ck_assert_uint_eq(st.num_pending_frees, 0);
    bfc_sim_stream_destroy(ctx, s);
    bfc_sim_stream_destroy(ctx, t);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* ------------------------------------------------------- OOM report */

static bfc_oom_info_t oom_info(bfc_ctx_t *ctx, bfc_oom_cause_t want)
{
    bfc_oom_info_t i;
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, &i), BFC_OK);
    ck_assert_msg(i.cause == want, "cause %d, want %d: %s", (int)i.cause, (int)want, i.diagnosis);
    ck_assert_msg(memchr(i.diagnosis, '\0', sizeof i.diagnosis) && strlen(i.diagnosis) > 20, "diagnosis: %s",
                  i.diagnosis);
    ck_assert_ptr_null(strchr(i.diagnosis, '\n')); /* one line */
    return i;
}

START_TEST(test_oom_report_limit_and_too_large)
{
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=4M,initial_region=4M");
    bfc_oom_info_t i;
    /* Nothing failed yet. */
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, &i), BFC_ESTATE);
    ck_assert_int_eq(i.cause, BFC_OOM_NONE);
    ck_assert_int_eq(bfc_ctx_oom_info(NULL, &i), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, NULL), BFC_EINVAL);
    json_object *v = snapshot(ctx);
    ck_assert(bfc_json_is_null(v, "oom"));
    json_object_put(v);

    /* 3 MiB of the 4 MiB region is not split (TensorFlow's rule): 4 MiB in
     * use, so 2 MiB more cannot fit however memory is arranged. */
    void *p = xalloc(ctx, NULL, 3 * MiB);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 2 * MiB + 5));
    i = oom_info(ctx, BFC_OOM_LIMIT);
    ck_assert_uint_eq(i.size, 2 * MiB + 5);
    ck_assert_uint_eq(i.rounded, 2 * MiB + 256);
    ck_assert_ptr_null(i.stream);
    ck_assert_uint_eq(i.bytes_limit, 4 * MiB);
    ck_assert_uint_eq(i.bytes_in_use, 4 * MiB);
    ck_assert_uint_eq(i.num_shards, 1);
    ck_assert_ptr_nonnull(strstr(i.diagnosis, "limit reached: 4.0 MiB in use + 2.0 MiB requested > 4.0 MiB limit"));

    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 5 * MiB));
    i = oom_info(ctx, BFC_OOM_TOO_LARGE);
    ck_assert_uint_eq(i.size, 5 * MiB);
    ck_assert_ptr_nonnull(strstr(i.diagnosis, "request too large"));
    xfree(ctx, p, NULL);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* A stream that released its shard while blocks of it stay live has a
 * new shard: the report's "this stream" is that one alone.  The retired
 * shard's hole (256 KiB between two live blocks) serves nothing: it is
 * another shard's free memory, listed as retired, and not a live shard. */
START_TEST(test_oom_report_retired_shard)
{
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,garbage_collection=false");
    bfc_stream_t a = bfc_sim_stream_create(ctx);
    void *x1 = xalloc(ctx, a, 256 * KiB), *x2 = xalloc(ctx, a, 256 * KiB), *x3 = xalloc(ctx, a, 256 * KiB);
    xfree(ctx, x2, a);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, a), BFC_OK);
    void *y = xalloc(ctx, a, 1000); /* a new shard for the same stream */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 7 * MiB));
    bfc_stats_t cs, ss;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &cs), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, a, &ss), BFC_OK);
    bfc_oom_info_t i;
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, &i), BFC_OK);
    ck_assert_uint_eq(cs.num_shards, 1);
    ck_assert_uint_eq(i.num_shards, cs.num_shards);
    ck_assert_uint_eq(i.stream_free, ss.bytes_free);
    ck_assert_uint_eq(i.stream_largest_free, ss.largest_free_chunk);
    ck_assert_uint_ge(i.other_free, 256 * KiB); /* the retired shard's hole */
    json_object *v = snapshot(ctx);
    const json_object *shards = array_of(bfc_json_get(v, "oom"), "shards");
    size_t requesting = 0, retired = 0;
    for (size_t k = 0; k < bfc_json_len(shards); k++) {
        const json_object *sh = bfc_json_at(shards, k);
        requesting += bool_of(sh, "requesting");
        retired += bool_of(sh, "retired");
        ck_assert(!(bool_of(sh, "requesting") && bool_of(sh, "retired")));
    }
    ck_assert_uint_eq(requesting, 1);
    ck_assert_uint_eq(retired, 1);
    json_object_put(v);
    xfree(ctx, x1, a);
    xfree(ctx, x3, a);
    xfree(ctx, y, a);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* A request above the limit is the stream's failure: counted on its shard
 * (where it has one), so the context's num_ooms is the sum of its shards'. */
START_TEST(test_too_large_counted_on_shard)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=8M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *p = xalloc(ctx, a, 1000);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 9 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc_stats_t cs, ss;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &cs), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, a, &ss), BFC_OK);
    ck_assert_uint_eq(ss.num_ooms, 1);
    ck_assert_uint_eq(cs.num_ooms, 1);
    /* A stream with no shard yet gets none for it; the context counts it. */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 9 * MiB));
    ck_assert_int_eq(bfc_ctx_stats(ctx, &cs), BFC_OK);
    ck_assert_uint_eq(cs.num_ooms, 2);
    ck_assert_uint_eq(cs.num_shards, 1);
    xfree(ctx, p, a);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* A request whose 256-byte rounding overflows: its report says so with
 * rounded = SIZE_MAX (it said 0 chunk bytes). */
START_TEST(test_oom_report_rounding_overflow)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=8M");
    const size_t n[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 254, SIZE_MAX - 255};
    const size_t want[] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX - 255};
    for (int i = 0; i < 4; i++) {
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, n[i]));
        ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
        bfc_oom_info_t info;
        ck_assert_int_eq(bfc_ctx_oom_info(ctx, &info), BFC_OK);
        ck_assert_uint_eq(info.size, n[i]);
        ck_assert_uint_eq(info.rounded, want[i]);
        ck_assert_int_eq(info.cause, BFC_OOM_TOO_LARGE);
    }
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* Each shard of the report says whether it is expandable; an expandable
 * shard's free figures are bounds, and largest_ready is the exact largest
 * block it could hand out without a map (the report's stream_largest_free,
 * for the requesting shard).  A classic shard's largest_ready is its
 * largest free chunk. */
START_TEST(test_oom_report_shard_bounds_named)
{
    const char *spec[] = {"memory_limit=8M,vmm=on", "memory_limit=8M,vmm=off,initial_region=8M"};
    for (int v = 0; v < 2; v++) {
        bfc_ctx_t *ctx = mkctx(spec[v]);
        bfc_stream_t a = bfc_sim_stream_create(ctx);
        void *b[8];
        for (int k = 0; k < 8; k++)
            b[k] = xalloc(ctx, a, MiB);
        for (int k = 0; k < 8; k += 2)
            xfree(ctx, b[k], a);
        /* The whole limit mapped, 4 MiB of it free in 1 MiB pieces: 2 MiB
         * fits nowhere. */
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 2 * MiB));
        json_object *j = snapshot(ctx);
        const json_object *o = bfc_json_get(j, "oom");
        ck_assert_ptr_nonnull(o);
        const json_object *sh = array_of(o, "shards");
        ck_assert_uint_eq(bfc_json_len(sh), 1);
        const json_object *e = bfc_json_at(sh, 0);
        ck_assert(bool_of(e, "requesting"));
        ck_assert_int_eq(bool_of(e, "expandable"), v == 0);
        uint64_t ready = bfc_json_u64(e, "largest_ready", 0), largest = bfc_json_u64(e, "largest_free", 0);
        ck_assert_uint_eq(ready, MiB);
        ck_assert_uint_eq(bfc_json_u64(o, "stream_largest_free", 0), ready);
        if (v == 0)
            ck_assert_uint_ge(largest, ready); /* a bound */
        else
            ck_assert_uint_eq(largest, ready); /* exact */
        json_object_put(j);
        for (int k = 1; k < 8; k += 2)
            xfree(ctx, b[k], a);
        bfc_sim_stream_destroy(ctx, a);
        bfc_ctx_destroy(ctx);
    }
}
END_TEST

START_TEST(test_oom_report_fragmented)
{
    /* Every other 1 MiB block of an 8 MiB region freed: 4 MiB free, in
     * pieces of 1 MiB. */
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,initial_region=8M");
    void *b[8];
    for (int k = 0; k < 8; k++)
        b[k] = xalloc(ctx, NULL, MiB);
    for (int k = 0; k < 8; k += 2)
        xfree(ctx, b[k], NULL);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 2 * MiB));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_FRAGMENTED);
    ck_assert_uint_eq(i.stream_free, 4 * MiB);
    ck_assert_uint_eq(i.stream_largest_free, MiB);
    ck_assert_uint_eq(i.bytes_unreserved, 0);
    ck_assert_ptr_nonnull(strstr(i.diagnosis, "too fragmented: 4.0 MiB free"));
    ck_assert_ptr_nonnull(strstr(i.diagnosis, "largest piece is 1.0 MiB, 2.0 MiB needed"));
    for (int k = 1; k < 8; k += 2)
        xfree(ctx, b[k], NULL);
    bfc_ctx_destroy(ctx);
}
END_TEST

/*
 * A fragmented pool (allow_growth=false, the whole 8 MiB reserved): stream a
 * takes the one region of everything and a 3 MiB block; stream b's first
 * block (1.25 MiB) makes a give its free tail back, and b's region is half
 * of that (2.5 MiB, [3, 5.5) MiB: two of its blocks); a's block is freed.
 * Then 5 MiB on b: a's fully free region goes back to the pool, which then
 * holds [0, 3) and [5.5, 8) MiB -- 5.5 MiB, no piece of 5 -- and b's own
 * free tail (1.25 MiB) would not join them into one.  The pool's spans say
 * so.
 */
static bfc_ctx_t *fragmented_pool(bfc_stream_t *a, bfc_stream_t *b, void **pb)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,allow_growth=false");
    *a = bfc_sim_stream_create(ctx);
    *b = bfc_sim_stream_create(ctx);
    void *pa = xalloc(ctx, *a, 3 * MiB);
    *pb = xalloc(ctx, *b, 5 * MiB / 4);
    ck_assert_ptr_eq(*pb, (char *)pa + 3 * MiB);
    xfree(ctx, pa, *a);
    return ctx;
}

START_TEST(test_oom_report_pool_spans)
{
    tmp_setup();
    bfc_stream_t a, b;
    void *pb;
    bfc_ctx_t *ctx = fragmented_pool(&a, &b, &pb);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 5 * MiB));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_FRAGMENTED);
    ck_assert_ptr_eq(i.stream, b);
    ck_assert_uint_eq(i.num_shards, 2);
    ck_assert_uint_eq(i.stream_largest_free, 5 * MiB / 4);
    ck_assert_uint_eq(i.other_largest_free, 0);
    ck_assert_uint_eq(i.pool_free, 11 * MiB / 2);
    ck_assert_uint_eq(i.pool_largest_span, 3 * MiB);
    ck_assert_uint_eq(i.num_pool_spans, 2);
    ck_assert_uint_eq(i.pool_fenced, 0);

    /* The snapshot (and so the oom_dump file) carries the same report, with
     * each shard's largest free chunk and the pool's spans. */
    json_object *v = snapshot(ctx);
    const json_object *o = bfc_json_get(v, "oom");
    ck_assert_ptr_nonnull(o);
    ck_assert(json_object_is_type(o, json_type_object));
    ck_assert_str_eq(bfc_json_str(o, "cause", ""), "fragmented");
    ck_assert_str_eq(bfc_json_str(o, "diagnosis", ""), i.diagnosis);
    ck_assert_uint_eq(bfc_json_u64(o, "size", 0), 5 * MiB);
    ck_assert_uint_eq(bfc_json_u64(o, "pool_free", 0), 11 * MiB / 2);
    char want[32];
    snprintf(want, sizeof want, "0x%" PRIxPTR, (uintptr_t)b);
    ck_assert_str_eq(bfc_json_str(o, "stream", ""), want);
    const json_object *sh = array_of(o, "shards");
    ck_assert_uint_eq(bfc_json_len(sh), 2);
    int requesting = 0;
    for (size_t k = 0; k < bfc_json_len(sh); k++) {
        const json_object *e = bfc_json_at(sh, k);
        if (bool_of(e, "requesting")) {
            requesting++;
            ck_assert_str_eq(bfc_json_str(e, "stream", ""), want);
            ck_assert_uint_eq(bfc_json_u64(e, "largest_free", 0), 5 * MiB / 4);
            ck_assert_uint_eq(bfc_json_u64(e, "in_use", 0), 5 * MiB / 4);
        } else {
            ck_assert_uint_eq(bfc_json_u64(e, "largest_free", 1), 0);
            ck_assert_uint_eq(bfc_json_u64(e, "in_use", 1), 0);
        }
    }
    ck_assert_int_eq(requesting, 1);
    const json_object *sp = array_of(o, "pool_spans");
    ck_assert_uint_eq(bfc_json_len(sp), 2);
    ck_assert_uint_eq(bfc_json_u64(bfc_json_at(sp, 0), "size", 0), 3 * MiB);
    ck_assert_uint_eq(bfc_json_u64(bfc_json_at(sp, 1), "size", 0), 5 * MiB / 2);
    ck_assert_int_eq(bool_of(bfc_json_at(sp, 0), "fenced"), false);
    ck_assert_uint_eq(bfc_json_u64(o, "spans_omitted", 9), 0);
    json_object_put(v);
    xfree(ctx, pb, b);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* A 64 MiB context (large_alloc=16M, plus spec) whose stream *a allocated
 * four 16 MiB large blocks and freed them while held: their segments sit
 * in the pool, fenced by *a.  *b is a second stream. */
static bfc_ctx_t *four_large_freed_busy(const char *spec, bfc_stream_t *a, bfc_stream_t *b)
{
    char full[128];
    snprintf(full, sizeof full, "memory_limit=64M,large_alloc=16M,%s", spec);
    bfc_ctx_t *ctx = mkctx(full);
    *a = bfc_sim_stream_create(ctx);
    *b = bfc_sim_stream_create(ctx);
    void *l[4];
    for (int k = 0; k < 4; k++)
        l[k] = xalloc(ctx, *a, 16 * MiB);
    bfc_sim_stream_hold(ctx, *a);
    for (int k = 0; k < 4; k++)
        xfree(ctx, l[k], *a);
    return ctx;
}

/* A request on s that fails, reported HELD, the diagnosis naming want. */
static bfc_oom_info_t expect_held(bfc_ctx_t *ctx, bfc_stream_t s, size_t n, const char *want)
{
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, n));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_HELD);
    ck_assert_msg(strstr(i.diagnosis, want), "%s", i.diagnosis);
    return i;
}

/* ... which was so: once `busy` drains, the same request succeeds. */
static void succeeds_after_drain(bfc_ctx_t *ctx, bfc_stream_t busy, bfc_stream_t s, size_t n)
{
    bfc_sim_stream_drain(ctx, busy);
    void *p = bfc_ctx_alloc(ctx, s, n);
    ck_assert_ptr_nonnull(p);
    xfree(ctx, p, s);
}

/* A released stream's free region tail departs to the pool fenced on that
 * stream.  Idle, its event is complete at once; busy, not until it drains.
 * The snapshot's pool "fenced" and the OOM report's pool_fenced (here
 * after a request above the limit, which polls nothing) say which: a
 * fence that completed is not counted, though no allocation has asked the
 * pool about it since.  Each reader first in turn (oom_first), so that
 * neither relies on the other's look. */
static void released_tail(bool busy, bool oom_first)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=64M");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    void *keep = xalloc(ctx, s, 777);
    xfree(ctx, xalloc(ctx, s, 99999), s);
    if (busy)
        bfc_sim_stream_hold(ctx, s);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    for (int round = 0; round < 2; round++) {
        /* Of the tail, only what was handed out (the freed block) is
         * fenced; the never-used rest of the region departs open. */
        uint64_t want = busy && round == 0 ? 100096 : 0;
        for (int k = 0; k < 2; k++) {
            if ((k == 0) == oom_first) {
                ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 65 * MiB));
                bfc_oom_info_t i = oom_info(ctx, BFC_OOM_TOO_LARGE);
                ck_assert_uint_eq(i.pool_fenced, want);
            } else {
                json_object *v = snapshot(ctx);
                ck_assert_uint_eq(bfc_json_u64(bfc_json_get(v, "pool"), "fenced", UINT64_MAX), want);
                json_object_put(v);
            }
        }
        if (busy)
            bfc_sim_stream_drain(ctx, s);
    }
    xfree(ctx, keep, s);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}

/* The same for an expandable shard released while its stream is busy: its
 * reservation departs mapped, fenced on that stream.  Once the stream
 * drains, the report no longer calls it fenced -- but a report only asks:
 * the memory stays held until the pool's next allocation or trim gives it
 * back to the device. */
static void released_reservation(void)
{
    /* The threshold keeps the freed granule mapped until the release. */
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,vmm=on,release_threshold=64M");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    xfree(ctx, xalloc(ctx, s, MiB), s);
    bfc_sim_stream_hold(ctx, s);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 65 * MiB));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_TOO_LARGE);
    uint64_t held = stats(ctx).bytes_reserved;
    ck_assert_uint_gt(held, 0);
    ck_assert_uint_eq(i.pool_fenced, held);
    bfc_sim_stream_drain(ctx, s);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 65 * MiB));
    i = oom_info(ctx, BFC_OOM_TOO_LARGE);
    ck_assert_uint_eq(i.pool_fenced, 0);
    ck_assert_uint_eq(stats(ctx).bytes_reserved, held);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(stats(ctx).bytes_reserved, 0);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}

/* An expandable shard whose granules all went back (a trim) departs with
 * nothing mapped, so with no fence, whatever its stream's state: the
 * snapshot's pool counts the departure, but not among the fenced ones. */
START_TEST(test_departure_unfenced_when_unmapped)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,vmm=on");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    xfree(ctx, xalloc(ctx, s, 1000), s);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    bfc_stats_t st;
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, s, &st), BFC_OK);
    ck_assert_uint_eq(st.bytes_reserved, 0);
    bfc_sim_stream_hold(ctx, s); /* queued work: a range with granules would wait for it */
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    json_object *v = snapshot(ctx), *pool = bfc_json_get(v, "pool");
    ck_assert_uint_ge(bfc_json_u64(pool, "departures", 0), 1);
    ck_assert_uint_eq(bfc_json_u64(pool, "fenced_departures", UINT64_MAX), 0);
    json_object_put(v);
    bfc_sim_stream_drain(ctx, s);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_pool_fence_seen_complete)
{
    for (int k = 0; k < 4; k++)
        released_tail(k & 1, k & 2);
    released_reservation();
}
END_TEST

START_TEST(test_oom_report_held_and_backend)
{
    /* Stream a's one region (8 MiB) holds a small live block after a free
     * 4 MiB chunk: the region is not fully free and its free tail (4 MiB -
     * 1 KiB) is too small to help, so nothing of a's reaches stream b. */
    bfc_ctx_t *ctx = mkctx("memory_limit=8M,initial_region=8M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *big = xalloc(ctx, a, 4 * MiB);
    void *keep = xalloc(ctx, a, KiB);
    xfree(ctx, big, a);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 4 * MiB));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_HELD);
    ck_assert_ptr_eq(i.stream, b);
    ck_assert_uint_eq(i.stream_largest_free, 0);
    ck_assert_uint_eq(i.other_largest_free, 4 * MiB);
    ck_assert_ptr_eq(i.other_largest_stream, a);
    char want[64];
    snprintf(want, sizeof want, "stream %p's shard has a free chunk of 4.0 MiB", (void *)a);
    ck_assert_msg(strstr(i.diagnosis, "memory free but held by other streams") && strstr(i.diagnosis, want), "%s",
                  i.diagnosis);
    xfree(ctx, keep, a);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);

    /* Large blocks' segments (allow_growth, garbage collection), freed on a
     * stream still busy: four 16 MiB pieces in the pool, fenced.  They are
     * what a 32 MiB request on another stream waits for -- once their fence
     * completes the slow path gives them back to the device and takes one
     * segment of 32 MiB -- so the cause is HELD, not FRAGMENTED. */
    ctx = four_large_freed_busy("garbage_collection=true", &a, &b);
    i = expect_held(ctx, b, 32 * MiB, "wholly free pool segments of 64.0 MiB, still fenced");
    ck_assert_msg(!strstr(i.diagnosis, "among others"), "a alone fences them: %s", i.diagnosis);
    ck_assert_uint_eq(i.pool_fenced, 64 * MiB);
    ck_assert_uint_eq(i.pool_largest_span, 16 * MiB);
    ck_assert_msg(strstr(i.diagnosis, "held by other streams"), "%s", i.diagnosis);
    /* Asked on a itself, whose own queued work fences them: said so. */
    expect_held(ctx, a, 32 * MiB, "memory free but held by this stream's own queued work");
    succeeds_after_drain(ctx, a, b, 32 * MiB); /* what the report said */
    /* Without garbage collection the pool keeps its segments (TensorFlow's
     * semantics): the same request fails after the drain too, and the
     * pieces are what they are, FRAGMENTED. */
    bfc_ctx_destroy(ctx);
    ctx = four_large_freed_busy("garbage_collection=false", &a, &b);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 32 * MiB));
    oom_info(ctx, BFC_OOM_FRAGMENTED);
    bfc_sim_stream_drain(ctx, a);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 32 * MiB));
    oom_info(ctx, BFC_OOM_FRAGMENTED);
    bfc_ctx_destroy(ctx);

    /* Whole segments fenced by two streams, each segment by one: the
     * diagnosis names one of them "among others". */
    ctx = mkctx("memory_limit=64M,large_alloc=16M,garbage_collection=true");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    bfc_stream_t c2 = bfc_sim_stream_create(ctx);
    void *seg[4];
    for (int k = 0; k < 4; k++)
        seg[k] = xalloc(ctx, k & 1 ? b : a, 16 * MiB);
    bfc_sim_stream_hold(ctx, a);
    bfc_sim_stream_hold(ctx, b);
    for (int k = 0; k < 4; k++)
        xfree(ctx, seg[k], k & 1 ? b : a);
    i = expect_held(ctx, c2, 32 * MiB, "wholly free pool segments of 64.0 MiB, still fenced");
    ck_assert_msg(strstr(i.diagnosis, "among others"), "a and b fence them: %s", i.diagnosis);
    bfc_sim_stream_drain(ctx, a);
    succeeds_after_drain(ctx, b, c2, 32 * MiB);
    bfc_ctx_destroy(ctx);

    /* A block of a's freed on b while b is busy: pending in a's shard,
     * fenced by b's own work.  The diagnosis names the freeing streams'
     * work, not "other streams'" (here it is the requester's). */
    ctx = mkctx("memory_limit=16M");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    void *whole = xalloc(ctx, a, 16 * MiB);
    bfc_sim_stream_hold(ctx, b);
    xfree(ctx, whole, b);
    i = expect_held(ctx, b, 16 * MiB,
                    "16.0 MiB of freed blocks wait for the earlier work of the streams that freed them");
    ck_assert_uint_eq(i.bytes_pending, 16 * MiB);
    succeeds_after_drain(ctx, b, b, 16 * MiB);
    bfc_ctx_destroy(ctx);

    /* The same segments free as halves fenced by two streams (large_alloc
     * 8M: each 16 MiB segment re-carved for a and b, freed while both are
     * busy): spans with different fences do not merge, but the segments
     * are wholly free all the same -- HELD, as with one stream. */
    ctx = mkctx("memory_limit=64M,large_alloc=8M,garbage_collection=true");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    bfc_stream_t c = bfc_sim_stream_create(ctx);
    void *h[8];
    for (int k = 0; k < 4; k++)
        h[k] = xalloc(ctx, c, 16 * MiB);
    for (int k = 0; k < 4; k++)
        xfree(ctx, h[k], c);
    for (int k = 0; k < 8; k++)
        h[k] = xalloc(ctx, k & 1 ? b : a, 8 * MiB);
    bfc_sim_stream_hold(ctx, a);
    bfc_sim_stream_hold(ctx, b);
    for (int k = 0; k < 8; k++)
        xfree(ctx, h[k], k & 1 ? b : a);
    i = expect_held(ctx, c, 32 * MiB, "still fenced");
    ck_assert_msg(strstr(i.diagnosis, "among others"), "a and b fence them: %s", i.diagnosis);
    ck_assert_uint_eq(i.num_pool_spans, 8);
    bfc_sim_stream_drain(ctx, a);
    succeeds_after_drain(ctx, b, c, 32 * MiB);
    bfc_ctx_destroy(ctx);

    /* One 32 MiB segment, half fenced by a busy stream, half open, the
     * other 32 MiB of the limit in use: the two spans make one piece once
     * the fence completes (the pool serves runs of adjacent spans), with
     * or without garbage collection -- HELD, not FRAGMENTED. */
    for (int gc = 0; gc < 2; gc++) {
        ctx = mkctx(gc ? "memory_limit=64M,large_alloc=16M,garbage_collection=true"
                       : "memory_limit=64M,large_alloc=16M,garbage_collection=false");
        a = bfc_sim_stream_create(ctx);
        b = bfc_sim_stream_create(ctx);
        c = bfc_sim_stream_create(ctx);
        bfc_stream_t d = bfc_sim_stream_create(ctx);
        void *x = xalloc(ctx, c, 32 * MiB);
        xfree(ctx, x, c);
        ck_assert_int_eq(bfc_ctx_stream_release(ctx, c), BFC_OK);
        void *half = xalloc(ctx, a, 16 * MiB);
        bfc_sim_stream_hold(ctx, a);
        xfree(ctx, half, a);
        ck_assert_int_eq(bfc_ctx_stream_release(ctx, a), BFC_OK);
        void *other = xalloc(ctx, d, 32 * MiB);
        expect_held(ctx, b, 32 * MiB, "adjacent pool spans, 32.0 MiB in all");
        succeeds_after_drain(ctx, a, b, 32 * MiB);
        xfree(ctx, other, d);
        bfc_ctx_destroy(ctx);
    }

    /* Expandable arenas: stream b's free granules, b still busy, are room
     * once b's work completes (the escalation unmaps them for a), not
     * pieces: HELD, and the request succeeds after b drains. */
    ctx = mkctx("memory_limit=8M,vmm=on");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    void *p4 = xalloc(ctx, b, 4 * MiB);
    bfc_sim_stream_hold(ctx, b);
    xfree(ctx, p4, b);
    expect_held(ctx, a, 6 * MiB, "granules of 4.0 MiB under free and pending chunks");
    succeeds_after_drain(ctx, b, a, 6 * MiB);
    bfc_ctx_destroy(ctx);

    /* One region (allow_growth=false): this stream's free 2 MiB beside a
     * block another stream freed while busy, pending: one 4 MiB piece once
     * that fence completes -- HELD, not FRAGMENTED. */
    ctx = mkctx("memory_limit=4M,allow_growth=false,initial_region=4M");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    void *q0 = xalloc(ctx, a, 2 * MiB), *q1 = xalloc(ctx, a, 2 * MiB);
    bfc_sim_stream_hold(ctx, b);
    xfree(ctx, q0, b);
    xfree(ctx, q1, a);
    expect_held(ctx, a, 3 * MiB, "this stream's pending frees and the free memory beside them make 4.0 MiB");
    succeeds_after_drain(ctx, b, a, 3 * MiB);
    bfc_ctx_destroy(ctx);

    /* An expandable shard released while its stream is busy leaves its
     * mapped granules in the pool's keeping behind the stream's fence:
     * pool memory, fenced, which the report counted nowhere (it said
     * FRAGMENTED with 4 MiB free, where 60 MiB is held).  After the drain
     * the request succeeds. */
    ctx = mkctx("memory_limit=64M,vmm=on");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    void *p60 = xalloc(ctx, a, 60 * MiB);
    bfc_sim_stream_hold(ctx, a);
    xfree(ctx, p60, a);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, a), BFC_OK);
    i = expect_held(ctx, b, 40 * MiB,
                    "reservations that shards gave up (a stream release or a trim) with 60.0 MiB mapped, still fenced");
    ck_assert_uint_eq(i.pool_free, 60 * MiB);
    ck_assert_uint_eq(i.pool_fenced, 60 * MiB);
    ck_assert_uint_eq(i.bytes_limit - i.bytes_in_use,
                      i.bytes_unreserved + i.stream_free + i.other_free + i.bytes_pending + i.pool_free);
    succeeds_after_drain(ctx, a, b, 40 * MiB);
    bfc_ctx_destroy(ctx);

    /* The same reservation given up by a trim, the stream never released:
     * the report does not call it a released stream's. */
    ctx = mkctx("memory_limit=64M,vmm=on");
    a = bfc_sim_stream_create(ctx);
    b = bfc_sim_stream_create(ctx);
    p60 = xalloc(ctx, a, 60 * MiB);
    bfc_sim_stream_hold(ctx, a);
    xfree(ctx, p60, a);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    i = expect_held(ctx, b, 40 * MiB,
                    "reservations that shards gave up (a stream release or a trim) with 60.0 MiB mapped, still fenced");
    succeeds_after_drain(ctx, a, b, 40 * MiB);
    bfc_ctx_destroy(ctx);

    /* The limit has room but the device does not: what it could not
     * provide is named as the context takes memory (granules, regions). */
    for (int classic = 0; classic < 2; classic++) {
        ctx = mkctx(classic ? "memory_limit=64M,initial_region=1M" : "memory_limit=64M,initial_region=1M,vmm=on");
        void *p = xalloc(ctx, NULL, 512 * KiB);
        bfc_sim_set_alloc_ceiling(ctx, MiB);
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 2 * MiB));
        i = oom_info(ctx, BFC_OOM_BACKEND);
        ck_assert_uint_eq(i.bytes_unreserved, classic ? 63 * MiB : 62 * MiB); /* vmm: a 2 MiB granule */
        ck_assert_ptr_nonnull(strstr(i.diagnosis, "the device refused"));
        ck_assert_msg(strstr(i.diagnosis, classic ? "provide a region for" : "provide the granules for"), "%d: %s", classic, i.diagnosis);
        xfree(ctx, p, NULL);
        bfc_ctx_destroy(ctx);
    }
}
END_TEST

struct oom_seen {
    int calls, rc;
    size_t size;
    bfc_stream_t stream;
    bfc_oom_info_t info;
    bfc_ctx_t *other;
    int rc_other;
};

static int oom_report_cb(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream, const bfc_stats_t *summary, void *arg)
{
    (void)summary;
    struct oom_seen *r = arg;
    r->calls++;
    r->size = size;
    r->stream = stream;
    r->rc = bfc_ctx_oom_info(ctx, &r->info);
    /* The thread-local report is ctx's only: another context has none. */
    bfc_oom_info_t o;
    r->rc_other = bfc_ctx_oom_info(r->other, &o);
    return 0;
}

START_TEST(test_oom_report_in_callback)
{
    bfc_ctx_t *ctx = mkctx("memory_limit=4M,initial_region=4M");
    bfc_ctx_t *other = mkctx("memory_limit=4M");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    struct oom_seen r = {.other = other};
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, oom_report_cb, &r), BFC_OK);
    void *p = xalloc(ctx, s, 3 * MiB);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 3 * MiB));
    ck_assert_int_eq(r.calls, 1);
    ck_assert_int_eq(r.rc, BFC_OK);
    ck_assert_int_eq(r.rc_other, BFC_ESTATE);
    /* The report is about this failure: the callback's own arguments. */
    ck_assert_uint_eq(r.info.size, r.size);
    ck_assert_ptr_eq(r.info.stream, r.stream);
    ck_assert_ptr_eq(r.info.stream, s);
    ck_assert_int_eq(r.info.cause, BFC_OOM_LIMIT);
    /* Outside the callback: the context's latest report, the same one. */
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_LIMIT);
    ck_assert_int_eq(memcmp(&i, &r.info, sizeof i), 0);
    xfree(ctx, p, s);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
    bfc_ctx_destroy(other);
}
END_TEST

/* ------------------------------------------------------------- config */

START_TEST(test_config_paths)
{
    bfc_config_t c, before;
    bfc_config_init(&c);
    ck_assert_str_eq(c.oom_dump, "");
    ck_assert_str_eq(c.trace, "");
    ck_assert_int_eq(bfc_config_parse(&c, "oom_dump=/tmp/a b/oom.json, trace = /tmp/t.csv "), BFC_OK);
    ck_assert_str_eq(c.oom_dump, "/tmp/a b/oom.json");
    ck_assert_str_eq(c.trace, "/tmp/t.csv");
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);

    char spec[600], path[300];
    memset(path, 'x', 255);
    path[0] = '/';
    path[255] = '\0';
    snprintf(spec, sizeof spec, "trace=%s", path); /* 255 bytes: fits */
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
    ck_assert_uint_eq(strlen(c.trace), 255);
    /* A shorter path after a longer one leaves no tail behind. */
    ck_assert_int_eq(bfc_config_parse(&c, "trace=/t"), BFC_OK);
    ck_assert_str_eq(c.trace, "/t");
    ck_assert(c.trace[3] == '\0' && c.trace[254] == '\0');

    memcpy(&before, &c, sizeof c);
    path[255] = 'y';
    path[256] = '\0';
    snprintf(spec, sizeof spec, "memory_limit=1G,trace=%s", path); /* 256 bytes: too long */
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_EINVAL);
    ck_assert(memcmp(&c, &before, sizeof c) == 0);
    ck_assert_int_eq(bfc_config_parse(&c, "memory_limit=1G,oom_dump=/tmp/a\tb"), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse(&c, "oom_dump="), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse(&c, "oom_dump=/tmp/\x7f"), BFC_EINVAL);
    ck_assert(memcmp(&c, &before, sizeof c) == 0);

    /* Filled by hand without a terminator: invalid. */
    memset(c.oom_dump, 'z', sizeof c.oom_dump);
    ck_assert_int_eq(bfc_config_validate(&c), BFC_EINVAL);
    bfc_ctx_t *ctx = NULL;
    c.backend = BFC_BACKEND_SIM;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_EINVAL);
    ck_assert_ptr_null(ctx);
}
END_TEST

/* -------------------------------------------------------------- trace */

static size_t count_action(const bfc_trace_event_t *ev, size_t n, int action)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ev[i].action == action;
    return k;
}

static const bfc_trace_event_t *find_event(const bfc_trace_event_t *ev, size_t n, int action, const void *p)
{
    for (size_t i = 0; i < n; i++)
        if (ev[i].action == action && ev[i].ptr == (uint64_t)(uintptr_t)p)
            return &ev[i];
    return NULL;
}

static void read_trace(const char *path, bfc_trace_event_t **ev, size_t *n)
{
    char err[300];
    ck_assert_msg(bfc_trace_csv_read(path, ev, n, err, sizeof err) == 0, "read %s: %s", path, err);
}

/* A trace file that cannot be opened for want of a descriptor is not the
 * path's fault: BFC_ENOMEM, and the same path opens once descriptors are
 * back.  (It said BFC_EINVAL, "the path will not do", which for trace= in
 * SHARDBFC_CONF stops the process-wide service for good.) */
START_TEST(test_trace_start_out_of_descriptors)
{
    tmp_setup();
    char path[400];
    tmp_path(path, sizeof path, "fd.csv");
    bfc_ctx_t *ctx = mkctx("memory_limit=16M");
    struct rlimit old, rl;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
    rl = old;
    rl.rlim_cur = 256;
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
    int fds[256], n = 0, fd;
    while (n < 256 && (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
        fds[n++] = fd;
    ck_assert_int_eq(errno, EMFILE);
    int st = bfc_ctx_trace_start(ctx, path);
    while (n > 0)
        close(fds[--n]);
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
    ck_assert_int_eq(st, BFC_ENOMEM);
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    /* And a path whose directory does not exist is the caller's. */
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, "/nonexistent-dir/x.csv"), BFC_EINVAL);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

START_TEST(test_trace_round_trip)
{
    tmp_setup();
    char path[400];
    tmp_path(path, sizeof path, "trace.csv");
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,initial_region=2M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_ESTATE);
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, "/nonexistent-dir/x.csv"), BFC_EINVAL);
    struct stat full;
    if (stat("/dev/full", &full) == 0 && S_ISCHR(full.st_mode)) /* opens, but no header fits */
        ck_assert_int_eq(bfc_ctx_trace_start(ctx, "/dev/full"), BFC_EBACKEND);
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_EBUSY);

    void *p1 = xalloc(ctx, a, 1000);
    void *p2 = xalloc(ctx, a, 5000);
    void *p3 = xalloc(ctx, b, 3 * MiB); /* b grows a 4 MiB region */
    xfree(ctx, p1, a);                  /* same stream: free only */
    bfc_sim_stream_hold(ctx, b);
    xfree(ctx, p2, b);                  /* cross-stream, fenced: free now ... */
    void *p4 = xalloc(ctx, a, 256);     /* (drain: still pending) */
    bfc_sim_stream_drain(ctx, b);
    void *p5 = xalloc(ctx, a, 512);     /* ... free_complete here */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 1u << 30)); /* allocate failure */
    xfree(ctx, p3, b);
    xfree(ctx, p4, a);
    xfree(ctx, p5, a);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK); /* releases every region */
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    /* Not traced any more. */
    void *after = xalloc(ctx, a, 777);
    xfree(ctx, after, a);

    bfc_trace_event_t *ev;
    size_t n;
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_ALLOC), 5);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_ALLOC_FAIL), 1);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_FREE), 5);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_FREE_COMPLETE), 1);
    size_t grows = count_action(ev, n, BFC_TRACE_GROW);
    ck_assert_uint_eq(grows, 2); /* one region per shard */
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_RELEASE), grows);
    ck_assert_uint_eq(n, 5 + 1 + 5 + 1 + 2 * grows);

    uint64_t tid = (uint64_t)syscall(SYS_gettid);
    for (size_t i = 0; i < n; i++) {
        ck_assert_uint_eq(ev[i].thread, tid);
        if (i)
            ck_assert_uint_ge(ev[i].time_ns, ev[i - 1].time_ns);
    }
    struct {
        void *p;
        size_t n;
        bfc_stream_t s;
    } al[] = {{p1, 1000, a}, {p2, 5000, a}, {p3, 3 * MiB, b}, {p4, 256, a}, {p5, 512, a}};
    /* One thread: the allocate rows are the allocations, in order (p4 may
     * reuse p1's address). */
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (ev[i].action != BFC_TRACE_ALLOC)
            continue;
        ck_assert_uint_eq(ev[i].ptr, (uintptr_t)al[k].p);
        ck_assert_uint_eq(ev[i].size, al[k].n);
        ck_assert_uint_eq(ev[i].stream, (uintptr_t)al[k].s);
        k++;
    }
    ck_assert_uint_eq(k, 5);
    const bfc_trace_event_t *f1 = find_event(ev, n, BFC_TRACE_FREE, p1);
    ck_assert_ptr_nonnull(f1);
    ck_assert_uint_eq(f1->stream, (uintptr_t)a);
    ck_assert_uint_eq(f1->size, 1000);
    ck_assert_ptr_null(find_event(ev, n, BFC_TRACE_FREE_COMPLETE, p1));
    /* The fenced free: free on b, completion on the owner a, after the
     * allocation that found it still pending and before p5's. */
    const bfc_trace_event_t *f2 = find_event(ev, n, BFC_TRACE_FREE, p2);
    const bfc_trace_event_t *c2 = find_event(ev, n, BFC_TRACE_FREE_COMPLETE, p2);
    ck_assert_ptr_nonnull(f2);
    ck_assert_ptr_nonnull(c2);
    ck_assert_uint_eq(f2->stream, (uintptr_t)b);
    ck_assert_uint_eq(c2->stream, (uintptr_t)a);
    ck_assert_uint_eq(c2->size, 5000);
    const bfc_trace_event_t *a4 = NULL, *a5 = NULL;
    for (size_t i = 0; i < n; i++)
        if (ev[i].action == BFC_TRACE_ALLOC && ev[i].size == 256)
            a4 = &ev[i];
        else if (ev[i].action == BFC_TRACE_ALLOC && ev[i].size == 512)
            a5 = &ev[i];
    ck_assert(f2 < a4 && a4 < c2 && c2 < a5);
    /* The failure row: nil pointer, the size asked. */
    for (size_t i = 0; i < n; i++)
        if (ev[i].action == BFC_TRACE_ALLOC_FAIL) {
            ck_assert_uint_eq(ev[i].ptr, 0);
            ck_assert_uint_eq(ev[i].size, 1u << 30);
        }
    /* Grow rows name regions that hold the blocks. */
    const bfc_trace_event_t *g3 = NULL;
    for (size_t i = 0; i < n; i++)
        if (ev[i].action == BFC_TRACE_GROW && ev[i].stream == (uintptr_t)b)
            g3 = &ev[i];
    ck_assert_ptr_nonnull(g3);
    ck_assert_uint_eq(g3->ptr, (uintptr_t)p3);
    ck_assert_uint_ge(g3->size, 3 * MiB);
    free(ev);

    /* The header is RMM's. */
    size_t len;
    char *text = read_file(path, &len);
    ck_assert(strncmp(text, "Thread,Time,Action,Pointer,Size,Stream\n", 39) == 0);
    free(text);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

#define TT_THREADS 4
#define TT_OPS 3000

struct tt_arg {
    bfc_ctx_t *ctx;
    uint64_t tid;
};

static void *trace_thread(void *p)
{
    struct tt_arg *arg = p;
    arg->tid = (uint64_t)syscall(SYS_gettid);
    bfc_stream_t s = bfc_sim_stream_create(arg->ctx);
    void *live[16] = {0};
    unsigned x = (unsigned)arg->tid * 2654435761u;
    for (int i = 0; i < TT_OPS; i++) {
        x = x * 1103515245u + 12345u;
        int k = (int)((x >> 8) % 16);
        if (live[k]) {
            if (bfc_ctx_free(arg->ctx, live[k], s) != BFC_OK)
                return (void *)1;
            live[k] = NULL;
        } else {
            live[k] = bfc_ctx_alloc(arg->ctx, s, 256 + (x >> 16) % 8192);
            if (!live[k])
                return (void *)1;
        }
    }
    for (int k = 0; k < 16; k++)
        if (live[k] && bfc_ctx_free(arg->ctx, live[k], s) != BFC_OK)
            return (void *)1;
    bfc_sim_stream_destroy(arg->ctx, s);
    return NULL;
}

/* Threads that exit while the trace runs: their buffers are flushed at
 * exit, and nothing is lost or duplicated. */
START_TEST(test_trace_threads)
{
    tmp_setup();
    char path[400];
    tmp_path(path, sizeof path, "threads.csv");
    bfc_ctx_t *ctx = mkctx("memory_limit=256M");
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    pthread_t th[TT_THREADS];
    struct tt_arg args[TT_THREADS];
    for (int i = 0; i < TT_THREADS; i++) {
        args[i].ctx = ctx;
        ck_assert_int_eq(pthread_create(&th[i], NULL, trace_thread, &args[i]), 0);
    }
    for (int i = 0; i < TT_THREADS; i++) {
        void *r;
        ck_assert_int_eq(pthread_join(th[i], &r), 0);
        ck_assert_ptr_null(r);
    }
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    bfc_stats_t st = stats(ctx);
    bfc_trace_event_t *ev;
    size_t n;
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_ALLOC), st.num_allocs);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_FREE), st.num_frees);
    ck_assert_uint_eq(st.num_allocs, st.num_frees);
    /* Per thread: times never go back, allocs and frees balance. */
    for (int t = 0; t < TT_THREADS; t++) {
        uint64_t last = 0;
        long bal = 0;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (ev[i].thread != args[t].tid)
                continue;
            ck_assert_uint_ge(ev[i].time_ns, last);
            last = ev[i].time_ns;
            bal += ev[i].action == BFC_TRACE_ALLOC ? 1 : ev[i].action == BFC_TRACE_FREE ? -1 : 0;
            k++;
        }
        ck_assert_uint_ge(k, TT_OPS / 2);
        ck_assert_int_eq(bal, 0);
    }
    free(ev);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* Bytes of one action's rows, for one stream (NULL: any). */
static uint64_t action_bytes(const bfc_trace_event_t *ev, size_t n, int action, bfc_stream_t s)
{
    uint64_t b = 0;
    for (size_t i = 0; i < n; i++)
        if (ev[i].action == action && (!s || ev[i].stream == (uintptr_t)s))
            b += ev[i].size;
    return b;
}

/* Bytes of [lo, hi) that rows of one action cover. */
static uint64_t action_covers(const bfc_trace_event_t *ev, size_t n, int action, uint64_t lo, uint64_t hi)
{
    uint64_t c = 0;
    for (size_t i = 0; i < n; i++) {
        if (ev[i].action != action)
            continue;
        uint64_t a = ev[i].ptr > lo ? ev[i].ptr : lo, b = ev[i].ptr + ev[i].size < hi ? ev[i].ptr + ev[i].size : hi;
        c += b > a ? b - a : 0;
    }
    return c;
}

/*
 * Expandable arenas: every run of granules unmapped gets its "release" row,
 * also where a released stream's reservation goes back to the device from
 * the pool rather than from its shard:
 *  (a) the stream released while it still holds a block: the reservation
 *      departs at that block's free, and goes at once (nothing queued);
 *  (b) the stream busy at its release: the reservation departs fenced, is
 *      taken back by the stream's next shard (no rows: it stays mapped),
 *      departs again at the second release, and goes when the fence has
 *      completed (the drain, then a trim).
 * Either way the granules mapped and unmapped balance, stream by stream,
 * once nothing is reserved (a departed reservation's unmap wrote no row:
 * 2 MiB grown and never released in (a)), and address by address: each
 * byte grown is released once, at its own address; (b)'s three granules
 * go as one run, one row.
 */
START_TEST(test_trace_vmm_departed)
{
    tmp_setup();
    char path[400];
    for (int k = 0; k < 2; k++) {
        tmp_path(path, sizeof path, k ? "vmm_b.csv" : "vmm_a.csv");
        bfc_ctx_t *ctx = mkctx(k ? "memory_limit=64M,vmm=on,release_threshold=64M" : "memory_limit=64M,vmm=on");
        bfc_stream_t s = bfc_sim_stream_create(ctx);
        ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
        void *big = xalloc(ctx, s, 4 * MiB), *small = xalloc(ctx, s, 1000);
        xfree(ctx, big, s);
        if (k == 0) {
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
            xfree(ctx, small, s);
        } else {
            xfree(ctx, small, s);
            bfc_sim_stream_hold(ctx, s);
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
            ck_assert_uint_eq(stats(ctx).bytes_reserved, 6 * MiB); /* departed, fenced */
            void *again = xalloc(ctx, s, 1000); /* adopts it */
            ck_assert_uint_eq(stats(ctx).bytes_reserved, 6 * MiB);
            xfree(ctx, again, s);
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
            bfc_sim_stream_drain(ctx, s);
        }
        ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
        ck_assert_uint_eq(stats(ctx).bytes_reserved, 0);
        ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
        bfc_trace_event_t *ev;
        size_t n;
        read_trace(path, &ev, &n);
        ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_GROW, NULL), 6 * MiB);
        ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_GROW, s), 6 * MiB);
        ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_RELEASE, s), 6 * MiB);
        ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_RELEASE, NULL), 6 * MiB);
        for (size_t i = 0; i < n; i++) {
            uint64_t lo = ev[i].ptr, hi = ev[i].ptr + ev[i].size;
            if (ev[i].action == BFC_TRACE_GROW)
                ck_assert_uint_eq(action_covers(ev, n, BFC_TRACE_RELEASE, lo, hi), ev[i].size);
            else if (ev[i].action == BFC_TRACE_RELEASE)
                ck_assert_uint_eq(action_covers(ev, n, BFC_TRACE_GROW, lo, hi), ev[i].size);
        }
        if (k == 1)
            ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_RELEASE), 1);
        free(ev);
        bfc_sim_stream_destroy(ctx, s);
        bfc_ctx_destroy(ctx);
    }
    tmp_teardown();
}
END_TEST

/*
 * The same when the device refuses part of a departed reservation's release
 * (SIM: every second unmap refused): the granules it took back get their
 * rows at once, and the later release, once the device takes the rest,
 * writes rows for the rest only -- so at every stop the rows say what the
 * device holds.  (Rows written only at the last release, for every granule
 * mapped at the departure: 8 MiB grown, nothing released, while the device
 * held 6; then 8 MiB released where it gave back 6.)
 */
START_TEST(test_trace_vmm_refused_release)
{
    tmp_setup();
    char path[400];
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,vmm=on,release_threshold=64M");
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    bfc_trace_event_t *ev;
    size_t n;
    tmp_path(path, sizeof path, "refused_a.csv");
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    xfree(ctx, xalloc(ctx, s, 8 * MiB), s);
    bfc_sim_fail_free_every(ctx, 2);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK); /* goes at once, in part */
    uint64_t held = bfc_sim_backend_bytes_held(ctx);
    ck_assert_uint_gt(held, 0);
    ck_assert_uint_lt(held, 8 * MiB);
    ck_assert_uint_eq(stats(ctx).bytes_reserved, held);
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_GROW, s), 8 * MiB);
    ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_RELEASE, s), 8 * MiB - held);
    free(ev);

    tmp_path(path, sizeof path, "refused_b.csv");
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    bfc_sim_fail_free_every(ctx, 0);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK); /* offered again: the rest goes */
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), 0);
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_GROW, NULL), 0);
    ck_assert_uint_eq(action_bytes(ev, n, BFC_TRACE_RELEASE, s), held);
    free(ev);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* trace=PATH in the configuration traces from creation to destruction. */
START_TEST(test_trace_from_config)
{
    tmp_setup();
    char path[400], spec[600];
    tmp_path(path, sizeof path, "cfg.csv");
    snprintf(spec, sizeof spec, "memory_limit=16M,trace=%s", path);
    bfc_ctx_t *ctx = mkctx(spec);
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_EBUSY);
    void *p = xalloc(ctx, NULL, 4096);
    xfree(ctx, p, NULL);
    bfc_ctx_destroy(ctx); /* flushes */
    bfc_trace_event_t *ev;
    size_t n;
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_ALLOC), 1);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_FREE), 1);
    ck_assert_uint_eq(count_action(ev, n, BFC_TRACE_GROW), 1);
    ck_assert_ptr_nonnull(find_event(ev, n, BFC_TRACE_ALLOC, p));
    free(ev);

    /* An unwritable trace path fails creation. */
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,trace=/nonexistent-dir/t.csv"), BFC_OK);
    ctx = NULL;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_EINVAL);
    ck_assert_ptr_null(ctx);
    tmp_teardown();
}
END_TEST

START_TEST(test_rmm_csv_edge_cases)
{
    tmp_setup();
    char path[400];
    FILE *f = tmp_create(path, sizeof path, "rmm.csv");
    /* Columns reordered, CR LF, blank line, RMM times, nil pointers. */
    fputs("Thread,Time,Action,Pointer,Size,Stream\r\n"
          "140230,09:15:02.123456,allocate,0x7f1200000000,1024,0x0\r\n"
          "140230,09:15:02.123460,allocate failure,0x0,68719476736,0x0\r\n"
          "\r\n"
          "140231,09:15:02.200000,allocate,7f1200000400,2048,0x5562a0\r\n"
          "140231,09:15:02.200001,allocate failure,(nil),4096,0x5562a0\r\n"
          "140230,09:15:03.000001,free,0x7f1200000000,1024,0x0\r\n"
          "140231,09:15:03.5,free,0x7f1200000400,2048,0x5562a0\r\n",
          f);
    fclose(f);
    bfc_trace_event_t *ev;
    size_t n;
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(n, 6);
    ck_assert_int_eq(ev[0].action, BFC_TRACE_ALLOC);
    ck_assert_uint_eq(ev[0].ptr, 0x7f1200000000ull);
    ck_assert_uint_eq(ev[0].time_ns, ((9 * 3600 + 15 * 60 + 2) * 1000000000ull) + 123456000ull);
    ck_assert_int_eq(ev[1].action, BFC_TRACE_ALLOC_FAIL);
    ck_assert_uint_eq(ev[1].ptr, 0);
    ck_assert_uint_eq(ev[1].size, 68719476736ull);
    ck_assert_uint_eq(ev[2].ptr, 0x7f1200000400ull); /* hex without 0x, as RMM parses it */
    ck_assert_uint_eq(ev[2].stream, 0x5562a0);
    ck_assert_uint_eq(ev[2].thread, 140231);
    ck_assert_uint_eq(ev[3].ptr, 0);
    ck_assert_uint_eq(ev[5].time_ns, ((9 * 3600 + 15 * 60 + 3) * 1000000000ull) + 500000000ull);

    /* Replayed: two allocations, two frees, the failure rows skipped. */
    bfc_replay_result_t r;
    char err[300];
    ck_assert_msg(bfc_replay_run(ev, n, "memory_limit=64M", NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(r.allocs, 2);
    ck_assert_uint_eq(r.frees, 2);
    ck_assert_uint_eq(r.skipped, 2);
    ck_assert_uint_eq(r.ooms, 0);
    ck_assert_uint_eq(r.streams, 1);
    ck_assert_uint_eq(r.peak_allocated, 1024 + 2048);
    ck_assert_uint_eq(r.peak_requested, 1024 + 2048); /* failure rows asked for nothing live */
    free(ev);

    /* Errors name the line. */
    const char *bad[] = {"Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,12x,0x0\n",
                         "Thread,Time,Action,Pointer,Size,Stream\n1,2,realloc,0x10,12,0x0\n",
                         "Thread,Time,Pointer,Size\n1,2,0x10,12\n",
                         "Thread,Time,Action,Pointer,Size,Stream\n1,2,free,0x10\n",
                         ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f = fopen(path, "w");
        fputs(bad[i], f);
        fclose(f);
        ck_assert_int_eq(bfc_trace_csv_read(path, &ev, &n, err, sizeof err), -1);
        ck_assert_ptr_null(ev);
        ck_assert_msg(strstr(err, path) != NULL, "message '%s' does not name the file", err);
        if (i < 2)
            ck_assert_msg(strstr(err, ":2:") != NULL, "message '%s' does not name line 2", err);
    }
    ck_assert_int_eq(bfc_trace_csv_read("/nonexistent-dir/x.csv", &ev, &n, err, sizeof err), -1);
    tmp_teardown();
}
END_TEST

/* Any number of columns (Stream, then Action, Pointer and Size past the
 * 16th: those beyond were dropped, a Stream there silently, the others as
 * "header lacks"), a UTF-8 byte-order mark before the first name (it hid
 * Thread), and thousands of threads each in time order (over 2,047 the
 * order check answered "not in time order" and the replay kept the file's
 * order, with another peak). */
START_TEST(test_csv_wide_marked_and_many_threads)
{
    tmp_setup();
    char path[400];
    FILE *f = tmp_create(path, sizeof path, "wide.csv");
    fputs("\xEF\xBB\xBFThread,Time", f);
    for (int i = 0; i < 15; i++)
        fprintf(f, ",x%d", i);
    fputs(",Stream,Action,Pointer,Size\n", f);
    for (int r = 0; r < 2; r++) {
        fprintf(f, "%d,%d", 7 + r, 10 + r);
        for (int i = 0; i < 15; i++)
            fputs(",junk", f);
        fprintf(f, ",0x%x,allocate,0x%x,%d\n", 0x500 + r, 0x1000 * (r + 1), 256 * (r + 1));
    }
    fclose(f);
    bfc_trace_event_t *ev;
    size_t n;
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(n, 2);
    for (int r = 0; r < 2; r++) {
        ck_assert_uint_eq(ev[r].thread, 7u + (unsigned)r);
        ck_assert_uint_eq(ev[r].time_ns, 10u + (unsigned)r);
        ck_assert_uint_eq(ev[r].stream, 0x500u + (unsigned)r);
        ck_assert_int_eq(ev[r].action, BFC_TRACE_ALLOC);
        ck_assert_uint_eq(ev[r].ptr, 0x1000u * (unsigned)(r + 1));
        ck_assert_uint_eq(ev[r].size, 256u * (unsigned)(r + 1));
    }
    free(ev);

    /* 3,000 threads, one row each at times 1..3000, written in reverse:
     * every thread's rows are in time order, so the replay sorts by time. */
    enum { T = 3000 };
    f = tmp_create(path, sizeof path, "threads.csv");
    fputs("Thread,Time,Action,Pointer,Size\n", f);
    for (int t = T; t >= 1; t--)
        fprintf(f, "%d,%d,allocate,0x%x,256\n", t, t, t * 0x1000);
    fclose(f);
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(n, T);
    size_t *order = malloc(T * sizeof(*order));
    ck_assert_ptr_nonnull(order);
    ck_assert_int_eq(bfc_trace_order(ev, n, order), 1);
    for (size_t i = 0; i < T; i++)
        ck_assert_uint_eq(ev[order[i]].time_ns, i + 1);
    /* One thread out of order among them: file order. */
    ev[5].thread = ev[7].thread; /* times 2995 then 2993: backwards */
    ck_assert_int_eq(bfc_trace_order(ev, n, order), 0);
    free(order);
    free(ev);
    tmp_teardown();
}
END_TEST

/* ------------------------------------------------------------- replay */

/* (index of the grow event whose region holds p, offset in it) */
struct addr {
    size_t region;
    uint64_t off;
};

static size_t addresses(const bfc_trace_event_t *ev, size_t n, struct addr *out, size_t max)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (ev[i].action != BFC_TRACE_ALLOC)
            continue;
        /* The most recent grow (before it) that contains the pointer. */
        size_t g = SIZE_MAX, gi = 0;
        for (size_t j = 0; j < i; j++) {
            if (ev[j].action == BFC_TRACE_GROW) {
                if (ev[i].ptr >= ev[j].ptr && ev[i].ptr < ev[j].ptr + ev[j].size)
                    g = gi;
                gi++;
            }
        }
        ck_assert_msg(g != SIZE_MAX, "allocation %zu lies in no traced region", i);
        ck_assert_uint_lt(k, max);
        size_t gj = 0;
        uint64_t base = 0;
        for (size_t j = 0; j < i; j++)
            if (ev[j].action == BFC_TRACE_GROW && gj++ == g)
                base = ev[j].ptr;
        out[k++] = (struct addr){g, ev[i].ptr - base};
    }
    return k;
}

START_TEST(test_replay_reproduces_peaks_and_addresses)
{
    tmp_setup();
    char path[400], path2[400];
    tmp_path(path, sizeof path, "orig.csv");
    tmp_path(path2, sizeof path2, "replayed.csv");
    const char *spec = "memory_limit=64M,initial_region=1M,vmm=off";
    bfc_ctx_t *ctx = mkctx(spec);
    bfc_stream_t s[2] = {bfc_sim_stream_create(ctx), bfc_sim_stream_create(ctx)};
    ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    void *live[64] = {0};
    int owner[64];
    size_t req[64], asz[64];
    /* The exact peaks, in the order the calls were issued. */
    uint64_t req_live = 0, req_peak = 0, alloc_live = 0, alloc_peak = 0;
    unsigned x = 12345;
    for (int i = 0; i < 3000; i++) {
        x = x * 1103515245u + 12345u;
        int k = (int)((x >> 10) % 64);
        if (live[k]) {
            /* One free in eight on the other stream (fenced). */
            int fs = ((x >> 20) & 7) == 0 ? 1 - owner[k] : owner[k];
            xfree(ctx, live[k], s[fs]);
            live[k] = NULL;
            req_live -= req[k];
            alloc_live -= asz[k];
        } else {
            owner[k] = (int)((x >> 24) & 1);
            req[k] = 256 + (x >> 12) % (256 * KiB);
            live[k] = xalloc(ctx, s[owner[k]], req[k]);
            asz[k] = bfc_ctx_allocated_size(ctx, live[k]);
            req_live += req[k];
            alloc_live += asz[k];
            if (req_live > req_peak)
                req_peak = req_live;
            if (alloc_live > alloc_peak)
                alloc_peak = alloc_live;
        }
    }
    for (int k = 0; k < 64; k++)
        if (live[k])
            xfree(ctx, live[k], s[owner[k]]);
    ck_assert_int_eq(bfc_ctx_trace_stop(ctx), BFC_OK);
    bfc_stats_t orig = stats(ctx);
    bfc_sim_stream_destroy(ctx, s[0]);
    bfc_sim_stream_destroy(ctx, s[1]);
    bfc_ctx_destroy(ctx);

    bfc_trace_event_t *ev, *ev2;
    size_t n, n2;
    read_trace(path, &ev, &n);
    bfc_replay_result_t r;
    char err[300];
    ck_assert_msg(bfc_replay_run(ev, n, spec, path2, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(r.allocs, orig.num_allocs);
    ck_assert_uint_eq(r.frees, orig.num_frees);
    ck_assert_uint_eq(r.ooms, 0);
    ck_assert_uint_eq(r.streams, 2);
    /* The measures: exact, and the context's own peak only a bound. */
    ck_assert_uint_eq(r.peak_requested, req_peak);
    ck_assert_uint_eq(r.peak_allocated, alloc_peak);
    ck_assert_uint_le(r.peak_allocated, orig.peak_bytes_in_use);
    ck_assert_uint_le(orig.peak_bytes_requested, orig.peak_bytes_in_use);
    ck_assert_uint_ge(orig.peak_bytes_requested, req_peak);
    ck_assert_uint_eq(r.peak_reserved, orig.peak_bytes_reserved);
    ck_assert(fabs(r.overhead - (double)r.peak_reserved / (double)req_peak) < 1e-12);
    ck_assert(r.overhead >= 1.0);
    ck_assert(r.fragmentation >= 0.0 && r.fragmentation < 1.0);

    /* The same addresses, relative to the regions. */
    read_trace(path2, &ev2, &n2);
    static struct addr A[4000], B[4000];
    size_t na = addresses(ev, n, A, 4000), nb = addresses(ev2, n2, B, 4000);
    ck_assert_uint_eq(na, nb);
    for (size_t i = 0; i < na; i++)
        ck_assert_msg(A[i].region == B[i].region && A[i].off == B[i].off,
                      "allocation %zu: region %zu +%" PRIu64 " vs region %zu +%" PRIu64, i, A[i].region, A[i].off,
                      B[i].region, B[i].off);

    /* A tighter limit changes the outcome: the replay reports OOMs. */
    ck_assert_msg(bfc_replay_run(ev, n, "memory_limit=1M,initial_region=1M", NULL, &r, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_uint_gt(r.ooms, 0);
    ck_assert_uint_le(r.peak_reserved, 1 * MiB);
    ck_assert_int_eq(bfc_replay_run(ev, n, "no_such_key=1", NULL, &r, err, sizeof err), -1);
    free(ev);
    free(ev2);
    tmp_teardown();
}
END_TEST

/* Two threads' batches written out of time order, as libshardbfc writes
 * them: thread 2's block lives across thread 1's whole batch.  File order
 * would show one block live at a time and a free before its allocation. */
static const char batches_csv[] =
    "Thread,Time,Action,Pointer,Size,Stream\n"
    "1,10,allocate,0x1000,1048576,0x0\n"
    "1,40,free,0x1000,1048576,0x0\n"
    "1,50,allocate,0x3000,1048576,0x0\n"
    "1,60,free,0x3000,1048576,0x0\n"
    "2,20,allocate,0x2000,2097152,0x0\n"
    "2,30,allocate,0x4000,1048576,0x0\n"
    "2,45,free,0x2000,2097152,0x0\n"
    "2,70,free,0x4000,1048576,0x0\n";

START_TEST(test_replay_order_shared)
{
    tmp_setup();
    char path[400];
    FILE *f = tmp_create(path, sizeof path, "batches.csv");
    fputs(batches_csv, f);
    fclose(f);

    /* The index order and the in-place sort agree, by time, ties kept. */
    bfc_trace_event_t *ev, *sorted;
    size_t n, ns;
    int was_sorted = -1;
    char err[300];
    read_trace(path, &ev, &n);
    ck_assert_uint_eq(n, 8);
    size_t order[8];
    ck_assert_int_eq(bfc_trace_order(ev, n, order), 1);
    ck_assert_msg(bfc_trace_csv_read_ordered(path, &sorted, &ns, &was_sorted, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(was_sorted, 1);
    ck_assert_uint_eq(ns, n);
    for (size_t i = 0; i < n; i++) {
        ck_assert_uint_eq(sorted[i].time_ns, ev[order[i]].time_ns);
        if (i)
            ck_assert_uint_le(sorted[i - 1].time_ns, sorted[i].time_ns);
    }
    ck_assert_uint_eq(sorted[1].ptr, 0x2000);

    /* Replayed in that order: 2 MiB + 1 MiB + 1 MiB live at t=30..40, and
     * every free matches an allocation. */
    bfc_replay_result_t r;
    ck_assert_msg(bfc_replay_run(ev, n, "memory_limit=64M", NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(r.peak_allocated, 4 * MiB);
    ck_assert_uint_eq(r.peak_requested, 4 * MiB);
    ck_assert_uint_eq(r.skipped, 0);
    ck_assert_uint_eq(r.unmatched_frees, 0);

    /* One thread's rows out of time order (an edited file): file order is
     * kept, and a free that comes before its allocation is unmatched. */
    ev[0].time_ns = 100; /* thread 1: 100, 40, ... */
    ck_assert_int_eq(bfc_trace_order(ev, n, order), 0);
    for (size_t i = 0; i < n; i++)
        ck_assert_uint_eq(order[i], i);
    bfc_trace_event_t swapped[8];
    memcpy(swapped, ev, sizeof swapped);
    swapped[0] = ev[1]; /* free 0x1000 first ... */
    swapped[1] = ev[0]; /* ... then its allocation: it stays live */
    ck_assert_msg(bfc_replay_run(swapped, n, "memory_limit=64M", NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(r.unmatched_frees, 1);
    ck_assert_uint_eq(r.skipped, 1);

    /* A free whose allocation failed in the replay is skipped but is not
     * unmatched: the trace itself is fine. */
    ck_assert_msg(bfc_replay_run(ev, n, "memory_limit=1M,initial_region=1M,large_alloc=0", NULL, &r, err,
                                 sizeof err) == 0,
                  "%s", err);
    ck_assert_uint_gt(r.ooms, 0);
    ck_assert_uint_eq(r.unmatched_frees, 0);
    ck_assert_uint_eq(r.skipped, r.ooms);

    /* A pointer allocated again while live (its free missing from the
     * trace) replaces the block, in the replay as in the peak of requested
     * bytes: freed first, so nothing stays live that the trace let go; a
     * free of a nil pointer frees nothing and is not unmatched. */
    bfc_trace_event_t dup[5];
    memset(dup, 0, sizeof dup);
    for (int i = 0; i < 5; i++) {
        dup[i].time_ns = (uint64_t)(i + 1);
        dup[i].thread = 1;
        dup[i].size = MiB;
        dup[i].action = i < 3 ? BFC_TRACE_ALLOC : BFC_TRACE_FREE;
        dup[i].ptr = i == 2 ? 0x200000 : 0x100000; /* A, A again, B; free A */
    }
    dup[4].ptr = 0; /* free(NULL) */
    ck_assert_msg(bfc_replay_run(dup, 5, "memory_limit=64M,vmm=off", NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(r.peak_requested, 2 * MiB);
    ck_assert_uint_eq(r.peak_allocated, 2 * MiB);
    ck_assert_uint_eq(r.replaced, 1);
    ck_assert_uint_eq(r.allocs, 3);
    ck_assert_uint_eq(r.frees, 2);
    ck_assert_uint_eq(r.skipped, 0);
    ck_assert_uint_eq(r.unmatched_frees, 0);
    free(ev);
    free(sorted);
    tmp_teardown();
}
END_TEST

/* --------------------------------------------------------------- view */

START_TEST(test_view_html)
{
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,initial_region=2M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *p = xalloc(ctx, a, 100000), *q = xalloc(ctx, b, 3 * MiB);
    char *json = NULL;
    size_t jlen = 0;
    FILE *f = open_memstream(&json, &jlen);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    fclose(f);
    char *html = NULL;
    size_t hlen = 0;
    char err[300];
    f = open_memstream(&html, &hlen);
    ck_assert_int_eq(bfc_view_write_html(json, jlen, "t<>&", f, err, sizeof err), 0);
    fclose(f);
    ck_assert(strncmp(html, "<!DOCTYPE html>", 15) == 0);
    ck_assert_ptr_nonnull(strstr(html, "<title>t&lt;&gt;&amp;</title>"));
    ck_assert_ptr_nonnull(strstr(html, "</html>"));
    /* Every region of the snapshot is in the page. */
    char *cp = NULL;
    json_object *v = json_canonical(json, jlen);
    const json_object *shards = array_of(v, "shards");
    size_t nreg = 0;
    for (size_t i = 0; i < bfc_json_len(shards); i++) {
        const json_object *regions = array_of(bfc_json_at(shards, i), "regions");
        for (size_t j = 0; j < bfc_json_len(regions); j++, nreg++) {
            char needle[64];
            snprintf(needle, sizeof needle, "\"base\":\"%s\"", bfc_json_str(bfc_json_at(regions, j), "base", "?"));
            ck_assert_msg(strstr(html, needle) != NULL, "page lacks region %s", needle);
        }
    }
    ck_assert_uint_eq(nreg, 2);
    json_object_put(v);
    /* Self-contained: no external resource. */
    ck_assert_ptr_null(strstr(html, "http://"));
    ck_assert_ptr_null(strstr(html, "https://"));
    ck_assert_ptr_null(strstr(html, "src="));
    ck_assert_ptr_null(strstr(html, "<link"));
    /* The page opens with the OOM report (when there is one): its element
     * comes after the title's and before the summary's. */
    const char *head_at = strstr(html, "<div id=\"head\">"), *oom_at = strstr(html, "<div id=\"oom\">"),
               *sum_at = strstr(html, "<div id=\"summary\">");
    ck_assert_msg(head_at && oom_at && sum_at && head_at < oom_at && oom_at < sum_at,
                  "the OOM report is not first on the page");
    free(html);
    (void)cp;

    /* A string that would close the script element is escaped. */
    const char *evil = "{\"version\":2,\"shards\":[],\"backend\":\"</script><script>alert(1)</script>\"}";
    html = NULL;
    f = open_memstream(&html, &hlen);
    ck_assert_int_eq(bfc_view_write_html(evil, strlen(evil), NULL, f, err, sizeof err), 0);
    fclose(f);
    ck_assert_ptr_null(strstr(html, "alert(1)</script>"));
    ck_assert_ptr_nonnull(strstr(html, "<\\/script><script>alert(1)<\\/script>"));
    free(html);

    /* Not JSON / not a snapshot: refused with a message. */
    html = NULL;
    f = open_memstream(&html, &hlen);
    ck_assert_int_eq(bfc_view_write_html("{\"shards\":[", 11, NULL, f, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "JSON"));
    ck_assert_int_eq(bfc_view_write_html("{\"x\":1}", 7, NULL, f, err, sizeof err), -1);
    ck_assert_ptr_nonnull(strstr(err, "snapshot"));
    /* Shaped wrong where the page's script walks it (it would stop on a
     * null shard or a number where an array belongs): refused, the place
     * named. */
    static const char *const wrong[][2] = {
        {"{\"shards\":[]}", "version"},
        {"{\"version\":0,\"shards\":[]}", "version"},
        {"{\"version\":2,\"shards\":[1,\"x\",null]}", "shards[0] is not an object"},
        {"{\"version\":2,\"shards\":[{},null]}", "shards[1] is not an object"},
        {"{\"version\":2,\"shards\":[{\"regions\":5}]}", "shards[0].regions is not an array"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"chunks\":[7]}]}]}", "shards[0].regions[0].chunks[0]"},
        {"{\"version\":2,\"shards\":[{\"stats\":[]}]}", "shards[0].stats is not an object"},
        {"{\"version\":2,\"shards\":[],\"totals\":3}", "\"totals\" is not an object"},
        {"{\"version\":2,\"shards\":[],\"oom\":{\"pool_spans\":{}}}", "oom.pool_spans is not an array"},
        /* the page orders regions by address, as numbers */
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"size\":1}]}]}", "shards[0].regions[0].base is not an address"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":\"0x10\"},{\"base\":\"zz\"}]}]}",
         "shards[0].regions[1].base is not an address"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":2.5}]}]}", "regions[0].base is not an address"},
        /* figures are unsigned integers: not printed as 0, refused */
        {"{\"version\":2,\"shards\":[],\"totals\":{\"bytes_in_use\":\"12\"}}",
         "totals.bytes_in_use is not a non-negative integer"},
        {"{\"version\":2,\"shards\":[],\"totals\":{\"peak_bytes_in_use_bound\":-5}}",
         "totals.peak_bytes_in_use_bound is not a non-negative integer"},
        {"{\"version\":2,\"shards\":[{\"stats\":{\"num_allocs\":1.5}}]}",
         "shards[0].stats.num_allocs is not a non-negative integer"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":\"0x10\",\"chunks\":[{\"size\":\"4k\"}]}]}]}",
         "shards[0].regions[0].chunks[0].size is not a non-negative integer"},
        {"{\"version\":2,\"shards\":[],\"oom\":{\"pool_spans\":[{\"size\":-1,\"fenced\":true}]}}",
         "oom.pool_spans[0].size is not a non-negative integer"},
        /* the device ordinal and allocation ids too (printed as 0 and as
         * "id 2" for -5 and 1.5) */
        {"{\"version\":2,\"device\":-5,\"shards\":[]}", "device is not a non-negative integer"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":\"0x10\",\"chunks\":[{\"allocation_id\":1.5}]}]}]}",
         "chunks[0].allocation_id is not an allocation id"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":\"0x10\",\"chunks\":[{\"allocation_id\":-5}]}]}]}",
         "chunks[0].allocation_id is not an allocation id"},
        {"{\"version\":2,\"shards\":[{\"regions\":[{\"base\":\"0x10\",\"chunks\":[{\"allocation_id\":"
         "9223372036854775808}]}]}]}",
         "chunks[0].allocation_id is not an allocation id"},
    };
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        ck_assert_int_eq(bfc_view_write_html(wrong[i][0], strlen(wrong[i][0]), NULL, f, err, sizeof err), -1);
        ck_assert_msg(strstr(err, wrong[i][1]), "%s: \"%s\" does not name %s", wrong[i][0], err, wrong[i][1]);
    }
    /* The same with every optional member at null or missing: a snapshot. */
    const char *bare = "{\"version\":2,\"shards\":[{\"regions\":null,\"stats\":{\"fragmentation\":0.25}}],"
                       "\"oom\":{\"pool_spans\":[{\"size\":256,\"fenced\":false}]},\"totals\":{\"bytes_in_use\":null}}";
    ck_assert_int_eq(bfc_view_write_html(bare, strlen(bare), NULL, f, err, sizeof err), 0);
    fclose(f);
    free(html);
    free(json);
    xfree(ctx, p, a);
    xfree(ctx, q, b);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* The page in a real browser, when Debian's chromium is installed (it is not
 * a build dependency; without it the suite leaves this test out and says
 * so): no script error, every region drawn, a screenshot that is not
 * blank. */
START_TEST(test_view_in_chromium)
{
    tmp_setup();
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,initial_region=2M");
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    void *p[40];
    for (int i = 0; i < 40; i++)
        p[i] = xalloc(ctx, i % 2 ? a : b, (size_t)(i + 1) * 20000);
    for (int i = 0; i < 40; i += 3)
        xfree(ctx, p[i], i % 2 ? a : b);
    char snap[400], page[400], shot[400], dom[400], prof[400], cmd[2000];
    tmp_path(snap, sizeof snap, "s.json");
    tmp_path(page, sizeof page, "page.html");
    tmp_path(shot, sizeof shot, "shot.png");
    tmp_path(dom, sizeof dom, "dom.html");
    tmp_path(prof, sizeof prof, "profile");
    FILE *f = fopen(snap, "w");
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    fclose(f);
    bfc_stats_t st = stats(ctx);
    size_t len;
    char *json = read_file(snap, &len), err[300];
    f = fopen(page, "w");
    ck_assert_int_eq(bfc_view_write_html(json, len, NULL, f, err, sizeof err), 0);
    fclose(f);
    free(json);
    const char *flags = "--headless=new --no-sandbox --disable-gpu --no-first-run --window-size=1200,800";
    snprintf(cmd, sizeof cmd, "timeout 60 chromium %s --user-data-dir='%s' --dump-dom 'file://%s' > '%s' 2>/dev/null",
             flags, prof, page, dom);
    ck_assert_int_eq(system(cmd), 0);
    char *d = read_file(dom, &len), want[128];
    ck_assert_ptr_nonnull(d);
    ck_assert_msg(strstr(d, "data-state=\"ok\"") != NULL, "page did not render: %.300s", d);
    snprintf(want, sizeof want, "%" PRIu64 " regions", st.num_regions);
    ck_assert_msg(strstr(d, want) != NULL, "page does not report %s", want);
    free(d);
    snprintf(cmd, sizeof cmd, "timeout 60 chromium %s --user-data-dir='%s' --screenshot='%s' 'file://%s' >/dev/null 2>&1",
             flags, prof, shot, page);
    ck_assert_int_eq(system(cmd), 0);
    struct stat sb;
    ck_assert_int_eq(stat(shot, &sb), 0);
    /* A blank 1200x800 PNG compresses to a few KiB; tables and bars do not. */
    ck_assert_int_gt(sb.st_size, 20000);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", prof);
    ck_assert_int_eq(system(cmd), 0);
    for (int i = 0; i < 40; i++)
        if (i % 3)
            xfree(ctx, p[i], i % 2 ? a : b);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* The page's own script, run by node when it is installed (not a build
 * dependency: without it the suite leaves this test out and says so) against a
 * minimal stand-in for the DOM: it must draw every part without a script
 * error, the OOM report first when the snapshot has one. */
static const char node_dom_js[] =
    "const fs = require('fs');\n"
    "const html = fs.readFileSync(process.argv[2], 'utf8');\n"
    "const json = /<script type=\"application\\/json\" id=\"snapshot\">([\\s\\S]*?)<\\/script>/.exec(html)[1];\n"
    "const code = /<\\/script>\\n<script>\\n([\\s\\S]*?)<\\/script>/.exec(html)[1];\n"
    "class Node {\n"
    "  constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.style = {};\n"
    "                     this.own = ''; this.className = ''; }\n"
    "  appendChild(c) { this.children.push(c); return c; }\n"
    "  setAttribute(k, v) { this.attrs[k] = String(v); }\n"
    "  addEventListener() {}\n"
    "  get textContent() { return this.own + this.children.map(c => ' ' + c.textContent).join(''); }\n"
    "  set textContent(v) { this.own = String(v); this.children = []; }\n"
    "  get offsetWidth() { return 0; }\n"
    "  get offsetHeight() { return 0; }\n"
    "}\n"
    "const ids = {};\n"
    "function byId(id) {\n"
    "  if (!ids[id]) { ids[id] = new Node('div'); if (id === 'snapshot') ids[id].own = json; }\n"
    "  return ids[id];\n"
    "}\n"
    "global.Node = Node;\n"
    "global.document = { getElementById: byId, createElement: t => new Node(t),\n"
    "                    createTextNode: t => { const n = new Node('#text'); n.own = String(t); return n; } };\n"
    "global.window = { addEventListener() {}, innerWidth: 1200, innerHeight: 800 };\n"
    "try { eval(code); } catch (e) { console.log('error=' + e.stack); }\n"
    "console.log('state=' + byId('status').attrs['data-state']);\n"
    "console.log('oom=' + byId('oom').textContent);\n"
    "console.log('summary=' + byId('summary').textContent);\n";

static char *render_in_node(bfc_ctx_t *ctx)
{
    char snap[400], page[400], js[400], out[400], cmd[1600];
    tmp_path(snap, sizeof snap, "n.json");
    tmp_path(page, sizeof page, "n.html");
    tmp_path(js, sizeof js, "dom.js");
    tmp_path(out, sizeof out, "n.out");
    FILE *f = fopen(snap, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    ck_assert_int_eq(fclose(f), 0);
    size_t len;
    char *json = read_file(snap, &len), err[300];
    f = fopen(page, "w");
    ck_assert_int_eq(bfc_view_write_html(json, len, NULL, f, err, sizeof err), 0);
    ck_assert_int_eq(fclose(f), 0);
    free(json);
    f = fopen(js, "w");
    ck_assert_int_eq(fputs(node_dom_js, f) >= 0, 1);
    ck_assert_int_eq(fclose(f), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 node '%s' '%s' > '%s' 2>&1", js, page, out);
    ck_assert_int_eq(system(cmd), 0);
    char *text = read_file(out, &len);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, "state=ok") && !strstr(text, "error="), "page script failed:\n%s", text);
    return text;
}

START_TEST(test_view_script_in_node)
{
    tmp_setup();
    bfc_stream_t a, b;
    void *pb;
    bfc_ctx_t *ctx = fragmented_pool(&a, &b, &pb);
    /* No failure yet: no OOM section. */
    char *text = render_in_node(ctx);
    ck_assert_msg(strstr(text, "oom=\n") != NULL, "%s", text);
    /* The context's peaks that are bounds are shown as bounds. */
    bfc_stats_t st = stats(ctx);
    char peak[64];
    snprintf(peak, sizeof peak, " \u2264 %.2f MiB", (double)st.peak_bytes_in_use / (double)MiB);
    ck_assert_msg(strstr(text, "peak allocated") && strstr(text, "peak requested") && strstr(text, peak) &&
                      strstr(text, "an upper bound"),
                  "%s\nlacks %s", text, peak);
    free(text);
    /* After one, the page opens with the report. */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 5 * MiB));
    bfc_oom_info_t i = oom_info(ctx, BFC_OOM_FRAGMENTED);
    text = render_in_node(ctx);
    ck_assert_msg(strstr(text, "Out of memory") && strstr(text, i.diagnosis), "%s", text);
    char want[64];
    snprintf(want, sizeof want, "0x%" PRIxPTR, (uintptr_t)b);
    ck_assert_msg(strstr(text, want) && strstr(text, "largest free piece") && strstr(text, "3.00 MiB"), "%s", text);
    /* Classic shards: exact figures, no bound mark in the shard table. */
    ck_assert_msg(!strstr(text, "\u2264 1.25 MiB"), "%s", text);
    free(text);
    xfree(ctx, pb, b);
    bfc_sim_stream_destroy(ctx, a);
    bfc_sim_stream_destroy(ctx, b);
    bfc_ctx_destroy(ctx);

    /* An expandable shard's free figures are bounds and its largest block
     * without a map is a column of its own (test_oom_report_shard_bounds_named's
     * failure: 8 MiB mapped, every other 1 MiB free, 2 MiB asked). */
    ctx = mkctx("memory_limit=8M,vmm=on");
    a = bfc_sim_stream_create(ctx);
    void *blk[8];
    for (int k = 0; k < 8; k++)
        blk[k] = xalloc(ctx, a, MiB);
    for (int k = 0; k < 8; k += 2)
        xfree(ctx, blk[k], a);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 2 * MiB));
    text = render_in_node(ctx);
    /* the row: free <= 4 MiB, largest free piece <= (a bound), largest
     * block without a map exactly 1 MiB, then pending 0 */
    ck_assert_msg(strstr(text, "largest block without a map") && strstr(text, "\u2264 4.00 MiB") &&
                      strstr(text, " 1.00 MiB 0 B"),
                  "%s", text);
    /* The report's own row marks the same figures as bounds: free in this
     * shard (4 MiB) and in other shards (none), not its largest (exact). */
    ck_assert_msg(strstr(text, "0 B \u2264 4.00 MiB 1.00 MiB \u2264 0 B \u2264 0 B"), "%s", text);
    free(text);
    for (int k = 1; k < 8; k += 2)
        xfree(ctx, blk[k], a);
    bfc_sim_stream_destroy(ctx, a);
    bfc_ctx_destroy(ctx);

    /* A retired shard is listed, and the count says so apart
     * (test_oom_report_retired_shard's failure). */
    ctx = mkctx("memory_limit=8M,garbage_collection=false");
    a = bfc_sim_stream_create(ctx);
    void *x1 = xalloc(ctx, a, 256 * KiB), *x3 = xalloc(ctx, a, 256 * KiB);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, a), BFC_OK);
    void *y = xalloc(ctx, a, 1000);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, a, 7 * MiB));
    text = render_in_node(ctx);
    ck_assert_msg(strstr(text, "Each shard at the failure (1, and 1 retired)"), "%s", text);
    /* Both shards have stream a: the retired column tells them apart (the
     * requesting one is not retired, the retired one is not requesting). */
    char req_row[96], ret_row[96];
    snprintf(req_row, sizeof req_row, " 0x%" PRIxPTR " yes  ", (uintptr_t)a);
    snprintf(ret_row, sizeof ret_row, " 0x%" PRIxPTR "  yes ", (uintptr_t)a);
    ck_assert_msg(strstr(text, "requesting retired free") && strstr(text, req_row) && strstr(text, ret_row), "%s",
                  text);
    free(text);
    xfree(ctx, x1, a);
    xfree(ctx, x3, a);
    xfree(ctx, y, a);
    bfc_sim_stream_destroy(ctx, a);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* ------------------------------------------------- application locale */

/*
 * A locale whose decimal point is a comma, as a German server that calls
 * setlocale(LC_ALL, "") has: de_DE.UTF-8 where the system has it, else
 * built by localedef (Debian's locales package) into a directory LOCPATH
 * then names.  NULL where neither works; main() leaves the test out then.
 */
static char comma_locale_dir[64];

/* glibc's newlocale keeps, unreferenced, the list it makes of LOCPATH's
 * directories (LeakSanitizer reports it): not ours, so its allocations are
 * not tracked. */
#ifdef BFC_TEST_ASAN
#include <sanitizer/lsan_interface.h>
#endif
static locale_t newlocale_untracked(const char *name)
{
#ifdef BFC_TEST_ASAN
    __lsan_disable();
#endif
    locale_t loc = newlocale(LC_ALL_MASK, name, (locale_t)0);
#ifdef BFC_TEST_ASAN
    __lsan_enable();
#endif
    return loc;
}

static locale_t comma_locale(void)
{
    locale_t loc = newlocale_untracked("de_DE.UTF-8");
    if (loc == (locale_t)0 && comma_locale_dir[0] == '\0') {
        char cmd[300];
        snprintf(comma_locale_dir, sizeof comma_locale_dir, "/tmp/shardbfc-locale-XXXXXX");
        if (!mkdtemp(comma_locale_dir)) {
            comma_locale_dir[0] = '\0';
            return (locale_t)0;
        }
        snprintf(cmd, sizeof cmd, "localedef -i de_DE -f UTF-8 '%s/de_DE.UTF-8' >/dev/null 2>&1",
                 comma_locale_dir);
        /* localedef exits 1 on warnings it still writes through; whether
         * the locale exists is newlocale's to say, below.  (Assigned, not
         * cast to void: glibc's fortified headers mark system() as
         * warn_unused_result, which a cast does not silence in GCC.) */
        int st = system(cmd);
        (void)st;
    }
    if (loc == (locale_t)0 && comma_locale_dir[0] != '\0') {
        /* LOCPATH only around this call: while it is set, every newlocale
         * leaks glibc's list of its directories -- json-c's, which parses
         * numbers under a "C" locale of its own, in every test. */
        setenv("LOCPATH", comma_locale_dir, 1);
        loc = newlocale_untracked("de_DE.UTF-8");
        unsetenv("LOCPATH");
    }
    if (loc != (locale_t)0) {
        locale_t old = uselocale(loc);
        char probe[16];
        snprintf(probe, sizeof probe, "%.1f", 0.5);
        uselocale(old);
        if (strcmp(probe, "0,5") != 0) {
            freelocale(loc);
            return (locale_t)0;
        }
    }
    return loc;
}

/* The snapshot (and so an oom_dump file) is JSON whatever the application's
 * LC_NUMERIC: its fractions were written with %f, which gave
 * "fragmentation":0,025025 under a German locale, and the OOM diagnosis's
 * sizes read "100,0 MiB". */
START_TEST(test_snapshot_in_comma_locale)
{
    tmp_setup();
    locale_t loc = comma_locale();
    ck_assert_msg(loc != (locale_t)0, "no locale with a decimal comma");
    bfc_ctx_t *ctx = mkctx("memory_limit=64M,vmm=off,initial_region=8M");
    void *p[10];
    for (int i = 0; i < 10; i++)
        p[i] = xalloc(ctx, NULL, 10000 * (size_t)(i + 1));
    for (int i = 0; i < 10; i += 2)
        xfree(ctx, p[i], NULL);
    char path[400];
    tmp_path(path, sizeof path, "locale.json");
    locale_t old = uselocale(loc);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 100 * MiB + MiB / 10)); /* too large: a report */
    bfc_oom_info_t info;
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, &info), BFC_OK);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    ck_assert_int_eq(fclose(f), 0);
    uselocale(old); /* json-c reads numbers with strtod, which follows it too */
    freelocale(loc);
    ck_assert_msg(strstr(info.diagnosis, "100.1 MiB") != NULL, "%s", info.diagnosis);
    size_t len;
    char *text = read_file(path, &len);
    ck_assert_ptr_nonnull(text);
    json_object *v = json_canonical(text, len);
    free(text);
    bfc_stats_t st = stats(ctx);
    ck_assert(bfc_stats_fragmentation(&st) > 0.0);
    assert_stats_equal(bfc_json_get(v, "totals"), &st, true);
    json_object_put(v);
    for (int i = 1; i < 10; i += 2)
        xfree(ctx, p[i], NULL);
    bfc_ctx_destroy(ctx);
    tmp_teardown();
}
END_TEST

/* The oracle of every snapshot above refuses what is not JSON -- json-c's
 * strict mode, and tools/json_read.c's checks of numbers and strings for
 * what that mode lets through -- and what json-c reads but would have
 * written otherwise (a raw control character, a lone surrogate): a writer
 * that wrote any of these fails json_canonical.  The lookups read exact
 * 64-bit integers and decoded strings. */
START_TEST(test_json_oracle_strict)
{
    char text[64], why[400];
    json_object *v;
    const char *bad[] = {"", "{", "[1,]", "{\"a\":1,}", "01", "1.", "-", "\"\\x\"", "\"a\nb\"", "nul",
                         "[1] 2", "{\"a\" 1}", "\"\\ud800\"", "NaN", "\"\\u0000\"",
                         /* accepted by json-c's strict mode itself (the last
                          * two are JSON, but not as json-c writes it): */
                         "{'a':1}", "[Infinity]", "[1e400]", "{\"a\":1,\"a\":2}", "{\"a\": 1}", "[-0]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text, "%s\n", bad[i]);
        ck_assert_msg(!canonical(text, strlen(text), &v, why, sizeof why), "the oracle accepted '%s'", bad[i]);
    }
    const char *fine = "{\"a\":[1,-3,0.250000,true,false,null,\"x\\\"y\"],\"b\":{},\"c\":[]}\n";
    ck_assert_msg(canonical(fine, strlen(fine), &v, why, sizeof why), "%s", why);
    json_object_put(v);

    const char *good = " {\"a\":[1,2.5e1,-3,true,false,null,\"\\u00e9\\ud83d\\ude00\\/\"],\"b\":{},"
                       "\"m\":-3,\"n\":18446744073709551615} ";
    ck_assert_msg(bfc_json_parse(good, strlen(good), &v, why, sizeof why) == 0, "%s", why);
    const json_object *a = array_of(v, "a");
    ck_assert_uint_eq(bfc_json_len(a), 7);
    ck_assert(json_object_get_double(bfc_json_at(a, 1)) == 25.0);
    ck_assert_uint_eq(bfc_json_u64(v, "m", 7), 7); /* negative: not a u64 */
    ck_assert_str_eq(json_object_get_string(bfc_json_at(a, 6)), "\xc3\xa9\xf0\x9f\x98\x80/");
    ck_assert_uint_eq(bfc_json_u64(v, "n", 0), UINT64_MAX);
    json_object_put(v);

    /* The tools' reader itself refuses what json-c's strict mode takes but
     * a browser's JSON.parse does not (the viewer's page would stop on it):
     * a single-quoted string, a raw tab or newline inside a string. */
    const char *lexical[] = {"{'a':1}", "[\"a\tb\"]", "[\"a\nb\"]", "{\"a\":'x'}",
                             /* and integers that json-c would clamp to 64 bits, silently */
                             "[18446744073709551616]", "{\"a\":99999999999999999999}", "[-9223372036854775809]"};
    for (size_t i = 0; i < sizeof lexical / sizeof lexical[0]; i++) {
        ck_assert_msg(bfc_json_parse(lexical[i], strlen(lexical[i]), &v, why, sizeof why) != 0,
                      "bfc_json_parse accepted '%s'", lexical[i]);
        ck_assert_ptr_null(v);
    }
    const char *edges = "[18446744073709551615,-9223372036854775808,1.8446744073709551616e19,\"99999999999999999999\"]";
    ck_assert_msg(bfc_json_parse(edges, strlen(edges), &v, why, sizeof why) == 0, "%s: %s", edges, why);
    json_object_put(v);
    const char *quoted = "[\"it's \\\"fine\\\"\\t\"]"; /* quotes and escapes inside a string */
    ck_assert_msg(bfc_json_parse(quoted, strlen(quoted), &v, why, sizeof why) == 0, "%s: %s", quoted, why);
    ck_assert_str_eq(json_object_get_string(bfc_json_at(v, 0)), "it's \"fine\"\t");
    json_object_put(v);
}
END_TEST

static Suite *obs_suite(void)
{
    Suite *s = suite_create("obs");
    TCase *tc = tcase_create("obs");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_fragmentation_formula);
    tcase_add_test(tc, test_fragmentation_live);
    tcase_add_test(tc, test_peaks_exact_or_bound);
    tcase_add_test(tc, test_snapshot_matches_stats);
    tcase_add_test(tc, test_oom_callback_args_and_no_retry);
    tcase_add_test(tc, test_oom_callback_frees_and_retry_succeeds);
    tcase_add_test(tc, test_oom_callback_nested);
    tcase_add_test(tc, test_oom_dump);
    tcase_add_test(tc, test_oom_dump_shared_path);
    tcase_add_test(tc, test_oom_dump_stale_tmp);
    tcase_add_test(tc, test_oom_dump_path_checked_at_create);
    tcase_add_test(tc, test_oom_dump_failure_said_once);
    tcase_add_test(tc, test_fenced_free_counted_when_issued);
    tcase_add_test(tc, test_oom_report_limit_and_too_large);
    tcase_add_test(tc, test_oom_report_fragmented);
    tcase_add_test(tc, test_oom_report_retired_shard);
    tcase_add_test(tc, test_too_large_counted_on_shard);
    tcase_add_test(tc, test_oom_report_rounding_overflow);
    tcase_add_test(tc, test_oom_report_shard_bounds_named);
    tcase_add_test(tc, test_oom_report_pool_spans);
    tcase_add_test(tc, test_oom_report_held_and_backend);
    tcase_add_test(tc, test_pool_fence_seen_complete);
    tcase_add_test(tc, test_departure_unfenced_when_unmapped);
    tcase_add_test(tc, test_oom_report_in_callback);
    tcase_add_test(tc, test_config_paths);
    tcase_add_test(tc, test_trace_round_trip);
    tcase_add_test(tc, test_trace_start_out_of_descriptors);
    tcase_add_test(tc, test_trace_vmm_departed);
    tcase_add_test(tc, test_trace_vmm_refused_release);
    tcase_add_test(tc, test_trace_threads);
    tcase_add_test(tc, test_trace_from_config);
    tcase_add_test(tc, test_rmm_csv_edge_cases);
    tcase_add_test(tc, test_csv_wide_marked_and_many_threads);
    tcase_add_test(tc, test_replay_reproduces_peaks_and_addresses);
    tcase_add_test(tc, test_replay_order_shared);
    tcase_add_test(tc, test_view_html);
    /* Tests that need a program the build does not: left out (and said
     * so) where it is missing, rather than passing without checking. */
    if (system("command -v chromium >/dev/null 2>&1") == 0)
        tcase_add_test(tc, test_view_in_chromium);
    else
        fprintf(stderr, "test_obs: SKIP test_view_in_chromium: chromium not installed\n");
    if (system("command -v node >/dev/null 2>&1") == 0)
        tcase_add_test(tc, test_view_script_in_node);
    else
        fprintf(stderr, "test_obs: SKIP test_view_script_in_node: node not installed\n");
    locale_t loc = comma_locale();
    if (loc != (locale_t)0) {
        freelocale(loc);
        tcase_add_test(tc, test_snapshot_in_comma_locale);
    } else {
        fprintf(stderr, "test_obs: SKIP test_snapshot_in_comma_locale: no de_DE.UTF-8 locale and "
                        "localedef could not build one (Debian package locales)\n");
    }
    tcase_add_test(tc, test_json_oracle_strict);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    int rc = run_suite(obs_suite());
    if (comma_locale_dir[0] != '\0') {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", comma_locale_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "test_obs: could not remove %s\n", comma_locale_dir);
    }
    return rc;
}
