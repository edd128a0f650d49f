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
 *   - an error that means "no device" from a call other than the open
 *     (cudaMalloc, cudaStreamGetId) is BFC_EBACKEND, not BFC_ENODEV.
 */
#include "fake_cudart.h"

#include <shardbfc.h>

#include <check.h>
#include <cuda_runtime_api.h>
#include <stdlib.h>
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
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
    bfc_ctx_destroy(ctx);
    ck_assert_int_eq(cudaStreamDestroy(s), cudaSuccess);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("cuda_faults");
    TCase *tc = tcase_create("cuda_faults");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_free_refused);
    tcase_add_test(tc, test_unmap_refused_part_way);
    tcase_add_test(tc, test_departed_release_refused);
    tcase_add_test(tc, test_no_device_error_after_open);
    suite_add_tcase(su, tc);
    SRunner *sr = srunner_create(su);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
