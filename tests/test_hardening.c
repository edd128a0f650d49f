/*
 * test_hardening.c -- the table of bad inputs a caller can pass, in one
 * place, each case checked for its documented status AND for leaving the
 * allocator exactly as it was.
 *
 * Every table case runs against a populated context: live blocks of several
 * sizes on three streams (filled with known bytes), a block freed on its
 * own stream between live neighbours, a cross-stream free still pending on a
 * held stream, and a second context with a live block.  After the call the
 * test requires: the status of include/shardbfc.h, identical statistics of
 * both contexts (num_ooms may move by exactly what the case says),
 * bfc_ctx_check passing on both, and every live block unchanged (contents,
 * requested and allocated size, allocation id).
 *
 * Cases that change state by design get their own tests: frees around a
 * released stream, a double free racing from two threads, NULL arguments to
 * every public function that takes a pointer, the process-wide API after
 * bfc_shutdown / bfc_ctx_destroy, malformed configuration strings.
 *
 * Debug mode: main() sets SHARDBFC_CONF with debug_check=true and
 * poison=true, so the process-wide context runs bfc_ctx_check after every
 * operation; a test corrupts a statistic (white-box) and sees the next
 * operation abort in a child process.  poison=true is tested on a private
 * context: a write after free is counted (stats num_poison_errors) and
 * reported on stderr once.
 *
 * Fork: hundreds of children forked while other threads allocate, free
 * across streams, reclaim under a tight limit, trim and release streams;
 * each child allocates, frees, trims, checks and exits, every wait bounded
 * (see "fork" below).  The library's fork handlers take every lock of the
 * library and of liburcu around fork(), so no lock a parent thread held is
 * inherited locked.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_tryjoin_np */
#endif
#include "testutil.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctx.h" /* white-box: the debug_check test corrupts a statistic */

#define LIMIT (64 * MiB)

#if defined(__SANITIZE_THREAD__)
#define HARD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HARD_TSAN 1
#endif
#endif

#if defined(__SANITIZE_ADDRESS__)
#define HARD_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HARD_ASAN 1
#endif
#endif

#define ENV_CONF "backend=sim,memory_limit=256M,debug_check=true,poison=true"

/* ------------------------------------------------------------ helpers */

static bfc_config_t cfg_sim(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = limit;
    c.initial_region = 2 * MiB;
    c.large_alloc = 0;
    return c;
}

/* Index of the first byte of m[0..n) that is not b, or n.  (One assertion
 * per block, not per byte: Check reports every assertion to its parent.) */
static size_t diff_at(const void *m, unsigned char b, size_t n)
{
    const unsigned char *c = m;
    size_t i = 0;
    while (i < n && c[i] == b)
        i++;
    return i;
}

/* -------------------------------------------------- the populated world */

#define NLIVE 12

struct world {
    bfc_ctx_t *ctx, *other;
    bfc_stream_t s[3];
    bfc_stream_t fresh;      /* a stream with no shard */
    void *live[NLIVE];
    size_t n[NLIVE];
    int on[NLIVE];
    void *freed;             /* freed on its own stream, between live blocks */
    void *pending;           /* freed on s[2] while s[2] is held */
    void *theirs;            /* live in `other` */
    /* what must not change */
    bfc_stats_t st, st_other;
    size_t req[NLIVE], asz[NLIVE];
    int64_t id[NLIVE];
};

static struct world W;

static unsigned char pat(int i)
{
    return (unsigned char)(0x11 * (i + 1));
}

static void world_snapshot(struct world *w)
{
    w->st = st(w->ctx);
    w->st_other = st(w->other);
    for (int i = 0; i < NLIVE; i++) {
        w->req[i] = bfc_ctx_requested_size(w->ctx, w->live[i]);
        w->asz[i] = bfc_ctx_allocated_size(w->ctx, w->live[i]);
        w->id[i] = bfc_ctx_allocation_id(w->ctx, w->live[i]);
    }
}

static void world_setup(void)
{
    struct world *w = &W;
    memset(w, 0, sizeof *w);
    bfc_config_t c = cfg_sim(LIMIT);
    w->ctx = ctx_new(&c);
    w->other = ctx_new(&c);
    for (int i = 0; i < 3; i++) {
        w->s[i] = bfc_sim_stream_create(w->ctx);
        ck_assert_ptr_nonnull(w->s[i]);
    }
    w->fresh = bfc_sim_stream_create(w->ctx);
    ck_assert_ptr_nonnull(w->fresh);
    static const size_t sizes[NLIVE] = { 256, 1000, 4096, 65536, 300000, 1 * MiB,
                                         512, 2048, 777, 3 * MiB, 256, 100 };
    for (int i = 0; i < NLIVE; i++) {
        w->on[i] = i % 3;
        w->n[i] = sizes[i];
        w->live[i] = xalloc(w->ctx, w->s[w->on[i]], sizes[i]);
        memset(w->live[i], pat(i), sizes[i]);
        if (i == 4) {
            /* A block freed on its own stream between live neighbours. */
            w->freed = xalloc(w->ctx, w->s[1], 1024);
        }
        if (i == 6)
            w->pending = xalloc(w->ctx, w->s[0], 2048);
    }
    xfree(w->ctx, w->freed, w->s[1]);
    bfc_sim_stream_hold(w->ctx, w->s[2]);
    xfree(w->ctx, w->pending, w->s[2]);
    w->theirs = xalloc(w->other, NULL, 4096);
    memset(w->theirs, 0x5C, 4096);
    world_snapshot(w);
    ck_assert_uint_eq(w->st.num_pending_frees, 1);
    xcheck(w->ctx);
}

/* Everything as it was; the context's num_ooms moved by `ooms`. */
static void world_intact(struct world *w, uint64_t ooms, const char *what)
{
    bfc_stats_t a = st(w->ctx), b = st(w->other);
    ck_assert_msg(a.num_ooms == w->st.num_ooms + ooms, "%s: num_ooms %llu, expected %llu", what,
                  (unsigned long long)a.num_ooms, (unsigned long long)(w->st.num_ooms + ooms));
    a.num_ooms = w->st.num_ooms;
    ck_assert_msg(memcmp(&a, &w->st, sizeof a) == 0, "%s: the context's statistics changed", what);
    ck_assert_msg(memcmp(&b, &w->st_other, sizeof b) == 0, "%s: the other context's statistics changed", what);
    xcheck(w->ctx);
    xcheck(w->other);
    for (int i = 0; i < NLIVE; i++) {
        size_t k = diff_at(w->live[i], pat(i), w->n[i]);
        ck_assert_msg(k == w->n[i], "%s: block %d byte %zu changed", what, i, k);
        ck_assert_uint_eq(bfc_ctx_requested_size(w->ctx, w->live[i]), w->req[i]);
        ck_assert_uint_eq(bfc_ctx_allocated_size(w->ctx, w->live[i]), w->asz[i]);
        ck_assert_int_eq(bfc_ctx_allocation_id(w->ctx, w->live[i]), w->id[i]);
    }
    ck_assert_msg(diff_at(w->theirs, 0x5C, 4096) == 4096, "%s: the other context's block changed", what);
}

static void world_teardown(void)
{
    struct world *w = &W;
    if (!w->ctx)
        return;
    bfc_sim_stream_drain(w->ctx, w->s[2]);
    for (int i = 0; i < NLIVE; i++)
        xfree(w->ctx, w->live[i], w->s[(w->on[i] + 1) % 3]);
    xfree(w->other, w->theirs, NULL);
    bfc_stats_t a = st(w->ctx);
    ck_assert_uint_eq(a.bytes_in_use, 0);
    ck_assert_uint_eq(a.num_pending_frees, 0);
    ck_assert_uint_eq(a.num_poison_errors, 0);
    xcheck(w->ctx);
    ck_assert_int_eq(bfc_ctx_trim(w->ctx), BFC_OK);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(w->ctx), 0);
    bfc_ctx_destroy(w->ctx);
    bfc_ctx_destroy(w->other);
    memset(w, 0, sizeof *w);
}

/* ---------------------------------------------------------- the table */

static int c_free_null(struct world *w) { return bfc_ctx_free(w->ctx, NULL, w->s[0]); }
static int c_free_null_default(struct world *w) { return bfc_ctx_free(w->ctx, NULL, NULL); }
static int c_free_low(struct world *w) { return bfc_ctx_free(w->ctx, (void *)(uintptr_t)0x1000, w->s[0]); }
static int c_free_high(struct world *w)
{
    return bfc_ctx_free(w->ctx, (void *)(UINTPTR_MAX & ~(uintptr_t)255), w->s[1]);
}
static int c_free_stack(struct world *w)
{
    char buf[512];
    void *volatile p = buf;
    return bfc_ctx_free(w->ctx, p, w->s[0]);
}
static int c_free_heap(struct world *w)
{
    void *h = malloc(100);
    ck_assert_ptr_nonnull(h);
    int rc = bfc_ctx_free(w->ctx, h, w->s[0]);
    free(h);
    return rc;
}
static int c_free_heap_aligned_cross(struct world *w)
{
    void *h = aligned_alloc(256, 4096);
    ck_assert_ptr_nonnull(h);
    int rc = bfc_ctx_free(w->ctx, h, w->s[1]);
    free(h);
    return rc;
}
static int c_free_interior1(struct world *w) { return bfc_ctx_free(w->ctx, (char *)w->live[2] + 1, w->s[2]); }
static int c_free_interior256(struct world *w)
{
    return bfc_ctx_free(w->ctx, (char *)w->live[3] + 256, w->s[w->on[3]]);
}
static int c_free_interior_cross(struct world *w)
{
    return bfc_ctx_free(w->ctx, (char *)w->live[3] + 256, w->s[(w->on[3] + 1) % 3]);
}
static int c_free_interior_last(struct world *w)
{
    return bfc_ctx_free(w->ctx, (char *)w->live[9] + w->n[9] - 256, w->s[w->on[9]]);
}
static int c_free_interior_held(struct world *w)
{
    return bfc_ctx_free(w->ctx, (char *)w->live[5] + 4096, w->s[2]);
}
static int c_free_other_ctx(struct world *w) { return bfc_ctx_free(w->ctx, w->theirs, w->s[0]); }
static int c_free_other_ctx_default(struct world *w) { return bfc_ctx_free(w->ctx, w->theirs, NULL); }
static int c_free_mine_in_other(struct world *w) { return bfc_ctx_free(w->other, w->live[0], NULL); }
static int c_double_free_same(struct world *w) { return bfc_ctx_free(w->ctx, w->freed, w->s[1]); }
static int c_double_free_cross(struct world *w) { return bfc_ctx_free(w->ctx, w->freed, w->s[0]); }
static int c_double_free_held(struct world *w) { return bfc_ctx_free(w->ctx, w->freed, w->s[2]); }
static int c_double_free_pending_owner(struct world *w) { return bfc_ctx_free(w->ctx, w->pending, w->s[0]); }
static int c_double_free_pending_same(struct world *w) { return bfc_ctx_free(w->ctx, w->pending, w->s[2]); }
static int c_double_free_pending_third(struct world *w) { return bfc_ctx_free(w->ctx, w->pending, w->s[1]); }
static int c_record_foreign(struct world *w) { return bfc_ctx_record_stream(w->ctx, w->theirs, w->s[1]); }
static int c_record_interior(struct world *w)
{
    return bfc_ctx_record_stream(w->ctx, (char *)w->live[1] + 256, w->s[1]);
}
static int c_record_freed(struct world *w) { return bfc_ctx_record_stream(w->ctx, w->freed, w->s[0]); }
static int c_record_pending(struct world *w) { return bfc_ctx_record_stream(w->ctx, w->pending, w->s[1]); }
static int c_record_null(struct world *w) { return bfc_ctx_record_stream(w->ctx, NULL, w->s[1]); }
static int c_size_foreign(struct world *w)
{
    return (int)bfc_ctx_requested_size(w->ctx, w->theirs) + (int)bfc_ctx_allocated_size(w->ctx, w->theirs);
}
static int c_id_freed(struct world *w) { return (int)bfc_ctx_allocation_id(w->ctx, w->freed); }
static int c_id_interior(struct world *w) { return (int)bfc_ctx_allocation_id(w->ctx, (char *)w->live[3] + 256); }
static int c_release_unknown(struct world *w) { return bfc_ctx_stream_release(w->ctx, w->fresh); }
static int c_stream_stats_unknown(struct world *w)
{
    bfc_stats_t s;
    return bfc_ctx_stream_stats(w->ctx, w->fresh, &s);
}

