/*
 * test_bins.c -- Check suite for bins.c, the free-chunk index of an arena.
 *
 * White-box: chunk records are calloc'd here with only ptr, size and
 * link.slot = BFC__NO_SLOT set, as the arena does, and handed straight to the
 * bins.  The suite checks the size classes and slots, every best-fit rule
 * (smallest sufficient size, lowest address among equals, fall-through to
 * the next non-empty slot and bin, none), largest, walk order, that bfc__bins_verify notices
 * corruption, and compares the bins against a brute-force reference on a long
 * random sequence and at 100 000 chunks.  All randomness is a fixed-seed
 * splitmix64, printed on failure.
 *
 * BFC_BINS_BENCH=1 also prints a microbenchmark (ns per insert + best_fit +
 * remove with 1000 and with 100 000 chunks present); it asserts nothing.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bins.h"
#include "chunk.h"

/* ------------------------------------------------------------- helpers */

static uint64_t rng_state;

static void rng_seed(uint64_t seed)
{
    rng_state = seed;
}

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static uint64_t rng_below(uint64_t n)
{
    return rng_next() % n;
}

static struct bfc__chunk *mk(uintptr_t ptr, size_t size)
{
    struct bfc__chunk *c = calloc(1, sizeof *c);
    ck_assert_ptr_nonnull(c);
    c->ptr = ptr;
    c->link.prio = bfc__bins_prio(ptr);
    c->size = size;
    c->link.slot = BFC__NO_SLOT;
    return c;
}

/* The bins that hold chunks: bit i set iff bin i does. */
static uint32_t bins_nonempty(const struct bfc__bins *b)
{
    uint32_t mask = 0;
    for (uint32_t i = 0; i < BFC__NUM_BINS; i++)
        if (bfc__bins_slots_of(b, i))
            mask |= UINT32_C(1) << i;
    return mask;
}

static void verify_ok(const struct bfc__bins *b)
{
    char msg[256];
    int rc = bfc__bins_verify(b, msg, sizeof msg);
    ck_assert_msg(rc == 0, "bins_verify: %s", msg);
}

/* A random multiple of 256 in bin `bin`'s range (bin 20 capped at 512 MiB). */
static size_t size_in_bin(uint32_t bin)
{
    size_t lo = (size_t)256 << bin;
    return lo + (size_t)rng_below(lo / 256) * 256;
}

/* A random permutation of 0..n-1 (Fisher-Yates). */
static size_t *shuffled(size_t n)
{
    size_t *p = malloc(n * sizeof *p);
    ck_assert_ptr_nonnull(p);
    for (size_t i = 0; i < n; i++)
        p[i] = i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)rng_below(i);
        size_t t = p[i - 1];
        p[i - 1] = p[j];
        p[j] = t;
    }
    return p;
}

static int key_cmp(const void *a, const void *b)
{
    const struct bfc__chunk *x = *(struct bfc__chunk *const *)a;
    const struct bfc__chunk *y = *(struct bfc__chunk *const *)b;
    if (x->size != y->size)
        return x->size < y->size ? -1 : 1;
    if (x->ptr != y->ptr)
        return x->ptr < y->ptr ? -1 : 1;
    return 0;
}

/* ----------------------------------------------------- size classes */

START_TEST(test_bin_for_size)
{
    ck_assert_uint_eq(bfc__bin_for_size(256), 0);
    ck_assert_uint_eq(bfc__bin_for_size(511), 0); /* not a valid size, but in bin 0 */
    ck_assert_uint_eq(bfc__bin_for_size(512), 1);
    ck_assert_uint_eq(bfc__bin_for_size(768), 1);
    ck_assert_uint_eq(bfc__bin_for_size(1024), 2);
    ck_assert_uint_eq(bfc__bin_for_size(256 * BFC__MiB - 256), 19);
    ck_assert_uint_eq(bfc__bin_for_size(256 * BFC__MiB), 20);
    ck_assert_uint_eq(bfc__bin_for_size(512 * BFC__MiB), 20);
    ck_assert_uint_eq(bfc__bin_for_size((size_t)1 << 40), 20);
    ck_assert_uint_eq(bfc__bin_for_size(SIZE_MAX & ~(size_t)255), 20);
    for (uint32_t i = 0; i < 20; i++) {
        ck_assert_uint_eq(bfc__bin_for_size((size_t)256 << i), i);
        ck_assert_uint_eq(bfc__bin_for_size(((size_t)256 << (i + 1)) - 256), i);
    }
}
END_TEST

