/*
 * meta.c -- the metadata shim: every host-side allocation of the library.
 *
 * Two builds, chosen by configure (--with-metadata=jemalloc|libc, seen here
 * as the 0/1 macro BFC_META_JEMALLOC):
 *
 *  - jemalloc: one dedicated arena, created once with mallctl("arenas.create")
 *    under pthread_once.  Every call passes MALLOCX_ARENA(ind) together with
 *    MALLOCX_TCACHE_NONE: with the thread's default tcache, jemalloc may serve
 *    an MALLOCX_ARENA request from objects the tcache cached for another arena
 *    (and park ours in it), which would defeat the point of a dedicated arena.
 *    Per-thread explicit tcaches ("tcache.create") would be per-arena safe but
 *    need thread-exit clean-up; the hot metadata (chunk records) comes from
 *    slabs anyway, so the shim stays simple.
 *  - libc: malloc/calloc/posix_memalign/free, so that a build exists that can
 *    be dlopen()ed into a process that did not start with jemalloc (Debian's
 *    libjemalloc replaces malloc and cannot be loaded late).
 *
 * Accounting: bfc__meta_bytes() is the sum of the usable sizes of the blocks
 * outstanding (sallocx / malloc_usable_size), measured at allocation and at
 * free, so it is exact whatever size hint a caller passes to bfc__meta_free.
 * The hint is not used for sized deallocation because an aligned block's size
 * class depends on its alignment, which bfc__meta_free does not know.
 *
 * Slabs (struct bfc__slab): fixed-size records carved from pages of at least
 * 64 KiB (and at least 64 records) obtained from bfc__meta_aligned_alloc.
 * Each page starts with a one-cache-line header linking the slab's pages;
 * free records are linked through their first word.  Pages are only released
 * by bfc__slab_destroy, so a record's address stays valid memory for the life
 * of the slab (lock-free readers may hold stale record pointers).  A slab is
 * not thread-safe: its owner's lock protects it.
 */
#include "meta.h"
#include "mutex.h" /* bfc__nocancel_begin/end */

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if BFC_META_JEMALLOC
#include <jemalloc/jemalloc.h>
#else
#include <malloc.h> /* malloc_usable_size (glibc) */
#endif

/*
 * Bytes outstanding.  Relaxed ordering: the counter is a statistic; no other
 * memory is published through it and nobody decides anything about other
 * data from its value, so only atomicity (no lost updates) is needed.  A
 * thread reading it after its own allocations sees them by program order.
 */
static atomic_size_t meta_bytes;

/*
 * Fault injection (bfc_sim_fail_meta_every): every Nth metadata allocation
 * of the process fails.  Process-wide, because the shim is.  relaxed: test
 * switches and a call counter; nothing is published through them.  The
 * disabled case costs one load per allocation (metadata allocations are off
 * the hot path: chunk records come from slabs).
 */
static atomic_uint meta_fail_every;
static atomic_uint meta_fail_calls;
static _Atomic uint64_t meta_fail_count;

static inline bool meta_fault(void)
{
    unsigned n = atomic_load_explicit(&meta_fail_every, memory_order_relaxed);
    if (BFC__LIKELY(n == 0))
        return false;
    if ((atomic_fetch_add_explicit(&meta_fail_calls, 1, memory_order_relaxed) + 1) % n != 0)
        return false;
    atomic_fetch_add_explicit(&meta_fail_count, 1, memory_order_relaxed);
    return true;
}

void bfc__meta_fail_every(unsigned n)
{
    atomic_store_explicit(&meta_fail_calls, 0, memory_order_relaxed);
    atomic_store_explicit(&meta_fail_every, n, memory_order_relaxed);
}

uint64_t bfc__meta_failures(void)
{
    return atomic_load_explicit(&meta_fail_count, memory_order_relaxed);
}

#if BFC_META_JEMALLOC
static unsigned meta_arena;   /* written once inside pthread_once */
static int meta_init_status;  /* idem */
/*
 * Fast-path flag: set (release) by the once routine after meta_arena is
 * written; loaded (acquire) by every entry point, pairing with that store, so
 * a thread that sees it true also sees meta_arena.
 */
