/*
 * perfutil.h -- what the benchmark programs in perf/ share: clocks, the
 * fixed-seed generator and its log-uniform sizes, the machine description,
 * the progress line on stderr, a JSON string writer, a thread-count list
 * parser and a single-producer/single-consumer ring.
 *
 * perf/shardbfc-perf (the side-by-side harness) and tests/test_perf link
 * perf/perfutil.c, so a sequence drawn from a seed is the same in the
 * harness and in the tests that check its generators.
 *
 * Nothing here is thread-safe unless it says so: the generator state is the
 * caller's, the ring has exactly one producer and one consumer thread, the
 * progress line is written by the main thread only.
 */
#ifndef SHARDBFC_PERFUTIL_H
#define SHARDBFC_PERFUTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* ---------------------------------------------------------------- clocks */

/* CLOCK_MONOTONIC in ns (vDSO: ~20 ns a call with a TSC clocksource). */
static inline uint64_t perf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* CPU time of the calling thread, ns: against the wall clock it tells how
 * much of a timed window the thread really ran. */
double perf_thread_cpu_ns(void);

/* Voluntary context switches of the calling thread (it slept in a lock). */
uint64_t perf_thread_vcsw(void);

/* ------------------------------------------------------------- generator */

/* splitmix64: small, fast, good enough for workload generation. */
static inline uint64_t perf_rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static inline double perf_rng_unit(uint64_t *s)
{
    return (double)(perf_rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform integer in [lo, hi] (hi >= lo). */
static inline uint64_t perf_rng_range(uint64_t *s, uint64_t lo, uint64_t hi)
{
    return lo + perf_rng_next(s) % (hi - lo + 1);
}

/* Log-uniform in [lo, hi], 1 <= lo <= hi: log2 of the result is uniform, so
 * the median is sqrt(lo * hi).  One draw of the generator per call. */
uint64_t perf_rng_logu(uint64_t *s, uint64_t lo, uint64_t hi);

/* --------------------------------------------------------------- machine */

struct perf_machine {
    long cores;            /* online CPUs */
    char cpu[128];         /* /proc/cpuinfo "model name", or "unknown" */
    char loadavg[64];      /* /proc/loadavg at perf_machine_read */
};

void perf_machine_read(struct perf_machine *m);
/* /proc/loadavg now, newline stripped ("unknown" when unreadable). */
void perf_read_loadavg(char *buf, size_t len);

/* ---------------------------------------------------------------- output */

/* Progress line on stderr: rewritten in place on a terminal, one line each
 * otherwise.  `prog` prefixes it ("[prog] ..."). */
void perf_progress_init(const char *prog);
void perf_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void perf_progress_done(void);

/* A JSON string literal, escaped. */
void perf_json_str(FILE *f, const char *s);

/* malloc that exits the program with a message when memory runs out. */
void *perf_xmalloc(size_t n);
void *perf_xcalloc(size_t n, size_t size);

/* Exits with "prog: what: strerror(rc)" when rc != 0 (pthread calls). */
void perf_check(int rc, const char *what);
/* pthread_barrier_wait, exiting on an error (the serial thread is no error). */
void perf_barrier_wait(pthread_barrier_t *barrier);
/* Sleeps `seconds`, resuming after signals. */
void perf_sleep(double seconds);

/* "1,2,4,8" -> out[], each 1..max; false on a malformed list or > cap. */
bool perf_parse_uint_list(const char *s, unsigned *out, unsigned cap,
                          unsigned *n, unsigned max);

/* ------------------------------------------------------------------ ring */

/*
 * Single-producer/single-consumer ring of pointers.  tail is written only by
 * the producer, head only by the consumer, each on its own cache line; the
 * release store of one side pairs with the acquire load of the other, so a
 * slot's content is visible before the index that publishes it.
 */
#define PERF_RING_CAP 4096u /* power of two */

struct perf_ring {
    _Alignas(64) atomic_uint_fast64_t tail; /* next slot the producer fills */
    _Alignas(64) atomic_uint_fast64_t head; /* next slot the consumer takes */
    _Alignas(64) void *slot[PERF_RING_CAP];
};

/* Spin briefly, then yield: the other side may be off its CPU. */
void perf_spin_pause(unsigned *spins);

/* Producer: waits while the ring is full, then publishes p. */
void perf_ring_push(struct perf_ring *rg, void *p, unsigned *spins);

/* Consumer: the next pointer, or false if the ring is empty right now. */
static inline bool perf_ring_try_pop(struct perf_ring *rg, void **out)
{
    uint_fast64_t head = atomic_load_explicit(&rg->head, memory_order_relaxed);
    if (head == atomic_load_explicit(&rg->tail, memory_order_acquire))
        return false;
    *out = rg->slot[head & (PERF_RING_CAP - 1)];
    atomic_store_explicit(&rg->head, head + 1, memory_order_release);
    return true;
}

#endif /* SHARDBFC_PERFUTIL_H */
