/*
 * test_ops.c -- what a production deployment relies on, checked in child
 * processes: a configuration that cannot misfire and traces that keep every
 * event when the program exits without tearing the library down.
 *
 * The process-wide service reads SHARDBFC_CONF once per process and a trace
 * is flushed when its process exits, so each case runs this same program
 * again (readlink("/proc/self/exe"), posix_spawn) with "--child MODE" and
 * its own environment, and looks at what the child left behind: its exit
 * status, its stderr, its trace file.  The test runner's own process-wide
 * state is never touched, whatever CK_FORK says.
 *
 * Child modes (each returns 0 when its own assertions hold):
 *   refuse        every service call fails with BFC_EINVAL (SHARDBFC_CONF
 *                 is invalid); the parent checks the one stderr line.
 *   main N        N allocation/free pairs through the service with
 *                 trace=PATH, then return from main (no bfc_shutdown).
 *   threads N     as main, plus a worker thread that does N pairs and then
 *                 sits idle (never joined) while main calls exit(0).
 *   ctx N         an explicit context traced with bfc_ctx_trace_start, N
 *                 pairs, exit(0) with the trace running and the context
 *                 alive.
 *   fork N        N pairs, fork(); the child makes N more and exits with
 *                 exit(0); the parent waits and returns.  The trace holds
 *                 the parent's events once each and none of the child's.
 *   nothreads N   no thread can be made: context creation and the service
 *                 fail with BFC_ENOMEM (liburcu would abort), then work
 *                 once threads can be made.
 *   nothreads_again N  the same after a context was made and destroyed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_{get,set}attr_default_np */
#endif
#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* ThreadSanitizer cannot follow a child that forks from a multi-threaded
 * process (liburcu's call_rcu thread runs) and then starts threads: the
 * fork case is left out of TSan builds. */
#if defined(__SANITIZE_THREAD__)
#define OPS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define OPS_TSAN 1
#endif
#endif

/* ------------------------------------------------------------ children */

#define CHILD_CHECK(cond)                                                                  \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "child: %s:%d: %s failed\n", __FILE__, __LINE__, #cond);       \
            return 3;                                                                      \
        }                                                                                  \
    } while (0)

static int child_refuse(void)
{
    /* Several calls, so that the parent can see the message is printed
     * once per process, not once per call. */
    for (int i = 0; i < 3; i++) {
        CHILD_CHECK(bfc_stream_alloc(NULL, 4096) == NULL);
        CHILD_CHECK(bfc_last_error() == BFC_EINVAL);
    }
    CHILD_CHECK(bfc_default_ctx() == NULL && bfc_last_error() == BFC_EINVAL);
    CHILD_CHECK(bfc_stream_release(NULL) == BFC_EINVAL);
    CHILD_CHECK(bfc_free((void *)(uintptr_t)4096) == BFC_EINVAL);
    CHILD_CHECK(bfc_host_alloc(64) == NULL && bfc_last_error() == BFC_EINVAL);
    return 0;
}

static int pairs(bfc_ctx_t *ctx, int n)
{
    for (int i = 0; i < n; i++) {
        size_t sz = 256 + (size_t)(i % 7) * 1000;
        void *p = ctx ? bfc_ctx_alloc(ctx, NULL, sz) : bfc_stream_alloc(NULL, sz);
        CHILD_CHECK(p != NULL);
        CHILD_CHECK((ctx ? bfc_ctx_free(ctx, p, NULL) : bfc_free(p)) == BFC_OK);
    }
    return 0;
}

static pthread_mutex_t idle_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle_cond = PTHREAD_COND_INITIALIZER;
static int worker_done;

static void *idle_worker(void *arg)
{
    int n = *(int *)arg;
    int rc = pairs(NULL, n);
    if (pthread_mutex_lock(&idle_lock) != 0)
        abort();
    worker_done = rc == 0 ? 1 : -1;
    if (pthread_cond_broadcast(&idle_cond) != 0)
        abort();
    /* Idle for good: a server's pool thread at exit. */
    for (;;)
        if (pthread_cond_wait(&idle_cond, &idle_lock) != 0)
            abort();
    return NULL;
}

