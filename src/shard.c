/*
 * shard.c -- the shard directory: stream id -> arena.
 *
 * A liburcu lock-free hash table (rculfhash) keyed by the stream's stable id
 * (cudaStreamGetId; the simulated stream's index on SIM), read under urcu-bp
 * read locks: callers' threads are not ours to register, and urcu-bp
 * registers them lazily.  A thread-local cache of the last (context, stream
 * handle, arena) triple skips even the hash lookup; it is valid while the
 * process-wide epoch it was filled under is unchanged (every retirement and
 * every context teardown bumps the epoch).
 *
 * Shards are created on first use with cds_lfht_add_unique: two threads
 * racing on a new stream end up sharing one arena (the loser frees its
 * unpublished one).  A retired shard leaves the table at once and is freed
 * after its last block and an RCU grace period (call_rcu), so a reader that
 * found it under rcu_read_lock can still lock it and see `retired`.
 *
 * A thread's per-thread default stream can be released only by that
 * thread; one that exits without releasing it has its shard retired later
 * by another thread ("Threads that exit", below).
 *
 * Locks: none on lookup.  Creation and reclamation take ctx->arenas_lock
 * (the arena list used by stats and by the OOM slow path) -- once per stream
 * lifetime, never per allocation.
 */
#include <string.h>

#include "ctx.h"

_Atomic uint64_t bfc__dir_epoch = 1;

__thread struct bfc__shard_cache bfc__shard_last BFC__TLS_IE;

static void reap(struct bfc_ctx *ctx);

static unsigned long hash_id(uint64_t x)
{
    /* splitmix64 finaliser: SIM ids are small consecutive integers. */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return (unsigned long)(x ^ (x >> 31));
}

static int match_id(struct cds_lfht_node *node, const void *key)
{
    struct bfc__arena *a = caa_container_of(node, struct bfc__arena, dir_node);
    /* acquire: pairs with the release before cds_lfht_add_unique. */
    return atomic_load_explicit(&a->ready, memory_order_acquire) && a->stream_id == *(const uint64_t *)key;
}

int bfc__shard_dir_init(struct bfc_ctx *ctx)
{
    CDS_INIT_LIST_HEAD(&ctx->arenas);
    CDS_INIT_LIST_HEAD(&ctx->exit_arenas);
    CDS_INIT_LIST_HEAD(&ctx->zombies);
    atomic_init(&ctx->nzombies, 0);
    ctx->dir = cds_lfht_new(64, 64, 0, CDS_LFHT_AUTO_RESIZE | CDS_LFHT_ACCOUNTING, NULL);
    if (!ctx->dir)
        return BFC_ENOMEM;
    if (bfc__mutex_init(&ctx->arenas_lock, BFC__RANK_ARENAS, "a context's arenas list")) {
        (void)cds_lfht_destroy(ctx->dir, NULL); /* empty, and no resize can be pending */
        return BFC_EBACKEND;
    }
    return BFC_OK;
}

/* -------------------------------------------------- threads that exit
 *
 * cudaStreamPerThread names the calling thread's own stream, so only that
 * thread can release its shard (shardbfc.h).  A thread that exits without
 * doing so would leave the shard -- its metadata, its cached memory -- in
 * the directory for the context's lifetime: one per thread a server ever
 * ran.  So each such shard carries a note shared with its thread.  A
 * pthread key destructor marks the thread's notes when it exits, and the
 * next thread that creates a shard on the context (a new thread's first
 * use of its per-thread stream, a new stream) or trims it retires the
 * marked shards, as bfc_ctx_stream_release would have.
 *
 * The exiting thread does nothing but atomics and metadata frees: where a
 * key destructor runs relative to the CUDA runtime's teardown of the same
 * thread is unknown.  The retiring thread records the departure fences, on
 * the legacy default stream, which waits for the exited thread's
 * per-thread stream's earlier work (backend.h, stream_for) as it does for
 * every departure of such a shard's memory on another thread's call.
 *
 * A note has two references, the shard's and its thread's list's; the last
 * to let go frees it.  The list is the key's value, touched by its thread
 * alone, which drops the notes of shards already gone whenever it adds one.
 * Without the note or the key (no memory) a shard stays until the context
 * goes, as it would without this.  A forked child's other threads never
 * exit in it: their shards stay.
 */
