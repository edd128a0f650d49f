/*
 * chunk.h -- the chunk record: one contiguous piece of a region, wholly free
 * or wholly in use.
 *
 * The chunks of a region cover it without gaps, linked in address order
 * (prev/next).  Records come from the owning arena's slab (meta.h), so their
 * addresses are stable for the life of the arena; the region's handle table
 * maps the start of each chunk to its record.
 *
 * Who touches what: every field is written only under the owning arena's
 * lock, except `state`, which a cross-stream free moves from INUSE to FREEING
 * with a compare-and-swap without that lock (the claim that makes exactly one
 * of two racing frees win).
 */
#ifndef BFC_CHUNK_H
#define BFC_CHUNK_H

#include "bins.h"

enum bfc__chunk_state {
    BFC__CHUNK_FREE = 0,   /* in a bin (or, transiently, being merged) */
    BFC__CHUNK_INUSE = 1,  /* handed out */
    BFC__CHUNK_FREEING = 2,/* claimed by a cross-stream free, in the owner's queue */
    BFC__CHUNK_PENDING = 3 /* freed, waiting for its fences; never merged or reused */
};

/* flags */
#define BFC__CF_RETURNED 1u  /* this start address was handed to a user once */
/* Some of these bytes may have been used by the owner stream's work since
 * its shard took them from the pool (handed out once, or taken back from
 * the pool under the stream's own departure fence).  Merges and splits pass
 * it on; memory that leaves the shard without it needs no departure fence. */
#define BFC__CF_USED 2u

struct bfc__region;
struct bfc__recorded;

struct bfc__chunk {
    /* First cache line: what best fit and the bins' tree walk touch. */
    void *slab_link;               /* first word: the slab's free-list link */
    uintptr_t ptr;                 /* start address (256-aligned) */
    size_t size;                   /* multiple of 256 */
    struct bfc__bin_link link;     /* bins.c */
    _Atomic uint32_t state;        /* enum bfc__chunk_state */
    uint32_t flags;
    /* Second line: the rest of the record. */
    alignas(BFC__CACHELINE) size_t requested; /* size asked for while in use, else 0 */
    int64_t alloc_id;              /* while in use, else -1 */
    struct bfc__chunk *prev, *next;/* address-ordered neighbours in the region */
    struct bfc__region *region;
    struct bfc__recorded *recorded;/* streams named by record_stream */
};

/* Free or pending: held by no block, and one piece with idle neighbours
 * once the pending fences complete (the OOM report's runs).  Under the
 * owning arena's lock.  relaxed: the one move made without that lock,
 * INUSE -> FREEING, is "not idle" on both sides. */
static inline bool bfc__chunk_idle(const struct bfc__chunk *c)
{
    uint32_t st = atomic_load_explicit(&c->state, memory_order_relaxed);
    return st == BFC__CHUNK_FREE || st == BFC__CHUNK_PENDING;
}

#endif /* BFC_CHUNK_H */
