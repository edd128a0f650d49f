/*
 * test_regionmap.c -- the region map alone (src/regionmap.c): which region
 * holds an address, for region records made here (the map never touches
 * their memory, so the addresses are made up too).  Insert, lookup at the
 * edges, remove, count per context, shrink in place, tombstones left by a
 * removal that cannot allocate its copy, lookups by reader threads
 * under RCU while a writer inserts, shrinks and removes, and the ranges
 * remembered as departed (double frees of blocks whose memory left).
 *
 * The map is process-wide: every test removes what it inserted, so the
 * tests also run one after another in one process (CK_FORK=no).
 */
#include "testutil.h"

#include <pthread.h>
#include <stdatomic.h>

#include "region.h"
#include "regionmap.h"
#include "rcu.h"

/* Made-up device addresses, far from anything the process maps. */
#define BASE ((uintptr_t)0x5a0000000000ull)

/* Two owners' tags, only ever compared by address. */
static char ctx_tag_a, ctx_tag_b;
#define CTX_A ((const void *)&ctx_tag_a)
#define CTX_B ((const void *)&ctx_tag_b)

static void rgn_init(struct bfc__region *r, uintptr_t base, size_t size, const void *tag)
{
    memset(r, 0, sizeof *r);
    r->base = base;
    r->size = size;
    r->tag = (void *)tag;
}

static struct bfc__region *lookup(uintptr_t p)
{
    bfc__rcu_lock();
    struct bfc__region *r = bfc__regionmap_lookup(p);
    bfc__rcu_unlock();
    return r;
}

static void xinsert(struct bfc__region *r)
{
    int rc = bfc__regionmap_insert(r);
    ck_assert_msg(rc == BFC_OK, "regionmap_insert(%#lx): %s", (unsigned long)r->base, bfc_err_name(rc));
}

/* r resolves over all of [base, base + size), and not just outside it
 * unless a neighbour is there. */
static void expect_region(struct bfc__region *r)
{
    ck_assert_ptr_eq(lookup(r->base), r);
    ck_assert_ptr_eq(lookup(r->base + 1), r);
    ck_assert_ptr_eq(lookup(r->base + r->size / 2), r);
    ck_assert_ptr_eq(lookup(r->base + r->size - 1), r);
    ck_assert_ptr_ne(lookup(r->base + r->size), r);
    ck_assert_ptr_ne(lookup(r->base - 1), r);
}

static void expect_absent(uintptr_t base, size_t size)
{
    ck_assert_ptr_null(lookup(base));
    ck_assert_ptr_null(lookup(base + size / 2));
    ck_assert_ptr_null(lookup(base + size - 1));
}

/* ------------------------------------------------------------ basics */

START_TEST(test_empty)
{
    ck_assert_ptr_null(lookup(0));
    ck_assert_ptr_null(lookup(BASE));
    ck_assert_ptr_null(lookup(UINTPTR_MAX));
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 0);
}
END_TEST

START_TEST(test_insert_lookup_remove)
{
    enum { N = 64 };
    static struct bfc__region r[N];
    /* Regions of various sizes, some adjacent, some with gaps, inserted
     * in a scrambled order. */
    uintptr_t at = BASE;
    for (int i = 0; i < N; i++) {
        size_t size = (size_t)(1 + i % 5) * MiB;
        rgn_init(&r[i], at, size, i % 3 ? CTX_A : CTX_B);
        at += size + (i % 4 == 0 ? 3 * MiB : 0);
    }
    for (int k = 0; k < N; k++)
        xinsert(&r[(k * 37) % N]);
    for (int i = 0; i < N; i++)
        expect_region(&r[i]);
    ck_assert_ptr_null(lookup(BASE - 1));
    ck_assert_ptr_null(lookup(at));
    ck_assert_ptr_null(lookup(r[0].base + r[0].size)); /* the first gap */
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A) + bfc__regionmap_count(CTX_B), N);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_B), (N + 2) / 3);

    /* Every other one goes; its neighbours stay whole. */
    for (int i = 0; i < N; i += 2)
        bfc__regionmap_remove(&r[i], false);
    for (int i = 0; i < N; i++) {
        if (i % 2)
            expect_region(&r[i]);
        else
            expect_absent(r[i].base, r[i].size);
    }
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A) + bfc__regionmap_count(CTX_B), N / 2);
    /* Removing one that is not there changes nothing. */
    bfc__regionmap_remove(&r[0], false);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A) + bfc__regionmap_count(CTX_B), N / 2);

    /* A new record at a departed region's addresses takes them over. */
    struct bfc__region again;
    rgn_init(&again, r[2].base, r[2].size, CTX_A);
    xinsert(&again);
    expect_region(&again);
    bfc__regionmap_remove(&again, false);
    for (int i = 1; i < N; i += 2)
        bfc__regionmap_remove(&r[i], false);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A) + bfc__regionmap_count(CTX_B), 0);
    ck_assert_ptr_null(lookup(r[1].base));
}
END_TEST

