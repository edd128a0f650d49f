/*
 * test_cuda_faults.c -- the CUDA backend when the runtime or the driver
 * refuses a call, on the fake runtime (fake_cudart.c), whose failures can
 * be injected call by call (fake_fail_next).  Runs only there: it calls the
 * fake's controls and is linked with -z now (tests/fakecuda.sh runs it).
 *
 *   - memory the device refuses to take back -- a cudaFree, a cuMemUnmap
 *     part way through a range, the release of a departed reservation --
 *     stays held and counted: bytes_reserved is what the device holds
 *     (cudaMemGetInfo's used bytes), trim says BFC_EBACKEND, the memory
 *     serves allocations again and a later trim returns it;
 *   - an expandable shard at the limit that must unmap its own free
 *     granules to place a block waits for its stream's work on them (a
 *     kernel still running there) and then serves, with no unmap under
 *     that work;
 *   - a granule's handle whose cuMemRelease the driver refuses is released
 *     again later: the allocation is served, and once trim has unmapped
 *     everything the device holds nothing of it; trim releases a kept
 *     handle that nothing else reaches (its map refused too), and says
 *     BFC_EBACKEND while the driver refuses;
 *   - a map that fails part way and whose roll-back the driver refuses
 *     leaves the context serving: the next map over the stranded granule
 *     unmaps it first (before, every later map over it was refused);
 *   - an error that means "no device" from a call other than the open
 *     (cudaMalloc, cudaStreamGetId) is BFC_EBACKEND, not BFC_ENODEV, and
 *     a release whose stream cannot be named is BFC_EBACKEND, not
 *     BFC_EINVAL (the shard stays);
 *   - host memory pinned for device 1 from a thread on device 0 whose
 *     context could not be restored after: the registration stands (the
 *     allocation is served, and trim unregisters it later);
 *   - a context on device 1 serves a thread without touching the thread's
 *     own device: one that never chose a device gets no device 0 context
 *     (memory on GPU 0, on a GPU), and one that chose device 0 keeps it.
 *     The fake has 2 devices here (main sets FAKE_CUDA_DEVICES).  The
 *     PyTorch plug-in (dlopen()ed from .libs/, as test_torch_plugin does;
 *     SHARDBFC_TORCH_PLUGIN names another copy) switches devices the same
 *     way for the NULL stream.
 */
#include "fake_cudart.h"
#include "backend.h" /* white-box: the primary-context table's fork lock */
#include "meta.h"    /* white-box: bfc__meta_bytes, its fault injection */

#include <shardbfc.h>

#include <check.h>
#include <inttypes.h>
#include <dlfcn.h>
#include <pthread.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <string.h>

#define MiB ((size_t)1 << 20)

static bfc_ctx_t *cuda_ctx(const char *spec)
{
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
    bfc_ctx_t *ctx = NULL;
    int st = bfc_ctx_create(&c, &ctx);
    ck_assert_msg(st == BFC_OK, "%s: %s", spec, bfc_err_name(st));
    return ctx;
}

/* Device memory in use, as the device counts it. */
static size_t device_used(void)
{
    size_t f = 0, t = 0;
    ck_assert_int_eq(cudaMemGetInfo(&f, &t), cudaSuccess);
    return t - f;
}

