/*
 * workloads.c -- the measuring threads of shardbfc-perf.
 *
 * One measurement: the main thread starts the threads, which build their
 * initial population (the prologue, untimed) and meet at a barrier; then
 * they run their loop while the main thread sleeps the warm-up, raises
 * `timing` (each thread, at its next look, zeroes its counters and notes its
 * start), sleeps the window and raises `stop`.  Threads look at the flags
 * every BATCH calls, so the window each thread measures is its own, from the
 * first look after `timing` to the first look after `stop`; throughput is
 * all calls divided by the longest of those windows.
 *
 * Latency: in perf_run_prog every call is timed by chaining timestamps (one
 * clock read per call: the call's latency is the time since the previous
 * read), so a latency includes ~20 ns of clock read and loop overhead, the
 * same for every allocator; in the cross pipeline each call is bracketed by
 * two reads, so waits on the ring are not counted, and so is every call of
 * cross on one thread (cfg->bracket), whose per-call rates are compared
 * with the pipeline's.  Each thread records
 * into its own histograms (hist.h, no lock); the main thread merges them
 * after joining.  With cfg->count_only (the arena workloads) no clock is
 * read inside a batch: the calls are only counted, so ops/s is the
 * allocator's cost alone (plus the loop and one indirect call), and there
 * are no latencies.
 *
 * A program run meets the main thread twice more: when every prologue is
 * done (before the warm-up) and when every loop has stopped (before the
 * clean-up frees); the main thread reads the allocator's own counters
 * there (ops->snapshot) with nothing running, so the free fragments at the
 * window's ends are exact.
 *
 * Each thread also counts every successful call of the run, prologue and
 * clean-up included (main.c checks libshardbfc's counters against them),
 * and its voluntary context switches in the window: a thread that sleeps in
 * a lock shows them, a thread that only lost its CPU to other load does
 * not (perf_disturbed tells the two apart).
 *
 * perf_run_base times the machine itself on the same thread count with the
 * same window rules: a register-only ALU loop, or a loop over 1 MiB per
 * thread (perf.h).
 *
 * Peak requested bytes: each thread publishes its running total of
 * requested-and-live bytes in its own cache line (relaxed store, written
 * only by that thread); with one thread that total is the exact peak, with
 * N every (16 x P)th allocation of each of the P threads that allocate
 * (P = N, or the N/2 producers of cross, whose consumers only lower their
 * own lines) sums all N lines and raises a shared maximum (CAS).  So an
 * allocation reads N / (16 x P) lines written by other cores on average
 * (1/16 of one; 1/8 in cross) and a thread's line is read once per 16 of
 * its allocations, whatever the thread count; the process samples once
 * per 16 x P allocations (at 16 threads every 256th, still over 100,000
 * samples in a 0.5 s window).  Before, every 16th allocation of each
 * thread read all N lines: 16 at 16 threads, and that cost 15% of the churn
 * workload's CPU time on 16 cores (perf record, 1% at one thread), which
 * the allocator's scaling figure then carried.  Sampling can miss a short
 * peak (the figure errs low, overhead = reserved / requested high), and a
 * sum of lines read one after another while their threads run can count a
 * block freed on one with a block allocated on another meanwhile (high, by
 * a few blocks): with N threads the figure is sampled, neither exact nor a
 * bound, and the report marks it so (req_sampled).  A counted run publishes once per batch instead:
 * its thread keeps its own peak in a register (exact with one thread) and
 * raises the shared maximum to the sum of the lines.
 *
 * The flags are relaxed atomics: they only bound the loops, nothing is
 * published through them; results are read after pthread_join.
 */
#define _GNU_SOURCE
#include "perf.h"
#include "perfutil.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BATCH 256u
#define TRACK_EVERY 16u

struct track_line {
    _Alignas(64) _Atomic int64_t cur;
};

struct shared {
    atomic_bool timing;
    atomic_bool stop;
    atomic_uint acked;      /* threads that have seen `timing` */
    pthread_barrier_t ready;
    pthread_barrier_t closed; /* program runs: loops stopped / clean-up may start */
    bool two_phase;         /* program runs: `ready` is passed twice (see drive) */
    unsigned nthreads;
    uint64_t track_every; /* track_publish: 1 with one thread, else TRACK_EVERY x publishers */
    struct track_line line[2 * PERF_MAX_THREADS];
    _Alignas(64) _Atomic uint64_t peak;
};

static void track_publish(struct shared *sh, unsigned idx, int64_t cur, uint64_t *nalloc)
{
    atomic_store_explicit(&sh->line[idx].cur, cur, memory_order_relaxed);
    if (++*nalloc >= sh->track_every) {
        *nalloc = 0;
        int64_t sum = 0;
        uint64_t old;
        for (unsigned i = 0; i < sh->nthreads; i++)
            sum += atomic_load_explicit(&sh->line[i].cur, memory_order_relaxed);
        old = atomic_load_explicit(&sh->peak, memory_order_relaxed);
        while (sum > 0 && (uint64_t)sum > old &&
               !atomic_compare_exchange_weak_explicit(&sh->peak, &old, (uint64_t)sum,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed))
            ;
    }
}

