/*
 * test_backend_sim.c -- the SIM backend's contract (src/backend_sim.c):
 * memory (alignment, NORESERVE, ceiling, fault injection), the stream/event
 * model (hold/drain generations, default, unknown and destroyed streams,
 * ids, table exhaustion), event_wait timeouts, and concurrent use; and, at
 * the public API, that a handle SIM never made or has destroyed is refused
 * by every call that names a stream.
 */
#define BFC_TESTUTIL_NO_CTX
#include "testutil.h"
#include "clockfail.h"

#include "backend.h"
#include "meta.h"

#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

static bfc__backend_t *open_sim_cfg(const bfc_config_t *cfg)
{
    bfc__backend_t *be = NULL;

    ck_assert_int_eq(bfc__backend_sim_open(cfg, &be), BFC_OK);
    ck_assert_ptr_nonnull(be);
    return be;
}

static bfc__backend_t *open_sim(void)
{
    bfc_config_t cfg;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    return open_sim_cfg(&cfg);
}

START_TEST(test_identity)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;
    size_t f = 0, t = 0;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_OK);
    ck_assert_int_eq(be->kind, BFC_BACKEND_SIM);
    ck_assert_str_eq(be->name, "sim");
    ck_assert(be->host_accessible);
    ck_assert_uint_eq(be->default_limit, 16 * BFC__GiB);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);
    ck_assert_uint_eq(t, 16 * BFC__GiB);
    ck_assert_uint_eq(f, 16 * BFC__GiB);
    ck_assert_int_eq(be->ops->host_register(be, &cfg, sizeof(cfg)), BFC_OK);
    ck_assert_int_eq(be->ops->host_unregister(be, &cfg), BFC_OK);
    be->ops->close(be);

    cfg.memory_limit = 3 * BFC__MiB;
    be = open_sim_cfg(&cfg);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);
    ck_assert_uint_eq(t, 3 * BFC__MiB);
    be->ops->close(be);

    ck_assert_int_eq(bfc__backend_open(NULL, &be), BFC_EINVAL);
    cfg.backend = (bfc_backend_t)42;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_EINVAL);
}
END_TEST

START_TEST(test_alloc_align_rw)
{
    bfc__backend_t *be = open_sim();
    static const size_t sizes[] = {256, 1000, 4096, 65536 + 256, 3 * BFC__MiB};
    void *p[5];
    size_t i, f, t;

    for (i = 0; i < 5; i++) {
        ck_assert_int_eq(be->ops->mem_alloc(be, sizes[i], &p[i]), BFC_OK);
        ck_assert_ptr_nonnull(p[i]);
        ck_assert_uint_eq((uintptr_t)p[i] % 256, 0);
        memset(p[i], (int)i + 1, sizes[i]);
    }
    for (i = 0; i < 5; i++) {
        unsigned char *c = p[i];

        ck_assert_uint_eq(c[0], i + 1);
        ck_assert_uint_eq(c[sizes[i] - 1], i + 1);
    }
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 256 + 1000 + 4096 + 65536 + 256 + 3 * BFC__MiB);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);
    ck_assert_uint_eq(f, t - bfc__sim_bytes_held(be));
    ck_assert_uint_eq(bfc__sim_allocs(be), 5);
    for (i = 0; i < 5; i++)
        ck_assert_int_eq(be->ops->mem_free(be, p[i], sizes[i]), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    ck_assert_int_eq(be->ops->mem_free(be, NULL, 0), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 0, &p[0]), BFC_EINVAL);
    be->ops->close(be);
}
END_TEST

START_TEST(test_big_noreserve)
{
    bfc__backend_t *be = open_sim();
    size_t big = 64 * BFC__GiB;
    unsigned char *p = NULL;

    /* Far more than this machine has: only works because nothing is
     * reserved until touched. */
    ck_assert_int_eq(be->ops->mem_alloc(be, big, (void **)&p), BFC_OK);
    ck_assert_uint_eq((uintptr_t)p % 256, 0);
    p[0] = 1;
    p[big / 2] = 2;
    p[big - 1] = 3;
    ck_assert_uint_eq(p[0] + p[big / 2] + p[big - 1], 6);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), big);
    ck_assert_int_eq(be->ops->mem_free(be, p, big), BFC_OK);
    be->ops->close(be);
}
END_TEST

