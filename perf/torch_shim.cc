// torch_shim.cc -- PyTorch's CUDA caching allocator behind a C interface,
// for perf/shardbfc-perf's "torch" allocator.
//
// Built only where a libtorch with CUDA exists (`make perf-torch
// TORCH_DIR=<site-packages>/torch`; scripts/gpu-check.sh run does it on the
// GPU machine), as perf/libshardbfc_perf_torch.so, which the harness
// dlopen()s at run time: the harness itself stays C and builds everywhere,
// and without the shim the allocator is listed as skipped with the reason.
//
// The calls are the ones a C++ framework embedding PyTorch's allocator
// makes: c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, stream)
// and raw_delete(p), on one device (0).  PyTorch's allocator serialises
// every call of a device on one mutex; that is part of what is measured.
// Only c10 and c10_cuda are linked (no ATen, no Python).
//
// Every entry point catches C++ exceptions (raw_alloc_with_stream throws
// on out-of-memory) and turns them into NULL / non-zero: nothing unwinds
// into the C caller.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <cstdio>
#include <exception>

namespace alloc = c10::cuda::CUDACachingAllocator;

extern "C" {

// 0 when the allocator is ready on device 0; otherwise non-zero and why.
__attribute__((visibility("default"))) int shardbfc_perf_torch_init(char *why, size_t len)
{
    // PyTorch initialises its allocator when Python starts CUDA; here no one
    // else does, and the harness calls this once, from its main thread.
    static bool done;

    try {
        int n = static_cast<int>(c10::cuda::device_count());
        if (n <= 0) {
            std::snprintf(why, len, "PyTorch sees no CUDA device");
            return 1;
        }
        if (!done)
            alloc::init(n);
        done = true;
        why[0] = '\0';
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(why, len, "PyTorch's allocator failed to start: %s", e.what());
        return 1;
    }
}

__attribute__((visibility("default"))) void *shardbfc_perf_torch_alloc(size_t n, void *stream)
{
    try {
        return alloc::raw_alloc_with_stream(n, static_cast<cudaStream_t>(stream));
    } catch (const std::exception &) {
        return nullptr;
    }
}

__attribute__((visibility("default"))) int shardbfc_perf_torch_free(void *p)
{
    try {
        alloc::raw_delete(p);
        return 0;
    } catch (const std::exception &) {
        return 1;
    }
}

// Gives the cache back to the device and resets the peaks: each
// measurement starts from an empty allocator, as libshardbfc's does from a
// fresh context.
__attribute__((visibility("default"))) int shardbfc_perf_torch_reset(void)
{
    try {
        alloc::emptyCache();
        alloc::resetPeakStats(static_cast<c10::DeviceIndex>(0));
        return 0;
    } catch (const std::exception &) {
        return 1;
    }
}

// Index 0 of every StatArray is the aggregate over the small and large pools.
__attribute__((visibility("default"))) int shardbfc_perf_torch_stats(uint64_t *peak_reserved,
                                                                     uint64_t *in_use)
{
    try {
        auto s = alloc::getDeviceStats(static_cast<c10::DeviceIndex>(0));
        *peak_reserved = static_cast<uint64_t>(s.reserved_bytes[0].peak);
        *in_use = static_cast<uint64_t>(s.allocated_bytes[0].current);
        return 0;
    } catch (const std::exception &) {
        return 1;
    }
}

} // extern "C"
