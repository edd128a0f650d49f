/*
 * arena.c -- one shard's allocator: TensorFlow's Best-Fit with Coalescing.
 *
 * The algorithm:
 *   - sizes are rounded up to 256 bytes; chunks tile regions without gaps;
 *   - allocation takes the best fit from the bins (bins.c: smallest free chunk
 *     >= the rounded size, lowest address among equals, found in O(log n));
 *   - the chunk is split when it is >= 2x the rounded size or when the
 *     leftover reaches the max internal fragmentation (128 MiB, or
 *     fragmentation_fraction x limit); the allocation keeps the front;
 *   - a free merges with a free next and a free previous neighbour at once;
 *   - when nothing fits the arena extends: a new region of curr_region_bytes
 *     (doubling from initial_region until it covers the request; never past
 *     the limit; 0.9x back-off when refused), exactly TensorFlow's Extend;
 *   - requests >= large_alloc get a region of their own (rounded to 2 MiB)
 *     that goes straight back to the pool when freed;
 *   - allow_growth=false: the first region is the whole limit and large
 *     requests are served from it too -- one stream gets exactly
 *     TensorFlow's layout.
 *
 * Fragmentation bound: with the split rule, a chunk handed out wastes less
 * than half of itself unless the leftover is below max internal
 * fragmentation, i.e. internal waste < max(size/2, max_frag) per block.
 *
 * Fences: a block freed with fences outstanding (another stream's free,
 * recorded streams) is PENDING: it stays out of the bins and is never merged
 * until every event has completed (drain / poll below).
 *
 * Departures: memory leaves the shard as whole fully free regions
 * (bfc__arena_region_depart: a large block's region at its free, shed
 * under pressure, retirement, trim) or as the free tail of a region still
 * in use (region_shed_tail, when that makes another request fit).  A chunk
 * in a bin may still be in use by work queued on our stream before its free
 * (same-stream frees are reusable at once), so departing memory is fenced
 * by an event on our stream (pool.c), unless none of it was ever used:
 * BFC__CF_USED marks chunks that were handed out or taken back under our own
 * departure fence, and merges and splits pass it on.  The records a
 * departure needs are reserved before anything changes (each region holds
 * its own ticket; a tail reserves one first), so it never fails half way.
 *
 * Locking: every function here runs under the arena's own lock (the callers
 * in ctx.c and remote.c take it), which one thread per stream normally holds
 * uncontended.  The pool lock and the region map's writer lock are taken
 * beneath it (one after the other, never nested) only when a region comes,
 * shrinks or goes.  Chunk handles are published with release stores because cross-stream
 * frees read them without this lock.
 */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "arena_inline.h"
#include "regionmap.h"

/* ------------------------------------------------------------ regions */

static void chunk_delete(struct bfc__arena *a, struct bfc__chunk *c)
{
    /* A lock-free reader may still hold c (a stale handle): the record's
     * memory stays valid (slab), and a state other than INUSE makes its
     * claim fail. */
    atomic_store_explicit(&c->state, BFC__CHUNK_FREE, memory_order_relaxed);
    c->ptr = 0;
    bfc__slab_put(&a->chunk_slab, c);
    a->st.chunks--;
}

static void region_free_cb(struct rcu_head *h)
{
    struct bfc__region *r = caa_container_of(h, struct bfc__region, rcu);
    bfc__rcu_reclaim();
    if (r->handles_bytes)
        (void)munmap((void *)r->handles, r->handles_bytes); /* fails only for a bad range: ours is not */
    else
        bfc__meta_free((void *)r->handles, r->nhandles * sizeof(r->handles[0]));
    bfc__meta_free(r, sizeof(*r));
    bfc__rcu_reclaim_done();
}

static void handles_free(struct bfc__region *r)
{
    if (r->handles_bytes)
        (void)munmap((void *)r->handles, r->handles_bytes); /* fails only for a bad range: ours is not */
    else if (r->handles)
        bfc__meta_free((void *)r->handles, r->nhandles * sizeof(r->handles[0]));
}

/* Creates a region of exactly `size` bytes from the pool, one free chunk
 * covering it, published in the region map.  BFC_ENOMEM when refused.
 * Everything its departure will need is reserved first (the ticket), so a
 * metadata failure refuses the region and changes nothing. */
static int region_setup(struct bfc__arena *a, uintptr_t base, size_t size, struct bfc__segment *seg, bool used,
                        bool large, bool vmm, struct bfc__region **out)
{
    const struct bfc__arena_env *env = a->env;
    struct bfc__region *r = bfc__meta_zalloc(sizeof(*r));
    struct bfc__chunk *c = bfc__arena_chunk_new(a);
    if (!r || !c)
        goto nomem;
    r->base = base;
    r->size = size;
    r->tag = env->tag;
    r->owner = a;
    r->seg = seg;
    r->large = large;
    r->vmm = vmm;
    r->nhandles = large ? 1 : size >> BFC__MIN_ALLOC_BITS;
    size_t hb = r->nhandles * sizeof(r->handles[0]);
    if (hb >= 64 * BFC__KiB) {
        /* Proportional to device memory: mapped so that only the pages
         * holding chunk starts are ever committed. */
        void *m = mmap(NULL, hb, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED)
            goto nomem;
        r->handles = m;
        r->handles_bytes = hb;
    } else {
        r->handles = bfc__meta_zalloc(hb);
        if (!r->handles)
            goto nomem;
    }
    c->ptr = base;
    c->link.prio = bfc__bins_prio(base);
    c->size = size;
    c->region = r;
    /* Taken back under our own departure fence: our queued work may still
     * use it, so it must be fenced again when it leaves. */
    c->flags = used ? BFC__CF_USED : 0;
    r->tail = c;
    r->used_end = used ? base + size : base;
    bfc__region_set_handle(r, base, c);
    if (bfc__regionmap_insert(r) != BFC_OK)
        goto nomem;
    cds_list_add(&r->alink, &a->regions);
    a->st.num_regions++;
    a->span += size;
    /* An expandable arena's reserved bytes are its mapped granules. */
    if (!vmm) {
        a->st.bytes_reserved += size;
        if (a->st.bytes_reserved > a->st.peak_reserved)
            a->st.peak_reserved = a->st.bytes_reserved;
        if (env->poison)
            memset((void *)base, 0xDB, size);
    }
    if (!large)
        bfc__bins_insert(&a->bins, c);
    if (bfc__tracing(env->obs) && !vmm)
        bfc__trace_event(env->obs, BFC__TR_GROW, base, size, a->stream);
    *out = r;
    return BFC_OK;
nomem:
    if (c)
        chunk_delete(a, c);
    if (r) {
        handles_free(r);
        bfc__meta_free(r, sizeof(*r));
    }
    return BFC_ENOMEM;
}

