/*
 * test_vmm_backend.c -- the virtual-memory calls of the backend interface
 * (va_reserve / va_map / va_unmap / va_release, src/backend.h) on the SIM
 * backend and its book (src/backend_vmm.c): round trips, data kept while
 * mapped, fresh pages after unmap and map again, sub-ranges unmapped apart
 * from how they were mapped, `held` and the ceiling, fault injection, bad
 * arguments, metadata failures, many reservations, a 64 GiB reservation
 * that costs nothing, a random model check of the book, threads, the
 * bfc_sim_mapped control, the driver cost model (bfc_sim_set_vmm_cost) and
 * the host backend (no virtual memory).
 *
 * Unmapped memory is never touched here (it faults); bfc__sim_mapped and
 * bfc_sim_mapped are how the tests see it.
 */
#include "backend.h"
#include "ctx.h"
#include "host.h"
#include "meta.h"

#include <shardbfc_sim.h>

#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

#define G (64 * BFC__KiB) /* the small granule most tests use */

static bfc__backend_t *open_sim(size_t granule)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    ck_assert_int_eq(bfc__backend_sim_open(&cfg, &be), BFC_OK);
    ck_assert_ptr_nonnull(be);
    if (granule)
        ck_assert_int_eq(bfc__sim_set_vmm_granule(be, granule), BFC_OK);
    return be;
}

static int mapped(bfc__backend_t *be, uintptr_t a, size_t n)
{
    return bfc__sim_mapped(be, (const void *)a, n);
}

static void fill(uintptr_t a, size_t n, unsigned char v)
{
    memset((void *)a, v, n);
}

/* True when every byte of [a, a + n) is v. */
static bool all_are(uintptr_t a, size_t n, unsigned char v)
{
    const unsigned char *p = (const unsigned char *)a;

    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return false;
    return true;
}

/* Resident set size of the process, from /proc/self/statm. */
static size_t rss_bytes(void)
{
    unsigned long size = 0, res = 0;
    FILE *f = fopen("/proc/self/statm", "r");

    if (!f)
        return 0;
    if (fscanf(f, "%lu %lu", &size, &res) != 2)
        res = 0;
    fclose(f);
    return (size_t)res * (size_t)sysconf(_SC_PAGESIZE);
}

START_TEST(test_identity)
{
    bfc__backend_t *be = open_sim(0);

    /* SIM has virtual memory, 2 MiB granules by default. */
    ck_assert_uint_eq(be->vmm_granule, 2 * BFC__MiB);
    ck_assert_ptr_nonnull(be->ops->va_reserve);
    ck_assert_ptr_nonnull(be->ops->va_release);
    ck_assert_ptr_nonnull(be->ops->va_map);
    ck_assert_ptr_nonnull(be->ops->va_unmap);

    /* Granule: a power of two of at least a page, only while nothing is
     * reserved. */
    ck_assert_int_eq(bfc__sim_set_vmm_granule(be, 0), BFC_EINVAL);
    ck_assert_int_eq(bfc__sim_set_vmm_granule(be, 3 * G), BFC_EINVAL);
    ck_assert_int_eq(bfc__sim_set_vmm_granule(be, 256), BFC_EINVAL);
    ck_assert_uint_eq(be->vmm_granule, 2 * BFC__MiB);
    ck_assert_int_eq(bfc__sim_set_vmm_granule(be, (size_t)sysconf(_SC_PAGESIZE)), BFC_OK);
    ck_assert_uint_eq(be->vmm_granule, (size_t)sysconf(_SC_PAGESIZE));
    ck_assert_int_eq(bfc__sim_set_vmm_granule(be, G), BFC_OK);
    {
        uintptr_t base = 0;

        ck_assert_int_eq(be->ops->va_reserve(be, 4 * G, &base), BFC_OK);
        ck_assert_int_eq(bfc__sim_set_vmm_granule(be, 2 * G), BFC_EINVAL);
        ck_assert_uint_eq(be->vmm_granule, G);
        ck_assert_int_eq(be->ops->va_release(be, base, 4 * G), BFC_OK);
        ck_assert_int_eq(bfc__sim_set_vmm_granule(be, 2 * G), BFC_OK);
    }
    /* Not a SIM backend: refused, and answers "not mapped". */
    ck_assert_int_eq(bfc__sim_set_vmm_granule(NULL, G), BFC_EINVAL);
    ck_assert_int_eq(bfc__sim_mapped(NULL, &be, 1), 0);
    be->ops->close(be);
}
END_TEST

