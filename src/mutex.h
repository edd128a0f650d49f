/*
 * mutex.h -- the library's one lock type, its ranks, and bfc__fatal, what
 * every lock calls when the operating system reports a failure that only
 * corrupted memory can cause.
 *
 * A leaf: it needs internal.h and nothing else of the library, so that every
 * layer, the backends included, may take a lock.
 *
 * The lock.  By default a futex mutex (Drepper, "Futexes Are Tricky", mutex
 * 3), inline: uncontended -- the normal case, one thread per stream -- it
 * costs one compare-and-swap to lock and one exchange to unlock, without a
 * call.  0 = unlocked, 1 = locked, 2 = locked with (possible) waiters.
 * Contended, it spins briefly (critical sections are short), then sleeps in
 * the kernel (mutex.c).  Configured with --enable-pthread-mutex it is a
 * pthread_mutex_t instead, which ThreadSanitizer and helgrind understand:
 * they then see the library's lock order, not only its data races.  No
 * lock of the library waits on a condition variable, so nothing else
 * depends on which it is.  One limit: ThreadSanitizer's deadlock detector
 * follows at most 64 locks held by one thread, and bfc_ctx_check and the
 * fork handlers hold every shard's lock at once, so a TSan run of a
 * context with more shards than that needs TSAN_OPTIONS=detect_deadlocks=0
 * (make sanitize's TSan build therefore keeps the futex: its tests create
 * hundreds of shards).
 *
 * Ranks.  Every lock is initialised with a rank (enum bfc__lock_rank) and a
 * name.  A thread takes locks in increasing rank only; taking a lock whose
 * rank is lower than or equal to one it holds is a bug -- the start of a
 * deadlock even if this run was lucky -- except where the call site says it
 * means it (bfc__lock_nested: several locks of one rank taken in a fixed
 * order by one thread, as the fork handlers and bfc_ctx_check do).  Debug
 * builds (--enable-debug) check this per thread in the manner of jemalloc's
 * witness: each thread keeps the locks it holds in a list threaded through
 * the locks themselves (a lock has one holder at a time), and a violation
 * is fatal with both names.  Other builds test bfc__config_debug, a
 * constant false, and the check compiles to nothing.
 */
#ifndef BFC_MUTEX_H
#define BFC_MUTEX_H

#include <errno.h>
#include <pthread.h>

#include "internal.h"

#ifndef BFC_PTHREAD_MUTEX
#define BFC_PTHREAD_MUTEX 0
#endif

/*
 * Cancellation.  A thread cancelled at a cancellation point (write, poll,
 * nanosleep, ...) while it holds a library lock would leave that lock held
 * for good, and every later caller of it waiting.  The paths that can meet
 * one with a lock held -- the allocation slow path's waits, trim, context
 * creation and teardown, dumps and snapshots, a trace's start, stop and
 * writes -- turn cancellation off for their duration (a request that comes
 * meanwhile acts at the thread's next cancellation point after the call).
 * The fast paths meet none.  Nesting is fine: each end restores what its
 * begin found.
 */
static inline int bfc__nocancel_begin(void)
{
    int old = PTHREAD_CANCEL_ENABLE;
    (void)pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
    return old;
}

static inline void bfc__nocancel_end(int old)
{
    (void)pthread_setcancelstate(old, NULL);
}

/* pthread_once with cancellation off: a once routine that reads files or
 * reports on stderr (set-up of the process, of host memory, of the
 * metadata arena; SHARDBFC_CONF's parse) must not end half done. */
static inline int bfc__once(pthread_once_t *once, void (*fn)(void))
{
    int cs = bfc__nocancel_begin();
    int e = pthread_once(once, fn);
    bfc__nocancel_end(cs);
    return e;
}

/*
 * A pthread call on a lock the library initialised can only fail if memory
 * was corrupted; there is no state to return to, so it reports and aborts
 * (mutex.c).  Every other failure is a status code.
 */
void bfc__fatal(const char *what, int err) __attribute__((noreturn, cold));

/*
 * The ranks, lowest (outermost) first: the order of the fork handlers
 * (ctx.c, "Fork", has why it must be so).  Outer locks are taken before
 * liburcu's fork hooks, inner ones after; a thread holding an inner lock
 * never waits for liburcu.
 */
enum bfc__lock_rank {
    BFC__RANK_NONE = 0,       /* an uninitialised lock: fatal when taken */
    /* ---- outer ---- */
    BFC__RANK_HOST_SETUP,     /* the host memory set-up, held across it (host.c) */
    BFC__RANK_RCU_REG,        /* urcu-bp registration of the library's threads (rcu.h) */
    BFC__RANK_API,            /* the process-wide service's create lock (api.c) */
    BFC__RANK_HOST,           /* the host context table (host.c) */
    BFC__RANK_CTX_REGISTRY,   /* the registry of live contexts (ctx.c) */
    BFC__RANK_OBS,            /* a context's obs.lock: trace start/stop, OOM report */
    /* ---- liburcu's fork hooks go here ---- */
    /* ---- inner ---- */
    BFC__RANK_ARENAS,         /* a context's arenas list (arenas_lock) */
    BFC__RANK_ARENA,          /* one arena (shard) */
    BFC__RANK_POOL,           /* a context's region pool */
    BFC__RANK_FENCE_POOL,     /* an arena's fence-pool dequeue lock (fpool_lock):
                                 cross-stream freers and record_stream (under the
                                 arena's lock), a few instructions */
    BFC__RANK_REGIONMAP,      /* the region map's writer lock */
    BFC__RANK_TRACE_REGISTRY, /* the registry of trace buffers (trace.c) */
    BFC__RANK_TRACE_FILE,     /* one running trace's file */
    BFC__RANK_URCU_GATE,      /* the liburcu gate (rcu.h) */
    BFC__RANK_SIM_STREAMS,    /* the SIM backend's stream table */
    BFC__RANK_BACKEND_BOOK,   /* a VMM backend's book of reservations */
    BFC__RANK_SIM_DRIVER,     /* the SIM backend's model of a driver's lock */
    BFC__RANK_CUDA_PCTX,      /* the CUDA backend's primary-context table: a
                                 backend's open, around two driver calls */
};

