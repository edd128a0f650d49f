/*
 * vmm_calls.c -- what the backend's virtual-memory calls cost, alone and
 * from many threads at once.
 *
 * Expandable arenas map and unmap granules through the backend (va_map,
 * va_unmap; on CUDA, cuMemCreate + cuMemMap + cuMemRelease per granule and
 * a cuMemSetAccess per range, and cuMemUnmap per granule).  On the GPU
 * machine, sixteen threads of one context made fewer than 17,000 such
 * calls a second between them, about what one thread could: the calls
 * wait for each other.  This program tells where.  Each thread reserves a
 * range of its own and then, --pairs times, maps --granules granules at a
 * rotating offset and unmaps them, timed; at each thread count it runs
 * twice:
 *
 *   shared      one backend for all threads, as the shards of one context
 *               share theirs (and the lock of its book of mappings, held
 *               across a call's driver calls);
 *   per-thread  a backend per thread, as contexts of their own have.
 *
 * If per-thread scales and shared does not, the backend's lock is what
 * serialises; if neither does, the driver (or the kernel, on SIM, whose
 * calls are mprotect and madvise).
 *
 *   perf/vmm_calls [--backend sim|cuda] [--threads 1,2,4,8,16]
 *                  [--pairs N] [--granules K]
 *
 * Prints one row per layout and thread count: map+unmap pairs per second
 * over all threads, microseconds per call as each thread sees it (the
 * window divided by its calls), and the speed-up over one thread.  Exit 77
 * when the backend cannot open or has no virtual memory (CUDA without a
 * driver or a device), 2 on a bad command line, 1 when a call fails.
 */
#include "config.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <shardbfc.h>

#include "backend.h"

#define PROG "vmm_calls"
#define MAX_THREADS 64
#define RANGE_GRANULES 64

struct worker {
    bfc__backend_t *be;
    pthread_barrier_t *start;
    unsigned pairs, granules;
    double seconds;
    int status;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    size_t g = w->be->vmm_granule, run = (size_t)w->granules * g;
    uintptr_t base = 0;
    int st = w->be->ops->va_reserve(w->be, RANGE_GRANULES * g, &base);
    int e = pthread_barrier_wait(w->start);
    if (e != 0 && e != PTHREAD_BARRIER_SERIAL_THREAD)
        st = st == BFC_OK ? BFC_EBACKEND : st;
    double t0 = now_s();
    for (unsigned i = 0; st == BFC_OK && i < w->pairs; i++) {
        uintptr_t at = base + (size_t)(i % (RANGE_GRANULES / w->granules)) * run;
        st = w->be->ops->va_map(w->be, at, run);
        if (st == BFC_OK)
            st = w->be->ops->va_unmap(w->be, at, run, NULL);
    }
    w->seconds = now_s() - t0;
    if (base && w->be->ops->va_release(w->be, base, RANGE_GRANULES * g) != BFC_OK && st == BFC_OK)
        st = BFC_EBACKEND;
    w->status = st;
    return NULL;
}

/* One measurement: n threads, over one backend or one each.  Returns the
 * pairs per second of all threads (0 on failure) and, in *us_call, the
 * mean microseconds per call as a thread sees it. */
