/*
 * arena_inline.h -- the arena's two fast-path operations as inline
 * functions: the allocation from the bins (bfc__arena_alloc_inline) and the
 * same-stream free of a live chunk (bfc__arena_free_chunk_inline), with the
 * steps they share with the rest of arena.c (split, take, release).  ctx.c
 * inlines them into bfc_ctx_alloc and the same-stream free; arena.c calls
 * the shared steps through out-of-line wrappers (take_chunk, release_chunk)
 * on its other paths.  As calls from ctx.c into arena.c they cost two sets
 * of register saves and argument moves per alloc+free pair (make
 * perf-instructions shows the difference).
 *
 * What is rare stays out of line, in arena.c: an expandable arena's chunk
 * on granules that are not mapped (bfc__arena_take_vmm), poison checks,
 * merges, a region's departure, fenced frees.  The algorithm and its rules
 * (split, coalescing, departures): arena.c.
 *
 * Not thread-safe: everything here runs under the arena's lock, as arena.h.
 */
#ifndef BFC_ARENA_INLINE_H
#define BFC_ARENA_INLINE_H

#include <string.h>

#include "arena.h"
#include "bins_inline.h"

/* The out-of-line parts (arena.c). */
struct bfc__chunk *bfc__arena_take_vmm(struct bfc__arena *a, struct bfc__chunk *c, size_t rounded);
__attribute__((cold)) void bfc__arena_poison_verify(struct bfc__arena *a, struct bfc__chunk *c);
/* Merges n (free, following c) into c. */
void bfc__arena_merge(struct bfc__arena *a, struct bfc__chunk *c, struct bfc__chunk *n);
/* Gives a fully free region back to the pool (arena.c, "Departures"). */
void bfc__arena_region_depart(struct bfc__arena *a, struct bfc__region *r, bool fence);
/* The free of a chunk with recorded streams: fenced, or released at once
 * when every stream recorded was the owner's own. */
void bfc__arena_free_recorded_locked(struct bfc__arena *a, struct bfc__chunk *c);

/* A fresh (zeroed) record's fields that are not zero, and the count. */
static inline void bfc__arena_chunk_init(struct bfc__arena *a, struct bfc__chunk *c)
{
    c->link.slot = BFC__NO_SLOT;
    c->alloc_id = -1;
    a->st.chunks++;
}

/* A chunk record from the arena's slab; NULL when metadata is exhausted. */
static inline struct bfc__chunk *bfc__arena_chunk_new(struct bfc__arena *a)
{
    struct bfc__chunk *c = bfc__slab_get(&a->chunk_slab);
    if (!c)
        return NULL;
    bfc__arena_chunk_init(a, c);
    return c;
}

static inline void bfc__arena_account_alloc(struct bfc__arena *a, struct bfc__chunk *c, size_t n)
{
    struct bfc__astats *st = &a->st;
    st->num_allocs++;
    st->bytes_in_use += c->size;
    if (st->bytes_in_use > st->peak_in_use)
        st->peak_in_use = st->bytes_in_use;
    st->bytes_requested += n;
    if (st->bytes_requested > st->peak_requested)
        st->peak_requested = st->bytes_requested;
    /* TensorFlow counts the chunk size as the largest allocation. */
    if (c->size > st->largest_alloc)
        st->largest_alloc = c->size;
}

static inline void bfc__arena_account_free(struct bfc__arena *a, struct bfc__chunk *c)
{
    a->st.num_frees++;
    a->st.bytes_in_use -= c->size;
    a->st.bytes_requested -= c->requested;
}

/* TensorFlow's split rule: a chunk handed out for `rounded` bytes is cut
 * when it is at least twice that, or when the leftover reaches max_frag;
 * otherwise the whole chunk is used. */
static inline bool bfc__arena_should_split(const struct bfc__arena *a, const struct bfc__chunk *c,
                                           size_t rounded)
{
    return c->size >= 2 * rounded || c->size - rounded >= a->env->max_frag;
}