START_TEST(test_shrink)
{
    struct bfc__region a, b;
    rgn_init(&a, BASE, 8 * MiB, CTX_A);
    rgn_init(&b, BASE + 8 * MiB, 2 * MiB, CTX_A);
    xinsert(&a);
    xinsert(&b);
    /* a's tail departs: the tail no longer resolves, the rest does. */
    a.size = 3 * MiB;
    bfc__regionmap_shrink(&a, false);
    expect_region(&a);
    expect_absent(BASE + 3 * MiB, 5 * MiB);
    expect_region(&b);
    /* A later region over the departed tail. */
    struct bfc__region t;
    rgn_init(&t, BASE + 4 * MiB, 4 * MiB, CTX_A);
    xinsert(&t);
    expect_region(&a);
    expect_region(&t);
    expect_absent(BASE + 3 * MiB, 1 * MiB);
    /* Shrinking a region that is not in the map changes nothing. */
    struct bfc__region stranger;
    rgn_init(&stranger, BASE + 4 * MiB, 1 * MiB, CTX_A);
    bfc__regionmap_shrink(&stranger, false);
    expect_region(&t);
    bfc__regionmap_remove(&t, false);
    bfc__regionmap_remove(&a, false);
    bfc__regionmap_remove(&b, false);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 0);
}
END_TEST

/* ------------------------------------------------------- tombstones */

START_TEST(test_tombstones)
{
    struct bfc__region w, x, y, v;
    rgn_init(&w, BASE, 2 * MiB, CTX_A);
    rgn_init(&x, BASE + 2 * MiB, 2 * MiB, CTX_A);
    rgn_init(&y, BASE + 4 * MiB, 2 * MiB, CTX_A);
    rgn_init(&v, BASE + 8 * MiB, 2 * MiB, CTX_A);
    xinsert(&w);
    xinsert(&x);
    xinsert(&y);
    xinsert(&v);

    /* No metadata for a copy: insert fails and changes nothing; removal
     * empties the entries in place. */
    bfc_sim_fail_meta_every(1);
    struct bfc__region z;
    rgn_init(&z, BASE + 12 * MiB, 1 * MiB, CTX_A);
    ck_assert_int_eq(bfc__regionmap_insert(&z), BFC_ENOMEM);
    bfc__regionmap_remove(&x, false);
    bfc__regionmap_remove(&y, false);
    bfc__regionmap_remove(&y, false); /* a tombstone is not found again */
    bfc_sim_fail_meta_every(0);
    ck_assert_ptr_null(lookup(z.base));
    expect_absent(x.base, x.size);
    expect_absent(y.base, y.size);
    /* Lookups over the tombstones find nothing; w and v are untouched. */
    expect_region(&w);
    expect_region(&v);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 2);

    /* The next copy drops them: new regions at their addresses resolve. */
    struct bfc__region x2, y2;
    rgn_init(&x2, x.base, 3 * MiB, CTX_A); /* over x and the front of y */
    rgn_init(&y2, x.base + 3 * MiB, 1 * MiB, CTX_A);
    xinsert(&x2);
    xinsert(&y2);
    expect_region(&x2);
    expect_region(&y2);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 4);
    bfc__regionmap_remove(&x2, false);
    bfc__regionmap_remove(&y2, false);
    bfc__regionmap_remove(&w, false);
    bfc__regionmap_remove(&v, false);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 0);
}
END_TEST

/* The last entry a tombstone: a lookup past the end lands on it and steps
 * back to the live entry before it. */
START_TEST(test_tombstone_last)
{
    struct bfc__region a, b;
    rgn_init(&a, BASE, 4 * MiB, CTX_A);
    rgn_init(&b, BASE + 4 * MiB, 4 * MiB, CTX_A);
    xinsert(&a);
    xinsert(&b);
    bfc_sim_fail_meta_every(1);
    bfc__regionmap_remove(&b, false); /* the last entry becomes a tombstone */
    bfc_sim_fail_meta_every(0);
    /* Past the end: step back over the tombstone to a, which ends before. */
    expect_absent(b.base, b.size);
    ck_assert_ptr_null(lookup(BASE + 64 * MiB));
    expect_region(&a);
    bfc__regionmap_remove(&a, false);
    ck_assert_ptr_null(lookup(a.base));
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 0);
}
END_TEST

