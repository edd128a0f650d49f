/*
 * testutil.h -- what the Check suites share: sizes, SIM contexts and
 * streams, allocations and frees that assert their status, statistics, the
 * invariant check after a test, clocks, a seeded random generator, cheap
 * assertions for tight loops, a thread that runs steps handed to it, and
 * main().
 *
 * Header-only: every helper is `static inline` so that a suite which uses
 * only some of them compiles without unused-function warnings.  The
 * public-API helpers need <shardbfc.h> and <shardbfc_sim.h>; a suite that
 * tests an internal part alone (bins, pool) uses only the assertions, the
 * sizes, the clock and the generator, and defines BFC_TESTUTIL_NO_CTX before
 * the include to leave the rest out.
 *
 * Why REQUIRE and not ck_assert in loops: every ck_assert that holds still
 * writes a "mark point" to the runner's pipe (a system call in the default
 * fork mode), so a loop of a million assertions spends its time in Check.
 * REQUIRE calls into Check only when it fails.  It is not for other
 * threads: Check's assertions are for the test's own thread (a worker
 * thread records its failure and the test asserts after joining).
 */
#ifndef BFC_TESTUTIL_H
#define BFC_TESTUTIL_H

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef BFC_TESTUTIL_NO_CTX
#include <shardbfc.h>
#include <shardbfc_sim.h>
#endif

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* Sanitizer builds: BFC_TEST_TSAN (busy-wait loops ~100x slower, fork in a
 * threaded process unsupported) and BFC_TEST_ASAN. */
#if defined(__SANITIZE_THREAD__)
#define BFC_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define BFC_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define BFC_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BFC_TEST_ASAN 1
#endif
#endif

/* True under valgrind, whose preload library is then in LD_PRELOAD.
 * memcheck's address-space manager refuses mappings of tens of GiB. */
static inline bool under_valgrind(void)
{
    const char *pre = getenv("LD_PRELOAD");
    return pre && strstr(pre, "vgpreload") != NULL;
}

/* The process's address space in use (VmSize), in bytes; 0 if unknown. */
static inline size_t vm_size(void)
{
    unsigned long pages = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return 0;
    if (fscanf(f, "%lu", &pages) != 1)
        pages = 0;
    fclose(f);
    return pages * (size_t)sysconf(_SC_PAGESIZE);
}

/* RLIMIT_AS tests run in a forked child (the limit is the process's).
 * False under sanitizers and valgrind, which manage their own address
 * space: such a test checks nothing there.  Else *vm is VmSize, from
 * which the child sets its limit. */
static inline bool rlimit_as_testable(size_t *vm)
{
#if defined(BFC_TEST_ASAN) || defined(BFC_TEST_TSAN)
    (void)vm;
    return false;
#else
    if (under_valgrind())
        return false;
    *vm = vm_size();
    ck_assert_uint_gt(*vm, 0);
    return true;
#endif
}

/* Forks; the child runs under RLIMIT_AS's soft limit `cur` (hard limit
 * unchanged, *old the limits before, so that it may lift it again) and
 * exits 10 where it cannot be set.  Returns 0 in the child, the child's
 * pid in the parent. */
static inline pid_t fork_under_rlimit_as(rlim_t cur, struct rlimit *old)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        struct rlimit rl;
        if (getrlimit(RLIMIT_AS, old) != 0)
            _exit(10);
        rl = *old;
        rl.rlim_cur = cur;
        if (setrlimit(RLIMIT_AS, &rl) != 0)
            _exit(10);
    }
    return pid;
}

