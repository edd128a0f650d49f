/*
 * fake_cudart.c -- a host-only stand-in for the CUDA runtime, built as
 * tests/fakecuda/libcudart.so.13 (SONAME and symbol version libcudart.so.13,
 * as the real one: libcudart.map), so that the CUDA backend and its tests
 * run on a machine without a GPU or a driver.  tests/fakecuda.sh runs
 * tests/test_backend_cuda and the GPU stream test (built with the host
 * kernels of kernels_host.c) with it first on LD_LIBRARY_PATH.
 *
 * It implements the runtime calls the library imports, the driver's
 * virtual memory entry points the library fetches with
 * cudaGetDriverEntryPointByVersion (cuDeviceGet, cuDeviceGetAttribute,
 * cuCtxGetCurrent, cuMemGetAllocationGranularity, cuMemAddressReserve and
 * cuMemAddressFree, cuMemCreate and cuMemRelease, cuMemMap and cuMemUnmap,
 * cuMemSetAccess), and what the GPU tests call besides (stream creation and
 * destruction, cudaStreamWaitEvent, cudaMemset(Async), cudaMemcpy, error
 * names).  The controls a test may use are in fake_cudart.h.
 *
 * The model
 *   Devices     FAKE_CUDA_DEVICES (default 1, at most 8), each with
 *               FAKE_CUDA_MEM bytes (default 1 GiB; K, M or G suffix).
 *               cudaMalloc (counted in 2 MiB units, the real allocator's
 *               granularity) and cuMemCreate count against it and fail with
 *               cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY beyond
 *               it.  The current device is per thread (default 0).  A thread
 *               has a "current context" (cuCtxGetCurrent) after cudaSetDevice
 *               or any call that initialises the device (cudaMalloc,
 *               cudaMemGetInfo, stream or event creation...), not after
 *               cudaGetDevice -- as with CUDA 12 and later -- and that
 *               binding makes the device's primary context.  Contexts are
 *               primary ones only: cuDevicePrimaryCtxRetain makes and
 *               counts one, cuCtxPushCurrent puts one over the thread's
 *               current context (the runtime's calls then use its device),
 *               cuCtxPopCurrent takes it off again (fake_primary_made says
 *               which devices' primary contexts exist).  Event query,
 *               synchronisation and destruction initialise the current
 *               device too, as a runtime's lazy initialisation may: a
 *               library must not count on their leaving a thread alone.
 *   Memory      cudaMalloc: mmap'ed host memory (zeroed, which no program
 *               may count on: device memory's content is undefined).
 *               Virtual memory: cuMemAddressReserve is an mmap(PROT_NONE);
 *               cuMemMap fills the pages with 0xA5 (undefined content) and
 *               leaves them PROT_NONE, cuMemSetAccess makes them read-write,
 *               cuMemUnmap drops them and puts PROT_NONE back, so touching
 *               memory that is not mapped faults.  cuMemUnmap takes only
 *               ranges made of whole mappings; cuMemAddressFree refuses a
 *               reservation with mappings left (a violation as well).
 *               FAKE_CUDA_VMM=0 makes the devices report no virtual memory
 *               management, FAKE_CUDA_RDMA=0 no GPUDirect RDMA with it;
 *               FAKE_CUDA_GRANULE sets the granule (default 2 MiB, a
 *               multiple of the page size).
 *   Streams     cudaStreamCreate* give heap handles; 0 and cudaStreamLegacy
 *               are the current device's legacy stream, cudaStreamPerThread
 *               the calling thread's own stream on its current device.
 *               Every stream has an id of its own (cudaStreamGetId).  A
 *               destroyed handle is kept, never reused, and refused
 *               afterwards; work queued on it still runs.
 *   Work        each stream has a queue of work that an executor runs in
 *               order (progress(), called by every entry point):
 *               fake_stream_hold(s) queues work that ends only at
 *               fake_stream_drain(s); fake_enqueue_spin work that ends after
 *               some wall time; fake_launch(s, p, n) a kernel that uses
 *               [p, p + n); fake_enqueue_fill and _count the fill and check
 *               kernels of tests/gpu/kernels.h; cudaEventRecord,
 *               cudaStreamWaitEvent and cudaMemsetAsync queue as on a GPU.
 *               The legacy stream waits for every blocking stream's earlier
 *               work and they for its (cudaStreamNonBlocking streams are
 *               left out).  Blocking calls (cudaStreamSynchronize,
 *               cudaEventSynchronize, cudaDeviceSynchronize, cudaFree, and
 *               the synchronous cudaMemset and cudaMemcpy) wait for the work
 *               they depend on, sleeping through spins; held work in the way
 *               is ended (a GPU would block until it ended) and counted
 *               (fake_blocking_syncs).
 *   Violations  unmapping (cuMemUnmap), freeing or unregistering memory that
 *               queued work not yet run uses; a kernel that finds its memory
 *               no longer device memory when it runs (it does not run);
 *               cudaFree of another device's block; cuMemAddressFree with
 *               mappings left.  Each is a "FAKE_CUDA VIOLATION" line on
 *               stderr, counted by fake_violations(); the call itself goes
 *               on as the real one would.
 *   Errors      a failed call sets the thread's last error (not sticky):
 *               cudaGetLastError returns and clears it, cudaPeekAtLastError
 *               only returns it.  cudaEventQuery's cudaErrorNotReady is put
 *               there too, as some runtimes do.  fake_trap(s): every later
 *               call fails with cudaErrorLaunchFailure
 *               (CUDA_ERROR_LAUNCH_FAILED), the sticky error of a kernel
 *               that trapped.  When a libcuda.so.1 loads and its cuInit says
 *               CUDA_ERROR_STUB_LIBRARY (the toolkit's stub), every call
 *               fails with cudaErrorStubLibrary, as the real runtime's do;
 *               without any libcuda.so.1 (no driver), or with a real one,
 *               the fake is the driver.
 *   Injection   FAKE_CUDA_FAIL="name:N[:code],..." makes the N-th call
 *               (from 1, process-wide) of the runtime or driver function
 *               `name` fail with `code`, by default its natural error (out
 *               of memory for cudaMalloc, cuMemCreate and
 *               cuMemAddressReserve, else cudaErrorUnknown /
 *               CUDA_ERROR_UNKNOWN).  fake_fail_next(name, k, code): the
 *               k-th call from now.
 *   Recording   FAKE_CUDA_TRACE=path appends a line per call, prefixed with
 *               the process id (children started with the same environment
 *               write to the same file); fake_calls(name) counts calls;
 *               fake_report(f) lists what is still alive (blocks, mappings,
 *               reservations, host registrations, events, device memory).
 *
 *   A FAKE_CUDA_* variable that cannot be read makes every call fail with
 *   cudaErrorInitializationError after one line on stderr that names it:
 *   the tests then find no device and say so, rather than run on a model
 *   other than the one asked for.
 *
 * Not modelled: kernels other than the queued operations above; true
 * concurrency on the device (work runs when some thread calls into the
 * fake); peer access, IPC, memory pools, graphs, timing events, stream
 * priorities; cudaFree's and cuMemUnmap's exact synchronisation (cudaFree
 * waits for the whole device, cuMemUnmap never waits); the real rounding of
 * cudaMalloc sizes (2 MiB here) and its address reuse; the primary
 * context's life cycle (a thread "has a context" from its first
 * cudaSetDevice or device-initialising call on).  Internal markers (the
 * legacy stream's implicit waits, synchronisations) are events that are
 * never freed: the fake is for test runs, not for long ones.
 *
 * Locking: one mutex, g_lock, guards all of the state below but the
 * thread-local current device, context flag and last error; every entry
 * point takes it.  Blocking calls drop it while they sleep (wait_until), so
 * another thread may queue, drain or run work meanwhile.
 *
 * The fake's own failures -- a lock that cannot be taken, host memory for
 * its bookkeeping, an mprotect or munmap of its own mappings, a trace that
 * cannot be written -- are not the runtime's errors to model: they stop
 * the process (die()) with one line saying which call failed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "fake_cudart.h"
#include "gpu/kernels.h" /* bfc_test_word: the fill and check kernels' pattern */

#define MAX_DEV 8
#define MALLOC_UNIT ((size_t)2 << 20) /* cudaMalloc's accounting granularity */

/* ------------------------------------------------------------ state */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* Set once by init_once (the environment), then read-only. */
static int g_ndev = 1;
static size_t g_granule = (size_t)2 << 20;
static int g_vmm = 1;
static int g_rdma = 1;
static FILE *g_trace;
static cudaError_t g_init_error = cudaSuccess;