/* ------------------------------------------------------- concurrency */

enum { NSTABLE = 16, NCHURN = 16, NREADERS = 3 };

static struct bfc__region g_stable[NSTABLE], g_churn[NCHURN];
static atomic_bool g_stop;
static atomic_ullong g_lookups;
static char g_why[256];
static atomic_bool g_bad;

static void reader_fail(const char *what, uintptr_t p, const struct bfc__region *got)
{
    bool was = false;
    if (atomic_compare_exchange_strong(&g_bad, &was, true))
        snprintf(g_why, sizeof g_why, "%s: lookup(%#lx) = %p", what, (unsigned long)p, (const void *)got);
}

/* Layout: stable region i at BASE + 4i MiB (1 MiB), churn region i at
 * BASE + 4i MiB + 2 MiB (1 MiB, shrinking to 512 KiB and back). */
static void *reader(void *arg)
{
    uint64_t x = (uint64_t)(uintptr_t)arg;
    unsigned long long n = 0;
    while (!atomic_load_explicit(&g_stop, memory_order_relaxed) && !atomic_load(&g_bad)) {
        uint64_t r = rng_next(&x);
        size_t i = (size_t)(r % NSTABLE);
        uintptr_t off = (uintptr_t)((r >> 8) % MiB);
        bfc__rcu_lock();
        uintptr_t p = g_stable[i].base + off;
        struct bfc__region *got = bfc__regionmap_lookup(p);
        if (got != &g_stable[i])
            reader_fail("stable region", p, got);
        /* A churning region's addresses resolve to it or to nothing. */
        p = BASE + 4 * MiB * i + 2 * MiB + off;
        got = bfc__regionmap_lookup(p);
        if (got != NULL && got != &g_churn[i])
            reader_fail("churning region", p, got);
        /* The gaps never resolve. */
        p = BASE + 4 * MiB * i + 1 * MiB + off;
        got = bfc__regionmap_lookup(p);
        if (got != NULL)
            reader_fail("gap", p, got);
        bfc__rcu_unlock();
        /* Counting (bfc_ctx_check's region count) reads every entry while
         * the writer shrinks some in place: the stable ones are all there
         * (a plain read of an entry's end raced with the shrink's store,
         * which the TSan build reports). */
        if ((n & 63) == 0 && bfc__regionmap_count(CTX_A) != NSTABLE)
            reader_fail("count of the stable regions", 0, NULL);
        n++;
    }
    atomic_fetch_add(&g_lookups, n);
    return NULL;
}

START_TEST(test_readers_under_rcu)
{
    for (int i = 0; i < NSTABLE; i++) {
        rgn_init(&g_stable[i], BASE + 4 * MiB * (uintptr_t)i, 1 * MiB, CTX_A);
        xinsert(&g_stable[i]);
    }
    for (int i = 0; i < NCHURN; i++)
        rgn_init(&g_churn[i], BASE + 4 * MiB * (uintptr_t)i + 2 * MiB, 1 * MiB, CTX_B);
    atomic_store(&g_stop, false);
    atomic_store(&g_bad, false);
    pthread_t th[NREADERS];
    for (int i = 0; i < NREADERS; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, reader, (void *)(uintptr_t)(i + 1)), 0);

    uint64_t x = 99;
    bool in[NCHURN] = { false };
    unsigned writes = 0;
    uint64_t end = now_ns() + 500000000u;
    while ((writes < 2000 || now_ns() < end) && writes < 200000 && !atomic_load(&g_bad)) {
        size_t i = (size_t)(rng_next(&x) % NCHURN);
        if (!in[i]) {
            g_churn[i].size = 1 * MiB;
            REQUIRE(bfc__regionmap_insert(&g_churn[i]) == BFC_OK, "insert failed");
        } else if (g_churn[i].size == 1 * MiB && (x & 1)) {
            g_churn[i].size = 512 * KiB;
            bfc__regionmap_shrink(&g_churn[i], false);
            writes++;
            continue;
        } else {
            bfc__regionmap_remove(&g_churn[i], false);
        }
        in[i] = !in[i];
        writes++;
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < NREADERS; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    ck_assert_msg(!atomic_load(&g_bad), "%s", g_why);
    ck_assert_uint_gt(atomic_load(&g_lookups), 0);

    for (int i = 0; i < NCHURN; i++) {
        if (in[i]) {
            ck_assert_ptr_eq(lookup(g_churn[i].base), &g_churn[i]);
            bfc__regionmap_remove(&g_churn[i], false);
        }
        ck_assert_ptr_null(lookup(g_churn[i].base));
    }
    ck_assert_uint_eq(bfc__regionmap_count(CTX_B), 0);
    for (int i = 0; i < NSTABLE; i++)
        bfc__regionmap_remove(&g_stable[i], false);
    ck_assert_uint_eq(bfc__regionmap_count(CTX_A), 0);
    /* The replaced arrays are freed after their grace periods. */
    rcu_barrier();
}
END_TEST

