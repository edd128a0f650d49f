/*
 * ctx.h -- the context: one allocator service for one device.
 *
 * A context owns a backend, a region pool, a shard directory (stream id ->
 * arena, an RCU lock-free hash) and the list of its arenas.  Everything a
 * common path needs from it is read-only after creation.
 */
#ifndef BFC_CTX_H
#define BFC_CTX_H

#include "arena.h"
#include "obs.h"
#include "regionmap.h"
#include "remote.h"
#include "shard.h"

struct bfc_ctx {
    bfc_config_t cfg;            /* resolved: backend, limit filled in */
    bfc__backend_t *be;
    size_t limit;
    /* The fast paths' entry test (ctx.c), next to `limit` on one line.  A
     * request of rounded size r (0 on overflow) stays on the fast path only
     * if r - 1 < fast_max = min(limit, env.bins_max - 1): zero, over the
     * limit and large blocks, in one compare.  fast_off is 0 unless a
     * BFC__FAST_* reason below holds: one load for three tests. */
    size_t fast_max;
    _Atomic uint32_t fast_off;
    struct bfc__pool pool;
    struct cds_lfht *dir;        /* stream id -> arena */
    bfc__mutex_t arenas_lock;  /* the arena list: shard create/reclaim, stats, slow path */
    struct cds_list_head arenas; /* bfc__arena.all, newest first */
    struct cds_list_head exit_arenas; /* those with an exit note (shard.c), bfc__arena.exit_link */
    struct cds_list_head zombies; /* retired, not yet dead (shard.c), bfc__arena.zombie_link */
    _Atomic size_t nzombies;     /* their number: written under arenas_lock, read relaxed */
    uint64_t arena_seq;
    _Atomic uint64_t ooms;       /* rejected before any shard was involved */
    struct bfc__astats retired;  /* cumulative counters of reclaimed shards (arenas_lock) */
    _Atomic uint64_t shards_live;
    _Atomic uint64_t exits_seen; /* bfc__thread_exits when its shards were last looked at (shard.c) */
    _Atomic uint64_t alloc_ids;  /* allocation ids given out to shards in blocks (arena.c) */
    _Atomic uint64_t poison_errors; /* poison=true: reused blocks found written after free */
    bool vmm;                    /* shards are expandable arenas (expand.c) */
    bool destroying;
    bool is_host;                /* a host pinned-memory context (host.c) */
    struct bfc_ctx *reg_next;    /* the process's context registry (ctx.c, fork) */
    struct bfc__obs obs;         /* trace and OOM report (obs.h) */
    struct bfc__arena_env env;   /* what its arenas see of it (arena.h) */
};

/* bfc_ctx.fast_off's bits: debug_check and poison are fixed at creation;
 * the trace bit is set and cleared with obs.trace (trace.c), atomically,
 * since the exit handler clears it under a lock of its own. */
#define BFC__FAST_DEBUG 1u
#define BFC__FAST_POISON 2u
#define BFC__FAST_TRACE 4u

/* A context over an already opened backend (host arenas); takes ownership of
 * be, also on failure. */
int bfc__ctx_create_with_backend(const bfc_config_t *cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out);

/* bfc_ctx_free, but the block's owner stream is told from `stream` by the
 * streams' ids alone, not by their handles: for a handle that another owner
 * had before (a host thread's slot, host.c), which the free would take for
 * the owner's stream. */
int bfc__ctx_free_by_id(bfc_ctx_t *ctx, void *ptr, bfc_stream_t stream);

/* Internal status of the slow path: the shard was retired meanwhile, look
 * the stream up again.  Never returned to a caller of the public API. */
#define BFC__RETRY 1
/* The out-of-memory escalation (ctx.c); a->lock held, see there. */
void *bfc__ctx_alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status);

/* The one-time process set-up: metadata arena, fork handlers (ctx.c).
 * Call before taking any lock the fork handlers cover for the first time.
 * (liburcu's default call_rcu thread is made by the first context's
 * creation, which fails with BFC_ENOMEM while no thread can be made.) */
void bfc__process_init(void);

/* The outer locks of the layers above, defined here so that the fork
 * handlers take them without calling up: the host set-up lock (host.c,
 * rank BFC__RANK_HOST_SETUP), the service's create lock (api.c,
 * BFC__RANK_API) and the host table lock (host.c, BFC__RANK_HOST). */
extern bfc__mutex_t bfc__host_setup_lock;
extern bfc__mutex_t bfc__ctx_create_lock;
extern bfc__mutex_t bfc__ctx_host_lock;

/* The inner locks trace.c lends to the fork handlers (ctx.c, "Fork", has
 * the order and the rule): the trace buffer registry and one running
 * trace's file lock (the file lock under ctx->obs.lock). */
void bfc__trace_fork_lock(void);
void bfc__trace_fork_unlock(void);
void bfc__trace_fork_lock_file(struct bfc_ctx *ctx);
void bfc__trace_fork_unlock_file(struct bfc_ctx *ctx);

#endif /* BFC_CTX_H */