START_TEST(test_round_trip)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t base = 0;
    size_t held0 = bfc__sim_bytes_held(be);
    uint64_t allocs0 = bfc__sim_allocs(be);

    ck_assert_int_eq(be->ops->va_reserve(be, 16 * G, &base), BFC_OK);
    ck_assert_uint_ne(base, 0);
    ck_assert_uint_eq(base % G, 0);
    /* Reserved is not held, and not mapped. */
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held0);
    ck_assert_int_eq(mapped(be, base, 1), 0);
    ck_assert_int_eq(mapped(be, base, 16 * G), 0);

    /* Map two granules in the middle: read-write, zero, counted. */
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * G, 2 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held0 + 2 * G);
    ck_assert_uint_eq(bfc__sim_allocs(be), allocs0 + 1);
    ck_assert_int_eq(mapped(be, base + 3 * G, 2 * G), 1);
    ck_assert_int_eq(mapped(be, base + 3 * G + 100, 10), 1);
    ck_assert_int_eq(mapped(be, base + 2 * G, 2 * G), 0);     /* starts before */
    ck_assert_int_eq(mapped(be, base + 4 * G, 2 * G), 0);     /* ends after */
    ck_assert_int_eq(mapped(be, base + 5 * G - 1, 2), 0);     /* one byte over */
    ck_assert_int_eq(mapped(be, base + 3 * G, 0), 0);         /* empty */
    ck_assert(all_are(base + 3 * G, 2 * G, 0));
    fill(base + 3 * G, 2 * G, 0xA5);
    ck_assert(all_are(base + 3 * G, 2 * G, 0xA5));

    /* Unmap: not held, not mapped. */
    ck_assert_int_eq(be->ops->va_unmap(be, base + 3 * G, 2 * G, NULL), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held0);
    ck_assert_int_eq(mapped(be, base + 3 * G, 1), 0);
    ck_assert_int_eq(mapped(be, base + 4 * G, G), 0);

    /* Map again at the same addresses: fresh pages, zero. */
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * G, 2 * G), BFC_OK);
    ck_assert(all_are(base + 3 * G, 2 * G, 0));
    ck_assert_int_eq(be->ops->va_unmap(be, base + 3 * G, 2 * G, NULL), BFC_OK);

    /* The whole range, first and last granules included. */
    ck_assert_int_eq(be->ops->va_map(be, base, 16 * G), BFC_OK);
    ck_assert_int_eq(mapped(be, base, 16 * G), 1);
    fill(base, 16 * G, 1);
    ck_assert_int_eq(be->ops->va_unmap(be, base, 16 * G, NULL), BFC_OK);
    ck_assert_int_eq(be->ops->va_release(be, base, 16 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held0);
    /* Released: nothing of it is known any more. */
    ck_assert_int_eq(be->ops->va_map(be, base, G), BFC_EINVAL);
    ck_assert_int_eq(mapped(be, base, 1), 0);
    be->ops->close(be);
}
END_TEST

/* Granules unmapped one at a time out of one map, and mapped back one at a
 * time: each is independent of how it was mapped, and its neighbours keep
 * their data. */
