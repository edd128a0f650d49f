/*
 * backend_cuda.c -- the device backend over the CUDA runtime (cudart only,
 * never the driver API's -lcuda).  Built when configure finds CUDA.
 *
 * One backend instance serves one device ordinal.  cudart calls that act on
 * "the current device" (cudaMalloc, event creation, the NULL stream,
 * cudaMemGetInfo, cudaHostRegister) run with that device's primary context
 * pushed over the caller's and popped afterwards ("Device switches"): a
 * server thread that frees memory of GPU 1 while driving GPU 0 must not
 * find its device or context changed, nor a context made on a GPU it never
 * used.
 *
 * Errors: every cudart return code is checked.  Out-of-memory reads as
 * BFC_ENOMEM, anything else as BFC_EBACKEND; after a failure the runtime's
 * last-error slot is cleared (cudaGetLastError) so that an application that
 * checks it afterwards is not blamed for our failure (nor for an event
 * query's cudaErrorNotReady).  A missing driver (cudaErrorInsufficientDriver),
 * the stub driver, no device and the like (no_device_error) are "zero
 * devices", which makes opening BFC_ENODEV and AUTO fall back to SIM.
 *
 * Stream ids come from cudaStreamGetId, never from the handle value:
 * cudaStreamPerThread is one handle on every thread but a different stream.
 * Events are created with cudaEventDisableTiming (cheaper record/query).
 *
 * Virtual memory: the driver's API (cuMemAddressReserve, cuMemCreate,
 * cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree,
 * cuMemGetAllocationGranularity), reached through
 * cudaGetDriverEntryPointByVersion, so the library still links cudart only:
 * <cuda.h> and <cudaTypedefs.h> give types, never symbols.  The entry points
 * are resolved once per process; without a driver they cannot be, and the
 * backend (which then cannot even open) has vmm_granule 0.  With a device,
 * vmm_granule is the driver's recommended granularity for pinned memory on
 * it when it reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
 * else 0 and the allocator keeps cudaMalloc regions.
 *
 * The constraint that shapes va_map: cuMemUnmap unmaps whole mappings only,
 * never a sub-range of one, while the allocator must be free to give back
 * any granule-aligned sub-range.  So every granule is its own physical
 * allocation: cuMemCreate of one granule, cuMemMap at its address, then
 * cuMemRelease of the handle at once -- the mapping keeps the memory alive,
 * and unmapping the granule then frees it (no handle table to keep; only
 * the few handles whose release the driver refused are kept, to be
 * released again at the next call, else their memory would outlive every
 * unmap).  One
 * cuMemSetAccess (read-write for this backend's device only, not its peers)
 * then covers the whole range just mapped.  A failure at any step unmaps
 * what the call had mapped: a failed va_map leaves nothing mapped.  Each
 * driver call costs microseconds to tens of microseconds, cuMemUnmap may
 * synchronise with the device, and a range costs a call per granule: the
 * allocator must keep va_* calls off its common path.
 *
 * Driver calls need a context current on the calling thread; the VMM calls
 * have the device's primary context current as every call here does (with
 * cudaSetDevice where it could not be retained, when the thread has none),
 * and leave the caller's as it was.  The book of reservations and mapped granules (backend_vmm.c)
 * checks every range before the driver sees it, and records what a failed
 * unmap left mapped, so that va_release can still free it.
 *
 * State: the instance is immutable after open, but for the book (under its
 * lock, taken by va_* calls only); every operation is thread-safe because
 * cudart and the driver are.
 */
#include "backend.h"

#if BFC_HAVE_CUDA

#include "meta.h"

#include <cuda.h>         /* driver types only: libcuda is never linked */
#include <cudaTypedefs.h> /* the PFN_ type of each driver entry point */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#define CUDA_POLL_NS 20000L

_Static_assert(sizeof(((struct cudaDeviceProp *)0)->name) >=
                   sizeof(((struct bfc__backend *)0)->name),
               "GPU name copy");

/* A handle whose cuMemRelease the driver refused (see va_map). */
struct cuda_stray {
    CUmemGenericAllocationHandle h;
    struct cuda_stray *next;
};

struct cuda_backend {
    struct bfc__backend base; /* first: bfc__backend_t * casts to this */
    /* Virtual memory (base.vmm_granule != 0 only). */
    CUmemAllocationProp prop; /* pinned memory on this device */
    CUmemAccessDesc access;   /* read-write for this device */
    bfc__vmm_book_t book;
    /* Handles whose cuMemRelease the driver refused (see va_map), under
     * the book's lock: released again by va_settle (trim), at close, and
     * by each va_map, va_unmap and va_release that reaches the driver. */
    struct cuda_stray *strays;
};

