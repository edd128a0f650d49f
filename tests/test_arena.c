/*
 * test_arena.c -- black-box tests of one BFC arena (a context driven from a
 * single stream), through the public API only.
 *
 * What is asserted is what a user of the allocator can observe: returned
 * addresses, bfc_ctx_allocated_size / requested_size / allocation_id, the
 * statistics of bfc_ctx_stats, the SIM backend's allocation counters, and the
 * verdict of bfc_ctx_check.  Many tests use the "TensorFlow" configuration
 * (allow_growth=false, large_alloc=0, initial_region == memory_limit), in
 * which the context is one region of the whole limit and every address is
 * predictable from the BFC algorithm (src/arena.c's opening comment): best fit,
 * lowest address among equal sizes, split when the chunk is >= 2x the rounded
 * size or the leftover >= the max internal fragmentation, coalescing with both
 * neighbours.  The growth tests follow TensorFlow's Extend() to the byte.
 *
 * Most tests run twice (loop index 0: the default stream NULL; 1: a simulated
 * stream from bfc_sim_stream_create), since a one-stream context is the arena
 * whichever stream drives it.
 *
 * Modelled on TensorFlow's gpu_bfc_allocator_test.cc (NoDups,
 * AllocationsAndDeallocations, ExerciseCoalescing, AllocatedVsRequested,
 * AllocationsAndDeallocationsWithGrowth, PhysicalAllocatorOomsFragmentation,
 * TestBinDebugInfo) plus the error-path tests of PyTorch's caching allocator
 * and RMM's arena.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* strcasestr, open_memstream */
#endif
#include "testutil.h"

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>


/* ------------------------------------------------------------- helpers */

static char *cp(void *p)
{
    return (char *)p;
}

/* TensorFlow's allocator with allow_growth=false: one region of the limit. */
static bfc_config_t cfg_tf(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = limit;
    c.allow_growth = false;
    c.initial_region = limit;
    c.large_alloc = 0;
    c.garbage_collection = false;
    return c;
}

/* Growth from 2 MiB regions, large requests (>= 32 MiB) in regions of their
 * own: classic regions (vmm=off), whose layout these tests check. */
static bfc_config_t cfg_grow(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.vmm = BFC_VMM_OFF;
    c.memory_limit = limit;
    c.allow_growth = true;
    c.initial_region = 2 * MiB;
    c.large_alloc = 32 * MiB;
    c.garbage_collection = false;
    return c;
}

/* Loop index 0: the default stream; 1: a simulated stream. */
static bfc_stream_t pick_stream(bfc_ctx_t *ctx, int i)
{
    if (i == 0)
        return NULL;
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    ck_assert_ptr_nonnull(s);
    return s;
}

static void ctx_done(bfc_ctx_t *ctx, bfc_stream_t s)
{
    if (s != NULL)
        bfc_sim_stream_destroy(ctx, s);
    bfc_ctx_destroy(ctx);
}

/* A successful allocation, with the properties every one must have. */
static void *xalloc_full(bfc_ctx_t *ctx, bfc_stream_t s, size_t n)
{
    void *p = bfc_ctx_alloc(ctx, s, n);
    ck_assert_msg(p != NULL, "alloc(%zu) failed: %s", n, bfc_err_name(bfc_last_error()));
    ck_assert_msg(((uintptr_t)p & 255) == 0, "alloc(%zu) = %p is not 256-byte aligned", n, p);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), n);
    size_t a = bfc_ctx_allocated_size(ctx, p);
    ck_assert_msg(a >= r256(n) && a % 256 == 0, "alloc(%zu): allocated_size %zu", n, a);
    ck_assert_int_ge(bfc_ctx_allocation_id(ctx, p), 0);
    return p;
}

/* An allocation that must fail with BFC_ENOMEM and change nothing but num_ooms. */
static void expect_oom(bfc_ctx_t *ctx, bfc_stream_t s, size_t n)
{
    bfc_stats_t a = st(ctx);
    void *p = bfc_ctx_alloc(ctx, s, n);
    ck_assert_msg(p == NULL, "alloc(%zu) = %p, expected NULL", n, p);
    ck_assert_msg(bfc_last_error() == BFC_ENOMEM, "alloc(%zu): last_error %s, expected BFC_ENOMEM",
                  n, bfc_err_name(bfc_last_error()));
    bfc_stats_t b = st(ctx);
    ck_assert_uint_eq(a.num_allocs, b.num_allocs);
    ck_assert_uint_eq(a.num_frees, b.num_frees);
    ck_assert_uint_eq(a.bytes_in_use, b.bytes_in_use);
    ck_assert_uint_eq(a.bytes_requested, b.bytes_requested);
    ck_assert_uint_eq(a.bytes_reserved, b.bytes_reserved);
    ck_assert_uint_eq(a.num_regions, b.num_regions);
    ck_assert_uint_eq(a.peak_bytes_in_use, b.peak_bytes_in_use);
    ck_assert_uint_ge(b.num_ooms, a.num_ooms);
    ck_assert_uint_le(b.num_ooms, a.num_ooms + 1);
    xcheck(ctx);
}

/* A free that must fail with `want` and leave every statistic as it was. */
static void expect_bad_free(bfc_ctx_t *ctx, void *p, bfc_stream_t s, int want)
{
    bfc_stats_t a = st(ctx);
    int rc = bfc_ctx_free(ctx, p, s);
    ck_assert_msg(rc == want, "free(%p) = %s, expected %s", p, bfc_err_name(rc), bfc_err_name(want));
    bfc_stats_t b = st(ctx);
    ck_assert_msg(memcmp(&a, &b, sizeof a) == 0, "free(%p) (rejected) changed the stats", p);
    xcheck(ctx);
}

/* Simple deterministic generator (splitmix64). */

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

/* Sorted by address, no two live blocks overlap (allocated sizes). */
static void expect_disjoint(bfc_ctx_t *ctx, void **ptrs, size_t n)
{
    void **v = malloc(n * sizeof *v);
    ck_assert_ptr_nonnull(v);
    memcpy(v, ptrs, n * sizeof *v);
    qsort(v, n, sizeof *v, cmp_ptr);
    for (size_t i = 1; i < n; i++) {
        ck_assert_msg(v[i] != v[i - 1], "duplicate pointer %p", v[i]);
        size_t req = bfc_ctx_requested_size(ctx, v[i - 1]);
        size_t asz = bfc_ctx_allocated_size(ctx, v[i - 1]);
        ck_assert_uint_gt(req, 0);
        ck_assert_msg((uintptr_t)v[i] - (uintptr_t)v[i - 1] >= asz,
                      "%p (+%zu) overlaps %p", v[i - 1], asz, v[i]);
    }
    free(v);
}

/* ------------------------------------------------ sizes and rounding */

START_TEST(test_zero_size)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    /* Make last_error non-OK first, so that n == 0 must actively reset it. */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, SIZE_MAX));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc_stats_t a = st(ctx);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 0));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    bfc_stats_t b = st(ctx);
    ck_assert_uint_eq(a.num_allocs, b.num_allocs);
    ck_assert_uint_eq(a.num_ooms, b.num_ooms);
    ck_assert_uint_eq(b.bytes_reserved, 0);
    ck_assert_uint_eq(b.num_regions, 0);

    void *p = xalloc_full(ctx, s, 1);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, 0));
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    ck_assert_uint_eq(st(ctx).num_allocs, 1);
    xfree(ctx, p, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * TensorFlow's TestLog2FloorNonZeroSlow / RoundedBytes, seen from outside: in
 * one big free region every request is split off the front, so its chunk is
 * exactly the request rounded up to 256, always at the region's start.
 */
START_TEST(test_rounding_allocated_size)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *base = xalloc_full(ctx, s, 1);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, base), 256);
    xfree(ctx, base, s);

    size_t sizes[1300];
    size_t n = 0;
    for (size_t k = 1; k <= 1100; k++)
        sizes[n++] = k;
    for (unsigned k = 8; k <= 29; k++) {
        sizes[n++] = ((size_t)1 << k) - 1;
        sizes[n++] = (size_t)1 << k;
        sizes[n++] = ((size_t)1 << k) + 1;
    }
    static const size_t odd[] = {12345, 65535, 65537, 99999, 1000000, 123456789, 255 * 1021, 3 * MiB + 7};
    for (size_t k = 0; k < sizeof odd / sizeof odd[0]; k++)
        sizes[n++] = odd[k];

    for (size_t k = 0; k < n; k++) {
        void *p = xalloc_full(ctx, s, sizes[k]);
        ck_assert_msg(p == base, "alloc(%zu) = %p, expected the region start %p", sizes[k], p, base);
        ck_assert_msg(bfc_ctx_allocated_size(ctx, p) == r256(sizes[k]),
                      "alloc(%zu): allocated_size %zu, expected %zu", sizes[k],
                      bfc_ctx_allocated_size(ctx, p), r256(sizes[k]));
        ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), sizes[k]);
        ck_assert_uint_eq(st(ctx).bytes_in_use, r256(sizes[k]));
        xfree(ctx, p, s);
    }
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* TensorFlow's AllocatedVsRequested, plus an unsplit chunk. */
START_TEST(test_allocated_vs_requested)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *t1 = xalloc_full(ctx, s, 4);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, t1), 4);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, t1), 256);

    /* A 1 KiB hole between two live blocks; 768 B takes all of it (no split). */
    void *a = xalloc_full(ctx, s, 1024);
    void *b = xalloc_full(ctx, s, 1024);
    xfree(ctx, a, s);
    void *q = xalloc_full(ctx, s, 768);
    ck_assert_ptr_eq(q, a);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, q), 768);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), 1024);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_in_use, 256 + 1024 + 1024);
    ck_assert_uint_eq(x.bytes_requested, 4 + 768 + 1024);

    xfree(ctx, q, s);
    xfree(ctx, b, s);
    xfree(ctx, t1, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* TensorFlow's AllocateTooLarge / TestCustomMemoryLimit, and overflow. */
START_TEST(test_alloc_too_large)
{
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_grow(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    const size_t huge[] = {SIZE_MAX,         SIZE_MAX - 1,    SIZE_MAX - 254, SIZE_MAX - 255,
                           SIZE_MAX - 256,   SIZE_MAX / 2 + 1, (size_t)1 << 63, (size_t)1 << 40,
                           limit + 1,        limit + 256,     2 * limit};
    const size_t nhuge = sizeof huge / sizeof huge[0];

    /* On a fresh growing context: nothing is reserved for a hopeless request. */
    for (size_t k = 0; k < nhuge; k++)
        expect_oom(ctx, s, huge[k]);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 0);
    ck_assert_uint_eq(x.num_regions, 0);
    ck_assert_uint_eq(x.num_allocs, 0);
    ck_assert_uint_eq(x.bytes_limit, limit);

    /* Exactly the limit fits (a large request: a region of its own). */
    void *p = xalloc_full(ctx, s, limit);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), limit);
    ck_assert_uint_eq(st(ctx).bytes_reserved, limit);
    memset(p, 0x5A, 4096);
    memset(cp(p) + limit - 4096, 0xA5, 4096);
    xfree(ctx, p, s);

    /* With state present, the same requests still change nothing. */
    void *q = xalloc_full(ctx, s, 1000);
    for (size_t k = 0; k < nhuge; k++)
        expect_oom(ctx, s, huge[k]);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, q), 1000);
    xfree(ctx, q, s);
    xcheck(ctx);
    ctx_done(ctx, s);

    /* TensorFlow's TestCustomMemoryLimit: a 2 MiB allocator. */
    c = cfg_tf(2 * MiB);
    ctx = ctx_new(&c);
    s = pick_stream(ctx, _i);
    void *first = xalloc_full(ctx, s, 256);
    expect_oom(ctx, s, 2 * MiB);
    xfree(ctx, first, s);
    void *all = xalloc_full(ctx, s, 2 * MiB);
    ck_assert_ptr_eq(all, first);
    expect_oom(ctx, s, 1);
    xfree(ctx, all, s);
    ctx_done(ctx, s);
}
END_TEST

