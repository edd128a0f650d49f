/*
 * test_gpu_streams.c -- on a real GPU: no block is reused by a stream while
 * another stream may still write it.  GPU only: built with CUDA and nvcc
 * (the kernels are tests/gpu/kernels.cu); without them, or without a
 * device, it exits 77 and says why.
 *
 * The method.  Kernels make the streams' order visible in the data.  A spin
 * kernel keeps stream A busy for SPIN (200 ms; BFC_GPU_SPIN_MS), and a fill
 * kernel queued behind it writes A's pattern into the first set of blocks
 * only when the spin ends.  The blocks then leave A by one of the paths
 * below, a second set of the same sizes is allocated -- on another stream,
 * idle, whose fills run at once, or on A itself -- and each block of it is
 * filled with a pattern of its own.  After a device synchronisation every
 * block of the second set must hold its own pattern: a block handed out
 * while A (or a stream that used it after A) could still write it holds
 * the late writer's pattern instead.  The control case shows that this
 * detector detects: the same two writes to one cudaMalloc'ed buffer,
 * without any allocator between them, leave the late writer's data.
 *
 * Where the limit is tight the second set cannot be served from fresh
 * memory: the allocator must move the first set's memory between streams,
 * which these cases also assert (address ranges overlap; under
 * compute-sanitizer, whose cudaMalloc never returns an address just freed,
 * that also proves a region was handed over, not freed to the device and
 * allocated again), and wait for its fences (retry_ms) rather than fail.  The paths, one case each, in
 * `paths[]` -- a new path (virtual-memory arenas unmapping pages, say) is
 * one more row:
 *
 *   same_stream      free on A, reallocate on A (stream order makes it safe)
 *   reclaim          free on A; an idle stream's shard needs the limit:
 *                    A's fully free region moves to it (departure fence)
 *   cross_other      B waits for A, writes, frees on B (fenced on B);
 *                    an idle stream takes the memory
 *   cross_owner      the same, A itself reallocates: its new writes run
 *                    as soon as its spin ends, B's later
 *   record_stream    B uses A's blocks (record_stream), A frees and
 *                    reallocates at once
 *   large            blocks >= large_alloc: their regions go back to the
 *                    pool on free and another stream takes them
 *   release          free on A, bfc_ctx_stream_release(A): A's regions go
 *                    to the pool, another stream takes them
 *   no_growth        allow_growth=false: one reservation shared through
 *                    the pool
 *   legacy_owner     as reclaim, with the legacy default stream as A
 *   trim             free on A, bfc_ctx_trim, another stream allocates
 *   vmm_*            the same departures in expandable arenas (vmm=on):
 *                    pages are unmapped from A's range after its fence
 *                    and mapped into the taker's
 *
 * Besides: an expandable context destroyed while a kernel still writes a
 * block freed just before waits for it (a child process: an unmapped page
 * written would be a fault that breaks the context for good);
 * cudaStreamPerThread used from two threads gets two shards, and memory
 * leaving one of those shards on the other thread's call waits for its
 * owner's work (per_thread_departure), also when that thread has exited
 * without releasing its stream and another thread retires its shard; the
 * legacy default stream (NULL and cudaStreamLegacy) allocates and frees;
 * granules an expandable shard marked to leave while its stream was busy
 * go to another stream's growth once its work is done (leaving_to_growth);
 * a stream released and destroyed while its work still runs, its blocks
 * freed afterwards on another stream, which gets their memory only once
 * that work is done (released_destroyed, a child process per arena kind);
 * device errors surface as BFC_EBACKEND (a child process whose context a
 * trapping kernel broke: a sticky error cannot be undone in-process).
 * BFC_GPU_NO_TRAP=1 leaves that child out (compute-sanitizer reports the
 * trap it provokes).
 *
 * Check runs the tests in-process (CK_NOFORK): the device probe in main()
 * initialised CUDA, and a forked child cannot use its parent's context.
 */
#include "config.h"

#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <shardbfc.h>

#ifndef BFC_TEST_KERNELS
#define BFC_TEST_KERNELS 0
#endif

#if BFC_HAVE_CUDA && BFC_TEST_KERNELS
#include <cuda_runtime_api.h>

#include "gpu/kernels.h"

extern char **environ;

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)
#define MAXB 8

#define CUDA_OK(call)                                                          \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

static uint64_t spin_ns(void)
{
    const char *s = getenv("BFC_GPU_SPIN_MS");
    long ms = s ? strtol(s, NULL, 10) : 0;

    return (uint64_t)(ms > 0 ? ms : 200) * 1000000ull;
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s;

    /* Non-blocking: no implicit ordering with the legacy default stream. */
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
}

static bfc_ctx_t *ctx_from(const char *spec)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;

    bfc_config_init(&cfg);
    ck_assert_int_eq(bfc_config_parse(&cfg, "backend=cuda"), BFC_OK);
    ck_assert_msg(bfc_config_parse(&cfg, spec) == BFC_OK, "config %s refused", spec);
    ck_assert_int_eq(bfc_ctx_create(&cfg, &ctx), BFC_OK);
    return ctx;
}

/* ctx_from for an expandable row: NULL when vmm=on is refused, by the
 * parser (a build without virtual-memory arenas) or at creation (a device
 * without virtual memory management). */
static bfc_ctx_t *ctx_vmm(const char *spec)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;

    bfc_config_init(&cfg);
    ck_assert_int_eq(bfc_config_parse(&cfg, "backend=cuda"), BFC_OK);
    if (bfc_config_parse(&cfg, spec) != BFC_OK)
        return NULL;
    int st = bfc_ctx_create(&cfg, &ctx);
    if (st == BFC_EINVAL)
        return NULL;
    ck_assert_msg(st == BFC_OK, "%s: %s", spec, bfc_err_name(st));
    return ctx;
}

/* Words of [p, p+n) not holding tag's pattern (after a full
 * synchronisation); ULLONG_MAX when the device calls fail.  Asserts
 * nothing, so it may run where an assertion must not unwind. */
static unsigned long long count_bad_raw(const void *p, size_t n, uint32_t tag)
{
    static unsigned long long *bad; /* device counter, outside the allocator */
    unsigned long long h = 0;

    if (!bad && cudaMalloc((void **)&bad, sizeof(*bad)) != cudaSuccess) {
        bad = NULL;
        return ULLONG_MAX;
    }
    if (cudaMemset(bad, 0, sizeof(*bad)) != cudaSuccess ||
        bfc_test_count_bad(p, n, tag, bad, cudaStreamLegacy) != cudaSuccess ||
        cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess)
        return ULLONG_MAX;
    return h;
}