/*
 * The driver entry points, resolved once (drv_resolve).  The version asked
 * for pins each function's ABI: the pointer returned is the function as it
 * was in CUDA 12.0, which for all of these is the version their PFN_ type
 * names (none changed between its introduction and 12.0), whatever later
 * variants a newer driver adds.  A CUDA 12 or 13 runtime (configure takes
 * nothing older) runs only on a driver of at least its major version, so
 * 12.0 is never above the driver's version (which would be
 * cudaErrorInvalidValue).
 */
#define CUDA_DRV_ABI 12000

static struct {
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
    PFN_cuCtxGetCurrent_v4000 ctx_get_current;
    /* Device switches (dev_enter): resolved apart from the VMM calls. */
    PFN_cuCtxPushCurrent_v4000 ctx_push;
    PFN_cuCtxPopCurrent_v4000 ctx_pop;
    PFN_cuDevicePrimaryCtxRetain_v7000 primary_retain;
    bool ctx_ok; /* device_get and the three above resolved */
    PFN_cuMemGetAllocationGranularity_v10020 get_granularity;
    PFN_cuMemAddressReserve_v10020 address_reserve;
    PFN_cuMemAddressFree_v10020 address_free;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
    bool ok; /* every entry point above resolved */
} g_drv;
static pthread_once_t g_drv_once = PTHREAD_ONCE_INIT;

/*
 * The errors that mean "no usable device" (BFC_ENODEV), not a runtime that
 * fails: no driver or one too old (cudaErrorInsufficientDriver), the
 * toolkit's stub libcuda found before the real one (cudaErrorStubLibrary:
 * containers that put lib64/stubs on the library path), a driver whose
 * kernel module does not match it or that cannot run this runtime on the
 * device (SystemDriverMismatch, CompatNotSupportedOnDevice), a system not
 * ready (SystemNotReady: NVSwitch systems before the fabric manager is up),
 * a runtime that could not initialise (InitializationError, also what a
 * forked child of a CUDA process gets), no device, a bad ordinal, or a
 * device taken by another process in exclusive mode (DevicesUnavailable).
 * bfc__cuda_device_count reads every failure as zero devices, so AUTO falls
 * back to SIM where the count fails; asking for CUDA says BFC_ENODEV in the
 * same cases, and where the count succeeds but the device cannot be used
 * (DevicesUnavailable, from cudaSetDevice) AUTO says BFC_ENODEV too.
 */
static bool no_device_error(cudaError_t err)
{
    switch (err) {
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorSystemNotReady:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
        return true;
    default:
        return false;
    }
}

/*
 * Maps a failed cudart call to a status and clears the last-error slot.
 * Once a backend is open its device exists, so a "no device" error from a
 * later call is a runtime failure like any other (BFC_EBACKEND): the
 * callers' contracts (an allocation fails with BFC_ENOMEM or
 * BFC_EBACKEND) know no BFC_ENODEV.
 */
/* What dev_enter_err returns for a refused driver call: no runtime error,
 * so nothing of ours in the last-error slot, which may hold the
 * application's own unread error (cuda_status must not clear it). */
#define CUDA_DRV_REFUSED ((cudaError_t)-1)

static int cuda_status(cudaError_t err)
{
    if (err == cudaSuccess)
        return BFC_OK;
    if (err == CUDA_DRV_REFUSED)
        return BFC_EBACKEND;
    (void)cudaGetLastError(); /* clears non-sticky errors; result is err */
    if (err == cudaErrorMemoryAllocation)
        return BFC_ENOMEM;
    return BFC_EBACKEND;
}

/* cuda_status for the calls that find or open a device: there the "no
 * usable device" errors say BFC_ENODEV. */
static int device_status(cudaError_t err)
{
    int st = cuda_status(err);

    return st == BFC_EBACKEND && no_device_error(err) ? BFC_ENODEV : st;
}

/*
 * Device switches.  A call for device d on a thread whose current context
 * is not d's primary context pushes d's primary context over it (the
 * driver's cuCtxPushCurrent: the runtime's calls use the context current
 * on the thread) and pops it afterwards, so the caller finds exactly the
 * context, and the runtime device, it had: also a thread that never chose
 * a device, whose "current device" 0 has no context yet.  Switching with
 * cudaSetDevice and back, as before, made that thread's device 0 primary
 * context (memory on GPU 0 for every thread that only ever served GPU 1),
 * failed the call where GPU 0 refuses the process (exclusive mode), and
 * replaced a caller's own context (cuCtxCreate) by a primary one.
 * cudaSetDevice remains for a device whose primary context the backend
 * could not retain (no driver entry points), and at the first open of a
 * device when the retain failed.
 *
 * g_pctx: each device's primary context, retained once per process at the
 * backend's first open on it (primary_ctx_retain) and never released, as
 * the runtime keeps a primary context it initialised until
 * cudaDeviceReset.  Written once under g_pctx_lock; read without it.
 */
