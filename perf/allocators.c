/*
 * allocators.c -- what shardbfc-perf compares, each behind struct
 * perf_alloc_ops (perf.h).
 *
 *   shardbfc     libshardbfc as an inference server uses it: one context,
 *                one stream per thread (SIM streams, or CUDA streams with
 *                --backend cuda), bfc_ctx_alloc / bfc_ctx_free; host mode:
 *                bfc_host_alloc / bfc_host_free.
 *   shardbfc-ctx the same with a context of its own for each thread (each
 *                producer/consumer pair in cross): whatever the threads
 *                still share is process-wide or in the memory layout, not
 *                the context.  Not in host mode (the host arenas are
 *                process-wide).
 *   single-lock  the same library as TensorFlow's BFCAllocator is used: one
 *                context, ONE stream for every thread, every call inside one
 *                global pthread mutex (TF locks once in AllocateRaw and once
 *                in DeallocateRaw); its pair op takes the mutex once for a
 *                free and the allocation after it (--lock-scope pair).
 *   jemalloc     mallocx / sdallocx on the same size sequence (host floor).
 *   malloc       glibc's own allocator through __libc_malloc / __libc_free:
 *                this program links jemalloc, which replaces malloc() in the
 *                whole process, so a plain malloc() call would measure
 *                jemalloc again.
 *   cuda         cudaMalloc / cudaFree (host mode: cudaHostAlloc / cudaFreeHost).
 *   cuda-async   cudaMallocAsync / cudaFreeAsync on the device's default
 *                pool with cudaMemPoolAttrReleaseThreshold = UINT64_MAX, so
 *                the pool caches instead of returning memory at each sync.
 *   torch        PyTorch's CUDA caching allocator driven from C++
 *                (raw_alloc_with_stream / raw_delete), through
 *                perf/libshardbfc_perf_torch.so (perf/torch_shim.cc), which
 *                is built only where a libtorch with CUDA exists (`make
 *                perf-torch TORCH_DIR=...`) and dlopen()ed at run time from
 *                $SHARDBFC_PERF_TORCH or beside this program.
 * The CUDA allocators are compiled only when BFC_HAVE_CUDA, and init
 * refuses (the run is listed as skipped, with the reason) when no device is
 * usable, or for torch when the shim is not there.
 *
 * Memory reporting: libshardbfc's peak_bytes_reserved (bfc_ctx_stats, or
 * bfc_host_stats, summed over the contexts) from fresh contexts per run,
 * and the whole bfc_stats_t for the harness's checks (snapshot); cudaMallocAsync's
 * cudaMemPoolAttrReservedMemHigh.  jemalloc, glibc and cudaMalloc cannot
 * report a peak of what they hold without sampling their global statistics
 * in the timed loop, so they report nothing (null in the JSON).
 *
 * Thread-safety: alloc and free are called from the measuring threads at
 * once; init, stats and fini from the main thread between runs.
 */
#include "config.h"

#include "perf.h"
#include "perfutil.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jemalloc/jemalloc.h>
#include <shardbfc_sim.h>

#if BFC_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* glibc's own entry points, under their internal names. */
extern void *__libc_malloc(size_t n);
extern void __libc_free(void *p);

struct bfc_state {
    bfc_ctx_t *ctx;          /* ctxs[0]; NULL in host mode */
    bfc_ctx_t **ctxs;        /* nctx contexts (shardbfc-ctx: one per group) */
    unsigned nctx;
    /* shardbfc-ctx: the context of each caller (the `thread` argument) */
    bfc_ctx_t *ctx_of[2 * PERF_MAX_THREADS];
    bool cuda_streams;       /* streams are cudaStreams we created */
    bool locked;             /* single-lock */
    unsigned ndistinct;      /* distinct streams created */
    pthread_mutex_t lock;
};

/* ------------------------------------------------------------ streams */

/* Stream i of n belongs to context i / (n / nctx) (equal consecutive
 * groups); with one context, to it. */