START_TEST(test_subranges)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t base = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, 8 * G, &base), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base, 8 * G), BFC_OK);
    for (size_t i = 0; i < 8; i++)
        fill(base + i * G, G, (unsigned char)(i + 1));
    ck_assert_int_eq(be->ops->va_unmap(be, base + 2 * G, 3 * G, NULL), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 5 * G);
    /* va_mapped: the whole reservation, any granule-aligned part of it. */
    ck_assert_uint_eq(be->ops->va_mapped(be, base, 8 * G), 5 * G);
    ck_assert_uint_eq(be->ops->va_mapped(be, base + G, 2 * G), G);
    ck_assert_uint_eq(be->ops->va_mapped(be, base + 3 * G, G), 0);
    ck_assert_uint_eq(be->ops->va_mapped(be, base + 4 * G, 4 * G), 3 * G);
    /* ... and 0 for anything else: past the end, unaligned, no reservation. */
    ck_assert_uint_eq(be->ops->va_mapped(be, base + 4 * G, 5 * G), 0);
    ck_assert_uint_eq(be->ops->va_mapped(be, base + 4096, G), 0);
    ck_assert_uint_eq(be->ops->va_mapped(be, base, G + 4096), 0);
    ck_assert_uint_eq(be->ops->va_mapped(be, base - G, G), 0);
    ck_assert_int_eq(mapped(be, base, 2 * G), 1);
    ck_assert_int_eq(mapped(be, base + 5 * G, 3 * G), 1);
    ck_assert_int_eq(mapped(be, base, 3 * G), 0);
    for (size_t i = 0; i < 8; i++)
        if (i < 2 || i >= 5)
            ck_assert(all_are(base + i * G, G, (unsigned char)(i + 1)));
    /* The middle one alone, then its neighbours, in another grouping. */
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * G, G), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base + 2 * G, G), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base + 4 * G, G), BFC_OK);
    ck_assert_int_eq(mapped(be, base, 8 * G), 1);
    ck_assert(all_are(base + 2 * G, 3 * G, 0));
    ck_assert(all_are(base + 5 * G, G, 6));
    /* Unmap across what were separate maps. */
    ck_assert_int_eq(be->ops->va_unmap(be, base + G, 6 * G, NULL), BFC_OK);
    ck_assert_int_eq(mapped(be, base, G), 1);
    ck_assert_int_eq(mapped(be, base + 7 * G, G), 1);
    ck_assert(all_are(base, G, 1));
    ck_assert(all_are(base + 7 * G, G, 8));
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 2 * G);
    /* Release with granules still mapped: they go too. */
    ck_assert_int_eq(be->ops->va_release(be, base, 8 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

START_TEST(test_held_and_ceiling)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t base = 0;
    void *blk = NULL;
    size_t f = 0, t = 0;
    uint64_t fails0;

    ck_assert_int_eq(be->ops->va_reserve(be, 64 * G, &base), BFC_OK);
    /* Classic blocks and mapped granules share one count and ceiling. */
    ck_assert_int_eq(be->ops->mem_alloc(be, G, &blk), BFC_OK);
    bfc__sim_set_alloc_ceiling(be, 4 * G);
    ck_assert_int_eq(be->ops->va_map(be, base, 2 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 3 * G);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);
    ck_assert_uint_eq(t - f, 3 * G);
    fails0 = bfc__sim_failures(be);
    /* Two more granules would pass the ceiling: refused whole. */
    ck_assert_int_eq(be->ops->va_map(be, base + 2 * G, 2 * G), BFC_ENOMEM);
    ck_assert_uint_eq(bfc__sim_failures(be), fails0 + 1);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 3 * G);
    ck_assert_int_eq(mapped(be, base + 2 * G, G), 0);
    ck_assert_int_eq(mapped(be, base + 3 * G, G), 0);
    /* One more fits exactly; then nothing does. */
    ck_assert_int_eq(be->ops->va_map(be, base + 2 * G, G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 4 * G);
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * G, G), BFC_ENOMEM);
    ck_assert_int_eq(be->ops->mem_free(be, blk, G), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * G, G), BFC_OK);
    /* Unmapping makes room again. */
    ck_assert_int_eq(be->ops->va_unmap(be, base, 2 * G, NULL), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 2 * G);
    ck_assert_int_eq(be->ops->va_map(be, base + 10 * G, 2 * G), BFC_OK);
    ck_assert_int_eq(be->ops->va_release(be, base, 64 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

START_TEST(test_fault_injection)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t base = 0;
    void *blk = NULL;
    int ok = 0, refused = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, 64 * G, &base), BFC_OK);
    bfc__sim_fail_alloc_every(be, 3);
    /* Every third device allocation fails, mem_alloc and va_map alike
     * (one counter): calls 1, 2 pass, 3 fails... */
    ck_assert_int_eq(be->ops->va_map(be, base, G), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &blk), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base + G, 2 * G), BFC_ENOMEM);
    ck_assert_int_eq(mapped(be, base + G, G), 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), G + 4096);
    /* A refused map leaves the granules free for the next try. */
    ck_assert_int_eq(be->ops->va_map(be, base + G, 2 * G), BFC_OK);
    ck_assert_int_eq(mapped(be, base, 3 * G), 1);
    ck_assert_int_eq(be->ops->mem_free(be, blk, 4096), BFC_OK);
    /* A run: a third of the maps fail, each one cleanly. */
    for (size_t i = 3; i < 63; i++) {
        int st = be->ops->va_map(be, base + i * G, G);

        if (st == BFC_OK) {
            ok++;
            ck_assert_int_eq(mapped(be, base + i * G, G), 1);
        } else {
            ck_assert_int_eq(st, BFC_ENOMEM);
            ck_assert_int_eq(mapped(be, base + i * G, G), 0);
            refused++;
        }
    }
    ck_assert_int_eq(refused, 20);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), (size_t)(3 + ok) * G);
    /* Unmap is never refused. */
    ck_assert_int_eq(be->ops->va_unmap(be, base, 3 * G, NULL), BFC_OK);
    bfc__sim_fail_alloc_every(be, 0);
    ck_assert_int_eq(be->ops->va_release(be, base, 64 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

START_TEST(test_bad_arguments)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t a = 0, b = 0, x = 1;
    size_t held;

    /* Reserve: no size, a size off the granule, nowhere to put the base. */
    ck_assert_int_eq(be->ops->va_reserve(be, 0, &x), BFC_EINVAL);
    ck_assert_uint_eq(x, 0);
    ck_assert_int_eq(be->ops->va_reserve(be, G + 4096, &x), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_reserve(be, G / 2, &x), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_reserve(be, G, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_reserve(be, SIZE_MAX - G + 1, &x), BFC_ENOMEM);

    /* One reservation for now: its neighbourhood is nobody's. */
    ck_assert_int_eq(be->ops->va_reserve(be, 8 * G, &a), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, a + 2 * G, 2 * G), BFC_OK);
    held = bfc__sim_bytes_held(be);

    /* Map: empty, unaligned address or size, outside or leaving a
     * reservation, over a mapped granule. */
    ck_assert_int_eq(be->ops->va_map(be, a, 0), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a + 4096, G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a, G + 4096), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a, G / 2), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a - G, G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a - G, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a + 7 * G, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a + 8 * G, G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a, 16 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, 0, G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, UINTPTR_MAX - G + 1, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, (uintptr_t)&held & ~(uintptr_t)(G - 1), G),
                     BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a + 2 * G, G), BFC_EINVAL);     /* double */
    ck_assert_int_eq(be->ops->va_map(be, a + 3 * G, 2 * G), BFC_EINVAL); /* overlaps */
    ck_assert_int_eq(be->ops->va_map(be, a, 8 * G), BFC_EINVAL);         /* covers */

    /* A second reservation, perhaps right beside the first (mmap tends to
     * place them so): a range may not run from one into the other. */
    ck_assert_int_eq(be->ops->va_reserve(be, 8 * G, &b), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, b + 7 * G, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, b - G, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a - G, 2 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, a + 7 * G, 2 * G), BFC_EINVAL);

    /* Unmap: the same, and granules that are not all mapped. */
    ck_assert_int_eq(be->ops->va_unmap(be, a, G, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, a + G, 2 * G, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, a + 2 * G, 3 * G, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, a + 2 * G + 4096, G, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, a + 2 * G, 0, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, b, G, NULL), BFC_EINVAL);

    /* Release: only a whole reservation, as reserved. */
    ck_assert_int_eq(be->ops->va_release(be, a, 4 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_release(be, a + G, 7 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_release(be, a, 16 * G), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_release(be, 0, 0), BFC_EINVAL);

    /* None of it changed anything. */
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held);
    ck_assert_int_eq(mapped(be, a + 2 * G, 2 * G), 1);
    ck_assert_int_eq(mapped(be, a, G), 0);
    ck_assert_int_eq(mapped(be, a + 4 * G, G), 0);
    ck_assert_int_eq(mapped(be, b, G), 0);
    ck_assert(all_are(a + 2 * G, 2 * G, 0));

    ck_assert_int_eq(be->ops->va_release(be, a, 8 * G), BFC_OK);
    ck_assert_int_eq(be->ops->va_release(be, a, 8 * G), BFC_EINVAL); /* twice */
    ck_assert_int_eq(be->ops->va_release(be, b, 8 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

/* The book's records come from the metadata shim: when it fails, so does
 * va_reserve (BFC_ENOMEM), and nothing stays reserved or recorded. */
START_TEST(test_metadata_failure)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t a = 1, b = 0;

    bfc__meta_fail_every(1); /* the book's first array */
    ck_assert_int_eq(be->ops->va_reserve(be, 4 * G, &a), BFC_ENOMEM);
    ck_assert_uint_eq(a, 0);
    bfc__meta_fail_every(0);
    ck_assert_int_eq(be->ops->va_reserve(be, 4 * G, &b), BFC_OK);
    bfc__meta_fail_every(1); /* a reservation's bitmap */
    ck_assert_int_eq(be->ops->va_reserve(be, 4 * G, &a), BFC_ENOMEM);
    bfc__meta_fail_every(0);
    ck_assert_uint_eq(a, 0);
    /* The book is intact: b works, nothing else is known. */
    ck_assert_int_eq(be->ops->va_map(be, b, 4 * G), BFC_OK);
    ck_assert_int_eq(mapped(be, b, 4 * G), 1);
    ck_assert_int_eq(be->ops->va_release(be, b, 4 * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

/* 4 KiB granules (16 per 64 KiB) in reservations of many sizes: the book
 * keeps them apart, and its bitmaps cross word boundaries. */
START_TEST(test_many_reservations)
{
    enum { N = 400 };
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    bfc__backend_t *be = open_sim(pg);
    uintptr_t base[N];
    size_t size[N];
    size_t held = 0;
    unsigned seed = 12345;

    for (size_t i = 0; i < N; i++) {
        size[i] = (1 + i % 200) * pg;
        ck_assert_int_eq(be->ops->va_reserve(be, size[i], &base[i]), BFC_OK);
        ck_assert_uint_eq(base[i] % pg, 0);
    }
    /* Map the last granule of each, in a scrambled order. */
    for (size_t k = 0; k < N; k++) {
        size_t i = (k * 7919) % N;
        uintptr_t last = base[i] + size[i] - pg;

        ck_assert_int_eq(be->ops->va_map(be, last, pg), BFC_OK);
        *(volatile size_t *)last = i;
        held += pg;
    }
    ck_assert_uint_eq(bfc__sim_bytes_held(be), held);
    for (size_t i = 0; i < N; i++) {
        uintptr_t last = base[i] + size[i] - pg;

        ck_assert_int_eq(mapped(be, last, pg), 1);
        ck_assert_uint_eq(*(volatile size_t *)last, i);
        if (size[i] > pg)
            ck_assert_int_eq(mapped(be, base[i], pg), 0);
        /* Just past the end: another reservation's, or nobody's. */
        ck_assert_int_eq(mapped(be, last, 2 * pg), 0);
    }
    /* Release in a random order. */
    for (size_t n = N; n > 0; n--) {
        size_t j = (size_t)rand_r(&seed) % n;

        ck_assert_int_eq(be->ops->va_release(be, base[j], size[j]), BFC_OK);
        held -= pg;
        ck_assert_uint_eq(bfc__sim_bytes_held(be), held);
        base[j] = base[n - 1];
        size[j] = size[n - 1];
    }
    be->ops->close(be);
}
END_TEST

START_TEST(test_huge_reservation)
{
    bfc__backend_t *be = open_sim(0); /* 2 MiB granules */
    size_t g = be->vmm_granule;
    /* memcheck's address-space manager refuses 64 GiB mappings: 1 GiB
     * there (the book's code is what it checks). */
    size_t huge = under_valgrind() ? BFC__GiB : 64 * BFC__GiB;
    uintptr_t base = 0, base2 = 0;
    size_t rss0, rss1;

    rss0 = rss_bytes();
    ck_assert_int_eq(be->ops->va_reserve(be, huge, &base), BFC_OK);
    ck_assert_int_eq(be->ops->va_reserve(be, huge, &base2), BFC_OK);
    rss1 = rss_bytes();
    ck_assert_uint_eq(base % g, 0);
    ck_assert_uint_eq(base2 % g, 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    /* 128 GiB of addresses for a few KiB of book. */
    ck_assert_uint_lt(rss1, rss0 + BFC__MiB);
    /* Its first and last granules. */
    ck_assert_int_eq(be->ops->va_map(be, base, g), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, base + huge - g, g), BFC_OK);
    fill(base, g, 7);
    fill(base + huge - g, g, 9);
    ck_assert(all_are(base, g, 7));
    ck_assert(all_are(base + huge - g, g, 9));
    ck_assert_int_eq(mapped(be, base + g, huge - 2 * g), 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 2 * g);
    ck_assert_int_eq(be->ops->va_release(be, base, huge), BFC_OK);
    ck_assert_int_eq(be->ops->va_release(be, base2, huge), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

/*
 * Random maps and unmaps of random ranges against a model (one flag per
 * granule): every call succeeds exactly when the model says it may, and
 * afterwards the book, `held` and the bytes agree with the model.
 */
START_TEST(test_model)
{
    enum { NG = 300, OPS = 4000 };
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    bfc__backend_t *be = open_sim(pg);
    bool model[NG] = {false};
    unsigned char tag[NG] = {0};
    uintptr_t base = 0;
    unsigned seed = 777;
    size_t n_mapped = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, NG * pg, &base), BFC_OK);
    for (int op = 0; op < OPS; op++) {
        size_t lo = (size_t)rand_r(&seed) % NG;
        size_t len = 1 + (size_t)rand_r(&seed) % (op % 3 == 0 ? 70 : 6);
        bool map = rand_r(&seed) & 1;
        bool in = lo + len <= NG, allow = in;
        int st;

        for (size_t i = lo; allow && i < lo + len; i++)
            allow = model[i] != map;
        if (map)
            st = be->ops->va_map(be, base + lo * pg, len * pg);
        else
            st = be->ops->va_unmap(be, base + lo * pg, len * pg, NULL);
        ck_assert_int_eq(st, allow ? BFC_OK : BFC_EINVAL);
        if (!allow)
            continue;
        for (size_t i = lo; i < lo + len; i++) {
            model[i] = map;
            if (map) {
                ck_assert(all_are(base + i * pg, pg, 0));
                tag[i] = (unsigned char)(1 + rand_r(&seed) % 255);
                fill(base + i * pg, pg, tag[i]);
            }
        }
        n_mapped = map ? n_mapped + len : n_mapped - len;
        if (op % 100 == 0) {
            for (size_t i = 0; i < NG; i++) {
                ck_assert_int_eq(mapped(be, base + i * pg, pg), model[i]);
                if (model[i])
                    ck_assert(all_are(base + i * pg, pg, tag[i]));
            }
        }
        ck_assert_uint_eq(bfc__sim_bytes_held(be), n_mapped * pg);
    }
    /* Runs of the model answer as runs. */
    for (size_t i = 0; i < NG; i++) {
        size_t j = i;

        while (j < NG && model[j] == model[i])
            j++;
        ck_assert_int_eq(mapped(be, base + i * pg, (j - i) * pg), model[i]);
        if (j < NG)
            ck_assert_int_eq(mapped(be, base + i * pg, (j - i + 1) * pg), 0);
        i = j - 1;
    }
    ck_assert_int_eq(be->ops->va_release(be, base, NG * pg), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

/* Threads map and unmap their own reservations and race for the granules
 * of a shared one: each shared granule is won by exactly one thread. */
#define THREADS 4
#define SHARED 256

struct race {
    bfc__backend_t *be;
    uintptr_t shared;
    int id;
    int won[SHARED];
};

static void *racer(void *arg)
{
    struct race *r = arg;
    bfc__backend_t *be = r->be;
    uintptr_t own = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, 32 * G, &own), BFC_OK);
    for (int round = 0; round < 50; round++) {
        size_t i = (size_t)(round * 5 + r->id) % 31;

        ck_assert_int_eq(be->ops->va_map(be, own + i * G, 2 * G), BFC_OK);
        *(volatile int *)(own + i * G) = r->id;
        ck_assert_int_eq(*(volatile int *)(own + i * G), r->id);
        ck_assert_int_eq(be->ops->va_unmap(be, own + i * G, 2 * G, NULL), BFC_OK);
    }
    for (size_t k = 0; k < SHARED; k++) {
        int st = be->ops->va_map(be, r->shared + k * G, G);

        ck_assert(st == BFC_OK || st == BFC_EINVAL);
        r->won[k] = st == BFC_OK;
        if (st == BFC_OK)
            *(volatile int *)(r->shared + k * G) = r->id;
    }
    ck_assert_int_eq(be->ops->va_release(be, own, 32 * G), BFC_OK);
    return NULL;
}

START_TEST(test_threads)
{
    bfc__backend_t *be = open_sim(G);
    static struct race r[THREADS];
    pthread_t th[THREADS];
    uintptr_t shared = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, SHARED * G, &shared), BFC_OK);
    for (int i = 0; i < THREADS; i++) {
        r[i] = (struct race){.be = be, .shared = shared, .id = i + 1};
        ck_assert_int_eq(pthread_create(&th[i], NULL, racer, &r[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    for (size_t k = 0; k < SHARED; k++) {
        int winners = 0, who = 0;

        for (int i = 0; i < THREADS; i++)
            if (r[i].won[k]) {
                winners++;
                who = r[i].id;
            }
        ck_assert_int_eq(winners, 1);
        ck_assert_int_eq(*(volatile int *)(shared + k * G), who);
    }
    ck_assert_uint_eq(bfc__sim_bytes_held(be), SHARED * G);
    ck_assert_int_eq(be->ops->va_release(be, shared, SHARED * G), BFC_OK);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    be->ops->close(be);
}
END_TEST

/* A backend closed with reservations (some mapped) still held frees them
 * (the leak checkers of the sanitizer and valgrind builds see the book). */
START_TEST(test_close_with_reservations)
{
    bfc__backend_t *be = open_sim(G);
    uintptr_t a = 0, b = 0;

    ck_assert_int_eq(be->ops->va_reserve(be, 8 * G, &a), BFC_OK);
    ck_assert_int_eq(be->ops->va_reserve(be, 8 * G, &b), BFC_OK);
    ck_assert_int_eq(be->ops->va_map(be, a + G, 3 * G), BFC_OK);
    be->ops->close(be);
}
END_TEST

/* The public control, through a context. */
START_TEST(test_ctx_mapped)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    bfc__backend_t *be;
    uintptr_t base = 0;
    uint64_t held0;
    void *p;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    cfg.vmm = BFC_VMM_OFF; /* classic regions: the last check needs one */
    ck_assert_int_eq(bfc_ctx_create(&cfg, &ctx), BFC_OK);
    be = ctx->be;
    ck_assert_uint_eq(be->vmm_granule, 2 * BFC__MiB);
    held0 = bfc_sim_backend_bytes_held(ctx);

    ck_assert_int_eq(be->ops->va_reserve(be, 16 * be->vmm_granule, &base), BFC_OK);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)base, 1), 0);
    ck_assert_int_eq(be->ops->va_map(be, base + be->vmm_granule, 2 * be->vmm_granule),
                     BFC_OK);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), held0 + 2 * be->vmm_granule);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)(base + be->vmm_granule),
                                    2 * be->vmm_granule),
                     1);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)(base + be->vmm_granule + 300), 1000), 1);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)base, 2 * be->vmm_granule), 0);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)(base + be->vmm_granule), 0), 0);
    ck_assert_int_eq(be->ops->va_unmap(be, base + be->vmm_granule, be->vmm_granule, NULL),
                     BFC_OK);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)(base + be->vmm_granule),
                                    2 * be->vmm_granule),
                     0);
    ck_assert_int_eq(bfc_sim_mapped(ctx, (void *)(base + 2 * be->vmm_granule),
                                    be->vmm_granule),
                     1);
    ck_assert_int_eq(be->ops->va_release(be, base, 16 * be->vmm_granule), BFC_OK);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(ctx), held0);

    /* Classic memory is outside every reservation: 0, as documented. */
    p = bfc_ctx_alloc(ctx, NULL, 4096);
    ck_assert_ptr_nonnull(p);
    ck_assert_int_eq(bfc_sim_mapped(ctx, p, 4096), 0);
    ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
    ck_assert_int_eq(bfc_sim_mapped(ctx, NULL, 4096), 0);
    ck_assert_int_eq(bfc_sim_mapped(NULL, &cfg, 1), 0);
    bfc_ctx_destroy(ctx);
}
END_TEST

