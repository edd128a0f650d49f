/*
 * regionmap.c -- which region holds an address, for every context of the
 * process, without a lock on the read side.
 *
 * The map is a sorted array of [base, end) -> region, published with RCU:
 * readers (every free, every introspection call) binary-search the current
 * array under rcu_read_lock; a writer (a region added or given back, a rare
 * event: regions double in size) copies the array with the change under
 * `wlock`, publishes the copy with a release store and frees the old one
 * after a grace period (call_rcu).  Lookups cost O(log regions).
 *
 * Invariant: entries are sorted by base and the live ones never overlap
 * (regions are disjoint pieces of device memory).  A removal that cannot
 * allocate its copy (metadata exhausted) empties the entry in place instead:
 * a tombstone (end == base) that no lookup returns and that the next copy
 * drops.  A tombstone may share its base with a later region or lie inside
 * one, so a lookup that lands on tombstones steps back over them.  A region
 * whose tail departed shrinks its entry in place (bfc__regionmap_shrink).
 *
 * Departed ranges (regionmap.h) are a second array, published the same
 * way: a departure copies it under `wlock`, lookups binary-search it under
 * rcu_read_lock.
 *
 * Locking: `wlock` is taken under arena locks, never together with the pool
 * lock, and held only for the copies.  Its holder never waits for liburcu:
 * the old array is handed to call_rcu after `wlock` is dropped (see the
 * fork rule in ctx.c), so a fork that holds liburcu's locks and then waits
 * for `wlock` always gets it.
 */
#include <stddef.h>
#include <string.h>

#include "meta.h"
#include "regionmap.h"

/* Published with a release store and read with an acquire load (C11 rather
 * than rcu_assign_pointer, so race detectors see the edge too). */
struct bfc__rmap *_Atomic bfc__rmap_cur;
static bfc__mutex_t wlock = BFC__MUTEX_INIT(BFC__RANK_REGIONMAP, "the region map writer lock");

/* Both published arrays (the map and the departed ranges, below) begin
 * with their rcu_head: one callback frees either after its grace period. */
static void array_free_cb(struct rcu_head *h)
{
    bfc__rcu_reclaim();
    bfc__meta_free(h, 0);
    bfc__rcu_reclaim_done();
}

/* Under wlock: the arrays' generations (bfc__rmap_hint), from 1. */
static uint64_t rmap_gen;

static struct bfc__rmap *rmap_new(size_t n)
{
    struct bfc__rmap *m = bfc__meta_alloc(sizeof(*m) + n * sizeof(m->e[0]));
    if (m) {
        m->n = n;
        m->gen = ++rmap_gen;
    }
    return m;
}