/* Allocations the API rejects return NULL; the case returns last_error. */
static int alloc_status(struct world *w, bfc_stream_t s, size_t n)
{
    void *p = bfc_ctx_alloc(w->ctx, s, n);
    ck_assert_msg(p == NULL, "alloc(%zu) = %p, expected NULL", n, p);
    return bfc_last_error();
}
static int c_alloc_0(struct world *w) { return alloc_status(w, w->s[0], 0); }
static int c_alloc_0_fresh(struct world *w) { return alloc_status(w, w->fresh, 0); }
static int c_alloc_max(struct world *w) { return alloc_status(w, w->s[0], SIZE_MAX); }
static int c_alloc_max_255(struct world *w) { return alloc_status(w, w->s[1], SIZE_MAX - 255); }
static int c_alloc_max_256(struct world *w) { return alloc_status(w, w->s[1], SIZE_MAX - 256); }
static int c_alloc_limit_1(struct world *w) { return alloc_status(w, w->s[2], LIMIT + 1); }
static int c_alloc_limit_1_fresh(struct world *w) { return alloc_status(w, w->fresh, LIMIT + 1); }
static int c_alloc_half_max(struct world *w) { return alloc_status(w, w->s[0], SIZE_MAX / 2 + 1); }

struct hcase {
    const char *name;
    int (*fn)(struct world *w);
    int want;
    uint64_t ooms;
};

static const struct hcase cases[] = {
    { "free NULL", c_free_null, BFC_OK, 0 },
    { "free NULL, default stream", c_free_null_default, BFC_OK, 0 },
    { "free foreign low address", c_free_low, BFC_ENOTOWNED, 0 },
    { "free foreign high address", c_free_high, BFC_ENOTOWNED, 0 },
    { "free stack address", c_free_stack, BFC_ENOTOWNED, 0 },
    { "free heap address", c_free_heap, BFC_ENOTOWNED, 0 },
    { "free aligned heap address, other stream", c_free_heap_aligned_cross, BFC_ENOTOWNED, 0 },
    { "free interior +1", c_free_interior1, BFC_ENOTOWNED, 0 },
    { "free interior +256, owner stream", c_free_interior256, BFC_ENOTOWNED, 0 },
    { "free interior +256, other stream", c_free_interior_cross, BFC_ENOTOWNED, 0 },
    { "free interior, last granule", c_free_interior_last, BFC_ENOTOWNED, 0 },
    { "free interior, held stream", c_free_interior_held, BFC_ENOTOWNED, 0 },
    { "free of another context's block", c_free_other_ctx, BFC_ENOTOWNED, 0 },
    { "free of another context's block, default stream", c_free_other_ctx_default, BFC_ENOTOWNED, 0 },
    { "free into the wrong context", c_free_mine_in_other, BFC_ENOTOWNED, 0 },
    { "double free, same stream", c_double_free_same, BFC_EDOUBLEFREE, 0 },
    { "double free, other stream", c_double_free_cross, BFC_EDOUBLEFREE, 0 },
    { "double free, held stream", c_double_free_held, BFC_EDOUBLEFREE, 0 },
    { "double free of a pending block, owner stream", c_double_free_pending_owner, BFC_EDOUBLEFREE, 0 },
    { "double free of a pending block, its fence stream", c_double_free_pending_same, BFC_EDOUBLEFREE, 0 },
    { "double free of a pending block, third stream", c_double_free_pending_third, BFC_EDOUBLEFREE, 0 },
    { "record_stream of another context's block", c_record_foreign, BFC_ENOTOWNED, 0 },
    { "record_stream of an interior pointer", c_record_interior, BFC_ENOTOWNED, 0 },
    { "record_stream of a freed block", c_record_freed, BFC_EDOUBLEFREE, 0 },
    { "record_stream of a pending block", c_record_pending, BFC_EDOUBLEFREE, 0 },
    { "record_stream of NULL", c_record_null, BFC_EINVAL, 0 },
    { "sizes of another context's block", c_size_foreign, 0, 0 },
    { "allocation id of a freed block", c_id_freed, BFC_EDOUBLEFREE, 0 },
    { "allocation id of an interior pointer", c_id_interior, BFC_ENOTOWNED, 0 },
    { "release of a stream without a shard", c_release_unknown, BFC_EINVAL, 0 },
    { "stream stats of a stream without a shard", c_stream_stats_unknown, BFC_EINVAL, 0 },
    { "alloc 0", c_alloc_0, BFC_OK, 0 },
    { "alloc 0 on a stream without a shard", c_alloc_0_fresh, BFC_OK, 0 },
    { "alloc SIZE_MAX", c_alloc_max, BFC_ENOMEM, 1 },
    { "alloc SIZE_MAX-255", c_alloc_max_255, BFC_ENOMEM, 1 },
    { "alloc SIZE_MAX-256", c_alloc_max_256, BFC_ENOMEM, 1 },
    { "alloc SIZE_MAX/2+1", c_alloc_half_max, BFC_ENOMEM, 1 },
    { "alloc limit+1", c_alloc_limit_1, BFC_ENOMEM, 1 },
    { "alloc limit+1 on a stream without a shard", c_alloc_limit_1_fresh, BFC_ENOMEM, 1 },
};

#define NCASES ((int)(sizeof cases / sizeof cases[0]))

START_TEST(test_bad_input_table)
{
    const struct hcase *c = &cases[_i];
    world_setup();
    /* Twice: a rejected call must not change what the next one sees. */
    for (int round = 0; round < 2; round++) {
        int rc = c->fn(&W);
        ck_assert_msg(rc == c->want, "%s: %s (%d), expected %s", c->name, bfc_err_name(rc), rc,
                      bfc_err_name(c->want));
        world_intact(&W, c->ooms * (uint64_t)(round + 1), c->name);
    }
    /* The world still works: the pending block comes back after the drain,
     * the freed one at once. */
    bfc_sim_stream_drain(W.ctx, W.s[2]);
    void *q = xalloc(W.ctx, W.s[1], 1024);
    ck_assert_ptr_eq(q, W.freed);
    xfree(W.ctx, q, W.s[1]);
    world_teardown();
}
END_TEST

/* ------------------------------------------------- released streams */

START_TEST(test_free_on_released_stream)
{
    bfc_config_t c = cfg_sim(LIMIT);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    bfc_stream_t r = bfc_sim_stream_create(ctx);
    void *keep = xalloc(ctx, t, 8 * KiB);
    memset(keep, 0x3C, 8 * KiB);
    void *a = xalloc(ctx, s, 4 * KiB), *b = xalloc(ctx, s, 8 * KiB), *d = xalloc(ctx, s, 16 * KiB);
    void *x = xalloc(ctx, r, 4 * KiB);
    xfree(ctx, x, r);
    /* r: released, no shard; s: released with three live blocks. */
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, r), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_EINVAL);
    ck_assert_uint_eq(st(ctx).num_shards, 1);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 36 * KiB);
    xcheck(ctx);
    /* A live block of a released stream, freed on that stream. */
    xfree(ctx, a, s);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 32 * KiB);
    /* ... on another stream that is itself released (a cross-stream free
     * fenced on it), and on a held stream (pending until drained). */
    xfree(ctx, b, r);
    bfc_sim_stream_hold(ctx, t);
    xfree(ctx, d, t);
    bfc_stats_t o = st(ctx);
    ck_assert_uint_eq(o.bytes_in_use, 8 * KiB);
    ck_assert_uint_eq(o.num_pending_frees, 1);
    xcheck(ctx);
    /* Second frees: the block is gone (EDOUBLEFREE while its region is
     * there, ENOTOWNED once the dead shard gave the region back); either
     * way nothing changes. */
    bfc_stats_t before = st(ctx);
    for (int k = 0; k < 3; k++) {
        void *v = k == 0 ? a : k == 1 ? b : d;
        int rc = bfc_ctx_free(ctx, v, k == 2 ? r : s);
        ck_assert_msg(rc == BFC_EDOUBLEFREE || rc == BFC_ENOTOWNED, "second free %d: %s", k, bfc_err_name(rc));
        bfc_stats_t after = st(ctx);
        ck_assert(memcmp(&before, &after, sizeof before) == 0);
    }
    bfc_sim_stream_drain(ctx, t);
    o = st(ctx);
    ck_assert_uint_eq(o.num_pending_frees, 0);
    ck_assert_uint_eq(o.bytes_in_use, 8 * KiB);
    ck_assert_uint_eq(diff_at(keep, 0x3C, 8 * KiB), 8 * KiB);
    /* The released streams get fresh shards on their next use. */
    void *y = xalloc(ctx, s, 4 * KiB);
    xfree(ctx, y, s);
    ck_assert_uint_eq(st(ctx).num_shards, 2);
    xfree(ctx, keep, t);
    xcheck(ctx);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), 0);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ------------------------------------------------- racing double free */

struct racer {
    bfc_ctx_t *ctx;
    pthread_barrier_t *bar;
    void *_Atomic p;
    bfc_stream_t on;
    int rc;
    int rounds;
};

static void *racer_main(void *arg)
{
    struct racer *r = arg;
    for (int i = 0; i < r->rounds; i++) {
        int e = pthread_barrier_wait(r->bar); /* p published */
        if (e != 0 && e != PTHREAD_BARRIER_SERIAL_THREAD)
            return (void *)1;
        r->rc = bfc_ctx_free(r->ctx, atomic_load(&r->p), r->on);
        e = pthread_barrier_wait(r->bar); /* rc published */
        if (e != 0 && e != PTHREAD_BARRIER_SERIAL_THREAD)
            return (void *)1;
    }
    return NULL;
}

