/*
 * pool.c -- the device-wide region pool: a coarse best-fit allocator over
 * device memory that hands regions to shards and takes them back.
 *
 * Memory comes from the backend in segments.  With allow_growth=true a
 * segment is taken when a shard needs a region and no free span fits (never
 * past the limit); with allow_growth=false the whole limit is reserved as
 * one segment at create and regions are carved out of it.  Free ranges
 * (spans) are kept in address order and coalesced within their segment, so
 * memory one shard gave back can serve another shard's larger request.
 * Wholly free segments stay cached until trim, or, with garbage collection
 * (`recycle`), until growth under the limit needs the room (then they go
 * back to the backend).
 *
 * Memory changing hands.  A shard may reuse a block at once after a free on
 * its own stream (its later work runs after its earlier work), so memory
 * that leaves a shard may still be in use by work queued on the shard's
 * stream.  Every range given back therefore carries a departure fence: an
 * event recorded on the owner stream when it departs (fence.h), unless the
 * shard never handed any of it out.  A fenced span is "guarded by stream
 * sid": only sid may take it (stream order makes that safe) until the fence
 * completes; the fences are polled whenever the pool is asked for memory,
 * and a completed span merges with its free neighbours.  Best fit looks at
 * runs of adjacent spans the asking stream may take, so a stream's own
 * departed memory coalesces with free memory around it.  Fresh memory from
 * the backend needs no fence, and a segment goes back to the backend only
 * when all of it is free and unfenced.  Under memory pressure a shard waits
 * for other streams' departure fences (bfc__pool_wait) outside the lock.
 *
 * Order.  Two fenced ranges of one stream that meet merge into one span,
 * and one fence can then guard both: the fences of a stream complete in
 * the order they were recorded, so the newer covers the older.  But a
 * departure is armed before the pool lock is taken, and two arenas of one
 * stream id (a released stream's shard, still holding blocks, and the
 * stream's new shard) depart from two threads at once: the departure
 * taken in last need not be the one recorded last.  So each fenced
 * departure is numbered as it is taken in (`inserted`), and notes how many
 * had been taken in when it was armed: a fence covers exactly those
 * recorded before it was armed (their number is at most its count), and a
 * merged span keeps, chained through `extra`, every fence that no other of
 * its fences covers.  Without concurrent departures that is one fence.
 *
 * Metadata.  Giving memory back never allocates: the span record and the
 * fence it needs come from a ticket reserved beforehand (every region holds
 * one for its own departure), so a metadata failure can only refuse a new
 * region, never leave the pool inconsistent.  Taking memory and merging
 * only free records.
 *
 * Invariants (bfc__pool_check): spans are sorted, disjoint, inside their
 * segment, and two adjacent spans of one segment never carry the same guard
 * (they would have merged); per segment the span bytes equal free_bytes;
 * fenced_bytes is the size of the fenced spans; held == sum of segment
 * sizes; committed == held - free.
 *
 * Locking: `lock` is the one device-wide lock of the library.  It is taken
 * only when a region is created or given back (a shard's growth, a large
 * request, trim, shard retirement, the out-of-memory slow path), never by
 * allocation or free of a chunk inside an existing region.  Callers may
 * hold one arena lock; the region map's writer lock is never taken under it.
 * No wait for a fence happens under it.
 */
#include <errno.h>
#include <string.h>

#include "meta.h"
#include "obs.h"
#include "pool.h"

/* ------------------------------------------------------- fence cache */

static struct bfc__fence *fcache_get_locked(struct bfc__pool *p)
{
    struct bfc__fence *f = p->fcache;
    if (f) {
        p->fcache = f->cnext;
        bfc__fence_reset(f);
    }
    return f;
}

/* Takes back f and every fence chained behind it. */
static void fcache_put_locked(struct bfc__pool *p, struct bfc__fence *f)
{
    while (f) {
        struct bfc__fence *next = f->extra;
        f->extra = NULL;
        f->cnext = p->fcache;
        p->fcache = f;
        f = next;
    }
}

static void ticket_put_locked(struct bfc__pool *p, struct bfc__pool_ticket *t)
{
    if (t->span)
        bfc__meta_free(t->span, sizeof(*t->span));
    if (t->fence)
        fcache_put_locked(p, t->fence);
    t->span = NULL;
    t->fence = NULL;
}

int bfc__pool_ticket_get(struct bfc__pool *p, struct bfc__pool_ticket *t)
{
    bfc__lock(&p->lock);
    t->fence = fcache_get_locked(p);
    bfc__unlock(&p->lock);
    if (!t->fence)
        t->fence = bfc__fence_new(p->be); /* outside the lock: calls the backend */
    t->span = bfc__meta_alloc(sizeof(*t->span));
    if (!t->fence || !t->span) {
        bfc__pool_ticket_put(p, t);
        return BFC_ENOMEM;
    }
    return BFC_OK;
}

void bfc__pool_ticket_put(struct bfc__pool *p, struct bfc__pool_ticket *t)
{
    bfc__lock(&p->lock);
    ticket_put_locked(p, t);
    bfc__unlock(&p->lock);
}