static atomic_bool meta_ready;
static pthread_once_t meta_once = PTHREAD_ONCE_INIT;

static void meta_init_once(void)
{
    unsigned ind = 0;
    size_t sz = sizeof(ind);

    if (mallctl("arenas.create", &ind, &sz, NULL, 0) != 0) {
        meta_init_status = BFC_ENOMEM;
        return;
    }
    meta_arena = ind;
    meta_init_status = BFC_OK;
    atomic_store_explicit(&meta_ready, true, memory_order_release);
}

static inline int meta_flags(void)
{
    return MALLOCX_ARENA(meta_arena) | MALLOCX_TCACHE_NONE;
}
#endif

int bfc__meta_init(void)
{
#if BFC_META_JEMALLOC
    /* acquire: pairs with the release store in meta_init_once. */
    if (BFC__LIKELY(atomic_load_explicit(&meta_ready, memory_order_acquire)))
        return BFC_OK;
    int e = bfc__once(&meta_once, meta_init_once); /* jemalloc's set-up reads files */
    if (e != 0)
        return BFC_ENOMEM;
    /* pthread_once orders the routine's writes before this read. */
    return meta_init_status;
#else
    return BFC_OK;
#endif
}

const char *bfc__meta_kind(void)
{
    return bfc__config_meta_jemalloc ? "jemalloc" : "libc";
}

size_t bfc__meta_bytes(void)
{
    return atomic_load_explicit(&meta_bytes, memory_order_relaxed);
}

static inline void meta_count_add(size_t n)
{
    atomic_fetch_add_explicit(&meta_bytes, n, memory_order_relaxed);
}

static inline void meta_count_sub(size_t n)
{
    atomic_fetch_sub_explicit(&meta_bytes, n, memory_order_relaxed);
}

/* Usable size of a live block of the shim. */
static inline size_t meta_usable(void *p)
{
#if BFC_META_JEMALLOC
    return sallocx(p, meta_flags());
#else
    return malloc_usable_size(p);
#endif
}

void *bfc__meta_alloc(size_t n)
{
    void *p;

    if (BFC__UNLIKELY(meta_fault()))
        return NULL;
    if (n == 0)
        n = 1; /* mallocx(0) is undefined; malloc(0) may return NULL */
#if BFC_META_JEMALLOC
    if (BFC__UNLIKELY(bfc__meta_init() != BFC_OK))
        return NULL;
    p = mallocx(n, meta_flags());
#else
    p = malloc(n);
#endif
    if (p)
        meta_count_add(meta_usable(p));
    return p;
}

void *bfc__meta_zalloc(size_t n)
{
    void *p;

    if (BFC__UNLIKELY(meta_fault()))
        return NULL;
    if (n == 0)
        n = 1;
#if BFC_META_JEMALLOC
    if (BFC__UNLIKELY(bfc__meta_init() != BFC_OK))
        return NULL;
    p = mallocx(n, meta_flags() | MALLOCX_ZERO);
#else
    p = calloc(1, n);
#endif
    if (p)
        meta_count_add(meta_usable(p));
    return p;
}

void *bfc__meta_aligned_alloc(size_t align, size_t n)
{
    void *p = NULL;

    if (align == 0 || (align & (align - 1)) != 0)
        return NULL;
    if (BFC__UNLIKELY(meta_fault()))
        return NULL;
    if (n == 0)
        n = 1;
#if BFC_META_JEMALLOC
    if (BFC__UNLIKELY(bfc__meta_init() != BFC_OK))
        return NULL;
    p = mallocx(n, meta_flags() | MALLOCX_ALIGN(align));
#else
    if (align < sizeof(void *))
        align = sizeof(void *); /* posix_memalign's minimum */
    if (posix_memalign(&p, align, n) != 0)
        p = NULL;
#endif
    if (p)
        meta_count_add(meta_usable(p));
    return p;
}

/*
 * Like realloc: p NULL allocates, new_n 0 frees and returns NULL, failure
 * returns NULL and leaves p allocated.  The alignment of a block from
 * bfc__meta_aligned_alloc is not kept beyond malloc's natural alignment.
 */
