/*
 * test_stress.c -- multithreaded stress of the sharded allocator through the
 * public API (SIM backend).
 *
 * Threads, all sharing one context:
 *   - NWORK workers, each with its own stream, doing random alloc / free
 *     (same-stream), now and then a record_stream on another worker's stream
 *     and now and then a hold/drain of their own stream;
 *   - NPAIR producer/consumer pairs: the producer allocates on its stream and
 *     hands blocks through a mutex+condvar ring to the consumer, which
 *     verifies and frees them on its own stream (cross-stream frees), holding
 *     and draining its stream at random so that fences are really pending;
 *     blocks freed while held are checked again just before the drain (the
 *     memory must not have been handed to anyone meanwhile);
 *   - one churn thread that creates a stream, allocates on it, releases the
 *     shard with blocks still live, then frees them on assorted streams;
 *   - the main thread, which reads statistics and trims meanwhile.
 *
 * Every block carries a pattern written at allocation: a 64-bit tag unique
 * to the allocation, stored at every 256-byte step and in the last 8 bytes;
 * it is verified at free.  Two live blocks that overlapped, or a block reused
 * while still live or still fenced (its tag overwritten by another thread's
 * pattern), fail the check.
 *
 * At the end: every block freed, every stream drained; the context reports
 * bytes_in_use == 0, num_pending_frees == 0, num_allocs == num_frees == the
 * operations counted here, a positive num_remote_frees, and bfc_ctx_check ==
 * BFC_OK.  Short mode (default, `make check`) runs ~2 s; SHARDBFC_STRESS=long
 * (`make stress`) runs ~60 s.  A one-line summary is printed.
 */
#include "testutil.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


enum {
    NWORK = 8,
    NPAIR = 2,
    WORK_SLOTS = 64,
    RING = 128,
};

static bfc_ctx_t *g_ctx;
static atomic_bool g_stop;
static atomic_bool g_failed;
static char g_why[512];
static pthread_mutex_t g_why_lock = PTHREAD_MUTEX_INITIALIZER;
static double g_seconds;

static atomic_ullong g_allocs, g_frees, g_cross, g_records, g_oom;
static atomic_ullong g_tag = 1;

/* Records the first failure (Check's asserts are not for other threads)
 * and stops everyone. */
__attribute__((format(printf, 1, 2))) static void stress_fail(const char *fmt, ...)
{
    if (pthread_mutex_lock(&g_why_lock) != 0)
        return;
    if (!atomic_load(&g_failed)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g_why, sizeof g_why, fmt, ap);
        va_end(ap);
        atomic_store(&g_failed, true);
    }
    pthread_mutex_unlock(&g_why_lock);
    atomic_store(&g_stop, true);
}

/* A size: mostly small, some medium, rarely large (up to 1 MiB, which
 * takes the large-region path above large_alloc = 512 KiB). */
static size_t rand_size(uint64_t *r)
{
    uint64_t x = rng_next(r);
    switch (x % 16) {
    case 0:
        return (size_t)(x >> 8) % (1 * MiB) + 1;
    case 1:
    case 2:
    case 3:
        return (size_t)(x >> 8) % (256 * KiB) + 1;
    default:
        return (size_t)(x >> 8) % (8 * KiB) + 1;
    }
}

struct blk {
    void *p;
    size_t n;
    uint64_t tag;
};

static void stamp(struct blk *b)
{
    unsigned char *c = b->p;
    /* Strided copies stop short of the tail copy so the two never overlap. */
    for (size_t off = 0; off + 16 <= b->n; off += 256)
        memcpy(c + off, &b->tag, 8);
    if (b->n >= 8)
        memcpy(c + b->n - 8, &b->tag, 8);
    else
        memset(c, (int)(b->tag & 0xff), b->n);
}

static bool verify(const struct blk *b)
{
    const unsigned char *c = b->p;
    uint64_t v;
    for (size_t off = 0; off + 16 <= b->n; off += 256) {
        memcpy(&v, c + off, 8);
        if (v != b->tag)
            return false;
    }
    if (b->n >= 8) {
        memcpy(&v, c + b->n - 8, 8);
        return v == b->tag;
    }
    for (size_t i = 0; i < b->n; i++)
        if (c[i] != (unsigned char)(b->tag & 0xff))
            return false;
    return true;
}

static bool take(bfc_stream_t s, size_t n, struct blk *b)
{
    void *p = bfc_ctx_alloc(g_ctx, s, n);
    if (!p) {
        int e = bfc_last_error();
        if (e != BFC_ENOMEM)
            stress_fail("alloc(%zu): %s", n, bfc_err_name(e));
        atomic_fetch_add(&g_oom, 1);
        return false;
    }
    if ((uintptr_t)p & 255)
        stress_fail("alloc(%zu) = %p: misaligned", n, p);
    b->p = p;
    b->n = n;
    b->tag = atomic_fetch_add(&g_tag, 1);
    stamp(b);
    atomic_fetch_add(&g_allocs, 1);
    return true;
}