/*
 * Each thread remembers the entry it found last and tries it first.  The
 * remembered entry must never answer for a region that is gone: not after
 * its array was replaced (a removal, a new region at the same addresses),
 * not when it was emptied in place (a tombstone) or shrunk in place.
 */
START_TEST(test_thread_hint)
{
    struct bfc__region a, b, a2;
    rgn_init(&a, BASE, 2 * MiB, CTX_A);
    rgn_init(&b, BASE + 4 * MiB, 2 * MiB, CTX_A);
    xinsert(&a);
    xinsert(&b);
    ck_assert_ptr_eq(lookup(a.base + 4096), &a); /* the hint is a */
    ck_assert_ptr_eq(lookup(a.base + 8192), &a);

    /* Shrunk in place: the hint's entry no longer covers the tail. */
    a.size = 1 * MiB;
    bfc__regionmap_shrink(&a, false);
    ck_assert_ptr_eq(lookup(a.base + 4096), &a);
    ck_assert_ptr_null(lookup(a.base + 1 * MiB + 4096));

    /* Replaced by a region at the same addresses (a new array). */
    ck_assert_ptr_eq(lookup(a.base), &a);
    bfc__regionmap_remove(&a, false);
    ck_assert_ptr_null(lookup(a.base + 4096));
    rgn_init(&a2, BASE, 2 * MiB, CTX_B);
    xinsert(&a2);
    ck_assert_ptr_eq(lookup(a.base + 4096), &a2);

    /* Emptied in place (removal without metadata for a copy). */
    ck_assert_ptr_eq(lookup(a2.base + 4096), &a2); /* the hint is a2 */
    bfc_sim_fail_meta_every(1);
    bfc__regionmap_remove(&a2, false);
    bfc_sim_fail_meta_every(0);
    ck_assert_ptr_null(lookup(a2.base + 4096));
    ck_assert_ptr_eq(lookup(b.base), &b);
    bfc__regionmap_remove(&b, false);
    ck_assert_ptr_null(lookup(b.base));
    rcu_barrier();
}
END_TEST

/*
 * Departed ranges: a region removed after use, or a tail shed after use,
 * is remembered with its context -- a large block's region by its base
 * alone, another at every 256-byte boundary -- newest first; a region
 * inserted over one erases it; forget drops a context's; the ring keeps the
 * last BFC__GONE_MAX.
 */
static int gone_of(uintptr_t p, const void **tag)
{
    *tag = NULL;
    return bfc__regionmap_gone(p, NULL, tag);
}