static bfc_ctx_t *stream_ctx(bfc_ctx_t *const *ctxs, unsigned nctx, unsigned i, unsigned n)
{
    unsigned per = nctx > 1 && n >= nctx ? n / nctx : n;
    if (ctxs == NULL)
        return NULL;
    return ctxs[per == 0 || nctx <= 1 ? 0 : (i / per < nctx ? i / per : nctx - 1)];
}

static const char *make_streams(struct perf_allocator *a, bfc_ctx_t *const *ctxs,
                                unsigned nctx, bool cuda, unsigned distinct, unsigned n)
{
    a->streams = perf_xcalloc(n ? n : 1, sizeof(*a->streams));
    a->nstreams = n;
    for (unsigned i = 0; i < distinct; i++) {
        bfc_ctx_t *ctx = stream_ctx(ctxs, nctx, i, n);
        if (cuda) {
#if BFC_HAVE_CUDA
            cudaStream_t s;
            if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
                return "cudaStreamCreateWithFlags failed";
            a->streams[i] = (bfc_stream_t)s;
#else
            return "built without CUDA";
#endif
        } else if (ctx != NULL) {
            a->streams[i] = bfc_sim_stream_create(ctx);
            if (a->streams[i] == NULL)
                return "bfc_sim_stream_create failed";
        }
    }
    for (unsigned i = distinct; i < n; i++)
        a->streams[i] = distinct ? a->streams[i % distinct] : NULL;
    return NULL;
}

static void drop_streams(struct perf_allocator *a, bfc_ctx_t *const *ctxs, unsigned nctx,
                         bool cuda, unsigned distinct)
{
    for (unsigned i = 0; i < distinct && a->streams != NULL; i++) {
        bfc_ctx_t *ctx = stream_ctx(ctxs, nctx, i, a->nstreams);
        if (a->streams[i] == NULL)
            continue;
        if (cuda) {
#if BFC_HAVE_CUDA
            (void)cudaStreamDestroy((cudaStream_t)a->streams[i]);
#endif
        } else if (ctx != NULL) {
            bfc_sim_stream_destroy(ctx, a->streams[i]);
        }
    }
    free(a->streams);
    a->streams = NULL;
    a->nstreams = 0;
}

/* ---------------------------------------------------------- libshardbfc */

static const char *bfc_init_common(struct perf_allocator *a, const struct perf_env *env,
                                   enum perf_mem mem, unsigned nstreams, bool locked,
                                   bool per_group)
{
    struct bfc_state *st = perf_xcalloc(1, sizeof(*st));
    const char *why;
    a->state = st;
    a->mem = mem;
    st->locked = locked;
    perf_check(pthread_mutex_init(&st->lock, NULL), "pthread_mutex_init");
    if (mem == PERF_MEM_HOST) {
        if (per_group)
            return "the host arenas are process-wide: no context of its own per thread";
        /* The process-wide host arenas: start each run from what they hold
         * now, with fully free regions given back and the peaks reset. */
        for (int node = 0; node < bfc_host_numa_nodes(); node++) {
            bfc_ctx_t *hc = bfc_host_ctx(node);
            if (hc != NULL) {
                (void)bfc_ctx_trim(hc);
                (void)bfc_ctx_clear_peaks(hc);
            }
        }
        return make_streams(a, NULL, 0, false, 0, nstreams);
    }
    st->nctx = per_group && a->ncontexts > 1 ? a->ncontexts : 1;
    if (st->nctx > nstreams && nstreams > 0)
        st->nctx = nstreams;
    st->ctxs = perf_xcalloc(st->nctx, sizeof(*st->ctxs));
    for (unsigned k = 0; k < st->nctx; k++) {
        bfc_config_t cfg;
        int rc;
        bfc_config_init(&cfg);
        cfg.allow_growth = true;
        if (env->backend_cuda) {
            if (!BFC_HAVE_CUDA)
                return "built without CUDA (--backend cuda)";
            if (!env->gpu)
                return env->no_gpu_reason;
            cfg.backend = BFC_BACKEND_CUDA;
        } else {
            cfg.backend = BFC_BACKEND_SIM;
            cfg.memory_limit = (size_t)64 << 30; /* address space only (MAP_NORESERVE) */
        }
        /* --conf was checked when parsed; it still fails for a context
         * whose other settings it contradicts. */
        if (env->conf && bfc_config_parse(&cfg, env->conf) != BFC_OK)
            return "--conf does not apply";
        rc = bfc_ctx_create(&cfg, &st->ctxs[k]);
        if (rc != BFC_OK) {
            st->ctxs[k] = NULL;
            return bfc_strerror(rc);
        }
        if (!env->backend_cuda)
            bfc_sim_set_vmm_cost(st->ctxs[k], env->sim_vmm_cost);
    }
    st->ctx = st->ctxs[0];
    {
        /* Caller t uses the context of its group; callers beyond the table
         * (never: at most 2 per thread) share the last. */
        unsigned cpc = a->callers_per_ctx ? a->callers_per_ctx : 1;
        for (unsigned t = 0; t < 2 * PERF_MAX_THREADS; t++)
            st->ctx_of[t] = st->ctxs[t / cpc < st->nctx ? t / cpc : st->nctx - 1];
    }
    st->cuda_streams = env->backend_cuda;
    st->ndistinct = locked ? 1 : nstreams;
    why = make_streams(a, st->ctxs, st->nctx, st->cuda_streams, st->ndistinct, nstreams);
    return why;
}