/* backend=cuda: 77 where a device is usable, else 0 after checking that
 * every call fails with BFC_ENODEV. */
static int child_nodev(void)
{
    void *p = bfc_stream_alloc(NULL, 4096);
    if (p) {
        CHILD_CHECK(bfc_free(p) == BFC_OK);
        return 77;
    }
    CHILD_CHECK(bfc_last_error() == BFC_ENODEV);
    for (int i = 0; i < 3; i++) {
        CHILD_CHECK(bfc_stream_alloc(NULL, 4096) == NULL);
        CHILD_CHECK(bfc_last_error() == BFC_ENODEV);
    }
    CHILD_CHECK(bfc_default_ctx() == NULL && bfc_last_error() == BFC_ENODEV);
    return 0;
}

/* The service on SIM (or AUTO without a usable GPU): served from device 0,
 * SIM's one device, whatever `device` says, and its context says so (with
 * AUTO on a machine with a GPU, the NULL stream's device: 0 as well). */
static int child_simdev(void)
{
    for (int i = 0; i < 3; i++) {
        void *p = bfc_stream_alloc(NULL, 4096);
        CHILD_CHECK(p != NULL);
        CHILD_CHECK(bfc_free(p) == BFC_OK);
    }
    bfc_ctx_t *ctx = bfc_default_ctx();
    CHILD_CHECK(ctx != NULL);
    bfc_config_t c;
    CHILD_CHECK(bfc_ctx_config(ctx, &c) == BFC_OK);
    CHILD_CHECK(c.device == 0);
    return 0;
}

static void *noop_thread(void *arg)
{
    return arg;
}

/* Sets the default thread stack size (what liburcu's threads get); 0 when
 * done. */
static int set_default_stack(size_t size)
{
    pthread_attr_t a;
    if (pthread_getattr_default_np(&a) != 0)
        return -1;
    int rc = pthread_attr_setstacksize(&a, size) != 0 || pthread_setattr_default_np(&a) != 0;
    pthread_attr_destroy(&a);
    return rc ? -1 : 0;
}

/*
 * No thread can be made (a process at RLIMIT_NPROC or a container's
 * pids.max; here: a default stack as large as the address space, which
 * the creation of liburcu's threads uses too): the first context and the
 * service fail with BFC_ENOMEM instead of liburcu aborting the process,
 * and once threads can be made again, they work.  77 where such a stack
 * does not stop pthread_create.  `again`: a context was made and destroyed
 * first, so liburcu's call_rcu thread runs, but its hash tables' resize
 * worker stopped with the last table (the new context's directory starts
 * it again: liburcu aborted there).
 */
static int child_nothreads(int n, bool again)
{
    if (again) {
        bfc_config_t c0;
        bfc_config_init(&c0);
        c0.backend = BFC_BACKEND_SIM;
        bfc_ctx_t *ctx0 = NULL;
        CHILD_CHECK(bfc_ctx_create(&c0, &ctx0) == BFC_OK);
        CHILD_CHECK(pairs(ctx0, n) == 0);
        bfc_ctx_destroy(ctx0);
    }
    pthread_attr_t a;
    size_t normal;
    CHILD_CHECK(pthread_getattr_default_np(&a) == 0);
    CHILD_CHECK(pthread_attr_getstacksize(&a, &normal) == 0);
    pthread_attr_destroy(&a);
    CHILD_CHECK(set_default_stack((size_t)1 << 47) == 0);
    pthread_t t;
    if (pthread_create(&t, NULL, noop_thread, NULL) == 0) {
        CHILD_CHECK(pthread_join(t, NULL) == 0);
        return 77;
    }
    bfc_config_t c;
    bfc_config_init(&c);
    c.backend = BFC_BACKEND_SIM;
    bfc_ctx_t *ctx = NULL;
    for (int i = 0; i < 2; i++) {
        CHILD_CHECK(bfc_ctx_create(&c, &ctx) == BFC_ENOMEM && ctx == NULL);
        CHILD_CHECK(bfc_stream_alloc(NULL, 4096) == NULL && bfc_last_error() == BFC_ENOMEM);
    }
    CHILD_CHECK(set_default_stack(normal) == 0);
    CHILD_CHECK(bfc_ctx_create(&c, &ctx) == BFC_OK);
    CHILD_CHECK(pairs(ctx, n) == 0);
    bfc_ctx_destroy(ctx);
    return pairs(NULL, n); /* the service too */
}