/* -------------------------------------------------------------- spans */

static void span_unlink(struct bfc__pool *p, struct bfc__span *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        p->spans = s->next;
    if (s->next)
        s->next->prev = s->prev;
}

static bool same_guard(const struct bfc__span *a, const struct bfc__span *b)
{
    return a->fence ? (b->fence && a->sid == b->sid) : !b->fence;
}

/* Would a and b (b right after a in address order) have been merged? */
static bool joinable(const struct bfc__span *a, const struct bfc__span *b)
{
    return a->seg == b->seg && a->base + a->size == b->base && same_guard(a, b);
}

/* `fence`, just taken in, absorbs the fences of `chain` (same stream):
 * those recorded before it was armed go back to the cache, the others stay
 * chained behind it ("Order" above). */
static void fence_absorb(struct bfc__pool *p, struct bfc__fence *fence, struct bfc__fence *chain)
{
    while (chain) {
        struct bfc__fence *next = chain->extra;
        chain->extra = NULL;
        if (chain->order.inserted <= fence->order.armed_after) {
            fcache_put_locked(p, chain);
        } else {
            chain->extra = fence->extra;
            fence->extra = chain;
        }
        chain = next;
    }
}

/* s takes in a range guarded by `fence` (NULL: none; then s has none). */
static void span_refence(struct bfc__pool *p, struct bfc__span *s, struct bfc__fence *fence)
{
    if (!fence)
        return;
    fence_absorb(p, fence, s->fence);
    s->fence = fence;
}

/* Inserts a free range in address order, merged with neighbours that carry
 * the same guard.  Uses *spare when it needs a record (then *spare = NULL). */
static void span_insert_locked(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg,
                               struct bfc__fence *fence, uint64_t sid, struct bfc__span **spare)
{
    struct bfc__span *prev = NULL, *next = p->spans;
    while (next && next->base < base) {
        prev = next;
        next = next->next;
    }
    struct bfc__span nw = { base, size, seg, next, prev, fence, fence ? sid : 0 };
    bool jp = prev && joinable(prev, &nw);
    bool jn = next && joinable(&nw, next);
    if (fence) {
        p->fenced_bytes += size;
        uint64_t n = atomic_load_explicit(&p->inserted, memory_order_relaxed) + 1;
        fence->order.inserted = n;
        /* release: pairs with the acquire load in bfc__pool_put_arm, which
         * so sees this fence recorded before its own. */
        atomic_store_explicit(&p->inserted, n, memory_order_release);
    }
    if (jp && jn) {
        prev->size += size + next->size;
        if (fence)
            fence_absorb(p, fence, next->fence);
        span_refence(p, prev, fence);
        span_unlink(p, next);
        bfc__meta_free(next, sizeof(*next));
    } else if (jp) {
        prev->size += size;
        span_refence(p, prev, fence);
    } else if (jn) {
        next->base = base;
        next->size += size;
        span_refence(p, next, fence);
    } else {
        struct bfc__span *s = *spare;
        *spare = NULL;
        *s = nw;
        if (prev)
            prev->next = s;
        else
            p->spans = s;
        if (next)
            next->prev = s;
    }
}

/* Mapped bytes charged against the limit (add) or given back. */
static void vmm_charge_locked(struct bfc__pool *p, size_t size, bool add)
{
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    /* relaxed: see carve_locked. */
    atomic_store_explicit(&p->committed, add ? committed + size : committed - size, memory_order_relaxed);
    if (add) {
        p->vmm_mapped += size;
        p->held += size;
        if (p->held > p->peak_held) {
            p->peak_held = p->held;
            p->peak_rise_maps = p->vmm_maps; /* this map's number, counted from 0 */
            p->peak_gen++;
        }
    } else {
        p->vmm_mapped -= size;
        p->held -= size;
    }
}

/* Did g's granule i go back to the device at its release?  Every mapped
 * one, unless the device refused part way (`refused`): then the backend's
 * book says, granule by granule (a rare path). */
static bool gone_went(struct bfc__pool *p, const struct bfc__vmm_gone *g, size_t i, bool refused)
{
    size_t gran = p->be->vmm_granule;
    return (g->bits[i / 64] >> (i % 64) & 1) && !(refused && p->be->ops->va_mapped(p->be, g->base + i * gran, gran));
}

/* After g's release: clears from g->bits the granules that went back to
 * the device (the bits then say what it still holds), writes their trace
 * rows -- one per run, as a shard's own unmaps do -- and returns the bytes
 * still mapped. */
static size_t vmm_gone_settle(struct bfc__pool *p, struct bfc__vmm_gone *g, bool refused)
{
    size_t gran = p->be->vmm_granule, n = g->size / gran, still = 0;
    bool trace = p->obs && bfc__tracing(p->obs);
    if (!refused && !trace)
        return 0; /* all of it went, and no row is wanted */
    for (size_t i = 0; i < n;) {
        if (!gone_went(p, g, i, refused)) {
            i++;
            continue;
        }
        size_t e = i + 1;
        while (e < n && gone_went(p, g, e, refused))
            e++;
        for (size_t k = i; k < e; k++)
            g->bits[k / 64] &= ~(UINT64_C(1) << (k % 64));
        if (trace)
            bfc__trace_event(p->obs, BFC__TR_RELEASE, g->base + i * gran, (e - i) * gran, g->stream);
        i = e;
    }
    for (size_t w = 0; w < g->words; w++)
        still += (size_t)__builtin_popcountll(g->bits[w]) * gran;
    return still;
}

