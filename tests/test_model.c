/*
 * test_model.c -- randomized model tests of one BFC arena (a context driven
 * from a single stream), through the public API only.
 *
 * Two kinds of model:
 *
 *  - The interval model (test_random_model): 10^6 random alloc/free
 *    operations per configuration against the set of live blocks.  Every
 *    allocation must be 256-aligned, report its requested size, an allocated
 *    size of at least the rounded request (and no more than the split rule
 *    allows), and a strictly increasing id; every 1000 operations no two live
 *    blocks may overlap, every live block must still hold the pattern written
 *    at allocation (first and last 64 bytes and four sampled words, derived
 *    from its allocation id; verified again at free), the statistics must
 *    equal the model's sums exactly, and bfc_ctx_check must pass.  A NULL
 *    return must come with BFC_ENOMEM and leave the model unchanged.
 *
 *  - The exact model (test_exact_model): in the TensorFlow configuration (one
 *    region of the whole limit), the BFC algorithm (src/arena.c) fixes every
 *    address.  A brute-force reimplementation (chunk list in address order,
 *    best fit with lowest address among equals, TensorFlow's split rule,
 *    coalescing with both neighbours) predicts the pointer, the allocated
 *    size and every OOM; chunk counts and free bytes are compared too.
 *
 * Seeds are fixed and printed with the operation index on any failure.
 * Hot-loop checks call ck_assert only on failure (Check's ck_assert records
 * a mark point per call, far too slow for millions of checks).
 */
#include "testutil.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* splitmix64: tiny, fast, and well mixed for deriving patterns from ids. */

/*
 * Sizes: mostly log-uniform over 256 B .. 1 MiB (a uniform octave, then
 * uniform inside it), some tiny (1..255), some odd sizes around powers of two.
 * `max_octave` caps the octave (20 = up to 1 MiB).
 */
static size_t pick_size(uint64_t *x, unsigned max_octave)
{
    uint64_t r = rng_next(x) % 100;
    unsigned span = max_octave - 8;
    if (r < 8)
        return 1 + (size_t)(rng_next(x) % 255);
    if (r < 14) {
        size_t b = (size_t)1 << (8 + rng_next(x) % span);
        switch (rng_next(x) % 4) {
        case 0: return b - 1;
        case 1: return b + 1;
        case 2: return b + 255;
        default: return b - 255;
        }
    }
    unsigned k = 8 + (unsigned)(rng_next(x) % span);
    return ((size_t)1 << k) + (size_t)(rng_next(x) % ((size_t)1 << k));
}

static void check_ctx(bfc_ctx_t *ctx, uint64_t seed, long op)
{
    char buf[1024];
    buf[0] = '\0';
    int rc = bfc_ctx_check_report(ctx, buf, sizeof buf);
    REQUIRE(rc == BFC_OK, "seed %#llx op %ld: bfc_ctx_check: %s: %s", (unsigned long long)seed, op,
            bfc_err_name(rc), buf);
}

static bfc_stats_t get_stats(bfc_ctx_t *ctx)
{
    bfc_stats_t s;
    memset(&s, 0xA5, sizeof s);
    int rc = bfc_ctx_stats(ctx, &s);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_stats: %s", bfc_err_name(rc));
    return s;
}

/* ================================================== interval model */

struct model_cfg {
    const char *name;
    size_t limit;
    bool growth;
    size_t initial_region;
    size_t large_alloc;
    bool gc;
    double frac;
    bool sim_stream;
    uint64_t seed;
    long ops;
    size_t target_live;
    bool trim;           /* call bfc_ctx_trim now and then */
    bool one_chunk_check;/* after freeing all: one chunk per region */
};

