/*
 * fuzz_ops.c -- a libFuzzer target: bytes decoded into a sequence of
 * allocator operations over several streams, each step checked against a
 * reference model.
 *
 * Input: 3 configuration bytes (limit, growth, garbage collection, large
 * allocations, first region size, split fraction, poison), then operations
 * of 3 bytes each (opcode, two arguments; a short tail reads as zeros):
 *   alloc on a stream (sizes from 0 to past the limit), free on the owner
 *   stream, free on another stream, record_stream, hold / drain a stream
 *   (the SIM controls that make a fence complete or not), trim, release a
 *   stream's shard, bad frees (interior pointers, second frees of old
 *   blocks, host addresses), stats and invariant check, and occasionally a
 *   switch to another configuration's context (from the next bytes).
 * Operations on several streams interleave as the steps of several threads
 * would, deterministically.
 *
 * The model holds every live block (address, size, owner stream, a tag
 * written into its first and last bytes) and every block freed under a
 * fence that has not completed: a block freed on another stream (or with
 * record_stream on a stream) while that stream was held may not be handed
 * out again before the stream is drained.  It also holds the guards of the
 * stream-safety rule, which covers every path on which memory leaves a
 * shard (a large block's region, release, reclaim, trim): a free of a block
 * on stream F leaves a guard on its requested range for F if F is held, and
 * for each stream named with record_stream that is held; draining X lifts
 * X's guards; an allocation on stream A may not overlap a live guard of any
 * stream but A (A itself may reuse what it freed, in its own order).
 * Checked after each step:
 *   - statuses: alloc NULL only with BFC_ENOMEM (or BFC_OK for 0 bytes) and
 *     always for more than the limit; frees of live blocks succeed; a bad
 *     free is BFC_ENOTOWNED / BFC_EDOUBLEFREE and changes no statistic;
 *   - a new block is 256-aligned and overlaps no live or fenced block, nor
 *     a live guard of another stream;
 *   - every live block keeps its tag bytes;
 *   - bfc_ctx_check passes; bytes_in_use, bytes_requested, num_allocs,
 *     num_frees equal the model's; nothing is pending when no stream is held;
 *   - with nothing live, nothing fenced, and no other stream held or
 *     guarding memory, half the limit can be allocated (memory that leaves
 *     a held stream's shard is fenced on that stream's work, so another
 *     stream may have to wait for it);
 *   - at the end every block is freed, nothing is pending and (growth mode)
 *     the SIM backend holds nothing after trim.
 * A violation prints what broke and aborts (libFuzzer records the input).
 *
 * Besides inputs found by fuzzing, the corpus holds a few made by hand, one
 * for each way memory leaves a shard while the stream that freed it is
 * still held: a large block's region (limit 64M, large_alloc 4M), a
 * released stream's shard (growth and reserved limits, also with
 * record_stream), and reclaim by another shard under a 4M limit.
 *
 * Built two ways: with clang -fsanitize=fuzzer,address by `make fuzz`, and
 * with the project's compiler together with replay.c (a main that runs the
 * corpus in tests/fuzz/corpus) as a `make check` test.
 */
#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define NS 5            /* four SIM streams and the default stream */
#define MAXLIVE 128
#define MAXFENCED 256
#define MAXGUARDS 256
#define NGHOSTS 8
#define TAGLEN 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail_dump(void);

#define REQUIRE(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_ops: %s:%d: %s: ", __FILE__, __LINE__, #cond);                   \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            fail_dump();                                                                           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

struct live {
    uintptr_t p;
    size_t n, asz;
    int owner;
    unsigned char tag;
    unsigned recorded; /* stream mask */
};

struct fenced {
    uintptr_t p;
    size_t size;
    unsigned need; /* streams that must be drained before reuse */
};

/* A freed block's requested range, out of bounds for every stream except
 * those in `streams` until they are all drained. */
struct guard {
    uintptr_t p;
    size_t n;
    unsigned streams; /* held streams that freed or recorded it */
};