/* The main thread's side of a measurement.  The window starts only once
 * every thread has seen `timing` (a thread can be inside a slow call, e.g.
 * a region being mapped, when the flag goes up), so each thread's own
 * window is at least cfg->seconds long.  With sh->two_phase the threads
 * wait at `ready` a second time, and `at_ready` runs in between, while
 * nothing else does. */
static void drive(struct shared *sh, const struct perf_run_cfg *cfg,
                  void (*at_ready)(void *), void *arg)
{
    perf_barrier_wait(&sh->ready);
    if (sh->two_phase) {
        if (at_ready != NULL)
            at_ready(arg);
        perf_barrier_wait(&sh->ready);
    }
    perf_sleep(cfg->warmup_seconds);
    atomic_store_explicit(&sh->timing, true, memory_order_relaxed);
    while (atomic_load_explicit(&sh->acked, memory_order_relaxed) < sh->nthreads)
        perf_sleep(0.0005);
    if (cfg->window_mark != NULL)
        cfg->window_mark(cfg->mark_arg, false);
    perf_sleep(cfg->seconds);
    if (cfg->window_mark != NULL)
        cfg->window_mark(cfg->mark_arg, true);
    atomic_store_explicit(&sh->stop, true, memory_order_relaxed);
}

/* A thread has started its window (or will never: it is leaving). */
static void ack_timing(struct shared *sh)
{
    atomic_fetch_add_explicit(&sh->acked, 1, memory_order_relaxed);
}

/* One thread's timed window: opened at its first look after `timing`,
 * closed at its first look after `stop` (or when it leaves). */
struct window {
    bool open, closed;
    uint64_t t0;
    double c0;
    uint64_t v0;
};

/* True when the window opens at this look (the caller resets its counters). */
static bool window_open(struct window *wd, struct shared *sh)
{
    if (wd->open || !atomic_load_explicit(&sh->timing, memory_order_relaxed))
        return false;
    wd->open = true;
    wd->v0 = perf_thread_vcsw();
    wd->c0 = perf_thread_cpu_ns();
    wd->t0 = perf_now_ns();
    ack_timing(sh);
    return true;
}

static void window_close(struct window *wd, struct shared *sh, double *window_ns,
                         double *cpu_ns, uint64_t *vcsw)
{
    if (wd->closed)
        return;
    wd->closed = true;
    if (wd->open) {
        *window_ns = (double)(perf_now_ns() - wd->t0);
        *cpu_ns = perf_thread_cpu_ns() - wd->c0;
        *vcsw = perf_thread_vcsw() - wd->v0;
    } else {
        ack_timing(sh); /* leaving before the window (a failure) */
    }
}

/* publishers: the threads that call track_publish (cross: the producers
 * alone; their consumers only lower their own lines). */
static void shared_init(struct shared *sh, unsigned nthreads, unsigned publishers,
                        unsigned parties, bool two_phase)
{
    memset(sh, 0, sizeof(*sh));
    sh->two_phase = two_phase;
    atomic_init(&sh->timing, false);
    atomic_init(&sh->stop, false);
    atomic_init(&sh->acked, 0);
    atomic_init(&sh->peak, 0);
    for (unsigned i = 0; i < 2 * PERF_MAX_THREADS; i++)
        atomic_init(&sh->line[i].cur, 0);
    sh->nthreads = nthreads;
    sh->track_every = nthreads == 1 ? 1 : (uint64_t)TRACK_EVERY * publishers;
    perf_check(pthread_barrier_init(&sh->ready, NULL, parties), "pthread_barrier_init");
    if (two_phase)
        perf_check(pthread_barrier_init(&sh->closed, NULL, parties), "pthread_barrier_init");
}

static void shared_fini(struct shared *sh)
{
    perf_check(pthread_barrier_destroy(&sh->ready), "pthread_barrier_destroy");
    if (sh->two_phase)
        perf_check(pthread_barrier_destroy(&sh->closed), "pthread_barrier_destroy");
}

/* ------------------------------------------------------------- programs */

struct worker {
    pthread_t tid;
    unsigned idx;
    bool pin;
    bool count_only, lock_pair, bracket;
    struct perf_allocator *a;
    const struct perf_prog *prog;
    struct shared *sh;
    /* out */
    struct perf_hist ha, hf;
    uint64_t ops;            /* calls in the window */
    uint64_t calls_alloc, calls_free; /* every successful call of the run */
    double window_ns, cpu_ns;
    uint64_t vcsw;
    uint64_t cycles;         /* full passes through the cycled events (warm-up included) */
    bool failed;
    char why[160];
};