static void give(struct blk *b, bfc_stream_t s, bool cross)
{
    if (!verify(b))
        stress_fail("block %p (tag %llu, size %zu) overwritten while live", b->p, (unsigned long long)b->tag, b->n);
    int rc = bfc_ctx_free(g_ctx, b->p, s);
    if (rc != BFC_OK)
        stress_fail("free(%p) (tag %llu): %s", b->p, (unsigned long long)b->tag, bfc_err_name(rc));
    atomic_fetch_add(&g_frees, 1);
    if (cross)
        atomic_fetch_add(&g_cross, 1);
    b->p = NULL;
}

/* --------------------------------------------------------- workers */

static bfc_stream_t g_work_stream[NWORK];

static void *worker(void *arg)
{
    int me = (int)(intptr_t)arg;
    bfc_stream_t s = g_work_stream[me];
    uint64_t r = 0x1234u + (uint64_t)me * 7919u;
    struct blk live[WORK_SLOTS];
    memset(live, 0, sizeof live);
    bool held = false;
    while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
        uint64_t x = rng_next(&r);
        int slot = (int)(x % WORK_SLOTS);
        if (live[slot].p) {
            give(&live[slot], s, false);
        } else {
            (void)take(s, rand_size(&r), &live[slot]);
            /* Sometimes another stream uses the block too. */
            if (live[slot].p && x % 61 == 0) {
                bfc_stream_t other = g_work_stream[(me + 1 + (int)(x % (NWORK - 1))) % NWORK];
                int rc = bfc_ctx_record_stream(g_ctx, live[slot].p, other);
                if (rc != BFC_OK)
                    stress_fail("record_stream(%p): %s", live[slot].p, bfc_err_name(rc));
                atomic_fetch_add(&g_records, 1);
            }
        }
        if (x % 97 == 0) {
            if (held)
                bfc_sim_stream_drain(g_ctx, s);
            else
                bfc_sim_stream_hold(g_ctx, s);
            held = !held;
        }
    }
    for (int i = 0; i < WORK_SLOTS; i++)
        if (live[i].p)
            give(&live[i], s, false);
    bfc_sim_stream_drain(g_ctx, s);
    return NULL;
}

/* ------------------------------------------------ producer/consumer */

struct ring {
    pthread_mutex_t lock;
    pthread_cond_t nonempty, nonfull;
    struct blk v[RING];
    unsigned head, tail; /* head: next to pop; tail: next to push */
    bool done;
    bfc_stream_t ps, cs;
    uint64_t seed;
};

static struct ring g_ring[NPAIR];

static void *producer(void *arg)
{
    struct ring *q = arg;
    uint64_t r = q->seed;
    while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
        struct blk b;
        if (!take(q->ps, rand_size(&r) % (64 * KiB) + 1, &b))
            continue;
        if (pthread_mutex_lock(&q->lock) != 0) {
            stress_fail("pthread_mutex_lock failed");
            break;
        }
        while (q->tail - q->head == RING && !atomic_load(&g_stop)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 10000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            (void)pthread_cond_timedwait(&q->nonfull, &q->lock, &ts);
        }
        if (q->tail - q->head == RING) {
            /* Stopping with a full ring: free this one ourselves. */
            pthread_mutex_unlock(&q->lock);
            give(&b, q->ps, false);
            break;
        }
        q->v[q->tail++ % RING] = b;
        pthread_cond_signal(&q->nonempty);
        pthread_mutex_unlock(&q->lock);
        if (rng_next(&r) % 53 == 0) {
            /* Holding the producer's own stream changes nothing for
             * cross-stream frees into it: only the consumer's fences count. */
            bfc_sim_stream_hold(g_ctx, q->ps);
            bfc_sim_stream_drain(g_ctx, q->ps);
        }
    }
    if (pthread_mutex_lock(&q->lock) == 0) {
        q->done = true;
        pthread_cond_broadcast(&q->nonempty);
        pthread_mutex_unlock(&q->lock);
    }
    return NULL;
}

/* Blocks the consumer freed while its stream was held: the "device" may
 * still be reading them, so until the drain nobody may get that memory.  A
 * producer that did would stamp its own tag over ours; the consumer checks
 * just before draining. */
enum { INFLIGHT = 64 };

static void check_inflight(struct blk *v, int *n)
{
    for (int i = 0; i < *n; i++)
        if (!verify(&v[i]))
            stress_fail("block %p (tag %llu, size %zu) reused while its cross-stream fence was pending",
                        v[i].p, (unsigned long long)v[i].tag, v[i].n);
    *n = 0;
}