static int region_new(struct bfc__arena *a, size_t size, bool large, struct bfc__region **out)
{
    struct bfc__pool *pool = a->env->pool;
    struct bfc__pool_ticket t;
    uintptr_t base;
    struct bfc__segment *seg;
    bool used;
    if (bfc__pool_ticket_get(pool, &t) != BFC_OK)
        return BFC_ENOMEM;
    int st = bfc__pool_get(pool, size, a->stream_id, &base, &seg, &used, NULL);
    if (st != BFC_OK) {
        bfc__pool_ticket_put(pool, &t);
        return st;
    }
    st = region_setup(a, base, size, seg, used, large, false, out);
    if (st != BFC_OK) {
        bfc__pool_put(pool, base, size, seg, used, a->stream, a->stream_id, &t);
        return st;
    }
    (*out)->ticket = t;
    return BFC_OK;
}

int bfc__arena_expand_locked(struct bfc__arena *a, size_t need)
{
    /* The region's handle table (a 32nd of its range, in addresses) can be
     * refused where the reservation was not -- under RLIMIT_AS a range of
     * twice the limit fits, its table not -- so the next smaller
     * reservation is tried then, down to the one `need` takes; not for an
     * adopted one (mapped: it departs again as it came). */
    size_t g = a->env->be->vmm_granule, min = bfc__round_up(need ? need : 1, g);
    for (size_t most = SIZE_MAX;;) {
        int st = bfc__expand_create_locked(a, need, most);
        if (st != BFC_OK)
            return st;
        size_t got = a->x->size;
        bool adopted = a->x->mapped_bytes != 0;
        st = region_setup(a, a->x->base, got, NULL, false, false, true, &a->x->region);
        if (st == BFC_OK)
            return BFC_OK;
        bfc__expand_destroy_locked(a);
        if (st != BFC_ENOMEM || adopted || got <= min)
            return st;
        most = got - g;
    }
}

static size_t initial_region_bytes(const struct bfc__arena_env *env)
{
    /* allow_growth=false: TensorFlow's layout, one region of everything. */
    size_t init = !env->allow_growth                ? env->limit
                  : env->initial_region < env->limit ? env->initial_region
                                                     : env->limit;
    size_t r = bfc__round256(init);
    return r ? r : BFC__MIN_ALLOC;
}

/*
 * Departing memory [base, base + size) of r, fenced (`used`) as far as
 * blocks were ever handed out from it (region.h, used_end).  unused_above
 * says how much of its end was never used -- 0 when it was all used, or
 * when no second ticket *t2 can be had for that part (then all of it is
 * fenced, as before) -- and depart_span gives the two parts to the pool.
 * So another stream may take the never-used part while ours is busy
 * (allow_growth=false: a stream that used 31, or 1, of its region's 64 MiB
 * and is still running no longer fences all of its free memory).
 */
static size_t unused_above(struct bfc__arena *a, const struct bfc__region *r, uintptr_t base, size_t size,
                           bool used, struct bfc__pool_ticket *t2)
{
    if (!used || r->vmm || r->large || r->used_end <= base || r->used_end >= base + size)
        return 0;
    return bfc__pool_ticket_get(a->env->pool, t2) == BFC_OK ? base + size - r->used_end : 0;
}

static void depart_span(struct bfc__arena *a, const struct bfc__region *r, uintptr_t base, size_t size, bool used,
                        size_t unused, struct bfc__pool_ticket *t, struct bfc__pool_ticket *t2)
{
    bfc__pool_put(a->env->pool, base, size - unused, r->seg, used, a->stream, a->stream_id, t);
    if (unused)
        bfc__pool_put(a->env->pool, base + size - unused, unused, r->seg, false, a->stream, a->stream_id, t2);
}

/*
 * Gives a fully free region back to the pool.  With `fence`, fenced on our
 * stream if any of it was used (fence.h), and only as far as it was
 * (unused_above); only context teardown, which returns everything to the
 * backend, passes false.
 */
void bfc__arena_region_depart(struct bfc__arena *a, struct bfc__region *r, bool fence)
{
    struct bfc__chunk *c = bfc__region_handle(r, r->base);
    bool used = fence && (c->flags & BFC__CF_USED);
    struct bfc__pool_ticket t2;
    size_t unused = unused_above(a, r, r->base, r->size, used, &t2);
    if (c->link.slot != BFC__NO_SLOT)
        bfc__bins_remove(&a->bins, c);
    bfc__region_set_handle(r, r->base, NULL);
    chunk_delete(a, c);
    cds_list_del(&r->alink);
    r->gone = true;
    r->tail = NULL;
    a->st.num_regions--;
    a->span -= r->size;
    if (!r->vmm)
        a->st.bytes_reserved -= r->size;
    if (bfc__tracing(a->env->obs) && !r->vmm)
        bfc__trace_event(a->env->obs, BFC__TR_RELEASE, r->base, r->size, a->stream);
    /* An arena that holds nothing any more starts its schedule afresh:
     * TensorFlow never gives regions back (bar GC), but a shard trimmed
     * and re-grown many times would otherwise take ever larger regions --
     * eventually the whole limit for one small block, starving the other
     * shards.  The shard's own garbage collection keeps the schedule, as
     * TensorFlow's does (ctx.c, shed_own). */
    if (cds_list_empty(&a->regions))
        a->curr_region_bytes = initial_region_bytes(a->env);
    /* Out of the map first: no lookup may find r once another shard can
     * be handed the memory. */
    bfc__regionmap_remove(r, used);
    if (r->vmm) /* expandable arena: its reservation goes (expand.c) */
        bfc__expand_depart_locked(a, fence);
    else
        depart_span(a, r, r->base, r->size, used, unused, &r->ticket, &t2);
    bfc__call_rcu(&r->rcu, region_free_cb);
}

static bool has_free_tail(struct bfc__region *r)
{
    struct bfc__chunk *c = r->tail;
    return !r->large && !r->vmm && r->live != 0 && atomic_load_explicit(&c->state, memory_order_relaxed) == BFC__CHUNK_FREE &&
           c->ptr != r->base;
}

/*
 * Gives the free tail of a region still in use back to the pool: the region
 * shrinks to end at its last live chunk.  This is how memory a shard holds
 * but does not use reaches other shards without a fully free region (with
 * allow_growth=false the first shard holds one region of the whole limit).
 * Returns the bytes given back (0 when there is no free tail or no record
 * for the departure could be reserved).
 */