START_TEST(test_double_free_race)
{
    world_setup();
    struct world *w = &W;
    enum { ROUNDS = 300 };
    pthread_barrier_t bar;
    ck_assert_int_eq(pthread_barrier_init(&bar, NULL, 3), 0);
    /* Pairs of freeing streams: owner + other, two others, owner + owner. */
    struct racer r[2] = { { w->ctx, &bar, NULL, w->s[0], 0, ROUNDS }, { w->ctx, &bar, NULL, w->s[1], 0, ROUNDS } };
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, racer_main, &r[i]), 0);
    uint64_t frees0 = st(w->ctx).num_frees;
    int variant_ok[3] = { 0, 0, 0 };
    for (int it = 0; it < ROUNDS; it++) {
        int v = it % 3;
        bfc_stream_t owner = v == 1 ? w->s[2] : w->s[0];
        r[0].on = w->s[0];
        r[1].on = v == 2 ? w->s[0] : w->s[1];
        void *p = xalloc(w->ctx, owner, (size_t)(it % 5 + 1) * 256);
        atomic_store(&r[0].p, p);
        atomic_store(&r[1].p, p);
        int e = pthread_barrier_wait(&bar);
        ck_assert(e == 0 || e == PTHREAD_BARRIER_SERIAL_THREAD);
        e = pthread_barrier_wait(&bar);
        ck_assert(e == 0 || e == PTHREAD_BARRIER_SERIAL_THREAD);
        int ok = (r[0].rc == BFC_OK) + (r[1].rc == BFC_OK);
        int dbl = (r[0].rc == BFC_EDOUBLEFREE) + (r[1].rc == BFC_EDOUBLEFREE);
        ck_assert_msg(ok == 1 && dbl == 1, "round %d: %s / %s", it, bfc_err_name(r[0].rc), bfc_err_name(r[1].rc));
        variant_ok[v]++;
    }
    for (int i = 0; i < 2; i++) {
        void *ret;
        ck_assert_int_eq(pthread_join(th[i], &ret), 0);
        ck_assert_ptr_null(ret);
    }
    ck_assert_int_eq(pthread_barrier_destroy(&bar), 0);
    ck_assert_int_eq(variant_ok[0] + variant_ok[1] + variant_ok[2], ROUNDS);
    /* Exactly one free per round counted; everything else as it was. */
    bfc_sim_stream_drain(w->ctx, w->s[2]);
    bfc_stats_t a = st(w->ctx);
    ck_assert_uint_eq(a.num_frees, frees0 + ROUNDS);
    ck_assert_uint_eq(a.num_allocs, w->st.num_allocs + ROUNDS);
    ck_assert_uint_eq(a.bytes_in_use, w->st.bytes_in_use);
    ck_assert_uint_eq(a.bytes_requested, w->st.bytes_requested);
    xcheck(w->ctx);
    for (int i = 0; i < NLIVE; i++)
        ck_assert_uint_eq(diff_at(w->live[i], pat(i), w->n[i]), w->n[i]);
    world_teardown();
}
END_TEST

/* ------------------------------------------------------ NULL pointers */