#define CUDA_MAX_DEV 64
#define SAVED_PUSHED (-2) /* dev_enter pushed a context for dev_leave to pop */
static _Atomic(CUcontext) g_pctx[CUDA_MAX_DEV];
/* Taken only at a backend's open and a plug-in's first switch to a device,
 * never on an allocation's path; made free in a fork child
 * (bfc__cuda_fork_child). */
static bfc__mutex_t g_pctx_lock = BFC__MUTEX_INIT(BFC__RANK_CUDA_PCTX, "the CUDA primary-context table");

/*
 * Makes `dev` current, saving in *saved what dev_leave needs: -1 when no
 * switch was needed, SAVED_PUSHED when dev's primary context was pushed,
 * else the caller's runtime device.  Paired with dev_leave.  Returns the
 * runtime's error (not yet cleared: map it with cuda_status or
 * device_status); a refused driver call reads CUDA_DRV_REFUSED.
 */
static cudaError_t dev_enter_err(int dev, int *saved)
{
    CUcontext pc = dev >= 0 && dev < CUDA_MAX_DEV
                       ? atomic_load_explicit(&g_pctx[dev], memory_order_acquire)
                       : NULL;
    int cur = -1;
    cudaError_t err;

    *saved = -1;
    if (pc) {
        CUcontext now = NULL;

        if (g_drv.ctx_get_current(&now) != CUDA_SUCCESS)
            return CUDA_DRV_REFUSED;
        if (now == pc)
            return cudaSuccess;
        if (g_drv.ctx_push(pc) != CUDA_SUCCESS)
            return CUDA_DRV_REFUSED;
        *saved = SAVED_PUSHED;
        return cudaSuccess;
    }
    err = cudaGetDevice(&cur);
    if (err != cudaSuccess || cur == dev)
        return err;
    err = cudaSetDevice(dev);
    if (err == cudaSuccess)
        *saved = cur;
    return err;
}

static int dev_enter(int dev, int *saved)
{
    return cuda_status(dev_enter_err(dev, saved));
}

/* Restores the caller's context or device; returns the first of `status`
 * and its own.  For calls that ask or wait (a query, a record, a
 * synchronisation): a failure to restore then reads as the call's, which
 * fences more, never less (a query as busy, a record as not made).  Calls
 * that change the device's state use done_leave. */
static int dev_leave(int saved, int status)
{
    cudaError_t err;

    if (saved == SAVED_PUSHED) {
        CUcontext popped = NULL;

        if (g_drv.ctx_pop(&popped) != CUDA_SUCCESS && status == BFC_OK)
            return BFC_EBACKEND;
        return status;
    }
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

/*
 * Restores the caller's context or device after a call that changed the
 * device's state -- memory allocated or freed, a range registered or
 * unregistered, an event made or destroyed, a reservation or mapping made
 * or undone -- or whose answer stands (a stream's id), and returns that
 * call's own status.  Unlike dev_leave, a failure to
 * restore does not turn the call's outcome into an error: what it did is
 * done, and reporting a failure would make the caller believe otherwise (a
 * segment the device took back kept in the pool and handed out again, a
 * registered range unmapped, an event or a mapping leaked).  The caller's
 * thread is then left on the wrong device whatever is reported.  The
 * failure is still checked, and cleared from the runtime's last-error slot.
 */
static int done_leave(int saved, int status)
{
    (void)dev_leave(saved, BFC_OK);
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
    return device_status(err);
}

int bfc__cuda_device_pci(int dev, int *domain, int *bus, int *slot)
{
    struct cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, dev);

    if (err != cudaSuccess) {
        (void)device_status(err); /* clears the slot */
        return BFC_ENODEV;
    }
    *domain = prop.pciDomainID;
    *bus = prop.pciBusID;
    *slot = prop.pciDeviceID;
    return BFC_OK;
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
    if (st == BFC_OK && ((uintptr_t)p & (BFC__MIN_ALLOC - 1)) != 0) {
        /* cudaMalloc guarantees 256-byte alignment; never hand out less.
         * Given back on the device it came from (entered), and its own
         * failure cleared from the last-error slot. */
        (void)cuda_status(cudaFree(p));
        st = BFC_EBACKEND;
    }
    st = done_leave(saved, st);
    if (st == BFC_OK)
        *out = p;
    return st;
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
    return done_leave(saved, st);
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
    st = done_leave(saved, st);
    if (st != BFC_OK)
        return st;
    *out = (bfc__event_t)ev;
    return BFC_OK;
}

