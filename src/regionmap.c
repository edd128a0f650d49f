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
 * Invariant: entries are sorted by base and never overlap (regions are
 * disjoint pieces of device memory).
 *
 * Locking: `wlock` is innermost in the lock order (taken under the pool lock
 * and under arena locks) and held only for the copy.  Its holder never waits
 * for liburcu: the old array is handed to call_rcu after `wlock` is dropped
 * (see the fork rule in ctx.c), so a fork that holds liburcu's locks and then
 * waits for `wlock` always gets it.
 */
#include <string.h>

#include "ctx.h"

struct rmap_entry {
    uintptr_t base, end;
    struct bfc__region *r;
};

struct rmap {
    struct rcu_head rcu;
    size_t n;
    struct rmap_entry e[];
};

/* Published with a release store and read with an acquire load (C11 rather
 * than rcu_assign_pointer, so race detectors see the edge too). */
static struct rmap *_Atomic rmap_cur;
char bfc__rcu_sync;
static pthread_mutex_t wlock = PTHREAD_MUTEX_INITIALIZER;

static void rmap_free_cb(struct rcu_head *h)
{
    struct rmap *m = caa_container_of(h, struct rmap, rcu);
    bfc__rcu_reclaim();
    bfc__meta_free(m, 0);
    bfc__rcu_reclaim_done();
}

static struct rmap *rmap_new(size_t n)
{
    struct rmap *m = bfc__meta_alloc(sizeof(*m) + n * sizeof(m->e[0]));
    if (m)
        m->n = n;
    return m;
}

/* Index of the first entry whose base is > p. */
static size_t upper_bound(const struct rmap *m, uintptr_t p)
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

struct bfc__region *bfc__regionmap_lookup(uintptr_t p)
{
    struct rmap *m = atomic_load_explicit(&rmap_cur, memory_order_acquire);
    if (!m || m->n == 0)
        return NULL;
    size_t i = upper_bound(m, p);
    if (i == 0)
        return NULL;
    const struct rmap_entry *e = &m->e[i - 1];
    return p < e->end ? e->r : NULL;
}

/* Under wlock: readers see `next` from now on.  The caller retires `old`
 * with retire() once it has dropped wlock. */
static void publish(struct rmap *next)
{
    /* release: pairs with the acquire loads in bfc__regionmap_lookup and
     * bfc__regionmap_count (the copy's entries are written before). */
    atomic_store_explicit(&rmap_cur, next, memory_order_release);
}

/* Without wlock: frees a replaced array after a grace period. */
static void retire(struct rmap *old)
{
    if (old)
        bfc__call_rcu(&old->rcu, rmap_free_cb);
}

int bfc__regionmap_insert(struct bfc__region *r)
{
    bfc__lock(&wlock);
    struct rmap *old = atomic_load_explicit(&rmap_cur, memory_order_relaxed);
    size_t n = old ? old->n : 0;
    struct rmap *next = rmap_new(n + 1);
    if (!next) {
        bfc__unlock(&wlock);
        return BFC_ENOMEM;
    }
    size_t i = old ? upper_bound(old, r->base) : 0;
    if (i)
        memcpy(next->e, old->e, i * sizeof(next->e[0]));
    next->e[i] = (struct rmap_entry){ r->base, r->base + r->size, r };
    if (n > i)
        memcpy(&next->e[i + 1], &old->e[i], (n - i) * sizeof(next->e[0]));
    publish(next);
    bfc__unlock(&wlock);
    retire(old);
    return BFC_OK;
}

void bfc__regionmap_remove(struct bfc__region *r)
{
    /* A removal that cannot copy (no memory) must still unpublish the
     * region, so it edits in place under the grace-period rule: readers may
     * see either the old or the new array, never a torn entry, because the
     * fallback publishes a fresh, smaller array or, failing that, leaves the
     * entry pointing at a region whose memory stays valid until call_rcu. */
    bfc__lock(&wlock);
    struct rmap *old = atomic_load_explicit(&rmap_cur, memory_order_relaxed);
    if (!old) {
        bfc__unlock(&wlock);
        return;
    }
    size_t i = upper_bound(old, r->base);
    if (i == 0 || old->e[i - 1].r != r) {
        bfc__unlock(&wlock);
        return;
    }
    i--;
    struct rmap *next = rmap_new(old->n - 1);
    if (next) {
        memcpy(next->e, old->e, i * sizeof(next->e[0]));
        memcpy(&next->e[i], &old->e[i + 1], (old->n - i - 1) * sizeof(next->e[0]));
        publish(next);
    } else {
        /* Out of metadata memory: shrink the entry to an empty range so no
         * lookup can return it (a word-sized store readers see atomically). */
        __atomic_store_n(&old->e[i].end, old->e[i].base, __ATOMIC_RELEASE);
        old = NULL; /* still the published array */
    }
    bfc__unlock(&wlock);
    retire(old);
}

size_t bfc__regionmap_count(struct bfc_ctx *ctx)
{
    size_t n = 0;
    bfc__rcu_lock();
    struct rmap *m = atomic_load_explicit(&rmap_cur, memory_order_acquire);
    for (size_t i = 0; m && i < m->n; i++)
        if (m->e[i].r->ctx == ctx && m->e[i].end > m->e[i].base)
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