static int child_main(const char *mode, int n)
{
    if (strcmp(mode, "nothreads") == 0 || strcmp(mode, "nothreads_again") == 0)
        return child_nothreads(n, strcmp(mode, "nothreads_again") == 0);
    if (strcmp(mode, "refuse") == 0)
        return child_refuse();
    if (strcmp(mode, "nodev") == 0)
        return child_nodev();
    if (strcmp(mode, "simdev") == 0)
        return child_simdev();
    if (strcmp(mode, "main") == 0)
        return pairs(NULL, n); /* return from main, no bfc_shutdown */
    if (strcmp(mode, "host") == 0) {
        /* Host blocks served, on a node that exists. */
        for (int i = 0; i < 3; i++) {
            void *p = bfc_host_alloc(4096);
            CHILD_CHECK(p != NULL);
            CHILD_CHECK(bfc_host_numa_node(p) >= 0);
            CHILD_CHECK(bfc_host_free(p) == BFC_OK);
        }
        return 0;
    }
    if (strcmp(mode, "threads") == 0) {
        pthread_t t;
        CHILD_CHECK(pthread_create(&t, NULL, idle_worker, &n) == 0);
        int rc = pairs(NULL, n);
        CHILD_CHECK(pthread_mutex_lock(&idle_lock) == 0);
        while (worker_done == 0)
            CHILD_CHECK(pthread_cond_wait(&idle_cond, &idle_lock) == 0);
        CHILD_CHECK(pthread_mutex_unlock(&idle_lock) == 0);
        CHILD_CHECK(worker_done == 1);
        exit(rc); /* the worker is still alive, its buffer unflushed */
    }
    if (strcmp(mode, "ctx") == 0) {
        bfc_config_t c;
        bfc_config_init(&c);
        c.backend = BFC_BACKEND_SIM;
        bfc_ctx_t *ctx;
        CHILD_CHECK(bfc_ctx_create(&c, &ctx) == BFC_OK);
        CHILD_CHECK(bfc_ctx_trace_start(ctx, getenv("OPS_TRACE")) == BFC_OK);
        exit(pairs(ctx, n)); /* trace running, context alive */
    }
    if (strcmp(mode, "fork") == 0) {
        CHILD_CHECK(pairs(NULL, n) == 0);
        fflush(NULL);
        pid_t pid = fork();
        CHILD_CHECK(pid >= 0);
        if (pid == 0)
            exit(pairs(NULL, n)); /* the parent's trace is not the child's */
        int status;
        CHILD_CHECK(waitpid(pid, &status, 0) == pid);
        CHILD_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        return 0;
    }
    fprintf(stderr, "child: unknown mode %s\n", mode);
    return 2;
}

/* -------------------------------------------------------------- parent */

struct run {
    int status;      /* exit status, or -1 when it did not exit normally */
    char out[16384]; /* stdout and stderr together */
};

/* Runs this program as "--child MODE N" with SHARDBFC_CONF=conf (and
 * OPS_TRACE=trace when trace is not NULL). */