/* Index of the first entry whose base is > p. */
static size_t upper_bound(const struct bfc__rmap *m, uintptr_t p)
{
    size_t lo = 0, hi = m->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (m->e[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Departed ranges (regionmap.h): a sorted array of disjoint ranges,
 * published with RCU as the map is, copied by writers under wlock.  Ranges
 * never overlap: a region inserted over one is cut out of it first (the
 * memory given out again: cut_gone), and a departure's range was a live
 * region's.  `seq`
 * orders departures: when the array is full, the oldest goes.  An entry
 * is erased in place by emptying it (end = base), which needs no copy. */
struct gone_range {
    uintptr_t base, end;  /* end is read and written atomically (erasure) */
    const void *tag;
    uint64_t seq;
    bool one_block;       /* a large block's region: its base only */
};
struct gone_set {
    struct rcu_head rcu;
    size_t n;
    struct gone_range g[];
};
static struct gone_set *_Atomic gone_cur;
static uint64_t gone_seq; /* under wlock */

static bool gone_empty(const struct gone_range *g)
{
    /* relaxed: an erasure (forget_where) only empties an entry; a lookup
     * that still sees it answers as it would have a moment before. */
    return __atomic_load_n(&g->end, __ATOMIC_RELAXED) <= g->base;
}

/* Under wlock: a copy of the set with [base, end) added (erased entries
 * dropped, the oldest too when full), published; returns the old set for
 * the caller to retire once it has dropped wlock (NULL: nothing to
 * retire).  Without metadata for the copy the departure is not recorded:
 * a second free of its blocks then reads as a foreign pointer. */
static struct gone_set *note_gone(uintptr_t base, uintptr_t end, const void *tag, bool one_block)
{
    struct gone_set *old = atomic_load_explicit(&gone_cur, memory_order_relaxed);
    size_t n = 0, oldest = SIZE_MAX;
    for (size_t k = 0; old && k < old->n; k++)
        if (!gone_empty(&old->g[k])) {
            n++;
            if (oldest == SIZE_MAX || old->g[k].seq < old->g[oldest].seq)
                oldest = k;
        }
    if (end <= base)
        return NULL;
    bool drop = n >= BFC__GONE_MAX;
    struct gone_set *next = bfc__meta_alloc(sizeof(*next) + (n + 1 - drop) * sizeof(next->g[0]));
    if (!next)
        return NULL;
    struct gone_range add = { base, end, tag, ++gone_seq, one_block };
    size_t m = 0;
    bool added = false;
    for (size_t k = 0; old && k < old->n; k++) {
        const struct gone_range *g = &old->g[k];
        if (gone_empty(g) || (drop && k == oldest))
            continue;
        if (!added && base < g->base) {
            next->g[m++] = add;
            added = true;
        }
        next->g[m] = *g;
        /* relaxed: under wlock, which every writer of `end` holds. */
        next->g[m].end = __atomic_load_n(&g->end, __ATOMIC_RELAXED);
        m++;
    }
    if (!added)
        next->g[m++] = add;
    next->n = m;
    /* release: pairs with the acquire load in bfc__regionmap_gone (the
     * entries are written before). */
    atomic_store_explicit(&gone_cur, next, memory_order_release);
    return old;
}

/* Under wlock: erases in place the entries that overlap [base, end) (the
 * memory given out again) or, with tag, that tag's. */
static void forget_where(uintptr_t base, uintptr_t end, const void *tag)
{
    struct gone_set *g = atomic_load_explicit(&gone_cur, memory_order_relaxed);
    for (size_t k = 0; g && k < g->n; k++) {
        struct gone_range *e = &g->g[k];
        if (gone_empty(e))
            continue;
        /* release: pairs with no acquire in particular (readers load `end`
         * relaxed, gone_empty); it orders the erasure after the writes
         * that gave the memory out again, for a reader that sees both. */
        if (tag ? e->tag == tag : (e->base < end && base < e->end))
            __atomic_store_n(&e->end, e->base, __ATOMIC_RELEASE);
    }
}

/*
 * Under wlock: [base, end) is given out again (a region inserted over it).
 * A copy of the set is published with that range cut out of every entry:
 * the parts of an entry on either side of it stay (the lower one only, for
 * a large block's entry, whose base is all it answers for, and when a split
 * would take the set past BFC__GONE_MAX).  Returns the old set for the
 * caller to retire once it has dropped wlock (NULL: none overlapped).
 * Without metadata for the copy, the entries it overlaps are erased in
 * place: their blocks' second frees then read as foreign pointers.
 */
static struct gone_set *cut_gone(uintptr_t base, uintptr_t end)
{
    struct gone_set *old = atomic_load_explicit(&gone_cur, memory_order_relaxed);
    size_t n = 0, hit = 0;
    for (size_t k = 0; old && k < old->n; k++) {
        const struct gone_range *g = &old->g[k];
        if (gone_empty(g))
            continue;
        n++;
        /* relaxed: under wlock, which every writer of `end` holds. */
        hit += g->base < end && base < __atomic_load_n(&g->end, __ATOMIC_RELAXED);
    }
    if (hit == 0)
        return NULL;
    struct gone_set *next = bfc__meta_alloc(sizeof(*next) + (n + 1) * sizeof(next->g[0]));
    if (!next) {
        forget_where(base, end, NULL);
        return NULL;
    }
    size_t m = 0;
    for (size_t k = 0; k < old->n; k++) {
        if (gone_empty(&old->g[k]))
            continue;
        struct gone_range e = old->g[k];
        e.end = __atomic_load_n(&old->g[k].end, __ATOMIC_RELAXED);
        if (!(e.base < end && base < e.end)) {
            next->g[m++] = e;
            continue;
        }
        struct gone_range lo = e, hi = e;
        lo.end = base;
        hi.base = end;
        /* Only an entry wholly around [base, end) splits (one at most: the
         * entries are disjoint), which the copy has the slot for. */
        bool has_lo = lo.base < lo.end, has_hi = hi.base < hi.end && !e.one_block;
        if (has_lo)
            next->g[m++] = lo;
        if (has_hi && (!has_lo || n < BFC__GONE_MAX))
            next->g[m++] = hi;
    }
    next->n = m;
    /* release: as in note_gone. */
    atomic_store_explicit(&gone_cur, next, memory_order_release);
    return old;
}

int bfc__regionmap_gone(uintptr_t p, const void *owner, const void **tag)
{
    int st = BFC_ENOTOWNED;
    /* relaxed: a process that never gave memory back has no set (the
     * common case of a foreign pointer costs one load). */
    if (!atomic_load_explicit(&gone_cur, memory_order_relaxed))
        return st;
    bfc__rcu_lock();
    /* acquire: pairs with the release store in note_gone. */
    const struct gone_set *g = atomic_load_explicit(&gone_cur, memory_order_acquire);
    size_t lo = 0, hi = g->n;
    while (lo < hi) { /* the first entry whose base is > p */
        size_t mid = lo + (hi - lo) / 2;
        if (g->g[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo > 0) {
        const struct gone_range *e = &g->g[lo - 1];
        /* relaxed: as in gone_empty. */
        if (p < __atomic_load_n(&e->end, __ATOMIC_RELAXED) && (!owner || e->tag == owner) &&
            (e->one_block ? p == e->base : (p & (BFC__MIN_ALLOC - 1)) == 0)) {
            if (tag)
                *tag = e->tag;
            st = BFC_EDOUBLEFREE;
        }
    }
    bfc__rcu_unlock();
    return st;
}

void bfc__regionmap_forget(const void *tag)
{
    bfc__lock(&wlock);
    forget_where(0, 0, tag);
    bfc__unlock(&wlock);
}

static bool tombstone(const struct bfc__rmap_entry *e)
{
    /* relaxed: see bfc__regionmap_lookup. */
    return __atomic_load_n(&e->end, __ATOMIC_RELAXED) == e->base;
}

__thread struct bfc__rmap_hint bfc__rmap_hint BFC__TLS_IE;

struct bfc__region *bfc__regionmap_lookup_slow(uintptr_t p)
{
    struct bfc__rmap *m = atomic_load_explicit(&bfc__rmap_cur, memory_order_acquire);
    if (!m || m->n == 0)
        return NULL;
    size_t i = upper_bound(m, p);
    while (i > 0 && tombstone(&m->e[i - 1]))
        i--;
    if (i == 0)
        return NULL;
    const struct bfc__rmap_entry *e = &m->e[i - 1];
    if (p >= __atomic_load_n(&e->end, __ATOMIC_RELAXED))
        return NULL;
    bfc__rmap_hint.gen = m->gen;
    bfc__rmap_hint.e = e;
    return e->r;
}

/* Under wlock: readers see `next` from now on.  The caller retires `old`
 * with retire() once it has dropped wlock. */
static void publish(struct bfc__rmap *next)
{
    /* release: pairs with the acquire loads in bfc__regionmap_lookup and
     * bfc__regionmap_count (the copy's entries are written before). */
    atomic_store_explicit(&bfc__rmap_cur, next, memory_order_release);
}

/* Without wlock: frees a replaced array (either kind; NULL: none) after a
 * grace period. */
static void retire(struct rcu_head *old)
{
    _Static_assert(offsetof(struct bfc__rmap, rcu) == 0, "array_free_cb frees the rcu_head's address");
    _Static_assert(offsetof(struct gone_set, rcu) == 0, "array_free_cb frees the rcu_head's address");
    if (old)
        bfc__call_rcu(old, array_free_cb);
}

/* Copies the live entries of old into next, leaving out `skip` (or none)
 * and tombstones, adding `add` (or none) in order.  Returns the count. */
static size_t copy_entries(struct bfc__rmap *next, const struct bfc__rmap *old, const struct bfc__region *skip,
                           const struct bfc__rmap_entry *add)
{
    size_t k = 0;
    bool added = add == NULL;
    for (size_t i = 0; old && i < old->n; i++) {
        const struct bfc__rmap_entry *e = &old->e[i];
        if (!added && add->base < e->base) {
            next->e[k++] = *add;
            added = true;
        }
        if (e->r == skip || tombstone(e))
            continue;
        next->e[k] = *e;
        next->e[k].end = __atomic_load_n(&e->end, __ATOMIC_RELAXED);
        k++;
    }
    if (!added)
        next->e[k++] = *add;
    next->n = k;
    return k;
}

int bfc__regionmap_insert(struct bfc__region *r)
{
    bfc__lock(&wlock);
    struct bfc__rmap *old = atomic_load_explicit(&bfc__rmap_cur, memory_order_relaxed);
    struct bfc__rmap *next = rmap_new((old ? old->n : 0) + 1);
    if (!next) {
        bfc__unlock(&wlock);
        return BFC_ENOMEM;
    }
    struct bfc__rmap_entry add = { r->base, r->base + r->size, r };
    copy_entries(next, old, NULL, &add);
    struct gone_set *old_gone = cut_gone(add.base, add.end);
    publish(next);
    bfc__unlock(&wlock);
    retire(old ? &old->rcu : NULL);
    retire(old_gone ? &old_gone->rcu : NULL);
    return BFC_OK;
}

void bfc__regionmap_remove(struct bfc__region *r, bool used)
{
    bfc__lock(&wlock);
    struct bfc__rmap *old = atomic_load_explicit(&bfc__rmap_cur, memory_order_relaxed);
    size_t i = old ? old->n : 0;
    while (i > 0 && (old->e[i - 1].r != r || tombstone(&old->e[i - 1])))
        i--;
    if (i == 0) {
        bfc__unlock(&wlock);
        return;
    }
    i--;
    struct gone_set *old_gone = used ? note_gone(r->base, r->base + r->size, r->tag, r->large) : NULL;
    struct bfc__rmap *next = rmap_new(old->n - 1);
    if (next) {
        copy_entries(next, old, r, NULL);
        publish(next);
    } else {
        /* Out of metadata memory: a tombstone (see the opening comment), a
         * word-sized store readers see atomically.  release: pairs with no
         * acquire in particular; it orders the store after our earlier
         * writes for readers that go on to read the region. */
        __atomic_store_n(&old->e[i].end, old->e[i].base, __ATOMIC_RELEASE);
        old = NULL; /* still the published array */
    }
    bfc__unlock(&wlock);
    retire(old ? &old->rcu : NULL);
    retire(old_gone ? &old_gone->rcu : NULL);
}

/*
 * In place: the entry's end moves down to r's new end, one word-sized
 * store.  Safe without a copy because the departed tail reaches another
 * region only through the pool, after this store: a later region over that
 * memory is inserted by copying the array, which then holds the new end,
 * and a thread that frees a block of the later region obtained the pointer
 * after that insertion was published.
 */
void bfc__regionmap_shrink(struct bfc__region *r, bool used)
{
    bfc__lock(&wlock);
    struct bfc__rmap *m = atomic_load_explicit(&bfc__rmap_cur, memory_order_relaxed);
    size_t i = m ? upper_bound(m, r->base) : 0;
    while (i > 0 && (m->e[i - 1].r != r || tombstone(&m->e[i - 1])))
        i--;
    struct gone_set *old_gone = NULL;
    if (i > 0) {
        if (used)
            old_gone = note_gone(r->base + r->size, m->e[i - 1].end, r->tag, false);
        __atomic_store_n(&m->e[i - 1].end, r->base + r->size, __ATOMIC_RELEASE);
    }
    bfc__unlock(&wlock);
    retire(old_gone ? &old_gone->rcu : NULL);
}

size_t bfc__regionmap_count(const void *tag)
{
    size_t n = 0;
    bfc__rcu_lock();
    struct bfc__rmap *m = atomic_load_explicit(&bfc__rmap_cur, memory_order_acquire);
    for (size_t i = 0; m && i < m->n; i++)
        /* An emptied entry (a removal that could not copy) may name a
         * region already freed: test the range first. */
        if (__atomic_load_n(&m->e[i].end, __ATOMIC_RELAXED) > m->e[i].base && m->e[i].r->tag == tag)
            n++;
    bfc__rcu_unlock();
    return n;
}

void bfc__regionmap_fork_lock(void)
{
    bfc__lock(&wlock);
}

void bfc__regionmap_fork_unlock(void)
{
    bfc__unlock(&wlock);
}