static size_t region_shed_tail(struct bfc__arena *a, struct bfc__region *r)
{
    struct bfc__chunk *c = r->tail;
    if (!has_free_tail(r))
        return 0;
    struct bfc__pool_ticket t, t2;
    if (bfc__pool_ticket_get(a->env->pool, &t) != BFC_OK)
        return 0;
    uintptr_t base = c->ptr;
    size_t size = c->size;
    bool used = c->flags & BFC__CF_USED;
    size_t unused = unused_above(a, r, base, size, used, &t2);
    bfc__bins_remove(&a->bins, c);
    r->tail = c->prev;
    c->prev->next = NULL;
    bfc__region_set_handle(r, base, NULL);
    chunk_delete(a, c);
    r->size -= size;
    a->span -= size;
    a->st.bytes_reserved -= size;
    if (bfc__tracing(a->env->obs))
        bfc__trace_event(a->env->obs, BFC__TR_RELEASE, base, size, a->stream);
    if (r->used_end > base)
        r->used_end = base;
    bfc__regionmap_shrink(r, used);
    depart_span(a, r, base, size, used, unused, &t, &t2);
    return size;
}

size_t bfc__arena_tails_locked(struct bfc__arena *a, struct bfc__range *out, size_t max)
{
    size_t n = 0;
    struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink) {
        if (n >= max)
            break;
        if (has_free_tail(r))
            out[n++] = (struct bfc__range){ r->tail->ptr, r->tail->size, r->seg };
        else if (r->live == 0 && !r->large && !r->vmm)
            out[n++] = (struct bfc__range){ r->base, r->size, r->seg };
    }
    return n;
}

size_t bfc__arena_shed_locked(struct bfc__arena *a, bool tails)
{
    size_t freed = 0;
    struct bfc__region *r;
    bfc__list_for_each_safe(r, &a->regions, alink) {
        /* A fully free expandable arena gives its whole reservation back
         * (fenced); one in use, its free granules. */
        if (r->live == 0) {
            freed += r->vmm ? a->x->mapped_bytes : r->size;
            bfc__arena_region_depart(a, r, true);
        } else if (r->vmm) {
            freed += bfc__expand_release_locked(a, 0);
        } else if (tails) {
            freed += region_shed_tail(a, r);
        }
    }
    return freed;
}

size_t bfc__arena_idle_region_bytes(const struct bfc__arena *a)
{
    size_t idle = 0;
    const struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink)
        if (r->live == 0 && !r->vmm)
            idle += r->size;
    return idle;
}

size_t bfc__arena_largest_idle_run(struct bfc__arena *a)
{
    size_t best = 0;
    struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink) {
        size_t run = 0;
        for (struct bfc__chunk *c = bfc__region_handle(r, r->base); c; c = c->next) {
            run = bfc__chunk_idle(c) ? run + c->size : 0;
            if (run > best)
                best = run;
        }
    }
    return best;
}

/* ------------------------------------------------------------- chunks */

/*
 * poison=true (host-accessible memory only): every byte of a free chunk is
 * 0xDB -- regions are filled when created, blocks when released, and merges
 * join filled chunks -- so a byte that differs when the chunk is handed out
 * again was written after its free.  Counted per context (stats
 * num_poison_errors) and reported on stderr once per context; the block is
 * still handed out (a debugging aid, not a fence).
 */
__attribute__((noinline, cold)) void bfc__arena_poison_verify(struct bfc__arena *a, struct bfc__chunk *c)
{
    const unsigned char *m = (const unsigned char *)c->ptr;
    size_t i = 0;
    while (i < c->size && m[i] == 0xDB)
        i++;
    if (i == c->size)
        return;
    /* relaxed: a statistic; the first increment also elects the reporter. */
    if (atomic_fetch_add_explicit(a->env->poison_errors, 1, memory_order_relaxed) == 0) {
        int cs = bfc__nocancel_begin(); /* under a->lock (mutex.h) */
        fprintf(stderr,
                "libshardbfc: poison: block %#lx (size %zu) was written after free "
                "(byte %zu is %#x, expected 0xdb); further reports counted in stats only\n",
                (unsigned long)c->ptr, c->size, i, (unsigned)m[i]);
        bfc__nocancel_end(cs);
    }
}

/* Expandable arena: the granules under a block about to be handed out are
 * mapped first.  NULL when they cannot be (c back in the bins). */
__attribute__((noinline)) struct bfc__chunk *bfc__arena_take_vmm(struct bfc__arena *a, struct bfc__chunk *c,
                                                                 size_t rounded)
{
    bool cut = bfc__arena_should_split(a, c, rounded);
    size_t keep = cut ? rounded : c->size;
    /* Granules not mapped are no internal fragmentation: a leftover that
     * has some is cut off rather than mapped for the block. */
    if (!cut && keep > rounded &&
        (!bfc__expand_ready(a->x, c->ptr + rounded, keep - rounded) ||
         bfc__expand_spared_leftover(a->x, c->ptr, c->size, rounded))) {
        cut = true;
        keep = rounded;
    }
    if (!bfc__expand_ready(a->x, c->ptr, keep) && bfc__expand_make_ready_locked(a, c->ptr, keep) != BFC_OK)
        return NULL;
    if (c->link.slot != BFC__NO_SLOT)
        bfc__bins_remove(&a->bins, c);
    if (cut && !bfc__arena_split(a, c, rounded) && !bfc__expand_ready(a->x, c->ptr, c->size) &&
        bfc__expand_make_ready_locked(a, c->ptr, c->size) != BFC_OK) {
        bfc__bins_insert(&a->bins, c);
        return NULL;
    }
    return c;
}

/* Blocks from one counter of the context: ids of different shards never
 * meet, each shard's increase, and 2^63 allocations pass before the first
 * wraps; the counter is written once per BFC__ID_BLOCK allocations of a
 * shard, so threads on different streams do not share a line per call (a
 * shard's creation order in the top bits, as before, bounded a shard to
 * 2^40 ids: 13 days at a million allocations a second). */
__attribute__((noinline, cold)) void bfc__arena_ids_refill(struct bfc__arena *a)
{
    /* relaxed: only uniqueness matters, which the add gives. */
    uint64_t base = atomic_fetch_add_explicit(a->env->alloc_ids, BFC__ID_BLOCK, memory_order_relaxed);
    a->next_id = (int64_t)(base + 1);
    a->id_end = (int64_t)(base + 1 + BFC__ID_BLOCK);
}

/* bfc__arena_take_inline, called: the paths other than the fast path. */
static __attribute__((noinline)) void *take_chunk(struct bfc__arena *a, struct bfc__chunk *c, size_t rounded,
                                                  size_t n)
{
    return bfc__arena_take_inline(a, c, rounded, n);
}

