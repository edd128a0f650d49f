/*
 * meta.h -- the metadata shim: every host-side allocation of the library
 * (chunk records, regions, arenas, queue nodes) goes through here.
 *
 * With --with-metadata=jemalloc (default) it is served from a dedicated
 * jemalloc arena (mallctl "arenas.create", MALLOCX_ARENA | MALLOCX_TCACHE_NONE),
 * so allocator metadata never shares pages with the application's heap.
 * With --with-metadata=libc it uses malloc/free, which makes a build that can
 * be dlopen()ed into a process that did not start with jemalloc.
 *
 * Slabs: fixed-size records with stable addresses (chunk records).  A slab
 * is not thread-safe: its owner's lock protects it.  A record handed back
 * keeps its memory (slab pages are only released by bfc__slab_destroy), so a
 * lock-free reader holding a stale record pointer reads valid memory; only
 * the first pointer-sized word of a record is overwritten while it is free
 * (the free-list link).
 */
#ifndef BFC_META_H
#define BFC_META_H

#include <string.h>

#include "internal.h"

/* One-time set-up (creates the jemalloc arena).  Thread-safe; idempotent.
 * BFC_OK or BFC_ENOMEM. */
int bfc__meta_init(void);

/* malloc-like; NULL on failure.  Thread-safe. */
void *bfc__meta_alloc(size_t n);
void *bfc__meta_zalloc(size_t n);
void *bfc__meta_aligned_alloc(size_t align, size_t n); /* align: power of two */
void *bfc__meta_realloc(void *p, size_t old_n, size_t new_n);
/* n is the size given at allocation (sized deallocation), or 0 if unknown. */
void bfc__meta_free(void *p, size_t n);
/* Fault injection: every Nth allocation of the shim (alloc, zalloc,
 * aligned_alloc, realloc; process-wide) fails from now on; 0 turns it off.
 * bfc__meta_failures: how many have been failed so far. */
void bfc__meta_fail_every(unsigned n);
uint64_t bfc__meta_failures(void);
/* "jemalloc" or "libc". */
const char *bfc__meta_kind(void);
/* Bytes currently allocated through the shim (all threads). */
size_t bfc__meta_bytes(void);

struct bfc__slab {
    size_t obj_size;  /* rounded up to 16 */
    size_t per_page;  /* records per slab page */
    void *free_list;  /* linked through each free record's first word */
    void *pages;      /* list of slab pages */
    size_t n_live;    /* records handed out */
    size_t n_pages;
};

void bfc__slab_init(struct bfc__slab *s, size_t obj_size);
/* A zeroed record (bar the first word, which is zero too), or NULL. */
void *bfc__slab_get(struct bfc__slab *s);
void bfc__slab_put(struct bfc__slab *s, void *obj);
/* bfc__slab_get's common case, inline, for a slab of records of `size`
 * bytes (the size it was made with, a constant): NULL when the free list is
 * empty, and the caller calls bfc__slab_get, which grows it. */
static inline void *bfc__slab_pop(struct bfc__slab *s, size_t size)
{
    void *obj = s->free_list;
    if (BFC__UNLIKELY(obj == NULL))
        return NULL;
    memcpy(&s->free_list, obj, sizeof(void *));
    memset(obj, 0, (size + 15) & ~(size_t)15);
    s->n_live++;
    return obj;
}
/* Frees every page (records must not be used any more). */
void bfc__slab_destroy(struct bfc__slab *s);

#endif /* BFC_META_H */