static uint64_t reserved(bfc_ctx_t *ctx)
{
    bfc_stats_t s;
    ck_assert_int_eq(bfc_ctx_stats(ctx, &s), BFC_OK);
    return s.bytes_reserved;
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s;
    ck_assert_int_eq(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    return s;
}

/* Allocates blocks on a stream and frees them; `fn`'s k-th call from
 * then on is refused: trim then says BFC_EBACKEND, and everything the
 * device still holds is counted.  A second round allocates as much
 * again (the refused memory serves it), and a trim without faults gives
 * everything back but `keep`'s. */
static void refused_round_trip(const char *spec, const char *fn, unsigned long k, bool whole_release)
{
    size_t base = device_used();
    bfc_ctx_t *ctx = cuda_ctx(spec);
    cudaStream_t s = new_stream();
    /* A live block keeps an expandable shard from handing its whole
     * reservation over (whole_release: no such block, the release of the
     * departed reservation is what fails). */
    void *keep = whole_release ? NULL : bfc_ctx_alloc(ctx, s, 4096);
    ck_assert(whole_release || keep);
    enum { N = 5 };
    void *v[N];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) {
            v[i] = bfc_ctx_alloc(ctx, s, 8 * MiB);
            ck_assert_msg(v[i] != NULL, "%s round %d alloc %d: %s", fn, round, i, bfc_err_name(bfc_last_error()));
        }
        ck_assert_uint_eq(reserved(ctx), device_used() - base);
        for (int i = 0; i < N; i++)
            ck_assert_int_eq(bfc_ctx_free(ctx, v[i], s), BFC_OK);
        ck_assert_uint_eq(reserved(ctx), device_used() - base);
        if (round == 0) /* from the frees' releases on */
            ck_assert(fake_fail_next(fn, k, 0));
        if (whole_release) {
            /* The reservation departs and, its fence complete, is released
             * at once: the refusal comes here, and the departed
             * reservation stays counted until trim offers it again. */
            ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
            ck_assert_uint_eq(reserved(ctx), device_used() - base);
            if (round == 0)
                ck_assert_uint_gt(reserved(ctx), 0);
        }
        int st = bfc_ctx_trim(ctx);
        if (round == 0 && !whole_release) {
            ck_assert_msg(st == BFC_EBACKEND, "%s refused: trim gave %s", fn, bfc_err_name(st));
            ck_assert_uint_gt(reserved(ctx), 0);
        }
        ck_assert_uint_eq(reserved(ctx), device_used() - base);
        ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    }
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    if (keep)
        ck_assert_int_eq(bfc_ctx_free(ctx, keep, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    bfc_ctx_destroy(ctx);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
    ck_assert_uint_eq(device_used(), base);
}

START_TEST(test_free_refused)
{
    refused_round_trip("backend=cuda,vmm=off,memory_limit=128M,large_alloc=0", "cudaFree", 1, false);
}
END_TEST

/* With a release threshold above what is freed, the frees keep their
 * granules mapped and trim is what unmaps them. */
START_TEST(test_unmap_refused_part_way)
{
    /* The second granule of a run: the first goes, the rest stays. */
    refused_round_trip("backend=cuda,vmm=on,memory_limit=128M,release_threshold=1G", "cuMemUnmap", 2, false);
}
END_TEST

START_TEST(test_departed_release_refused)
{
    /* Nothing live: the released stream's reservation departs with its
     * granules mapped, and its release unmaps them. */
    refused_round_trip("backend=cuda,vmm=on,memory_limit=128M,release_threshold=1G", "cuMemUnmap", 3, true);
}
END_TEST

/* On the driver: a shard whose first allocation found the address space
 * short (two cuMemAddressReserve calls refused) grows within a sixteenth
 * of the limit -- a block of exactly that size is served there --; once it
 * holds nothing, a block larger than that range is served from a new
 * reservation, and the old one is freed. */
START_TEST(test_fallback_range_regrows)
{
    size_t base = device_used();
    bfc_ctx_t *ctx = cuda_ctx("backend=cuda,vmm=on,memory_limit=64M,retry_ms=0,release_threshold=0");
    cudaStream_t s = new_stream();
    unsigned long r0 = fake_calls("cuMemAddressReserve"), f0 = fake_calls("cuMemAddressFree");
    ck_assert(fake_fail_next("cuMemAddressReserve", 1, CUDA_ERROR_OUT_OF_MEMORY));
    ck_assert(fake_fail_next("cuMemAddressReserve", 2, CUDA_ERROR_OUT_OF_MEMORY));
    void *a = bfc_ctx_alloc(ctx, s, MiB);
    ck_assert_ptr_nonnull(a);
    ck_assert_uint_eq(fake_calls("cuMemAddressReserve"), r0 + 3); /* twice the limit, the limit, 4 MiB */
    ck_assert_int_eq(bfc_ctx_free(ctx, a, s), BFC_OK);
    /* A block the range holds exactly is served there: no new reservation. */
    void *w = bfc_ctx_alloc(ctx, s, 4 * MiB);
    ck_assert_ptr_eq(w, a);
    ck_assert_uint_eq(fake_calls("cuMemAddressReserve"), r0 + 3);
    ck_assert_int_eq(bfc_ctx_free(ctx, w, s), BFC_OK);
    void *b = bfc_ctx_alloc(ctx, s, 32 * MiB);
    ck_assert_msg(b != NULL, "32 MiB in a 4 MiB range with nothing live: %s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(fake_calls("cuMemAddressReserve"), r0 + 4);
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    ck_assert_int_eq(bfc_ctx_free(ctx, b, s), BFC_OK);
    ck_assert_int_eq(cudaStreamSynchronize(s), cudaSuccess);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(device_used(), base);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
    /* Every reservation made was freed: the old range, and the new one. */
    ck_assert_uint_eq(fake_calls("cuMemAddressFree"), f0 + 2);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
}
END_TEST

/* An expandable shard at the limit whose free granules lie where its next
 * block does not fit unmaps them to map where it does -- after its own
 * stream's work on them has ended: it waits for that work (the device may
 * still use the memory) rather than fail or unmap under it. */
START_TEST(test_own_release_waits)
{
    bfc_ctx_t *ctx = cuda_ctx("backend=cuda,vmm=on,memory_limit=8M,release_threshold=1G");
    cudaStream_t s = new_stream();
    void *v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = bfc_ctx_alloc(ctx, s, 2 * MiB);
        ck_assert_msg(v[i] != NULL, "alloc %d: %s", i, bfc_err_name(bfc_last_error()));
    }
    unsigned long violations = fake_violations();
    ck_assert_int_eq(fake_enqueue_spin(s, 200 * 1000 * 1000ull), cudaSuccess);
    fake_launch(s, v[1], 2 * MiB);
    fake_launch(s, v[3], 2 * MiB);
    ck_assert_int_eq(bfc_ctx_free(ctx, v[1], s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, v[3], s), BFC_OK);
    ck_assert_uint_eq(reserved(ctx), 8 * MiB);
    /* Two free granules, not adjacent: 4 MiB must be mapped elsewhere. */
    void *big = bfc_ctx_alloc(ctx, s, 4 * MiB);
    ck_assert_msg(big != NULL, "4 MiB: %s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(fake_violations(), violations);
    ck_assert_uint_le(reserved(ctx), 8 * MiB);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, big, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, v[0], s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(ctx, v[2], s), BFC_OK);
    bfc_ctx_destroy(ctx);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
    ck_assert_uint_eq(fake_violations(), violations);
}
END_TEST

/* An expandable context and a stream, with the device's use and the fake's
 * live objects before them: vmm_done checks that both are back. */
struct vmm_fix {
    size_t base;
    FILE *null;
    int alive;
    bfc_ctx_t *ctx;
    cudaStream_t s;
};

static void vmm_open(struct vmm_fix *f)
{
    f->base = device_used();
    f->null = fopen("/dev/null", "w");
    ck_assert_ptr_nonnull(f->null);
    f->alive = fake_report(f->null);
    f->ctx = cuda_ctx("backend=cuda,vmm=on,memory_limit=128M");
    f->s = new_stream();
}

static void vmm_done(struct vmm_fix *f)
{
    ck_assert_int_eq(bfc_ctx_check(f->ctx), BFC_OK);
    bfc_ctx_destroy(f->ctx);
    ck_assert_int_eq(cudaStreamDestroy(f->s), cudaSuccess);
    ck_assert_uint_eq(device_used(), f->base);
    ck_assert_int_eq(fake_report(f->null), f->alive);
    fclose(f->null);
}

/* cuMemRelease refused for a granule's handle just after its map, alone
 * (the granule serves) and with the map itself refused (the handle holds
 * memory no mapping does): the handle is released again at a later call,
 * so once trim has unmapped everything the device holds nothing more of
 * it, where before the granule's memory stayed taken for the process's
 * life. */
static void release_refused(const char *also_fails)
{
    struct vmm_fix f;
    vmm_open(&f);
    bfc_ctx_t *ctx = f.ctx;
    cudaStream_t s = f.s;
    size_t base = f.base;
    unsigned long releases = fake_calls("cuMemRelease");
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    if (also_fails)
        ck_assert(fake_fail_next(also_fails, 1, 0));
    void *p = bfc_ctx_alloc(ctx, s, 4 * MiB);
    if (!also_fails)
        ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_gt(fake_calls("cuMemRelease"), releases);
    if (p) {
        memset(p, 0x5a, 4 * MiB);
        ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    }
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_msg(reserved(ctx) == device_used() - base, "%s: %" PRIu64 " reserved, %zu on the device",
                  also_fails ? also_fails : "cuMemRelease", reserved(ctx), device_used() - base);
    vmm_done(&f);
}

START_TEST(test_release_refused_handle_kept)
{
    release_refused(NULL);
    release_refused("cuMemMap");
}
END_TEST

/* Every release of a 66 MiB growth (33 granules) refused: every handle is
 * kept, whatever their number (a table of 32 once lost the 33rd). */
START_TEST(test_release_refused_many)
{
    struct vmm_fix f;
    vmm_open(&f);
    for (unsigned long k = 1; k <= 33; k++)
        ck_assert(fake_fail_next("cuMemRelease", k, 0));
    void *p = bfc_ctx_alloc(f.ctx, f.s, 66 * MiB);
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    memset(p, 0x5a, 66 * MiB);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_OK);
    ck_assert_uint_eq(reserved(f.ctx), device_used() - f.base);
    vmm_done(&f);
}
END_TEST