START_TEST(test_ceiling)
{
    bfc__backend_t *be = open_sim();
    void *a = NULL, *b = NULL, *c = NULL;

    bfc__sim_set_alloc_ceiling(be, 1 * BFC__MiB);
    ck_assert_int_eq(be->ops->mem_alloc(be, 512 * BFC__KiB, &a), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 512 * BFC__KiB, &b), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 256, &c), BFC_ENOMEM); /* exactly full */
    ck_assert_ptr_null(c);
    ck_assert_uint_eq(bfc__sim_failures(be), 1);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 1 * BFC__MiB); /* failure undone */
    ck_assert_int_eq(be->ops->mem_free(be, b, 512 * BFC__KiB), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 512 * BFC__KiB + 256, &c), BFC_ENOMEM);
    ck_assert_int_eq(be->ops->mem_alloc(be, 256 * BFC__KiB, &c), BFC_OK);
    bfc__sim_set_alloc_ceiling(be, SIZE_MAX);
    ck_assert_int_eq(be->ops->mem_alloc(be, 4 * BFC__MiB, &b), BFC_OK);
    ck_assert_uint_eq(bfc__sim_allocs(be), 4);
    ck_assert_uint_eq(bfc__sim_failures(be), 2);
    be->ops->mem_free(be, a, 512 * BFC__KiB);
    be->ops->mem_free(be, b, 4 * BFC__MiB);
    be->ops->mem_free(be, c, 256 * BFC__KiB);
    be->ops->close(be);
}
END_TEST

START_TEST(test_fail_alloc_every)
{
    bfc_config_t cfg;
    bfc__backend_t *be;
    void *p[12];
    int i, ok = 0;

    bfc_config_init(&cfg);
    be = open_sim_cfg(&cfg);
    bfc__sim_fail_alloc_every(be, 3);
    for (i = 1; i <= 9; i++) {
        int st = be->ops->mem_alloc(be, 4096, &p[ok]);

        if (i % 3 == 0) {
            ck_assert_int_eq(st, BFC_ENOMEM);
        } else {
            ck_assert_int_eq(st, BFC_OK);
            ok++;
        }
    }
    ck_assert_uint_eq(bfc__sim_allocs(be), 6);
    ck_assert_uint_eq(bfc__sim_failures(be), 3);

    bfc__sim_fail_alloc_every(be, 1); /* at run time: every call fails */
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p[ok]), BFC_ENOMEM);
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p[ok]), BFC_ENOMEM);
    bfc__sim_fail_alloc_every(be, 2); /* counts from the change */
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p[ok]), BFC_OK);
    ok++;
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p[ok]), BFC_ENOMEM);
    bfc__sim_fail_alloc_every(be, 0);
    for (i = 0; i < 3; i++, ok++)
        ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p[ok]), BFC_OK);
    for (i = 0; i < ok; i++)
        ck_assert_int_eq(be->ops->mem_free(be, p[i], 4096), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

START_TEST(test_fail_event_every)
{
    bfc_config_t cfg;
    bfc__backend_t *be;
    bfc__event_t ev;

    bfc_config_init(&cfg);
    be = open_sim_cfg(&cfg);
    bfc__sim_fail_event_every(be, 2);
    ck_assert_int_eq(be->ops->event_create(be, &ev), BFC_OK);
    ck_assert_int_eq(be->ops->event_record(be, ev, NULL), BFC_OK);    /* 1 */
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_EBACKEND);     /* 2 */
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_OK);           /* 3 */
    ck_assert_int_eq(be->ops->event_record(be, ev, NULL), BFC_EBACKEND); /* 4 */
    bfc__sim_fail_event_every(be, 0);
    ck_assert_int_eq(be->ops->event_record(be, ev, NULL), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_OK);
    bfc__sim_fail_event_every(be, 1);
    ck_assert_int_eq(be->ops->event_record(be, ev, NULL), BFC_EBACKEND);
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_EBACKEND);
    ck_assert_int_eq(be->ops->event_destroy(be, ev), BFC_OK);
    be->ops->close(be);
}
END_TEST

