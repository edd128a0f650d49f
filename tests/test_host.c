/*
 * test_host.c -- host pinned-memory arenas: NUMA placement verified through
 * the pages' real location, per-thread arenas, cross-thread frees, thread
 * exit with live blocks, record_stream fencing on the SIM backend, bad input,
 * and node selection on a synthetic two-node topology (white-box).
 */
#define _GNU_SOURCE /* pthread_setaffinity_np */
#include <check.h>
#include <inttypes.h>
#include <limits.h>
#include <hwloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include "ctx.h" /* white-box: a host context's backend */
#include "host.h"

static void setup(void)
{
    setenv("SHARDBFC_CONF", "backend=sim", 1);
}

/* Host contexts otherwise live until exit; their metadata is in the
 * library's jemalloc arena, which LeakSanitizer does not scan, so the
 * liburcu hash table they point to would read as leaked. */
static void teardown(void)
{
    bfc_shutdown();
}

/* Cases that set host memory up with a configuration or topology of their
 * own need a process of their own: host memory reads both once per
 * process.  Without Check's fork (CK_FORK=no: make valgrind) an earlier
 * case has set it up already, so they say so and check nothing. */
static bool own_process(const char *name)
{
    const char *fork_mode = getenv("CK_FORK");
    if (fork_mode && strcmp(fork_mode, "no") == 0) {
        printf("SKIP %s: host memory set up by earlier cases (CK_FORK=no)\n", name);
        return false;
    }
    return true;
}

static bfc_stats_t host_stats(void)
{
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_stats(&s), BFC_OK);
    return s;
}

static void check_host_ctx(void)
{
    for (int n = 0; n < 64; n++) {
        bfc_ctx_t *ctx = bfc_host_ctx(n);
        if (!ctx)
            continue;
        char buf[512] = "";
        ck_assert_msg(bfc_ctx_check_report(ctx, buf, sizeof buf) == BFC_OK, "node %d: %s", n, buf);
    }
}

/*
 * Shutdown unpins and unmaps host memory: it first waits for the device
 * (the work of streams that may still copy from or to a block), as an
 * expandable device context does before it unmaps.  It did not: a copy
 * queued on a pinned block before bfc_shutdown read memory already gone.
 * Counted by wrapping the host backend's device_sync (white-box: the host
 * context's backend ops replaced by a copy).
 */
static _Atomic int host_device_syncs;
static int (*real_device_sync)(bfc__backend_t *be);

static int counting_device_sync(bfc__backend_t *be)
{
    atomic_fetch_add(&host_device_syncs, 1);
    return real_device_sync(be);
}

START_TEST(test_shutdown_waits_for_device)
{
    char *p = bfc_host_alloc(100000);
    ck_assert_ptr_nonnull(p);
    bfc_ctx_t *ctx = bfc_host_ctx(bfc_host_numa_node(p));
    ck_assert_ptr_nonnull(ctx);
    static struct bfc__backend_ops counting;
    counting = *ctx->be->ops;
    real_device_sync = counting.device_sync;
    counting.device_sync = counting_device_sync;
    ctx->be->ops = &counting;
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    ck_assert_int_eq(atomic_load(&host_device_syncs), 0); /* not on the common path */
    bfc_shutdown();
    ck_assert_int_eq(atomic_load(&host_device_syncs), 1);
}
END_TEST

START_TEST(test_alloc_on_node0)
{
    ck_assert_int_ge(bfc_host_numa_nodes(), 1);
    char *p = bfc_host_alloc(100000);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_uint_eq((uintptr_t)p % 256, 0);
    memset(p, 0x5a, 100000);
    ck_assert_int_eq(p[99999], 0x5a);
    /* This machine has one node: the pages must really be on node 0. */
    if (bfc_host_numa_nodes() == 1)
        ck_assert_int_eq(bfc_host_numa_node(p), 0);
    else
        ck_assert_int_ge(bfc_host_numa_node(p), 0);
    ck_assert_ptr_nonnull(bfc_host_ctx(bfc_host_numa_node(p)));
    ck_assert_int_eq(bfc_host_numa_node(p + 256), BFC_ENOTOWNED); /* not a block's start */
    bfc_stats_t s = host_stats();
    ck_assert_uint_eq(s.num_allocs, 1);
    ck_assert_uint_eq(s.bytes_requested, 100000);
    ck_assert_uint_ge(s.bytes_in_use, 100000);
    ck_assert_uint_eq(s.num_shards, 1);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    s = host_stats();
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(s.num_frees, 1);
    /* A freed block has no node to report: the status says why. */
    ck_assert_int_eq(bfc_host_numa_node(p), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_host_record_stream(p, NULL), BFC_EDOUBLEFREE);
    check_host_ctx();
    ck_assert_ptr_null(bfc_host_alloc(0));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_ptr_null(bfc_host_alloc(SIZE_MAX));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
}
END_TEST

