/*
 * backend_cuda.c -- the device backend over the CUDA runtime (cudart only,
 * never the driver API's -lcuda).  Built when configure finds CUDA.
 *
 * One backend instance serves one device ordinal.  cudart calls that act on
 * "the current device" (cudaMalloc, event creation, the NULL stream,
 * cudaMemGetInfo, cudaHostRegister) run with that device made current and
 * the caller's current device restored afterwards: a server thread that
 * frees memory of GPU 1 while driving GPU 0 must not find its device changed.
 *
 * Errors: every cudart return code is checked.  Out-of-memory reads as
 * BFC_ENOMEM, anything else as BFC_EBACKEND; after a failure the runtime's
 * last-error slot is cleared (cudaGetLastError) so that an application that
 * checks it afterwards is not blamed for our failure.  A missing driver
 * (cudaErrorInsufficientDriver) or no device is "zero devices", which makes
 * opening BFC_ENODEV and AUTO fall back to SIM.
 *
 * Stream ids come from cudaStreamGetId, never from the handle value:
 * cudaStreamPerThread is one handle on every thread but a different stream.
 * Events are created with cudaEventDisableTiming (cheaper record/query).
 *
 * State: the instance is immutable after open; every operation is
 * thread-safe because cudart is.
 */
#include "backend.h"

#if BFC_HAVE_CUDA

#include "meta.h"

#include <cuda_runtime_api.h>
#include <string.h>
#include <time.h>

#define CUDA_POLL_NS 20000L

_Static_assert(sizeof(((struct cudaDeviceProp *)0)->name) >=
                   sizeof(((struct bfc__backend *)0)->name),
               "GPU name copy");

struct cuda_backend {
    struct bfc__backend base; /* first: bfc__backend_t * casts to this */
};

/* Maps a failed cudart call to a status and clears the last-error slot. */
static int cuda_status(cudaError_t err)
{
    if (err == cudaSuccess)
        return BFC_OK;
    (void)cudaGetLastError(); /* clears non-sticky errors; result is err */
    if (err == cudaErrorMemoryAllocation)
        return BFC_ENOMEM;
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice ||
        err == cudaErrorInvalidDevice)
        return BFC_ENODEV;
    return BFC_EBACKEND;
}

/*
 * Makes `dev` current, saving the caller's device in *saved (-1 when no
 * switch was needed).  Paired with dev_leave.
 */
static int dev_enter(int dev, int *saved)
{
    int cur = -1;
    cudaError_t err;

    *saved = -1;
    err = cudaGetDevice(&cur);
    if (err != cudaSuccess)
        return cuda_status(err);
    if (cur == dev)
        return BFC_OK;
    err = cudaSetDevice(dev);
    if (err != cudaSuccess)
        return cuda_status(err);
    *saved = cur;
    return BFC_OK;
}

/* Restores the caller's device; returns the first of `status` and its own. */
static int dev_leave(int saved, int status)
{
    cudaError_t err;

    if (saved < 0)
        return status;
    err = cudaSetDevice(saved);
    if (err != cudaSuccess) {
        int st = cuda_status(err); /* clears the last-error slot too */

        if (status == BFC_OK)
            return st;
    }
    return status;
}

int bfc__cuda_device_count(void)
{
    int n = 0; /* left unwritten on cudaErrorInsufficientDriver / NoDevice */
    cudaError_t err = cudaGetDeviceCount(&n);

    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n > 0 ? n : 0;
}

int bfc__cuda_stream_device(bfc_stream_t s, int *dev)
{
    cudaError_t err;

    if (!dev)
        return BFC_EINVAL;
    if (!s)
        err = cudaGetDevice(dev);
    else
        err = cudaStreamGetDevice(s, dev);
    return cuda_status(err);
}

static int cuda_mem_alloc(bfc__backend_t *be, size_t size, void **out)
{
    void *p = NULL;
    int saved;
    int st;

    if (!out || size == 0)
        return BFC_EINVAL;
    *out = NULL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaMalloc(&p, size));
    st = dev_leave(saved, st);
    if (st != BFC_OK) {
        if (p) /* only if restoring the device failed after a success */
            (void)cudaFree(p);
        return st;
    }
    if (((uintptr_t)p & (BFC__MIN_ALLOC - 1)) != 0) {
        /* cudaMalloc guarantees 256-byte alignment; never hand out less. */
        (void)cudaFree(p);
        return BFC_EBACKEND;
    }
    *out = p;
    return BFC_OK;
}

static int cuda_mem_free(bfc__backend_t *be, void *p, size_t size)
{
    int saved;
    int st;

    (void)size;
    if (!p)
        return BFC_OK;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaFree(p));
    return dev_leave(saved, st);
}

static int cuda_event_create(bfc__backend_t *be, bfc__event_t *out)
{
    cudaEvent_t ev = NULL;
    int saved;
    int st;

    if (!out)
        return BFC_EINVAL;
    *out = NULL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    st = dev_leave(saved, st);
    if (st != BFC_OK)
        return st;
    *out = (bfc__event_t)ev;
    return BFC_OK;
}

static int cuda_event_destroy(bfc__backend_t *be, bfc__event_t ev)
{
    (void)be;
    if (!ev)
        return BFC_OK;
    return cuda_status(cudaEventDestroy((cudaEvent_t)ev));
}