static void run_child(const char *mode, int n, const char *conf, const char *trace, struct run *r)
{
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    ck_assert_int_gt(len, 0);
    self[len] = '\0';

    size_t nenv = 0;
    while (environ[nenv])
        nenv++;
    char **envp = calloc(nenv + 3, sizeof(*envp));
    ck_assert_ptr_nonnull(envp);
    size_t k = 0;
    for (size_t i = 0; i < nenv; i++)
        if (strncmp(environ[i], "SHARDBFC_CONF=", 14) != 0 && strncmp(environ[i], "OPS_TRACE=", 10) != 0)
            envp[k++] = environ[i];
    char confvar[1024], tracevar[1024];
    snprintf(confvar, sizeof confvar, "SHARDBFC_CONF=%s", conf);
    envp[k++] = confvar;
    if (trace) {
        snprintf(tracevar, sizeof tracevar, "OPS_TRACE=%s", trace);
        envp[k++] = tracevar;
    }
    envp[k] = NULL;

    char outpath[] = "/tmp/test_ops_out_XXXXXX";
    int fd = mkstemp(outpath);
    ck_assert_int_ge(fd, 0);
    posix_spawn_file_actions_t fa;
    ck_assert_int_eq(posix_spawn_file_actions_init(&fa), 0);
    ck_assert_int_eq(posix_spawn_file_actions_adddup2(&fa, fd, 1), 0);
    ck_assert_int_eq(posix_spawn_file_actions_adddup2(&fa, fd, 2), 0);
    char nbuf[32];
    snprintf(nbuf, sizeof nbuf, "%d", n);
    char *argv[] = {self, "--child", (char *)mode, nbuf, NULL};
    pid_t pid;
    ck_assert_int_eq(posix_spawn(&pid, self, &fa, NULL, argv, envp), 0);
    posix_spawn_file_actions_destroy(&fa);
    int st;
    while (waitpid(pid, &st, 0) < 0)
        ck_assert_int_eq(errno, EINTR);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    ssize_t got = pread(fd, r->out, sizeof r->out - 1, 0);
    r->out[got > 0 ? got : 0] = '\0';
    close(fd);
    unlink(outpath);
    free(envp);
}

static size_t count(const char *hay, const char *needle)
{
    size_t c = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        c++;
    return c;
}

/* --------------------------------------------------------- config refusal */

static void expect_refusal(const char *conf, const char *const *parts)
{
    struct run r;
    run_child("refuse", 0, conf, NULL, &r);
    ck_assert_msg(r.status == 0, "child status %d:\n%s", r.status, r.out);
    /* One line, naming key, value and reason, and what happens now. */
    ck_assert_msg(count(r.out, "libshardbfc: SHARDBFC_CONF is invalid: ") == 1, "%s", r.out);
    ck_assert_msg(strstr(r.out, "the allocator will not start (every call fails with BFC_EINVAL)"), "%s", r.out);
    for (; *parts; parts++)
        ck_assert_msg(strstr(r.out, *parts) != NULL, "stderr lacks \"%s\":\n%s", *parts, r.out);
}

START_TEST(conf_typo_refuses_to_start)
{
    expect_refusal("backend=sim,memory_limt=1G",
                   (const char *const[]){"memory_limt=1G", "unknown key 'memory_limt'", NULL});
}
END_TEST

START_TEST(conf_bad_value_refuses_to_start)
{
    expect_refusal("backend=sim,memory_limit=1X",
                   (const char *const[]){"memory_limit=1X", "invalid value for memory_limit",
                                         "expected a size", NULL});
    expect_refusal("retry_ms=7200000",
                   (const char *const[]){"retry_ms=7200000", "3600000 (one hour)", NULL});
}
END_TEST

START_TEST(conf_valid_runs)
{
    /* The same child under a valid configuration fails its checks: the
     * refusal above is caused by the configuration, nothing else. */
    struct run r;
    run_child("refuse", 0, "backend=sim,memory_limit=1G", NULL, &r);
    ck_assert_int_eq(r.status, 3);
    ck_assert_ptr_null(strstr(r.out, "SHARDBFC_CONF is invalid"));
}
END_TEST