/* Event calls need no current device, but a runtime call on a thread
 * with no context may initialise one for the thread's device (0 if it
 * never chose one): they too run with the event's device entered, which
 * costs one cuCtxGetCurrent where that device is already current. */
static int cuda_event_destroy(bfc__backend_t *be, bfc__event_t ev)
{
    int saved;
    int st;

    if (!ev)
        return BFC_OK;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaEventDestroy((cudaEvent_t)ev));
    return done_leave(saved, st);
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
    int saved;
    int st;

    if (!ev)
        return BFC_EINVAL;
    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    err = cudaEventQuery((cudaEvent_t)ev);
    st = dev_leave(saved, BFC_OK);
    if (st != BFC_OK && err != cudaSuccess && err != cudaErrorNotReady)
        st = BFC_OK; /* the query's own failure comes first, below */
    if (st != BFC_OK)
        return st;
    if (err == cudaErrorNotReady) {
        /* Not a failure.  Runtimes that keep it as the last error would
         * make an application that checks cudaGetLastError after its next
         * launch blame that launch for our query (PyTorch's event query
         * clears it for that reason).  Cleared only when it is what the
         * slot holds: an error of the application's own, still unread,
         * stays for it to read. */
        if (cudaPeekAtLastError() == cudaErrorNotReady)
            (void)cudaGetLastError();
        return BFC_EBUSY;
    }
    return cuda_status(err);
}

