/*
 * test_errors.c -- status codes, bfc_strerror, bfc_err_name and the
 * thread-local bfc_last_error.
 *
 * The expected strings are spelled out by hand (not regenerated from
 * BFC_ERRNO_MAP), so a table edit that changes a public name or value shows
 * up here as a failure that someone has to acknowledge.
 */
#define BFC_TESTUTIL_NO_CTX
#include "testutil.h"

#include "internal.h"

#include <check.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    int code;
    int value;
    const char *name;
    const char *desc;
} expected[] = {
    {BFC_OK, 0, "BFC_OK", "success"},
    {BFC_ENOMEM, -1, "BFC_ENOMEM", "out of memory: the request cannot be served within the limit"},
    {BFC_EINVAL, -2, "BFC_EINVAL", "invalid argument or configuration"},
    {BFC_ENOTOWNED, -3, "BFC_ENOTOWNED", "pointer was not allocated by this context"},
    {BFC_EDOUBLEFREE, -4, "BFC_EDOUBLEFREE", "pointer was already freed"},
    {BFC_EBACKEND, -5, "BFC_EBACKEND", "device or runtime call failed"},
    {BFC_ENODEV, -6, "BFC_ENODEV", "no usable device for the chosen backend"},
    {BFC_ECORRUPT, -7, "BFC_ECORRUPT", "allocator invariant violated"},
    {BFC_EBUSY, -8, "BFC_EBUSY", "resource busy"},
    {BFC_ESTATE, -9, "BFC_ESTATE", "operation not valid in the current state"},
};
#define N_EXPECTED (sizeof expected / sizeof expected[0])

START_TEST(test_values)
{
    for (size_t i = 0; i < N_EXPECTED; i++)
        ck_assert_int_eq(expected[i].code, expected[i].value);
}
END_TEST

START_TEST(test_table_size)
{
    /* Every entry of the header's table is listed above. */
    size_t n = 0;
#define COUNT(name, val, desc) n++;
    BFC_ERRNO_MAP(COUNT)
#undef COUNT
    ck_assert_uint_eq(n, N_EXPECTED);
}
END_TEST

START_TEST(test_strerror_each)
{
    for (size_t i = 0; i < N_EXPECTED; i++) {
        const char *s = bfc_strerror(expected[i].code);
        ck_assert_ptr_nonnull(s);
        ck_assert_str_eq(s, expected[i].desc);
    }
}
END_TEST

START_TEST(test_err_name_each)
{
    for (size_t i = 0; i < N_EXPECTED; i++) {
        const char *s = bfc_err_name(expected[i].code);
        ck_assert_ptr_nonnull(s);
        ck_assert_str_eq(s, expected[i].name);
    }
}
END_TEST

START_TEST(test_distinct)
{
    for (size_t i = 0; i < N_EXPECTED; i++)
        for (size_t j = i + 1; j < N_EXPECTED; j++) {
            ck_assert_int_ne(expected[i].code, expected[j].code);
            ck_assert_str_ne(bfc_strerror(expected[i].code), bfc_strerror(expected[j].code));
            ck_assert_str_ne(bfc_err_name(expected[i].code), bfc_err_name(expected[j].code));
        }
}
END_TEST

START_TEST(test_unknown)
{
    static const int unknown[] = {1, 2, -10, -11, -100, 12345, INT_MIN, INT_MAX, INT_MIN + 1};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        ck_assert_str_eq(bfc_strerror(unknown[i]), "unknown status");
        ck_assert_str_eq(bfc_err_name(unknown[i]), "BFC_UNKNOWN");
    }
}
END_TEST

START_TEST(test_last_error_initial_and_set)
{
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
    bfc__set_last_error(BFC_ENOMEM);
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc__set_last_error(BFC_EINVAL);
    ck_assert_int_eq(bfc_last_error(), BFC_EINVAL);
    bfc__set_last_error(BFC_OK);
    ck_assert_int_eq(bfc_last_error(), BFC_OK);
}
END_TEST

struct peer {
    int seen_at_start;
    int set_to;
    int seen_at_end;
};

static void *peer_main(void *arg)
{
    struct peer *p = arg;
    p->seen_at_start = bfc_last_error();
    bfc__set_last_error(p->set_to);
    p->seen_at_end = bfc_last_error();
    return NULL;
}

START_TEST(test_last_error_thread_local)
{
    bfc__set_last_error(BFC_ENOMEM);

    struct peer p = {.seen_at_start = 12345, .set_to = BFC_EDOUBLEFREE, .seen_at_end = 12345};
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, peer_main, &p), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);

    /* The new thread started clean although this one had failed ... */
    ck_assert_int_eq(p.seen_at_start, BFC_OK);
    ck_assert_int_eq(p.seen_at_end, BFC_EDOUBLEFREE);
    /* ... and its failure did not leak back here. */
    ck_assert_int_eq(bfc_last_error(), BFC_ENOMEM);
    bfc__set_last_error(BFC_OK); /* leave no trace under CK_FORK=no */
}
END_TEST

#define N_THREADS 8
#define N_ROUNDS 20000

struct racer {
    int code;
    int mismatches;
};

static void *racer_main(void *arg)
{
    struct racer *r = arg;
    for (int i = 0; i < N_ROUNDS; i++) {
        bfc__set_last_error(r->code);
        if (bfc_last_error() != r->code)
            r->mismatches++;
        bfc__set_last_error(BFC_OK);
        if (bfc_last_error() != BFC_OK)
            r->mismatches++;
    }
    bfc__set_last_error(r->code);
    return NULL;
}

START_TEST(test_last_error_concurrent)
{
    pthread_t t[N_THREADS];
    struct racer r[N_THREADS];
    bfc__set_last_error(BFC_EBUSY);
    for (int i = 0; i < N_THREADS; i++) {
        r[i].code = -1 - (i % 9); /* BFC_ENOMEM .. BFC_ESTATE */
        r[i].mismatches = 0;
        ck_assert_int_eq(pthread_create(&t[i], NULL, racer_main, &r[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++) {
        ck_assert_int_eq(pthread_join(t[i], NULL), 0);
        ck_assert_int_eq(r[i].mismatches, 0);
    }
    /* Eight threads each ended on their own code; this one kept its own. */
    ck_assert_int_eq(bfc_last_error(), BFC_EBUSY);
    bfc__set_last_error(BFC_OK);
}
END_TEST

static Suite *errors_suite(void)
{
    Suite *s = suite_create("errors");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_values);
    tcase_add_test(tc, test_table_size);
    tcase_add_test(tc, test_strerror_each);
    tcase_add_test(tc, test_err_name_each);
    tcase_add_test(tc, test_distinct);
    tcase_add_test(tc, test_unknown);
    tcase_add_test(tc, test_last_error_initial_and_set);
    tcase_add_test(tc, test_last_error_thread_local);
    tcase_add_test(tc, test_last_error_concurrent);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return run_suite(errors_suite());
}