/* Departed reservations whose fences completed (all: every one, teardown)
 * go back to the backend. */
static void vmm_gone_poll_locked(struct bfc__pool *p, bool all)
{
    struct bfc__vmm_gone **pp = &p->vmm_gone;
    while (*pp) {
        struct bfc__vmm_gone *g = *pp;
        if (!all && g->fence && bfc__fence_query(p->be, g->fence) != BFC_OK) {
            pp = &g->next;
            continue;
        }
        int st = p->be->ops->va_release(p->be, g->base, g->size);
        if (g->fence)
            fcache_put_locked(p, g->fence);
        g->fence = NULL;
        if (st != BFC_OK && !all) {
            /* The device refused part way; its book says what it still
             * holds, which stays charged.  No shard adopts g (it is not
             * the reservation that departed), and the next poll offers it
             * again. */
            size_t still = vmm_gone_settle(p, g, true);
            if (still < g->mapped) {
                vmm_charge_locked(p, g->mapped - still, false);
                g->mapped = still;
            }
            g->refused = true;
            p->refusals++;
            pp = &g->next;
            continue;
        }
        *pp = g->next;
        (void)vmm_gone_settle(p, g, false);
        vmm_charge_locked(p, g->mapped, false);
        if (g->mapped)
            p->vmm_unmaps++;
        bfc__meta_free(g->bits, g->words * sizeof(uint64_t));
        bfc__meta_free(g, sizeof(*g));
    }
}

/* Fences that completed: their spans become free for every stream and merge
 * with free neighbours. */
static void poll_spans_locked(struct bfc__pool *p)
{
    if (p->fenced_bytes == 0)
        return;
    struct bfc__span *s = p->spans;
    while (s) {
        if (s->fence && bfc__fence_query(p->be, s->fence) == BFC_OK) {
            fcache_put_locked(p, s->fence);
            s->fence = NULL;
            s->sid = 0;
            p->fenced_bytes -= s->size;
            if (s->prev && joinable(s->prev, s)) {
                struct bfc__span *pr = s->prev;
                pr->size += s->size;
                span_unlink(p, s);
                bfc__meta_free(s, sizeof(*s));
                s = pr;
            }
            if (s->next && joinable(s, s->next)) {
                struct bfc__span *n = s->next;
                s->size += n->size;
                span_unlink(p, n);
                bfc__meta_free(n, sizeof(*n));
            }
        }
        s = s->next;
    }
}

/* ... and departed reservations whose fences completed go back to the
 * backend. */
static void poll_locked(struct bfc__pool *p)
{
    if (p->vmm_gone)
        vmm_gone_poll_locked(p, false);
    poll_spans_locked(p);
}

static bool usable(const struct bfc__span *s, uint64_t sid)
{
    return !s->fence || s->sid == sid;
}

/* The bytes of the run of adjacent spans of one segment, all of which
 * stream sid may take, that starts at `first` (usable); *after is the span
 * after the run. */
static size_t run_at(struct bfc__span *first, uint64_t sid, struct bfc__span **after)
{
    struct bfc__span *t = first->next;
    size_t len = first->size;
    while (t && usable(t, sid) && t->seg == first->seg && t->prev->base + t->prev->size == t->base) {
        len += t->size;
        t = t->next;
    }
    *after = t;
    return len;
}

/* Best fit over runs of adjacent spans of one segment that stream sid may
 * take: the smallest run of at least `size` bytes, lowest address among
 * equals.  Returns the run's first span or NULL. */
static struct bfc__span *find_run(struct bfc__pool *p, uint64_t sid, size_t size)
{
    struct bfc__span *best = NULL;
    size_t best_len = 0;
    for (struct bfc__span *s = p->spans; s;) {
        if (!usable(s, sid)) {
            s = s->next;
            continue;
        }
        struct bfc__span *first = s;
        size_t len = run_at(first, sid, &s);
        if (len >= size && (!best || len < best_len)) {
            best = first;
            best_len = len;
        }
    }
    return best;
}

/* Takes `size` bytes from the front of the run starting at `first`.  Sets
 * *used when any of it was guarded by (the asking stream's own) fence. */
