/*
 * arena.h -- regions, the region pool, the region map and the BFC arena.
 *
 * A region is one piece of device memory handed to one arena (a shard) by
 * the context's region pool.  An arena cuts its regions into chunks (chunk.h)
 * and serves allocations with TensorFlow's best-fit-with-coalescing.  The
 * region map (process-wide, RCU) finds the region of any pointer without a
 * lock; the region's handle table then finds the chunk that starts there.
 *
 * Lock order (outermost first); no path takes two arena locks:
 *     ctx->arenas_lock -> arena->lock -> { pool.lock | region map writer lock }
 * (the pool lock and the region map's writer lock are never held together)
 * Common paths (allocation, same-stream free) take one arena lock and no
 * device-wide lock; a cross-stream free takes no arena lock at all.  These
 * are "inner" locks (ctx.c, "Fork", has the whole order): a thread holding
 * one never waits for liburcu -- for its locks, a grace period or its
 * threads -- because the fork handlers take them after liburcu's own
 * prepare hooks.
 */
#ifndef BFC_ARENA_H
#define BFC_ARENA_H

#include <pthread.h>

#include <urcu-bp.h>
#include <urcu/rculfhash.h>
#include <urcu/wfcqueue.h>

#include "backend.h"
#include "chunk.h"
#include "fence.h"
#include "meta.h"
#include "pool.h"

struct bfc__arena;

/* RCU read side, and the matching edge for reclamation (see internal.h). */
extern char bfc__rcu_sync;
static inline void bfc__rcu_lock(void)
{
    rcu_read_lock();
}
static inline void bfc__rcu_unlock(void)
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
    rcu_read_unlock();
}
/*
 * Registers the calling thread with urcu-bp if it is not yet (a thread-local
 * test when it is).  urcu-bp registers a thread at its first rcu_read_lock,
 * and registering takes liburcu's registry lock, which the fork handlers hold
 * while they wait for the library's locks (ctx.c, "Fork").  So a thread must
 * be registered before it takes any library lock on a path that may enter
 * RCU (call_rcu, a nested read section): the allocation and free paths are,
 * because they open a read section first; the slow entry points that start
 * with a lock (trim, statistics, dumps) call this first.
 */
static inline void bfc__rcu_register(void)
{
    urcu_bp_register_thread();
}

/*
 * The liburcu gate: held around every call of the library that enqueues on
 * one of liburcu's wait-free queues (call_rcu; rculfhash add and delete,
 * which may queue a resize for its worker).  Such an enqueue is two stores
 * (swap the tail, then link the old tail); a thread stopped between them by
 * fork() would leave the child a queue whose consumer -- the child's new
 * call_rcu thread or hash-table worker -- waits forever for the link.  The
 * fork handlers take the gate, so no such enqueue is ever in flight at fork.
 * The gate is a leaf: its holder only enqueues (never blocking: the thread
 * is registered and the default call_rcu data exists from process set-up).
 */
extern pthread_mutex_t bfc__urcu_gate;

/* Every call_rcu goes through here: the caller's accesses happen before
 * the callback's (which starts with bfc__rcu_reclaim). */
static inline void bfc__call_rcu(struct rcu_head *h, void (*fn)(struct rcu_head *))
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
    bfc__rcu_register();
    bfc__plock(&bfc__urcu_gate);
    call_rcu(h, fn);
    bfc__punlock(&bfc__urcu_gate);
}
/* First thing in every call_rcu callback and after synchronize_rcu /
 * rcu_barrier. */
static inline void bfc__rcu_reclaim(void)
{
    BFC__TSAN_ACQUIRE(&bfc__rcu_sync);
}
/* Last thing in every call_rcu callback: what it did happens before the
 * return of a later rcu_barrier. */
static inline void bfc__rcu_reclaim_done(void)
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
}

/* A handle-table entry: a chunk record at a chunk start, NULL where no chunk
 * ever started, or BFC__HANDLE_GONE where a chunk started once and has since
 * been merged into its predecessor (tells a double free from a foreign
 * pointer). */
#define BFC__HANDLE_GONE ((struct bfc__chunk *)(uintptr_t)1)

