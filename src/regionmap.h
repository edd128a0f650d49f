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

/* Process-wide: which region holds an address.  Lookups under
 * rcu_read_lock; updates under a writer mutex (only when regions come or
 * go).  Returns NULL when no region holds p. */
struct bfc__region *bfc__regionmap_lookup(uintptr_t p);
int bfc__regionmap_insert(struct bfc__region *r);
void bfc__regionmap_remove(struct bfc__region *r);
/* r->size shrank (its tail departed): lookups stop resolving the tail. */
void bfc__regionmap_shrink(struct bfc__region *r);
/* Number of regions in the map whose tag is `tag` (bfc_ctx_check). */
size_t bfc__regionmap_count(const void *tag);
/* The writer lock, held across fork (ctx.c). */
void bfc__regionmap_fork_lock(void);
void bfc__regionmap_fork_unlock(void);

#endif /* BFC_REGIONMAP_H */
