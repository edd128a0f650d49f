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
 * Locking: `wlock` is taken under arena locks, never together with the pool
 * lock, and held only for the copy.  Its holder never waits for liburcu:
 * the old array is handed to call_rcu after `wlock` is dropped (see the
 * fork rule in ctx.c), so a fork that holds liburcu's locks and then waits
 * for `wlock` always gets it.
 */
#include <string.h>

#include "meta.h"
#include "regionmap.h"

/* Published with a release store and read with an acquire load (C11 rather
 * than rcu_assign_pointer, so race detectors see the edge too). */
struct bfc__rmap *_Atomic bfc__rmap_cur;
static bfc__mutex_t wlock = BFC__MUTEX_INIT(BFC__RANK_REGIONMAP, "the region map writer lock");

static void rmap_free_cb(struct rcu_head *h)
{
    struct bfc__rmap *m = caa_container_of(h, struct bfc__rmap, rcu);
    bfc__rcu_reclaim();
    bfc__meta_free(m, 0);
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

/* Departed ranges (regionmap.h), a ring under wlock: gone_next is the
 * slot the next departure overwrites. */
static struct gone_range {
    uintptr_t base, end;  /* empty when unused or forgotten */
    const void *tag;
    bool one_block;       /* a large block's region: its base only */
} gone[BFC__GONE_MAX];
static size_t gone_next;

static void note_gone(uintptr_t base, uintptr_t end, const void *tag, bool one_block)
{
    if (end <= base)
        return;
    gone[gone_next] = (struct gone_range){ base, end, tag, one_block };
    gone_next = (gone_next + 1) % BFC__GONE_MAX;
}

/* Memory given out again: what departed there before is no one's now. */
static void forget_range(uintptr_t base, uintptr_t end)
{
    for (size_t k = 0; k < BFC__GONE_MAX; k++)
        if (gone[k].base < end && base < gone[k].end)
            gone[k] = (struct gone_range){ 0 };
}

int bfc__regionmap_gone(uintptr_t p, const void **tag)
{
    int st = BFC_ENOTOWNED;
    bfc__lock(&wlock);
    for (size_t k = 1; k <= BFC__GONE_MAX; k++) {
        const struct gone_range *g = &gone[(gone_next + BFC__GONE_MAX - k) % BFC__GONE_MAX];
        if (p < g->base || p >= g->end)
            continue;
        if (g->one_block ? p == g->base : (p & (BFC__MIN_ALLOC - 1)) == 0) {
            *tag = g->tag;
            st = BFC_EDOUBLEFREE;
        }
        break;
    }
    bfc__unlock(&wlock);
    return st;
}

void bfc__regionmap_forget(const void *tag)
{
    bfc__lock(&wlock);
    for (size_t k = 0; k < BFC__GONE_MAX; k++)
        if (gone[k].tag == tag)
            gone[k] = (struct gone_range){ 0 };
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

/* Without wlock: frees a replaced array after a grace period. */
static void retire(struct bfc__rmap *old)
{
    if (old)
        bfc__call_rcu(&old->rcu, rmap_free_cb);
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
    forget_range(add.base, add.end);
    publish(next);
    bfc__unlock(&wlock);
    retire(old);
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
    if (used)
        note_gone(r->base, r->base + r->size, r->tag, r->large);
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
    retire(old);
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
    if (i > 0) {
        if (used)
            note_gone(r->base + r->size, m->e[i - 1].end, r->tag, false);
        __atomic_store_n(&m->e[i - 1].end, r->base + r->size, __ATOMIC_RELEASE);
    }
    bfc__unlock(&wlock);
}

size_t bfc__regionmap_count(const void *tag)
{
    size_t n = 0;
    bfc__rcu_lock();
    struct bfc__rmap *m = atomic_load_explicit(&bfc__rmap_cur, memory_order_acquire);
    for (size_t i = 0; m && i < m->n; i++)
        /* An emptied entry (a removal that could not copy) may name a
         * region already freed: test the range first. */
        if (m->e[i].end > m->e[i].base && m->e[i].r->tag == tag)
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
