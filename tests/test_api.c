/*
 * test_api.c -- the process-wide service: bfc_stream_alloc, bfc_stream_free,
 * bfc_free, bfc_record_stream, bfc_stream_release, bfc_default_ctx and
 * bfc_shutdown, configured by SHARDBFC_CONF.
 *
 * SHARDBFC_CONF is read once per process, at the first use of the service.
 * Every test sets it with setenv before its first call, and relies on Check
 * forking each test (the default, CK_FORK) for a fresh process; under
 * CK_FORK=no the tests that need their own configuration are left out.
 *
 * Observed behaviour pinned down here (SIM, no GPU):
 *   - an invalid SHARDBFC_CONF stops the service: every call, device and
 *     host, fails with BFC_EINVAL (freeing NULL stays BFC_OK), private
 *     contexts are unaffected; tests/test_ops checks the stderr line in a
 *     child process;
 *   - backend=cuda without a usable device: allocations fail with
 *     BFC_ENODEV and bfc_default_ctx() is NULL, nothing crashes;
 *   - after bfc_shutdown(), an old pointer is BFC_ENOTOWNED for bfc_free /
 *     bfc_stream_free / bfc_record_stream, bfc_stream_release is
 *     BFC_EINVAL, and the next allocation creates a fresh context from the
 *     same (cached) configuration;
 *   - a pointer from a private context (bfc_ctx_create) is found by the
 *     service too: "a pointer finds its context by itself".
 */
#include "testutil.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


static void conf(const char *spec)
{
    if (spec)
        ck_assert_int_eq(setenv("SHARDBFC_CONF", spec, 1), 0);
    else
        ck_assert_int_eq(unsetenv("SHARDBFC_CONF"), 0);
}

static void use_sim(void)
{
    conf("backend=sim,memory_limit=256M");
}

static bfc_ctx_t *dctx(void)
{
    bfc_ctx_t *ctx = bfc_default_ctx();
    ck_assert_msg(ctx != NULL, "bfc_default_ctx: %s", bfc_err_name(bfc_last_error()));
    return ctx;
}

static void *xsalloc(bfc_stream_t s, size_t n)
{
    void *p = bfc_stream_alloc(s, n);
    ck_assert_msg(p != NULL, "bfc_stream_alloc(%zu): %s", n, bfc_err_name(bfc_last_error()));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_uint_eq((uintptr_t)p & 255, 0);
    return p;
}

/* ------------------------------------------------------------- basics */

START_TEST(test_conf_applied)
{
    use_sim();
    void *p = xsalloc(NULL, 1000);
    bfc_ctx_t *ctx = dctx();
    ck_assert_ptr_eq(bfc_default_ctx(), ctx); /* one context per device */
    bfc_config_t c;
    ck_assert_int_eq(bfc_ctx_config(ctx, &c), BFC_OK);
    ck_assert_int_eq(c.backend, BFC_BACKEND_SIM);
    ck_assert_uint_eq(c.memory_limit, 256 * MiB);
    bfc_stats_t s = st(ctx);
    ck_assert_uint_eq(s.bytes_limit, 256 * MiB);
    ck_assert_uint_eq(s.bytes_in_use, 1024);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 1024);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), 1000);
    /* The limit is enforced. */
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 256 * MiB + 1));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    ck_assert_int_eq(bfc_free(p), BFC_EDOUBLEFREE);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    /* The configuration was read once: changing it now changes nothing. */
    conf("backend=sim,memory_limit=1G");
    ck_assert_ptr_eq(bfc_default_ctx(), ctx);
    ck_assert_uint_eq(st(ctx).bytes_limit, 256 * MiB);
    bfc_shutdown();
    ctx = dctx();
    ck_assert_uint_eq(st(ctx).bytes_limit, 256 * MiB);
    bfc_shutdown();
}
END_TEST