/* Leaves one granule's handle kept and mapped nowhere: an allocation whose
 * two tries at a map are both refused, and each try's release of its
 * handle too (the first handle goes at the second try's pass over the kept
 * ones).  The allocation fails; the device holds 2 MiB that no
 * reservation counts. */
static void keep_unmapped_handle(struct vmm_fix *f)
{
    ck_assert(fake_fail_next("cuMemMap", 1, 0));
    ck_assert(fake_fail_next("cuMemMap", 2, 0));
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    ck_assert(fake_fail_next("cuMemRelease", 3, 0));
    ck_assert_ptr_null(bfc_ctx_alloc(f->ctx, f->s, 2 * MiB));
    ck_assert_uint_eq(device_used() - f->base, reserved(f->ctx) + 2 * MiB);
}

/* The host metadata a second context's fixture starts from: the process's
 * first context leaves records behind for the process (its primary
 * context's), so a count of what a context leaves starts after one. */
static size_t meta_after_first_ctx(void)
{
    struct vmm_fix f;
    vmm_open(&f);
    void *p = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    vmm_done(&f);
    return bfc__meta_bytes();
}

/* A kept handle that nothing else reaches: twice a map refused and its
 * handle's release refused too, so that the allocation fails and the
 * device holds a granule that no reservation counts.  Trim gives it back
 * (it has nothing to unmap that would), and says BFC_EBACKEND while the
 * driver still refuses. */
START_TEST(test_trim_releases_kept_handles)
{
    struct vmm_fix f;
    vmm_open(&f);
    bfc_ctx_t *ctx = f.ctx;
    cudaStream_t s = f.s;
    size_t base = f.base;
    void *keep = bfc_ctx_alloc(ctx, s, 2 * MiB);
    ck_assert_ptr_nonnull(keep);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    unsigned long maps = fake_calls("cuMemMap");
    keep_unmapped_handle(&f); /* the second map's handle */
    ck_assert_uint_eq(fake_calls("cuMemMap") - maps, 2);
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_EBACKEND);
    ck_assert_uint_eq(device_used() - base, reserved(ctx) + 2 * MiB);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    ck_assert_int_eq(bfc_ctx_free(ctx, keep, s), BFC_OK);
    vmm_done(&f);
}
END_TEST

/* A kept handle that holds memory no mapping does (its map refused) is
 * released by the next map that passes, without a trim. */
START_TEST(test_map_releases_kept_handles)
{
    struct vmm_fix f;
    vmm_open(&f);
    void *keep = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_ptr_nonnull(keep);
    keep_unmapped_handle(&f); /* one handle kept */
    void *p = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx)); /* released by that map */
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, keep, f.s), BFC_OK);
    vmm_done(&f);
}
END_TEST

/* ... and so does an unmap outside trim: a free whose granules go. */
START_TEST(test_unmap_releases_kept_handles)
{
    struct vmm_fix f;
    vmm_open(&f);
    void *keep = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    void *big = bfc_ctx_alloc(f.ctx, f.s, 32 * MiB);
    ck_assert_ptr_nonnull(keep);
    ck_assert_ptr_nonnull(big);
    keep_unmapped_handle(&f);
    unsigned long unmaps = fake_calls("cuMemUnmap");
    ck_assert_int_eq(bfc_ctx_free(f.ctx, big, f.s), BFC_OK);
    ck_assert_uint_gt(fake_calls("cuMemUnmap"), unmaps);
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx));
    ck_assert_int_eq(bfc_ctx_free(f.ctx, keep, f.s), BFC_OK);
    vmm_done(&f);
}
END_TEST