static struct {
    bfc_ctx_t *ctx;
    bfc_config_t cfg;
    bfc_stream_t s[NS];
    unsigned held; /* stream mask */
    struct live live[MAXLIVE];
    int nlive;
    struct fenced fenced[MAXFENCED];
    int nfenced;
    struct guard guards[MAXGUARDS];
    int nguards;
    uintptr_t ghosts[NGHOSTS];
    int nghosts;
    uint64_t allocs, frees, bytes, req;
    uint64_t base_allocs, base_frees; /* the kept context's counts before this input */
} M;

static bfc_stream_t g_streams[NS - 1];
static void destroy_all(void);

/* What a failure report needs: the configuration, the model, the map. */
static void fail_dump(void)
{
    static bool busy;
    if (busy || !M.ctx)
        return;
    busy = true;
    fprintf(stderr, "config: limit %zu growth %d gc %d poison %d initial %zu large %zu fraction %g\n",
            M.cfg.memory_limit, M.cfg.allow_growth, M.cfg.garbage_collection, M.cfg.poison, M.cfg.initial_region,
            M.cfg.large_alloc, M.cfg.fragmentation_fraction);
    fprintf(stderr, "model: %d live (%llu bytes), %d fenced, %d guarded ranges, held %#x\n", M.nlive,
            (unsigned long long)M.bytes, M.nfenced, M.nguards, M.held);
    (void)bfc_ctx_dump(M.ctx, stderr);
}

/* SIM streams belong to the process (never reused once destroyed), so
 * they are made once and shared by every input's context. */
static void streams_once(void)
{
    if (g_streams[0])
        return;
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    bfc_ctx_t *ctx;
    REQUIRE(bfc_ctx_create(&c, &ctx) == BFC_OK, "bootstrap context");
    for (int i = 0; i < NS - 1; i++) {
        g_streams[i] = bfc_sim_stream_create(ctx);
        REQUIRE(g_streams[i] != NULL, "stream %d", i);
    }
    bfc_ctx_destroy(ctx);
    atexit(destroy_all);
}

/* --------------------------------------------------------------- input */

struct in {
    const uint8_t *d;
    size_t n, at;
};

static uint8_t byte(struct in *in)
{
    return in->at < in->n ? in->d[in->at++] : 0;
}

/* One of NCFG configurations, picked by 3 bytes.  Each configuration's
 * context is made once and kept across inputs (a context that has had
 * regions costs an RCU barrier to destroy, ~20 ms: it would cap the run at
 * a few inputs per second); every input leaves it empty, its streams'
 * shards released and its free regions trimmed, so the next input starts
 * from fresh shards. */
#define NCFG 64
static bfc_ctx_t *g_ctx[NCFG];

static int config_from(struct in *in, bfc_config_t *c)
{
    static const size_t limits[] = { 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB };
    static const size_t initial[] = { 256 * KiB, 1 * MiB, 2 * MiB, 3 * MiB + 256 };
    static const size_t large[] = { 0, 1 * MiB, 4 * MiB, 32 * MiB };
    static const double fractions[] = { 0, 0.01, 0.5, 1.0 };
    uint8_t a = byte(in), b = byte(in), d = byte(in);
    int idx = (a ^ b * 7 ^ d * 13) % NCFG;
    /* The configuration is a function of idx alone. */
    unsigned x = (unsigned)idx * 2654435761u;
    bfc_config_init(c);
    c->backend = BFC_BACKEND_SIM;
    c->memory_limit = limits[x >> 30];
    c->allow_growth = (x >> 29 & 1) == 0;
    c->garbage_collection = (x >> 28 & 1) != 0;
    c->poison = (x >> 27 & 1) != 0;
    c->initial_region = initial[x >> 25 & 3];
    c->large_alloc = large[x >> 23 & 3];
    c->fragmentation_fraction = fractions[x >> 21 & 3];
    if (!c->allow_growth && (x >> 20 & 1))
        c->initial_region = c->memory_limit;
    return idx;
}

static void destroy_all(void)
{
    for (int i = 0; i < NCFG; i++)
        if (g_ctx[i]) {
            bfc_ctx_destroy(g_ctx[i]);
            g_ctx[i] = NULL;
        }
}

/* ---------------------------------------------------------------- model */