START_TEST(test_null_arguments)
{
    bfc_config_t c = cfg_sim(LIMIT);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    void *p = xalloc(ctx, s, 4096);
    memset(p, 0x42, 4096);
    bfc_stats_t before = st(ctx), so;
    bfc_config_t co;
    char buf[64];

    bfc_config_init(NULL); /* no crash */
    ck_assert_int_eq(bfc_config_parse(NULL, "memory_limit=1G"), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse(NULL, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse(&co, NULL), BFC_OK);
    ck_assert_int_eq(bfc_config_validate(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_create(&c, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_create(NULL, NULL), BFC_EINVAL);
    bfc_ctx_destroy(NULL);
    ck_assert_ptr_null(bfc_ctx_alloc(NULL, s, 16));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(NULL, p, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(NULL, NULL, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_record_stream(NULL, p, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, NULL, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_release(NULL, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_trim(NULL), BFC_EINVAL);
    ck_assert_uint_eq(bfc_ctx_requested_size(NULL, p), 0);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, NULL), 0);
    ck_assert_uint_eq(bfc_ctx_allocated_size(NULL, p), 0);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, NULL), 0);
    ck_assert_int_lt(bfc_ctx_allocation_id(NULL, p), 0);
    ck_assert_int_lt(bfc_ctx_allocation_id(ctx, NULL), 0);
    ck_assert_int_eq(bfc_ctx_config(NULL, &co), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_config(ctx, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stats(NULL, &so), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stats(ctx, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_stats(NULL, s, &so), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, s, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_clear_peaks(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_check(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_check_report(NULL, buf, sizeof buf), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_check_report(NULL, NULL, 0), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_check_report(ctx, NULL, 0), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check_report(ctx, buf, 0), BFC_OK);
    ck_assert_int_eq(bfc_ctx_dump(NULL, stderr), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_dump(ctx, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_snapshot_json(NULL, stderr), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, NULL), BFC_EINVAL);
    /* A file that takes no write: reported even when all of it would fit
     * in the stream's buffer (the last flush is the call's). */
    FILE *full = fopen("/dev/full", "w");
    if (full) {
        ck_assert_int_eq(bfc_ctx_dump(ctx, full), BFC_EBACKEND);
        clearerr(full);
        ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, full), BFC_EBACKEND);
        fclose(full);
    }
    /* Process-wide and host calls with NULL pointers. */
    ck_assert_int_eq(bfc_free(NULL), BFC_OK);
    ck_assert_int_eq(bfc_stream_free(NULL, s), BFC_OK);
    ck_assert_int_eq(bfc_record_stream(NULL, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_free(NULL), BFC_OK);
    ck_assert_int_eq(bfc_host_record_stream(NULL, s), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_numa_node(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_stats(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_node_stats(0, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_node_stats(-1, &so), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_node_stats(1 << 20, &so), BFC_EINVAL);
    ck_assert_ptr_null(bfc_host_ctx(-1));
    ck_assert_ptr_null(bfc_host_ctx(1 << 20));
    /* SIM controls with a NULL context: no-ops / NULL / 0. */
    ck_assert_ptr_null(bfc_sim_stream_create(NULL));
    bfc_sim_stream_destroy(NULL, s);
    bfc_sim_stream_hold(NULL, s);
    bfc_sim_stream_drain(NULL, s);
    bfc_sim_fail_alloc_every(NULL, 1);
    bfc_sim_fail_event_every(NULL, 1);
    bfc_sim_set_alloc_ceiling(NULL, 0);
    ck_assert_uint_eq(bfc_sim_backend_allocs(NULL), 0);
    ck_assert_uint_eq(bfc_sim_backend_failures(NULL), 0);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(NULL), 0);
    /* Status names for values outside the table. */
    ck_assert_ptr_nonnull(bfc_strerror(-1000));
    ck_assert_str_eq(bfc_err_name(12345), "BFC_UNKNOWN");
    ck_assert_str_eq(bfc_err_name(INT32_MIN), "BFC_UNKNOWN");

    /* Nothing moved; the block is intact and still freeable. */
    bfc_stats_t after = st(ctx);
    ck_assert(memcmp(&before, &after, sizeof before) == 0);
    ck_assert_uint_eq(diff_at(p, 0x42, 4096), 4096);
    xcheck(ctx);
    xfree(ctx, p, s);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ------------------------------------- process-wide API after teardown */

START_TEST(test_service_after_shutdown_and_destroy)
{
    void *p = bfc_stream_alloc(NULL, 4 * KiB);
    ck_assert_ptr_nonnull(p);
    void *h = bfc_host_alloc(4 * KiB);
    ck_assert_ptr_nonnull(h);
    bfc_ctx_t *d = bfc_default_ctx();
    ck_assert_ptr_nonnull(d);
    bfc_config_t dc;
    ck_assert_int_eq(bfc_ctx_config(d, &dc), BFC_OK);
    ck_assert(dc.debug_check && dc.poison); /* SHARDBFC_CONF was applied */
    bfc_shutdown();
    /* Device and host pointers of the destroyed service: clear statuses. */
    ck_assert_int_eq(bfc_free(p), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free(p, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_record_stream(p, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_release(NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_free(h), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_record_stream(h, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_numa_node(h), BFC_ENOTOWNED);
    ck_assert_ptr_null(bfc_host_ctx(0));
    bfc_stats_t hs;
    ck_assert_int_eq(bfc_host_node_stats(0, &hs), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_stats(&hs), BFC_OK);
    ck_assert_uint_eq(hs.bytes_in_use, 0);
    ck_assert_uint_eq(hs.num_allocs, 0);

    /* A private context's pointer after bfc_ctx_destroy, through the
     * process-wide calls. */
    bfc_config_t c = cfg_sim(LIMIT);
    bfc_ctx_t *mine = ctx_new(&c);
    void *m = xalloc(mine, NULL, 4 * KiB);
    ck_assert_int_eq(bfc_record_stream(m, NULL), BFC_OK); /* found while alive */
    bfc_ctx_destroy(mine);
    ck_assert_int_eq(bfc_free(m), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free(m, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_record_stream(m, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_free(m), BFC_ENOTOWNED);

    /* Service again: fresh contexts, consistent, empty but for the new
     * blocks. */
    void *q = bfc_stream_alloc(NULL, 8 * KiB);
    ck_assert_ptr_nonnull(q);
    void *hq = bfc_host_alloc(8 * KiB);
    ck_assert_ptr_nonnull(hq);
    bfc_ctx_t *d2 = bfc_default_ctx();
    bfc_stats_t ds = st(d2);
    ck_assert_uint_eq(ds.num_allocs, 1);
    ck_assert_uint_eq(ds.bytes_in_use, 8 * KiB);
    ck_assert_int_eq(bfc_host_stats(&hs), BFC_OK);
    ck_assert_uint_eq(hs.num_allocs, 1);
    xcheck(d2);
    ck_assert_int_eq(bfc_free(q), BFC_OK);
    ck_assert_int_eq(bfc_host_free(hq), BFC_OK);
    ck_assert_uint_eq(st(d2).num_poison_errors, 0);
    bfc_shutdown();
}
END_TEST

/* --------------------------------------------------- configuration */

static const char *const bad_specs[] = {
    /* unknown keys */
    "memory_limt=1G", "bogus=1", "memory_limit=1G,bogus=1", "poison=true,,x=y", "memory limit=1G",
    /* negative numbers */
    "memory_limit=-1", "memory_limit=-1G", "retry_ms=-5", "device=-1", "initial_region=-256",
    "sim_fail_alloc_every=-1", "fragmentation_fraction=-0.5", "large_alloc=-1", "host_numa=-3",
    /* huge numbers */
    "memory_limit=18446744073709551616", "memory_limit=17179869184G", "memory_limit=99999999999999999999999",
    "retry_ms=3600001", "retry_ms=4294967296", "sim_fail_alloc_every=4294967296", "device=2147483648",
    "fragmentation_fraction=1.5", "fragmentation_fraction=1e400", "initial_region=18446744073709551615K",
    /* empty values and keys */
    "memory_limit=", "backend=", "poison=", "debug_check= ", "=", "=1", "memory_limit", "retry_ms==1",
    /* garbage bytes */
    "\x80", "\xff\xfe=1", "memory_limit=1G\x01", "backend=s\x7fim", "poison=tr\303\274e", "\x1b[0m=1",
    "memory_limit=1\tG", "memory_limit=0x100", "memory_limit=1.5G", "backend=sim;poison=true",
};

START_TEST(test_bad_config_strings)
{
    for (size_t i = 0; i < sizeof bad_specs / sizeof bad_specs[0]; i++) {
        bfc_config_t c, before;
        bfc_config_init(&c);
        ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,memory_limit=8M,poison=true,retry_ms=7"), BFC_OK);
        memcpy(&before, &c, sizeof c);
        int rc = bfc_config_parse(&c, bad_specs[i]);
        ck_assert_msg(rc == BFC_EINVAL, "spec %zu \"%s\": %s", i, bad_specs[i], bfc_err_name(rc));
        ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "spec %zu changed the config", i);
        /* The untouched config still makes a working context. */
        if (i % 8 == 0) {
            bfc_ctx_t *ctx = ctx_new(&c);
            void *p = xalloc(ctx, NULL, 1000);
            xfree(ctx, p, NULL);
            xcheck(ctx);
            bfc_ctx_destroy(ctx);
        }
    }
}
END_TEST

/* Values at the edges that parse: each makes a context that works. */
START_TEST(test_edge_configs_work)
{
    static const char *const specs[] = {
        "backend=sim,memory_limit=256",                         /* one granule */
        "backend=sim,memory_limit=1M,initial_region=1",         /* 256-byte regions */
        "backend=sim,memory_limit=4M,large_alloc=1",            /* every block its own region */
        "backend=sim,memory_limit=4M,allow_growth=false,initial_region=4M,large_alloc=0",
        "backend=sim,memory_limit=16M,fragmentation_fraction=1,garbage_collection=true",
        "backend=sim,memory_limit=16M,fragmentation_fraction=0.0000001",
        "backend=sim,memory_limit=16M,initial_region=1G",       /* first region capped at the limit */
    };
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        bfc_config_t c;
        bfc_config_init(&c);
        ck_assert_int_eq(bfc_config_parse(&c, specs[i]), BFC_OK);
        bfc_ctx_t *ctx = ctx_new(&c);
        bfc_stream_t s = bfc_sim_stream_create(ctx);
        void *v[8];
        int n = 0;
        for (int k = 0; k < 8; k++) {
            v[n] = bfc_ctx_alloc(ctx, k % 2 ? s : NULL, 256u << k);
            if (v[n]) {
                memset(v[n], k, 256u << k);
                n++;
            } else {
                ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
            }
        }
        ck_assert_msg(n > 0, "%s: nothing could be allocated", specs[i]);
        xcheck(ctx);
        for (int k = 0; k < n; k++)
            xfree(ctx, v[k], k % 3 ? s : NULL);
        ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
        xcheck(ctx);
        bfc_ctx_destroy(ctx);
    }
    /* A limit far beyond memory without growth: reserved lazily by the SIM
     * backend (or refused); never a crash. */
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,memory_limit=1024G,allow_growth=false"), BFC_OK);
    bfc_ctx_t *ctx = NULL;
    int rc = bfc_ctx_create(&c, &ctx);
    ck_assert_msg(rc == BFC_OK || rc == BFC_ENOMEM, "%s", bfc_err_name(rc));
    if (ctx) {
        void *p = xalloc(ctx, NULL, 1 * MiB);
        xfree(ctx, p, NULL);
        xcheck(ctx);
        bfc_ctx_destroy(ctx);
    }
}
END_TEST

/* ------------------------------------------------------- debug mode */

#ifndef HARD_TSAN /* the children below fork; see the fork test */
/* Runs fn in a child; returns its wait status, its stderr in err[]. */
static int in_child(void (*fn)(void), char *err, size_t errlen)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ne(pid, -1);
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        fn();
        _exit(0);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while ((k = read(fds[0], err + got, errlen - 1 - got)) > 0 && got + (size_t)k < errlen - 1)
        got += (size_t)k;
    if (k > 0)
        got += (size_t)k;
    err[got] = '\0';
    close(fds[0]);
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    return status;
}

/* White-box: breaks invariant 4 of p's shard (its bytes_in_use). */
static void corrupt_shard_of(void *p, int64_t delta)
{
    bfc__rcu_lock();
    struct bfc__region *r = bfc__regionmap_lookup((uintptr_t)p);
    if (r) {
        bfc__lock(&r->owner->lock);
        r->owner->st.bytes_in_use += (uint64_t)delta;
        bfc__unlock(&r->owner->lock);
    }
    bfc__rcu_unlock();
}

static void child_env_debug_check(void)
{
    /* The process-wide context takes debug_check=true from SHARDBFC_CONF. */
    void *p = bfc_stream_alloc(NULL, 4096);
    if (!p)
        _exit(10);
    corrupt_shard_of(p, 256);
    (void)bfc_stream_alloc(NULL, 256); /* checks after the operation: aborts */
    _exit(11);
}

static void child_private_no_debug(void)
{
    bfc_config_t c = cfg_sim(LIMIT);
    bfc_ctx_t *ctx;
    if (bfc_ctx_create(&c, &ctx) != BFC_OK)
        _exit(20);
    void *p = bfc_ctx_alloc(ctx, NULL, 4096);
    if (!p)
        _exit(21);
    corrupt_shard_of(p, 256);
    void *q = bfc_ctx_alloc(ctx, NULL, 256); /* no check: goes on */
    if (!q || bfc_ctx_check(ctx) != BFC_ECORRUPT)
        _exit(22);
    corrupt_shard_of(p, -256);
    if (bfc_ctx_free(ctx, q, NULL) != BFC_OK || bfc_ctx_check(ctx) != BFC_OK)
        _exit(23);
    _exit(0);
}

/* debug_check without poison: the allocation and the free that the fast
 * paths would take (the stream's shard cached, an exact fit that needs no
 * split, a free between two live blocks) check too. */
static bfc_ctx_t *debug_only_ctx(void **q)
{
    bfc_config_t c = cfg_sim(LIMIT);
    c.debug_check = true;
    bfc_ctx_t *ctx;
    if (bfc_ctx_create(&c, &ctx) != BFC_OK)
        _exit(30);
    void *p = bfc_ctx_alloc(ctx, NULL, 4096);
    *q = bfc_ctx_alloc(ctx, NULL, 256);
    void *r = bfc_ctx_alloc(ctx, NULL, 256); /* q's neighbours stay live */
    void *s = bfc_ctx_alloc(ctx, NULL, 512);
    void *t = bfc_ctx_alloc(ctx, NULL, 256); /* and s's */
    if (!p || !*q || !r || !s || !t || bfc_ctx_free(ctx, s, NULL) != BFC_OK)
        _exit(31);
    corrupt_shard_of(p, 256);
    return ctx;
}

static void child_debug_fast_alloc(void)
{
    void *q;
    bfc_ctx_t *ctx = debug_only_ctx(&q);
    (void)bfc_ctx_alloc(ctx, NULL, 512); /* s's chunk again; checks after: aborts */
    _exit(12);
}

static void child_debug_fast_free(void)
{
    void *q;
    bfc_ctx_t *ctx = debug_only_ctx(&q);
    (void)bfc_ctx_free(ctx, q, NULL); /* checks after the operation: aborts */
    _exit(13);
}
#endif

START_TEST(test_debug_check_fast_paths)
{
#ifndef HARD_TSAN
    void (*const fns[])(void) = {child_debug_fast_alloc, child_debug_fast_free};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        char err[4096];
        int status = in_child(fns[i], err, sizeof err);
        ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
                      "%s: debug_check did not abort on a broken invariant (status %#x): %s",
                      i ? "free" : "alloc", status, err);
        ck_assert_msg(strstr(err, "debug_check: invariant 4") != NULL, "stderr: %s", err);
    }
#endif
}
END_TEST

START_TEST(test_debug_check_from_env)
{
    bfc_ctx_t *d = bfc_default_ctx();
    ck_assert_ptr_nonnull(d);
    bfc_config_t dc;
    ck_assert_int_eq(bfc_ctx_config(d, &dc), BFC_OK);
    ck_assert(dc.debug_check);
    /* Every operation of the service passes its check while consistent. */
    void *v[64];
    for (int i = 0; i < 64; i++) {
        v[i] = bfc_stream_alloc(NULL, (size_t)(i + 1) * 300);
        ck_assert_ptr_nonnull(v[i]);
    }
    for (int i = 0; i < 64; i += 2)
        ck_assert_int_eq(bfc_free(v[i]), BFC_OK);
    for (int i = 1; i < 64; i += 2)
        ck_assert_int_eq(bfc_free(v[i]), BFC_OK);
#ifndef HARD_TSAN
    char err[4096];
    int status = in_child(child_env_debug_check, err, sizeof err);
    ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
                  "debug_check did not abort on a broken invariant (status %#x): %s", status, err);
    ck_assert_msg(strstr(err, "debug_check: invariant 4") != NULL, "stderr: %s", err);
    /* The control: without debug_check the same corruption goes unnoticed
     * until someone calls bfc_ctx_check. */
    status = in_child(child_private_no_debug, err, sizeof err);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "control child: status %#x: %s", status, err);
#endif
    bfc_shutdown();
}
END_TEST

/* Runs fn with stderr redirected to a temporary file; returns its text. */
static void capture_stderr(void (*fn)(void *), void *arg, char *out, size_t outlen)
{
    FILE *tmp = tmpfile();
    ck_assert_ptr_nonnull(tmp);
    fflush(stderr);
    int saved = dup(2);
    ck_assert_int_ge(saved, 0);
    ck_assert_int_ge(dup2(fileno(tmp), 2), 0);
    fn(arg);
    fflush(stderr);
    ck_assert_int_ge(dup2(saved, 2), 0);
    close(saved);
    rewind(tmp);
    size_t n = fread(out, 1, outlen - 1, tmp);
    out[n] = '\0';
    fclose(tmp);
}

struct uaf {
    bfc_ctx_t *ctx;
    bfc_stream_t s;
    int writes;
    uint64_t errors;
};

/* Frees a block, writes into it, allocates the same size again (best fit
 * hands the same chunk back): the write after free is seen at reuse. */
static void uaf_run(void *arg)
{
    struct uaf *u = arg;
    void *guard = xalloc(u->ctx, u->s, 512);
    for (int i = 0; i < u->writes; i++) {
        unsigned char *p = xalloc(u->ctx, u->s, 4096);
        void *g2 = xalloc(u->ctx, u->s, 512); /* keeps p from merging forward */
        memset(p, 0x11, 4096);
        xfree(u->ctx, p, u->s);
        p[100 + i] = 0x00; /* the bug */
        unsigned char *q = xalloc(u->ctx, u->s, 4096);
        ck_assert_ptr_eq(q, p);
        xfree(u->ctx, q, u->s);
        xfree(u->ctx, g2, u->s);
    }
    xfree(u->ctx, guard, u->s);
    u->errors = st(u->ctx).num_poison_errors;
}

START_TEST(test_poison_detects_write_after_free)
{
    bfc_config_t c = cfg_sim(LIMIT);
    c.poison = true;
    bfc_ctx_t *ctx = ctx_new(&c);
    struct uaf u = { ctx, bfc_sim_stream_create(ctx), 0, 0 };
    /* A clean workload first: no false positives (splits, merges, cross-
     * stream frees, fences, region growth). */
    bfc_stream_t t = bfc_sim_stream_create(ctx);
    void *v[200];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 200; i++) {
            size_t n = (size_t)(i * 7919 % 20000) + 1;
            v[i] = xalloc(ctx, i % 2 ? u.s : t, n);
            memset(v[i], i, n);
        }
        if (round == 1)
            bfc_sim_stream_hold(ctx, t);
        for (int i = 0; i < 200; i += 2)
            xfree(ctx, v[i], i % 4 ? u.s : t);
        bfc_sim_stream_drain(ctx, t);
        for (int i = 1; i < 200; i += 2)
            xfree(ctx, v[i], u.s);
    }
    ck_assert_uint_eq(st(ctx).num_poison_errors, 0);
    /* Freed memory reads as poison. */
    unsigned char *p = xalloc(ctx, u.s, 1024);
    void *g = xalloc(ctx, u.s, 1024);
    memset(p, 0x77, 1024);
    xfree(ctx, p, u.s);
    ck_assert_uint_eq(diff_at(p, 0xDB, 1024), 1024);
    xfree(ctx, g, u.s);
    /* Three writes after free: three errors, one line on stderr. */
    char err[4096];
    u.writes = 3;
    capture_stderr(uaf_run, &u, err, sizeof err);
    ck_assert_uint_eq(u.errors, 3);
    ck_assert_msg(strstr(err, "written after free") != NULL, "stderr: %s", err);
    ck_assert_msg(strstr(strstr(err, "written after free") + 1, "written after free") == NULL,
                  "reported more than once: %s", err);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);

    /* Without poison the same bug goes unseen. */
    c.poison = false;
    ctx = ctx_new(&c);
    struct uaf u2 = { ctx, bfc_sim_stream_create(ctx), 2, 0 };
    capture_stderr(uaf_run, &u2, err, sizeof err);
    ck_assert_uint_eq(u2.errors, 0);
    ck_assert_str_eq(err, "");
    bfc_ctx_destroy(ctx);
}
END_TEST

/* -------------------------------------------------------------- fork */

/*
 * Fork while other threads use the library.  Three workers hammer two
 * contexts -- a tight one (24 MiB, garbage collection on: requests hit the
 * OOM slow path, shards reclaim each other's regions, regions are published
 * in and retired from the region map all the time) and a roomy one --
 * allocating, freeing on their own and on other streams (a cross-stream free
 * is a wait-free enqueue), naming streams with record_stream, holding and
 * draining a stream, trimming, reading statistics, and releasing and
 * recreating their streams.  Three more threads (one in sanitizer builds:
 * FORK_CHURNERS) keep starting short-lived threads whose first call is a
 * trim: a thread that has never entered RCU, so it registers with urcu-bp,
 * then takes the arenas lock.  (One such thread, pausing 200 us between
 * threads, met a fork in the middle of a registration once in about 75,000
 * forks; three without the pause, twice in 3,800 forks.  Such a child hung
 * until the library gated registration across fork: rcu.h.)  Meanwhile the
 * main thread forks again and again;
 * each child allocates, frees on its own and on other streams, trims,
 * releases a stream, checks both contexts and exits.
 *
 * Every wait is bounded.  A fork() that has not returned after FORK_BOUND_S
 * (its prepare handler is deadlocked) makes a watchdog thread print which
 * fork and abort; a child that has not exited after FORK_BOUND_S (it
 * inherited a lock or a queue in a state only a parent thread would have
 * changed) is killed and the test fails naming the fork.
 *
 * ThreadSanitizer refuses by default to let the child of a multithreaded
 * process start a thread (die_after_fork), and every child here must:
 * liburcu restarts its call_rcu thread and hash-table worker in the child.
 * TSan builds of this program therefore set die_after_fork=0 (below), and
 * with the sanitizer gate (below) run the same loop.
 */
#ifdef HARD_TSAN
const char *__tsan_default_options(void);
__attribute__((visibility("default"))) const char *__tsan_default_options(void)
{
    return "die_after_fork=0";
}
#endif

/* Under valgrind a child also runs memcheck's leak scan at exit, over
 * every readable mapping (the SIM device memory its parent had mapped
 * included): seconds, so the bound is longer there. */
#define FORK_BOUND_S (under_valgrind() ? 120 : 10)
#define FORK_WORKERS 3
/* Threads starting short-lived threads: three, back to back, in plain
 * builds; in sanitizer builds one, pausing CHURN_PAUSE_US between threads.
 * There a new thread's library calls (trim, statistics) run ungated beside
 * the forks, and their mallocs in the sanitizer's allocator at the instant
 * of a fork hang the child in the runtime (the sanitizer gate, below):
 * three churners made that 2 forks in 7,800 under ASan, where one pausing
 * churner had passed every sanitize run. */
#if defined(HARD_ASAN) || defined(HARD_TSAN)
#define FORK_CHURNERS 1
#define CHURN_PAUSE_US 200
#else
#define FORK_CHURNERS 3
#define CHURN_PAUSE_US 0
#endif
#define FORK_BLOCKS 24
#define FORK_STREAM_RELEASES 400 /* per worker: SIM's stream table is finite */

struct fork_world {
    bfc_ctx_t *tight, *roomy;
    bfc_stream_t spare[2]; /* streams that are only freed on, held and drained */
    atomic_bool stop;
};

struct forker {
    struct fork_world *w;
    unsigned id;
    unsigned long ops, ooms, releases, threads;
    int bad;
    char why[160];
};

struct fblock {
    void *p;
    bfc_ctx_t *ctx;
    bfc_stream_t s; /* allocated on (perhaps released since) */
};

/*
 * The sanitizer gate.  GCC 12's sanitizer runtimes do not hold their own
 * locks across fork(): a thread inside ASan's or TSan's allocator (a cache
 * refill) or thread registry (a thread starting or exiting) at the instant
 * of fork leaves that lock held in the child, which then hangs in its first
 * malloc or pthread_create -- a hang of the runtime, not of this library
 * (seen once in about 3000 forks under TSan, in the allocator).  So in
 * sanitizer builds the main thread takes `fork_gate` for writing across
 * fork(), and the other threads take it for reading around what mallocs
 * outside the library's locks: a thread starting or exiting, a cross-stream
 * free (its fence record may be new), a stream's release and its new shards,
 * an allocation in the tight context (the OOM slow path mallocs its report:
 * 1 hang in 8,550 ASan forks, in the runtime's allocator, while it ran
 * ungated).  Everything else -- roomy allocations, same-stream frees, trims,
 * statistics, record_stream, hold and drain, a new thread's library calls --
 * stays concurrent with the forks, and plain builds gate nothing.
 */
static const bool fork_gated =
#if defined(HARD_ASAN) || defined(HARD_TSAN)
    true;
#else
    false;
#endif
static pthread_rwlock_t fork_gate;

static void gate(int (*op)(pthread_rwlock_t *))
{
    if (fork_gated && op(&fork_gate) != 0)
        abort(); /* cannot fail on an initialised lock */
}

static void fork_bad(struct forker *f, const char *what, const char *err)
{
    if (f->bad++ == 0)
        snprintf(f->why, sizeof f->why, "thread %u: %s: %s", f->id, what, err);
}

static void fork_free(struct forker *f, struct fblock *b, bfc_stream_t on)
{
    int rc = bfc_ctx_free(b->ctx, b->p, on);
    if (rc != BFC_OK)
        fork_bad(f, "free", bfc_err_name(rc));
    b->p = NULL;
}

/* Stream s gets its shard in both contexts (the tight one may be full). */
static void new_shards(struct forker *f, bfc_stream_t s)
{
    for (int k = 0; k < 2; k++) {
        bfc_ctx_t *ctx = k ? f->w->tight : f->w->roomy;
        void *p = bfc_ctx_alloc(ctx, s, 256);
        int rc = p ? bfc_ctx_free(ctx, p, s) : bfc_last_error();
        if (rc != BFC_OK && !(k == 1 && !p && rc == BFC_ENOMEM))
            fork_bad(f, "alloc on a new stream", bfc_err_name(rc));
    }
}

static void *fork_worker(void *arg)
{
    struct forker *f = arg;
    struct fork_world *w = f->w;
    struct fblock v[FORK_BLOCKS];
    memset(v, 0, sizeof v);
    bfc_stream_t s = bfc_sim_stream_create(w->roomy);
    gate(pthread_rwlock_rdlock); /* the new shards (see the sanitizer gate) */
    new_shards(f, s);
    gate(pthread_rwlock_unlock);
    unsigned x = 0x9e3779b9u * (f->id + 1);
    bool held = false;
    while (!atomic_load(&w->stop)) {
        x = x * 1103515245u + 12345u;
        unsigned r = x >> 8;
        struct fblock *b = &v[r % FORK_BLOCKS];
        f->ops++;
        if (b->p) {
            /* One free in four on another stream than the block's. */
            bool cross = (r >> 5) % 4 == 0;
            if (cross)
                gate(pthread_rwlock_rdlock);
            fork_free(f, b, cross ? w->spare[(r >> 7) & 1] : b->s);
            if (cross)
                gate(pthread_rwlock_unlock);
        } else {
            bool tight = (r >> 9) & 1;
            /* Up to 3 MiB: regions come and go, and in the tight context
             * most requests past the first few take the OOM slow path. */
            size_t n = (size_t)((x >> 3) % (3 * MiB)) + 1;
            b->ctx = tight ? w->tight : w->roomy;
            b->s = s;
            if (tight)
                gate(pthread_rwlock_rdlock); /* its OOM report mallocs */
            b->p = bfc_ctx_alloc(b->ctx, s, n);
            if (tight)
                gate(pthread_rwlock_unlock);
            if (!b->p) {
                int rc = bfc_last_error();
                if (tight && rc == BFC_ENOMEM)
                    f->ooms++;
                else
                    fork_bad(f, tight ? "alloc (tight)" : "alloc (roomy)", bfc_err_name(rc));
            } else if ((r >> 11) % 8 == 0) {
                int rc = bfc_ctx_record_stream(b->ctx, b->p, w->spare[(r >> 14) & 1]);
                if (rc != BFC_OK)
                    fork_bad(f, "record_stream", bfc_err_name(rc));
            }
        }
        if (f->ops % 64 == 0 && bfc_ctx_trim((f->ops / 64) & 1 ? w->tight : w->roomy) != BFC_OK)
            fork_bad(f, "trim", "failed");
        if (f->ops % 50 == 0) {
            bfc_stats_t sst;
            int rc = bfc_ctx_stats(w->tight, &sst);
            if (rc != BFC_OK)
                fork_bad(f, "stats", bfc_err_name(rc));
        }
        if (f->id == 0 && f->ops % 100 == 0) {
            /* Frees fenced on a busy stream stay pending meanwhile. */
            if (held)
                bfc_sim_stream_drain(w->roomy, w->spare[0]);
            else
                bfc_sim_stream_hold(w->roomy, w->spare[0]);
            held = !held;
        }
        if (f->ops % 500 == 0 && f->releases < FORK_STREAM_RELEASES) {
            /* The stream goes away: half of its blocks are freed first, the
             * others later, on the released stream or another one.  The new
             * stream gets its shards at once. */
            gate(pthread_rwlock_rdlock);
            for (int i = 0; i < FORK_BLOCKS; i += 2)
                if (v[i].p && v[i].s == s)
                    fork_free(f, &v[i], s);
            (void)bfc_ctx_stream_release(w->tight, s); /* BFC_EINVAL if it has no shard there */
            (void)bfc_ctx_stream_release(w->roomy, s);
            s = bfc_sim_stream_create(w->roomy);
            new_shards(f, s);
            gate(pthread_rwlock_unlock);
            f->releases++;
        }
    }
    for (int i = 0; i < FORK_BLOCKS; i++)
        if (v[i].p)
            fork_free(f, &v[i], v[i].s);
    if (held)
        bfc_sim_stream_drain(w->roomy, w->spare[0]);
    return NULL;
}

struct ephemeral {
    struct forker *f;
    atomic_int phase; /* 1: running its calls, 2: done, 3: may exit */
};

/* A new thread's first call into the library is a trim. */
static void *fork_ephemeral(void *arg)
{
    struct ephemeral *e = arg;
    struct forker *f = e->f;
    atomic_store(&e->phase, 1);
    if (bfc_ctx_trim(f->w->tight) != BFC_OK)
        fork_bad(f, "trim in a new thread", "failed");
    bfc_stats_t sst;
    int rc = bfc_ctx_stats(f->w->roomy, &sst);
    if (rc != BFC_OK)
        fork_bad(f, "stats in a new thread", bfc_err_name(rc));
    atomic_store(&e->phase, 2);
    while (fork_gated && atomic_load(&e->phase) != 3)
        sched_yield(); /* the churner holds the gate for our exit */
    return NULL;
}

static void *fork_churner(void *arg)
{
    struct forker *f = arg;
    while (!atomic_load(&f->w->stop)) {
        struct ephemeral e = { .f = f };
        pthread_t t;
        gate(pthread_rwlock_rdlock); /* the thread's start */
        int rc = pthread_create(&t, NULL, fork_ephemeral, &e);
        if (rc != 0) {
            fork_bad(f, "pthread_create", strerror(rc));
            gate(pthread_rwlock_unlock);
            break;
        }
        if (fork_gated) {
            while (atomic_load(&e.phase) == 0)
                sched_yield();
            gate(pthread_rwlock_unlock);
            while (atomic_load(&e.phase) != 2)
                sched_yield();
            gate(pthread_rwlock_rdlock); /* its exit */
            atomic_store(&e.phase, 3);
        }
        rc = pthread_join(t, NULL);
        gate(pthread_rwlock_unlock);
        if (rc != 0) {
            fork_bad(f, "pthread_join", strerror(rc));
            break;
        }
        f->threads++;
        if (CHURN_PAUSE_US)
            usleep(CHURN_PAUSE_US);
    }
    return NULL;
}

/* The child: 0, or the step that failed. */
static int fork_child(struct fork_world *w)
{
    bfc_stream_t s = bfc_sim_stream_create(w->roomy);
    if (!s)
        return 10;
    for (int i = 0; i < 48; i++) {
        bfc_stream_t on = i % 2 ? s : NULL, other = i % 2 ? NULL : s;
        void *p = bfc_ctx_alloc(w->roomy, on, (size_t)(i % 13 + 1) * 64 * KiB);
        if (!p)
            return 11;
        memset(p, i, 4096);
        /* One free in three on the other stream: into the owner's
         * remote-free queue, drained by its next allocation. */
        if (bfc_ctx_free(w->roomy, p, i % 3 ? on : other) != BFC_OK)
            return 12;
    }
    /* The tight context may be short of memory here (the parent's workers'
     * blocks stay allocated in the child), but every call answers. */
    bfc_stats_t before, after;
    if (bfc_ctx_stats(w->tight, &before) != BFC_OK)
        return 13;
    for (int i = 0; i < 8; i++) {
        void *p = bfc_ctx_alloc(w->tight, s, (size_t)(i + 1) * 128 * KiB);
        if (!p) {
            if (bfc_last_error() != BFC_ENOMEM)
                return 14;
            continue;
        }
        if (bfc_ctx_free(w->tight, p, i % 2 ? s : NULL) != BFC_OK)
            return 15;
    }
    if (bfc_ctx_trim(w->tight) != BFC_OK || bfc_ctx_trim(w->roomy) != BFC_OK)
        return 16;
    if (bfc_ctx_stream_release(w->roomy, s) != BFC_OK)
        return 17;
    if (bfc_ctx_check(w->tight) != BFC_OK)
        return 18;
    if (bfc_ctx_check(w->roomy) != BFC_OK)
        return 19;
    if (bfc_ctx_stats(w->tight, &after) != BFC_OK || after.bytes_in_use != before.bytes_in_use)
        return 20;
    return 0;
}

static _Atomic uint64_t fork_since_ns; /* when the fork() in progress began; 0: none */
static atomic_int fork_number;
static atomic_bool fork_watch_stop;

static void *fork_watchdog(void *arg)
{
    (void)arg;
    while (!atomic_load(&fork_watch_stop)) {
        uint64_t t = atomic_load(&fork_since_ns);
        if (t && now_ns() - t > (uint64_t)FORK_BOUND_S * 1000000000u) {
            fprintf(stderr,
                    "test_hardening: fork %d has not returned after %d s: a fork handler is deadlocked\n",
                    atomic_load(&fork_number), FORK_BOUND_S);
            abort();
        }
        usleep(20000);
    }
    return NULL;
}

/* Waits for child k with the bound; "" or what went wrong in msg. */
/* A child that hangs: where?  Its one thread's stack on stderr, through
 * gdb where the machine has it (a hang seen once in a loop of thousands
 * is otherwise lost with the child). */
static void fork_dump_stack(pid_t pid, int k)
{
    char cmd[256];
    if (system("command -v gdb >/dev/null 2>&1") != 0) {
        fprintf(stderr, "fork %d: child %d hangs (no gdb for its stack)\n", k, (int)pid);
        return;
    }
    snprintf(cmd, sizeof cmd,
             "gdb -p %d -batch -nx -ex 'thread apply all bt' </dev/null 2>&1 | grep -E '^(#|Thread)' >&2",
             (int)pid);
    fprintf(stderr, "fork %d: child %d hangs; its stack:\n", k, (int)pid);
    if (system(cmd) != 0)
        fprintf(stderr, "fork %d: gdb could not attach\n", k);
}

static void fork_wait(pid_t pid, int k, char *msg, size_t len)
{
    uint64_t t0 = now_ns();
    msg[0] = '\0';
    for (;;) {
        int status = 0;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            if (WIFSIGNALED(status))
                snprintf(msg, len, "fork %d: child killed by signal %d", k, WTERMSIG(status));
            else if (WEXITSTATUS(status) != 0)
                snprintf(msg, len, "fork %d: child failed at step %d (see fork_child)", k, WEXITSTATUS(status));
            return;
        }
        if (r < 0 && errno != EINTR) {
            snprintf(msg, len, "fork %d: waitpid: %s", k, strerror(errno));
            return;
        }
        if (now_ns() - t0 > (uint64_t)FORK_BOUND_S * 1000000000u) {
            fork_dump_stack(pid, k);
            kill(pid, SIGKILL);
            (void)waitpid(pid, &status, 0);
            snprintf(msg, len,
                     "fork %d: child did not exit within %d s (it inherited a lock or queue left held by a "
                     "parent thread): killed",
                     k, FORK_BOUND_S);
            return;
        }
        usleep(200);
    }
}

static void fork_loop(int nworkers, int nforks)
{
    struct fork_world w;
    memset(&w, 0, sizeof w);
    bfc_config_t c = cfg_sim(24 * MiB);
    c.initial_region = 1 * MiB;
    c.garbage_collection = true;
    w.tight = ctx_new(&c);
    /* Never short of memory, whatever the workers do: with regions doubling
     * per shard and released streams' shards pinned by a few live blocks, a
     * few GiB can be held by a handful of blocks (SIM memory costs nothing
     * until touched).  Under valgrind 4 GiB: an expandable arena reserves
     * its limit in addresses per shard, and memcheck refuses 64 GiB. */
    c = cfg_sim(under_valgrind() ? 4 * GiB : 64 * GiB);
    c.initial_region = 1 * MiB;
    w.roomy = ctx_new(&c);
    w.spare[0] = bfc_sim_stream_create(w.roomy);
    w.spare[1] = bfc_sim_stream_create(w.roomy);
    atomic_store(&w.stop, false);

    pthread_rwlockattr_t ga;
    ck_assert_int_eq(pthread_rwlockattr_init(&ga), 0);
    /* Writer first: the forks must not wait behind a stream of readers. */
    ck_assert_int_eq(pthread_rwlockattr_setkind_np(&ga, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP), 0);
    ck_assert_int_eq(pthread_rwlock_init(&fork_gate, &ga), 0);
    ck_assert_int_eq(pthread_rwlockattr_destroy(&ga), 0);

    struct forker f[FORK_WORKERS + FORK_CHURNERS];
    pthread_t th[FORK_WORKERS + FORK_CHURNERS], dog;
    int nthreads = nworkers ? nworkers + FORK_CHURNERS : 0;
    for (int i = 0; i < nthreads; i++) {
        f[i] = (struct forker){ .w = &w, .id = (unsigned)i };
        ck_assert_int_eq(pthread_create(&th[i], NULL, i < nworkers ? fork_worker : fork_churner, &f[i]), 0);
    }
    atomic_store(&fork_watch_stop, false);
    atomic_store(&fork_since_ns, 0);
    ck_assert_int_eq(pthread_create(&dog, NULL, fork_watchdog, NULL), 0);

    char msg[256];
    unsigned x = 12345;
    uint64_t fork_ns = 0, child_ns = 0;
    for (int k = 0; k < nforks; k++) {
        x = x * 1103515245u + 12345u;
        usleep((x >> 8) % 1500); /* lands at different points of the workers' paths */
        atomic_store(&fork_number, k);
        gate(pthread_rwlock_wrlock);
        uint64_t began = now_ns();
        atomic_store(&fork_since_ns, began);
        pid_t pid = fork();
        if (pid == 0)
            _exit(fork_child(&w));
        atomic_store(&fork_since_ns, 0);
        gate(pthread_rwlock_unlock);
        ck_assert_msg(pid > 0, "fork %d: %s", k, strerror(errno));
        uint64_t forked = now_ns();
        fork_wait(pid, k, msg, sizeof msg);
        fork_ns += forked - began;
        child_ns += now_ns() - forked;
        if (msg[0]) {
            /* No joins: a deadlocked worker would hang them. */
            atomic_store(&w.stop, true);
            ck_abort_msg("%s", msg);
        }
    }
    atomic_store(&w.stop, true);
    atomic_store(&fork_watch_stop, true);
    ck_assert_int_eq(pthread_join(dog, NULL), 0);
    for (int i = 0; i < nthreads; i++) {
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
        ck_assert_msg(f[i].bad == 0, "%d bad results; first: %s", f[i].bad, f[i].why);
    }
    unsigned long ops = 0, ooms = 0, releases = 0, threads = 0;
    for (int i = 0; i < nworkers; i++) {
        ops += f[i].ops;
        ooms += f[i].ooms;
        releases += f[i].releases;
    }
    for (int i = nworkers; i < nthreads; i++)
        threads += f[i].threads;
    printf("fork loop: %d forks beside %d workers (%lu operations, %lu OOMs in the tight context, %lu stream "
           "releases, the roomy one's reserve peaking at %lu MiB) and %lu short-lived threads; fork() %.1f ms, "
           "child %.1f ms on average\n",
           nforks, nworkers, ops, ooms, releases, (unsigned long)(st(w.roomy).peak_bytes_reserved / MiB),
           threads, fork_ns / 1e6 / nforks, child_ns / 1e6 / nforks);
    for (int i = 0; i < nworkers; i++)
        ck_assert_uint_gt(f[i].ops, 0);
    for (int i = nworkers; i < nthreads; i++)
        ck_assert_uint_gt(f[i].threads, 0);
    bfc_sim_stream_drain(w.roomy, w.spare[0]);
    bfc_sim_stream_drain(w.roomy, w.spare[1]);
    ck_assert_uint_eq(st(w.tight).bytes_in_use, 0);
    ck_assert_uint_eq(st(w.roomy).bytes_in_use, 0);
    xcheck(w.tight);
    xcheck(w.roomy);
    bfc_ctx_destroy(w.tight);
    bfc_ctx_destroy(w.roomy);
    ck_assert_int_eq(pthread_rwlock_destroy(&fork_gate), 0);
}

static bool stress_long(void)
{
    const char *m = getenv("SHARDBFC_STRESS");
    return m && strcmp(m, "long") == 0;
}

/* Only the main thread and liburcu's own threads: the fork handlers alone. */
START_TEST(test_fork_quiet)
{
    fork_loop(0, 20);
}
END_TEST

/* 300 forks under `make check`, 1000 under `make stress`; half of that in
 * sanitizer builds, where a fork and its child cost 3-10 times more.
 * SHARDBFC_FORKS=N sets the number (`make valgrind` runs 20). */
START_TEST(test_fork_while_allocating)
{
    int n = stress_long() ? 1000 : 300;
#if defined(HARD_TSAN) || defined(HARD_ASAN)
    n /= 2;
#endif
    const char *env = getenv("SHARDBFC_FORKS");
    if (env && atoi(env) > 0)
        n = atoi(env);
    fork_loop(FORK_WORKERS, n);
}
END_TEST

/*
 * A fork at the library's first use.  The fork handlers were registered at
 * the first context, and a fork whose prepare handlers had begun before
 * that ran none of them: when it caught the set-up making liburcu's
 * call_rcu data, the child inherited call_rcu_mutex locked and hung on it
 * in its first bfc_ctx_create -- in about one run in four where four
 * threads started creating contexts as the main thread forked.  The
 * handlers are now registered when the library is loaded.  The scenario
 * needs a fresh process, so the test runs this binary again in that mode
 * (first_use_child), 40 times.
 */
static atomic_bool first_use_stop;

static void *first_use_worker(void *arg)
{
    (void)arg;
    while (!atomic_load(&first_use_stop)) {
        bfc_config_t c;
        bfc_config_init(&c);
        c.backend = BFC_BACKEND_SIM;
        c.memory_limit = 32 * MiB;
        bfc_ctx_t *ctx;
        if (bfc_ctx_create(&c, &ctx) != BFC_OK)
            continue;
        void *p = bfc_ctx_alloc(ctx, NULL, 1000);
        (void)bfc_ctx_free(ctx, p, NULL);
        bfc_ctx_destroy(ctx);
    }
    return NULL;
}

static int first_use_child(void)
{
    alarm(30); /* a hang of this process ends as SIGALRM too */
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        if (pthread_create(&th[i], NULL, first_use_worker, NULL) != 0)
            return 2;
    int bad = 0;
    for (int k = 0; k < 3; k++) {
        pid_t pid = fork();
        if (pid < 0)
            return 3;
        if (pid == 0) {
            alarm(10); /* a hang ends as SIGALRM */
            bfc_config_t c;
            bfc_config_init(&c);
            c.backend = BFC_BACKEND_SIM;
            bfc_ctx_t *ctx;
            if (bfc_ctx_create(&c, &ctx) != BFC_OK)
                _exit(4);
            void *p = bfc_ctx_alloc(ctx, NULL, 100);
            _exit(p && bfc_ctx_free(ctx, p, NULL) == BFC_OK ? 0 : 5);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            bad = 1;
    }
    atomic_store(&first_use_stop, true);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    return bad;
}

/* This program's own file, from argv[0] (/proc/self/exe is valgrind's
 * tool under `make valgrind`, which cannot be run by itself). */
static char self_exe[PATH_MAX] = "/proc/self/exe";

/* Runs this binary again in `mode` (a fresh process: main's first
 * argument); its wait status. */
static int run_self(const char *mode)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        execl(self_exe, "test_hardening", mode, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return status;
}

START_TEST(test_fork_at_first_use)
{
#if defined(HARD_TSAN) || defined(HARD_ASAN)
    /* The workers allocate through the sanitizer's malloc (the metadata
     * there is libc's) as the main thread forks, and a child forked while
     * one held its allocator lock hangs in it (see the fork loop): that
     * would be the sanitizer's hang, not the library's. */
    return;
#endif
    for (int run = 0; run < 40; run++) {
        int status = run_self("first-use-fork");
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                      "run %d: a child forked at the first use failed or hung (status %#x)", run, status);
    }
}
END_TEST

/*
 * A fork while another thread makes the process's first host call: host
 * set-up loads the hwloc topology, and hwloc holds a lock of its own while
 * it does.  The child makes its own host calls.  Set-up ran in
 * pthread_once, which glibc restarts in a child forked while it runs: the
 * child ran it again from the start and waited for ever on the lock hwloc
 * had held at the fork (10 of 200 fresh processes, a fork within 3 ms of
 * the first call).  The fork handlers now wait for the set-up.  Set-up
 * runs once per process, so each round is this binary run again in that
 * mode (host_setup_child).
 */
static void *first_host_call(void *arg)
{
    void *h = bfc_host_alloc(1000);
    return h && bfc_host_free(h) == BFC_OK ? NULL : arg;
}

static int host_setup_child(void)
{
    alarm(30); /* a hang of this process ends as SIGALRM too */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned seed = (unsigned)ts.tv_nsec ^ (unsigned)getpid();
    pthread_t t;
    if (pthread_create(&t, NULL, first_host_call, &seed) != 0)
        return 2;
    usleep((useconds_t)(rand_r(&seed) % 3000));
    pid_t pid = fork();
    if (pid < 0)
        return 3;
    if (pid == 0) {
        alarm(10); /* a hang ends as SIGALRM */
        void *h = bfc_host_alloc(4000);
        _exit(h && bfc_host_free(h) == BFC_OK ? 0 : 5);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    void *bad = NULL;
    pthread_join(t, &bad);
    if (WIFSIGNALED(status))
        return WTERMSIG(status) == SIGALRM ? 6 : 7;
    return bad ? 8 : WEXITSTATUS(status);
}

START_TEST(test_fork_during_host_setup)
{
#if defined(HARD_TSAN) || defined(HARD_ASAN)
    /* hwloc allocates through the sanitizer's malloc as the main thread
     * forks, and a child forked while it held that allocator's lock hangs
     * in it: the sanitizer's hang, not the library's (see the fork loop). */
    return;
#endif
    for (int run = 0; run < 150; run++) {
        int status = run_self("host-setup-fork");
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                      "run %d: %s (status %#x)", run,
                      WIFEXITED(status) && WEXITSTATUS(status) == 6 ? "the child forked during host set-up hung"
                                                                    : "a host call failed",
                      status);
    }
}
END_TEST

/* ------------------------------------------------------- cancellation
 *
 * A thread cancelled while the library writes to a file it was given (a
 * dump into a pipe nobody reads yet, a trace into one) is blocked in
 * write(2), a cancellation point, under the library's locks.  Cancellation
 * must wait until the call is done: a thread that died there would leave
 * its locks held, and every later call waiting on them for good. */

struct cancel_arg {
    bfc_ctx_t *ctx;
    bfc_stream_t s;
    FILE *f;    /* the dump's file (the pipe's write end) */
    bool trace; /* else a dump */
    atomic_bool returned; /* the dump returned: the call did not act on the request */
};

static void *cancel_victim(void *v)
{
    struct cancel_arg *a = v;
    if (!a->trace) {
        (void)bfc_ctx_dump(a->ctx, a->f);
        atomic_store(&a->returned, true);
        for (;;)
            pthread_testcancel();
    }
    /* Trace events fill the thread's buffer, whose flush writes to the
     * pipe under the trace file's lock (sometimes under the arena's). */
    for (;;) {
        void *p = bfc_ctx_alloc(a->ctx, a->s, 4096);
        if (p)
            (void)bfc_ctx_free(a->ctx, p, a->s);
        pthread_testcancel();
    }
    return NULL;
}

/* What a later caller does: every lock of the context, the stream's own,
 * the trace's file. */
static void *cancel_probe(void *v)
{
    struct cancel_arg *a = v;
    int rc = bfc_ctx_check(a->ctx);
    void *p = bfc_ctx_alloc(a->ctx, a->s, 4096);
    if (!p || bfc_ctx_free(a->ctx, p, a->s) != BFC_OK)
        rc = BFC_ECORRUPT;
    if (a->trace && bfc_ctx_trace_stop(a->ctx) != BFC_OK)
        rc = BFC_ECORRUPT;
    return (void *)(intptr_t)(rc == BFC_OK ? 1 : 2);
}

/* Reads what is in the pipe (non-blocking); false at end of file. */
static bool drain_pipe(int fd)
{
    char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n > 0)
            continue;
        return !(n == 0);
    }
}

/* Joins t within about `ms` milliseconds, reading the pipe meanwhile. */
static bool join_draining(pthread_t t, int fd, int ms, void **res)
{
    struct timespec ms1 = {0, 1000 * 1000};
    for (int i = 0; i < ms; i++) {
        (void)drain_pipe(fd);
        if (pthread_tryjoin_np(t, res) == 0)
            return true;
        nanosleep(&ms1, NULL);
    }
    return false;
}

static void cancel_while_writing(bool trace)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=256M");
    bfc_stream_t s = new_stream(ctx);
    /* Enough chunks that the dump is far larger than the pipe. */
    enum { N = 3000 };
    static void *v[N];
    for (int i = 0; i < N; i++)
        v[i] = xalloc(ctx, s, 256 + (size_t)i % 7 * 256);
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    ck_assert_int_ne(fcntl(fds[0], F_SETFL, O_NONBLOCK), -1);
    struct cancel_arg a = {.ctx = ctx, .s = s, .trace = trace};
    if (trace) {
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fds[1]);
        ck_assert_int_eq(bfc_ctx_trace_start(ctx, path), BFC_OK);
    } else {
        a.f = fdopen(fds[1], "w");
        ck_assert_ptr_nonnull(a.f);
    }
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, cancel_victim, &a), 0);
    /* Let the pipe fill: the victim then waits in write(2). */
    struct timespec ms100 = {0, 100 * 1000 * 1000};
    nanosleep(&ms100, NULL);
    ck_assert_int_eq(pthread_cancel(t), 0);
    nanosleep(&ms100, NULL);
    /* Now read: a victim that kept its locks finishes its write and is
     * cancelled after the call; one cancelled inside is gone already. */
    void *res = NULL;
    ck_assert_msg(join_draining(t, fds[0], 5000, &res), "the cancelled thread did not end");
    ck_assert_ptr_eq(res, PTHREAD_CANCELED);
    /* No call acts on a cancellation request (shardbfc.h): the dump
     * returned, its last flush included, and the thread ended after it. */
    ck_assert(trace || atomic_load(&a.returned));
    pthread_t probe;
    ck_assert_int_eq(pthread_create(&probe, NULL, cancel_probe, &a), 0);
    void *ok = NULL;
    ck_assert_msg(join_draining(probe, fds[0], 3000, &ok),
                  "a later call waited for ever: the cancelled thread left the library's locks held");
    ck_assert_ptr_eq(ok, (void *)(intptr_t)1);
    if (a.f)
        fclose(a.f);
    else
        close(fds[1]);
    close(fds[0]);
    for (int i = 0; i < N; i++)
        xfree(ctx, v[i], s);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}