static size_t g_total = (size_t)1 << 30; /* per device; set by init_once */
static size_t g_used[MAX_DEV];
static unsigned long g_violations, g_blocking_syncs;
static unsigned long long g_next_stream_id = 100;
static cudaError_t g_sticky = cudaSuccess; /* a trapped kernel broke the context */

/* The calling thread's contexts, as the driver keeps them: the runtime's
 * device (cudaSetDevice, default 0) and whether its primary context is
 * bound (after cudaSetDevice or a call that initialises the device, not
 * after cudaGetDevice), under a stack of contexts pushed with
 * cuCtxPushCurrent (here always primary ones: the device's number).  The
 * context on top is the current one, whose device the runtime's calls use.
 * g_primary: devices whose primary context exists (made by binding it,
 * using it, or cuDevicePrimaryCtxRetain) -- what a GPU pays memory for. */
#define MAX_PUSH 8
static _Thread_local int t_rt_dev;
static _Thread_local bool t_rt_ctx;
static _Thread_local int t_stack[MAX_PUSH];
static _Thread_local int t_depth;
static bool g_primary[MAX_DEV];
static unsigned g_retained[MAX_DEV];

static int cur_dev(void)
{
    return t_depth > 0 ? t_stack[t_depth - 1] : t_rt_dev;
}

static bool cur_ctx(void)
{
    return t_depth > 0 || t_rt_ctx;
}

/* A call that initialises the current device: with nothing pushed, the
 * runtime binds its device's primary context (making it). */
static void bind_ctx(void)
{
    if (t_depth == 0) {
        t_rt_ctx = true;
        g_primary[t_rt_dev] = true;
    }
}

#define t_dev (cur_dev())
#define FAKE_CTX(d) ((CUcontext)(uintptr_t)(0x1000 + (d)))
static _Thread_local cudaError_t t_last;

/* Work queued on a stream, run in order by progress(). */
enum op_kind {
    OP_HOLD,   /* fake_stream_hold: done only when released */
    OP_SPIN,   /* busy for ns of wall time from when it starts */
    OP_USE,    /* fake_launch: a kernel that uses [lo, hi) */
    OP_FILL,   /* bfc_test_fill: word i becomes bfc_test_word(tag, i) */
    OP_COUNT,  /* bfc_test_count_bad: counts the words that do not */
    OP_MEMSET, /* cudaMemsetAsync: the byte in tag */
    OP_RECORD, /* cudaEventRecord */
    OP_WAIT,   /* cudaStreamWaitEvent, and the legacy stream's implicit waits */
};

struct fevent;
struct op {
    enum op_kind kind;
    bool released;           /* OP_HOLD */
    uint64_t ns, start_ns;   /* OP_SPIN */
    uintptr_t lo, hi;        /* OP_USE, OP_FILL, OP_COUNT, OP_MEMSET */
    uint32_t tag;            /* OP_FILL, OP_COUNT; OP_MEMSET: the byte */
    unsigned long long *bad; /* OP_COUNT */
    struct fevent *ev;       /* OP_RECORD, OP_WAIT */
    unsigned long seq;       /* OP_RECORD, OP_WAIT */
    struct op *next;
};

struct fstream {
    int device;
    bool destroyed;
    bool nonblocking;
    bool legacy;
    unsigned long long id;
    struct op *head, *tail; /* queued work */
    struct fstream *next;   /* g_streams: every stream but the legacy ones */
};

struct fevent {
    int device;
    bool destroyed;
    bool internal;              /* a marker of the fake's own, not the caller's */
    unsigned long rec_seq;      /* records queued */
    unsigned long done_seq;     /* records run */
    struct fstream *rec_stream; /* the stream of the last record */
    struct fevent *next;
};

struct dalloc {
    uintptr_t p;
    size_t size, acct; /* requested; counted against the device */
    int device;
    struct dalloc *next;
};

struct hostreg {
    uintptr_t p;
    size_t size;
    struct hostreg *next;
};

struct vres {
    uintptr_t base;
    size_t size;
    void *map_base; /* the mmap that holds it, aligned inside */
    size_t map_len;
    struct vres *next;
};

/* A physical allocation.  Every live one is on g_handles, as a driver
 * keeps its own: a handle the library lost (its release refused to the
 * end) is the device's memory still, not a leak of this process's heap. */
struct vhandle {
    size_t size;
    int device;
    bool released;
    int nmaps;
    struct vhandle *prev, *next;
};

struct vmapping {
    uintptr_t p;
    size_t size;
    struct vhandle *h;
    bool access;
    struct vmapping *next;
};

static struct fstream *g_streams;
static struct fstream g_legacy[MAX_DEV];
static struct fevent *g_events;
static struct dalloc *g_allocs;
static struct hostreg *g_hostregs;
static struct vres *g_res;
static struct vmapping *g_maps;
static struct vhandle *g_handles;
static _Thread_local struct fstream *t_pts[MAX_DEV]; /* cudaStreamPerThread */

/* Calls counted per function name, and the failures to inject. */
#define MAX_FN 64
static struct {
    const char *name; /* a string literal of the fake's */
    unsigned long n;
} g_count[MAX_FN];

#define MAX_FAIL 64
static struct fail {
    char name[64];
    unsigned long nth;
    int code; /* 0: the function's natural error */
    bool used;
} g_fail[MAX_FAIL];
static int g_nfail;

/* --------------------------------------------------------- plumbing */

static void die(const char *what, int err)
{
    fprintf(stderr, "fake_cudart: fatal: %s failed: %s\n", what, strerror(err));
    abort();
}

static void *zalloc(size_t n)
{
    void *p = calloc(1, n);

    if (!p)
        die("calloc", ENOMEM);
    return p;
}

