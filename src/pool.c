/*
 * pool.c -- the device-wide region pool: a coarse best-fit allocator over
 * device memory that hands regions to arenas and takes them back.
 *
 * Memory comes from the backend in segments.  With allow_growth=true a
 * segment is taken when an arena needs a region and no free span fits (never
 * past the limit); with allow_growth=false the whole limit is reserved as one
 * segment at create and regions are carved out of it.  Free ranges (spans)
 * are kept in address order and coalesced within their segment, so memory one
 * shard gave back can serve another shard's larger request.  Wholly free
 * segments stay cached until trim, garbage collection or growth under the
 * limit needs the room (then they go back to the backend).
 *
 * Invariants (bfc__pool_check): spans are sorted, disjoint, inside their
 * segment and never adjacent within one segment; per segment the span bytes
 * equal free_bytes; held == sum of segment sizes; committed == held - free.
 *
 * Locking: `lock` is the one device-wide lock of the library.  It is taken
 * only when a region is created or given back (an arena's growth, a large
 * request, trim, shard retirement, the OOM slow path), never by allocation
 * or free of a chunk inside an existing region.  Callers may hold one arena
 * lock; the region map's writer lock nests inside.
 */
#include <string.h>

#include "ctx.h"

static void span_unlink(struct bfc__pool *p, struct bfc__span *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        p->spans = s->next;
    if (s->next)
        s->next->prev = s->prev;
}

/* Inserts a free range in address order and merges it with adjacent spans of
 * the same segment.  Returns false if no span record could be allocated (the
 * range is then lost to the pool until the segment is released). */
static bool span_insert(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg)
{
    struct bfc__span *prev = NULL, *next = p->spans;
    while (next && next->base < base) {
        prev = next;
        next = next->next;
    }
    bool join_prev = prev && prev->seg == seg && prev->base + prev->size == base;
    bool join_next = next && next->seg == seg && base + size == next->base;
    if (join_prev && join_next) {
        prev->size += size + next->size;
        span_unlink(p, next);
        bfc__meta_free(next, sizeof(*next));
    } else if (join_prev) {
        prev->size += size;
    } else if (join_next) {
        next->base = base;
        next->size += size;
    } else {
        struct bfc__span *s = bfc__meta_alloc(sizeof(*s));
        if (!s)
            return false;
        *s = (struct bfc__span){ base, size, seg, next, prev };
        if (prev)
            prev->next = s;
        else
            p->spans = s;
        if (next)
            next->prev = s;
    }
    return true;
}

static int seg_new(struct bfc_ctx *ctx, size_t size, struct bfc__segment **out)
{
    struct bfc__pool *p = &ctx->pool;
    struct bfc__segment *seg = bfc__meta_alloc(sizeof(*seg));
    if (!seg)
        return BFC_ENOMEM;
    void *mem = NULL;
    int st = ctx->be->ops->mem_alloc(ctx->be, size, &mem);
    if (st != BFC_OK) {
        bfc__meta_free(seg, sizeof(*seg));
        return st;
    }
    *seg = (struct bfc__segment){ (uintptr_t)mem, size, size, p->segs };
    if (!span_insert(p, seg->base, size, seg)) {
        ctx->be->ops->mem_free(ctx->be, mem, size);
        bfc__meta_free(seg, sizeof(*seg));
        return BFC_ENOMEM;
    }
    p->segs = seg;
    p->held += size;
    p->backend_allocs++;
    if (p->held > p->peak_held)
        p->peak_held = p->held;
    *out = seg;
    return BFC_OK;
}

int bfc__pool_init(struct bfc_ctx *ctx)
{
    struct bfc__pool *p = &ctx->pool;
    memset(p, 0, sizeof(*p));
    if (pthread_mutex_init(&p->lock, NULL))
        return BFC_EBACKEND;
    p->limit = ctx->limit;
    p->growth = ctx->cfg.allow_growth;
    if (!p->growth) {
        struct bfc__segment *seg;
        int st = seg_new(ctx, p->limit, &seg);
        if (st != BFC_OK) {
            pthread_mutex_destroy(&p->lock);
            return st;
        }
    }
    return BFC_OK;
}

/* Gives every wholly free segment back to the backend.  Pool lock held. */
static size_t release_free_locked(struct bfc_ctx *ctx)
{
    struct bfc__pool *p = &ctx->pool;
    size_t released = 0;
    if (!p->growth)
        return 0;
    struct bfc__segment **pp = &p->segs;
    while (*pp) {
        struct bfc__segment *seg = *pp;
        if (seg->free_bytes != seg->size) {
            pp = &seg->next;
            continue;
        }
        for (struct bfc__span *s = p->spans; s; s = s->next) {
            if (s->seg == seg) {
                span_unlink(p, s);
                bfc__meta_free(s, sizeof(*s));
                break;
            }
        }
        *pp = seg->next;
        ctx->be->ops->mem_free(ctx->be, (void *)seg->base, seg->size);
        p->held -= seg->size;
        p->backend_frees++;
        released += seg->size;
        bfc__meta_free(seg, sizeof(*seg));
    }
    return released;
}