START_TEST(test_event_hold_drain)
{
    bfc__backend_t *be = open_sim();
    bfc_stream_t s = bfc__sim_stream_create(be);
    bfc__event_t before, during, again;

    ck_assert_ptr_nonnull(s);
    ck_assert_int_eq(be->ops->event_create(be, &before), BFC_OK);
    ck_assert_int_eq(be->ops->event_create(be, &during), BFC_OK);
    ck_assert_int_eq(be->ops->event_create(be, &again), BFC_OK);

    /* Idle stream: complete at once. */
    ck_assert_int_eq(be->ops->event_record(be, before, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, before), BFC_OK);
    ck_assert_int_eq(be->ops->stream_sync(be, s), BFC_OK);

    bfc__sim_stream_hold(be, s);
    ck_assert_int_eq(be->ops->event_record(be, during, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, during), BFC_EBUSY);
    ck_assert_int_eq(be->ops->event_query(be, before), BFC_OK); /* recorded before the hold */
    ck_assert_int_eq(be->ops->stream_sync(be, s), BFC_EBUSY);
    bfc__sim_stream_hold(be, s); /* holding twice is one hold */
    bfc__sim_stream_drain(be, s);
    ck_assert_int_eq(be->ops->event_query(be, during), BFC_OK);
    ck_assert_int_eq(be->ops->stream_sync(be, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_wait(be, during, 0), BFC_OK);

    /* A new hold does not re-open events of the old generation. */
    bfc__sim_stream_hold(be, s);
    ck_assert_int_eq(be->ops->event_query(be, during), BFC_OK);
    ck_assert_int_eq(be->ops->event_record(be, again, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, again), BFC_EBUSY);
    /* Re-recording an event on an idle stream makes it complete. */
    ck_assert_int_eq(be->ops->event_record(be, again, NULL), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, again), BFC_OK);
    ck_assert_int_eq(be->ops->event_record(be, again, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, again), BFC_EBUSY);

    /* Destroy drains; the record stays valid for events naming it. */
    bfc__sim_stream_destroy(be, s);
    ck_assert_int_eq(be->ops->event_query(be, again), BFC_OK);
    bfc__sim_stream_hold(be, s); /* dead: stays idle */
    ck_assert_int_eq(be->ops->event_record(be, again, s), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, again), BFC_OK);

    be->ops->event_destroy(be, before);
    be->ops->event_destroy(be, during);
    be->ops->event_destroy(be, again);
    be->ops->close(be);
}
END_TEST

START_TEST(test_streams_independent)
{
    bfc__backend_t *be = open_sim();
    bfc_stream_t a = bfc__sim_stream_create(be);
    bfc_stream_t b = bfc__sim_stream_create(be);
    bfc__event_t ea, eb, en;

    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert_int_eq(be->ops->event_create(be, &ea), BFC_OK);
    ck_assert_int_eq(be->ops->event_create(be, &eb), BFC_OK);
    ck_assert_int_eq(be->ops->event_create(be, &en), BFC_OK);

    bfc__sim_stream_hold(be, a);
    be->ops->event_record(be, ea, a);
    be->ops->event_record(be, eb, b);
    be->ops->event_record(be, en, NULL);
    ck_assert_int_eq(be->ops->event_query(be, ea), BFC_EBUSY);
    ck_assert_int_eq(be->ops->event_query(be, eb), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, en), BFC_OK);

    bfc__sim_stream_hold(be, b);
    be->ops->event_record(be, eb, b);
    bfc__sim_stream_drain(be, a);
    ck_assert_int_eq(be->ops->event_query(be, ea), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, eb), BFC_EBUSY);
    bfc__sim_stream_drain(be, b);
    ck_assert_int_eq(be->ops->event_query(be, eb), BFC_OK);

    /* The NULL (default) stream can be held too. */
    bfc__sim_stream_hold(be, NULL);
    be->ops->event_record(be, en, NULL);
    ck_assert_int_eq(be->ops->event_query(be, en), BFC_EBUSY);
    ck_assert_int_eq(be->ops->stream_sync(be, NULL), BFC_EBUSY);
    be->ops->event_record(be, ea, a);
    ck_assert_int_eq(be->ops->event_query(be, ea), BFC_OK);
    bfc__sim_stream_drain(be, NULL);
    ck_assert_int_eq(be->ops->event_query(be, en), BFC_OK);

    be->ops->event_destroy(be, ea);
    be->ops->event_destroy(be, eb);
    be->ops->event_destroy(be, en);
    be->ops->close(be);
}
END_TEST