static uint64_t now_ns(void)
{
    struct timespec ts;

    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        die("clock_gettime", errno);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void protect(uintptr_t p, size_t n, int prot)
{
    if (mprotect((void *)p, n, prot) != 0)
        die("mprotect", errno);
}

static size_t round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

/* ----------------------------------------------------- environment */

static void bad_env(const char *name, const char *value, const char *why)
{
    fprintf(stderr, "fake_cudart: %s=%s: %s; every call fails with cudaErrorInitializationError\n", name,
            value, why);
    g_init_error = cudaErrorInitializationError;
}

/* A decimal number in [min, max] that is all of s.  False when it is not. */
static bool parse_ulong(const char *s, unsigned long min, unsigned long max, unsigned long *out)
{
    char *end;
    unsigned long v;

    if (*s < '0' || *s > '9')
        return false;
    errno = 0;
    v = strtoul(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < min || v > max)
        return false;
    *out = v;
    return true;
}

/* A byte count with an optional K, M or G suffix.  False when s is not one
 * or it is 0. */
static bool parse_size(const char *s, size_t *out)
{
    char digits[32];
    size_t len = strlen(s);
    unsigned shift = 0;
    unsigned long v;

    if (len > 0 && strchr("kKmMgG", s[len - 1])) {
        shift = strchr("kK", s[len - 1]) ? 10 : strchr("mM", s[len - 1]) ? 20 : 30;
        len--;
    }
    if (len == 0 || len >= sizeof digits)
        return false;
    memcpy(digits, s, len);
    digits[len] = '\0';
    if (!parse_ulong(digits, 1, SIZE_MAX >> shift, &v))
        return false;
    *out = (size_t)v << shift;
    return true;
}

/* One FAKE_CUDA_FAIL entry, name:N[:code].  False when malformed. */
static bool parse_fail(char *tok)
{
    char *c1 = strchr(tok, ':'), *c2;
    unsigned long nth, code = 0;
    struct fail *f;

    if (!c1 || c1 == tok || (size_t)(c1 - tok) >= sizeof f->name || g_nfail == MAX_FAIL)
        return false;
    *c1 = '\0';
    c2 = strchr(c1 + 1, ':');
    if (c2)
        *c2 = '\0';
    if (!parse_ulong(c1 + 1, 1, ULONG_MAX, &nth) || (c2 && !parse_ulong(c2 + 1, 1, INT_MAX, &code)))
        return false;
    f = &g_fail[g_nfail++];
    memcpy(f->name, tok, (size_t)(c1 - tok) + 1);
    f->nth = nth;
    f->code = (int)code;
    return true;
}

static void read_fail_spec(const char *spec)
{
    char *dup = strdup(spec), *save = NULL;

    if (!dup)
        die("strdup", ENOMEM);
    for (char *tok = strtok_r(dup, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (!parse_fail(tok)) {
            bad_env("FAKE_CUDA_FAIL", spec, "want name:N[:code],... (N, code >= 1; at most 64 entries)");
            break;
        }
    free(dup);
}

/* As the real runtime, look for a driver first: a libcuda.so.1 whose cuInit
 * says CUDA_ERROR_STUB_LIBRARY (the toolkit's stub) makes every call fail
 * with cudaErrorStubLibrary.  A real driver is left loaded (it may have
 * started threads) and ignored: the fake stands in for it. */
static void probe_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CUresult (*init)(unsigned);

    if (!h)
        return;
    init = (CUresult(*)(unsigned))dlsym(h, "cuInit");
    if (init && init(0) == CUDA_ERROR_STUB_LIBRARY)
        g_init_error = cudaErrorStubLibrary;
}

static void init_once(void)
{
    unsigned long v;
    long page = sysconf(_SC_PAGESIZE);
    const char *e;

    if (page <= 0)
        die("sysconf(_SC_PAGESIZE)", errno ? errno : EINVAL);
    probe_driver();
    if ((e = getenv("FAKE_CUDA_DEVICES"))) {
        if (parse_ulong(e, 0, MAX_DEV, &v))
            g_ndev = (int)v;
        else
            bad_env("FAKE_CUDA_DEVICES", e, "want 0 to 8");
    }
    if ((e = getenv("FAKE_CUDA_MEM")) && !parse_size(e, &g_total))
        bad_env("FAKE_CUDA_MEM", e, "want a byte count (K, M or G suffix)");
    if ((e = getenv("FAKE_CUDA_GRANULE")) && (!parse_size(e, &g_granule) || g_granule % (size_t)page != 0))
        bad_env("FAKE_CUDA_GRANULE", e, "want a multiple of the page size");
    if ((e = getenv("FAKE_CUDA_VMM"))) {
        if (parse_ulong(e, 0, 1, &v))
            g_vmm = (int)v;
        else
            bad_env("FAKE_CUDA_VMM", e, "want 0 or 1");
    }
    if ((e = getenv("FAKE_CUDA_RDMA"))) {
        if (parse_ulong(e, 0, 1, &v))
            g_rdma = (int)v;
        else
            bad_env("FAKE_CUDA_RDMA", e, "want 0 or 1");
    }
    if ((e = getenv("FAKE_CUDA_TRACE")) && !(g_trace = fopen(e, "a")))
        bad_env("FAKE_CUDA_TRACE", e, strerror(errno));
    if ((e = getenv("FAKE_CUDA_FAIL")))
        read_fail_spec(e);
    for (int d = 0; d < MAX_DEV; d++) {
        g_legacy[d].device = d;
        g_legacy[d].legacy = true;
        g_legacy[d].id = (unsigned long long)d + 1;
    }
}

static void lock(void)
{
    int rc = pthread_once(&g_once, init_once);

    if (rc != 0)
        die("pthread_once", rc);
    if ((rc = pthread_mutex_lock(&g_lock)) != 0)
        die("pthread_mutex_lock", rc);
}

static void unlock(void)
{
    int rc = pthread_mutex_unlock(&g_lock);

    if (rc != 0)
        die("pthread_mutex_unlock", rc);
}

/* ------------------------------------------ recording and injection */

__attribute__((format(printf, 3, 4))) static void trace(const char *fn, int rc, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (!g_trace)
        return;
    va_start(ap, fmt);
    n = fprintf(g_trace, "%ld %s rc=%d ", (long)getpid(), fn, rc);
    if (n >= 0)
        n = vfprintf(g_trace, fmt, ap);
    va_end(ap);
    if (n < 0 || fputc('\n', g_trace) == EOF || fflush(g_trace) != 0)
        die("writing FAKE_CUDA_TRACE", errno);
}

__attribute__((format(printf, 1, 2))) static void violation(const char *fmt, ...)
{
    va_list ap;

    g_violations++;
    fprintf(stderr, "FAKE_CUDA VIOLATION: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    trace("VIOLATION", 0, "#%lu (stderr)", g_violations);
}

/* The slot counting fn's calls.  Lock held. */
static unsigned long *count_of(const char *fn, bool add)
{
    int i;

    for (i = 0; i < MAX_FN && g_count[i].name; i++)
        if (g_count[i].name == fn || strcmp(g_count[i].name, fn) == 0)
            return &g_count[i].n;
    if (!add)
        return NULL;
    if (i == MAX_FN)
        die("counting calls (MAX_FN functions)", ENOSPC);
    g_count[i].name = fn;
    return &g_count[i].n;
}

/* Counts a call of fn; true when it is to fail, with the code to fail with
 * in *code (0: the function's natural error).  Lock held. */
static bool injected(const char *fn, int *code)
{
    unsigned long n = ++*count_of(fn, true);

    for (int k = 0; k < g_nfail; k++)
        if (!g_fail[k].used && g_fail[k].nth == n && strcmp(g_fail[k].name, fn) == 0) {
            g_fail[k].used = true;
            *code = g_fail[k].code;
            return true;
        }
    return false;
}

/* The error a runtime call starts with (natural error `dflt`).  Lock held. */
static cudaError_t inj_rt(const char *fn, cudaError_t dflt)
{
    int code;

    if (g_init_error != cudaSuccess)
        return g_init_error;
    if (g_sticky != cudaSuccess)
        return g_sticky;
    if (!injected(fn, &code))
        return cudaSuccess;
    return code ? (cudaError_t)code : dflt;
}

/* The same for a driver call. */
static CUresult inj_drv(const char *fn, CUresult dflt)
{
    int code;

    if (g_sticky != cudaSuccess)
        return CUDA_ERROR_LAUNCH_FAILED;
    if (!injected(fn, &code))
        return CUDA_SUCCESS;
    return code ? (CUresult)code : dflt;
}

/* A runtime call's result: a failure goes into the last-error slot. */
static cudaError_t rt(cudaError_t e)
{
    if (e != cudaSuccess)
        t_last = e;
    return e;
}

/* ------------------------------------------------ streams and events */

static struct fstream *new_stream(int dev, bool nonblocking)
{
    struct fstream *s = zalloc(sizeof *s);

    s->device = dev;
    s->nonblocking = nonblocking;
    s->id = g_next_stream_id++;
    s->next = g_streams;
    g_streams = s;
    return s;
}

/* The stream a handle names, or NULL for a bad or destroyed one. */
static struct fstream *stream_of(cudaStream_t h)
{
    struct fstream *s;

    if (h == NULL || h == cudaStreamLegacy)
        return &g_legacy[t_dev];
    if (h == cudaStreamPerThread) {
        if (!t_pts[t_dev])
            t_pts[t_dev] = new_stream(t_dev, false);
        return t_pts[t_dev];
    }
    for (s = g_streams; s; s = s->next)
        if (s == (struct fstream *)h)
            return s->destroyed ? NULL : s;
    return NULL;
}

static struct fevent *new_event(int dev, bool internal)
{
    struct fevent *e = zalloc(sizeof *e);

    e->device = dev;
    e->internal = internal;
    e->next = g_events;
    g_events = e;
    return e;
}

/* The caller's event a handle names, or NULL for a bad or destroyed one. */
static struct fevent *event_of(cudaEvent_t h)
{
    for (struct fevent *e = g_events; e; e = e->next)
        if (e == (struct fevent *)h)
            return e->destroyed || e->internal ? NULL : e;
    return NULL;
}

static bool event_done(const struct fevent *e)
{
    return e->done_seq >= e->rec_seq;
}

static struct op *new_op(enum op_kind kind)
{
    struct op *o = zalloc(sizeof *o);

    o->kind = kind;
    return o;
}

static struct op *mem_op(enum op_kind kind, const void *p, size_t n)
{
    struct op *o = new_op(kind);

    o->lo = (uintptr_t)p;
    o->hi = (uintptr_t)p + n;
    return o;
}

/* A record of e (the next in its sequence) to queue on s. */
static struct op *record_op(struct fevent *e, struct fstream *s)
{
    struct op *r = new_op(OP_RECORD);

    r->ev = e;
    r->seq = ++e->rec_seq;
    e->rec_stream = s;
    return r;
}

static void push_raw(struct fstream *s, struct op *o)
{
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
}

/* `to` waits for the work queued on `from` so far. */
static void push_dependency(struct fstream *from, struct fstream *to)
{
    struct fevent *m;
    struct op *w;

    if (!from->head)
        return;
    m = new_event(from->device, true);
    push_raw(from, record_op(m, from));
    w = new_op(OP_WAIT);
    w->ev = m;
    w->seq = m->rec_seq;
    push_raw(to, w);
}

/* Memory a kernel may touch: a live cudaMalloc block, registered host
 * memory, or mapped pages with access set. */
static bool device_memory(uintptr_t lo, uintptr_t hi)
{
    uintptr_t at = lo;

    for (struct dalloc *a = g_allocs; a; a = a->next)
        if (lo >= a->p && hi <= a->p + a->size)
            return true;
    for (struct hostreg *r = g_hostregs; r; r = r->next)
        if (lo >= r->p && hi <= r->p + r->size)
            return true;
    while (at < hi) {
        struct vmapping *m;

        for (m = g_maps; m; m = m->next)
            if (at >= m->p && at < m->p + m->size && m->access)
                break;
        if (!m)
            return false;
        at = m->p + m->size;
    }
    return true;
}

/* Runs the head of s's queue if it can run now; true when it did. */
static bool step(struct fstream *s, uint64_t now)
{
    struct op *o = s->head;

    if (!o)
        return false;
    switch (o->kind) {
    case OP_HOLD:
        if (!o->released)
            return false;
        break;
    case OP_SPIN:
        if (!o->start_ns)
            o->start_ns = now ? now : 1;
        if (now - o->start_ns < o->ns)
            return false;
        break;
    case OP_USE:
        break;
    case OP_FILL:
    case OP_COUNT:
    case OP_MEMSET:
        if (!device_memory(o->lo, o->hi)) {
            violation("a kernel on stream id %llu touches [%#lx, %#lx), which is not device memory any more",
                      s->id, (unsigned long)o->lo, (unsigned long)o->hi);
        } else if (o->kind == OP_MEMSET) {
            memset((void *)o->lo, (int)o->tag, o->hi - o->lo);
        } else {
            uint32_t *w = (uint32_t *)o->lo;

            for (uint64_t i = 0; i < (o->hi - o->lo) / 4; i++) {
                if (o->kind == OP_FILL)
                    w[i] = bfc_test_word(o->tag, i);
                else if (w[i] != bfc_test_word(o->tag, i))
                    (*o->bad)++;
            }
        }
        break;
    case OP_RECORD:
        if (o->ev->done_seq < o->seq)
            o->ev->done_seq = o->seq;
        break;
    case OP_WAIT:
        if (o->ev->done_seq < o->seq)
            return false;
        break;
    }
    s->head = o->next;
    if (!s->head)
        s->tail = NULL;
    free(o);
    return true;
}

/* Runs every stream's work as far as it can go now.  Lock held. */
static void progress(void)
{
    uint64_t now = now_ns();
    bool moved;

    do {
        moved = false;
        for (struct fstream *s = g_streams; s; s = s->next)
            while (step(s, now))
                moved = true;
        for (int d = 0; d < MAX_DEV; d++)
            while (step(&g_legacy[d], now))
                moved = true;
    } while (moved);
}

/* Queues o on s with the legacy stream's implicit ordering: work on the
 * legacy stream waits for every blocking stream's earlier work, and work on
 * a blocking stream for the legacy stream's. */
static void enqueue(struct fstream *s, struct op *o)
{
    if (s->legacy) {
        for (struct fstream *b = g_streams; b; b = b->next)
            if (b->device == s->device && !b->nonblocking)
                push_dependency(b, s);
    } else if (!s->nonblocking) {
        push_dependency(&g_legacy[s->device], s);
    }
    push_raw(s, o);
    progress();
}

static bool held(const struct fstream *s)
{
    for (const struct op *o = s->head; o; o = o->next)
        if (o->kind == OP_HOLD && !o->released)
            return true;
    return false;
}

/*
 * What a blocking call does about work that cannot end by itself: the held
 * work at the head of s (or of the stream whose event s waits for) is
 * released, as a GPU would block until it ended, and counted.  Spins are
 * left to end in their time.
 */
static void unblock(struct fstream *s, int depth);

static void unblock_event(struct fevent *e, int depth)
{
    if (!event_done(e) && e->rec_stream)
        unblock(e->rec_stream, depth + 1);
}

static void unblock(struct fstream *s, int depth)
{
    struct op *o = s->head;

    if (!o || depth > 64)
        return;
    if (o->kind == OP_HOLD && !o->released) {
        g_blocking_syncs++;
        o->released = true;
    } else if (o->kind == OP_WAIT) {
        unblock_event(o->ev, depth);
    }
}

/* A blocking call: returns once done(arg) holds, releasing what is in the
 * way (kick) and sleeping without the lock while spins run.  Lock held. */
static void wait_until(bool (*done)(void *), void *arg, void (*kick)(void *))
{
    static const struct timespec nap = {0, 100000};

    for (;;) {
        progress();
        if (done(arg))
            return;
        kick(arg);
        progress();
        if (done(arg))
            return;
        unlock();
        if (nanosleep(&nap, NULL) != 0 && errno != EINTR)
            die("nanosleep", errno);
        lock();
    }
}

static bool ev_done_cb(void *a)
{
    return event_done(a);
}

static void ev_kick_cb(void *a)
{
    unblock_event(a, 0);
}

/* A stream is synchronised when a marker queued now has run. */
static void sync_stream(struct fstream *s)
{
    struct fevent *m = new_event(s->device, true);

    enqueue(s, record_op(m, s)); /* on the legacy stream: after every blocking stream */
    wait_until(ev_done_cb, m, ev_kick_cb);
}

static bool dev_idle_cb(void *a)
{
    int dev = (int)(intptr_t)a;

    for (struct fstream *s = g_streams; s; s = s->next)
        if (s->device == dev && s->head)
            return false;
    return g_legacy[dev].head == NULL;
}

static void dev_kick_cb(void *a)
{
    int dev = (int)(intptr_t)a;

    for (struct fstream *s = g_streams; s; s = s->next)
        if (s->device == dev)
            unblock(s, 0);
    unblock(&g_legacy[dev], 0);
}

static void sync_device(int dev)
{
    wait_until(dev_idle_cb, (void *)(intptr_t)dev, dev_kick_cb);
}

static bool queue_uses(const struct fstream *s, uintptr_t lo, uintptr_t hi)
{
    for (const struct op *o = s->head; o; o = o->next)
        if ((o->kind == OP_USE || o->kind == OP_FILL || o->kind == OP_COUNT || o->kind == OP_MEMSET) &&
            o->lo < hi && lo < o->hi)
            return true;
    return false;
}

/* A stream whose queued work, not run yet, touches [lo, hi), or NULL. */
static struct fstream *busy(uintptr_t lo, uintptr_t hi)
{
    progress();
    for (struct fstream *s = g_streams; s; s = s->next)
        if (queue_uses(s, lo, hi))
            return s;
    for (int d = 0; d < MAX_DEV; d++)
        if (queue_uses(&g_legacy[d], lo, hi))
            return &g_legacy[d];
    return NULL;
}

/* ------------------------------------------------------ fake-only API */

void fake_stream_hold(cudaStream_t h)
{
    struct fstream *s;

    lock();
    if ((s = stream_of(h)))
        enqueue(s, new_op(OP_HOLD));
    trace("fake_stream_hold", 0, "s=%p", (void *)h);
    unlock();
}

void fake_stream_drain(cudaStream_t h)
{
    struct fstream *s;

    lock();
    if ((s = stream_of(h))) {
        for (struct op *o = s->head; o; o = o->next)
            if (o->kind == OP_HOLD)
                o->released = true;
        progress();
    }
    trace("fake_stream_drain", 0, "s=%p", (void *)h);
    unlock();
}

void fake_launch(cudaStream_t h, const void *p, size_t n)
{
    struct fstream *s;

    lock();
    if ((s = stream_of(h)) && n)
        enqueue(s, mem_op(OP_USE, p, n));
    trace("fake_launch", 0, "s=%p p=%p n=%zu", (void *)h, p, n);
    unlock();
}

/* Queues o (made by the caller) on h; cudaErrorInvalidResourceHandle, and o
 * freed, when h is no stream.  The last-error slot is left alone: the test
 * kernels' launch status is cudaGetLastError after the launch, which clears
 * it (tests/gpu/kernels.cu). */
static cudaError_t enqueue_kernel(cudaStream_t h, struct op *o, const char *fn)
{
    struct fstream *s;
    cudaError_t e;

    lock();
    e = inj_rt(fn, cudaErrorUnknown);
    s = e == cudaSuccess ? stream_of(h) : NULL;
    if (e == cudaSuccess && !s)
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        enqueue(s, o);
    else
        free(o);
    trace(fn, e, "s=%p", (void *)h);
    unlock();
    return e;
}

cudaError_t fake_enqueue_spin(cudaStream_t h, uint64_t ns)
{
    struct op *o = new_op(OP_SPIN);

    o->ns = ns;
    return enqueue_kernel(h, o, "fake_enqueue_spin");
}

cudaError_t fake_enqueue_fill(cudaStream_t h, void *p, size_t n, uint32_t tag)
{
    struct op *o = mem_op(OP_FILL, p, n);

    o->tag = tag;
    return enqueue_kernel(h, o, "fake_enqueue_fill");
}

cudaError_t fake_enqueue_count(cudaStream_t h, const void *p, size_t n, uint32_t tag, unsigned long long *bad)
{
    struct op *o = mem_op(OP_COUNT, p, n);

    o->tag = tag;
    o->bad = bad;
    return enqueue_kernel(h, o, "fake_enqueue_count");
}

/* The launch succeeds; the broken context shows in every later call. */
cudaError_t fake_trap(cudaStream_t h)
{
    cudaError_t e;

    lock();
    e = inj_rt("fake_trap", cudaErrorUnknown);
    if (e == cudaSuccess && !stream_of(h))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        g_sticky = cudaErrorLaunchFailure;
    trace("fake_trap", e, "s=%p", (void *)h);
    unlock();
    return e;
}

bool fake_fail_next(const char *fn, unsigned long k, int code)
{
    struct fail *f;
    unsigned long *n;
    bool ok;

    lock();
    /* A failure that has fired leaves its slot to the next: the table
     * bounds the pending ones (a long fault-injection run arms thousands). */
    int slot = g_nfail;
    for (int i = 0; i < g_nfail; i++)
        if (g_fail[i].used) {
            slot = i;
            break;
        }
    ok = fn && strlen(fn) < sizeof f->name && k >= 1 && code >= 0 && slot < MAX_FAIL;
    if (ok) {
        n = count_of(fn, false);
        f = &g_fail[slot];
        if (slot == g_nfail)
            g_nfail++;
        snprintf(f->name, sizeof f->name, "%s", fn);
        f->nth = (n ? *n : 0) + k;
        f->code = code;
        f->used = false;
    }
    unlock();
    return ok;
}

unsigned long fake_calls(const char *fn)
{
    unsigned long *n;
    unsigned long r;

    lock();
    n = count_of(fn, false);
    r = n ? *n : 0;
    unlock();
    return r;
}

bool fake_primary_made(int dev)
{
    bool made;

    lock();
    made = dev >= 0 && dev < g_ndev && g_primary[dev];
    unlock();
    return made;
}

unsigned long fake_violations(void)
{
    unsigned long n;

    lock();
    n = g_violations;
    unlock();
    return n;
}

unsigned long fake_blocking_syncs(void)
{
    unsigned long n;

    lock();
    n = g_blocking_syncs;
    unlock();
    return n;
}

int fake_report(FILE *f)
{
    int n = 0;
    bool ok = true;

    lock();
    for (struct dalloc *a = g_allocs; a; a = a->next, n++)
        ok = ok && fprintf(f, "leak: cudaMalloc %#lx size %zu\n", (unsigned long)a->p, a->size) >= 0;
    for (struct vmapping *m = g_maps; m; m = m->next, n++)
        ok = ok && fprintf(f, "leak: mapping %#lx size %zu\n", (unsigned long)m->p, m->size) >= 0;
    for (struct vres *r = g_res; r; r = r->next, n++)
        ok = ok && fprintf(f, "leak: reservation %#lx size %zu\n", (unsigned long)r->base, r->size) >= 0;
    for (struct hostreg *h = g_hostregs; h; h = h->next, n++)
        ok = ok && fprintf(f, "leak: host registration %#lx size %zu\n", (unsigned long)h->p, h->size) >= 0;
    for (struct fevent *e = g_events; e; e = e->next)
        if (!e->destroyed && !e->internal) {
            n++;
            ok = ok && fprintf(f, "leak: event %p\n", (void *)e) >= 0;
        }
    for (int d = 0; d < MAX_DEV; d++)
        if (g_used[d]) {
            n++;
            ok = ok && fprintf(f, "leak: device %d still holds %zu bytes (a handle never released?)\n", d,
                               g_used[d]) >= 0;
        }
    unlock();
    return ok && fflush(f) == 0 ? n : -1;
}

/* ------------------------------------------------------- runtime API */

static const char *const err_names[] = {
    [cudaSuccess] = "cudaSuccess",
    [cudaErrorInvalidValue] = "cudaErrorInvalidValue",
    [cudaErrorMemoryAllocation] = "cudaErrorMemoryAllocation",
    [cudaErrorInitializationError] = "cudaErrorInitializationError",
    [cudaErrorStubLibrary] = "cudaErrorStubLibrary",
    [cudaErrorInvalidDevice] = "cudaErrorInvalidDevice",
    [cudaErrorNoDevice] = "cudaErrorNoDevice",
    [cudaErrorNotReady] = "cudaErrorNotReady",
    [cudaErrorInvalidResourceHandle] = "cudaErrorInvalidResourceHandle",
    [cudaErrorHostMemoryAlreadyRegistered] = "cudaErrorHostMemoryAlreadyRegistered",
    [cudaErrorHostMemoryNotRegistered] = "cudaErrorHostMemoryNotRegistered",
    [cudaErrorLaunchFailure] = "cudaErrorLaunchFailure",
    [cudaErrorUnknown] = "cudaErrorUnknown",
};

const char *cudaGetErrorName(cudaError_t e)
{
    if ((unsigned)e < sizeof err_names / sizeof *err_names && err_names[e])
        return err_names[e];
    return "cudaErrorFake";
}

const char *cudaGetErrorString(cudaError_t e)
{
    return cudaGetErrorName(e);
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e;

    lock();
    e = g_init_error != cudaSuccess ? g_init_error : g_sticky;
    unlock();
    if (e == cudaSuccess) {
        e = t_last;
        t_last = cudaSuccess;
    }
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    cudaError_t e;

    lock();
    e = g_init_error != cudaSuccess ? g_init_error : g_sticky;
    unlock();
    return e != cudaSuccess ? e : t_last;
}

cudaError_t cudaGetDeviceCount(int *count)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaGetDeviceCount", cudaErrorUnknown);
    if (e == cudaSuccess && !count)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && g_ndev == 0)
        e = cudaErrorNoDevice;
    if (e == cudaSuccess)
        *count = g_ndev;
    trace("cudaGetDeviceCount", e, "-> %d", g_ndev);
    unlock();
    return rt(e);
}

cudaError_t cudaGetDevice(int *dev)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaGetDevice", cudaErrorUnknown);
    if (e == cudaSuccess && !dev)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && g_ndev == 0)
        e = cudaErrorNoDevice;
    if (e == cudaSuccess)
        *dev = t_dev;
    trace("cudaGetDevice", e, "-> %d", t_dev);
    unlock();
    return rt(e);
}