/* One allocation / free of the program, outside the timed loop (prologue,
 * clean-up); false on failure (w->why says what). */
static bool do_alloc(struct worker *w, void **live, uint64_t *lsize, bfc_stream_t s,
                     const struct perf_ev *e, int64_t *cur)
{
    live[e->slot] = w->a->ops->alloc(w->a, w->idx, s, e->size);
    if (live[e->slot] == NULL) {
        snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed (prologue)",
                 e->size);
        return false;
    }
    lsize[e->slot] = e->size;
    *cur += (int64_t)e->size;
    w->calls_alloc++;
    return true;
}

static bool do_free(struct worker *w, void **live, uint64_t *lsize, bfc_stream_t s,
                    uint32_t slot, int64_t *cur, const char *what)
{
    int rc = w->a->ops->free(w->a, w->idx, live[slot], s, lsize[slot]);
    live[slot] = NULL;
    *cur -= (int64_t)lsize[slot];
    if (rc != 0) {
        snprintf(w->why, sizeof(w->why), "%s free failed (%d)", what, rc);
        return false;
    }
    w->calls_free++;
    return true;
}

/* BATCH events with a clock read after each call (latencies); false on a
 * failure.  *prev is the previous clock read (w->bracket: one more read
 * before each call, so a latency is the call's own time). */
static bool batch_timed(struct worker *w, void **live, uint64_t *lsize, bfc_stream_t *streams,
                        size_t *pos, int64_t *cur, uint64_t *nalloc, uint64_t *prev)
{
    struct perf_allocator *a = w->a;
    const struct perf_alloc_ops *ops = a->ops;
    const struct perf_prog *pg = w->prog;
    struct shared *sh = w->sh;

    for (unsigned b = 0; b < BATCH; b++) {
        const struct perf_ev *e = &pg->ev[*pos];
        uint64_t now;
        if (w->bracket)
            *prev = perf_now_ns();
        if (e->op == PERF_OP_ALLOC) {
            void *p = ops->alloc(a, w->idx, streams[e->stream], e->size);
            now = perf_now_ns();
            perf_hist_add(&w->ha, now - *prev);
            if (p == NULL) {
                snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed",
                         e->size);
                return false;
            }
            live[e->slot] = p;
            lsize[e->slot] = e->size;
            *cur += (int64_t)e->size;
            w->calls_alloc++;
            track_publish(sh, w->idx, *cur, nalloc);
        } else {
            int rc = ops->free(a, w->idx, live[e->slot], streams[e->stream], lsize[e->slot]);
            now = perf_now_ns();
            perf_hist_add(&w->hf, now - *prev);
            live[e->slot] = NULL;
            *cur -= (int64_t)lsize[e->slot];
            atomic_store_explicit(&sh->line[w->idx].cur, *cur, memory_order_relaxed);
            if (rc != 0) {
                snprintf(w->why, sizeof(w->why), "free failed (%d)", rc);
                return false;
            }
            w->calls_free++;
        }
        *prev = now;
        if (++*pos == pg->nev) {
            *pos = 0;
            w->cycles++;
        }
    }
    return true;
}

/* At least BATCH events with no clock read: the calls are counted (w->ops)
 * and the live bytes' peak kept in a register (*lpeak), published once per
 * batch.  A free followed by an allocation into the same slot goes through
 * ops->pair when w->lock_pair.  false on a failure. */
static bool batch_counted(struct worker *w, void **live, uint64_t *lsize,
                          bfc_stream_t *streams, size_t *pos, int64_t *cur, int64_t *lpeak)
{
    struct perf_allocator *a = w->a;
    const struct perf_alloc_ops *ops = a->ops;
    const struct perf_prog *pg = w->prog;
    const bool pairs = w->lock_pair && ops->pair != NULL;
    unsigned b = 0;

    while (b < BATCH) {
        const struct perf_ev *e = &pg->ev[*pos];
        const struct perf_ev *nx = *pos + 1 < pg->nev ? e + 1 : NULL;
        if (pairs && e->op == PERF_OP_FREE && nx != NULL && nx->op == PERF_OP_ALLOC &&
            nx->slot == e->slot && nx->stream == e->stream) {
            int rc = 0;
            void *p = ops->pair(a, w->idx, live[e->slot], lsize[e->slot],
                                streams[e->stream], nx->size, &rc);
            *cur -= (int64_t)lsize[e->slot];
            if (rc != 0) {
                live[e->slot] = NULL;
                snprintf(w->why, sizeof(w->why), "free failed (%d)", rc);
                return false;
            }
            w->calls_free++;
            live[e->slot] = p;
            if (p == NULL) {
                snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed",
                         nx->size);
                return false;
            }
            lsize[e->slot] = nx->size;
            *cur += (int64_t)nx->size;
            w->calls_alloc++;
            *pos += 2;
            b += 2;
        } else if (e->op == PERF_OP_ALLOC) {
            void *p = ops->alloc(a, w->idx, streams[e->stream], e->size);
            live[e->slot] = p;
            if (p == NULL) {
                snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed",
                         e->size);
                return false;
            }
            lsize[e->slot] = e->size;
            *cur += (int64_t)e->size;
            w->calls_alloc++;
            ++*pos;
            b++;
        } else {
            int rc = ops->free(a, w->idx, live[e->slot], streams[e->stream], lsize[e->slot]);
            live[e->slot] = NULL;
            *cur -= (int64_t)lsize[e->slot];
            if (rc != 0) {
                snprintf(w->why, sizeof(w->why), "free failed (%d)", rc);
                return false;
            }
            w->calls_free++;
            ++*pos;
            b++;
        }
        if (*cur > *lpeak)
            *lpeak = *cur;
        if (*pos >= pg->nev) {
            *pos = 0;
            w->cycles++;
        }
    }
    w->ops += b;
    return true;
}

