/*
 * ctx.c -- the context API: create/destroy, allocate, free (same stream or
 * cross-stream), record_stream, stream release, trim, introspection, and the
 * SIM controls of shardbfc_sim.h.
 *
 * The paths and their locks:
 *   alloc            rcu_read_lock; shard lookup (TLS cache or lock-free hash);
 *                    the stream's arena lock.  Slow path (no fit): the pool
 *                    lock, then -- own lock dropped -- arenas_lock and each
 *                    other arena's lock in turn.
 *   free, same stream   region map (RCU, no lock); owner arena's lock.
 *   free, other stream  region map; CAS claim of the chunk; the owner's fence
 *                    pool queue; wait-free enqueue.  No arena lock.
 *   errors (bad free)   owner arena's lock, to classify without races.
 *   record_stream, introspection   owner arena's lock.
 *   release, trim, stats, check    arenas_lock / each arena lock / pool lock.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ctx.h"
#include "arena_inline.h"
#include <shardbfc_sim.h>

/* ------------------------------------------------------------ process */

/*
 * Fork.  The child has one thread: a lock another thread of the parent held
 * at fork() would stay locked in it forever, and so would liburcu's.  The
 * prepare handler therefore takes every lock of the library and liburcu's
 * fork hooks take liburcu's, and both after-fork handlers release them all.
 * The order is what keeps prepare from deadlocking, and it follows from one
 * rule:
 *
 *   No thread waits for liburcu -- for call_rcu_mutex, the grace-period or
 *   registry lock, a grace period, or progress of liburcu's own threads --
 *   while it holds an "inner" lock; and no RCU reader, call_rcu callback or
 *   liburcu thread ever waits for an "outer" lock.
 *
 * liburcu's prepare hooks take call_rcu_mutex, pause every call_rcu thread
 * and the hash-table worker (waiting until they do), then take the grace-
 * period and registry locks.  A paused call_rcu thread may first have to
 * finish a grace period, i.e. wait for every reader -- and readers take arena
 * locks.  So inner locks (whose holders are readers, or wait for readers
 * that need them) can only be taken after the hooks, when every liburcu
 * thread is paused and no grace period is in progress; and they are safe to
 * take then only because no holder of one waits for what the hooks now hold.
 * Outer locks are held across context creation and destruction or a trace
 * stop, which do wait for liburcu (cds_lfht_new/destroy take call_rcu_mutex,
 * teardown runs synchronize_rcu and rcu_barrier); they are taken before the
 * hooks, which is safe because nothing liburcu waits for needs them.
 *
 * The order, outermost first (every path nests in it, none the other way),
 * is that of the lock ranks (enum bfc__lock_rank, mutex.h), which debug
 * builds check on every lock taken:
 *   outer   the urcu-bp registration gate (rcu.h: urcu-bp registers a
 *           thread under a lock of its own that its hooks do not take, so
 *           no thread may be registering across fork; a registering thread
 *           holds no other lock); the service's create lock (api.c); the
 *           host table lock (host.c); the context registry (g_ctxs_lock,
 *           below); each context's obs.lock (trace start/stop, OOM report);
 *   liburcu call_rcu_before_fork, rcu_bp_before_fork;
 *   inner   every context's arenas_lock, then every arena's lock, then
 *           every context's pool lock, then every arena's fence-pool dequeue
 *           lock (the mutex of cds_wfcq_dequeue_blocking); then process-
 *           wide: the region map writer lock, the trace buffer registry and
 *           each running trace's file lock, the liburcu gate (rcu.h), the
 *           SIM stream-table lock.
 * Locks of one rank are taken over all contexts before the next rank, so
 * the handler itself keeps the order the witness checks (bfc__lock_nested
 * for several locks of one rank).  Both after-fork handlers release in the
 * reverse order.
 *
 * What makes the inner holders keep the rule:
 *   - the default call_rcu data is created before the first context
 *     (call_rcu_ensure, below): else the first call_rcu takes
 *     call_rcu_mutex to create it, under an arena
 *     lock (the hang this order was written for: fork holds call_rcu_mutex
 *     and waits for an arena lock whose holder waits for the region map
 *     writer lock whose holder waits for call_rcu_mutex).  liburcu recreates
 *     it in the child;
 *   - a thread is registered with urcu-bp before it takes an inner lock on a
 *     path that may enter RCU (bfc__rcu_register, rcu.h): registering takes
 *     the registry lock;
 *   - the region map hands old arrays to call_rcu after its writer lock is
 *     dropped, and synchronize_rcu / rcu_barrier run only with no inner lock
 *     held (context teardown, trace stop).
 * And for the outer ones: no allocator path takes one inside a read-side
 * section, and our call_rcu callbacks take no lock.  The application shares
 * urcu-bp with us (one domain per process): its own read-side sections and
 * call_rcu callbacks must not create or destroy contexts, start or stop a
 * trace, or set an OOM callback, or a concurrent fork can deadlock.
 *
 * Wait-free queues.  An enqueue on a wfcqueue is two stores (swap the tail,
 * then link the old tail) with no lock, so fork() can stop a thread between
 * them.  liburcu's queues are protected by the liburcu gate (rcu.h).  Ours
 * -- each arena's remote-free queue (cross-stream frees, wait-free by design),
 * the stash the owner's drain spliced it into (whose chain a freer may still
 * have been linking, arena.h) and the fence pool -- are repaired in the
 * child instead, so the free path pays nothing: a chain that stops short of
 * its tail is cut at the last linked node.  The enqueuing thread does not
 * exist in the child, so its free is lost there (the block stays allocated
 * in the child, consistently counted); the parent is untouched.
 *
 * Contexts are found through a registry; `g_ctxs_lock` is taken only by
 * create, destroy and fork.  A context being destroyed has left it, and the
 * contract of bfc_ctx_destroy (no concurrent users) covers its locks.
 */
bfc__mutex_t bfc__host_setup_lock = BFC__MUTEX_INIT(BFC__RANK_HOST_SETUP, "the host set-up");
bfc__mutex_t bfc__ctx_create_lock = BFC__MUTEX_INIT(BFC__RANK_API, "the service create lock");
bfc__mutex_t bfc__ctx_host_lock = BFC__MUTEX_INIT(BFC__RANK_HOST, "the host context table");
static bfc__mutex_t g_ctxs_lock = BFC__MUTEX_INIT(BFC__RANK_CTX_REGISTRY, "the context registry");
static struct bfc_ctx *g_ctxs;

static void registry_add(struct bfc_ctx *ctx)
{
    bfc__lock(&g_ctxs_lock);
    ctx->reg_next = g_ctxs;
    g_ctxs = ctx;
    bfc__unlock(&g_ctxs_lock);
}

static void registry_remove(struct bfc_ctx *ctx)
{
    bfc__lock(&g_ctxs_lock);
    for (struct bfc_ctx **pp = &g_ctxs; *pp; pp = &(*pp)->reg_next)
        if (*pp == ctx) {
            *pp = ctx->reg_next;
            break;
        }
    bfc__unlock(&g_ctxs_lock);
}

/* Cuts a wait-free queue whose chain stops short of its tail (see "Wait-free
 * queues" above).  Child only: no other thread exists. */
static void wfcq_cut(struct cds_wfcq_node *head, struct cds_wfcq_tail *t)
{
    struct cds_wfcq_node *n = head;
    while (n != t->p) {
        struct cds_wfcq_node *next = n->next;
        if (!next) {
            t->p = n;
            return;
        }
        n = next;
    }
}

/* The forking thread's cancellation state, from prepare to the after-fork
 * handler (the child's thread is the same thread, with the same
 * thread-locals). */
static __thread int fork_cancel_state;