static void tag_write(struct live *l)
{
    size_t k = l->n < TAGLEN ? l->n : TAGLEN;
    memset((void *)l->p, l->tag, k);
    memset((void *)(l->p + l->n - k), l->tag, k);
}

static void tag_check(const struct live *l)
{
    size_t k = l->n < TAGLEN ? l->n : TAGLEN;
    const unsigned char *m = (const unsigned char *)l->p;
    for (size_t i = 0; i < k; i++) {
        REQUIRE(m[i] == l->tag, "block %#lx (%zu): byte %zu is %#x, tag %#x", (unsigned long)l->p, l->n, i,
                m[i], l->tag);
        REQUIRE(m[l->n - 1 - i] == l->tag, "block %#lx (%zu): tail byte changed", (unsigned long)l->p, l->n);
    }
}

static bool overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn)
{
    return a < b + bn && b < a + an;
}

static int live_at(uintptr_t p)
{
    for (int i = 0; i < M.nlive; i++)
        if (M.live[i].p == p)
            return i;
    return -1;
}

static bool inside_live(uintptr_t p)
{
    for (int i = 0; i < M.nlive; i++)
        if (p >= M.live[i].p && p < M.live[i].p + M.live[i].asz)
            return true;
    return false;
}

static void ghost_add(uintptr_t p)
{
    if (M.nghosts < NGHOSTS)
        M.ghosts[M.nghosts++] = p;
    else
        M.ghosts[(M.frees) % NGHOSTS] = p;
}

/* The block of live entry i was freed on stream f: fenced on every held
 * stream among f (if not the owner) and its recorded streams. */
static void model_free(int i, int f)
{
    struct live *l = &M.live[i];
    unsigned fence = l->recorded;
    if (f != l->owner)
        fence |= 1u << f;
    fence &= ~(1u << l->owner);
    unsigned need = fence & M.held;
    if (need && M.nfenced < MAXFENCED)
        M.fenced[M.nfenced++] = (struct fenced){ l->p, l->asz, need };
    else if (need) {
        /* Model full: keep the oldest entries (stricter is not required). */
    }
    /* Guards: the freeing stream and the recorded ones (never the owner,
     * whose record is a no-op) that are held now.  Model full: dropped, as
     * above. */
    unsigned g = ((1u << f) | (l->recorded & ~(1u << l->owner))) & M.held;
    if (g && M.nguards < MAXGUARDS)
        M.guards[M.nguards++] = (struct guard){ l->p, l->n, g };
    M.frees++;
    M.bytes -= l->asz;
    M.req -= l->n;
    ghost_add(l->p);
    M.live[i] = M.live[--M.nlive];
}

static void model_drain(int k)
{
    for (int i = 0; i < M.nfenced;) {
        M.fenced[i].need &= ~(1u << k);
        if (!M.fenced[i].need)
            M.fenced[i] = M.fenced[--M.nfenced];
        else
            i++;
    }
    for (int i = 0; i < M.nguards;) {
        M.guards[i].streams &= ~(1u << k);
        if (!M.guards[i].streams)
            M.guards[i] = M.guards[--M.nguards];
        else
            i++;
    }
}

/* Whether a stream other than k guards memory or is held (memory leaving
 * its shard would carry an incomplete fence). */
static bool others_busy(int k)
{
    if (M.held & ~(1u << k))
        return true;
    for (int i = 0; i < M.nguards; i++)
        if (M.guards[i].streams & ~(1u << k))
            return true;
    return false;
}

static bfc_stats_t stats(void)
{
    bfc_stats_t s;
    REQUIRE(bfc_ctx_stats(M.ctx, &s) == BFC_OK, "stats");
    return s;
}

