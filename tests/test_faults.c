/*
 * test_faults.c -- the allocator under injected device faults (SIM backend).
 *
 * Four switches of shardbfc_sim.h: every Nth device allocation fails, every
 * Nth event record/query fails, device allocations succeed only below a
 * ceiling (here: one that keeps shrinking), every Nth allocation of the
 * library's own metadata fails (chunk and region records, pool spans, fence
 * records, shard creation).  Under each, a randomized
 * workload over four streams (fixed seeds: allocations of many sizes,
 * same- and cross-stream frees, record_stream, held and drained streams,
 * stream release, trim) keeps running and the test requires:
 *   - a failed allocation says BFC_ENOMEM (or BFC_EBACKEND), nothing else;
 *   - a failed free says BFC_EBACKEND and only when its event could not be
 *     recorded on a held stream (src/remote.c: the fallback synchronisation
 *     fails too), and the block is then still allocated, intact, freeable
 *     later;
 *   - bfc_ctx_check passes and the statistics match the model (live bytes,
 *     allocation and free counts) at every checkpoint;
 *   - no leak: when the fault stops, every block is freed, nothing is
 *     pending, bytes_in_use is 0 and after bfc_ctx_trim the SIM backend holds
 *     no memory (bfc_sim_backend_bytes_held);
 *   - once the fault stops the allocator serves again.
 * A threaded variant runs two workloads on one context at once.
 */
#include "testutil.h"
#include "clockfail.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ------------------------------------------------------------ helpers */

static bfc_config_t cfg_sim(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = limit;
    c.initial_region = 1 * MiB;
    c.large_alloc = 2 * MiB;
    return c;
}

static uint64_t rnd(uint64_t *x)
{
    /* xorshift64*: fixed seeds make every run the same sequence. */
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return *x * 0x2545F4914F6CDD1Dull;
}

/* ----------------------------------------------------------- workload */

/* Check's assertions are not thread-safe: a workload sharing the context
 * with another thread reports a failure on stderr and aborts instead. */
#define REQ(w, cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            if ((w)->shared) {                                                                     \
                fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                    \
                fprintf(stderr, __VA_ARGS__);                                                      \
                fputc('\n', stderr);                                                               \
                abort();                                                                           \
            }                                                                                      \
            ck_abort_msg(__VA_ARGS__);                                                             \
        }                                                                                          \
    } while (0)

#define NSTREAMS 4
#define MAXLIVE 256

struct blk {
    unsigned char *p;
    size_t n, asz;
    int owner;
    unsigned char tag;
};

struct wl {
    bfc_ctx_t *ctx;
    bfc_stream_t s[NSTREAMS];
    bool held[NSTREAMS];
    struct blk live[MAXLIVE];
    int nlive;
    uint64_t seed;
    bool shared;          /* another workload runs on ctx: no global stats checks */
    /* model counters */
    uint64_t allocs, frees, live_bytes, live_req;
    /* outcomes */
    uint64_t ok_allocs, enomem, ebackend_alloc, ebackend_free, enomem_free, ebackend_rec, enomem_rec, releases;
};

static void fill(struct blk *b)
{
    size_t k = b->n < 512 ? b->n : 512;
    memset(b->p, b->tag, k);
    memset(b->p + b->n - k, b->tag, k);
}

static void verify(const struct wl *w, const struct blk *b)
{
    size_t k = b->n < 512 ? b->n : 512;
    size_t bad = k;
    for (size_t i = 0; i < k && bad == k; i++)
        if (b->p[i] != b->tag || b->p[b->n - 1 - i] != b->tag)
            bad = i;
    REQ(w, bad == k, "block %p (%zu): byte %zu (or %zu from the end) changed", (void *)b->p, b->n, bad, bad);
}

static size_t pick_size(uint64_t r)
{
    switch (r % 16) {
    case 0:
        return (size_t)(r >> 8) % (4 * MiB) + 1; /* some large (own region) */
    case 1:
    case 2:
        return (size_t)(r >> 8) % (512 * KiB) + 1;
    default:
        return (size_t)(r >> 8) % (16 * KiB) + 1;
    }
}