START_TEST(test_stream_ids)
{
    bfc__backend_t *be = open_sim();
    bfc__backend_t *other = open_sim();
    bfc_stream_t a = bfc__sim_stream_create(be);
    bfc_stream_t b = bfc__sim_stream_create(be);
    bfc_stream_t foreign = bfc__sim_stream_create(other);
    bfc_stream_t unknown = (bfc_stream_t)(uintptr_t)0x1000;
    uint64_t ida = 0, idb = 0, idn = 99, idu = 0, idu2 = 0, idf = 0;
    bfc__event_t ev;

    ck_assert_int_eq(be->ops->stream_id(be, NULL, &idn), BFC_OK);
    ck_assert_uint_eq(idn, 0);
    ck_assert_int_eq(be->ops->stream_id(be, a, &ida), BFC_OK);
    ck_assert_int_eq(be->ops->stream_id(be, b, &idb), BFC_OK);
    ck_assert_uint_ne(ida, idb);
    ck_assert_uint_ne(ida, 0);
    ck_assert_uint_ne(idb, 0);
    ck_assert_uint_eq(ida >> 63, 0);
    ck_assert_int_eq(be->ops->stream_id(be, a, &idu2), BFC_OK);
    ck_assert_uint_eq(idu2, ida); /* stable */

    /* A handle SIM never made is refused (on CUDA it would be undefined
     * behaviour, so a test must not get away with it). */
    idu = 77;
    ck_assert_int_eq(be->ops->stream_id(be, unknown, &idu), BFC_EINVAL);
    ck_assert_uint_eq(idu, 77); /* untouched */
    /* Streams are process-wide: one made through another SIM backend is
     * known here, with the same id it has there. */
    ck_assert_int_eq(be->ops->stream_id(be, foreign, &idf), BFC_OK);
    ck_assert_uint_eq(idf >> 63, 0);
    ck_assert_uint_ne(idf, ida);
    ck_assert_int_eq(other->ops->stream_id(other, foreign, &idu2), BFC_OK);
    ck_assert_uint_eq(idu2, idf);
    /* A pointer inside the table but not on a record boundary is unknown,
     * and so is a record not handed out yet. */
    ck_assert_int_eq(be->ops->stream_id(be, (bfc_stream_t)((char *)a + 8), &idu2), BFC_EINVAL);
    ck_assert_int_eq(be->ops->stream_id(be, (bfc_stream_t)((char *)foreign + 64 * 1000), &idu2), BFC_EINVAL);

    /* Unknown streams: hold is a no-op, record and sync refuse. */
    ck_assert_int_eq(be->ops->event_create(be, &ev), BFC_OK);
    bfc__sim_stream_hold(be, unknown);
    ck_assert_int_eq(be->ops->event_record(be, ev, unknown), BFC_EINVAL);
    ck_assert_int_eq(be->ops->stream_sync(be, unknown), BFC_EINVAL);

    /* Destroy does not recycle an index, and the handle is refused from
     * then on; an event recorded on it (a fence naming a stream that went
     * away) is complete at once, and syncing it succeeds. */
    bfc__sim_stream_hold(be, a);
    bfc__event_t ev_a;
    ck_assert_int_eq(be->ops->event_create(be, &ev_a), BFC_OK);
    ck_assert_int_eq(be->ops->event_record(be, ev_a, a), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, ev_a), BFC_EBUSY);
    bfc__sim_stream_destroy(be, a);
    ck_assert_int_eq(be->ops->event_query(be, ev_a), BFC_OK); /* destroy drains */
    ck_assert_ptr_ne(bfc__sim_stream_create(be), a);
    ck_assert_int_eq(be->ops->stream_id(be, a, &idu2), BFC_EINVAL);
    bfc__sim_stream_hold(be, a); /* a no-op on a dead stream */
    ck_assert_int_eq(be->ops->event_record(be, ev, a), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_OK);
    ck_assert_int_eq(be->ops->stream_sync(be, a), BFC_OK);
    /* The others are unaffected. */
    ck_assert_int_eq(be->ops->stream_id(be, b, &idu2), BFC_OK);
    ck_assert_uint_eq(idu2, idb);
    be->ops->event_destroy(be, ev);
    be->ops->event_destroy(be, ev_a);

    /* SIM controls refuse a NULL backend without crashing. */
    ck_assert_ptr_null(bfc__sim_stream_create(NULL));
    ck_assert_uint_eq(bfc__sim_allocs(NULL), 0);
    bfc__sim_stream_hold(NULL, a);
    be->ops->close(be);
    other->ops->close(other);
}
END_TEST

