/*
 * test_rcu.c -- the inlined RCU read side (src/rcu.h, src/rcu.c).
 *
 * The library opens its read sections itself on urcu-bp's reader record,
 * cached in an initial-exec thread-local, instead of calling liburcu-bp.
 * These tests check that such a section is one urcu-bp sees: the cache
 * points at the thread's own urcu-bp record and nests as urcu-bp does; a
 * grace period waits for a reader inside an inlined section and ends once
 * it leaves; a thread's exit empties the cache before urcu-bp's key
 * destructor frees the record, so memory freed from an application's key
 * destructor still works; and threads that come and go (their records
 * reused by later threads) while grace periods run leave no reader stuck.
 */
#include "testutil.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "rcu.h"

/* ------------------------------------------------------- the cache */

/* Called inside one read section on record rec: the nest count there, in a
 * second section, and once both (the caller's too) are closed. */
static void nesting(const unsigned long *rec, unsigned long nest[3])
{
    nest[0] = *rec & URCU_BP_GP_CTR_NEST_MASK;
    bfc__rcu_lock();
    nest[1] = *rec & URCU_BP_GP_CTR_NEST_MASK;
    bfc__rcu_unlock();
    bfc__rcu_unlock();
    nest[2] = *rec & URCU_BP_GP_CTR_NEST_MASK;
}

struct cache_probe {
    bool empty_before;
    bool same_record;
    unsigned long nest[3];
};

static void *cache_thread(void *arg)
{
    struct cache_probe *pr = arg;
    pr->empty_before = bfc__rcu_ctr == NULL;
    bfc__rcu_lock();
    /* Compared as addresses: urcu-bp's records may lie below their type's
     * alignment, so the record is not dereferenced through its type. */
    pr->same_record = bfc__rcu_ctr != NULL && (void *)bfc__rcu_ctr == (void *)URCU_TLS(urcu_bp_reader);
    nesting(bfc__rcu_ctr, pr->nest);
    return NULL;
}

START_TEST(test_cache_is_urcu_record)
{
    /* The inline cache is filled only where urcu-bp uses membarrier (an
     * old kernel or a filtering sandbox has none); test_no_membarrier_fences
     * covers the other case. */
    if (!urcu_bp_has_sys_membarrier)
        return;
    struct cache_probe pr;
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, cache_thread, &pr), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert(pr.empty_before);
    ck_assert(pr.same_record);
    ck_assert_uint_eq(pr.nest[0], 1);
    ck_assert_uint_eq(pr.nest[1], 2);
    ck_assert_uint_eq(pr.nest[2], 0);
}
END_TEST

/* ------------------------------------------------ without membarrier */

/* Where urcu-bp has no membarrier its readers must fence: the inline cache
 * stays empty, and the sections run out of line with full fences on the
 * second cache, which holds the thread's own urcu-bp record (nesting as
 * urcu-bp does). */
struct nomb_probe {
    bool empty_inside, empty_after, fenced_record;
    unsigned long nest[3];
    bool alloc_ok;
};

static void *nomb_thread(void *arg)
{
    struct nomb_probe *pr = arg;
    /* Converted, not dereferenced through its type (see cache_thread). */
    bfc__rcu_lock();
    const unsigned long *rec = (const unsigned long *)(const void *)URCU_TLS(urcu_bp_reader);
    pr->empty_inside = bfc__rcu_ctr == NULL;
    pr->fenced_record = (const void *)bfc__rcu_ctr_fenced == (const void *)rec;
    nesting(rec, pr->nest);
    bfc_config_t cfg = sim_cfg(64 * MiB);
    bfc_ctx_t *ctx = NULL;
    if (bfc_ctx_create(&cfg, &ctx) == BFC_OK) {
        bfc_stream_t s = bfc_sim_stream_create(ctx);
        void *p = bfc_ctx_alloc(ctx, s, 5000);
        pr->alloc_ok = p != NULL && bfc_ctx_free(ctx, p, s) == BFC_OK && bfc_ctx_check(ctx) == BFC_OK;
        bfc_ctx_destroy(ctx);
    }
    pr->empty_after = bfc__rcu_ctr == NULL;
    return NULL;
}

START_TEST(test_no_membarrier_fences)
{
    /* This process only (Check forks each test); restored below. */
    int saved = urcu_bp_has_sys_membarrier;
    urcu_bp_has_sys_membarrier = 0;
    struct nomb_probe pr = { 0 };
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, nomb_thread, &pr), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    urcu_bp_has_sys_membarrier = saved;
    ck_assert(pr.empty_inside);
    ck_assert(pr.fenced_record);
    ck_assert(pr.empty_after);
    ck_assert_uint_eq(pr.nest[0], 1);
    ck_assert_uint_eq(pr.nest[1], 2);
    ck_assert_uint_eq(pr.nest[2], 0);
    ck_assert(pr.alloc_ok);
}
END_TEST