static double measure(const bfc_config_t *cfg, unsigned n, bool shared, unsigned pairs,
                      unsigned granules, double *us_call)
{
    bfc__backend_t *be[MAX_THREADS] = {0};
    struct worker w[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    pthread_barrier_t start;
    unsigned opened = 0, started = 0;
    double rate = 0, slowest = 0, sum_us = 0;
    bool ok = true;

    if (pthread_barrier_init(&start, NULL, n) != 0)
        return 0;
    for (unsigned i = 0; i < (shared ? 1 : n); i++, opened++) {
        int st = bfc__backend_open(cfg, &be[i]);
        if (st != BFC_OK) {
            fprintf(stderr, PROG ": opening backend %u of %u: %s\n", i + 1, shared ? 1 : n,
                    bfc_err_name(st));
            exit(1);
        }
    }
    for (unsigned i = 0; i < n && ok; i++, started++) {
        w[i] = (struct worker){be[shared ? 0 : i], &start, pairs, granules, 0, BFC_OK};
        ok = pthread_create(&th[i], NULL, worker_main, &w[i]) == 0;
    }
    if (!ok) {
        /* The barrier waits for n threads: it cannot be left half-filled. */
        fprintf(stderr, PROG ": could not start %u threads\n", n);
        exit(1);
    }
    for (unsigned i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (w[i].status != BFC_OK) {
            fprintf(stderr, PROG ": thread %u: %s\n", i, bfc_err_name(w[i].status));
            ok = false;
        }
        if (w[i].seconds > slowest)
            slowest = w[i].seconds;
        sum_us += w[i].seconds * 1e6 / (2.0 * pairs);
    }
    for (unsigned i = 0; i < opened; i++)
        if (be[i])
            be[i]->ops->close(be[i]);
    pthread_barrier_destroy(&start);
    if (ok && slowest > 0)
        rate = (double)n * pairs / slowest;
    *us_call = started ? sum_us / started : 0;
    return rate;
}

static int parse_threads(const char *s, unsigned *t, unsigned *nt)
{
    char buf[128], *save = NULL, *tok;
    if (strlen(s) >= sizeof(buf))
        return -1;
    snprintf(buf, sizeof(buf), "%s", s);
    *nt = 0;
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long v = strtol(tok, &end, 10);
        if (*end || v < 1 || v > MAX_THREADS || *nt == MAX_THREADS)
            return -1;
        t[(*nt)++] = (unsigned)v;
    }
    return *nt ? 0 : -1;
}

static int usage(void)
{
    fprintf(stderr, "usage: " PROG " [--backend sim|cuda] [--threads 1,2,4,8,16] [--pairs N]"
                    " [--granules K]\n");
    return 2;
}

int main(int argc, char **argv)
{
    bfc_config_t cfg;
    unsigned threads[MAX_THREADS] = {1, 2, 4, 8, 16}, nt = 5, pairs = 500, granules = 1;
    bfc__backend_t *probe = NULL;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    for (int i = 1; i < argc; i += 2) { /* OPTION VALUE pairs */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!v)
            return usage();
        if (strcmp(a, "--backend") == 0) {
            if (strcmp(v, "sim") == 0)
                cfg.backend = BFC_BACKEND_SIM;
            else if (strcmp(v, "cuda") == 0)
                cfg.backend = BFC_BACKEND_CUDA;
            else
                return usage();
        } else if (strcmp(a, "--threads") == 0) {
            if (parse_threads(v, threads, &nt) != 0)
                return usage();
        } else if (strcmp(a, "--pairs") == 0) {
            unsigned long n = strtoul(v, &end, 10);
            if (*end || n < 1 || n > 10000000)
                return usage();
            pairs = (unsigned)n;
        } else if (strcmp(a, "--granules") == 0) {
            unsigned long n = strtoul(v, &end, 10);
            if (*end || n < 1 || n > RANGE_GRANULES / 2)
                return usage();
            granules = (unsigned)n;
        } else {
            return usage();
        }
    }
    int st = bfc__backend_open(&cfg, &probe);
    if (st != BFC_OK) {
        printf(PROG ": the %s backend does not open (%s): nothing to measure\n",
               cfg.backend == BFC_BACKEND_CUDA ? "CUDA" : "SIM", bfc_err_name(st));
        return 77;
    }
    size_t g = probe->vmm_granule;
    probe->ops->close(probe);
    if (g == 0) {
        printf(PROG ": the backend has no virtual memory: nothing to measure\n");
        return 77;
    }
    printf(PROG ": %s backend, granule %zu KiB, %u map+unmap pairs of %u granule%s per "
           "thread\n", cfg.backend == BFC_BACKEND_CUDA ? "CUDA" : "SIM", g >> 10, pairs,
           granules, granules == 1 ? "" : "s");
    printf("  %-10s %7s %14s %12s %9s\n", "layout", "threads", "pairs/s (all)", "us per call",
           "speed-up");
    for (int shared = 1; shared >= 0; shared--) {
        double one = 0;
        for (unsigned k = 0; k < nt; k++) {
            double us = 0, rate = measure(&cfg, threads[k], shared, pairs, granules, &us);
            if (rate <= 0)
                return 1;
            if (threads[k] == 1)
                one = rate;
            printf("  %-10s %7u %14.0f %12.1f", shared ? "shared" : "per-thread", threads[k], rate,
                   us);
            if (one > 0)
                printf(" %8.2fx\n", rate / one);
            else
                printf(" %9s\n", "-");
        }
    }
    return 0;
}
