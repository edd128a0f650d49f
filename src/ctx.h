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

struct bfc_ctx {
    bfc_config_t cfg;            /* resolved: backend, limit filled in */
    bfc__backend_t *be;
    size_t limit;
    size_t max_frag;             /* split when the leftover reaches this */
    size_t bins_max;             /* requests of at least this size skip the bins on the fast path */
    struct bfc__pool pool;
    struct cds_lfht *dir;        /* stream id -> arena */
    pthread_mutex_t arenas_lock; /* the arena list: shard create/reclaim, stats, slow path */
    struct bfc__arena *arenas;
    uint64_t arena_seq;
    _Atomic uint64_t ooms;       /* rejected before any shard was involved */
    struct bfc__astats retired;  /* cumulative counters of reclaimed shards (arenas_lock) */
    _Atomic uint64_t shards_live;
    _Atomic uint64_t poison_errors; /* poison=true: reused blocks found written after free */
    bool vmm;                    /* shards are expandable arenas (expand.c) */
    bool destroying;
    bool is_host;                /* a host pinned-memory context (host.c) */
    struct bfc_ctx *reg_next;    /* the process's context registry (ctx.c, fork) */
    struct bfc__obs obs;         /* trace and OOM report (obs.h) */
};

/* A context over an already opened backend (host arenas); takes ownership of
 * be, also on failure. */
int bfc__ctx_create_with_backend(const bfc_config_t *cfg, bfc__backend_t *be, bool host, bfc_ctx_t **out);

/* Shard directory (shard.c). */
int bfc__shard_dir_init(struct bfc_ctx *ctx);
/* The arena of stream s, created on first use.  Call under rcu_read_lock;
 * the arena stays valid until rcu_read_unlock.  NULL on ENOMEM/EBACKEND. */
struct bfc__arena *bfc__shard_get(struct bfc_ctx *ctx, bfc_stream_t s, int *status);
/* Existing arena of s or NULL (no creation).  Under rcu_read_lock. */
struct bfc__arena *bfc__shard_find(struct bfc_ctx *ctx, bfc_stream_t s);
/* Stream id of s (thread-local cache first). */
int bfc__shard_stream_id(struct bfc_ctx *ctx, bfc_stream_t s, uint64_t *id);
int bfc__shard_retire(struct bfc_ctx *ctx, bfc_stream_t s);
/* Unlinks a dead arena and frees it after a grace period. */
void bfc__shard_reclaim(struct bfc__arena *a);
/* Destroys every arena (ctx teardown; no concurrent users). */
void bfc__shard_dir_fini(struct bfc_ctx *ctx);
/* Bumped whenever a shard leaves a directory or a context dies: thread-local
 * caches compare it to know they are stale. */
extern _Atomic uint64_t bfc__dir_epoch;

/* Every lock of the context / all released (fork, consistent checks). */
void bfc__ctx_lock_all(struct bfc_ctx *ctx);
void bfc__ctx_unlock_all(struct bfc_ctx *ctx);

/* Slow path: every other arena gives its fully free regions (with tails,
 * also the free tails of its regions) back to the pool; returns the bytes. */
size_t bfc__ctx_reclaim_others(struct bfc_ctx *ctx, struct bfc__arena *self, bool tails);

/* The free tails of every other arena's regions (see
 * bfc__arena_tails_locked), up to max; returns how many. */
size_t bfc__ctx_collect_tails(struct bfc_ctx *ctx, struct bfc__arena *self, struct bfc__range *out, size_t max);

/* Internal status of the slow path: the shard was retired meanwhile, look
 * the stream up again.  Never returned to a caller of the public API. */
#define BFC__RETRY 1
/* The out-of-memory escalation (ctx.c); a->lock held, see there. */
void *bfc__ctx_alloc_slow(struct bfc_ctx *ctx, struct bfc__arena *a, size_t n, size_t rounded, int *status);

/* The one-time process set-up: metadata arena, liburcu's default call_rcu
 * thread, fork handlers (ctx.c).  Call before taking any lock the fork
 * handlers cover for the first time. */
void bfc__process_init(void);

/* The locks other parts lend to the fork handlers (ctx.c, "Fork", has the
 * order and the rule).  Outer: the service's create lock (api.c), the host
 * table lock (host.c).  Inner: the trace buffer registry and one running
 * trace's file lock (trace.c; the file lock under ctx->obs.lock). */
void bfc__api_fork_lock(void);
void bfc__api_fork_unlock(void);
void bfc__host_fork_lock(void);
void bfc__host_fork_unlock(void);
void bfc__trace_fork_lock(void);
void bfc__trace_fork_unlock(void);
void bfc__trace_fork_lock_file(struct bfc_ctx *ctx);
void bfc__trace_fork_unlock_file(struct bfc_ctx *ctx);

#endif /* BFC_CTX_H */