/* Slots: 16 per bin, ordered as sizes are, each bin's range cut evenly. */
START_TEST(test_slots)
{
    const uint32_t S = BFC__BIN_SUBS;
    ck_assert_uint_eq(S, 16);
    ck_assert_uint_eq(bfc__bin_slot(256), 0);
    ck_assert_uint_eq(bfc__bin_slot(512), S);           /* bin 1 has 2 sizes: slots 0 and 8 */
    ck_assert_uint_eq(bfc__bin_slot(768), S + 8);
    ck_assert_uint_eq(bfc__bin_slot(1024), 2 * S);      /* bin 2 has 4: slots 0, 4, 8, 12 */
    ck_assert_uint_eq(bfc__bin_slot(1792), 2 * S + 12);
    ck_assert_uint_eq(bfc__bin_slot(4096), 4 * S);      /* bin 4: one size per slot */
    ck_assert_uint_eq(bfc__bin_slot(4096 + 256), 4 * S + 1);
    ck_assert_uint_eq(bfc__bin_slot(8192 - 256), 4 * S + 15);
    ck_assert_uint_eq(bfc__bin_slot(65536 + 4095), 8 * S); /* bin 8: 4 KiB per slot */
    ck_assert_uint_eq(bfc__bin_slot(65536 + 4096), 8 * S + 1);
    ck_assert_uint_eq(bfc__bin_slot(256 * BFC__MiB), 20 * S);
    ck_assert_uint_eq(bfc__bin_slot(512 * BFC__MiB - 256), 20 * S + 15);
    ck_assert_uint_eq(bfc__bin_slot(512 * BFC__MiB), 20 * S + 15); /* the open end */
    ck_assert_uint_eq(bfc__bin_slot((size_t)1 << 40), BFC__NUM_SLOTS - 1);
    /* Every size from 256 B to 2 MiB, and samples of every bin: the slot is in
     * the size's bin, never decreases with the size, and a bin of 16 or more
     * sizes fills all its slots, in equal runs. */
    uint32_t prev = 0, runs[BFC__NUM_SLOTS] = {0};
    for (size_t sz = 256; sz <= 2 * BFC__MiB; sz += 256) {
        uint32_t k = bfc__bin_slot(sz);
        ck_assert_uint_lt(k, BFC__NUM_SLOTS);
        ck_assert_uint_eq(k / S, bfc__bin_for_size(sz));
        ck_assert_uint_ge(k, prev);
        prev = k;
        runs[k]++;
    }
    for (uint32_t i = 4; i <= 12; i++)
        for (uint32_t j = 0; j < S; j++)
            ck_assert_uint_eq(runs[i * S + j], 1u << (i - 4));
    for (uint32_t i = 0; i < 20; i++) {
        size_t lo = (size_t)256 << i, hi = ((size_t)256 << (i + 1)) - 256;
        ck_assert_uint_eq(bfc__bin_slot(lo), i * S);
        ck_assert_uint_eq(bfc__bin_slot(hi), i * S + (i == 0 ? 0 : i < 4 ? S - (S >> i) : S - 1));
    }
    /* Every slot's bounds from its definition (16 * bin + the sixteenth of
     * the bin's range), at both ends of each slot of every bin and for
     * random sizes up to 2^44, the open end included. */
    for (uint32_t i = 0; i < BFC__NUM_BINS; i++) {
        size_t lo = (size_t)256 << i, step = lo / S;
        for (uint32_t j = 0; j < S; j++) {
            size_t first = lo + j * step, last = first + step - 256;
            if (step < 256 && (first % 256 || step * j % 256))
                continue; /* bins below 4 have fewer sizes than slots */
            ck_assert_uint_eq(bfc__bin_slot(first), i * S + j);
            if (step >= 256)
                ck_assert_uint_eq(bfc__bin_slot(last), i * S + j);
        }
    }
    uint64_t x = 88172645463325252u;
    for (int t = 0; t < 1000000; t++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t sz = ((size_t)(x >> (20 + x % 24)) + 1) << 8;
        size_t units = sz >> 8;
        uint32_t i = bfc__bin_for_size(sz);
        size_t j = (units << 4) >> i;
        uint32_t want = i * S + (uint32_t)(j > 31 ? 31 : j) - S;
        ck_assert_uint_eq(bfc__bin_slot(sz), want);
    }
}
END_TEST

/* Best fit across slots of one bin: the request's own slot holds only
 * smaller chunks (or none), so the fit is the minimum of the next non-empty
 * slot of the bin, before any chunk of a higher bin. */
START_TEST(test_falls_through_slots)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    /* bin 8 (64 KiB .. 128 KiB - 256): slots 4 KiB wide */
    struct bfc__chunk *small = mk(0x100000, 65536 + 1024);      /* slot 128 */
    struct bfc__chunk *mid_a = mk(0x200000, 65536 + 5 * 4096); /* slot 133 */
    struct bfc__chunk *mid_b = mk(0x300000, 65536 + 5 * 4096); /* slot 133, mid_a's size, higher address */
    struct bfc__chunk *mid2 = mk(0x050000, 65536 + 5 * 4096 + 256); /* slot 133, larger */
    struct bfc__chunk *top = mk(0x400000, 131072);              /* bin 9 */
    bfc__bins_insert(&b, top);
    bfc__bins_insert(&b, mid_b);
    bfc__bins_insert(&b, mid2);
    bfc__bins_insert(&b, mid_a);
    bfc__bins_insert(&b, small);
    verify_ok(&b);
    ck_assert_uint_eq(bfc__bins_slots_of(&b, 8), (1u << 0) | (1u << 5));
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536), small);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 1024), small);
    /* own slot 128 holds only a smaller chunk: on to slot 133's minimum */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 1280), mid_a);
    /* own slot 130 empty */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 2 * 4096), mid_a);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 5 * 4096 + 256), mid2);
    /* past slot 133 inside bin 8: on to bin 9 */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 5 * 4096 + 512), top);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 131072 - 256), top);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 131072 + 256));
    /* the walk of bin 8 visits its slots in order */
    ck_assert_uint_eq(bfc__bins_largest(&b), 131072);
    bfc__bins_remove(&b, mid_a);
    bfc__bins_remove(&b, mid_b);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 1280), mid2);
    bfc__bins_remove(&b, mid2);
    ck_assert_uint_eq(bfc__bins_slots_of(&b, 8), 1u);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65536 + 1280), top);
    bfc__bins_remove(&b, small);
    ck_assert_uint_eq(bfc__bins_slots_of(&b, 8), 0);
    ck_assert_uint_eq(bins_nonempty(&b), 1u << 9);
    verify_ok(&b);
    bfc__bins_remove(&b, top);
    ck_assert_uint_eq(bins_nonempty(&b), 0);
    free(small);
    free(mid_a);
    free(mid_b);
    free(mid2);
    free(top);
}
END_TEST