struct xfer {
    void *p[64];
    int n;
};

static void *alloc_thread(void *arg)
{
    struct xfer *x = arg;
    for (int i = 0; i < x->n; i++) {
        x->p[i] = bfc_host_alloc(4096 + (size_t)i * 256);
        if (x->p[i])
            memset(x->p[i], i, 4096);
    }
    return NULL;
}

START_TEST(test_per_thread_arenas_and_cross_thread_free)
{
    void *mine = bfc_host_alloc(4096);
    ck_assert_ptr_nonnull(mine);
    struct xfer x = { .n = 32 };
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, alloc_thread, &x), 0);
    /* Keep the other thread alive until its blocks are checked: join later. */
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    for (int i = 0; i < x.n; i++) {
        ck_assert_ptr_nonnull(x.p[i]);
        ck_assert_int_eq(((unsigned char *)x.p[i])[100], (unsigned char)i);
    }
    /* The other thread exited with 32 live blocks: they stay valid and this
     * thread frees them (cross-thread frees into a retired arena). */
    ck_assert_int_eq(bfc_host_free(x.p[0]), BFC_OK);
    ck_assert_int_eq(bfc_host_free(x.p[0]), BFC_EDOUBLEFREE); /* the arena still lives */
    for (int i = 1; i < x.n; i++)
        ck_assert_int_eq(bfc_host_free(x.p[i]), BFC_OK);
    /* The last free reclaimed the retired arena and its regions: the memory
     * left the shard, and a second free is still a double free (the region
     * map remembers the departed ranges), through every entry point. */
    for (int i = 0; i < x.n; i++) {
        int rc = bfc_host_free(x.p[i]);
        ck_assert_msg(rc == BFC_EDOUBLEFREE, "second free: %s", bfc_err_name(rc));
    }
    ck_assert_int_eq(bfc_host_record_stream(x.p[1], NULL), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_free(x.p[2]), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_host_free((char *)x.p[3] + 8), BFC_ENOTOWNED);
    bfc_stats_t s = host_stats();
    ck_assert_uint_eq(s.num_allocs, 33);
    ck_assert_uint_eq(s.num_frees, 32);
    ck_assert_uint_eq(s.bytes_in_use, bfc_ctx_allocated_size(bfc_host_ctx(bfc_host_numa_node(mine)), mine));
    /* The exited thread's arena is gone once its last block went. */
    ck_assert_uint_eq(s.num_shards, 1);
    ck_assert_int_eq(bfc_host_free(mine), BFC_OK);
    check_host_ctx();
}
END_TEST

struct freer {
    void **p;
    int n;
    int rc_bad;
};

static void *free_thread(void *arg)
{
    struct freer *f = arg;
    for (int i = 0; i < f->n; i++)
        if (bfc_host_free(f->p[i]) != BFC_OK)
            f->rc_bad++;
    return NULL;
}

START_TEST(test_remote_free_returns_to_owner)
{
    enum { N = 50 };
    void *p[N];
    for (int i = 0; i < N; i++)
        ck_assert_ptr_nonnull(p[i] = bfc_host_alloc(1024));
    struct freer f = { p, N, 0 };
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, free_thread, &f), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert_int_eq(f.rc_bad, 0);
    bfc_stats_t s = host_stats(); /* drains the owner's queue */
    ck_assert_uint_eq(s.num_remote_frees, N);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    /* Back in the owner's bins: the owner gets the same memory again. */
    void *q = bfc_host_alloc(1024);
    ck_assert_ptr_eq(q, p[0]);
    ck_assert_int_eq(bfc_host_free(q), BFC_OK);
    check_host_ctx();
}
END_TEST

/*
 * A thread's slot (its pseudo-stream handle) goes to the next thread once
 * it exits.  A block of the exited thread freed by the slot's next owner is
 * another thread's block -- a cross-thread free, counted in
 * num_remote_frees -- though the handle is the same: it was taken for the
 * owner's stream, and the free counted as local.
 */
static void *alloc_one(void *arg)
{
    *(void **)arg = bfc_host_alloc(4096);
    return NULL;
}

static void *free_one(void *arg)
{
    return (void *)(intptr_t)bfc_host_free(arg);
}

