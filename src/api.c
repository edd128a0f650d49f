/*
 * api.c -- the process-wide service: one context per CUDA device, created
 * lazily from SHARDBFC_CONF on first use.
 *
 * A stream's own device picks the context (cudaStreamGetDevice; the NULL
 * stream means the calling thread's current device; on SIM everything is
 * device 0, its one device).  A pointer finds its context by itself through the
 * process-wide region map, so frees need no device argument.
 *
 * An invalid SHARDBFC_CONF (or one on which the first context cannot be
 * made: refuse_device) stops the service before it starts: every call
 * returns BFC_EINVAL (NULL with bfc_last_error() == BFC_EINVAL for the
 * pointer-returning ones; freeing NULL stays the no-op it always is), and config.c has said once on stderr which item
 * is wrong and why.  Falling back to the defaults instead would turn a typo
 * in memory_limit into "take the whole device".  The check is the
 * pthread_once that reads the configuration anyway, so it costs the
 * allocation path nothing new; the pointer-only calls (bfc_free,
 * bfc_stream_free, bfc_record_stream) pay one pthread_once fast path.
 *
 * Locking: `bfc__ctx_create_lock` (defined in ctx.c, which takes it across fork) is taken only when a device's context does not exist
 * yet (once per device) and by bfc_shutdown; every other call reads the
 * context table with an acquire load.  It is held while a context is created
 * or destroyed, which waits for liburcu (its locks, grace periods, its
 * threads), so it is an "outer" lock in the fork order (ctx.c): the fork
 * handlers take it before liburcu's hooks.  The process set-up (and with it
 * the fork handlers) is done before the lock is first taken.
 */
#include <string.h>

#include "host.h"

#define MAX_DEVICES 64

static bfc_ctx_t *_Atomic devices[MAX_DEVICES];

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static bfc_config_t env_cfg;
static int env_status; /* BFC_OK, or why the service refuses to start */
static bool env_use_cuda;

static void env_init(void)
{
    /* The message naming the bad item is config.c's (printed once). */
    env_status = bfc__config_from_env(&env_cfg) == BFC_OK ? BFC_OK : BFC_EINVAL;
    env_use_cuda = false;
#if BFC_HAVE_CUDA
    if (env_status == BFC_OK && env_cfg.backend != BFC_BACKEND_SIM && bfc__cuda_device_count() > 0)
        env_use_cuda = true;
#endif
}

static atomic_bool env_done; /* env_init has run: the common path's one test */

/* BFC_OK when the service may run; pthread_once (or env_done's acquire)
 * orders env_init's writes before every return. */
static int service_status(void)
{
    /* acquire: pairs with the release store below, after env_init. */
    if (BFC__UNLIKELY(!atomic_load_explicit(&env_done, memory_order_acquire))) {
        int e = bfc__once(&env_once, env_init); /* may report a bad SHARDBFC_CONF */
        if (e != 0)
            bfc__fatal("pthread_once", e);
        atomic_store_explicit(&env_done, true, memory_order_release);
    }
    return bfc__config_refused() ? BFC_EINVAL : env_status;
}

/* Devices whose context SHARDBFC_CONF cannot make while another device's
 * context runs (ctx_of_device): refused alone, without a retry per call. */
static atomic_bool dev_refused[MAX_DEVICES];

static void say_no_device(int dev);

/* The device whose context serves stream s: on CUDA the stream's own
 * (NULL: the thread's current device); on SIM device 0, its one device,
 * whatever `device` says (a SIM context runs as device 0, bfc_ctx_config);
 * with backend=cuda and no usable GPU the configured ordinal, which the
 * no-device message names. */
static int device_of(bfc_stream_t s, int *dev)
{
    int st = service_status();
    if (st != BFC_OK)
        return st;
    *dev = env_cfg.backend == BFC_BACKEND_CUDA ? env_cfg.device : 0;
#if BFC_HAVE_CUDA
    if (env_use_cuda) {
        int st = bfc__cuda_stream_device(s, dev);
        if (st != BFC_OK)
            return st;
    }
#else
    (void)s;
#endif
    if (BFC__UNLIKELY(*dev < 0 || *dev >= MAX_DEVICES)) {
        say_no_device(*dev);
        return BFC_ENODEV;
    }
    return BFC_OK;
}

