/*
 * test_safety.c -- stream safety wherever memory changes hands, black-box
 * (public API only, SIM backend).
 *
 * The rule under test: a block freed on stream F is reusable at once by
 * later allocations on F, but by any other stream only after the work F had
 * queued before the free has completed; bfc_ctx_record_stream(p, R) adds R's
 * work up to the free.  Inside one shard the chunk fences give this.  The
 * paths on which memory leaves a shard must give it too: a large block's
 * region going back to the region pool, a released stream's regions,
 * regions reclaimed by another shard under a tight limit, garbage
 * collection, trim.  On a GPU a breach is a silent data race (the next
 * kernel overwrites memory a queued kernel still reads); on SIM it is
 * observable, because a held stream's events stay incomplete until the test
 * drains it, so "memory reached another stream too early" is "an allocation
 * on another stream returned an address inside the freed range before the
 * drain".
 *
 * Four parts:
 *
 * 1. Named reproductions ("handoff" cases).  Each frees a block under a
 *    fence that cannot complete yet -- its own stream held (own), a recorded
 *    stream held (record), or a cross-stream free on a held stream (cross) --
 *    and then takes it away from its shard by one path: a large block's own
 *    region (large), bfc_ctx_stream_release (release), reclaim by another
 *    shard under a 4 MiB limit (reclaim), and the same with retry_ms=2000
 *    while a thread drains the guarding stream after 300 ms (reclaim_wait).
 *    Every stream but the guarding one must be kept off the range until the
 *    drain; a failed allocation is always acceptable; after the drain the
 *    memory must be usable again.
 *
 * 2. Emptied pools and TensorFlow's layout (pool cases): before it reports
 *    out of memory a shard gives its fully free regions (and free region
 *    tails) back to the pool, where they coalesce, so any request that fits
 *    the free memory succeeds -- unless that memory is still fenced by a
 *    held stream.  With allow_growth=false one stream gets one region of the
 *    whole limit and exact splits, as TensorFlow's allocator does, and a
 *    second stream is served from the free tail.
 *
 * 3. A randomized model (model cases).  Four SIM streams, each idle or held.
 *    A free of block B (requested range [p, p+n)) on stream F leaves a guard
 *    on that range for F if F is held at that moment, and one for every
 *    stream named with bfc_ctx_record_stream(B, R) before the free that is
 *    held at that moment; draining X lifts X's guards.  A successful
 *    allocation on stream A whose requested range overlaps a live guard of a
 *    stream X != A is a violation.  Also checked: live blocks never overlap
 *    (allocated chunk sizes), 256-byte alignment, bfc_ctx_check every few
 *    operations, and at the end (everything drained, freed and trimmed)
 *    bytes_in_use == 0.  A failed allocation is always allowed.  The model
 *    knows nothing of shards, so it holds whatever path the allocator takes.
 *    Operations: alloc (log-uniform 256 B .. limit/8, now and then a large
 *    one or more than the limit), free on the allocating stream, free on
 *    another stream, record_stream, hold, drain, stream release, trim.
 *    Configurations: the product of limits 16M (tight: forces reclaim and
 *    release), 48M, 64M, 128M, 256M; allow_growth on/off; garbage collection
 *    on/off; large_alloc 0 / default / 4M; retry_ms=0; and, for expandable
 *    arenas at 16M and 64M, an address space that holds only two
 *    reservations of the limit and a quarter more (a "tight_va," prefix:
 *    the SIM backend's ceiling on reserved addresses), so that later shards
 *    reserve less than the limit, and some none; and, at the same limits,
 *    expandable arenas whose decay gives back unused memory after 1 ms,
 *    looked at every 8 allocations.  Each run is one
 *    (configuration, seed): single-threaded and seeded.  The operations
 *    follow the seed and the allocator's answers; those can differ slightly
 *    between runs (the library defers some work, such as reclaiming a
 *    retired shard, to its RCU thread, and the backend's mapping addresses
 *    vary), so a re-run retraces a failing run most of the time, not
 *    always: the report's history shows the failure either way.
 *
 *    Coverage is counted, because a model test that never moves memory
 *    between streams proves nothing: "moved" counts allocations on A that
 *    overlap a range last freed from a block owned by another stream, and
 *    "moved after guard" those where the range had been guarded by a stream
 *    other than A when it was freed (the guard was lifted by a drain before
 *    the reuse: the interesting case).  The tight configurations must move
 *    memory; the totals are printed in the log.
 *
 *    A second model case runs with metadata fault injection on
 *    (bfc_sim_fail_meta_every): any call may then fail with a status, a
 *    free that fails leaves the block live (it is freed again later), a
 *    record_stream that fails records nothing, but nothing may crash,
 *    bfc_ctx_check stays BFC_OK and the rule still holds.  Injection is
 *    switched off for each run's final clean-up and at the end.
 *
 *    On a violation the run stops, the report names the configuration, the
 *    seed, the operation index and the history of the offending range, and
 *    the other configurations still run (one violation per configuration is
 *    reported; the case fails at the end).  To re-run one case:
 *      SHARDBFC_SAFETY_CONF='<spec>' SHARDBFC_SAFETY_SEED=<n> \
 *      [SHARDBFC_SAFETY_OPS=<ops>] [SHARDBFC_SAFETY_META=<every>] \
 *      CK_RUN_CASE=model ./tests/test_safety
 *    (CK_RUN_CASE=model_faults for the fault-injection case.)
 *    SHARDBFC_SAFETY_KEEP_GOING=1 lets each run go on past its violations
 *    (the offending block is given back at once) and counts them.
 *
 * 4. Concurrent departures (departures case): real threads make two or
 *    three departures of one stream id at the same moment, the newest
 *    behind held work, while another stream takes memory (see
 *    test_departures_race below).
 *
 * Size: under `make check` the model runs 2 seeds x 1500 operations per
 * configuration, and 1 seed x 2000 operations for a third of them under
 * faults (~10 s in all); SHARDBFC_STRESS=long (`make stress`) runs 6 seeds
 * x 12000 operations, and 4 x 8000 under faults (a few minutes).  The
 * departures case runs three configurations for 1,500 to 3,000 cycles
 * (~10 s), and under `make stress` two seeds of each for 10,000 to 20,000
 * (~2.5 min).
 */
#include "testutil.h"

#include "ctx.h" /* ctx->be, for the SIM address-space ceiling (tight_va) */

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


static bool g_long; /* SHARDBFC_STRESS=long */

/* ------------------------------------------------------------- helpers */

static bool overlaps(const void *a, size_t an, const void *b, size_t bn)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + bn && y < x + an;
}

/* Touches the first and last page of [p, p+n): the memory is host memory on
 * SIM, so a block the allocator handed out must be writable. */
static void touch(void *p, size_t n, int v)
{
    size_t k = n < 4096 ? n : 4096;
    memset(p, v, k);
    memset((char *)p + n - k, v, k);
}

/* ---------------------------------------------- 1. named reproductions */

enum path {
    PATH_LARGE,        /* a large block's own region goes back to the pool */
    PATH_RELEASE,      /* the owner stream's shard is released */
    PATH_RECLAIM,      /* another shard needs the memory under a tight limit, retry_ms=0 */
    PATH_RECLAIM_WAIT, /* the same with retry_ms=2000 and a drain 300 ms later */
};

enum fence {
    FENCE_OWN,    /* freed on its own stream s1 while s1 is held */
    FENCE_RECORD, /* recorded on s3, s3 held, freed on an idle s1 */
    FENCE_CROSS,  /* allocated on s1, freed on s2 while s2 is held */
};

struct drainer {
    bfc_ctx_t *ctx;
    bfc_stream_t s;
    atomic_bool draining;
};

/* Sleeps 300 ms, then announces and performs the drain.  The flag is set
 * just BEFORE bfc_sim_stream_drain: an allocation that observed the drain
 * (the SIM event's completion, an acquire load pairing with the drain's
 * release RMW) therefore also observes the flag, so "overlapping and the
 * flag still clear" can only mean the allocation did not wait. */
static void *drainer_main(void *arg)
{
    struct drainer *d = arg;
    struct timespec t = { 0, 300 * 1000 * 1000 };
    while (nanosleep(&t, &t) != 0 && errno == EINTR)
        ; /* interrupted: sleep the rest */
    /* release: pairs with the acquire load in handoff() after the allocation
     * returns (and is sequenced before the drain's own release RMW). */
    atomic_store_explicit(&d->draining, true, memory_order_release);
    bfc_sim_stream_drain(d->ctx, d->s);
    return NULL;
}

static const char *path_name[] = { "large", "release", "reclaim", "reclaim_wait" };
static const char *fence_name[] = { "own", "record", "cross" };

/* One reproduction: block p of n bytes on s1, freed under `fence`, then
 * moved off its shard by `path`.  Every stream that is not the guarding one
 * is kept off [p, p+n) until the guarding stream is drained. */