static void before_fork(void)
{
    struct bfc__arena *a;
    /* Not cancellable until the after-fork handler is done: liburcu's
     * hooks wait for its threads in poll(), a cancellation point, and a
     * cancellation acting there would leave every lock taken so far held
     * (mutex.h). */
    fork_cancel_state = bfc__nocancel_begin();
    /* Outer, in rank order (mutex.h): the locks of one rank across every
     * context before those of the next rank.  First, the host set-up done
     * or not begun (host.c, init: hwloc holds a lock of its own while it
     * loads the topology); then no thread registering with urcu-bp (rcu.h:
     * its init_lock is no fork hook's). */
    bfc__lock(&bfc__host_setup_lock);
    bfc__lock(&bfc__rcu_reg_gate);
    bfc__lock(&bfc__ctx_create_lock);
    bfc__lock(&bfc__ctx_host_lock);
    bfc__lock(&g_ctxs_lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        if (c->obs.lock_ready)
            bfc__lock_nested(&c->obs.lock);
    /* liburcu: its threads paused, its locks held. */
    call_rcu_before_fork();
    rcu_bp_before_fork();
    /* Inner, in rank order. */
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__lock_nested(&c->arenas_lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__list_for_each(a, &c->arenas, all)
            bfc__lock_nested(&a->lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__lock_nested(&c->pool.lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__list_for_each(a, &c->arenas, all)
            bfc__lock_nested(&a->fpool_lock);
    bfc__regionmap_fork_lock();
    bfc__trace_fork_lock();
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        if (c->obs.lock_ready)
            bfc__trace_fork_lock_file(c);
    bfc__lock(&bfc__urcu_gate);
    bfc__sim_fork_lock();
}

static void release_inner(bool child)
{
    struct bfc__arena *a;
#if BFC_HAVE_CUDA
    if (child)
        bfc__cuda_fork_child();
#endif
    bfc__sim_fork_unlock();
    bfc__unlock(&bfc__urcu_gate);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        if (c->obs.lock_ready)
            bfc__trace_fork_unlock_file(c);
    bfc__trace_fork_unlock();
    bfc__regionmap_fork_unlock();
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__list_for_each(a, &c->arenas, all) {
            if (child) {
                wfcq_cut(&a->rq_head.node, &a->rq_tail);
                wfcq_cut(&a->rq_stash_head.node, &a->rq_stash_tail);
                wfcq_cut(&a->fpool_head.node, &a->fpool_tail);
            }
            bfc__unlock(&a->fpool_lock);
        }
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__unlock(&c->pool.lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__list_for_each(a, &c->arenas, all)
            bfc__unlock(&a->lock);
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        bfc__unlock(&c->arenas_lock);
}

static void release_outer(void)
{
    for (struct bfc_ctx *c = g_ctxs; c; c = c->reg_next)
        if (c->obs.lock_ready)
            bfc__unlock(&c->obs.lock);
    bfc__unlock(&g_ctxs_lock);
    bfc__unlock(&bfc__ctx_host_lock);
    bfc__unlock(&bfc__ctx_create_lock);
    bfc__unlock(&bfc__rcu_reg_gate);
    bfc__unlock(&bfc__host_setup_lock);
}

static void after_fork_parent(void)
{
    release_inner(false);
    rcu_bp_after_fork_parent();
    call_rcu_after_fork_parent();
    release_outer();
    bfc__nocancel_end(fork_cancel_state);
}

static void after_fork_child(void)
{
    release_inner(true);
    rcu_bp_after_fork_child();
    call_rcu_after_fork_child();
    release_outer();
    bfc__nocancel_end(fork_cancel_state);
}

static pthread_once_t process_once = PTHREAD_ONCE_INIT, handlers_once = PTHREAD_ONCE_INIT;
static int process_status = BFC_OK, handlers_status = BFC_OK;

/*
 * The fork handlers, registered when the library is loaded (below).  The
 * order matters: jemalloc registers its own fork handlers when it starts
 * (here at the latest), and prepare handlers run in reverse order of
 * registration, so ours run before jemalloc's -- while every thread can
 * still allocate metadata, as inner-lock holders do.
 */
static void handlers_init_once(void)
{
    if (bfc__meta_init() != BFC_OK) {
        handlers_status = BFC_ENOMEM;
        return;
    }
    if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
        handlers_status = BFC_ENOMEM;
}

/*
 * Runs before any context exists.  The handlers are there already (from
 * load), so a fork from another thread meanwhile finds them: creating
 * liburcu's call_rcu data (call_rcu_ensure, after this) takes
 * call_rcu_mutex, which our prepare handler takes too
 * (call_rcu_before_fork).  Registered at the first context instead, as
 * they were, a fork whose prepare handlers had begun before the
 * registration ran none of ours, and when it caught that creation the
 * child inherited call_rcu_mutex locked and hung on it making the data
 * again: 47 of 200 fresh processes whose main thread forked as four
 * threads started creating contexts.  A fork that interrupts this routine
 * makes the child run it again (glibc's pthread_once counts forks), which
 * it may: the handlers are not registered twice, and the rest is
 * idempotent.
 */
static void process_init_once(void)
{
    if (pthread_once(&handlers_once, handlers_init_once) != 0 || handlers_status != BFC_OK) {
        process_status = BFC_ENOMEM;
        return;
    }
    bfc__remote_init();
}

/*
 * liburcu makes threads of its own and cannot report that it failed to: it
 * aborts the process (urcu_die).  A process at its thread limit
 * (RLIMIT_NPROC, a container's pids.max) or short of addresses for a
 * thread's stack (RLIMIT_AS) would die in bfc_ctx_create, so before each
 * step that may start one a thread is created and joined, with the same
 * (default) attributes: if that fails, the creation fails with BFC_ENOMEM,
 * and a later one tries again.  (A thread that takes the last slot between
 * the two can still make liburcu abort; the window is the probe's join.)
 * The steps: its default call_rcu data and thread, made before the first
 * context (not at the first call_rcu, under an arena lock: see "Fork"
 * above; not in pthread_once: a failure here must not be final); and each
 * context's shard directory, a hash table that resizes itself, whose
 * creation starts liburcu's resize worker thread when no such table exists
 * in the process (liburcu counts them: the first context's, and the first
 * after every context was destroyed).
 */
static _Atomic bool call_rcu_ready;

static void *thread_probe(void *arg)
{
    return arg;
}

static int thread_room(void)
{
    pthread_t t;
    if (pthread_create(&t, NULL, thread_probe, NULL) != 0)
        return BFC_ENOMEM;
    int e = pthread_join(t, NULL);
    if (e != 0)
        bfc__fatal("pthread_join", e);
    return BFC_OK;
}

static int call_rcu_ensure(void)
{
    if (atomic_load_explicit(&call_rcu_ready, memory_order_acquire))
        return BFC_OK;
    if (thread_room() != BFC_OK)
        return BFC_ENOMEM;
    if (get_default_call_rcu_data() == NULL)
        return BFC_ENOMEM;
    atomic_store_explicit(&call_rcu_ready, true, memory_order_release);
    return BFC_OK;
}

/* What a context's creation needs of the process: BFC_OK or a status. */
static int process_ready(void)
{
    bfc__process_init();
    return process_status != BFC_OK ? process_status : call_rcu_ensure();
}

void bfc__process_init(void)
{
    int e = pthread_once(&process_once, process_init_once);
    if (e != 0)
        bfc__fatal("pthread_once", e);
}

/* The handlers are registered when the library is loaded (before main, or
 * inside dlopen): no thread is made and nothing else is set up until the
 * first context, so a process that only links the library forks as fast
 * as before.  A process that loads the library with dlopen while another
 * of its threads forks keeps a window. */
__attribute__((constructor)) static void handlers_init_at_load(void)
{
    (void)pthread_once(&handlers_once, handlers_init_once);
}

/* ------------------------------------------------------ observability */

/*
 * An oom_dump path that can never be written fails the context's creation
 * as an uncreatable trace= path does: the dump is wanted at the worst
 * moment, and an operator must learn at start-up, not after the outage,
 * that it will not be there.  The dump is written to PATH.tmp.PID.N beside
 * PATH and renamed over it, so: the directory must exist and be writable
 * and searchable by the effective user (faccessat's AT_EACCESS, as open
 * and rename will act); PATH must not name a directory (a symbolic link
 * to one is replaced by the rename, so it may) nor end in '/'; and the
 * temporary name must fit NAME_MAX.  Checked before the backend opens
 * (which reserves the whole limit with allow_growth=false).  A relative
 * PATH is checked against the working directory now and resolved against
 * the one at each dump.
 */
/* What a dump's temporary name adds to PATH: its pid and a process-wide
 * sequence number (oom_dump). */
#define DUMP_TMP_SUFFIX ".tmp.%ld.%u"

static bool oom_dump_path_ok(const char *path)
{
    size_t len = strlen(path);
    if (len == 0 || path[len - 1] == '/')
        return false;
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return false;
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    /* The longest suffix: a pid (a positive int) and a sequence number at
     * their widest, 26 bytes. */
    int suffix = snprintf(NULL, 0, DUMP_TMP_SUFFIX, (long)INT_MAX, UINT_MAX);
    if (suffix < 0 || strlen(base) + (size_t)suffix > NAME_MAX)
        return false;
    char dir[sizeof(((bfc_config_t *)0)->oom_dump)];
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    return faccessat(AT_FDCWD, dir, W_OK | X_OK, AT_EACCESS) == 0;
}

/*
 * The context's observability state (obs.h) is set up and torn down here,
 * and the OOM dump is written from here: they use the trace (trace.c), the
 * OOM report (obs_oom.c) and the snapshot (stats.c) -- all at this layer or
 * below -- so none of those has to call another to start or stop.
 */
static int obs_init(struct bfc_ctx *ctx)
{
    int e = bfc__mutex_init(&ctx->obs.lock, BFC__RANK_OBS, "a context's obs lock");
    if (e != 0)
        return BFC_ENOMEM;
    ctx->obs.lock_ready = true;
    /* (A host context's cfg.trace is "": ctx_create.) */
    if (ctx->cfg.trace[0]) {
        int st = bfc_ctx_trace_start(ctx, ctx->cfg.trace);
        if (st != BFC_OK) {
            ctx->obs.lock_ready = false;
            bfc__mutex_destroy(&ctx->obs.lock);
            return st;
        }
    }
    return BFC_OK;
}

static void obs_fini(struct bfc_ctx *ctx)
{
    if (!ctx->obs.lock_ready)
        return;
    if (atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed))
        (void)bfc_ctx_trace_stop(ctx);
    bfc__oom_fini(ctx);
    ctx->obs.lock_ready = false;
    bfc__mutex_destroy(&ctx->obs.lock);
}

/* Writes the snapshot to cfg.oom_dump if set (rate-limited). */
static void oom_dump(struct bfc_ctx *ctx)
{
    if (!ctx->cfg.oom_dump[0] || !ctx->obs.lock_ready)
        return;
    uint64_t now = bfc__clock_ns(CLOCK_MONOTONIC);
    if (now == 0)
        return;
    /* At most one dump a second, and one at a time: an OOM storm must not
     * turn into a storm of multi-megabyte writes, and the newest state is
     * what matters.  The file is written without obs.lock, because the
     * snapshot takes it to print the report. */
    bfc__lock(&ctx->obs.lock);
    bool go = !ctx->obs.dumping && (ctx->obs.last_dump_ns == 0 || now - ctx->obs.last_dump_ns >= 1000000000u);
    if (go) {
        ctx->obs.dumping = true;
        ctx->obs.last_dump_ns = now ? now : 1;
    }
    bfc__unlock(&ctx->obs.lock);
    if (!go)
        return;
    /* The temporary file's name is this dump's own (pid and a process-wide
     * sequence number): several contexts -- the service's one per device,
     * all from one SHARDBFC_CONF -- or processes may dump to one PATH at
     * once, and with one shared "PATH.tmp" the second open truncated the
     * file the first was writing and both wrote into it.  Each rename
     * replaces PATH whole, so PATH is always one complete snapshot (the
     * last renamed).  O_CLOEXEC: a program the server execs meanwhile does
     * not inherit the file.  Cancellation is off while the file is open
     * (write is a cancellation point, and the snapshot takes allocator
     * locks). */
    static _Atomic unsigned dump_seq;
    char tmp[sizeof(ctx->cfg.oom_dump) + 40];
    int cancel_state = bfc__nocancel_begin();
    /* A name taken already (left by a killed process that had our pid: a
     * restarted container's pid 1) is someone else's: the next number. */
    int fd = -1;
    bool failed = true; /* no file could be opened */
    for (int tries = 0; fd < 0 && tries < 8; tries++) {
        int n = snprintf(tmp, sizeof(tmp), "%s" DUMP_TMP_SUFFIX, ctx->cfg.oom_dump, (long)getpid(),
                         atomic_fetch_add_explicit(&dump_seq, 1, memory_order_relaxed));
        if (n <= 0 || (size_t)n >= sizeof(tmp))
            break;
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        errno = 0;
        FILE *f = fdopen(fd, "w");
        bool written = f != NULL && bfc_ctx_snapshot_json(ctx, f) == BFC_OK;
        if (!written)
            err = errno ? errno : EIO;
        if (f ? fclose(f) != 0 : close(fd) != 0) {
            written = false;
            err = errno;
        }
        if (written && rename(tmp, ctx->cfg.oom_dump) != 0) {
            written = false;
            err = errno;
        }
        if (!written)
            (void)unlink(tmp);
        failed = !written;
    }
    bfc__nocancel_end(cancel_state);
    bfc__lock(&ctx->obs.lock);
    ctx->obs.dumping = false;
    /* Checked at creation, the directory can still go away or fill up: a
     * dump that was asked for and is missing is said once per context
     * (not per OOM: an OOM storm must not flood the log). */
    bool say = failed && !ctx->obs.dump_failed_said;
    if (say)
        ctx->obs.dump_failed_said = true;
    bfc__unlock(&ctx->obs.lock);
    if (say) {
        errno = err; /* %m: strerror's text, without its static buffer */
        fprintf(stderr, "libshardbfc: oom_dump=%s: the snapshot could not be written (%m); later failures "
                        "are not said\n",
                ctx->cfg.oom_dump);
    }
}

/* ------------------------------------------------------------ create */

/* Builds a context over an opened backend (which it then owns, also on
 * failure).  cfg has been validated. */
static int ctx_create(bfc_config_t cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out)
{
    int st;
    struct bfc_ctx *ctx = bfc__meta_zalloc(sizeof(*ctx));
    if (!ctx) {
        be->ops->close(be);
        return BFC_ENOMEM;
    }
    ctx->be = be;
    ctx->is_host = host;
    cfg.backend = be->kind;
    cfg.device = be->device; /* SIM has one device: 0, whatever was asked */
    /* A host context shares the process configuration with the device
     * ones but follows neither trace= nor oom_dump=: one file per context
     * is what those mean, and there is a host context per NUMA node (it
     * can still be traced by bfc_ctx_trace_start).  Cleared here, they are
     * what obs_init and oom_dump read and what bfc_ctx_config reports. */
    if (host) {
        cfg.trace[0] = '\0';
        cfg.oom_dump[0] = '\0';
    }
    if (cfg.memory_limit == 0)
        cfg.memory_limit = be->default_limit;
    ctx->limit = cfg.memory_limit & ~(BFC__MIN_ALLOC - 1);
    /* Rounded up to 256 bytes; one within 255 bytes of SIZE_MAX (valid: at
     * least 1 byte) rounds down instead of wrapping to 0.  A first region
     * larger than the limit is cut to what is available anyway. */
    cfg.initial_region = cfg.initial_region > SIZE_MAX - (BFC__MIN_ALLOC - 1) ? SIZE_MAX & ~(size_t)(BFC__MIN_ALLOC - 1)
                                                                              : bfc__round256(cfg.initial_region);
    if (ctx->limit == 0 || cfg.initial_region == 0) {
        st = BFC_EINVAL;
        goto fail_be;
    }
    ctx->cfg = cfg;
    /* At least one chunk: a leftover is a multiple of 256 bytes, so every
     * threshold under 256 cuts the same leftovers (all but none), and 0
     * would "split off" a chunk of 0 bytes from an exact fit -- TensorFlow
     * would (its rule is leftover >= threshold), and a 0-byte chunk in the
     * bins is no chunk at all.  The fraction is of the limit as
     * configured, not as counted (rounded down to 256 bytes): TensorFlow's
     * fragmentation_fraction * memory_limit_. */
    if (cfg.fragmentation_fraction > 0) {
        /* A limit near 2^64 times 1 rounds to 2^64, which no size_t holds. */
        double t = cfg.fragmentation_fraction * (double)cfg.memory_limit;
        ctx->env.max_frag = t < (double)SIZE_MAX ? (size_t)t : SIZE_MAX;
        if (ctx->env.max_frag < BFC__MIN_ALLOC)
            ctx->env.max_frag = BFC__MIN_ALLOC;
    } else
        ctx->env.max_frag = BFC__MAX_INTERNAL_FRAG;
    /* allow_growth=false: TensorFlow serves large requests from its one
     * region too, so the fast path tries the bins for every size. */
    ctx->env.bins_max = (cfg.large_alloc && cfg.allow_growth) ? cfg.large_alloc : SIZE_MAX;
    /* Expandable arenas (expand.c): auto where the backend can; a host
     * context keeps classic regions whatever the setting. */
    bool vmm_able = be->vmm_granule && cfg.allow_growth && ctx->limit >= be->vmm_granule;
    if (!host && cfg.vmm == BFC_VMM_ON && !vmm_able) {
        st = BFC_EINVAL;
        goto fail_be;
    }
    /* Granules are mapped whole, so a limit that is not a whole number of
     * them leaves its last partial granule unusable: auto keeps classic
     * regions where that loses more than 1/64 of the limit (3 MiB would
     * serve 2), vmm=on accepts the loss. */
    bool vmm_whole = vmm_able && (ctx->limit % be->vmm_granule == 0 || ctx->limit / be->vmm_granule >= 64);
    /* large_alloc=0 with a first region of the whole limit asks for
     * TensorFlow's allocator with allow_growth=false exactly (one region of
     * the limit, its split rule): expandable arenas have no regions and
     * ignore both settings, so auto keeps classic regions there; vmm=on
     * still maps by the granule.  (Not for initial_region alone: its
     * default, 2 MiB, covers a small limit that never asked for this.) */
    bool one_region = cfg.large_alloc == 0 && cfg.initial_region >= ctx->limit;
    ctx->vmm = !host && vmm_able &&
               (cfg.vmm == BFC_VMM_ON || (cfg.vmm == BFC_VMM_AUTO && vmm_whole && !one_region));
    if (ctx->vmm)
        ctx->env.bins_max = SIZE_MAX; /* large_alloc is ignored: every block is a chunk */
    st = bfc__pool_init(&ctx->pool, be, ctx->limit, cfg.allow_growth, cfg.garbage_collection);
    if (st != BFC_OK)
        goto fail_be;
    ctx->pool.obs = &ctx->obs;
    /* What the arenas see (max_frag and bins_max are set above). */
    ctx->env.limit = ctx->limit;
    ctx->env.initial_region = cfg.initial_region;
    ctx->env.large_alloc = cfg.large_alloc;
    ctx->env.release_threshold = cfg.release_threshold;
    ctx->env.slack_decay_ms = cfg.slack_decay_ms == 0               ? BFC_DECAY_DEFAULT_MS
                              : cfg.slack_decay_ms == BFC_DECAY_NEVER ? 0
                                                                      : cfg.slack_decay_ms;
    ctx->env.decay_check_allocs = BFC__DECAY_CHECK_ALLOCS;
    ctx->env.allow_growth = cfg.allow_growth;
    ctx->env.poison = cfg.poison && be->host_accessible;
    ctx->env.vmm = ctx->vmm;
    ctx->env.pool = &ctx->pool;
    ctx->env.be = be;
    ctx->env.obs = &ctx->obs;
    ctx->env.tag = ctx;
    ctx->env.poison_errors = &ctx->poison_errors;
    ctx->env.shards_live = &ctx->shards_live;
    ctx->env.alloc_ids = &ctx->alloc_ids;
    ctx->fast_max = ctx->limit < ctx->env.bins_max - 1 ? ctx->limit : ctx->env.bins_max - 1;
    atomic_store_explicit(&ctx->fast_off,
                          (cfg.debug_check ? BFC__FAST_DEBUG : 0) | (ctx->env.poison ? BFC__FAST_POISON : 0),
                          memory_order_relaxed);
    st = thread_room(); /* the directory may start liburcu's resize worker (above) */
    if (st == BFC_OK)
        st = bfc__shard_dir_init(ctx);
    if (st != BFC_OK)
        goto fail_pool;
    st = obs_init(ctx); /* last: it may start a trace */
    if (st != BFC_OK) {
        bfc__shard_dir_fini(ctx);
        goto fail_pool;
    }
    registry_add(ctx);
    *out = ctx;
    return BFC_OK;
fail_pool:
    bfc__pool_fini(&ctx->pool);
fail_be:
    be->ops->close(be);
    bfc__meta_free(ctx, sizeof(*ctx));
    return st;
}

/* Creation is not cancellable (mutex.h): the process set-up joins a probe
 * thread, the backend's open reads files (the CUDA runtime's), and the
 * context's creation waits for liburcu under outer locks. */
static int create_with_backend(const bfc_config_t *cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out);
static int create(const bfc_config_t *cfg_in, bfc_ctx_t **out);

int bfc__ctx_create_with_backend(const bfc_config_t *cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out)
{
    int cs = bfc__nocancel_begin();
    int st = create_with_backend(cfg, be, host, out);
    bfc__nocancel_end(cs);
    return st;
}

int bfc_ctx_create(const bfc_config_t *cfg_in, bfc_ctx_t **out)
{
    int cs = bfc__nocancel_begin();
    int st = create(cfg_in, out);
    bfc__nocancel_end(cs);
    return st;
}

static int create_with_backend(const bfc_config_t *cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out)
{
    *out = NULL;
    if (bfc_config_validate(cfg) != BFC_OK) {
        be->ops->close(be);
        return BFC_EINVAL;
    }
    int st = process_ready();
    if (st != BFC_OK) {
        be->ops->close(be);
        return st;
    }
    return ctx_create(*cfg, be, host, out);
}

static int create(const bfc_config_t *cfg_in, bfc_ctx_t **out)
{
    if (!out)
        return BFC_EINVAL;
    *out = NULL;
    bfc_config_t cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        bfc_config_init(&cfg);
    if (bfc_config_validate(&cfg) != BFC_OK)
        return BFC_EINVAL;
    /* (Host contexts follow no oom_dump: create_with_backend.) */
    if (cfg.oom_dump[0] && !oom_dump_path_ok(cfg.oom_dump))
        return BFC_EINVAL;
    int st = process_ready();
    if (st != BFC_OK)
        return st;
    bfc__backend_t *be;
    st = bfc__backend_open(&cfg, &be);
    if (st != BFC_OK)
        return st;
    return ctx_create(cfg, be, false, out);
}

void bfc_ctx_destroy(bfc_ctx_t *ctx)
{
    if (!ctx)
        return;
    /* Teardown waits for grace periods, a trace's writes and the device
     * under the library's locks: not cancellable (mutex.h). */
    int cs = bfc__nocancel_begin();
    registry_remove(ctx); /* first: a fork from now on does not touch it */
    ctx->destroying = true;
    obs_fini(ctx); /* the trace gets every event up to here */
    /* Work still queued may use the memory: blocks freed a moment ago
     * (their fences are dropped below, not waited for) and blocks still
     * live.  cudaFree waits for the device by itself (its documentation
     * says it "may perform implicit synchronization"; every driver does,
     * and PyTorch's caching allocator relies on it the same way when it
     * frees cached blocks), so classic regions are safe; cuMemUnmap does not, and a kernel still writing an
     * unmapped page faults and breaks the process's CUDA context for good.
     * So an expandable context waits for the device first, as PyTorch's
     * expandable segments synchronise before they unmap.  A host context
     * too: its memory is unpinned (cudaHostUnregister) and unmapped, and a
     * copy still queued on a block would read or write memory that is gone
     * (its backend synchronises the device its events live on).  A failure
     * (a context already broken; SIM with a stream held) changes nothing:
     * destroy cannot fail. */
    if (ctx->vmm || ctx->is_host)
        (void)ctx->be->ops->device_sync(ctx->be);
    bfc__shard_dir_fini(ctx);
    bfc__pool_fini(&ctx->pool);
    bfc__regionmap_forget(ctx); /* its departed ranges: no pointer of it is ours now */
    ctx->be->ops->close(ctx->be);
    bfc__meta_free(ctx, sizeof(*ctx));
    bfc__nocancel_end(cs);
}

int bfc_ctx_config(bfc_ctx_t *ctx, bfc_config_t *out)
{
    if (!ctx || !out)
        return BFC_EINVAL;
    *out = ctx->cfg;
    /* What it runs with: the limit in whole 256-byte units, vmm decided. */
    out->memory_limit = ctx->limit;
    out->vmm = ctx->vmm ? BFC_VMM_ON : BFC_VMM_OFF;
    return BFC_OK;
}

/* ------------------------------------------------------------ debug */

static void debug_check(struct bfc_ctx *ctx)
{
    char buf[512];
    if (bfc_ctx_check_report(ctx, buf, sizeof(buf)) != BFC_OK) {
        (void)bfc__nocancel_begin(); /* the report, then the abort (mutex.h) */
        fprintf(stderr, "libshardbfc: debug_check: %s\n", buf);
        abort();
    }
}

/* ------------------------------------------------------------- alloc */

/* -------------------------------------------- out of memory: escalation */

static void sleep_ms(unsigned ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/*
 * retry_ms: waits a millisecond for other threads to free memory (and on
 * SIM for streams to be drained), with a's lock dropped.  *deadline starts
 * at 0 and is set at the first call; false, without waiting, once the
 * budget is spent (or retry_ms is 0).
 */
static bool retry_wait(struct bfc_ctx *ctx, struct bfc__arena *a, uint64_t *deadline)
{
    if (ctx->cfg.retry_ms == 0)
        return false;
    if (*deadline == 0)
        *deadline = bfc__deadline_in((uint64_t)ctx->cfg.retry_ms * 1000000u);
    if (bfc__deadline_passed(*deadline))
        return false;
    bfc__unlock(&a->lock);
    sleep_ms(1);
    bfc__lock(&a->lock);
    return true;
}

/*
 * How long the slow path waits for fences.  On a device, queued work always
 * finishes, so without bound (PyTorch's caching allocator synchronises its
 * outstanding events the same way before it reports out of memory).  On SIM
 * a held stream finishes only when a test drains it: no wait here, and
 * retry_ms (below) polls instead, so a test decides how long a shard waits.
 */
static uint32_t fence_wait_ms(struct bfc_ctx *ctx)
{
    return ctx->be->kind == BFC_BACKEND_SIM ? 0 : UINT32_MAX;
}

/* Set while alloc_observed retries an allocation for the OOM callback:
 * num_ooms counts allocations, not attempts, so the retry's failure is not
 * counted again (the first attempt's was, before the callback saw it; a
 * retry that succeeds leaves that count, which never goes back). */
static __thread bool oom_retrying;

/* A failed allocation, counted once (a->lock held): on its shard, or on
 * the context when the shard died while the slow path had dropped its lock
 * (a stream released meanwhile): a dead shard's counters have moved to the
 * context's retired totals already, and a count added to it would be lost.
 * With no shard at all (a == NULL: none could be made, or a request above
 * the limit on a stream that has none), on the context. */
static void count_oom(struct bfc_ctx *ctx, struct bfc__arena *a, int st)
{
    if (st == BFC__RETRY || oom_retrying)
        return;
    if (!a || a->dead)
        atomic_fetch_add_explicit(&ctx->ooms, 1, memory_order_relaxed); /* relaxed: a statistic */
    else
        a->st.ooms++;
}

/* ------------------------------------------- expandable arenas' escalation
 *
 * The primitives are expand.c's (mark, fence and unmap free granules) and
 * the arena's (fit, drain, wait for pending fences); the order in which
 * they are tried, reaching other shards and waiting, is policy, here. */

#define UNMAP_WAIT_MAX 64

/* Calls fn on every live shard but self, each under its own lock after
 * draining it (blocks other streams freed to it count as freed; a drain
 * may retire an expandable shard's reservation).  self's lock not held:
 * arenas_lock, then one arena lock at a time. */
static void each_other_drained(struct bfc_ctx *ctx, struct bfc__arena *self,
                               void (*fn)(struct bfc__arena *a, void *arg), void *arg)
{
    struct bfc__arena *a;
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        if (a == self)
            continue;
        bfc__lock(&a->lock);
        if (!a->dead) {
            bfc__arena_drain_locked(a, true);
            fn(a, arg);
        }
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
}

/*
 * Could any memory given back make room for a block of `rounded` bytes?
 * Not when the blocks in use -- `mine` in the asking shard, and every other
 * shard's, each drained first so that blocks freed to it by other streams
 * count as free -- leave less of the limit than that (the block itself,
 * not its whole granules: it may begin in a granule that a live block of
 * its shard maps already): the memory other shards
 * cache, and the pool's, would go back to the device (a cudaFree, which
 * waits for the whole device; an unmap) and the request fail all the
 * same, and with retry_ms every millisecond of the wait, each time taken
 * again by its shard's next allocation.  TensorFlow's DeallocateFreeRegions
 * makes the same test before it frees (own_room, below, is its form for one
 * shard).  Pending blocks count as free: their fences may complete.  The
 * shards are read one at a time under their own locks, a->lock not held:
 * an allocation on another stream that follows a free on a third during
 * the walk may be counted with that free's block, a bound that errs toward
 * "futile" by that block for a request at the very edge of the limit; the
 * request is refused as it would be an instant later, when the allocation
 * has taken the room.
 */
static void add_live(struct bfc__arena *a, void *live)
{
    *(size_t *)live += a->st.bytes_in_use;
}

static bool futile(struct bfc_ctx *ctx, struct bfc__arena *self, size_t mine, size_t rounded)
{
    size_t committed = atomic_load_explicit(&ctx->pool.committed, memory_order_relaxed);
    if (rounded > ctx->limit)
        return true;
    if (committed <= ctx->limit - rounded) /* room now: not this test's case */
        return false;
    size_t live = mine;
    each_other_drained(ctx, self, add_live, &live);
    return live > ctx->limit - rounded;
}

/* Asks every other shard for its free granules: all of them (`all`: at the
 * limit, and trim) or those beyond what it keeps for its own churn (a
 * growth that still fits the limit; expand.c, "When", (a)).  With wait_ms,
 * waits for their fences without a lock and unmaps again. */
struct unmap_walk {
    bool all, again;
    size_t loan, n;
    bfc__event_t evs[UNMAP_WAIT_MAX];
};

static void unmap_one(struct bfc__arena *a, void *arg)
{
    struct unmap_walk *w = arg;
    if (!a->x)
        return;
    if (w->all)
        (void)bfc__expand_release_locked(a, 0);
    else
        (void)bfc__expand_release_spare_locked(a, &w->loan);
    if (a->x && a->x->leaving_bytes) {
        w->again = true;
        /* The record is the pool's: its event outlives our locks. */
        struct bfc__fence *f = a->x->fence;
        if (w->n < UNMAP_WAIT_MAX && f->ev && !f->synced && !f->unfenced)
            w->evs[w->n++] = f->ev;
    }
}

static void expand_unmap_others(struct bfc_ctx *ctx, struct bfc__arena *self, uint32_t wait_ms, bool all,
                                size_t need)
{
    struct unmap_walk w = { .all = all, .loan = need };
    struct bfc__arena *a;
    each_other_drained(ctx, self, unmap_one, &w);
    if (!w.again || wait_ms == 0)
        return;
    for (size_t i = 0; i < w.n; i++)
        (void)ctx->be->ops->event_wait(ctx->be, w.evs[i], wait_ms);
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        if (a == self)
            continue;
        bfc__lock(&a->lock);
        if (!a->dead && a->x && a->x->leaving_bytes)
            (void)bfc__expand_release_locked(a, 0);
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
}

/* The best fit, mapped; NULL with *st why. */
static void *expand_fit(struct bfc__arena *a, size_t n, size_t rounded, int *st)
{
    if (!a->x) {
        *st = BFC_ENOMEM;
        return NULL;
    }
    a->x->map_status = BFC_ENOMEM;
    void *p = bfc__arena_fit_locked(a, n, rounded);
    *st = p ? BFC_OK : a->x->map_status;
    if (a->x)
        a->x->spared = 0; /* the release's spare served this fit only */
    return p;
}

/*
 * A shard with nothing live trades its reservation for another:
 *  - for a departed one of its own stream that holds more mapped memory,
 *    as a new shard of the stream would adopt it (expand.c, "Departure").
 *    The case: a shard was released while a block of it was pending on
 *    another stream's fence, its stream meanwhile made this shard, and the
 *    old reservation departed only later, fenced on the stream's queued
 *    work.  Without the trade the stream's allocations are refused (or
 *    wait for its own work, on a GPU) while its own memory holds the limit
 *    (found by make fuzz: limit 4 MiB, all of it departed, 13 KB refused).
 *  - for a new one, when the block does not fit its range at all: a range
 *    short of the limit is a fallback taken while the address space was
 *    short (expand.c, reserve()), and the addresses may have come back
 *    since.  Without it such a shard refused every larger block until a
 *    trim or its stream's release, with the limit free.  The new range is
 *    had before the old one goes (expand_regrow): where the address space
 *    still refuses, the shard keeps its range, as a hopeless request must
 *    leave it.
 * Ours departs fenced as any other; nothing is mapped or unmapped.
 */
static bool expand_regrow(struct bfc__arena *a, size_t rounded)
{
    /* bfc__arena_expand_locked makes a->x; the old one is set aside until
     * the new exists, then departs as itself (bfc__expand_depart_locked
     * works on a->x).  Both regions are the arena's meanwhile, under its
     * lock: the old one holds nothing, so no lookup finds a block in it. */
    struct bfc__expand *old = a->x;
    a->x = NULL;
    if (bfc__arena_expand_locked(a, rounded) != BFC_OK) {
        a->x = old;
        return false;
    }
    struct bfc__expand *nx = a->x;
    nx->deferred = true; /* as a shard's first: the slow path maps where it must */
    a->x = old;
    bfc__arena_region_depart(a, old->region, true);
    a->x = nx;
    return true;
}

/* Will the escalation give the shard's range up for a new one
 * (expand_trade, expand_regrow)?  When nothing in it is live or pending and
 * the block is larger than the range. */
static bool expand_regrows(const struct bfc__arena *a, size_t rounded)
{
    return a->x && a->x->region->live == 0 && rounded > a->x->size;
}

static bool expand_trade(struct bfc__arena *a, size_t rounded)
{
    struct bfc__expand *x = a->x;
    if (!x || x->region->live != 0)
        return false;
    if (expand_regrows(a, rounded))
        return expand_regrow(a, rounded);
    if (bfc__pool_vmm_gone_mapped(a->env->pool, a->stream_id, rounded) <= x->mapped_bytes)
        return false;
    bfc__arena_region_depart(a, x->region, true);
    return true;
}

static void *expand_retry(struct bfc__arena *a, size_t n, size_t rounded, int *st)
{
    /* acquire: pairs with the seq_cst store in bfc__remote_mark_retired. */
    if (atomic_load_explicit(&a->retired, memory_order_acquire)) {
        *st = BFC__RETRY;
        return NULL;
    }
    for (bool traded = false;; traded = true) {
        if (!a->x) {
            int s = bfc__arena_expand_locked(a, rounded);
            if (s != BFC_OK) {
                *st = s;
                return NULL;
            }
            a->x->deferred = true; /* the slow path maps where it must */
        }
        bfc__arena_drain_locked(a, true);
        void *p = expand_fit(a, n, rounded, st);
        if (p || *st != BFC_ENOMEM || traded || !expand_trade(a, rounded))
            return p;
    }
}

/*
 * The escalation of an expandable arena, cheapest first: our queue and
 * pending fences; the best fit, mapping what it lacks (or a departed
 * reservation of our stream, traded for ours: expand_trade); waiting for
 * our own pending frees; unmapping our own free granules (so that the limit
 * lets us map where the best fit lands); other shards' free granules, their
 * fences waited for without a lock; departed reservations' fences;
 * retry_ms.
 */
static void *expand_escalate(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status)
{
    uint32_t wait = fence_wait_ms(ctx);
    int st = BFC_ENOMEM;
    void *p;
    if ((p = expand_retry(a, n, rounded, &st)))
        return p;
    if (st != BFC_ENOMEM)
        goto fail;
    if (!cds_list_empty(&a->pending) && a->st.pending_bytes + bfc__arena_free_bytes(a) >= rounded) {
        bfc__arena_wait_pending_locked(a, wait);
        if ((p = expand_fit(a, n, rounded, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
    }
    for (uint64_t deadline = 0;;) {
        if (bfc__expand_release_for_locked(a, wait, rounded) && (p = expand_fit(a, n, rounded, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
        /* No reservation: the address space refused even this block's
         * (expand.c, reserve()).  Other shards' free granules would not
         * help, only departed reservations going back. */
        bool reserved = a->x != NULL;
        size_t mine = a->st.bytes_in_use;
        bfc__unlock(&a->lock);
        if (reserved && !futile(ctx, a, mine, rounded))
            expand_unmap_others(ctx, a, wait, true, 0);
        bfc__pool_wait(&ctx->pool, a->stream_id, true, wait);
        bfc__lock(&a->lock);
        if ((p = expand_retry(a, n, rounded, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
        /* The departed ranges' addresses gave us a reservation just now:
         * other shards' free granules help us from here on, so this pass
         * runs again with them (once: a reservation is never given up
         * unreplaced).  Else a request the limit could serve failed, as
         * "held by other streams", with nothing pending anywhere. */
        if (!reserved && a->x)
            continue;
        /* Last resort before waiting: best fit chose a chunk whose granules
         * need a map the limit refuses, while a larger free chunk has the
         * block's bytes mapped already (a free tail past a live block,
         * say).  Off best fit, but memory the shard holds: the OOM report
         * counts it as ready (limit 8 MiB, a 3 MiB hole unmapped between
         * live blocks, the limit taken by another stream: 1.5 MiB failed on
         * every retry beside 2 MiB - 256 mapped and free).  Before
         * retry_ms's wait, which would only delay it. */
        if ((p = bfc__arena_fit_mapped_locked(a, n, rounded)))
            return p;
        if (!retry_wait(ctx, a, &deadline))
            break;
        if ((p = expand_retry(a, n, rounded, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
    }
fail:
    *status = st;
    count_oom(ctx, a, st);
    return NULL;
}

/*
 * The slow path of an expandable arena.  The fast path comes here instead
 * of growing while other shards hold spare granules (`deferred`, set by
 * bfc__expand_make_ready_locked), or for a shard with no reservation yet
 * (or one the escalation will give a new one) when they say they do (the
 * pool's vmm_idle hint, or vmm_lendable for a growth that would raise the
 * peak reserved): their spare goes first (fenced, not waited for), as one
 * allocator over the device would reuse it, then the escalation maps where
 * it must -- and at the limit takes everything free (expand_escalate).
 */
static void *expand_alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status)
{
    size_t gran = ctx->be->vmm_granule, need = bfc__round_up(rounded, gran);
    /* Other shards lend their slack only to a growth that would raise the
     * peak reserved: below it, what a shard keeps for its churn costs no
     * memory the context has not held already (expand.c, "When", (a)). */
    bool peak = bfc__pool_would_peak(&ctx->pool, need);
    /* A range the escalation gives up for a new one grows as a shard's
     * first block does: the new range maps at once, so the other shards
     * are asked here or not at all. */
    bool others = !a->x ? atomic_load_explicit(&ctx->pool.vmm_idle, memory_order_relaxed) >= gran ||
                              (peak && atomic_load_explicit(&ctx->pool.vmm_lendable, memory_order_relaxed) >= gran)
                  : expand_regrows(a, rounded) ? bfc__expand_ask_others(a, need)
                                               : a->x->deferred;
    if (others) {
        size_t mine = a->st.bytes_in_use;
        bfc__unlock(&a->lock);
        if (!futile(ctx, a, mine, rounded))
            expand_unmap_others(ctx, a, 0, false, peak ? need : 0);
        bfc__lock(&a->lock);
    }
    if (a->x)
        a->x->deferred = true; /* the escalation maps where it must */
    void *p = expand_escalate(ctx, a, n, rounded, status);
    if (a->x)
        a->x->deferred = false;
    return p;
}

/* Could giving our fully free regions back to the pool make room for
 * `rounded` bytes?  A hopeless request leaves the shard as it was:
 * TensorFlow's DeallocateFreeRegions test (the limit's room plus the
 * free regions' bytes); free chunks of regions still in use do not count,
 * since step 4 cannot give them (limit 16 MiB, regions of 2 MiB with 1 MiB
 * live and of 4 MiB free: a 14.5 MiB request gave the 4 MiB region back to
 * the device and still failed). */
static bool own_room(struct bfc_ctx *ctx, struct bfc__arena *a, size_t rounded)
{
    size_t committed = atomic_load_explicit(&ctx->pool.committed, memory_order_relaxed);
    size_t room = committed < ctx->limit ? ctx->limit - committed : 0;
    size_t idle = bfc__arena_idle_region_bytes(a);
    return idle && idle + room >= rounded;
}

/* Step 4 of the slow path: gives our fully free regions back to the pool,
 * where they coalesce with the free memory around them, when that could
 * make room (allow_growth=false, or garbage_collection: see there).  True
 * when any went. */
static bool shed_own(struct bfc_ctx *ctx, struct bfc__arena *a, size_t rounded)
{
    if (!(!ctx->cfg.allow_growth || ctx->cfg.garbage_collection) || !own_room(ctx, a, rounded))
        return false;
    /* TensorFlow's garbage collection (DeallocateFreeRegions, then Extend)
     * leaves the doubling schedule where it was, so the region that follows
     * is min(curr, available) even when every region went.  Only memory
     * taken from outside the allocation -- trim, another shard's reclaim --
     * restarts it (bfc__arena_region_depart). */
    size_t curr = a->curr_region_bytes;
    bool shed = bfc__arena_shed_locked(a, false) != 0;
    a->curr_region_bytes = curr;
    return shed;
}

/* After the lock was dropped: the shard may have been retired (*status =
 * BFC__RETRY); else our queue, the bins and a new region once more.  NULL
 * with *status BFC_ENOMEM when nothing worked. */
static void *retry_here(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, bool large,
                        bool fit_first, int *status)
{
    void *p;
    (void)ctx;
    /* acquire: pairs with the seq_cst store in bfc__remote_mark_retired. */
    if (atomic_load_explicit(&a->retired, memory_order_acquire)) {
        *status = BFC__RETRY;
        return NULL;
    }
    bfc__arena_drain_locked(a, true);
    if (fit_first && (p = bfc__arena_fit_locked(a, n, rounded)))
        return p;
    *status = BFC_ENOMEM;
    return bfc__arena_grow_locked(a, n, rounded, large, status);
}

#define TAILS_MAX 256

static int range_cmp(const void *x, const void *y)
{
    const struct bfc__range *a = x, *b = y;
    return a->base < b->base ? -1 : a->base > b->base;
}

/* Would the free tails of every shard's regions, given back, make room for
 * `rounded` bytes for a's stream?  a->lock held; dropped and retaken to read
 * the other shards. */
static bool tails_help(struct bfc_ctx *ctx, struct bfc__arena *a, size_t rounded)
{
    struct bfc__range r[TAILS_MAX];
    size_t n = bfc__arena_tails_locked(a, r, TAILS_MAX);
    bfc__unlock(&a->lock);
    n += bfc__shard_collect_tails(ctx, a, r + n, TAILS_MAX - n);
    bfc__lock(&a->lock);
    if (n == 0)
        return false;
    qsort(r, n, sizeof(r[0]), range_cmp);
    return bfc__pool_fits_with(&ctx->pool, a->stream_id, r, n, rounded);
}

/*
 * The slow path, policy of the context over the arena's primitives (the
 * shape of TensorFlow's AllocatorRetry and RMM's defragmenting retry): each
 * step costs more than the one before and runs only when the cheaper ones
 * failed.  Called and returns with a->lock held; drops it to reach other
 * shards and to wait (never holding two arena locks).  *status: BFC_ENOMEM,
 * a backend error, or BFC__RETRY when the shard was retired meanwhile (the
 * caller looks the stream up again).
 */
static void *alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status);

/* The slow path waits (fences, retry_ms) with locks held or about to be
 * taken again: not cancellable (mutex.h). */
void *bfc__ctx_alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status)
{
    int cs = bfc__nocancel_begin();
    void *p = alloc_slow(ctx, a, n, rounded, status);
    bfc__nocancel_end(cs);
    return p;
}

static void *alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status)
{
    if (ctx->vmm) /* expandable arenas have their own escalation */
        return expand_alloc_slow(ctx, a, n, rounded, status);
    /* allow_growth=false: TensorFlow serves large requests from its region
     * -- the first one too, which must not make a region of its own. */
    bool large = ctx->cfg.allow_growth && ctx->cfg.large_alloc && rounded >= ctx->cfg.large_alloc;
    bool fit_first = !large;
    uint32_t wait = fence_wait_ms(ctx);
    int st = BFC_ENOMEM;
    void *p;

    /* 1. Our own queue and every pending fence, polled. */
    bfc__arena_drain_locked(a, true);
    if (fit_first && (p = bfc__arena_fit_locked(a, n, rounded)))
        return p;
    /* 2. A new region from the pool (TensorFlow's Extend). */
    if ((p = bfc__arena_grow_locked(a, n, rounded, large, &st)))
        return p;
    if (st != BFC_ENOMEM)
        goto fail;
    /* 3. Our pending frees, when they could serve: wait for their fences. */
    if (!cds_list_empty(&a->pending) && a->st.pending_bytes + bfc__arena_free_bytes(a) >= rounded) {
        bfc__arena_wait_pending_locked(a, wait);
        if (fit_first && (p = bfc__arena_fit_locked(a, n, rounded)))
            return p;
    }
    for (uint64_t deadline = 0;;) {
        /* 4. Our fully free regions back to the pool, where they coalesce
         * with the free memory around them; we may take them back at once
         * (stream order), so a request that fits the pool's free memory
         * succeeds.  With allow_growth=true the pool's segments are separate
         * backend allocations that cannot coalesce: there this only helps by
         * returning memory to the backend, which is what
         * garbage_collection asks for (TensorFlow's semantics: without it a
         * shard keeps its regions and the request fails -- bar step 6, which
         * gives them back, whole, only where that makes the request fit in
         * memory the pool holds, with no backend call). */
        if (shed_own(ctx, a, rounded)) {
            st = BFC_ENOMEM;
            if ((p = bfc__arena_grow_locked(a, n, rounded, large, &st)))
                return p;
        }
        /* 5. Other shards' fully free regions, each fenced on its own
         * stream.  Memory that other streams' fences still guard: wait for
         * their work.  Our lock is dropped meanwhile (no path holds two
         * arena locks).  Then, with garbage collection, the pool's cached
         * segments go back to the backend (TensorFlow's retry after a
         * failed cudaMalloc) -- after a first try, so that a region the
         * pool can hand over as it is is taken, not freed and allocated
         * again: on a GPU that costs a cudaFree, which waits for the whole
         * device. */
        size_t mine = a->st.bytes_in_use;
        bfc__unlock(&a->lock);
        bool hopeless = futile(ctx, a, mine, rounded);
        if (!hopeless) {
            bfc__shard_reclaim_others(ctx, a, false);
            bfc__pool_wait(&ctx->pool, a->stream_id, false, wait);
        }
        bfc__lock(&a->lock);
        /* Steps 5 to 6 are for a request the limit could hold beside the
         * blocks in use (futile): else they would only give memory back to
         * the device for the shards that cached it to take again. */
        if (hopeless)
            goto last;
        if ((p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
        /* Step 4 again: it judged our free regions by what the limit had
         * room for then; with the other shards' regions back in the pool
         * ours may now make the piece the request needs with them. */
        if (shed_own(ctx, a, rounded)) {
            if ((p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
                return p;
            if (st != BFC_ENOMEM)
                goto fail;
        }
        if (ctx->cfg.garbage_collection && bfc__pool_release_free(&ctx->pool) > 0) {
            if ((p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
                return p;
            if (st != BFC_ENOMEM)
                goto fail;
        }
        /* 6. Free tails of regions still in use, ours and other shards':
         * only when giving them back makes the request fit, because a
         * shard that gives up a tail keeps its regions cut there (with
         * allow_growth=false this is how a second stream is served from the
         * one region of the first). */
        if (tails_help(ctx, a, rounded)) {
            bfc__arena_shed_locked(a, true);
            bfc__unlock(&a->lock);
            bfc__shard_reclaim_others(ctx, a, true);
            bfc__pool_wait(&ctx->pool, a->stream_id, false, wait);
            bfc__lock(&a->lock);
            if ((p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
                return p;
            if (st != BFC_ENOMEM)
                goto fail;
        }
    last:
        /* The lock was dropped (the walks of the other shards): a shard
         * retired meanwhile hands out nothing more.  acquire: pairs with
         * the seq_cst store in bfc__remote_mark_retired. */
        if (atomic_load_explicit(&a->retired, memory_order_acquire)) {
            st = BFC__RETRY;
            goto fail;
        }
        /* Last resort for a large request: a big enough free chunk of an
         * ordinary region (TensorFlow's allocator would use it too). */
        if (large && (p = bfc__arena_fit_locked(a, n, rounded)))
            return p;
        /* 7. retry_ms: wait for other threads to free memory (and on SIM
         * for streams to be drained), polling every millisecond. */
        if (!retry_wait(ctx, a, &deadline))
            break;
        if ((p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
            return p;
        if (st != BFC_ENOMEM)
            goto fail;
    }
    /* Before failing: the steps above moved memory between the shards and
     * the pool, and other threads freed meanwhile; a piece that arrived in
     * the pool after our last look serves the request (rarely: 1 in 1,000
     * stressed runs failed with one). */
    if (bfc__pool_largest(&ctx->pool, a->stream_id) >= rounded &&
        (p = retry_here(ctx, a, n, rounded, large, fit_first, &st)))
        return p;
fail:
    *status = st;
    count_oom(ctx, a, st);
    return NULL;
}

/* A request above the limit, counted once: on the stream's shard when it
 * has one (so that its num_ooms, like every other failure's, is the
 * stream's and the context's figure is the sum of its shards'), else on
 * the context.  No shard is made for a request that could never be
 * served.  A stream the backend refuses is refused first (BFC_EINVAL),
 * whatever the size, and nothing is counted. */
static __attribute__((noinline, cold)) int count_too_large(struct bfc_ctx *ctx, bfc_stream_t stream)
{
    uint64_t id;
    bfc__rcu_lock();
    struct bfc__arena *a = bfc__shard_find(ctx, stream);
    int st = a ? BFC_OK : bfc__shard_stream_id(ctx, stream, &id);
    if (st == BFC_OK) {
        if (a)
            bfc__lock(&a->lock);
        count_oom(ctx, a, BFC_ENOMEM);
        if (a)
            bfc__unlock(&a->lock);
        st = BFC_ENOMEM;
    }
    bfc__rcu_unlock();
    return st;
}

/* One attempt: NULL with *status on failure. */
static inline __attribute__((always_inline)) void *alloc_once(struct bfc_ctx *ctx, bfc_stream_t stream,
                                                               size_t n, int *status)
{
    size_t rounded = bfc__round256(n);
    if (BFC__UNLIKELY(rounded == 0 || rounded > ctx->limit)) {
        *status = count_too_large(ctx, stream);
        return NULL;
    }
    void *p = NULL;
    int st = BFC_ENOMEM;
    bfc__rcu_lock();
    for (;;) {
        struct bfc__arena *a = bfc__shard_get(ctx, stream, &st);
        if (!a) {
            /* No shard: its metadata could not be had (BFC_ENOMEM, a failed
             * allocation like any other, counted on the context), or the
             * stream is refused. */
            if (st == BFC_ENOMEM)
                count_oom(ctx, NULL, st);
            break;
        }
        bfc__lock(&a->lock);
        if (BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire))) {
            /* Released under our feet: the directory has forgotten it, so
             * the next lookup makes a fresh shard. */
            bfc__unlock(&a->lock);
            continue;
        }
        p = bfc__arena_alloc_inline(a, n, rounded);
        if (BFC__UNLIKELY(!p)) {
            st = BFC_ENOMEM;
            p = bfc__ctx_alloc_slow(ctx, a, n, rounded, &st);
            if (st == BFC__RETRY) {
                bfc__unlock(&a->lock);
                continue;
            }
        }
        bfc__unlock(&a->lock);
        break;
    }
    bfc__rcu_unlock();
    *status = st;
    return p;
}

/* A failed allocation, or any allocation while a trace runs: the OOM
 * report (callback, one retry, oom_dump) and the trace event.  No allocator
 * lock is held here. */
static __attribute__((noinline, cold)) void *alloc_observed(struct bfc_ctx *ctx, bfc_stream_t stream, size_t n,
                                                            void *p, int st)
{
    if (!p && st == BFC_ENOMEM) {
        if (bfc__oom_callback(ctx, n, stream, bfc_ctx_stats)) {
            oom_retrying = true;
            p = alloc_once(ctx, stream, n, &st);
            oom_retrying = false;
        }
        if (!p && st == BFC_ENOMEM)
            oom_dump(ctx);
    }
    if (bfc__tracing(&ctx->obs))
        bfc__trace_event(&ctx->obs, p ? BFC__TR_ALLOC : BFC__TR_ALLOC_FAIL, (uintptr_t)p, n, stream);
    bfc__set_last_error(p ? BFC_OK : st);
    if (BFC__UNLIKELY(ctx->cfg.debug_check))
        debug_check(ctx);
    return p;
}

/* The end of every allocation: the OOM report and trace (alloc_observed),
 * the thread's last error, the debug check. */
static inline __attribute__((always_inline)) void *alloc_exit(struct bfc_ctx *ctx, bfc_stream_t stream, size_t n,
                                                             void *p, int st)
{
    /* The one test observability adds: failure or a running trace. */
    if (BFC__UNLIKELY((p == NULL) | bfc__tracing(&ctx->obs)))
        return alloc_observed(ctx, stream, n, p, st);
    bfc__set_last_error(BFC_OK);
    if (BFC__UNLIKELY(ctx->cfg.debug_check))
        debug_check(ctx);
    return p;
}

/* The general allocation: every case (bfc_ctx_alloc, below, takes the
 * common one). */
static __attribute__((noinline)) void *alloc_general(struct bfc_ctx *ctx, bfc_stream_t stream, size_t n)
{
    if (BFC__UNLIKELY(!ctx)) {
        bfc__set_last_error(BFC_EINVAL);
        return NULL;
    }
    if (BFC__UNLIKELY(n == 0)) {
        bfc__set_last_error(BFC_OK);
        return NULL;
    }
    int st;
    void *p = alloc_once(ctx, stream, n, &st);
    return alloc_exit(ctx, stream, n, p, st);
}

/* The fast path's ways out, holding a's lock and the read section (tail
 * calls from bfc_ctx_alloc): the rest of alloc_once's step for a request
 * the fast path declined before changing anything, and the wake of a
 * waiter on the lock, which the fast path has released. */
static __attribute__((noinline)) void *alloc_locked_rest(struct bfc_ctx *ctx, bfc_stream_t stream,
                                                        struct bfc__arena *a, size_t n, size_t rounded)
{
    void *p = NULL;
    int st = BFC_ENOMEM;
    /* acquire: as alloc_once. */
    if (BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire)))
        st = BFC__RETRY;
    else if (!(p = bfc__arena_alloc_inline(a, n, rounded)))
        p = bfc__ctx_alloc_slow(ctx, a, n, rounded, &st);
    bfc__unlock(&a->lock);
    bfc__rcu_unlock();
    if (st == BFC__RETRY) /* the shard was released: alloc_once's next round */
        return alloc_general(ctx, stream, n);
    return alloc_exit(ctx, stream, n, p, st);
}

static __attribute__((noinline)) void *alloc_wake(struct bfc__arena *a, void *p)
{
    bfc__unlock_wake(&a->lock);
    bfc__rcu_unlock();
    bfc__set_last_error(BFC_OK);
    return p;
}

/* The fast paths' read section.  With membarrier (the thread's inline
 * cache filled, rcu.h) its steps are inline; without, they are rcu.h's
 * general calls, whose fenced steps run out of line (`fenced`, a constant
 * in each copy of a fast path). */
static inline __attribute__((always_inline)) void fast_rcu_lock(bool fenced)
{
    if (fenced)
        bfc__rcu_lock();
    else
        bfc__rcu_lock_on(bfc__rcu_ctr);
}

static inline __attribute__((always_inline)) void fast_rcu_unlock(bool fenced)
{
    if (fenced)
        bfc__rcu_unlock();
    else
        bfc__rcu_unlock_on(bfc__rcu_ctr);
}

/*
 * The common allocation: the thread's last stream (bfc__shard_hit), a best
 * fit in the bins on mapped memory, a record at hand if it splits, no
 * remote frees to drain, nobody waiting on the lock, no trace, no poison,
 * no debug check.  Like bfc_ctx_free it makes no call but tail calls;
 * whatever else it meets it hands, before it has changed anything, to
 * alloc_general or (holding the lock) to alloc_locked_rest, whose paths are
 * alloc_once's.  Where the read section's steps are not inline (no
 * membarrier, or the thread's first section) the same path runs with
 * rcu.h's calls, in alloc_fast_fenced.
 */
static inline __attribute__((always_inline)) void *alloc_fast(struct bfc_ctx *ctx, bfc_stream_t stream, size_t n,
                                                             bool fenced)
{
    size_t rounded = bfc__round256(n); /* 0 for 0 and on overflow */
    /* rounded - 1 >= fast_max: rounded is 0, above the limit or a large
     * block's (ctx.h); fast_off: debug_check, poison or a trace. */
    if (BFC__UNLIKELY(!ctx || rounded - 1 >= ctx->fast_max ||
                      atomic_load_explicit(&ctx->fast_off, memory_order_relaxed)))
        return alloc_general(ctx, stream, n);
    fast_rcu_lock(fenced);
    if (BFC__UNLIKELY(!bfc__shard_hit(ctx, stream)))
        goto general;
    struct bfc__arena *a = bfc__shard_last.arena;
    if (BFC__UNLIKELY(!bfc__trylock(&a->lock)))
        goto general;
    /* acquire: as alloc_once. */
    if (BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire) || bfc__arena_rq_waiting(a) ||
                      a->st.pending || a->next_id == a->id_end))
        return alloc_locked_rest(ctx, stream, a, n, rounded);
    struct bfc__chunk *c = bfc__bins_best_fit_inline(&a->bins, rounded), *leftover = NULL;
    if (BFC__UNLIKELY(!c || (a->x != NULL && !bfc__expand_backed(a->x, c->ptr + c->size))))
        return alloc_locked_rest(ctx, stream, a, n, rounded);
    /* A binned chunk is never a large region's (those leave at their
     * free), so TensorFlow's split rule applies as it stands. */
    if (bfc__arena_should_split(a, c, rounded)) {
        leftover = bfc__slab_pop(&a->chunk_slab, sizeof(struct bfc__chunk));
        if (BFC__UNLIKELY(!leftover))
            return alloc_locked_rest(ctx, stream, a, n, rounded);
    }
    /* From here on as bfc__arena_take_inline. */
    bfc__bins_remove_binned_inline(&a->bins, c);
    if (leftover) {
        bfc__arena_chunk_init(a, leftover);
        bfc__arena_split_with(a, c, leftover, rounded);
    }
    void *p = bfc__arena_hand_out(a, c, n);
    if (BFC__UNLIKELY(bfc__unlock_nowake(&a->lock)))
        return alloc_wake(a, p);
    fast_rcu_unlock(fenced);
    bfc__set_last_error(BFC_OK);
    return p;
general:
    fast_rcu_unlock(fenced);
    return alloc_general(ctx, stream, n);
}

static __attribute__((noinline)) void *alloc_fast_fenced(struct bfc_ctx *ctx, bfc_stream_t stream, size_t n)
{
    return alloc_fast(ctx, stream, n, true);
}

void *bfc_ctx_alloc(bfc_ctx_t *ctx, bfc_stream_t stream, size_t n)
{
    if (BFC__UNLIKELY(bfc__rcu_ctr == NULL))
        return alloc_fast_fenced(ctx, stream, n);
    return alloc_fast(ctx, stream, n, false);
}

/* -------------------------------------------------------------- free */

/* Resolves p to its region and chunk (lock-free).  Under rcu_read_lock. */
static inline __attribute__((always_inline)) int resolve(struct bfc_ctx *ctx, uintptr_t p,
                                                         struct bfc__region **rp, struct bfc__chunk **cp)
{
    struct bfc__region *r = bfc__regionmap_lookup(p);
    *rp = NULL;
    *cp = NULL;
    if (!r) /* a block of ours whose memory left its shard after its free is a
             * double free (regionmap.h, departed memory); else foreign */
        return bfc__regionmap_gone(p, ctx, NULL);
    if (r->tag != ctx)
        return BFC_ENOTOWNED;
    *rp = r;
    *cp = (p & (BFC__MIN_ALLOC - 1)) ? NULL : bfc__region_handle(r, p);
    return BFC_OK;
}

/* Same-stream (or error) path under the owner's lock, which it takes with
 * free_locked_inline (inlined into the general free; free_locked_path, below,
 * for the other cases) and releases. */
static inline __attribute__((always_inline)) int free_under_lock(struct bfc__arena *a, struct bfc__region *r,
                                                                  uintptr_t p, struct bfc__chunk *hint)
{
    struct bfc__chunk *c;
    int st = bfc__arena_classify_fast_locked(a, r, p, hint, &c);
    bool dead = false;
    if (st == BFC_OK) {
        /* Claim it as a cross-stream free does (which takes no lock):
         * exactly one of two racing frees wins.  acq_rel/acquire as there. */
        uint32_t expect = BFC__CHUNK_INUSE;
        if (!atomic_compare_exchange_strong_explicit(&c->state, &expect, BFC__CHUNK_FREEING, memory_order_acq_rel,
                                                     memory_order_acquire))
            st = BFC_EDOUBLEFREE;
    }
    if (st == BFC_OK) {
        /* The owner's stream by name: the caller's handle may be its
         * stream_key (bfc_free, api.c). */
        if (bfc__tracing(a->env->obs))
            bfc__trace_event(a->env->obs, BFC__TR_FREE, p, c->requested, a->stream);
        bfc__arena_free_chunk_inline(a, c);
        dead = bfc__arena_maybe_dead_locked(a);
    }
    bfc__unlock(&a->lock);
    if (dead)
        bfc__shard_reclaim(a);
    return st;
}

static inline __attribute__((always_inline)) int free_locked_inline(struct bfc__arena *a, struct bfc__region *r,
                                                                     uintptr_t p, struct bfc__chunk *hint)
{
    bfc__lock(&a->lock);
    return free_under_lock(a, r, p, hint);
}

static __attribute__((noinline)) int free_locked_path(struct bfc__arena *a, struct bfc__region *r, uintptr_t p)
{
    return free_locked_inline(a, r, p, NULL);
}

/* The end of every free: the read section, then the debug check. */
static inline __attribute__((always_inline)) int free_exit(struct bfc_ctx *ctx, int st)
{
    bfc__rcu_unlock();
    if (BFC__UNLIKELY(ctx->cfg.debug_check))
        debug_check(ctx);
    return st;
}

/* The general free: every case (bfc_ctx_free, below, takes the common one).
 * by_id: the owner's stream is known by its id alone, never by the handle
 * (bfc__ctx_free_by_id). */
static inline __attribute__((always_inline)) int free_general_in(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream,
                                                                  bool by_id)
{
    if (!ptr)
        return BFC_OK;
    if (!ctx)
        return BFC_EINVAL;
    uintptr_t p = (uintptr_t)ptr;
    struct bfc__region *r;
    struct bfc__chunk *c;
    int st;
    bfc__rcu_lock();
    st = resolve(ctx, p, &r, &c);
    if (st != BFC_OK)
        goto out;
    struct bfc__arena *a = r->owner;
    bool local = !by_id && stream == a->stream_key;
    uint64_t id = 0;
    if (!local) {
        st = bfc__shard_stream_id(ctx, stream, &id);
        if (st != BFC_OK)
            goto out;
        local = id == a->stream_id;
    }
    if (BFC__LIKELY(local)) {
        st = free_locked_inline(a, r, p, c);
        goto out;
    }
    if (!c || c == BFC__HANDLE_GONE) {
        st = free_locked_path(a, r, p);
        goto out;
    }
    /* Cross-stream: claim the block without the owner's lock.  acq_rel:
     * acquire pairs with bfc__arena_take_inline's release store of INUSE
     * (we then see ptr/region); release orders our claim before the
     * enqueue. */
    uint32_t expect = BFC__CHUNK_INUSE;
    if (!atomic_compare_exchange_strong_explicit(&c->state, &expect, BFC__CHUNK_FREEING, memory_order_acq_rel,
                                                 memory_order_acquire)) {
        st = free_locked_path(a, r, p); /* classifies: double free or foreign */
        goto out;
    }
    if (BFC__UNLIKELY(c->ptr != p || c->region != r)) {
        /* The record was recycled for another block: undo the claim. */
        atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
        st = free_locked_path(a, r, p);
        goto out;
    }
    /* Recorded before the hand-off, so that it precedes the owner's
     * free_complete; c->requested is stable while we hold the claim. */
    if (bfc__tracing(&ctx->obs))
        bfc__trace_event(&ctx->obs, BFC__TR_FREE, p, c->requested, stream);
    bool dead;
    st = bfc__remote_free(a, c, stream, id, &dead);
    if (dead)
        bfc__shard_reclaim(a);
out:
    return free_exit(ctx, st);
}

static __attribute__((noinline)) int free_general(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream)
{
    return free_general_in(ctx, ptr, stream, false);
}

int bfc__ctx_free_by_id(bfc_ctx_t *ctx, void *ptr, bfc_stream_t stream)
{
    return free_general_in(ctx, ptr, stream, true);
}

/* The fast path's ways out, holding the owner's lock and the read section
 * (tail calls from bfc_ctx_free): the general same-stream free of p, which
 * nothing has touched yet; the end of a free whose release left more to do
 * (bfc__arena_release_followup_due, a retired shard); the wake of a waiter
 * on the lock, which the fast path has released. */
static __attribute__((noinline)) int free_locked_rest(struct bfc_ctx *ctx, struct bfc__arena *a,
                                                     struct bfc__region *r, uintptr_t p, struct bfc__chunk *hint)
{
    return free_exit(ctx, free_under_lock(a, r, p, hint));
}

/* (These two take only what the fast path still holds after the release:
 * fewer values live across the bins' insert.  The fast path runs without
 * debug_check, so they end without it.) */
static __attribute__((noinline)) int free_followup(struct bfc__arena *a, struct bfc__chunk *c)
{
    struct bfc__region *r = c->region;
    if (bfc__arena_release_followup_due(a, r))
        bfc__arena_release_followup(a, r);
    bool dead = bfc__arena_maybe_dead_locked(a);
    bfc__unlock(&a->lock);
    if (dead)
        bfc__shard_reclaim(a);
    bfc__rcu_unlock();
    return BFC_OK;
}

static __attribute__((noinline)) int free_wake(struct bfc__arena *a)
{
    bfc__unlock_wake(&a->lock);
    bfc__rcu_unlock();
    return BFC_OK;
}

/*
 * The common free: a live block freed on its owner's stream, with nothing
 * unusual about it -- no merge with a neighbour, no trace, no recorded
 * stream, no poison, no large region, no waiter on the lock, nothing left
 * for after the release.  It makes no call but tail calls, so it spills no
 * argument and sets up no call on the way (make perf-instructions);
 * whatever else it meets it hands, before it has changed anything, to
 * free_general or (holding the lock) to free_locked_rest, or after the
 * release to free_followup or free_wake, whose paths are those of
 * free_general.  free_fast_in is the part after the region lookup, under
 * the read section: bfc_ctx_free runs it when the thread's region-map hint
 * holds p, free_search after the search (an arena of several regions).
 */
static inline __attribute__((always_inline)) int free_fast_in(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream,
                                                              struct bfc__region *r, bool fenced)
{
    uintptr_t p = (uintptr_t)ptr;
    if (BFC__UNLIKELY(r->tag != ctx || r->owner->stream_key != stream))
        goto general;
    struct bfc__arena *a = r->owner;
    struct bfc__chunk *c = bfc__region_handle(r, p);
    if (BFC__UNLIKELY(!c || c == BFC__HANDLE_GONE || !bfc__trylock(&a->lock)))
        goto general;
    /* Under the lock: still the block at p (the record may have been
     * recycled since the handle was read), and a plain release: not its
     * region's last chunk either, whose release notes how far the region
     * was used (region.h, used_end).  (Poison was tested at the entry:
     * r->tag == ctx, so a->env is ctx->env.) */
    if (BFC__UNLIKELY(!bfc__chunk_at(c, r, p) || a->dead || r->gone || r->large ||
                      atomic_load_explicit((struct bfc__recorded *_Atomic *)&c->recorded, memory_order_relaxed) ||
                      !c->next || bfc__arena_free_neighbour(c->next) || bfc__arena_free_neighbour(c->prev)))
        return free_locked_rest(ctx, a, r, p, c);
    /* The claim, as free_under_lock's; a lost claim is classified there. */
    uint32_t expect = BFC__CHUNK_INUSE;
    if (BFC__UNLIKELY(!atomic_compare_exchange_strong_explicit(&c->state, &expect, BFC__CHUNK_FREEING,
                                                               memory_order_acq_rel, memory_order_acquire)))
        return free_locked_rest(ctx, a, r, p, c);
    bfc__arena_account_free(a, c);
    bfc__arena_release_mark(a, c);
    bfc__bins_insert_inline(&a->bins, c);
    /* acquire: as bfc__arena_maybe_dead_locked.  c->region: r, reloaded
     * rather than kept in a register across the insert. */
    if (BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire) ||
                      bfc__arena_release_followup_due(a, c->region)))
        return free_followup(a, c);
    if (BFC__UNLIKELY(bfc__unlock_nowake(&a->lock)))
        return free_wake(a);
    fast_rcu_unlock(fenced);
    return BFC_OK;
general:
    fast_rcu_unlock(fenced);
    return free_general(ctx, ptr, stream);
}

/* The hint missed p, under the read section: the search (which moves the
 * hint to p's region), then the rest of the fast path, with rcu.h's general
 * unlock (right with and without the inline steps). */
static __attribute__((noinline)) int free_search(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream)
{
    struct bfc__region *r = bfc__regionmap_lookup_slow((uintptr_t)ptr);
    if (BFC__UNLIKELY(!r)) {
        bfc__rcu_unlock();
        return free_general(ctx, ptr, stream);
    }
    return free_fast_in(ctx, ptr, stream, r, true);
}

/* The free's fast path up to the region (its copy without the inline read
 * section: free_fast_fenced, as alloc_fast_fenced). */
static inline __attribute__((always_inline)) int free_fast(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream,
                                                           bool fenced)
{
    uintptr_t p = (uintptr_t)ptr;
    /* NULL passes this test and fails the region map's (no region holds
     * address 0), as any pointer we did not hand out. */
    if (BFC__UNLIKELY(!ctx || (p & (BFC__MIN_ALLOC - 1)) || atomic_load_explicit(&ctx->fast_off, memory_order_relaxed)))
        return free_general(ctx, ptr, stream);
    fast_rcu_lock(fenced);
    struct bfc__region *r = bfc__regionmap_hit(p);
    if (BFC__UNLIKELY(!r))
        return free_search(ctx, ptr, stream);
    return free_fast_in(ctx, ptr, stream, r, fenced);
}

static __attribute__((noinline)) int free_fast_fenced(struct bfc_ctx *ctx, void *ptr, bfc_stream_t stream)
{
    return free_fast(ctx, ptr, stream, true);
}

int bfc_ctx_free(bfc_ctx_t *ctx, void *ptr, bfc_stream_t stream)
{
    if (BFC__UNLIKELY(bfc__rcu_ctr == NULL))
        return free_fast_fenced(ctx, ptr, stream);
    return free_fast(ctx, ptr, stream, false);
}

/* Runs fn on the live chunk at p under its owner's lock. */
static int with_live_chunk(struct bfc_ctx *ctx, const void *ptr,
                           int (*fn)(struct bfc__arena *a, struct bfc__chunk *c, void *arg), void *arg)
{
    if (!ctx || !ptr)
        return BFC_EINVAL;
    uintptr_t p = (uintptr_t)ptr;
    struct bfc__region *r;
    struct bfc__chunk *c;
    bfc__rcu_lock();
    int st = resolve(ctx, p, &r, &c);
    if (st == BFC_OK) {
        struct bfc__arena *a = r->owner;
        bfc__lock(&a->lock);
        st = bfc__arena_classify_locked(a, r, p, &c);
        if (st == BFC_OK)
            st = fn(a, c, arg);
        bfc__unlock(&a->lock);
    }
    bfc__rcu_unlock();
    return st;
}

struct record_arg {
    bfc_stream_t stream;
    uint64_t id; /* the stream's */
};

static int record_fn(struct bfc__arena *a, struct bfc__chunk *c, void *arg)
{
    struct record_arg *ra = arg;
    uint64_t id = ra->id;
    if (id == a->stream_id)
        return BFC_OK;
    struct bfc__recorded *head = atomic_load_explicit((struct bfc__recorded *_Atomic *)&c->recorded,
                                                      memory_order_relaxed);
    for (struct bfc__recorded *x = head; x; x = x->next)
        if (x->id == id)
            return BFC_OK;
    /* The fence record is taken now, so that the free never allocates. */
    struct bfc__recorded *rs = bfc__meta_alloc(sizeof(*rs));
    struct bfc__fence *f = rs ? bfc__arena_fence_get(a) : NULL;
    if (!f) {
        bfc__meta_free(rs, sizeof(*rs));
        return BFC_ENOMEM;
    }
    rs->stream = ra->stream;
    rs->id = id;
    rs->fence = f;
    rs->next = head;
    /* release: pairs with the acquire load in bfc__arena_fence_recorded_locked (arena.c). */
    atomic_store_explicit((struct bfc__recorded *_Atomic *)&c->recorded, rs, memory_order_release);
    return BFC_OK;
}

int bfc_ctx_record_stream(bfc_ctx_t *ctx, void *p, bfc_stream_t stream)
{
    if (!ctx || !p)
        return BFC_EINVAL;
    /* The stream first, as on every call that names one: a dead or foreign
     * handle is BFC_EINVAL whatever p is. */
    struct record_arg ra = { stream, 0 };
    int st = ctx->be->ops->stream_id(ctx->be, stream, &ra.id);
    if (st != BFC_OK)
        return st;
    return with_live_chunk(ctx, p, record_fn, &ra);
}

static int size_fn(struct bfc__arena *a, struct bfc__chunk *c, void *arg)
{
    (void)a;
    size_t *out = arg;
    out[0] = c->requested;
    out[1] = c->size;
    out[2] = (size_t)c->alloc_id;
    return BFC_OK;
}

/* The queries that return a size or an id share one convention: the value
 * on success, else a value no block can have (0 for a size, the negative
 * status for an id), and bfc_last_error() says which (BFC_OK or why). */
static int query(bfc_ctx_t *ctx, const void *p, size_t v[3])
{
    v[0] = v[1] = v[2] = 0;
    int st = with_live_chunk(ctx, p, size_fn, v);
    bfc__set_last_error(st);
    return st;
}

size_t bfc_ctx_requested_size(bfc_ctx_t *ctx, const void *p)
{
    size_t v[3];
    return query(ctx, p, v) == BFC_OK ? v[0] : 0;
}

size_t bfc_ctx_allocated_size(bfc_ctx_t *ctx, const void *p)
{
    size_t v[3];
    return query(ctx, p, v) == BFC_OK ? v[1] : 0;
}

int64_t bfc_ctx_allocation_id(bfc_ctx_t *ctx, const void *p)
{
    size_t v[3];
    int st = query(ctx, p, v);
    return st == BFC_OK ? (int64_t)v[2] : (int64_t)st;
}

int bfc_ctx_stream_release(bfc_ctx_t *ctx, bfc_stream_t stream)
{
    if (!ctx)
        return BFC_EINVAL;
    return bfc__shard_retire(ctx, stream);
}

int bfc_ctx_trim(bfc_ctx_t *ctx)
{
    if (!ctx)
        return BFC_EINVAL;
    bfc__rcu_register(); /* before the arenas lock: releases call call_rcu */
    int cs = bfc__nocancel_begin(); /* it waits for fences (mutex.h) */
    uint64_t refused = bfc__pool_refusals(&ctx->pool);
    /* The shards of threads gone without releasing their per-thread
     * streams give back what they can, fenced (shard.c). */
    bfc__shard_retire_exited(ctx);
    if (ctx->vmm) /* the free granules of shards still in use */
        expand_unmap_others(ctx, NULL, fence_wait_ms(ctx), true, 0);
    bfc__shard_reclaim_others(ctx, NULL, false);
    /* What just left the shards is fenced on their streams: on a device,
     * wait for that work (as PyTorch's empty_cache synchronises its events
     * before it frees), so that trim returns what it can. */
    bfc__pool_wait(&ctx->pool, 0, true, fence_wait_ms(ctx));
    bfc__pool_release_free(&ctx->pool);
    (void)bfc__pool_settle(&ctx->pool); /* a refusal is counted */
    /* Another thread's refusal meanwhile counts too: the device refused
     * memory back while trim ran. */
    int st = bfc__pool_refusals(&ctx->pool) == refused ? BFC_OK : BFC_EBACKEND;
    bfc__nocancel_end(cs);
    return st;
}

/* ------------------------------------------------------- SIM controls */

/* The context's backend if it is SIM's own; NULL for other backends and
 * for a host context, whose host backend wraps SIM (and reports its kind)
 * but has no simulated streams or device memory of its own to control. */
static bfc__backend_t *sim_be(bfc_ctx_t *ctx)
{
    return ctx && bfc__sim_is(ctx->be) ? ctx->be : NULL;
}

bfc_stream_t bfc_sim_stream_create(bfc_ctx_t *ctx)
{
    bfc__backend_t *be = sim_be(ctx);
    bfc_stream_t s = be ? bfc__sim_stream_create(be) : NULL;
    /* A NULL says why: not a SIM context, or every stream made. */
    bfc__set_last_error(s ? BFC_OK : be ? BFC_ENOMEM : BFC_EINVAL);
    return s;
}

void bfc_sim_stream_destroy(bfc_ctx_t *ctx, bfc_stream_t s)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be) {
        bfc__sim_stream_destroy(be, s);
        /* Threads cache (stream, shard) pairs keyed by handle; a new epoch
         * makes every cache miss once, and the lookup then asks stream_id,
         * which refuses the dead handle.  The SIM backend knows nothing of
         * the shard directory, so the bump is here.  release: pairs with
         * the acquire loads of the epoch in shard.c's cache check. */
        atomic_fetch_add_explicit(&bfc__dir_epoch, 1, memory_order_release);
    }
}

void bfc_sim_stream_hold(bfc_ctx_t *ctx, bfc_stream_t s)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_stream_hold(be, s);
}

void bfc_sim_stream_drain(bfc_ctx_t *ctx, bfc_stream_t s)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_stream_drain(be, s);
}

void bfc_sim_fail_alloc_every(bfc_ctx_t *ctx, unsigned n)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_fail_alloc_every(be, n);
}

void bfc_sim_fail_event_every(bfc_ctx_t *ctx, unsigned n)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_fail_event_every(be, n);
}

void bfc_sim_fail_free_every(bfc_ctx_t *ctx, unsigned n)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_fail_free_every(be, n);
}

void bfc_sim_fail_meta_every(unsigned n)
{
    bfc__meta_fail_every(n);
}

uint64_t bfc_sim_meta_failures(void)
{
    return bfc__meta_failures();
}

void bfc_sim_set_alloc_ceiling(bfc_ctx_t *ctx, size_t bytes)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_set_alloc_ceiling(be, bytes);
}

void bfc_sim_set_vmm_cost(bfc_ctx_t *ctx, unsigned ns_per_granule)
{
    bfc__backend_t *be = sim_be(ctx);
    if (be)
        bfc__sim_set_vmm_cost(be, ns_per_granule);
}

uint64_t bfc_sim_backend_allocs(bfc_ctx_t *ctx)
{
    bfc__backend_t *be = sim_be(ctx);
    return be ? bfc__sim_allocs(be) : 0;
}

uint64_t bfc_sim_backend_failures(bfc_ctx_t *ctx)
{
    bfc__backend_t *be = sim_be(ctx);
    return be ? bfc__sim_failures(be) : 0;
}

uint64_t bfc_sim_backend_bytes_held(bfc_ctx_t *ctx)
{
    bfc__backend_t *be = sim_be(ctx);
    return be ? (uint64_t)bfc__sim_bytes_held(be) : 0;
}

int bfc_sim_mapped(bfc_ctx_t *ctx, const void *p, size_t n)
{
    bfc__backend_t *be = sim_be(ctx);
    return be ? bfc__sim_mapped(be, p, n) : 0;
}