static void full_check(void)
{
    char buf[512] = "";
    REQUIRE(bfc_ctx_check_report(M.ctx, buf, sizeof buf) == BFC_OK, "%s", buf);
    bfc_stats_t s = stats();
    REQUIRE(s.bytes_in_use == M.bytes, "bytes_in_use %llu, model %llu", (unsigned long long)s.bytes_in_use,
            (unsigned long long)M.bytes);
    REQUIRE(s.bytes_requested == M.req, "bytes_requested %llu, model %llu",
            (unsigned long long)s.bytes_requested, (unsigned long long)M.req);
    REQUIRE(s.num_allocs - M.base_allocs == M.allocs && s.num_frees - M.base_frees == M.frees,
            "allocs %llu/%llu frees %llu/%llu", (unsigned long long)(s.num_allocs - M.base_allocs),
            (unsigned long long)M.allocs, (unsigned long long)(s.num_frees - M.base_frees),
            (unsigned long long)M.frees);
    REQUIRE(s.num_pending_frees >= (uint64_t)(M.nfenced > 0), "fenced blocks but nothing pending");
    if (M.held == 0)
        REQUIRE(s.num_pending_frees == 0, "%llu pending with no stream held",
                (unsigned long long)s.num_pending_frees);
    REQUIRE(s.num_poison_errors == 0, "poison errors");
    for (int i = 0; i < M.nlive; i++)
        tag_check(&M.live[i]);
}

/* ------------------------------------------------------------ operations */

static void op_alloc(int k, uint8_t a1, uint8_t a2)
{
    size_t n;
    switch (a1 >> 6) {
    case 0:
        n = ((size_t)(a1 & 63) << 8 | a2); /* 0 .. 16 KiB */
        break;
    case 1:
        n = ((size_t)(a1 & 63) << 8 | a2) * 16; /* .. 256 KiB */
        break;
    case 2:
        n = ((size_t)(a1 & 63) << 8 | a2) * 256 + 1; /* .. 4 MiB */
        break;
    default:
        n = a2 < 4 ? (a2 == 0 ? SIZE_MAX : a2 == 1 ? SIZE_MAX - 255 : M.cfg.memory_limit + a2)
                   : ((size_t)(a1 & 63) << 8 | a2) * 1024; /* .. 16 MiB */
        break;
    }
    if (M.nlive == MAXLIVE)
        return;
    void *p = bfc_ctx_alloc(M.ctx, M.s[k], n);
    int e = bfc_last_error();
    if (n == 0) {
        REQUIRE(p == NULL && e == BFC_OK, "alloc(0) = %p, %s", p, bfc_err_name(e));
        return;
    }
    size_t limit = M.cfg.memory_limit;
    if (n > limit) {
        REQUIRE(p == NULL && e == BFC_ENOMEM, "alloc(%zu) over the limit = %p, %s", n, p, bfc_err_name(e));
        return;
    }
    if (!p) {
        REQUIRE(e == BFC_ENOMEM, "alloc(%zu): %s", n, bfc_err_name(e));
        /* Nothing live, nothing fenced, no other stream busy: half the limit
         * must be servable. */
        REQUIRE(!(M.nlive == 0 && M.nfenced == 0 && !others_busy(k) && n <= limit / 2),
                "alloc(%zu) failed in an empty context", n);
        return;
    }
    REQUIRE(e == BFC_OK, "alloc ok but last_error %s", bfc_err_name(e));
    uintptr_t u = (uintptr_t)p;
    REQUIRE((u & 255) == 0, "alloc(%zu) = %p unaligned", n, p);
    size_t asz = bfc_ctx_allocated_size(M.ctx, p);
    REQUIRE(asz >= n && asz % 256 == 0, "allocated_size %zu for %zu", asz, n);
    REQUIRE(bfc_ctx_requested_size(M.ctx, p) == n, "requested_size");
    for (int i = 0; i < M.nlive; i++)
        REQUIRE(!overlaps(u, asz, M.live[i].p, M.live[i].asz), "alloc(%zu) = %p overlaps live %#lx+%zu", n, p,
                (unsigned long)M.live[i].p, M.live[i].asz);
    for (int i = 0; i < M.nfenced; i++)
        REQUIRE(!overlaps(u, asz, M.fenced[i].p, M.fenced[i].size),
                "alloc(%zu) = %p reuses %#lx+%zu before its fence (streams %#x) completed", n, p,
                (unsigned long)M.fenced[i].p, M.fenced[i].size, M.fenced[i].need);
    for (int i = 0; i < M.nguards; i++)
        REQUIRE(!(overlaps(u, n, M.guards[i].p, M.guards[i].n) && (M.guards[i].streams & ~(1u << k))),
                "alloc(%zu) on stream %d = %p overlaps %#lx+%zu, freed while streams %#x were held and not "
                "drained since (memory reached another stream too early)",
                n, k, p, (unsigned long)M.guards[i].p, M.guards[i].n, M.guards[i].streams);
    struct live *l = &M.live[M.nlive++];
    *l = (struct live){ u, n, asz, k, (unsigned char)(M.allocs * 37 + 1), 0 };
    tag_write(l);
    M.allocs++;
    M.bytes += asz;
    M.req += n;
}