static void remove_at(struct wl *w, int i)
{
    w->live_bytes -= w->live[i].asz;
    w->live_req -= w->live[i].n;
    w->live[i] = w->live[--w->nlive];
}

/* Frees live block i on stream f; returns the status. */
static int wl_free(struct wl *w, int i, int f)
{
    struct blk *b = &w->live[i];
    verify(w, b);
    int rc = bfc_ctx_free(w->ctx, b->p, w->s[f]);
    if (rc == BFC_OK) {
        w->frees++;
        remove_at(w, i);
        return rc;
    }
    /* Only a cross-stream free whose event failed and whose stream could
     * not be synchronised (held) may fail -- or a fence record that could
     * not be allocated.  The block stays allocated, untouched. */
    REQ(w, rc == BFC_EBACKEND || rc == BFC_ENOMEM, "free: %s", bfc_err_name(rc));
    if (rc == BFC_EBACKEND) {
        REQ(w, f != b->owner && w->held[f], "EBACKEND from a free on an idle or owner stream");
        w->ebackend_free++;
    } else {
        w->enomem_free++;
    }
    REQ(w, bfc_ctx_requested_size(w->ctx, b->p) == b->n, "requested_size changed");
    REQ(w, bfc_ctx_allocated_size(w->ctx, b->p) == b->asz, "allocated_size changed");
    verify(w, b);
    return rc;
}

/* With other threads working on the context, bfc_ctx_check must still see
 * one consistent state (it holds every lock of the context while it
 * compares shards, pool and region map); the full stats comparison below
 * needs a quiescent context. */
static void wl_checkpoint(struct wl *w)
{
    if (w->shared) {
        char buf[512] = "";
        REQ(w, bfc_ctx_check_report(w->ctx, buf, sizeof buf) == BFC_OK, "concurrent check: %s", buf);
        return;
    }
    xcheck(w->ctx);
    bfc_stats_t s = st(w->ctx);
    ck_assert_uint_eq(s.bytes_in_use, w->live_bytes);
    ck_assert_uint_eq(s.bytes_requested, w->live_req);
    ck_assert_uint_eq(s.num_allocs, w->allocs);
    ck_assert_uint_eq(s.num_frees, w->frees);
    ck_assert_uint_le(s.bytes_in_use + s.bytes_pending, s.bytes_reserved);
}

static void wl_init(struct wl *w, bfc_ctx_t *ctx, uint64_t seed)
{
    memset(w, 0, sizeof *w);
    w->ctx = ctx;
    w->seed = seed;
    for (int i = 0; i < NSTREAMS; i++) {
        w->s[i] = bfc_sim_stream_create(ctx);
        REQ(w, w->s[i] != NULL, "stream");
    }
}