static unsigned long long count_bad(const void *p, size_t n, uint32_t tag)
{
    unsigned long long h = count_bad_raw(p, n, tag);

    ck_assert_msg(h != ULLONG_MAX, "reading back %p failed: %s", p,
                  cudaGetErrorString(cudaGetLastError()));
    return h;
}

static bool overlaps(void *const *a, const size_t *an, unsigned na, void *const *b,
                     const size_t *bn, unsigned nb)
{
    for (unsigned i = 0; i < na; i++)
        for (unsigned j = 0; j < nb; j++) {
            uintptr_t a0 = (uintptr_t)a[i], b0 = (uintptr_t)b[j];

            if (a0 < b0 + bn[j] && b0 < a0 + an[i])
                return true;
        }
    return false;
}

/* ------------------------------------------------------------ control */

/*
 * The detector detects: a write queued behind A's spin lands after a write
 * queued later on an idle stream, so a block reused too early would hold
 * the late writer's pattern.
 */
START_TEST(test_control_detector)
{
    cudaStream_t a = new_stream(), c = new_stream();
    size_t n = 4 * MiB;
    void *buf;

    CUDA_OK(cudaMalloc(&buf, n));
    /* Five spins long: only the host stalling that long between the two
     * launches below (a loaded machine) could make this fail. */
    CUDA_OK(bfc_test_spin(a, 5 * spin_ns()));
    CUDA_OK(bfc_test_fill(buf, n, 1, a));  /* runs when the spin ends */
    CUDA_OK(bfc_test_fill(buf, n, 2, c));  /* runs now */
    CUDA_OK(cudaDeviceSynchronize());
    ck_assert_msg(count_bad(buf, n, 2) == n / 4,
                  "the late write on the busy stream did not land last: "
                  "the spin kernel does not delay A, and every case below is blind");
    CUDA_OK(cudaFree(buf));
    CUDA_OK(cudaStreamDestroy(a));
    CUDA_OK(cudaStreamDestroy(c));
}
END_TEST

/* ------------------------------------------------------------- paths */

enum departure {
    DEP_FREE_OWNER, /* free on A */
    DEP_FREE_OTHER, /* B waits for A, writes, frees on B */
    DEP_RECORD,     /* B waits for A, writes; record_stream(B); free on A */
    DEP_RELEASE,    /* free on A; bfc_ctx_stream_release(A) */
    DEP_TRIM,       /* free on A; bfc_ctx_trim */
};

enum taker {
    TAKE_OTHER, /* an idle stream allocates the second set */
    TAKE_OWNER, /* A allocates the second set */
};

struct path {
    const char *name;
    const char *conf;         /* on top of backend=cuda */
    size_t sizes[MAXB];       /* first and second set, 0-terminated */
    enum departure dep;
    enum taker take;
    bool owner_legacy;        /* A is the legacy default stream */
    bool expect_overlap;      /* the second set must reuse first-set memory */
    const char *skip_if_refused; /* conf may be refused: skip, saying this */
    bool expect_unmap;        /* expandable: the taker's pages come from A's unmap */
};

/* Tight: one 32 MiB region holds the whole limit, so a second stream can
 * only be served from the memory the first one gave up.  The first set is
 * 16 + 4 + 1 MiB: TensorFlow's split rule splits a free chunk only when it
 * is at least twice the request (or the rest is 128 MiB or more), so a
 * 24 MiB block would take the whole region, and the next fail.  The classic rows
 * say vmm=off: under the default (auto) a device with virtual memory
 * management gets expandable arenas, whose paths are the vmm_ rows. */
#define TIGHT "memory_limit=32M,initial_region=32M,retry_ms=20000,vmm=off"
/* The same limit in an expandable arena: pages are unmapped from one
 * shard's range and mapped into another's, so no address overlap is
 * asserted; an early unmap shows as a fault of A's late fill, a wrong remap
 * as corrupted data. */
#define VTIGHT "memory_limit=32M,retry_ms=20000,vmm=on,release_threshold=0"
#define NOVMM "no virtual-memory arenas here (vmm=on refused: the build or the device)"
#define TIGHT_SET {16 * MiB, 4 * MiB, MiB}

static const struct path paths[] = {
    {"same_stream", "memory_limit=64M,vmm=off", {MiB, 256 * KiB, 4 * MiB, 64 * KiB},
     DEP_FREE_OWNER, TAKE_OWNER, false, true, NULL, false},
    {"reclaim", TIGHT, TIGHT_SET, DEP_FREE_OWNER, TAKE_OTHER, false, true, NULL, false},
    {"cross_other", TIGHT, TIGHT_SET, DEP_FREE_OTHER, TAKE_OTHER, false, true, NULL, false},
    {"cross_owner", TIGHT, TIGHT_SET, DEP_FREE_OTHER, TAKE_OWNER, false, true, NULL, false},
    {"record_stream", TIGHT, TIGHT_SET, DEP_RECORD, TAKE_OWNER, false, true, NULL, false},
    {"large", "memory_limit=160M,large_alloc=32M,retry_ms=20000,vmm=off", {64 * MiB, 64 * MiB},
     DEP_FREE_OWNER, TAKE_OTHER, false, true, NULL, false},
    {"release", TIGHT, TIGHT_SET, DEP_RELEASE, TAKE_OTHER, false, true, NULL, false},
    {"no_growth", "allow_growth=false,memory_limit=32M,retry_ms=20000,vmm=off",
     TIGHT_SET, DEP_FREE_OWNER, TAKE_OTHER, false, true, NULL, false},
    {"legacy_owner", TIGHT, TIGHT_SET, DEP_FREE_OWNER, TAKE_OTHER, true, true, NULL, false},
    {"trim", "memory_limit=64M,vmm=off", {24 * MiB, 4 * MiB, MiB}, DEP_TRIM, TAKE_OTHER, false,
     false, NULL, false},
    /* Expandable arenas: each departure again, pages changing hands. */
    {"vmm_same_stream", "memory_limit=64M,vmm=on", {MiB, 256 * KiB, 4 * MiB, 64 * KiB},
     DEP_FREE_OWNER, TAKE_OWNER, false, false, NOVMM, false},
    {"vmm_reclaim", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_FREE_OWNER, TAKE_OTHER, false, false,
     NOVMM, true},
    {"vmm_cross_other", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_FREE_OTHER, TAKE_OTHER, false,
     false, NOVMM, true},
    {"vmm_cross_owner", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_FREE_OTHER, TAKE_OWNER, false,
     false, NOVMM, false},
    {"vmm_record_stream", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_RECORD, TAKE_OWNER, false,
     false, NOVMM, false},
    {"vmm_release", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_RELEASE, TAKE_OTHER, false, false,
     NOVMM, true},
    {"vmm_legacy_owner", VTIGHT, {24 * MiB, 4 * MiB, MiB}, DEP_FREE_OWNER, TAKE_OTHER, true,
     false, NOVMM, true},
    {"vmm_trim", "memory_limit=64M,vmm=on", {24 * MiB, 4 * MiB, MiB}, DEP_TRIM, TAKE_OTHER,
     false, false, NOVMM, false},
};