START_TEST(test_free_by_slot_heir_is_remote)
{
    pthread_t t;
    void *p = NULL, *rc;
    /* this thread has no slot yet: its first host call takes the freed one */
    ck_assert_int_eq(pthread_create(&t, NULL, alloc_one, &p), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_eq(host_stats().num_remote_frees, 0);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    bfc_stats_t s = host_stats();
    ck_assert_uint_eq(s.num_frees, 1);
    ck_assert_uint_eq(s.num_remote_frees, 1);
    /* a new thread takes the slot the next exited thread gave back */
    ck_assert_int_eq(pthread_create(&t, NULL, alloc_one, &p), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(pthread_create(&t, NULL, free_one, p), 0);
    ck_assert_int_eq(pthread_join(t, &rc), 0);
    ck_assert_int_eq((int)(intptr_t)rc, BFC_OK);
    s = host_stats();
    ck_assert_uint_eq(s.num_frees, 2);
    ck_assert_uint_eq(s.num_remote_frees, 2);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    /* A thread's own block freed by itself stays local. */
    void *q = bfc_host_alloc(4096);
    ck_assert_ptr_nonnull(q);
    ck_assert_int_eq(bfc_host_free(q), BFC_OK);
    ck_assert_uint_eq(host_stats().num_remote_frees, 2);
    check_host_ctx();
}
END_TEST

/*
 * Threads that exit one after another, each leaving one small block live:
 * each thread's arena keeps the region under its block, and the rest of that
 * region goes to the pool when the thread exits.  The next thread's first
 * region takes memory the pool holds before new memory: 200 such threads
 * held 400 MiB of pinned memory (a new 2 MiB region each) for 600 KB live.
 */
static void *leave_one(void *arg)
{
    *(void **)arg = bfc_host_alloc(3000);
    return NULL;
}

START_TEST(test_exited_threads_share_regions)
{
    enum { N = 200 };
    static void *p[N];
    for (int i = 0; i < N; i++) {
        pthread_t t;
        ck_assert_int_eq(pthread_create(&t, NULL, leave_one, &p[i]), 0);
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        ck_assert_ptr_nonnull(p[i]);
        memset(p[i], i, 3000);
    }
    bfc_stats_t s = host_stats();
    ck_assert_uint_eq(s.num_allocs, N);
    /* Every block is still live and its own. */
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(((unsigned char *)p[i])[2999], (unsigned char)i);
    /* 200 blocks of 3 KiB fit one 2 MiB region: the first thread's region,
     * its tail taken piece by piece by the threads after it (a few more
     * regions at most). */
    ck_assert_msg(s.bytes_reserved <= 4u << 20, "%" PRIu64 " bytes reserved for %" PRIu64 " in use", s.bytes_reserved,
                  s.bytes_in_use);
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(bfc_host_free(p[i]), BFC_OK);
    check_host_ctx();
}
END_TEST

START_TEST(test_record_stream_fence)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 64u << 20;
    bfc_ctx_t *dev;
    ck_assert_int_eq(bfc_ctx_create(&c, &dev), BFC_OK);
    bfc_stream_t s = bfc_sim_stream_create(dev);
    ck_assert_ptr_nonnull(s);

    void *p = bfc_host_alloc(8192);
    ck_assert_ptr_nonnull(p);
    bfc_sim_stream_hold(dev, s); /* an async copy from p is in flight on s */
    ck_assert_int_eq(bfc_host_record_stream(p, s), BFC_OK);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    bfc_stats_t st = host_stats();
    ck_assert_uint_eq(st.num_pending_frees, 1);
    void *q = bfc_host_alloc(8192);
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_ne(q, p); /* not reused while the copy may still read it */
    bfc_sim_stream_drain(dev, s);
    void *r = bfc_host_alloc(8192);
    ck_assert_ptr_eq(r, p); /* reused once the stream's work completed */
    st = host_stats();
    ck_assert_uint_eq(st.num_pending_frees, 0);
    ck_assert_int_eq(bfc_host_free(q), BFC_OK);
    ck_assert_int_eq(bfc_host_free(r), BFC_OK);
    check_host_ctx();
    bfc_ctx_destroy(dev);
}
END_TEST

START_TEST(test_bad_input)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = 64u << 20;
    bfc_ctx_t *dev;
    ck_assert_int_eq(bfc_ctx_create(&c, &dev), BFC_OK);
    void *d = bfc_ctx_alloc(dev, NULL, 1000);
    ck_assert_ptr_nonnull(d);
    char stack[64];
    void *heap = malloc(100);
    void *p = bfc_host_alloc(1000);
    ck_assert_ptr_nonnull(p);
    bfc_stats_t before = host_stats();

    ck_assert_int_eq(bfc_host_free(NULL), BFC_OK);
    ck_assert_int_eq(bfc_host_free(d), BFC_ENOTOWNED);  /* device pointer */
    ck_assert_int_eq(bfc_host_free(stack), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_free(heap), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_free((char *)p + 256), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_free((char *)p + 1), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_numa_node(d), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_numa_node(stack), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_host_record_stream(stack, NULL), BFC_ENOTOWNED);
    /* A host pointer is not the device context's either. */
    ck_assert_int_eq(bfc_ctx_free(dev, p, NULL), BFC_ENOTOWNED);
    /* A host context wraps SIM (and reports its kind) but is not a SIM
     * device: its simulated streams and faults are refused, the stream
     * with BFC_EINVAL (not ENOMEM, which says every stream was made). */
    bfc_ctx_t *hc = bfc_host_ctx(bfc_host_numa_node(p));
    ck_assert_ptr_nonnull(hc);
    ck_assert_ptr_null(bfc_sim_stream_create(hc));
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(hc), 0);
    bfc_stream_t ds = bfc_sim_stream_create(dev);
    ck_assert_ptr_nonnull(ds);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    bfc_sim_stream_destroy(dev, ds);

    bfc_stats_t after = host_stats();
    ck_assert(memcmp(&before, &after, sizeof before) == 0);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    ck_assert_int_eq(bfc_host_free(p), BFC_EDOUBLEFREE);
    ck_assert_int_eq(bfc_ctx_free(dev, d, NULL), BFC_OK);
    check_host_ctx();
    free(heap);
    bfc_ctx_destroy(dev);
}
END_TEST