/* ----------------------------------------------------------- best fit */

/*
 * The slot map's words (64 slots, 4 bins, to a word): a lone chunk of each
 * reachable slot's smallest size in turn is the best fit for the smallest
 * size of every slot up to its own, across words, and of none above it.
 */
START_TEST(test_slot_map_words)
{
    struct bfc__bins b;
    size_t lo[BFC__NUM_SLOTS]; /* each slot's smallest size; 0 when no size maps there */
    bfc__bins_init(&b);
    for (uint32_t k = 0; k < BFC__NUM_SLOTS; k++) {
        uint64_t a = 1, z = UINT64_C(1) << 40; /* in units of 256 B; bfc__bin_slot is monotone */
        while (a < z) {
            uint64_t m = a + (z - a) / 2;
            if (bfc__bin_slot((size_t)m << BFC__MIN_ALLOC_BITS) >= k)
                z = m;
            else
                a = m + 1;
        }
        lo[k] = bfc__bin_slot((size_t)a << BFC__MIN_ALLOC_BITS) == k ? (size_t)a << BFC__MIN_ALLOC_BITS : 0;
        /* from bin 4 on a slot is at least 256 B wide: all reachable */
        ck_assert(k < 4 * BFC__BIN_SUBS || lo[k] != 0);
    }
    for (uint32_t k = 0; k < BFC__NUM_SLOTS; k++) {
        if (!lo[k])
            continue;
        struct bfc__chunk *c = mk(0x100000, lo[k]);
        bfc__bins_insert(&b, c);
        ck_assert_uint_eq(c->link.slot, k);
        for (uint32_t j = 0; j < BFC__NUM_SLOTS; j++)
            if (lo[j] && bfc__bins_best_fit(&b, lo[j]) != (j <= k ? c : NULL))
                ck_abort_msg("chunk of slot %u: best fit for slot %u's %zu wrong", k, j, lo[j]);
        ck_assert_uint_eq(bfc__bins_largest(&b), lo[k]);
        verify_ok(&b);
        bfc__bins_remove(&b, c);
        ck_assert_uint_eq(bins_nonempty(&b), 0);
        free(c);
    }
}
END_TEST

START_TEST(test_empty)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    verify_ok(&b);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 256));
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 256 * BFC__MiB));
    ck_assert_uint_eq(bfc__bins_largest(&b), 0);
    ck_assert_uint_eq(bins_nonempty(&b), 0);
    ck_assert_uint_eq(b.n, 0);
}
END_TEST

START_TEST(test_exact_match)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    struct bfc__chunk *c1 = mk(0x10000, 1024), *c2 = mk(0x20000, 2048), *c3 = mk(0x30000, 4096);
    bfc__bins_insert(&b, c3);
    bfc__bins_insert(&b, c1);
    bfc__bins_insert(&b, c2);
    verify_ok(&b);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1024), c1);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 2048), c2);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 4096), c3);
    /* the first slot of bins 2, 3, 4 */
    ck_assert_uint_eq(c1->link.slot, 2 * BFC__BIN_SUBS);
    ck_assert_uint_eq(c2->link.slot, 3 * BFC__BIN_SUBS);
    ck_assert_uint_eq(c3->link.slot, 4 * BFC__BIN_SUBS);
    ck_assert_uint_eq(bins_nonempty(&b), (1u << 2) | (1u << 3) | (1u << 4));
    ck_assert_uint_eq(b.n, 3);
    size_t n, bytes;
    bfc__bins_tally(&b, BFC__NUM_BINS, &n, &bytes);
    ck_assert_uint_eq(n, 3);
    ck_assert_uint_eq(bytes, 1024 + 2048 + 4096);
    bfc__bins_tally(&b, 3, &n, &bytes);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(bytes, 2048);
    bfc__bins_tally(&b, 5, &n, &bytes);
    ck_assert_uint_eq(n, 0);
    ck_assert_uint_eq(bytes, 0);
    free(c1);
    free(c2);
    free(c3);
}
END_TEST