struct bfc__thread_exit {
    _Atomic unsigned refs;
    _Atomic bool exited;
    struct bfc__thread_exit *next; /* the thread's list */
};

/* Threads that exited with notes so far: a context compares it with its
 * exits_seen to know whether to look. */
static _Atomic uint64_t thread_exits;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static pthread_key_t exit_key;
static bool exit_key_ok;

static void exit_note_put(struct bfc__thread_exit *n)
{
    /* acq_rel: whoever frees the note sees the other side's accesses. */
    if (atomic_fetch_sub_explicit(&n->refs, 1, memory_order_acq_rel) == 1)
        bfc__meta_free(n, sizeof(*n));
}

static void thread_exited(void *v)
{
    struct bfc__thread_exit *n = v, *next;
    for (; n; n = next) {
        next = n->next;
        /* release: pairs with the acquire load in retire_exited. */
        atomic_store_explicit(&n->exited, true, memory_order_release);
        exit_note_put(n);
    }
    /* release: a context that sees the new count sees the notes marked. */
    atomic_fetch_add_explicit(&thread_exits, 1, memory_order_release);
}

static void exit_key_init(void)
{
    exit_key_ok = pthread_key_create(&exit_key, thread_exited) == 0;
}

/* The new shard a's note (the shard's reference), or NULL. */
static struct bfc__thread_exit *exit_note_new(void)
{
    struct bfc__thread_exit *n = bfc__meta_zalloc(sizeof(*n));
    if (n)
        atomic_init(&n->refs, 1);
    return n;
}

/* Puts a's note on the calling thread's list (the second reference).  On
 * failure the note stays the shard's alone, never marked. */
static void exit_note_register(struct bfc__arena *a)
{
    struct bfc__thread_exit *n = a->exit_note;
    if (!n || pthread_once(&exit_once, exit_key_init) != 0 || !exit_key_ok)
        return;
    /* relaxed: the note is not shared yet. */
    atomic_fetch_add_explicit(&n->refs, 1, memory_order_relaxed);
    n->next = pthread_getspecific(exit_key);
    if (pthread_setspecific(exit_key, n) != 0) {
        n->next = NULL;
        exit_note_put(n);
        return;
    }
    /* The notes of shards already gone: only this list holds them. */
    struct bfc__thread_exit **pp = &n->next;
    while (*pp) {
        struct bfc__thread_exit *x = *pp;
        /* acquire: pairs with the shard's acq_rel put. */
        if (atomic_load_explicit(&x->refs, memory_order_acquire) == 1) {
            *pp = x->next;
            bfc__meta_free(x, sizeof(*x));
        } else {
            pp = &x->next;
        }
    }
}

/* Frees an arena that is no longer anyone's, and lets go of its note. */
static void arena_release(struct bfc__arena *a)
{
    struct bfc__thread_exit *n = a->exit_note;
    bfc__arena_free(a);
    if (n)
        exit_note_put(n);
}

static bool tls_hit(struct bfc_ctx *ctx, bfc_stream_t s)
{
    return bfc__shard_hit(ctx, s);
}

int bfc__shard_stream_id(struct bfc_ctx *ctx, bfc_stream_t s, uint64_t *id)
{
    if (tls_hit(ctx, s)) {
        *id = bfc__shard_last.arena->stream_id;
        return BFC_OK;
    }
    return ctx->be->ops->stream_id(ctx->be, s, id);
}

static struct bfc__arena *lookup(struct bfc_ctx *ctx, uint64_t id)
{
    struct cds_lfht_iter it;
    cds_lfht_lookup(ctx->dir, hash_id(id), match_id, &id, &it);
    struct cds_lfht_node *node = cds_lfht_iter_get_node(&it);
    return node ? caa_container_of(node, struct bfc__arena, dir_node) : NULL;
}

static void tls_fill(struct bfc_ctx *ctx, bfc_stream_t s, struct bfc__arena *a, uint64_t epoch)
{
    bfc__shard_last.ctx = ctx;
    bfc__shard_last.stream = s;
    bfc__shard_last.arena = a;
    bfc__shard_last.epoch = epoch;
}

struct bfc__arena *bfc__shard_find(struct bfc_ctx *ctx, bfc_stream_t s)
{
    if (tls_hit(ctx, s))
        return bfc__shard_last.arena;
    uint64_t epoch = atomic_load_explicit(&bfc__dir_epoch, memory_order_acquire);
    uint64_t id;
    if (ctx->be->ops->stream_id(ctx->be, s, &id) != BFC_OK)
        return NULL;
    struct bfc__arena *a = lookup(ctx, id);
    if (a)
        tls_fill(ctx, s, a, epoch);
    return a;
}