START_TEST(test_host_numa_config)
{
    setenv("SHARDBFC_CONF", "backend=sim,host_numa=0", 1);
    void *p = bfc_host_alloc(4096);
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(bfc_host_ctx(0));
    ck_assert_int_eq(bfc_host_numa_node(p), 0);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_node_stats(0, &s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, 1);
    ck_assert_int_eq(bfc_host_node_stats(63, &s), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
}
END_TEST

/* A set-up that fails for want of the topology (hwloc's discovery
 * stopped: HWLOC_COMPONENTS=stop) or of memory is not final: once hwloc
 * loads it, the next call sets host memory up (the first failure was
 * for the life of the process). */
START_TEST(test_setup_failure_retried)
{
    if (!own_process("test_setup_failure_retried"))
        return;
    const char *had = getenv("HWLOC_COMPONENTS");
    char *saved = had ? strdup(had) : NULL;
    setenv("HWLOC_COMPONENTS", "stop", 1);
    ck_assert_ptr_null(bfc_host_alloc(4096));
    ck_assert_int_eq(bfc_last_error(), BFC_EBACKEND);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_stats(&s), BFC_EBACKEND);
    if (saved)
        setenv("HWLOC_COMPONENTS", saved, 1);
    else
        unsetenv("HWLOC_COMPONENTS");
    free(saved);
    void *p = bfc_host_alloc(4096);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_host_stats(&s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, 1);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
}
END_TEST

/* A host context follows neither trace= nor oom_dump= of SHARDBFC_CONF,
 * and bfc_ctx_config says so; a device context made from the same spec
 * follows both.  (The trace file must not appear for the host context.) */
START_TEST(test_host_config_reports_what_it_runs)
{
    char path[] = "/tmp/test_host_trace_XXXXXX", spec[200];
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    ck_assert_int_eq(unlink(path), 0);
    snprintf(spec, sizeof spec, "backend=sim,trace=%s,oom_dump=%s.oom", path, path);
    setenv("SHARDBFC_CONF", spec, 1);
    void *p = bfc_host_alloc(4096);
    ck_assert_ptr_nonnull(p);
    bfc_config_t c;
    ck_assert_int_eq(bfc_ctx_config(bfc_host_ctx(bfc_host_numa_node(p)), &c), BFC_OK);
    ck_assert_str_eq(c.trace, "");
    ck_assert_str_eq(c.oom_dump, "");
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    ck_assert_ptr_null(bfc_host_alloc((size_t)1 << 60)); /* an OOM report: no dump either */
    char dump[sizeof path + 8];
    snprintf(dump, sizeof dump, "%s.oom", path);
    ck_assert_int_ne(access(dump, F_OK), 0);
    ck_assert_int_ne(access(path, F_OK), 0); /* no trace from the host context */
    /* The same spec on a device context: both kept, and the trace written. */
    bfc_config_t dc;
    bfc_config_init(&dc);
    ck_assert_int_eq(bfc_config_parse(&dc, spec), BFC_OK);
    bfc_ctx_t *dev;
    ck_assert_int_eq(bfc_ctx_create(&dc, &dev), BFC_OK);
    ck_assert_int_eq(bfc_ctx_config(dev, &c), BFC_OK);
    ck_assert_str_eq(c.trace, path);
    ck_assert_int_eq(strncmp(c.oom_dump, path, strlen(path)), 0);
    bfc_ctx_destroy(dev);
    ck_assert_int_eq(access(path, F_OK), 0);
    unlink(path);
}
END_TEST

/* A host context's limit is its node's memory and it always grows:
 * SHARDBFC_CONF's memory_limit and allow_growth bound device memory only
 * (the header's "host pinned memory" says so).  The device context made
 * from the same spec keeps both. */