void *bfc__meta_realloc(void *p, size_t old_n, size_t new_n)
{
    size_t old_usable;
    void *q;

    if (!p)
        return bfc__meta_alloc(new_n);
    if (new_n == 0) {
        bfc__meta_free(p, old_n);
        return NULL;
    }
    if (BFC__UNLIKELY(meta_fault()))
        return NULL;
    old_usable = meta_usable(p);
#if BFC_META_JEMALLOC
    q = rallocx(p, new_n, meta_flags());
#else
    q = realloc(p, new_n);
#endif
    if (!q)
        return NULL;
    meta_count_sub(old_usable);
    meta_count_add(meta_usable(q));
    return q;
}

void bfc__meta_free(void *p, size_t n)
{
    size_t usable;

    (void)n; /* see the opening comment: sized free needs the alignment too */
    if (!p)
        return;
    usable = meta_usable(p);
    meta_count_sub(usable);
#if BFC_META_JEMALLOC
    /* The usable size is always a valid size for sdallocx. */
    sdallocx(p, usable, meta_flags());
#else
    free(p);
#endif
}

/* ------------------------------------------------------------------ slabs */

#define SLAB_PAGE_MIN ((size_t)64 * 1024)
#define SLAB_MIN_PER_PAGE 64
#define SLAB_HEADER BFC__CACHELINE /* keeps records cache-line placed */

struct slab_page {
    struct slab_page *next;
    size_t bytes;
};

_Static_assert(sizeof(struct slab_page) <= SLAB_HEADER, "slab page header");

void bfc__slab_init(struct bfc__slab *s, size_t obj_size)
{
    size_t sz = bfc__round_up(obj_size < 16 ? 16 : obj_size, 16);
    size_t page;

    memset(s, 0, sizeof(*s));
    s->obj_size = sz; /* 0 after overflow: slab_get then fails */
    if (sz == 0 || sz > (SIZE_MAX - SLAB_HEADER) / SLAB_MIN_PER_PAGE / 2)
        return;
    page = sz * SLAB_MIN_PER_PAGE + SLAB_HEADER;
    if (page < SLAB_PAGE_MIN)
        page = SLAB_PAGE_MIN;
    s->per_page = (page - SLAB_HEADER) / sz;
}

/* Adds a page and threads all its records onto the free list. */
static bool slab_grow(struct bfc__slab *s)
{
    size_t bytes = SLAB_HEADER + s->per_page * s->obj_size;
    struct slab_page *pg;
    char *base;
    void *head;
    size_t i;

    pg = bfc__meta_aligned_alloc(BFC__CACHELINE, bytes);
    if (!pg)
        return true;
    pg->next = s->pages;
    pg->bytes = bytes;
    s->pages = pg;
    s->n_pages++;

    /* Built back to front so that records are handed out in address order. */
    base = (char *)pg + SLAB_HEADER;
    head = s->free_list;
    for (i = s->per_page; i-- > 0;) {
        void *obj = base + i * s->obj_size;
        memcpy(obj, &head, sizeof(head));
        head = obj;
    }
    s->free_list = head;
    return false;
}

void *bfc__slab_get(struct bfc__slab *s)
{
    if (BFC__UNLIKELY(s->per_page == 0))
        return NULL;
    if (!s->free_list && slab_grow(s))
        return NULL;
    return bfc__slab_pop(s, s->obj_size);
}

void bfc__slab_put(struct bfc__slab *s, void *obj)
{
    if (!obj)
        return;
    /* Only the first word changes: stale readers see the rest intact. */
    memcpy(obj, &s->free_list, sizeof(void *));
    s->free_list = obj;
    s->n_live--;
}

void bfc__slab_destroy(struct bfc__slab *s)
{
    struct slab_page *pg = s->pages;

    while (pg) {
        struct slab_page *next = pg->next;

        bfc__meta_free(pg, pg->bytes);
        pg = next;
    }
    s->pages = NULL;
    s->free_list = NULL;
    s->n_pages = 0;
    s->n_live = 0;
}