void bfc__arena_merge(struct bfc__arena *a, struct bfc__chunk *c, struct bfc__chunk *n)
{
    c->size += n->size;
    c->flags |= n->flags & BFC__CF_USED;
    c->next = n->next;
    if (n->next)
        n->next->prev = c;
    else
        c->region->tail = c;
    bfc__region_set_handle(c->region, n->ptr, (n->flags & BFC__CF_RETURNED) ? BFC__HANDLE_GONE : NULL);
    chunk_delete(a, n);
}

/* What a release leaves beyond the bins, once bfc__arena_release_followup_due
 * said there is something: a retired shard's empty region departs, else the
 * expandable arena's decay is due. */
void bfc__arena_release_followup(struct bfc__arena *a, struct bfc__region *r)
{
    if (r->live == 0 && atomic_load_explicit(&a->retired, memory_order_relaxed))
        bfc__arena_region_depart(a, r, true);
    else
        bfc__expand_after_free_locked(a);
}

/* bfc__arena_release_inline, called: fenced and remote frees. */
static __attribute__((noinline)) void release_chunk(struct bfc__arena *a, struct bfc__chunk *c)
{
    bfc__arena_release_inline(a, c);
}

/* ------------------------------------------------------------- fences */

/* A fenced free's block is reusable now (trace.c).  Before release_chunk,
 * which clears requested and may merge c away. */
static __attribute__((noinline, cold)) void trace_free_complete(struct bfc__arena *a, struct bfc__chunk *c)
{
    bfc__trace_event(a->env->obs, BFC__TR_FREE_COMPLETE, c->ptr, c->requested, a->stream);
}

/* Not inlined: its list update would cost the same-stream free, which
 * reaches it only for blocks with recorded streams, registers on every call. */
static __attribute__((noinline)) void pending_append(struct bfc__arena *a, struct bfc__fence *f)
{
    cds_list_add_tail(&f->plink, &a->pending);
    atomic_store_explicit(&f->chunk->state, BFC__CHUNK_PENDING, memory_order_relaxed);
    a->st.pending++;
    a->st.pending_bytes += f->chunk->size;
}

static void pending_unlink(struct bfc__arena *a, struct bfc__fence *f)
{
    cds_list_del(&f->plink);
    a->st.pending--;
    a->st.pending_bytes -= f->chunk->size;
}

/* Records an event on every stream named by record_stream for c (except the
 * owner's own stream), appended to the chain *chain.  The recorded list is
 * consumed; each entry brought the fence record it needs, so this cannot
 * fail.  It runs at the free: under the owner's lock in a same-stream free,
 * and in a cross-stream free by the freeing thread, which tries that lock
 * for it (remote.c; when it is held, the owner runs this as it takes the
 * block).  Later is never too early, but too late: the block waits for
 * work those streams took on after the free. */
void bfc__arena_fence_recorded_locked(struct bfc__arena *a, struct bfc__chunk *c, struct bfc__fence **chain)
{
    /* A load, and a store only when there are records: bfc_ctx_record_stream
     * adds them under the owner's lock, which we hold, so no exchange is
     * needed -- and a locked exchange on the chunk record, whose line a
     * cross-stream freer has just read, waited for the line to be taken
     * from the freer's core on every remote free the owner drained.
     * acquire: pairs with the release store in record_fn (ctx.c). */
    struct bfc__recorded *rs = atomic_load_explicit((struct bfc__recorded *_Atomic *)&c->recorded,
                                                    memory_order_acquire);
    if (BFC__LIKELY(rs == NULL))
        return;
    atomic_store_explicit((struct bfc__recorded *_Atomic *)&c->recorded, NULL, memory_order_relaxed);
    while (rs) {
        struct bfc__recorded *next = rs->next;
        struct bfc__fence *f = rs->fence;
        if (rs->id != a->stream_id) {
            bfc__fence_arm(a->env->be, f, rs->stream, rs->id);
            f->chunk = c;
            f->extra = *chain;
            *chain = f;
        } else {
            bfc__arena_fence_put(a, f);
        }
        bfc__meta_free(rs, sizeof(*rs));
        rs = next;
    }
}

/* The fences of c (chain f) have completed: the records go back to the
 * pool and the block to the bins. */
static void fenced_free_done(struct bfc__arena *a, struct bfc__fence *f, struct bfc__chunk *c)
{
    bfc__arena_fence_put(a, f);
    if (bfc__tracing(a->env->obs))
        trace_free_complete(a, c);
    release_chunk(a, c);
}

__attribute__((noinline)) void bfc__arena_free_recorded_locked(struct bfc__arena *a, struct bfc__chunk *c)
{
    struct bfc__fence *chain = NULL;
    bfc__arena_fence_recorded_locked(a, c, &chain);
    if (!chain) { /* every stream recorded was our own */
        release_chunk(a, c);
    } else if (bfc__fence_query(a->env->be, chain) == BFC_OK) {
        fenced_free_done(a, chain, c);
    } else {
        chain->chunk = c;
        pending_append(a, chain);
    }
}

/*
 * Stuck streams.  Events recorded on one stream complete in the order they
 * were recorded, so once a drain has found a stream's fence in flight, the
 * stream's later fences are too, and the drain does not ask the device
 * about them (a cudaEventQuery each): the slow path's full drain walked
 * every pending fence with a query, so a large allocation of a shard cost
 * time in proportion to what another stream, still busy, had freed into it
 * (100,000 pending fences: 1.1 ms on SIM per allocation, a query each on a
 * GPU).  A drain remembers up to STUCK_MAX streams.  Only the fences of
 * cross-stream frees carry their stream's id (f->sid, fence.h): the
 * freeing thread records the event and then queues the fence, so one
 * thread's fences on a stream reach the pending list in the order their
 * events were recorded, and a later one is in flight when an earlier one
 * is.  record_stream's fences are armed at other moments (at a local
 * free, appended at once while an older cross-stream free of the same
 * stream may still wait in the queue; at the drain that takes a block):
 * they neither mark nor are skipped.  A cross-stream free's fence chained
 * with some may be skipped (its own event is in flight then) but does not
 * mark its stream (the chain's other events may be what is in flight).
 * A skip is never early: at worst it is late, where two threads
 * freed on one stream at once and their fences arrived in the other order
 * than recorded.
 */
#define STUCK_MAX 8

struct stuck {
    unsigned n;
    uint64_t sid[STUCK_MAX];
};

/* Has f completed?  Asks the device unless f's stream is known stuck. */
static inline __attribute__((always_inline)) bool fence_done(struct bfc__arena *a, struct bfc__fence *f,
                                                              struct stuck *k)
{
    if (f->sid) {
        for (unsigned i = 0; i < k->n; i++)
            if (k->sid[i] == f->sid)
                return false;
    }
    if (bfc__fence_query(a->env->be, f) == BFC_OK)
        return true;
    if (f->sid && !f->extra && k->n < STUCK_MAX)
        k->sid[k->n++] = f->sid;
    return false;
}

