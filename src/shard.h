/*
 * shard.h -- the shard directory (shard.c): stream -> arena, one arena
 * (shard) per stream, created on first use and retired when its stream goes.
 *
 * The directory is an RCU lock-free hash keyed by stream id, fronted by a
 * thread-local cache that bfc__dir_epoch invalidates.  The context's list
 * of arenas (ctx->arenas, under arenas_lock, rank BFC__RANK_ARENAS) is the
 * directory's too: the walks over every shard -- reclaim from the others,
 * collect free tails, the OOM report's per-shard figures, every lock for a
 * consistency check -- are here, and the context decides when to run them.
 */
#ifndef BFC_SHARD_H
#define BFC_SHARD_H

#include "arena.h"

struct bfc_ctx;

int bfc__shard_dir_init(struct bfc_ctx *ctx);
/* Bumped whenever a shard leaves a directory or a context dies: thread-local
 * caches compare it to know they are stale. */
extern _Atomic uint64_t bfc__dir_epoch;

/* The calling thread's last (context, stream handle, arena), valid while
 * bfc__dir_epoch is what it was when filled (shard.c).  Filled only with an
 * arena, never NULL; a thread's cache starts zeroed, and epoch 0 is never
 * current (bfc__dir_epoch starts at 1 and only grows), so an unfilled cache
 * never hits. */
struct bfc__shard_cache {
    struct bfc_ctx *ctx;
    bfc_stream_t stream;
    struct bfc__arena *arena;
    uint64_t epoch;
};
extern __thread struct bfc__shard_cache bfc__shard_last BFC__TLS_IE;

static inline bool bfc__shard_hit(struct bfc_ctx *ctx, bfc_stream_t s)
{
    /* acquire: pairs with the release increment in bfc__shard_retire; an
     * unchanged epoch means the cached arena was not retired before this
     * read section began, so it is not freed before we unlock RCU. */
    return bfc__shard_last.ctx == ctx && bfc__shard_last.stream == s &&
           bfc__shard_last.epoch == atomic_load_explicit(&bfc__dir_epoch, memory_order_acquire);
}

/* The arena of stream s, created on first use.  Call under rcu_read_lock;
 * the arena stays valid until rcu_read_unlock.  NULL on ENOMEM/EBACKEND.
 * The thread-local hit is inline; the rest is bfc__shard_get_slow. */
struct bfc__arena *bfc__shard_get_slow(struct bfc_ctx *ctx, bfc_stream_t s, int *status);
static inline struct bfc__arena *bfc__shard_get(struct bfc_ctx *ctx, bfc_stream_t s, int *status)
{
    if (BFC__LIKELY(bfc__shard_hit(ctx, s)))
        return bfc__shard_last.arena;
    return bfc__shard_get_slow(ctx, s, status);
}
/* Existing arena of s or NULL (no creation).  Under rcu_read_lock. */
struct bfc__arena *bfc__shard_find(struct bfc_ctx *ctx, bfc_stream_t s);
/* Stream id of s (thread-local cache first).  Under rcu_read_lock: the
 * cache's hit reads its arena. */
int bfc__shard_stream_id(struct bfc_ctx *ctx, bfc_stream_t s, uint64_t *id);
int bfc__shard_retire(struct bfc_ctx *ctx, bfc_stream_t s);
/* Retires the per-thread stream shards of threads that have exited
 * (shard.c, "Threads that exit"); returns how many.  Takes arenas_lock and
 * each such arena's lock: call with no arena lock held. */
size_t bfc__shard_retire_exited(struct bfc_ctx *ctx);
/* Unlinks a dead arena and frees it after a grace period. */
void bfc__shard_reclaim(struct bfc__arena *a);
/* Destroys every arena (ctx teardown; no concurrent users). */
void bfc__shard_dir_fini(struct bfc_ctx *ctx);

/* Every lock of the context's shards, in rank order (arenas_lock, each
 * arena, the pool) / all released (bfc_ctx_check). */
void bfc__shard_lock_all(struct bfc_ctx *ctx);
void bfc__shard_unlock_all(struct bfc_ctx *ctx);

/* Slow path: every other arena gives its fully free regions (with tails,
 * also the free tails of its regions) back to the pool; returns the bytes. */
size_t bfc__shard_reclaim_others(struct bfc_ctx *ctx, struct bfc__arena *self, bool tails);

/* The free tails of every other arena's regions (see
 * bfc__arena_tails_locked), up to max; returns how many. */
size_t bfc__shard_collect_tails(struct bfc_ctx *ctx, struct bfc__arena *self, struct bfc__range *out, size_t max);

/* What one shard could give, as the OOM report shows it.  An expandable
 * shard counts only mapped memory: free_bytes is its mapped bytes under no
 * block in use or pending (granules shared with such a block included, so a
 * bound), largest_free the smaller of that and its largest free chunk (a
 * bound of its largest mapped free piece: what unmapping could give),
 * largest_ready the largest block it could hand out without a map (exact:
 * bfc__expand_largest_mapped_free) and largest_range its largest free
 * chunk, mapped or not (addresses).  A classic shard's three are its
 * largest free chunk. */
struct bfc__shard_free {
    uint64_t stream_id;
    bfc_stream_t stream;
    size_t free_bytes;      /* in its bins (expandable: mapped, above) */
    size_t largest_free;    /* its largest free chunk (expandable: above) */
    size_t largest_ready;   /* expandable: above */
    size_t largest_range;   /* expandable: above */
    size_t free_granules;   /* expandable: mapped granules wholly in runs of free and
                               pending chunks (exact) */
    size_t largest_run;     /* classic: the largest run of adjacent free and pending
                               chunks of one region, one piece once the fences complete */
    size_t pending_bytes;   /* freed blocks still waiting for their fences */
    size_t in_use;          /* live chunk bytes */
    size_t reserved;        /* its regions */
    bool retired;           /* released: serves no allocation, holds blocks still live */
    bool expandable;        /* a vmm shard: free_bytes and largest_free are bounds */
};
/* Each shard of ctx that is not dead in turn, retired ones included
 * (arenas_lock, then each arena's lock, never two; the remote-free queue
 * drained first, as bfc_ctx_stats does): the first `max` into out.  Returns
 * the number of such shards; *live (when not NULL) gets the number of them
 * not retired, the context's live shards (bfc_stats_t.num_shards). */
size_t bfc__shard_free_info(struct bfc_ctx *ctx, struct bfc__shard_free *out, size_t max, size_t *live);

#endif /* BFC_SHARD_H */