START_TEST(test_cancel_in_dump)
{
    cancel_while_writing(false);
}
END_TEST

START_TEST(test_cancel_in_trace_write)
{
    cancel_while_writing(true);
}
END_TEST

/* A call made with a cancellation already pending (requested while the
 * thread had cancellation off, then turned back on): it must return, the
 * cancellation acting at the thread's next cancellation point after it. */
struct pending {
    void (*call)(struct pending *);
    bfc_ctx_t *ctx;
    bfc_stream_t s;
    FILE *f;
    void *p;
    bool returned;
    /* The OOM callback case: what a thread-specific-data destructor of
     * the thread saw, once the thread was gone from the library. */
    bool tsd;
    pid_t pid; /* the fork case's child */
    int info_rc;
    size_t info_size;
    pthread_mutex_t m;
    pthread_cond_t c;
    int phase;
    int old_state; /* not a local: the thread's frame is unwound by the
                    * cancellation, and AddressSanitizer would keep its
                    * redzones poisoned for the exit handlers below it */
};

/* Scribbles over the stack below the caller (a dead frame's bytes); not a
 * tail call, so each level has a frame of its own. */
static __attribute__((noinline)) int stack_scribble(int depth)
{
    volatile char junk[4096];
    memset((char *)junk, 0x5A, sizeof junk);
    return depth > 0 ? stack_scribble(depth - 1) + junk[depth] : junk[0];
}

