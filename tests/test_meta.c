/*
 * test_meta.c -- the metadata shim (src/meta.c): allocation entry points,
 * the bytes counter, and slabs (stable addresses, reuse, zeroing, growth
 * across pages, destroy).  Runs against whichever shim configure chose.
 */
#include "meta.h"

#include <check.h>
#include <stdlib.h>
#include <string.h>

START_TEST(test_init_and_kind)
{
    ck_assert_int_eq(bfc__meta_init(), BFC_OK);
    ck_assert_int_eq(bfc__meta_init(), BFC_OK); /* idempotent */
    ck_assert_str_eq(bfc__meta_kind(), BFC_META_JEMALLOC ? "jemalloc" : "libc");
}
END_TEST

START_TEST(test_alloc_sizes)
{
    static const size_t sizes[] = {0, 1, 7, 16, 100, 4096, 65537, 3 << 20};
    size_t i;

    for (i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        unsigned char *p = bfc__meta_alloc(sizes[i]);

        ck_assert_ptr_nonnull(p);
        ck_assert_uint_eq((uintptr_t)p % 16, 0); /* malloc alignment */
        if (sizes[i]) {
            memset(p, 0xab, sizes[i]); /* whole block writable */
            ck_assert_uint_eq(p[sizes[i] - 1], 0xab);
        }
        bfc__meta_free(p, sizes[i]);
    }
    bfc__meta_free(NULL, 0); /* no-op */
}
END_TEST

START_TEST(test_zalloc_zeroed)
{
    size_t n;

    for (n = 1; n <= (1u << 20); n *= 4) {
        unsigned char *p;
        size_t i, nonzero = 0;

        /* Dirty a block of the same size first so reuse would show. */
        p = bfc__meta_alloc(n);
        ck_assert_ptr_nonnull(p);
        memset(p, 0xff, n);
        bfc__meta_free(p, n);

        p = bfc__meta_zalloc(n);
        ck_assert_ptr_nonnull(p);
        for (i = 0; i < n; i++)
            nonzero += p[i] != 0;
        ck_assert_uint_eq(nonzero, 0);
        bfc__meta_free(p, n);
    }
}
END_TEST

START_TEST(test_aligned_alloc)
{
    size_t align;

    for (align = 1; align <= 65536; align *= 2) {
        void *p = bfc__meta_aligned_alloc(align, 100);
        void *q = bfc__meta_aligned_alloc(align, 3 * align + 1);

        ck_assert_ptr_nonnull(p);
        ck_assert_ptr_nonnull(q);
        ck_assert_uint_eq((uintptr_t)p % align, 0);
        ck_assert_uint_eq((uintptr_t)q % align, 0);
        memset(q, 1, 3 * align + 1);
        /* Freed with the request size as a hint: must be safe even though
         * the block's size class depends on its alignment. */
        bfc__meta_free(p, 100);
        bfc__meta_free(q, 3 * align + 1);
    }
    ck_assert_ptr_null(bfc__meta_aligned_alloc(0, 16));
    ck_assert_ptr_null(bfc__meta_aligned_alloc(48, 16)); /* not a power of two */
}
END_TEST

START_TEST(test_realloc)
{
    unsigned char *p = bfc__meta_realloc(NULL, 0, 64);
    size_t i;

    ck_assert_ptr_nonnull(p);
    for (i = 0; i < 64; i++)
        p[i] = (unsigned char)i;
    p = bfc__meta_realloc(p, 64, 100000);
    ck_assert_ptr_nonnull(p);
    for (i = 0; i < 64; i++)
        ck_assert_uint_eq(p[i], i);
    p = bfc__meta_realloc(p, 100000, 32);
    ck_assert_ptr_nonnull(p);
    for (i = 0; i < 32; i++)
        ck_assert_uint_eq(p[i], i);
    ck_assert_ptr_null(bfc__meta_realloc(p, 32, 0)); /* frees */
}
END_TEST