START_TEST(test_stream_table_exhaustion)
{
    bfc__backend_t *be = open_sim();
    bfc_stream_t s, last = NULL;
    uint64_t id = 0;
    unsigned n = 0;

    while ((s = bfc__sim_stream_create(be)) != NULL) {
        last = s;
        if (++n > 1000000)
            break; /* never: the table is bounded */
    }
    ck_assert_uint_eq(n, 65535); /* index 0 is the default stream */
    ck_assert_ptr_null(bfc__sim_stream_create(be));
    ck_assert_int_eq(be->ops->stream_id(be, last, &id), BFC_OK);
    ck_assert_uint_eq(id, 65535);
    be->ops->close(be);
}
END_TEST

/* The process-wide stream table (4 MiB of addresses) is mapped at the
 * first open.  An open that finds no addresses for it (RLIMIT_AS) fails
 * with BFC_ENOMEM, and a later one, with addresses back, maps it (it was
 * mapped in pthread_once: the first failure was for the life of the
 * process).  In a child, the table not yet mapped there; plain builds
 * only (sanitizers and valgrind manage their own address space). */
START_TEST(test_stream_table_mapped_later)
{
    size_t vm;
    if (!rlimit_as_testable(&vm))
        return;
    struct rlimit old;
    pid_t pid = fork_under_rlimit_as(vm + 1024 * 1024, &old);
    if (pid == 0) {
        bfc_config_t cfg;
        bfc_config_init(&cfg);
        cfg.backend = BFC_BACKEND_SIM;
        bfc__backend_t *be = NULL;
        if (bfc__backend_sim_open(&cfg, &be) != BFC_ENOMEM || be)
            _exit(12);
        if (setrlimit(RLIMIT_AS, &old) != 0)
            _exit(13);
        if (bfc__backend_sim_open(&cfg, &be) != BFC_OK || !be)
            _exit(14);
        be->ops->close(be);
        _exit(0);
    }
    int code = child_exit(pid);
    ck_assert_msg(code == 0, "child: exit %d (12: the open under the limit did not fail; 14: the open after it failed)",
                  code);
}
END_TEST

START_TEST(test_event_wait_timeout)
{
    bfc__backend_t *be = open_sim();
    bfc_stream_t s = bfc__sim_stream_create(be);
    bfc__event_t ev;
    double t0, dt;

    ck_assert_int_eq(be->ops->event_create(be, &ev), BFC_OK);
    bfc__sim_stream_hold(be, s);
    be->ops->event_record(be, ev, s);
    t0 = now_s();
    ck_assert_int_eq(be->ops->event_wait(be, ev, 20), BFC_EBUSY);
    dt = now_s() - t0;
    ck_assert(dt >= 0.019);
    ck_assert(dt < 1.0);
    t0 = now_s();
    ck_assert_int_eq(be->ops->event_wait(be, ev, 0), BFC_EBUSY);
    ck_assert(now_s() - t0 < 0.5);
    /* A clock that cannot be read spends the budget at once (the wait
     * went on for ever: its deadline was a clock of 0 plus the bound). */
    atomic_store(&clock_broken, true);
    int st = be->ops->event_wait(be, ev, 20);
    atomic_store(&clock_broken, false);
    ck_assert_int_eq(st, BFC_EBUSY);
    bfc__sim_stream_drain(be, s);
    ck_assert_int_eq(be->ops->event_wait(be, ev, UINT32_MAX), BFC_OK);
    be->ops->event_destroy(be, ev);
    be->ops->close(be);
}
END_TEST

/* A waiter blocked with no timeout is released by a drain on another thread. */
struct waiter {
    bfc__backend_t *be;
    bfc__event_t ev;
    int status;
};

static void *wait_forever(void *arg)
{
    struct waiter *w = arg;

    w->status = w->be->ops->event_wait(w->be, w->ev, UINT32_MAX);
    return NULL;
}