START_TEST(test_departed)
{
    const void *tag;
    struct bfc__region a, big, t, unused, again;
    rgn_init(&a, BASE, 2 * MiB, CTX_A);
    rgn_init(&big, BASE + 8 * MiB, 64 * MiB, CTX_B);
    big.large = true;
    rgn_init(&unused, BASE + 4 * MiB, 2 * MiB, CTX_A);
    xinsert(&a);
    xinsert(&big);
    xinsert(&unused);
    ck_assert_int_eq(gone_of(a.base, &tag), BFC_ENOTOWNED); /* live: not departed */

    bfc__regionmap_remove(&a, true);
    bfc__regionmap_remove(&big, true);
    bfc__regionmap_remove(&unused, false);
    ck_assert_int_eq(gone_of(a.base, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_A);
    ck_assert_int_eq(gone_of(a.base + 256 * 37, &tag), BFC_EDOUBLEFREE);
    ck_assert_int_eq(gone_of(a.base + 2 * MiB - 256, &tag), BFC_EDOUBLEFREE);
    ck_assert_int_eq(gone_of(a.base + 8, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(a.base + 2 * MiB, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(big.base, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_B);
    ck_assert_int_eq(gone_of(big.base + 256, &tag), BFC_ENOTOWNED); /* one block */
    ck_assert_int_eq(gone_of(unused.base, &tag), BFC_ENOTOWNED);    /* never used */

    /* A shed tail: the departed part only. */
    rgn_init(&t, BASE + 128 * MiB, 4 * MiB, CTX_A);
    xinsert(&t);
    t.size = 1 * MiB;
    bfc__regionmap_shrink(&t, true);
    ck_assert_int_eq(gone_of(t.base, &tag), BFC_ENOTOWNED); /* still the region's */
    ck_assert_ptr_eq(lookup(t.base), &t);
    ck_assert_int_eq(gone_of(t.base + 1 * MiB, &tag), BFC_EDOUBLEFREE);
    ck_assert_int_eq(gone_of(t.base + 4 * MiB - 256, &tag), BFC_EDOUBLEFREE);
    bfc__regionmap_remove(&t, false);

    /* Given out again: what is given out leaves the record, the rest of it
     * stays; departed again, the newer record decides. */
    rgn_init(&again, BASE, 1 * MiB, CTX_B);
    xinsert(&again);
    ck_assert_int_eq(gone_of(a.base + 256, &tag), BFC_ENOTOWNED); /* given out */
    ck_assert_int_eq(gone_of(a.base + 1 * MiB, &tag), BFC_EDOUBLEFREE); /* not given out */
    ck_assert_ptr_eq(tag, CTX_A);
    again.large = true;
    bfc__regionmap_remove(&again, true);
    ck_assert_int_eq(gone_of(a.base, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_B);
    ck_assert_int_eq(gone_of(a.base + 256, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(a.base + 2 * MiB - 256, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_A);

    /* A region inside a departed range splits it; inside a large block's,
     * only the part holding the block's start answers. */
    struct bfc__region mid, bmid;
    rgn_init(&mid, a.base + 1 * MiB + 256 * 1024, 256 * 1024, CTX_B);
    xinsert(&mid);
    ck_assert_int_eq(gone_of(a.base + 1 * MiB, &tag), BFC_EDOUBLEFREE);
    ck_assert_int_eq(gone_of(mid.base, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(mid.base + mid.size, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_A);
    bfc__regionmap_remove(&mid, false);
    ck_assert_int_eq(gone_of(mid.base, &tag), BFC_ENOTOWNED); /* given out, never used */
    rgn_init(&bmid, big.base + 4 * MiB, 4 * MiB, CTX_A);
    xinsert(&bmid);
    ck_assert_int_eq(gone_of(big.base, &tag), BFC_EDOUBLEFREE);
    ck_assert_ptr_eq(tag, CTX_B);
    bfc__regionmap_remove(&bmid, false);
    rgn_init(&bmid, big.base, 4 * MiB, CTX_A);
    xinsert(&bmid);
    bfc__regionmap_remove(&bmid, false);
    ck_assert_int_eq(gone_of(big.base, &tag), BFC_ENOTOWNED); /* its start given out */

    /* Forgotten with its context. */
    bfc__regionmap_forget(CTX_B);
    ck_assert_int_eq(gone_of(a.base, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(a.base + 1 * MiB, &tag), BFC_EDOUBLEFREE); /* CTX_A's stays */
    ck_assert_int_eq(gone_of(t.base + 1 * MiB, &tag), BFC_EDOUBLEFREE); /* CTX_A's stays */

    /* The ring: BFC__GONE_MAX departures later, the oldest is forgotten. */
    for (size_t k = 0; k < BFC__GONE_MAX; k++) {
        struct bfc__region r;
        rgn_init(&r, BASE + 256 * MiB + k * 2 * MiB, 2 * MiB, CTX_B);
        xinsert(&r);
        bfc__regionmap_remove(&r, true);
    }
    ck_assert_int_eq(gone_of(t.base + 1 * MiB, &tag), BFC_ENOTOWNED);
    ck_assert_int_eq(gone_of(BASE + 256 * MiB, &tag), BFC_EDOUBLEFREE); /* the oldest kept */
    ck_assert_int_eq(gone_of(BASE + 256 * MiB + (BFC__GONE_MAX - 1) * 2 * MiB, &tag), BFC_EDOUBLEFREE);
    bfc__regionmap_forget(CTX_A);
    bfc__regionmap_forget(CTX_B);
    ck_assert_int_eq(gone_of(BASE + 256 * MiB, &tag), BFC_ENOTOWNED);
    rcu_barrier();
}
END_TEST

static Suite *regionmap_suite(void)
{
    Suite *s = suite_create("regionmap");
    TCase *tc = tcase_create("regionmap");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_empty);
    tcase_add_test(tc, test_insert_lookup_remove);
    tcase_add_test(tc, test_shrink);
    tcase_add_test(tc, test_tombstones);
    tcase_add_test(tc, test_tombstone_last);
    tcase_add_test(tc, test_readers_under_rcu);
    tcase_add_test(tc, test_thread_hint);
    tcase_add_test(tc, test_departed);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return run_suite(regionmap_suite());
}