/* Kept handles are each released again, also when the driver refuses one
 * of them again: three kept (maps refused, and their releases), then a map
 * whose pass refuses the first: the other two go. */
START_TEST(test_kept_handles_released_past_a_refusal)
{
    struct vmm_fix f;
    vmm_open(&f);
    void *keep = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_ptr_nonnull(keep);
    keep_unmapped_handle(&f);
    /* Again, every release refused: the kept one stays, two more join it. */
    unsigned long releases = fake_calls("cuMemRelease");
    ck_assert(fake_fail_next("cuMemMap", 1, 0));
    ck_assert(fake_fail_next("cuMemMap", 2, 0));
    for (unsigned long k = 1; k <= 5; k++)
        ck_assert(fake_fail_next("cuMemRelease", k, 0));
    ck_assert_ptr_null(bfc_ctx_alloc(f.ctx, f.s, 2 * MiB));
    ck_assert_uint_eq(fake_calls("cuMemRelease") - releases, 5);
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx) + 6 * MiB);
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    void *p = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx) + 2 * MiB); /* only the refused one */
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, keep, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_OK);
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx));
    vmm_done(&f);
}
END_TEST

/* A kept handle the driver still refuses at trim goes at the context's
 * destruction: the device holds nothing of it after (and no record of it
 * is left behind). */
START_TEST(test_close_releases_kept_handles)
{
    size_t meta0 = meta_after_first_ctx();
    struct vmm_fix f;
    vmm_open(&f);
    keep_unmapped_handle(&f);
    unsigned long releases = fake_calls("cuMemRelease");
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    ck_assert(fake_fail_next("cuMemRelease", 2, 0));
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_EBACKEND);
    ck_assert_uint_eq(fake_calls("cuMemRelease") - releases, 2); /* no failure left pending */
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx) + 2 * MiB);
    vmm_done(&f); /* the device's use and the fake's live objects as before */
    ck_assert_uint_eq(bfc__meta_bytes(), meta0);
}
END_TEST

/* ... and when the driver refuses it to the end, the context's destruction
 * still frees its record (the device keeps the granule: lost to the
 * process, as the fake reports). */
START_TEST(test_close_frees_refused_handle_records)
{
    size_t meta0 = meta_after_first_ctx();
    struct vmm_fix f;
    vmm_open(&f);
    keep_unmapped_handle(&f);
    for (unsigned long k = 1; k <= 8; k++) /* every release from now on */
        ck_assert(fake_fail_next("cuMemRelease", k, 0));
    unsigned long releases = fake_calls("cuMemRelease");
    bfc_ctx_destroy(f.ctx);
    ck_assert_uint_ge(fake_calls("cuMemRelease") - releases, 1);
    ck_assert_uint_le(fake_calls("cuMemRelease") - releases, 8);
    ck_assert_int_eq(cudaStreamDestroy(f.s), cudaSuccess);
    ck_assert_uint_eq(device_used() - f.base, 2 * MiB);
    ck_assert_uint_eq(bfc__meta_bytes(), meta0);
    fclose(f.null);
}
END_TEST


/* A refused release whose handle cannot be kept (no host metadata for its
 * record): the map fails and is rolled back, and the allocation's next try
 * maps afresh.  The granule is lost to the process (the driver holds it),
 * the one case where the device keeps more than the reservations count,
 * even after the context's destruction. */
/* A trim with no kept handle and nothing to unmap enters no device: no
 * context is asked for, pushed or switched to (a kept handle's pass runs
 * only when there is one). */
START_TEST(test_idle_trim_leaves_device_alone)
{
    static const char *const calls[] = {"cuCtxGetCurrent", "cuCtxPushCurrent", "cudaSetDevice"};
    unsigned long before[3];
    struct vmm_fix f;
    vmm_open(&f);
    void *p = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_OK);
    for (int i = 0; i < 3; i++)
        before[i] = fake_calls(calls[i]);
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_OK);
    for (int i = 0; i < 3; i++)
        ck_assert_msg(fake_calls(calls[i]) == before[i], "%s called", calls[i]);
    vmm_done(&f);
}
END_TEST

START_TEST(test_release_refused_no_record)
{
    struct vmm_fix f;
    vmm_open(&f);
    void *keep = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    ck_assert_ptr_nonnull(keep);
    unsigned long maps = fake_calls("cuMemMap"), unmaps = fake_calls("cuMemUnmap");
    uint64_t failed = bfc__meta_failures();
    ck_assert(fake_fail_next("cuMemRelease", 1, 0));
    bfc__meta_fail_every(1);
    void *p = bfc_ctx_alloc(f.ctx, f.s, 2 * MiB);
    bfc__meta_fail_every(0);
    ck_assert_uint_eq(bfc__meta_failures() - failed, 1); /* the record, alone */
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(fake_calls("cuMemMap") - maps, 2);
    ck_assert_uint_eq(fake_calls("cuMemUnmap") - unmaps, 1);
    ck_assert_uint_eq(device_used() - f.base, reserved(f.ctx) + 2 * MiB);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, p, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(f.ctx, keep, f.s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(f.ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check(f.ctx), BFC_OK);
    bfc_ctx_destroy(f.ctx);
    ck_assert_int_eq(cudaStreamDestroy(f.s), cudaSuccess);
    ck_assert_uint_eq(device_used() - f.base, 2 * MiB);
    fclose(f.null);
}
END_TEST

START_TEST(test_no_device_error_after_open)
{
    bfc_ctx_t *ctx = cuda_ctx("backend=cuda,vmm=off,memory_limit=64M");
    cudaStream_t s = new_stream();
    ck_assert(fake_fail_next("cudaMalloc", 1, cudaErrorInvalidDevice));
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 5000));
    ck_assert_int_eq(bfc_last_error(), BFC_EBACKEND);
    cudaStream_t t = new_stream(); /* no shard yet: its id is asked */
    ck_assert(fake_fail_next("cudaStreamGetId", 1, cudaErrorDevicesUnavailable));
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, t, 5000));
    ck_assert_int_eq(bfc_last_error(), BFC_EBACKEND);
    ck_assert_int_eq(cudaStreamDestroy(t), cudaSuccess);
    void *p = bfc_ctx_alloc(ctx, s, 5000); /* and it serves again */
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    /* A release whose stream the runtime fails to name says so, and the
     * shard stays until a release that works. */
    bfc_stats_t st;
    ck_assert(fake_fail_next("cudaStreamGetId", 1, 0));
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_EBACKEND);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, s, &st), BFC_OK);
    ck_assert_uint_eq(st.num_allocs, 1);
    ck_assert_int_eq(bfc_ctx_stream_release(ctx, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_stream_stats(ctx, s, &st), BFC_EINVAL);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
}
END_TEST