START_TEST(test_event_wait_released_by_drain)
{
    bfc__backend_t *be = open_sim();
    bfc_stream_t s = bfc__sim_stream_create(be);
    struct waiter w = {be, NULL, 1};
    struct timespec nap = {0, 20 * 1000 * 1000};
    pthread_t t;

    ck_assert_int_eq(be->ops->event_create(be, &w.ev), BFC_OK);
    bfc__sim_stream_hold(be, s);
    be->ops->event_record(be, w.ev, s);
    ck_assert_int_eq(pthread_create(&t, NULL, wait_forever, &w), 0);
    nanosleep(&nap, NULL);
    bfc__sim_stream_drain(be, s);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert_int_eq(w.status, BFC_OK);
    be->ops->event_destroy(be, w.ev);
    be->ops->close(be);
}
END_TEST

/* Two threads hammer hold/drain/record/query on shared streams. */
#define HAMMER_ITERS 200000

struct hammer {
    bfc__backend_t *be;
    bfc_stream_t s[2];
    int seed;
    int bad;
};

static void *hammer_thread(void *arg)
{
    struct hammer *h = arg;
    bfc__backend_t *be = h->be;
    bfc__event_t ev;
    unsigned x = (unsigned)h->seed;
    int i;

    if (be->ops->event_create(be, &ev) != BFC_OK) {
        h->bad = 1;
        return NULL;
    }
    for (i = 0; i < HAMMER_ITERS; i++) {
        bfc_stream_t s = h->s[(x >> 7) & 1];
        int st;

        x = x * 1103515245u + 12345u;
        switch ((x >> 16) % 4) {
        case 0:
            bfc__sim_stream_hold(be, s);
            break;
        case 1:
            bfc__sim_stream_drain(be, s);
            break;
        case 2:
            if (be->ops->event_record(be, ev, s) != BFC_OK)
                h->bad = 1;
            break;
        default:
            st = be->ops->event_query(be, ev);
            if (st != BFC_OK && st != BFC_EBUSY)
                h->bad = 1;
            break;
        }
    }
    /* After a final drain of both streams every event must be complete. */
    be->ops->event_record(be, ev, h->s[0]);
    bfc__sim_stream_drain(be, h->s[0]);
    if (be->ops->event_query(be, ev) != BFC_OK)
        h->bad = 2;
    be->ops->event_destroy(be, ev);
    return NULL;
}

START_TEST(test_concurrency)
{
    bfc__backend_t *be = open_sim();
    struct hammer h[2];
    pthread_t t[2];
    int i;

    for (i = 0; i < 2; i++) {
        h[i].be = be;
        h[i].s[0] = i == 0 ? bfc__sim_stream_create(be) : h[0].s[0];
        h[i].s[1] = NULL;
        h[i].seed = 17 + i * 101;
        h[i].bad = 0;
    }
    for (i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_create(&t[i], NULL, hammer_thread, &h[i]), 0);
    for (i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_join(t[i], NULL), 0);
    for (i = 0; i < 2; i++)
        ck_assert_int_eq(h[i].bad, 0);
    be->ops->close(be);
}
END_TEST

/* ----------------------------------------- handles through the public API */

#include <shardbfc_sim.h>

static bfc_ctx_t *sim_ctx(void)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 64 * BFC__MiB;
    bfc_ctx_t *ctx = NULL;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_OK);
    return ctx;
}

/* Every call that names `bad` fails with BFC_EINVAL and changes nothing. */
static void expect_refused(bfc_ctx_t *ctx, bfc_stream_t bad, void *live)
{
    bfc_stats_t before, after;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &before), BFC_OK);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, bad, 4096));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    /* Refused whatever the size: one above the limit is no OOM here. */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, bad, (size_t)before.bytes_limit + 1));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, bad, SIZE_MAX));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(ctx, live, bad), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, live, bad), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, bad), BFC_EINVAL);
    bfc_stats_t ss;
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, bad, &ss), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stats(ctx, &after), BFC_OK);
    ck_assert_uint_eq(after.num_allocs, before.num_allocs);
    ck_assert_uint_eq(after.num_frees, before.num_frees);
    ck_assert_uint_eq(after.num_shards, before.num_shards);
    ck_assert_uint_eq(after.num_ooms, before.num_ooms);
    /* The block is still live and whole. */
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, live), 1000);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
}

/* The public create says why it returns NULL: not a SIM context, or the
 * process's 65,535 streams all made (destroyed ones are not reused). */