/* ------------------------------------------------------ split rule */

START_TEST(test_split_twice_rule)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *a = xalloc_full(ctx, s, 4096);
    void *g = xalloc_full(ctx, s, 256);
    ck_assert_ptr_eq(g, cp(a) + 4096);
    xfree(ctx, a, s);

    /* 4096 >= 2 x 2048: split, the front goes out, the back stays free. */
    void *p = xalloc_full(ctx, s, 2048);
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 2048);
    void *q = xalloc_full(ctx, s, 2048);
    ck_assert_ptr_eq(q, cp(a) + 2048);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), 2048);
    xfree(ctx, p, s);
    xfree(ctx, q, s);

    /* 4096 < 2 x 2304 and 1792 < 128 MiB: the whole chunk. */
    p = xalloc_full(ctx, s, 2304);
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 4096);
    xfree(ctx, p, s);
    p = xalloc_full(ctx, s, 2049);
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 4096);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), 2049);
    xfree(ctx, p, s);
    p = xalloc_full(ctx, s, 2047);
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 2048);
    xfree(ctx, p, s);
    xfree(ctx, g, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* fragmentation_fraction x limit replaces the 128 MiB rule: here 1 KiB. */
START_TEST(test_split_fraction_rule)
{
    bfc_config_t c = cfg_tf(64 * MiB);
    c.fragmentation_fraction = 1.0 / 65536.0; /* 64 MiB / 65536 = 1024 bytes */
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *a = xalloc_full(ctx, s, 4096);
    void *g = xalloc_full(ctx, s, 256);
    xfree(ctx, a, s);

    void *p = xalloc_full(ctx, s, 2304); /* leftover 1792 >= 1024: split */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 2304);
    void *q = xalloc_full(ctx, s, 1792);
    ck_assert_ptr_eq(q, cp(a) + 2304);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), 1792);
    xfree(ctx, p, s);
    xfree(ctx, q, s);

    p = xalloc_full(ctx, s, 3072); /* leftover exactly 1024: split */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 3072);
    xfree(ctx, p, s);

    p = xalloc_full(ctx, s, 3328); /* leftover 768 < 1024 and 4096 < 6656: no split */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 4096);
    xfree(ctx, p, s);
    xfree(ctx, g, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* The fraction is of the limit as configured, as TensorFlow's
 * fragmentation_fraction * memory_limit_, not of the limit rounded down
 * to 256 bytes: with 1048751 bytes and 0.3, the threshold is 314625, and
 * the 314624 bytes a 733952-byte block leaves of the 1 MiB region stay
 * in its chunk (of the rounded limit, 314572, they were split off). */
START_TEST(test_split_fraction_of_configured_limit)
{
    bfc_config_t c = cfg_tf(1048751);
    c.fragmentation_fraction = 0.3;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p = xalloc_full(ctx, s, 733952);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 1048576);
    xfree(ctx, p, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* fraction x limit past what a size_t holds (1 x 2^64 - 1, which rounds
 * to 2^64 as a double) is no threshold at all, never one of 256 bytes (the
 * conversion's undefined result on x86): the 512 KiB a 1.5 MiB block
 * leaves of a 2 MiB region stay in its chunk. */
START_TEST(test_split_fraction_huge_limit)
{
    bfc_config_t c = cfg_grow(SIZE_MAX);
    c.fragmentation_fraction = 1.0;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 256);
    void *p = xalloc_full(ctx, s, 1536 * KiB);
    ck_assert_ptr_eq(p, cp(a) + 256);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 2 * MiB - 256);
    xfree(ctx, p, s);
    xfree(ctx, a, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* A fraction so small that fraction x limit is under one chunk: a leftover
 * of 0 bytes must not be "split off" (a 0-byte chunk in the bins crashed
 * the next allocation that searched them); every leftover of 256 bytes or
 * more is, as with any threshold below 256.  Both kinds of arena. */
START_TEST(test_split_fraction_tiny)
{
    for (int vmm = 0; vmm < 2; vmm++) {
        bfc_config_t c = cfg_tf(64 * MiB);
        c.fragmentation_fraction = 1e-12; /* 64 MiB x 1e-12: 0 bytes */
        c.vmm = vmm ? BFC_VMM_ON : BFC_VMM_OFF;
        c.allow_growth = vmm; /* expandable arenas grow by granules */
        bfc_ctx_t *ctx = ctx_new(&c);
        bfc_stream_t s = pick_stream(ctx, _i);

        void *a = xalloc_full(ctx, s, 4096);
        void *g = xalloc_full(ctx, s, 256);
        xfree(ctx, a, s);
        void *p = xalloc_full(ctx, s, 4096); /* exact fit: nothing left over */
        ck_assert_ptr_eq(p, a);
        ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 4096);
        xcheck(ctx);
        void *q = xalloc_full(ctx, s, 16); /* searches the bins */
        ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), 256);
        xfree(ctx, p, s);
        p = xalloc_full(ctx, s, 3840); /* leftover 256: split */
        ck_assert_ptr_eq(p, a);
        ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 3840);
        xfree(ctx, p, s);
        xfree(ctx, q, s);
        xfree(ctx, g, s);
        xcheck(ctx);
        ctx_done(ctx, s);
    }
}
END_TEST

/* A limit above SIZE_MAX / 2: the doubling schedule cannot double past it,
 * and a request larger than SIZE_MAX / 2 (which no device gives) must
 * fail with BFC_ENOMEM, not loop for ever under the shard's lock.  Any
 * initial region: 2 MiB doubles to 2^63, 3000 bytes stops at 3 x 2^62. */
START_TEST(test_growth_huge_limit)
{
    static const size_t first[] = {2 * MiB, 3000};
    for (int k = 0; k < 2; k++) {
        bfc_config_t c;
        bfc_config_init(&c);
        c.backend = BFC_BACKEND_SIM;
        c.memory_limit = SIZE_MAX;
        c.vmm = BFC_VMM_OFF;
        c.large_alloc = 0;
        c.initial_region = first[k];
        bfc_ctx_t *ctx = ctx_new(&c);
        bfc_stream_t s = pick_stream(ctx, _i);
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, ((size_t)1 << 63) + 256));
        ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
        ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, SIZE_MAX - 4 * MiB));
        ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
        void *p = xalloc_full(ctx, s, 4096); /* the shard still serves */
        xfree(ctx, p, s);
        xcheck(ctx);
        ctx_done(ctx, s);
    }
}
END_TEST

