/*
 * arena.h -- the BFC arena: one shard's allocator.
 *
 * An arena takes regions (region.h) from the context's region pool
 * (pool.h), cuts them into chunks (chunk.h) and serves allocations with
 * TensorFlow's best-fit-with-coalescing.  It exports primitives -- fit,
 * grow, drain, wait for pending fences, shed free regions, a "dead" result
 * -- and no policy: the out-of-memory escalation is the context's (ctx.c).
 * Each arena keeps its own pool of fence records (bfc__arena_fence_*),
 * which cross-stream frees (remote.c) draw from.
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

#include "rcu.h" /* the urcu-bp flavour, before the data structures that use it */

#include <urcu/list.h>
#include <urcu/rculfhash.h>
#include <urcu/wfcqueue.h>

#include "backend.h"
#include "chunk.h"
#include "expand.h"
#include "fence.h"
#include "meta.h"
#include "obs.h"
#include "pool.h"
#include "region.h"

struct bfc__arena;

/*
 * What an arena sees of the world above it: the context fills one at its
 * creation (ctx.c) and every arena of the context points to it.  Read-only
 * after creation, except through the pointers, which name state with its
 * own synchronisation (the pool's lock, the observer's trace pointer, the
 * two counters' atomics).  An arena never sees the context itself: `tag`
 * is only stored in the regions it makes, for the layers above.
 */
struct bfc__arena_env {
    size_t limit;                /* the context's memory limit */
    size_t max_frag;             /* split when the leftover reaches this */
    size_t bins_max;             /* requests of at least this size skip the bins on the fast path */
    size_t initial_region;       /* the first region (allow_growth=true) */
    size_t large_alloc;          /* requests of at least this size get a region of their own; 0: none */
    size_t release_threshold;    /* expandable arenas: mapped-but-free bytes kept (expand.c) */
    uint64_t slack_decay_ms;     /* expandable arenas: free memory unused this long goes; 0: never */
    uint64_t decay_check_allocs; /* ... looked at after every this many allocations (expand.h) */
    uint64_t (*decay_clock)(void); /* milliseconds for the decay; NULL: CLOCK_MONOTONIC_COARSE
                                      (white-box tests set their own) */
    bool allow_growth;           /* false: one region of the whole limit */
    bool poison;                 /* poison=true on a host-accessible backend: fill and verify */
    bool vmm;                    /* shards are expandable arenas (expand.c) */
    struct bfc__pool *pool;
    bfc__backend_t *be;
    struct bfc__obs *obs;        /* trace events */
    void *tag;                   /* regions' tag (region.h): the context */
    _Atomic uint64_t *poison_errors; /* poison=true: reused blocks found written after free */
    _Atomic uint64_t *shards_live;   /* live shards of the context (a region is sized by it) */
    _Atomic uint64_t *alloc_ids;     /* ids given out so far, in blocks of BFC__ID_BLOCK (arena.c) */
};

/* Allocation ids: unique within a context, increasing within a shard,
 * > 0.  A shard takes them from its context in blocks of this many, one
 * atomic add per block, and hands them out one by one. */
#define BFC__ID_BLOCK 65536

/* ------------------------------------------------------------------ arena */

struct bfc__astats {
    /* num_frees not next to bytes_in_use: GCC's vectoriser fuses the free's
     * two adjacent updates into eight SSE instructions where two plain
     * read-modify-writes do (make perf-instructions). */
    uint64_t num_allocs;
    uint64_t bytes_in_use, peak_in_use;
    uint64_t bytes_requested, peak_requested, largest_alloc;
    uint64_t num_frees;
    uint64_t bytes_reserved, peak_reserved;
    uint64_t num_regions;
    uint64_t remote_frees;
    uint64_t pending, pending_bytes;
    uint64_t ooms;
    uint64_t chunks;
    uint64_t vmm_maps, vmm_unmaps; /* expandable arena: device calls */
};

struct bfc__arena {
    /* ---- identity: set at creation, then only read -- by every
     * cross-stream free too, so it shares no line with what the owner
     * writes (the lock word above all: a freer's read of `stream` next to
     * it would pull the line away from the owner on every free) ---- */
    const struct bfc__arena_env *env;
    bfc_stream_t stream;
    /* The handle a free may compare with `stream` to know it is the owner's
     * stream without asking its id: `stream`, but for the per-thread
     * default stream, whose handle every thread shares (internal.h): then
     * BFC__PER_THREAD_KEY, which no handle is, and a free asks the id. */
    bfc_stream_t stream_key;
    uint64_t stream_id;
    uint64_t seq;                /* creation order, for dumps */
    /* A per-thread default stream's shard: what tells the directory that
     * its thread has exited (shard.c, "Threads that exit"); else NULL. */
    struct bfc__thread_exit *exit_note;