/* Raises the shared peak once per counted batch: to the thread's exact
 * peak with one thread, else to the sum of every thread's current bytes. */
static void track_batch(struct shared *sh, unsigned idx, int64_t cur, int64_t lpeak)
{
    int64_t sum = 0;
    uint64_t old;
    /* relaxed, as in track_publish: the lines and the maximum are counters
     * read after pthread_join, nothing is published through them. */
    atomic_store_explicit(&sh->line[idx].cur, cur, memory_order_relaxed);
    if (sh->nthreads == 1) {
        sum = lpeak;
    } else {
        for (unsigned i = 0; i < sh->nthreads; i++)
            sum += atomic_load_explicit(&sh->line[i].cur, memory_order_relaxed);
    }
    old = atomic_load_explicit(&sh->peak, memory_order_relaxed);
    while (sum > 0 && (uint64_t)sum > old &&
           !atomic_compare_exchange_weak_explicit(&sh->peak, &old, (uint64_t)sum,
                                                  memory_order_relaxed, memory_order_relaxed))
        ;
}

static void *prog_main(void *arg)
{
    struct worker *w = arg;
    struct perf_allocator *a = w->a;
    const struct perf_prog *pg = w->prog;
    bfc_stream_t *streams = a->streams + (size_t)w->idx * pg->nstreams;
    void **live = perf_xcalloc(pg->nslots, sizeof(*live));
    uint64_t *lsize = perf_xcalloc(pg->nslots, sizeof(*lsize));
    struct shared *sh = w->sh;
    int64_t cur = 0, lpeak = 0;
    uint64_t nalloc = 0, prev;
    size_t pos = 0;
    struct window wd = {0};

    if (w->pin) {
        /* The host arenas are per NUMA node of the calling thread: pin it
         * so that its node cannot change under it. */
        cpu_set_t set;
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        CPU_ZERO(&set);
        CPU_SET((int)(w->idx % (unsigned)(cores > 0 ? cores : 1)), &set);
        perf_check(pthread_setaffinity_np(pthread_self(), sizeof(set), &set),
                   "pthread_setaffinity_np");
    }
    perf_hist_reset(&w->ha);
    perf_hist_reset(&w->hf);
    for (size_t i = 0; i < pg->npro && !w->failed; i++) {
        const struct perf_ev *e = &pg->pro[i];
        if (e->op == PERF_OP_ALLOC)
            w->failed = !do_alloc(w, live, lsize, streams[e->stream], e, &cur);
        else
            w->failed = !do_free(w, live, lsize, streams[e->stream], e->slot, &cur,
                                 "prologue");
        if (cur > lpeak)
            lpeak = cur;
    }
    track_batch(sh, w->idx, cur, lpeak);
    perf_barrier_wait(&sh->ready);
    perf_barrier_wait(&sh->ready); /* the main thread has read the counters */

    prev = perf_now_ns();
    while (!w->failed && !atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
        if (window_open(&wd, sh)) {
            perf_hist_reset(&w->ha);
            perf_hist_reset(&w->hf);
            w->ops = 0;
            prev = wd.t0;
        }
        if (w->count_only) {
            w->failed = !batch_counted(w, live, lsize, streams, &pos, &cur, &lpeak);
            track_batch(sh, w->idx, cur, lpeak);
        } else {
            w->failed = !batch_timed(w, live, lsize, streams, &pos, &cur, &nalloc, &prev);
        }
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns, &w->vcsw);
    if (!w->count_only)
        w->ops = w->ha.count + w->hf.count;
    perf_barrier_wait(&sh->closed);
    perf_barrier_wait(&sh->closed); /* the main thread has read the counters */
    /* Untimed: give back what is still live. */
    for (unsigned i = 0; i < pg->nslots; i++) {
        /* Free on the stream that a later free event would use: any of the
         * thread's streams is valid; the first is the owner's in every
         * generated program. */
        if (live[i] != NULL && !do_free(w, live, lsize, streams[0], i, &cur, "final") &&
            !w->failed)
            w->failed = true;
    }
    free(live);
    free(lsize);
    return NULL;
}

