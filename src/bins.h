/*
 * bins.h -- the free-chunk index of one BFC arena.
 *
 * 21 bins: bin i holds free chunks of size in [256*2^i, 256*2^(i+1)), the
 * last bin open-ended (TensorFlow's bins: their counts and bytes are what
 * stats, dumps and snapshots show).  Each bin is cut into 16 sub-bins of
 * equal width (slots; a bin of fewer than 16 sizes leaves some empty), and
 * inside a slot the chunks are kept in an intrusive balanced search tree
 * ordered by (size, address); bitmaps record which bins and which slots are
 * non-empty.  Best fit -- the smallest free chunk >= the request, lowest
 * address among equal sizes -- costs O(log n) and never scans: a lower-bound
 * search in the request's own slot, else the minimum of the next non-empty
 * slot found with two find-first-sets.
 *
 * Not thread-safe: the owning arena's lock protects a bins structure.
 * The bins never allocate; a chunk carries its own tree links.
 */
#ifndef BFC_BINS_H
#define BFC_BINS_H

#include "internal.h"

struct bfc__chunk;

/* Intrusive tree links, embedded in every chunk record. */
struct bfc__bin_link {
    struct bfc__chunk *left, *right, *parent;
    uint32_t prio;   /* treap priority (or balance info for another tree) */
    uint32_t slot;   /* slot (sub-bin) index while binned, BFC__NO_SLOT otherwise */
};
#define BFC__NO_SLOT UINT32_MAX

/* Sub-bins per bin, and slots in all. */
#define BFC__BIN_SUB_BITS 4
#define BFC__BIN_SUBS (1u << BFC__BIN_SUB_BITS)
#define BFC__NUM_SLOTS (BFC__NUM_BINS * BFC__BIN_SUBS)

/* What the bins need to see of a chunk (the rest lives in chunk.h). */
struct bfc__chunk_key {
    uintptr_t ptr;
    size_t size;
};

/* The slot map's 64-bit words; a bin's slots never straddle two. */
#define BFC__SLOT_WORDS ((BFC__NUM_SLOTS + 63) / 64)
_Static_assert(64 % BFC__BIN_SUBS == 0, "a bin's slots in one word of the slot map");

/*
 * One counter: the chunks in all slots, which bounds every walk (a corrupt
 * tree with a cycle still ends) and gives the arena its free-chunk count.
 * A bin's chunks and bytes (stats, dumps, snapshots) are counted by walking
 * it (bfc__bins_tally): an insert and a remove cost one increment, where
 * two per-bin counters cost four instructions each on the fast path.  The
 * arena knows its free bytes without them (arena.h).
 */
struct bfc__bins {
    uint64_t slot_map[BFC__SLOT_WORDS];         /* bit k % 64 of word k / 64: slot k has chunks */
    struct bfc__chunk *root[BFC__NUM_SLOTS];    /* one tree per slot */
    size_t n;                                   /* chunks in all slots */
};

/* Bin i's part of the slot map: bit j set iff slot 16i+j has chunks. */
static inline uint32_t bfc__bins_slots_of(const struct bfc__bins *b, uint32_t i)
{
    uint32_t k = i << BFC__BIN_SUB_BITS;
    return (uint32_t)(b->slot_map[k >> 6] >> (k & 63)) & ((1u << BFC__BIN_SUBS) - 1);
}

/* Bin index of a size (a multiple of 256, >= 256): min(20, floor(log2(size/256))). */
static inline uint32_t bfc__bin_for_size(size_t size)
{
    size_t units = size >> BFC__MIN_ALLOC_BITS;
    uint32_t b = units ? (uint32_t)(63 - __builtin_clzll((unsigned long long)units)) : 0;
    return b < BFC__NUM_BINS - 1 ? b : BFC__NUM_BINS - 1;
}

/*
 * Slot of a size: 16 * bin + j, where j cuts the bin's range into 16 equal
 * parts (the open-ended last bin's last slot also takes every size of
 * 512 MiB or more).  Slots are ordered as sizes are: every size of slot k is
 * below every size of slot k + 1.
 */
static inline uint32_t bfc__bin_slot(size_t size)
{
    size_t units = size >> BFC__MIN_ALLOC_BITS;
    uint32_t i;
    size_t j;
    if (BFC__LIKELY(units < (size_t)1 << (BFC__NUM_BINS - 1))) {
        /* Below the last bin neither the bin nor j needs a bound: one
         * test instead of two (this runs three times per alloc+free pair).
         * units | 1: the same top bit for every size >= 256. */
        i = (uint32_t)(63 - __builtin_clzll((unsigned long long)(units | 1)));
        j = (units << BFC__BIN_SUB_BITS) >> i; /* [16, 32) */
    } else {
        i = BFC__NUM_BINS - 1;
        j = (units << BFC__BIN_SUB_BITS) >> i;
        if (j > 2 * BFC__BIN_SUBS - 1)
            j = 2 * BFC__BIN_SUBS - 1;
    }
    return (i << BFC__BIN_SUB_BITS) + (uint32_t)j - BFC__BIN_SUBS;
}

/*
 * The treap priority of a chunk at address ptr: the top half of murmur3's
 * fmix64, a bijective avalanche mix, so the low 8 always-zero bits of a
 * 256-aligned address do not matter and nearby addresses get unrelated
 * priorities.  A chunk record's link.prio must be bfc__bins_prio(ptr)
 * before its first insert: whoever sets a record's ptr sets it (a record's
 * address never changes while it lives), so no insert recomputes it.
 */
static inline uint32_t bfc__bins_prio(uintptr_t ptr)
{
    uint64_t x = (uint64_t)ptr;
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return (uint32_t)(x >> 32);
}

void bfc__bins_init(struct bfc__bins *b);
/* c must not be in a bin (link.slot == BFC__NO_SLOT), its link.prio set
 * (bfc__bins_prio); its key (ptr, size) must not change while binned. */
void bfc__bins_insert(struct bfc__bins *b, struct bfc__chunk *c);
void bfc__bins_remove(struct bfc__bins *b, struct bfc__chunk *c);
/* The best-fit chunk for a rounded size (not removed), or NULL. */
struct bfc__chunk *bfc__bins_best_fit(const struct bfc__bins *b, size_t rounded);
/* Largest free chunk size (0 when empty). */
size_t bfc__bins_largest(const struct bfc__bins *b);
/* Calls fn on every chunk of bin i in (size, address) order; stops when fn
 * returns non-zero and returns that value. */
int bfc__bins_walk(const struct bfc__bins *b, uint32_t i,
                   int (*fn)(struct bfc__chunk *c, void *arg), void *arg);
/* Is c in bin i, in its slot's tree (O(log n) search by key)?  For bfc_ctx_check. */
bool bfc__bins_contains(const struct bfc__bins *b, uint32_t i, const struct bfc__chunk *c);
/* Chunks and bytes of bin i, or of every bin when i is BFC__NUM_BINS: a
 * walk, O(chunks counted); the trees must be sound (bfc__bins_verify). */
void bfc__bins_tally(const struct bfc__bins *b, uint32_t i, size_t *count, size_t *bytes);
/* Verifies tree order, links, the count and the bitmap; 0 if sound, else
 * writes a description into buf and returns -1. */
int bfc__bins_verify(const struct bfc__bins *b, char *buf, size_t len);

#endif /* BFC_BINS_H */