int bfc__pool_get(struct bfc_ctx *ctx, size_t size, uintptr_t *base, struct bfc__segment **segp)
{
    struct bfc__pool *p = &ctx->pool;
    bfc__lock(&p->lock);
    int st = BFC_ENOMEM;
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    if (size > p->limit || committed > p->limit - size)
        goto out;
    /* Best fit among free spans: smallest that fits, lowest address first. */
    struct bfc__span *best = NULL;
    for (struct bfc__span *s = p->spans; s; s = s->next)
        if (s->size >= size && (!best || s->size < best->size))
            best = s;
    if (!best && p->growth) {
        if (p->held + size > p->limit)
            release_free_locked(ctx);
        if (p->held + size <= p->limit) {
            struct bfc__segment *seg;
            st = seg_new(ctx, size, &seg);
            if (st != BFC_OK)
                goto out;
            for (struct bfc__span *s = p->spans; s; s = s->next)
                if (s->seg == seg)
                    best = s;
        }
    }
    if (!best) {
        st = BFC_ENOMEM;
        goto out;
    }
    *base = best->base;
    *segp = best->seg;
    best->seg->free_bytes -= size;
    best->base += size;
    best->size -= size;
    if (best->size == 0) {
        span_unlink(p, best);
        bfc__meta_free(best, sizeof(*best));
    }
    /* relaxed: committed is only written under the pool lock; lock-free
     * readers (stats) want an approximate figure. */
    atomic_store_explicit(&p->committed, committed + size, memory_order_relaxed);
    st = BFC_OK;
out:
    bfc__unlock(&p->lock);
    return st;
}

void bfc__pool_put(struct bfc_ctx *ctx, uintptr_t base, size_t size, struct bfc__segment *seg)
{
    struct bfc__pool *p = &ctx->pool;
    bfc__lock(&p->lock);
    seg->free_bytes += size;
    span_insert(p, base, size, seg);
    size_t committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    atomic_store_explicit(&p->committed, committed - size, memory_order_relaxed);
    bfc__unlock(&p->lock);
}

size_t bfc__pool_release_free(struct bfc_ctx *ctx)
{
    bfc__lock(&ctx->pool.lock);
    size_t n = release_free_locked(ctx);
    bfc__unlock(&ctx->pool.lock);
    return n;
}

void bfc__pool_fini(struct bfc_ctx *ctx)
{
    struct bfc__pool *p = &ctx->pool;
    while (p->spans) {
        struct bfc__span *s = p->spans;
        p->spans = s->next;
        bfc__meta_free(s, sizeof(*s));
    }
    while (p->segs) {
        struct bfc__segment *seg = p->segs;
        p->segs = seg->next;
        ctx->be->ops->mem_free(ctx->be, (void *)seg->base, seg->size);
        bfc__meta_free(seg, sizeof(*seg));
    }
    p->held = 0;
    pthread_mutex_destroy(&p->lock);
}

void bfc__pool_stats(struct bfc_ctx *ctx, size_t *held, size_t *peak, size_t *committed,
                     size_t *free_spans)
{
    struct bfc__pool *p = &ctx->pool;
    bfc__lock(&p->lock);
    size_t f = 0;
    for (struct bfc__span *s = p->spans; s; s = s->next)
        f += s->size;
    *held = p->held;
    *peak = p->peak_held;
    *committed = atomic_load_explicit(&p->committed, memory_order_relaxed);
    *free_spans = f;
    bfc__unlock(&p->lock);
}

size_t bfc__pool_spans(struct bfc_ctx *ctx, struct bfc__span_info *out, size_t max)
{
    size_t n = 0;
    bfc__lock(&ctx->pool.lock);
    for (struct bfc__span *s = ctx->pool.spans; s; s = s->next, n++)
        if (n < max)
            out[n] = (struct bfc__span_info){s->base, s->size, false, 0};
    bfc__unlock(&ctx->pool.lock);
    return n;
}

void bfc__pool_clear_peak(struct bfc_ctx *ctx)
{
    bfc__lock(&ctx->pool.lock);
    ctx->pool.peak_held = ctx->pool.held;
    bfc__unlock(&ctx->pool.lock);
}

int bfc__pool_check(struct bfc_ctx *ctx, char *buf, size_t len)
{
    bfc__lock(&ctx->pool.lock);
    int bad = bfc__pool_check_locked(ctx, buf, len);
    bfc__unlock(&ctx->pool.lock);
    return bad;
}

int bfc__pool_check_locked(struct bfc_ctx *ctx, char *buf, size_t len)
{
    struct bfc__pool *p = &ctx->pool;
    int bad = 0;
    size_t held = 0, free_total = 0;
    for (struct bfc__segment *seg = p->segs; seg; seg = seg->next) {
        held += seg->size;
        size_t f = 0;
        for (struct bfc__span *s = p->spans; s; s = s->next)
            if (s->seg == seg)
                f += s->size;
        if (f != seg->free_bytes) {
            snprintf(buf, len, "invariant 6: pool segment %#lx: spans hold %zu bytes, segment says %zu",
                     (unsigned long)seg->base, f, seg->free_bytes);
            bad = -1;
            goto out;
        }
    }
    for (struct bfc__span *s = p->spans; s; s = s->next) {
        free_total += s->size;
        if (s->size == 0 || s->base < s->seg->base || s->base + s->size > s->seg->base + s->seg->size ||
            (s->next && (s->next->base < s->base + s->size ||
                         (s->next->seg == s->seg && s->next->base == s->base + s->size))) ||
            (s->next && s->next->prev != s)) {
            snprintf(buf, len, "invariant 6: pool span %#lx+%zu misplaced or not coalesced",
                     (unsigned long)s->base, s->size);
            bad = -1;
            goto out;
        }
    }
    if (held != p->held || p->held - free_total != atomic_load_explicit(&p->committed, memory_order_relaxed)) {
        snprintf(buf, len, "invariant 4: pool holds %zu (counted %zu), free %zu, committed %zu",
                 p->held, held, free_total, atomic_load_explicit(&p->committed, memory_order_relaxed));
        bad = -1;
    }
out:
    return bad;
}
