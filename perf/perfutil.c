/*
 * perfutil.c -- the helpers of the programs in perf/ (see perfutil.h):
 * generator sizes, machine description, progress line,
 * JSON strings, checked pthread calls and the SPSC ring's producer side.
 *
 * The progress prefix and terminal flag are process globals set once by
 * perf_progress_init from the main thread before any worker starts; only the
 * main thread prints progress.
 */
#define _GNU_SOURCE
#include "perfutil.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static const char *g_prog = "perf";
static bool g_tty;

double perf_thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

uint64_t perf_thread_vcsw(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) != 0)
        return 0;
    return (uint64_t)ru.ru_nvcsw;
}

/* 2^f for f in [0, 1) by its Taylor series: exact enough, and the same
 * doubles on every libm, so a seed gives the same sizes everywhere. */
static double pow2_frac(double f)
{
    double x = f * 0.69314718055994530942, term = 1.0, sum = 1.0;
    for (int k = 1; k < 20; k++) {
        term *= x / k;
        sum += term;
    }
    return sum;
}

/* log2(v) for v >= 1: integer part by shifting, fraction by bisection on
 * pow2_frac (only called when the bounds are not powers of two). */
static double log2_u64(uint64_t v)
{
    int e = 63 - __builtin_clzll(v);
    double m = (double)v / (double)(1ull << e), lo = 0.0, hi = 1.0;
    for (int i = 0; i < 52; i++) {
        double mid = 0.5 * (lo + hi);
        if (pow2_frac(mid) <= m)
            lo = mid;
        else
            hi = mid;
    }
    return e + lo;
}

uint64_t perf_rng_logu(uint64_t *s, uint64_t lo, uint64_t hi)
{
    double span, e, v;
    unsigned ip;
    uint64_t n;
    if (lo == 0)
        lo = 1;
    if (hi <= lo) {
        (void)perf_rng_next(s);
        return lo;
    }
    /* Powers of two (the common case) take the exact integer path. */
    if ((lo & (lo - 1)) == 0 && (hi & (hi - 1)) == 0)
        span = (double)(__builtin_ctzll(hi) - __builtin_ctzll(lo));
    else
        span = log2_u64(hi) - log2_u64(lo);
    e = perf_rng_unit(s) * span;
    ip = (unsigned)e;
    v = (double)lo * (double)(1ull << ip) * pow2_frac(e - ip);
    n = (uint64_t)v;
    if (n < lo)
        n = lo;
    if (n > hi)
        n = hi;
    return n;
}

void perf_read_loadavg(char *buf, size_t len)
{
    FILE *f = fopen("/proc/loadavg", "r");
    snprintf(buf, len, "unknown");
    if (f == NULL)
        return;
    if (fgets(buf, (int)len, f) != NULL)
        buf[strcspn(buf, "\n")] = '\0';
    else
        snprintf(buf, len, "unknown");
    fclose(f);
}

void perf_machine_read(struct perf_machine *m)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    m->cores = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(m->cpu, sizeof(m->cpu), "unknown");
    if (f != NULL) {
        while (fgets(line, sizeof(line), f) != NULL) {
            if (strncmp(line, "model name", 10) == 0) {
                char *c = strchr(line, ':');
                if (c != NULL) {
                    c++;
                    while (*c == ' ' || *c == '\t')
                        c++;
                    c[strcspn(c, "\n")] = '\0';
                    snprintf(m->cpu, sizeof(m->cpu), "%s", c);
                }
                break;
            }
        }
        fclose(f);
    }
    perf_read_loadavg(m->loadavg, sizeof(m->loadavg));
}

void perf_progress_init(const char *prog)
{
    g_prog = prog;
    g_tty = isatty(STDERR_FILENO) == 1;
}

void perf_progress(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (g_tty)
        fputs("\r\033[K", stderr);
    fprintf(stderr, "[%s] ", g_prog);
    vfprintf(stderr, fmt, ap);
    if (!g_tty)
        fputc('\n', stderr);
    fflush(stderr);
    va_end(ap);
}

void perf_progress_done(void)
{
    if (g_tty) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
}

void perf_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", (unsigned)(unsigned char)*s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

void *perf_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "%s: out of host memory (%zu bytes)\n", g_prog, n);
        exit(1);
    }
    return p;
}

void *perf_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (p == NULL) {
        fprintf(stderr, "%s: out of host memory (%zu x %zu bytes)\n", g_prog, n, size);
        exit(1);
    }
    return p;
}

void perf_check(int rc, const char *what)
{
    if (rc != 0) {
        fprintf(stderr, "%s: %s: %s\n", g_prog, what, strerror(rc));
        exit(1);
    }
}

void perf_barrier_wait(pthread_barrier_t *barrier)
{
    int rc = pthread_barrier_wait(barrier);
    if (rc != PTHREAD_BARRIER_SERIAL_THREAD)
        perf_check(rc, "pthread_barrier_wait");
}

void perf_sleep(double seconds)
{
    struct timespec ts;
    if (seconds <= 0)
        return;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

bool perf_parse_uint_list(const char *s, unsigned *out, unsigned cap, unsigned *n,
                          unsigned max)
{
    char buf[256], *save = NULL, *tok;
    if (strlen(s) >= sizeof(buf))
        return false;
    /* strtok_r would pass over an empty item ("1,,2", ",1", "1,"). */
    if (s[0] == ',' || strstr(s, ",,") || (s[0] && s[strlen(s) - 1] == ','))
        return false;
    snprintf(buf, sizeof(buf), "%s", s);
    *n = 0;
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long v;
        errno = 0;
        v = strtol(tok, &end, 10);
        if (errno != 0 || end == tok || *end != '\0' || v < 1 || (unsigned long)v > max ||
            *n == cap)
            return false;
        out[(*n)++] = (unsigned)v;
    }
    return *n > 0;
}

void perf_spin_pause(unsigned *spins)
{
    if (++*spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        *spins = 0;
        sched_yield();
    }
}

void perf_ring_push(struct perf_ring *rg, void *p, unsigned *spins)
{
    uint_fast64_t tail = atomic_load_explicit(&rg->tail, memory_order_relaxed);
    /* acquire pairs with the consumer's release store of head: the slot is
     * empty once head has passed it. */
    while (tail - atomic_load_explicit(&rg->head, memory_order_acquire) >= PERF_RING_CAP)
        perf_spin_pause(spins);
    rg->slot[tail & (PERF_RING_CAP - 1)] = p;
    /* release pairs with the consumer's acquire load of tail. */
    atomic_store_explicit(&rg->tail, tail + 1, memory_order_release);
}
