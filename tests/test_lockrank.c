/*
 * test_lockrank.c -- the lock ranks of src/mutex.h and their witness.
 *
 * Every lock of the library has a rank, and a thread takes locks in
 * increasing rank only (bfc__lock_nested allows an equal rank where the
 * caller says so).  Debug builds check this on every lock taken and abort
 * with both lock names on a violation; these tests take locks in order
 * (which must work in every build), then out of order, in a forked test
 * process that must die of SIGABRT.  Built without --enable-debug there is
 * no witness to test: the in-order tests run, and the program reports a
 * skip (77) rather than pass without checking the point of the suite.  The
 * abort tests need Check's fork mode, and are left out (a skip) without it.
 */
#include "mutex.h"

#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bfc__mutex_t outer = BFC__MUTEX_INIT(BFC__RANK_ARENAS, "test arenas list");
static bfc__mutex_t arena1 = BFC__MUTEX_INIT(BFC__RANK_ARENA, "test arena 1");
static bfc__mutex_t arena2 = BFC__MUTEX_INIT(BFC__RANK_ARENA, "test arena 2");
static bfc__mutex_t pool = BFC__MUTEX_INIT(BFC__RANK_POOL, "test pool");

START_TEST(test_in_order)
{
    bfc__mutex_t dyn;
    ck_assert_int_eq(bfc__mutex_init(&dyn, BFC__RANK_REGIONMAP, "test region map"), 0);
    bfc__lock(&outer);
    bfc__lock(&arena1);
    bfc__lock(&pool);
    bfc__lock(&dyn);
    /* Released in any order: the rest still checks against the highest. */
    bfc__unlock(&arena1);
    bfc__unlock(&dyn);
    bfc__unlock(&pool);
    bfc__lock(&arena2);
    bfc__unlock(&arena2);
    bfc__unlock(&outer);
    bfc__mutex_destroy(&dyn);
    /* And again from nothing held: the list emptied. */
    bfc__lock(&pool);
    bfc__unlock(&pool);
    bfc__lock(&arena1);
    bfc__unlock(&arena1);
}
END_TEST

START_TEST(test_nested_same_rank)
{
    bfc__lock(&outer);
    bfc__lock_nested(&arena1);
    bfc__lock_nested(&arena2);
    bfc__lock(&pool);
    bfc__unlock(&pool);
    bfc__unlock(&arena1);
    bfc__unlock(&arena2);
    bfc__unlock(&outer);
}
END_TEST

/* ---- each of these must abort (debug builds) ---- */

START_TEST(test_inversion_aborts)
{
    bfc__lock(&pool);
    bfc__lock(&arena1); /* rank ARENA < POOL: fatal */
    bfc__unlock(&arena1);
    bfc__unlock(&pool);
}
END_TEST

START_TEST(test_same_rank_aborts)
{
    bfc__lock(&arena1);
    bfc__lock(&arena2); /* two arenas without bfc__lock_nested: fatal */
    bfc__unlock(&arena2);
    bfc__unlock(&arena1);
}
END_TEST

START_TEST(test_relock_aborts)
{
    bfc__lock_nested(&arena1);
    bfc__lock_nested(&arena1); /* a self-deadlock, caught instead of hung */
}
END_TEST

START_TEST(test_unlock_not_held_aborts)
{
    bfc__unlock(&pool);
}
END_TEST

START_TEST(test_uninitialised_aborts)
{
    bfc__mutex_t z;
    memset(&z, 0, sizeof(z));
    bfc__lock(&z);
    bfc__unlock(&z);
}
END_TEST

static Suite *lockrank_suite(bool witness)
{
    Suite *s = suite_create("lockrank");
    TCase *tc = tcase_create("order");
    tcase_add_test(tc, test_in_order);
    tcase_add_test(tc, test_nested_same_rank);
    suite_add_tcase(s, tc);
    if (witness) {
        TCase *tw = tcase_create("witness");
        tcase_add_test_raise_signal(tw, test_inversion_aborts, SIGABRT);
        tcase_add_test_raise_signal(tw, test_same_rank_aborts, SIGABRT);
        tcase_add_test_raise_signal(tw, test_relock_aborts, SIGABRT);
        tcase_add_test_raise_signal(tw, test_unlock_not_held_aborts, SIGABRT);
        tcase_add_test_raise_signal(tw, test_uninitialised_aborts, SIGABRT);
        suite_add_tcase(s, tw);
    }
    return s;
}

int main(void)
{
    const char *fork_env = getenv("CK_FORK");
    bool forking = !(fork_env && strcmp(fork_env, "no") == 0);
    bool witness = bfc__config_debug && forking;
    SRunner *sr = srunner_create(lockrank_suite(witness));
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (failed != 0)
        return EXIT_FAILURE;
    if (!bfc__config_debug) {
        fprintf(stderr, "test_lockrank: not a debug build (--enable-debug): no witness to test; skipped\n");
        return 77;
    }
    if (!forking) {
        fprintf(stderr, "test_lockrank: CK_FORK=no: the abort tests need a process each; skipped\n");
        return 77;
    }
    return EXIT_SUCCESS;
}
