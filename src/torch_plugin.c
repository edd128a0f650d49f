/*
 * torch_plugin.c -- libshardbfc_torch.so, the allocator PyTorch loads with
 * torch.cuda.memory.CUDAPluggableAllocator (include/shardbfc_torch.h).
 *
 * The plug-in is a thin adapter over the process-wide service (api.c):
 * PyTorch's alloc_fn(size, device, stream) is bfc_stream_alloc(stream,
 * size) and its free_fn(p, size, device, stream) -- PyTorch passes the
 * stream the block was allocated on -- is bfc_stream_free(p, stream), a
 * same-stream free, reusable at once by that stream and by other streams
 * only through the library's fences.  The whole library is linked into
 * this object, compiled a second time with -DBFC_FORCE_META_LIBC
 * (internal.h): its metadata comes from libc, so the object can be
 * dlopen()ed into a Python process that did not start with jemalloc.
 *
 * The device argument.  On the CUDA backend the service picks a device's
 * context from the stream (cudaStreamGetDevice), which for an ordinary
 * stream is the device PyTorch names.  The three handles that are not tied
 * to a device -- the NULL stream, cudaStreamLegacy and cudaStreamPerThread
 * -- mean "the current device", so for them the plug-in makes `device`
 * current around the call (and restores the caller's device), in case
 * PyTorch's current device is not the one it names.  On the SIM backend
 * there is one simulated device and `device` is not used.
 *
 * Errors.  alloc_fn cannot return a status and free_fn returns nothing, so
 * failures are counted (alloc_failures, free_errors; relaxed atomics, pure
 * counters read by shardbfc_torch_stat) and the first failing free is
 * reported once on stderr: a bad free in a framework is a bug worth one
 * line, not one line per tensor.
 *
 * State: the counters above and `on_cuda`, which is computed once under
 * pthread_once from SHARDBFC_CONF and the device count, as api.c decides
 * whether the service runs on CUDA.  Everything else is the service's.
 */
#include "backend.h"

#include <stdio.h>
#include <string.h>

#include <shardbfc_torch.h>

#if BFC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* relaxed: statistics only; nothing is published through them. */
static _Atomic uint64_t alloc_failures;
static _Atomic uint64_t free_errors;
static atomic_bool free_error_reported;

static pthread_once_t backend_once = PTHREAD_ONCE_INIT;
static bool on_cuda; /* written once inside pthread_once, read after it */

static void backend_probe(void)
{
    bfc_config_t cfg;

    on_cuda = false;
    if (bfc__config_from_env(&cfg) != BFC_OK)
        return; /* the service refuses to start; every call reports it */
#if BFC_HAVE_CUDA
    on_cuda = cfg.backend != BFC_BACKEND_SIM && bfc__cuda_device_count() > 0;
#endif
}

static bool service_on_cuda(void)
{
    int e = pthread_once(&backend_once, backend_probe);

    if (e != 0)
        bfc__fatal("pthread_once", e);
    return on_cuda;
}

/*
 * Makes `device` current when the service runs on CUDA and the call's
 * stream (or, for statistics, the call itself: `any` true) resolves its
 * device from the current one: as the backend's own calls do, its primary
 * context pushed over the caller's (bfc__cuda_dev_enter), so that a thread
 * that never chose a device gets no context made on device 0 by the way
 * back.  *saved is for device_leave; -1: nothing to undo.
 */
static int device_enter(int device, bfc_stream_t s, bool any, int *saved)
{
    *saved = -1;
#if BFC_HAVE_CUDA
    /* The common case first: an ordinary stream names its own device. */
    if (!any && s != NULL && s != (bfc_stream_t)cudaStreamLegacy &&
        s != (bfc_stream_t)cudaStreamPerThread)
        return BFC_OK;
    if (device < 0 || !service_on_cuda())
        return BFC_OK;
    return bfc__cuda_dev_enter(device, saved);
#else
    (void)device;
    (void)s;
    (void)any;
    (void)service_on_cuda;
#endif
    return BFC_OK;
}

static void device_leave(int saved)
{
#if BFC_HAVE_CUDA
    if (saved != -1)
        (void)bfc__cuda_dev_leave(saved); /* nothing to report it to; the call itself succeeded */
#else
    (void)saved;
#endif
}