START_TEST(test_host_limit_is_the_nodes_memory)
{
    if (!own_process("test_host_limit_is_the_nodes_memory"))
        return;
    setenv("SHARDBFC_CONF", "backend=sim,memory_limit=64M,allow_growth=false", 1);
    void *p = bfc_host_alloc(200u << 20);
    ck_assert_ptr_nonnull(p);
    bfc_config_t c;
    ck_assert_int_eq(bfc_ctx_config(bfc_host_ctx(bfc_host_numa_node(p)), &c), BFC_OK);
    ck_assert(c.allow_growth);
    ck_assert_uint_gt(c.memory_limit, 200u << 20);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_stats(&s), BFC_OK);
    ck_assert_uint_eq(s.bytes_limit, c.memory_limit);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    bfc_ctx_t *dev = bfc_default_ctx();
    ck_assert_ptr_nonnull(dev);
    ck_assert_int_eq(bfc_ctx_config(dev, &c), BFC_OK);
    ck_assert_uint_eq(c.memory_limit, 64u << 20);
    ck_assert(!c.allow_growth);
    bfc_stream_t st = bfc_sim_stream_create(dev);
    ck_assert_ptr_null(bfc_ctx_alloc(dev, st, 200u << 20));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc_sim_stream_destroy(dev, st);
}
END_TEST

/* Node selection logic on a synthetic topology with two NUMA nodes (binding
 * is a no-op there, so the choice is tested on cpusets directly). */
START_TEST(test_synthetic_two_nodes)
{
    hwloc_topology_t t;
    ck_assert_int_eq(hwloc_topology_init(&t), 0);
    ck_assert_int_eq(hwloc_topology_set_synthetic(t, "pack:2 numa:1 core:2 pu:1"), 0);
    ck_assert_int_eq(hwloc_topology_load(t), 0);
    ck_assert_int_eq(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), 2);
    hwloc_cpuset_t set = hwloc_bitmap_alloc();

    hwloc_bitmap_set_range(set, 0, 1); /* the cores of package 0 */
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), 0);
    hwloc_bitmap_zero(set);
    hwloc_bitmap_set(set, 1); /* one core of package 0 */
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), 0);
    hwloc_bitmap_zero(set);
    hwloc_bitmap_set_range(set, 2, 3); /* package 1 */
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), 1);
    hwloc_bitmap_zero(set);
    hwloc_bitmap_set(set, 3);
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), 1);
    hwloc_bitmap_zero(set);
    hwloc_bitmap_set_range(set, 1, 2); /* spans both: no single node */
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), -1);
    hwloc_bitmap_zero(set);
    ck_assert_int_eq(bfc__host_node_of_cpuset(t, set), -1);

    hwloc_bitmap_free(set);
    hwloc_topology_destroy(t);
}
END_TEST

/* Topologies for the node choice, in hwloc's XML: a package's DRAM and
 * MCDRAM nodes share its CPUs (HBM in flat mode), and a memory-only node is
 * attached to the whole machine (CXL, persistent memory). */
#define XML_HEAD                                                                                         \
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"           \
    "<topology version=\"2.0\">\n"
#define XML_TAIL                                                                                         \
    "<support name=\"discovery.pu\"/><support name=\"discovery.numa\"/>"                                \
    "<support name=\"discovery.numa_memory\"/></topology>\n"
#define XML_SETS(cpus, nodes)                                                                            \
    " cpuset=\"" cpus "\" complete_cpuset=\"" cpus "\" nodeset=\"" nodes "\" complete_nodeset=\"" nodes "\""
#define XML_NODE(os, cpus, nodes, gp, extra)                                                             \
    "<object type=\"NUMANode\" os_index=\"" #os "\"" XML_SETS(cpus, nodes) " gp_index=\"" #gp            \
    "\" local_memory=\"1073741824\"" extra "/>\n"
#define XML_PU(os, cpus, nodes, gp)                                                                      \
    "<object type=\"PU\" os_index=\"" #os "\"" XML_SETS(cpus, nodes) " gp_index=\"" #gp "\"/>\n"

/* Package 0: DRAM node 2 and DRAM node 0, listed in that order; package 1:
 * MCDRAM node 1 and DRAM node 3. */
static const char xml_hbm[] =
    XML_HEAD "<object type=\"Machine\" os_index=\"0\"" XML_SETS("0x00000003", "0x0000000f")
             " allowed_cpuset=\"0x00000003\" allowed_nodeset=\"0x0000000f\" gp_index=\"1\">\n"
             "<object type=\"Package\" os_index=\"0\"" XML_SETS("0x00000001", "0x00000005") " gp_index=\"2\">\n"
             XML_NODE(2, "0x00000001", "0x00000004", 3, "")
             XML_NODE(0, "0x00000001", "0x00000001", 4, "")
             XML_PU(0, "0x00000001", "0x00000005", 5)
             "</object>\n"
             "<object type=\"Package\" os_index=\"1\"" XML_SETS("0x00000002", "0x0000000a") " gp_index=\"6\">\n"
             XML_NODE(1, "0x00000002", "0x00000002", 7, " subtype=\"MCDRAM\"")
             XML_NODE(3, "0x00000002", "0x00000008", 8, "")
             XML_PU(1, "0x00000002", "0x0000000a", 9)
             "</object>\n</object>\n" XML_TAIL;