static void op_free(uint8_t a1, int f, bool own)
{
    if (M.nlive == 0)
        return;
    int i = a1 % M.nlive;
    if (own)
        f = M.live[i].owner;
    tag_check(&M.live[i]);
    int rc = bfc_ctx_free(M.ctx, (void *)M.live[i].p, M.s[f]);
    REQUIRE(rc == BFC_OK, "free of a live block on stream %d: %s", f, bfc_err_name(rc));
    model_free(i, f);
}

static void op_record(uint8_t a1, int k)
{
    if (M.nlive == 0)
        return;
    int i = a1 % M.nlive;
    int rc = bfc_ctx_record_stream(M.ctx, (void *)M.live[i].p, M.s[k]);
    REQUIRE(rc == BFC_OK, "record_stream: %s", bfc_err_name(rc));
    M.live[i].recorded |= 1u << k;
}

static void op_bad_free(uint8_t a1, uint8_t a2, int f)
{
    bfc_stats_t before = stats();
    uintptr_t p = 0;
    int rc;
    switch (a1 % 4) {
    case 0: /* interior */
        if (M.nlive == 0)
            return;
        {
            struct live *l = &M.live[a2 % M.nlive];
            size_t off = (a1 & 4) ? 1 + (size_t)(a2 % 255) : 256 * (1 + (size_t)a2 % (l->asz / 256));
            if (off >= l->asz)
                return;
            p = l->p + off;
        }
        rc = bfc_ctx_free(M.ctx, (void *)p, M.s[f]);
        REQUIRE(rc == BFC_ENOTOWNED, "interior free %#lx: %s", (unsigned long)p, bfc_err_name(rc));
        break;
    case 1: /* an old block, unless its address is live again */
        if (M.nghosts == 0)
            return;
        p = M.ghosts[a2 % M.nghosts];
        if (live_at(p) >= 0)
            return;
        rc = bfc_ctx_free(M.ctx, (void *)p, M.s[f]);
        REQUIRE(rc == BFC_EDOUBLEFREE || rc == BFC_ENOTOWNED, "second free %#lx: %s", (unsigned long)p,
                bfc_err_name(rc));
        if (!inside_live(p))
            REQUIRE(bfc_ctx_record_stream(M.ctx, (void *)p, M.s[f]) != BFC_OK, "record_stream of a dead block");
        break;
    case 2: { /* host memory */
        void *h = malloc(512);
        REQUIRE(h != NULL, "malloc");
        rc = bfc_ctx_free(M.ctx, h, M.s[f]);
        free(h);
        REQUIRE(rc == BFC_ENOTOWNED, "heap free: %s", bfc_err_name(rc));
        break;
    }
    default: {
        char stack[256];
        void *volatile sp = stack;
        rc = bfc_ctx_free(M.ctx, sp, M.s[f]);
        REQUIRE(rc == BFC_ENOTOWNED, "stack free: %s", bfc_err_name(rc));
        break;
    }
    }
    bfc_stats_t after = stats();
    REQUIRE(memcmp(&before, &after, sizeof before) == 0, "a rejected free changed the statistics");
}

/* -------------------------------------------------------- context life */