struct bfc__region {
    uintptr_t base;
    size_t size;                 /* shrinks when a free tail departs (owner's lock) */
    struct bfc_ctx *ctx;
    /* Written once when the region is created; a region never changes owner
     * (it goes back to the pool and a new region record is made). */
    struct bfc__arena *owner;
    /* One entry per 256 bytes; mapped (MAP_NORESERVE) so that untouched
     * pages cost nothing; written under the owner's lock, read lock-free by
     * cross-stream frees (release stores pair with acquire loads). */
    struct bfc__chunk *_Atomic *handles;
    size_t nhandles;
    size_t handles_bytes;
    struct bfc__segment *seg;    /* pool segment it is carved from */
    bool large;                  /* a large request's own region */
    bool gone;                   /* given back to the pool (owner's lock) */
    size_t live;                 /* chunks not FREE (owner's lock) */
    struct bfc__chunk *tail;     /* last chunk in address order (owner's lock) */
    /* The records its departure needs, reserved when it was made, so that
     * giving it back to the pool never fails. */
    struct bfc__pool_ticket ticket;
    struct bfc__region *anext, *aprev; /* owner's region list */
    struct rcu_head rcu;
};

/* ----------------------------------------------------------- region map */

/* Process-wide: which region holds an address.  Lookups under
 * rcu_read_lock; updates under a writer mutex (only when regions come or
 * go).  Returns NULL when no region holds p. */
struct bfc__region *bfc__regionmap_lookup(uintptr_t p);
int bfc__regionmap_insert(struct bfc__region *r);
void bfc__regionmap_remove(struct bfc__region *r);
/* r->size shrank (its tail departed): lookups stop resolving the tail. */
void bfc__regionmap_shrink(struct bfc__region *r);
/* Number of regions of ctx in the map (bfc_ctx_check). */
size_t bfc__regionmap_count(struct bfc_ctx *ctx);
/* The writer lock, held across fork (ctx.c). */
void bfc__regionmap_fork_lock(void);
void bfc__regionmap_fork_unlock(void);

/* Chunk record starting exactly at p in r, or NULL / BFC__HANDLE_GONE. */
static inline struct bfc__chunk *bfc__region_handle(struct bfc__region *r, uintptr_t p)
{
    size_t i = (p - r->base) >> BFC__MIN_ALLOC_BITS;
    if (i >= r->nhandles)
        return NULL;
    /* acquire: pairs with the release store that published the chunk's
     * fields in bfc__region_set_handle. */
    return atomic_load_explicit(&r->handles[i], memory_order_acquire);
}

static inline void bfc__region_set_handle(struct bfc__region *r, uintptr_t p, struct bfc__chunk *c)
{
    size_t i = (p - r->base) >> BFC__MIN_ALLOC_BITS;
    atomic_store_explicit(&r->handles[i], c, memory_order_release);
}

/* ------------------------------------------------------------------ arena */

struct bfc__astats {
    uint64_t num_allocs, num_frees;
    uint64_t bytes_in_use, peak_in_use;
    uint64_t bytes_requested, peak_requested, largest_alloc;
    uint64_t bytes_reserved, peak_reserved;
    uint64_t num_regions;
    uint64_t remote_frees;
    uint64_t pending, pending_bytes;
    uint64_t ooms;
    uint64_t chunks;
};

struct bfc__arena {
    /* ---- owner side: written under `lock` ---- */
    bfc__mutex_t lock;           /* normally taken by the one thread driving the stream */
    struct bfc_ctx *ctx;
    bfc_stream_t stream;
    uint64_t stream_id;
    struct bfc__bins bins;
    struct bfc__slab chunk_slab;
    struct bfc__region *regions;
    size_t curr_region_bytes;    /* TensorFlow's doubling schedule, per arena */
    int64_t next_id;
    struct bfc__astats st;
    struct bfc__fence *pending_head, *pending_tail;
    bool dead;                   /* reclaimed: no regions, no chunks; awaiting RCU */
    bool unlinked;
    size_t live;                 /* chunks in use, freeing or pending */

    /* ---- shared with cross-stream freers: separate cache lines ---- */
    alignas(BFC__CACHELINE) struct cds_wfcq_head rq_head; /* remote frees (enqueued wait-free) */
    alignas(BFC__CACHELINE) struct cds_wfcq_tail rq_tail;
    alignas(BFC__CACHELINE) struct cds_wfcq_head fpool_head; /* fence pool: dequeue takes its mutex */
    alignas(BFC__CACHELINE) struct cds_wfcq_tail fpool_tail;
    alignas(BFC__CACHELINE) _Atomic bool retired;
    _Atomic size_t nfences;      /* fence nodes created (destroyed at reclaim) */
    _Atomic bool ready;          /* release before publication in the directory */

    /* ---- directory, context list, RCU ---- */
    struct cds_lfht_node dir_node;
    struct bfc__arena *all_next, *all_prev; /* ctx->arenas_lock */
    struct rcu_head rcu;
    uint64_t seq;                /* creation order, for alloc ids and dumps */
};

/* Is the remote-free queue empty?  The test of liburcu's _cds_wfcq_empty,
 * inline (the exported cds_wfcq_empty is a call on every allocation). */