static void run_path(const struct path *pt)
{
    bfc_ctx_t *ctx;
    cudaStream_t a, b = new_stream(), c = new_stream(), t;
    cudaEvent_t a_done;
    void *first[MAXB], *second[MAXB];
    size_t n[MAXB];
    unsigned nb = 0;
    bfc_stats_t st;
    double t0, waited;

    ctx = pt->skip_if_refused ? ctx_vmm(pt->conf) : ctx_from(pt->conf);
    if (!ctx) {
        printf("test_gpu_streams: %s: SKIP: %s\n", pt->name, pt->skip_if_refused);
        CUDA_OK(cudaStreamDestroy(b));
        CUDA_OK(cudaStreamDestroy(c));
        return;
    }
    a = pt->owner_legacy ? cudaStreamLegacy : new_stream();
    t = pt->take == TAKE_OWNER ? a : c;
    while (nb < MAXB && pt->sizes[nb]) {
        n[nb] = pt->sizes[nb];
        nb++;
    }

    /* First set on A: written at once, and again when A's spin ends. */
    for (unsigned i = 0; i < nb; i++) {
        first[i] = bfc_ctx_alloc(ctx, (bfc_stream_t)a, n[i]);
        ck_assert_msg(first[i] != NULL, "%s: first alloc(%zu): %s", pt->name, n[i],
                      bfc_err_name(bfc_last_error()));
        CUDA_OK(bfc_test_fill(first[i], n[i], 0x100 + i, a));
    }
    CUDA_OK(bfc_test_spin(a, spin_ns()));
    for (unsigned i = 0; i < nb; i++)
        CUDA_OK(bfc_test_fill(first[i], n[i], 0x200 + i, a));

    /* The blocks leave A. */
    switch (pt->dep) {
    case DEP_FREE_OTHER:
    case DEP_RECORD:
        CUDA_OK(cudaEventCreateWithFlags(&a_done, cudaEventDisableTiming));
        CUDA_OK(cudaEventRecord(a_done, a));
        CUDA_OK(cudaStreamWaitEvent(b, a_done, 0));
        CUDA_OK(bfc_test_spin(b, spin_ns())); /* B writes later still */
        for (unsigned i = 0; i < nb; i++)
            CUDA_OK(bfc_test_fill(first[i], n[i], 0x300 + i, b));
        CUDA_OK(cudaEventDestroy(a_done));
        for (unsigned i = 0; i < nb; i++) {
            if (pt->dep == DEP_RECORD) {
                ck_assert_int_eq(bfc_ctx_record_stream(ctx, first[i], (bfc_stream_t)b), BFC_OK);
                ck_assert_int_eq(bfc_ctx_free(ctx, first[i], (bfc_stream_t)a), BFC_OK);
            } else {
                ck_assert_int_eq(bfc_ctx_free(ctx, first[i], (bfc_stream_t)b), BFC_OK);
            }
        }
        break;
    case DEP_FREE_OWNER:
    case DEP_RELEASE:
    case DEP_TRIM:
        for (unsigned i = 0; i < nb; i++)
            ck_assert_int_eq(bfc_ctx_free(ctx, first[i], (bfc_stream_t)a), BFC_OK);
        if (pt->dep == DEP_RELEASE)
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, (bfc_stream_t)a), BFC_OK);
        if (pt->dep == DEP_TRIM)
            ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
        break;
    }

    /* Second set on the taker: each block gets a pattern of its own, written
     * as soon as the taker's queue allows (at once on an idle stream). */
    t0 = now_s();
    for (unsigned i = 0; i < nb; i++) {
        second[i] = bfc_ctx_alloc(ctx, (bfc_stream_t)t, n[i]);
        ck_assert_msg(second[i] != NULL,
                      "%s: alloc(%zu) on the taking stream failed (%s), though the memory "
                      "given up frees within %.0f ms (retry_ms)",
                      pt->name, n[i], bfc_err_name(bfc_last_error()), spin_ns() * 2e-6);
        CUDA_OK(bfc_test_fill(second[i], n[i], 0x400 + i, t));
    }
    waited = now_s() - t0;
    CUDA_OK(cudaDeviceSynchronize());

    for (unsigned i = 0; i < nb; i++) {
        unsigned long long bad = count_bad(second[i], n[i], 0x400 + i);

        ck_assert_msg(bad == 0,
                      "%s: block %u (%zu bytes at %p) has %llu words overwritten by a "
                      "stream that still used its memory: reused too early",
                      pt->name, i, n[i], second[i], bad);
    }
    if (pt->expect_overlap)
        ck_assert_msg(overlaps(first, n, nb, second, n, nb),
                      "%s: the second set got fresh memory: the path was not exercised",
                      pt->name);
    printf("test_gpu_streams: %s: ok (second set %s first-set memory; allocating it took "
           "%.1f ms)\n",
           pt->name, overlaps(first, n, nb, second, n, nb) ? "reuses" : "does not reuse",
           waited * 1e3);

    for (unsigned i = 0; i < nb; i++)
        ck_assert_int_eq(bfc_ctx_free(ctx, second[i], (bfc_stream_t)t), BFC_OK);
    CUDA_OK(cudaDeviceSynchronize());
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_uint_eq(st.bytes_in_use, 0);
    ck_assert_uint_le(st.peak_bytes_reserved, st.bytes_limit);
    if (pt->skip_if_refused) /* an expandable row: the arena mapped its pages */
        ck_assert_msg(st.num_vmm_maps > 0, "%s: no map call: not an expandable arena", pt->name);
    if (pt->expect_unmap)
        ck_assert_msg(st.num_vmm_unmaps > 0,
                      "%s: nothing was unmapped: the taker's pages did not come from A",
                      pt->name);
    if (pt->skip_if_refused)
        printf("test_gpu_streams: %s: %" PRIu64 " map and %" PRIu64 " unmap calls\n", pt->name,
               st.num_vmm_maps, st.num_vmm_unmaps);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
    if (!pt->owner_legacy)
        CUDA_OK(cudaStreamDestroy(a));
    CUDA_OK(cudaStreamDestroy(b));
    CUDA_OK(cudaStreamDestroy(c));
}