START_TEST(test_smallest_sufficient)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    /* Bin 2 is [1024, 2048): three sizes, inserted out of order, at addresses
     * that do not follow size order; a bigger chunk in bin 3 at a low address. */
    struct bfc__chunk *a = mk(0x1000, 1792), *m = mk(0x5000, 1280), *z = mk(0x3000, 1536);
    struct bfc__chunk *big = mk(0x100, 2048);
    bfc__bins_insert(&b, a);
    bfc__bins_insert(&b, big);
    bfc__bins_insert(&b, m);
    bfc__bins_insert(&b, z);
    verify_ok(&b);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 256), m);   /* falls up from bin 0 */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1024), m);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1280), m);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1536), z);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1792), a);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 2048), big);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 2304));
    free(a);
    free(m);
    free(z);
    free(big);
}
END_TEST

START_TEST(test_lowest_address_among_equals)
{
    enum { N = 200 };
    struct bfc__bins b;
    struct bfc__chunk *c[N], *other[N];
    bfc__bins_init(&b);
    rng_seed(0xb1a5);
    size_t *perm = shuffled(N);
    /* N chunks of 4096 at addresses k * 1 MiB, inserted in random order,
     * mixed with N chunks of other sizes in the same bin (4352..8191) and
     * below it. */
    for (size_t k = 0; k < N; k++) {
        c[k] = mk((uintptr_t)(k + 1) << 20, 4096);
        other[k] = mk(((uintptr_t)(k + 1) << 20) + 0x10000, k % 2 ? 4096 + 256 * (1 + k % 15) : 3840);
    }
    for (size_t k = 0; k < N; k++) {
        bfc__bins_insert(&b, c[perm[k]]);
        bfc__bins_insert(&b, other[perm[k]]);
    }
    verify_ok(&b);
    /* best fit walks the 4096s in ascending address order as each is taken */
    for (size_t k = 0; k < N; k++) {
        struct bfc__chunk *f = bfc__bins_best_fit(&b, 4096);
        ck_assert_msg(f == c[k], "step %zu: got ptr 0x%lx size %zu", k,
                      f ? (unsigned long)f->ptr : 0ul, f ? f->size : 0);
        bfc__bins_remove(&b, f);
        ck_assert_uint_eq(f->link.slot, BFC__NO_SLOT);
    }
    verify_ok(&b);
    /* then the next size up, 4352, lowest address first: other[k] for odd k
     * has 4096 + 256 * (1 + k % 15), so k = 15, 45, 75, ... -> other[15] */
    struct bfc__chunk *f = bfc__bins_best_fit(&b, 4096);
    ck_assert_ptr_eq(f, other[15]);
    ck_assert_uint_eq(f->size, 4352);
    for (size_t k = 0; k < N; k++) {
        free(c[k]);
        free(other[k]);
    }
    free(perm);
}
END_TEST

START_TEST(test_falls_through)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    /* bin 3 [2048, 4096) holds 2304 only; bins 4..7 empty; bin 8 holds
     * 100352 (low address) and 65536 (high address); bin 12 holds 1 MiB. */
    struct bfc__chunk *small = mk(0x1000, 2304);
    struct bfc__chunk *b8hi = mk(0x900000, 65536), *b8lo = mk(0x100000, 100352);
    struct bfc__chunk *b12 = mk(0x200000, BFC__MiB);
    bfc__bins_insert(&b, b12);
    bfc__bins_insert(&b, b8lo);
    bfc__bins_insert(&b, small);
    bfc__bins_insert(&b, b8hi);
    verify_ok(&b);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 2304), small);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 2560), b8hi);   /* min of bin 8 */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 8192), b8hi);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 65792), b8lo);  /* inside bin 8 */
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 100608), b12);  /* past bin 8's max */
    ck_assert_ptr_null(bfc__bins_best_fit(&b, BFC__MiB + 256));
    bfc__bins_remove(&b, b8hi);
    bfc__bins_remove(&b, b8lo);
    verify_ok(&b);
    ck_assert_uint_eq(bins_nonempty(&b), (1u << 3) | (1u << 12));
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 2560), b12);
    free(small);
    free(b8hi);
    free(b8lo);
    free(b12);
}
END_TEST

START_TEST(test_none_fits)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    struct bfc__chunk *c = mk(0x1000, 8192), *huge = mk(0x40000000, 300 * BFC__MiB);
    bfc__bins_insert(&b, c);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 8448));
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 256 * BFC__MiB));
    bfc__bins_insert(&b, huge);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 8448), huge);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 300 * BFC__MiB), huge);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 300 * BFC__MiB + 256));
    ck_assert_ptr_null(bfc__bins_best_fit(&b, (size_t)1 << 40));
    free(c);
    free(huge);
}
END_TEST