static void carve_locked(struct bfc__pool *p, struct bfc__span *first, size_t size, bool *used)
{
    struct bfc__segment *seg = first->seg;
    struct bfc__span *s = first;
    size_t left = size;
    while (left) {
        struct bfc__span *next = s->next;
        if (s->fence)
            *used = true;
        if (s->size <= left) {
            left -= s->size;
            if (s->fence) {
                p->fenced_bytes -= s->size;
                fcache_put_locked(p, s->fence);
            }
            span_unlink(p, s);
            bfc__meta_free(s, sizeof(*s));
        } else {
            s->base += left;
            s->size -= left;
            if (s->fence)
                p->fenced_bytes -= left;
            left = 0;
        }
        s = next;
    }
    seg->free_bytes -= size;
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    /* relaxed: committed is only written under the pool lock; lock-free
     * readers (shards sizing a region, stats) want an estimate. */
    atomic_store_explicit(&p->committed, committed + size, memory_order_relaxed);
}

/* ----------------------------------------------------------- segments */

static int seg_new_locked(struct bfc__pool *p, size_t size, struct bfc__span **out)
{
    struct bfc__segment *seg = bfc__meta_alloc(sizeof(*seg));
    struct bfc__span *s = bfc__meta_alloc(sizeof(*s));
    void *mem = NULL;
    int st = BFC_ENOMEM;
    if (!seg || !s || (st = p->be->ops->mem_alloc(p->be, size, &mem)) != BFC_OK) {
        bfc__meta_free(seg, sizeof(*seg));
        bfc__meta_free(s, sizeof(*s));
        return st;
    }
    *seg = (struct bfc__segment){ (uintptr_t)mem, size, size, p->segs };
    p->segs = seg;
    p->held += size;
    p->backend_allocs++;
    if (p->held > p->peak_held) {
        p->peak_held = p->held;
        p->peak_gen++;
    }
    span_insert_locked(p, seg->base, size, seg, NULL, 0, &s);
    if (s)
        bfc__meta_free(s, sizeof(*s)); /* cannot happen: a new segment joins nothing */
    *out = NULL;
    for (struct bfc__span *x = p->spans; x; x = x->next)
        if (x->seg == seg)
            *out = x;
    return BFC_OK;
}

/* Is s the one span of a wholly free, unfenced segment (which
 * release_free_locked gives back)?  Adjacent unfenced spans of a segment
 * always merge, so such a segment has exactly one. */
static bool releasable(const struct bfc__span *s)
{
    return !s->fence && s->size == s->seg->size;
}

/* Gives every wholly free, unfenced segment back to the backend. */
static size_t release_free_locked(struct bfc__pool *p)
{
    size_t released = 0;
    if (!p->growth)
        return 0;
    poll_locked(p);
    struct bfc__segment **pp = &p->segs;
    while (*pp) {
        struct bfc__segment *seg = *pp;
        struct bfc__span *s = NULL;
        if (seg->free_bytes == seg->size)
            for (s = p->spans; s && s->seg != seg; s = s->next)
                ;
        if (!s || !releasable(s)) {
            pp = &seg->next;
            continue;
        }
        /* A segment the device refuses to take back stays, held and
         * counted, and is offered again at the next release. */
        if (p->be->ops->mem_free(p->be, (void *)seg->base, seg->size) != BFC_OK) {
            p->refusals++;
            pp = &seg->next;
            continue;
        }
        span_unlink(p, s);
        bfc__meta_free(s, sizeof(*s));
        *pp = seg->next;
        p->held -= seg->size;
        p->backend_frees++;
        released += seg->size;
        bfc__meta_free(seg, sizeof(*seg));
    }
    return released;
}

/* --------------------------------------------------------------- API */

int bfc__pool_init(struct bfc__pool *p, bfc__backend_t *be, size_t limit, bool growth, bool recycle)
{
    memset(p, 0, sizeof(*p));
    int e = bfc__mutex_init(&p->lock, BFC__RANK_POOL, "a region pool");
    if (e != 0)
        return e == ENOMEM ? BFC_ENOMEM : BFC_EBACKEND;
    p->be = be;
    p->limit = limit;
    p->growth = growth;
    p->recycle = recycle;
    if (!growth) {
        struct bfc__span *s;
        int st = seg_new_locked(p, limit, &s);
        if (st != BFC_OK) {
            bfc__mutex_destroy(&p->lock);
            return st;
        }
    }
    return BFC_OK;
}

void bfc__pool_fini(struct bfc__pool *p)
{
    vmm_gone_poll_locked(p, true);
    while (p->spans) {
        struct bfc__span *s = p->spans;
        p->spans = s->next;
        if (s->fence)
            fcache_put_locked(p, s->fence);
        bfc__meta_free(s, sizeof(*s));
    }
    while (p->fcache) {
        struct bfc__fence *f = p->fcache;
        p->fcache = f->cnext;
        bfc__fence_destroy(p->be, f);
    }
    while (p->segs) {
        struct bfc__segment *seg = p->segs;
        p->segs = seg->next;
        /* The last try: what the device refuses here stays lost to the
         * process. */
        (void)p->be->ops->mem_free(p->be, (void *)seg->base, seg->size);
        bfc__meta_free(seg, sizeof(*seg));
    }
    p->held = 0;
    p->fenced_bytes = 0;
    bfc__mutex_destroy(&p->lock);
}