static const struct model_cfg model_cfgs[] = {
    /* Growing context, 256 MiB, default region schedule; default stream. */
    {"grow-256M", 256 * MiB, true, 2 * MiB, 32 * MiB, false, 0.0, false, 0x5EED0001ull, 1000000, 1000, false,
     true},
    /* TensorFlow's allow_growth=false: one 64 MiB region, OOMs frequent. */
    {"fixed-64M", 64 * MiB, false, 64 * MiB, 0, false, 0.0, false, 0x5EED0002ull, 1000000, 1000, false, true},
    /* Reservation carved into 2 MiB.. regions, large blocks >= 512 KiB, gc; a sim stream. */
    {"fixed-64M-pool", 64 * MiB, false, 2 * MiB, 512 * KiB, true, 0.0, true, 0x5EED0003ull, 300000, 600, false,
     false},
    /* Growing with gc, trims, fraction split rule, large blocks >= 768 KiB; a sim stream. */
    {"grow-64M-gc", 64 * MiB, true, 1 * MiB, 768 * KiB, true, 1.0 / 4096.0, true, 0x5EED0004ull, 300000, 400,
     true, false},
};
#define N_MODEL_CFGS ((int)(sizeof model_cfgs / sizeof model_cfgs[0]))

struct blk {
    unsigned char *p;
    size_t n;   /* requested */
    size_t asz; /* allocated */
    int64_t id;
};

static unsigned char pat(uint64_t h, size_t k)
{
    return (unsigned char)((h >> ((k & 7) * 8)) + (k >> 3) * 131u);
}

static uint64_t blk_hash(const struct blk *b, uint64_t seed)
{
    return mix64((uint64_t)b->id ^ seed ^ ((uint64_t)b->n << 40));
}

/* The bytes of a block that carry its pattern: first/last 64 and 4 words. */
static void blk_ranges(const struct blk *b, uint64_t h, size_t lo[6], size_t hi[6])
{
    size_t n = b->n;
    lo[0] = 0;
    hi[0] = n < 64 ? n : 64;
    lo[1] = n > 64 ? n - 64 : 0;
    hi[1] = n;
    for (int j = 0; j < 4; j++) {
        size_t o = (size_t)((h >> (j * 16)) % n);
        lo[2 + j] = o;
        hi[2 + j] = o + 8 < n ? o + 8 : n;
    }
}

static void blk_write(const struct blk *b, uint64_t seed)
{
    uint64_t h = blk_hash(b, seed);
    size_t lo[6], hi[6];
    blk_ranges(b, h, lo, hi);
    for (int r = 0; r < 6; r++)
        for (size_t k = lo[r]; k < hi[r]; k++)
            b->p[k] = pat(h, k);
}

/* Returns the first corrupted offset, or SIZE_MAX. */
static size_t blk_verify(const struct blk *b, uint64_t seed)
{
    uint64_t h = blk_hash(b, seed);
    size_t lo[6], hi[6];
    blk_ranges(b, h, lo, hi);
    for (int r = 0; r < 6; r++)
        for (size_t k = lo[r]; k < hi[r]; k++)
            if (b->p[k] != pat(h, k))
                return k;
    return SIZE_MAX;
}

static int cmp_blk_addr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const struct blk *)a)->p, y = (uintptr_t)((const struct blk *)b)->p;
    return x < y ? -1 : x > y;
}

struct model {
    struct blk *live;
    size_t nlive, cap;
    uint64_t allocs, frees, ooms;
    uint64_t in_use, requested, peak, peak_req;
    size_t max_n, max_asz;
    int64_t last_id;
};