/* ------------------------------------------- grace periods wait for us */

static atomic_int reader_in, reader_go, sync_done;

static void *reader_thread(void *arg)
{
    (void)arg;
    bfc__rcu_lock();
    atomic_store(&reader_in, 1);
    while (!atomic_load(&reader_go))
        usleep(1000);
    /* The grace period has not ended while we are inside. */
    int early = atomic_load(&sync_done);
    bfc__rcu_unlock();
    return (void *)(intptr_t)early;
}

static void *sync_thread(void *arg)
{
    (void)arg;
    synchronize_rcu();
    atomic_store(&sync_done, 1);
    return NULL;
}

START_TEST(test_grace_period_waits)
{
    pthread_t r, w;
    atomic_store(&reader_in, 0);
    atomic_store(&reader_go, 0);
    atomic_store(&sync_done, 0);
    ck_assert_int_eq(pthread_create(&r, NULL, reader_thread, NULL), 0);
    while (!atomic_load(&reader_in))
        usleep(1000);
    ck_assert_int_eq(pthread_create(&w, NULL, sync_thread, NULL), 0);
    usleep(200 * 1000);
    ck_assert_msg(!atomic_load(&sync_done), "a grace period ended inside an inlined read section");
    atomic_store(&reader_go, 1);
    void *early;
    ck_assert_int_eq(pthread_join(r, &early), 0);
    ck_assert_ptr_null(early);
    ck_assert_int_eq(pthread_join(w, NULL), 0);
    ck_assert(atomic_load(&sync_done));
}
END_TEST

/* -------------------------------------------------- a thread's exit */

static pthread_key_t late_key;
static bfc_ctx_t *g_ctx;
static bfc_stream_t g_stream;

struct late {
    void *p;
    bool cache_empty;  /* the cache was emptied before this destructor */
    int free_status;
    bool alloc_ok;
};

/* An application's key destructor: it runs after the library's
 * thread_local destructor, and frees (and allocates) memory. */
static void late_dtor(void *arg)
{
    struct late *l = arg;
    l->cache_empty = bfc__rcu_ctr == NULL;
    l->free_status = bfc_ctx_free(g_ctx, l->p, g_stream);
    void *q = bfc_ctx_alloc(g_ctx, g_stream, 4096);
    l->alloc_ok = q != NULL && bfc_ctx_free(g_ctx, q, g_stream) == BFC_OK;
}

static void *exiting_thread(void *arg)
{
    struct late *l = arg;
    l->p = bfc_ctx_alloc(g_ctx, g_stream, 1000);
    if (l->p)
        pthread_setspecific(late_key, l);
    return NULL;
}

START_TEST(test_exit_empties_cache)
{
    bfc_config_t cfg = sim_cfg(256 * MiB);
    g_ctx = ctx_new(&cfg);
    g_stream = new_stream(g_ctx);
    ck_assert_int_eq(pthread_key_create(&late_key, late_dtor), 0);
    for (int i = 0; i < 8; i++) {
        struct late l = { 0 };
        pthread_t t;
        ck_assert_int_eq(pthread_create(&t, NULL, exiting_thread, &l), 0);
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        ck_assert_ptr_nonnull(l.p);
        ck_assert(l.cache_empty);
        ck_assert_int_eq(l.free_status, BFC_OK);
        ck_assert(l.alloc_ok);
    }
    /* No section was left open on a record: a grace period ends. */
    synchronize_rcu();
    ck_assert_uint_eq(st(g_ctx).bytes_in_use, 0);
    xcheck(g_ctx);
    pthread_key_delete(late_key);
    bfc_ctx_destroy(g_ctx);
}
END_TEST

/*
 * A thread whose first use of the library comes from a key destructor, after
 * glibc ran the thread_local destructors (the cache's own hook, registered
 * then, never runs): urcu-bp registers it and, in the next round, its key
 * destructor frees the record.  The cache must be empty before that record
 * goes to another thread: sections through it stored into the next owner's
 * counter, and the next registration aborted in urcu-bp's add_thread
 * (`rcu_reader_reg->ctr == 0`), every time with 100 such threads in a row.
 */
static pthread_key_t first_key;

struct first_use {
    int rounds_seen;
    bool cache_empty_later; /* every round after the first saw the cache empty */
    bool ok;
};

/* LeakSanitizer's (sanitizer builds only): glibc never frees the record of
 * a thread_local destructor registered after the thread's own ran -- the
 * cache's hook, registered by a first section inside a key destructor
 * (src/rcu.c) -- 32 bytes per such thread. */
extern void __lsan_disable(void) __attribute__((weak));
extern void __lsan_enable(void) __attribute__((weak));

