/*
 * bins_inline.h -- the bins' three hot operations (insert, remove, best fit)
 * as inline functions, for the arena's fast path (arena_inline.h) and for
 * bins.c, whose bfc__bins_insert / _remove / _best_fit are these, called:
 * on the fast path a call's register saves and argument moves would cost
 * more than some of the operations (make perf-instructions).  The
 * algorithm, its invariants and why a treap: bins.c.
 *
 * Not thread-safe: under the owning arena's lock, as bins.h.
 */
#ifndef BFC_BINS_INLINE_H
#define BFC_BINS_INLINE_H

#include "bins.h"
#include "chunk.h"

#define L(c) ((c)->link.left)
#define R(c) ((c)->link.right)
#define P(c) ((c)->link.parent)

/* A bug inside the library (never user input): reported, then abort(). */
__attribute__((noreturn, cold)) void bfc__bins_bug(const char *what, const struct bfc__chunk *c);
/* Is c in slot k's tree?  A search by its key (debug builds' checks). */
bool bfc__bins_find(const struct bfc__bins *b, uint32_t k, const struct bfc__chunk *c);

/* Key order: a < b by (size, ptr). */
static inline bool bfc__bins_less(const struct bfc__chunk *a, const struct bfc__chunk *b)
{
    return a->size < b->size || (a->size == b->size && a->ptr < b->ptr);
}

static inline struct bfc__chunk *bfc__bins_min(struct bfc__chunk *n)
{
    while (L(n))
        n = L(n);
    return n;
}

/* Puts `to` where `from` hangs below parent p (the root when p is NULL).
 * Only the downward link: the caller sets to's parent. */
static inline void bfc__bins_replace_child(struct bfc__chunk **root, struct bfc__chunk *p, struct bfc__chunk *from,
                                           struct bfc__chunk *to)
{
    if (!p)
        *root = to;
    else if (L(p) == from)
        L(p) = to;
    else
        R(p) = to;
}

/* Makes child x take its parent's place (one rotation), fixing all links. */
static inline void bfc__bins_rotate_up(struct bfc__chunk **root, struct bfc__chunk *x)
{
    struct bfc__chunk *p = P(x), *g = P(p), *mid;

    if (L(p) == x) {
        mid = R(x);
        L(p) = mid;
        R(x) = p;
    } else {
        mid = L(x);
        R(p) = mid;
        L(x) = p;
    }
    if (mid)
        P(mid) = p;
    P(p) = x;
    P(x) = g;
    bfc__bins_replace_child(root, g, p, x);
}

static inline __attribute__((always_inline)) void bfc__bins_insert_inline(struct bfc__bins *b, struct bfc__chunk *c)
{
    uint32_t k = bfc__bin_slot(c->size);
    struct bfc__chunk **root = &b->root[k];
    struct bfc__chunk *parent = NULL, **slot = root;

    if (bfc__config_debug && c->link.slot != BFC__NO_SLOT)
        bfc__bins_bug("insert of a chunk already in a bin", c);

    /* Plain BST insert at a leaf ... */
    while (*slot) {
        parent = *slot;
        if (bfc__config_debug && parent->size == c->size && parent->ptr == c->ptr)
            bfc__bins_bug("insert of a duplicate key", c);
        slot = bfc__bins_less(c, parent) ? &L(parent) : &R(parent);
    }
    L(c) = NULL;
    R(c) = NULL;
    P(c) = parent;
    c->link.slot = k;
    *slot = c;

    /* ... then rotate up until the heap property holds again. */
    while (P(c) && c->link.prio > P(c)->link.prio)
        bfc__bins_rotate_up(root, c);

    b->slot_map[k >> 6] |= UINT64_C(1) << (k & 63);
    b->n++;
}

/* Removes c, which is in a bin (best fit's answer: no test of its slot). */
static inline __attribute__((always_inline)) void bfc__bins_remove_binned_inline(struct bfc__bins *b,
                                                                                struct bfc__chunk *c)
{
    uint32_t k = c->link.slot;

    if (bfc__config_debug && (k >= BFC__NUM_SLOTS || !bfc__bins_find(b, k, c)))
        bfc__bins_bug("remove of a chunk missing from its slot's tree", c);

    struct bfc__chunk **root = &b->root[k];

    /* Rotate c down (its higher-priority child up) until it has <= 1 child. */
    while (L(c) && R(c))
        bfc__bins_rotate_up(root, L(c)->link.prio > R(c)->link.prio ? L(c) : R(c));

    struct bfc__chunk *child = L(c) ? L(c) : R(c), *p = P(c);
    if (child)
        P(child) = p;
    bfc__bins_replace_child(root, p, c, child);

    /* c's tree links stay as they were: nothing reads them out of a tree,
     * and the next insert sets all three. */
    c->link.slot = BFC__NO_SLOT;

    b->n--;
    if (!*root)
        b->slot_map[k >> 6] &= ~(UINT64_C(1) << (k & 63));
}

static inline __attribute__((always_inline)) void bfc__bins_remove_inline(struct bfc__bins *b, struct bfc__chunk *c)
{
    if (BFC__UNLIKELY(c->link.slot >= BFC__NUM_SLOTS)) {
        if (bfc__config_debug)
            bfc__bins_bug("remove of a chunk not in a bin", c);
        return;
    }
    bfc__bins_remove_binned_inline(b, c);
}

static inline __attribute__((always_inline)) struct bfc__chunk *bfc__bins_best_fit_inline(const struct bfc__bins *b,
                                                                                     size_t rounded)
{
    uint32_t k = bfc__bin_slot(rounded);
    struct bfc__chunk *n = b->root[k], *best = NULL;

    /*
     * lower_bound((rounded, 0)): (size, ptr) >= (rounded, 0) iff size >= rounded.
     * Plain branches on purpose: a branch-free descent (cmov, computed child)
     * halves mispredictions but serialises the loads, and measured slower
     * here, worst with a cold 100 000-chunk tree where speculation prefetches.
     */
    while (n) {
        if (n->size >= rounded) {
            best = n;
            n = L(n);
        } else {
            n = R(n);
        }
    }
    if (best)
        return best;

    /* Every chunk of a higher slot is larger than any size of slot k: the
     * minimum of the next non-empty slot, from the slot map (slots above k
     * in k's word, then the next words; 4 bins to a word). */
    uint32_t w = k >> 6;
    uint64_t m = b->slot_map[w] & (~UINT64_C(1) << (k & 63));
    while (!m) {
        if (++w == BFC__SLOT_WORDS)
            return NULL;
        m = b->slot_map[w];
    }
    return bfc__bins_min(b->root[(w << 6) | (uint32_t)__builtin_ctzll(m)]);
}


#undef L
#undef R
#undef P

#endif /* BFC_BINS_INLINE_H */