struct bfc__arena *bfc__shard_get_slow(struct bfc_ctx *ctx, bfc_stream_t s, int *status)
{
    uint64_t epoch = atomic_load_explicit(&bfc__dir_epoch, memory_order_acquire);
    uint64_t id;
    int st = ctx->be->ops->stream_id(ctx->be, s, &id);
    if (st != BFC_OK) {
        *status = st;
        return NULL;
    }
    struct bfc__arena *a = lookup(ctx, id);
    if (!a) {
        /* A shard is being made: the moment to retire those of threads
         * that have exited (the epoch moves if any goes), and to reclaim
         * retired ones that hold nothing more. */
        if (bfc__shard_retire_exited(ctx))
            epoch = atomic_load_explicit(&bfc__dir_epoch, memory_order_acquire);
        reap(ctx);
        struct bfc__arena *mine = bfc__arena_new(&ctx->env, s, id);
        if (!mine) {
            *status = BFC_ENOMEM;
            return NULL;
        }
        if (s == BFC__STREAM_PER_THREAD)
            mine->exit_note = exit_note_new();
        bfc__lock(&ctx->arenas_lock);
        mine->seq = ctx->arena_seq++;
        cds_list_add(&mine->all, &ctx->arenas);
        if (mine->exit_note) /* the shards a look for exited threads walks */
            cds_list_add(&mine->exit_link, &ctx->exit_arenas);
        bfc__unlock(&ctx->arenas_lock);
        atomic_store_explicit(&mine->ready, true, memory_order_release);
        bfc__lock(&bfc__urcu_gate); /* rcu.h: may queue a resize */
        struct cds_lfht_node *got =
            cds_lfht_add_unique(ctx->dir, hash_id(id), match_id, &id, &mine->dir_node);
        bfc__unlock(&bfc__urcu_gate);
        if (got != &mine->dir_node) {
            /* Another thread published this stream's shard first. */
            mine->unlinked = true;
            bfc__lock(&ctx->arenas_lock);
            cds_list_del(&mine->all);
            if (mine->exit_note)
                cds_list_del(&mine->exit_link);
            bfc__unlock(&ctx->arenas_lock);
            arena_release(mine);
            a = caa_container_of(got, struct bfc__arena, dir_node);
        } else {
            a = mine;
            /* relaxed: a statistic. */
            atomic_fetch_add_explicit(&ctx->shards_live, 1, memory_order_relaxed);
            exit_note_register(mine);
        }
    }
    tls_fill(ctx, s, a, epoch);
    return a;
}

static void arena_free_cb(struct rcu_head *h)
{
    bfc__rcu_reclaim();
    arena_release(caa_container_of(h, struct bfc__arena, rcu));
    bfc__rcu_reclaim_done();
}

/* Unlinks from the context list; ctx->arenas_lock held.  The arena is dead
 * (no chunks, no regions), so its counters are final: the cumulative ones
 * move to the context so totals never go backwards. */
static void unlink_locked(struct bfc_ctx *ctx, struct bfc__arena *a)
{
    if (a->unlinked)
        return;
    a->unlinked = true;
    struct bfc__astats *r = &ctx->retired;
    r->num_allocs += a->st.num_allocs;
    r->num_frees += a->st.num_frees;
    r->remote_frees += a->st.remote_frees;
    r->ooms += a->st.ooms;
    r->peak_in_use += a->st.peak_in_use;
    r->peak_requested += a->st.peak_requested;
    if (a->st.largest_alloc > r->largest_alloc)
        r->largest_alloc = a->st.largest_alloc;
    cds_list_del(&a->all);
    if (a->exit_note)
        cds_list_del(&a->exit_link);
    if (a->zombie) {
        cds_list_del(&a->zombie_link);
        a->zombie = false;
        /* relaxed: see reap(). */
        atomic_store_explicit(&ctx->nzombies, atomic_load_explicit(&ctx->nzombies, memory_order_relaxed) - 1,
                              memory_order_relaxed);
    }
}