int bfc__pool_get(struct bfc__pool *p, size_t size, uint64_t sid, uintptr_t *base, struct bfc__segment **segp,
                  bool *used, bool *fenced_others)
{
    int st = BFC_ENOMEM;
    *used = false;
    if (fenced_others)
        *fenced_others = false;
    bfc__lock(&p->lock);
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    if (size == 0 || size > p->limit || committed > p->limit - size)
        goto out;
    poll_locked(p);
    struct bfc__span *best = find_run(p, sid, size);
    if (!best && p->growth) {
        if (p->held + size > p->limit && p->recycle)
            release_free_locked(p);
        if (p->held + size <= p->limit) {
            st = seg_new_locked(p, size, &best);
            if (st != BFC_OK)
                goto out;
        }
    }
    if (!best) {
        if (fenced_others)
            for (struct bfc__span *s = p->spans; s && !*fenced_others; s = s->next)
                *fenced_others = s->fence && s->sid != sid;
        st = BFC_ENOMEM;
        goto out;
    }
    *base = best->base;
    *segp = best->seg;
    carve_locked(p, best, size, used);
    st = BFC_OK;
out:
    bfc__unlock(&p->lock);
    return st;
}

void bfc__pool_put_arm(struct bfc__pool *p, bool used, bfc_stream_t s, uint64_t sid, struct bfc__pool_ticket *t)
{
    if (!used)
        return;
    struct bfc__fence *f = t->fence;
    bfc__fence_reset(f);
    /* acquire: pairs with the release store in span_insert_locked: every
     * departure counted here was recorded before ours ("Order"). */
    f->order.armed_after = atomic_load_explicit(&p->inserted, memory_order_acquire);
    f->order.inserted = 0;
    /* Armed before the lock: a failed record falls back to waiting. */
    bfc__fence_arm(p->be, f, s, sid);
}

void bfc__pool_put(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg, bool used,
                   bfc_stream_t s, uint64_t sid, struct bfc__pool_ticket *t)
{
    bfc__pool_put_arm(p, used, s, sid, t);
    bfc__pool_put_armed(p, base, size, seg, used, sid, t);
}

void bfc__pool_put_armed(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg, bool used,
                         uint64_t sid, struct bfc__pool_ticket *t)
{
    struct bfc__fence *f = NULL;
    if (used) {
        f = t->fence;
        t->fence = NULL;
    }
    bfc__lock(&p->lock);
    p->departures++;
    if (used)
        p->fenced_departures++;
    seg->free_bytes += size;
    span_insert_locked(p, base, size, seg, f, sid, &t->span);
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    /* relaxed: see carve_locked. */
    atomic_store_explicit(&p->committed, committed - size, memory_order_relaxed);
    ticket_put_locked(p, t);
    bfc__unlock(&p->lock);
}

#define WAIT_MAX_EVENTS 32

bool bfc__pool_wait(struct bfc__pool *p, uint64_t sid, bool all, uint32_t timeout_ms)
{
    bfc__event_t evs[WAIT_MAX_EVENTS];
    size_t n = 0;
    bfc__lock(&p->lock);
    size_t before = p->fenced_bytes + p->vmm_mapped;
    poll_locked(p);
    bool progress = p->fenced_bytes + p->vmm_mapped < before;
    /* Event handles stay valid after we unlock: fence records are only
     * destroyed by bfc__pool_fini.  One re-recorded meanwhile just makes
     * the wait end at another point; the poll below decides. */
    for (struct bfc__span *s = p->spans; s && n < WAIT_MAX_EVENTS; s = s->next)
        if (s->fence && (all || s->sid != sid))
            for (struct bfc__fence *f = s->fence; f && n < WAIT_MAX_EVENTS; f = f->extra)
                if (f->ev && !f->synced && !f->unfenced)
                    evs[n++] = f->ev;
    for (struct bfc__vmm_gone *g = p->vmm_gone; g && n < WAIT_MAX_EVENTS; g = g->next)
        if (g->fence && g->fence->ev && !g->fence->synced && !g->fence->unfenced)
            evs[n++] = g->fence->ev;
    if (n)
        p->fence_waits++;
    bfc__unlock(&p->lock);
    if (n == 0 || timeout_ms == 0)
        return progress;
    for (size_t i = 0; i < n; i++)
        (void)p->be->ops->event_wait(p->be, evs[i], timeout_ms);
    bfc__lock(&p->lock);
    before = p->fenced_bytes + p->vmm_mapped;
    poll_locked(p);
    progress |= p->fenced_bytes + p->vmm_mapped < before;
    bfc__unlock(&p->lock);
    return progress;
}