START_TEST(test_map_rollback_refused)
{
    size_t base = device_used();
    bfc_ctx_t *ctx = cuda_ctx("backend=cuda,vmm=on,memory_limit=64M");
    cudaStream_t s = new_stream();
    /* 10 MiB: five granules; the third cuMemMap fails, and the roll-back's
     * first cuMemUnmap is refused: one granule stays mapped. */
    ck_assert(fake_fail_next("cuMemMap", 3, 0));
    ck_assert(fake_fail_next("cuMemUnmap", 1, 0));
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 10 * MiB));
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    /* No more faults: the same request, and a smaller one over the same
     * addresses, are served. */
    void *p = bfc_ctx_alloc(ctx, s, 10 * MiB);
    ck_assert_msg(p != NULL, "after a refused roll-back: %s", bfc_err_name(bfc_last_error()));
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_OK);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    void *q = bfc_ctx_alloc(ctx, s, 1 * MiB);
    ck_assert_ptr_nonnull(q);
    ck_assert_int_eq(bfc_ctx_free(ctx, q, s), BFC_OK);
    /* One trim gives everything back. */
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    ck_assert_uint_eq(reserved(ctx), device_used() - base);
    bfc_ctx_destroy(ctx);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
    ck_assert_uint_eq(device_used(), base);
}
END_TEST

/* The thread's current driver context (NULL: none), through the entry
 * point, as the library reaches the driver. */
static CUcontext current_ctx(void)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q;
    CUcontext c = (CUcontext)1;
    ck_assert_int_eq(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &q),
                     cudaSuccess);
    ck_assert_ptr_nonnull(fn);
    ck_assert_int_eq(((PFN_cuCtxGetCurrent_v4000)fn)(&c), CUDA_SUCCESS);
    return c;
}

/* Two streams of device 1, made by a thread of their own so that the
 * test's thread stays as it was. */
static cudaStream_t g_dev1_streams[2];

static void *make_dev1_streams(void *arg)
{
    (void)arg;
    if (cudaSetDevice(1) != cudaSuccess)
        return NULL;
    for (int i = 0; i < 2; i++)
        if (cudaStreamCreateWithFlags(&g_dev1_streams[i], cudaStreamNonBlocking) != cudaSuccess)
            return NULL;
    return g_dev1_streams;
}

/* Allocates and frees on ctx (device 1) from the calling thread, classic
 * and expandable, on the NULL stream and across two streams (a
 * cross-stream free records an event, the owner's next allocation asks
 * it), and checks the thread's device and context after each. */
static void serve_device1(bfc_ctx_t *ctx, int want_dev, CUcontext want_ctx)
{
    static const size_t sizes[] = {5000, 3 * MiB};
    cudaStream_t a = g_dev1_streams[0], b = g_dev1_streams[1];
    for (int i = 0; i < 2; i++) {
        void *p = bfc_ctx_alloc(ctx, NULL, sizes[i]);
        ck_assert_msg(p != NULL, "%zu bytes on device 1: %s", sizes[i], bfc_err_name(bfc_last_error()));
        ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
        p = bfc_ctx_alloc(ctx, a, sizes[i]);
        ck_assert_ptr_nonnull(p);
        fake_stream_hold(b); /* b busy: the free's fence is an event */
        ck_assert_int_eq(bfc_ctx_free(ctx, p, b), BFC_OK);
        fake_stream_drain(b);
        for (int k = 0; k < 3; k++) { /* a's allocations drain the free */
            void *q = bfc_ctx_alloc(ctx, a, sizes[i]);
            ck_assert_ptr_nonnull(q);
            ck_assert_int_eq(bfc_ctx_free(ctx, q, a), BFC_OK);
        }
        int d = -1;
        ck_assert_int_eq(cudaGetDevice(&d), cudaSuccess);
        ck_assert_int_eq(d, want_dev);
        ck_assert_ptr_eq(current_ctx(), want_ctx);
    }
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
}