/* One step of the random workload. */
static void wl_step(struct wl *w)
{
    uint64_t r = rnd(&w->seed);
    int op = (int)(r % 100);
    if (op < 45 || w->nlive == 0) {
        if (w->nlive == MAXLIVE)
            return;
        int o = (int)((r >> 7) % NSTREAMS);
        size_t n = pick_size(rnd(&w->seed));
        unsigned char *p = bfc_ctx_alloc(w->ctx, w->s[o], n);
        if (!p) {
            int e = bfc_last_error();
            REQ(w, e == BFC_ENOMEM || e == BFC_EBACKEND, "alloc(%zu): %s", n, bfc_err_name(e));
            if (e == BFC_ENOMEM)
                w->enomem++;
            else
                w->ebackend_alloc++;
            return;
        }
        REQ(w, bfc_last_error() == BFC_OK, "last_error after a successful alloc");
        REQ(w, ((uintptr_t)p & 255) == 0, "unaligned %p", (void *)p);
        struct blk *b = &w->live[w->nlive++];
        b->p = p;
        b->n = n;
        b->asz = bfc_ctx_allocated_size(w->ctx, p);
        REQ(w, b->asz >= n, "allocated_size %zu < %zu", b->asz, n);
        b->owner = o;
        b->tag = (unsigned char)(r >> 32);
        fill(b);
        w->allocs++;
        w->ok_allocs++;
        w->live_bytes += b->asz;
        w->live_req += n;
    } else if (op < 65) {
        int i = (int)((r >> 7) % (uint64_t)w->nlive);
        (void)wl_free(w, i, w->live[i].owner);
    } else if (op < 85) {
        int i = (int)((r >> 7) % (uint64_t)w->nlive);
        (void)wl_free(w, i, (int)((r >> 20) % NSTREAMS));
    } else if (op < 90) {
        int i = (int)((r >> 7) % (uint64_t)w->nlive);
        int rc = bfc_ctx_record_stream(w->ctx, w->live[i].p, w->s[(r >> 20) % NSTREAMS]);
        REQ(w, rc == BFC_OK || rc == BFC_ENOMEM || rc == BFC_EBACKEND, "record_stream: %s",
                      bfc_err_name(rc));
        if (rc == BFC_ENOMEM)
            w->enomem_rec++;
        if (rc == BFC_EBACKEND)
            w->ebackend_rec++;
    } else if (op < 96) {
        int k = (int)((r >> 7) % NSTREAMS);
        if (w->held[k])
            bfc_sim_stream_drain(w->ctx, w->s[k]);
        else
            bfc_sim_stream_hold(w->ctx, w->s[k]);
        w->held[k] = !w->held[k];
    } else if (op < 98) {
        int rc = bfc_ctx_stream_release(w->ctx, w->s[(r >> 7) % NSTREAMS]);
        REQ(w, rc == BFC_OK || rc == BFC_EINVAL, "release: %s", bfc_err_name(rc));
        w->releases += rc == BFC_OK;
    } else {
        REQ(w, bfc_ctx_trim(w->ctx) == BFC_OK, "trim");
    }
}

static void wl_run(struct wl *w, int steps)
{
    for (int i = 0; i < steps; i++) {
        wl_step(w);
        if (i % 64 == 63)
            wl_checkpoint(w);
    }
    wl_checkpoint(w);
}

/* The fault has stopped: every stream drained, every block freed (each
 * on a random stream), nothing pending, nothing held from the device. */
static void wl_finish(struct wl *w)
{
    for (int k = 0; k < NSTREAMS; k++) {
        bfc_sim_stream_drain(w->ctx, w->s[k]);
        w->held[k] = false;
    }
    while (w->nlive) {
        int i = w->nlive - 1;
        int rc = wl_free(w, i, (int)(rnd(&w->seed) % NSTREAMS));
        REQ(w, rc == BFC_OK, "free after the fault stopped: %s", bfc_err_name(rc));
    }
    wl_checkpoint(w);
}

static void expect_clean(bfc_ctx_t *ctx)
{
    bfc_stats_t s = st(ctx);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(s.bytes_requested, 0);
    ck_assert_uint_eq(s.num_pending_frees, 0);
    ck_assert_uint_eq(s.num_allocs, s.num_frees);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    s = st(ctx);
    /* allow_growth=false keeps its one reservation of the whole limit. */
    bfc_config_t c;
    ck_assert_int_eq(bfc_ctx_config(ctx, &c), BFC_OK);
    size_t kept = c.allow_growth ? 0 : c.memory_limit;
    ck_assert_uint_eq(s.bytes_reserved, kept);
    ck_assert_uint_eq(s.num_regions, 0);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), kept);
    xcheck(ctx);
}

/* After the fault: half the limit can be allocated again, in blocks of two
 * sizes on two streams (each stream's region schedule doubles, so a stream
 * may hold up to about twice what it uses). */