/* Runs where the thread's dead frames were: at its exit, from the top of
 * its stack. */
static void pending_tsd(void *v)
{
    struct pending *x = v;
    (void)stack_scribble(16);
    bfc_oom_info_t i;
    x->info_rc = bfc_ctx_oom_info(x->ctx, &i);
    x->info_size = i.size;
}

static pthread_key_t pending_key;

static void pending_key_init(void)
{
    ck_assert_int_eq(pthread_key_create(&pending_key, pending_tsd), 0);
}

static void *pending_main(void *v)
{
    struct pending *x = v;
    (void)pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &x->old_state);
    pthread_mutex_lock(&x->m);
    x->phase = 1;
    pthread_cond_broadcast(&x->c);
    while (x->phase != 2)
        pthread_cond_wait(&x->c, &x->m);
    pthread_mutex_unlock(&x->m);
    if (x->tsd)
        (void)pthread_setspecific(pending_key, x);
    (void)pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &x->old_state); /* now pending */
    x->call(x);
    x->returned = true;
    pthread_testcancel();
    return NULL;
}

/* Runs x->call on a thread with a cancellation pending; true when the
 * call returned before it acted. */
static bool call_cancel_pending(struct pending *x)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    ck_assert_int_eq(pthread_once(&once, pending_key_init), 0);
    ck_assert_int_eq(pthread_mutex_init(&x->m, NULL), 0);
    ck_assert_int_eq(pthread_cond_init(&x->c, NULL), 0);
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, pending_main, x), 0);
    pthread_mutex_lock(&x->m);
    while (x->phase != 1)
        pthread_cond_wait(&x->c, &x->m);
    ck_assert_int_eq(pthread_cancel(t), 0);
    x->phase = 2;
    pthread_cond_broadcast(&x->c);
    pthread_mutex_unlock(&x->m);
    void *res = NULL;
    ck_assert_int_eq(pthread_join(t, &res), 0);
    ck_assert_ptr_eq(res, PTHREAD_CANCELED);
    pthread_cond_destroy(&x->c);
    pthread_mutex_destroy(&x->m);
    return x->returned;
}