static void model_checkpoint(bfc_ctx_t *ctx, const struct model_cfg *mc, struct model *m, long op,
                             struct blk *scratch)
{
    uint64_t seed = mc->seed;
    /* No two live blocks overlap. */
    memcpy(scratch, m->live, m->nlive * sizeof *scratch);
    qsort(scratch, m->nlive, sizeof *scratch, cmp_blk_addr);
    for (size_t i = 1; i < m->nlive; i++)
        REQUIRE((uintptr_t)scratch[i - 1].p + scratch[i - 1].asz <= (uintptr_t)scratch[i].p,
                "seed %#llx op %ld: %p (+%zu) overlaps %p", (unsigned long long)seed, op,
                (void *)scratch[i - 1].p, scratch[i - 1].asz, (void *)scratch[i].p);
    /* Contents survive. */
    for (size_t i = 0; i < m->nlive; i++) {
        size_t bad = blk_verify(&m->live[i], seed);
        REQUIRE(bad == SIZE_MAX, "seed %#llx op %ld: block %p (id %lld, %zu bytes) corrupted at +%zu",
                (unsigned long long)seed, op, (void *)m->live[i].p, (long long)m->live[i].id, m->live[i].n,
                bad);
    }
    /* Stats equal the model. */
    bfc_stats_t s = get_stats(ctx);
#define EQ(field, want)                                                                            \
    REQUIRE(s.field == (uint64_t)(want), "seed %#llx op %ld: stats." #field " = %llu, model %llu", \
            (unsigned long long)seed, op, (unsigned long long)s.field, (unsigned long long)(want))
    EQ(num_allocs, m->allocs);
    EQ(num_frees, m->frees);
    EQ(bytes_in_use, m->in_use);
    EQ(bytes_requested, m->requested);
    EQ(peak_bytes_in_use, m->peak);
    EQ(peak_bytes_requested, m->peak_req);
    EQ(num_ooms, m->ooms);
    EQ(bytes_limit, mc->limit);
    EQ(num_remote_frees, 0);
    EQ(num_pending_frees, 0);
    if (!mc->growth)
        EQ(bytes_reserved, mc->limit);
#undef EQ
    REQUIRE(s.bytes_reserved <= mc->limit && s.peak_bytes_reserved <= mc->limit,
            "seed %#llx op %ld: reserved %llu (peak %llu) over the limit %zu", (unsigned long long)seed, op,
            (unsigned long long)s.bytes_reserved, (unsigned long long)s.peak_bytes_reserved, mc->limit);
    REQUIRE(s.bytes_reserved >= s.bytes_in_use, "seed %#llx op %ld: reserved < in use", (unsigned long long)seed,
            op);
    REQUIRE(m->allocs == 0 || (s.largest_alloc_size >= m->max_n && s.largest_alloc_size <= m->max_asz),
            "seed %#llx op %ld: largest_alloc_size %llu outside [%zu, %zu]", (unsigned long long)seed, op,
            (unsigned long long)s.largest_alloc_size, m->max_n, m->max_asz);
    check_ctx(ctx, seed, op);
}

static void model_free(bfc_ctx_t *ctx, bfc_stream_t st, const struct model_cfg *mc, struct model *m, size_t k,
                       long op)
{
    struct blk b = m->live[k];
    size_t bad = blk_verify(&b, mc->seed);
    REQUIRE(bad == SIZE_MAX, "seed %#llx op %ld: block %p (id %lld, %zu bytes) corrupted at +%zu before free",
            (unsigned long long)mc->seed, op, (void *)b.p, (long long)b.id, b.n, bad);
    REQUIRE(bfc_ctx_allocation_id(ctx, b.p) == b.id, "seed %#llx op %ld: id of %p changed",
            (unsigned long long)mc->seed, op, (void *)b.p);
    int rc = bfc_ctx_free(ctx, b.p, st);
    REQUIRE(rc == BFC_OK, "seed %#llx op %ld: free(%p) = %s", (unsigned long long)mc->seed, op, (void *)b.p,
            bfc_err_name(rc));
    REQUIRE(bfc_ctx_allocation_id(ctx, b.p) < 0 && bfc_ctx_requested_size(ctx, b.p) == 0,
            "seed %#llx op %ld: %p still live after free", (unsigned long long)mc->seed, op, (void *)b.p);
    m->live[k] = m->live[--m->nlive];
    m->frees++;
    m->in_use -= b.asz;
    m->requested -= b.n;
}