/* The default rule: a leftover of 128 MiB or more is split off. */
START_TEST(test_split_128mib_rule)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *a = xalloc_full(ctx, s, 400 * MiB);
    void *g = xalloc_full(ctx, s, 256);
    ck_assert_ptr_eq(g, cp(a) + 400 * MiB);
    xfree(ctx, a, s);

    void *p = xalloc_full(ctx, s, 260 * MiB); /* 400 < 520, but leftover 140 MiB >= 128 MiB */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 260 * MiB);
    void *q = xalloc_full(ctx, s, 100 * MiB); /* the 140 MiB rest: 140 < 200, 40 < 128: whole */
    ck_assert_ptr_eq(q, cp(a) + 260 * MiB);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, q), 140 * MiB);
    xfree(ctx, p, s);
    xfree(ctx, q, s);

    p = xalloc_full(ctx, s, 272 * MiB + 256); /* leftover 128 MiB - 256: no split */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 400 * MiB);
    xfree(ctx, p, s);
    p = xalloc_full(ctx, s, 272 * MiB); /* leftover exactly 128 MiB: split */
    ck_assert_ptr_eq(p, a);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 272 * MiB);
    xfree(ctx, p, s);
    xfree(ctx, g, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* -------------------------------------------------------- best fit */

/* Makes holes of the given sizes, each followed by a live 256-byte guard. */
static void make_holes(bfc_ctx_t *ctx, bfc_stream_t s, const size_t *sz, size_t n, void **h, void **g)
{
    for (size_t i = 0; i < n; i++) {
        h[i] = xalloc_full(ctx, s, sz[i]);
        g[i] = xalloc_full(ctx, s, 256);
        ck_assert_ptr_eq(g[i], cp(h[i]) + sz[i]);
    }
    for (size_t i = 0; i < n; i++)
        xfree(ctx, h[i], s);
}

static void expect_at(bfc_ctx_t *ctx, void *p, void *where, size_t asz)
{
    ck_assert_msg(p == where, "got %p, best fit is %p", p, where);
    ck_assert_msg(bfc_ctx_allocated_size(ctx, p) == asz, "%p: allocated_size %zu, expected %zu", p,
                  bfc_ctx_allocated_size(ctx, p), asz);
}

START_TEST(test_best_fit_smallest)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    const size_t sz[] = {6144, 5120, 2048, 5120, 8192};
    void *h[5], *g[5];
    make_holes(ctx, s, sz, 5, h, g);

    /* First fit would take h[0] each time; best fit must not. */
    expect_at(ctx, xalloc_full(ctx, s, 4352), h[1], 5120);
    expect_at(ctx, xalloc_full(ctx, s, 4608), h[3], 5120);
    expect_at(ctx, xalloc_full(ctx, s, 4608), h[0], 6144);
    expect_at(ctx, xalloc_full(ctx, s, 2048), h[2], 2048);
    expect_at(ctx, xalloc_full(ctx, s, 3000), h[4], 3072);
    expect_at(ctx, xalloc_full(ctx, s, 5000), cp(h[4]) + 3072, 5120);
    /* All holes used: the next block comes from the free space after the guards. */
    expect_at(ctx, xalloc_full(ctx, s, 256), cp(g[4]) + 256, 256);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* Inside one bin, the smallest chunk that fits, not the bin's first or smallest. */
START_TEST(test_best_fit_within_bin)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    /* 2048, 3840 and 2560 share bin 3 ([2048, 4096)); 4096 starts bin 4. */
    const size_t sz[] = {4096, 2048, 3840, 2560};
    void *h[4], *g[4];
    make_holes(ctx, s, sz, 4, h, g);

    expect_at(ctx, xalloc_full(ctx, s, 2304), h[3], 2560);  /* not 2048 (too small), not 3840 */
    expect_at(ctx, xalloc_full(ctx, s, 2304), h[2], 3840);  /* 3840 < 4608: whole */
    expect_at(ctx, xalloc_full(ctx, s, 3000), h[0], 4096);  /* next bin up */
    expect_at(ctx, xalloc_full(ctx, s, 1800), h[1], 2048);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* Equal sizes: lowest address first, whatever order they were freed in. */
START_TEST(test_best_fit_lowest_address)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    enum { N = 8 };
    void *h[N], *g[N];
    for (int i = 0; i < N; i++) {
        h[i] = xalloc_full(ctx, s, 1024);
        g[i] = xalloc_full(ctx, s, 256);
    }
    static const int order[2][N] = {{5, 2, 7, 0, 3, 6, 1, 4}, {7, 6, 5, 4, 3, 2, 1, 0}};
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++)
            xfree(ctx, h[order[round][i]], s);
        for (int i = 0; i < N; i++) {
            void *p = xalloc_full(ctx, s, 1000);
            expect_at(ctx, p, h[i], 1024);
        }
    }
    (void)g;
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* The last bin is open-ended: best fit still holds among chunks >= 256 MiB. */
START_TEST(test_best_fit_open_bin)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    const size_t sz[] = {300 * MiB, 260 * MiB};
    void *h[2], *g[2];
    make_holes(ctx, s, sz, 2, h, g);
    /* Free chunks now: 300 MiB, 260 MiB, and about 464 MiB after g[1]. */
    expect_at(ctx, xalloc_full(ctx, s, 256 * MiB + 1), h[1], 260 * MiB);
    expect_at(ctx, xalloc_full(ctx, s, 270 * MiB), h[0], 300 * MiB);
    /* 464 MiB - 512 for 300 MiB: leftover >= 128 MiB, so it is split. */
    expect_at(ctx, xalloc_full(ctx, s, 300 * MiB), cp(g[1]) + 256, 300 * MiB);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * 100 000 free fragments of 16 sizes (each between live guards) plus the
 * region's tail; 1500 requests; each must land exactly where a brute-force
 * best-fit search over the fragments says, with the split rule applied.
 */
START_TEST(test_best_fit_100k_fragments)
{
    enum { NH = 100000, NQ = 1500 };
    bfc_config_t c = cfg_tf(512 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    uintptr_t *addr = malloc((NH + 1) * sizeof *addr);
    size_t *size = malloc((NH + 1) * sizeof *size);
    void **hp = malloc(NH * sizeof *hp);
    ck_assert(addr && size && hp);
    uint64_t seed = 0xB0F17u + (uint64_t)_i, x = seed;

    uintptr_t base = 0, end = 0;
    for (size_t i = 0; i < NH; i++) {
        size_t sz = 256 * (1 + rng_next(&x) % 16);
        hp[i] = bfc_ctx_alloc(ctx, s, sz);
        void *g = bfc_ctx_alloc(ctx, s, 256);
        if (hp[i] == NULL || (uintptr_t)g != (uintptr_t)hp[i] + sz)
            ck_abort_msg("setup %zu: hole %p guard %p", i, hp[i], g);
        if (i == 0)
            base = (uintptr_t)hp[0];
        addr[i] = (uintptr_t)hp[i];
        size[i] = sz;
        end = (uintptr_t)g + 256;
    }
    for (size_t i = 0; i < NH; i++)
        if (bfc_ctx_free(ctx, hp[i], s) != BFC_OK)
            ck_abort_msg("free of hole %zu failed", i);
    addr[NH] = end; /* the rest of the region */
    size[NH] = base + 512 * MiB - end;
    size_t nholes = NH + 1;
    ck_assert_uint_eq(st(ctx).bytes_in_use, NH * 256);
    xcheck(ctx);

    for (size_t q = 0; q < NQ; q++) {
        size_t n;
        uint64_t r = rng_next(&x);
        if (r % 4 == 0)
            n = 1 + rng_next(&x) % 4096; /* odd sizes */
        else
            n = 256 * (1 + rng_next(&x) % 16);
        size_t rn = r256(n), best = SIZE_MAX;
        for (size_t i = 0; i < nholes; i++) {
            if (size[i] < rn)
                continue;
            if (best == SIZE_MAX || size[i] < size[best] || (size[i] == size[best] && addr[i] < addr[best]))
                best = i;
        }
        ck_assert_uint_ne(best, SIZE_MAX);
        bool split = size[best] >= 2 * rn || size[best] - rn >= 128 * MiB;
        size_t want = split ? rn : size[best];
        void *p = bfc_ctx_alloc(ctx, s, n);
        if (p != (void *)addr[best] || bfc_ctx_allocated_size(ctx, p) != want)
            ck_abort_msg("seed %#llx query %zu: alloc(%zu) = %p (size %zu), best fit is %#lx (size %zu)",
                         (unsigned long long)seed, q, n, p, bfc_ctx_allocated_size(ctx, p),
                         (unsigned long)addr[best], want);
        if (split) {
            addr[best] += rn;
            size[best] -= rn;
        } else {
            addr[best] = addr[nholes - 1];
            size[best] = size[nholes - 1];
            nholes--;
        }
    }
    xcheck(ctx);
    free(addr);
    free(size);
    free(hp);
    ctx_done(ctx, s);
}
END_TEST

/* -------------------------------------------------------- coalescing */

static void coalesce_case(int which, int loop)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, loop);
    void *a = xalloc_full(ctx, s, 1024), *b = xalloc_full(ctx, s, 1024);
    void *c3 = xalloc_full(ctx, s, 1024), *d = xalloc_full(ctx, s, 1024);
    void *g = xalloc_full(ctx, s, 256);
    ck_assert_ptr_eq(b, cp(a) + 1024);
    ck_assert_ptr_eq(c3, cp(a) + 2048);
    ck_assert_ptr_eq(d, cp(a) + 3072);
    void *p;
    switch (which) {
    case 0: /* both neighbours at once */
        xfree(ctx, a, s);
        xfree(ctx, c3, s);
        xfree(ctx, b, s);
        p = xalloc_full(ctx, s, 3072);
        expect_at(ctx, p, a, 3072);
        break;
    case 1: /* with the next chunk */
        xfree(ctx, b, s);
        xfree(ctx, a, s);
        p = xalloc_full(ctx, s, 2048);
        expect_at(ctx, p, a, 2048);
        xfree(ctx, c3, s);
        break;
    default: /* with the previous chunk */
        xfree(ctx, a, s);
        xfree(ctx, b, s);
        p = xalloc_full(ctx, s, 2048);
        expect_at(ctx, p, a, 2048);
        xfree(ctx, c3, s);
        break;
    }
    xcheck(ctx);
    /* Everything freed, in an order that merges into a free tail too: the
     * region is whole again and can be handed out in one piece. */
    xfree(ctx, g, s);
    xfree(ctx, p, s);
    xfree(ctx, d, s);
    xcheck(ctx);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.largest_free_chunk, 16 * MiB);
    void *all = xalloc_full(ctx, s, 16 * MiB);
    ck_assert_ptr_eq(all, a);
    xfree(ctx, all, s);
    ctx_done(ctx, s);
}

START_TEST(test_coalesce_both)
{
    coalesce_case(0, _i);
}
END_TEST

START_TEST(test_coalesce_next)
{
    coalesce_case(1, _i);
}
END_TEST

START_TEST(test_coalesce_prev)
{
    coalesce_case(2, _i);
}
END_TEST

/* TensorFlow's ExerciseCoalescing, with its expected stats. */
START_TEST(test_exercise_coalescing)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 0);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 0);
    ck_assert_uint_eq(x.largest_alloc_size, 0);

    void *first = xalloc_full(ctx, s, 1024 * 4);
    xfree(ctx, first, s);
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 1);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 4096);
    ck_assert_uint_eq(x.largest_alloc_size, 4096);

    for (int i = 0; i < 1024; i++) {
        void *t1 = xalloc_full(ctx, s, 1024 * 4);
        void *t2 = xalloc_full(ctx, s, 1048576 * 8);
        void *t3 = xalloc_full(ctx, s, 2048 * 8);
        void *t4 = xalloc_full(ctx, s, 10485760 * 4);
        xfree(ctx, t1, s);
        xfree(ctx, t2, s);
        xfree(ctx, t3, s);
        xfree(ctx, t4, s);
    }
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 4097);
    ck_assert_uint_eq(x.num_frees, 4097);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.bytes_requested, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 1024 * 4 + 1048576 * 8 + 2048 * 8 + 10485760 * 4);
    ck_assert_uint_eq(x.largest_alloc_size, 10485760 * 4);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_reserved, 1 * GiB);

    void *after = xalloc_full(ctx, s, 1024 * 4);
    ck_assert_ptr_eq(after, first);
    xfree(ctx, after, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * Freeing everything restores one free chunk per region, and the same
 * allocation sequence then returns the same addresses.
 */
START_TEST(test_same_sequence_same_addresses)
{
    enum { N = 2000 };
    bfc_config_t c = cfg_tf(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *run[2][N];
    for (int round = 0; round < 2; round++) {
        uint64_t x = 42;
        void *live[N];
        size_t nlive = 0;
        for (int i = 0; i < N; i++) {
            size_t n = 1 + rng_next(&x) % (64 * KiB);
            run[round][i] = live[nlive++] = xalloc_full(ctx, s, n);
            if (rng_next(&x) % 3 == 0) { /* free a random live block */
                size_t k = rng_next(&x) % nlive;
                xfree(ctx, live[k], s);
                live[k] = live[--nlive];
            }
        }
        for (size_t k = 0; k < nlive; k++)
            xfree(ctx, live[k], s);
        xcheck(ctx);
        bfc_stats_t x2 = st(ctx);
        ck_assert_uint_eq(x2.bytes_in_use, 0);
        ck_assert_uint_eq(x2.num_chunks, x2.num_regions);
        ck_assert_uint_eq(x2.largest_free_chunk, 256 * MiB);
    }
    for (int i = 0; i < N; i++)
        ck_assert_msg(run[0][i] == run[1][i], "allocation %d: %p then %p", i, run[0][i], run[1][i]);
    ctx_done(ctx, s);

    /* Growing context: after freeing all, every region is one free chunk. */
    c = cfg_grow(256 * MiB);
    ctx = ctx_new(&c);
    s = pick_stream(ctx, _i);
    uint64_t x = 7;
    void *live[N];
    size_t nlive = 0;
    for (int i = 0; i < N; i++) {
        live[nlive++] = xalloc_full(ctx, s, 1 + rng_next(&x) % (64 * KiB));
        if (rng_next(&x) % 2 == 0) {
            size_t k = rng_next(&x) % nlive;
            xfree(ctx, live[k], s);
            live[k] = live[--nlive];
        }
    }
    ck_assert_uint_gt(st(ctx).num_regions, 1);
    for (size_t k = 0; k < nlive; k++)
        xfree(ctx, live[k], s);
    bfc_stats_t y = st(ctx);
    ck_assert_uint_eq(y.bytes_in_use, 0);
    ck_assert_uint_eq(y.num_chunks, y.num_regions);
    ck_assert_uint_eq(y.bytes_free, y.bytes_reserved);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ---------------------------------------------- TensorFlow's classics */

START_TEST(test_no_dups)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *ptrs[1023];
    for (size_t n = 1; n < 1024; n++)
        ptrs[n - 1] = xalloc_full(ctx, s, n);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 1023);
    ck_assert_uint_eq(x.bytes_in_use, 654336);
    ck_assert_uint_eq(x.peak_bytes_in_use, 654336);
    ck_assert_uint_eq(x.bytes_requested, 1023 * 1024 / 2);
    ck_assert_msg(x.largest_alloc_size == 1023 || x.largest_alloc_size == 1024,
                  "largest_alloc_size %llu", (unsigned long long)x.largest_alloc_size);
    expect_disjoint(ctx, ptrs, 1023);
    for (size_t i = 0; i < 1023; i++)
        xfree(ctx, ptrs[i], s);
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 1023);
    ck_assert_uint_eq(x.num_frees, 1023);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.bytes_requested, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 654336);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