/* A node per CPU, numbered 0 and 100, and CPU-less node 5 on the machine. */
static const char xml_cxl[] =
    XML_HEAD "<object type=\"Machine\" os_index=\"0\"" XML_SETS("0x00000003", "0x00000010,0x00000000,0x00000000,0x00000021")
             " allowed_cpuset=\"0x00000003\" allowed_nodeset=\"0x00000010,0x00000000,0x00000000,0x00000021\" gp_index=\"1\">\n"
             "<object type=\"Group\"" XML_SETS("0x00000001", "0x00000001") " gp_index=\"2\" kind=\"1001\" subkind=\"0\">\n"
             XML_NODE(0, "0x00000001", "0x00000001", 3, "")
             XML_PU(0, "0x00000001", "0x00000001", 4)
             "</object>\n"
             "<object type=\"Group\"" XML_SETS("0x00000002", "0x00000010,0x00000000,0x00000000,0x00000000")
             " gp_index=\"5\" kind=\"1001\" subkind=\"0\">\n"
             XML_NODE(100, "0x00000002", "0x00000010,0x00000000,0x00000000,0x00000000", 6, "")
             XML_PU(1, "0x00000002", "0x00000010,0x00000000,0x00000000,0x00000000", 7)
             "</object>\n"
             XML_NODE(5, "0x00000003", "0x00000020", 8, "")
             "</object>\n" XML_TAIL;

/* Node 0 on CPU 0; CPU 1 has no node of its own, only node 5 on the
 * machine. */
static const char xml_partial[] =
    XML_HEAD "<object type=\"Machine\" os_index=\"0\"" XML_SETS("0x00000003", "0x00000021")
             " allowed_cpuset=\"0x00000003\" allowed_nodeset=\"0x00000021\" gp_index=\"1\">\n"
             "<object type=\"Group\"" XML_SETS("0x00000001", "0x00000001") " gp_index=\"2\" kind=\"1001\" subkind=\"0\">\n"
             XML_NODE(0, "0x00000001", "0x00000001", 3, "")
             XML_PU(0, "0x00000001", "0x00000001", 4)
             "</object>\n"
             XML_PU(1, "0x00000002", "0x00000020", 5)
             XML_NODE(5, "0x00000003", "0x00000020", 6, "")
             "</object>\n" XML_TAIL;

static hwloc_topology_t xml_topology(const char *xml)
{
    hwloc_topology_t t;
    ck_assert_int_eq(hwloc_topology_init(&t), 0);
    ck_assert_int_eq(hwloc_topology_set_xmlbuffer(t, xml, (int)strlen(xml) + 1), 0);
    ck_assert_int_eq(hwloc_topology_load(t), 0);
    return t;
}

static int node_of_cpus(hwloc_topology_t t, int first, int last)
{
    hwloc_cpuset_t set = hwloc_bitmap_alloc();
    ck_assert_ptr_nonnull(set);
    hwloc_bitmap_set_range(set, (unsigned)first, last);
    int node = bfc__host_node_of_cpuset(t, set);
    hwloc_bitmap_free(set);
    return node;
}

/* A CPU local to two nodes: the node of its own locality rather than one
 * spanning more CPUs, and of two with the same CPUs the ordinary DRAM one
 * (no subtype), then the lower number.  The choice was "exactly one node
 * meets the CPUs, else the machine's first node": package 1's threads had
 * their memory on package 0, and with a CXL node on the machine every
 * thread had node 0's. */
START_TEST(test_node_choice_shared_locality)
{
    hwloc_topology_t t = xml_topology(xml_hbm);
    ck_assert_int_eq(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), 4);
    ck_assert_int_eq(node_of_cpus(t, 0, 0), 0); /* DRAM 0 and 2: the lower */
    ck_assert_int_eq(node_of_cpus(t, 1, 1), 3); /* DRAM 3 over MCDRAM 1 */
    ck_assert_int_eq(node_of_cpus(t, 0, 1), -1); /* two packages: none */
    hwloc_topology_destroy(t);

    t = xml_topology(xml_cxl);
    ck_assert_int_eq(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), 3);
    ck_assert_int_eq(node_of_cpus(t, 0, 0), 0);
    ck_assert_int_eq(node_of_cpus(t, 1, 1), 100);
    ck_assert_int_eq(node_of_cpus(t, 0, 1), -1); /* node 5 spans both, but is no one's own */
    hwloc_topology_destroy(t);

    /* A set with a CPU that only the machine's node serves: node 0 is
     * local to CPU 0 alone, so the set has no node of its own. */
    t = xml_topology(xml_partial);
    ck_assert_int_eq(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), 2);
    ck_assert_int_eq(node_of_cpus(t, 0, 0), 0);
    ck_assert_int_eq(node_of_cpus(t, 1, 1), 5);
    ck_assert_int_eq(node_of_cpus(t, 0, 1), -1);
    hwloc_topology_destroy(t);
}
END_TEST