cudaError_t cudaSetDevice(int dev)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaSetDevice", cudaErrorUnknown);
    if (e == cudaSuccess && (dev < 0 || dev >= g_ndev))
        e = cudaErrorInvalidDevice;
    if (e == cudaSuccess) {
        /* Binds dev's primary context: in place of a pushed context on top
         * of the stack, else as the runtime's own. */
        if (t_depth > 0) {
            t_stack[t_depth - 1] = dev;
        } else {
            t_rt_dev = dev;
            t_rt_ctx = true;
        }
        g_primary[dev] = true;
    }
    trace("cudaSetDevice", e, "dev=%d", dev);
    unlock();
    return rt(e);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int dev)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaGetDeviceProperties", cudaErrorUnknown);
    if (e == cudaSuccess && !prop)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && (dev < 0 || dev >= g_ndev))
        e = cudaErrorInvalidDevice;
    if (e == cudaSuccess) {
        memset(prop, 0, sizeof *prop);
        snprintf(prop->name, sizeof prop->name, "Fake GPU %d", dev);
        prop->totalGlobalMem = g_total;
        prop->major = 9;
        prop->minor = 0;
    }
    trace("cudaGetDeviceProperties", e, "dev=%d", dev);
    unlock();
    return rt(e);
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaMemGetInfo", cudaErrorUnknown);
    if (e == cudaSuccess) {
        bind_ctx();
        if (free_b)
            *free_b = g_total > g_used[t_dev] ? g_total - g_used[t_dev] : 0;
        if (total_b)
            *total_b = g_total;
    }
    trace("cudaMemGetInfo", e, "dev=%d used=%zu", t_dev, g_used[t_dev]);
    unlock();
    return rt(e);
}

cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaDeviceSynchronize", cudaErrorUnknown);
    if (e == cudaSuccess) {
        bind_ctx();
        sync_device(t_dev);
    }
    trace("cudaDeviceSynchronize", e, "dev=%d", t_dev);
    unlock();
    return rt(e);
}

cudaError_t cudaMalloc(void **p, size_t size)
{
    size_t acct = round_up(size ? size : 1, MALLOC_UNIT);
    void *m = NULL;
    cudaError_t e;

    lock();
    e = inj_rt("cudaMalloc", cudaErrorMemoryAllocation);
    if (e == cudaSuccess && !p)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && size > 0 && (acct > g_total || g_used[t_dev] > g_total - acct))
        e = cudaErrorMemoryAllocation;
    if (e == cudaSuccess && size > 0) {
        m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            m = NULL;
            e = cudaErrorMemoryAllocation;
        }
    }
    if (e == cudaSuccess && m) {
        struct dalloc *a = zalloc(sizeof *a);

        a->p = (uintptr_t)m;
        a->size = size;
        a->acct = acct;
        a->device = t_dev;
        a->next = g_allocs;
        g_allocs = a;
        g_used[t_dev] += acct;
        bind_ctx();
    }
    if (e == cudaSuccess)
        *p = m; /* NULL for 0 bytes */
    trace("cudaMalloc", e, "dev=%d size=%zu -> %p", t_dev, size, m);
    unlock();
    return rt(e);
}