static void model_alloc(bfc_ctx_t *ctx, bfc_stream_t st, const struct model_cfg *mc, struct model *m, size_t n,
                        long op)
{
    uint64_t seed = mc->seed;
    void *p = bfc_ctx_alloc(ctx, st, n);
    if (p == NULL) {
        REQUIRE(bfc_last_error() == BFC_ENOMEM, "seed %#llx op %ld: alloc(%zu) = NULL with %s",
                (unsigned long long)seed, op, n, bfc_err_name(bfc_last_error()));
        m->ooms++;
        return;
    }
    REQUIRE(((uintptr_t)p & 255) == 0, "seed %#llx op %ld: alloc(%zu) = %p unaligned", (unsigned long long)seed,
            op, n, p);
    REQUIRE(bfc_last_error() == BFC_OK, "seed %#llx op %ld: last_error %s after success",
            (unsigned long long)seed, op, bfc_err_name(bfc_last_error()));
    struct blk b = {p, n, bfc_ctx_allocated_size(ctx, p), bfc_ctx_allocation_id(ctx, p)};
    size_t rn = r256(n);
    REQUIRE(bfc_ctx_requested_size(ctx, p) == n, "seed %#llx op %ld: requested_size %zu != %zu",
            (unsigned long long)seed, op, bfc_ctx_requested_size(ctx, p), n);
    REQUIRE(b.asz >= rn && b.asz % 256 == 0, "seed %#llx op %ld: alloc(%zu): allocated_size %zu",
            (unsigned long long)seed, op, n, b.asz);
    if (mc->large_alloc == 0 || rn < mc->large_alloc) {
        /* A chunk the split rule would have cut must have been cut.  (Large
         * blocks live in regions of their own, rounded to 2 MiB; whether
         * "large" is judged on n or on the rounded size is not pinned down,
         * so both are left out.) */
        size_t maxfrag = mc->frac > 0 ? (size_t)(mc->frac * (double)mc->limit) : 128 * MiB;
        REQUIRE(b.asz == rn || (b.asz < 2 * rn && b.asz - rn < maxfrag),
                "seed %#llx op %ld: alloc(%zu): allocated_size %zu should have been split",
                (unsigned long long)seed, op, n, b.asz);
    }
    REQUIRE(b.id > m->last_id, "seed %#llx op %ld: allocation id %lld not above %lld", (unsigned long long)seed,
            op, (long long)b.id, (long long)m->last_id);
    m->last_id = b.id;
    blk_write(&b, seed);
    if (m->nlive == m->cap) {
        m->cap = m->cap ? 2 * m->cap : 1024;
        m->live = realloc(m->live, m->cap * sizeof *m->live);
        ck_assert_ptr_nonnull(m->live);
    }
    m->live[m->nlive++] = b;
    m->allocs++;
    m->in_use += b.asz;
    m->requested += n;
    if (m->in_use > m->peak)
        m->peak = m->in_use;
    if (m->requested > m->peak_req)
        m->peak_req = m->requested;
    if (n > m->max_n)
        m->max_n = n;
    if (b.asz > m->max_asz)
        m->max_asz = b.asz;
}