/* Node numbers are the kernel's, which can be sparse and large (POWER9
 * numbers its GPUs' memory nodes 252 to 255).  The host contexts were a
 * table of 64 by number: node 69's allocations failed with BFC_EINVAL, and
 * the exit of a thread of that node read past the table (a crash, or
 * UBSan's out-of-bounds report). */
static void *alloc_on_thread(void *arg)
{
    (void)arg;
    return bfc_host_alloc(8192);
}

START_TEST(test_sparse_node_numbers)
{
    if (!own_process("test_sparse_node_numbers"))
        return;
    setenv("HWLOC_SYNTHETIC", "numa:70 pu:1", 1);
    setenv("SHARDBFC_CONF", "backend=sim,host_numa=69", 1);
    ck_assert_int_eq(bfc_host_numa_nodes(), 70);
    void *p = bfc_host_alloc(4096);
    ck_assert_msg(p != NULL, "error %d", bfc_last_error());
    ck_assert_ptr_nonnull(bfc_host_ctx(69));
    ck_assert_ptr_null(bfc_host_ctx(0));
    ck_assert_ptr_null(bfc_host_ctx(70));
    ck_assert_ptr_null(bfc_host_ctx(-1));
    ck_assert_ptr_null(bfc_host_ctx(INT_MAX));
    pthread_t th;
    void *q = NULL;
    ck_assert_int_eq(pthread_create(&th, NULL, alloc_on_thread, NULL), 0);
    ck_assert_int_eq(pthread_join(th, &q), 0); /* its exit retires its arena */
    ck_assert_ptr_nonnull(q);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_node_stats(69, &s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, 2);
    ck_assert_uint_eq(s.num_shards, 1);
    ck_assert_uint_eq(s.bytes_requested, 4096 + 8192);
    ck_assert_int_eq(bfc_host_node_stats(70, &s), BFC_EINVAL);
    ck_assert_int_eq(bfc_host_node_stats(0, &s), BFC_EINVAL);
    ck_assert_uint_eq(host_stats().num_allocs, 2);
    ck_assert_int_eq(bfc_host_free(q), BFC_OK);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    char buf[512] = "";
    ck_assert_msg(bfc_ctx_check_report(bfc_host_ctx(69), buf, sizeof buf) == BFC_OK, "%s", buf);
    ck_assert_uint_eq(host_stats().bytes_in_use, 0);
}
END_TEST

/* A thread whose node is not known falls back to the machine's first node
 * that host memory serves: hwloc's first was node 70000, past the table,
 * and every allocation failed with BFC_EINVAL though node 3 was there. */
/* The process's first host block: counted on `node`, then freed. */
static void first_block_on(int node)
{
    void *p = bfc_host_alloc(4096);
    ck_assert_msg(p != NULL, "error %d", bfc_last_error());
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_node_stats(node, &s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, 1);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
}

START_TEST(test_fallback_node_is_served)
{
    if (!own_process("test_fallback_node_is_served"))
        return;
    setenv("HWLOC_SYNTHETIC", "numa:2(indexes=70000,3) pu:1", 1);
    ck_assert_int_eq(bfc_host_numa_nodes(), 2);
    first_block_on(3);
    bfc_stats_t s;
    ck_assert_int_eq(bfc_host_node_stats(70000, &s), BFC_EINVAL);
}
END_TEST

/* The largest node number served is 65535 (the table's bound): as the
 * machine's first node, and named by host_numa.  (The node's figures tell
 * where the block went; bfc_host_numa_node would say where the kernel
 * placed its pages, not on a node of a made-up topology.) */
START_TEST(test_top_node_number)
{
    if (!own_process("test_top_node_number"))
        return;
    setenv("HWLOC_SYNTHETIC", "numa:2(indexes=65535,70000) pu:1", 1);
    first_block_on(65535);
}
END_TEST

START_TEST(test_top_node_named)
{
    if (!own_process("test_top_node_named"))
        return;
    setenv("HWLOC_SYNTHETIC", "numa:2(indexes=3,65535) pu:1", 1);
    setenv("SHARDBFC_CONF", "backend=sim,host_numa=65535", 1);
    first_block_on(65535);
}
END_TEST

/* The same end to end: threads bound to CPU 0 and CPU 1 of the xml_cxl
 * machine (hwloc told it is this one, so it reads the threads' bindings)
 * allocate from nodes 0 and 100, and the host totals sum both nodes'
 * limits (each node's memory; the sum took one node's).  Needs CPUs 0 and
 * 1; where the test runs with fewer, the binding fails and it skips. */