static void expect_serves(bfc_ctx_t *ctx, size_t limit)
{
    bfc_stream_t a = bfc_sim_stream_create(ctx), b = bfc_sim_stream_create(ctx);
    enum { MAXV = 64 };
    void *v[MAXV];
    size_t got = 0;
    int n = 0;
    while (got + 2 * MiB <= limit / 2 && n < MAXV) {
        size_t sz = n % 3 == 0 ? 2 * MiB : 512 * KiB;
        v[n] = bfc_ctx_alloc(ctx, n % 2 ? a : b, sz);
        ck_assert_msg(v[n] != NULL, "after the fault: alloc %d (%zu, %zu held) failed: %s", n, sz, got,
                      bfc_err_name(bfc_last_error()));
        memset(v[n], n, 256);
        got += sz;
        n++;
    }
    ck_assert_int_ge(n, 8);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(bfc_ctx_free(ctx, v[i], i % 3 ? a : b), BFC_OK);
    expect_clean(ctx);
}

/* --------------------------------------------- device allocation faults */

static const unsigned alloc_every[] = { 1, 2, 3, 7 };

START_TEST(test_fail_alloc_every)
{
    unsigned every = alloc_every[_i];
    const size_t limit = 48 * MiB;
    bfc_config_t c = cfg_sim(limit);
    c.garbage_collection = _i % 2 == 1;
    bfc_ctx_t *ctx = ctx_new(&c);
    struct wl w;
    wl_init(&w, ctx, 0x1234567ull + _i);
    wl_run(&w, 300); /* warm: regions exist */
    bfc_sim_fail_alloc_every(ctx, every);
    uint64_t f0 = bfc_sim_backend_failures(ctx);
    wl_run(&w, 2500);
    uint64_t failures = bfc_sim_backend_failures(ctx) - f0;
    ck_assert_msg(failures > 0, "every=%u: no device allocation failed", every);
    ck_assert_msg(w.ok_allocs > 100, "every=%u: only %lu allocations served", every, (unsigned long)w.ok_allocs);
    if (every <= 2)
        ck_assert_msg(w.enomem > 0, "every=%u: no failure reached the caller", every);
    ck_assert_uint_eq(w.ebackend_free, 0); /* events work */
    bfc_sim_fail_alloc_every(ctx, 0);
    wl_finish(&w);
    expect_clean(ctx);
    expect_serves(ctx, limit);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* The same switch from a configuration string (as the perf harness sets it). */
START_TEST(test_fail_alloc_always)
{
    bfc_config_t c = cfg_sim(32 * MiB);
    ck_assert_int_eq(bfc_config_parse(&c, "large_alloc=1M"), BFC_OK);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_sim_fail_alloc_every(ctx, 1);
    /* Every device allocation fails: nothing can be served at all. */
    for (int i = 0; i < 20; i++) {
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, (size_t)(i + 1) * 100 * KiB));
        ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    }
    bfc_stats_t s = st(ctx);
    ck_assert_uint_eq(s.num_ooms, 20);
    ck_assert_uint_eq(s.bytes_reserved, 0);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), 0);
    ck_assert_uint_ge(bfc_sim_backend_failures(ctx), 20);
    xcheck(ctx);
    bfc_sim_fail_alloc_every(ctx, 0);
    expect_serves(ctx, 32 * MiB);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ----------------------------------------------------- event faults */

static const unsigned event_every[] = { 1, 2, 5 };