START_TEST(conf_cuda_without_device_says_so)
{
    /* Not a refusal (the call is retried, a device may appear), but the
     * operator who asked for CUDA reads why every call fails: once. */
    struct run r;
    run_child("nodev", 0, "backend=cuda", NULL, &r);
    if (r.status == 77)
        return; /* a machine with a usable device */
    ck_assert_msg(r.status == 0, "child status %d:\n%s", r.status, r.out);
    ck_assert_msg(count(r.out, "libshardbfc: SHARDBFC_CONF: no usable device 0 for backend=cuda") == 1, "%s",
                  r.out);
    ck_assert_msg(strstr(r.out, "fail with BFC_ENODEV"), "%s", r.out);
    ck_assert_ptr_null(strstr(r.out, "is invalid"));
}
END_TEST

START_TEST(conf_cuda_device_beyond_table_says_so)
{
    /* An ordinal past the service's table of devices: said once too (it
     * used to fail silently). */
    struct run r;
    run_child("nodev", 0, "backend=cuda,device=64", NULL, &r);
    if (r.status == 77)
        return;
    ck_assert_msg(r.status == 0, "child status %d:\n%s", r.status, r.out);
    ck_assert_msg(count(r.out, "libshardbfc: SHARDBFC_CONF: no usable device 64 for backend=cuda") == 1, "%s",
                  r.out);
}
END_TEST

START_TEST(conf_sim_serves_device_zero)
{
    /* SIM has one device: `device` does not keep the service from it
     * (device=64 made every call fail with BFC_ENODEV, silently). */
    static const char *const confs[] = { "backend=sim,device=64", "backend=sim,device=3", "device=100000" };
    for (size_t i = 0; i < sizeof confs / sizeof confs[0]; i++) {
        struct run r;
        run_child("simdev", 0, confs[i], NULL, &r);
        ck_assert_msg(r.status == 0, "%s: child status %d:\n%s", confs[i], r.status, r.out);
        ck_assert_msg(r.out[0] == '\0', "%s: %s", confs[i], r.out);
    }
}
END_TEST

START_TEST(conf_host_numa_missing_node_says_so)
{
    /* A node this machine lacks: served from the thread's node, and said
     * once (it used to be silent). */
    struct run r;
    run_child("host", 0, "backend=sim,host_numa=4095", NULL, &r);
    ck_assert_msg(r.status == 0, "child status %d:\n%s", r.status, r.out);
    ck_assert_msg(count(r.out, "libshardbfc: SHARDBFC_CONF: host_numa=4095: this machine has no NUMA node 4095") == 1,
                  "%s", r.out);
    /* A node it has: nothing said. */
    run_child("host", 0, "backend=sim,host_numa=thread", NULL, &r);
    ck_assert_msg(r.status == 0, "child status %d:\n%s", r.status, r.out);
    ck_assert_ptr_null(strstr(r.out, "libshardbfc:"));
}
END_TEST

/* ------------------------------------------------------- trace at exit */

struct rows {
    size_t total, allocs, frees, bad;
    bool header;
};

static void read_trace(const char *path, struct rows *rw)
{
    memset(rw, 0, sizeof *rw);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "no trace file %s", path);
    char line[512];
    bool first = true;
    while (fgets(line, sizeof line, f)) {
        if (first) {
            rw->header = strcmp(line, "Thread,Time,Action,Pointer,Size,Stream\n") == 0;
            first = false;
            continue;
        }
        rw->total++;
        if (count(line, ",") != 5 || line[strlen(line) - 1] != '\n')
            rw->bad++;
        else if (strstr(line, ",allocate,"))
            rw->allocs++;
        else if (strstr(line, ",free,"))
            rw->frees++;
    }
    fclose(f);
}