static long online_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        return CPU_COUNT(&set);
    return 1;
}

static unsigned usable_cpus(unsigned threads)
{
    long cores = online_cores();
    return threads < (unsigned)cores ? threads : (unsigned)cores;
}

bool perf_disturbed(double cpu_share, double sleeps_per_sec, unsigned threads)
{
    return cpu_share < 0.9 && sleeps_per_sec <= 50.0 * (threads ? threads : 1);
}

/* The figures common to every run, from the threads' sums. */
static void finish_common(struct perf_result *r, uint64_t ops, double window_ns, double cpu_ns,
                          uint64_t vcsw, unsigned threads, uint64_t peak)
{
    unsigned usable = usable_cpus(threads);
    r->threads = threads;
    r->ops = ops;
    r->seconds = window_ns * 1e-9;
    r->ops_per_sec = window_ns > 0 ? (double)ops / (window_ns * 1e-9) : 0.0;
    r->cpu_share = window_ns > 0 && usable > 0 ? cpu_ns / (window_ns * usable) : 0.0;
    r->ops_per_cpu_sec = cpu_ns > 0 ? (double)ops / (cpu_ns * 1e-9) : 0.0;
    r->sleeps_per_sec = window_ns > 0 ? (double)vcsw / (window_ns * 1e-9) : 0.0;
    r->disturbed = perf_disturbed(r->cpu_share, r->sleeps_per_sec, threads);
    r->peak_requested = peak;
    r->req_sampled = threads > 1; /* see "Peak requested bytes" above */
}

static void finish_latency(struct perf_result *r, struct perf_hist *ha, struct perf_hist *hf)
{
    struct perf_hist *all = perf_xmalloc(sizeof(*all));
    perf_hist_reset(all);
    perf_hist_merge(all, ha);
    perf_hist_merge(all, hf);
    r->have_lat = true;
    r->hist = all;
    r->p50_ns = perf_hist_quantile(all, 0.50);
    r->p99_ns = perf_hist_quantile(all, 0.99);
    r->p999_ns = perf_hist_quantile(all, 0.999);
    r->alloc_p99_ns = perf_hist_quantile(ha, 0.99);
    r->free_p99_ns = perf_hist_quantile(hf, 0.99);
}

/* Free chunks now: chunk records less live blocks less blocks waiting for
 * their fence. */
static bool read_free_chunks(struct perf_allocator *a, uint64_t *out)
{
    bfc_stats_t st;
    if (a->ops->snapshot == NULL || !a->ops->snapshot(a, &st))
        return false;
    *out = st.num_chunks - (st.num_allocs - st.num_frees) - st.num_pending_frees;
    return true;
}

struct chunks_at {
    struct perf_allocator *a;
    bool ok;
    uint64_t n;
};

static void chunks_at_ready(void *arg)
{
    struct chunks_at *c = arg;
    c->ok = read_free_chunks(c->a, &c->n);
}

int perf_run_prog(struct perf_allocator *a, struct perf_prog *const *prog,
                  const struct perf_run_cfg *cfg, struct perf_result *r)
{
    unsigned n = cfg->threads;
    struct worker *w = perf_xcalloc(n, sizeof(*w));
    struct shared *sh = perf_xmalloc(sizeof(*sh));
    struct perf_hist *ha = perf_xmalloc(sizeof(*ha)), *hf = perf_xmalloc(sizeof(*hf));
    struct chunks_at before = {.a = a};
    double window = 0, cpu = 0;
    uint64_t ops = 0, vcsw = 0, cycles = UINT64_MAX;
    int rc = 0;

    shared_init(sh, n, n, n + 1, true);
    for (unsigned i = 0; i < n; i++) {
        w[i].idx = i;
        w[i].a = a;
        w[i].prog = prog[i];
        w[i].sh = sh;
        w[i].pin = cfg->pin;
        w[i].count_only = cfg->count_only;
        w[i].lock_pair = cfg->lock_pair;
        w[i].bracket = cfg->bracket;
        perf_check(pthread_create(&w[i].tid, NULL, prog_main, &w[i]), "pthread_create");
    }
    drive(sh, cfg, chunks_at_ready, &before);
    perf_barrier_wait(&sh->closed);
    r->have_chunks = before.ok && read_free_chunks(a, &r->free_chunks_after);
    r->free_chunks_before = before.n;
    perf_barrier_wait(&sh->closed);
    perf_hist_reset(ha);
    perf_hist_reset(hf);
    for (unsigned i = 0; i < n; i++) {
        perf_check(pthread_join(w[i].tid, NULL), "pthread_join");
        if (w[i].failed) {
            fprintf(stderr, "shardbfc-perf: %s, thread %u: %s\n", a->ops->name, i, w[i].why);
            rc = -1;
        }
        perf_hist_merge(ha, &w[i].ha);
        perf_hist_merge(hf, &w[i].hf);
        if (w[i].window_ns > window)
            window = w[i].window_ns;
        cpu += w[i].cpu_ns;
        vcsw += w[i].vcsw;
        ops += w[i].ops;
        r->calls_alloc += w[i].calls_alloc;
        r->calls_free += w[i].calls_free;
        if (w[i].cycles < cycles)
            cycles = w[i].cycles;
    }
    shared_fini(sh);
    finish_common(r, ops, window, cpu, vcsw, n,
                  atomic_load_explicit(&sh->peak, memory_order_relaxed));
    r->have_cycles = true;
    r->prog_cycles = n > 0 ? cycles : 0;
    if (!cfg->count_only)
        finish_latency(r, ha, hf);
    /* In-library free rate of one thread (cross on one thread: every free
     * crosses streams). */
    r->consumers = 1;
    r->frees_per_sec_per_consumer =
        hf->sum > 0 ? (double)hf->count / ((double)hf->sum * 1e-9) : 0.0;
    r->allocs_per_sec_per_producer =
        ha->sum > 0 ? (double)ha->count / ((double)ha->sum * 1e-9) : 0.0;
    r->blocks_per_sec = window > 0 ? (double)hf->count / (window * 1e-9) : 0.0;
    r->cpu_share_producer = r->cpu_share_consumer = window > 0 ? cpu / window / n : 0.0;
    free(ha);
    free(hf);
    free(sh);
    free(w);
    return rc;
}