bool bfc__pool_fits_with(struct bfc__pool *p, uint64_t sid, const struct bfc__range *extra, size_t n, size_t size)
{
    bool fits = false;
    bfc__lock(&p->lock);
    poll_locked(p);
    /* A merge of two address-sorted lists: the usable spans and `extra`;
     * contiguous pieces of one segment add up. */
    struct bfc__span *s = p->spans;
    size_t i = 0, run = 0;
    uintptr_t end = 0;
    struct bfc__segment *seg = NULL;
    while (!fits && (s || i < n)) {
        uintptr_t b;
        size_t sz;
        struct bfc__segment *g;
        if (s && !usable(s, sid)) {
            s = s->next;
            continue;
        }
        if (s && (i == n || s->base < extra[i].base)) {
            b = s->base, sz = s->size, g = s->seg;
            s = s->next;
        } else {
            b = extra[i].base, sz = extra[i].size, g = extra[i].seg;
            i++;
        }
        run = (g == seg && b == end) ? run + sz : sz;
        seg = g;
        end = b + sz;
        fits = run >= size;
    }
    bfc__unlock(&p->lock);
    return fits;
}

/* The longest run of spans stream sid may take now; p->lock held, fences
 * polled. */
static size_t largest_run_locked(struct bfc__pool *p, uint64_t sid)
{
    size_t most = 0;
    for (struct bfc__span *s = p->spans; s;) {
        if (!usable(s, sid)) {
            s = s->next;
            continue;
        }
        size_t len = run_at(s, sid, &s);
        if (len > most)
            most = len;
    }
    return most;
}

size_t bfc__pool_largest_held(struct bfc__pool *p, uint64_t sid)
{
    bfc__lock(&p->lock);
    poll_locked(p);
    size_t most = largest_run_locked(p, sid);
    bfc__unlock(&p->lock);
    return most & ~(size_t)(BFC__MIN_ALLOC - 1);
}

size_t bfc__pool_largest(struct bfc__pool *p, uint64_t sid)
{
    bfc__lock(&p->lock);
    poll_locked(p);
    size_t most = largest_run_locked(p, sid), headroom = 0;
    if (p->growth) {
        /* With recycle, what release_free_locked would give back first. */
        size_t held = p->held;
        for (struct bfc__span *s = p->spans; s && p->recycle; s = s->next)
            if (releasable(s))
                held -= s->size;
        headroom = held < p->limit ? p->limit - held : 0;
    }
    if (headroom > most)
        most = headroom;
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    size_t left = committed < p->limit ? p->limit - committed : 0;
    bfc__unlock(&p->lock);
    return (most < left ? most : left) & ~(size_t)(BFC__MIN_ALLOC - 1);
}

uint64_t bfc__pool_refusals(struct bfc__pool *p)
{
    bfc__lock(&p->lock);
    uint64_t n = p->refusals;
    bfc__unlock(&p->lock);
    return n;
}

size_t bfc__pool_release_free(struct bfc__pool *p)
{
    bfc__lock(&p->lock);
    size_t n = release_free_locked(p);
    bfc__unlock(&p->lock);
    return n;
}

int bfc__pool_settle(struct bfc__pool *p)
{
    int st = p->be->ops->va_settle(p->be); /* without the pool lock: calls the driver */
    if (st != BFC_OK) {
        bfc__lock(&p->lock);
        p->refusals++;
        bfc__unlock(&p->lock);
    }
    return st;
}

void bfc__pool_stats(struct bfc__pool *p, struct bfc__pool_stats *out)
{
    memset(out, 0, sizeof(*out));
    bfc__lock(&p->lock);
    for (struct bfc__span *s = p->spans; s; s = s->next) {
        out->free_bytes += s->size;
        out->spans++;
    }
    for (struct bfc__segment *g = p->segs; g; g = g->next)
        out->segments++;
    out->held = p->held;
    out->peak_held = p->peak_held;
    out->committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    out->fenced_bytes = p->fenced_bytes;
    out->departures = p->departures;
    out->fenced_departures = p->fenced_departures;
    out->fence_waits = p->fence_waits;
    out->vmm_maps = p->vmm_maps;
    out->vmm_unmaps = p->vmm_unmaps;
    out->vmm_adoptions = p->vmm_adoptions;
    size_t gone_largest = 0;
    for (struct bfc__vmm_gone *g = p->vmm_gone; g; g = g->next) {
        if (!g->fence) {
            out->gone_open += g->mapped;
            continue;
        }
        out->gone_fenced += g->mapped;
        if (g->mapped > gone_largest) {
            gone_largest = g->mapped;
            out->gone_stream = g->sid;
        }
    }
    bfc__unlock(&p->lock);
}

void bfc__pool_poll(struct bfc__pool *p)
{
    bfc__lock(&p->lock);
    /* Readers ask, they do not release: a departed reservation whose fence
     * completed is only marked so (open), and goes back to the device at
     * the pool's next allocation or trim, as before. */
    for (struct bfc__vmm_gone *g = p->vmm_gone; g; g = g->next)
        if (g->fence && bfc__fence_query(p->be, g->fence) == BFC_OK) {
            fcache_put_locked(p, g->fence);
            g->fence = NULL;
        }
    poll_spans_locked(p);
    bfc__unlock(&p->lock);
}

void bfc__pool_clear_peak(struct bfc__pool *p)
{
    bfc__lock(&p->lock);
    p->peak_held = p->held;
    p->peak_gen++; /* a refused map in flight keeps this peak */
    bfc__unlock(&p->lock);
}