START_TEST(test_device_switch_leaves_caller_alone)
{
    if (fake_primary_made(0) || fake_primary_made(1)) {
        /* Only in one process for all cases (CK_FORK=no): fakecuda.sh
         * fails a run that prints this. */
        printf("SKIP test_device_switch_leaves_caller_alone: contexts made by earlier cases (CK_FORK=no)\n");
        return;
    }
    static const char *specs[] = {"backend=cuda,device=1,vmm=off,memory_limit=64M",
                                  "backend=cuda,device=1,vmm=on,memory_limit=64M"};
    pthread_t th;
    void *made = NULL;
    ck_assert_int_eq(pthread_create(&th, NULL, make_dev1_streams, NULL), 0);
    ck_assert_int_eq(pthread_join(th, &made), 0);
    ck_assert_ptr_nonnull(made);
    for (int k = 0; k < 2; k++) {
        bfc_ctx_t *ctx = cuda_ctx(specs[k]);
        ck_assert_msg(!fake_primary_made(0), "%s: creating it made a context on device 0", specs[k]);
        /* A thread that never chose a device: its device stays 0, with
         * no context, and none is made there. */
        serve_device1(ctx, 0, NULL);
        ck_assert_msg(!fake_primary_made(0), "%s: serving it made a context on device 0", specs[k]);
        bfc_ctx_destroy(ctx);
        ck_assert(!fake_primary_made(0));
    }
    /* A thread that chose device 0 keeps it, and its context. */
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    CUcontext mine = current_ctx();
    ck_assert_ptr_nonnull(mine);
    for (int k = 0; k < 2; k++) {
        bfc_ctx_t *ctx = cuda_ctx(specs[k]);
        serve_device1(ctx, 0, mine);
        bfc_ctx_destroy(ctx);
    }
    /* And a thread on device 1 needs no switch at all. */
    ck_assert_int_eq(cudaSetDevice(1), cudaSuccess);
    CUcontext one = current_ctx();
    unsigned long pushes = fake_calls("cuCtxPushCurrent");
    bfc_ctx_t *ctx = cuda_ctx(specs[1]);
    serve_device1(ctx, 1, one);
    bfc_ctx_destroy(ctx);
    ck_assert_uint_eq(fake_calls("cuCtxPushCurrent"), pushes);
}
END_TEST

/* The driver refuses the switch: the call fails, BFC_EBACKEND, and the
 * application's own unread error stays in the runtime's slot (clearing it
 * would hide it from the application's next check). */
START_TEST(test_switch_refused_keeps_app_error)
{
    bfc_ctx_t *ctx = cuda_ctx("backend=cuda,device=1,vmm=off,memory_limit=64M");
    void *huge = NULL;
    ck_assert_int_eq(cudaMalloc(&huge, (size_t)1 << 62), cudaErrorMemoryAllocation);
    ck_assert(fake_fail_next("cuCtxPushCurrent", 1, 0));
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 5000));
    ck_assert_int_eq(bfc_last_error(), BFC_EBACKEND);
    ck_assert_int_eq(cudaPeekAtLastError(), cudaErrorMemoryAllocation);
    (void)cudaGetLastError();
    void *p = bfc_ctx_alloc(ctx, NULL, 5000); /* and it serves again */
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* A fork while another thread holds the primary-context table's lock (one
 * retaining a context): the child finds it free (it would otherwise block
 * for ever on its first device switch instead of failing), and the fork
 * does not wait for the holder (who may be inside the driver, whose own
 * fork handlers run before ours). */
static atomic_int g_release_pctx;

static void *hold_pctx_lock(void *arg)
{
    bfc__cuda_pctx_lock();
    atomic_store((atomic_int *)arg, 1);
    while (!atomic_load(&g_release_pctx))
        sched_yield();
    bfc__cuda_pctx_unlock();
    return NULL;
}

START_TEST(test_fork_frees_pctx_lock)
{
    atomic_int held = 0;
    pthread_t th;
    atomic_store(&g_release_pctx, 0);
    ck_assert_int_eq(pthread_create(&th, NULL, hold_pctx_lock, &held), 0);
    while (!atomic_load(&held))
        sched_yield();
    /* The child says it took the lock through a pipe, not its exit status
     * (a sanitizer's report at the child's exit changes that). */
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork(); /* the holder still holds it: the fork must not wait */
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        alarm(5); /* a lock left held would hang the child */
        bfc__cuda_pctx_lock();
        bfc__cuda_pctx_unlock();
        ssize_t w = write(fds[1], "y", 1);
        _exit(w == 1 ? 0 : 1);
    }
    close(fds[1]);
    char got = 0;
    ssize_t r = read(fds[0], &got, 1);
    close(fds[0]);
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(r == 1 && got == 'y', "the child did not take the lock (status %d)", status);
    atomic_store(&g_release_pctx, 1);
    ck_assert_int_eq(pthread_join(th, NULL), 0);
}
END_TEST

/* The plug-in on device 1 from a thread that never chose a device: its
 * device stays 0 with no context made there. */
START_TEST(test_plugin_device_switch)
{
    if (fake_primary_made(0) || fake_primary_made(1)) {
        printf("SKIP test_plugin_device_switch: contexts made by earlier cases (CK_FORK=no)\n");
        return;
    }
    const char *path = getenv("SHARDBFC_TORCH_PLUGIN");
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "backend=cuda,memory_limit=64M", 1), 0);
    void *h = dlopen(path && *path ? path : ".libs/libshardbfc_torch.so", RTLD_NOW | RTLD_LOCAL);
    ck_assert_msg(h != NULL, "dlopen: %s", dlerror());
    void *(*alloc)(ssize_t, int, void *) = (void *(*)(ssize_t, int, void *))dlsym(h, "shardbfc_torch_alloc");
    void (*release)(void *, ssize_t, int, void *) =
        (void (*)(void *, ssize_t, int, void *))dlsym(h, "shardbfc_torch_free");
    ck_assert(alloc && release);
    for (int i = 0; i < 3; i++) {
        void *p = alloc(5000, 1, NULL);
        ck_assert_ptr_nonnull(p);
        release(p, 5000, 1, NULL);
        int d = -1;
        ck_assert_int_eq(cudaGetDevice(&d), cudaSuccess);
        ck_assert_int_eq(d, 0);
        ck_assert_ptr_null(current_ctx());
        ck_assert_msg(!fake_primary_made(0), "the plug-in made a context on device 0");
    }
    ck_assert(fake_primary_made(1));
}
END_TEST