START_TEST(test_bytes_counter)
{
    size_t before = bfc__meta_bytes();
    void *a = bfc__meta_alloc(1000);
    void *b = bfc__meta_zalloc(5000);
    void *c = bfc__meta_aligned_alloc(4096, 10000);
    size_t mid = bfc__meta_bytes();

    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert_ptr_nonnull(c);
    ck_assert_uint_ge(mid - before, 16000);
    /* Usable sizes: some rounding, but not wildly more than asked. */
    ck_assert_uint_le(mid - before, 16000 + 3 * 4096);

    a = bfc__meta_realloc(a, 1000, 200000);
    ck_assert_ptr_nonnull(a);
    ck_assert_uint_ge(bfc__meta_bytes() - before, 215000);

    bfc__meta_free(a, 200000);
    bfc__meta_free(b, 0); /* size unknown */
    bfc__meta_free(c, 10000);
    ck_assert_uint_eq(bfc__meta_bytes(), before);
}
END_TEST

struct rec {
    void *link;
    uint64_t a, b, c;
    char pad[40];
};

START_TEST(test_slab_basic)
{
    struct bfc__slab s;
    struct rec *r1, *r2, *r3;

    bfc__slab_init(&s, sizeof(struct rec));
    ck_assert_uint_eq(s.obj_size % 16, 0);
    ck_assert_uint_ge(s.obj_size, sizeof(struct rec));
    ck_assert_uint_ge(s.per_page, 64);
    ck_assert_uint_ge(s.per_page * s.obj_size, 60000); /* ~64 KiB pages */

    r1 = bfc__slab_get(&s);
    r2 = bfc__slab_get(&s);
    ck_assert_ptr_nonnull(r1);
    ck_assert_ptr_nonnull(r2);
    ck_assert_ptr_ne(r1, r2);
    ck_assert_uint_eq(s.n_live, 2);
    ck_assert_uint_eq(s.n_pages, 1);
    ck_assert_uint_eq((uintptr_t)r1 % 16, 0);

    r1->a = 1;
    r1->b = 2;
    r1->c = 3;
    memset(r1->pad, 0x5a, sizeof(r1->pad));
    bfc__slab_put(&s, r1);
    ck_assert_uint_eq(s.n_live, 1);
    /* Only the first word is written while free: a stale reader still sees
     * the rest of the record. */
    ck_assert_uint_eq(r1->a, 1);
    ck_assert_uint_eq(r1->c, 3);
    ck_assert_uint_eq((unsigned char)r1->pad[39], 0x5a);

    /* Reuse: the record just put back comes out again, zeroed. */
    r3 = bfc__slab_get(&s);
    ck_assert_ptr_eq(r3, r1);
    ck_assert_ptr_null(r3->link);
    ck_assert_uint_eq(r3->a, 0);
    ck_assert_uint_eq(r3->c, 0);
    ck_assert_uint_eq((unsigned char)r3->pad[39], 0);

    bfc__slab_put(&s, NULL); /* no-op */
    ck_assert_uint_eq(s.n_live, 2);
    bfc__slab_destroy(&s);
    ck_assert_uint_eq(s.n_pages, 0);
    ck_assert_ptr_null(s.pages);
}
END_TEST

#define MANY 20000

START_TEST(test_slab_many)
{
    struct bfc__slab s;
    struct rec **v = malloc(MANY * sizeof(*v));
    size_t before = bfc__meta_bytes();
    size_t i, j, pages;

    ck_assert_ptr_nonnull(v);
    bfc__slab_init(&s, sizeof(struct rec));
    for (i = 0; i < MANY; i++) {
        v[i] = bfc__slab_get(&s);
        ck_assert_ptr_nonnull(v[i]);
        v[i]->a = i; /* stable address: value must survive later growth */
        v[i]->b = ~(uint64_t)i;
    }
    pages = s.n_pages;
    ck_assert_uint_ge(pages, MANY / s.per_page);
    ck_assert_uint_le(pages, MANY / s.per_page + 1);
    ck_assert_uint_eq(s.n_live, MANY);
    ck_assert_uint_ge(bfc__meta_bytes() - before, pages * s.per_page * s.obj_size);
    for (i = 0; i < MANY; i++) {
        ck_assert_uint_eq(v[i]->a, i);
        ck_assert_uint_eq(v[i]->b, ~(uint64_t)i);
    }
    /* No two records overlap. */
    for (i = 0; i < 200; i++)
        for (j = i + 1; j < MANY; j += 97)
            ck_assert(v[i] + 1 <= v[j] || v[j] + 1 <= v[i]);

    /* Put back every other one; gets reuse them without new pages. */
    for (i = 0; i < MANY; i += 2)
        bfc__slab_put(&s, v[i]);
    ck_assert_uint_eq(s.n_live, MANY / 2);
    for (i = 0; i < MANY; i += 2) {
        struct rec *r = bfc__slab_get(&s);

        ck_assert_ptr_nonnull(r);
        ck_assert_uint_eq(r->a, 0);
        ck_assert_uint_eq(r->b, 0);
    }
    ck_assert_uint_eq(s.n_pages, pages);
    for (i = 1; i < MANY; i += 2)
        ck_assert_uint_eq(v[i]->a, i);

    bfc__slab_destroy(&s);
    ck_assert_uint_eq(bfc__meta_bytes(), before);
    free(v);
}
END_TEST