static const char *bfc_init(struct perf_allocator *a, const struct perf_env *env,
                            enum perf_mem mem, unsigned nstreams)
{
    return bfc_init_common(a, env, mem, nstreams, false, false);
}

static const char *ctx_init(struct perf_allocator *a, const struct perf_env *env,
                            enum perf_mem mem, unsigned nstreams)
{
    return bfc_init_common(a, env, mem, nstreams, false, true);
}

static const char *lock_init(struct perf_allocator *a, const struct perf_env *env,
                             enum perf_mem mem, unsigned nstreams)
{
    return bfc_init_common(a, env, mem, nstreams, true, false);
}

static void *bfc_alloc_fn(struct perf_allocator *a, unsigned thread, bfc_stream_t s,
                          size_t n)
{
    struct bfc_state *st = a->state;
    (void)thread;
    return st->ctx ? bfc_ctx_alloc(st->ctx, s, n) : bfc_host_alloc(n);
}

static int bfc_free_fn(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                       size_t n)
{
    struct bfc_state *st = a->state;
    (void)thread;
    (void)n;
    return st->ctx ? bfc_ctx_free(st->ctx, p, s) : bfc_host_free(p);
}

static void *lock_alloc_fn(struct perf_allocator *a, unsigned thread, bfc_stream_t s,
                           size_t n)
{
    struct bfc_state *st = a->state;
    void *p;
    perf_check(pthread_mutex_lock(&st->lock), "pthread_mutex_lock");
    p = bfc_alloc_fn(a, thread, s, n);
    perf_check(pthread_mutex_unlock(&st->lock), "pthread_mutex_unlock");
    return p;
}

static int lock_free_fn(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                        size_t n)
{
    struct bfc_state *st = a->state;
    int rc;
    perf_check(pthread_mutex_lock(&st->lock), "pthread_mutex_lock");
    rc = bfc_free_fn(a, thread, p, s, n);
    perf_check(pthread_mutex_unlock(&st->lock), "pthread_mutex_unlock");
    return rc;
}

static void *lock_pair_fn(struct perf_allocator *a, unsigned thread, void *p, size_t n_free,
                          bfc_stream_t s, size_t n, int *free_rc)
{
    struct bfc_state *st = a->state;
    void *q;
    perf_check(pthread_mutex_lock(&st->lock), "pthread_mutex_lock");
    *free_rc = bfc_free_fn(a, thread, p, s, n_free);
    q = *free_rc == 0 ? bfc_alloc_fn(a, thread, s, n) : NULL;
    perf_check(pthread_mutex_unlock(&st->lock), "pthread_mutex_unlock");
    return q;
}

static void *ctx_alloc_fn(struct perf_allocator *a, unsigned thread, bfc_stream_t s, size_t n)
{
    struct bfc_state *st = a->state;
    return bfc_ctx_alloc(st->ctx_of[thread], s, n);
}