static void call_dump(struct pending *x)
{
    (void)bfc_ctx_dump(x->ctx, x->f);
}

static void call_snapshot(struct pending *x)
{
    (void)bfc_ctx_snapshot_json(x->ctx, x->f);
}

static void call_alloc(struct pending *x)
{
    x->p = bfc_ctx_alloc(x->ctx, x->s, 64 * KiB);
}

static void call_create(struct pending *x)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 64 * MiB;
    (void)bfc_ctx_create(&c, &x->ctx);
}

static void call_destroy(struct pending *x)
{
    bfc_ctx_destroy(x->ctx);
}

/* The whole of what f holds. */
static char *file_text(FILE *f)
{
    long n = ftell(f);
    ck_assert_int_gt(n, 0);
    char *t = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(t);
    rewind(f);
    ck_assert_uint_eq(fread(t, 1, (size_t)n, f), (size_t)n);
    t[n] = '\0';
    return t;
}

/* Dumps and snapshots into an unbuffered file (every line a write(2), a
 * cancellation point): whole, the cancellation after them. */
START_TEST(test_cancel_pending_dump_snapshot)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=64M");
    bfc_stream_t s = new_stream(ctx);
    void *p = xalloc(ctx, s, 4096);
    for (int snap = 0; snap <= 1; snap++) {
        struct pending x = {.call = snap ? call_snapshot : call_dump, .ctx = ctx};
        x.f = tmpfile();
        ck_assert_ptr_nonnull(x.f);
        setvbuf(x.f, NULL, _IONBF, 0);
        ck_assert_msg(call_cancel_pending(&x), "%s acted on the pending cancellation", snap ? "snapshot" : "dump");
        char *t = file_text(x.f);
        size_t n = strlen(t);
        if (snap)
            ck_assert_msg(n >= 3 && strcmp(t + n - 3, "]}\n") == 0, "the snapshot was cut short: ...%s",
                          t + (n > 40 ? n - 40 : 0));
        else
            ck_assert_msg(strstr(t, "\nStats: ") && t[n - 1] == '\n', "the dump was cut short");
        free(t);
        fclose(x.f);
    }
    xfree(ctx, p, s);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* poison=true: an allocation that finds its block written after free
 * reports on stderr (a write(2)) under the arena's lock. */