cudaError_t cudaFree(void *p)
{
    struct dalloc **pp = &g_allocs;
    cudaError_t e;

    lock();
    e = inj_rt("cudaFree", cudaErrorUnknown);
    if (e == cudaSuccess && p) {
        while (*pp && (*pp)->p != (uintptr_t)p)
            pp = &(*pp)->next;
        if (!*pp)
            e = cudaErrorInvalidValue;
    }
    if (e == cudaSuccess && p) {
        struct dalloc *a = *pp;

        /* cudaFree synchronises the block's device first. */
        sync_device(a->device);
        if (busy(a->p, a->p + a->size))
            violation("cudaFree(%p) while a kernel uses it", p);
        if (a->device != t_dev)
            violation("cudaFree(%p) of device %d with device %d current", p, a->device, t_dev);
        g_used[a->device] -= a->acct;
        *pp = a->next;
        if (munmap((void *)a->p, a->size) != 0)
            die("munmap", errno);
        free(a);
    }
    trace("cudaFree", e, "p=%p", p);
    unlock();
    return rt(e);
}

/* The synchronous set and copy: after the legacy stream's earlier work (and
 * with it every blocking stream's). */
cudaError_t cudaMemset(void *p, int v, size_t n)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaMemset", cudaErrorUnknown);
    if (e == cudaSuccess) {
        bind_ctx();
        sync_stream(&g_legacy[t_dev]);
    }
    trace("cudaMemset", e, "p=%p n=%zu", p, n);
    unlock();
    if (e == cudaSuccess)
        memset(p, v, n);
    return rt(e);
}

cudaError_t cudaMemcpy(void *d, const void *src, size_t n, enum cudaMemcpyKind k)
{
    cudaError_t e;

    lock();
    e = inj_rt("cudaMemcpy", cudaErrorUnknown);
    if (e == cudaSuccess) {
        bind_ctx();
        sync_stream(&g_legacy[t_dev]);
    }
    trace("cudaMemcpy", e, "%p <- %p n=%zu kind=%d", d, src, n, (int)k);
    unlock();
    if (e == cudaSuccess)
        memmove(d, src, n);
    return rt(e);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t h)
{
    struct op *o = mem_op(OP_MEMSET, p, n);

    o->tag = (uint32_t)(unsigned char)v;
    return rt(enqueue_kernel(h, o, "cudaMemsetAsync"));
}

static cudaError_t stream_create(cudaStream_t *out, unsigned flags, const char *fn)
{
    struct fstream *s = NULL;
    cudaError_t e;

    lock();
    e = inj_rt(fn, cudaErrorUnknown);
    if (e == cudaSuccess && !out)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess) {
        s = new_stream(t_dev, (flags & cudaStreamNonBlocking) != 0);
        bind_ctx();
        *out = (cudaStream_t)s;
    }
    trace(fn, e, "dev=%d -> %p id=%llu", t_dev, (void *)s, s ? s->id : 0);
    unlock();
    return rt(e);
}

cudaError_t cudaStreamCreate(cudaStream_t *out)
{
    return stream_create(out, 0, "cudaStreamCreate");
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned int flags)
{
    return stream_create(out, flags, "cudaStreamCreateWithFlags");
}