static void *consumer(void *arg)
{
    struct ring *q = arg;
    uint64_t r = q->seed ^ 0xABCDEFull;
    bool held = false;
    struct blk inflight[INFLIGHT];
    int ninflight = 0;
    for (;;) {
        if (pthread_mutex_lock(&q->lock) != 0) {
            stress_fail("pthread_mutex_lock failed");
            break;
        }
        while (q->tail == q->head && !q->done)
            pthread_cond_wait(&q->nonempty, &q->lock);
        if (q->tail == q->head && q->done) {
            pthread_mutex_unlock(&q->lock);
            break;
        }
        struct blk b = q->v[q->head++ % RING];
        pthread_cond_signal(&q->nonfull);
        pthread_mutex_unlock(&q->lock);
        struct blk keep = b;
        give(&b, q->cs, true);
        if (held)
            inflight[ninflight++] = keep;
        uint64_t x = rng_next(&r);
        if (x % 29 == 0 || ninflight == INFLIGHT) {
            if (held) {
                check_inflight(inflight, &ninflight);
                bfc_sim_stream_drain(g_ctx, q->cs);
            } else {
                bfc_sim_stream_hold(g_ctx, q->cs);
            }
            held = !held;
        }
    }
    check_inflight(inflight, &ninflight);
    bfc_sim_stream_drain(g_ctx, q->cs);
    return NULL;
}

/* --------------------------------------------------------- shard churn */

static atomic_ullong g_released;

static void *churn(void *arg)
{
    (void)arg;
    uint64_t r = 0xC0FFEEu;
    bfc_stream_t other = bfc_sim_stream_create(g_ctx);
    if (!other) {
        stress_fail("bfc_sim_stream_create failed");
        return NULL;
    }
    /* SIM stream records are never reused: cap the number created. */
    for (int it = 0; it < 20000 && !atomic_load_explicit(&g_stop, memory_order_relaxed); it++) {
        bfc_stream_t s = bfc_sim_stream_create(g_ctx);
        if (!s) {
            stress_fail("bfc_sim_stream_create failed at iteration %d", it);
            break;
        }
        struct blk b[8];
        int nb = 0;
        for (int i = 0; i < 8; i++)
            if (take(s, rand_size(&r) % (32 * KiB) + 1, &b[nb]))
                nb++;
        bool hold = rng_next(&r) % 2;
        if (hold)
            bfc_sim_stream_hold(g_ctx, other);
        int rc = bfc_ctx_stream_release(g_ctx, s);
        if (nb > 0 && rc != BFC_OK)
            stress_fail("stream_release (iteration %d): %s", it, bfc_err_name(rc));
        for (int i = 0; i < nb; i++) {
            int how = (int)(rng_next(&r) % 3);
            give(&b[i], how == 0 ? s : how == 1 ? other : NULL, how != 0);
        }
        if (hold)
            bfc_sim_stream_drain(g_ctx, other);
        bfc_sim_stream_destroy(g_ctx, s);
        atomic_fetch_add(&g_released, 1);
        struct timespec ts = { 0, 200000 };
        nanosleep(&ts, NULL);
    }
    bfc_sim_stream_drain(g_ctx, other);
    return NULL;
}

/* ---------------------------------------------------------------- test */