/* A remote free taken off the queue: fenced, or back in the bins. */
static void remote_arrived(struct bfc__arena *a, struct bfc__fence *f, struct stuck *k)
{
    /* acquire: pairs with the release in bfc__remote_free. */
    (void)atomic_load_explicit(&f->handoff, memory_order_acquire);
    struct bfc__chunk *c = f->chunk;
    bfc__arena_account_free(a, c);
    a->st.remote_frees++;
    /* The freer armed the recorded streams' fences at the free (remote.c)
     * unless it found the owner's lock held; this takes those, and a record
     * a racing bfc_ctx_record_stream added after its look (the caller's own
     * race): fenced late, never early. */
    bfc__arena_fence_recorded_locked(a, c, &f->extra);
    if (fence_done(a, f, k))
        fenced_free_done(a, f, c);
    else
        pending_append(a, f);
}

/*
 * Takes the remote frees off the queue without ever waiting for a freer.
 * A wait-free enqueue is two stores: swap the tail, then link the old tail
 * to the new node; between them the chain stops short.  liburcu's blocking
 * splice and walk wait for the link by spinning ten times and then sleeping
 * 10 ms in poll() -- on a busy machine, dozens of times a second, each a
 * 10 ms stall of the allocating thread.  Here the queue is spliced (only
 * when its first link is there) behind the stash, and the stash is handled
 * up to the first node whose successor link is still missing; that node
 * stays first in the stash for the next drain (it cannot be handled yet:
 * handling recycles its record, into which the freer is about to write).
 */
static void drain_remote(struct bfc__arena *a, struct stuck *k)
{
    if (!bfc__arena_rq_empty(a))
        (void)__cds_wfcq_splice_nonblocking(&a->rq_stash_head, &a->rq_stash_tail, &a->rq_head, &a->rq_tail);
    struct cds_wfcq_node *node = __cds_wfcq_first_nonblocking(&a->rq_stash_head, &a->rq_stash_tail);
    if (node == CDS_WFCQ_WOULDBLOCK)
        return; /* cannot be: the stash's first link is always ours */
    while (node) {
        struct cds_wfcq_node *next = __cds_wfcq_next_nonblocking(&a->rq_stash_head, &a->rq_stash_tail, node);
        if (next == CDS_WFCQ_WOULDBLOCK)
            break;
        remote_arrived(a, caa_container_of(node, struct bfc__fence, qnode), k);
        node = next;
    }
    if (node)
        a->rq_stash_head.node.next = node;
    else
        __cds_wfcq_init(&a->rq_stash_head, &a->rq_stash_tail);
}

void bfc__arena_drain_locked(struct bfc__arena *a, bool full)
{
    struct stuck k;
    k.n = 0; /* the ids are written before they are read */
    /* The pending fences first: they are older than the queue's, so a
     * stream found stuck among them is skipped in the queue (and the
     * queue's fences still in flight, appended to the list, are not asked
     * about twice). */
    struct bfc__fence *f;
    bfc__list_for_each_safe(f, &a->pending, plink) {
        if (fence_done(a, f, &k)) {
            pending_unlink(a, f);
            fenced_free_done(a, f, f->chunk);
        } else if (!full) {
            /* Fences complete roughly in the order they were queued: the
             * cheap poll stops at the first one still in flight. */
            break;
        }
    }
    if (bfc__arena_rq_waiting(a))
        drain_remote(a, &k);
}

void bfc__arena_wait_pending_locked(struct bfc__arena *a, uint32_t timeout_ms)
{
    struct bfc__fence *f;
    if (timeout_ms)
        bfc__list_for_each(f, &a->pending, plink)
            bfc__fence_wait(a->env->be, f, timeout_ms);
    bfc__arena_drain_locked(a, true);
}

/* ----------------------------------------------------------- extension */

/* Doubles the next region size.  Once it covers the limit it stays: every
 * region is min(curr, available) <= limit anyway, and a context whose regions
 * are trimmed and re-taken forever must not double its way to overflow.
 * Where doubling would overflow (a limit above SIZE_MAX / 2) it takes the
 * limit, which the same min makes equivalent: extend's loop, which doubles
 * until the region covers a request no larger than the limit, must end. */
static void grow_schedule(struct bfc__arena *a)
{
    if (a->curr_region_bytes < a->env->limit)
        a->curr_region_bytes = a->curr_region_bytes <= SIZE_MAX / 2 ? 2 * a->curr_region_bytes : a->env->limit;
}

/* TensorFlow's Extend, per arena. */
static int extend(struct bfc__arena *a, size_t rounded)
{
    const struct bfc__arena_env *env = a->env;
    size_t committed = atomic_load_explicit(&env->pool->committed, memory_order_relaxed);
    size_t available = committed < env->limit ? (env->limit - committed) & ~(BFC__MIN_ALLOC - 1) : 0;
    if (rounded > available)
        return BFC_ENOMEM;
    bool grew = false;
    while (rounded > a->curr_region_bytes) {
        grow_schedule(a);
        grew = true;
    }
    size_t size = a->curr_region_bytes < available ? a->curr_region_bytes : available;
    /* Several shards share the limit: TensorFlow's schedule assumes one
     * allocator per device, and left alone one busy shard doubles its way to
     * regions that hold everything while little of it is live, starving the
     * next stream.  So while other shards exist a new region takes at most
     * half of what remains (never less than the request), in whole
     * multiples of the request: a stream whose blocks are all of one size
     * fills it to the end, leaving no piece between it and the rest (64
     * streams of 1 MiB in a 64 MiB limit, allow_growth=false: six were
     * refused, the pool's 6 MiB in pieces of 0.94 MiB between regions of
     * 31.5, 15.75, ... MiB).  One shard alone behaves exactly like
     * TensorFlow.  relaxed: an estimate is enough. */
    bool shared = atomic_load_explicit(env->shards_live, memory_order_relaxed) > 1;
    if (shared && size > available / 2) {
        size_t half = (available / 2) & ~(BFC__MIN_ALLOC - 1);
        size = half > rounded ? half - half % rounded : rounded;
    }
    /* Memory the pool already holds before new memory: a region the pool
     * has no run for would come from the backend, while runs that other
     * shards gave up -- a released stream's or an exited host thread's
     * region tails, kept apart by the live blocks their shards still
     * hold -- could serve the request.  The region is then the largest such
     * run, and the schedule does not double for it (a run of the pool is
     * no step of this arena's growth).  Each host thread that exited with a
     * 3 KB block live cost a new 2 MiB region before: 400 MiB of pinned
     * memory for 200 such threads, 600 KB live.  Only where shards share
     * the context, now or before this one: the context's first shard,
     * alone, keeps TensorFlow's Extend exactly, garbage collection
     * included (its regions shed into the pool make room for a region of
     * the schedule's size, as TensorFlow's freed regions do). */
    bool from_pool = false;
    if (env->allow_growth && (shared || a->seq != 0)) {
        size_t held = bfc__pool_largest_held(env->pool, a->stream_id);
        if (held >= rounded && held < size) {
            size = held;
            from_pool = true;
        }
    }
    /* With other shards, a region the split rule would hand to this one
     * block whole (less than twice it, the leftover under max_frag) is cut
     * to the block, at every step below too: near the limit the rest is
     * what the next stream needs (64 streams of 1 MiB each in a 64 MiB
     * limit, allow_growth=false: eleven were refused, their memory gone to
     * regions of 1.63 MiB given whole). */
    if (shared && size < 2 * rounded && size - rounded < env->max_frag)
        size = rounded;
    struct bfc__region *r;
    /* Each refusal shrinks by 0.9x; when rounding would undo the shrink we
     * step down by one granule, so the loop ends within a bounded number of
     * backend calls (at most (size - rounded)/256 + 1, in practice ~log).
     * TensorFlow's device takes any size below what it has free, so its
     * steps find one; the pool's free memory is in pieces, so the step
     * after a refusal never passes the largest region the pool could give
     * (else a 3.35 MiB span is skipped by the steps 3.51 and 3.16 MiB for
     * a 3.23 MiB request: out of memory while the pool holds a fitting
     * piece), and the loop stops when that is below the request. */
    for (;;) {
        int st = region_new(a, size, false, &r);
        if (st == BFC_OK)
            break;
        if (st != BFC_ENOMEM)
            return st;
        size_t next = bfc__round256(size / 10 * 9);
        if (next >= size)
            next = size - BFC__MIN_ALLOC;
        size_t most = bfc__pool_largest(env->pool, a->stream_id);
        if (next > most)
            next = most;
        if (next < rounded)
            return BFC_ENOMEM; /* no step could be served */
        if (shared && next < 2 * rounded && next - rounded < env->max_frag)
            next = rounded;
        size = next;
    }
    if (!grew && !from_pool)
        grow_schedule(a);
    return BFC_OK;
}