/* A call that changed the device's state -- cudaMalloc, cudaFree, an
 * event's creation -- and then the caller's context could not be restored
 * (cuCtxPopCurrent refused): the call's outcome stands.  The backend said
 * BFC_EBACKEND for it, so a segment cudaFree had taken back stayed in the
 * pool to be handed out again (and freed twice), and an event it had made
 * was lost.  Device 1's context serves a thread on device 0, so every call
 * pushes and pops; the k-th pop of a round (allocation, a cross-stream free
 * on a held stream, the owner's next allocation, trim) is refused, for
 * every k.  Each allocation and free succeeds (a free that failed for the
 * restore was lost to a caller that cannot retry, as PyTorch's), after
 * each round the pool agrees with the device, and once the context is gone
 * the device holds nothing: no block, no event. */
static void restore_round(bfc_ctx_t *ctx)
{
    cudaStream_t a = g_dev1_streams[0], b = g_dev1_streams[1];
    void *p = bfc_ctx_alloc(ctx, a, 8 * MiB);
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    fake_stream_hold(b); /* the free's fence is an event */
    ck_assert_int_eq(bfc_ctx_free(ctx, p, b), BFC_OK);
    fake_stream_drain(b);
    void *q = bfc_ctx_alloc(ctx, a, 3 * MiB);
    ck_assert_msg(q != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_int_eq(bfc_ctx_free(ctx, q, a), BFC_OK);
    (void)bfc_ctx_trim(ctx);
}

/* Pops the context that a refused cuCtxPopCurrent left on the thread's
 * stack, through the entry point. */
static void pop_left_context(void)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q;
    CUcontext c = NULL;
    ck_assert_int_eq(cudaGetDriverEntryPointByVersion("cuCtxPopCurrent", &fn, 12000, cudaEnableDefault, &q),
                     cudaSuccess);
    ck_assert_ptr_nonnull(fn);
    ck_assert_int_eq(((PFN_cuCtxPopCurrent_v4000)fn)(&c), CUDA_SUCCESS);
}

/* Device 1's memory in use, from a thread on device 0. */
static size_t device1_used(void)
{
    ck_assert_int_eq(cudaSetDevice(1), cudaSuccess);
    size_t used = device_used();
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    return used;
}

/* Every cuCtxPopCurrent of restore_round refused in turn, on a context of
 * `spec` (vmm=on: the granules' maps and unmaps switch devices too). */
static void restore_refused(const char *spec, FILE *null)
{
    int alive = fake_report(null);
    size_t base = device1_used();
    bfc_ctx_t *ctx = cuda_ctx(spec);
    unsigned long pops = fake_calls("cuCtxPopCurrent");
    restore_round(ctx);
    unsigned long n = fake_calls("cuCtxPopCurrent") - pops;
    bfc_ctx_destroy(ctx);
    ck_assert_uint_ge(n, 6);
    for (unsigned long k = 1; k <= n; k++) {
        ctx = cuda_ctx(spec);
        pops = fake_calls("cuCtxPopCurrent");
        ck_assert(fake_fail_next("cuCtxPopCurrent", k, 0));
        restore_round(ctx);
        ck_assert_msg(fake_calls("cuCtxPopCurrent") - pops >= k, "%s: pop %lu of %lu not reached", spec, k, n);
        pop_left_context(); /* the thread's own context again */
        ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
        ck_assert_msg(reserved(ctx) == device1_used() - base,
                      "%s: pop %lu refused: %" PRIu64 " reserved, %zu on the device", spec, k, reserved(ctx),
                      device1_used() - base);
        ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
        ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
        ck_assert_uint_eq(reserved(ctx), device1_used() - base);
        bfc_ctx_destroy(ctx);
        ck_assert_uint_eq(device1_used(), base);
        ck_assert_msg(fake_report(null) == alive, "%s: pop %lu refused: %d objects alive, %d before", spec, k,
                      fake_report(null), alive);
    }
}

START_TEST(test_restore_refused_after_the_call)
{
    pthread_t th;
    void *made = NULL;
    ck_assert_int_eq(pthread_create(&th, NULL, make_dev1_streams, NULL), 0);
    ck_assert_int_eq(pthread_join(th, &made), 0);
    ck_assert_ptr_nonnull(made);
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    FILE *null = fopen("/dev/null", "w");
    ck_assert_ptr_nonnull(null);
    restore_refused("backend=cuda,device=1,vmm=off,memory_limit=64M", null);
    restore_refused("backend=cuda,device=1,vmm=on,memory_limit=64M", null);
    ck_assert_uint_eq(fake_violations(), 0);
    fclose(null);
}
END_TEST

/* host_numa=gpu finds the GPU's CPUs from its PCI numbers, asking the
 * runtime (in a CUDA build, whatever the device backend: SIM here, since
 * no context can be made on a device the runtime lacks).  For a device it
 * does not have (device=3 of one) the thread's own node serves, and the
 * runtime's last-error slot is left clear: an application that checks
 * cudaGetLastError after its own calls must not find ours (hwloc's inline
 * helper left cudaErrorInvalidDevice there). */
START_TEST(test_host_numa_gpu_leaves_no_error)
{
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "backend=sim,host_numa=gpu,device=3", 1), 0);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    void *p = bfc_host_alloc(4096); /* the thread's first: its node chosen */
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_ge(bfc_host_numa_node(p), 0);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
}
END_TEST