void *shardbfc_torch_alloc(ssize_t size, int device, bfc_stream_t stream)
{
    void *p;
    int saved, st;

    if (size <= 0) {
        /* Size 0 is PyTorch's empty tensor: NULL, not a failure. */
        if (size == 0) {
            bfc__set_last_error(BFC_OK);
            return NULL;
        }
        bfc__set_last_error(BFC_EINVAL);
        atomic_fetch_add_explicit(&alloc_failures, 1, memory_order_relaxed);
        return NULL;
    }
    st = device_enter(device, stream, false, &saved);
    if (BFC__UNLIKELY(st != BFC_OK)) {
        bfc__set_last_error(st);
        atomic_fetch_add_explicit(&alloc_failures, 1, memory_order_relaxed);
        return NULL;
    }
    p = bfc_stream_alloc(stream, (size_t)size);
    if (BFC__UNLIKELY(saved != -1)) {
        st = bfc_last_error(); /* restoring the device must not reset it */
        device_leave(saved);
        bfc__set_last_error(p ? BFC_OK : st);
    }
    if (BFC__UNLIKELY(p == NULL))
        atomic_fetch_add_explicit(&alloc_failures, 1, memory_order_relaxed);
    return p;
}

void shardbfc_torch_free(void *p, ssize_t size, int device, bfc_stream_t stream)
{
    int st;

    (void)size;
    (void)device;
    if (!p)
        return;
    st = bfc_stream_free(p, stream);
    if (BFC__LIKELY(st == BFC_OK))
        return;
    atomic_fetch_add_explicit(&free_errors, 1, memory_order_relaxed);
    /* relaxed: only which caller prints matters, not what it sees. */
    if (!atomic_exchange_explicit(&free_error_reported, true, memory_order_relaxed)) {
        int cs = bfc__nocancel_begin(); /* no call acts on cancellation (mutex.h) */
        fprintf(stderr,
                "libshardbfc_torch: free of %p failed: %s (%s); later failures are only "
                "counted (shardbfc_torch_stat \"free_errors\")\n",
                p, bfc_err_name(st), bfc_strerror(st));
        bfc__nocancel_end(cs);
    }
}

int shardbfc_torch_record_stream(void *p, bfc_stream_t stream)
{
    return bfc_record_stream(p, stream);
}

/* The context serving `device`, made current for the lookup on CUDA. */
static bfc_ctx_t *ctx_for(int device, int *status)
{
    bfc_ctx_t *ctx;
    int saved;
    int st = device_enter(device, NULL, true, &saved);

    if (st != BFC_OK) {
        *status = st;
        return NULL;
    }
    ctx = bfc_default_ctx();
    if (!ctx)
        *status = bfc_last_error();
    device_leave(saved);
    return ctx;
}

int shardbfc_torch_stats(int device, bfc_stats_t *out)
{
    bfc_ctx_t *ctx;
    int st = BFC_OK;

    if (!out)
        return BFC_EINVAL;
    ctx = ctx_for(device, &st);
    return ctx ? bfc_ctx_stats(ctx, out) : st;
}

uint64_t shardbfc_torch_stat(int device, const char *name)
{
    bfc_stats_t s;

    if (!name)
        return UINT64_MAX;
    if (strcmp(name, "alloc_failures") == 0)
        return atomic_load_explicit(&alloc_failures, memory_order_relaxed);
    if (strcmp(name, "free_errors") == 0)
        return atomic_load_explicit(&free_errors, memory_order_relaxed);
#define STAT_KNOWN(f, combine, desc) strcmp(name, #f) == 0 ||
    if (!(BFC_STATS_FIELDS(STAT_KNOWN) false))
        return UINT64_MAX;
#undef STAT_KNOWN
    if (shardbfc_torch_stats(device, &s) != BFC_OK)
        return UINT64_MAX;
#define STAT_GET(f, combine, desc)                                             \
    if (strcmp(name, #f) == 0)                                                 \
        return s.f;
    BFC_STATS_FIELDS(STAT_GET)
#undef STAT_GET
    return UINT64_MAX;
}

int shardbfc_torch_reset_peaks(int device)
{
    int st = BFC_OK;
    bfc_ctx_t *ctx = ctx_for(device, &st);

    return ctx ? bfc_ctx_clear_peaks(ctx) : st;
}

int shardbfc_torch_empty_cache(int device)
{
    int st = BFC_OK;
    bfc_ctx_t *ctx = ctx_for(device, &st);

    return ctx ? bfc_ctx_trim(ctx) : st;
}