/* ---------------------------------------------------------------- cross */

struct xworker {
    pthread_t tid;
    unsigned pair;
    bool producer;
    struct perf_allocator *a;
    struct perf_ring *ring;
    const uint64_t *sizes;
    unsigned nsizes;
    struct shared *sh;
    /* out */
    struct perf_hist h;
    double window_ns, cpu_ns;
    uint64_t vcsw;
    uint64_t calls;  /* every successful call of the run, the drain included */
    bool failed;
};

static void *xprod_main(void *arg)
{
    struct xworker *w = arg;
    struct perf_allocator *a = w->a;
    bfc_stream_t s = a->streams[2 * w->pair];
    struct shared *sh = w->sh;
    unsigned k = (w->pair * 7919u) % w->nsizes, spins = 0;
    unsigned idx = 2 * w->pair;
    uint64_t nalloc = 0;
    int64_t cur = 0;
    struct window wd = {0};

    perf_hist_reset(&w->h);
    perf_barrier_wait(&sh->ready);
    while (!atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
        if (window_open(&wd, sh))
            perf_hist_reset(&w->h);
        for (unsigned b = 0; b < BATCH; b++) {
            uint64_t n = w->sizes[k], t1 = perf_now_ns(), t2;
            void *p = a->ops->alloc(a, idx, s, n);
            t2 = perf_now_ns();
            perf_hist_add(&w->h, t2 - t1);
            if (p == NULL) {
                w->failed = true;
                break;
            }
            w->calls++;
            cur += (int64_t)n;
            track_publish(sh, idx, cur, &nalloc);
            perf_ring_push(w->ring, p, &spins);
            if (++k == w->nsizes)
                k = 0;
        }
        if (w->failed)
            break;
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns, &w->vcsw);
    perf_ring_push(w->ring, NULL, &spins); /* sentinel: the consumer stops */
    return NULL;
}

static void *xcons_main(void *arg)
{
    struct xworker *w = arg;
    struct perf_allocator *a = w->a;
    bfc_stream_t s = a->streams[2 * w->pair + 1];
    struct shared *sh = w->sh;
    unsigned k = (w->pair * 7919u) % w->nsizes, spins = 0;
    unsigned idx = 2 * w->pair + 1;
    int64_t cur = 0;
    struct window wd = {0};
    bool done = false;

    perf_hist_reset(&w->h);
    perf_barrier_wait(&sh->ready);
    while (!done) {
        if (window_open(&wd, sh))
            perf_hist_reset(&w->h);
        for (unsigned b = 0; b < BATCH; b++) {
            void *p;
            uint64_t n, t1, t2;
            int rc;
            while (!perf_ring_try_pop(w->ring, &p))
                perf_spin_pause(&spins);
            if (p == NULL) {
                done = true;
                break;
            }
            n = w->sizes[k];
            t1 = perf_now_ns();
            rc = a->ops->free(a, idx, p, s, n);
            t2 = perf_now_ns();
            /* After stop the producer's last blocks are drained untimed. */
            if (!atomic_load_explicit(&sh->stop, memory_order_relaxed))
                perf_hist_add(&w->h, t2 - t1);
            cur -= (int64_t)n;
            atomic_store_explicit(&sh->line[idx].cur, cur, memory_order_relaxed);
            if (rc != 0)
                w->failed = true;
            else
                w->calls++;
            if (++k == w->nsizes)
                k = 0;
        }
        if (wd.open && atomic_load_explicit(&sh->stop, memory_order_relaxed))
            window_close(&wd, sh, &w->window_ns, &w->cpu_ns, &w->vcsw);
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns, &w->vcsw);
    return NULL;
}