START_TEST(test_paths)
{
    run_path(&paths[_i]);
}
END_TEST

/* ------------------------------------------------- special streams */

struct pt_arg {
    bfc_ctx_t *ctx;
    pthread_barrier_t *bar;
    uint32_t tag;
    void *p;
    uint64_t shard_allocs;
    int status;
};

static bool barrier_ok(int e)
{
    return e == 0 || e == PTHREAD_BARRIER_SERIAL_THREAD;
}

/* No Check assertion here: a failed one would unwind the wrong thread.  The
 * thread reports in *x; the main thread asserts. */
static void *per_thread_main(void *arg)
{
    struct pt_arg *x = arg;
    bfc_stats_t s;

    x->p = bfc_ctx_alloc(x->ctx, (bfc_stream_t)cudaStreamPerThread, MiB);
    if (!x->p) {
        x->status = bfc_last_error();
    } else {
        if (bfc_test_fill(x->p, MiB, x->tag, cudaStreamPerThread) != cudaSuccess ||
            cudaStreamSynchronize(cudaStreamPerThread) != cudaSuccess)
            x->status = BFC_EBACKEND;
        if (bfc_ctx_stream_stats(x->ctx, (bfc_stream_t)cudaStreamPerThread, &s) == BFC_OK)
            x->shard_allocs = s.num_allocs;
    }
    /* 1: both blocks are live and written; the main thread counts the
     * shards and reads the blocks.  2: it is done; free on our stream. */
    if (!barrier_ok(pthread_barrier_wait(x->bar)) || !barrier_ok(pthread_barrier_wait(x->bar)))
        x->status = BFC_EBACKEND;
    if (x->p && bfc_ctx_free(x->ctx, x->p, (bfc_stream_t)cudaStreamPerThread) != BFC_OK)
        x->status = BFC_ECORRUPT;
    return NULL;
}

/* cudaStreamPerThread is one handle but a different stream on each
 * thread: two threads get two shards. */
START_TEST(test_per_thread_streams)
{
    bfc_ctx_t *ctx = ctx_from("memory_limit=256M");
    pthread_barrier_t bar;
    pthread_t th[2];
    struct pt_arg x[2];
    unsigned long long bad[2] = {0, 0};
    bfc_stats_t s;
    int sst;

    ck_assert_int_eq(pthread_barrier_init(&bar, NULL, 3), 0);
    for (int i = 0; i < 2; i++) {
        memset(&x[i], 0, sizeof(x[i]));
        x[i].ctx = ctx;
        x[i].bar = &bar;
        x[i].tag = 0x500 + (uint32_t)i;
        ck_assert_int_eq(pthread_create(&th[i], NULL, per_thread_main, &x[i]), 0);
    }
    /* Between the barriers nothing may unwind this thread (the workers
     * would wait forever): read, then assert after the second barrier. */
    ck_assert(barrier_ok(pthread_barrier_wait(&bar)));
    sst = bfc_ctx_stats(ctx, &s);
    for (int i = 0; i < 2; i++)
        if (x[i].p && x[i].status == BFC_OK)
            bad[i] = count_bad_raw(x[i].p, MiB, x[i].tag);
    ck_assert(barrier_ok(pthread_barrier_wait(&bar)));
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    ck_assert_int_eq(sst, BFC_OK);
    ck_assert_uint_eq(s.num_shards, 2);
    ck_assert_uint_eq(s.num_allocs, 2);
    for (int i = 0; i < 2; i++) {
        ck_assert_msg(x[i].status == BFC_OK, "thread %d: %s", i, bfc_err_name(x[i].status));
        ck_assert_uint_eq(x[i].shard_allocs, 1); /* its own shard */
        ck_assert_uint_eq(bad[i], 0);
    }
    ck_assert_ptr_ne(x[0].p, x[1].p);
    ck_assert_int_eq(pthread_barrier_destroy(&bar), 0);
    ck_assert_int_eq(bfc_ctx_stats(ctx, &s), BFC_OK);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
}
END_TEST

/*
 * Memory of another thread's per-thread stream taken by this thread: a
 * thread allocates the tight set on cudaStreamPerThread, queues a spin and a
 * late fill, and frees on it; this thread's stream then needs the limit.
 * The departure fence, armed here, cannot be recorded on the other
 * thread's stream through the shared handle (it would land on this
 * thread's own, idle one): the library records it on the legacy default
 * stream, which waits for the spin.  The second set must keep its data.
 */
struct pt_owner {
    bfc_ctx_t *ctx;
    pthread_barrier_t *bar;
    void *first[MAXB];
    size_t n[MAXB];
    unsigned nb;
    bool exits; /* the thread exits once it has freed, not releasing its stream */
    int status;
};

static void *pt_owner_main(void *arg)
{
    struct pt_owner *o = arg;
    cudaStream_t pt = cudaStreamPerThread;

    for (unsigned i = 0; i < o->nb && o->status == BFC_OK; i++) {
        o->first[i] = bfc_ctx_alloc(o->ctx, (bfc_stream_t)pt, o->n[i]);
        if (!o->first[i] || bfc_test_fill(o->first[i], o->n[i], 0x100 + i, pt) != cudaSuccess)
            o->status = o->first[i] ? BFC_EBACKEND : bfc_last_error();
    }
    if (o->status == BFC_OK && bfc_test_spin(pt, spin_ns()) != cudaSuccess)
        o->status = BFC_EBACKEND;
    for (unsigned i = 0; i < o->nb && o->status == BFC_OK; i++)
        if (bfc_test_fill(o->first[i], o->n[i], 0x200 + i, pt) != cudaSuccess)
            o->status = BFC_EBACKEND;
    for (unsigned i = 0; i < o->nb; i++)
        if (o->first[i] && bfc_ctx_free(o->ctx, o->first[i], (bfc_stream_t)pt) != BFC_OK)
            o->status = BFC_ECORRUPT;
    /* 1: freed, the spin still running; 2: the taker is done (an owner
     * that exits has gone by then). */
    if (!barrier_ok(pthread_barrier_wait(o->bar)) || (!o->exits && !barrier_ok(pthread_barrier_wait(o->bar))))
        o->status = BFC_EBACKEND;
    return NULL;
}