/* ---------------------------------------------- the driver cost model */

#define COST_NS (4u * 1000u * 1000u) /* 4 ms a granule: far above any noise */

static bfc_ctx_t *sim_ctx(void)
{
    bfc_config_t cfg = sim_cfg(0);
    bfc_ctx_t *ctx = ctx_new(&cfg);
    ck_assert_int_eq(bfc__sim_set_vmm_granule(ctx->be, G), BFC_OK);
    return ctx;
}

struct costed {
    bfc__backend_t *be;
    uintptr_t base;
    pthread_barrier_t *go;
    uint64_t start, end;
};

static void *costed_map(void *arg)
{
    struct costed *c = arg;
    int st = pthread_barrier_wait(c->go);
    ck_assert(st == 0 || st == PTHREAD_BARRIER_SERIAL_THREAD);
    c->start = now_ns();
    ck_assert_int_eq(c->be->ops->va_map(c->be, c->base, G), BFC_OK);
    c->end = now_ns();
    return NULL;
}

/*
 * bfc_sim_set_vmm_cost: a map or unmap costs at least the set time per
 * granule; two contexts' calls run one at a time (the driver's lock is the
 * process's), so two threads mapping at once take twice as long in all;
 * memory and its accounting are unchanged; NULL is a no-op.  Only lower
 * bounds are asserted: they cannot fail on a slow machine.
 */