static void *alloc_large(struct bfc__arena *a, size_t n, size_t rounded, int *status)
{
    const struct bfc__arena_env *env = a->env;
    size_t size = bfc__round_up(rounded, 2 * BFC__MiB);
    size_t committed = atomic_load_explicit(&env->pool->committed, memory_order_relaxed);
    size_t available = committed < env->limit ? (env->limit - committed) & ~(BFC__MIN_ALLOC - 1) : 0;
    if (size == 0 || size > available)
        size = rounded; /* the 2 MiB rounding must not turn a fitting request into an OOM */
    struct bfc__region *r;
    int st = region_new(a, size, true, &r);
    if (st == BFC_ENOMEM && size > rounded) {
        /* The pool's free memory may hold the request in a piece smaller
         * than its 2 MiB rounding. */
        size = rounded;
        st = region_new(a, size, true, &r);
    }
    if (st != BFC_OK) {
        *status = st;
        return NULL;
    }
    return take_chunk(a, bfc__region_handle(r, r->base), size, n);
}

void *bfc__arena_fit_locked(struct bfc__arena *a, size_t n, size_t rounded)
{
    struct bfc__chunk *c = bfc__bins_best_fit(&a->bins, rounded);
    return c ? take_chunk(a, c, rounded, n) : NULL;
}

void *bfc__arena_fit_mapped_locked(struct bfc__arena *a, size_t n, size_t rounded)
{
    struct bfc__chunk *c = a->x ? bfc__expand_mapped_fit(a, rounded) : NULL;
    return c ? take_chunk(a, c, rounded, n) : NULL;
}

void *bfc__arena_grow_locked(struct bfc__arena *a, size_t n, size_t rounded, bool large, int *status)
{
    if (large)
        return alloc_large(a, n, rounded, status);
    int st = extend(a, rounded);
    if (st != BFC_OK) {
        *status = st;
        return NULL;
    }
    return bfc__arena_fit_locked(a, n, rounded);
}

/* ---------------------------------------------------------- lifecycle */

struct bfc__arena *bfc__arena_new(const struct bfc__arena_env *env, bfc_stream_t s, uint64_t sid)
{
    struct bfc__arena *a = bfc__meta_aligned_alloc(alignof(struct bfc__arena), sizeof(*a));
    if (!a)
        return NULL;
    memset(a, 0, sizeof(*a));
    if (bfc__mutex_init(&a->lock, BFC__RANK_ARENA, "an arena") != 0) {
        bfc__meta_free(a, sizeof(*a));
        return NULL;
    }
    if (bfc__mutex_init(&a->fpool_lock, BFC__RANK_FENCE_POOL, "an arena's fence pool") != 0) {
        bfc__mutex_destroy(&a->lock);
        bfc__meta_free(a, sizeof(*a));
        return NULL;
    }
    a->env = env;
    a->stream = s;
    a->stream_key = s == BFC__STREAM_PER_THREAD ? BFC__PER_THREAD_KEY : s;
    a->stream_id = sid;
    bfc__bins_init(&a->bins);
    bfc__slab_init(&a->chunk_slab, sizeof(struct bfc__chunk));
    a->curr_region_bytes = initial_region_bytes(env);
    a->next_id = a->id_end = 0; /* the first allocation takes a block */
    CDS_INIT_LIST_HEAD(&a->regions);
    CDS_INIT_LIST_HEAD(&a->pending);
    cds_wfcq_init(&a->rq_head, &a->rq_tail);
    __cds_wfcq_init(&a->rq_stash_head, &a->rq_stash_tail);
    __cds_wfcq_init(&a->fpool_head, &a->fpool_tail);
    cds_lfht_node_init(&a->dir_node);
    return a;
}

/* A chunk's record_stream list and the fence records it holds (teardown). */
static void recorded_discard(struct bfc__arena *a, struct bfc__chunk *c)
{
    struct bfc__recorded *rs = c->recorded;
    while (rs) {
        struct bfc__recorded *x = rs->next;
        bfc__arena_fence_put(a, rs->fence);
        bfc__meta_free(rs, sizeof(*rs));
        rs = x;
    }
    c->recorded = NULL;
}