size_t bfc__pool_peak_excess(struct bfc__pool *p, size_t bytes, uint64_t *maps_since_rise)
{
    bfc__lock(&p->lock);
    size_t over = p->held + bytes > p->peak_held ? p->held + bytes - p->peak_held : 0;
    if (maps_since_rise)
        *maps_since_rise = p->vmm_maps - p->peak_rise_maps;
    bfc__unlock(&p->lock);
    return over;
}

bool bfc__pool_would_peak(struct bfc__pool *p, size_t bytes)
{
    return bfc__pool_peak_excess(p, bytes, NULL) != 0;
}

size_t bfc__pool_spans(struct bfc__pool *p, struct bfc__span_info *out, size_t max)
{
    size_t n = 0;
    bfc__lock(&p->lock);
    for (struct bfc__span *s = p->spans; s; s = s->next, n++) {
        if (n >= max)
            continue;
        unsigned fences = 0;
        for (struct bfc__fence *f = s->fence; f; f = f->extra)
            fences++;
        out[n] = (struct bfc__span_info){ s->base, s->size, s->fence != NULL, s->sid, s->seg->base, s->seg->size,
                                          fences };
    }
    bfc__unlock(&p->lock);
    return n;
}

int bfc__pool_check(struct bfc__pool *p, char *buf, size_t len)
{
    bfc__lock(&p->lock);
    int bad = bfc__pool_check_locked(p, buf, len);
    bfc__unlock(&p->lock);
    return bad;
}