static void per_thread_departure(const char *conf, bool vmm, bool exits)
{
    bfc_ctx_t *ctx;
    pthread_barrier_t bar;
    pthread_t th;
    struct pt_owner o;
    const size_t set[] = {vmm ? 24 * MiB : 16 * MiB, 4 * MiB, MiB};
    void *second[MAXB];
    unsigned long long bad[MAXB];
    int fails = 0;
    cudaStream_t c = new_stream();

    ctx = vmm ? ctx_vmm(conf) : ctx_from(conf);
    if (!ctx) {
        printf("test_gpu_streams: per-thread departure%s (vmm): SKIP: %s\n", exits ? ", owner exited" : "", NOVMM);
        CUDA_OK(cudaStreamDestroy(c));
        return;
    }
    memset(&o, 0, sizeof o);
    o.ctx = ctx;
    o.bar = &bar;
    o.nb = 3;
    o.exits = exits;
    memcpy(o.n, set, sizeof set);
    ck_assert_int_eq(pthread_barrier_init(&bar, NULL, 2), 0);
    ck_assert_int_eq(pthread_create(&th, NULL, pt_owner_main, &o), 0);
    ck_assert(barrier_ok(pthread_barrier_wait(&bar)));
    /* The owner gone, its shard is retired by this thread's first
     * allocation on c (which makes c's shard), its fence on the legacy
     * stream.  Otherwise, until the second barrier nothing may unwind this
     * thread. */
    if (exits)
        ck_assert_int_eq(pthread_join(th, NULL), 0);
    for (unsigned i = 0; i < o.nb; i++) {
        second[i] = o.status == BFC_OK ? bfc_ctx_alloc(ctx, (bfc_stream_t)c, o.n[i]) : NULL;
        if (!second[i] || bfc_test_fill(second[i], o.n[i], 0x400 + i, c) != cudaSuccess)
            fails++;
    }
    (void)cudaDeviceSynchronize();
    for (unsigned i = 0; i < o.nb; i++)
        bad[i] = second[i] ? count_bad_raw(second[i], o.n[i], 0x400 + i) : 0;
    if (!exits) {
        ck_assert(barrier_ok(pthread_barrier_wait(&bar)));
        ck_assert_int_eq(pthread_join(th, NULL), 0);
    }
    ck_assert_msg(o.status == BFC_OK, "owner thread: %s", bfc_err_name(o.status));
    if (exits) {
        bfc_stats_t st;
        ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
        ck_assert_msg(st.num_shards == 1, "%" PRIu64 " live shards: the exited owner's was not retired",
                      st.num_shards);
    }
    ck_assert_msg(fails == 0, "the taking stream could not allocate or fill the second set");
    for (unsigned i = 0; i < o.nb; i++)
        ck_assert_msg(bad[i] == 0,
                      "block %u (%zu bytes) has %llu words overwritten by the other thread's "
                      "per-thread stream: its memory moved before its work finished",
                      i, o.n[i], bad[i]);
    if (!vmm)
        ck_assert_msg(overlaps(o.first, o.n, o.nb, second, o.n, o.nb),
                      "the second set got fresh memory: the path was not exercised");
    for (unsigned i = 0; i < o.nb; i++)
        ck_assert_int_eq(bfc_ctx_free(ctx, second[i], (bfc_stream_t)c), BFC_OK);
    CUDA_OK(cudaDeviceSynchronize());
    ck_assert_int_eq(pthread_barrier_destroy(&bar), 0);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
    CUDA_OK(cudaStreamDestroy(c));
    printf("test_gpu_streams: per-thread departure%s (%s): ok\n", exits ? ", owner exited" : "",
           vmm ? "vmm" : "classic");
}

START_TEST(test_per_thread_departure)
{
    per_thread_departure(TIGHT, false, false);
    per_thread_departure(VTIGHT, true, false);
}
END_TEST

/* The same with an owner thread that exits once it has freed, without
 * releasing its per-thread stream: its shard is retired by another thread,
 * which cannot name the exited thread's stream either. */
START_TEST(test_per_thread_exit_departure)
{
    per_thread_departure(TIGHT, false, true);
    per_thread_departure(VTIGHT, true, true);
}
END_TEST

/* The legacy default stream, as NULL and as cudaStreamLegacy. */
START_TEST(test_legacy_stream)
{
    bfc_ctx_t *ctx = ctx_from("memory_limit=64M");
    void *p, *q, *r;

    p = bfc_ctx_alloc(ctx, NULL, MiB);
    q = bfc_ctx_alloc(ctx, (bfc_stream_t)cudaStreamLegacy, MiB);
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_ne(p, q);
    CUDA_OK(bfc_test_fill(p, MiB, 0x600, NULL));
    CUDA_OK(bfc_test_fill(q, MiB, 0x601, cudaStreamLegacy));
    ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
    r = bfc_ctx_alloc(ctx, NULL, MiB); /* same stream: reusable at once */
    ck_assert_ptr_nonnull(r);
    CUDA_OK(bfc_test_fill(r, MiB, 0x602, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    ck_assert_uint_eq(count_bad(q, MiB, 0x601), 0);
    ck_assert_uint_eq(count_bad(r, MiB, 0x602), 0);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, (bfc_stream_t)cudaStreamLegacy), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, r, NULL), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ------------------------------------------------- leaving granules */

/*
 * Expandable arenas: granules a shard marked to leave while its stream was
 * busy -- the usual case on a GPU: a free finds work queued -- go to
 * another stream's growth once that work is done, instead of the growth
 * mapping beside them while they wait for the owner's next policy check.
 * A frees a 32 MiB block behind a spin (its fill after the spin still
 * writes it); C grows by 24 MiB while the spin runs -- it must map: A's
 * granules are still written --, then by 24 MiB more once A is done,
 * which A's granules cover: the context holds less than before that
 * growth, A unmapped them, and every block holds its own pattern (an
 * early unmap is a fault of A's fill, a sticky error).  Returns whether
 * the spin outlasted C's first growth (else that half showed nothing).
 */
static bool leaving_to_growth(bfc_ctx_t *ctx, uint64_t spin)
{
    cudaStream_t a = new_stream(), c = new_stream();
    cudaEvent_t a_done;
    bfc_stats_t sa, st;
    uint64_t before;
    bool busy;
    void *ak, *ck, *big, *c1, *c2;

    ak = bfc_ctx_alloc(ctx, (bfc_stream_t)a, 256);
    ck = bfc_ctx_alloc(ctx, (bfc_stream_t)c, 256);
    big = bfc_ctx_alloc(ctx, (bfc_stream_t)a, 32 * MiB);
    ck_assert(ak && ck && big);
    CUDA_OK(bfc_test_spin(a, spin));
    CUDA_OK(bfc_test_fill(big, 32 * MiB, 0x700, a));
    CUDA_OK(cudaEventCreateWithFlags(&a_done, cudaEventDisableTiming));
    CUDA_OK(cudaEventRecord(a_done, a));
    ck_assert_int_eq(bfc_ctx_free(ctx, big, (bfc_stream_t)a), BFC_OK);
    c1 = bfc_ctx_alloc(ctx, (bfc_stream_t)c, 24 * MiB);
    ck_assert_ptr_nonnull(c1);
    CUDA_OK(bfc_test_fill(c1, 24 * MiB, 0x701, c));
    busy = cudaEventQuery(a_done) == cudaErrorNotReady;
    if (busy) {
        ck_assert_int_eq(bfc_ctx_stream_stats(ctx, (bfc_stream_t)a, &sa), BFC_OK);
        ck_assert_msg(sa.num_vmm_unmaps == 0, "A's granules were unmapped while its spin ran");
    }
    CUDA_OK(cudaEventSynchronize(a_done));
    CUDA_OK(cudaEventDestroy(a_done));
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    before = st.bytes_reserved;
    c2 = bfc_ctx_alloc(ctx, (bfc_stream_t)c, 24 * MiB);
    ck_assert_ptr_nonnull(c2);
    CUDA_OK(bfc_test_fill(c2, 24 * MiB, 0x702, c));
    CUDA_OK(cudaDeviceSynchronize());
    ck_assert_uint_eq(count_bad(c1, 24 * MiB, 0x701), 0);
    ck_assert_uint_eq(count_bad(c2, 24 * MiB, 0x702), 0);
    ck_assert_int_eq(bfc_ctx_stats(ctx, &st), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, (bfc_stream_t)a, &sa), BFC_OK);
    printf("test_gpu_streams: leaving granules (spin %.0f ms%s): reserved %.1f MiB before C's "
           "second growth, %.1f MiB after; A unmapped %" PRIu64 " time(s)\n",
           spin * 1e-6, busy ? "" : ", ended early", before / (double)MiB,
           st.bytes_reserved / (double)MiB, sa.num_vmm_unmaps);
    ck_assert_msg(sa.num_vmm_unmaps > 0, "A's leaving granules stayed mapped");
    ck_assert_msg(st.bytes_reserved < before,
                  "C's growth mapped beside A's free granules (%" PRIu64 " -> %" PRIu64 ")",
                  before, (uint64_t)st.bytes_reserved);
    ck_assert_int_eq(bfc_ctx_free(ctx, c1, (bfc_stream_t)c), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, c2, (bfc_stream_t)c), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, ck, (bfc_stream_t)c), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, ak, (bfc_stream_t)a), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    CUDA_OK(cudaStreamDestroy(a));
    CUDA_OK(cudaStreamDestroy(c));
    return busy;
}