void bfc__arena_free(struct bfc__arena *a)
{
    /* Teardown path (context destroy, or an arena reclaimed after its
     * grace period): whatever is left goes, every fence record back to the
     * fence pool first so that bfc__arena_fence_pool_destroy frees them all. */
    if (bfc__arena_rq_waiting(a)) {
        struct cds_wfcq_node *node, *next;
        /* Blocking: at teardown every freer has finished its enqueue (its
         * links are written, or about to be: waiting for them is right). */
        (void)__cds_wfcq_splice_blocking(&a->rq_stash_head, &a->rq_stash_tail, &a->rq_head, &a->rq_tail);
        __cds_wfcq_for_each_blocking_safe(&a->rq_stash_head, &a->rq_stash_tail, node, next)
        {
            struct bfc__fence *f = caa_container_of(node, struct bfc__fence, qnode);
            /* acquire: pairs with the release in bfc__remote_free. */
            (void)atomic_load_explicit(&f->handoff, memory_order_acquire);
            bfc__arena_fence_put(a, f);
        }
    }
    while (!cds_list_empty(&a->pending)) {
        struct bfc__fence *f = cds_list_first_entry(&a->pending, struct bfc__fence, plink);
        pending_unlink(a, f);
        bfc__arena_fence_put(a, f);
    }
    while (!cds_list_empty(&a->regions)) {
        struct bfc__region *r = cds_list_first_entry(&a->regions, struct bfc__region, alink);
        /* Free every chunk record of the region but the first, then the
         * region itself (bfc__arena_region_depart deletes the first). */
        struct bfc__chunk *c = bfc__region_handle(r, r->base);
        if (c) {
            struct bfc__chunk *n = c->next;
            while (n) {
                struct bfc__chunk *nn = n->next;
                recorded_discard(a, n);
                chunk_delete(a, n);
                n = nn;
            }
            c->next = NULL;
            recorded_discard(a, c);
        }
        bfc__bins_init(&a->bins);
        if (c)
            c->link.slot = BFC__NO_SLOT;
        r->live = 0;
        bfc__arena_region_depart(a, r, false);
    }
    bfc__arena_fence_pool_destroy(a);
    bfc__slab_destroy(&a->chunk_slab);
    bfc__mutex_destroy(&a->lock);
    bfc__mutex_destroy(&a->fpool_lock);
    cds_wfcq_destroy(&a->rq_head, &a->rq_tail);
    bfc__meta_free(a, sizeof(*a));
}

bool bfc__arena_maybe_dead_slow(struct bfc__arena *a)
{
    if (a->dead)
        return false;
    bfc__arena_drain_locked(a, true);
    if (a->live != 0 || !cds_list_empty(&a->pending))
        return false;
    bfc__arena_shed_locked(a, false);
    a->dead = true;
    return true;
}

/* ------------------------------------------------------- validation */

int bfc__arena_classify_locked(struct bfc__arena *a, struct bfc__region *r, uintptr_t p,
                               struct bfc__chunk **out)
{
    *out = NULL;
    if (p & (BFC__MIN_ALLOC - 1))
        return BFC_ENOTOWNED;
    if (a->dead || r->gone) {
        /* The region left the map after the caller's lookup found it: its
         * blocks were all freed, and it is classified as a lookup now
         * would (regionmap.h, departed memory). */
        return bfc__regionmap_gone(p, r->tag, NULL);
    }
    struct bfc__chunk *c = bfc__region_handle(r, p);
    if (bfc__chunk_at(c, r, p)) {
        uint32_t s = atomic_load_explicit(&c->state, memory_order_acquire);
        if (s == BFC__CHUNK_INUSE) {
            *out = c;
            return BFC_OK;
        }
        return (c->flags & BFC__CF_RETURNED) ? BFC_EDOUBLEFREE : BFC_ENOTOWNED;
    }
    if (c == BFC__HANDLE_GONE) {
        /* A block started here once and was merged away: a second free,
         * unless the address now lies inside a live block. */
        struct bfc__chunk *in = bfc__region_find_containing(r, p);
        if (in && atomic_load_explicit(&in->state, memory_order_acquire) != BFC__CHUNK_INUSE)
            return BFC_EDOUBLEFREE;
    }
    return BFC_ENOTOWNED;
}

/* ------------------------------------------------------------- checks */