static size_t tf_size(uint64_t *x, size_t max)
{
    size_t n = (size_t)(rng_next(x) % max);
    return n < 100 ? 100 : n;
}

START_TEST(test_allocations_and_deallocations)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    uint64_t x = 123;
    void *initial[255], *existing[510];
    size_t ne = 0;
    for (int i = 0; i < 255; i++)
        initial[i] = xalloc_full(ctx, s, tf_size(&x, MiB));
    for (int i = 0; i < 255; i++) {
        if (i % 2 == 1)
            xfree(ctx, initial[i], s);
        else
            existing[ne++] = initial[i];
    }
    /* An OOM must not prevent later allocations. */
    expect_oom(ctx, s, GiB + 1);
    for (int i = 0; i < 255; i++)
        existing[ne++] = xalloc_full(ctx, s, tf_size(&x, MiB));
    expect_disjoint(ctx, existing, ne);

    /* Every block lies in the one region of 1 GiB. */
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (size_t i = 0; i < ne; i++) {
        uintptr_t p = (uintptr_t)existing[i];
        lo = p < lo ? p : lo;
        uintptr_t e = p + bfc_ctx_allocated_size(ctx, existing[i]);
        hi = e > hi ? e : hi;
    }
    ck_assert_uint_le(hi - lo, 1 * GiB);
    xcheck(ctx);
    for (size_t i = 0; i < ne; i++)
        xfree(ctx, existing[i], s);
    bfc_stats_t y = st(ctx);
    ck_assert_uint_eq(y.num_allocs, 510);
    ck_assert_uint_eq(y.num_frees, 510);
    ck_assert_uint_eq(y.bytes_in_use, 0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

START_TEST(test_allocations_with_growth)
{
    const size_t limit = 2 * GiB;
    bfc_config_t c = cfg_grow(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    uint64_t x = 17;
    void *initial[9], *existing[18];
    size_t ne = 0;
    for (int i = 0; i < 9; i++) {
        initial[i] = xalloc_full(ctx, s, tf_size(&x, 128 * MiB));
        ck_assert_uint_le(st(ctx).bytes_reserved, limit);
    }
    for (int i = 0; i < 9; i++) {
        if (i % 2 == 1)
            xfree(ctx, initial[i], s);
        else
            existing[ne++] = initial[i];
    }
    for (int i = 0; i < 9; i++) {
        existing[ne++] = xalloc_full(ctx, s, tf_size(&x, 64 * MiB));
        ck_assert_uint_le(st(ctx).bytes_reserved, limit);
    }
    expect_disjoint(ctx, existing, ne);
    xcheck(ctx);
    for (size_t i = 0; i < ne; i++)
        xfree(ctx, existing[i], s);
    bfc_stats_t y = st(ctx);
    ck_assert_uint_eq(y.bytes_in_use, 0);
    ck_assert_uint_le(y.peak_bytes_reserved, limit);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* TestBinDebugInfo's allocation pattern, read through the memory map. */
START_TEST(test_dump)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p[10];
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 2; j++)
            p[2 * i + j] = xalloc_full(ctx, s, (size_t)256 << i);
    void *a = xalloc_full(ctx, s, 12345);
    void *b = xalloc_full(ctx, s, 777);
    xfree(ctx, p[1], s);
    bfc_stats_t before = st(ctx);

    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_dump(ctx, f), BFC_OK);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_ptr_nonnull(buf);
    ck_assert_uint_gt(len, 0);

    ck_assert_msg(strcasestr(buf, "region") != NULL, "dump names no region:\n%s", buf);
    ck_assert_msg(strcasestr(buf, "bin") != NULL, "dump has no bin summary:\n%s", buf);
    ck_assert_msg(strcasestr(buf, "free") != NULL, "dump shows no free chunk:\n%s", buf);
    ck_assert_msg(strstr(buf, "12544") != NULL, "dump lacks the chunk size 12544:\n%s", buf);
    ck_assert_msg(strstr(buf, "12345") != NULL, "dump lacks the requested size 12345:\n%s", buf);
    ck_assert_msg(strstr(buf, "4096") != NULL, "dump lacks the chunk size 4096:\n%s", buf);
    /* Chunks in address order: a's address is printed before b's. */
    char ha[32], hb[32];
    snprintf(ha, sizeof ha, "%lx", (unsigned long)(uintptr_t)a);
    snprintf(hb, sizeof hb, "%lx", (unsigned long)(uintptr_t)b);
    const char *pa = strcasestr(buf, ha), *pb = strcasestr(buf, hb);
    ck_assert_msg(pa != NULL && pb != NULL, "dump lacks the addresses %s / %s:\n%s", ha, hb, buf);
    ck_assert_msg(pa < pb, "chunks not in address order");
    free(buf);

    /* Dumping changes nothing. */
    bfc_stats_t after = st(ctx);
    ck_assert(memcmp(&before, &after, sizeof before) == 0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

static bool have_jq(void)
{
    return system("command -v jq >/dev/null 2>&1") == 0;
}

START_TEST(test_snapshot_json)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 1 * MiB), *b = xalloc_full(ctx, s, 3000), *d = xalloc_full(ctx, s, 4 * MiB);
    xfree(ctx, b, s);

    char path[] = "/tmp/test_arena_snapXXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    FILE *f = fdopen(fd, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(bfc_ctx_snapshot_json(ctx, f), BFC_OK);
    ck_assert_int_eq(fclose(f), 0);

    f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int ch;
    while ((ch = fgetc(f)) == ' ' || ch == '\n' || ch == '\t')
        ;
    ck_assert_msg(ch == '{' || ch == '[', "snapshot does not start a JSON value");
    fclose(f);
    if (have_jq()) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "jq -e . %s >/dev/null 2>&1", path);
        ck_assert_msg(system(cmd) == 0, "snapshot %s is not valid JSON", path);
    }
    unlink(path);
    xfree(ctx, a, s);
    xfree(ctx, d, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ---------------------------------------------------------- growth */

/* TensorFlow's Extend() by the numbers: requests of 1 MiB, 1 MiB, 256 B and
 * 4 MiB leave regions of 2, 4 and 8 MiB (each new region doubles the last
 * unless the request needed the doubling already). */
START_TEST(test_growth_schedule)
{
    bfc_config_t c = cfg_grow(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    uint64_t b0 = bfc_sim_backend_allocs(ctx);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 0);
    ck_assert_uint_eq(x.num_regions, 0);

    void *p1 = xalloc_full(ctx, s, 1 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_reserved, 2 * MiB);
    void *p2 = xalloc_full(ctx, s, 1 * MiB);
    ck_assert_ptr_eq(p2, cp(p1) + 1 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_reserved, 2 * MiB);
    void *p3 = xalloc_full(ctx, s, 256);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.bytes_reserved, 6 * MiB);
    void *p4 = xalloc_full(ctx, s, 4 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 3);
    ck_assert_uint_eq(x.bytes_reserved, 14 * MiB);
    ck_assert_uint_eq(x.peak_bytes_reserved, 14 * MiB);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx) - b0, 3);
    /* The 4 MiB block is not in the 4 MiB region holding the 256 B block. */
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p4), 4 * MiB);
    ck_assert_msg((uintptr_t)p4 + 4 * MiB <= (uintptr_t)p3 || (uintptr_t)p4 >= (uintptr_t)p3 + 4 * MiB,
                  "4 MiB block %p shares the second region with %p", p4, p3);
    xcheck(ctx);
    xfree(ctx, p1, s);
    xfree(ctx, p2, s);
    xfree(ctx, p3, s);
    xfree(ctx, p4, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * TensorFlow's PhysicalAllocatorOomsFragmentation: 128 x 4 MiB fill a
 * 512 MiB limit with regions of 4, 4, 8, ..., 256 MiB; with one block still
 * live in the last region, 508 MiB cannot be had.
 */
START_TEST(test_growth_fills_limit)
{
    const size_t limit = 512 * MiB;
    bfc_config_t c = cfg_grow(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p[128];
    for (int i = 0; i < 128; i++) {
        p[i] = xalloc_full(ctx, s, 4 * MiB);
        ck_assert_uint_le(st(ctx).bytes_reserved, limit);
    }
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 8);
    ck_assert_uint_eq(x.bytes_reserved, limit);
    ck_assert_uint_eq(x.bytes_in_use, limit);
    expect_oom(ctx, s, 256);
    ck_assert_uint_eq(st(ctx).num_ooms, 1);
    for (int i = 0; i < 127; i++)
        xfree(ctx, p[i], s);
    expect_oom(ctx, s, limit - 4 * MiB);
    ck_assert_uint_eq(st(ctx).num_ooms, 2);
    /* Not sticky: what fits in the free chunks is served. */
    void *q = xalloc_full(ctx, s, 16 * MiB);
    xfree(ctx, q, s);
    xfree(ctx, p[127], s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* The last region is cut to what the limit leaves: 2 + 4 + 4 MiB of 10. */
START_TEST(test_growth_capped_by_limit)
{
    bfc_config_t c = cfg_grow(10 * MiB);
    c.large_alloc = 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 2 * MiB);
    void *b = xalloc_full(ctx, s, 4 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    void *d = xalloc_full(ctx, s, 4 * MiB); /* the next region would be 8 MiB; 4 remain */
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 3);
    ck_assert_uint_eq(x.bytes_reserved, 10 * MiB);
    ck_assert_uint_eq(x.peak_bytes_reserved, 10 * MiB);
    expect_oom(ctx, s, 256);
    ck_assert_uint_eq(st(ctx).num_ooms, 1);
    xfree(ctx, a, s);
    void *e = xalloc_full(ctx, s, 256); /* not sticky; the only free chunk is a's region */
    ck_assert_ptr_eq(e, a);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 10 * MiB);
    xfree(ctx, e, s);
    xfree(ctx, b, s);
    xfree(ctx, d, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* A refused extension backs off by 0.9x until the backend agrees. */
START_TEST(test_growth_backoff)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    c.large_alloc = 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 1 * MiB); /* region of 2 MiB */
    ck_assert_uint_eq(st(ctx).bytes_reserved, 2 * MiB);
    bfc_sim_set_alloc_ceiling(ctx, 5 * MiB);
    uint64_t f0 = bfc_sim_backend_failures(ctx);
    /* Wants a 4 MiB region; 3.6 and 3.24 MiB are refused too; ~2.92 MiB fits. */
    void *b = xalloc_full(ctx, s, 2 * MiB);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_le(x.bytes_reserved, 5 * MiB);
    size_t second = x.bytes_reserved - 2 * MiB;
    ck_assert_uint_eq(second % 256, 0);
    ck_assert_msg(second >= 3057000 && second <= 3059500, "second region %zu, expected about 0.9^3 x 4 MiB",
                  second);
    ck_assert_uint_eq(bfc_sim_backend_failures(ctx) - f0, 3);
    xfree(ctx, b, s);
    xfree(ctx, a, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* A backend that refuses everything: the back-off must end, even at 256 bytes. */
START_TEST(test_growth_backoff_terminates)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    bfc_sim_set_alloc_ceiling(ctx, 0);
    uint64_t f0 = bfc_sim_backend_failures(ctx);
    expect_oom(ctx, s, 256);
    uint64_t tries = bfc_sim_backend_failures(ctx) - f0;
    ck_assert_uint_ge(tries, 1);
    ck_assert_uint_le(tries, 1000);
    expect_oom(ctx, s, 1 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 0);
    /* The device recovers: so does the context. */
    bfc_sim_set_alloc_ceiling(ctx, SIZE_MAX);
    void *p = xalloc_full(ctx, s, 256);
    xfree(ctx, p, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * Regions released (trim) and taken again, many times: the doubling schedule
 * must stay finite (a region never exceeds the limit, and the arena keeps
 * serving).  Loop index: 0 growing context, 1 allow_growth=false.
 */
START_TEST(test_growth_release_cycles)
{
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_grow(limit);
    c.allow_growth = _i == 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    for (int i = 0; i < 200; i++) {
        void *p = xalloc_full(ctx, NULL, 1 * MiB);
        bfc_stats_t x = st(ctx);
        ck_assert_uint_le(x.bytes_reserved, limit);
        ck_assert_uint_eq(x.num_regions, 1);
        xfree(ctx, p, NULL);
        ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
        if (c.allow_growth)
            ck_assert_uint_eq(st(ctx).bytes_reserved, 0);
    }
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* -------------------------------------------- allow_growth = false */

/*
 * allow_growth=false with every other setting at its default (initial_region
 * 2 MiB, large_alloc 32 MiB): the whole limit is reserved at create and one
 * stream gets TensorFlow's layout -- one region of the whole limit, exact
 * splits from its front -- large requests included (TensorFlow serves them
 * from its one region too).  Nothing more is taken from the backend.
 */
static bfc_config_t cfg_no_growth(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = limit;
    c.allow_growth = false;
    return c;
}

START_TEST(test_no_growth_reserves_at_create)
{
    const size_t limit = 64 * MiB;
    bfc_config_t c = cfg_no_growth(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, limit);
    ck_assert_uint_eq(x.peak_bytes_reserved, limit);
    ck_assert_uint_eq(x.bytes_limit, limit);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    uint64_t b0 = bfc_sim_backend_allocs(ctx);

    void *p1 = xalloc_full(ctx, s, 1 * MiB), *p2 = xalloc_full(ctx, s, 1 * MiB);
    void *p3 = xalloc_full(ctx, s, 256), *p4 = xalloc_full(ctx, s, 4 * MiB);
    expect_at(ctx, p2, cp(p1) + 1 * MiB, 1 * MiB);
    expect_at(ctx, p3, cp(p1) + 2 * MiB, 256);
    expect_at(ctx, p4, cp(p1) + 2 * MiB + 256, 4 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_reserved, limit);
    ck_assert_uint_eq(x.bytes_in_use, 6 * MiB + 256);

    /* A large request comes from the same region, right after p4, and by
     * TensorFlow's split rule takes the whole tail (58 MiB - 256 B is less
     * than twice 40 MiB, and the 18 MiB left over is under 128 MiB). */
    const size_t tail = limit - (6 * MiB + 256);
    void *big = xalloc_full(ctx, s, 40 * MiB);
    expect_at(ctx, big, cp(p4) + 4 * MiB, tail);
    ck_assert_uint_eq(st(ctx).num_regions, 1);
    expect_oom(ctx, s, 256);
    xfree(ctx, big, s);
    /* It merged back into one free tail, which 16 MiB splits (the tail is
     * at least twice 16 MiB). */
    big = xalloc_full(ctx, s, 16 * MiB);
    expect_at(ctx, big, cp(p4) + 4 * MiB, 16 * MiB);
    void *rest = xalloc_full(ctx, s, tail - 16 * MiB);
    expect_at(ctx, rest, cp(big) + 16 * MiB, tail - 16 * MiB);
    xfree(ctx, rest, s);
    xfree(ctx, big, s);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx), b0);
    xfree(ctx, p1, s);
    xfree(ctx, p2, s);
    xfree(ctx, p3, s);
    xfree(ctx, p4, s);
    /* Emptied, the pool is usable whole. */
    void *all = xalloc_full(ctx, s, limit);
    ck_assert_ptr_eq(all, p1);
    xfree(ctx, all, s);
    x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, limit);
    ck_assert_uint_eq(x.peak_bytes_reserved, limit);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx), b0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* The same when the stream's first request is large: it is cut from the
 * front of the one region, as TensorFlow's would be, and the blocks after
 * it follow it there.  A region of its own would leave the stream two
 * regions, and make its free hand the block's memory to the pool. */
START_TEST(test_no_growth_large_first)
{
    bfc_config_t c = cfg_no_growth(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p = xalloc_full(ctx, s, 64 * MiB);
    void *q = xalloc_full(ctx, s, 1000);
    void *r = xalloc_full(ctx, s, 40 * MiB);
    expect_at(ctx, q, cp(p) + 64 * MiB, 1024);
    expect_at(ctx, r, cp(q) + 1024, 40 * MiB);
    ck_assert_uint_eq(st(ctx).num_regions, 1);
    /* Freed, it stays the shard's: a second free is a double free. */
    xfree(ctx, p, s);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, s), BFC_EDOUBLEFREE);
    ck_assert_uint_eq(st(ctx).num_regions, 1);
    void *again = xalloc_full(ctx, s, 64 * MiB);
    ck_assert_ptr_eq(again, p);
    xfree(ctx, again, s);
    xfree(ctx, q, s);
    xfree(ctx, r, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* The TensorFlow configuration: one region of the whole limit. */
START_TEST(test_tf_one_region)
{
    bfc_config_t c = cfg_tf(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 1 * GiB);
    uint64_t b0 = bfc_sim_backend_allocs(ctx);
    void *p1 = xalloc_full(ctx, s, 512 * MiB);
    void *p2 = xalloc_full(ctx, s, 256 * MiB);
    void *p3 = xalloc_full(ctx, s, 256 * MiB);
    ck_assert_ptr_eq(p2, cp(p1) + 512 * MiB);
    ck_assert_ptr_eq(p3, cp(p1) + 768 * MiB);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_in_use, 1 * GiB);
    expect_oom(ctx, s, 256);
    xfree(ctx, p2, s);
    void *q = xalloc_full(ctx, s, 200 * MiB); /* 256 < 400 and 56 < 128: the whole hole */
    expect_at(ctx, q, p2, 256 * MiB);
    xfree(ctx, q, s);
    xfree(ctx, p1, s);
    xfree(ctx, p3, s);
    void *all = xalloc_full(ctx, s, 1 * GiB);
    ck_assert_ptr_eq(all, p1);
    xfree(ctx, all, s);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx), b0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ---------------------------------------------------- large requests */

START_TEST(test_large_alloc_own_region)
{
    bfc_config_t c = cfg_grow(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *small = xalloc_full(ctx, s, 1 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 2 * MiB);

    size_t n = 33 * MiB + 1;
    void *big = xalloc_full(ctx, s, n);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.bytes_reserved, 2 * MiB + 34 * MiB); /* rounded to 2 MiB */
    ck_assert_uint_le(bfc_ctx_allocated_size(ctx, big), 34 * MiB);
    ck_assert_msg((uintptr_t)big + n <= (uintptr_t)small || (uintptr_t)big >= (uintptr_t)small + 2 * MiB,
                  "large block inside the small region");
    memset(big, 0x11, 4096);
    memset(cp(big) + n - 4096, 0x22, 4096);
    /* Small requests keep coming from the small region. */
    void *s2 = xalloc_full(ctx, s, 1 * MiB);
    ck_assert_ptr_eq(s2, cp(small) + 1 * MiB);

    xfree(ctx, big, s);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1); /* returned to the pool at once */
    ck_assert_uint_eq(x.bytes_in_use, 2 * MiB);
    /* trim hands the pooled region back to the device. */
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 2 * MiB);
    ck_assert_uint_eq(x.num_regions, 1);
    xcheck(ctx);

    /* Exactly large_alloc is large. */
    void *exact = xalloc_full(ctx, s, 32 * MiB);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, exact), 32 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.bytes_reserved, 34 * MiB);
    xfree(ctx, exact, s);
    ck_assert_uint_eq(st(ctx).num_regions, 1);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 2 * MiB);

    /* Just below large_alloc is not: an arena region (doubling 4 -> 32 MiB),
     * kept by the arena after the free. */
    void *below = xalloc_full(ctx, s, 32 * MiB - 256);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.bytes_reserved, 34 * MiB);
    xfree(ctx, below, s);
    ck_assert_uint_eq(st(ctx).num_regions, 2);
    xfree(ctx, small, s);
    xfree(ctx, s2, s);
    xcheck(ctx);

    /* trim gives every fully free region back. */
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 0);
    ck_assert_uint_eq(x.num_regions, 0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* large_alloc = 0 turns the rule off: TensorFlow's doubling, no split. */
START_TEST(test_large_alloc_off)
{
    bfc_config_t c = cfg_grow(1 * GiB);
    c.large_alloc = 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *small = xalloc_full(ctx, s, 1 * MiB); /* region 2 MiB; next would be 4 */
    void *big = xalloc_full(ctx, s, 33 * MiB);  /* doubles 4 -> 64 MiB */
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.bytes_reserved, 66 * MiB);
    /* 64 MiB < 2 x 33 MiB and 31 MiB < 128 MiB: the whole region is the chunk. */
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, big), 64 * MiB);
    xfree(ctx, big, s);
    ck_assert_uint_eq(st(ctx).num_regions, 2);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 66 * MiB);
    xfree(ctx, small, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ----------------------------------------- garbage collection, trim */

static void gc_case(bool gc, int loop)
{
    bfc_config_t c = cfg_grow(8 * MiB);
    c.large_alloc = 0;
    c.garbage_collection = gc;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, loop);
    void *a = xalloc_full(ctx, s, 2 * MiB);
    void *b = xalloc_full(ctx, s, 4 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    xfree(ctx, a, s);
    xfree(ctx, b, s);
    /* Free regions of 2 and 4 MiB; 2 MiB left under the limit; 6 MiB wanted. */
    if (!gc) {
        expect_oom(ctx, s, 6 * MiB);
        ck_assert_uint_eq(st(ctx).num_regions, 2);
        ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    } else {
        void *p = xalloc_full(ctx, s, 6 * MiB);
        bfc_stats_t x = st(ctx);
        ck_assert_uint_eq(x.num_regions, 1);
        ck_assert_uint_eq(x.bytes_reserved, 8 * MiB);
        ck_assert_uint_eq(x.num_ooms, 0);
        memset(p, 0x33, 6 * MiB);
        xfree(ctx, p, s);
    }
    xcheck(ctx);
    ctx_done(ctx, s);
}

START_TEST(test_gc_off_fails)
{
    gc_case(false, _i);
}
END_TEST

START_TEST(test_gc_on_retries)
{
    gc_case(true, _i);
}
END_TEST

/* Without garbage collection the pool keeps the segments it holds, as
 * TensorFlow's allocator keeps its regions: another stream's request that
 * none of them can hold fails, with no backend call, rather than free them
 * to the device (a cudaFree waits for the whole device); trim gives them
 * back, and then it fits. */
START_TEST(test_gc_off_keeps_cached)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    c.garbage_collection = false;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t a = new_stream(ctx), b = new_stream(ctx);
    void *v[64];
    size_t n = 0;
    while (n < 64 && (v[n] = bfc_ctx_alloc(ctx, a, 1 * MiB)) != NULL)
        n++;
    ck_assert_uint_ge(n, 32);
    for (size_t i = 0; i < n; i++)
        xfree(ctx, v[i], a);
    uint64_t allocs = bfc_sim_backend_allocs(ctx);
    size_t held = bfc_sim_backend_bytes_held(ctx);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, b, 60 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx), allocs);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), held);
    ck_assert_uint_eq(st(ctx).num_ooms, 1);
    /* The report says why, and what gives the memory back. */
    bfc_oom_info_t oi;
    ck_assert_int_eq(bfc_ctx_oom_info(ctx, &oi), BFC_OK);
    ck_assert_msg(strstr(oi.diagnosis, "without garbage_collection: bfc_ctx_trim gives them back") != NULL, "%s",
                  oi.diagnosis);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    void *p = xalloc_full(ctx, b, 60 * MiB);
    xfree(ctx, p, b);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* Garbage collection gives regions back only where that can make the
 * request fit (TensorFlow's DeallocateFreeRegions: the limit's room plus
 * the fully free regions' bytes): regions of 2 MiB (1 MiB live) and 4 MiB
 * (free) in a 16 MiB limit leave 14 MiB for a 14.5 MiB request, which
 * fails with both regions kept and no backend call; 13.5 MiB succeeds. */
START_TEST(test_gc_hopeless_keeps_regions)
{
    bfc_config_t c = cfg_grow(16 * MiB);
    c.garbage_collection = true;
    c.large_alloc = 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    void *a = xalloc_full(ctx, NULL, MiB);
    void *b = xalloc_full(ctx, NULL, 3 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    xfree(ctx, b, NULL);
    uint64_t allocs = bfc_sim_backend_allocs(ctx);
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, NULL, 14 * MiB + 512 * KiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    ck_assert_uint_eq(st(ctx).num_regions, 2);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), 6 * MiB);
    ck_assert_uint_eq(bfc_sim_backend_allocs(ctx), allocs);
    xcheck(ctx);
    b = xalloc_full(ctx, NULL, 13 * MiB + 512 * KiB);
    xfree(ctx, b, NULL);
    xfree(ctx, a, NULL);
    xcheck(ctx);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* Garbage collection keeps the doubling schedule, as TensorFlow's does:
 * regions of 2, 4, 8, 16 and 20 MiB (the last one the limit's rest, the
 * schedule at 64 MiB) in a 50 MiB limit, all free; a 20.4 MiB request fits
 * none, every region goes, and the one region that follows is
 * min(64 MiB, 50 MiB), split after the block.  Restarting the schedule
 * there gave a 32 MiB region handed out whole.  Trim, which empties the
 * shard from outside an allocation, does restart it: a 2 MiB region. */
START_TEST(test_gc_keeps_schedule)
{
    bfc_config_t c = cfg_grow(50 * MiB);
    c.garbage_collection = true;
    c.large_alloc = 0;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    static const size_t mib[] = {1, 3, 7, 15, 17};
    void *p[5];
    for (int i = 0; i < 5; i++)
        p[i] = xalloc_full(ctx, s, mib[i] * MiB);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 5);
    ck_assert_uint_eq(x.bytes_reserved, 50 * MiB);
    for (int i = 0; i < 5; i++)
        xfree(ctx, p[i], s);
    const size_t n = 21437925, rounded = 21437952;
    void *big = xalloc_full(ctx, s, n);
    x = st(ctx);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_reserved, 50 * MiB);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, big), rounded);
    ck_assert_uint_eq(x.largest_alloc_size, rounded);
    xcheck(ctx);
    xfree(ctx, big, s);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 0);
    void *small = xalloc_full(ctx, s, 1 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 2 * MiB);
    xfree(ctx, small, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* garbage_collection also rescues TensorFlow's fragmentation case once all is free. */
START_TEST(test_gc_large_after_free)
{
    const size_t limit = 512 * MiB;
    bfc_config_t c = cfg_grow(limit);
    c.garbage_collection = true;
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p[128];
    for (int i = 0; i < 128; i++)
        p[i] = xalloc_full(ctx, s, 4 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, limit);
    for (int i = 0; i < 127; i++)
        xfree(ctx, p[i], s);
    /* 256 MiB region still holds p[127]: even gc cannot find 508 MiB (it may
     * have released the free regions while trying). */
    ck_assert_ptr_null(bfc_ctx_alloc(ctx, s, limit - 4 * MiB));
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_ooms, 1);
    ck_assert_uint_eq(x.bytes_in_use, 4 * MiB);
    ck_assert_uint_ge(x.bytes_reserved, 256 * MiB);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p[127]), 4 * MiB);
    xcheck(ctx);
    xfree(ctx, p[127], s);
    void *big = xalloc_full(ctx, s, limit - 4 * MiB);
    ck_assert_uint_le(st(ctx).bytes_reserved, limit);
    xfree(ctx, big, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

START_TEST(test_trim)
{
    bfc_config_t c = cfg_grow(1 * GiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p1 = xalloc_full(ctx, s, 1 * MiB), *p2 = xalloc_full(ctx, s, 1 * MiB);
    void *p3 = xalloc_full(ctx, s, 256), *p4 = xalloc_full(ctx, s, 4 * MiB);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 14 * MiB);

    xfree(ctx, p4, s); /* the 8 MiB region is now fully free */
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 6 * MiB);
    ck_assert_uint_eq(x.num_regions, 2);
    ck_assert_uint_eq(x.peak_bytes_reserved, 14 * MiB);
    ck_assert_uint_eq(x.bytes_in_use, 2 * MiB + 256);
    xcheck(ctx);
    ck_assert_int_eq(bfc_ctx_clear_peaks(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).peak_bytes_reserved, 6 * MiB);

    /* Live blocks survive a trim untouched. */
    memset(p1, 0x44, 1 * MiB);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).bytes_reserved, 6 * MiB);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p1), 1 * MiB);
    ck_assert_int_eq(cp(p1)[1 * MiB - 1], 0x44);

    xfree(ctx, p1, s);
    xfree(ctx, p2, s);
    xfree(ctx, p3, s);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    x = st(ctx);
    ck_assert_uint_eq(x.bytes_reserved, 0);
    ck_assert_uint_eq(x.num_regions, 0);
    xcheck(ctx);
    /* And the context still works. */
    void *q = xalloc_full(ctx, s, 3 * MiB);
    ck_assert_uint_gt(st(ctx).bytes_reserved, 0);
    xfree(ctx, q, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* An OOM is never sticky. */
START_TEST(test_oom_not_sticky)
{
    bfc_config_t c = cfg_tf(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 32 * MiB); /* split: the other 32 MiB stay free */
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, a), 32 * MiB);
    for (int i = 0; i < 3; i++) {
        expect_oom(ctx, s, 48 * MiB);
        ck_assert_uint_eq(st(ctx).num_ooms, (uint64_t)i + 1);
        void *b = xalloc_full(ctx, s, 8 * MiB);
        ck_assert_int_eq(bfc_last_error(), BFC_OK);
        xfree(ctx, b, s);
    }
    xfree(ctx, a, s);
    void *d = xalloc_full(ctx, s, 64 * MiB);
    xfree(ctx, d, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* --------------------------------------------------------- bad frees */

START_TEST(test_free_null)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    ck_assert_int_eq(bfc_ctx_free(ctx, NULL, s), BFC_OK);
    void *p = xalloc_full(ctx, s, 1000);
    bfc_stats_t a = st(ctx);
    ck_assert_int_eq(bfc_ctx_free(ctx, NULL, s), BFC_OK);
    bfc_stats_t b = st(ctx);
    ck_assert(memcmp(&a, &b, sizeof a) == 0);
    xfree(ctx, p, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

START_TEST(test_free_foreign)
{
    bfc_config_t c = cfg_grow(64 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_ctx_t *other = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *mine = xalloc_full(ctx, s, 1024);
    void *theirs = xalloc_full(other, NULL, 1024);
    char on_stack[1024];
    void *heap = aligned_alloc(256, 4096);
    ck_assert_ptr_nonnull(heap);

    expect_bad_free(ctx, theirs, s, BFC_ENOTOWNED);
    expect_bad_free(ctx, on_stack, s, BFC_ENOTOWNED);
    expect_bad_free(ctx, heap, s, BFC_ENOTOWNED);
    expect_bad_free(ctx, (void *)(uintptr_t)0x100, s, BFC_ENOTOWNED);
    expect_bad_free(ctx, (void *)(uintptr_t)(UINTPTR_MAX & ~(uintptr_t)255), s, BFC_ENOTOWNED);
    /* Just outside this context's region. */
    expect_bad_free(ctx, cp(mine) - 256, s, BFC_ENOTOWNED);
    /* The other context's block is still its own, and still live there. */
    ck_assert_uint_eq(bfc_ctx_requested_size(other, theirs), 1024);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, theirs), 0);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, theirs), 0);
    ck_assert_int_lt(bfc_ctx_allocation_id(ctx, theirs), 0);
    xfree(other, theirs, NULL);
    xfree(ctx, mine, s);
    free(heap);
    (void)on_stack;
    xcheck(ctx);
    xcheck(other);
    bfc_ctx_destroy(other);
    ctx_done(ctx, s);
}
END_TEST

