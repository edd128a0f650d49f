/*
 * bins.c -- the free-chunk index of one BFC arena: 21 size-class bins, each an
 * intrusive treap, plus a bitmap of the non-empty bins.
 *
 * What it does.  Bin i holds the free chunks whose size lies in
 * [256*2^i, 256*2^(i+1)) (bin 20 open-ended), as TensorFlow's bins do; the
 * bins' counts and bytes, which stats and dumps show, are counted by a walk
 * (bfc__bins_tally), the fast path keeping one counter.  Each bin is cut into
 * 16 slots of equal width (bfc__bin_slot, bins.h), and inside a slot the
 * chunks form a binary search tree ordered by the key (size ascending, ptr
 * ascending), so an in-order walk of the slots in turn visits a bin's chunks
 * smallest first and, among equal sizes, lowest address first.  Best fit for
 * a rounded size r is then the lower bound of the key (r, 0) in
 * bfc__bin_slot(r) -- the first chunk with size >= r, which is the smallest
 * sufficient size at its lowest address -- and, when that slot has none, the
 * minimum of the first non-empty slot above it, found with a find-first-set
 * on the slot map (one bit per slot, 64 to a word: the rest of k's word,
 * then the next of the six words).  Nothing ever scans a bin.  The result is TensorFlow's best
 * fit exactly; the slots only make the trees smaller: a tree of one slot
 * holds about a sixteenth of a bin, so the descents of insert and best fit
 * are about 2 ln 16 = 5.5 levels shorter, and each level is a key
 * comparison the CPU mispredicts about half the time.  On perf/pairs (1000
 * live blocks, 256 B .. 1 MiB) that took mispredicted branches per
 * alloc+free pair from 7.6 to 3.8 (cachegrind --branch-sim) and the pair
 * from about 105 to 80 ns, at the same instruction count; 8 slots gave 4.6,
 * and 32 gave 5.4, since a slot that small more often holds no fit and the
 * search moves on to the next slot's minimum.  The price is 336 root
 * pointers and a 336-bit slot map per arena.  (The map was a 16-bit map per
 * bin under a 21-bit map of the bins, two words to set or clear on an insert
 * or a remove; one flat map of slots is one, 11 instructions fewer per
 * alloc+free pair, make perf-instructions.)
 *
 * Why a treap.  A treap keeps a BST by key and a max-heap by a priority per
 * node; with priorities that behave like independent random numbers its shape
 * is that of a random BST, so every operation costs expected O(log n) (depth
 * about 2 ln n: ~23 for 100 000 chunks) and an insert or remove does expected
 * O(1) rotations.  The priority is a fixed 64-bit finaliser (murmur3's fmix64)
 * of the chunk's address, so the structure is fully deterministic -- the same
 * sequence of operations builds the same trees, which keeps the allocator's
 * "same allocations give the same addresses" property and makes failures
 * reproducible -- while the arena's choices of sizes and addresses have no
 * relation to the hash.  It needs far less code than a red-black tree, and the
 * heap property is trivially checkable in bfc__bins_verify.  Every loop is
 * iterative (parent pointers), so nothing recurses.
 *
 * Invariants (all checked by bfc__bins_verify):
 *  - each slot's tree is a BST by (size, ptr) with strictly increasing keys;
 *    root->parent == NULL and child->parent is the node above it;
 *  - heap: a child's link.prio <= its parent's, and link.prio == prio(ptr)
 *    (set by whoever sets a record's ptr: bfc__bins_prio, bins.h);
 *  - a chunk in slot k's tree has link.slot == k and bfc__bin_slot(size) == k;
 *  - n is the number of chunks in all slots; bit k of the slot map is set
 *    iff slot k has chunks, and the map's bits past the last slot are clear.
 *  A chunk not in any bin has link.slot == BFC__NO_SLOT.  bfc__bins_init
 *  touches no chunk: whoever creates a chunk record zeroes it and sets
 *  link.slot = BFC__NO_SLOT before its first insert; bfc__bins_remove resets
 *  it (and leaves the tree links stale: insert sets them).  In debug builds (bfc__config_debug) insert checks that link.slot ==
 *  BFC__NO_SLOT and remove that the chunk really is in its slot; a failure
 *  there is a bug inside the library (never user input), so it is reported
 *  on stderr and aborts.  In every build remove ignores a chunk whose
 *  link.slot is not a slot index rather than index past root[].
 *
 * Locking: none here.  A struct bfc__bins and the links of the chunks in it
 * belong to one arena and are touched only under that arena's lock.  The
 * module never allocates.
 *
 * Insert, remove and best fit are written in bins_inline.h, inline for the
 * arena's fast path; the functions of the same names here call them.
 */
#include "bins_inline.h"
#include "mutex.h" /* bfc__nocancel_begin */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#define L(c) ((c)->link.left)
#define R(c) ((c)->link.right)
#define P(c) ((c)->link.parent)

static inline struct bfc__chunk *bins_max(struct bfc__chunk *n)
{
    while (R(n))
        n = R(n);
    return n;
}