static int ctx_free_fn(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                       size_t n)
{
    struct bfc_state *st = a->state;
    (void)n;
    return bfc_ctx_free(st->ctx_of[thread], p, s);
}

/* acc (+)= s, each figure as BFC_STATS_FIELDS says it combines. */
static uint64_t comb_SUM(uint64_t a, uint64_t b)
{
    return a + b;
}

static uint64_t comb_MAX(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

static uint64_t comb_SAME(uint64_t a, uint64_t b)
{
    (void)a;
    return b;
}

static void stats_add(bfc_stats_t *acc, const bfc_stats_t *s)
{
#define PERF_STATS_ADD(name, combine, desc) acc->name = comb_##combine(acc->name, s->name);
    BFC_STATS_FIELDS(PERF_STATS_ADD)
#undef PERF_STATS_ADD
}

static bool bfc_read_stats(struct perf_allocator *a, bfc_stats_t *out)
{
    struct bfc_state *st = a->state;
    if (st == NULL)
        return false;
    if (st->ctx == NULL)
        return bfc_host_stats(out) == BFC_OK;
    memset(out, 0, sizeof(*out));
    for (unsigned k = 0; k < st->nctx; k++) {
        bfc_stats_t one;
        if (st->ctxs[k] == NULL || bfc_ctx_stats(st->ctxs[k], &one) != BFC_OK)
            return false;
        stats_add(out, &one);
    }
    return true;
}

/* One context's peak_bytes_reserved is exact (the pool's own); a sum over
 * a context per thread, or bfc_host_stats over several NUMA nodes' host
 * contexts, adds peaks that may fall at different times: an upper bound. */
static bool bfc_stats_fn(struct perf_allocator *a, uint64_t *peak_reserved, bool *bound)
{
    struct bfc_state *st = a->state;
    bfc_stats_t s;
    if (!bfc_read_stats(a, &s))
        return false;
    *peak_reserved = s.peak_bytes_reserved;
    *bound = st->ctx == NULL ? bfc_host_numa_nodes() > 1 : st->nctx > 1;
    return true;
}

static bool bfc_in_use_fn(struct perf_allocator *a, uint64_t *bytes)
{
    bfc_stats_t s;
    if (!bfc_read_stats(a, &s))
        return false;
    *bytes = s.bytes_in_use;
    return true;
}

static void bfc_fini(struct perf_allocator *a)
{
    struct bfc_state *st = a->state;
    if (st == NULL)
        return;
    drop_streams(a, st->ctxs, st->nctx, st->cuda_streams, st->ndistinct);
    for (unsigned k = 0; k < st->nctx; k++)
        if (st->ctxs[k] != NULL)
            bfc_ctx_destroy(st->ctxs[k]);
    free(st->ctxs);
    (void)pthread_mutex_destroy(&st->lock);
    free(st);
    a->state = NULL;
}

static const struct perf_alloc_ops ops_shardbfc = {
    .name = "shardbfc",
    .desc = "libshardbfc: one context, one stream (shard) per thread",
    .init = bfc_init,
    .alloc = bfc_alloc_fn,
    .free = bfc_free_fn,
    .stats = bfc_stats_fn,
    .in_use = bfc_in_use_fn,
    .fini = bfc_fini,
    .snapshot = bfc_read_stats,
};

static const struct perf_alloc_ops ops_shardbfc_ctx = {
    .name = "shardbfc-ctx",
    .desc = "libshardbfc: a context of its own per thread (per cross pair), one stream each",
    .init = ctx_init,
    .alloc = ctx_alloc_fn,
    .free = ctx_free_fn,
    .stats = bfc_stats_fn,
    .in_use = bfc_in_use_fn,
    .fini = bfc_fini,
    .snapshot = bfc_read_stats,
};

static const struct perf_alloc_ops ops_single_lock = {
    .name = "single-lock",
    .desc = "the same library, ONE stream, every call under one global mutex "
            "(TensorFlow's design)",
    .init = lock_init,
    .alloc = lock_alloc_fn,
    .free = lock_free_fn,
    .stats = bfc_stats_fn,
    .in_use = bfc_in_use_fn,
    .fini = bfc_fini,
    .pair = lock_pair_fn,
    .snapshot = bfc_read_stats,
};

/* ------------------------------------------------------- host allocators */

static const char *host_init(struct perf_allocator *a, const struct perf_env *env,
                             enum perf_mem mem, unsigned nstreams)
{
    (void)env;
    a->mem = mem;
    a->state = NULL;
    return make_streams(a, NULL, 0, false, 0, nstreams);
}

static void host_fini(struct perf_allocator *a)
{
    drop_streams(a, NULL, 0, false, 0);
}

static bool no_stats(struct perf_allocator *a, uint64_t *v)
{
    (void)a;
    (void)v;
    return false;
}

static bool no_peak(struct perf_allocator *a, uint64_t *v, bool *bound)
{
    (void)a;
    (void)v;
    (void)bound;
    return false;
}

static void *je_alloc(struct perf_allocator *a, unsigned thread, bfc_stream_t s, size_t n)
{
    (void)a;
    (void)thread;
    (void)s;
    return mallocx(n, 0);
}

static int je_free(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                   size_t n)
{
    (void)a;
    (void)thread;
    (void)s;
    sdallocx(p, n, 0);
    return 0;
}

static void *libc_alloc(struct perf_allocator *a, unsigned thread, bfc_stream_t s, size_t n)
{
    (void)a;
    (void)thread;
    (void)s;
    return __libc_malloc(n);
}

static int libc_free(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                     size_t n)
{
    (void)a;
    (void)thread;
    (void)s;
    (void)n;
    __libc_free(p);
    return 0;
}

static const struct perf_alloc_ops ops_jemalloc = {
    .name = "jemalloc",
    .desc = "jemalloc mallocx/sdallocx (host memory: the reference floor)",
    .init = host_init,
    .alloc = je_alloc,
    .free = je_free,
    .stats = no_peak,
    .in_use = no_stats,
    .fini = host_fini,
};

static const struct perf_alloc_ops ops_malloc = {
    .name = "malloc",
    .desc = "glibc malloc via __libc_malloc/__libc_free (plain malloc() is "
            "jemalloc in this process)",
    .init = host_init,
    .alloc = libc_alloc,
    .free = libc_free,
    .stats = no_peak,
    .in_use = no_stats,
    .fini = host_fini,
};

/* -------------------------------------------------------------- CUDA */

#if BFC_HAVE_CUDA
struct cuda_state {
    bool async;
    cudaMemPool_t pool;
};

static const char *cuda_init_common(struct perf_allocator *a, const struct perf_env *env,
                                    enum perf_mem mem, unsigned nstreams, bool async)
{
    struct cuda_state *st;
    const char *why;
    a->mem = mem;
    a->state = NULL;
    if (!env->gpu)
        return env->no_gpu_reason;
    if (async && mem == PERF_MEM_HOST)
        return "CUDA has no stream-ordered pinned host allocator";
    st = perf_xcalloc(1, sizeof(*st));
    st->async = async;
    a->state = st;
    if (async) {
        uint64_t thr = UINT64_MAX;
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetDefaultMemPool(&st->pool, dev) != cudaSuccess ||
            cudaMemPoolSetAttribute(st->pool, cudaMemPoolAttrReleaseThreshold, &thr) !=
                cudaSuccess)
            return "cannot configure the default memory pool";
        /* Start each run from an empty pool with fresh peaks (the run's
         * overhead is read from them). */
        thr = 0;
        if (cudaDeviceSynchronize() != cudaSuccess || cudaMemPoolTrimTo(st->pool, 0) != cudaSuccess ||
            cudaMemPoolSetAttribute(st->pool, cudaMemPoolAttrReservedMemHigh, &thr) != cudaSuccess ||
            cudaMemPoolSetAttribute(st->pool, cudaMemPoolAttrUsedMemHigh, &thr) != cudaSuccess)
            return "cannot empty the default memory pool or reset its peaks";
    }
    why = make_streams(a, NULL, 0, mem == PERF_MEM_DEVICE,
                       mem == PERF_MEM_DEVICE ? nstreams : 0, nstreams);
    return why;
}

