/*
 * region.c -- what a region can answer about itself (region.h).
 *
 * bfc__region_find_containing walks the handle table down from p to the
 * chunk that starts at or below it: an error path (is a bad pointer inside
 * a live block?), called under the owner's lock.
 */
#include "region.h"

struct bfc__chunk *bfc__region_find_containing(struct bfc__region *r, uintptr_t p)
{
    if (p < r->base || p >= r->base + r->size)
        return NULL;
    size_t i = (p - r->base) >> BFC__MIN_ALLOC_BITS;
    if (i >= r->nhandles)
        i = r->nhandles - 1;
    for (;;) {
        struct bfc__chunk *c = atomic_load_explicit(&r->handles[i], memory_order_acquire);
        if (c && c != BFC__HANDLE_GONE)
            return (p >= c->ptr && p < c->ptr + c->size) ? c : NULL;
        if (i == 0)
            return NULL;
        i--;
    }
}