START_TEST(test_stress)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 4096 * MiB;
    c.allow_growth = true;
    c.initial_region = 2 * MiB;
    c.large_alloc = 512 * KiB; /* the large-region path is exercised too */
    c.garbage_collection = true;
    ck_assert_int_eq(bfc_ctx_create(&c, &g_ctx), BFC_OK);
    atomic_store(&g_stop, false);

    for (int i = 0; i < NWORK; i++) {
        g_work_stream[i] = bfc_sim_stream_create(g_ctx);
        ck_assert_ptr_nonnull(g_work_stream[i]);
    }
    for (int i = 0; i < NPAIR; i++) {
        struct ring *q = &g_ring[i];
        memset(q, 0, sizeof *q);
        ck_assert_int_eq(pthread_mutex_init(&q->lock, NULL), 0);
        ck_assert_int_eq(pthread_cond_init(&q->nonempty, NULL), 0);
        ck_assert_int_eq(pthread_cond_init(&q->nonfull, NULL), 0);
        q->ps = bfc_sim_stream_create(g_ctx);
        q->cs = bfc_sim_stream_create(g_ctx);
        ck_assert_ptr_nonnull(q->ps);
        ck_assert_ptr_nonnull(q->cs);
        q->seed = 0x5EED0000u + (uint64_t)i;
    }

    pthread_t wt[NWORK], pt[NPAIR], ct[NPAIR], chth;
    for (int i = 0; i < NWORK; i++)
        ck_assert_int_eq(pthread_create(&wt[i], NULL, worker, (void *)(intptr_t)i), 0);
    for (int i = 0; i < NPAIR; i++) {
        ck_assert_int_eq(pthread_create(&pt[i], NULL, producer, &g_ring[i]), 0);
        ck_assert_int_eq(pthread_create(&ct[i], NULL, consumer, &g_ring[i]), 0);
    }
    ck_assert_int_eq(pthread_create(&chth, NULL, churn, NULL), 0);

    double t0 = now_s();
    unsigned polls = 0;
    while (!atomic_load(&g_stop) && now_s() - t0 < g_seconds) {
        struct timespec ts = { 0, 50 * 1000000L };
        nanosleep(&ts, NULL);
        bfc_stats_t s;
        ck_assert_int_eq(bfc_ctx_stats(g_ctx, &s), BFC_OK);
        ck_assert_uint_le(s.bytes_reserved, c.memory_limit);
        ck_assert_uint_le(s.bytes_in_use, s.bytes_reserved);
        if (++polls % 4 == 0)
            ck_assert_int_eq(bfc_ctx_trim(g_ctx), BFC_OK);
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < NWORK; i++)
        ck_assert_int_eq(pthread_join(wt[i], NULL), 0);
    for (int i = 0; i < NPAIR; i++) {
        ck_assert_int_eq(pthread_join(pt[i], NULL), 0);
        ck_assert_int_eq(pthread_join(ct[i], NULL), 0);
    }
    ck_assert_int_eq(pthread_join(chth, NULL), 0);
    ck_assert_msg(!atomic_load(&g_failed), "%s", g_why);

    /* Every stream drained; then nothing may be in use or pending. */
    for (int i = 0; i < NWORK; i++)
        bfc_sim_stream_drain(g_ctx, g_work_stream[i]);
    for (int i = 0; i < NPAIR; i++) {
        bfc_sim_stream_drain(g_ctx, g_ring[i].ps);
        bfc_sim_stream_drain(g_ctx, g_ring[i].cs);
    }
    bfc_stats_t s;
    ck_assert_int_eq(bfc_ctx_stats(g_ctx, &s), BFC_OK);
    unsigned long long allocs = atomic_load(&g_allocs), frees = atomic_load(&g_frees);
    printf("test_stress: %.1f s, %llu allocs, %llu frees (%llu cross-stream, %llu record_stream), "
           "%llu shards released, %llu OOMs; context: %llu remote frees, peak reserved %llu MiB\n",
           now_s() - t0, allocs, frees, (unsigned long long)atomic_load(&g_cross),
           (unsigned long long)atomic_load(&g_records), (unsigned long long)atomic_load(&g_released),
           (unsigned long long)atomic_load(&g_oom), (unsigned long long)s.num_remote_frees,
           (unsigned long long)(s.peak_bytes_reserved / MiB));
    fflush(stdout);
    ck_assert_uint_eq(allocs, frees);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(s.bytes_requested, 0);
    ck_assert_uint_eq(s.num_pending_frees, 0);
    ck_assert_uint_eq(s.bytes_pending, 0);
    ck_assert_uint_gt(allocs, 1000);
    ck_assert_uint_gt(atomic_load(&g_cross), 100);
    /* Cumulative counters survive shard release and reclamation. */
    ck_assert_uint_eq(s.num_allocs, allocs);
    ck_assert_uint_eq(s.num_allocs, s.num_frees);
    ck_assert_uint_gt(s.num_remote_frees, 0);
    ck_assert_uint_le(s.num_remote_frees, atomic_load(&g_cross));
    /* Workers and producers allocate; consumers and the churn's freeing
     * stream only free (no shard); churned shards were released. */
    ck_assert_uint_eq(s.num_shards, NWORK + NPAIR);
    char buf[1024];
    buf[0] = '\0';
    int rc = bfc_ctx_check_report(g_ctx, buf, sizeof buf);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_check: %s", buf);
    /* Everything fully free goes back on trim. */
    ck_assert_int_eq(bfc_ctx_trim(g_ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stats(g_ctx, &s), BFC_OK);
    ck_assert_uint_eq(s.num_regions, 0);
    ck_assert_uint_eq(s.bytes_reserved, 0);
    ck_assert_int_eq(bfc_ctx_check(g_ctx), BFC_OK);
    bfc_ctx_destroy(g_ctx);
    g_ctx = NULL;
}
END_TEST

int main(void)
{
    const char *mode = getenv("SHARDBFC_STRESS");
    bool long_mode = mode && strcmp(mode, "long") == 0;
    g_seconds = long_mode ? 60.0 : 2.0;
    Suite *s = suite_create("stress");
    TCase *tc = tcase_create("threads");
    tcase_set_timeout(tc, long_mode ? 600 : 120);
    tcase_add_test(tc, test_stress);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