static const char *cuda_init(struct perf_allocator *a, const struct perf_env *env,
                             enum perf_mem mem, unsigned nstreams)
{
    return cuda_init_common(a, env, mem, nstreams, false);
}

static const char *cuda_async_init(struct perf_allocator *a, const struct perf_env *env,
                                   enum perf_mem mem, unsigned nstreams)
{
    return cuda_init_common(a, env, mem, nstreams, true);
}

static void *cuda_alloc_fn(struct perf_allocator *a, unsigned thread, bfc_stream_t s,
                           size_t n)
{
    struct cuda_state *st = a->state;
    void *p = NULL;
    cudaError_t e;
    (void)thread;
    if (a->mem == PERF_MEM_HOST)
        e = cudaHostAlloc(&p, n, cudaHostAllocDefault);
    else if (st->async)
        e = cudaMallocAsync(&p, n, (cudaStream_t)s);
    else
        e = cudaMalloc(&p, n);
    return e == cudaSuccess ? p : NULL;
}

static int cuda_free_fn(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                        size_t n)
{
    struct cuda_state *st = a->state;
    (void)thread;
    (void)n;
    if (a->mem == PERF_MEM_HOST)
        return cudaFreeHost(p) != cudaSuccess;
    if (st->async)
        return cudaFreeAsync(p, (cudaStream_t)s) != cudaSuccess;
    return cudaFree(p) != cudaSuccess;
}