typedef struct bfc__mutex {
#if BFC_PTHREAD_MUTEX
    pthread_mutex_t pm;
#else
    _Atomic uint32_t v;
#endif
    /* The witness (debug builds): set at initialisation, then read only;
     * held_next is written by the holder alone. */
    uint32_t rank;
    const char *name;
    struct bfc__mutex *held_next;
} bfc__mutex_t;

#if BFC_PTHREAD_MUTEX
#define BFC__MUTEX_INIT(rank, name) { PTHREAD_MUTEX_INITIALIZER, (rank), (name), NULL }
#else
#define BFC__MUTEX_INIT(rank, name) { 0, (rank), (name), NULL }
#endif

/* Initialises a lock that is not statically initialised; 0 or the error of
 * pthread_mutex_init (a futex lock cannot fail). */
int bfc__mutex_init(bfc__mutex_t *m, enum bfc__lock_rank rank, const char *name);
/* Destroys an unlocked lock (fatal on a pthread failure). */
void bfc__mutex_destroy(bfc__mutex_t *m);

void bfc__mutex_lock_slow(bfc__mutex_t *m, uint32_t seen);
void bfc__mutex_wake(bfc__mutex_t *m);
/* The witness (mutex.c), called in debug builds only: before taking m
 * (fatal on a rank violation; nested allows a rank equal to the highest
 * held), once m is taken, and before m is released (fatal if not held). */
void bfc__witness_check(bfc__mutex_t *m, bool nested);
void bfc__witness_acquired(bfc__mutex_t *m);
void bfc__witness_release(bfc__mutex_t *m);

#if !BFC_PTHREAD_MUTEX
/* One attempt at the futex word: true when m is now ours, else false with
 * what it held in *seen (1 locked, 2 locked with waiters).  acquire: pairs
 * with the release exchange in bfc__unlock_nowake. */
static inline bool bfc__mutex_try(bfc__mutex_t *m, uint32_t *seen)
{
    *seen = 0;
    return atomic_compare_exchange_strong_explicit(&m->v, seen, 1, memory_order_acquire, memory_order_relaxed);
}
#endif

static inline void bfc__lock_impl(bfc__mutex_t *m, bool nested)
{
    if (bfc__config_debug)
        bfc__witness_check(m, nested);
#if BFC_PTHREAD_MUTEX
    int e = pthread_mutex_lock(&m->pm);
    if (BFC__UNLIKELY(e != 0))
        bfc__fatal("pthread_mutex_lock", e);
#else
    uint32_t c;
    if (BFC__UNLIKELY(!bfc__mutex_try(m, &c)))
        bfc__mutex_lock_slow(m, c);
#endif
    if (bfc__config_debug)
        bfc__witness_acquired(m);
}

/* Takes m; its rank must be above every lock the thread holds. */
static inline void bfc__lock(bfc__mutex_t *m)
{
    bfc__lock_impl(m, false);
}

/* Takes m, which may share its rank with the highest lock the thread holds:
 * only for a fixed walk over several locks of one rank (the fork handlers,
 * every lock of a context for bfc_ctx_check), never on a path that other
 * threads could walk in another order. */
static inline void bfc__lock_nested(bfc__mutex_t *m)
{
    bfc__lock_impl(m, true);
}

/* Takes m only if it is free: false when another thread holds it (the
 * caller then takes a way that waits).  For a fast path that must make no
 * call (ctx.c). */
static inline bool bfc__trylock(bfc__mutex_t *m)
{
    if (bfc__config_debug)
        bfc__witness_check(m, false);
#if BFC_PTHREAD_MUTEX
    int e = pthread_mutex_trylock(&m->pm);
    if (e == EBUSY)
        return false;
    if (BFC__UNLIKELY(e != 0))
        bfc__fatal("pthread_mutex_trylock", e);
#else
    uint32_t c;
    if (BFC__UNLIKELY(!bfc__mutex_try(m, &c)))
        return false;
#endif
    if (bfc__config_debug)
        bfc__witness_acquired(m);
    return true;
}

/* Releases m; true when a waiter must be woken with bfc__unlock_wake (never
 * with pthread mutexes).  bfc__unlock does both; a fast path that must make
 * no call wakes in a tail call (ctx.c). */
static inline bool bfc__unlock_nowake(bfc__mutex_t *m)
{
    if (bfc__config_debug)
        bfc__witness_release(m);
#if BFC_PTHREAD_MUTEX
    int e = pthread_mutex_unlock(&m->pm);
    if (BFC__UNLIKELY(e != 0))
        bfc__fatal("pthread_mutex_unlock", e);
    return false;
#else
    /* release: pairs with the acquire CAS/exchange of the next locker. */
    return BFC__UNLIKELY(atomic_exchange_explicit(&m->v, 0, memory_order_release) == 2);
#endif
}

/* The wake bfc__unlock_nowake asked for (none exists with pthread mutexes,
 * which wake their own waiters). */
static inline void bfc__unlock_wake(bfc__mutex_t *m)
{
#if BFC_PTHREAD_MUTEX
    (void)m;
#else
    bfc__mutex_wake(m);
#endif
}

static inline void bfc__unlock(bfc__mutex_t *m)
{
    if (bfc__unlock_nowake(m))
        bfc__unlock_wake(m);
}

#endif /* BFC_MUTEX_H */