    /* ---- owner side: written under `lock` ---- */
    alignas(BFC__SHARE_SPAN) bfc__mutex_t lock; /* normally taken by the one thread driving the stream */
    struct bfc__bins bins;
    struct bfc__slab chunk_slab;
    struct cds_list_head regions; /* bfc__region.alink, newest first */
    size_t curr_region_bytes;    /* TensorFlow's doubling schedule, per arena */
    size_t span;                 /* the sizes of its regions: the bytes of all its chunks */
    int64_t next_id, id_end;     /* the shard's block of allocation ids: next, end (BFC__ID_BLOCK) */
    struct bfc__astats st;
    struct cds_list_head pending; /* bfc__fence.plink, oldest first */
    /* Remote frees taken off rq_head but not yet handled: the first of them
     * waits for its successor's link, which a cross-stream freer is still
     * writing (bfc__arena_drain_locked never waits for it).  Empty: next
     * is NULL. */
    struct __cds_wfcq_head rq_stash_head;
    struct cds_wfcq_tail rq_stash_tail;
    struct bfc__expand *x;       /* expandable arena: its reservation, else NULL */
    bool dead;                   /* reclaimed: no regions, no chunks; awaiting RCU */
    bool unlinked;
    size_t live;                 /* chunks in use, freeing or pending */

    /* ---- shared with cross-stream freers: each written by one side, so
     * each in a span of its own (BFC__SHARE_SPAN) ---- */
    alignas(BFC__SHARE_SPAN) struct cds_wfcq_head rq_head; /* remote frees (enqueued wait-free) */
    alignas(BFC__SHARE_SPAN) struct cds_wfcq_tail rq_tail;
    alignas(BFC__SHARE_SPAN) struct __cds_wfcq_head fpool_head; /* fence pool: dequeue under fpool_lock */
    bfc__mutex_t fpool_lock;     /* dequeuers only (cross-stream freers, record_stream); rank BFC__RANK_FENCE_POOL */
    alignas(BFC__SHARE_SPAN) struct cds_wfcq_tail fpool_tail;
    alignas(BFC__SHARE_SPAN) _Atomic bool retired;
    _Atomic size_t nfences;      /* fence nodes created (destroyed at reclaim) */
    _Atomic bool ready;          /* release before publication in the directory */

    /* ---- directory, context list, RCU ---- */
    struct cds_lfht_node dir_node;
    struct cds_list_head all;    /* in ctx->arenas; ctx->arenas_lock */
    struct cds_list_head exit_link; /* with an exit_note: in ctx->exit_arenas; ctx->arenas_lock */
    struct cds_list_head zombie_link; /* retired, not yet dead: in ctx->zombies; ctx->arenas_lock */
    bool zombie;                 /* in ctx->zombies; ctx->arenas_lock */
    struct rcu_head rcu;
};

/* Is the remote-free queue empty?  The test of liburcu's _cds_wfcq_empty,
 * inline (the exported cds_wfcq_empty is a call on every allocation). */
static inline bool bfc__arena_rq_empty(struct bfc__arena *a)
{
    return CMM_LOAD_SHARED(a->rq_head.node.next) == NULL && CMM_LOAD_SHARED(a->rq_tail.p) == &a->rq_head.node;
}

/* Has the arena remote frees to handle: queued, or left by a drain?  For
 * the owner (under its lock) the queue's tail alone says whether anything
 * was queued since its last splice: an enqueue swaps the tail before it
 * links the node, and a splice -- the owner's, the queue's only consumer --
 * clears the head's link before it resets the tail, so the tail is back at
 * the head only when the queue is empty.  One line read on every
 * allocation instead of two (the head's link is in a span of its own).  A
 * freer between its two stores counts as queued; the drain stashes its
 * node until the link is there. */
static inline bool bfc__arena_rq_waiting(struct bfc__arena *a)
{
    return CMM_LOAD_SHARED(a->rq_tail.p) != &a->rq_head.node || a->rq_stash_head.node.next != NULL;
}

/* The bytes in a's bins, without walking them: its regions are tiled by
 * chunks, each free (binned), in use or freeing (bytes_in_use) or pending
 * (pending_bytes) -- bfc__arena_check_locked checks all three sums.  Under
 * a's lock. */
static inline size_t bfc__arena_free_bytes(const struct bfc__arena *a)
{
    return a->span - a->st.bytes_in_use - a->st.pending_bytes;
}

struct bfc__arena *bfc__arena_new(const struct bfc__arena_env *env, bfc_stream_t s, uint64_t sid);
/* Takes the shard's next block of allocation ids from its context. */
void bfc__arena_ids_refill(struct bfc__arena *a);
/* Frees an arena that was never published, or one reclaimed after its
 * grace period (regions must all be gone). */
void bfc__arena_free(struct bfc__arena *a);