START_TEST(test_random_model)
{
    const struct model_cfg *mc = &model_cfgs[_i];
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = mc->limit;
    c.allow_growth = mc->growth;
    c.initial_region = mc->initial_region;
    c.large_alloc = mc->large_alloc;
    c.garbage_collection = mc->gc;
    c.fragmentation_fraction = mc->frac;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t st = NULL;
    if (mc->sim_stream) {
        st = bfc_sim_stream_create(ctx);
        ck_assert_ptr_nonnull(st);
    }
    struct model m;
    memset(&m, 0, sizeof m);
    m.last_id = -1;
    struct blk *scratch = NULL;
    size_t scratch_cap = 0;
    uint64_t x = mc->seed;
    const long phase = mc->ops / 4;

    for (long op = 0; op < mc->ops; op++) {
        bool alloc;
        if (m.nlive == 0)
            alloc = true;
        else
            alloc = rng_next(&x) % 100 < (m.nlive < mc->target_live ? 60u : 40u);
        if (alloc)
            model_alloc(ctx, st, mc, &m, pick_size(&x, 20), op);
        else
            model_free(ctx, st, mc, &m, (size_t)(rng_next(&x) % m.nlive), op);

        if ((op + 1) % 1000 == 0) {
            if (scratch_cap < m.cap) {
                scratch_cap = m.cap;
                scratch = realloc(scratch, scratch_cap * sizeof *scratch);
                ck_assert_ptr_nonnull(scratch);
            }
            if (mc->trim && rng_next(&x) % 4 == 0)
                REQUIRE(bfc_ctx_trim(ctx) == BFC_OK, "seed %#llx op %ld: trim failed",
                        (unsigned long long)mc->seed, op);
            model_checkpoint(ctx, mc, &m, op, scratch);
        }
        if ((op + 1) % phase == 0) {
            /* Drain completely: everything coalesces back. */
            while (m.nlive > 0)
                model_free(ctx, st, mc, &m, (size_t)(rng_next(&x) % m.nlive), op);
            bfc_stats_t s = get_stats(ctx);
            REQUIRE(s.bytes_in_use == 0 && s.bytes_requested == 0,
                    "seed %#llx op %ld: %llu bytes in use after freeing all", (unsigned long long)mc->seed, op,
                    (unsigned long long)s.bytes_in_use);
            if (mc->one_chunk_check)
                REQUIRE(s.num_chunks == s.num_regions,
                        "seed %#llx op %ld: %llu chunks in %llu regions after freeing all",
                        (unsigned long long)mc->seed, op, (unsigned long long)s.num_chunks,
                        (unsigned long long)s.num_regions);
            if (!mc->growth && mc->large_alloc == 0 && mc->initial_region == mc->limit) {
                /* One region of the whole limit, whole again. */
                void *all = bfc_ctx_alloc(ctx, st, mc->limit);
                REQUIRE(all != NULL, "seed %#llx op %ld: the whole limit is not allocatable after freeing all",
                        (unsigned long long)mc->seed, op);
                struct blk b = {all, mc->limit, bfc_ctx_allocated_size(ctx, all), bfc_ctx_allocation_id(ctx, all)};
                REQUIRE(b.id > m.last_id, "seed %#llx op %ld: id not increasing", (unsigned long long)mc->seed,
                        op);
                m.last_id = b.id;
                m.allocs++;
                if (mc->limit > m.peak)
                    m.peak = mc->limit;
                if (mc->limit > m.peak_req)
                    m.peak_req = mc->limit;
                if (mc->limit > m.max_n)
                    m.max_n = m.max_asz = mc->limit;
                REQUIRE(bfc_ctx_free(ctx, all, st) == BFC_OK, "free of the whole limit failed");
                m.frees++;
            }
            check_ctx(ctx, mc->seed, op);
        }
    }
    while (m.nlive > 0)
        model_free(ctx, st, mc, &m, m.nlive - 1, mc->ops);
    if (scratch == NULL) {
        scratch = malloc(sizeof *scratch);
        ck_assert_ptr_nonnull(scratch);
    }
    model_checkpoint(ctx, mc, &m, mc->ops, scratch);
    /* OOMs must have been exercised where the configuration forces them. */
    if (!mc->growth && mc->large_alloc == 0)
        ck_assert_msg(m.ooms > 0, "config %s never ran out of memory", mc->name);
    ck_assert_uint_gt(m.allocs, (uint64_t)mc->ops / 3);
    free(scratch);
    free(m.live);
    if (st != NULL)
        bfc_sim_stream_destroy(ctx, st);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ===================================================== exact model */

struct exact_cfg {
    size_t limit;
    double frac;
    bool sim_stream;
    uint64_t seed;
    long ops;
    size_t target_live;
};

static const struct exact_cfg exact_cfgs[] = {
    {16 * MiB, 0.0, false, 0xE1AC7001ull, 200000, 150},
    {16 * MiB, 1.0 / 16384.0, true, 0xE1AC7002ull, 200000, 150}, /* max fragmentation 1 KiB */
    {4 * MiB, 0.0, false, 0xE1AC7003ull, 200000, 120},           /* tight: many OOMs */
};
#define N_EXACT_CFGS ((int)(sizeof exact_cfgs / sizeof exact_cfgs[0]))

/* The arena's chunks, in address order, as offsets from the region start. */
struct xchunks {
    size_t *off, *size;
    unsigned char *used;
    size_t n, cap;
};

static void xc_insert(struct xchunks *c, size_t i, size_t off, size_t size, unsigned char used)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 1024;
        c->off = realloc(c->off, c->cap * sizeof *c->off);
        c->size = realloc(c->size, c->cap * sizeof *c->size);
        c->used = realloc(c->used, c->cap);
        ck_assert(c->off && c->size && c->used);
    }
    memmove(&c->off[i + 1], &c->off[i], (c->n - i) * sizeof *c->off);
    memmove(&c->size[i + 1], &c->size[i], (c->n - i) * sizeof *c->size);
    memmove(&c->used[i + 1], &c->used[i], c->n - i);
    c->off[i] = off;
    c->size[i] = size;
    c->used[i] = used;
    c->n++;
}