/* Splits c so that it keeps `rounded` bytes, with the new record n (from
 * bfc__arena_chunk_new) for the leftover after it, which goes to the bins. */
static inline __attribute__((always_inline)) void bfc__arena_split_with(struct bfc__arena *a, struct bfc__chunk *c,
                                                                        struct bfc__chunk *n, size_t rounded)
{
    n->ptr = c->ptr + rounded;
    n->link.prio = bfc__bins_prio(n->ptr);
    n->size = c->size - rounded;
    n->region = c->region;
    n->flags = c->flags & BFC__CF_USED;
    n->prev = c;
    n->next = c->next;
    if (c->next) {
        c->next->prev = n;
    } else {
        /* c is its region's last chunk, cut for a block: the region's
         * used memory reaches the block's end (region.h, used_end; the
         * other way it grows is the last chunk handed out whole, which its
         * release notes). */
        c->region->tail = n;
        if (c->ptr + rounded > c->region->used_end) /* never lowered: c may have been used whole */
            c->region->used_end = c->ptr + rounded;
    }
    c->next = n;
    c->size = rounded;
    bfc__region_set_handle(c->region, n->ptr, n);
    bfc__bins_insert_inline(&a->bins, n);
}

/* The same with a record of its own; false (c unchanged) if none is left. */
static inline __attribute__((always_inline)) bool bfc__arena_split(struct bfc__arena *a, struct bfc__chunk *c,
                                                                   size_t rounded)
{
    struct bfc__chunk *n = bfc__arena_chunk_new(a);
    if (!n)
        return false;
    bfc__arena_split_with(a, c, n, rounded);
    return true;
}

/* The last steps of a take: c, out of the bins and cut to size, is handed
 * out for a request of n bytes (the caller has made sure that an
 * allocation id is left, a->next_id < a->id_end). */
static inline __attribute__((always_inline)) void *bfc__arena_hand_out(struct bfc__arena *a, struct bfc__chunk *c,
                                                                       size_t n)
{
    c->requested = n;
    c->alloc_id = a->next_id++;
    c->flags |= BFC__CF_RETURNED | BFC__CF_USED;
    c->region->live++;
    a->live++;
    /* release: pairs with the acquire CAS of a cross-stream free, which
     * must see ptr/region of this chunk once it sees INUSE. */
    atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
    bfc__arena_account_alloc(a, c, n);
    return (void *)c->ptr;
}

/* Hands out free chunk c (in a bin or just made) for a request of n bytes
 * (rounded): split by TensorFlow's rule, marked live, counted.  NULL only
 * when an expandable arena cannot map the granules under it. */
static inline __attribute__((always_inline)) void *bfc__arena_take_inline(struct bfc__arena *a,
                                                                          struct bfc__chunk *c, size_t rounded,
                                                                          size_t n)
{
    /* An expandable arena's chunk wholly on ready granules takes the
     * classic way: bfc__arena_take_vmm's rules differ only where granules
     * are not. */
    if (BFC__UNLIKELY(a->x != NULL) && !bfc__expand_backed(a->x, c->ptr + c->size)) {
        if (!bfc__arena_take_vmm(a, c, rounded))
            return NULL;
    } else {
        if (c->link.slot != BFC__NO_SLOT)
            bfc__bins_remove_inline(&a->bins, c);
        if (!c->region->large && bfc__arena_should_split(a, c, rounded))
            (void)bfc__arena_split(a, c, rounded); /* without a record the whole chunk is used */
    }
    if (BFC__UNLIKELY(a->env->poison))
        bfc__arena_poison_verify(a, c);
    if (BFC__UNLIKELY(a->next_id == a->id_end))
        bfc__arena_ids_refill(a);
    return bfc__arena_hand_out(a, c, n);
}

/* The first steps of a release: from here on the chunk is free. */
static inline void bfc__arena_release_mark(struct bfc__arena *a, struct bfc__chunk *c)
{
    atomic_store_explicit(&c->state, BFC__CHUNK_FREE, memory_order_relaxed);
    c->requested = 0;
    c->alloc_id = -1;
    c->region->live--;
    a->live--;
}