/*
 * The allocation fast path and the same-stream free are inline functions in
 * arena_inline.h (bfc__arena_alloc_inline, bfc__arena_free_chunk_inline).
 * When the fast path finds nothing (or the request is large) the caller
 * runs the slow path (bfc__ctx_alloc_slow), which escalates with the
 * primitives below.
 */
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
/* Expandable arenas: a block from mapped memory only (bfc__expand_mapped_fit),
 * the last resort when best fit's chunk needs a map the limit refuses. */
void *bfc__arena_fit_mapped_locked(struct bfc__arena *a, size_t n, size_t rounded);
/* What shed with tails would give back: the free tails of our regions
 * still in use, and our fully free classic regions whole (a region may
 * become one between a shed of the fully free ones and this look, when its
 * last blocks are freed meanwhile): up to max ranges into out, returns how
 * many. */
size_t bfc__arena_tails_locked(struct bfc__arena *a, struct bfc__range *out, size_t max);
void *bfc__arena_grow_locked(struct bfc__arena *a, size_t n, size_t rounded, bool large, int *status);
void bfc__arena_drain_locked(struct bfc__arena *a, bool full);
void bfc__arena_wait_pending_locked(struct bfc__arena *a, uint32_t timeout_ms);
size_t bfc__arena_shed_locked(struct bfc__arena *a, bool tails);
/* The bytes of a's classic regions with nothing live: what
 * bfc__arena_shed_locked(a, false) would give the pool.  Under a's lock. */
size_t bfc__arena_idle_region_bytes(const struct bfc__arena *a);
/* The largest run of adjacent idle chunks (bfc__chunk_idle) of one of a's
 * regions, in bytes.  Under a's lock; walks every chunk: OOM report only. */
size_t bfc__arena_largest_idle_run(struct bfc__arena *a);
/* Makes a an expandable arena (expand.c): the reservation (at least `need`
 * bytes), then its one region (nothing mapped), one free chunk covering it,
 * published in the region map.  BFC_OK, BFC_ENOMEM or the backend's error;
 * a unchanged on failure. */
int bfc__arena_expand_locked(struct bfc__arena *a, size_t need);
/* Retired and empty: give everything back, mark dead.  Returns true when the
 * caller must unlink and reclaim the arena (bfc__shard_reclaim) after
 * unlocking. */
bool bfc__arena_maybe_dead_slow(struct bfc__arena *a);
static inline bool bfc__arena_maybe_dead_locked(struct bfc__arena *a)
{
    /* acquire: pairs with the seq_cst store in bfc__remote_mark_retired. */
    return BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_acquire)) && bfc__arena_maybe_dead_slow(a);
}
/* Under a->lock: validate p against chunk c of region r for a free or an
 * introspection call; BFC_OK, BFC_ENOTOWNED or BFC_EDOUBLEFREE. */
int bfc__arena_classify_locked(struct bfc__arena *a, struct bfc__region *r, uintptr_t p,
                               struct bfc__chunk **out);
/* Is c (a value read from a handle) the chunk record that starts at p in r? */
static inline bool bfc__chunk_at(const struct bfc__chunk *c, const struct bfc__region *r, uintptr_t p)
{
    return c && c != BFC__HANDLE_GONE && c->ptr == p && c->region == r;
}
/* The same, with the common answer decided inline (the same-stream free):
 * `hint` is the chunk the caller read from p's handle without the lock; if
 * it is still the live block that starts at p -- its start, region and
 * state say so under the lock, whatever happened to the handle meanwhile --
 * it is the answer.  Everything else goes to the call. */
static inline int bfc__arena_classify_fast_locked(struct bfc__arena *a, struct bfc__region *r, uintptr_t p,
                                                  struct bfc__chunk *hint, struct bfc__chunk **out)
{
    if (BFC__LIKELY(bfc__chunk_at(hint, r, p) && !a->dead && !r->gone &&
                    atomic_load_explicit(&hint->state, memory_order_acquire) == BFC__CHUNK_INUSE)) {
        *out = hint;
        return BFC_OK;
    }
    return bfc__arena_classify_locked(a, r, p, out);
}
int bfc__arena_check_locked(struct bfc__arena *a, char *buf, size_t len);

/* The fences of the streams bfc_ctx_record_stream gave c, armed now and
 * chained on *chain; c's list is consumed.  Under the owner's lock: at a
 * same-stream free, at a cross-stream free by the freeing thread (which
 * only tries the lock, remote.c), else when the owner drains the block. */
void bfc__arena_fence_recorded_locked(struct bfc__arena *a, struct bfc__chunk *c, struct bfc__fence **chain);

/* The owner arena's pool of fence records (with events): get (NULL when
 * metadata is exhausted) and put back a chain (through `extra`). */
struct bfc__fence *bfc__arena_fence_get(struct bfc__arena *a);
void bfc__arena_fence_put(struct bfc__arena *a, struct bfc__fence *f);
void bfc__arena_fence_pool_destroy(struct bfc__arena *a);

#endif /* BFC_ARENA_H */
