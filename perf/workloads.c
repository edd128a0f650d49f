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
 * two reads, so waits on the ring are not counted.  Each thread records
 * into its own histograms (hist.h, no lock); the main thread merges them
 * after joining.
 *
 * Peak requested bytes: each thread publishes its running total of
 * requested-and-live bytes in its own cache line (relaxed store, written
 * only by that thread); with one thread that total is the exact peak, with
 * more every 16th allocation of each thread sums all lines and raises a
 * shared maximum (CAS).  Sampling can miss a short peak, so the figure is a
 * lower bound and fragmentation = reserved / requested errs high, never in
 * the allocator's favour.
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
    unsigned nthreads;
    struct track_line line[2 * PERF_MAX_THREADS];
    _Alignas(64) _Atomic uint64_t peak;
};

static void track_publish(struct shared *sh, unsigned idx, int64_t cur, uint64_t *nalloc)
{
    atomic_store_explicit(&sh->line[idx].cur, cur, memory_order_relaxed);
    if (sh->nthreads == 1 || (++*nalloc % TRACK_EVERY) == 0) {
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
 * window is at least cfg->seconds long. */
static void drive(struct shared *sh, const struct perf_run_cfg *cfg)
{
    perf_barrier_wait(&sh->ready);
    perf_sleep(cfg->warmup_seconds);
    atomic_store_explicit(&sh->timing, true, memory_order_relaxed);
    while (atomic_load_explicit(&sh->acked, memory_order_relaxed) < sh->nthreads)
        perf_sleep(0.0005);
    perf_sleep(cfg->seconds);
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
};

/* True when the window opens at this look (the caller resets its counters). */
static bool window_open(struct window *wd, struct shared *sh)
{
    if (wd->open || !atomic_load_explicit(&sh->timing, memory_order_relaxed))
        return false;
    wd->open = true;
    wd->c0 = perf_thread_cpu_ns();
    wd->t0 = perf_now_ns();
    ack_timing(sh);
    return true;
}

static void window_close(struct window *wd, struct shared *sh, double *window_ns,
                         double *cpu_ns)
{
    if (wd->closed)
        return;
    wd->closed = true;
    if (wd->open) {
        *window_ns = (double)(perf_now_ns() - wd->t0);
        *cpu_ns = perf_thread_cpu_ns() - wd->c0;
    } else {
        ack_timing(sh); /* leaving before the window (a failure) */
    }
}

static void shared_init(struct shared *sh, unsigned nthreads, unsigned parties)
{
    memset(sh, 0, sizeof(*sh));
    atomic_init(&sh->timing, false);
    atomic_init(&sh->stop, false);
    atomic_init(&sh->acked, 0);
    atomic_init(&sh->peak, 0);
    for (unsigned i = 0; i < 2 * PERF_MAX_THREADS; i++)
        atomic_init(&sh->line[i].cur, 0);
    sh->nthreads = nthreads;
    perf_check(pthread_barrier_init(&sh->ready, NULL, parties), "pthread_barrier_init");
}

/* ------------------------------------------------------------- programs */

struct worker {
    pthread_t tid;
    unsigned idx;
    bool pin;
    struct perf_allocator *a;
    const struct perf_prog *prog;
    struct shared *sh;
    /* out */
    struct perf_hist ha, hf;
    uint64_t ops;
    double window_ns, cpu_ns;
    bool failed;
    char why[160];
};

static void *prog_main(void *arg)
{
    struct worker *w = arg;
    struct perf_allocator *a = w->a;
    const struct perf_prog *pg = w->prog;
    const struct perf_alloc_ops *ops = a->ops;
    bfc_stream_t *streams = a->streams + (size_t)w->idx * pg->nstreams;
    void **live = perf_xcalloc(pg->nslots, sizeof(*live));
    uint64_t *lsize = perf_xcalloc(pg->nslots, sizeof(*lsize));
    struct shared *sh = w->sh;
    int64_t cur = 0;
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
        live[e->slot] = ops->alloc(a, w->idx, streams[e->stream], e->size);
        lsize[e->slot] = e->size;
        cur += (int64_t)e->size;
        if (live[e->slot] == NULL) {
            w->failed = true;
            snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed (prologue)",
                     e->size);
        }
    }
    track_publish(sh, w->idx, cur, &nalloc);
    perf_barrier_wait(&sh->ready);

    prev = perf_now_ns();
    while (!w->failed && !atomic_load_explicit(&sh->stop, memory_order_relaxed)) {
        if (window_open(&wd, sh)) {
            perf_hist_reset(&w->ha);
            perf_hist_reset(&w->hf);
            prev = wd.t0;
        }
        for (unsigned b = 0; b < BATCH; b++) {
            const struct perf_ev *e = &pg->ev[pos];
            uint64_t now;
            if (e->op == PERF_OP_ALLOC) {
                void *p = ops->alloc(a, w->idx, streams[e->stream], e->size);
                now = perf_now_ns();
                perf_hist_add(&w->ha, now - prev);
                if (p == NULL) {
                    w->failed = true;
                    snprintf(w->why, sizeof(w->why), "allocation of %" PRIu64 " B failed",
                             e->size);
                    break;
                }
                live[e->slot] = p;
                lsize[e->slot] = e->size;
                cur += (int64_t)e->size;
                track_publish(sh, w->idx, cur, &nalloc);
            } else {
                int rc = ops->free(a, w->idx, live[e->slot], streams[e->stream],
                                   lsize[e->slot]);
                now = perf_now_ns();
                perf_hist_add(&w->hf, now - prev);
                live[e->slot] = NULL;
                cur -= (int64_t)lsize[e->slot];
                atomic_store_explicit(&sh->line[w->idx].cur, cur, memory_order_relaxed);
                if (rc != 0) {
                    w->failed = true;
                    snprintf(w->why, sizeof(w->why), "free failed (%d)", rc);
                    break;
                }
            }
            prev = now;
            if (++pos == pg->nev)
                pos = 0;
        }
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns);
    w->ops = w->ha.count + w->hf.count;
    /* Untimed: give back what is still live. */
    for (unsigned i = 0; i < pg->nslots; i++) {
        if (live[i] != NULL) {
            /* Free on the stream that a later free event would use: any of
             * the thread's streams is valid; the first is the owner's in
             * every generated program. */
            if (ops->free(a, w->idx, live[i], streams[0], lsize[i]) != 0 && !w->failed) {
                w->failed = true;
                snprintf(w->why, sizeof(w->why), "final free failed");
            }
        }
    }
    free(live);
    free(lsize);
    return NULL;
}