/* In-order successor through parent links, or NULL. */
static inline struct bfc__chunk *bins_next(struct bfc__chunk *n)
{
    if (R(n))
        return bfc__bins_min(R(n));
    struct bfc__chunk *p = P(n);
    while (p && n == R(p)) {
        n = p;
        p = P(p);
    }
    return p;
}

void bfc__bins_bug(const char *what, const struct bfc__chunk *c)
{
    (void)bfc__nocancel_begin(); /* the report, then the abort (mutex.h) */
    fprintf(stderr,
            "shardbfc: internal error in bins: %s (chunk %p ptr 0x%" PRIxPTR
            " size %zu slot %" PRIu32 ")\n",
            what, (const void *)c, c->ptr, c->size, c->link.slot);
    abort();
}

void bfc__bins_init(struct bfc__bins *b)
{
    for (uint32_t w = 0; w < BFC__SLOT_WORDS; w++)
        b->slot_map[w] = 0;
    b->n = 0;
    for (uint32_t k = 0; k < BFC__NUM_SLOTS; k++)
        b->root[k] = NULL;
}

void bfc__bins_insert(struct bfc__bins *b, struct bfc__chunk *c)
{
    bfc__bins_insert_inline(b, c);
}

void bfc__bins_remove(struct bfc__bins *b, struct bfc__chunk *c)
{
    bfc__bins_remove_inline(b, c);
}

struct bfc__chunk *bfc__bins_best_fit(const struct bfc__bins *b, size_t rounded)
{
    return bfc__bins_best_fit_inline(b, rounded);
}

size_t bfc__bins_largest(const struct bfc__bins *b)
{
    for (uint32_t w = BFC__SLOT_WORDS; w-- > 0;)
        if (b->slot_map[w])
            return bins_max(b->root[(w << 6) | (63 - (uint32_t)__builtin_clzll(b->slot_map[w]))])->size;
    return 0;
}


/*
 * The slots of bin i in turn, each in order.  The successor is taken before
 * fn runs, so fn may remove the chunk it is given (removal keeps the order
 * of the others, and the walk resumes from a node still in the tree); any
 * other change to bin i during the walk is not allowed.
 */
int bfc__bins_walk(const struct bfc__bins *b, uint32_t i,
                   int (*fn)(struct bfc__chunk *c, void *arg), void *arg)
{
    if (i >= BFC__NUM_BINS)
        return 0;
    for (uint32_t k = i << BFC__BIN_SUB_BITS; k < (i + 1) << BFC__BIN_SUB_BITS; k++) {
        struct bfc__chunk *n = b->root[k] ? bfc__bins_min(b->root[k]) : NULL;
        while (n) {
            struct bfc__chunk *next = bins_next(n);
            int rc = fn(n, arg);
            if (rc)
                return rc;
            n = next;
        }
    }
    return 0;
}

static int tally_fn(struct bfc__chunk *c, void *arg)
{
    size_t *t = arg;
    t[0]++;
    t[1] += c->size;
    return 0;
}

void bfc__bins_tally(const struct bfc__bins *b, uint32_t i, size_t *count, size_t *bytes)
{
    size_t t[2] = {0, 0};
    uint32_t lo = i < BFC__NUM_BINS ? i : 0, hi = i < BFC__NUM_BINS ? i + 1 : BFC__NUM_BINS;
    for (uint32_t j = lo; j < hi; j++)
        (void)bfc__bins_walk(b, j, tally_fn, t);
    *count = t[0];
    *bytes = t[1];
}

/* Search by c's key, bounded by the chunk count so a corrupt tree cannot loop. */
bool bfc__bins_find(const struct bfc__bins *b, uint32_t k, const struct bfc__chunk *c)
{
    const struct bfc__chunk *n = b->root[k];
    size_t steps = 0;
    while (n && steps++ <= b->n) {
        if (n == c)
            return true;
        if (n->size == c->size && n->ptr == c->ptr)
            return false; /* another record with c's key */
        n = bfc__bins_less(c, n) ? L(n) : R(n);
    }
    return false;
}

bool bfc__bins_contains(const struct bfc__bins *b, uint32_t i, const struct bfc__chunk *c)
{
    if (i >= BFC__NUM_BINS || !c)
        return false;
    uint32_t k = bfc__bin_slot(c->size);
    return k >> BFC__BIN_SUB_BITS == i && bfc__bins_find(b, k, c);
}

#define BINS_FAIL(...)                                                         \
    do {                                                                       \
        if (buf && len)                                                        \
            snprintf(buf, len, __VA_ARGS__);                                   \
        return -1;                                                             \
    } while (0)

/*
 * One slot k of bin i: an in-order traversal through parent links.  Every
 * node is "entered" exactly once, from its parent (or as the root), and its
 * parent link is checked on entry, so the climb back up only follows checked
 * links; entering more nodes than the count n leaves after the slots before
 * (*visited_out of them) stops the walk, so a corrupt tree with a cycle
 * still terminates.  Adds the slot's chunks to *visited_out.
 */
