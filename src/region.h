/*
 * region.h -- a region: one piece of device memory handed to one arena (a
 * shard) by the context's region pool.
 *
 * Its owner cuts it into chunks (chunk.h) and keeps, per 256 bytes, a
 * handle-table entry: the chunk record that starts there.  The region map
 * (regionmap.h) finds the region of any pointer without a lock; the handle
 * table then finds the chunk, so a cross-stream free reaches its chunk
 * without taking the owner's lock.  Every field but the handle table is the
 * owner's (written under its lock); handle entries are published with
 * release stores and read with acquire loads.  A region never changes
 * owner: when it goes back to the pool a new record is made for its memory.
 * `tag` names the context that made it (only counted by regionmap.c).
 */
#ifndef BFC_REGION_H
#define BFC_REGION_H

#include "rcu.h"

#include <urcu/list.h>

#include "chunk.h"
#include "pool.h"

struct bfc__arena;

/* A handle-table entry: a chunk record at a chunk start, NULL where no chunk
 * ever started, or BFC__HANDLE_GONE where a chunk started once and has since
 * been merged into its predecessor (tells a double free from a foreign
 * pointer). */
#define BFC__HANDLE_GONE ((struct bfc__chunk *)(uintptr_t)1)

struct bfc__region {
    uintptr_t base;
    size_t size;                 /* shrinks when a free tail departs (owner's lock) */
    /* The context that made it, opaque below the context layer: the
     * region map counts by it, the API finds a pointer's context by it. */
    void *tag;
    /* Written once when the region is created; a region never changes owner
     * (it goes back to the pool and a new region record is made). */
    struct bfc__arena *owner;
    /* One entry per 256 bytes; mapped (MAP_NORESERVE) so that untouched
     * pages cost nothing; written under the owner's lock, read lock-free by
     * cross-stream frees (release stores pair with acquire loads). */
    struct bfc__chunk *_Atomic *handles;
    size_t nhandles;
    size_t handles_bytes;
    struct bfc__segment *seg;    /* pool segment it is carved from */
    bool large;                  /* a large request's own region */
    bool vmm;                    /* an expandable arena's reservation (expand.h) */
    bool gone;                   /* given back to the pool (owner's lock) */
    size_t live;                 /* chunks not FREE (owner's lock) */
    /* Memory at and above it was never handed out (all of it, for a
     * region taken back under a fence): a free tail departs unfenced there
     * (owner's lock).  Best fit cuts blocks from the front of chunks, so
     * never-used memory is a suffix of the last chunk, and this moves only
     * when that chunk is cut for a block or, handed out whole, released
     * (arena_inline.h) -- a bound above the highest block's end, kept off
     * the common path. */
    uintptr_t used_end;
    struct bfc__chunk *tail;     /* last chunk in address order (owner's lock) */
    /* The records its departure needs, reserved when it was made, so that
     * giving it back to the pool never fails. */
    struct bfc__pool_ticket ticket;
    struct cds_list_head alink;  /* in the owner's regions (owner's lock) */
    struct rcu_head rcu;
};

/* Chunk record starting exactly at p in r, or NULL / BFC__HANDLE_GONE. */
static inline struct bfc__chunk *bfc__region_handle(struct bfc__region *r, uintptr_t p)
{
    size_t i = (p - r->base) >> BFC__MIN_ALLOC_BITS;
    if (i >= r->nhandles)
        return NULL;
    /* acquire: pairs with the release store that published the chunk's
     * fields in bfc__region_set_handle. */
    return atomic_load_explicit(&r->handles[i], memory_order_acquire);
}

static inline void bfc__region_set_handle(struct bfc__region *r, uintptr_t p, struct bfc__chunk *c)
{
    size_t i = (p - r->base) >> BFC__MIN_ALLOC_BITS;
    atomic_store_explicit(&r->handles[i], c, memory_order_release);
}

/* Chunk of a region p lies in (error path, owner's lock; region.c). */
struct bfc__chunk *bfc__region_find_containing(struct bfc__region *r, uintptr_t p);

#endif /* BFC_REGION_H */