static void finish_result(struct perf_result *r, struct perf_hist *ha, struct perf_hist *hf,
                          double window_ns, double cpu_ns, unsigned threads, long cores,
                          uint64_t peak)
{
    struct perf_hist *all = perf_xmalloc(sizeof(*all));
    unsigned usable = threads < (unsigned)cores ? threads : (unsigned)cores;
    perf_hist_reset(all);
    perf_hist_merge(all, ha);
    perf_hist_merge(all, hf);
    r->hist = all;
    r->ops = all->count;
    r->seconds = window_ns * 1e-9;
    r->ops_per_sec = window_ns > 0 ? (double)all->count / (window_ns * 1e-9) : 0.0;
    r->p50_ns = perf_hist_quantile(all, 0.50);
    r->p99_ns = perf_hist_quantile(all, 0.99);
    r->p999_ns = perf_hist_quantile(all, 0.999);
    r->alloc_p99_ns = perf_hist_quantile(ha, 0.99);
    r->free_p99_ns = perf_hist_quantile(hf, 0.99);
    r->cpu_share = window_ns > 0 && usable > 0 ? cpu_ns / (window_ns * usable) : 0.0;
    r->threads = threads;
    r->peak_requested = peak;
}

static long online_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        return CPU_COUNT(&set);
    return 1;
}

int perf_run_prog(struct perf_allocator *a, struct perf_prog *const *prog,
                  const struct perf_run_cfg *cfg, struct perf_result *r)
{
    unsigned n = cfg->threads;
    struct worker *w = perf_xcalloc(n, sizeof(*w));
    struct shared *sh = perf_xmalloc(sizeof(*sh));
    struct perf_hist *ha = perf_xmalloc(sizeof(*ha)), *hf = perf_xmalloc(sizeof(*hf));
    double window = 0, cpu = 0;
    int rc = 0;

    shared_init(sh, n, n + 1);
    for (unsigned i = 0; i < n; i++) {
        w[i].idx = i;
        w[i].a = a;
        w[i].prog = prog[i];
        w[i].sh = sh;
        w[i].pin = cfg->pin;
        perf_check(pthread_create(&w[i].tid, NULL, prog_main, &w[i]), "pthread_create");
    }
    drive(sh, cfg);
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
    }
    perf_check(pthread_barrier_destroy(&sh->ready), "pthread_barrier_destroy");
    finish_result(r, ha, hf, window, cpu, n, online_cores(),
                  atomic_load_explicit(&sh->peak, memory_order_relaxed));
    /* In-library free rate of one thread (cross on one thread: every free
     * crosses streams). */
    r->consumers = 1;
    r->frees_per_sec_per_consumer =
        hf->sum > 0 ? (double)hf->count / ((double)hf->sum * 1e-9) : 0.0;
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
            cur += (int64_t)n;
            track_publish(sh, idx, cur, &nalloc);
            perf_ring_push(w->ring, p, &spins);
            if (++k == w->nsizes)
                k = 0;
        }
        if (w->failed)
            break;
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns);
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
            if (++k == w->nsizes)
                k = 0;
        }
        if (wd.open && atomic_load_explicit(&sh->stop, memory_order_relaxed))
            window_close(&wd, sh, &w->window_ns, &w->cpu_ns);
    }
    window_close(&wd, sh, &w->window_ns, &w->cpu_ns);
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
    double window = 0, cpu = 0, per_consumer = 0;
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
    shared_init(sh, n, n + 1);
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
    drive(sh, cfg);
    perf_hist_reset(ha);
    perf_hist_reset(hf);
    for (unsigned i = 0; i < n; i++) {
        perf_check(pthread_join(w[i].tid, NULL), "pthread_join");
        if (w[i].failed) {
            fprintf(stderr, "shardbfc-perf: %s, cross %s %u: a call failed\n",
                    a->ops->name, w[i].producer ? "producer" : "consumer", w[i].pair);
            rc = -1;
        }
        perf_hist_merge(w[i].producer ? ha : hf, &w[i].h);
        if (w[i].window_ns > window)
            window = w[i].window_ns;
        cpu += w[i].cpu_ns;
        if (!w[i].producer && w[i].h.sum > 0)
            per_consumer += (double)w[i].h.count / ((double)w[i].h.sum * 1e-9);
    }
    perf_check(pthread_barrier_destroy(&sh->ready), "pthread_barrier_destroy");
    finish_result(r, ha, hf, window, cpu, n, online_cores(),
                  atomic_load_explicit(&sh->peak, memory_order_relaxed));
    r->consumers = pairs;
    r->frees_per_sec_per_consumer = per_consumer / pairs;
    free(rings);
    free(ha);
    free(hf);
    free(sh);
    free(w);
    return rc;
}