static inline bool bfc__rq_empty(struct bfc__arena *a)
{
    return CMM_LOAD_SHARED(a->rq_head.node.next) == NULL && CMM_LOAD_SHARED(a->rq_tail.p) == &a->rq_head.node;
}

struct bfc__arena *bfc__arena_new(struct bfc_ctx *ctx, bfc_stream_t s, uint64_t sid);
/* Frees an arena that was never published, or one reclaimed after its
 * grace period (regions must all be gone). */
void bfc__arena_free(struct bfc__arena *a);

/*
 * The allocation fast path, under a->lock: drains the remote queue when it
 * is not empty, then takes the best fit from the bins.  NULL when nothing
 * fits (or the request is large): the caller runs the slow path
 * (bfc__ctx_alloc_slow), which escalates with the primitives below.
 */
void *bfc__arena_alloc_locked(struct bfc__arena *a, size_t n, size_t rounded);
/* Primitives of the slow path, all under a->lock:
 * fit     the best fit from the bins, or NULL;
 * grow    a new region (TensorFlow's Extend; for a large request a region of
 *         its own) and the allocation from it; NULL with *status;
 * drain   the remote queue and pending fences (full: poll every pending
 *         entry, else stop at the first still in flight);
 * wait_pending  waits up to timeout_ms for the pending fences, then drains;
 * shed    gives fully free regions -- with tails, also the free tails of
 *         regions still in use -- back to the pool, fenced on our stream;
 *         returns the bytes given back. */
void *bfc__arena_fit_locked(struct bfc__arena *a, size_t n, size_t rounded);
/* The free tails of our regions that are still in use (what shed with tails
 * would give back): up to max ranges into out, returns how many. */
size_t bfc__arena_tails_locked(struct bfc__arena *a, struct bfc__range *out, size_t max);
void *bfc__arena_grow_locked(struct bfc__arena *a, size_t n, size_t rounded, bool large, int *status);
void bfc__arena_drain_locked(struct bfc__arena *a, bool full);
void bfc__arena_wait_pending_locked(struct bfc__arena *a, uint32_t timeout_ms);
size_t bfc__arena_shed_locked(struct bfc__arena *a, bool tails);
/* Local free of a live chunk c (validated and claimed by the caller). */
void bfc__arena_free_chunk_locked(struct bfc__arena *a, struct bfc__chunk *c);
/* Retired and empty: give everything back, mark dead.  Returns true when the
 * caller must unlink and reclaim the arena (bfc__shard_reclaim) after
 * unlocking. */
bool bfc__arena_maybe_dead_slow(struct bfc__arena *a);
static inline bool bfc__arena_maybe_dead_locked(struct bfc__arena *a)
{
    /* acquire: pairs with the seq_cst store in bfc__shard_retire. */
    return BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire)) && bfc__arena_maybe_dead_slow(a);
}
/* Under a->lock: validate p against chunk c of region r for a free or an
 * introspection call; BFC_OK, BFC_ENOTOWNED or BFC_EDOUBLEFREE. */
int bfc__arena_classify_locked(struct bfc__arena *a, struct bfc__region *r, uintptr_t p,
                               struct bfc__chunk **out);
/* Chunk of a region p lies in (error path, owner's lock). */
struct bfc__chunk *bfc__region_find_containing(struct bfc__region *r, uintptr_t p);
int bfc__arena_check_locked(struct bfc__arena *a, char *buf, size_t len);

/* What one shard could give, as the OOM report shows it. */
struct bfc__shard_free {
    uint64_t stream_id;
    bfc_stream_t stream;
    size_t free_bytes;      /* in its bins */
    size_t largest_free;    /* its largest free chunk */
    size_t pending_bytes;   /* freed blocks still waiting for their fences */
    size_t in_use;          /* live chunk bytes */
    size_t reserved;        /* its regions */
};
/* Each live shard of ctx in turn (arenas_lock, then each arena's lock, never
 * two; the remote-free queue drained first, as bfc_ctx_stats does): the
 * first `max` into out.  Returns the number of live shards. */
size_t bfc__arenas_free_info(struct bfc_ctx *ctx, struct bfc__shard_free *out, size_t max);

/* remote.c: cross-stream free of chunk c (claimed: FREEING) of owner a. */
int bfc__remote_free(struct bfc__arena *a, struct bfc__chunk *c, bfc_stream_t s);
/* The owner arena's pool of fence records (with events): get (NULL when
 * metadata is exhausted) and put back a chain (through `extra`). */
struct bfc__fence *bfc__fence_get(struct bfc__arena *a);
void bfc__fence_put(struct bfc__arena *a, struct bfc__fence *f);
void bfc__fence_pool_destroy(struct bfc__arena *a);

#endif /* BFC_ARENA_H */