START_TEST(test_bfc_free_on_alloc_stream)
{
    use_sim();
    bfc_ctx_t *ctx = dctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    ck_assert_ptr_nonnull(s);
    void *g = xsalloc(s, 4 * KiB);
    void *p = xsalloc(s, 4 * KiB);
    void *g2 = xsalloc(s, 4 * KiB);
    /* s is busy; bfc_free frees in s's own order: reusable by s at once. */
    bfc_sim_stream_hold(ctx, s);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    bfc_stats_t o = sst(ctx, s);
    ck_assert_uint_eq(o.num_remote_frees, 0);
    ck_assert_uint_eq(o.num_pending_frees, 0);
    ck_assert_ptr_eq(xsalloc(s, 4 * KiB), p);
    /* Same for the default stream. */
    void *d = xsalloc(NULL, 8 * KiB);
    void *d2 = xsalloc(NULL, 8 * KiB);
    bfc_sim_stream_hold(ctx, NULL);
    ck_assert_int_eq(bfc_free(d), BFC_OK);
    ck_assert_ptr_eq(xsalloc(NULL, 8 * KiB), d);
    ck_assert_uint_eq(sst(ctx, NULL).num_remote_frees, 0);
    bfc_sim_stream_drain(ctx, NULL);
    bfc_sim_stream_drain(ctx, s);
    ck_assert_int_eq(bfc_free(d), BFC_OK);
    ck_assert_int_eq(bfc_free(d2), BFC_OK);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    ck_assert_int_eq(bfc_free(g), BFC_OK);
    ck_assert_int_eq(bfc_free(g2), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

START_TEST(test_stream_free_cross)
{
    use_sim();
    bfc_ctx_t *ctx = dctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *g = xsalloc(s, 2 * KiB);
    void *p = xsalloc(s, 2 * KiB);
    void *g2 = xsalloc(s, 2 * KiB);
    bfc_sim_stream_hold(ctx, t);
    ck_assert_int_eq(bfc_stream_free(p, t), BFC_OK);
    ck_assert_int_eq(bfc_stream_free(p, t), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_free(p), BFC_EDOUBLEFREE);
    bfc_stats_t o = sst(ctx, s);
    ck_assert_uint_eq(o.num_remote_frees, 1);
    ck_assert_uint_eq(o.num_pending_frees, 1);
    void *v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = xsalloc(s, 2 * KiB);
        ck_assert_ptr_ne(v[i], p);
    }
    bfc_sim_stream_drain(ctx, t);
    ck_assert_ptr_eq(xsalloc(s, 2 * KiB), p);
    /* Same-stream bfc_stream_free is bfc_free. */
    ck_assert_int_eq(bfc_stream_free(p, s), BFC_OK);
    ck_assert_ptr_eq(xsalloc(s, 2 * KiB), p);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(bfc_stream_free(v[i], i % 2 ? t : s), BFC_OK);
    ck_assert_int_eq(bfc_free(g), BFC_OK);
    ck_assert_int_eq(bfc_free(g2), BFC_OK);
    bfc_stats_t c = st(ctx);
    ck_assert_uint_eq(c.bytes_in_use, 0);
    ck_assert_uint_eq(c.num_pending_frees, 0);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

START_TEST(test_record_stream_service)
{
    use_sim();
    bfc_ctx_t *ctx = dctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx), t = bfc_sim_stream_create(ctx);
    void *g = xsalloc(s, 2 * KiB);
    void *p = xsalloc(s, 2 * KiB);
    void *g2 = xsalloc(s, 2 * KiB);
    ck_assert_int_eq(bfc_record_stream(p, t), BFC_OK);
    ck_assert_int_eq(bfc_record_stream(p, s), BFC_OK); /* owner: no-op */
    bfc_sim_stream_hold(ctx, t);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    ck_assert_uint_eq(sst(ctx, s).num_pending_frees, 1);
    void *q = xsalloc(s, 2 * KiB);
    ck_assert_ptr_ne(q, p);
    bfc_sim_stream_drain(ctx, t);
    ck_assert_ptr_eq(xsalloc(s, 2 * KiB), p);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    ck_assert_int_eq(bfc_record_stream(p, t), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_free(q), BFC_OK);
    ck_assert_int_eq(bfc_free(g), BFC_OK);
    ck_assert_int_eq(bfc_free(g2), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

START_TEST(test_stream_release_service)
{
    use_sim();
    /* Before any context exists there is nothing to release. */
    ck_assert_int_eq(bfc_stream_release(NULL), BFC_EINVAL);
    bfc_ctx_t *ctx = dctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx), never = bfc_sim_stream_create(ctx);
    void *p = xsalloc(s, 64 * KiB);
    memset(p, 0x3C, 64 * KiB);
    ck_assert_uint_eq(st(ctx).num_shards, 1);
    ck_assert_int_eq(bfc_stream_release(s), BFC_OK);
    ck_assert_int_eq(bfc_stream_release(s), BFC_EINVAL);
    ck_assert_int_eq(bfc_stream_release(never), BFC_EINVAL);
    ck_assert_uint_eq(st(ctx).num_shards, 0);
    /* The live block survives and frees normally. */
    ck_assert_uint_eq(((unsigned char *)p)[64 * KiB - 1], 0x3C);
    void *q = xsalloc(s, 1 * KiB); /* a fresh shard */
    ck_assert_uint_eq(st(ctx).num_shards, 1);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    /* The retired shard died with its last block and gave its region back;
     * a second free is still a double free (the region map remembers the
     * range that departed), on every service call that names the block. */
    ck_assert_int_eq(bfc_free(p), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_stream_free(p, s), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_record_stream(p, s), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_free((char *)p + 8), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free(q), BFC_OK);
    bfc_stats_t c = st(ctx);
    ck_assert_uint_eq(c.bytes_in_use, 0);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

/* ------------------------------------------------------------- errors */

START_TEST(test_foreign_pointers_service)
{
    use_sim();
    void *p = xsalloc(NULL, 4 * KiB);
    int local = 0;
    void *heap = malloc(1024);
    ck_assert_ptr_nonnull(heap);
    ck_assert_int_eq(bfc_free(&local), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free(heap), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free(heap, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_record_stream(heap, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free((char *)p + 256), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free((char *)p + 1), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free((char *)p + 512, NULL), BFC_ENOTOWNED);
    free(heap);
    /* A host block is bfc_host_free's: the device calls leave it alone. */
    void *h = bfc_host_alloc(1000);
    ck_assert_ptr_nonnull(h);
    ck_assert_int_eq(bfc_free(h), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free(h, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_record_stream(h, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_free(h), BFC_OK);
    bfc_ctx_t *ctx = dctx();
    ck_assert_uint_eq(st(ctx).bytes_in_use, 4 * KiB);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

START_TEST(test_private_ctx_pointer)
{
    use_sim();
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 64 * MiB;
    bfc_ctx_t *mine = NULL;
    ck_assert_int_eq(bfc_ctx_create(&c, &mine), BFC_OK);
    void *p = bfc_ctx_alloc(mine, NULL, 4 * KiB);
    ck_assert_ptr_nonnull(p);
    /* The service finds the pointer's own context. */
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    ck_assert_uint_eq(st(mine).bytes_in_use, 0);
    ck_assert_int_eq(bfc_ctx_free(mine, p, NULL), BFC_EDOUBLEFREE);
    /* And the service's pointers are foreign to the private context. */
    void *q = xsalloc(NULL, 4 * KiB);
    ck_assert_int_eq(bfc_ctx_free(mine, q, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free(q), BFC_OK);
    xcheck(mine);
    bfc_ctx_destroy(mine);
    /* A destroyed context's pointer is foreign to everyone. */
    ck_assert_int_eq(bfc_free(p), BFC_ENOTOWNED);
    bfc_shutdown();
}
END_TEST

START_TEST(test_after_shutdown)
{
    use_sim();
    /* Shutdown before any use is harmless. */
    bfc_shutdown();
    bfc_ctx_t *ctx = dctx();
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    void *p = xsalloc(s, 16 * KiB);
    void *d = xsalloc(NULL, 16 * KiB);
    bfc_shutdown();
    bfc_shutdown(); /* twice */
    /* Old pointers: clear statuses, no crash. */
    ck_assert_int_eq(bfc_free(p), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_free(d), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_free(p, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_record_stream(d, NULL), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_release(NULL), BFC_EINVAL);
    /* New allocations work again, in a fresh context. */
    void *q = xsalloc(NULL, 16 * KiB);
    bfc_ctx_t *ctx2 = dctx();
    bfc_stats_t c = st(ctx2);
    ck_assert_uint_eq(c.bytes_in_use, 16 * KiB);
    ck_assert_uint_eq(c.num_allocs, 1);
    ck_assert_uint_eq(c.num_shards, 1);
    ck_assert_uint_eq(c.bytes_limit, 256 * MiB);
    ck_assert_int_eq(bfc_free(q), BFC_OK);
    ck_assert_uint_eq(st(ctx2).bytes_in_use, 0);
    xcheck(ctx2);
    bfc_shutdown();
}
END_TEST

START_TEST(test_null_handling)
{
    use_sim();
    ck_assert_int_eq(bfc_free(NULL), BFC_OK);
    ck_assert_int_eq(bfc_stream_free(NULL, NULL), BFC_OK);
    ck_assert_int_eq(bfc_record_stream(NULL, NULL), BFC_EINVAL);
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 0));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_ptr_null(bfc_stream_alloc(NULL, SIZE_MAX));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_ptr_null(bfc_stream_alloc(NULL, SIZE_MAX - 100));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    void *p = xsalloc(NULL, 1);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    /* The context calls with a NULL context. */
    ck_assert_ptr_null(bfc_ctx_alloc(NULL, NULL, 16));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(NULL, p, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_free(NULL, NULL, NULL), BFC_OK);
    ck_assert_int_eq(bfc_ctx_record_stream(NULL, p, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_release(NULL, NULL), BFC_EINVAL);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_ctx_stats(NULL, &s), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stats(dctx(), NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_stream_stats(NULL, NULL, &s), BFC_EINVAL);
    ck_assert_ptr_null(bfc_sim_stream_create(NULL));
    bfc_sim_stream_hold(NULL, NULL);
    bfc_sim_stream_drain(NULL, NULL);
    bfc_ctx_destroy(NULL);
    bfc_shutdown();
}
END_TEST

/* ----------------------------------------------------- configuration */

/* Every call of the service fails with BFC_EINVAL: nothing runs on the
 * defaults behind the user's back. */
static void expect_refused(void)
{
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 1 * KiB));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_ptr_null(bfc_default_ctx());
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_ptr_null(bfc_host_alloc(1 * KiB));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_int_eq(bfc_stream_release(NULL), BFC_EINVAL);
    /* Pointer calls too, even for a pointer of a private context (which the
     * service would otherwise find by itself). */
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    bfc_ctx_t *own;
    ck_assert_int_eq(bfc_ctx_create(&c, &own), BFC_OK); /* SHARDBFC_CONF is not its business */
    void *q = bfc_ctx_alloc(own, NULL, 512);
    ck_assert_ptr_nonnull(q);
    ck_assert_int_eq(bfc_free(q), BFC_EINVAL);
    ck_assert_int_eq(bfc_stream_free(q, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_record_stream(q, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_free(q), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_record_stream(q, NULL), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_numa_node(q), BFC_EINVAL);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_stats(&s), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_numa_nodes(), BFC_EINVAL);
    /* Freeing NULL stays a no-op; the private context still works. */
    ck_assert_int_eq(bfc_free(NULL), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(own, q, NULL), BFC_OK);
    bfc_ctx_destroy(own);
    /* Still refused later: the decision is cached with the configuration. */
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 1));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    bfc_shutdown();
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 1));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
}

START_TEST(test_bad_conf_refuses)
{
    /* One bad item spoils the whole spec, and the service does not start:
     * falling back to the defaults would turn this typo into "no limit". */
    conf("backend=sim,memory_limit=banana");
    expect_refused();
}
END_TEST

START_TEST(test_bad_conf_negative)
{
    conf("memory_limit=-5");
    expect_refused();
}
END_TEST

START_TEST(test_bad_conf_misspelt_key)
{
    conf("backend=sim,memory_limt=1G");
    expect_refused();
}
END_TEST

START_TEST(test_bad_conf_conflict)
{
    /* Each setting is valid; together they are not. */
    conf("backend=sim,vmm=on,allow_growth=false");
    expect_refused();
}
END_TEST

START_TEST(test_conf_trace_uncreatable)
{
    /* The spec parses, but no context can be made on it: the first call
     * finds that out and the service stops there, as for a bad spec,
     * rather than try again at every call. */
    conf("backend=sim,trace=/nonexistent-shardbfc-dir/t.csv");
    expect_refused();
}
END_TEST

START_TEST(test_no_conf_defaults)
{
    conf(NULL);
    bfc_ctx_t *ctx = dctx();
    bfc_config_t c, d;
    ck_assert_int_eq(bfc_ctx_config(ctx, &c), BFC_OK);
    bfc_config_init(&d);
    ck_assert_uint_eq(c.initial_region, d.initial_region);
    ck_assert_int_eq(c.allow_growth, d.allow_growth);
    void *p = xsalloc(NULL, 300);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    bfc_shutdown();
}
END_TEST

START_TEST(test_conf_cuda_without_device)
{
    conf("backend=cuda");
    void *p = bfc_stream_alloc(NULL, 1 * KiB);
    if (p) {
        /* A machine with a GPU: the service works; nothing more to see. */
        ck_assert_int_eq(bfc_free(p), BFC_OK);
        bfc_shutdown();
        return;
    }
    ck_assert_int_eq(bfc_last_error(), BFC_ENODEV);
    ck_assert_ptr_null(bfc_default_ctx());
    ck_assert_int_eq(bfc_last_error(), BFC_ENODEV);
    int local;
    ck_assert_int_eq(bfc_free(&local), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_stream_release(NULL), BFC_EINVAL);
    /* Still no context on a second try; no crash on shutdown. */
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 1 * KiB));
    bfc_shutdown();
}
END_TEST

START_TEST(test_conf_growth_off)
{
    conf("backend=sim,memory_limit=64M,allow_growth=false");
    bfc_ctx_t *ctx = dctx();
    /* The whole limit is reserved at create. */
    ck_assert_uint_eq(st(ctx).bytes_reserved, 64 * MiB);
    void *p = xsalloc(NULL, 60 * MiB);
    ck_assert_ptr_null(bfc_stream_alloc(NULL, 8 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_int_eq(bfc_free(p), BFC_OK);
    bfc_shutdown();
}
END_TEST

/* ----------------------------------------------------- threads */

#define NTH 8

static void *first_use(void *arg)
{
    void **out = arg;
    void *p = bfc_stream_alloc(NULL, 4 * KiB);
    out[0] = bfc_default_ctx();
    out[1] = p;
    return NULL;
}

START_TEST(test_concurrent_first_use)
{
    use_sim();
    pthread_t th[NTH];
    void *res[NTH][2];
    for (int i = 0; i < NTH; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, first_use, res[i]), 0);
    for (int i = 0; i < NTH; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    bfc_ctx_t *ctx = dctx();
    for (int i = 0; i < NTH; i++) {
        ck_assert_ptr_eq(res[i][0], ctx);
        ck_assert_ptr_nonnull(res[i][1]);
    }
    bfc_stats_t c = st(ctx);
    ck_assert_uint_eq(c.num_allocs, NTH);
    ck_assert_uint_eq(c.num_shards, 1);
    for (int i = 0; i < NTH; i++)
        ck_assert_int_eq(bfc_free(res[i][1]), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_in_use, 0);
    xcheck(ctx);
    bfc_shutdown();
}
END_TEST

static Suite *api_suite(void)
{
    Suite *s = suite_create("api");
    TCase *tc = tcase_create("service");
    tcase_add_test(tc, test_conf_applied);
    tcase_add_test(tc, test_bfc_free_on_alloc_stream);
    tcase_add_test(tc, test_stream_free_cross);
    tcase_add_test(tc, test_record_stream_service);
    tcase_add_test(tc, test_stream_release_service);
    tcase_add_test(tc, test_foreign_pointers_service);
    tcase_add_test(tc, test_private_ctx_pointer);
    tcase_add_test(tc, test_after_shutdown);
    tcase_add_test(tc, test_null_handling);
    tcase_add_test(tc, test_concurrent_first_use);
    suite_add_tcase(s, tc);
    TCase *cf = tcase_create("conf");
    tcase_add_test(cf, test_bad_conf_refuses);
    tcase_add_test(cf, test_bad_conf_misspelt_key);
    tcase_add_test(cf, test_bad_conf_negative);
    tcase_add_test(cf, test_bad_conf_conflict);
    tcase_add_test(cf, test_conf_trace_uncreatable);
    tcase_add_test(cf, test_no_conf_defaults);
    tcase_add_test(cf, test_conf_cuda_without_device);
    tcase_add_test(cf, test_conf_growth_off);
    suite_add_tcase(s, cf);
    return s;
}

int main(void)
{
    /* Every test needs a process of its own (SHARDBFC_CONF is read once). */
    const char *fork_env = getenv("CK_FORK");
    if (fork_env && strcmp(fork_env, "no") == 0) {
        fprintf(stderr, "test_api: needs CK_FORK (one process per test); skipped\n");
        return 77;
    }
    SRunner *sr = srunner_create(api_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