static void handoff(enum path path, enum fence fence)
{
    const char *spec = NULL;
    size_t n = 0;
    switch (path) {
    case PATH_LARGE:
        /* 64 MiB >= large_alloc (32 MiB default): a region of its own. */
        spec = "memory_limit=1G";
        n = 64 * MiB;
        break;
    case PATH_RELEASE:
        spec = "memory_limit=1G";
        n = 1 * MiB;
        break;
    case PATH_RECLAIM:
        spec = "memory_limit=4M,garbage_collection=true,retry_ms=0";
        n = 3 * MiB;
        break;
    case PATH_RECLAIM_WAIT:
        spec = "memory_limit=4M,garbage_collection=true,retry_ms=2000";
        n = 3 * MiB;
        break;
    }
    const char *what_path = path_name[path], *what_fence = fence_name[fence];
    bfc_ctx_t *ctx = ctx_spec(spec);
    bfc_stream_t s[4] = { NULL, new_stream(ctx), new_stream(ctx), new_stream(ctx) };
    void *p = xalloc(ctx, s[1], n);
    touch(p, n, 0x11);

    int guard = 0, taker = 0;
    switch (fence) {
    case FENCE_OWN:
        bfc_sim_stream_hold(ctx, s[1]);
        xfree(ctx, p, s[1]);
        guard = 1;
        taker = 2;
        break;
    case FENCE_RECORD:
        ck_assert_int_eq(bfc_ctx_record_stream(ctx, p, s[3]), BFC_OK);
        bfc_sim_stream_hold(ctx, s[3]);
        xfree(ctx, p, s[1]);
        guard = 3;
        taker = 2;
        break;
    case FENCE_CROSS:
        bfc_sim_stream_hold(ctx, s[2]);
        xfree(ctx, p, s[2]);
        guard = 2;
        taker = 3;
        break;
    }
    if (path == PATH_RELEASE)
        ck_assert_int_eq(bfc_ctx_stream_release(ctx, s[1]), BFC_OK);

    void *keep[8];
    int keep_s[8], nkeep = 0;
    if (path != PATH_RECLAIM_WAIT) {
        /* While the guard is held: each other stream, the taker first. */
        int order[3] = { taker, 0, 0 }, no = 1;
        for (int k = 1; k <= 3; k++)
            if (k != guard && k != taker)
                order[no++] = k;
        for (int j = 0; j < no; j++) {
            int o = order[j];
            void *q = bfc_ctx_alloc(ctx, s[o], n);
            if (!q)
                continue; /* failing is always acceptable */
            ck_assert_msg(!overlaps(q, n, p, n),
                          "%s/%s: alloc(%zu) on s%d = %p overlaps the block %p freed under s%d's fence "
                          "while s%d is still held",
                          what_path, what_fence, n, o, q, p, guard, guard);
            touch(q, n, 0x20 + o);
            if (path == PATH_RECLAIM) {
                /* Give the next stream the same chance (o is idle). */
                xfree(ctx, q, s[o]);
            } else {
                keep[nkeep] = q;
                keep_s[nkeep++] = o;
            }
        }
        xcheck(ctx);
        bfc_sim_stream_drain(ctx, s[guard]);
        /* The fence completed: the memory must be usable again. */
        void *q = bfc_ctx_alloc(ctx, s[taker], n);
        ck_assert_msg(q != NULL, "%s/%s: alloc(%zu) on s%d after s%d was drained failed: %s", what_path, what_fence, n,
                      taker, guard, bfc_err_name(bfc_last_error()));
        touch(q, n, 0x30);
        keep[nkeep] = q;
        keep_s[nkeep++] = taker;
    } else {
        struct drainer d = { .ctx = ctx, .s = s[guard] };
        atomic_init(&d.draining, false);
        pthread_t th;
        int rc = pthread_create(&th, NULL, drainer_main, &d);
        ck_assert_msg(rc == 0, "pthread_create: %d", rc);
        double t0 = now_s();
        void *q = bfc_ctx_alloc(ctx, s[taker], n);
        int err = bfc_last_error();
        double waited = now_s() - t0;
        /* acquire: pairs with the release store in drainer_main. */
        bool drained = atomic_load_explicit(&d.draining, memory_order_acquire);
        rc = pthread_join(th, NULL);
        ck_assert_msg(rc == 0, "pthread_join: %d", rc);
        ck_assert_msg(q != NULL,
                      "%s/%s: alloc(%zu) on s%d with retry_ms=2000 failed (%s) after %.3f s, though s%d was "
                      "drained after 0.3 s",
                      what_path, what_fence, n, taker, bfc_err_name(err), waited, guard);
        ck_assert_msg(!overlaps(q, n, p, n) || drained,
                      "%s/%s: alloc(%zu) on s%d = %p overlaps the block %p freed under s%d's fence and returned "
                      "after %.3f s, before s%d was drained",
                      what_path, what_fence, n, taker, q, p, guard, waited, guard);
        touch(q, n, 0x30);
        keep[nkeep] = q;
        keep_s[nkeep++] = taker;
    }
    xcheck(ctx);
    for (int k = 1; k <= 3; k++)
        bfc_sim_stream_drain(ctx, s[k]);
    for (int j = 0; j < nkeep; j++)
        xfree(ctx, keep[j], s[keep_s[j]]);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    bfc_stats_t c = st(ctx);
    ck_assert_uint_eq(c.bytes_in_use, 0);
    ck_assert_uint_eq(c.num_pending_frees, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}

#define HANDOFF_TEST(P, F, path, fence)                                                                                \
    START_TEST(test_##P##_##F)                                                                                         \
    {                                                                                                                  \
        handoff(path, fence);                                                                                          \
    }                                                                                                                  \
    END_TEST

HANDOFF_TEST(large, own, PATH_LARGE, FENCE_OWN)
HANDOFF_TEST(large, record, PATH_LARGE, FENCE_RECORD)
HANDOFF_TEST(large, cross, PATH_LARGE, FENCE_CROSS)
HANDOFF_TEST(release, own, PATH_RELEASE, FENCE_OWN)
HANDOFF_TEST(release, record, PATH_RELEASE, FENCE_RECORD)
HANDOFF_TEST(release, cross, PATH_RELEASE, FENCE_CROSS)
HANDOFF_TEST(reclaim, own, PATH_RECLAIM, FENCE_OWN)
HANDOFF_TEST(reclaim, record, PATH_RECLAIM, FENCE_RECORD)
HANDOFF_TEST(reclaim, cross, PATH_RECLAIM, FENCE_CROSS)
HANDOFF_TEST(reclaim_wait, own, PATH_RECLAIM_WAIT, FENCE_OWN)
HANDOFF_TEST(reclaim_wait, record, PATH_RECLAIM_WAIT, FENCE_RECORD)
HANDOFF_TEST(reclaim_wait, cross, PATH_RECLAIM_WAIT, FENCE_CROSS)

/* ------------------------------------- 2. emptied pools, TensorFlow layout */

/* Allocates blocks of `each` on s until the allocator refuses (at most
 * `max`); returns how many. */
static int fill(bfc_ctx_t *ctx, bfc_stream_t s, size_t each, void **v, int max)
{
    int k = 0;
    while (k < max) {
        void *p = bfc_ctx_alloc(ctx, s, each);
        if (!p) {
            ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
            break;
        }
        v[k++] = p;
    }
    return k;
}

/* A fixed pool, emptied: the whole of it serves one request again. */
START_TEST(test_fixed_pool_emptied)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=4M,allow_growth=false");
    bfc_stream_t s = new_stream(ctx);
    void *v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = xalloc(ctx, s, 1 * MiB);
        touch(v[i], 1 * MiB, i + 1);
    }
    for (int i = 0; i < 4; i++)
        xfree(ctx, v[i], s);
    void *p = bfc_ctx_alloc(ctx, s, 4 * MiB);
    ck_assert_msg(p != NULL, "alloc(4 MiB) on the emptied 4 MiB pool failed: %s", bfc_err_name(bfc_last_error()));
    touch(p, 4 * MiB, 9);
    xcheck(ctx);
    xfree(ctx, p, s);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

#define GROW_SPEC "memory_limit=8M,allow_growth=true,initial_region=1M,vmm=off"

/* Growth from 1 MiB regions: one shard ends up with several regions; freed,
 * they must serve a request of the whole limit. */
START_TEST(test_growth_pool_emptied)
{
    bfc_ctx_t *ctx = ctx_spec(GROW_SPEC);
    bfc_stream_t s = new_stream(ctx);
    void *v[64];
    int k = fill(ctx, s, 1 * MiB, v, 64);
    ck_assert_int_ge(k, 4);
    ck_assert_msg(sst(ctx, s).num_regions >= 2, "scenario too easy: the shard holds one region");
    for (int i = 0; i < k; i++)
        xfree(ctx, v[i], s);
    void *p = bfc_ctx_alloc(ctx, s, 8 * MiB);
    ck_assert_msg(p != NULL, "alloc(8 MiB) after freeing %d blocks of the 8 MiB limit failed: %s", k,
                  bfc_err_name(bfc_last_error()));
    touch(p, 8 * MiB, 7);
    xcheck(ctx);
    xfree(ctx, p, s);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* Shard A filled the limit and freed everything on its own stream.  A idle:
 * B gets the whole limit.  A held: B gets nothing (retry_ms=0) until A is
 * drained. */
static void across_shards(const char *spec, size_t limit, size_t each, bool held)
{
    bfc_ctx_t *ctx = ctx_spec(spec);
    bfc_stream_t a = new_stream(ctx), b = new_stream(ctx);
    void *v[64];
    int k = fill(ctx, a, each, v, 64);
    ck_assert_int_ge(k, 4);
    if (held)
        bfc_sim_stream_hold(ctx, a);
    for (int i = 0; i < k; i++)
        xfree(ctx, v[i], a);
    if (held) {
        void *q = bfc_ctx_alloc(ctx, b, limit);
        ck_assert_msg(q == NULL, "alloc(limit) on B = %p: memory A freed while A is held reached B", q);
        ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
        xcheck(ctx);
        bfc_sim_stream_drain(ctx, a);
    }
    void *p = bfc_ctx_alloc(ctx, b, limit);
    ck_assert_msg(p != NULL, "alloc(%zu) on B after A freed its %d blocks (A idle) failed: %s", limit, k,
                  bfc_err_name(bfc_last_error()));
    touch(p, limit, 5);
    xcheck(ctx);
    xfree(ctx, p, b);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}

START_TEST(test_growth_across_shards_idle)
{
    across_shards(GROW_SPEC, 8 * MiB, 1 * MiB, false);
}
END_TEST

START_TEST(test_growth_across_shards_held)
{
    across_shards(GROW_SPEC, 8 * MiB, 1 * MiB, true);
}
END_TEST

START_TEST(test_fixed_across_shards_idle)
{
    across_shards("memory_limit=4M,allow_growth=false", 4 * MiB, 1 * MiB, false);
}
END_TEST

START_TEST(test_fixed_across_shards_held)
{
    across_shards("memory_limit=4M,allow_growth=false", 4 * MiB, 1 * MiB, true);
}
END_TEST

/* allow_growth=false, one stream: one region of the whole limit, split
 * exactly, blocks at its front in order (TensorFlow's layout). */
static void tf_layout(const char *spec)
{
    bfc_ctx_t *ctx = ctx_spec(spec);
    bfc_stream_t s = new_stream(ctx);
    enum { N = 10 };
    void *v[N];
    for (int i = 0; i < N; i++)
        v[i] = xalloc(ctx, s, 10 * MiB);
    for (int i = 0; i < N; i++)
        ck_assert_msg((uintptr_t)v[i] == (uintptr_t)v[0] + (uintptr_t)i * 10 * MiB,
                      "block %d at %p, expected base %p + %d * 10 MiB", i, v[i], v[0], i);
    bfc_stats_t c = st(ctx);
    ck_assert_uint_eq(c.bytes_in_use, 100 * MiB);
    ck_assert_uint_eq(c.num_regions, 1);
    bfc_stats_t o = sst(ctx, s);
    ck_assert_uint_eq(o.num_regions, 1);
    ck_assert_uint_eq(o.bytes_reserved, 256 * MiB);
    xcheck(ctx);
    for (int i = 0; i < N; i++)
        xfree(ctx, v[i], s);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}

START_TEST(test_tf_layout_large_off)
{
    tf_layout("memory_limit=256M,allow_growth=false,large_alloc=0");
}
END_TEST

START_TEST(test_tf_layout_default)
{
    tf_layout("memory_limit=256M,allow_growth=false");
}
END_TEST

/* allow_growth=false: s1's shard holds the one region of the whole limit;
 * s2 (s1 idle) is served from its free tail. */
START_TEST(test_fixed_second_stream)
{
    bfc_ctx_t *ctx = ctx_spec("memory_limit=64M,allow_growth=false");
    bfc_stream_t s1 = new_stream(ctx), s2 = new_stream(ctx);
    void *a = xalloc(ctx, s1, 1 * MiB);
    bfc_stats_t o = sst(ctx, s1);
    ck_assert_uint_eq(o.num_regions, 1);
    ck_assert_uint_eq(o.bytes_reserved, 64 * MiB);
    void *b = bfc_ctx_alloc(ctx, s2, 16 * MiB);
    ck_assert_msg(b != NULL, "alloc(16 MiB) on a second stream failed: %s", bfc_err_name(bfc_last_error()));
    ck_assert(!overlaps(a, 1 * MiB, b, 16 * MiB));
    memset(a, 0xA1, 1 * MiB);
    memset(b, 0xB2, 16 * MiB);
    ck_assert_int_eq(((unsigned char *)a)[1 * MiB - 1], 0xA1);
    ck_assert_int_eq(((unsigned char *)b)[0], 0xB2);
    xcheck(ctx);
    xfree(ctx, a, s1);
    xfree(ctx, b, s2);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/*
 * A stream used after its release.  Its shard is retired, but the stream
 * may still run work on the shard's live blocks; memory leaving the shard
 * later carries an event recorded on the stream at that departure, so the
 * work keeps the block from other streams until it ends -- whether the
 * block is then freed on the stream itself, named for it with
 * record_stream and freed elsewhere, or just freed elsewhere (the stream
 * last used it: memory changes hands only after that stream's work).  A
 * version that recorded the stream's fence once, at the release, and
 * none at later departures (so as not to touch a stream destroyed since)
 * handed the block over in all three cases.
 */
enum released_use { FREED_ON_IT, RECORDED_FOR_IT, FREED_ELSEWHERE };

static void released_then_used(const char *spec, enum released_use how)
{
    static const char *const what[] = { "freed on a", "recorded for a, freed on b", "freed on b" };
    bfc_ctx_t *ctx = ctx_spec(spec);
    bfc_stream_t a = new_stream(ctx), b = new_stream(ctx), c = new_stream(ctx);
    void *p = xalloc(ctx, a, 8 * MiB);
    touch(p, 8 * MiB, 1);
    if (how == RECORDED_FOR_IT)
        ck_assert_int_eq(bfc_ctx_record_stream(ctx, p, a), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, a), BFC_OK); /* a idle: the release's event completes */
    bfc_sim_stream_hold(ctx, a);                               /* then work on a uses p */
    xfree(ctx, p, how == FREED_ON_IT ? a : b);
    void *q = bfc_ctx_alloc(ctx, c, 8 * MiB);
    ck_assert_msg(q == NULL, "%s, %s: alloc(8 MiB) on c = %p while a, released, still runs work on the block", spec,
                  what[how], q);
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    xcheck(ctx);
    bfc_sim_stream_drain(ctx, a);
    q = bfc_ctx_alloc(ctx, c, 8 * MiB);
    ck_assert_msg(q != NULL, "%s, %s: alloc(8 MiB) on c after a drained failed: %s", spec, what[how],
                  bfc_err_name(bfc_last_error()));
    touch(q, 8 * MiB, 2);
    xfree(ctx, q, c);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}

START_TEST(test_released_stream_used)
{
    static const char *const specs[] = { "memory_limit=8M,vmm=off", "memory_limit=8M,vmm=off,allow_growth=false",
                                         "memory_limit=8M,vmm=on" };
    for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++)
        for (int how = FREED_ON_IT; how <= FREED_ELSEWHERE; how++)
            released_then_used(specs[i], (enum released_use)how);
}
END_TEST

/* ------------------------------------------------ 3. the randomized model */

enum {
    NSTREAM = 4,
    /* With threads (test_model_threads), three more stream numbers: the
     * per-thread stream of a worker thread the model drives, the stream of
     * a worker that exited while that stream was busy (held, not drained
     * since: at most one at a time), and those of exited workers whose
     * streams are idle for good. */
    W_PT = NSTREAM,
    W_DEAD,
    W_GONE,
    NSTREAM_ALL,
    MAXLIVE = 96,
    MAXFREED = 4096, /* freed ranges remembered (guards and history) */
    LOGN = 8192,     /* operations remembered for a failure report */
    CHECK_EVERY = 64,
};

struct mlive {
    uintptr_t p;
    size_t n, asz;
    int owner;
    unsigned rec; /* streams named by record_stream (never the owner) */
    uint64_t op;
    unsigned char tag;
};

struct mfreed {
    uintptr_t p;
    size_t n;
    int owner, freer;
    unsigned guard;     /* streams whose guard is live */
    unsigned had_guard; /* streams that guarded it when freed */
    uint64_t op;
    uint64_t alloc_op; /* when the block was allocated */
};

enum evkind { EV_ALLOC, EV_AFAIL, EV_FREE, EV_FFAIL, EV_RECORD, EV_RFAIL, EV_HOLD, EV_DRAIN, EV_RELEASE, EV_TRIM, EV_EXIT };
static const char *ev_name[] = { "alloc",         "alloc-failed", "free",  "free-failed", "record",
                                 "record-failed", "hold",         "drain", "release",     "trim",
                                 "thread-exit" };

struct mev {
    uint64_t op;
    uint8_t kind;
    int8_t s, s2;
    int rc;
    uintptr_t p;
    size_t n;
    unsigned guard;
};

struct counters {
    uint64_t runs, ops, allocs, ooms, frees, free_errors, cross_frees, records, holds, drains, releases, trims, checks,
        moved, moved_guarded, meta_failures, violations, exits, exits_busy, moved_exited;
};

/* One model run's whole state. */
struct model {
    bfc_ctx_t *ctx;
    bfc_stream_t *s;
    const char *spec;
    bfc_config_t cfg;
    uint64_t seed, rng, op;
    uint64_t last_release[NSTREAM + 1], last_trim; /* op + 1 of the last one; 0: none */
    unsigned meta_every;                           /* 0: no fault injection */
    unsigned held;
    /* test_model_threads: stream W_PT is the per-thread stream of `worker`
     * (started at its first use); w_handle names it from this thread (a
     * SIM record, for draining it once the worker has exited: W_DEAD's is
     * dead_handle). */
    bool threads, worker_up;
    struct step_thread worker;
    bfc_stream_t w_handle, dead_handle;
    struct mlive live[MAXLIVE];
    int nlive;
    struct mfreed *freed;
    int nfreed;
    struct mev *log;
    uint64_t nlog;
    struct counters c;
    bool keep_going; /* SHARDBFC_SAFETY_KEEP_GOING: count violations, do not stop */
    bool stop;       /* the run ends after this operation */
    uint64_t nviol, viol_op;
    char why[1024];
};

static uint64_t rnd(struct model *m)
{
    uint64_t z = (m->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rnd_below(struct model *m, uint64_t n)
{
    return n ? rnd(m) % n : 0;
}

static void log_ev(struct model *m, enum evkind k, int s, int s2, int rc, uintptr_t p, size_t n, unsigned guard)
{
    m->log[m->nlog++ % LOGN] = (struct mev){ m->op, (uint8_t)k, (int8_t)s, (int8_t)s2, rc, p, n, guard };
}

static bool range_overlap(uintptr_t a, size_t an, uintptr_t b, size_t bn)
{
    return a < b + bn && b < a + an;
}

/* "s0,s2" for a stream mask; s4 is the worker's per-thread stream, s5
 * an exited worker's busy one, s6 exited workers' idle ones. */
static const char *mask_str(unsigned mask, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int k = 0; k < NSTREAM_ALL; k++)
        if (mask >> k & 1)
            at += (size_t)snprintf(buf + at, len - at, "%ss%d", at ? "," : "", k);
    return at ? buf : "none";
}

/* The history of [lo, lo+len) (its last 24 events), and the holds, drains
 * and releases of `streams` from their last hold before op `since` on. */
static void print_history(struct model *m, uintptr_t lo, size_t len, unsigned streams, uint64_t since)
{
    uint64_t first = m->nlog > LOGN ? m->nlog - LOGN : 0;
    for (uint64_t i = m->nlog; i-- > first;) {
        const struct mev *e = &m->log[i % LOGN];
        if (e->op <= since && e->kind == EV_HOLD && e->s >= 0 && (streams >> e->s & 1)) {
            since = e->op;
            break;
        }
    }
    uint64_t idx[40];
    int k = 0, on_range = 0;
    for (uint64_t i = m->nlog; i-- > first && k < 40;) {
        const struct mev *e = &m->log[i % LOGN];
        bool r = e->n && range_overlap(e->p, e->n, lo, len) && on_range < 24;
        bool st = e->op >= since && e->s >= 0 && (streams >> e->s & 1) &&
                  (e->kind == EV_HOLD || e->kind == EV_DRAIN || e->kind == EV_RELEASE);
        on_range += r;
        if (r || st)
            idx[k++] = i;
    }
    fprintf(stderr, "  history (oldest first; sN = stream N):\n");
    while (k-- > 0) {
        const struct mev *e = &m->log[idx[k] % LOGN];
        fprintf(stderr, "    op %6" PRIu64 ": %-13s s%d", e->op, ev_name[e->kind], e->s);
        if (e->kind == EV_FREE || e->kind == EV_FFAIL)
            fprintf(stderr, " (owner s%d)", e->s2);
        if (e->kind == EV_RECORD || e->kind == EV_RFAIL)
            fprintf(stderr, " names s%d", e->s2);
        if (e->n)
            fprintf(stderr, " [%#" PRIxPTR ", +%zu)", e->p, e->n);
        char g[32];
        if (e->kind == EV_FREE)
            fprintf(stderr, " guarded by %s", mask_str(e->guard, g, sizeof g));
        if (e->rc)
            fprintf(stderr, " -> %s", bfc_err_name(e->rc));
        fputc('\n', stderr);
    }
}

/* Reports a broken rule: the first of a run in full (with the history of
 * the range and of the streams in `streams`), later ones (keep-going mode)
 * only counted.  The run stops unless it keeps going. */
__attribute__((format(printf, 6, 7))) static void violation(struct model *m, uintptr_t lo, size_t len, unsigned streams,
                                                            uint64_t since, const char *fmt, ...)
{
    char why[sizeof m->why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (!m->keep_going)
        m->stop = true;
    if (m->nviol++) {
        if (m->nviol <= 10)
            fprintf(stderr, "  and at op %" PRIu64 ": %s\n", m->op, why);
        return;
    }
    m->viol_op = m->op;
    memcpy(m->why, why, sizeof why);
    fprintf(stderr, "VIOLATION: config \"%s\" seed %" PRIu64 " op %" PRIu64 "%s: %s\n", m->spec, m->seed, m->op,
            m->meta_every ? " (metadata faults on)" : "", m->why);
    print_history(m, lo, len, streams, since);
    char meta[48] = "";
    if (m->meta_every)
        snprintf(meta, sizeof meta, " SHARDBFC_SAFETY_META=%u", m->meta_every);
    fprintf(stderr,
            "  re-run: SHARDBFC_SAFETY_CONF='%s' SHARDBFC_SAFETY_SEED=%" PRIu64
            "%s CK_RUN_CASE=%s ./tests/test_safety\n",
            m->spec, m->seed, meta, m->threads ? "model_threads" : m->meta_every ? "model_faults" : "model");
}

/* Model of a successful free of live[i] on stream f. */
static void model_free(struct model *m, int i, int f)
{
    struct mlive *l = &m->live[i];
    unsigned guard = ((1u << f) | l->rec) & m->held;
    if (m->nfreed == MAXFREED) {
        /* Forget the oldest unguarded range (history only); if every range
         * is guarded the test's sizes are wrong. */
        int j = 0;
        while (j < m->nfreed && m->freed[j].guard)
            j++;
        ck_assert_msg(j < m->nfreed, "model full: %d guarded ranges", m->nfreed);
        memmove(&m->freed[j], &m->freed[j + 1], (size_t)(m->nfreed - j - 1) * sizeof m->freed[0]);
        m->nfreed--;
    }
    m->freed[m->nfreed++] = (struct mfreed){ l->p, l->n, l->owner, f, guard, guard, m->op, l->op };
    log_ev(m, EV_FREE, f, l->owner, 0, l->p, l->n, guard);
    m->c.frees++;
    if (f != l->owner)
        m->c.cross_frees++;
    *l = m->live[--m->nlive];
}

static void model_drain(struct model *m, int x)
{
    for (int i = 0; i < m->nfreed; i++)
        m->freed[i].guard &= ~(1u << x);
}

/* ------------------------------------------ calls on the model's streams
 *
 * Streams 0..3 are SIM streams driven from this thread.  W_PT is the
 * per-thread stream of the worker thread: every call naming it runs there.
 * An exited worker's blocks (W_DEAD, W_GONE) are freed on their owner's
 * stream with bfc_free, from this thread. */

enum wkind { WC_ALLOC, WC_FREE, WC_RECORD, WC_HOLD, WC_DRAIN, WC_RELEASE, WC_ID };

struct wcall {
    enum wkind kind;
    bfc_ctx_t *ctx;
    void *p;
    size_t n;
    int rc;
    uint64_t id;
};

static void wcall_run(void *v)
{
    struct wcall *c = v;
    const bfc_stream_t pt = BFC_SIM_STREAM_PER_THREAD;
    switch (c->kind) {
    case WC_ALLOC:
        c->p = bfc_ctx_alloc(c->ctx, pt, c->n);
        c->rc = bfc_last_error();
        break;
    case WC_FREE:
        c->rc = bfc_ctx_free(c->ctx, c->p, pt);
        break;
    case WC_RECORD:
        c->rc = bfc_ctx_record_stream(c->ctx, c->p, pt);
        break;
    case WC_HOLD:
        bfc_sim_stream_hold(c->ctx, pt);
        break;
    case WC_DRAIN:
        bfc_sim_stream_drain(c->ctx, pt);
        break;
    case WC_RELEASE:
        c->rc = bfc_ctx_stream_release(c->ctx, pt);
        break;
    case WC_ID:
        c->rc = c->ctx->be->ops->stream_id(c->ctx->be, pt, &c->id);
        break;
    }
}

/* Runs one call on the worker, starting it first if it is not running. */
static struct wcall on_worker(struct model *m, enum wkind k, void *p, size_t n)
{
    if (!m->worker_up) {
        step_start(&m->worker);
        m->worker_up = true;
        struct wcall id = { WC_ID, m->ctx, NULL, 0, 0, 0 };
        step_run(&m->worker, wcall_run, &id);
        ck_assert_int_eq(id.rc, BFC_OK);
        /* From this thread the id reaches the worker's own stream record
         * (backend.h, stream_for): the handle that drains it after exit. */
        m->w_handle = m->ctx->be->ops->stream_for(m->ctx->be, BFC_SIM_STREAM_PER_THREAD, id.id);
        ck_assert_ptr_ne(m->w_handle, BFC_SIM_STREAM_PER_THREAD);
    }
    struct wcall c = { k, m->ctx, p, n, 0, 0 };
    step_run(&m->worker, wcall_run, &c);
    return c;
}

static void *m_alloc(struct model *m, int a, size_t n, int *err)
{
    if (a == W_PT) {
        struct wcall c = on_worker(m, WC_ALLOC, NULL, n);
        *err = c.rc;
        return c.p;
    }
    void *q = bfc_ctx_alloc(m->ctx, m->s[a], n);
    *err = bfc_last_error();
    return q;
}

static int m_free(struct model *m, void *p, int f)
{
    if (f == W_PT)
        return on_worker(m, WC_FREE, p, 0).rc;
    if (f > W_PT)
        return bfc_free(p); /* an exited worker's own stream */
    return bfc_ctx_free(m->ctx, p, m->s[f]);
}

static int m_record(struct model *m, void *p, int r)
{
    return r == W_PT ? on_worker(m, WC_RECORD, p, 0).rc : bfc_ctx_record_stream(m->ctx, p, m->s[r]);
}

static void m_hold(struct model *m, int x)
{
    if (x == W_PT)
        (void)on_worker(m, WC_HOLD, NULL, 0);
    else
        bfc_sim_stream_hold(m->ctx, m->s[x]);
}

static void m_drain(struct model *m, int x)
{
    if (x == W_PT)
        (void)on_worker(m, WC_DRAIN, NULL, 0);
    else
        bfc_sim_stream_drain(m->ctx, m->s[x]);
}

static int m_release(struct model *m, int x)
{
    return x == W_PT ? on_worker(m, WC_RELEASE, NULL, 0).rc : bfc_ctx_stream_release(m->ctx, m->s[x]);
}

/* Stream `from`'s part in the model -- live blocks it owns, streams it was
 * recorded on, guards and histories of freed ranges -- becomes `to`'s
 * (-1: gone, for streams idle for good). */
static void model_rename(struct model *m, int from, int to)
{
    unsigned bit = 1u << from, tobit = to >= 0 ? 1u << to : 0;
    for (int i = 0; i < m->nlive; i++) {
        struct mlive *l = &m->live[i];
        if (l->owner == from)
            l->owner = to >= 0 ? to : W_GONE;
        if (l->rec & bit)
            l->rec = (l->rec & ~bit) | tobit;
    }
    for (int i = 0; i < m->nfreed; i++) {
        struct mfreed *f = &m->freed[i];
        if (f->owner == from)
            f->owner = to >= 0 ? to : W_GONE;
        if (f->freer == from)
            f->freer = to >= 0 ? to : W_GONE;
        if (f->guard & bit)
            f->guard = (f->guard & ~bit) | tobit;
        if (f->had_guard & bit)
            f->had_guard = (f->had_guard & ~bit) | (to >= 0 ? tobit : 1u << W_GONE);
    }
}

/* The exited worker's busy stream completes its work. */
static void drain_dead(struct model *m)
{
    if (!(m->held >> W_DEAD & 1))
        return;
    bfc_sim_stream_drain(m->ctx, m->dead_handle);
    m->held &= ~(1u << W_DEAD);
    model_drain(m, W_DEAD);
    model_rename(m, W_DEAD, -1);
    m->c.drains++;
    log_ev(m, EV_DRAIN, W_DEAD, -1, 0, 0, 0, 0);
}

/* The worker exits without releasing its per-thread stream; its shard is
 * retired by a later shard creation or trim, on this thread.  Its stream
 * goes on: busy, it becomes W_DEAD (an earlier W_DEAD drained first, so
 * that the number stands for one stream); idle, it is idle for good. */
static void op_exit(struct model *m)
{
    if (!m->worker_up)
        return;
    bool busy = m->held >> W_PT & 1;
    if (busy)
        drain_dead(m);
    step_stop(&m->worker);
    m->worker_up = false;
    model_rename(m, W_PT, busy ? W_DEAD : -1);
    if (busy) {
        m->held = (m->held & ~(1u << W_PT)) | 1u << W_DEAD;
        m->dead_handle = m->w_handle;
        m->c.exits_busy++;
    }
    m->last_release[W_PT] = 0;
    m->c.exits++;
    log_ev(m, EV_EXIT, W_PT, -1, 0, 0, 0, 0);
}

static void tag_write(struct mlive *l)
{
    size_t k = l->n < 64 ? l->n : 64;
    memset((void *)l->p, l->tag, k);
    memset((void *)(l->p + l->n - k), l->tag, k);
}

static bool tag_ok(const struct mlive *l)
{
    size_t k = l->n < 64 ? l->n : 64;
    const unsigned char *a = (const unsigned char *)l->p, *b = (const unsigned char *)(l->p + l->n - k);
    for (size_t i = 0; i < k; i++)
        if (a[i] != l->tag || b[i] != l->tag)
            return false;
    return true;
}

static size_t pick_size(struct model *m)
{
    size_t limit = m->cfg.memory_limit, large = m->cfg.large_alloc;
    uint64_t r = rnd_below(m, 1000);
    if (r < 2)
        return limit + 1 + (size_t)rnd_below(m, 4096); /* never servable */
    if (r < 40 && large) {
        size_t hi = large * 2 < limit * 3 / 4 ? large * 2 : limit * 3 / 4;
        if (large <= hi)
            return large + (size_t)rnd_below(m, hi - large + 1);
    }
    if (r < 60)
        return limit / 8 + (size_t)rnd_below(m, limit / 2 - limit / 8);
    /* log-uniform 256 B .. limit/8, not a multiple of 256 as often as not */
    double lo = log(256.0), hi = log((double)(limit / 8));
    double u = (double)(rnd(m) >> 11) * 0x1.0p-53;
    size_t n = (size_t)exp(lo + u * (hi - lo));
    return n < 1 ? 1 : n;
}

/* How the memory probably left its shard, from what the model saw (it
 * knows no shards): a guess for the reader of a failure report. */
static void leave_hint(const struct model *m, const struct mfreed *f, char *buf, size_t len)
{
    uint64_t rel = m->last_release[f->owner];
    size_t large = m->cfg.large_alloc;
    if (rel && rel - 1 >= f->alloc_op && rel - 1 < f->op)
        snprintf(buf, len, "the owner's shard was released at op %" PRIu64 " (the free emptied a retired shard)",
                 rel - 1);
    else if (rel && rel - 1 > f->op)
        snprintf(buf, len, "the owner's shard was released at op %" PRIu64 " after the free", rel - 1);
    else if (large && ((f->n + 255) & ~(size_t)255) >= large)
        snprintf(buf, len, "a large block (region of its own, large_alloc %zu)", large);
    else if (m->last_trim && m->last_trim - 1 > f->op)
        snprintf(buf, len, "trimmed at op %" PRIu64, m->last_trim - 1);
    else
        snprintf(buf, len, "reclaimed by another shard%s", m->cfg.garbage_collection ? " or garbage-collected" : "");
}

/* A block that broke the rule is not kept: it goes back at once (on its
 * own stream, reusable by nobody else), so the run's clean-up balances. */
static void reject(struct model *m, void *q, int a)
{
    int rc = m_free(m, q, a);
    if (rc != BFC_OK && m->nviol <= 10)
        fprintf(stderr, "  (the offending block %p could not be freed: %s)\n", q, bfc_err_name(rc));
}

static void op_alloc(struct model *m, int a)
{
    if (m->nlive == MAXLIVE)
        return;
    size_t n = pick_size(m);
    int e;
    void *q = m_alloc(m, a, n, &e);
    if (!q) {
        log_ev(m, EV_AFAIL, a, -1, e, 0, 0, 0);
        if (e == BFC_ENOMEM)
            m->c.ooms++;
        ck_assert_msg(e != BFC_OK, "alloc(%zu) returned NULL with BFC_OK", n);
        if (!m->meta_every)
            ck_assert_msg(e == BFC_ENOMEM, "alloc(%zu): %s (config \"%s\" seed %" PRIu64 " op %" PRIu64 ")", n,
                          bfc_err_name(e), m->spec, m->seed, m->op);
        return;
    }
    m->c.allocs++;
    uintptr_t u = (uintptr_t)q;
    log_ev(m, EV_ALLOC, a, -1, 0, u, n, 0);
    if (n > m->cfg.memory_limit) {
        violation(m, u, n, 0, m->op, "alloc(%zu) on s%d succeeded beyond the limit %zu", n, a, m->cfg.memory_limit);
        reject(m, q, a);
        return;
    }
    if (u % 256 != 0) {
        violation(m, u, n, 0, m->op, "alloc(%zu) on s%d = %p is not 256-byte aligned", n, a, q);
        reject(m, q, a);
        return;
    }
    size_t asz = bfc_ctx_allocated_size(m->ctx, q);
    if (asz < n) {
        violation(m, u, n, 0, m->op, "alloc(%zu) on s%d = %p: allocated_size %zu", n, a, q, asz);
        reject(m, q, a);
        return;
    }
    for (int i = 0; i < m->nlive; i++) {
        const struct mlive *l = &m->live[i];
        if (range_overlap(u, asz, l->p, l->asz)) {
            violation(m, u, asz, 0, m->op,
                      "alloc(%zu) on s%d = [%#" PRIxPTR ", +%zu) overlaps the live block [%#" PRIxPTR
                      ", +%zu) of s%d allocated at op %" PRIu64,
                      n, a, u, asz, l->p, l->asz, l->owner, l->op);
            reject(m, q, a);
            return;
        }
    }
    bool moved = false, moved_guarded = false, moved_exited = false;
    for (int i = 0; i < m->nfreed;) {
        struct mfreed *f = &m->freed[i];
        if (!range_overlap(u, n, f->p, f->n)) {
            i++;
            continue;
        }
        unsigned others = f->guard & ~(1u << a);
        if (others) {
            char g1[32], g2[32], hint[160];
            leave_hint(m, f, hint, sizeof hint);
            violation(m, f->p, f->n, others, f->op,
                      "alloc(%zu) on s%d = [%#" PRIxPTR ", +%zu) overlaps [%#" PRIxPTR ", +%zu), freed at op %" PRIu64
                      " on s%d (owner s%d) while guarded by %s, of which %s not drained since; %s",
                      n, a, u, n, f->p, f->n, f->op, f->freer, f->owner, mask_str(f->had_guard, g1, sizeof g1),
                      mask_str(others, g2, sizeof g2), hint);
            reject(m, q, a);
            return;
        }
        if (f->owner != a) {
            moved = true;
            if (f->had_guard & ~(1u << a))
                moved_guarded = true;
            if (f->owner > W_PT)
                moved_exited = true;
        }
        if (f->guard) {
            i++; /* a's own guard: stays for the rest of the range */
            continue;
        }
        /* The range starts a new history. */
        *f = m->freed[--m->nfreed];
    }
    m->c.moved += moved;
    m->c.moved_guarded += moved_guarded;
    m->c.moved_exited += moved_exited;
    struct mlive *l = &m->live[m->nlive++];
    *l = (struct mlive){ u, n, asz, a, 0, m->op, (unsigned char)(m->op * 37 + 1) };
    tag_write(l);
}

static void op_free(struct model *m, bool own)
{
    if (m->nlive == 0)
        return;
    int i = (int)rnd_below(m, (uint64_t)m->nlive);
    struct mlive *l = &m->live[i];
    int ns = m->threads ? NSTREAM + 1 : NSTREAM;
    int f = l->owner;
    if (!own)
        f = l->owner >= ns ? (int)rnd_below(m, (uint64_t)ns)
                           : (l->owner + 1 + (int)rnd_below(m, (uint64_t)ns - 1)) % ns;
    if (!tag_ok(l)) {
        violation(m, l->p, l->n, 0, m->op, "live block [%#" PRIxPTR ", +%zu) of s%d lost its tag before its free", l->p,
                  l->n, l->owner);
        if (m->stop)
            return;
    }
    int rc = m_free(m, (void *)l->p, f);
    if (rc != BFC_OK) {
        log_ev(m, EV_FFAIL, f, l->owner, rc, l->p, l->n, 0);
        m->c.free_errors++;
        if (!m->meta_every)
            ck_assert_msg(rc == BFC_OK,
                          "free of a live block on s%d: %s (config \"%s\" seed %" PRIu64 " op %" PRIu64 ")", f,
                          bfc_err_name(rc), m->spec, m->seed, m->op);
        return; /* still live: freed again later */
    }
    model_free(m, i, f);
}

static void op_record(struct model *m)
{
    if (m->nlive == 0)
        return;
    int i = (int)rnd_below(m, (uint64_t)m->nlive);
    int r = (int)rnd_below(m, m->threads ? NSTREAM + 1 : NSTREAM);
    struct mlive *l = &m->live[i];
    int rc = m_record(m, (void *)l->p, r);
    log_ev(m, rc == BFC_OK ? EV_RECORD : EV_RFAIL, l->owner, r, rc, l->p, l->n, 0);
    if (rc != BFC_OK) {
        if (!m->meta_every)
            ck_assert_msg(rc == BFC_OK, "record_stream: %s", bfc_err_name(rc));
        return; /* not recorded */
    }
    m->c.records++;
    if (r != l->owner) /* recording the owner is a no-op */
        l->rec |= 1u << r;
}

static void model_check(struct model *m)
{
    char buf[512];
    buf[0] = '\0';
    int rc = bfc_ctx_check_report(m->ctx, buf, sizeof buf);
    m->c.checks++;
    if (rc != BFC_OK) {
        violation(m, 0, 0, 0, m->op, "bfc_ctx_check: %s: %s", bfc_err_name(rc), buf);
        m->stop = true; /* going on with a corrupt allocator proves nothing */
    }
}

static void model_step(struct model *m)
{
    if (m->threads) {
        uint64_t t = rnd_below(m, 200);
        if (t == 0) {
            op_exit(m);
            return;
        }
        if (t == 1) {
            drain_dead(m);
            return;
        }
    }
    uint64_t r = rnd_below(m, 100);
    int x = (int)rnd_below(m, m->threads ? NSTREAM + 1 : NSTREAM);
    if (r < 34) {
        op_alloc(m, x);
    } else if (r < 56) {
        op_free(m, true);
    } else if (r < 64) {
        op_free(m, false);
    } else if (r < 70) {
        op_record(m);
    } else if (r < 81) {
        m_hold(m, x);
        m->held |= 1u << x;
        m->c.holds++;
        log_ev(m, EV_HOLD, x, -1, 0, 0, 0, 0);
    } else if (r < 94) {
        m_drain(m, x);
        m->held &= ~(1u << x);
        model_drain(m, x);
        m->c.drains++;
        log_ev(m, EV_DRAIN, x, -1, 0, 0, 0, 0);
    } else if (r < 98) {
        int rc = m_release(m, x);
        log_ev(m, EV_RELEASE, x, -1, rc, 0, 0, 0);
        if (rc == BFC_OK) {
            m->c.releases++;
            m->last_release[x] = m->op + 1;
        } else if (!m->meta_every)
            ck_assert_msg(rc == BFC_EINVAL, "release: %s", bfc_err_name(rc));
    } else {
        int rc = bfc_ctx_trim(m->ctx);
        log_ev(m, EV_TRIM, -1, -1, rc, 0, 0, 0);
        m->c.trims++;
        m->last_trim = m->op + 1;
        if (!m->meta_every)
            ck_assert_msg(rc == BFC_OK, "trim: %s", bfc_err_name(rc));
    }
}

/* Drains everything, frees everything, trims: nothing may be left. */
static void model_finish(struct model *m)
{
    bfc_sim_fail_meta_every(0);
    for (int k = 0; k < NSTREAM; k++)
        bfc_sim_stream_drain(m->ctx, m->s[k]);
    if (m->worker_up)
        m_drain(m, W_PT);
    drain_dead(m);
    m->held = 0;
    while (m->nlive) {
        struct mlive *l = &m->live[m->nlive - 1];
        if (!m->stop && !tag_ok(l))
            violation(m, l->p, l->n, 0, m->op, "live block [%#" PRIxPTR ", +%zu) of s%d lost its tag", l->p, l->n,
                      l->owner);
        int rc = m_free(m, (void *)l->p, l->owner);
        if (rc != BFC_OK)
            violation(m, l->p, l->n, 0, m->op, "clean-up: free of the live block [%#" PRIxPTR ", +%zu) of s%d: %s",
                      l->p, l->n, l->owner, bfc_err_name(rc));
        m->nlive--;
    }
    if (m->worker_up) {
        step_stop(&m->worker); /* exits: the trim below retires its shard */
        m->worker_up = false;
    }
    int rc = bfc_ctx_trim(m->ctx);
    if (rc != BFC_OK)
        violation(m, 0, 0, 0, m->op, "clean-up: trim: %s", bfc_err_name(rc));
    bfc_stats_t s;
    rc = bfc_ctx_stats(m->ctx, &s);
    if (rc != BFC_OK)
        violation(m, 0, 0, 0, m->op, "clean-up: stats: %s", bfc_err_name(rc));
    else if (s.bytes_in_use != 0 || s.num_pending_frees != 0)
        violation(m, 0, 0, 0, m->op,
                  "clean-up: %" PRIu64 " bytes in use, %" PRIu64 " pending frees after every block was freed",
                  s.bytes_in_use, s.num_pending_frees);
    else if (s.num_shards > NSTREAM)
        violation(m, 0, 0, 0, m->op, "clean-up: %" PRIu64 " live shards after trim: exited workers' were kept",
                  s.num_shards);
    char buf[512];
    buf[0] = '\0';
    rc = bfc_ctx_check_report(m->ctx, buf, sizeof buf);
    if (rc != BFC_OK)
        violation(m, 0, 0, 0, m->op, "clean-up: bfc_ctx_check: %s: %s", bfc_err_name(rc), buf);
}

/* The process-wide SIM stream table never reuses records: one set of
 * streams serves every run of the process. */
static bfc_stream_t *model_streams(bfc_ctx_t *ctx)
{
    static bfc_stream_t s[NSTREAM];
    if (!s[0])
        for (int k = 0; k < NSTREAM; k++)
            s[k] = new_stream(ctx);
    return s;
}

/* The decay's clock in the configurations with slack_decay_ms=1: a
 * millisecond more at each look (runs are single-threaded). */
static uint64_t model_clock_ms;
static uint64_t model_decay_clock(void)
{
    return ++model_clock_ms;
}

/* One (configuration, seed) run; returns whether it found a violation. */
static bool model_run(struct model *m, const char *spec, uint64_t seed, uint64_t ops, unsigned meta_every,
                      bool threads, bool keep_going)
{
    struct mfreed *freed = m->freed;
    struct mev *log = m->log;
    struct counters c = m->c;
    memset(m, 0, sizeof *m);
    m->freed = freed;
    m->log = log;
    m->c = c;
    m->spec = spec;
    m->seed = seed;
    m->rng = seed * 0xD1B54A32D192ED03ull + 1;
    m->meta_every = meta_every;
    m->threads = threads;
    m->keep_going = keep_going;
    static const char tight_va[] = "tight_va,";
    bool va = strncmp(spec, tight_va, sizeof tight_va - 1) == 0;
    m->ctx = ctx_spec(va ? spec + sizeof tight_va - 1 : spec);
    ck_assert_int_eq(bfc_ctx_config(m->ctx, &m->cfg), BFC_OK);
    if (va)
        /* two shards' whole reservations (twice the limit each), then
         * fallbacks of an eighth of the limit */
        bfc__sim_set_va_ceiling(m->ctx->be, 4 * m->cfg.memory_limit + m->cfg.memory_limit / 2);
    /* A run's shards make hundreds of allocations, not thousands, in a
     * millisecond or two: with a decay of 1 ms, look every 8 allocations,
     * on a clock that advances a millisecond at each look (set before any
     * shard exists), so that every look may give memory back. */
    if (m->cfg.slack_decay_ms == 1) {
        m->ctx->env.decay_check_allocs = 8;
        m->ctx->env.decay_clock = model_decay_clock;
    }
    m->s = model_streams(m->ctx);
    for (int k = 0; k < NSTREAM; k++)
        bfc_sim_stream_drain(m->ctx, m->s[k]);
    m->c.runs++;
    if (meta_every)
        bfc_sim_fail_meta_every(meta_every); /* also restarts the count: runs reproduce */
    uint64_t fails0 = bfc_sim_meta_failures();
    for (m->op = 0; m->op < ops && !m->stop; m->op++) {
        model_step(m);
        if (!m->stop && (m->op + 1) % CHECK_EVERY == 0)
            model_check(m);
    }
    if (!m->stop)
        model_check(m);
    m->c.ops += m->op;
    m->c.violations += m->nviol;
    if (meta_every)
        m->c.meta_failures += bfc_sim_meta_failures() - fails0;
    model_finish(m);
    bfc_ctx_destroy(m->ctx);
    m->ctx = NULL;
    return m->nviol != 0;
}

static uint64_t env_u64(const char *name, uint64_t def)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return def;
    char *end;
    unsigned long long x = strtoull(v, &end, 0);
    ck_assert_msg(*end == '\0', "%s=%s is not a number", name, v);
    return (uint64_t)x;
}

#define TIGHT_LIMIT "16M"

/* The configurations: the product of the dimensions above. */
static int model_configs(char (*out)[160], int max)
{
    static const char *limits[] = { TIGHT_LIMIT, "48M", "64M", "128M", "256M" };
    static const char *large[] = { "large_alloc=0,", "", "large_alloc=4M," };
    int n = 0;
    for (size_t li = 0; li < sizeof limits / sizeof limits[0]; li++)
        for (int g = 1; g >= 0; g--)
            for (int gc = 0; gc <= 1; gc++)
                for (size_t la = 0; la < sizeof large / sizeof large[0]; la++) {
                    ck_assert_int_lt(n, max);
                    /* With growth, classic regions and expandable arenas
                     * (vmm=on) alternate over the other dimensions. */
                    const char *vmm = !g ? "" : (li + (size_t)gc + la) % 2 ? "vmm=off," : "vmm=on,";
                    snprintf(out[n++], 160, "memory_limit=%s,allow_growth=%s,garbage_collection=%s,%s%sretry_ms=0",
                             limits[li], g ? "true" : "false", gc ? "true" : "false", large[la], vmm);
                }
    /* Expandable arenas in an address space too small for a reservation of
     * the limit per shard (model_run reads the prefix); then expandable
     * arenas whose decay runs at nearly every check (1 ms; the default,
     * 10 s, never comes within a run): memory leaves by the decay's
     * releases too; then a release threshold, so that releases at frees
     * give back only part of what is free (the granules beyond it). */
    static const char *va_limits[] = { TIGHT_LIMIT, "64M" };
    static const char *va_kinds[][2] = {
        { "tight_va,", "" }, { "", "slack_decay_ms=1," }, { "", "release_threshold=4M," } };
    for (size_t kind = 0; kind < sizeof va_kinds / sizeof va_kinds[0]; kind++)
        for (size_t li = 0; li < sizeof va_limits / sizeof va_limits[0]; li++)
            for (int gc = 0; gc <= 1; gc++) {
                ck_assert_int_lt(n, max);
                snprintf(out[n++], 160,
                         "%smemory_limit=%s,allow_growth=true,garbage_collection=%s,vmm=on,%sretry_ms=0",
                         va_kinds[kind][0], va_limits[li], gc ? "true" : "false", va_kinds[kind][1]);
            }
    return n;
}

/* Runs every configuration (or the one in SHARDBFC_SAFETY_CONF) over its
 * seeds; fails at the end if any run found a violation, or if the tight
 * configurations never moved memory between streams. */
static void model_suite(bool faults, bool threads)
{
    static char confs[72][160];
    int nconf;
    const char *env_conf = getenv("SHARDBFC_SAFETY_CONF");
    bool one = false;
    if (env_conf && *env_conf) {
        snprintf(confs[0], sizeof confs[0], "%s", env_conf);
        nconf = 1;
        one = true;
    } else {
        nconf = model_configs(confs, 72);
    }
    uint64_t seeds = g_long ? 6 : 2, seed0 = 1;
    uint64_t ops = g_long ? 12000 : 1500;
    if (faults) {
        seeds = g_long ? 4 : 1;
        ops = g_long ? 8000 : 2000;
    }
    if (threads)
        seeds = g_long ? 3 : 1; /* each worker takes one of SIM's 65,535 streams */
    if (getenv("SHARDBFC_SAFETY_SEED")) {
        seed0 = env_u64("SHARDBFC_SAFETY_SEED", 1);
        seeds = 1;
        one = true;
    }
    ops = env_u64("SHARDBFC_SAFETY_OPS", ops);
    bool keep_going = env_u64("SHARDBFC_SAFETY_KEEP_GOING", 0) != 0;
    static const unsigned fault_every[] = { 7, 23 };
    unsigned meta_env = (unsigned)env_u64("SHARDBFC_SAFETY_META", 0);

    struct model *m = calloc(1, sizeof *m);
    ck_assert_ptr_nonnull(m);
    m->freed = calloc(MAXFREED, sizeof m->freed[0]);
    m->log = calloc(LOGN, sizeof m->log[0]);
    ck_assert(m->freed && m->log);

    static const char tight_prefix[] = "memory_limit=" TIGHT_LIMIT ",";
    double t0 = now_s();
    int nviol = 0, nran = 0;
    char first_bad[512] = "";
    struct counters tight = { 0 }, all = { 0 };
    printf("%-92s %5s %7s %7s %6s %6s %6s %5s %5s  %s\n", "configuration", "runs", "ops", "allocs", "ooms", "moved",
           "mv-grd", "rel", "trim", "first violation");
    for (int ci = 0; ci < nconf; ci++) {
        /* With faults: a third of the configurations (every limit, growth
         * and GC setting, large_alloc rotating), injection period
         * alternating. */
        if (faults && !one && ci % 3 != ci / 3 % 3)
            continue;
        unsigned every = meta_env ? meta_env : faults ? fault_every[ci / 3 % 2] : 0;
        nran++;
        m->c = (struct counters){ 0 };
        char verdict[160] = "-";
        for (uint64_t k = 0; k < seeds; k++) {
            /* Each configuration has seeds of its own (1, 2, ... for the
             * first; 1001, 1002, ... for the second, ...). */
            uint64_t seed = one ? seed0 + k : seed0 + k + (uint64_t)ci * 1000;
            if (model_run(m, confs[ci], seed, ops, every, threads, keep_going)) {
                if (verdict[0] == '-') {
                    snprintf(verdict, sizeof verdict, "seed %" PRIu64 " op %" PRIu64, seed, m->viol_op);
                    if (!nviol)
                        snprintf(first_bad, sizeof first_bad, "\"%.150s\" seed %" PRIu64 " op %" PRIu64 ": %.200s",
                                 confs[ci], seed, m->viol_op, m->why);
                    nviol++;
                }
                if (!keep_going)
                    break;
            }
        }
        if (keep_going && m->c.violations) {
            size_t at = strlen(verdict);
            snprintf(verdict + at, sizeof verdict - at, " (%" PRIu64 " in all)", m->c.violations);
        }
        const struct counters *c = &m->c;
        printf("%-92s %5" PRIu64 " %7" PRIu64 " %7" PRIu64 " %6" PRIu64 " %6" PRIu64 " %6" PRIu64 " %5" PRIu64
               " %5" PRIu64 "  %s\n",
               confs[ci], c->runs, c->ops, c->allocs, c->ooms, c->moved, c->moved_guarded, c->releases, c->trims,
               verdict);
        fflush(stdout);
        struct counters *sums[2] = { &all,
                                     strncmp(confs[ci], tight_prefix, strlen(tight_prefix)) == 0 ? &tight : NULL };
        for (int j = 0; j < 2; j++) {
            if (!sums[j])
                continue;
            struct counters *t = sums[j];
            t->runs += c->runs;
            t->ops += c->ops;
            t->allocs += c->allocs;
            t->ooms += c->ooms;
            t->frees += c->frees;
            t->free_errors += c->free_errors;
            t->cross_frees += c->cross_frees;
            t->records += c->records;
            t->releases += c->releases;
            t->trims += c->trims;
            t->checks += c->checks;
            t->moved += c->moved;
            t->moved_guarded += c->moved_guarded;
            t->meta_failures += c->meta_failures;
            t->violations += c->violations;
            t->exits += c->exits;
            t->exits_busy += c->exits_busy;
            t->moved_exited += c->moved_exited;
        }
    }
    printf("model%s: %d configurations, %" PRIu64 " runs, %" PRIu64 " operations (%" PRIu64 " allocations, %" PRIu64
           " OOMs, %" PRIu64 " frees of which %" PRIu64 " cross-stream, %" PRIu64 " failed frees, %" PRIu64
           " records, %" PRIu64 " releases, %" PRIu64 " trims, %" PRIu64 " checks), memory moved between streams "
           "%" PRIu64 " times (%" PRIu64 " after a guard was lifted; tight limit: %" PRIu64 " / %" PRIu64 "), %" PRIu64
           " metadata faults injected, %d configurations with a violation, %.1f s\n",
           faults ? " under metadata faults" : "", nran, all.runs, all.ops, all.allocs, all.ooms, all.frees,
           all.cross_frees, all.free_errors, all.records, all.releases, all.trims, all.checks, all.moved,
           all.moved_guarded, tight.moved, tight.moved_guarded, all.meta_failures, nviol, now_s() - t0);
    if (threads)
        printf("model with a worker thread: %" PRIu64 " worker exits without a release (%" PRIu64
               " with its stream busy), memory of exited workers' shards moved to another stream %" PRIu64 " times\n",
               all.exits, all.exits_busy, all.moved_exited);
    fflush(stdout);
    free(m->freed);
    free(m->log);
    free(m);
    bfc_sim_fail_meta_every(0);
    ck_assert_msg(nviol == 0, "%d configuration(s) broke the stream-safety rule; first: %s", nviol, first_bad);
    if (!one) {
        ck_assert_msg(tight.moved_guarded > 0 && tight.releases > 0,
                      "the tight configurations never moved guarded memory between streams (moved %" PRIu64
                      ", after a guard %" PRIu64 ", releases %" PRIu64 "): the test proves nothing",
                      tight.moved, tight.moved_guarded, tight.releases);
        if (faults)
            ck_assert_msg(all.meta_failures > 0, "no metadata fault was injected");
        if (threads)
            ck_assert_msg(all.exits_busy > 0 && all.moved_exited > 0,
                          "no worker exited busy (%" PRIu64 "), or no exited worker's memory moved (%" PRIu64
                          "): the test proves nothing",
                          all.exits_busy, all.moved_exited);
    }
}

START_TEST(test_model)
{
    model_suite(false, false);
}
END_TEST

START_TEST(test_model_faults)
{
    model_suite(true, false);
}
END_TEST

/* The model with a fifth stream: a worker thread's per-thread stream.  The
 * worker now and then exits without releasing it, busy or idle, and its
 * shard is retired by another thread (the next shard made, or a trim): the
 * memory it leaves with must wait for the exited thread's stream as for
 * any other. */
START_TEST(test_model_threads)
{
    model_suite(false, true);
}
END_TEST

/* ------------------------------------------------ concurrent departures */

/*
 * Two departures of one stream id from two threads at once.  Each cycle,
 * stream A's shard is released with a block b1 still live (its region
 * departs when b1 is freed), in half the runs once more with a block b0,
 * and A's next shard gets b2.  Then, at the same moment, one thread frees
 * b1 (on stream B, or by bfc_free) -- the old shard's departure, fenced on
 * an idle A --, another frees b0, and the owner holds A, frees b2 on it and
 * releases A's new shard or trims: the new departure, fenced behind the
 * held work.  A taker then allocates on C while A is still held: none of
 * b2's range may come back before A drains, and with expandable arenas
 * b2's whole granules stay mapped.  One more thread trims and reads
 * statistics throughout.  The departures reach the region pool within a
 * few hundred nanoseconds of each other, taken in in either order.  A pool
 * that kept only the fence taken in last handed b2 to C a few times in
 * 3,000 cycles (the first configuration, seed 1: nine of ten runs on a
 * mostly quiet machine failed; beside two busy loops, the one run tried
 * passed).
 * Each seed bounds the random spins before each side's step differently,
 * which moves that moment around.  test_pool's fence-order cases check
 * the rule itself, deterministically.
 */
struct dep_race {
    bfc_ctx_t *ctx;
    bfc_stream_t a, b, c;
    pthread_barrier_t bar;
    int cycles;
    unsigned owner_spin, freer_spin; /* bounds of the random spins */
    bool vmm, third;
    uint64_t seed;
    void *b0, *b1, *b2;
    size_t b2n;
    atomic_bool stop;
    atomic_int violations, errors;
    atomic_uint_fast64_t c_got;
    char first[256];
    atomic_flag first_taken;
};

static void dep_note(struct dep_race *r, atomic_int *count, const char *fmt, ...)
{
    atomic_fetch_add(count, 1);
    if (atomic_flag_test_and_set(&r->first_taken))
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->first, sizeof r->first, fmt, ap);
    va_end(ap);
}

static void dep_spin(uint64_t *rng, unsigned most)
{
    for (volatile unsigned i = 0, n = (unsigned)(rng_next(rng) % most); i < n; i++)
        ;
}

/* b2's whole granules are still mapped (expandable arenas). */
static bool dep_b2_mapped(const struct dep_race *r)
{
    const uintptr_t g = 2u << 20;
    uintptr_t lo = ((uintptr_t)r->b2 + g - 1) & ~(g - 1), hi = ((uintptr_t)r->b2 + r->b2n) & ~(g - 1);
    return !r->vmm || lo >= hi || bfc_sim_mapped(r->ctx, (void *)lo, hi - lo);
}

static void *dep_owner(void *arg)
{
    struct dep_race *r = arg;
    uint64_t rng = r->seed * 3 + 1;
    for (int i = 0; i < r->cycles; i++) {
        r->b1 = bfc_ctx_alloc(r->ctx, r->a, 1u << 20);
        bfc_ctx_stream_release(r->ctx, r->a);
        if (r->third) {
            r->b0 = bfc_ctx_alloc(r->ctx, r->a, (1 + rng_next(&rng) % 2) << 20);
            bfc_ctx_stream_release(r->ctx, r->a);
        }
        r->b2 = bfc_ctx_alloc(r->ctx, r->a, (1 + rng_next(&rng) % (r->vmm ? 8 : 4)) << 20);
        r->b2n = r->b2 ? bfc_ctx_allocated_size(r->ctx, r->b2) : 0;
        pthread_barrier_wait(&r->bar); /* 1: the departures */
        dep_spin(&rng, r->owner_spin);
        bfc_sim_stream_hold(r->ctx, r->a);
        if (r->b2 && bfc_ctx_free(r->ctx, r->b2, r->a) != BFC_OK)
            dep_note(r, &r->errors, "cycle %d: free of b2 refused", i);
        switch (rng_next(&rng) % 3) {
        case 0: bfc_ctx_stream_release(r->ctx, r->a); break;
        case 1: bfc_ctx_trim(r->ctx); break;
        default: break;
        }
        pthread_barrier_wait(&r->bar); /* 2: C's turn */
        pthread_barrier_wait(&r->bar); /* 3: C done */
        bfc_sim_stream_drain(r->ctx, r->a);
        bfc_ctx_stream_release(r->ctx, r->a);
    }
    atomic_store(&r->stop, true);
    return NULL;
}

/* A freer of an old shard's block: b1, or in the three-shard runs (a
 * thread of its own) b0, on stream B or by bfc_free. */
struct dep_freer {
    struct dep_race *r;
    void **slot;
    uint64_t rng;
};

static void *dep_freer(void *arg)
{
    struct dep_freer *f = arg;
    struct dep_race *r = f->r;
    for (int i = 0; i < r->cycles; i++) {
        pthread_barrier_wait(&r->bar);
        dep_spin(&f->rng, r->freer_spin);
        void *p = *f->slot;
        *f->slot = NULL;
        int rc = !p ? BFC_OK : rng_next(&f->rng) % 2 ? bfc_free(p) : bfc_ctx_free(r->ctx, p, r->b);
        if (rc != BFC_OK)
            dep_note(r, &r->errors, "cycle %d: free of an old shard's block: %s", i, bfc_err_name(rc));
        pthread_barrier_wait(&r->bar);
        pthread_barrier_wait(&r->bar);
    }
    return NULL;
}

static void *dep_taker(void *arg)
{
    struct dep_race *r = arg;
    uint64_t rng = r->seed * 7 + 5;
    for (int i = 0; i < r->cycles; i++) {
        void *v[32];
        int k = 0;
        pthread_barrier_wait(&r->bar);
        pthread_barrier_wait(&r->bar); /* A is held; b2 was freed on it */
        size_t n = (1 + rng_next(&rng) % 8) << 20;
        for (; k < 32 && (v[k] = bfc_ctx_alloc(r->ctx, r->c, n)) != NULL; k++) {
            size_t got = bfc_ctx_allocated_size(r->ctx, v[k]);
            if (r->b2 && overlaps(v[k], got, r->b2, r->b2n))
                dep_note(r, &r->violations, "seed %" PRIu64 " cycle %d: C got [%p, +%zu) inside b2 [%p, +%zu), freed on A while A is held",
                         r->seed, i, v[k], got, r->b2, r->b2n);
        }
        atomic_fetch_add(&r->c_got, (uint64_t)k);
        if (r->b2 && !dep_b2_mapped(r))
            dep_note(r, &r->violations, "seed %" PRIu64 " cycle %d: b2's granules unmapped while A is held", r->seed, i);
        for (int j = 0; j < k; j++)
            if (bfc_ctx_free(r->ctx, v[j], r->c) != BFC_OK)
                dep_note(r, &r->errors, "cycle %d: free on C refused", i);
        pthread_barrier_wait(&r->bar);
    }
    return NULL;
}

static void *dep_trimmer(void *arg)
{
    struct dep_race *r = arg;
    uint64_t rng = r->seed * 11 + 7;
    while (!atomic_load(&r->stop)) {
        bfc_stats_t s;
        if (rng_next(&rng) % 4 == 0)
            bfc_ctx_trim(r->ctx);
        else
            bfc_ctx_stats(r->ctx, &s);
    }
    return NULL;
}

static void dep_race_run(const char *spec, uint64_t seed, int cycles, bool third, uint64_t *c_got)
{
    struct dep_race r = {.cycles = cycles, .seed = seed, .third = third, .first_taken = ATOMIC_FLAG_INIT};
    r.freer_spin = 1 + (unsigned)(seed % 3000);
    r.owner_spin = 1 + (unsigned)(seed / 3 % 3000);
    bfc_config_t cfg;
    r.ctx = ctx_spec(spec);
    ck_assert_int_eq(bfc_ctx_config(r.ctx, &cfg), BFC_OK);
    r.vmm = cfg.vmm == BFC_VMM_ON;
    r.a = new_stream(r.ctx);
    r.b = new_stream(r.ctx);
    r.c = new_stream(r.ctx);
    struct dep_freer f1 = {&r, &r.b1, seed * 5 + 3}, f0 = {&r, &r.b0, seed * 13 + 9};
    int n = third ? 5 : 4; /* the trimmer is last: not a party to the barrier */
    ck_assert_int_eq(pthread_barrier_init(&r.bar, NULL, (unsigned)n - 1), 0);
    pthread_t t[5];
    void *(*fn[5])(void *) = {dep_owner, dep_freer, dep_taker, dep_freer, dep_trimmer};
    void *arg[5] = {&r, &f1, &r, &f0, &r};
    if (!third)
        fn[3] = dep_trimmer, arg[3] = &r;
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(pthread_create(&t[i], NULL, fn[i], arg[i]), 0);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(pthread_join(t[i], NULL), 0);
    ck_assert_int_eq(pthread_barrier_destroy(&r.bar), 0);
    ck_assert_msg(atomic_load(&r.violations) == 0 && atomic_load(&r.errors) == 0,
                  "%s: %d violation(s), %d error(s); first: %s", spec, atomic_load(&r.violations),
                  atomic_load(&r.errors), r.first);
    ck_assert_int_eq(bfc_ctx_check(r.ctx), BFC_OK);
    ck_assert_uint_eq(st(r.ctx).bytes_in_use, 0);
    *c_got += atomic_load(&r.c_got);
    bfc_sim_stream_destroy(r.ctx, r.a);
    bfc_sim_stream_destroy(r.ctx, r.b);
    bfc_sim_stream_destroy(r.ctx, r.c);
    bfc_ctx_destroy(r.ctx);
}

START_TEST(test_departures_race)
{
    static const char *const specs[] = {
        "memory_limit=64M,vmm=off,allow_growth=false",
        "memory_limit=64M,vmm=off",
        "memory_limit=32M,vmm=on",
    };
    int cycles = g_long ? 10000 : 1500;
    uint64_t c_got = 0;
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        for (uint64_t seed = 1; seed <= (g_long ? 2 : 1); seed++)
            dep_race_run(specs[i], seed, i == 0 ? 2 * cycles : cycles, (seed + i) % 2 == 1, &c_got);
    ck_assert_msg(c_got > 0, "C never got memory: the test proves nothing");
}
END_TEST

/* ---------------------------------------------------------------- main */

static Suite *safety_suite(void)
{
    Suite *s = suite_create("safety");

    TCase *h = tcase_create("handoff");
    /* The reclaim_wait cases wait 0.3 s (up to retry_ms = 2 s if broken). */
    tcase_set_timeout(h, 30);
    tcase_add_test(h, test_large_own);
    tcase_add_test(h, test_large_record);
    tcase_add_test(h, test_large_cross);
    tcase_add_test(h, test_release_own);
    tcase_add_test(h, test_release_record);
    tcase_add_test(h, test_release_cross);
    tcase_add_test(h, test_reclaim_own);
    tcase_add_test(h, test_reclaim_record);
    tcase_add_test(h, test_reclaim_cross);
    tcase_add_test(h, test_reclaim_wait_own);
    tcase_add_test(h, test_reclaim_wait_record);
    tcase_add_test(h, test_reclaim_wait_cross);
    suite_add_tcase(s, h);

    TCase *p = tcase_create("pool");
    tcase_set_timeout(p, 30);
    tcase_add_test(p, test_fixed_pool_emptied);
    tcase_add_test(p, test_growth_pool_emptied);
    tcase_add_test(p, test_growth_across_shards_idle);
    tcase_add_test(p, test_growth_across_shards_held);
    tcase_add_test(p, test_fixed_across_shards_idle);
    tcase_add_test(p, test_fixed_across_shards_held);
    tcase_add_test(p, test_tf_layout_large_off);
    tcase_add_test(p, test_tf_layout_default);
    tcase_add_test(p, test_fixed_second_stream);
    tcase_add_test(p, test_released_stream_used);
    suite_add_tcase(s, p);

    /* Sanitizer builds run the same sizes several times slower. */
    TCase *m = tcase_create("model");
    tcase_set_timeout(m, g_long ? 3600 : 300);
    tcase_add_test(m, test_model);
    suite_add_tcase(s, m);

    TCase *mf = tcase_create("model_faults");
    tcase_set_timeout(mf, g_long ? 3600 : 300);
    tcase_add_test(mf, test_model_faults);
    suite_add_tcase(s, mf);

    TCase *mt = tcase_create("model_threads");
    tcase_set_timeout(mt, g_long ? 3600 : 300);
    tcase_add_test(mt, test_model_threads);
    suite_add_tcase(s, mt);

    TCase *dr = tcase_create("departures");
    tcase_set_timeout(dr, g_long ? 3600 : 300);
    tcase_add_test(dr, test_departures_race);
    suite_add_tcase(s, dr);
    return s;
}

int main(void)
{
    const char *mode = getenv("SHARDBFC_STRESS");
    g_long = mode && strcmp(mode, "long") == 0;
    SRunner *sr = srunner_create(safety_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