START_TEST(test_remove_skips)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    struct bfc__chunk *x = mk(0x1000, 1024), *y = mk(0x2000, 1024), *z = mk(0x3000, 1280);
    bfc__bins_insert(&b, y);
    bfc__bins_insert(&b, z);
    bfc__bins_insert(&b, x);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1024), x);
    bfc__bins_remove(&b, x);
    verify_ok(&b);
    ck_assert(!bfc__bins_contains(&b, 2, x));
    ck_assert(bfc__bins_contains(&b, 2, y));
    ck_assert(!bfc__bins_contains(&b, 3, y));
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1024), y);
    bfc__bins_remove(&b, y);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 1024), z);
    size_t n, bytes;
    bfc__bins_tally(&b, 2, &n, &bytes);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(bytes, 1280);
    bfc__bins_remove(&b, z);
    ck_assert_ptr_null(bfc__bins_best_fit(&b, 256));
    ck_assert_uint_eq(bins_nonempty(&b), 0);
    bfc__bins_tally(&b, BFC__NUM_BINS, &n, &bytes);
    ck_assert_uint_eq(n, 0);
    ck_assert_uint_eq(bytes, 0);
    ck_assert_uint_eq(b.n, 0);
    verify_ok(&b);
    /* a removed chunk may be resized and inserted again */
    x->size = 512;
    bfc__bins_insert(&b, x);
    ck_assert_uint_eq(x->link.slot, bfc__bin_slot(512));
    ck_assert_uint_eq(x->link.slot >> BFC__BIN_SUB_BITS, 1);
    ck_assert_ptr_eq(bfc__bins_best_fit(&b, 256), x);
    verify_ok(&b);
    free(x);
    free(y);
    free(z);
}
END_TEST

START_TEST(test_largest)
{
    struct bfc__bins b;
    bfc__bins_init(&b);
    struct bfc__chunk *c[4] = {mk(0x1000, 1024), mk(0x2000, 1792), mk(0x3000, 1536),
                               mk(0x4000, 512 * BFC__MiB)};
    ck_assert_uint_eq(bfc__bins_largest(&b), 0);
    bfc__bins_insert(&b, c[0]);
    ck_assert_uint_eq(bfc__bins_largest(&b), 1024);
    bfc__bins_insert(&b, c[1]);
    bfc__bins_insert(&b, c[2]);
    ck_assert_uint_eq(bfc__bins_largest(&b), 1792);   /* max of the bin, not last inserted */
    bfc__bins_insert(&b, c[3]);
    ck_assert_uint_eq(bfc__bins_largest(&b), 512 * BFC__MiB);
    bfc__bins_remove(&b, c[3]);
    ck_assert_uint_eq(bfc__bins_largest(&b), 1792);
    bfc__bins_remove(&b, c[1]);
    ck_assert_uint_eq(bfc__bins_largest(&b), 1536);
    for (int i = 0; i < 4; i++)
        free(c[i]);
}
END_TEST

/* ---------------------------------------------------------------- walk */

struct walk_rec {
    struct bfc__chunk *seen[512];
    size_t n;
    size_t stop_at; /* return 7 on this visit (1-based), 0 = never */
    struct bfc__bins *remove_from;
};

static int walk_fn(struct bfc__chunk *c, void *arg)
{
    struct walk_rec *w = arg;
    if (w->n < 512)
        w->seen[w->n] = c;
    w->n++;
    if (w->remove_from)
        bfc__bins_remove(w->remove_from, c);
    return w->stop_at && w->n == w->stop_at ? 7 : 0;
}

START_TEST(test_walk_order)
{
    enum { N = 300 };
    struct bfc__bins b;
    struct bfc__chunk *c[N];
    static struct walk_rec w;
    bfc__bins_init(&b);
    rng_seed(0x3a1c);
    /* bin 5 is [8192, 16384): few distinct sizes, so many ties on size */
    for (size_t k = 0; k < N; k++) {
        /* unique addresses, not in insertion order (7919 is prime to N) */
        c[k] = mk(((uintptr_t)k * 7919 % N + 1) << 16, 8192 + 256 * rng_below(4));
        bfc__bins_insert(&b, c[k]);
    }
    struct bfc__chunk *other = mk(0x7000, 256);
    bfc__bins_insert(&b, other);
    verify_ok(&b);

    memset(&w, 0, sizeof w);
    ck_assert_int_eq(bfc__bins_walk(&b, 5, walk_fn, &w), 0);
    ck_assert_uint_eq(w.n, N);
    struct bfc__chunk *sorted[N];
    memcpy(sorted, c, sizeof sorted);
    qsort(sorted, N, sizeof sorted[0], key_cmp);
    for (size_t k = 0; k < N; k++)
        ck_assert_msg(w.seen[k] == sorted[k], "walk position %zu out of order", k);

    /* an empty bin and a bad index visit nothing */
    memset(&w, 0, sizeof w);
    ck_assert_int_eq(bfc__bins_walk(&b, 4, walk_fn, &w), 0);
    ck_assert_int_eq(bfc__bins_walk(&b, BFC__NUM_BINS, walk_fn, &w), 0);
    ck_assert_uint_eq(w.n, 0);

    /* non-zero from fn stops the walk and is returned */
    memset(&w, 0, sizeof w);
    w.stop_at = 10;
    ck_assert_int_eq(bfc__bins_walk(&b, 5, walk_fn, &w), 7);
    ck_assert_uint_eq(w.n, 10);

    /* fn may remove the chunk it is given: the walk still sees every chunk in order */
    memset(&w, 0, sizeof w);
    w.remove_from = &b;
    ck_assert_int_eq(bfc__bins_walk(&b, 5, walk_fn, &w), 0);
    ck_assert_uint_eq(w.n, N);
    for (size_t k = 0; k < N; k++)
        ck_assert_msg(w.seen[k] == sorted[k], "removing walk position %zu out of order", k);
    for (uint32_t k = 5 * BFC__BIN_SUBS; k < 6 * BFC__BIN_SUBS; k++)
        ck_assert_ptr_null(b.root[k]);
    ck_assert_uint_eq(bfc__bins_slots_of(&b, 5), 0);
    ck_assert_uint_eq(bins_nonempty(&b), 1u);
    ck_assert_uint_eq(b.n, 1);
    verify_ok(&b);
    for (size_t k = 0; k < N; k++)
        free(c[k]);
    free(other);
}
END_TEST