cudaError_t cudaStreamDestroy(cudaStream_t h)
{
    struct fstream *s = NULL;
    cudaError_t e;

    lock();
    e = inj_rt("cudaStreamDestroy", cudaErrorUnknown);
    if (e == cudaSuccess && h != NULL && h != cudaStreamLegacy && h != cudaStreamPerThread)
        s = stream_of(h);
    if (e == cudaSuccess && !s)
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        s->destroyed = true; /* kept: a later use is refused, never a crash */
    trace("cudaStreamDestroy", e, "s=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaStreamGetId(cudaStream_t h, unsigned long long *id)
{
    struct fstream *s = NULL;
    cudaError_t e;

    lock();
    e = inj_rt("cudaStreamGetId", cudaErrorUnknown);
    if (e == cudaSuccess && !id)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && !(s = stream_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        *id = s->id;
    trace("cudaStreamGetId", e, "s=%p -> %llu", (void *)h, s ? s->id : 0);
    unlock();
    return rt(e);
}

cudaError_t cudaStreamGetDevice(cudaStream_t h, int *dev)
{
    struct fstream *s;
    cudaError_t e;

    lock();
    e = inj_rt("cudaStreamGetDevice", cudaErrorUnknown);
    if (e == cudaSuccess && !dev)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess && !(s = stream_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        *dev = s->device;
    trace("cudaStreamGetDevice", e, "s=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaStreamSynchronize(cudaStream_t h)
{
    struct fstream *s;
    cudaError_t e;

    lock();
    e = inj_rt("cudaStreamSynchronize", cudaErrorUnknown);
    if (e == cudaSuccess && !(s = stream_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess) {
        bind_ctx();
        sync_stream(s);
    }
    trace("cudaStreamSynchronize", e, "s=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t evh, unsigned int flags)
{
    struct fstream *s = NULL;
    struct fevent *ev = NULL;
    cudaError_t e;

    (void)flags;
    lock();
    e = inj_rt("cudaStreamWaitEvent", cudaErrorUnknown);
    if (e == cudaSuccess) {
        s = stream_of(h);
        ev = event_of(evh);
        if (!s || !ev)
            e = cudaErrorInvalidResourceHandle;
    }
    if (e == cudaSuccess && !event_done(ev)) {
        struct op *w = new_op(OP_WAIT);

        w->ev = ev;
        w->seq = ev->rec_seq;
        enqueue(s, w);
    }
    trace("cudaStreamWaitEvent", e, "s=%p ev=%p", (void *)h, (void *)evh);
    unlock();
    return rt(e);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned int flags)
{
    struct fevent *ev = NULL;
    cudaError_t e;

    (void)flags;
    lock();
    e = inj_rt("cudaEventCreateWithFlags", cudaErrorUnknown);
    if (e == cudaSuccess && !out)
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess) {
        ev = new_event(t_dev, false);
        bind_ctx();
        *out = (cudaEvent_t)ev;
    }
    trace("cudaEventCreateWithFlags", e, "dev=%d -> %p", t_dev, (void *)ev);
    unlock();
    return rt(e);
}

cudaError_t cudaEventCreate(cudaEvent_t *out)
{
    return cudaEventCreateWithFlags(out, 0);
}

cudaError_t cudaEventDestroy(cudaEvent_t h)
{
    struct fevent *ev;
    cudaError_t e;

    lock();
    e = inj_rt("cudaEventDestroy", cudaErrorUnknown);
    bind_ctx(); /* as the runtime's lazy initialisation may (see the model) */
    if (e == cudaSuccess && !(ev = event_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        ev->destroyed = true; /* kept: records queued on streams still point to it */
    trace("cudaEventDestroy", e, "ev=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t sh)
{
    struct fevent *ev = NULL;
    struct fstream *s = NULL;
    cudaError_t e;

    lock();
    e = inj_rt("cudaEventRecord", cudaErrorUnknown);
    if (e == cudaSuccess) {
        ev = event_of(h);
        s = stream_of(sh);
        if (!ev || !s || ev->device != s->device)
            e = cudaErrorInvalidResourceHandle;
    }
    if (e == cudaSuccess)
        enqueue(s, record_op(ev, s));
    trace("cudaEventRecord", e, "ev=%p s=%p sid=%llu held=%d", (void *)h, (void *)sh, s ? s->id : 0,
          s ? held(s) : 0);
    unlock();
    return rt(e);
}

cudaError_t cudaEventQuery(cudaEvent_t h)
{
    struct fevent *ev;
    cudaError_t e;

    lock();
    e = inj_rt("cudaEventQuery", cudaErrorUnknown);
    bind_ctx(); /* as the runtime's lazy initialisation may (see the model) */
    if (e == cudaSuccess && !(ev = event_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess) {
        progress();
        if (!event_done(ev))
            e = cudaErrorNotReady;
    }
    trace("cudaEventQuery", e, "ev=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaEventSynchronize(cudaEvent_t h)
{
    struct fevent *ev;
    cudaError_t e;

    lock();
    e = inj_rt("cudaEventSynchronize", cudaErrorUnknown);
    bind_ctx(); /* as the runtime's lazy initialisation may (see the model) */
    if (e == cudaSuccess && !(ev = event_of(h)))
        e = cudaErrorInvalidResourceHandle;
    if (e == cudaSuccess)
        wait_until(ev_done_cb, ev, ev_kick_cb);
    trace("cudaEventSynchronize", e, "ev=%p", (void *)h);
    unlock();
    return rt(e);
}

cudaError_t cudaHostRegister(void *p, size_t size, unsigned int flags)
{
    cudaError_t e;

    (void)flags;
    lock();
    e = inj_rt("cudaHostRegister", cudaErrorMemoryAllocation);
    if (e == cudaSuccess && (!p || !size))
        e = cudaErrorInvalidValue;
    for (struct hostreg *r = g_hostregs; e == cudaSuccess && r; r = r->next)
        if ((uintptr_t)p < r->p + r->size && r->p < (uintptr_t)p + size)
            e = cudaErrorHostMemoryAlreadyRegistered;
    if (e == cudaSuccess) {
        struct hostreg *r = zalloc(sizeof *r);

        r->p = (uintptr_t)p;
        r->size = size;
        r->next = g_hostregs;
        g_hostregs = r;
        bind_ctx();
    }
    trace("cudaHostRegister", e, "p=%p size=%zu", p, size);
    unlock();
    return rt(e);
}

cudaError_t cudaHostUnregister(void *p)
{
    struct hostreg **pp = &g_hostregs;
    cudaError_t e;

    lock();
    e = inj_rt("cudaHostUnregister", cudaErrorUnknown);
    while (e == cudaSuccess && *pp && (*pp)->p != (uintptr_t)p)
        pp = &(*pp)->next;
    if (e == cudaSuccess && !*pp)
        e = cudaErrorHostMemoryNotRegistered;
    if (e == cudaSuccess) {
        struct hostreg *r = *pp;

        if (busy(r->p, r->p + r->size))
            violation("cudaHostUnregister(%p) while a kernel uses it", p);
        *pp = r->next;
        free(r);
    }
    trace("cudaHostUnregister", e, "p=%p", p);
    unlock();
    return rt(e);
}

/* ------------------------------------------------------- driver VMM */
/* Reached only through cudaGetDriverEntryPointByVersion, as the real
 * driver's entry points are by a library that links cudart alone. */

static CUresult need_ctx(void)
{
    return cur_ctx() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult fk_cuDeviceGet(CUdevice *d, int ordinal)
{
    CUresult r;

    lock();
    r = inj_drv("cuDeviceGet", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && (!d || ordinal < 0 || ordinal >= g_ndev))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (r == CUDA_SUCCESS)
        *d = ordinal;
    trace("cuDeviceGet", r, "%d", ordinal);
    unlock();
    return r;
}

static CUresult fk_cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
    CUresult r;

    lock();
    r = inj_drv("cuDeviceGetAttribute", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && !v)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && (d < 0 || d >= g_ndev))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (r == CUDA_SUCCESS) {
        if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
            *v = g_vmm;
        else if (a == CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
            *v = g_rdma;
        else
            *v = 0;
    }
    trace("cuDeviceGetAttribute", r, "attr=%d dev=%d", (int)a, d);
    unlock();
    return r;
}

static CUresult fk_cuCtxGetCurrent(CUcontext *c)
{
    CUresult r;

    lock();
    r = inj_drv("cuCtxGetCurrent", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && !c)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        *c = cur_ctx() ? FAKE_CTX(t_dev) : NULL;
    trace("cuCtxGetCurrent", r, "dev=%d ctx=%d", t_dev, (int)cur_ctx());
    unlock();
    return r;
}

/* The context handle of a device's primary context, and back (-1 for a
 * handle that is none). */
static int ctx_dev(CUcontext c)
{
    uintptr_t v = (uintptr_t)c;
    return v >= 0x1000 && v < 0x1000 + (uintptr_t)g_ndev ? (int)(v - 0x1000) : -1;
}

static CUresult fk_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    CUresult r;

    lock();
    r = inj_drv("cuDevicePrimaryCtxRetain", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && !c)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && (d < 0 || d >= g_ndev))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (r == CUDA_SUCCESS) {
        *c = FAKE_CTX(d);
        g_primary[d] = true;
        g_retained[d]++;
    }
    trace("cuDevicePrimaryCtxRetain", r, "dev=%d", d);
    unlock();
    return r;
}

static CUresult fk_cuDevicePrimaryCtxRelease(CUdevice d)
{
    CUresult r;

    lock();
    r = inj_drv("cuDevicePrimaryCtxRelease", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && (d < 0 || d >= g_ndev))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (r == CUDA_SUCCESS && g_retained[d] == 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS)
        g_retained[d]--;
    trace("cuDevicePrimaryCtxRelease", r, "dev=%d", d);
    unlock();
    return r;
}

static CUresult fk_cuCtxPushCurrent(CUcontext c)
{
    CUresult r;
    int d;

    lock();
    r = inj_drv("cuCtxPushCurrent", CUDA_ERROR_UNKNOWN);
    d = ctx_dev(c);
    if (r == CUDA_SUCCESS && (d < 0 || !g_primary[d]))
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS && t_depth == MAX_PUSH)
        r = CUDA_ERROR_OUT_OF_MEMORY; /* the fake's limit, not the driver's */
    if (r == CUDA_SUCCESS)
        t_stack[t_depth++] = d;
    trace("cuCtxPushCurrent", r, "dev=%d depth=%d", d, t_depth);
    unlock();
    return r;
}

/* Pops the current context: a pushed one, or else the runtime's own (the
 * thread then has none). */
static CUresult fk_cuCtxPopCurrent(CUcontext *c)
{
    CUresult r;
    int d = -1;

    lock();
    r = inj_drv("cuCtxPopCurrent", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && !cur_ctx())
        r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS) {
        if (t_depth > 0) {
            d = t_stack[--t_depth];
        } else {
            d = t_rt_dev;
            t_rt_ctx = false;
        }
        if (c)
            *c = FAKE_CTX(d);
    }
    trace("cuCtxPopCurrent", r, "dev=%d depth=%d", d, t_depth);
    unlock();
    return r;
}

static CUresult fk_cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p,
                                                 CUmemAllocationGranularity_flags f)
{
    CUresult r;

    (void)f;
    lock();
    r = inj_drv("cuMemGetAllocationGranularity", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && (!g || !p || p->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
                              p->location.type != CU_MEM_LOCATION_TYPE_DEVICE))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        *g = g_granule;
    trace("cuMemGetAllocationGranularity", r, "-> %zu", g_granule);
    unlock();
    return r;
}

static CUresult fk_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                       unsigned long long flags)
{
    void *m = MAP_FAILED;
    CUresult r;

    (void)addr;
    (void)flags;
    lock();
    r = inj_drv("cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY);
    if (align == 0)
        align = g_granule;
    if (r == CUDA_SUCCESS && (!ptr || size == 0 || size % g_granule || size > SIZE_MAX - align))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        /* Over-sized by the alignment, whose slack stays reserved too. */
        m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        struct vres *v = zalloc(sizeof *v);

        v->map_base = m;
        v->map_len = size + align;
        v->base = round_up((uintptr_t)m, align);
        v->size = size;
        v->next = g_res;
        g_res = v;
        *ptr = (CUdeviceptr)v->base;
    }
    trace("cuMemAddressReserve", r, "size=%zu -> %#llx", size,
          r == CUDA_SUCCESS ? (unsigned long long)*ptr : 0ull);
    unlock();
    return r;
}

static CUresult fk_cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct vres **pp = &g_res;
    CUresult r;

    lock();
    r = inj_drv("cuMemAddressFree", CUDA_ERROR_UNKNOWN);
    while (r == CUDA_SUCCESS && *pp && !((*pp)->base == ptr && (*pp)->size == size))
        pp = &(*pp)->next;
    if (r == CUDA_SUCCESS && !*pp)
        r = CUDA_ERROR_INVALID_VALUE;
    for (struct vmapping *m = g_maps; r == CUDA_SUCCESS && m; m = m->next)
        if (m->p >= ptr && m->p < ptr + size) {
            violation("cuMemAddressFree(%#llx) with a mapping left at %#lx", (unsigned long long)ptr,
                      (unsigned long)m->p);
            r = CUDA_ERROR_INVALID_VALUE;
        }
    if (r == CUDA_SUCCESS) {
        struct vres *v = *pp;

        *pp = v->next;
        if (munmap(v->map_base, v->map_len) != 0)
            die("munmap", errno);
        free(v);
    }
    trace("cuMemAddressFree", r, "ptr=%#llx size=%zu", (unsigned long long)ptr, size);
    unlock();
    return r;
}

static CUresult fk_cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    int dev = prop ? prop->location.id : -1;
    CUresult r;

    (void)flags;
    lock();
    r = inj_drv("cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY);
    if (r == CUDA_SUCCESS)
        r = need_ctx();
    if (r == CUDA_SUCCESS && (!h || dev < 0 || dev >= g_ndev || size == 0 || size % g_granule))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && (size > g_total || g_used[dev] > g_total - size))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS) {
        struct vhandle *v = zalloc(sizeof *v);

        v->size = size;
        v->device = dev;
        v->next = g_handles;
        if (g_handles)
            g_handles->prev = v;
        g_handles = v;
        g_used[dev] += size;
        *h = (CUmemGenericAllocationHandle)(uintptr_t)v;
    }
    trace("cuMemCreate", r, "size=%zu dev=%d", size, dev);
    unlock();
    return r;
}

/* The physical memory goes when its handle is released and unmapped
 * everywhere.  A handle used after that is undefined behaviour, as on
 * CUDA. */
static void handle_maybe_free(struct vhandle *v)
{
    if (v->released && v->nmaps == 0) {
        g_used[v->device] -= v->size;
        if (v->prev)
            v->prev->next = v->next;
        else
            g_handles = v->next;
        if (v->next)
            v->next->prev = v->prev;
        free(v);
    }
}

static CUresult fk_cuMemRelease(CUmemGenericAllocationHandle h)
{
    struct vhandle *v = (struct vhandle *)(uintptr_t)h;
    CUresult r;

    lock();
    r = inj_drv("cuMemRelease", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS && (!v || v->released))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        v->released = true;
        handle_maybe_free(v);
    }
    trace("cuMemRelease", r, "h=%p", (void *)v);
    unlock();
    return r;
}

static bool reserved(uintptr_t p, size_t n)
{
    for (struct vres *v = g_res; v; v = v->next)
        if (p >= v->base && n <= v->size && p - v->base <= v->size - n)
            return true;
    return false;
}

static CUresult fk_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                            unsigned long long flags)
{
    struct vhandle *v = (struct vhandle *)(uintptr_t)h;
    CUresult r;

    (void)flags;
    lock();
    r = inj_drv("cuMemMap", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS)
        r = need_ctx();
    if (r == CUDA_SUCCESS && (!v || v->released || offset != 0 || size != v->size || !reserved(ptr, size)))
        r = CUDA_ERROR_INVALID_VALUE;
    for (struct vmapping *m = g_maps; r == CUDA_SUCCESS && m; m = m->next)
        if (m->p < ptr + size && ptr < m->p + m->size)
            r = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    if (r == CUDA_SUCCESS) {
        struct vmapping *m = zalloc(sizeof *m);

        m->p = ptr;
        m->size = size;
        m->h = v;
        m->next = g_maps;
        g_maps = m;
        v->nmaps++;
        /* Undefined content, and no access until cuMemSetAccess. */
        protect(ptr, size, PROT_READ | PROT_WRITE);
        memset((void *)ptr, 0xA5, size);
        protect(ptr, size, PROT_NONE);
    }
    trace("cuMemMap", r, "ptr=%#llx size=%zu", (unsigned long long)ptr, size);
    unlock();
    return r;
}

static CUresult fk_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    size_t covered = 0;
    CUresult r;

    lock();
    r = inj_drv("cuMemUnmap", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS)
        r = need_ctx();
    /* The range must be made of whole mappings. */
    for (struct vmapping *m = g_maps; r == CUDA_SUCCESS && m; m = m->next)
        if (m->p < ptr + size && ptr < m->p + m->size) {
            if (m->p < ptr || m->p + m->size > ptr + size)
                r = CUDA_ERROR_INVALID_VALUE;
            covered += m->size;
        }
    if (r == CUDA_SUCCESS && covered != size)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        struct fstream *l = busy(ptr, ptr + size);
        struct vmapping **pp = &g_maps;

        if (l)
            violation("cuMemUnmap(%#llx, %zu) while a kernel queued on stream id %llu (not run yet) uses it",
                      (unsigned long long)ptr, size, l->id);
        while (*pp) {
            struct vmapping *m = *pp;

            if (m->p >= ptr && m->p < ptr + size) {
                *pp = m->next;
                m->h->nmaps--;
                handle_maybe_free(m->h);
                free(m);
            } else {
                pp = &m->next;
            }
        }
        if (madvise((void *)ptr, size, MADV_DONTNEED) != 0)
            die("madvise", errno);
        protect(ptr, size, PROT_NONE);
    }
    trace("cuMemUnmap", r, "ptr=%#llx size=%zu", (unsigned long long)ptr, size);
    unlock();
    return r;
}

static CUresult fk_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    size_t covered = 0;
    CUresult r;

    lock();
    r = inj_drv("cuMemSetAccess", CUDA_ERROR_UNKNOWN);
    if (r == CUDA_SUCCESS)
        r = need_ctx();
    if (r == CUDA_SUCCESS && (!desc || count == 0 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
                              desc->location.id < 0 || desc->location.id >= g_ndev))
        r = CUDA_ERROR_INVALID_VALUE;
    for (struct vmapping *m = g_maps; r == CUDA_SUCCESS && m; m = m->next)
        if (m->p < ptr + size && ptr < m->p + m->size)
            covered += m->size;
    if (r == CUDA_SUCCESS && covered != size)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        for (struct vmapping *m = g_maps; m; m = m->next)
            if (m->p < ptr + size && ptr < m->p + m->size)
                m->access = true;
        protect(ptr, size, PROT_READ | PROT_WRITE);
    }
    trace("cuMemSetAccess", r, "ptr=%#llx size=%zu", (unsigned long long)ptr, size);
    unlock();
    return r;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status)
{
    static const struct {
        const char *name;
        void *fn;
    } table[] = {
        {"cuDeviceGet", (void *)fk_cuDeviceGet},
        {"cuDeviceGetAttribute", (void *)fk_cuDeviceGetAttribute},
        {"cuCtxGetCurrent", (void *)fk_cuCtxGetCurrent},
        {"cuCtxPushCurrent", (void *)fk_cuCtxPushCurrent},
        {"cuCtxPopCurrent", (void *)fk_cuCtxPopCurrent},
        {"cuDevicePrimaryCtxRetain", (void *)fk_cuDevicePrimaryCtxRetain},
        {"cuDevicePrimaryCtxRelease", (void *)fk_cuDevicePrimaryCtxRelease},
        {"cuMemGetAllocationGranularity", (void *)fk_cuMemGetAllocationGranularity},
        {"cuMemAddressReserve", (void *)fk_cuMemAddressReserve},
        {"cuMemAddressFree", (void *)fk_cuMemAddressFree},
        {"cuMemCreate", (void *)fk_cuMemCreate},
        {"cuMemRelease", (void *)fk_cuMemRelease},
        {"cuMemMap", (void *)fk_cuMemMap},
        {"cuMemUnmap", (void *)fk_cuMemUnmap},
        {"cuMemSetAccess", (void *)fk_cuMemSetAccess},
    };
    cudaError_t e;

    (void)flags;
    lock();
    e = inj_rt("cudaGetDriverEntryPointByVersion", cudaErrorUnknown);
    if (e == cudaSuccess && (!symbol || !fn || version > CUDART_VERSION))
        e = cudaErrorInvalidValue;
    if (e == cudaSuccess) {
        *fn = NULL;
        if (status)
            *status = cudaDriverEntryPointSymbolNotFound;
        for (size_t i = 0; i < sizeof table / sizeof *table; i++)
            if (strcmp(table[i].name, symbol) == 0) {
                *fn = table[i].fn;
                if (status)
                    *status = cudaDriverEntryPointSuccess;
            }
    }
    trace("cudaGetDriverEntryPointByVersion", e, "%s v%u", symbol ? symbol : "(null)", version);
    unlock();
    return rt(e);
}