/* Host pinned memory on device 1 (SHARDBFC_CONF device=1) from a thread on
 * device 0: every cuCtxPopCurrent of a round that pins a new region
 * (cudaHostRegister), frees it and trims refused in turn.  The pinning
 * stands whatever the restore says: each allocation is served, and after
 * each round every registration went back (the fake counts them among its
 * live objects).  Reported as failed, a registered range was unmapped
 * with its registration left behind. */
static void host_round(FILE *null, int *alive)
{
    void *p = bfc_host_alloc(8 * MiB);
    ck_assert_msg(p != NULL, "%s", bfc_err_name(bfc_last_error()));
    memset(p, 0x5a, 8 * MiB);
    ck_assert_int_eq(bfc_host_free(p), BFC_OK);
    for (int node = 0; node < 64; node++) {
        bfc_ctx_t *h = bfc_host_ctx(node);
        if (h) {
            (void)bfc_ctx_trim(h);
            ck_assert_int_eq(bfc_ctx_check(h), BFC_OK);
        }
    }
    if (*alive < 0)
        *alive = fake_report(null);
}

START_TEST(test_host_register_restore_refused)
{
    if (fake_primary_made(0) || fake_primary_made(1)) {
        printf("SKIP test_host_register_restore_refused: contexts made by earlier cases (CK_FORK=no)\n");
        return;
    }
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "backend=cuda,device=1", 1), 0);
    ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
    ck_assert_int_eq(cudaFree(NULL), cudaSuccess); /* device 0's context current */
    FILE *null = fopen("/dev/null", "w");
    ck_assert_ptr_nonnull(null);
    int alive = -1;
    host_round(null, &alive); /* the host context made, trimmed empty */
    unsigned long pops = fake_calls("cuCtxPopCurrent"), regs = fake_calls("cudaHostRegister");
    host_round(null, &alive);
    unsigned long n = fake_calls("cuCtxPopCurrent") - pops;
    ck_assert_uint_eq(fake_calls("cudaHostRegister") - regs, 1);
    ck_assert_uint_ge(n, 2); /* the registration's and the unregistration's */
    for (unsigned long k = 1; k <= n; k++) {
        pops = fake_calls("cuCtxPopCurrent");
        ck_assert(fake_fail_next("cuCtxPopCurrent", k, 0));
        host_round(null, &alive);
        ck_assert_msg(fake_calls("cuCtxPopCurrent") - pops >= k, "pop %lu of %lu not reached", k, n);
        pop_left_context();
        ck_assert_msg(fake_report(null) == alive, "pop %lu of %lu refused: %d objects alive, %d before", k, n,
                      fake_report(null), alive);
    }
    ck_assert_uint_eq(fake_violations(), 0);
    fclose(null);
}
END_TEST

/* The fake's table bounds the pending failures only: one that has fired
 * leaves its slot, so a long fault-injection run can arm any number in
 * turn (a model fuzzer arms thousands), and a full table of pending ones
 * still refuses the next. */
START_TEST(test_fake_fail_slots_reused)
{
    int n = 0;
    for (int i = 0; i < 200; i++) {
        ck_assert_msg(fake_fail_next("cudaGetDeviceCount", 1, cudaErrorNotReady), "arm %d refused", i);
        ck_assert_int_eq(cudaGetDeviceCount(&n), cudaErrorNotReady);
        ck_assert_int_eq(cudaGetDeviceCount(&n), cudaSuccess);
    }
    int armed = 0;
    while (armed < 1000 && fake_fail_next("cudaGetDeviceCount", 1000 + (unsigned long)armed, cudaErrorNotReady))
        armed++;
    ck_assert_int_eq(armed, 64);
}
END_TEST

int main(void)
{
    /* Two devices, for test_device_switch_leaves_caller_alone (the others
     * use device 0 only); read at the fake's first call. */
    if (setenv("FAKE_CUDA_DEVICES", "2", 0) != 0)
        return EXIT_FAILURE;
    Suite *su = suite_create("cuda_faults");
    TCase *tc = tcase_create("cuda_faults");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_free_refused);
    tcase_add_test(tc, test_unmap_refused_part_way);
    tcase_add_test(tc, test_departed_release_refused);
    tcase_add_test(tc, test_own_release_waits);
    tcase_add_test(tc, test_fallback_range_regrows);
    tcase_add_test(tc, test_fake_fail_slots_reused);
    tcase_add_test(tc, test_release_refused_handle_kept);
    tcase_add_test(tc, test_release_refused_many);
    tcase_add_test(tc, test_trim_releases_kept_handles);
    tcase_add_test(tc, test_map_releases_kept_handles);
    tcase_add_test(tc, test_unmap_releases_kept_handles);
    tcase_add_test(tc, test_kept_handles_released_past_a_refusal);
    tcase_add_test(tc, test_close_releases_kept_handles);
    tcase_add_test(tc, test_close_frees_refused_handle_records);
    tcase_add_test(tc, test_idle_trim_leaves_device_alone);
    tcase_add_test(tc, test_release_refused_no_record);
    tcase_add_test(tc, test_no_device_error_after_open);
    tcase_add_test(tc, test_map_rollback_refused);
    tcase_add_test(tc, test_device_switch_leaves_caller_alone);
    tcase_add_test(tc, test_plugin_device_switch);
    tcase_add_test(tc, test_switch_refused_keeps_app_error);
    tcase_add_test(tc, test_fork_frees_pctx_lock);
    tcase_add_test(tc, test_restore_refused_after_the_call);
    tcase_add_test(tc, test_host_register_restore_refused);
    tcase_add_test(tc, test_host_numa_gpu_leaves_no_error);
    suite_add_tcase(su, tc);
    SRunner *sr = srunner_create(su);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