/* -------------------------------------------------------------- verify */

/* Corrupts (or restores) slot k's bit in the slot map. */
static void slot_bit_flip(struct bfc__bins *b, uint32_t k)
{
    b->slot_map[k >> 6] ^= UINT64_C(1) << (k & 63);
}

START_TEST(test_verify_detects_corruption)
{
    /* 64 chunks of 4 sizes, 64 KiB .. 64.75 KiB: all in bin 8's first slot
     * (its slots are 4 KiB wide), so one tree holds several sizes. */
    enum { N = 64, BIN = 8 };
    const uint32_t K = BIN * BFC__BIN_SUBS;
    struct bfc__bins b;
    struct bfc__chunk *c[N];
    char msg[256];
    bfc__bins_init(&b);
    for (size_t k = 0; k < N; k++) {
        c[k] = mk((uintptr_t)(k + 1) << 20, 65536 + 256 * (k % 4));
        bfc__bins_insert(&b, c[k]);
        ck_assert_uint_eq(c[k]->link.slot, K);
    }
    verify_ok(&b);

    /* the count off by one either way */
    b.n++;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "count says") != NULL, "message: %s", msg);
    b.n -= 2;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "more nodes than the count") != NULL, "message: %s", msg);
    b.n++;
    verify_ok(&b);

    /* a bit past the last slot */
    slot_bit_flip(&b, BFC__SLOT_WORDS * 64 - 1);
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "past slot 335") != NULL, "message: %s", msg);
    slot_bit_flip(&b, BFC__SLOT_WORDS * 64 - 1);
    verify_ok(&b);

    /* a slot's bit set with no tree, and a tree with its bit clear */
    slot_bit_flip(&b, K + 3); /* set */
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "slot 131") != NULL, "message: %s", msg);
    slot_bit_flip(&b, K + 3);
    slot_bit_flip(&b, K); /* clear */
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "slot 128") != NULL, "message: %s", msg);
    slot_bit_flip(&b, K);
    verify_ok(&b);

    /* an address changed while binned: stale priority (and order) */
    struct bfc__chunk *r = b.root[K];
    r->ptr += (uintptr_t)1 << 30;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    r->ptr -= (uintptr_t)1 << 30;
    verify_ok(&b);

    /* a size changed while binned (same slot) breaks the order */
    struct bfc__chunk *mx = b.root[K];
    while (mx->link.right)
        mx = mx->link.right;
    size_t saved = mx->size; /* 65536 + 768, the largest */
    mx->size = 65536;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "order") != NULL, "message: %s", msg);
    mx->size = saved;
    verify_ok(&b);

    /* a size that belongs in another bin, and in another slot of the same bin */
    struct bfc__chunk *leaf = bfc__bins_best_fit(&b, 65536); /* the minimum: no left child */
    ck_assert_ptr_null(leaf->link.left);
    saved = leaf->size;
    leaf->size = 768;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "belongs in slot 24") != NULL, "message: %s", msg); /* bin 1 */
    leaf->size = 65536 + 4096;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "belongs in slot 129") != NULL, "message: %s", msg);
    leaf->size = saved;
    verify_ok(&b);

    /* a broken parent link */
    struct bfc__chunk *child = r->link.left ? r->link.left : r->link.right;
    ck_assert_ptr_nonnull(child);
    child->link.parent = NULL;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "parent") != NULL, "message: %s", msg);
    child->link.parent = r;

    /* heap order */
    uint32_t saved_prio = child->link.prio;
    child->link.prio = r->link.prio + 1u;
    if (child->link.prio > r->link.prio) { /* r's prio may be UINT32_MAX */
        ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
        ck_assert_msg(strstr(msg, "heap") != NULL, "message: %s", msg);
    }
    child->link.prio = saved_prio;

    /* a cycle terminates */
    struct bfc__chunk *lo = b.root[K];
    while (lo->link.left)
        lo = lo->link.left;
    lo->link.left = b.root[K];
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    lo->link.left = NULL;

    /* wrong link.slot */
    c[5]->link.slot = K + 1;
    ck_assert_int_eq(bfc__bins_verify(&b, msg, sizeof msg), -1);
    ck_assert_msg(strstr(msg, "link.slot") != NULL, "message: %s", msg);
    c[5]->link.slot = K;
    verify_ok(&b);

    /* buffer of length 0 is fine */
    b.n++;
    ck_assert_int_eq(bfc__bins_verify(&b, NULL, 0), -1);
    b.n--;
    for (size_t k = 0; k < N; k++)
        free(c[k]);
}
END_TEST

/* ------------------------------------------------ against a reference */

/* A request or chunk size: half from a few fixed sizes (many ties), half
 * log-uniform over all 21 bins. */