START_TEST(test_fail_event_every)
{
    unsigned every = event_every[_i];
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_sim(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    struct wl w;
    wl_init(&w, ctx, 0xfeedbeefull + _i);
    wl_run(&w, 200);
    bfc_sim_fail_event_every(ctx, every);
    wl_run(&w, 2500);
    ck_assert_msg(w.ok_allocs > 100, "every=%u: only %lu allocations", every, (unsigned long)w.ok_allocs);
    if (every == 1)
        ck_assert_msg(w.ebackend_free > 0, "every=1: no free on a held stream failed");
    bfc_sim_fail_event_every(ctx, 0);
    wl_finish(&w);
    expect_clean(ctx);
    expect_serves(ctx, limit);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* The documented behaviour (src/remote.c) step by step. */
START_TEST(test_event_failure_contract)
{
    bfc_config_t c = cfg_sim(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *g = bfc_ctx_alloc(ctx, s, 1 * KiB);
    void *p = bfc_ctx_alloc(ctx, s, 4 * KiB);
    void *g2 = bfc_ctx_alloc(ctx, s, 1 * KiB);
    ck_assert(g && p && g2);
    memset(p, 0x6B, 4 * KiB);
    bfc_sim_fail_event_every(ctx, 1);
    /* Event fails and the held stream cannot be synchronised: BFC_EBACKEND,
     * and the block stays allocated. */
    bfc_sim_stream_hold(ctx, t);
    bfc_stats_t before = st(ctx);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, t), BFC_EBACKEND);
    bfc_stats_t after = st(ctx);
    ck_assert(memcmp(&before, &after, sizeof before) == 0);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), 4 * KiB);
    for (int k = 0; k < 4096; k++)
        if (((unsigned char *)p)[k] != 0x6B)
            ck_abort_msg("byte %d of the block changed", k);
    xcheck(ctx);
    /* Not reused meanwhile. */
    void *q = bfc_ctx_alloc(ctx, s, 4 * KiB);
    ck_assert_ptr_ne(q, p);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, s), BFC_OK);
    /* Event still failing, stream idle: the fallback synchronisation
     * fences it, the free succeeds and the block is reusable at once. */
    bfc_sim_stream_drain(ctx, t);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, t), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, t), BFC_EDOUBLEFREE);
    q = bfc_ctx_alloc(ctx, s, 4 * KiB);
    ck_assert_ptr_eq(q, p);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, s), BFC_OK);
    /* A same-stream free never needs an event. */
    bfc_sim_stream_hold(ctx, s);
    ck_assert_int_eq(bfc_ctx_free(ctx, g, s), BFC_OK);
    bfc_sim_stream_drain(ctx, s);
    bfc_sim_fail_event_every(ctx, 0);
    ck_assert_int_eq(bfc_ctx_free(ctx, g2, t), BFC_OK);
    expect_clean(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* A recorded stream whose event cannot be recorded and that cannot be
 * synchronised (held) must keep the block from being reused until it can. */
START_TEST(test_event_failure_recorded_stream)
{
    bfc_config_t c = cfg_sim(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = bfc_sim_stream_create(ctx), u = bfc_sim_stream_create(ctx);
    void *g = bfc_ctx_alloc(ctx, s, 1 * KiB);
    void *p = bfc_ctx_alloc(ctx, s, 4 * KiB);
    void *g2 = bfc_ctx_alloc(ctx, s, 1 * KiB);
    ck_assert(g && p && g2);
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, p, u), BFC_OK);
    bfc_sim_stream_hold(ctx, u);
    /* The record on u fails and u cannot be synchronised; then the fault
     * stops, so later queries work -- of an event that was never recorded. */
    bfc_sim_fail_event_every(ctx, 1);
    int rc = bfc_ctx_free(ctx, p, s);
    ck_assert_msg(rc == BFC_OK || rc == BFC_EBACKEND, "free: %s", bfc_err_name(rc));
    bfc_sim_fail_event_every(ctx, 0);
    /* u is still held: p must not come back. */
    for (int i = 0; i < 4; i++) {
        void *q = bfc_ctx_alloc(ctx, s, 4 * KiB);
        ck_assert_ptr_nonnull(q);
        ck_assert_msg(q != p, "block reused while its recorded stream is still held");
        ck_assert_int_eq(bfc_ctx_free(ctx, q, s), BFC_OK);
    }
    bfc_sim_stream_drain(ctx, u);
    if (rc == BFC_EBACKEND)
        ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    bfc_stats_t o = st(ctx);
    ck_assert_uint_eq(o.num_pending_frees, 0);
    void *q = bfc_ctx_alloc(ctx, s, 4 * KiB);
    ck_assert_ptr_eq(q, p);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, g, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, g2, s), BFC_OK);
    expect_clean(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------- shrinking ceiling */

START_TEST(test_shrinking_ceiling)
{
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_sim(limit);
    c.garbage_collection = _i == 1;
    bfc_ctx_t *ctx = ctx_new(&c);
    struct wl w;
    wl_init(&w, ctx, 0xc0ffee00ull + _i);
    size_t ceiling = limit;
    uint64_t f0 = bfc_sim_backend_failures(ctx);
    for (int phase = 0; phase < 8; phase++) {
        bfc_sim_set_alloc_ceiling(ctx, ceiling);
        size_t held0 = bfc_sim_backend_bytes_held(ctx);
        for (int i = 0; i < 300; i++) {
            wl_step(&w);
            /* The backend never grows past the ceiling (it may hold more
             * than a ceiling set below what it already held). */
            size_t held = bfc_sim_backend_bytes_held(ctx);
            ck_assert_msg(held <= (held0 > ceiling ? held0 : ceiling), "held %zu > ceiling %zu", held, ceiling);
            if (held < held0)
                held0 = held;
        }
        wl_checkpoint(&w);
        ceiling -= 7 * MiB;
    }
    ck_assert_uint_gt(bfc_sim_backend_failures(ctx) - f0, 0);
    ck_assert_uint_gt(w.enomem, 0);
    ck_assert_uint_eq(w.ebackend_alloc, 0);
    bfc_sim_set_alloc_ceiling(ctx, SIZE_MAX);
    wl_finish(&w);
    expect_clean(ctx);
    expect_serves(ctx, limit);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* -------------------------------------------------- metadata exhausted */

static const unsigned meta_every[] = { 1, 2, 5, 17 };

/* Every Nth metadata allocation fails while the workload runs: regions,
 * tails and large blocks still leave shards cleanly (their records were
 * reserved first), the pool stays consistent (bfc_ctx_check at every
 * checkpoint), statuses are BFC_ENOMEM only, and afterwards nothing leaked
 * and the whole limit is usable again. */
START_TEST(test_fail_meta_every)
{
    unsigned every = meta_every[_i];
    const size_t limit = 48 * MiB;
    bfc_config_t c = cfg_sim(limit);
    c.garbage_collection = _i % 2 == 1;
    c.allow_growth = _i != 2;
    bfc_ctx_t *ctx = ctx_new(&c);
    struct wl w;
    wl_init(&w, ctx, 0x5eed0000ull + _i);
    wl_run(&w, 200);
    uint64_t f0 = bfc_sim_meta_failures();
    bfc_sim_fail_meta_every(every);
    wl_run(&w, 1200);
    bfc_sim_fail_meta_every(0);
    ck_assert_uint_gt(bfc_sim_meta_failures() - f0, 0);
    /* No metadata failure surfaces as anything but BFC_ENOMEM, a
     * cross-stream free whose fence record got no event (SIM events are
     * metadata) on a held stream included. */
    ck_assert_uint_eq(w.ebackend_alloc, 0);
    ck_assert_uint_eq(w.ebackend_free, 0);
    if (every == 1)
        ck_assert_uint_gt(w.enomem, 0);
    wl_finish(&w);
    expect_clean(ctx);
    expect_serves(ctx, limit);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* A stream's first allocation whose shard cannot be made (its metadata
 * refused) fails with BFC_ENOMEM and counts in num_ooms like any other
 * failed allocation. */
START_TEST(test_meta_failure_counted)
{
    bfc_config_t c = cfg_sim(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    ck_assert_ptr_nonnull(s);
    bfc_sim_fail_meta_every(1);
    void *p = bfc_ctx_alloc(ctx, s, 4096);
    int err = bfc_last_error();
    bfc_sim_fail_meta_every(0);
    ck_assert_ptr_null(p);
    ck_assert_int_eq(err, BFC_ENOMEM);
    bfc_stats_t st;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_uint_eq(st.num_ooms, 1);
    ck_assert_uint_eq(st.num_shards, 0);
    p = bfc_ctx_alloc(ctx, s, 4096);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ------------------------------------------------ two threads, faults */

struct thr {
    struct wl w;
    int steps;
};

static void *thr_main(void *arg)
{
    struct thr *t = arg;
    wl_run(&t->w, t->steps);
    return NULL;
}

START_TEST(test_threads_under_faults)
{
    const size_t limit = 96 * MiB;
    bfc_config_t c = cfg_sim(limit);
    c.garbage_collection = true;
    bfc_ctx_t *ctx = ctx_new(&c);
    static struct thr t[2];
    for (int i = 0; i < 2; i++) {
        wl_init(&t[i].w, ctx, 0xabcdef01ull * (uint64_t)(i + 1));
        t[i].w.shared = true;
        t[i].steps = 1500;
    }
    bfc_sim_fail_alloc_every(ctx, 3);
    bfc_sim_fail_event_every(ctx, 4);
    bfc_sim_set_alloc_ceiling(ctx, 40 * MiB);
    bfc_sim_fail_meta_every(13);
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, thr_main, &t[i]), 0);
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    bfc_sim_fail_alloc_every(ctx, 0);
    bfc_sim_fail_event_every(ctx, 0);
    bfc_sim_set_alloc_ceiling(ctx, SIZE_MAX);
    bfc_sim_fail_meta_every(0);
    ck_assert_uint_gt(bfc_sim_backend_failures(ctx), 0);
    ck_assert_uint_gt(bfc_sim_meta_failures(), 0);
    uint64_t allocs = 0, frees = 0, bytes = 0;
    for (int i = 0; i < 2; i++) {
        allocs += t[i].w.allocs;
        frees += t[i].w.frees;
        bytes += t[i].w.live_bytes;
    }
    bfc_stats_t s = st(ctx);
    ck_assert_uint_eq(s.num_allocs, allocs);
    ck_assert_uint_eq(s.num_frees, frees);
    ck_assert_uint_eq(s.bytes_in_use, bytes);
    for (int i = 0; i < 2; i++) {
        t[i].w.shared = false;
        t[i].w.allocs = t[i].w.frees = 0; /* per-workload counts no longer match the context's */
        t[i].w.shared = true;
        wl_finish(&t[i].w);
    }
    expect_clean(ctx);
    expect_serves(ctx, limit);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* --------------------------------------------------- device free faults */

/* The device refuses to take memory back (a region's free, or granules'
 * unmap part way through a range): that memory stays held and counted --
 * bytes_reserved is what the device holds, the limit still covers it --
 * trim says BFC_EBACKEND, the allocator serves from it, and a later trim
 * gives it back.  Loop: classic regions, expandable arenas, and expandable
 * arenas whose stream is released with nothing live (its reservation
 * departs with its granules mapped, and its release is refused part way:
 * the pool keeps charging what is still mapped). */
START_TEST(test_fail_free_kept)
{
    const bool vmm = _i >= 1, depart = _i == 2;
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_sim(limit);
    c.vmm = vmm ? BFC_VMM_ON : BFC_VMM_OFF;
    c.large_alloc = 0;
    if (depart)
        c.release_threshold = limit; /* the frees unmap nothing */
    bfc_ctx_t *ctx;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_OK);
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    /* A live block: an expandable shard with nothing live would hand its
     * whole reservation over instead of unmapping granules. */
    void *keep = depart ? NULL : bfc_ctx_alloc(ctx, s, 4 * KiB);
    ck_assert(depart || keep);
    enum { N = 6 };
    void *v[N];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) {
            v[i] = bfc_ctx_alloc(ctx, s, 8 * MiB);
            ck_assert_msg(v[i] != NULL, "round %d: alloc %d: %s", round, i, bfc_err_name(bfc_last_error()));
            memset(v[i], i, 8 * MiB);
        }
        bfc_stats_t full = st(ctx);
        ck_assert_uint_le(full.bytes_reserved, limit);
        ck_assert_uint_eq(full.bytes_reserved, bfc_sim_backend_bytes_held(ctx));
        /* Every free refused (regions); every third granule (vmm: the
         * first two of each run go, the rest stays), from the frees on:
         * an expandable shard may unmap at a free already. */
        bfc_sim_fail_free_every(ctx, vmm ? 3 : 1);
        for (int i = 0; i < N; i++)
            ck_assert_int_eq(bfc_ctx_free(ctx, v[i], s), BFC_OK);
        ck_assert_uint_eq(st(ctx).bytes_reserved, bfc_sim_backend_bytes_held(ctx));
        if (depart) {
            /* The release comes at once (no work queued): refused there. */
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
            ck_assert_uint_eq(st(ctx).bytes_reserved, bfc_sim_backend_bytes_held(ctx));
            ck_assert_uint_gt(st(ctx).bytes_reserved, 16 * MiB);
            bfc_sim_fail_free_every(ctx, 0);
            xcheck(ctx);
            continue;
        }
        ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_EBACKEND);
        bfc_stats_t after = st(ctx);
        ck_assert_uint_eq(after.bytes_reserved, bfc_sim_backend_bytes_held(ctx));
        ck_assert_uint_gt(after.bytes_reserved, 16 * MiB);
        xcheck(ctx);
        /* The second round allocates as much again, with the refused
         * memory still held: the limit holds, the counts stay exact. */
        bfc_sim_fail_free_every(ctx, 0);
    }
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    bfc_stats_t t = st(ctx);
    ck_assert_uint_eq(t.bytes_reserved, bfc_sim_backend_bytes_held(ctx));
    ck_assert_uint_le(t.bytes_reserved, vmm ? 2 * MiB : 2 * MiB);
    ck_assert_int_eq(bfc_ctx_free(ctx, keep, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 0);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), 0);
    xcheck(ctx);
    bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* retry_ms waits for other threads' frees up to its bound, read on the
 * clock; a clock that cannot be read spends the budget at once, so the
 * request fails with BFC_ENOMEM instead of waiting for ever (its deadline
 * was "now + retry_ms" on a clock that read 0 at every look). */