START_TEST(test_free_interior)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *p = xalloc_full(ctx, s, 1024);
    void *q = xalloc_full(ctx, s, 1024);
    const size_t offs[] = {1, 8, 255, 256, 512, 768, 1023};
    for (size_t k = 0; k < sizeof offs / sizeof offs[0]; k++) {
        expect_bad_free(ctx, cp(p) + offs[k], s, BFC_ENOTOWNED);
        ck_assert_uint_eq(bfc_ctx_requested_size(ctx, cp(p) + offs[k]), 0);
        ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, cp(p) + offs[k]), 0);
        ck_assert_int_lt(bfc_ctx_allocation_id(ctx, cp(p) + offs[k]), 0);
    }
    /* p is still live and whole. */
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, p), 1024);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, p), 1024);
    xfree(ctx, p, s);
    xfree(ctx, q, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

START_TEST(test_double_free)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 1024), *b = xalloc_full(ctx, s, 1024), *g = xalloc_full(ctx, s, 256);
    void *d = xalloc_full(ctx, s, 1024);
    /* b between live neighbours: its chunk stays as it was. */
    xfree(ctx, b, s);
    expect_bad_free(ctx, b, s, BFC_EDOUBLEFREE);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, b), 0);
    ck_assert_int_lt(bfc_ctx_allocation_id(ctx, b), 0);
    /* d merges with the free space after it but still starts its chunk. */
    xfree(ctx, d, s);
    expect_bad_free(ctx, d, s, BFC_EDOUBLEFREE);
    ck_assert_uint_eq(st(ctx).num_frees, 2);
    /* The freed memory is served again, once. */
    void *b2 = xalloc_full(ctx, s, 1024);
    ck_assert_ptr_eq(b2, b);
    xfree(ctx, b2, s);
    xfree(ctx, a, s);
    xfree(ctx, g, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/*
 * A second free of a block whose memory has left its shard since the first
 * -- a large block's region, given back at its free; a region trimmed to the
 * device; an expandable shard's reservation when its stream is released --
 * is still a double free, not a foreign pointer: the region map remembers
 * the ranges that departed.  A large block's region held that one block: a
 * pointer inside it is not one.  Another context's departed block is
 * foreign to this one.
 */
START_TEST(test_double_free_departed)
{
    bfc_config_t c = cfg_grow(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_ctx_t *other = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);

    void *big = xalloc_full(ctx, s, 64 * MiB);
    uint32_t regions = st(ctx).num_regions;
    xfree(ctx, big, s);
    ck_assert_uint_eq(st(ctx).num_regions, regions - 1); /* its region left */
    expect_bad_free(ctx, big, s, BFC_EDOUBLEFREE);
    expect_bad_free(ctx, cp(big) + 256, s, BFC_ENOTOWNED);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, big), 0);
    ck_assert_int_eq(bfc_last_error(), BFC_EDOUBLEFREE);
    expect_bad_free(other, big, NULL, BFC_ENOTOWNED);

    void *small = xalloc_full(ctx, s, 1000), *next = xalloc_full(ctx, s, 1000);
    xfree(ctx, small, s);
    xfree(ctx, next, s);
    ck_assert_int_eq(bfc_ctx_trim(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).num_regions, 0);
    expect_bad_free(ctx, small, s, BFC_EDOUBLEFREE);
    expect_bad_free(ctx, next, s, BFC_EDOUBLEFREE);
    expect_bad_free(ctx, cp(small) + 8, s, BFC_ENOTOWNED);

    /* The other context's block, departed with its shard's reservation. */
    bfc_config_t v;
    bfc_config_init(&v);
    v.backend = BFC_BACKEND_SIM;
    v.memory_limit = 64 * MiB;
    v.vmm = BFC_VMM_ON;
    bfc_ctx_t *x = ctx_new(&v);
    bfc_stream_t t = new_stream(x);
    void *q = xalloc_full(x, t, 4096);
    xfree(x, q, t);
    ck_assert_int_eq(bfc_ctx_stream_release(x, t), BFC_OK);
    ck_assert_int_eq(bfc_ctx_free(x, q, t), BFC_EDOUBLEFREE);
    expect_bad_free(ctx, q, s, BFC_ENOTOWNED);
    xcheck(x);
    bfc_ctx_destroy(x);
    /* A destroyed context's ranges are forgotten with it. */
    expect_bad_free(ctx, q, s, BFC_ENOTOWNED);

    /* Memory given out again is the new block's. */
    void *again = xalloc_full(ctx, s, 64 * MiB);
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, again), 64 * MiB);
    xfree(ctx, again, s);
    xcheck(ctx);
    bfc_ctx_destroy(other);
    ctx_done(ctx, s);
}
END_TEST