static size_t random_size(void)
{
    static const size_t fixed[] = {256, 512, 768, 1024, 4096, 4352, 65536, BFC__MiB,
                                   2 * BFC__MiB, 256 * BFC__MiB};
    if (rng_below(2))
        return fixed[rng_below(sizeof fixed / sizeof fixed[0])];
    return size_in_bin((uint32_t)rng_below(BFC__NUM_BINS));
}

START_TEST(test_random_vs_reference)
{
    enum { N = 2000, OPS = 100000 };
    const uint64_t seed = 0x5eed0b1;
    struct bfc__bins b;
    struct bfc__chunk **c = calloc(N, sizeof *c);
    bool *in = calloc(N, sizeof *in);
    size_t ref_count = 0, ref_bytes = 0;
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(in);
    rng_seed(seed);
    size_t *perm = shuffled(N);
    for (size_t k = 0; k < N; k++)
        c[k] = mk((uintptr_t)(perm[k] + 1) << 24, 256);
    bfc__bins_init(&b);

    for (size_t op = 0; op < OPS; op++) {
        uint64_t kind = rng_below(3);
        size_t k = (size_t)rng_below(N);
        if (kind == 0 && !in[k]) {
            c[k]->size = random_size(); /* a chunk out of the bins may change size */
            bfc__bins_insert(&b, c[k]);
            in[k] = true;
            ref_count++;
            ref_bytes += c[k]->size;
        } else if (kind == 1 && in[k]) {
            bfc__bins_remove(&b, c[k]);
            ck_assert_uint_eq(c[k]->link.slot, BFC__NO_SLOT);
            in[k] = false;
            ref_count--;
            ref_bytes -= c[k]->size;
        } else {
            size_t want = random_size();
            if (rng_below(4) == 0 && want > 256)
                want -= 256; /* just under a fixed size: lands on the size below */
            struct bfc__chunk *expect = NULL;
            for (size_t j = 0; j < N; j++)
                if (in[j] && c[j]->size >= want && (!expect || key_cmp(&c[j], &expect) < 0))
                    expect = c[j];
            struct bfc__chunk *got = bfc__bins_best_fit(&b, want);
            ck_assert_msg(got == expect,
                          "seed 0x%llx op %zu: best_fit(%zu) got (%zu, 0x%lx) want (%zu, 0x%lx)",
                          (unsigned long long)seed, op, want, got ? got->size : 0,
                          got ? (unsigned long)got->ptr : 0ul, expect ? expect->size : 0,
                          expect ? (unsigned long)expect->ptr : 0ul);
        }
        size_t tn, tbytes;
        bfc__bins_tally(&b, BFC__NUM_BINS, &tn, &tbytes);
        ck_assert_uint_eq(b.n, ref_count);
        ck_assert_uint_eq(tn, ref_count);
        ck_assert_uint_eq(tbytes, ref_bytes);
        if (op % 1000 == 999) {
            char msg[256];
            ck_assert_msg(bfc__bins_verify(&b, msg, sizeof msg) == 0,
                          "seed 0x%llx op %zu: %s", (unsigned long long)seed, op, msg);
            size_t largest = 0;
            for (size_t j = 0; j < N; j++) {
                if (in[j] && c[j]->size > largest)
                    largest = c[j]->size;
                ck_assert(bfc__bins_contains(&b, bfc__bin_for_size(c[j]->size), c[j]) == in[j]);
            }
            ck_assert_uint_eq(bfc__bins_largest(&b), largest);
        }
    }
    ck_assert_uint_gt(ref_count, N / 4); /* the sequence really filled the bins */
    for (size_t k = 0; k < N; k++)
        free(c[k]);
    free(c);
    free(in);
    free(perm);
}
END_TEST

/* Lower bound of `want` in a key-sorted array: the reference best fit. */
static struct bfc__chunk *ref_lower_bound(struct bfc__chunk **sorted, size_t n, size_t want)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (sorted[mid]->size < want)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n ? sorted[lo] : NULL;
}

static void check_queries(const struct bfc__bins *b, struct bfc__chunk **sorted, size_t n)
{
    for (int q = 0; q < 20000; q++) {
        size_t want = 256 * (1 + (size_t)rng_below(q % 2 ? 4200 : 64));
        struct bfc__chunk *expect = ref_lower_bound(sorted, n, want);
        ck_assert_msg(bfc__bins_best_fit(b, want) == expect, "best_fit(%zu) at n=%zu", want, n);
    }
    ck_assert_uint_eq(bfc__bins_largest(b), n ? sorted[n - 1]->size : 0);
}