/* After a release that left region r with `live` live chunks: is there more
 * to do than the bins (a retired shard's region left empty, an expandable
 * arena's decay)?  bfc__arena_release_followup (arena.c) does it, when and
 * only when this says so. */
static inline bool bfc__arena_release_followup_due(struct bfc__arena *a, const struct bfc__region *r)
{
    /* A retired shard keeps nothing it does not need. */
    return (r->live == 0 && atomic_load_explicit(&a->retired, memory_order_relaxed)) ||
           (BFC__UNLIKELY(r->vmm) &&
            (a->st.bytes_in_use < a->x->low_water || a->st.num_allocs >= a->x->decay_at));
}
void bfc__arena_release_followup(struct bfc__arena *a, struct bfc__region *r);

/* Is c's neighbour n free (to merge with)? */
static inline bool bfc__arena_free_neighbour(const struct bfc__chunk *n)
{
    return n && atomic_load_explicit(&n->state, memory_order_relaxed) == BFC__CHUNK_FREE;
}

/* The block's memory is reusable now: back to the bins, coalesced. */
static inline __attribute__((always_inline)) void bfc__arena_release_inline(struct bfc__arena *a,
                                                                            struct bfc__chunk *c)
{
    struct bfc__region *r = c->region;
    const struct bfc__arena_env *env = a->env;
    bfc__arena_release_mark(a, c);
    if (BFC__UNLIKELY(env->poison))
        memset((void *)c->ptr, 0xDB, c->size);
    if (r->large) {
        bfc__arena_region_depart(a, r, true);
        return;
    }
    struct bfc__chunk *n = c->next;
    if (!n) /* the last chunk, handed out whole: all of the region was used */
        r->used_end = c->ptr + c->size;
    else if (bfc__arena_free_neighbour(n)) {
        bfc__bins_remove_inline(&a->bins, n);
        bfc__arena_merge(a, c, n);
    }
    struct bfc__chunk *p = c->prev;
    if (bfc__arena_free_neighbour(p)) {
        bfc__bins_remove_inline(&a->bins, p);
        bfc__arena_merge(a, p, c);
        c = p;
    }
    bfc__bins_insert_inline(&a->bins, c);
    if (bfc__arena_release_followup_due(a, r))
        bfc__arena_release_followup(a, r);
}

/* Local free of a live chunk c (validated and claimed by the caller). */
static inline __attribute__((always_inline)) void bfc__arena_free_chunk_inline(struct bfc__arena *a,
                                                                               struct bfc__chunk *c)
{
    bfc__arena_account_free(a, c);
    if (BFC__UNLIKELY(atomic_load_explicit((struct bfc__recorded *_Atomic *)&c->recorded, memory_order_relaxed) !=
                      NULL))
        bfc__arena_free_recorded_locked(a, c);
    else
        bfc__arena_release_inline(a, c);
}

/*
 * The allocation fast path: drains the remote queue when it is not empty,
 * then takes the best fit from the bins.  NULL when nothing fits (or the
 * request is large).
 */
static inline __attribute__((always_inline)) void *bfc__arena_alloc_inline(struct bfc__arena *a, size_t n,
                                                                           size_t rounded)
{
    const struct bfc__arena_env *env = a->env;
    /* st.pending counts the pending list: a test of one word, cheaper here
     * than cds_list_empty's compare with the head's address. */
    if (bfc__arena_rq_waiting(a) || a->st.pending)
        bfc__arena_drain_locked(a, false);
    if (BFC__LIKELY(rounded < env->bins_max)) {
        struct bfc__chunk *c = bfc__bins_best_fit_inline(&a->bins, rounded);
        if (BFC__LIKELY(c != NULL))
            return bfc__arena_take_inline(a, c, rounded, n);
    }
    return NULL;
}

#endif /* BFC_ARENA_INLINE_H */