static void ctx_open(int idx, const bfc_config_t *c)
{
    M.cfg = *c;
    if (!g_ctx[idx]) {
        int rc = bfc_ctx_create(c, &g_ctx[idx]);
        REQUIRE(rc == BFC_OK, "bfc_ctx_create: %s", bfc_err_name(rc));
    }
    M.ctx = g_ctx[idx];
    bfc_stats_t s = stats();
    REQUIRE(s.bytes_in_use == 0 && s.num_pending_frees == 0, "a kept context is not empty");
    M.base_allocs = s.num_allocs;
    M.base_frees = s.num_frees;
    M.allocs = M.frees = M.bytes = M.req = 0;
    M.nghosts = 0;
    for (int k = 0; k < NS; k++)
        bfc_sim_stream_drain(M.ctx, M.s[k]);
}

/* Drains everything, frees every block, checks nothing is left. */
static void ctx_close(void)
{
    for (int k = 0; k < NS; k++)
        bfc_sim_stream_drain(M.ctx, M.s[k]);
    M.held = 0;
    M.nfenced = 0;
    M.nguards = 0;
    while (M.nlive) {
        struct live *l = &M.live[M.nlive - 1];
        int f = (int)((l->p >> 8) % NS);
        tag_check(l);
        int rc = bfc_ctx_free(M.ctx, (void *)l->p, M.s[f]);
        REQUIRE(rc == BFC_OK, "final free: %s", bfc_err_name(rc));
        model_free(M.nlive - 1, f);
    }
    full_check();
    bfc_stats_t s = stats();
    REQUIRE(s.bytes_in_use == 0 && s.num_pending_frees == 0, "left over");
    for (int k = 0; k < NS; k++) {
        int rc = bfc_ctx_stream_release(M.ctx, M.s[k]);
        REQUIRE(rc == BFC_OK || rc == BFC_EINVAL, "release: %s", bfc_err_name(rc));
    }
    REQUIRE(bfc_ctx_trim(M.ctx) == BFC_OK, "trim");
    s = stats();
    REQUIRE(s.num_shards == 0 && s.num_regions == 0, "%llu shards, %llu regions left",
            (unsigned long long)s.num_shards, (unsigned long long)s.num_regions);
    if (M.cfg.allow_growth)
        REQUIRE(bfc_sim_backend_bytes_held(M.ctx) == 0, "backend still holds %llu bytes",
                (unsigned long long)bfc_sim_backend_bytes_held(M.ctx));
    full_check();
    M.ctx = NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    streams_once();
    struct in in = { data, size, 0 };
    bfc_config_t c;
    int idx = config_from(&in, &c);
    memset(&M, 0, sizeof M);
    for (int i = 0; i < NS - 1; i++)
        M.s[i] = g_streams[i];
    M.s[NS - 1] = NULL;
    ctx_open(idx, &c);
    int steps = 0;
    while (in.at < in.n && steps < 4096) {
        uint8_t op = byte(&in), a1 = byte(&in), a2 = byte(&in);
        int k = op >> 4 & 7;
        k %= NS;
        int k2 = (a2 >> 5) % NS;
        steps++;
        switch (op & 15) {
        case 0:
        case 1:
        case 2:
        case 3:
        case 4:
            op_alloc(k, a1, a2);
            break;
        case 5:
        case 6:
            op_free(a1, k, true);
            break;
        case 7:
        case 8:
            op_free(a1, k2, false);
            break;
        case 9:
            op_record(a1, k2);
            break;
        case 10:
            bfc_sim_stream_hold(M.ctx, M.s[k]);
            M.held |= 1u << k;
            break;
        case 11:
            bfc_sim_stream_drain(M.ctx, M.s[k]);
            M.held &= ~(1u << k);
            model_drain(k);
            break;
        case 12:
            REQUIRE(bfc_ctx_trim(M.ctx) == BFC_OK, "trim");
            break;
        case 13: {
            int rc = bfc_ctx_stream_release(M.ctx, M.s[k]);
            REQUIRE(rc == BFC_OK || rc == BFC_EINVAL, "release: %s", bfc_err_name(rc));
            break;
        }
        case 14:
            op_bad_free(a1, a2, k);
            break;
        default:
            if (a1 == 0xC5) {
                /* A new context with the configuration in the next bytes. */
                ctx_close();
                idx = config_from(&in, &c);
                ctx_open(idx, &c);
            }
            break;
        }
        full_check();
    }
    ctx_close();
    return 0;
}