static int cuda_event_wait(bfc__backend_t *be, bfc__event_t ev, uint32_t timeout_ms)
{
    struct timespec nap = {0, CUDA_POLL_NS};
    uint64_t deadline;
    int st;

    if (!ev)
        return BFC_EINVAL;
    if (timeout_ms == UINT32_MAX) {
        int saved;

        st = dev_enter(be->device, &saved);
        if (st != BFC_OK)
            return st;
        return dev_leave(saved, cuda_status(cudaEventSynchronize((cudaEvent_t)ev)));
    }
    deadline = bfc__deadline_in((uint64_t)timeout_ms * 1000000ull);
    for (;;) {
        st = cuda_event_query(be, ev);
        if (st != BFC_EBUSY)
            return st;
        if (bfc__deadline_passed(deadline))
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
    st = done_leave(saved, st); /* the id stands: a free must not fail for the restore */
    if (st == BFC_OK)
        *id = (uint64_t)sid;
    return st;
}

/*
 * The per-thread default stream named from another thread (backend.h): the
 * legacy default stream, which waits for the owner's earlier work as for
 * every blocking stream's.  The calling thread's own per-thread stream id
 * (on this device) tells the two apart; when even that fails, the legacy
 * stream too (it fences more, never less).
 */
static bfc_stream_t cuda_stream_for(bfc__backend_t *be, bfc_stream_t s, uint64_t sid)
{
    uint64_t mine;

    if (s != BFC__STREAM_PER_THREAD)
        return s;
    if (cuda_stream_id(be, s, &mine) == BFC_OK && mine == sid)
        return s;
    return (bfc_stream_t)cudaStreamLegacy;
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

static int cuda_device_sync(bfc__backend_t *be)
{
    int saved;
    int st;

    st = dev_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cuda_status(cudaDeviceSynchronize());
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
    return done_leave(saved, st);
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
    return done_leave(saved, st);
}

/* ------------------------------------------------------ virtual memory */

static inline struct cuda_backend *cuda_of(bfc__backend_t *be)
{
    return (struct cuda_backend *)be;
}

/* One entry point, or NULL when the runtime or the driver cannot give it. */
static void *drv_sym(const char *name)
{
#if CUDART_VERSION >= 12050
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    void *fn = NULL;
    cudaError_t err;

    err = cudaGetDriverEntryPointByVersion(name, &fn, CUDA_DRV_ABI, cudaEnableDefault, &q);
    if (err != cudaSuccess) {
        (void)cuda_status(err); /* clears the last-error slot: no driver */
        return NULL;
    }
    return q == cudaDriverEntryPointSuccess ? fn : NULL;
#else
    /* Runtimes before 12.5 lack the versioned query; without a pinned ABI
     * the entry points are not worth the risk: no virtual memory. */
    (void)name;
    return NULL;
#endif
}

/* pthread_once routine: fills g_drv, ok only when every entry point came.
 * (A data pointer converted to a function pointer, as POSIX dlsym's.) */
static void drv_resolve(void)
{
    bool ok = true;

#define DRV_SYM(field, name)                                \
    do {                                                    \
        void *fn_ = drv_sym(name);                          \
        g_drv.field = (__typeof__(g_drv.field))fn_;         \
        ok = ok && fn_ != NULL;                             \
    } while (0)
    DRV_SYM(device_get, "cuDeviceGet");
    DRV_SYM(device_get_attribute, "cuDeviceGetAttribute");
    DRV_SYM(ctx_get_current, "cuCtxGetCurrent");
    DRV_SYM(get_granularity, "cuMemGetAllocationGranularity");
    DRV_SYM(address_reserve, "cuMemAddressReserve");
    DRV_SYM(address_free, "cuMemAddressFree");
    DRV_SYM(create, "cuMemCreate");
    DRV_SYM(release, "cuMemRelease");
    DRV_SYM(map, "cuMemMap");
    DRV_SYM(unmap, "cuMemUnmap");
    DRV_SYM(set_access, "cuMemSetAccess");
    g_drv.ok = ok;
    ok = g_drv.device_get != NULL;
    DRV_SYM(ctx_push, "cuCtxPushCurrent");
    DRV_SYM(ctx_pop, "cuCtxPopCurrent");
    DRV_SYM(primary_retain, "cuDevicePrimaryCtxRetain");
    g_drv.ctx_ok = ok && g_drv.ctx_get_current != NULL;
#undef DRV_SYM
}

/* Retains `device`'s primary context into g_pctx, once per process (see
 * "Device switches"); where the driver cannot, dev_enter keeps switching
 * with cudaSetDevice. */
static void primary_ctx_retain(int device)
{
    CUdevice d = 0;
    CUcontext c = NULL;

    if (device < 0 || device >= CUDA_MAX_DEV || pthread_once(&g_drv_once, drv_resolve) != 0 || !g_drv.ctx_ok)
        return;
    bfc__lock(&g_pctx_lock);
    if (!atomic_load_explicit(&g_pctx[device], memory_order_relaxed) &&
        g_drv.device_get(&d, device) == CUDA_SUCCESS && g_drv.primary_retain(&c, d) == CUDA_SUCCESS && c)
        atomic_store_explicit(&g_pctx[device], c, memory_order_release);
    bfc__unlock(&g_pctx_lock);
}

/* For the plug-in, which switches before any backend of the device may
 * exist: the primary context is retained here first (a device the driver
 * does not know is not, and cudaSetDevice then says BFC_ENODEV). */
int bfc__cuda_dev_enter(int dev, int *saved)
{
    if (dev >= 0 && dev < CUDA_MAX_DEV && !atomic_load_explicit(&g_pctx[dev], memory_order_acquire))
        primary_ctx_retain(dev);
    return device_status(dev_enter_err(dev, saved));
}

int bfc__cuda_dev_leave(int saved)
{
    return dev_leave(saved, BFC_OK);
}

void bfc__cuda_fork_child(void)
{
    /* The child's one thread holds nothing: whoever held the lock stayed
     * in the parent.  A table entry is one atomic store: there or not. */
    int e = bfc__mutex_init(&g_pctx_lock, BFC__RANK_CUDA_PCTX, "the CUDA primary-context table");
    if (e != 0)
        bfc__fatal("bfc__mutex_init", e);
}

void bfc__cuda_pctx_lock(void)
{
    bfc__lock(&g_pctx_lock);
}

void bfc__cuda_pctx_unlock(void)
{
    bfc__unlock(&g_pctx_lock);
}

/* Maps a driver result to a status (driver calls leave cudart's last-error
 * slot alone: nothing to clear). */
static int cu_status(CUresult r)
{
    if (r == CUDA_SUCCESS)
        return BFC_OK;
    return r == CUDA_ERROR_OUT_OF_MEMORY ? BFC_ENOMEM : BFC_EBACKEND;
}

/*
 * The granule of `device` and the properties of its pinned memory, or 0
 * when the driver, the device or a query says no (see the opening essay).
 */
static size_t vmm_probe(int device, CUmemAllocationProp *prop)
{
    CUdevice dev = 0;
    int supported = 0;
    size_t g = 0;

    if (pthread_once(&g_drv_once, drv_resolve) != 0 || !g_drv.ok)
        return 0;
    if (g_drv.device_get(&dev, device) != CUDA_SUCCESS)
        return 0;
    if (g_drv.device_get_attribute(&supported,
                                   CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   dev) != CUDA_SUCCESS ||
        !supported)
        return 0;
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = (int)dev;
    /* Memory a NIC can reach (GPUDirect RDMA) where the device allows it
     * for virtual-memory allocations, as cudaMalloc's memory can be
     * reached: KV-cache transfer and collective libraries register these
     * blocks with their NICs (PyTorch's expandable segments ask the same).
     * A device that does not say so gets memory without the flag. */
    if (g_drv.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev) ==
            CUDA_SUCCESS &&
        supported)
        prop->allocFlags.gpuDirectRDMACapable = 1;
    if (g_drv.get_granularity(&g, prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) !=
        CUDA_SUCCESS)
        return 0;
    /* The book and the arena count on a power of two that keeps chunks
     * 256-byte aligned; any real granule is (2 MiB on current GPUs). */
    if (g < BFC__MIN_ALLOC || (g & (g - 1)) != 0)
        return 0;
    return g;
}

size_t bfc__cuda_vmm_granule(int device)
{
    CUmemAllocationProp prop;

    return vmm_probe(device, &prop);
}

/*
 * Makes `dev` current for driver calls: dev_enter, plus the device's primary
 * context when the thread has no context at all (cudaGetDevice alone binds
 * none, and driver calls need one; since CUDA 12 cudaSetDevice makes the
 * primary context current at once).  Paired with vmm_leave.
 */
static int vmm_enter(int dev, int *saved)
{
    CUcontext cur = NULL;
    int st = dev_enter(dev, saved);

    if (st != BFC_OK || *saved != -1)
        return st; /* failed, or dev's context was just pushed or bound */
    if (g_drv.ctx_get_current(&cur) != CUDA_SUCCESS || cur == NULL)
        st = cuda_status(cudaSetDevice(dev));
    return st;
}


/* Releases again the handles whose release was refused (book's lock held,
 * device entered); those refused again stay for the next call. */
static void strays_release_locked(struct cuda_backend *b)
{
    struct cuda_stray **pp = &b->strays;

    while (*pp) {
        struct cuda_stray *st = *pp;

        if (cu_status(g_drv.release(st->h)) == BFC_OK) {
            *pp = st->next;
            bfc__meta_free(st, sizeof(*st));
        } else {
            pp = &st->next;
        }
    }
}

/* Keeps h to be released again (book's lock held); false when no record
 * can be had (host metadata exhausted). */
static bool stray_keep_locked(struct cuda_backend *b, CUmemGenericAllocationHandle h)
{
    struct cuda_stray *st = bfc__meta_alloc(sizeof(*st));

    if (!st)
        return false;
    st->h = h;
    st->next = b->strays;
    b->strays = st;
    return true;
}

/* Unmaps the granules of [addr, addr + size) one by one (each is a mapping
 * of its own); returns the status and, in *done, the bytes unmapped. */
static int unmap_granules(size_t g, uintptr_t addr, size_t size, size_t *done)
{
    int st = BFC_OK;
    size_t off;

    for (off = 0; off < size; off += g) {
        st = cu_status(g_drv.unmap((CUdeviceptr)(addr + off), g));
        if (st != BFC_OK)
            break;
    }
    *done = off;
    return st;
}

static int cuda_va_reserve(bfc__backend_t *be, size_t size, uintptr_t *base)
{
    struct cuda_backend *b = cuda_of(be);
    size_t g = be->vmm_granule;
    CUdeviceptr p = 0;
    int saved, st;

    if (!base)
        return BFC_EINVAL;
    *base = 0;
    if (g == 0 || size == 0 || (size & (g - 1)) != 0)
        return BFC_EINVAL;
    st = vmm_enter(be->device, &saved);
    if (st != BFC_OK)
        return st;
    st = cu_status(g_drv.address_reserve(&p, size, g, 0, 0));
    if (st == BFC_OK) {
        bfc__lock(&b->book.lock);
        st = bfc__vmm_book_add(&b->book, (uintptr_t)p, size);
        bfc__unlock(&b->book.lock);
        /* Out of metadata: give the range back; if even that fails, the
         * addresses (not memory) stay taken until the process ends. */
        if (st != BFC_OK && g_drv.address_free(p, size) != CUDA_SUCCESS)
            st = BFC_EBACKEND;
    }
    st = done_leave(saved, st);
    if (st == BFC_OK)
        *base = (uintptr_t)p;
    return st;
}

/*
 * Gives back r: its mapped granules, then its addresses.  Called with the
 * book's lock held and the device entered.  On failure r stays, less what
 * could be unmapped.
 */
static int release_locked(struct cuda_backend *b, struct bfc__vmm_res *r)
{
    size_t g = b->base.vmm_granule;
    uintptr_t a = r->base;
    size_t len, done;
    int st;

    while (bfc__vmm_book_next_run(&b->book, r, &a, &len)) {
        st = unmap_granules(g, a, len, &done);
        bfc__vmm_book_mark(&b->book, r, a, done, false);
        if (st != BFC_OK)
            return st;
        a += len;
    }
    st = cu_status(g_drv.address_free((CUdeviceptr)r->base, r->size));
    if (st == BFC_OK)
        bfc__vmm_book_remove(&b->book, r);
    return st;
}

static int cuda_va_release(bfc__backend_t *be, uintptr_t base, size_t size)
{
    struct cuda_backend *b = cuda_of(be);
    struct bfc__vmm_res *r;
    int saved, st;

    if (be->vmm_granule == 0)
        return BFC_EINVAL;
    bfc__lock(&b->book.lock);
    r = bfc__vmm_book_exact(&b->book, base, size);
    st = r ? vmm_enter(be->device, &saved) : BFC_EINVAL;
    if (st == BFC_OK) {
        strays_release_locked(b);
        st = done_leave(saved, release_locked(b, r));
    }
    bfc__unlock(&b->book.lock);
    return st;
}

static size_t cuda_va_mapped(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    return be->vmm_granule ? bfc__vmm_book_res_mapped(&cuda_of(be)->book, addr, size) : 0;
}

static int cuda_va_settle(bfc__backend_t *be)
{
    struct cuda_backend *b = cuda_of(be);
    int saved, st = BFC_OK;

    if (be->vmm_granule == 0)
        return BFC_OK;
    bfc__lock(&b->book.lock);
    if (b->strays && (st = vmm_enter(be->device, &saved)) == BFC_OK) {
        strays_release_locked(b);
        st = done_leave(saved, b->strays ? BFC_EBACKEND : BFC_OK);
    }
    bfc__unlock(&b->book.lock);
    return st;
}

static int cuda_va_map(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    struct cuda_backend *b = cuda_of(be);
    size_t g = be->vmm_granule;
    struct bfc__vmm_res *r;
    size_t done = 0;
    int saved, st;

    if (g == 0)
        return BFC_EINVAL;
    bfc__lock(&b->book.lock);
    st = vmm_enter(be->device, &saved);
    if (st != BFC_OK)
        goto out;
    strays_release_locked(b);
    /* Granules an earlier failed va_map left stranded (its roll-back was
     * refused) are unmapped now, before the book is asked: else the range
     * would read as partly mapped and every map over it be refused. */
    {
        uintptr_t run;
        size_t len, gone;

        while (st == BFC_OK && bfc__vmm_book_stranded_run(&b->book, addr, size, &r, &run, &len)) {
            st = unmap_granules(g, run, len, &gone);
            bfc__vmm_book_mark(&b->book, r, run, gone, false);
        }
    }
    if (st == BFC_OK)
        st = bfc__vmm_book_check(&b->book, addr, size, false, &r);
    if (st != BFC_OK) {
        st = done_leave(saved, st);
        goto out;
    }
    /* One physical allocation per granule (see the opening essay). */
    while (done < size) {
        CUmemGenericAllocationHandle h = 0;
        int rel;

        st = cu_status(g_drv.create(&h, g, &b->prop, 0));
        if (st != BFC_OK)
            break;
        st = cu_status(g_drv.map((CUdeviceptr)(addr + done), g, 0, h, 0));
        /* Mapped: the mapping now keeps the memory alive, and unmapping
         * frees it.  Not mapped: this frees it at once.  Refused: the
         * handle would keep the memory for the process's life, so it is
         * kept and released again later (a mapped granule serves
         * meanwhile); with no record to keep it in (host metadata
         * exhausted), the call fails and rolls back, and the memory is
         * lost. */
        rel = cu_status(g_drv.release(h));
        if (rel != BFC_OK && stray_keep_locked(b, h))
            rel = BFC_OK;
        if (st != BFC_OK)
            break;
        done += g;
        if (rel != BFC_OK) {
            st = rel;
            break;
        }
    }
    if (st == BFC_OK)
        st = cu_status(g_drv.set_access((CUdeviceptr)addr, size, &b->access, 1));
    if (st == BFC_OK) {
        bfc__vmm_book_mark(&b->book, r, addr, size, true);
    } else {
        size_t undone = 0;

        /* Roll back.  What the driver refuses to unmap stays mapped in the
         * book, stranded: the next va_map over it unmaps it first, and
         * va_release frees it. */
        while (undone < done) {
            size_t n;

            (void)unmap_granules(g, addr + undone, done - undone, &n);
            undone += n;
            if (undone < done) {
                bfc__vmm_book_strand(&b->book, r, addr + undone, g);
                undone += g;
            }
        }
    }
    st = done_leave(saved, st);
out:
    bfc__unlock(&b->book.lock);
    return st;
}

static int cuda_va_unmap(bfc__backend_t *be, uintptr_t addr, size_t size, size_t *donep)
{
    struct cuda_backend *b = cuda_of(be);
    struct bfc__vmm_res *r;
    size_t done = 0;
    int saved, st;

    if (donep)
        *donep = 0;
    if (be->vmm_granule == 0)
        return BFC_EINVAL;
    bfc__lock(&b->book.lock);
    st = bfc__vmm_book_check(&b->book, addr, size, true, &r);
    if (st == BFC_OK)
        st = vmm_enter(be->device, &saved);
    if (st == BFC_OK) {
        strays_release_locked(b);
        st = unmap_granules(be->vmm_granule, addr, size, &done);
        /* On failure the leading granules are gone: the book says so. */
        bfc__vmm_book_mark(&b->book, r, addr, done, false);
        st = done_leave(saved, st);
        if (donep)
            *donep = done;
    }
    bfc__unlock(&b->book.lock);
    return st;
}

static void cuda_close(bfc__backend_t *be)
{
    struct cuda_backend *b = cuda_of(be);
    int saved;

    if (be->vmm_granule != 0) {
        /* Reservations the allocator did not release go with the backend;
         * what the driver refuses to free is dropped from the book. */
        bfc__lock(&b->book.lock);
        if ((b->book.n > 0 || b->strays) && vmm_enter(be->device, &saved) == BFC_OK) {
            while (b->book.n > 0) {
                struct bfc__vmm_res *r = &b->book.res[b->book.n - 1];

                if (release_locked(b, r) != BFC_OK)
                    bfc__vmm_book_remove(&b->book, r);
            }
            /* Their granules unmapped above (or, where the driver
             * refused, dropped with their reservation): this frees what
             * it can. */
            strays_release_locked(b);
            (void)done_leave(saved, BFC_OK);
        }
        while (b->strays) { /* refused to the end: only the records go */
            struct cuda_stray *st = b->strays;

            b->strays = st->next;
            bfc__meta_free(st, sizeof(*st));
        }
        bfc__unlock(&b->book.lock);
        bfc__vmm_book_fini(&b->book);
    }
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
    .stream_for = cuda_stream_for,
    .device_sync = cuda_device_sync,
    .mem_info = cuda_mem_info,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .va_reserve = cuda_va_reserve,
    .va_release = cuda_va_release,
    .va_mapped = cuda_va_mapped,
    .va_map = cuda_va_map,
    .va_unmap = cuda_va_unmap,
    .va_settle = cuda_va_settle,
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
    /* BFC__STREAM_PER_THREAD must be cudaStreamPerThread (internal.h).  A
     * test the compiler folds away, not a _Static_assert: CUDA defines the
     * handle as a pointer cast, which clang (make fuzz) does not take as a
     * constant expression. */
    if ((uintptr_t)cudaStreamPerThread != (uintptr_t)BFC__STREAM_PER_THREAD)
        return BFC_EBACKEND;
    /* Not bfc__cuda_device_count, which reads every failure as "no device":
     * opening must tell a missing driver or device (BFC_ENODEV) from a
     * runtime that fails, e.g. a context broken by an earlier kernel fault
     * (BFC_EBACKEND). */
    count = 0;
    st = device_status(cudaGetDeviceCount(&count));
    if (st != BFC_OK)
        return st;
    if (cfg->device < 0 || cfg->device >= count)
        return BFC_ENODEV;

    memset(&prop, 0, sizeof(prop));
    st = device_status(cudaGetDeviceProperties(&prop, cfg->device));
    if (st != BFC_OK)
        return st;
    /* The device's primary context: retained for dev_enter, and made by
     * cudaMemGetInfo where it could not be. */
    primary_ctx_retain(cfg->device);
    st = device_status(dev_enter_err(cfg->device, &saved));
    if (st != BFC_OK)
        return st;
    st = device_status(cudaMemGetInfo(&free_b, &total_b));
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
    b->base.vmm_granule = vmm_probe(cfg->device, &b->prop);
    if (b->base.vmm_granule != 0) {
        b->access.location = b->prop.location;
        b->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if (bfc__vmm_book_init(&b->book, b->base.vmm_granule) != BFC_OK)
            b->base.vmm_granule = 0; /* classic regions still work */
    }
    /* GPU names are short; a longer one is cut to fit name[]. */
    prop.name[sizeof(b->base.name) - 1] = '\0';
    memcpy(b->base.name, prop.name, sizeof(b->base.name));
    *out = &b->base;
    return BFC_OK;
}

#endif /* BFC_HAVE_CUDA */