static bool cuda_stats_fn(struct perf_allocator *a, uint64_t *peak_reserved, bool *bound)
{
    struct cuda_state *st = a->state;
    uint64_t v = 0;
    if (st == NULL || !st->async || a->mem != PERF_MEM_DEVICE)
        return false;
    if (cudaMemPoolGetAttribute(st->pool, cudaMemPoolAttrReservedMemHigh, &v) != cudaSuccess)
        return false;
    *peak_reserved = v;
    *bound = false; /* the pool's own high-water mark */
    return true;
}

static bool cuda_in_use_fn(struct perf_allocator *a, uint64_t *bytes)
{
    struct cuda_state *st = a->state;
    uint64_t v = 0;
    if (st == NULL || !st->async || a->mem != PERF_MEM_DEVICE)
        return false;
    (void)cudaDeviceSynchronize();
    if (cudaMemPoolGetAttribute(st->pool, cudaMemPoolAttrUsedMemCurrent, &v) != cudaSuccess)
        return false;
    *bytes = v;
    return true;
}

static void cuda_fini(struct perf_allocator *a)
{
    struct cuda_state *st = a->state;
    (void)cudaDeviceSynchronize();
    drop_streams(a, NULL, 0, a->mem == PERF_MEM_DEVICE && st != NULL, a->nstreams);
    if (st != NULL && st->async)
        (void)cudaMemPoolTrimTo(st->pool, 0);
    free(st);
    a->state = NULL;
}

static const struct perf_alloc_ops ops_cuda = {
    .name = "cuda",
    .desc = "cudaMalloc/cudaFree (host: cudaHostAlloc/cudaFreeHost)",
    .init = cuda_init,
    .alloc = cuda_alloc_fn,
    .free = cuda_free_fn,
    .stats = cuda_stats_fn,
    .in_use = cuda_in_use_fn,
    .fini = cuda_fini,
};

static const struct perf_alloc_ops ops_cuda_async = {
    .name = "cuda-async",
    .desc = "cudaMallocAsync/cudaFreeAsync, default pool, release threshold UINT64_MAX",
    .init = cuda_async_init,
    .alloc = cuda_alloc_fn,
    .free = cuda_free_fn,
    .stats = cuda_stats_fn,
    .in_use = cuda_in_use_fn,
    .fini = cuda_fini,
};

/* PyTorch's caching allocator, through the shim (loaded once, by the main
 * thread, at the first init; the measuring threads only call through the
 * function pointers). */
struct torch_shim {
    bool tried, ok;
    char why[200];
    int (*init)(char *why, size_t len);
    void *(*alloc)(size_t n, void *stream);
    int (*free)(void *p);
    int (*reset)(void);
    int (*stats)(uint64_t *peak_reserved, uint64_t *in_use);
};
static struct torch_shim torch_shim;

