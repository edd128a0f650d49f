/*
 * kernels_host.c -- tests/gpu/kernels.h on the fake runtime (fake_cudart.c):
 * the GPU tests' kernels queued on the fake's streams and run on the host,
 * in stream order, by its executor.  Linked instead of tests/gpu/kernels.cu
 * into tests/fakecuda/test_gpu_streams_host, which then runs
 * tests/test_gpu_streams.c unchanged.  The fake_* calls exist in the fake
 * only: on the real runtime the program does not start.
 */
#include "gpu/kernels.h"

#include "fake_cudart.h"

cudaError_t bfc_test_spin(cudaStream_t s, uint64_t ns)
{
    return fake_enqueue_spin(s, ns);
}

cudaError_t bfc_test_fill(void *p, size_t bytes, uint32_t tag, cudaStream_t s)
{
    return fake_enqueue_fill(s, p, bytes, tag);
}

cudaError_t bfc_test_count_bad(const void *p, size_t bytes, uint32_t tag, unsigned long long *bad,
                               cudaStream_t s)
{
    return fake_enqueue_count(s, p, bytes, tag, bad);
}

cudaError_t bfc_test_trap(cudaStream_t s)
{
    return fake_trap(s);
}

/* Nothing to load: the kernels are host code. */
cudaError_t bfc_test_load(void)
{
    return cudaSuccess;
}