START_TEST(test_driver_cost)
{
    bfc_ctx_t *a = sim_ctx(), *b = sim_ctx();
    uintptr_t ra = 0, rb = 0;
    uint64_t t;

    bfc_sim_set_vmm_cost(NULL, COST_NS); /* no context: no-op */
    bfc_sim_set_vmm_cost(a, COST_NS);
    bfc_sim_set_vmm_cost(b, COST_NS);
    ck_assert_int_eq(a->be->ops->va_reserve(a->be, 8 * G, &ra), BFC_OK);
    ck_assert_int_eq(b->be->ops->va_reserve(b->be, 8 * G, &rb), BFC_OK);

    /* Per granule, for map and unmap alike. */
    t = now_ns();
    ck_assert_int_eq(a->be->ops->va_map(a->be, ra + 2 * G, 3 * G), BFC_OK);
    ck_assert_uint_ge(now_ns() - t, 3ull * COST_NS);
    t = now_ns();
    ck_assert_int_eq(a->be->ops->va_unmap(a->be, ra + 3 * G, 2 * G, NULL), BFC_OK);
    ck_assert_uint_ge(now_ns() - t, 2ull * COST_NS);
    ck_assert_int_eq(mapped(a->be, ra + 2 * G, G), 1);
    ck_assert_int_eq(mapped(a->be, ra + 3 * G, 2 * G), 0);

    /* Serialised across contexts: the two calls' costs do not overlap. */
    {
        pthread_barrier_t go;
        pthread_t th[2];
        struct costed c[2] = {{a->be, ra, &go, 0, 0}, {b->be, rb, &go, 0, 0}};
        ck_assert_int_eq(pthread_barrier_init(&go, NULL, 2), 0);
        for (int i = 0; i < 2; i++)
            ck_assert_int_eq(pthread_create(&th[i], NULL, costed_map, &c[i]), 0);
        for (int i = 0; i < 2; i++)
            ck_assert_int_eq(pthread_join(th[i], NULL), 0);
        ck_assert_int_eq(pthread_barrier_destroy(&go), 0);
        uint64_t s0 = c[0].start < c[1].start ? c[0].start : c[1].start;
        uint64_t e1 = c[0].end > c[1].end ? c[0].end : c[1].end;
        ck_assert_uint_ge(e1 - s0, 2ull * COST_NS);
    }

    /* Memory and accounting unchanged by the model. */
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(a), 2 * G);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(b), G);
    fill(ra, G, 0x5A);
    fill(ra + 2 * G, G, 0xA5);
    ck_assert(all_are(ra, G, 0x5A) && all_are(ra + 2 * G, G, 0xA5));

    /* A refused call changes nothing; 0 turns the model off (its speed is
     * not asserted: an upper bound on time would be a timing assertion). */
    ck_assert_int_eq(a->be->ops->va_map(a->be, ra, G), BFC_EINVAL); /* mapped already */
    bfc_sim_set_vmm_cost(a, 0);
    ck_assert_int_eq(a->be->ops->va_map(a->be, ra + 4 * G, G), BFC_OK);
    ck_assert_int_eq(a->be->ops->va_release(a->be, ra, 8 * G), BFC_OK);
    ck_assert_int_eq(b->be->ops->va_release(b->be, rb, 8 * G), BFC_OK);
    ck_assert_uint_eq(bfc_sim_backend_bytes_held(a), 0);
    bfc_ctx_destroy(a);
    bfc_ctx_destroy(b);
}
END_TEST