/* Waits for the child pid: its exit code, or -1 when a signal ended it. */
static inline int child_exit(pid_t pid)
{
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ------------------------------------------------- cheap assertions */

/* Fails the test with the message only when cond is false. */
#define REQUIRE(cond, ...)                                                                         \
    do {                                                                                           \
        if (__builtin_expect(!(cond), 0))                                                          \
            ck_abort_msg(__VA_ARGS__);                                                             \
    } while (0)

/* REQUIRE with the condition, file and line as the message. */
#define FAST_ASSERT(cond)                                                                          \
    REQUIRE(cond, "%s:%d: assertion failed: %s", __FILE__, __LINE__, #cond)

/* Two unsigned integers equal, both printed when not. */
#define REQUIRE_EQ_U(a, b)                                                                         \
    do {                                                                                           \
        unsigned long long tu_a_ = (unsigned long long)(a), tu_b_ = (unsigned long long)(b);       \
        REQUIRE(tu_a_ == tu_b_, "%s:%d: %s == %s failed: %llu != %llu", __FILE__, __LINE__, #a, #b, \
                tu_a_, tu_b_);                                                                     \
    } while (0)

/* -------------------------------------------------- sizes, time, random */

static inline size_t r256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline double now_s(void)
{
    return (double)now_ns() * 1e-9;
}

/* splitmix64 (a seed is any value, 0 included): small, fast, well mixed,
 * and the same sequence on every run. */
static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t rng_next(uint64_t *x)
{
    return mix64(*x += 0x9E3779B97F4A7C15ull);
}

/* ------------------------------------------------- a stepping thread */

/* A thread that runs the functions handed to it one at a time while the
 * caller waits: for calls that must be made on another thread (its
 * per-thread stream, its exit) in a sequence the test decides.  Check's
 * assertions stay on the test's own thread: the function records what it
 * saw. */
struct step_thread {
    pthread_t tid;
    pthread_mutex_t m;
    pthread_cond_t c;
    void (*fn)(void *);
    void *arg;
    bool quit;
};

static inline void *step_thread_main(void *v)
{
    struct step_thread *w = v;
    pthread_mutex_lock(&w->m);
    for (;;) {
        while (!w->fn && !w->quit)
            pthread_cond_wait(&w->c, &w->m);
        if (w->quit)
            break;
        w->fn(w->arg);
        w->fn = NULL;
        pthread_cond_broadcast(&w->c);
    }
    pthread_mutex_unlock(&w->m);
    return NULL;
}

static inline void step_start(struct step_thread *w)
{
    memset(w, 0, sizeof *w);
    ck_assert_int_eq(pthread_mutex_init(&w->m, NULL), 0);
    ck_assert_int_eq(pthread_cond_init(&w->c, NULL), 0);
    ck_assert_int_eq(pthread_create(&w->tid, NULL, step_thread_main, w), 0);
}

/* Runs fn(arg) on the thread and waits for it. */
static inline void step_run(struct step_thread *w, void (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&w->m);
    w->fn = fn;
    w->arg = arg;
    pthread_cond_broadcast(&w->c);
    while (w->fn)
        pthread_cond_wait(&w->c, &w->m);
    pthread_mutex_unlock(&w->m);
}

/* The thread returns (its thread-exit handlers run) and is joined. */
static inline void step_stop(struct step_thread *w)
{
    pthread_mutex_lock(&w->m);
    w->quit = true;
    pthread_cond_broadcast(&w->c);
    pthread_mutex_unlock(&w->m);
    ck_assert_int_eq(pthread_join(w->tid, NULL), 0);
    pthread_cond_destroy(&w->c);
    pthread_mutex_destroy(&w->m);
}

/* ------------------------------------------------------------- main */

/* Runs one suite (CK_ENV: CK_VERBOSITY, CK_RUN_CASE, ... apply). */
static inline int run_suite(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

#ifndef BFC_TESTUTIL_NO_CTX

/* ------------------------------------------------ contexts and streams */

/* Defaults on the SIM backend with this memory limit; a suite sets the
 * rest of its configuration on the result. */
static inline bfc_config_t sim_cfg(size_t limit)
{
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    c.memory_limit = limit;
    return c;
}

static inline bfc_ctx_t *ctx_new(const bfc_config_t *cfg)
{
    bfc_ctx_t *ctx = NULL;
    int rc = bfc_ctx_create(cfg, &ctx);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_create: %s", bfc_err_name(rc));
    ck_assert_ptr_nonnull(ctx);
    return ctx;
}

/* A SIM context from a configuration string ("memory_limit=64M,..."). */
static inline bfc_ctx_t *ctx_spec(const char *spec)
{
    bfc_config_t c = sim_cfg(0);
    int rc = bfc_config_parse(&c, spec);
    ck_assert_msg(rc == BFC_OK, "bfc_config_parse(\"%s\"): %s", spec, bfc_err_name(rc));
    bfc_ctx_t *ctx = NULL;
    rc = bfc_ctx_create(&c, &ctx);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_create(\"%s\"): %s", spec, bfc_err_name(rc));
    ck_assert_ptr_nonnull(ctx);
    return ctx;
}

static inline bfc_stream_t new_stream(bfc_ctx_t *ctx)
{
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    ck_assert_ptr_nonnull(s);
    return s;
}

/* ------------------------------------------------------ alloc and free */

/* A successful allocation: not NULL, 256-byte aligned, no error set. */
static inline void *xalloc(bfc_ctx_t *ctx, bfc_stream_t s, size_t n)
{
    void *p = bfc_ctx_alloc(ctx, s, n);
    REQUIRE(p != NULL, "alloc(%p, %zu) failed: %s", (void *)s, n, bfc_err_name(bfc_last_error()));
    REQUIRE(((uintptr_t)p & 255) == 0, "alloc(%zu) = %p is not 256-byte aligned", n, p);
    REQUIRE(bfc_last_error() == BFC_OK, "alloc(%zu) = %p left error %s", n, p, bfc_err_name(bfc_last_error()));
    return p;
}

static inline void xfree(bfc_ctx_t *ctx, void *p, bfc_stream_t s)
{
    int rc = bfc_ctx_free(ctx, p, s);
    REQUIRE(rc == BFC_OK, "free(%p, %p): %s", p, (void *)s, bfc_err_name(rc));
}

/* ---------------------------------------------------- stats and checks */

/* The context's statistics (every field overwritten: poisoned first). */
static inline bfc_stats_t st(bfc_ctx_t *ctx)
{
    bfc_stats_t s;
    memset(&s, 0xA5, sizeof s);
    int rc = bfc_ctx_stats(ctx, &s);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_stats: %s", bfc_err_name(rc));
    return s;
}

/* One stream's shard. */
static inline bfc_stats_t sst(bfc_ctx_t *ctx, bfc_stream_t s)
{
    bfc_stats_t o;
    memset(&o, 0xA5, sizeof o);
    int rc = bfc_ctx_stream_stats(ctx, s, &o);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_stream_stats(%p): %s", (void *)s, bfc_err_name(rc));
    return o;
}

/* Every invariant holds: the report (which names a broken one) and
 * bfc_ctx_check agree. */
static inline void xcheck(bfc_ctx_t *ctx)
{
    char buf[1024];
    buf[0] = '\0';
    int rc = bfc_ctx_check_report(ctx, buf, sizeof buf);
    ck_assert_msg(rc == BFC_OK, "bfc_ctx_check_report: %s: %s", bfc_err_name(rc), buf);
    ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
}

#endif /* BFC_TESTUTIL_NO_CTX */

#endif /* BFC_TESTUTIL_H */