int perf_run_cross(struct perf_allocator *a, const uint64_t *sizes, unsigned nsizes,
                   const struct perf_run_cfg *cfg, struct perf_result *r)
{
    unsigned pairs = cfg->threads / 2, n;
    struct xworker *w;
    struct perf_ring *rings;
    struct shared *sh = perf_xmalloc(sizeof(*sh));
    struct perf_hist *ha = perf_xmalloc(sizeof(*ha)), *hf = perf_xmalloc(sizeof(*hf));
    double window = 0, cpu = 0, per_consumer = 0, per_producer = 0, share_p = 0, share_c = 0;
    uint64_t vcsw = 0;
    int rc = 0;

    if (pairs == 0)
        pairs = 1;
    n = 2 * pairs;
    w = perf_xcalloc(n, sizeof(*w));
    if (posix_memalign((void **)&rings, 64, pairs * sizeof(*rings)) != 0) {
        fprintf(stderr, "shardbfc-perf: out of host memory (rings)\n");
        exit(1);
    }
    for (unsigned i = 0; i < pairs; i++) {
        atomic_init(&rings[i].head, 0);
        atomic_init(&rings[i].tail, 0);
    }
    shared_init(sh, n, pairs, n + 1, false);
    for (unsigned i = 0; i < n; i++) {
        w[i].pair = i / 2;
        w[i].producer = (i % 2) == 0;
        w[i].a = a;
        w[i].ring = &rings[i / 2];
        w[i].sizes = sizes;
        w[i].nsizes = nsizes;
        w[i].sh = sh;
        perf_check(pthread_create(&w[i].tid, NULL, w[i].producer ? xprod_main : xcons_main,
                                  &w[i]),
                   "pthread_create");
    }
    drive(sh, cfg, NULL, NULL);
    perf_hist_reset(ha);
    perf_hist_reset(hf);
    for (unsigned i = 0; i < n; i++) {
        double per, share;
        perf_check(pthread_join(w[i].tid, NULL), "pthread_join");
        per = w[i].h.sum > 0 ? (double)w[i].h.count / ((double)w[i].h.sum * 1e-9) : 0;
        share = w[i].window_ns > 0 ? w[i].cpu_ns / w[i].window_ns : 0;
        if (w[i].failed) {
            fprintf(stderr, "shardbfc-perf: %s, cross %s %u: a call failed\n",
                    a->ops->name, w[i].producer ? "producer" : "consumer", w[i].pair);
            rc = -1;
        }
        perf_hist_merge(w[i].producer ? ha : hf, &w[i].h);
        if (w[i].window_ns > window)
            window = w[i].window_ns;
        cpu += w[i].cpu_ns;
        vcsw += w[i].vcsw;
        if (w[i].producer) {
            r->calls_alloc += w[i].calls;
            per_producer += per;
            share_p += share;
        } else {
            r->calls_free += w[i].calls;
            per_consumer += per;
            share_c += share;
        }
    }
    shared_fini(sh);
    finish_common(r, ha->count + hf->count, window, cpu, vcsw, n,
                  atomic_load_explicit(&sh->peak, memory_order_relaxed));
    finish_latency(r, ha, hf);
    r->consumers = pairs;
    r->frees_per_sec_per_consumer = per_consumer / pairs;
    r->allocs_per_sec_per_producer = per_producer / pairs;
    r->blocks_per_sec = window > 0 ? (double)hf->count / (window * 1e-9) : 0.0;
    r->cpu_share_producer = share_p / pairs;
    r->cpu_share_consumer = share_c / pairs;
    free(rings);
    free(ha);
    free(hf);
    free(sh);
    free(w);
    return rc;
}

/* ------------------------------------------------------------ baselines */

uint64_t perf_alu_kernel(uint64_t x, uint64_t iters)
{
    for (uint64_t i = 0; i < iters; i++) {
        /* A multiply, an add, a shift and a xor, each on the result of the
         * last: the loop runs at the latency of that chain, in one
         * register.  The empty asm keeps the compiler from reshaping the
         * loop (it cannot see through it), so every build times the same
         * instructions. */
        x = x * 0x5851f42d4c957f2dull + 0x14057b7ef767814full;
        x ^= x >> 29;
        __asm__ volatile("" : "+r"(x));
    }
    return x;
}