/* ------------------------------------------------------------- zombies
 *
 * A retired shard that still holds something -- a live block, or a freed
 * one whose fence has not completed -- is reclaimed by whoever sees it hold
 * nothing more: the free of its last live block (ctx.c, remote.c).  A
 * fence is seen completed only when someone looks, though, and a block
 * freed while the freeing stream was busy (the common case on a device) is
 * still pending at that free.  Nothing else looks at a retired shard but
 * trim and the OOM path, so streams or threads that come and go would each
 * leave one behind (70 KB of metadata and its address range).  So every
 * retired shard that is not dead at once goes on ctx->zombies, and reap()
 * -- at each shard creation and retirement, when shards come and go --
 * reclaims those that hold nothing more.  Its walk takes arenas_lock and
 * each zombie's lock in turn: only where shards are made or retired.
 */

/* a was retired and is not dead: noted as a zombie.  Inside the read
 * section that found it (a stays allocated). */
static void note_zombie(struct bfc_ctx *ctx, struct bfc__arena *a)
{
    bfc__lock(&ctx->arenas_lock);
    if (!a->unlinked && !a->zombie) {
        a->zombie = true;
        cds_list_add_tail(&a->zombie_link, &ctx->zombies);
        atomic_store_explicit(&ctx->nzombies, atomic_load_explicit(&ctx->nzombies, memory_order_relaxed) + 1,
                              memory_order_relaxed);
    }
    bfc__unlock(&ctx->arenas_lock);
}

/* Reclaims the zombies that hold nothing more (their fences completed). */
static void reap(struct bfc_ctx *ctx)
{
    /* relaxed: a hint; a zombie noted meanwhile waits for the next look. */
    if (atomic_load_explicit(&ctx->nzombies, memory_order_relaxed) == 0)
        return;
    bfc__lock(&ctx->arenas_lock);
    struct bfc__arena *a;
    bfc__list_for_each_safe(a, &ctx->zombies, zombie_link) {
        bfc__lock(&a->lock);
        bool dead = bfc__arena_maybe_dead_locked(a);
        bfc__unlock(&a->lock);
        if (dead) {
            unlink_locked(ctx, a);
            bfc__call_rcu(&a->rcu, arena_free_cb);
        }
    }
    bfc__unlock(&ctx->arenas_lock);
}

void bfc__shard_reclaim(struct bfc__arena *a)
{
    struct bfc_ctx *ctx = a->env->tag;
    bfc__lock(&ctx->arenas_lock);
    bool first = !a->unlinked;
    unlink_locked(ctx, a);
    bfc__unlock(&ctx->arenas_lock);
    if (first)
        bfc__call_rcu(&a->rcu, arena_free_cb);
}

/* Takes a out of the directory and sheds what it does not use, under
 * rcu_read_lock; BFC_EINVAL when it had already left.  *dead: it holds
 * nothing more, the caller reclaims it once out of the read section. */
static int retire(struct bfc_ctx *ctx, struct bfc__arena *a, bool *dead)
{
    bfc__lock(&bfc__urcu_gate); /* rcu.h: may queue a resize */
    int del = cds_lfht_del(ctx->dir, &a->dir_node);
    bfc__unlock(&bfc__urcu_gate);
    if (del != 0)
        return BFC_EINVAL;
    /* Pairs with bfc__remote_owner_retired in a cross-stream free: an
     * enqueue racing with retirement is drained by one side or the other
     * (remote.c, "Retirement"). */
    bfc__remote_mark_retired(a);
    /* release: pairs with the acquire loads in tls_hit. */
    atomic_fetch_add_explicit(&bfc__dir_epoch, 1, memory_order_release);
    atomic_fetch_sub_explicit(&ctx->shards_live, 1, memory_order_relaxed);
    bfc__lock(&a->lock);
    bfc__arena_drain_locked(a, true);
    /* A retired shard allocates no more: everything it does not use goes
     * back to the pool, fenced on its stream. */
    bfc__arena_shed_locked(a, true);
    *dead = bfc__arena_maybe_dead_locked(a);
    bfc__unlock(&a->lock);
    return BFC_OK;
}