START_TEST(test_retry_without_clock)
{
    bfc_config_t c = cfg_sim(64 * MiB);
    c.retry_ms = 50;
    bfc_ctx_t *ctx = NULL;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_OK);
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *p = bfc_ctx_alloc(ctx, s, 48 * MiB);
    ck_assert_ptr_nonnull(p);
    atomic_store(&clock_broken, true);
    void *q = bfc_ctx_alloc(ctx, t, 48 * MiB);
    atomic_store(&clock_broken, false);
    ck_assert_ptr_null(q);
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    q = bfc_ctx_alloc(ctx, t, 48 * MiB);
    ck_assert_ptr_nonnull(q);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, t), BFC_OK);
    xcheck(ctx);
    bfc_sim_stream_destroy(ctx, s);
    bfc_sim_stream_destroy(ctx, t);
    bfc_ctx_destroy(ctx);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("faults");
    TCase *tc = tcase_create("faults");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_fail_alloc_every, 0, (int)(sizeof alloc_every / sizeof alloc_every[0]));
    tcase_add_test(tc, test_fail_alloc_always);
    tcase_add_loop_test(tc, test_fail_event_every, 0, (int)(sizeof event_every / sizeof event_every[0]));
    tcase_add_test(tc, test_event_failure_contract);
    tcase_add_test(tc, test_event_failure_recorded_stream);
    tcase_add_loop_test(tc, test_shrinking_ceiling, 0, 2);
    tcase_add_loop_test(tc, test_fail_meta_every, 0, (int)(sizeof meta_every / sizeof meta_every[0]));
    tcase_add_test(tc, test_threads_under_faults);
    tcase_add_test(tc, test_meta_failure_counted);
    tcase_add_loop_test(tc, test_fail_free_kept, 0, 3);
    suite_add_tcase(s, tc);
    TCase *clock = tcase_create("clock");
    tcase_set_timeout(clock, 10); /* a wait without bound fails it here */
    tcase_add_test(clock, test_retry_without_clock);
    suite_add_tcase(s, clock);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