START_TEST(test_public_stream_create_status)
{
    ck_assert_ptr_null(bfc_sim_stream_create(NULL));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    bfc_ctx_t *ctx = sim_ctx();
    unsigned n = 0;
    bfc_stream_t s;
    while ((s = bfc_sim_stream_create(ctx)) != NULL) {
        ck_assert_int_eq(bfc_last_error(), BFC_OK);
        bfc_sim_stream_destroy(ctx, s);
        ck_assert_uint_le(++n, 65535);
    }
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_uint_eq(n, 65535);
    bfc_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_public_unknown_handle)
{
    bfc_ctx_t *ctx = sim_ctx();
    void *p = bfc_ctx_alloc(ctx, NULL, 1000);
    ck_assert_ptr_nonnull(p);
    expect_refused(ctx, (bfc_stream_t)(uintptr_t)0x1234, p);
    int local;
    expect_refused(ctx, (bfc_stream_t)(void *)&local, p);
    /* NULL is still the default stream. */
    ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
    /* The stream is judged first, whatever the pointer: a freed one too. */
    ck_assert_int_eq(bfc_ctx_free(ctx, p, (bfc_stream_t)(uintptr_t)0x1234), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, p, (bfc_stream_t)(uintptr_t)0x1234), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, p, NULL), BFC_EDOUBLEFREE);
    bfc_ctx_destroy(ctx);
}
END_TEST

START_TEST(test_public_destroyed_handle)
{
    bfc_ctx_t *ctx = sim_ctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    bfc_stream_t t = bfc_sim_stream_create(ctx);
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_nonnull(t);
    /* The last stream this thread used, destroyed without a release: the
     * thread's cached (stream, shard) pair must not outlive the stream. */
    bfc_stream_t u = bfc_sim_stream_create(ctx);
    void *q = bfc_ctx_alloc(ctx, u, 500);
    ck_assert_ptr_nonnull(q);
    bfc_sim_stream_destroy(ctx, u);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, u, 500));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, u), BFC_OK);

    void *own = bfc_ctx_alloc(ctx, s, 2000);
    void *p = bfc_ctx_alloc(ctx, t, 1000);
    void *r = bfc_ctx_alloc(ctx, t, 3000);
    ck_assert_ptr_nonnull(own);
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(r);
    /* r is used on s too; s goes away before r is freed. */
    ck_assert_int_eq(bfc_ctx_record_stream(ctx, r, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    bfc_sim_stream_destroy(ctx, s);
    expect_refused(ctx, s, p);
    /* Blocks allocated on s stay valid and are freed as always: on their
     * own stream (no stream operation is needed for that) or with bfc_free;
     * a fence naming the dead stream does not strand r. */
    ck_assert_int_eq(bfc_ctx_free(ctx, own, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, r, t), BFC_OK);
    bfc_stats_t st;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_uint_eq(st.num_pending_frees, 0);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, t), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_uint_eq(st.bytes_in_use, 0);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_sim_stream_destroy(ctx, t);
    bfc_ctx_destroy(ctx);
}
END_TEST

static Suite *sim_suite(void)
{
    Suite *s = suite_create("backend_sim");
    TCase *mem = tcase_create("memory");
    TCase *ev = tcase_create("streams_events");

    tcase_add_test(mem, test_identity);
    tcase_add_test(mem, test_alloc_align_rw);
    tcase_add_test(mem, test_big_noreserve);
    tcase_add_test(mem, test_ceiling);
    tcase_add_test(mem, test_fail_alloc_every);
    suite_add_tcase(s, mem);

    tcase_add_test(ev, test_fail_event_every);
    tcase_add_test(ev, test_event_hold_drain);
    tcase_add_test(ev, test_streams_independent);
    tcase_add_test(ev, test_stream_ids);
    tcase_add_test(ev, test_stream_table_exhaustion);
    tcase_add_test(ev, test_stream_table_mapped_later);
    tcase_add_test(ev, test_public_stream_create_status);
    tcase_add_test(ev, test_event_wait_timeout);
    tcase_add_test(ev, test_event_wait_released_by_drain);
    tcase_add_test(ev, test_concurrency);
    tcase_add_test(ev, test_public_unknown_handle);
    tcase_add_test(ev, test_public_destroyed_handle);
    tcase_set_timeout(ev, 30);
    suite_add_tcase(s, ev);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(sim_suite());
    int failed;

    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