START_TEST(test_cancel_pending_poison_report)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=64M,poison=true,vmm=off");
    bfc_stream_t s = new_stream(ctx);
    char *p = xalloc(ctx, s, 64 * KiB);
    xfree(ctx, p, s);
    p[100] = 1; /* written after free */
    struct pending x = {.call = call_alloc, .ctx = ctx, .s = s};
    ck_assert_msg(call_cancel_pending(&x), "the allocation acted on the pending cancellation in its poison report");
    ck_assert_ptr_eq(x.p, p);
    ck_assert_uint_eq(st(ctx).num_poison_errors, 1);
    xfree(ctx, x.p, s);
    xcheck(ctx); /* every lock: none was left held */
    bfc_ctx_destroy(ctx);
}
END_TEST

/* The slow path's retry_ms sleeps (nanosleep, a cancellation point). */
START_TEST(test_cancel_pending_slow_path)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=4M,allow_growth=false,retry_ms=30");
    bfc_stream_t s = new_stream(ctx);
    void *big = xalloc(ctx, s, 4 * MiB);
    struct pending x = {.call = call_alloc, .ctx = ctx, .s = s};
    ck_assert_msg(call_cancel_pending(&x), "the slow path acted on the pending cancellation");
    ck_assert_ptr_null(x.p);
    xfree(ctx, big, s);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* The process's first context (its set-up joins a probe thread) and a
 * destroy with a trace running (a grace period, the trace's writes). */
START_TEST(test_cancel_pending_create_destroy)
{
    struct pending x = {.call = call_create};
    ck_assert_msg(call_cancel_pending(&x), "bfc_ctx_create acted on the pending cancellation");
    ck_assert_ptr_nonnull(x.ctx);
    bfc_stream_t s = new_stream(x.ctx);
    ck_assert_int_eq(bfc_ctx_trace_start(x.ctx, "/dev/null"), BFC_OK);
    void *p = xalloc(x.ctx, s, 4096);
    xfree(x.ctx, p, s);
    struct pending y = {.call = call_destroy, .ctx = x.ctx};
    ck_assert_msg(call_cancel_pending(&y), "bfc_ctx_destroy acted on the pending cancellation");
}
END_TEST

/* A callback cancelled at its own cancellation point: the thread's exit
 * handlers may still ask for the report (the callback's frame, gone with
 * it, must not be the library's any more). */
static int oom_cb_writes(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream, const bfc_stats_t *summary, void *arg)
{
    (void)ctx, (void)size, (void)stream, (void)summary, (void)arg;
    int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, "x", 1); /* the pending cancellation acts here */
        close(fd);
    }
    return 0;
}

START_TEST(test_cancel_in_oom_callback)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=4M,allow_growth=false");
    bfc_stream_t s = new_stream(ctx);
    void *big = xalloc(ctx, s, 4 * MiB);
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, oom_cb_writes, NULL), BFC_OK);
    struct pending x = {.call = call_alloc, .ctx = ctx, .s = s, .tsd = true, .info_rc = -1};
    ck_assert_msg(!call_cancel_pending(&x), "the callback's write did not act on the cancellation");
    ck_assert_int_eq(x.info_rc, BFC_OK);
    ck_assert_uint_eq(x.info_size, 64 * KiB);
    /* The next failure on this thread calls the callback as usual. */
    ck_assert_int_eq(bfc_ctx_set_oom_callback(ctx, NULL, NULL), BFC_OK);
    xfree(ctx, big, s);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* fork() from a thread with a cancellation pending: the library's prepare
 * handler waits for liburcu's threads in poll(), a cancellation point,
 * with the library's locks taken; fork must return, and every lock with
 * it. */
static void call_fork(struct pending *x)
{
    x->pid = fork();
    if (x->pid == 0)
        _exit(bfc_ctx_check(x->ctx) == BFC_OK ? 0 : 1);
}

static void *fork_probe(void *v)
{
    bfc_ctx_t *ctx = v;
    bool ok = bfc_ctx_check(ctx) == BFC_OK;
    bfc_ctx_t *c2 = NULL;
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    ok = ok && bfc_ctx_create(&c, &c2) == BFC_OK;
    if (c2)
        bfc_ctx_destroy(c2);
    return (void *)(intptr_t)(ok ? 1 : 2);
}

START_TEST(test_cancel_pending_fork)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=64M");
    bfc_stream_t s = new_stream(ctx);
    void *p = xalloc(ctx, s, 4096);
    struct pending x = {.call = call_fork, .ctx = ctx, .pid = -1};
    ck_assert_msg(call_cancel_pending(&x), "fork() acted on the pending cancellation in the library's fork handler");
    ck_assert_int_gt(x.pid, 0);
    int status;
    ck_assert_int_eq(waitpid(x.pid, &status, 0), x.pid);
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* Every lock the handlers took is free again. */
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, fork_probe, ctx), 0);
    void *ok = NULL;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 10;
    ck_assert_msg(pthread_timedjoin_np(t, &ok, &deadline) == 0, "a later call waited for ever: fork left locks held");
    ck_assert_ptr_eq(ok, (void *)(intptr_t)1);
    xfree(ctx, p, s);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* exit() from a thread with a cancellation pending, a trace running: the
 * library's exit handler stops the trace (a grace period, the file's
 * close); the process must exit, the trace complete. */
static void call_exit(struct pending *x)
{
    (void)x;
    exit(7);
}

START_TEST(test_cancel_pending_exit_with_trace)
{
    char path[] = "/tmp/shardbfc-cancel-exit-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        bfc_config_t c;
        bfc_config_init(&c);
        c.backend = BFC_BACKEND_SIM;
        bfc_ctx_t *ctx = NULL;
        if (bfc_ctx_create(&c, &ctx) != BFC_OK || bfc_ctx_trace_start(ctx, path) != BFC_OK)
            _exit(2);
        for (int i = 0; i < 10; i++) {
            void *q = bfc_ctx_alloc(ctx, NULL, 4096);
            if (!q || bfc_ctx_free(ctx, q, NULL) != BFC_OK)
                _exit(2);
        }
        struct pending x = {.call = call_exit, .ctx = ctx};
        (void)call_cancel_pending(&x); /* returns only if exit() was cut short */
        _exit(3);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 7,
                  "exit() did not end the process (status %#x): the exit handler acted on the cancellation", status);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char line[256];
    int rows = 0;
    while (fgets(line, sizeof line, f))
        rows++;
    fclose(f);
    unlink(path);
    ck_assert_int_ge(rows, 1 + 20); /* the header, 10 allocations and 10 frees (and growth) */
}
END_TEST

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "first-use-fork") == 0)
        return first_use_child();
    if (argc > 1 && strcmp(argv[1], "host-setup-fork") == 0)
        return host_setup_child();
    if (argc > 0 && strchr(argv[0], '/') && !realpath(argv[0], self_exe))
        snprintf(self_exe, sizeof self_exe, "/proc/self/exe");
    /* Before anything reads it (the service reads it once). */
    setenv("SHARDBFC_CONF", ENV_CONF, 1);
    Suite *s = suite_create("hardening");
    TCase *tc = tcase_create("bad input");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_bad_input_table, 0, NCASES);
    tcase_add_test(tc, test_free_on_released_stream);
    tcase_add_test(tc, test_double_free_race);
    tcase_add_test(tc, test_null_arguments);
    tcase_add_test(tc, test_service_after_shutdown_and_destroy);
    tcase_add_test(tc, test_bad_config_strings);
    tcase_add_test(tc, test_edge_configs_work);
    suite_add_tcase(s, tc);
    TCase *dbg = tcase_create("debug");
    tcase_set_timeout(dbg, 60);
    tcase_add_test(dbg, test_debug_check_from_env);
    tcase_add_test(dbg, test_debug_check_fast_paths);
    tcase_add_test(dbg, test_poison_detects_write_after_free);
    suite_add_tcase(s, dbg);
    TCase *cn = tcase_create("cancel");
    tcase_set_timeout(cn, 60);
    tcase_add_test(cn, test_cancel_in_dump);
    tcase_add_test(cn, test_cancel_in_trace_write);
    tcase_add_test(cn, test_cancel_pending_dump_snapshot);
    tcase_add_test(cn, test_cancel_pending_poison_report);
    tcase_add_test(cn, test_cancel_pending_slow_path);
    tcase_add_test(cn, test_cancel_pending_create_destroy);
    tcase_add_test(cn, test_cancel_in_oom_callback);
    tcase_add_test(cn, test_cancel_pending_fork);
    tcase_add_test(cn, test_cancel_pending_exit_with_trace);
    suite_add_tcase(s, cn);
    /* A child forked while other threads hold allocator locks must not
     * inherit them locked (the library's fork handlers take every lock). */
    {
        TCase *fk = tcase_create("fork");
        tcase_set_timeout(fk, stress_long() ? 1800 : 300);
        tcase_add_test(fk, test_fork_quiet);
        tcase_add_test(fk, test_fork_at_first_use);
        tcase_add_test(fk, test_fork_during_host_setup);
        tcase_add_test(fk, test_fork_while_allocating);
        suite_add_tcase(s, fk);
    }
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