/* The common double free: the block merged into a free chunk before it. */
START_TEST(test_double_free_after_merge)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 1024), *b = xalloc_full(ctx, s, 1024), *g = xalloc_full(ctx, s, 256);
    xfree(ctx, a, s);
    xfree(ctx, b, s); /* b's chunk is now the back half of a's */
    expect_bad_free(ctx, b, s, BFC_EDOUBLEFREE);
    expect_bad_free(ctx, a, s, BFC_EDOUBLEFREE);
    void *m = xalloc_full(ctx, s, 2048);
    ck_assert_ptr_eq(m, a);
    xfree(ctx, m, s);
    xfree(ctx, g, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* Addresses inside this context's free memory that were never handed out. */
START_TEST(test_free_never_returned_in_region)
{
    bfc_config_t c = cfg_tf(16 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    void *a = xalloc_full(ctx, s, 1024);
    const size_t offs[] = {1024, 1024 + 256, 4096, 1 * MiB, 16 * MiB - 256};
    for (size_t k = 0; k < sizeof offs / sizeof offs[0]; k++) {
        void *p = cp(a) + offs[k];
        bfc_stats_t x = st(ctx);
        int rc = bfc_ctx_free(ctx, p, s);
        ck_assert_msg(rc == BFC_ENOTOWNED || rc == BFC_EDOUBLEFREE, "free(a+%zu) = %s", offs[k],
                      bfc_err_name(rc));
        bfc_stats_t y = st(ctx);
        ck_assert(memcmp(&x, &y, sizeof x) == 0);
        xcheck(ctx);
    }
    /* The free space is intact: all of it but a can still be had at once. */
    void *rest = xalloc_full(ctx, s, 16 * MiB - 1024);
    ck_assert_ptr_eq(rest, cp(a) + 1024);
    xfree(ctx, rest, s);
    xfree(ctx, a, s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ------------------------------------------------------ introspection */

START_TEST(test_introspection)
{
    bfc_config_t c = cfg_grow(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    enum { N = 3000 };
    void *live[N];
    size_t req[N];
    int64_t ids[N];
    size_t nlive = 0;
    int64_t last = -1;
    uint64_t x = 99;
    for (int i = 0; i < N; i++) {
        size_t n = 1 + rng_next(&x) % (64 * KiB);
        void *p = xalloc_full(ctx, s, n);
        int64_t id = bfc_ctx_allocation_id(ctx, p);
        ck_assert_msg(id > last, "allocation id %lld after %lld", (long long)id, (long long)last);
        last = id;
        live[nlive] = p;
        req[nlive] = n;
        ids[nlive++] = id;
        if (rng_next(&x) % 2 == 0) {
            size_t k = rng_next(&x) % nlive;
            /* Sizes and id are stable for the block's whole life. */
            ck_assert_uint_eq(bfc_ctx_requested_size(ctx, live[k]), req[k]);
            ck_assert_int_eq(bfc_ctx_allocation_id(ctx, live[k]), ids[k]);
            void *dead = live[k];
            xfree(ctx, dead, s);
            /* Not live any more (unless a later allocation reuses it). */
            ck_assert_uint_eq(bfc_ctx_requested_size(ctx, dead), 0);
            ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, dead), 0);
            ck_assert_int_lt(bfc_ctx_allocation_id(ctx, dead), 0);
            nlive--;
            live[k] = live[nlive];
            req[k] = req[nlive];
            ids[k] = ids[nlive];
        }
    }
    /* Non-live pointers: 0 / 0 / negative. */
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, NULL), 0);
    ck_assert_uint_eq(bfc_ctx_allocated_size(ctx, NULL), 0);
    ck_assert_int_lt(bfc_ctx_allocation_id(ctx, NULL), 0);
    int local;
    ck_assert_uint_eq(bfc_ctx_requested_size(ctx, &local), 0);
    ck_assert_int_eq(bfc_last_error(), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_ctx_allocation_id(ctx, &local), BFC_ENOTOWNED);
    ck_assert_int_eq(bfc_last_error(), BFC_ENOTOWNED);
    ck_assert_uint_eq(bfc_ctx_allocated_size(NULL, live[0]), 0);
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    /* Every query sets the status, success included. */
    ck_assert_uint_gt(bfc_ctx_allocated_size(ctx, live[0]), 0);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    for (size_t k = 0; k < nlive; k++) {
        ck_assert_uint_eq(bfc_ctx_requested_size(ctx, live[k]), req[k]);
        ck_assert_int_eq(bfc_ctx_allocation_id(ctx, live[k]), ids[k]);
        xfree(ctx, live[k], s);
    }
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* Allocation ids stay unique within the context and increasing within
 * each shard over many allocations of two shards that alternate, hundreds
 * of thousands each (a shard takes its ids from the context in blocks). */
static int cmp_i64(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

START_TEST(test_allocation_ids_unique)
{
    bfc_config_t c = cfg_grow(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s[2] = {new_stream(ctx), new_stream(ctx)};
    enum { N = 300000, RUN = 7000 };
    int64_t *ids = malloc(2 * N * sizeof(*ids));
    ck_assert_ptr_nonnull(ids);
    int64_t last[2] = {0, 0};
    size_t n = 0;
    for (int i = 0; i < 2 * N; i++) {
        int w = (i / RUN) % 2; /* runs of each stream in turn */
        void *p = xalloc(ctx, s[w], 256 + (size_t)(i % 7) * 512);
        int64_t id = bfc_ctx_allocation_id(ctx, p);
        ck_assert_msg(id > last[w], "stream %d: id %lld after %lld", w, (long long)id, (long long)last[w]);
        last[w] = id;
        ids[n++] = id;
        xfree(ctx, p, s[w]);
    }
    qsort(ids, n, sizeof(*ids), cmp_i64);
    for (size_t k = 1; k < n; k++)
        ck_assert_msg(ids[k] != ids[k - 1], "allocation id %lld given twice", (long long)ids[k]);
    free(ids);
    xcheck(ctx);
    bfc_sim_stream_destroy(ctx, s[1]);
    ctx_done(ctx, s[0]);
}
END_TEST

/* ------------------------------------------------------------- stats */

START_TEST(test_stats_exact)
{
    const size_t limit = 16 * MiB;
    bfc_config_t c = cfg_tf(limit);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    bfc_stats_t x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 0);
    ck_assert_uint_eq(x.num_frees, 0);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 0);
    ck_assert_uint_eq(x.bytes_requested, 0);
    ck_assert_uint_eq(x.largest_alloc_size, 0);
    ck_assert_uint_eq(x.bytes_limit, limit);
    ck_assert_uint_eq(x.bytes_reserved, limit);
    ck_assert_uint_eq(x.peak_bytes_reserved, limit);
    ck_assert_uint_eq(x.num_ooms, 0);
    ck_assert_uint_eq(x.num_remote_frees, 0);
    ck_assert_uint_eq(x.num_pending_frees, 0);

    void *a = xalloc_full(ctx, s, 1000);
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 1);
    ck_assert_uint_eq(x.bytes_in_use, 1024);
    ck_assert_uint_eq(x.bytes_requested, 1000);
    ck_assert_uint_eq(x.peak_bytes_in_use, 1024);
    ck_assert_uint_eq(x.num_regions, 1);
    ck_assert_uint_eq(x.bytes_in_use + x.bytes_free, limit);
    ck_assert_uint_eq(x.largest_free_chunk, limit - 1024);

    void *b = xalloc_full(ctx, s, 5120);
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 2);
    ck_assert_uint_eq(x.bytes_in_use, 6144);
    ck_assert_uint_eq(x.bytes_requested, 6120);
    ck_assert_uint_eq(x.peak_bytes_in_use, 6144);
    ck_assert_uint_eq(x.largest_alloc_size, 5120);

    xfree(ctx, a, s);
    x = st(ctx);
    ck_assert_uint_eq(x.num_frees, 1);
    ck_assert_uint_eq(x.bytes_in_use, 5120);
    ck_assert_uint_eq(x.bytes_requested, 5120);
    ck_assert_uint_eq(x.peak_bytes_in_use, 6144);
    ck_assert_uint_eq(x.bytes_in_use + x.bytes_free, limit);

    void *d = xalloc_full(ctx, s, 100); /* into a's hole, split */
    ck_assert_ptr_eq(d, a);
    x = st(ctx);
    ck_assert_uint_eq(x.bytes_in_use, 5376);
    ck_assert_uint_eq(x.bytes_requested, 5220);
    ck_assert_uint_eq(x.peak_bytes_in_use, 6144);

    ck_assert_int_eq(bfc_ctx_clear_peaks(ctx), BFC_OK);
    x = st(ctx);
    ck_assert_uint_eq(x.peak_bytes_in_use, 5376);
    ck_assert_uint_eq(x.peak_bytes_reserved, limit);
    ck_assert_uint_eq(x.num_allocs, 3); /* counters are not peaks */

    void *e = xalloc_full(ctx, s, 2 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.peak_bytes_in_use, 5376 + 2 * MiB);
    ck_assert_uint_eq(x.largest_alloc_size, 2 * MiB);
    expect_oom(ctx, s, 15 * MiB);
    x = st(ctx);
    ck_assert_uint_eq(x.num_ooms, 1);
    ck_assert_uint_eq(x.num_allocs, 4);

    xfree(ctx, b, s);
    xfree(ctx, d, s);
    xfree(ctx, e, s);
    x = st(ctx);
    ck_assert_uint_eq(x.num_allocs, 4);
    ck_assert_uint_eq(x.num_frees, 4);
    ck_assert_uint_eq(x.bytes_in_use, 0);
    ck_assert_uint_eq(x.bytes_requested, 0);
    ck_assert_uint_eq(x.peak_bytes_in_use, 5376 + 2 * MiB);
    ck_assert_uint_eq(x.bytes_free, limit);
    ck_assert_uint_eq(x.largest_free_chunk, limit);
    ck_assert_uint_eq(x.num_remote_frees, 0);
    ck_assert_uint_eq(x.num_pending_frees, 0);
    ck_assert_int_eq(bfc_ctx_clear_peaks(ctx), BFC_OK);
    ck_assert_uint_eq(st(ctx).peak_bytes_in_use, 0);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ------------------------------------------------ memory is usable */

START_TEST(test_contents_preserved)
{
    bfc_config_t c = cfg_grow(256 * MiB);
    bfc_ctx_t *ctx = ctx_new(&c);
    bfc_stream_t s = pick_stream(ctx, _i);
    enum { N = 400 };
    void *p[N];
    size_t n[N];
    uint64_t x = 5;
    for (int i = 0; i < N; i++) {
        n[i] = 1 + rng_next(&x) % (300 * KiB);
        p[i] = xalloc_full(ctx, s, n[i]);
        /* Fill the whole chunk: it is ours up to allocated_size. */
        memset(p[i], (unsigned char)i, bfc_ctx_allocated_size(ctx, p[i]));
    }
    for (int i = 0; i < N; i += 2) {
        xfree(ctx, p[i], s);
        n[i] = 1 + rng_next(&x) % (300 * KiB);
        p[i] = xalloc_full(ctx, s, n[i]);
        memset(p[i], (unsigned char)i, bfc_ctx_allocated_size(ctx, p[i]));
    }
    for (int i = 0; i < N; i++) {
        const unsigned char *q = p[i];
        size_t a = bfc_ctx_allocated_size(ctx, p[i]);
        for (size_t k = 0; k < a; k++)
            if (q[k] != (unsigned char)i)
                ck_abort_msg("block %d (%p, %zu bytes) byte %zu clobbered", i, p[i], a, k);
    }
    for (int i = 0; i < N; i++)
        xfree(ctx, p[i], s);
    xcheck(ctx);
    ctx_done(ctx, s);
}
END_TEST

/* ------------------------------------------------------------- suite */

static Suite *arena_suite(void)
{
    Suite *su = suite_create("arena");
    struct {
        const char *name;
        const TTest *tests[16];
    } groups[] = {
        {"sizes",
         {test_zero_size, test_rounding_allocated_size, test_allocated_vs_requested, test_alloc_too_large,
          test_oom_not_sticky, NULL}},
        {"split",
         {test_split_twice_rule, test_split_fraction_rule, test_split_fraction_of_configured_limit,
          test_split_fraction_huge_limit, test_split_fraction_tiny, test_split_128mib_rule,
          test_growth_huge_limit, NULL}},
        {"best_fit",
         {test_best_fit_smallest, test_best_fit_within_bin, test_best_fit_lowest_address, test_best_fit_open_bin,
          test_best_fit_100k_fragments, NULL}},
        {"coalesce",
         {test_coalesce_both, test_coalesce_next, test_coalesce_prev, test_exercise_coalescing,
          test_same_sequence_same_addresses, NULL}},
        {"tensorflow",
         {test_no_dups, test_allocations_and_deallocations, test_allocations_with_growth, test_dump,
          test_snapshot_json, NULL}},
        {"growth",
         {test_growth_schedule, test_growth_fills_limit, test_growth_capped_by_limit, test_growth_backoff,
          test_growth_backoff_terminates, test_no_growth_reserves_at_create, test_no_growth_large_first,
          test_tf_one_region, NULL}},
        {"large", {test_large_alloc_own_region, test_large_alloc_off, NULL}},
        {"gc",
         {test_gc_off_fails, test_gc_on_retries, test_gc_off_keeps_cached, test_gc_hopeless_keeps_regions,
          test_gc_keeps_schedule, test_gc_large_after_free, test_trim, NULL}},
        {"bad_free",
         {test_free_null, test_free_foreign, test_free_interior, test_double_free, test_double_free_after_merge,
          test_double_free_departed,
          test_free_never_returned_in_region, NULL}},
        {"introspection",
         {test_introspection, test_allocation_ids_unique, test_stats_exact, test_contents_preserved, NULL}},
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        TCase *tc = tcase_create(groups[g].name);
        /* Explicit, so that CK_DEFAULT_TIMEOUT cannot shorten it. */
        tcase_set_timeout(tc, 60);
        for (size_t t = 0; groups[g].tests[t] != NULL; t++)
            tcase_add_loop_test(tc, groups[g].tests[t], 0, 2);
        suite_add_tcase(su, tc);
    }
    /* A hang here is the failure: keep its timeout short. */
    TCase *tc = tcase_create("growth_cycles");
    tcase_set_timeout(tc, 10);
    tcase_add_loop_test(tc, test_growth_release_cycles, 0, 2);
    suite_add_tcase(su, tc);
    return su;
}

int main(void)
{
    return run_suite(arena_suite());
}