/* A loaded host can delay C's growth past the spin: then again, with a
 * spin four times as long, three times at most (under ThreadSanitizer on
 * the fake runtime, with make check -j2 beside it, even 800 ms ended
 * first: C's growth maps, and the fake fills, 24 MiB). */
START_TEST(test_leaving_to_growth)
{
    uint64_t spin = spin_ns();

    for (int i = 0; i < 4; i++, spin *= 4) {
        bfc_ctx_t *ctx = ctx_vmm("memory_limit=1G,vmm=on,slack_decay_ms=never");
        bool busy;

        if (!ctx) {
            printf("test_gpu_streams: leaving granules: SKIP: %s\n", NOVMM);
            return;
        }
        busy = leaving_to_growth(ctx, spin);
        bfc_ctx_destroy(ctx);
        if (busy)
            return;
    }
    printf("test_gpu_streams: leaving granules: every spin ended before C's first growth: the "
           "busy half not checked\n");
}
END_TEST

/* -------------------------------------------------------- device errors */

/*
 * In a child process (its context will be broken for good): a trapping
 * kernel gives the context a sticky error; from then on every device call
 * fails, and the library must say BFC_EBACKEND -- not BFC_ENOMEM, not a
 * crash.  Exit 0 when every status is as expected.
 */
static int sticky_child(void)
{
    bfc_config_t cfg, vcfg;
    bfc_ctx_t *ctx = NULL, *ctx2 = NULL, *vctx = NULL;
    cudaStream_t a, b;
    cudaError_t e;
    void *p, *q, *vp;
    int st, vst, fails = 0;

    /* A classic context, and an expandable one where the device has
     * virtual memory management (vmm=auto would pick it silently). */
    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_CUDA;
    cfg.memory_limit = 64 * MiB;
    cfg.vmm = BFC_VMM_OFF;
    vcfg = cfg;
    vcfg.vmm = BFC_VMM_ON;
    if (bfc_ctx_create(&cfg, &ctx) != BFC_OK ||
        cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) != cudaSuccess) {
        printf("sticky child: set-up failed\n");
        return 2;
    }
    vst = bfc_ctx_create(&vcfg, &vctx);
    if (vst != BFC_OK)
        printf("sticky child: no expandable context (%s): classic only\n", bfc_err_name(vst));
    p = bfc_ctx_alloc(ctx, (bfc_stream_t)a, MiB); /* fits the first region */
    vp = vctx ? bfc_ctx_alloc(vctx, (bfc_stream_t)a, MiB) : NULL;
    if (!p || (vctx && !vp)) {
        printf("sticky child: first alloc failed\n");
        return 2;
    }
    e = bfc_test_trap(a);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(a);
    printf("sticky child: after the trap: %s\n", cudaGetErrorName(e));
    if (e == cudaSuccess) {
        printf("sticky child: the trap did not break the context\n");
        return 2;
    }