/* Where the shim is: $SHARDBFC_PERF_TORCH, else beside this program (where
 * `make perf-torch` puts it).  false with the reason in t->why. */
static bool torch_shim_path(char *path, size_t len)
{
    struct torch_shim *t = &torch_shim;
    const char *env = getenv("SHARDBFC_PERF_TORCH");

    if (env != NULL && *env != '\0') {
        snprintf(path, len, "%s", env);
    } else {
        ssize_t n = readlink("/proc/self/exe", path, len - 1);
        char *slash;
        if (n <= 0) {
            snprintf(t->why, sizeof(t->why), "cannot locate this program (/proc/self/exe)");
            return false;
        }
        path[n] = '\0';
        slash = strrchr(path, '/');
        if (slash == NULL || (size_t)(slash - path) + 32 >= len) {
            snprintf(t->why, sizeof(t->why), "cannot locate this program's directory");
            return false;
        }
        snprintf(slash + 1, len - (size_t)(slash + 1 - path), "libshardbfc_perf_torch.so");
    }
    if (access(path, R_OK) != 0) {
        snprintf(t->why, sizeof(t->why),
                 "PyTorch allocator shim not built (make perf-torch TORCH_DIR=DIR)");
        return false;
    }
    return true;
}

static void torch_shim_load(void)
{
    struct torch_shim *t = &torch_shim;
    char path[4096];
    void *dl;

    t->tried = true;
    if (!torch_shim_path(path, sizeof(path)))
        return;
    dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (dl == NULL) {
        snprintf(t->why, sizeof(t->why), "dlopen: %.180s", dlerror());
        return;
    }
    *(void **)&t->init = dlsym(dl, "shardbfc_perf_torch_init");
    *(void **)&t->alloc = dlsym(dl, "shardbfc_perf_torch_alloc");
    *(void **)&t->free = dlsym(dl, "shardbfc_perf_torch_free");
    *(void **)&t->reset = dlsym(dl, "shardbfc_perf_torch_reset");
    *(void **)&t->stats = dlsym(dl, "shardbfc_perf_torch_stats");
    if (!t->init || !t->alloc || !t->free || !t->reset || !t->stats) {
        snprintf(t->why, sizeof(t->why), "%.150s lacks the shim's entry points", path);
        return; /* the handle stays open: harmless, and nothing is half-unloaded */
    }
    if (t->init(t->why, sizeof(t->why)) != 0)
        return;
    t->ok = true;
}

static const char *torch_init(struct perf_allocator *a, const struct perf_env *env,
                              enum perf_mem mem, unsigned nstreams)
{
    static char both[400];
    char path[4096];
    a->mem = mem;
    a->state = NULL;
    if (mem == PERF_MEM_HOST)
        return "PyTorch's host allocator is not measured (device memory only)";
    if (!env->gpu) {
        /* Say both when both are missing: the shim needs a build step too. */
        if (torch_shim_path(path, sizeof(path)))
            return env->no_gpu_reason;
        snprintf(both, sizeof(both), "%s; %s", env->no_gpu_reason, torch_shim.why);
        return both;
    }
    if (!torch_shim.tried)
        torch_shim_load();
    if (!torch_shim.ok)
        return torch_shim.why;
    (void)cudaDeviceSynchronize();
    if (torch_shim.reset() != 0)
        return "PyTorch's emptyCache/resetPeakStats failed";
    a->state = &torch_shim;
    return make_streams(a, NULL, 0, true, nstreams, nstreams);
}

static void *torch_alloc_fn(struct perf_allocator *a, unsigned thread, bfc_stream_t s,
                            size_t n)
{
    (void)a;
    (void)thread;
    return torch_shim.alloc(n, (void *)s);
}

static int torch_free_fn(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t s,
                         size_t n)
{
    (void)a;
    (void)thread;
    (void)s;
    (void)n;
    return torch_shim.free(p);
}