int bfc__pool_check_locked(struct bfc__pool *p, char *buf, size_t len)
{
    size_t held = 0, free_total = 0, fenced = 0;
    for (struct bfc__segment *seg = p->segs; seg; seg = seg->next) {
        held += seg->size;
        size_t f = 0;
        for (struct bfc__span *s = p->spans; s; s = s->next)
            if (s->seg == seg)
                f += s->size;
        if (f != seg->free_bytes) {
            snprintf(buf, len, "invariant 6: pool segment %#lx: spans hold %zu bytes, segment says %zu",
                     (unsigned long)seg->base, f, seg->free_bytes);
            return -1;
        }
    }
    for (struct bfc__span *s = p->spans; s; s = s->next) {
        free_total += s->size;
        if (s->fence)
            fenced += s->size;
        if (s->size == 0 || (s->size & (BFC__MIN_ALLOC - 1)) || s->base < s->seg->base ||
            s->base + s->size > s->seg->base + s->seg->size ||
            (s->next && (s->next->base < s->base + s->size || joinable(s, s->next) || s->next->prev != s))) {
            snprintf(buf, len, "invariant 6: pool span %#lx+%zu misplaced or not coalesced", (unsigned long)s->base,
                     s->size);
            return -1;
        }
        /* "Order": a fence chained behind the first was not covered by it. */
        uint64_t inserted = atomic_load_explicit(&p->inserted, memory_order_relaxed);
        for (struct bfc__fence *f = s->fence; f; f = f->extra)
            if (f->order.inserted == 0 || f->order.inserted > inserted ||
                (f != s->fence && f->order.inserted <= s->fence->order.armed_after)) {
                snprintf(buf, len, "invariant 6: pool span %#lx+%zu keeps a fence its newest covers",
                         (unsigned long)s->base, s->size);
                return -1;
            }
    }
    size_t gone = 0;
    for (struct bfc__vmm_gone *g = p->vmm_gone; g; g = g->next)
        gone += g->mapped;
    if (gone > p->vmm_mapped) {
        snprintf(buf, len, "invariant 4: pool: departed reservations hold %zu mapped bytes, more than %zu mapped",
                 gone, p->vmm_mapped);
        return -1;
    }
    held += p->vmm_mapped;
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    if (held != p->held || p->held - free_total != committed || fenced != p->fenced_bytes) {
        snprintf(buf, len, "invariant 4: pool holds %zu (counted %zu), free %zu, committed %zu, fenced %zu (counted %zu)",
                 p->held, held, free_total, committed, p->fenced_bytes, fenced);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------- expandable arenas */

struct bfc__fence *bfc__pool_fence_get(struct bfc__pool *p)
{
    bfc__lock(&p->lock);
    struct bfc__fence *f = fcache_get_locked(p);
    bfc__unlock(&p->lock);
    return f ? f : bfc__fence_new(p->be); /* outside the lock: calls the backend */
}

void bfc__pool_fence_put(struct bfc__pool *p, struct bfc__fence *f)
{
    bfc__lock(&p->lock);
    fcache_put_locked(p, f);
    bfc__unlock(&p->lock);
}

int bfc__pool_vmm_reserve(struct bfc__pool *p, size_t size, uintptr_t *base)
{
    int st = p->be->ops->va_reserve(p->be, size, base);
    return st == BFC_EINVAL ? BFC_EBACKEND : st;
}

void bfc__pool_vmm_unreserve(struct bfc__pool *p, uintptr_t base, size_t size)
{
    /* Nothing is mapped in it (a range never used, or one whose every
     * granule went back): a refusal keeps only addresses, which the
     * backend's book holds until it closes. */
    (void)p->be->ops->va_release(p->be, base, size);
}

/* Whether `size` bytes more may be mapped: departed reservations whose
 * fences completed go first when the limit would refuse them. */
static bool vmm_fits_locked(struct bfc__pool *p, size_t size)
{
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    if (committed > p->limit - size && p->vmm_gone) {
        vmm_gone_poll_locked(p, false);
        committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    }
    return size <= p->limit && committed <= p->limit - size;
}

bool bfc__pool_vmm_fits(struct bfc__pool *p, size_t size)
{
    bfc__lock(&p->lock);
    bool fits = vmm_fits_locked(p, size);
    bfc__unlock(&p->lock);
    return fits;
}

int bfc__pool_vmm_map(struct bfc__pool *p, uintptr_t addr, size_t size)
{
    bfc__lock(&p->lock);
    if (!vmm_fits_locked(p, size)) {
        bfc__unlock(&p->lock);
        return BFC_ENOMEM;
    }
    /* Charged first, so that two shards mapping at once cannot both pass
     * the limit; the driver call runs without the pool lock.  The charge
     * raises the peak at once (held never passes peak_held, and the peak
     * is never below what was mapped); a map the device refuses takes
     * back the rise it made, unless a later rise or a clear has built on
     * it (then the peak stays an upper bound). */
    size_t peak_before = p->peak_held;
    uint64_t rise_before = p->peak_rise_maps;
    vmm_charge_locked(p, size, true);
    uint64_t gen = p->peak_held != peak_before ? p->peak_gen : 0;
    bfc__unlock(&p->lock);
    int st = p->be->ops->va_map(p->be, addr, size);
    bfc__lock(&p->lock);
    if (st != BFC_OK) {
        vmm_charge_locked(p, size, false);
        if (gen && p->peak_gen == gen) {
            p->peak_held = peak_before > p->held ? peak_before : p->held;
            p->peak_rise_maps = rise_before;
        }
    } else {
        p->vmm_maps++;
    }
    bfc__unlock(&p->lock);
    return st == BFC_OK || st == BFC_ENOMEM ? st : BFC_EBACKEND;
}

int bfc__pool_vmm_unmap(struct bfc__pool *p, uintptr_t addr, size_t size, size_t *done)
{
    size_t gone = 0;
    int st = p->be->ops->va_unmap(p->be, addr, size, &gone);
    bfc__lock(&p->lock);
    /* Only what the device took back is uncharged: granules it refused
     * stay mapped, held against the limit, and the caller keeps them. */
    vmm_charge_locked(p, gone, false);
    p->vmm_unmaps++;
    /* A refusal is memory the device kept: a failure after the unmap (the
     * caller's device not restored) leaves none. */
    if (gone < size)
        p->refusals++;
    bfc__unlock(&p->lock);
    *done = gone;
    return st == BFC_OK || st == BFC_EINVAL ? st : BFC_EBACKEND;
}

void bfc__pool_vmm_depart(struct bfc__pool *p, struct bfc__vmm_gone *rec, uintptr_t base, size_t size,
                          size_t mapped, struct bfc__fence *fence, uint64_t sid, bfc_stream_t stream, uint64_t *bits,
                          size_t words)
{
    *rec = (struct bfc__vmm_gone){ base, size, mapped, fence, sid, stream, bits, words, false, NULL };
    bfc__lock(&p->lock);
    rec->next = p->vmm_gone;
    p->vmm_gone = rec;
    p->departures++;
    if (fence)
        p->fenced_departures++;
    vmm_gone_poll_locked(p, false);
    bfc__unlock(&p->lock);
}

/* May a new shard of stream sid needing min bytes take g back? */
static bool adoptable(const struct bfc__vmm_gone *g, uint64_t sid, size_t min)
{
    return g->sid == sid && g->mapped && g->size >= min && !g->refused;
}

struct bfc__vmm_gone *bfc__pool_vmm_adopt(struct bfc__pool *p, uint64_t sid, size_t min)
{
    bfc__lock(&p->lock);
    struct bfc__vmm_gone **pp = &p->vmm_gone, *g = NULL;
    struct bfc__vmm_gone **best = NULL;
    for (; *pp; pp = &(*pp)->next)
        if (adoptable(*pp, sid, min) && (!best || (*pp)->mapped > (*best)->mapped))
            best = pp;
    if (best) {
        g = *best;
        *best = g->next;
        g->next = NULL;
        if (g->fence)
            fcache_put_locked(p, g->fence);
        g->fence = NULL;
        p->vmm_adoptions++;
    }
    bfc__unlock(&p->lock);
    return g;
}

size_t bfc__pool_vmm_gone_mapped(struct bfc__pool *p, uint64_t sid, size_t min)
{
    size_t most = 0;
    bfc__lock(&p->lock);
    vmm_gone_poll_locked(p, false);
    for (struct bfc__vmm_gone *g = p->vmm_gone; g; g = g->next)
        if (adoptable(g, sid, min) && g->mapped > most)
            most = g->mapped;
    bfc__unlock(&p->lock);
    return most;
}