/* Every Nth shim allocation fails, of every kind, and the switch turns off. */
START_TEST(test_fault_injection)
{
    uint64_t before = bfc__meta_failures();
    bfc__meta_fail_every(3);
    int failed = 0;
    void *keep[12];
    for (int i = 0; i < 12; i++) {
        switch (i % 4) {
        case 0: keep[i] = bfc__meta_alloc(64); break;
        case 1: keep[i] = bfc__meta_zalloc(64); break;
        case 2: keep[i] = bfc__meta_aligned_alloc(64, 64); break;
        default: keep[i] = bfc__meta_realloc(NULL, 0, 64); break;
        }
        if (!keep[i])
            failed++;
        ck_assert_msg((keep[i] == NULL) == ((i + 1) % 3 == 0), "call %d", i);
    }
    ck_assert_int_eq(failed, 4);
    ck_assert_uint_eq(bfc__meta_failures() - before, 4);
    /* realloc of a live block fails too and leaves the block allocated. */
    void *p = bfc__meta_alloc(32);
    bfc__meta_fail_every(1);
    ck_assert_ptr_null(bfc__meta_realloc(p, 32, 4096));
    bfc__meta_fail_every(0);
    for (int i = 0; i < 100; i++) {
        void *q = bfc__meta_alloc(16);
        ck_assert_ptr_nonnull(q);
        bfc__meta_free(q, 16);
    }
    bfc__meta_free(p, 32);
    for (int i = 0; i < 12; i++)
        bfc__meta_free(keep[i], 64);
}
END_TEST

START_TEST(test_slab_tiny_and_big)
{
    struct bfc__slab s;
    void *p;

    bfc__slab_init(&s, 1); /* rounded up to hold the free-list link */
    ck_assert_uint_eq(s.obj_size, 16);
    p = bfc__slab_get(&s);
    ck_assert_ptr_nonnull(p);
    bfc__slab_put(&s, p);
    bfc__slab_destroy(&s);

    bfc__slab_init(&s, 10000); /* big records: still >= 64 per page */
    ck_assert_uint_ge(s.per_page, 64);
    p = bfc__slab_get(&s);
    ck_assert_ptr_nonnull(p);
    memset(p, 7, 10000);
    bfc__slab_destroy(&s);

    bfc__slab_init(&s, SIZE_MAX - 3); /* absurd: get fails, no crash */
    ck_assert_ptr_null(bfc__slab_get(&s));
    bfc__slab_destroy(&s);
}
END_TEST

static Suite *meta_suite(void)
{
    Suite *s = suite_create("meta");
    TCase *tc = tcase_create("core");

    tcase_add_test(tc, test_init_and_kind);
    tcase_add_test(tc, test_alloc_sizes);
    tcase_add_test(tc, test_zalloc_zeroed);
    tcase_add_test(tc, test_aligned_alloc);
    tcase_add_test(tc, test_realloc);
    tcase_add_test(tc, test_bytes_counter);
    tcase_add_test(tc, test_slab_basic);
    tcase_add_test(tc, test_slab_many);
    tcase_add_test(tc, test_slab_tiny_and_big);
    tcase_add_test(tc, test_fault_injection);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(meta_suite());
    int failed;

    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