static bool torch_stats_fn(struct perf_allocator *a, uint64_t *peak_reserved, bool *bound)
{
    uint64_t used;
    *bound = false; /* reserved_bytes' own peak */
    return a->state != NULL && torch_shim.stats(peak_reserved, &used) == 0;
}

static bool torch_in_use_fn(struct perf_allocator *a, uint64_t *bytes)
{
    uint64_t peak;
    return a->state != NULL && torch_shim.stats(&peak, bytes) == 0;
}

static void torch_fini(struct perf_allocator *a)
{
    (void)cudaDeviceSynchronize();
    drop_streams(a, NULL, 0, a->state != NULL, a->state != NULL ? a->nstreams : 0);
    if (a->state != NULL)
        (void)torch_shim.reset();
    a->state = NULL;
}

static const struct perf_alloc_ops ops_torch = {
    .name = "torch",
    .desc = "PyTorch's CUDA caching allocator from C++ (raw_alloc_with_stream/raw_delete)",
    .init = torch_init,
    .alloc = torch_alloc_fn,
    .free = torch_free_fn,
    .stats = torch_stats_fn,
    .in_use = torch_in_use_fn,
    .fini = torch_fini,
};
#else
/* Not built: init says why, nothing else is ever called. */
static const char *nocuda_init(struct perf_allocator *a, const struct perf_env *env,
                               enum perf_mem mem, unsigned nstreams)
{
    (void)env;
    (void)nstreams;
    a->mem = mem;
    a->state = NULL;
    a->streams = NULL;
    a->nstreams = 0;
    return "built without CUDA (configure --with-cuda)";
}

static void nocuda_fini(struct perf_allocator *a)
{
    (void)a;
}

static const struct perf_alloc_ops ops_cuda = {
    .name = "cuda", .desc = "cudaMalloc/cudaFree (not built)", .init = nocuda_init,
    .stats = no_peak, .in_use = no_stats, .fini = nocuda_fini,
};
static const struct perf_alloc_ops ops_cuda_async = {
    .name = "cuda-async", .desc = "cudaMallocAsync/cudaFreeAsync (not built)",
    .init = nocuda_init, .stats = no_peak, .in_use = no_stats, .fini = nocuda_fini,
};
static const struct perf_alloc_ops ops_torch = {
    .name = "torch", .desc = "PyTorch's CUDA caching allocator (not built)",
    .init = nocuda_init, .stats = no_peak, .in_use = no_stats, .fini = nocuda_fini,
};
#endif

/* ---------------------------------------------------------------- table */

const struct perf_alloc_ops *const perf_allocators[] = {
    &ops_shardbfc, &ops_shardbfc_ctx, &ops_single_lock, &ops_jemalloc, &ops_malloc, &ops_cuda,
    &ops_cuda_async, &ops_torch,
};
const unsigned perf_n_allocators = sizeof(perf_allocators) / sizeof(perf_allocators[0]);

const struct perf_alloc_ops *perf_alloc_find(const char *name)
{
    for (unsigned i = 0; i < perf_n_allocators; i++)
        if (strcmp(perf_allocators[i]->name, name) == 0)
            return perf_allocators[i];
    return NULL;
}

void perf_env_probe(struct perf_env *env, bool backend_cuda)
{
    memset(env, 0, sizeof(*env));
    env->backend_cuda = backend_cuda;
#if BFC_HAVE_CUDA
    {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess || n == 0) {
            /* cudaErrorInsufficientDriver (no driver) reads as "no device". */
            snprintf(env->no_gpu_reason, sizeof(env->no_gpu_reason),
                     "no usable CUDA device (%s)",
                     e != cudaSuccess ? cudaGetErrorName(e) : "0 devices");
            (void)cudaGetLastError();
        } else {
            struct cudaDeviceProp prop;
            env->gpu = true;
            if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
                snprintf(env->gpu_name, sizeof(env->gpu_name), "%.255s", prop.name);
            else
                snprintf(env->gpu_name, sizeof(env->gpu_name), "CUDA device 0");
        }
    }
#else
    snprintf(env->no_gpu_reason, sizeof(env->no_gpu_reason), "built without CUDA");
#endif
}