#define EXPECT(what, got, want)                                                \
    do {                                                                       \
        int g_ = (got);                                                        \
        printf("sticky child: %-44s %s%s\n", what, bfc_err_name(g_),          \
               g_ == (want) ? "" : "   <-- expected " #want);                 \
        fails += g_ != (want);                                                 \
    } while (0)

    q = bfc_ctx_alloc(ctx, (bfc_stream_t)a, 16 * MiB); /* needs a new region */
    EXPECT("alloc needing a new region", q ? BFC_OK : bfc_last_error(), BFC_EBACKEND);
    st = bfc_ctx_free(ctx, p, (bfc_stream_t)b); /* needs an event on b */
    EXPECT("cross-stream free", st, BFC_EBACKEND);
    st = bfc_ctx_free(ctx, p, (bfc_stream_t)a); /* no device call: still fine */
    EXPECT("same-stream free after the failed one", st, BFC_OK);
    EXPECT("context creation", bfc_ctx_create(&cfg, &ctx2), BFC_EBACKEND);
    if (vctx) {
        /* Mapping more pages is not a stream operation: the driver may
         * still grant it in a broken context, and the block is then real
         * memory.  Either way no BFC_ENOMEM, and no crash. */
        q = bfc_ctx_alloc(vctx, (bfc_stream_t)a, 16 * MiB);
        st = q ? BFC_OK : bfc_last_error();
        printf("sticky child: %-44s %s%s\n", "expandable: alloc mapping new pages",
               bfc_err_name(st),
               st == BFC_OK || st == BFC_EBACKEND ? "" : "   <-- expected BFC_OK or BFC_EBACKEND");
        fails += st != BFC_OK && st != BFC_EBACKEND;
        EXPECT("expandable: cross-stream free", bfc_ctx_free(vctx, vp, (bfc_stream_t)b),
               BFC_EBACKEND);
        EXPECT("expandable: same-stream free", bfc_ctx_free(vctx, vp, (bfc_stream_t)a), BFC_OK);
    }
#undef EXPECT
    /* No bfc_ctx_destroy: returning memory to a broken context only fails. */
    return fails ? 1 : 0;
}

/* Runs this program again with arg1 and arg2 (a child process) and asserts
 * that it exits 0, or 77 (nothing to check here) where may_skip. */
static void spawn_child(const char *arg1, const char *arg2, bool may_skip, const char *what)
{
    char *argv[] = {(char *)"test_gpu_streams", (char *)arg1, (char *)arg2, NULL};
    pid_t pid;
    int status = 0, rc;

    fflush(stdout);
    rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ);
    ck_assert_msg(rc == 0, "posix_spawn: %s", strerror(rc));
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) &&
                      (WEXITSTATUS(status) == 0 || (may_skip && WEXITSTATUS(status) == 77)),
                  "%s (status %d): see its lines above", what, status);
}

/*
 * In a child process (a fault would break its context for good): an
 * expandable context destroyed while a kernel queued before the free still
 * writes the block.  Destroy unmaps the pages; unless it waits for the
 * device first, the late write faults.  Exit 0 when the device is still
 * healthy afterwards, 77 when the device has no virtual memory.
 */
static int destroy_child(void)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    cudaStream_t a;
    cudaError_t e;
    void *p;

    if (bfc_test_load() != cudaSuccess)
        return 2;
    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_CUDA;
    cfg.memory_limit = 64 * MiB;
    cfg.vmm = BFC_VMM_ON;
    if (bfc_ctx_create(&cfg, &ctx) != BFC_OK) {
        printf("destroy child: no expandable context: not checked\n");
        return 77;
    }
    if (cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) != cudaSuccess ||
        !(p = bfc_ctx_alloc(ctx, (bfc_stream_t)a, 4 * MiB)))
        return 2;
    if (bfc_test_spin(a, spin_ns()) != cudaSuccess || bfc_test_fill(p, 4 * MiB, 0x500, a) != cudaSuccess)
        return 2;
    if (bfc_ctx_free(ctx, p, (bfc_stream_t)a) != BFC_OK)
        return 2;
    bfc_ctx_destroy(ctx); /* the fill has not run yet */
    e = cudaDeviceSynchronize();
    printf("destroy child: after the destroy, the queued write: %s\n", cudaGetErrorName(e));
    return e == cudaSuccess ? 0 : 1;
}

START_TEST(test_destroy_waits)
{
    spawn_child("--destroy-child", NULL, true,
                "the destroy child failed: an expandable context unmapped pages a queued "
                "kernel still wrote");
}
END_TEST

/*
 * In a child process (an early unmap is a fault that breaks the context
 * for good): a stream released while its work still runs, then destroyed
 * -- as bfc_ctx_stream_release's contract allows --, its blocks freed
 * afterwards on an idle stream C.  The last free makes the retired
 * shard's memory leave while A's spin and late fill still run, so that
 * departure is fenced on A, whose handle is gone: the library either
 * records on it (a driver that keeps a busy stream's object until its
 * work ends) or, refused, waits for the whole device.  C then takes the
 * memory under a limit that leaves it nothing else; every block must hold
 * C's pattern, and the device must be healthy.  vmm selects an expandable
 * arena.  Returns 0 when it holds, 1 when a block was overwritten or the
 * device faulted, 2 on a failed call, 77 when vmm=on is refused; *busy
 * says whether A's work still ran at the frees, *destroy_s how long
 * cudaStreamDestroy took.
 */