struct bound {
    int cpu;
    void *p;
};

static void *alloc_bound(void *arg)
{
    struct bound *b = arg;
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(b->cpu, &cs);
    if (pthread_setaffinity_np(pthread_self(), sizeof cs, &cs) == 0)
        b->p = bfc_host_alloc(4096);
    return NULL;
}

START_TEST(test_bound_threads_find_their_nodes)
{
    if (!own_process("test_bound_threads_find_their_nodes"))
        return;
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2) {
        printf("test_bound_threads_find_their_nodes: fewer than 2 CPUs, not checked\n");
        return;
    }
    char path[] = "/tmp/test_host_xml.XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, xml_cxl, sizeof xml_cxl - 1), (ssize_t)(sizeof xml_cxl - 1));
    close(fd);
    setenv("HWLOC_XMLFILE", path, 1);
    setenv("HWLOC_THISSYSTEM", "1", 1);
    ck_assert_int_eq(bfc_host_numa_nodes(), 3);
    unlink(path);
    struct bound b[2] = {{0, NULL}, {1, NULL}};
    for (int i = 0; i < 2; i++) {
        pthread_t th;
        ck_assert_int_eq(pthread_create(&th, NULL, alloc_bound, &b[i]), 0);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
    }
    if (!b[0].p || !b[1].p) {
        bfc_host_free(b[0].p);
        bfc_host_free(b[1].p);
        printf("test_bound_threads_find_their_nodes: CPU 0 or 1 cannot be bound to, not checked\n");
        return;
    }
    bfc_stats_t s0, s1;
    ck_assert_int_eq(bfc_host_node_stats(0, &s0), BFC_OK);
    ck_assert_int_eq(bfc_host_node_stats(100, &s1), BFC_OK);
    ck_assert_uint_eq(s0.bytes_requested, 4096);
    ck_assert_uint_eq(s1.bytes_requested, 4096);
    ck_assert_uint_eq(s0.bytes_limit, 1u << 30);
    ck_assert_uint_eq(s1.bytes_limit, 1u << 30);
    ck_assert_int_eq(bfc_host_node_stats(5, &s0), BFC_EINVAL); /* the CXL node: nobody's */
    bfc_stats_t all = host_stats();
    ck_assert_uint_eq(all.bytes_limit, 2u << 30);
    ck_assert_uint_eq(all.bytes_requested, 8192);
    ck_assert_int_eq(bfc_host_free(b[0].p), BFC_OK);
    ck_assert_int_eq(bfc_host_free(b[1].p), BFC_OK);
}
END_TEST

/* A registration the driver will not let go of: the pages stay mapped
 * (the driver may still reach them), the free fails, and a later free,
 * once the driver lets go, returns them. */
START_TEST(test_unregister_refused)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    bfc__backend_t *be;
    ck_assert_int_eq(bfc__backend_host_open(&c, NULL, 0, false, 64 * BFC__MiB, &be), BFC_OK);
    void *p = NULL;
    ck_assert_int_eq(be->ops->mem_alloc(be, 2 * BFC__MiB, &p), BFC_OK);
    memset(p, 1, 2 * BFC__MiB);
    bfc__sim_fail_free_every(bfc__backend_host_inner(be), 1);
    ck_assert_int_eq(be->ops->mem_free(be, p, 2 * BFC__MiB), BFC_EBACKEND);
    memset(p, 2, 2 * BFC__MiB); /* still mapped */
    bfc__sim_fail_free_every(bfc__backend_host_inner(be), 0);
    ck_assert_int_eq(be->ops->mem_free(be, p, 2 * BFC__MiB), BFC_OK);
    be->ops->close(be);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("host");
    TCase *tc = tcase_create("host");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_alloc_on_node0);
    tcase_add_test(tc, test_setup_failure_retried);
    tcase_add_test(tc, test_shutdown_waits_for_device);
    tcase_add_test(tc, test_per_thread_arenas_and_cross_thread_free);
    tcase_add_test(tc, test_remote_free_returns_to_owner);
    tcase_add_test(tc, test_free_by_slot_heir_is_remote);
    tcase_add_test(tc, test_exited_threads_share_regions);
    tcase_add_test(tc, test_record_stream_fence);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_host_numa_config);
    tcase_add_test(tc, test_host_config_reports_what_it_runs);
    tcase_add_test(tc, test_host_limit_is_the_nodes_memory);
    tcase_add_test(tc, test_synthetic_two_nodes);
    tcase_add_test(tc, test_node_choice_shared_locality);
    tcase_add_test(tc, test_sparse_node_numbers);
    tcase_add_test(tc, test_bound_threads_find_their_nodes);
    tcase_add_test(tc, test_fallback_node_is_served);
    tcase_add_test(tc, test_top_node_number);
    tcase_add_test(tc, test_top_node_named);
    tcase_add_test(tc, test_unregister_refused);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