void perf_ports_kernel(uint64_t x[PERF_PORTS_LANES], uint64_t iters)
{
    /* Eight chains in eight registers, each alu's step: their multiplies
     * and shifts are independent, so the loop runs as fast as the core
     * issues them.  The empty asm holds every lane in its register (the
     * compiler cannot merge or vectorise what it cannot see through). */
    uint64_t a = x[0], b = x[1], c = x[2], d = x[3], e = x[4], f = x[5], g = x[6], h = x[7];
    for (uint64_t i = 0; i < iters; i++) {
#define PERF_STEP(v) v = v * 0x5851f42d4c957f2dull + 0x14057b7ef767814full, v ^= v >> 29
        PERF_STEP(a); PERF_STEP(b); PERF_STEP(c); PERF_STEP(d);
        PERF_STEP(e); PERF_STEP(f); PERF_STEP(g); PERF_STEP(h);
#undef PERF_STEP
        __asm__ volatile("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d), "+r"(e), "+r"(f), "+r"(g), "+r"(h));
    }
    x[0] = a, x[1] = b, x[2] = c, x[3] = d, x[4] = e, x[5] = f, x[6] = g, x[7] = h;
}

uint64_t perf_mem_kernel(uint64_t *buf, size_t bytes)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < bytes / sizeof(*buf); i += 64 / sizeof(*buf)) {
        sum += buf[i];
        buf[i] += 1;
    }
    return sum;
}

struct bworker {
    pthread_t tid;
    unsigned kind;
    struct shared *sh;
    uint64_t *buf;       /* mem: PERF_MEM_BYTES, this thread's own */
    /* out */
    uint64_t ops, sink;
    double window_ns, cpu_ns;
    uint64_t vcsw;
};

static void *base_main(void *arg)
{
    struct bworker *w = arg;
    struct shared *sh = w->sh;
    struct window wd = {0};
    const uint64_t per = w->kind == PERF_BASE_MEM ? PERF_MEM_BYTES / 64 : PERF_ALU_BATCH;
    uint64_t x = (uint64_t)(uintptr_t)w | 1u, ops = 0, lanes[PERF_PORTS_LANES];

    for (unsigned i = 0; i < PERF_PORTS_LANES; i++)
        lanes[i] = x + 2 * i;

    if (w->buf != NULL)
        memset(w->buf, 0, PERF_MEM_BYTES); /* its pages are faulted in before timing */
    perf_barrier_wait(&sh->ready);
    while (!atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
        if (window_open(&wd, sh))
            ops = 0;
        if (w->kind == PERF_BASE_ALU)
            x = perf_alu_kernel(x, PERF_ALU_BATCH);
        else if (w->kind == PERF_BASE_PORTS)
            perf_ports_kernel(lanes, PERF_ALU_BATCH);
        else
            x += perf_mem_kernel(w->buf, PERF_MEM_BYTES);
        ops += per;
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns, &w->vcsw);
    w->ops = ops;
    for (unsigned i = 0; i < PERF_PORTS_LANES; i++)
        x ^= lanes[i];
    w->sink = x; /* the result is used: the loop cannot be dropped */
    return NULL;
}

int perf_run_base(unsigned kind, const struct perf_run_cfg *cfg, struct perf_base *b)
{
    unsigned n = cfg->threads, usable;
    struct bworker *w;
    struct shared *sh;
    double window = 0, cpu = 0;
    uint64_t ops = 0, vcsw = 0;

    if (kind >= PERF_BASE_N || n == 0 || n > PERF_MAX_THREADS)
        return -1;
    w = perf_xcalloc(n, sizeof(*w));
    sh = perf_xmalloc(sizeof(*sh));
    shared_init(sh, n, n, n + 1, false);
    for (unsigned i = 0; i < n; i++) {
        w[i].kind = kind;
        w[i].sh = sh;
        if (kind == PERF_BASE_MEM &&
            posix_memalign((void **)&w[i].buf, 64, PERF_MEM_BYTES) != 0) {
            fprintf(stderr, "shardbfc-perf: out of host memory (baseline)\n");
            exit(1);
        }
        perf_check(pthread_create(&w[i].tid, NULL, base_main, &w[i]), "pthread_create");
    }
    drive(sh, cfg, NULL, NULL);
    for (unsigned i = 0; i < n; i++) {
        perf_check(pthread_join(w[i].tid, NULL), "pthread_join");
        if (w[i].window_ns > window)
            window = w[i].window_ns;
        cpu += w[i].cpu_ns;
        vcsw += w[i].vcsw;
        ops += w[i].ops;
        free(w[i].buf);
    }
    shared_fini(sh);
    usable = usable_cpus(n);
    b->kind = kind;
    b->threads = n;
    b->ops = ops;
    b->seconds = window * 1e-9;
    b->ops_per_sec = window > 0 ? (double)ops / (window * 1e-9) : 0.0;
    b->cpu_share = window > 0 ? cpu / (window * usable) : 0.0;
    b->disturbed =
        perf_disturbed(b->cpu_share, window > 0 ? (double)vcsw / (window * 1e-9) : 0.0, n);
    free(sh);
    free(w);
    return 0;
}