/* Host arenas have no virtual memory: granule 0, and every call refused. */
START_TEST(test_host_backend)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;
    uintptr_t x = 1;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    ck_assert_int_eq(bfc__backend_host_open(&cfg, NULL, 0, false, 64 * BFC__MiB, &be), BFC_OK);
    ck_assert_uint_eq(be->vmm_granule, 0);
    ck_assert_int_eq(be->ops->va_reserve(be, 2 * BFC__MiB, &x), BFC_EINVAL);
    ck_assert_uint_eq(x, 0);
    ck_assert_int_eq(be->ops->va_map(be, 0, 2 * BFC__MiB), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, 0, 2 * BFC__MiB, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_release(be, 0, 2 * BFC__MiB), BFC_EINVAL);
    ck_assert_int_eq(bfc__sim_mapped(be, &x, 1), 0); /* not SIM itself */
    be->ops->close(be);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("vmm_backend");
    TCase *sim = tcase_create("sim");
    TCase *more = tcase_create("others");
    SRunner *sr;
    int failed;

    tcase_add_test(sim, test_identity);
    tcase_add_test(sim, test_round_trip);
    tcase_add_test(sim, test_subranges);
    tcase_add_test(sim, test_held_and_ceiling);
    tcase_add_test(sim, test_fault_injection);
    tcase_add_test(sim, test_bad_arguments);
    tcase_add_test(sim, test_metadata_failure);
    tcase_add_test(sim, test_many_reservations);
    tcase_add_test(sim, test_huge_reservation);
    tcase_add_test(sim, test_model);
    tcase_add_test(sim, test_threads);
    tcase_add_test(sim, test_close_with_reservations);
    tcase_set_timeout(sim, 60);
    suite_add_tcase(s, sim);
    tcase_add_test(more, test_ctx_mapped);
    tcase_add_test(more, test_driver_cost);
    tcase_add_test(more, test_host_backend);
    suite_add_tcase(s, more);
    sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
