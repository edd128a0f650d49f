/*
 * kernels.cu -- device code of the GPU tests (see kernels.h).
 *
 * spin: one thread polls %globaltimer (nanoseconds) until the time is up,
 * so the delay is wall time whatever the clocks do.  fill and count_bad
 * are grid-stride loops over 32-bit words; count_bad sums its mismatches
 * per block in a register and adds them with one atomicAdd per thread
 * that found any (no shared memory: nothing for racecheck to report).
 */
#include "kernels.h"

static __device__ __forceinline__ uint64_t global_ns(void)
{
    uint64_t t;

    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __global__ void spin_kernel(uint64_t ns, unsigned long long *sink)
{
    uint64_t t0 = global_ns();
    unsigned long long n = 0;

    while (global_ns() - t0 < ns)
        n++;
    if (sink)
        *sink = n; /* never taken: keeps the loop from being optimised out */
}

static __global__ void fill_kernel(uint32_t *p, size_t words, uint32_t tag)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;

    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
        p[i] = bfc_test_word(tag, i);
}

static __global__ void count_kernel(const uint32_t *p, size_t words, uint32_t tag,
                                    unsigned long long *bad)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long n = 0;

    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
        n += p[i] != bfc_test_word(tag, i);
    if (n)
        atomicAdd(bad, n);
}

static __global__ void trap_kernel(void)
{
    __trap();
}

static unsigned grid_for(size_t words)
{
    size_t blocks = (words + 255) / 256;

    return blocks > 1024 ? 1024u : (blocks ? (unsigned)blocks : 1u);
}

extern "C" cudaError_t bfc_test_spin(cudaStream_t s, uint64_t ns)
{
    spin_kernel<<<1, 1, 0, s>>>(ns, NULL);
    return cudaGetLastError();
}

extern "C" cudaError_t bfc_test_fill(void *p, size_t bytes, uint32_t tag, cudaStream_t s)
{
    size_t words = bytes / 4;

    fill_kernel<<<grid_for(words), 256, 0, s>>>((uint32_t *)p, words, tag);
    return cudaGetLastError();
}

extern "C" cudaError_t bfc_test_count_bad(const void *p, size_t bytes, uint32_t tag,
                                          unsigned long long *bad, cudaStream_t s)
{
    size_t words = bytes / 4;

    count_kernel<<<grid_for(words), 256, 0, s>>>((const uint32_t *)p, words, tag, bad);
    return cudaGetLastError();
}

extern "C" cudaError_t bfc_test_trap(cudaStream_t s)
{
    trap_kernel<<<1, 1, 0, s>>>();
    return cudaGetLastError();
}

/* CUDA loads a kernel at its first launch by default (CUDA_MODULE_LOADING=
 * LAZY), and loading may wait for the device to go idle: the control case's
 * first fill would then queue behind the spin it must overtake.  One launch
 * of each kernel, and a synchronisation, loads them all up front. */
extern "C" cudaError_t bfc_test_load(void)
{
    uint32_t *w = NULL;
    unsigned long long *bad = NULL;
    cudaError_t e = cudaMalloc((void **)&w, 64 * sizeof(*w));

    if (e == cudaSuccess)
        e = cudaMalloc((void **)&bad, sizeof(*bad));
    if (e == cudaSuccess) {
        spin_kernel<<<1, 1>>>(0, NULL);
        fill_kernel<<<1, 64>>>(w, 64, 0);
        count_kernel<<<1, 64>>>(w, 64, 0, bad);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaDeviceSynchronize();
    if (bad)
        cudaFree(bad);
    if (w)
        cudaFree(w);
    return e;
}