static int cuda_event_record(bfc__backend_t *be, bfc__event_t ev, bfc_stream_t s)
{
    int saved;
    int st;

    if (!ev)
        return BFC_EINVAL;
    /* The NULL stream is the current device's: make ours current. */
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaEventRecord((cudaEvent_t)ev, s));
    return dev_leave(saved, st);
}

static int cuda_event_query(bfc__backend_t *be, bfc__event_t ev)
{
    cudaError_t err;

    (void)be;
    if (!ev)
        return BFC_EINVAL;
    err = cudaEventQuery((cudaEvent_t)ev);
    if (err == cudaErrorNotReady)
        return BFC_EBUSY; /* not an error: nothing to clear */
    return cuda_status(err);
}

static uint64_t now_ns(void)
{
    struct timespec ts;

    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cuda_event_wait(bfc__backend_t *be, bfc__event_t ev, uint32_t timeout_ms)
{
    struct timespec nap = {0, CUDA_POLL_NS};
    uint64_t deadline;
    int st;

    if (!ev)
        return BFC_EINVAL;
    if (timeout_ms == UINT32_MAX)
        return cuda_status(cudaEventSynchronize((cudaEvent_t)ev));
    deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        st = cuda_event_query(be, ev);
        if (st != BFC_EBUSY)
            return st;
        if (now_ns() >= deadline)
            return BFC_EBUSY;
        nanosleep(&nap, NULL); /* EINTR: just poll again */
    }
}

static int cuda_stream_id(bfc__backend_t *be, bfc_stream_t s, uint64_t *id)
{
    unsigned long long sid = 0;
    int saved;
    int st;

    if (!id)
        return BFC_EINVAL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaStreamGetId(s, &sid));
    st = dev_leave(saved, st);
    if (st == BFC_OK)
        *id = (uint64_t)sid;
    return st;
}

static int cuda_stream_sync(bfc__backend_t *be, bfc_stream_t s)
{
    int saved;
    int st;

    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaStreamSynchronize(s));
    return dev_leave(saved, st);
}

static int cuda_mem_info(bfc__backend_t *be, size_t *free_bytes, size_t *total_bytes)
{
    size_t f = 0, t = 0;
    int saved;
    int st;

    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaMemGetInfo(&f, &t));
    st = dev_leave(saved, st);
    if (st != BFC_OK)
        return st;
    if (free_bytes)
        *free_bytes = f;
    if (total_bytes)
        *total_bytes = t;
    return BFC_OK;
}

static int cuda_host_register(bfc__backend_t *be, void *p, size_t n)
{
    int saved;
    int st;

    if (!p || n == 0)
        return BFC_EINVAL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaHostRegister(p, n, cudaHostRegisterDefault));
    return dev_leave(saved, st);
}

static int cuda_host_unregister(bfc__backend_t *be, void *p)
{
    int saved;
    int st;

    if (!p)
        return BFC_EINVAL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaHostUnregister(p));
    return dev_leave(saved, st);
}

static void cuda_close(bfc__backend_t *be)
{
    /* The primary context stays: other users in the process may share it. */
    bfc__meta_free(be, sizeof(struct cuda_backend));
}

static const struct bfc__backend_ops cuda_ops = {
    .mem_alloc = cuda_mem_alloc,
    .mem_free = cuda_mem_free,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_wait = cuda_event_wait,
    .stream_id = cuda_stream_id,
    .stream_sync = cuda_stream_sync,
    .mem_info = cuda_mem_info,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .close = cuda_close,
};

int bfc__backend_cuda_open(const bfc_config_t *cfg, bfc__backend_t **out)
{
    struct cudaDeviceProp prop;
    struct cuda_backend *b;
    size_t free_b = 0, total_b = 0;
    int count, saved, st;

    if (!cfg || !out)
        return BFC_EINVAL;
    *out = NULL;
    /* Not bfc__cuda_device_count, which reads every failure as "no device":
     * opening must tell a missing driver or device (BFC_ENODEV) from a
     * runtime that fails, e.g. a context broken by an earlier kernel fault
     * (BFC_EBACKEND). */
    count = 0;
    st = cuda_status(cudaGetDeviceCount(&count));
    if (st != BFC_OK)
        return st;
    if (cfg->device < 0 || cfg->device >= count)
        return BFC_ENODEV;

    memset(&prop, 0, sizeof(prop));
    st = cuda_status(cudaGetDeviceProperties(&prop, cfg->device));
    if (st != BFC_OK)
        return st;
    /* cudaMemGetInfo also creates the device's primary context. */
    st = dev_enter(cfg->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaMemGetInfo(&free_b, &total_b));
    st = dev_leave(saved, st);
    if (st != BFC_OK)
        return st;

    b = bfc__meta_zalloc(sizeof(*b));
    if (!b)
        return BFC_ENOMEM;
    b->base.ops = &cuda_ops;
    b->base.kind = BFC_BACKEND_CUDA;
    b->base.device = cfg->device;
    b->base.default_limit = free_b;
    b->base.host_accessible = false;
    /* GPU names are short; a longer one is cut to fit name[]. */
    prop.name[sizeof(b->base.name) - 1] = '\0';
    memcpy(b->base.name, prop.name, sizeof(b->base.name));
    *out = &b->base;
    return BFC_OK;
}

#endif /* BFC_HAVE_CUDA */