/*
 * A configuration that parses but on which a context cannot be made
 * (bfc_ctx_create says BFC_EINVAL: a trace= path that cannot be created,
 * an oom_dump= path that cannot be written, vmm=on
 * where the device has no virtual memory or the limit holds no granule)
 * stops the service as a bad spec does, with its one line on
 * stderr, rather than retry the creation at every call.  Where another
 * device's context already runs, only this device is refused (its users'
 * pointers stay valid).  Other failures (no device, no memory) are retried
 * at the next call.  Under bfc__ctx_create_lock.
 */
static void refuse_device(int dev)
{
    char why[320];
    snprintf(why, sizeof why,
             "the context for device %d cannot be created (a trace= path that cannot be created, an "
             "oom_dump= path that cannot be written, or vmm=on where the device has no virtual memory or the "
             "limit holds no granule)",
             dev);
    for (int i = 0; i < MAX_DEVICES; i++)
        if (atomic_load_explicit(&devices[i], memory_order_relaxed)) {
            atomic_store_explicit(&dev_refused[dev], true, memory_order_relaxed);
            fprintf(stderr, "libshardbfc: SHARDBFC_CONF: %s; calls for that device fail with BFC_EINVAL\n", why);
            return;
        }
    bfc__config_refuse(why);
}

/*
 * No usable device (backend=cuda without a GPU or a driver, a device
 * ordinal the machine lacks) is not a bad spec: the creation is tried
 * again at every call, so a device that appears later is used.  But an
 * operator who asked for CUDA must not be left with nothing but NULLs to
 * read, so stderr says so once per device; an ordinal past the service's
 * table (device=64 or more, or a stream on such a GPU) has one slot for
 * all, as it can never be served.  Called with or without
 * bfc__ctx_create_lock (device_of takes none), hence the exchange
 * (relaxed: a once-only message, no data).
 */
static atomic_bool no_device_said[MAX_DEVICES + 1];

static void say_no_device(int dev)
{
    bool beyond = dev < 0 || dev >= MAX_DEVICES;
    if (atomic_exchange_explicit(&no_device_said[beyond ? MAX_DEVICES : dev], true, memory_order_relaxed))
        return;
    const char *backend = env_cfg.backend == BFC_BACKEND_CUDA ? "cuda" : "auto";
    if (beyond)
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF: no usable device %d for backend=%s (the service serves devices "
                "0 to %d); calls for it fail with BFC_ENODEV\n",
                dev, backend, MAX_DEVICES - 1);
    else
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF: no usable device %d for backend=%s; calls for it fail with "
                "BFC_ENODEV until one is usable\n",
                dev, backend);
}

static bfc_ctx_t *ctx_of_device(int dev, int *status)
{
    /* acquire: pairs with the release store below (a fully built context). */
    bfc_ctx_t *ctx = atomic_load_explicit(&devices[dev], memory_order_acquire);
    if (BFC__LIKELY(ctx != NULL))
        return ctx;
    bfc__process_init(); /* the fork handlers exist before bfc__ctx_create_lock is used */
    /* Registered before the lock: a creation that fails tears down what it
     * made, which may enter RCU (rcu.h, bfc__rcu_register). */
    bfc__rcu_register();
    /* The backend's open and the context's creation wait under the create
     * lock (mutex.h). */
    int cs = bfc__nocancel_begin();
    bfc__lock(&bfc__ctx_create_lock);
    ctx = atomic_load_explicit(&devices[dev], memory_order_relaxed);
    if (!ctx && (bfc__config_refused() || atomic_load_explicit(&dev_refused[dev], memory_order_relaxed))) {
        *status = BFC_EINVAL;
    } else if (!ctx) {
        bfc_config_t cfg = env_cfg;
        cfg.device = dev;
        int st = bfc_ctx_create(&cfg, &ctx);
        if (st != BFC_OK) {
            *status = st;
            ctx = NULL;
        } else {
            atomic_store_explicit(&devices[dev], ctx, memory_order_release);
        }
        if (st == BFC_EINVAL)
            refuse_device(dev);
        else if (st == BFC_ENODEV)
            say_no_device(dev);
    }
    bfc__unlock(&bfc__ctx_create_lock);
    bfc__nocancel_end(cs);
    return ctx;
}