static void first_dtor(void *arg)
{
    struct first_use *u = arg;
    if (u->rounds_seen++ > 0 && bfc__rcu_ctr != NULL)
        u->cache_empty_later = false;
    if (__lsan_disable)
        __lsan_disable();
    void *p = bfc_ctx_alloc(g_ctx, g_stream, 1000);
    if (!p || bfc_ctx_free(g_ctx, p, g_stream) != BFC_OK)
        u->ok = false;
    if (__lsan_enable)
        __lsan_enable();
    if (u->rounds_seen < 3)
        pthread_setspecific(first_key, u);
}

static void *first_use_thread(void *arg)
{
    pthread_setspecific(first_key, arg);
    return NULL;
}

START_TEST(test_first_use_in_key_destructor)
{
    bfc_config_t cfg = sim_cfg(256 * MiB);
    g_ctx = ctx_new(&cfg);
    g_stream = new_stream(g_ctx);
    /* created after the library's own key, as an application's are */
    ck_assert_int_eq(pthread_key_create(&first_key, first_dtor), 0);
    for (int i = 0; i < 100; i++) {
        struct first_use u = { 0, true, true };
        pthread_t t;
        ck_assert_int_eq(pthread_create(&t, NULL, first_use_thread, &u), 0);
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        ck_assert_int_eq(u.rounds_seen, 3);
        ck_assert(u.ok);
        ck_assert_msg(u.cache_empty_later, "thread %d: the cache outlived the round its record was freed in", i);
    }
    /* No section was left open on a record: a grace period ends. */
    synchronize_rcu();
    ck_assert_uint_eq(st(g_ctx).bytes_in_use, 0);
    xcheck(g_ctx);
    pthread_key_delete(first_key);
    bfc_ctx_destroy(g_ctx);
}
END_TEST

/* ---------------------------- threads come and go during grace periods */

#define CHURN_THREADS 4
static atomic_int churn_stop;
static atomic_long churn_syncs;

static void churn_dtor(void *arg)
{
    (void)arg;
    /* A section after the cache was emptied: urcu-bp's own calls. */
    bfc__rcu_lock();
    bfc__rcu_unlock();
}

static void *short_thread(void *arg)
{
    (void)arg;
    for (int i = 0; i < 100; i++) {
        bfc__rcu_lock();
        bfc__rcu_lock();
        bfc__rcu_unlock();
        bfc__rcu_unlock();
    }
    pthread_setspecific(late_key, (void *)1);
    return NULL;
}

static void *spawner(void *arg)
{
    (void)arg;
    while (!atomic_load(&churn_stop)) {
        pthread_t t;
        if (pthread_create(&t, NULL, short_thread, NULL) != 0)
            return (void *)1;
        pthread_join(t, NULL);
    }
    return NULL;
}

static void *syncer(void *arg)
{
    (void)arg;
    while (!atomic_load(&churn_stop)) {
        synchronize_rcu();
        atomic_fetch_add(&churn_syncs, 1);
    }
    return NULL;
}

START_TEST(test_threads_come_and_go)
{
    ck_assert_int_eq(pthread_key_create(&late_key, churn_dtor), 0);
    atomic_store(&churn_stop, 0);
    atomic_store(&churn_syncs, 0);
    pthread_t sp[CHURN_THREADS], sy;
    for (int i = 0; i < CHURN_THREADS; i++)
        ck_assert_int_eq(pthread_create(&sp[i], NULL, spawner, NULL), 0);
    ck_assert_int_eq(pthread_create(&sy, NULL, syncer, NULL), 0);
    usleep(1500 * 1000);
    atomic_store(&churn_stop, 1);
    for (int i = 0; i < CHURN_THREADS; i++) {
        void *bad;
        ck_assert_int_eq(pthread_join(sp[i], &bad), 0);
        ck_assert_ptr_null(bad);
    }
    ck_assert_int_eq(pthread_join(sy, NULL), 0);
    /* Grace periods kept ending while records were freed and reused: a
     * stale cached record would have left a reader's count behind and
     * stalled them (the test's timeout), and this one would not return. */
    ck_assert_int_gt(atomic_load(&churn_syncs), 0);
    synchronize_rcu();
    pthread_key_delete(late_key);
}
END_TEST

static Suite *rcu_suite(void)
{
    Suite *s = suite_create("rcu");
    TCase *tc = tcase_create("rcu");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_cache_is_urcu_record);
    tcase_add_test(tc, test_no_membarrier_fences);
    tcase_add_test(tc, test_grace_period_waits);
    tcase_add_test(tc, test_exit_empties_cache);
    tcase_add_test(tc, test_first_use_in_key_destructor);
    tcase_add_test(tc, test_threads_come_and_go);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return run_suite(rcu_suite());
}