int bfc__shard_retire(struct bfc_ctx *ctx, bfc_stream_t s)
{
    bfc__rcu_lock();
    uint64_t id;
    /* A stream the runtime fails to name says so (BFC_EBACKEND), as in
     * record_stream; one it names without a shard is BFC_EINVAL. */
    int st = ctx->be->ops->stream_id(ctx->be, s, &id);
    struct bfc__arena *a = st == BFC_OK ? lookup(ctx, id) : NULL;
    bool dead = false;
    if (st == BFC_OK)
        st = a ? retire(ctx, a, &dead) : BFC_EINVAL;
    if (st == BFC_OK && !dead)
        note_zombie(ctx, a);
    bfc__rcu_unlock();
    if (dead)
        bfc__shard_reclaim(a);
    reap(ctx);
    return st;
}

/* At most this many shards are taken per look at the list (a stack array;
 * the walk repeats while it fills). */
#define EXITED_BATCH 16

size_t bfc__shard_retire_exited(struct bfc_ctx *ctx)
{
    /* acquire: pairs with the release increment in thread_exited. */
    uint64_t now = atomic_load_explicit(&thread_exits, memory_order_acquire);
    /* relaxed: a hint; two threads may both look (the directory's delete
     * gives each shard to one of them).  Stored once the look is done: a
     * fork in the middle leaves the child's count unseen, so that the
     * child's next look retires what this one had not yet. */
    if (atomic_load_explicit(&ctx->exits_seen, memory_order_relaxed) == now)
        return 0;
    size_t retired = 0, n;
    do {
        struct bfc__arena *got[EXITED_BATCH];
        bool dead[EXITED_BATCH];
        n = 0;
        bfc__rcu_lock(); /* the arenas stay until it ends, reclaimed or not */
        bfc__lock(&ctx->arenas_lock);
        struct bfc__arena *a;
        bfc__list_for_each(a, &ctx->exit_arenas, exit_link) {
            /* acquire: pairs with the release store in thread_exited; and
             * with the seq_cst store in bfc__remote_mark_retired (a shard
             * another look is retiring may be taken twice: its second
             * retire finds it gone from the directory). */
            if (atomic_load_explicit(&a->exit_note->exited, memory_order_acquire) &&
                !atomic_load_explicit(&a->retired, memory_order_acquire)) {
                got[n++] = a;
                if (n == EXITED_BATCH)
                    break;
            }
        }
        bfc__unlock(&ctx->arenas_lock);
        for (size_t i = 0; i < n; i++) {
            dead[i] = false;
            if (retire(ctx, got[i], &dead[i]) == BFC_OK) {
                retired++;
                if (!dead[i])
                    note_zombie(ctx, got[i]);
            }
        }
        bfc__rcu_unlock();
        for (size_t i = 0; i < n; i++)
            if (dead[i])
                bfc__shard_reclaim(got[i]);
    } while (n == EXITED_BATCH);
    atomic_store_explicit(&ctx->exits_seen, now, memory_order_relaxed);
    return retired;
}

size_t bfc__shard_reclaim_others(struct bfc_ctx *ctx, struct bfc__arena *self, bool tails)
{
    size_t freed = 0;
    bfc__lock(&ctx->arenas_lock);
    struct bfc__arena *a;
    bfc__list_for_each_safe(a, &ctx->arenas, all) {
        if (a != self) {
            bfc__lock(&a->lock);
            bool dead = false;
            if (!a->dead) {
                bfc__arena_drain_locked(a, true);
                freed += bfc__arena_shed_locked(a, tails);
                dead = bfc__arena_maybe_dead_locked(a);
            }
            bfc__unlock(&a->lock);
            if (dead) {
                unlink_locked(ctx, a);
                bfc__call_rcu(&a->rcu, arena_free_cb);
            }
        }
    }
    bfc__unlock(&ctx->arenas_lock);
    return freed;
}