static bfc_ctx_t *ctx_of_stream(bfc_stream_t s, int *status)
{
    int dev;
    int st = device_of(s, &dev);
    if (st != BFC_OK) {
        *status = st;
        return NULL;
    }
    return ctx_of_device(dev, status);
}

bfc_ctx_t *bfc_default_ctx(void)
{
    int st = BFC_OK;
    bfc_ctx_t *ctx = ctx_of_stream(NULL, &st);
    if (!ctx)
        bfc__set_last_error(st);
    return ctx;
}

void *bfc_stream_alloc(bfc_stream_t stream, size_t n)
{
    int st = BFC_OK;
    bfc_ctx_t *ctx = ctx_of_stream(stream, &st);
    if (!ctx) {
        bfc__set_last_error(st);
        return NULL;
    }
    return bfc_ctx_alloc(ctx, stream, n);
}

/* The context and owner stream of a device pointer -- as the owner's
 * stream_key (arena.h), which bfc_ctx_free takes for the owner's stream
 * without asking its id: a per-thread default stream's shard is then freed
 * into as its own stream, from any thread --; BFC_EDOUBLEFREE for
 * a block whose memory left its shard after its free (regionmap.h,
 * departed memory), else BFC_ENOTOWNED -- also for a host block, which
 * only bfc_host_free frees (a host context's shards are threads' arenas,
 * not streams). */
static int owner_of(const void *p, bfc_ctx_t **ctx, bfc_stream_t *s)
{
    bfc__rcu_lock();
    struct bfc__region *r = bfc__regionmap_lookup((uintptr_t)p);
    int st = BFC_ENOTOWNED;
    if (r && !((struct bfc_ctx *)r->tag)->is_host) {
        *ctx = r->tag;
        *s = r->owner->stream_key;
        st = BFC_OK;
    }
    bfc__rcu_unlock();
    if (!r)
        st = bfc__regionmap_gone((uintptr_t)p, NULL, NULL);
    return st;
}

int bfc_stream_free(void *p, bfc_stream_t stream)
{
    if (!p)
        return BFC_OK;
    int st0 = service_status();
    if (st0 != BFC_OK)
        return st0;
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    int st = owner_of(p, &ctx, &owner);
    return st == BFC_OK ? bfc_ctx_free(ctx, p, stream) : st;
}

int bfc_free(void *p)
{
    if (!p)
        return BFC_OK;
    int st0 = service_status();
    if (st0 != BFC_OK)
        return st0;
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    int st = owner_of(p, &ctx, &owner);
    return st == BFC_OK ? bfc_ctx_free(ctx, p, owner) : st;
}

int bfc_record_stream(void *p, bfc_stream_t stream)
{
    if (!p)
        return BFC_EINVAL;
    int st0 = service_status();
    if (st0 != BFC_OK)
        return st0;
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    int st = owner_of(p, &ctx, &owner);
    return st == BFC_OK ? bfc_ctx_record_stream(ctx, p, stream) : st;
}

int bfc_stream_release(bfc_stream_t stream)
{
    int dev;
    int st = device_of(stream, &dev);
    if (st != BFC_OK)
        return st;
    bfc_ctx_t *ctx = atomic_load_explicit(&devices[dev], memory_order_acquire);
    return ctx ? bfc_ctx_stream_release(ctx, stream) : BFC_EINVAL;
}

void bfc_shutdown(void)
{
    bfc__process_init(); /* as in ctx_of_device */
    int cs = bfc__nocancel_begin(); /* teardown under the create lock (mutex.h) */
    bfc__lock(&bfc__ctx_create_lock);
    for (int i = 0; i < MAX_DEVICES; i++) {
        bfc_ctx_t *ctx = atomic_exchange_explicit(&devices[i], NULL, memory_order_acq_rel);
        if (ctx)
            bfc_ctx_destroy(ctx);
    }
    bfc__unlock(&bfc__ctx_create_lock);
    bfc__host_shutdown();
    bfc__nocancel_end(cs);
}