static int bins_verify_slot(const struct bfc__bins *b, uint32_t k, size_t *visited_out, char *buf, size_t len)
{
    uint32_t i = k >> BFC__BIN_SUB_BITS;
    struct bfc__chunk *root = b->root[k];
    size_t entered = 0, visited = 0;
    size_t room = b->n > *visited_out ? b->n - *visited_out : 0;
    const struct bfc__chunk *prev = NULL;
    bool bit = (b->slot_map[k >> 6] >> (k & 63)) & 1;

    if (!root) {
        if (bit)
            BINS_FAIL("slot %" PRIu32 " (bin %" PRIu32 "): empty but its bit in the slot map is set", k, i);
        return 0;
    }
    if (!bit)
        BINS_FAIL("slot %" PRIu32 " (bin %" PRIu32 "): has chunks but its bit in the slot map is clear", k, i);
    if (P(root))
        BINS_FAIL("slot %" PRIu32 ": root %p has a parent", k, (void *)root);

    struct bfc__chunk *n = root;
    entered = 1;
    if (entered > room)
        BINS_FAIL("slot %" PRIu32 ": more nodes than the count %zu", k, b->n);
    for (;;) {
        /* Enter the left spine below n. */
        while (L(n)) {
            struct bfc__chunk *l = L(n);
            if (++entered > room)
                BINS_FAIL("slot %" PRIu32 ": more nodes than the count %zu (or a cycle)", k, b->n);
            if (P(l) != n)
                BINS_FAIL("bin %" PRIu32 ": chunk 0x%" PRIxPTR " has a wrong parent link", i,
                          l->ptr);
            if (l->link.prio > n->link.prio)
                BINS_FAIL("bin %" PRIu32 ": heap order broken below chunk 0x%" PRIxPTR, i,
                          n->ptr);
            n = l;
        }
        /* Visit n. */
        for (;;) {
            visited++;
            if (n->link.slot != k)
                BINS_FAIL("slot %" PRIu32 ": chunk 0x%" PRIxPTR " has link.slot %" PRIu32, k,
                          n->ptr, n->link.slot);
            if (n->size < BFC__MIN_ALLOC || n->size % BFC__MIN_ALLOC)
                BINS_FAIL("bin %" PRIu32 ": chunk 0x%" PRIxPTR " has bad size %zu", i, n->ptr,
                          n->size);
            if (bfc__bin_slot(n->size) != k)
                BINS_FAIL("slot %" PRIu32 ": chunk 0x%" PRIxPTR " of size %zu belongs in slot %" PRIu32,
                          k, n->ptr, n->size, bfc__bin_slot(n->size));
            if (n->link.prio != bfc__bins_prio(n->ptr))
                BINS_FAIL("bin %" PRIu32 ": chunk 0x%" PRIxPTR
                          " has a stale priority (key changed while binned?)",
                          i, n->ptr);
            if (prev && !bfc__bins_less(prev, n))
                BINS_FAIL("bin %" PRIu32 ": order broken: (%zu, 0x%" PRIxPTR
                          ") not after (%zu, 0x%" PRIxPTR ")",
                          i, n->size, n->ptr, prev->size, prev->ptr);
            prev = n;

            if (R(n)) {
                struct bfc__chunk *r = R(n);
                if (++entered > room)
                    BINS_FAIL("slot %" PRIu32 ": more nodes than the count %zu (or a cycle)", k, b->n);
                if (P(r) != n)
                    BINS_FAIL("bin %" PRIu32 ": chunk 0x%" PRIxPTR " has a wrong parent link",
                              i, r->ptr);
                if (r->link.prio > n->link.prio)
                    BINS_FAIL("bin %" PRIu32 ": heap order broken below chunk 0x%" PRIxPTR, i,
                              n->ptr);
                n = r;
                break; /* enter its left spine */
            }
            /* Climb past the ancestors whose right subtree is done. */
            struct bfc__chunk *p = P(n);
            while (p && n == R(p)) {
                n = p;
                p = P(p);
            }
            if (!p)
                goto done;
            n = p; /* came up from its left: visit it next */
        }
    }
done:
    *visited_out += visited;
    return 0;
}

int bfc__bins_verify(const struct bfc__bins *b, char *buf, size_t len)
{
#if BFC__NUM_SLOTS % 64
    if (b->slot_map[BFC__SLOT_WORDS - 1] >> (BFC__NUM_SLOTS % 64))
        BINS_FAIL("slot map word %d 0x%016" PRIx64 " has bits past slot %d", BFC__SLOT_WORDS - 1,
                  b->slot_map[BFC__SLOT_WORDS - 1], BFC__NUM_SLOTS - 1);
#endif
    /* Each slot's walk is bounded by what the count leaves; so is their sum. */
    size_t visited = 0;
    for (uint32_t k = 0; k < BFC__NUM_SLOTS; k++)
        if (bins_verify_slot(b, k, &visited, buf, len))
            return -1;
    if (visited != b->n)
        BINS_FAIL("%zu chunks in the slots but the count says %zu", visited, b->n);
    if (buf && len)
        buf[0] = '\0';
    return 0;
}