size_t bfc__shard_collect_tails(struct bfc_ctx *ctx, struct bfc__arena *self, struct bfc__range *out, size_t max)
{
    size_t n = 0;
    bfc__lock(&ctx->arenas_lock);
    struct bfc__arena *a;
    bfc__list_for_each(a, &ctx->arenas, all) {
        if (n >= max)
            break;
        if (a == self)
            continue;
        bfc__lock(&a->lock);
        if (!a->dead)
            n += bfc__arena_tails_locked(a, out + n, max - n);
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
    return n;
}

/*
 * Stop the world: every lock of the context, in the documented order
 * (arenas_lock, each arena in list order, the pool).  Only fork and
 * bfc_ctx_check do this; it is the one exception to "no path takes two
 * arena locks", and it cannot deadlock because no path takes arenas_lock or
 * a second arena lock while holding an arena lock: whoever holds one arena
 * lock finishes (taking at most the pool and region-map locks) and lets go.
 */
void bfc__shard_lock_all(struct bfc_ctx *ctx)
{
    bfc__lock(&ctx->arenas_lock);
    struct bfc__arena *a;
    bfc__list_for_each(a, &ctx->arenas, all)
        bfc__lock_nested(&a->lock);
    bfc__lock(&ctx->pool.lock);
}

void bfc__shard_unlock_all(struct bfc_ctx *ctx)
{
    bfc__unlock(&ctx->pool.lock);
    struct bfc__arena *a;
    bfc__list_for_each(a, &ctx->arenas, all)
        bfc__unlock(&a->lock);
    bfc__unlock(&ctx->arenas_lock);
}

void bfc__shard_dir_fini(struct bfc_ctx *ctx)
{
    /* No concurrent users (bfc_ctx_destroy's contract); readers that might
     * still hold a stale thread-local entry are fenced off by the epoch. */
    atomic_fetch_add_explicit(&bfc__dir_epoch, 1, memory_order_release);
    bfc__rcu_lock();
    struct cds_lfht_iter it;
    struct cds_lfht_node *node;
    bfc__lock(&bfc__urcu_gate); /* rcu.h: may queue a resize */
    cds_lfht_for_each(ctx->dir, &it, node) (void)cds_lfht_del(ctx->dir, node);
    bfc__unlock(&bfc__urcu_gate);
    bfc__rcu_unlock();
    /* Wait for readers, then for every call_rcu callback queued so far
     * (retired arenas, regions) before freeing the rest by hand. */
    synchronize_rcu();
    rcu_barrier();
    bfc__rcu_reclaim();
    struct bfc__arena *a;
    bfc__list_for_each_safe(a, &ctx->arenas, all)
        arena_release(a);
    CDS_INIT_LIST_HEAD(&ctx->arenas);
    rcu_barrier();
    bfc__rcu_reclaim();
    /* Empty (every arena released above) and after rcu_barrier: it fails
     * only for a table still holding nodes or called from a read-side
     * section, neither possible here. */
    (void)cds_lfht_destroy(ctx->dir, NULL);
    bfc__mutex_destroy(&ctx->arenas_lock);
}

/* ------------------------------------------------------- OOM report */

size_t bfc__shard_free_info(struct bfc_ctx *ctx, struct bfc__shard_free *out, size_t max, size_t *live)
{
    size_t n = 0, nlive = 0;
    bfc__lock(&ctx->arenas_lock);
    struct bfc__arena *a;
    bfc__list_for_each(a, &ctx->arenas, all) {
        bfc__lock(&a->lock);
        /* A dead shard still listed holds nothing; a retired one may still
         * hold free chunks next to live blocks, which is worth showing. */
        if (!a->dead) {
            bfc__arena_drain_locked(a, true);
            size_t free_bytes = bfc__arena_free_bytes(a), largest = bfc__bins_largest(&a->bins);
            size_t range = largest, ready = largest, granules = 0, run = 0;
            if (a->x) {
                /* An expandable shard's free chunks are mostly address
                 * space: only its mapped granules are memory. */
                free_bytes = bfc__expand_idle_bytes(a);
                if (largest > free_bytes)
                    largest = free_bytes;
                ready = bfc__expand_largest_mapped_free(a);
                granules = bfc__expand_free_granule_bytes(a);
            } else {
                run = bfc__arena_largest_idle_run(a);
            }
            /* acquire: pairs with the seq_cst store in bfc__remote_mark_retired. */
            bool retired = atomic_load_explicit(&a->retired, memory_order_acquire);
            nlive += !retired;
            if (n < max)
                out[n] = (struct bfc__shard_free){
                    .stream_id = a->stream_id,
                    .stream = a->stream,
                    .free_bytes = free_bytes,
                    .largest_free = largest,
                    .largest_ready = ready,
                    .largest_range = range,
                    .free_granules = granules,
                    .largest_run = run,
                    .pending_bytes = a->st.pending_bytes,
                    .in_use = a->st.bytes_in_use,
                    .reserved = a->st.bytes_reserved,
                    .retired = retired,
                    .expandable = a->x != NULL,
                };
            n++;
        }
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
    if (live)
        *live = nlive;
    return n;
}