static void trace_case(const char *mode, int n, size_t want_pairs)
{
    char path[] = "/tmp/test_ops_trace_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    char conf[256];
    if (strcmp(mode, "ctx") == 0)
        snprintf(conf, sizeof conf, "backend=sim");
    else
        snprintf(conf, sizeof conf, "backend=sim,memory_limit=1G,trace=%s", path);
    struct run r;
    run_child(mode, n, conf, path, &r);
    ck_assert_msg(r.status == 0, "%s %d: child status %d:\n%s", mode, n, r.status, r.out);
    struct rows rw;
    read_trace(path, &rw);
    unlink(path);
    ck_assert_msg(rw.header, "%s %d: header missing", mode, n);
    ck_assert_msg(rw.bad == 0, "%s %d: %zu malformed rows", mode, n, rw.bad);
    ck_assert_msg(rw.allocs == want_pairs && rw.frees == want_pairs,
                  "%s %d: %zu allocate and %zu free rows of %zu each (%zu rows in all)", mode, n, rw.allocs,
                  rw.frees, want_pairs, rw.total);
}

START_TEST(trace_return_from_main_100)
{
    /* Fewer events than one buffer: before the exit flush the file had
     * the header alone. */
    trace_case("main", 100, 100);
}
END_TEST

START_TEST(trace_return_from_main_1000)
{
    /* Several buffers' worth: the tail used to be lost (1,536 of 2,001 rows). */
    trace_case("main", 1000, 1000);
}
END_TEST

START_TEST(trace_exit_with_idle_thread)
{
    trace_case("threads", 1000, 2000);
}
END_TEST

START_TEST(no_thread_for_liburcu_is_enomem)
{
    static const char *const modes[] = { "nothreads", "nothreads_again" };
    for (int k = 0; k < 2; k++) {
        struct run r;
        run_child(modes[k], 100, "backend=sim", NULL, &r);
        if (r.status == 77) {
            fprintf(stderr, "test_ops: SKIP no_thread_for_liburcu_is_enomem: a thread with an "
                            "address-space-sized stack was made\n");
            return;
        }
        ck_assert_msg(r.status == 0, "%s: child status %d (-1: killed, e.g. liburcu's abort):\n%s", modes[k],
                      r.status, r.out);
    }
}
END_TEST

START_TEST(trace_exit_explicit_context)
{
    trace_case("ctx", 300, 300);
}
END_TEST

START_TEST(trace_fork_child_writes_nothing)
{
    /* 300 pairs before fork, the child's 300 after it are not the trace's,
     * and the parent's are not written twice. */
#ifdef OPS_TSAN
    fprintf(stderr, "test_ops: ThreadSanitizer build, the fork case is not run\n");
#else
    trace_case("fork", 300, 300);
#endif
}
END_TEST

static Suite *ops_suite(void)
{
    Suite *s = suite_create("ops");
    TCase *tc = tcase_create("config");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, conf_typo_refuses_to_start);
    tcase_add_test(tc, conf_bad_value_refuses_to_start);
    tcase_add_test(tc, conf_valid_runs);
    tcase_add_test(tc, conf_cuda_without_device_says_so);
    tcase_add_test(tc, conf_cuda_device_beyond_table_says_so);
    tcase_add_test(tc, conf_sim_serves_device_zero);
    tcase_add_test(tc, conf_host_numa_missing_node_says_so);
    tcase_add_test(tc, no_thread_for_liburcu_is_enomem);
    suite_add_tcase(s, tc);
    TCase *tt = tcase_create("trace");
    tcase_set_timeout(tt, 60);
    tcase_add_test(tt, trace_return_from_main_100);
    tcase_add_test(tt, trace_return_from_main_1000);
    tcase_add_test(tt, trace_exit_with_idle_thread);
    tcase_add_test(tt, trace_exit_explicit_context);
    tcase_add_test(tt, trace_fork_child_writes_nothing);
    suite_add_tcase(s, tt);
    return s;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child") == 0)
        return child_main(argv[2], atoi(argv[3]));
    SRunner *sr = srunner_create(ops_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