static void xc_remove(struct xchunks *c, size_t i)
{
    memmove(&c->off[i], &c->off[i + 1], (c->n - i - 1) * sizeof *c->off);
    memmove(&c->size[i], &c->size[i + 1], (c->n - i - 1) * sizeof *c->size);
    memmove(&c->used[i], &c->used[i + 1], c->n - i - 1);
    c->n--;
}

static size_t xc_find(const struct xchunks *c, size_t off)
{
    size_t lo = 0, hi = c->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c->off[mid] < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->n && c->off[lo] == off ? lo : SIZE_MAX;
}

START_TEST(test_exact_model)
{
    const struct exact_cfg *ec = &exact_cfgs[_i];
    const uint64_t seed = ec->seed;
    const size_t maxfrag = ec->frac > 0 ? (size_t)(ec->frac * (double)ec->limit) : 128 * MiB;
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = ec->limit;
    c.allow_growth = false;
    c.initial_region = ec->limit;
    c.large_alloc = 0;
    c.fragmentation_fraction = ec->frac;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t st = NULL;
    if (ec->sim_stream) {
        st = bfc_sim_stream_create(ctx);
        ck_assert_ptr_nonnull(st);
    }
    struct xchunks ch;
    memset(&ch, 0, sizeof ch);
    xc_insert(&ch, 0, 0, ec->limit, 0);
    uintptr_t base = 0;
    size_t *live = malloc(4096 * sizeof *live), nlive = 0, cap = 4096;
    ck_assert_ptr_nonnull(live);
    uint64_t x = seed, ooms = 0, allocs = 0, in_use = 0;

    for (long op = 0; op < ec->ops; op++) {
        bool alloc = nlive == 0 || rng_next(&x) % 100 < (nlive < ec->target_live ? 60u : 40u);
        if (alloc) {
            size_t n = pick_size(&x, 18); /* up to 256 KiB */
            size_t rn = r256(n), best = SIZE_MAX;
            for (size_t i = 0; i < ch.n; i++)
                if (!ch.used[i] && ch.size[i] >= rn && (best == SIZE_MAX || ch.size[i] < ch.size[best]))
                    best = i;
            void *p = bfc_ctx_alloc(ctx, st, n);
            if (best == SIZE_MAX) {
                REQUIRE(p == NULL && bfc_last_error() == BFC_ENOMEM,
                        "seed %#llx op %ld: alloc(%zu) = %p (%s), the model has no chunk for it",
                        (unsigned long long)seed, op, n, p, bfc_err_name(bfc_last_error()));
                ooms++;
            } else {
                if (base == 0) {
                    REQUIRE(p != NULL, "seed %#llx op %ld: first alloc(%zu) failed", (unsigned long long)seed, op, n);
                    base = (uintptr_t)p;
                }
                bool split = ch.size[best] >= 2 * rn || ch.size[best] - rn >= maxfrag;
                size_t want = split ? rn : ch.size[best];
                REQUIRE(p == (void *)(base + ch.off[best]) && bfc_ctx_allocated_size(ctx, p) == want,
                        "seed %#llx op %ld: alloc(%zu) = %p (size %zu), the model says +%zu = %p (size %zu)",
                        (unsigned long long)seed, op, n, p, bfc_ctx_allocated_size(ctx, p), ch.off[best],
                        (void *)(base + ch.off[best]), want);
                if (split) {
                    xc_insert(&ch, best + 1, ch.off[best] + rn, ch.size[best] - rn, 0);
                    ch.size[best] = rn;
                }
                ch.used[best] = 1;
                in_use += want;
                allocs++;
                if (nlive == cap) {
                    cap *= 2;
                    live = realloc(live, cap * sizeof *live);
                    ck_assert_ptr_nonnull(live);
                }
                live[nlive++] = ch.off[best];
            }
        } else {
            size_t k = (size_t)(rng_next(&x) % nlive), off = live[k];
            live[k] = live[--nlive];
            int rc = bfc_ctx_free(ctx, (void *)(base + off), st);
            REQUIRE(rc == BFC_OK, "seed %#llx op %ld: free(+%zu) = %s", (unsigned long long)seed, op, off,
                    bfc_err_name(rc));
            size_t i = xc_find(&ch, off);
            ck_assert_uint_ne(i, SIZE_MAX);
            in_use -= ch.size[i];
            ch.used[i] = 0;
            if (i + 1 < ch.n && !ch.used[i + 1]) {
                ch.size[i] += ch.size[i + 1];
                xc_remove(&ch, i + 1);
            }
            if (i > 0 && !ch.used[i - 1]) {
                ch.size[i - 1] += ch.size[i];
                xc_remove(&ch, i);
            }
        }
        if ((op + 1) % 1000 == 0) {
            bfc_stats_t s = get_stats(ctx);
            size_t free_bytes = 0, largest = 0;
            for (size_t i = 0; i < ch.n; i++)
                if (!ch.used[i]) {
                    free_bytes += ch.size[i];
                    largest = ch.size[i] > largest ? ch.size[i] : largest;
                }
            REQUIRE(s.bytes_in_use == in_use && s.bytes_free == free_bytes && s.largest_free_chunk == largest &&
                        s.num_chunks == ch.n && s.num_allocs == allocs && s.num_ooms == ooms,
                    "seed %#llx op %ld: stats in_use %llu free %llu largest %llu chunks %llu allocs %llu ooms "
                    "%llu; model %zu %zu %zu %zu %llu %llu",
                    (unsigned long long)seed, op, (unsigned long long)s.bytes_in_use,
                    (unsigned long long)s.bytes_free, (unsigned long long)s.largest_free_chunk,
                    (unsigned long long)s.num_chunks, (unsigned long long)s.num_allocs,
                    (unsigned long long)s.num_ooms, (size_t)in_use, free_bytes, largest, ch.n,
                    (unsigned long long)allocs, (unsigned long long)ooms);
            check_ctx(ctx, seed, op);
        }
    }
    ck_assert_uint_gt(allocs, (uint64_t)ec->ops / 3);
    while (nlive > 0)
        ck_assert_int_eq(bfc_ctx_free(ctx, (void *)(base + live[--nlive]), st), BFC_OK);
    bfc_stats_t s = get_stats(ctx);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(s.num_chunks, 1);
    ck_assert_uint_eq(s.largest_free_chunk, ec->limit);
    check_ctx(ctx, seed, ec->ops);
    free(live);
    free(ch.off);
    free(ch.size);
    free(ch.used);
    if (st != NULL)
        bfc_sim_stream_destroy(ctx, st);
    bfc_ctx_destroy(ctx);
}
END_TEST

static Suite *model_suite(void)
{
    Suite *s = suite_create("arena_model");
    TCase *tc = tcase_create("interval_model");
    /* Explicit, so that CK_DEFAULT_TIMEOUT cannot shorten it. */
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_random_model, 0, N_MODEL_CFGS);
    suite_add_tcase(s, tc);
    tc = tcase_create("exact_model");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_exact_model, 0, N_EXACT_CFGS);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return run_suite(model_suite());
}
