/*
 * regionmap.h -- the process-wide region map (regionmap.c): which region
 * holds an address.
 *
 * Lookups run under rcu_read_lock and take no lock; updates (a region added,
 * given back or shrunk: rare) copy the sorted array under the writer lock,
 * rank BFC__RANK_REGIONMAP (mutex.h), and publish the copy.
 */
#ifndef BFC_REGIONMAP_H
#define BFC_REGIONMAP_H

#include "region.h"

/* The map: a sorted array of [base, end) -> region (regionmap.c). */
struct bfc__rmap_entry {
    uintptr_t base, end;
    struct bfc__region *r;
};
struct bfc__rmap {
    struct rcu_head rcu;
    size_t n;
    uint64_t gen;                /* unique per array, never 0 (the hint's key) */
    struct bfc__rmap_entry e[];
};
extern struct bfc__rmap *_Atomic bfc__rmap_cur;

/*
 * The entry the calling thread found last, and the generation of the array
 * it found it in: a thread frees mostly into the regions it allocates from,
 * so the next lookup tries that entry first.  Valid only while that array
 * is still the current one, which its generation tells: an array freed and
 * its address reused by a later one has another generation, so the entry
 * pointer is dereferenced only inside the array it points into (and under
 * the caller's read section, which keeps that array alive).  The entry's
 * range is checked against p; a tombstone's range is empty.  A thread's
 * hint starts zeroed, and no array has generation 0.
 */
struct bfc__rmap_hint {
    uint64_t gen;
    const struct bfc__rmap_entry *e;
};
extern __thread struct bfc__rmap_hint bfc__rmap_hint BFC__TLS_IE;

/* The binary search (regionmap.c); it sets the hint. */
struct bfc__region *bfc__regionmap_lookup_slow(uintptr_t p);

/* Process-wide: which region holds an address.  Lookups under
 * rcu_read_lock; updates under a writer mutex (only when regions come or
 * go).  bfc__regionmap_hit answers from the thread's hint alone (NULL when
 * it does not hold p: ask bfc__regionmap_lookup); bfc__regionmap_lookup
 * returns NULL only when no region holds p. */
static inline struct bfc__region *bfc__regionmap_hit(uintptr_t p)
{
    /* acquire: pairs with the release store that publishes an array. */
    const struct bfc__rmap *m = atomic_load_explicit(&bfc__rmap_cur, memory_order_acquire);
    /* relaxed load of `end`: it changes in place only to shrink (a tail
     * departed, or a tombstone); a reader that sees the old end can only be
     * asked about memory it obtained before the change (see
     * bfc__regionmap_shrink). */
    if (BFC__LIKELY(m != NULL && m->gen == bfc__rmap_hint.gen)) {
        const struct bfc__rmap_entry *e = bfc__rmap_hint.e;
        if (e->base <= p && p < __atomic_load_n(&e->end, __ATOMIC_RELAXED)) {
            if (!e->r)
                __builtin_unreachable(); /* every entry names its region: callers need no test */
            return e->r;
        }
    }
    return NULL;
}
static inline struct bfc__region *bfc__regionmap_lookup(uintptr_t p)
{
    struct bfc__region *r = bfc__regionmap_hit(p);
    return BFC__LIKELY(r != NULL) ? r : bfc__regionmap_lookup_slow(p);
}
int bfc__regionmap_insert(struct bfc__region *r);
/* r leaves the map; with `used` (blocks were cut from it), its range is
 * remembered as departed (below). */
void bfc__regionmap_remove(struct bfc__region *r, bool used);
/* r->size shrank (its tail departed): lookups stop resolving the tail,
 * remembered as departed with `used`. */
void bfc__regionmap_shrink(struct bfc__region *r, bool used);

/*
 * Departed memory: the last BFC__GONE_MAX ranges that left the map after
 * blocks were cut from them and freed (a region given back, a tail shed),
 * with their context, so that a second free of one of those blocks reads
 * as a double free rather than as a pointer the library never gave out.
 * bfc__regionmap_gone classifies a pointer that no region holds: inside a
 * remembered range, at the base of a large block's region (which held that
 * one block) or at any 256-byte boundary of another (the blocks' starts
 * are not kept), BFC_EDOUBLEFREE with *tag (if tag is not NULL) set to its
 * context -- only if that is `owner`, unless owner is NULL; else
 * BFC_ENOTOWNED.  Lock-free (rcu_read_lock inside; one load when nothing
 * ever departed).  A region inserted over part of a departed range (the
 * memory given out again) cuts that part out of it, the rest stays;
 * bfc__regionmap_forget erases a context's
 * (its destruction).  Memory the library gave back to the device and that
 * someone else has obtained since reads as a double free while its range
 * is remembered: the library cannot see it change hands.
 */
#define BFC__GONE_MAX 256
int bfc__regionmap_gone(uintptr_t p, const void *owner, const void **tag);
void bfc__regionmap_forget(const void *tag);
/* Number of regions in the map whose tag is `tag` (bfc_ctx_check). */
size_t bfc__regionmap_count(const void *tag);
/* The writer lock, held across fork (ctx.c). */
void bfc__regionmap_fork_lock(void);
void bfc__regionmap_fork_unlock(void);

#endif /* BFC_REGIONMAP_H */