static int released_destroyed_once(bool vmm, uint64_t spin, bool *busy, double *destroy_s)
{
    static const size_t n[] = TIGHT_SET;
    enum { NB = sizeof(n) / sizeof(n[0]) };
    const char *spec = vmm ? VTIGHT : TIGHT;
    const char *kind = vmm ? "expandable" : "classic";
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    cudaStream_t a, c;
    void *first[NB], *second[NB];
    cudaEvent_t a_end;
    double t0, t_free, t_alloc;
    cudaError_t e;
    int fails = 0;

    bfc_config_init(&cfg);
    if (bfc_config_parse(&cfg, "backend=cuda") != BFC_OK)
        return 2;
    if (bfc_config_parse(&cfg, spec) != BFC_OK || bfc_ctx_create(&cfg, &ctx) != BFC_OK) {
        printf("released-destroyed child: %s refused: not checked\n", spec);
        return vmm ? 77 : 2;
    }
    if (cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking) != cudaSuccess)
        return 2;
    for (unsigned i = 0; i < NB; i++)
        if (!(first[i] = bfc_ctx_alloc(ctx, (bfc_stream_t)a, n[i])) ||
            bfc_test_fill(first[i], n[i], 0x800 + i, a) != cudaSuccess)
            return 2;
    if (bfc_test_spin(a, spin) != cudaSuccess)
        return 2;
    for (unsigned i = 0; i < NB; i++)
        if (bfc_test_fill(first[i], n[i], 0x900 + i, a) != cudaSuccess)
            return 2;
    if (cudaEventCreateWithFlags(&a_end, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(a_end, a) != cudaSuccess)
        return 2;
    if (bfc_ctx_stream_release(ctx, (bfc_stream_t)a) != BFC_OK)
        return 2;
    t0 = now_s();
    if (cudaStreamDestroy(a) != cudaSuccess) /* A's work runs on */
        return 2;
    *destroy_s = now_s() - t0;
    /* Whether A's work still ran when its memory left: a runtime whose
     * cudaStreamDestroy waits for the stream (compute-sanitizer's does)
     * leaves nothing to guard, and so does a host slower than the spin. */
    *busy = cudaEventQuery(a_end) == cudaErrorNotReady;
    t0 = now_s();
    for (unsigned i = 0; i < NB; i++)
        if (bfc_ctx_free(ctx, first[i], (bfc_stream_t)c) != BFC_OK)
            return 2;
    t_free = now_s() - t0;
    /* What the library's record on the destroyed stream met (the frees
     * above made it): reported, not asserted -- a runtime may refuse it or,
     * while the stream's work runs, accept it. */
    e = cudaEventRecord(a_end, a);
    (void)cudaGetLastError(); /* a refused record leaves the error slot set */
    printf("released-destroyed child (%s): an event record on the destroyed stream: %s\n", kind,
           cudaGetErrorName(e));
    t0 = now_s();
    for (unsigned i = 0; i < NB; i++) {
        if (!(second[i] = bfc_ctx_alloc(ctx, (bfc_stream_t)c, n[i]))) {
            printf("released-destroyed child: alloc(%zu) on C: %s\n", n[i],
                   bfc_err_name(bfc_last_error()));
            return 2;
        }
        if (bfc_test_fill(second[i], n[i], 0xa00 + i, c) != cudaSuccess)
            return 2;
    }
    t_alloc = now_s() - t0;
    e = cudaDeviceSynchronize();
    printf("released-destroyed child (%s): the destroy took %.1f ms, the frees %.1f ms, C's "
           "allocations %.1f ms (spin %.0f ms%s); the device after: %s\n",
           kind, *destroy_s * 1e3, t_free * 1e3, t_alloc * 1e3, spin * 1e-6,
           *busy ? "" : ", ended before the frees", cudaGetErrorName(e));
    if (cudaEventDestroy(a_end) != cudaSuccess)
        return 2;
    if (e != cudaSuccess)
        return 1;
    for (unsigned i = 0; i < NB; i++) {
        unsigned long long bad = count_bad_raw(second[i], n[i], 0xa00 + i);

        if (bad == ULLONG_MAX)
            return 2;
        if (bad) {
            printf("released-destroyed child: block %u (%zu bytes) has %llu words written by "
                   "the destroyed stream's late fill: reused too early\n",
                   i, n[i], bad);
            fails++;
        }
    }
    for (unsigned i = 0; i < NB; i++)
        if (bfc_ctx_free(ctx, second[i], (bfc_stream_t)c) != BFC_OK)
            return 2;
    if (cudaDeviceSynchronize() != cudaSuccess || bfc_ctx_check(ctx) != BFC_OK ||
        cudaStreamDestroy(c) != cudaSuccess)
        return 2;
    bfc_ctx_destroy(ctx);
    return fails ? 1 : 0;
}

/* The case above; when A's spin ended before the frees on a host that was
 * slow to get there (not a destroy that waited for it), again with a spin
 * four times as long, three tries in all. */
static int released_destroyed_child(bool vmm)
{
    uint64_t spin = spin_ns();
    double destroy_s = 0;
    bool busy = false;
    int rc;

    if (bfc_test_load() != cudaSuccess)
        return 2;
    for (int i = 0; i < 3; i++, spin *= 4) {
        rc = released_destroyed_once(vmm, spin, &busy, &destroy_s);
        if (rc != 0 || busy || destroy_s * 2e9 >= (double)spin)
            break;
    }
    if (rc == 0 && !busy)
        printf("released-destroyed child (%s): A's work had ended before the frees%s: not checked\n",
               vmm ? "expandable" : "classic",
               destroy_s * 2e9 >= (double)spin ? " (cudaStreamDestroy waited for it)" : "");
    return rc;
}

START_TEST(test_released_destroyed)
{
    spawn_child("--released-destroyed-child", _i ? "vmm" : "classic", true,
                _i ? "the released, destroyed stream's expandable shard"
                   : "the released, destroyed stream's shard");
}
END_TEST

START_TEST(test_device_errors)
{
    if (getenv("BFC_GPU_NO_TRAP")) {
        printf("test_gpu_streams: device errors: SKIP (BFC_GPU_NO_TRAP is set)\n");
        return;
    }
    spawn_child("--sticky-error-child", NULL, false, "the sticky-error child failed");
}
END_TEST

static int run_suite(void)
{
    Suite *s = suite_create("gpu_streams");
    TCase *ctl = tcase_create("control");
    TCase *tp = tcase_create("paths");
    TCase *sp = tcase_create("streams");
    SRunner *sr;
    int failed;

    tcase_add_test(ctl, test_control_detector);
    tcase_add_loop_test(tp, test_paths, 0, (int)(sizeof(paths) / sizeof(paths[0])));
    tcase_add_test(sp, test_per_thread_streams);
    tcase_add_test(sp, test_legacy_stream);
    tcase_add_test(sp, test_per_thread_departure);
    tcase_add_test(sp, test_per_thread_exit_departure);
    tcase_add_test(sp, test_leaving_to_growth);
    tcase_add_test(sp, test_device_errors);
    tcase_add_test(sp, test_destroy_waits);
    tcase_add_loop_test(sp, test_released_destroyed, 0, 2);
    tcase_set_timeout(tp, 120);
    tcase_set_timeout(sp, 120);
    suite_add_tcase(s, ctl);
    suite_add_tcase(s, tp);
    suite_add_tcase(s, sp);
    sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
#endif /* BFC_HAVE_CUDA && BFC_TEST_KERNELS */

int main(int argc, char **argv)
{
#if !BFC_HAVE_CUDA
    (void)argc;
    (void)argv;
    printf("test_gpu_streams: built without CUDA: skipping the GPU tests\n");
    return 77;
#elif !BFC_TEST_KERNELS
    (void)argc;
    (void)argv;
    printf("test_gpu_streams: built without nvcc (no test kernels): skipping the GPU tests\n");
    return 77;
#else
    int n = 0;
    cudaError_t e;

    if (argc > 1 && strcmp(argv[1], "--sticky-error-child") == 0)
        return sticky_child();
    if (argc > 1 && strcmp(argv[1], "--destroy-child") == 0)
        return destroy_child();
    if (argc > 2 && strcmp(argv[1], "--released-destroyed-child") == 0)
        return released_destroyed_child(strcmp(argv[2], "vmm") == 0);
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("test_gpu_streams: no usable CUDA device (%s): skipping the GPU tests\n",
               e != cudaSuccess ? cudaGetErrorName(e) : "cudaGetDeviceCount found none");
        return 77;
    }
    e = bfc_test_load();
    if (e != cudaSuccess) {
        printf("test_gpu_streams: loading the test kernels failed: %s\n", cudaGetErrorName(e));
        return EXIT_FAILURE;
    }
    return run_suite();
#endif
}