int bfc__arena_check_locked(struct bfc__arena *a, char *buf, size_t len)
{
    uint64_t in_use = 0, requested = 0, reserved = 0, regions = 0, pending = 0, pending_bytes = 0;
    uint64_t free_chunks = 0, free_bytes = 0, chunks = 0, live = 0, span = 0;
    struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink) {
        regions++;
        span += r->size;
        reserved += r->vmm ? a->x->mapped_bytes : r->size;
        struct bfc__chunk *c = bfc__region_handle(r, r->base);
        uintptr_t expect = r->base;
        struct bfc__chunk *prev = NULL;
        size_t rlive = 0;
        if (r->owner != a || r->gone) {
            snprintf(buf, len, "invariant 6: region %#lx listed by shard %lu is owned elsewhere",
                     (unsigned long)r->base, (unsigned long)a->stream_id);
            return -1;
        }
        if (bfc__regionmap_lookup(r->base) != r) {
            snprintf(buf, len, "invariant 5: region %#lx not resolved by the region map", (unsigned long)r->base);
            return -1;
        }
        for (; c; prev = c, c = c->next) {
            chunks++;
            if (c == BFC__HANDLE_GONE || c->ptr != expect || c->prev != prev || c->region != r || c->size == 0 ||
                (c->size & (BFC__MIN_ALLOC - 1))) {
                snprintf(buf, len, "invariant 1: region %#lx: chunk at %#lx breaks the tiling (expected %#lx)",
                         (unsigned long)r->base, c == BFC__HANDLE_GONE ? 0ul : (unsigned long)c->ptr,
                         (unsigned long)expect);
                return -1;
            }
            if (bfc__region_handle(r, c->ptr) != c) {
                snprintf(buf, len, "invariant 5: chunk %#lx: handle table does not resolve to it",
                         (unsigned long)c->ptr);
                return -1;
            }
            uint32_t s = atomic_load_explicit(&c->state, memory_order_acquire);
            if (s == BFC__CHUNK_FREE) {
                free_chunks++;
                free_bytes += c->size;
                if (prev && atomic_load_explicit(&prev->state, memory_order_relaxed) == BFC__CHUNK_FREE) {
                    snprintf(buf, len, "invariant 2: adjacent free chunks %#lx and %#lx not merged",
                             (unsigned long)prev->ptr, (unsigned long)c->ptr);
                    return -1;
                }
                uint32_t b = bfc__bin_for_size(c->size);
                if (r->large) {
                    /* A large region leaves at its block's free (the fast
                     * allocation relies on it: no binned chunk is large). */
                    snprintf(buf, len, "invariant 3: large region %#lx holds a free chunk",
                             (unsigned long)r->base);
                    return -1;
                }
                if (c->link.slot != bfc__bin_slot(c->size) || !bfc__bins_contains(&a->bins, b, c)) {
                    snprintf(buf, len, "invariant 3: free chunk %#lx (size %zu) not in bin %u",
                             (unsigned long)c->ptr, c->size, b);
                    return -1;
                }
            } else {
                rlive++;
                if (c->link.slot != BFC__NO_SLOT) {
                    snprintf(buf, len, "invariant 3: chunk %#lx in state %u is in bin %u", (unsigned long)c->ptr,
                             s, c->link.slot >> BFC__BIN_SUB_BITS);
                    return -1;
                }
                if (s == BFC__CHUNK_PENDING) {
                    pending++;
                    pending_bytes += c->size;
                } else {
                    in_use += c->size;
                    requested += c->requested;
                }
            }
            expect = c->ptr + c->size;
        }
        if (expect != r->base + r->size || r->tail != prev) {
            snprintf(buf, len, "invariant 1: region %#lx+%zu: chunks end at %#lx (tail record %s)",
                     (unsigned long)r->base, r->size, (unsigned long)expect, r->tail == prev ? "right" : "wrong");
            return -1;
        }
        if (rlive != r->live) {
            snprintf(buf, len, "invariant 4: region %#lx counts %zu live chunks, found %zu", (unsigned long)r->base,
                     r->live, rlive);
            return -1;
        }
        live += rlive;
    }
    if (a->x && bfc__expand_check_locked(a, buf, len) != 0)
        return -1;
    char bb[256];
    if (bfc__bins_verify(&a->bins, bb, sizeof(bb)) != 0) {
        snprintf(buf, len, "invariant 3: bins: %s", bb);
        return -1;
    }
    size_t binned, binned_bytes;
    bfc__bins_tally(&a->bins, BFC__NUM_BINS, &binned, &binned_bytes);
    if (binned != free_chunks || binned_bytes != free_bytes) {
        snprintf(buf, len, "invariant 3: bins hold %zu chunks/%zu bytes, regions %lu/%lu", binned, binned_bytes,
                 (unsigned long)free_chunks, (unsigned long)free_bytes);
        return -1;
    }
    if (span != a->span) {
        snprintf(buf, len, "invariant 4: shard %lu counts %zu bytes of regions, its regions hold %lu",
                 (unsigned long)a->stream_id, a->span, (unsigned long)span);
        return -1;
    }
    if (in_use != a->st.bytes_in_use || requested != a->st.bytes_requested || reserved != a->st.bytes_reserved ||
        regions != a->st.num_regions || pending != a->st.pending || pending_bytes != a->st.pending_bytes ||
        live != a->live || chunks != a->st.chunks) {
        snprintf(buf, len,
                 "invariant 4: shard %lu stats (in use %lu, requested %lu, reserved %lu, regions %lu, pending %lu, "
                 "chunks %lu) differ from chunks (%lu, %lu, %lu, %lu, %lu, %lu)",
                 (unsigned long)a->stream_id, (unsigned long)a->st.bytes_in_use,
                 (unsigned long)a->st.bytes_requested, (unsigned long)a->st.bytes_reserved,
                 (unsigned long)a->st.num_regions, (unsigned long)a->st.pending, (unsigned long)a->st.chunks,
                 (unsigned long)in_use, (unsigned long)requested, (unsigned long)reserved, (unsigned long)regions,
                 (unsigned long)pending, (unsigned long)chunks);
        return -1;
    }
    return 0;
}

const char bfc__per_thread_key_obj; /* internal.h: BFC__PER_THREAD_KEY */

/* ------------------------------------------------------- fence pool */

/*
 * The arena's pool of fence records, a second wfcqueue: the owner enqueues
 * records whose fences completed (wait-free); cross-stream freers
 * (remote.c) and bfc_ctx_record_stream (ctx.c, holding the arena's lock)
 * dequeue under the arena's fpool_lock (rank
 * BFC__RANK_FENCE_POOL, mutex.h), never waiting for an enqueue in progress.
 * That lock is the library's own (an inline compare-and-swap when free),
 * not the pthread mutex inside liburcu's cds_wfcq_head: a call to each of
 * pthread_mutex_lock and unlock cost a cross-stream free 77 of its
 * instructions, and the lock-order witness of debug builds sees this one.
 * An empty pool creates a record and its event.  These are kept out of line, as
 * they were when they lived in remote.c: inlined into the free path they
 * cost it registers (callee-saved pushes) on every call, used or not.
 */
__attribute__((noinline)) struct bfc__fence *bfc__arena_fence_get(struct bfc__arena *a)
{
    /* Not cds_wfcq_dequeue_blocking: with the pool's last record being put
     * back at this moment it would sleep 10 ms (see drain_remote); a new
     * record instead costs an allocation. */
    bfc__lock(&a->fpool_lock);
    struct cds_wfcq_node *node = __cds_wfcq_dequeue_nonblocking(&a->fpool_head, &a->fpool_tail);
    bfc__unlock(&a->fpool_lock);
    struct bfc__fence *f;
    if (node == CDS_WFCQ_WOULDBLOCK)
        node = NULL;
    if (node) {
        f = caa_container_of(node, struct bfc__fence, qnode);
        /* acquire: pairs with the release in bfc__arena_fence_put. */
        (void)atomic_load_explicit(&f->handoff, memory_order_acquire);
        /* A record whose event could not be created: try again. */
        if (BFC__UNLIKELY(!f->ev) && (f->ev_err = a->env->be->ops->event_create(a->env->be, &f->ev)) != BFC_OK)
            f->ev = NULL;
    } else {
        f = bfc__fence_new(a->env->be);
        if (!f)
            return NULL;
        /* relaxed: a count for teardown accounting only. */
        atomic_fetch_add_explicit(&a->nfences, 1, memory_order_relaxed);
    }
    bfc__fence_reset(f);
    return f;
}

__attribute__((noinline)) void bfc__arena_fence_put(struct bfc__arena *a, struct bfc__fence *f)
{
    while (f) {
        struct bfc__fence *next = f->extra;
        cds_wfcq_node_init(&f->qnode);
        atomic_store_explicit(&f->handoff, 0, memory_order_release);
        cds_wfcq_enqueue(&a->fpool_head, &a->fpool_tail, &f->qnode);
        f = next;
    }
}

__attribute__((noinline)) void bfc__arena_fence_pool_destroy(struct bfc__arena *a)
{
    struct cds_wfcq_node *node;
    /* Teardown: no freer is left, so no lock; blocking, as every enqueue
     * has finished (or is about to). */
    while ((node = __cds_wfcq_dequeue_blocking(&a->fpool_head, &a->fpool_tail))) {
        struct bfc__fence *f = caa_container_of(node, struct bfc__fence, qnode);
        bfc__fence_destroy(a->env->be, f);
        atomic_fetch_sub_explicit(&a->nfences, 1, memory_order_relaxed);
    }
}