START_TEST(test_scale_100k)
{
    enum { N = 100000 };
    struct bfc__bins b;
    struct bfc__chunk **c = malloc(N * sizeof *c), **sorted = malloc(N * sizeof *sorted);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(sorted);
    rng_seed(0x100000);
    size_t *perm = shuffled(N);
    /* sizes 256 B .. 1 MiB in 256-byte steps: bins 0..12, ~24 chunks per size */
    for (size_t k = 0; k < N; k++)
        c[k] = mk((uintptr_t)(perm[k] + 1) << 21, 256 * (1 + (size_t)rng_below(4096)));
    bfc__bins_init(&b);
    for (size_t k = 0; k < N; k++)
        bfc__bins_insert(&b, c[k]);
    verify_ok(&b);
    ck_assert_uint_eq(b.n, N);
    memcpy(sorted, c, N * sizeof *c);
    qsort(sorted, N, sizeof *sorted, key_cmp);
    check_queries(&b, sorted, N);

    /* remove a random half, then check again */
    for (size_t k = 0; k < N / 2; k++)
        bfc__bins_remove(&b, c[perm[k]]);
    verify_ok(&b);
    size_t n = 0;
    for (size_t k = 0; k < N; k++)
        if (c[k]->link.slot != BFC__NO_SLOT)
            sorted[n++] = c[k];
    ck_assert_uint_eq(n, N - N / 2);
    ck_assert_uint_eq(b.n, n);
    qsort(sorted, n, sizeof *sorted, key_cmp);
    check_queries(&b, sorted, n);

    /* and empty it by repeated best fit: every chunk comes out in key order */
    for (size_t k = 0; k < n; k++) {
        struct bfc__chunk *f = bfc__bins_best_fit(&b, 256);
        ck_assert_ptr_eq(f, sorted[k]);
        bfc__bins_remove(&b, f);
    }
    ck_assert_uint_eq(bins_nonempty(&b), 0);
    verify_ok(&b);
    for (size_t k = 0; k < N; k++)
        free(c[k]);
    free(c);
    free(sorted);
    free(perm);
}
END_TEST

/* --------------------------------------------------------- benchmark */

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* About log-uniform over 256 B .. 1 MiB (uniform within each power of two),
 * a multiple of 256; integer-only so the test needs no libm. */
static size_t bench_size(void)
{
    size_t lo = (size_t)256 << rng_below(12);
    return lo + ((size_t)rng_below(lo) & ~(size_t)255);
}

/*
 * With `present` chunks in the bins: insert a spare chunk of a random size,
 * take the best fit for a random size, remove what was found (the spare when
 * nothing fits) and make it the next spare, so the population stays constant.
 */
static double bench_one(size_t present, size_t iters)
{
    enum { TAB = 1 << 16 };
    struct bfc__bins b;
    struct bfc__chunk *recs = calloc(present + 1, sizeof *recs);
    size_t *ins = malloc(TAB * sizeof *ins), *req = malloc(TAB * sizeof *req);
    if (!recs || !ins || !req)
        abort();
    rng_seed(0xbe7c4 + present);
    for (size_t k = 0; k < TAB; k++) {
        ins[k] = bench_size();
        req[k] = bench_size();
    }
    bfc__bins_init(&b);
    for (size_t k = 0; k <= present; k++) {
        recs[k].ptr = (uintptr_t)(k + 1) << 21;
        recs[k].link.prio = bfc__bins_prio(recs[k].ptr);
        recs[k].size = bench_size();
        recs[k].link.slot = BFC__NO_SLOT;
        if (k < present)
            bfc__bins_insert(&b, &recs[k]);
    }
    struct bfc__chunk *spare = &recs[present];
    double best = 1e30;
    for (int round = 0; round < 15; round++) { /* min of many: robust to a busy machine */
        double t0 = now_ns();
        for (size_t i = 0; i < iters; i++) {
            spare->size = ins[i & (TAB - 1)];
            bfc__bins_insert(&b, spare);
            struct bfc__chunk *f = bfc__bins_best_fit(&b, req[(i * 7) & (TAB - 1)]);
            if (!f)
                f = spare;
            bfc__bins_remove(&b, f);
            spare = f;
        }
        double per = (now_ns() - t0) / (double)iters;
        if (per < best)
            best = per;
    }
    char msg[256];
    if (bfc__bins_verify(&b, msg, sizeof msg))
        fprintf(stderr, "bench: verify failed: %s\n", msg);
    free(recs);
    free(ins);
    free(req);
    return best;
}

static void bench(void)
{
    const size_t iters = 300000;
    double small = bench_one(1000, iters);
    double large = bench_one(100000, iters);
    printf("bins bench: ns per insert+best_fit+remove (best of 15 x %zu): "
           "1000 present %.1f, 100000 present %.1f (ratio %.2f)\n",
           iters, small, large, large / small);
}

/* --------------------------------------------------------------- main */

static Suite *bins_suite(void)
{
    Suite *s = suite_create("bins");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_bin_for_size);
    tcase_add_test(tc, test_slots);
    tcase_add_test(tc, test_falls_through_slots);
    tcase_add_test(tc, test_slot_map_words);
    tcase_add_test(tc, test_empty);
    tcase_add_test(tc, test_exact_match);
    tcase_add_test(tc, test_smallest_sufficient);
    tcase_add_test(tc, test_lowest_address_among_equals);
    tcase_add_test(tc, test_falls_through);
    tcase_add_test(tc, test_none_fits);
    tcase_add_test(tc, test_remove_skips);
    tcase_add_test(tc, test_largest);
    tcase_add_test(tc, test_walk_order);
    tcase_add_test(tc, test_verify_detects_corruption);
    tcase_add_test(tc, test_random_vs_reference);
    tcase_add_test(tc, test_scale_100k);
    tcase_set_timeout(tc, 60);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    const char *bench_env = getenv("BFC_BINS_BENCH");
    SRunner *sr = srunner_create(bins_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (bench_env && strcmp(bench_env, "1") == 0)
        bench();
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
