/*
 * kernels.h -- the GPU tests' device code (tests/gpu/kernels.cu, built with
 * nvcc), behind plain C functions so that the tests themselves stay C and
 * link like every other test.
 *
 * Each function queues work on a stream and returns the launch status
 * (cudaGetLastError after the launch); the work's own outcome is read
 * after a synchronisation, as always in CUDA.
 */
#ifndef BFC_TEST_GPU_KERNELS_H
#define BFC_TEST_GPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Keeps `s` busy for about `ns` nanoseconds of wall time (one thread
 * reading the GPU's global timer), so that work queued on `s` after it runs
 * that much later than work queued now on an idle stream. */
cudaError_t bfc_test_spin(cudaStream_t s, uint64_t ns);

/* Writes the pattern of `tag` over the `bytes` bytes at p (a multiple of 4):
 * word i becomes bfc_test_word(tag, i). */
cudaError_t bfc_test_fill(void *p, size_t bytes, uint32_t tag, cudaStream_t s);

/* Adds to *bad (device memory) the number of words at p that do not hold
 * the pattern of `tag`. */
cudaError_t bfc_test_count_bad(const void *p, size_t bytes, uint32_t tag,
                               unsigned long long *bad, cudaStream_t s);

/* A kernel that traps: the context gets a sticky error (cudaErrorLaunchFailure
 * from then on), for the device-error test. */
cudaError_t bfc_test_trap(cudaStream_t s);

/* Loads every kernel but the trap (one launch each, then a device
 * synchronisation): lazy loading must not serialise the first launches. */
cudaError_t bfc_test_load(void);

/* The pattern: distinct per tag and per word.  Host and device code. */
#ifdef __CUDACC__
#define BFC_TEST_HD __host__ __device__
#else
#define BFC_TEST_HD
#endif
static inline BFC_TEST_HD uint32_t bfc_test_word(uint32_t tag, uint64_t i)
{
    return (tag * 0x9e3779b9u) ^ ((uint32_t)i * 0x85ebca6bu) ^ (uint32_t)(i >> 32) ^ 0x5bd1e995u;
}

#ifdef __cplusplus
}
#endif
#endif /* BFC_TEST_GPU_KERNELS_H */
