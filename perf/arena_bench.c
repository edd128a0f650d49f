/*
 * arena_bench.c -- the arena's and the shards' own performance figures:
 * how fast one BFC arena serves alloc+free pairs, how the sharded service scales with
 * threads against the same arena behind one mutex, and how fast a consumer
 * frees blocks another stream allocated.
 *
 * Three sections, all run by default, each selectable with --workload:
 *
 *   arena    One thread, SIM backend, one stream.  1000 live blocks; each
 *            "pair" frees a random live slot and allocates a new size into
 *            it (sizes log-uniform 256 B .. 1 MiB).  The slot/size sequence
 *            is drawn from a fixed-seed PRNG into an array before timing, so
 *            the RNG is never timed.  Measured three ways, interleaved run by
 *            run so that drift hits them alike: libshardbfc on a fresh
 *            context; libshardbfc on a context that also holds 100 000 free
 *            fragments that cannot coalesce (every other one of ~200 000
 *            small blocks freed; counted through bfc_ctx_stats); jemalloc's
 *            mallocx/sdallocx on the same sequence (the host floor).
 *            The figure is the median ns per pair over the runs.
 *
 *   threads  N threads (1, 2, 4, 8 by default) run the arena workload for a
 *            fixed time, in two modes: "sharded" (one context, one SIM
 *            stream per thread, the library's own locking) and "single-lock"
 *            (one context, ONE stream shared by all threads, every call
 *            wrapped in one global pthread mutex: TensorFlow's design, one
 *            arena behind a device-wide lock).  Reported in pairs/s (all
 *            threads together), median over the repetitions.
 *
 *   cross    A producer thread allocates on its stream and hands the blocks
 *            through a single-producer/single-consumer lock-free ring to a
 *            consumer thread that frees each on its own stream, so every free
 *            crosses streams (event fence + the owner's remote-free queue).
 *            Rates count only the time spent inside the library (batches of
 *            calls timed as a whole), not the time a thread waits on the
 *            ring; the wall-clock rate is printed beside them.  At the end
 *            bfc_ctx_stats must show num_remote_frees == frees and
 *            bytes_in_use == 0.
 *
 * Only the public API (<shardbfc.h>, <shardbfc_sim.h>) and jemalloc's public
 * header are used.  Nothing is pinned; clocks are CLOCK_MONOTONIC; every
 * timed loop is preceded by an untimed warm-up of the same loop.  Missed
 * targets are reported (MET / NOT MET), they do not change the exit status;
 * an allocation failure or a failed verification does (exit 1).
 *
 * Output: a table on stdout; --json FILE writes every figure (its layout
 * follows the "machine" / "results" shape the future perf harness keeps).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <jemalloc/jemalloc.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include "perfutil.h"

/* ------------------------------------------------------------ parameters */

#define LIVE_BLOCKS 1000u
#define SIZE_MIN 256u
#define SIZE_MAX_LOG2 20u /* 1 MiB */
#define SIZE_MIN_LOG2 8u
#define THREAD_SEQ_LEN 65536u /* per-thread pair sequence, cycled */
#define BATCH 256u            /* pairs between two looks at the stop flag */
#define CROSS_BATCH 64u       /* calls timed as one batch in `cross` */
#define MAX_THREADS 64
#define MAX_RUNS 64

#define TARGET_PAIR_NS 100.0
#define TARGET_FRAG_FACTOR 2.0
#define TARGET_SCALING_2 1.8
#define TARGET_VS_LOCK 2.0
#define TARGET_CROSS_FREES 5e6

struct params {
    bool quick;
    bool do_arena, do_threads, do_cross;
    uint64_t seed;
    /* arena */
    unsigned arena_runs;
    unsigned arena_pairs;
    unsigned frag_blocks;   /* small blocks allocated; every other one freed */
    unsigned frag_min, frag_max; /* their sizes, bytes */
    /* threads */
    unsigned nthreads_list[16];
    unsigned n_nthreads;
    double thread_seconds; /* per measurement */
    unsigned thread_runs;
    bool lock_per_pair;    /* single-lock: one lock per pair instead of per call */
    /* cross */
    unsigned cross_runs;
    uint64_t cross_blocks;
    uint64_t cross_warmup;
    const char *json_path;
};

/* ---------------------------------------------------------------- utils */

/* Log-uniform in [256, 1 MiB] (the same sequence as shardbfc-perf's). */
static uint32_t rng_size(uint64_t *s)
{
    return (uint32_t)perf_rng_logu(s, SIZE_MIN, 1u << SIZE_MAX_LOG2);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, unsigned n)
{
    double tmp[MAX_RUNS];
    if (n == 0)
        return 0.0;
    memcpy(tmp, v, n * sizeof(*v));
    qsort(tmp, n, sizeof(*tmp), cmp_double);
    return (n & 1) ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

static double vmin(const double *v, unsigned n)
{
    double m = v[0];
    for (unsigned i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}

static double vmax(const double *v, unsigned n)
{
    double m = v[0];
    for (unsigned i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

static void die_bfc(const char *what, int st)
{
    fprintf(stderr, "arena_bench: %s failed: %s (%s)\n", what, bfc_err_name(st),
            bfc_strerror(st));
    exit(1);
}

/* Timings taken while the benchmark did not get its CPUs are not the
 * allocator's: say so next to the figures. */
static bool disturbed;

static void load_warning(double share)
{
    if (share < 0.9) {
        disturbed = true;
        printf("  WARNING: the timed threads ran only %.0f%% of the wall-clock time:"
               " other load on the machine; these figures overstate the cost\n",
               100 * share);
    }
}

/* ------------------------------------------------------------- results */

/* Everything printed is also kept here for --json. */
struct result {
    char workload[32];
    char allocator[32];
    unsigned threads;
    double ops_per_sec;  /* pairs/s (arena, threads), frees/s (cross) */
    double ns_per_op;    /* per pair (arena), 0 if not meaningful */
    double runs[MAX_RUNS];
    unsigned nruns;
    char unit[24];       /* what `runs` holds */
    char extra[512];     /* further JSON members, already formatted */
};

struct target {
    char name[96];
    double value;
    double limit;
    bool upper; /* true: value <= limit is MET; false: value >= limit */
    bool met;
};

static struct result results[128];
static unsigned nresults;
static struct target targets[32];
static unsigned ntargets;

static struct result *add_result(const char *workload, const char *allocator,
                                 unsigned threads)
{
    struct result *r;
    if (nresults == sizeof(results) / sizeof(results[0])) {
        fprintf(stderr, "arena_bench: too many results\n");
        exit(1);
    }
    r = &results[nresults++];
    memset(r, 0, sizeof(*r));
    snprintf(r->workload, sizeof(r->workload), "%s", workload);
    snprintf(r->allocator, sizeof(r->allocator), "%s", allocator);
    r->threads = threads;
    return r;
}

static void add_target(const char *name, double value, double limit, bool upper)
{
    struct target *t;
    if (ntargets == sizeof(targets) / sizeof(targets[0]))
        return;
    t = &targets[ntargets++];
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->value = value;
    t->limit = limit;
    t->upper = upper;
    t->met = upper ? value <= limit : value >= limit;
    printf("  target: %-52s %12.3f %s %-10.3f %s\n", name, value,
           upper ? "<=" : ">=", limit, t->met ? "MET" : "NOT MET");
}

/* ---------------------------------------------------------------- machine */

static struct perf_machine mach;
static char loadavg_end[64] = "unknown";

/* ------------------------------------------------------------- workload */

/* One pair: free live slot `slot`, then allocate `size` into it. */
struct pair_op {
    uint32_t slot;
    uint32_t size;
};

static struct pair_op *make_ops(uint64_t seed, unsigned n)
{
    struct pair_op *ops = perf_xmalloc((size_t)n * sizeof(*ops));
    uint64_t s = seed;
    for (unsigned i = 0; i < n; i++) {
        ops[i].slot = (uint32_t)(perf_rng_next(&s) % LIVE_BLOCKS);
        ops[i].size = rng_size(&s);
    }
    return ops;
}

static void make_init_sizes(uint64_t seed, uint32_t *sizes)
{
    uint64_t s = seed;
    for (unsigned i = 0; i < LIVE_BLOCKS; i++)
        sizes[i] = rng_size(&s);
}

static bfc_ctx_t *make_ctx(size_t limit)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    int st;
    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    cfg.memory_limit = limit;
    st = bfc_ctx_create(&cfg, &ctx);
    if (st != BFC_OK)
        die_bfc("bfc_ctx_create", st);
    return ctx;
}

static bfc_stream_t make_stream(bfc_ctx_t *ctx)
{
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    if (s == NULL) {
        fprintf(stderr, "arena_bench: bfc_sim_stream_create failed\n");
        exit(1);
    }
    return s;
}

static void *must_alloc(bfc_ctx_t *ctx, bfc_stream_t s, size_t n)
{
    void *p = bfc_ctx_alloc(ctx, s, n);
    if (p == NULL) {
        int e = bfc_last_error();
        fprintf(stderr, "arena_bench: bfc_ctx_alloc(%zu) returned NULL: %s\n", n,
                bfc_err_name(e));
        exit(1);
    }
    return p;
}

static void must_free(bfc_ctx_t *ctx, void *p, bfc_stream_t s)
{
    int st = bfc_ctx_free(ctx, p, s);
    if (st != BFC_OK)
        die_bfc("bfc_ctx_free", st);
}

static void must_stats(bfc_ctx_t *ctx, bfc_stats_t *st)
{
    int rc = bfc_ctx_stats(ctx, st);
    if (rc != BFC_OK)
        die_bfc("bfc_ctx_stats", rc);
}

/* Free chunks = chunk records - live blocks - blocks waiting for a fence. */
static uint64_t free_chunks(const bfc_stats_t *st)
{
    uint64_t live = st->num_allocs - st->num_frees;
    return st->num_chunks - live - st->num_pending_frees;
}

/* ---------------------------------------------------------- section: arena */

/*
 * The timed loops are kept free of anything but the calls: a NULL return is
 * remembered and reported after the clock stops.
 */
static double run_bfc_pairs(bfc_ctx_t *ctx, bfc_stream_t s, void **live,
                            const struct pair_op *ops, unsigned n, double *share)
{
    bool failed = false;
    double c0 = perf_thread_cpu_ns(), t0 = (double)perf_now_ns(), t1;
    for (unsigned i = 0; i < n; i++) {
        uint32_t k = ops[i].slot;
        bfc_ctx_free(ctx, live[k], s);
        live[k] = bfc_ctx_alloc(ctx, s, ops[i].size);
        failed |= live[k] == NULL;
    }
    t1 = (double)perf_now_ns();
    *share = (perf_thread_cpu_ns() - c0) / (t1 - t0);
    if (failed) {
        fprintf(stderr, "arena_bench: allocation failed in the arena loop: %s\n",
                bfc_err_name(bfc_last_error()));
        exit(1);
    }
    return (t1 - t0) / n;
}

static double run_je_pairs(void **live, uint32_t *live_size,
                           const struct pair_op *ops, unsigned n, double *share)
{
    bool failed = false;
    double c0 = perf_thread_cpu_ns(), t0 = (double)perf_now_ns(), t1;
    for (unsigned i = 0; i < n; i++) {
        uint32_t k = ops[i].slot;
        sdallocx(live[k], live_size[k], 0);
        live[k] = mallocx(ops[i].size, 0);
        live_size[k] = ops[i].size;
        failed |= live[k] == NULL;
    }
    t1 = (double)perf_now_ns();
    *share = (perf_thread_cpu_ns() - c0) / (t1 - t0);
    if (failed) {
        fprintf(stderr, "arena_bench: mallocx failed\n");
        exit(1);
    }
    return (t1 - t0) / n;
}

/* Allocates frag_blocks small blocks and frees every other one; the freed
 * ones are each fenced in by two live neighbours, so they cannot coalesce. */
static void **make_fragments(const struct params *P, bfc_ctx_t *ctx, bfc_stream_t s)
{
    void **blk = perf_xmalloc((size_t)P->frag_blocks * sizeof(*blk));
    uint64_t rs = P->seed ^ 0xf4a9f4a9ull;
    unsigned span = (P->frag_max - P->frag_min) / 256u + 1u;
    for (unsigned i = 0; i < P->frag_blocks; i++) {
        size_t n = P->frag_min + 256u * (size_t)(perf_rng_next(&rs) % span);
        blk[i] = must_alloc(ctx, s, n);
    }
    for (unsigned i = 0; i < P->frag_blocks; i += 2) {
        must_free(ctx, blk[i], s);
        blk[i] = NULL;
    }
    return blk;
}

static int section_arena(const struct params *P)
{
    const unsigned runs = P->arena_runs, n = P->arena_pairs;
    struct pair_op *ops = make_ops(P->seed, n);
    uint32_t init_sizes[LIVE_BLOCKS];
    void *live_a[LIVE_BLOCKS], *live_f[LIVE_BLOCKS], *live_j[LIVE_BLOCKS];
    uint32_t size_j[LIVE_BLOCKS];
    double ns_a[MAX_RUNS], ns_f[MAX_RUNS], ns_j[MAX_RUNS];
    double sh_a[MAX_RUNS], sh_f[MAX_RUNS], sh_j[MAX_RUNS], sh;
    bfc_ctx_t *ctx_a, *ctx_f;
    bfc_stream_t s_a, s_f;
    bfc_stats_t st0, st1, sta;
    void **frag;
    uint64_t fc_before, fc_after;
    struct result *r;
    char name[96];

    make_init_sizes(P->seed + 1, init_sizes);

    printf("\n== arena: one thread, SIM backend, alloc+free pairs ==\n");
    printf("  sizes log-uniform %u B .. %u B (requested, rounded by the allocator),"
           " %u live blocks\n", SIZE_MIN, 1u << SIZE_MAX_LOG2, LIVE_BLOCKS);
    printf("  sequence seed %" PRIu64 " (live-set seed %" PRIu64 "), %u pairs per run,"
           " %u runs + 1 warm-up, median reported\n", P->seed, P->seed + 1, n, runs);
    printf("  a pair = free a random live slot, allocate the next size into it\n");

    /* Plain context. */
    ctx_a = make_ctx((size_t)8 << 30);
    s_a = make_stream(ctx_a);
    for (unsigned i = 0; i < LIVE_BLOCKS; i++)
        live_a[i] = must_alloc(ctx_a, s_a, init_sizes[i]);

    /* Context with fragments. */
    perf_progress("arena: creating %u fragments", P->frag_blocks / 2);
    ctx_f = make_ctx((size_t)8 << 30);
    s_f = make_stream(ctx_f);
    frag = make_fragments(P, ctx_f, s_f);
    must_stats(ctx_f, &st0);
    fc_before = free_chunks(&st0);
    for (unsigned i = 0; i < LIVE_BLOCKS; i++)
        live_f[i] = must_alloc(ctx_f, s_f, init_sizes[i]);
    printf("  fragments: %u blocks of %u..%u B (multiples of 256, seed %" PRIu64
           "), every other one freed\n", P->frag_blocks, P->frag_min, P->frag_max,
           (uint64_t)(P->seed ^ 0xf4a9f4a9ull));
    printf("  after freeing: free chunks %" PRIu64 ", bytes_free %" PRIu64
           ", num_chunks %" PRIu64 ", live %" PRIu64 ", regions %" PRIu64 "\n",
           fc_before, st0.bytes_free, st0.num_chunks, st0.num_allocs - st0.num_frees,
           st0.num_regions);

    /* jemalloc. */
    for (unsigned i = 0; i < LIVE_BLOCKS; i++) {
        live_j[i] = mallocx(init_sizes[i], 0);
        size_j[i] = init_sizes[i];
        if (live_j[i] == NULL) {
            fprintf(stderr, "arena_bench: mallocx failed\n");
            return 1;
        }
    }

    /* Warm-up: one full run of each. */
    perf_progress("arena: warm-up");
    (void)run_bfc_pairs(ctx_a, s_a, live_a, ops, n, &sh);
    (void)run_bfc_pairs(ctx_f, s_f, live_f, ops, n, &sh);
    (void)run_je_pairs(live_j, size_j, ops, n, &sh);

    for (unsigned r = 0; r < runs; r++) {
        perf_progress("arena: run %u/%u", r + 1, runs);
        ns_a[r] = run_bfc_pairs(ctx_a, s_a, live_a, ops, n, &sh_a[r]);
        ns_f[r] = run_bfc_pairs(ctx_f, s_f, live_f, ops, n, &sh_f[r]);
        ns_j[r] = run_je_pairs(live_j, size_j, ops, n, &sh_j[r]);
    }
    perf_progress_done();

    must_stats(ctx_f, &st1);
    fc_after = free_chunks(&st1);
    must_stats(ctx_a, &sta);

    {
        double ma = median(ns_a, runs), mf = median(ns_f, runs), mj = median(ns_j, runs);
        double ca = median(sh_a, runs), cf = median(sh_f, runs), cj = median(sh_j, runs);
        printf("\n  %-34s %10s %10s %10s %12s %11s %6s\n", "allocator", "median ns",
               "min ns", "max ns", "pairs/s", "vs jemalloc", "cpu");
        printf("  %-34s %10.1f %10.1f %10.1f %12.0f %10.2fx %5.0f%%\n", "shardbfc",
               ma, vmin(ns_a, runs), vmax(ns_a, runs), 1e9 / ma, ma / mj, 100 * ca);
        snprintf(name, sizeof(name), "shardbfc + %" PRIu64 " free fragments", fc_before);
        printf("  %-34s %10.1f %10.1f %10.1f %12.0f %10.2fx %5.0f%%\n", name,
               mf, vmin(ns_f, runs), vmax(ns_f, runs), 1e9 / mf, mf / mj, 100 * cf);
        printf("  %-34s %10.1f %10.1f %10.1f %12.0f %10.2fx %5.0f%%\n",
               "jemalloc mallocx/sdallocx", mj, vmin(ns_j, runs), vmax(ns_j, runs),
               1e9 / mj, 1.0, 100 * cj);
        printf("  (cpu = median share of the wall-clock window the thread was on a CPU)\n");
        load_warning(ca < cf ? (ca < cj ? ca : cj) : (cf < cj ? cf : cj));
        printf("  free chunks in the fragmented context: %" PRIu64 " before,"
               " %" PRIu64 " after the runs (bytes_free %" PRIu64 ")\n",
               fc_before, fc_after, st1.bytes_free);
        printf("  plain context: regions %" PRIu64 ", bytes_reserved %" PRIu64
               ", peak_bytes_in_use %" PRIu64 "\n", sta.num_regions, sta.bytes_reserved,
               sta.peak_bytes_in_use);

        r = add_result("arena", "shardbfc", 1);
        r->ns_per_op = ma;
        r->ops_per_sec = 1e9 / ma;
        memcpy(r->runs, ns_a, runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "ns_per_pair");
        snprintf(r->extra, sizeof(r->extra),
                 "\"ratio_vs_jemalloc\": %.4f, \"cpu_share\": %.3f, \"peak_reserved\": %"
                 PRIu64 ", \"peak_in_use\": %" PRIu64, ma / mj, ca, sta.peak_bytes_reserved,
                 sta.peak_bytes_in_use);

        r = add_result("arena-fragmented", "shardbfc", 1);
        r->ns_per_op = mf;
        r->ops_per_sec = 1e9 / mf;
        memcpy(r->runs, ns_f, runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "ns_per_pair");
        snprintf(r->extra, sizeof(r->extra),
                 "\"ratio_vs_jemalloc\": %.4f, \"ratio_vs_plain\": %.4f, \"cpu_share\": %.3f, "
                 "\"free_chunks_before\": %" PRIu64 ", \"free_chunks_after\": %" PRIu64
                 ", \"bytes_free_before\": %" PRIu64 ", \"fragment_blocks\": %u",
                 mf / mj, mf / ma, cf, fc_before, fc_after, st0.bytes_free, P->frag_blocks);

        r = add_result("arena", "jemalloc", 1);
        r->ns_per_op = mj;
        r->ops_per_sec = 1e9 / mj;
        memcpy(r->runs, ns_j, runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "ns_per_pair");
        snprintf(r->extra, sizeof(r->extra), "\"cpu_share\": %.3f", cj);

        printf("\n");
        add_target("arena: ns per pair", ma, TARGET_PAIR_NS, true);
        add_target("arena: ns per pair with fragments", mf,
                   TARGET_FRAG_FACTOR * TARGET_PAIR_NS, true);
        add_target("arena: fragments / plain (x)", mf / ma, TARGET_FRAG_FACTOR, true);
        if (fc_before < 100000)
            printf("  WARNING: only %" PRIu64 " free fragments (wanted >= 100000)\n",
                   fc_before);
    }

    for (unsigned i = 0; i < LIVE_BLOCKS; i++) {
        must_free(ctx_a, live_a[i], s_a);
        must_free(ctx_f, live_f[i], s_f);
        sdallocx(live_j[i], size_j[i], 0);
    }
    for (unsigned i = 1; i < P->frag_blocks; i += 2)
        must_free(ctx_f, frag[i], s_f);
    must_stats(ctx_a, &sta);
    must_stats(ctx_f, &st1);
    if (sta.bytes_in_use != 0 || st1.bytes_in_use != 0) {
        fprintf(stderr, "arena_bench: bytes_in_use not 0 after freeing everything\n");
        return 1;
    }
    free(frag);
    bfc_sim_stream_destroy(ctx_a, s_a);
    bfc_sim_stream_destroy(ctx_f, s_f);
    bfc_ctx_destroy(ctx_a);
    bfc_ctx_destroy(ctx_f);
    free(ops);
    return 0;
}

/* -------------------------------------------------------- section: threads */

struct thr {
    pthread_t tid;
    unsigned idx;
    bool single_lock;
    bool lock_per_pair;
    bfc_ctx_t *ctx;
    bfc_stream_t stream;
    const struct pair_op *ops; /* THREAD_SEQ_LEN entries */
    const uint32_t *init_sizes;
    unsigned warmup_pairs;
    pthread_barrier_t *start;
    atomic_bool *stop;
    /* out */
    uint64_t pairs;
    double elapsed_ns;
    double cpu_ns;
    uint64_t vcsw;
    int error; /* bfc status of the first failure, 0 if none */
};

static pthread_mutex_t global_lock = PTHREAD_MUTEX_INITIALIZER;

static void lock_global(void)
{
    perf_check(pthread_mutex_lock(&global_lock), "pthread_mutex_lock");
}

static void unlock_global(void)
{
    perf_check(pthread_mutex_unlock(&global_lock), "pthread_mutex_unlock");
}

/* One pair in the thread's mode; false if the allocation failed. */
static inline bool thr_pair(struct thr *t, void **live, const struct pair_op *op)
{
    void *p;
    if (!t->single_lock) {
        bfc_ctx_free(t->ctx, live[op->slot], t->stream);
        p = bfc_ctx_alloc(t->ctx, t->stream, op->size);
    } else if (t->lock_per_pair) {
        lock_global();
        bfc_ctx_free(t->ctx, live[op->slot], t->stream);
        p = bfc_ctx_alloc(t->ctx, t->stream, op->size);
        unlock_global();
    } else {
        /* TensorFlow's BFCAllocator locks once in DeallocateRaw and once in
         * AllocateRaw. */
        lock_global();
        bfc_ctx_free(t->ctx, live[op->slot], t->stream);
        unlock_global();
        lock_global();
        p = bfc_ctx_alloc(t->ctx, t->stream, op->size);
        unlock_global();
    }
    live[op->slot] = p;
    return p != NULL;
}

static void *thr_main(void *arg)
{
    struct thr *t = arg;
    void *live[LIVE_BLOCKS];
    unsigned pos = 0;
    uint64_t pairs = 0;
    double t0, t1, c0;
    uint64_t v0;
    int rc;

    for (unsigned i = 0; i < LIVE_BLOCKS; i++) {
        if (t->single_lock)
            lock_global();
        live[i] = bfc_ctx_alloc(t->ctx, t->stream, t->init_sizes[i]);
        if (t->single_lock)
            unlock_global();
        if (live[i] == NULL && t->error == 0)
            t->error = bfc_last_error() ? bfc_last_error() : BFC_ENOMEM;
    }
    for (unsigned i = 0; i < t->warmup_pairs && t->error == 0; i++) {
        if (!thr_pair(t, live, &t->ops[pos]))
            t->error = bfc_last_error() ? bfc_last_error() : BFC_ENOMEM;
        pos = (pos + 1) & (THREAD_SEQ_LEN - 1);
    }

    perf_barrier_wait(t->start);
    v0 = perf_thread_vcsw();
    c0 = perf_thread_cpu_ns();
    t0 = (double)perf_now_ns();
    /* relaxed: the flag only bounds the run; nothing is published with it. */
    while (t->error == 0 && !atomic_load_explicit(t->stop, memory_order_relaxed)) {
        bool ok = true;
        for (unsigned b = 0; b < BATCH; b++) {
            ok &= thr_pair(t, live, &t->ops[pos]);
            pos = (pos + 1) & (THREAD_SEQ_LEN - 1);
        }
        pairs += BATCH;
        if (!ok)
            t->error = bfc_last_error() ? bfc_last_error() : BFC_ENOMEM;
    }
    t1 = (double)perf_now_ns();
    t->cpu_ns = perf_thread_cpu_ns() - c0;
    t->vcsw = perf_thread_vcsw() - v0;
    t->pairs = pairs;
    t->elapsed_ns = t1 - t0;

    for (unsigned i = 0; i < LIVE_BLOCKS; i++) {
        if (live[i] == NULL)
            continue;
        if (t->single_lock)
            lock_global();
        rc = bfc_ctx_free(t->ctx, live[i], t->stream);
        if (t->single_lock)
            unlock_global();
        if (rc != BFC_OK && t->error == 0)
            t->error = rc;
    }
    return NULL;
}

struct thr_seqs {
    struct pair_op *ops[MAX_THREADS];
    uint32_t init[MAX_THREADS][LIVE_BLOCKS];
};

/* One measurement: returns pairs/s of all threads together. */
static double run_threads(const struct params *P, struct thr_seqs *seqs, unsigned n,
                          bool single_lock, double *share, double *vcsw_per_s,
                          double *per_cpu_s)
{
    struct thr th[MAX_THREADS];
    bfc_stream_t streams[MAX_THREADS];
    pthread_barrier_t start;
    atomic_bool stop;
    bfc_ctx_t *ctx = make_ctx((size_t)15 << 30);
    bfc_stats_t st;
    uint64_t total = 0;
    double longest = 0.0, cpu = 0.0;
    uint64_t vcsw = 0;

    atomic_init(&stop, false);
    perf_check(pthread_barrier_init(&start, NULL, n + 1), "pthread_barrier_init");
    for (unsigned i = 0; i < n; i++)
        streams[i] = (single_lock && i > 0) ? streams[0] : make_stream(ctx);

    for (unsigned i = 0; i < n; i++) {
        memset(&th[i], 0, sizeof(th[i]));
        th[i].idx = i;
        th[i].single_lock = single_lock;
        th[i].lock_per_pair = P->lock_per_pair;
        th[i].ctx = ctx;
        th[i].stream = streams[i];
        th[i].ops = seqs->ops[i];
        th[i].init_sizes = seqs->init[i];
        th[i].warmup_pairs = P->quick ? 20000u : 50000u;
        th[i].start = &start;
        th[i].stop = &stop;
        perf_check(pthread_create(&th[i].tid, NULL, thr_main, &th[i]), "pthread_create");
    }
    perf_barrier_wait(&start);
    perf_sleep(P->thread_seconds);
    /* relaxed: see thr_main. */
    atomic_store_explicit(&stop, true, memory_order_relaxed);
    for (unsigned i = 0; i < n; i++) {
        perf_check(pthread_join(th[i].tid, NULL), "pthread_join");
        if (th[i].error != 0) {
            fprintf(stderr, "arena_bench: thread %u (%s, N=%u) failed: %s\n", i,
                    single_lock ? "single-lock" : "sharded", n, bfc_err_name(th[i].error));
            exit(1);
        }
        total += th[i].pairs;
        cpu += th[i].cpu_ns;
        vcsw += th[i].vcsw;
        if (th[i].elapsed_ns > longest)
            longest = th[i].elapsed_ns;
    }
    perf_check(pthread_barrier_destroy(&start), "pthread_barrier_destroy");
    must_stats(ctx, &st);
    if (st.bytes_in_use != 0) {
        fprintf(stderr, "arena_bench: threads: bytes_in_use %" PRIu64 " at the end\n",
                st.bytes_in_use);
        exit(1);
    }
    for (unsigned i = 0; i < n; i++)
        if (!single_lock || i == 0)
            bfc_sim_stream_destroy(ctx, streams[i]);
    bfc_ctx_destroy(ctx);
    /* The share of the CPUs the threads could have used. */
    *vcsw_per_s = (double)vcsw / (longest * 1e-9);
    *per_cpu_s = (double)total / (cpu * 1e-9);
    *share = cpu / (longest * (double)(n < (unsigned)mach.cores ? n : (unsigned)mach.cores));
    return (double)total / (longest * 1e-9);
}

static int section_threads(const struct params *P)
{
    struct thr_seqs *seqs = perf_xmalloc(sizeof(*seqs));
    unsigned maxn = 0, nn = P->n_nthreads, runs = P->thread_runs;
    static double shard[16][MAX_RUNS], lock[16][MAX_RUNS];
    static double shs[16][MAX_RUNS], shl[16][MAX_RUNS];
    static double vs[16][MAX_RUNS], vl[16][MAX_RUNS];
    static double pcs[16][MAX_RUNS], pcl[16][MAX_RUNS];
    double worst = 1.0;
    double ms[16], ml[16];
    unsigned i1 = nn, i2 = nn;

    for (unsigned j = 0; j < nn; j++)
        if (P->nthreads_list[j] > maxn)
            maxn = P->nthreads_list[j];
    for (unsigned i = 0; i < maxn; i++) {
        seqs->ops[i] = make_ops(P->seed + 1000u + i, THREAD_SEQ_LEN);
        make_init_sizes(P->seed + 2000u + i, seqs->init[i]);
    }

    printf("\n== threads: N threads, the arena workload each, fixed time ==\n");
    printf("  machine has %ld online CPUs: N above that oversubscribes\n", mach.cores);
    printf("  per thread: %u live blocks, sizes log-uniform %u B .. %u B, a cycled"
           " sequence of %u pairs (seed %" PRIu64 "+1000+thread; live set seed %"
           PRIu64 "+2000+thread)\n", LIVE_BLOCKS, SIZE_MIN, 1u << SIZE_MAX_LOG2,
           THREAD_SEQ_LEN, P->seed, P->seed);
    printf("  %.2f s per measurement after %u warm-up pairs per thread, %u runs"
           " per point (modes interleaved), median reported\n", P->thread_seconds,
           P->quick ? 20000u : 50000u, runs);
    printf("  sharded: one context, one SIM stream per thread\n");
    printf("  single-lock: one context, ONE stream for all threads, one global"
           " pthread mutex taken %s\n",
           P->lock_per_pair ? "once per alloc+free pair"
                            : "around each call (free, then alloc: as TensorFlow)");

    for (unsigned r = 0; r < runs; r++) {
        for (unsigned j = 0; j < nn; j++) {
            unsigned n = P->nthreads_list[j];
            perf_progress("threads: run %u/%u, N=%u sharded", r + 1, runs, n);
            shard[j][r] = run_threads(P, seqs, n, false, &shs[j][r], &vs[j][r], &pcs[j][r]);
            perf_progress("threads: run %u/%u, N=%u single-lock", r + 1, runs, n);
            lock[j][r] = run_threads(P, seqs, n, true, &shl[j][r], &vl[j][r], &pcl[j][r]);
        }
    }
    perf_progress_done();

    printf("\n  %3s %16s %16s %14s %9s %12s %6s %6s %9s %9s\n", "N", "sharded pairs/s",
           "single-lock /s", "sharded/lock", "scaling", "per thread", "cpu S", "cpu L",
           "sleeps/s S", "sleeps/s L");
    for (unsigned j = 0; j < nn; j++) {
        ms[j] = median(shard[j], runs);
        ml[j] = median(lock[j], runs);
        if (P->nthreads_list[j] == 1)
            i1 = j;
        if (P->nthreads_list[j] == 2)
            i2 = j;
    }
    for (unsigned j = 0; j < nn; j++) {
        unsigned n = P->nthreads_list[j];
        struct result *r;
        double cs = median(shs[j], runs), cl = median(shl[j], runs);
        printf("  %3u %16.0f %16.0f %13.2fx", n, ms[j], ml[j], ms[j] / ml[j]);
        if (i1 < nn)
            printf(" %8.2fx", ms[j] / ms[i1]);
        else
            printf(" %9s", "-");
        printf(" %12.0f %5.0f%% %5.0f%% %9.0f %9.0f\n", ms[j] / n, 100 * cs, 100 * cl,
               median(vs[j], runs), median(vl[j], runs));
        if (cs < worst)
            worst = cs;

        r = add_result("threads", "shardbfc", n);
        r->ops_per_sec = ms[j];
        memcpy(r->runs, shard[j], runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "pairs_per_sec");
        snprintf(r->extra, sizeof(r->extra),
                 "\"ratio_vs_single_lock\": %.4f, \"cpu_share\": %.3f, \"sleeps_per_sec\": %.1f, "
                 "\"pairs_per_cpu_sec\": %.1f",
                 ms[j] / ml[j], cs, median(vs[j], runs), median(pcs[j], runs));
        r = add_result("threads", "single-lock", n);
        r->ops_per_sec = ml[j];
        memcpy(r->runs, lock[j], runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "pairs_per_sec");
        snprintf(r->extra, sizeof(r->extra),
                 "\"lock_scope\": \"%s\", \"cpu_share\": %.3f, \"sleeps_per_sec\": %.1f, "
                 "\"pairs_per_cpu_sec\": %.1f",
                 P->lock_per_pair ? "pair" : "call", cl, median(vl[j], runs), median(pcl[j], runs));
    }
    printf("  (min..max of runs:");
    for (unsigned j = 0; j < nn; j++)
        printf(" N=%u sharded %.0f..%.0f lock %.0f..%.0f;", P->nthreads_list[j],
               vmin(shard[j], runs), vmax(shard[j], runs), vmin(lock[j], runs),
               vmax(lock[j], runs));
    printf(")\n");
    printf("  pairs per CPU-second (sharded / single-lock), independent of other load:");
    for (unsigned j = 0; j < nn; j++)
        printf(" N=%u %.0f / %.0f;", P->nthreads_list[j], median(pcs[j], runs),
               median(pcl[j], runs));
    printf("\n");
    if (i1 < nn && i2 < nn)
        printf("  estimate for an idle machine (not a measurement): sharded(2)/sharded(1)"
               " = %.2fx = 2 x per-CPU-second(2) / per-CPU-second(1)\n",
               (mach.cores >= 2 ? 2.0 : 1.0) * median(pcs[i2], runs) / median(pcs[i1], runs));
    printf("  (cpu S / L = median share of min(N, CPUs) that the sharded / single-lock"
           " threads were on a CPU;\n   single-lock threads also sleep on the mutex,"
           " so a low cpu L is expected;\n   sleeps/s = voluntary context switches of"
           " all threads per second: blocking in a lock, not other load)\n");
    load_warning(worst);
    printf("\n");

    if (i1 < nn && i2 < nn)
        add_target("threads: sharded(2) / sharded(1) (x)", ms[i2] / ms[i1],
                   TARGET_SCALING_2, false);
    for (unsigned j = 0; j < nn; j++) {
        char name[96];
        if (P->nthreads_list[j] < 2)
            continue;
        snprintf(name, sizeof(name), "threads: sharded / single-lock at N=%u (x)",
                 P->nthreads_list[j]);
        add_target(name, ms[j] / ml[j], TARGET_VS_LOCK, false);
    }

    for (unsigned i = 0; i < maxn; i++)
        free(seqs->ops[i]);
    free(seqs);
    return 0;
}

/* ---------------------------------------------------------- section: cross */

/* The producer/consumer ring is perfutil.h's struct perf_ring. */

struct cross_arg {
    bfc_ctx_t *ctx;
    bfc_stream_t stream;
    struct perf_ring *ring;
    const struct pair_op *ops; /* sizes only, THREAD_SEQ_LEN entries */
    uint64_t count;
    /* out */
    double busy_ns;   /* time inside bfc_ctx_alloc / bfc_ctx_free */
    double wall_ns;
    double cpu_ns;
    int error;
};

static void *producer_main(void *arg)
{
    struct cross_arg *a = arg;
    struct perf_ring *rg = a->ring;
    void *batch[CROSS_BATCH];
    uint64_t done = 0;
    unsigned pos = 0, spins = 0;
    double busy = 0.0, w0 = (double)perf_now_ns(), c0 = perf_thread_cpu_ns();

    while (done < a->count) {
        unsigned b = a->count - done < CROSS_BATCH ? (unsigned)(a->count - done)
                                                   : CROSS_BATCH;
        double t0 = (double)perf_now_ns();
        for (unsigned i = 0; i < b; i++) {
            batch[i] = bfc_ctx_alloc(a->ctx, a->stream, a->ops[pos].size);
            pos = (pos + 1) & (THREAD_SEQ_LEN - 1);
        }
        busy += (double)perf_now_ns() - t0;
        for (unsigned i = 0; i < b; i++) {
            if (batch[i] == NULL) {
                a->error = bfc_last_error() ? bfc_last_error() : BFC_ENOMEM;
                a->count = done + i; /* stop here; the consumer is told below */
                b = i;
                break;
            }
        }
        for (unsigned i = 0; i < b; i++)
            perf_ring_push(rg, batch[i], &spins);
        done += b;
        if (a->error != 0)
            break;
    }
    if (a->error != 0)
        perf_ring_push(rg, NULL, &spins); /* a NULL sentinel stops the consumer */
    a->busy_ns = busy;
    a->wall_ns = (double)perf_now_ns() - w0;
    a->cpu_ns = perf_thread_cpu_ns() - c0;
    return NULL;
}

static void *consumer_main(void *arg)
{
    struct cross_arg *a = arg;
    struct perf_ring *rg = a->ring;
    void *batch[CROSS_BATCH];
    uint64_t done = 0, head = atomic_load_explicit(&rg->head, memory_order_relaxed);
    unsigned spins = 0;
    double busy = 0.0, w0 = (double)perf_now_ns(), c0 = perf_thread_cpu_ns();
    bool stop = false;

    while (done < a->count && !stop) {
        uint64_t avail;
        unsigned b = 0;
        /* acquire pairs with the producer's release store of tail. */
        while ((avail = atomic_load_explicit(&rg->tail, memory_order_acquire) - head) == 0)
            perf_spin_pause(&spins);
        while (b < CROSS_BATCH && b < avail) {
            void *p = rg->slot[(head + b) & (PERF_RING_CAP - 1)];
            if (p == NULL) {
                stop = true;
                break;
            }
            batch[b++] = p;
        }
        head += b + (stop ? 1u : 0u);
        /* release pairs with the producer's acquire load of head: we have
         * read the slots before handing them back. */
        atomic_store_explicit(&rg->head, head, memory_order_release);
        {
            double t0 = (double)perf_now_ns();
            int bad = 0;
            for (unsigned i = 0; i < b; i++)
                bad |= bfc_ctx_free(a->ctx, batch[i], a->stream);
            busy += (double)perf_now_ns() - t0;
            if (bad != 0 && a->error == 0)
                a->error = BFC_EBACKEND; /* reported after the run */
        }
        done += b;
    }
    a->count = done;
    a->busy_ns = busy;
    a->wall_ns = (double)perf_now_ns() - w0;
    a->cpu_ns = perf_thread_cpu_ns() - c0;
    return NULL;
}

struct cross_fig {
    double prod_allocs_per_s, cons_frees_per_s, wall_per_s;
};

static void run_cross_once(struct cross_arg *pa, struct cross_arg *ca, uint64_t count)
{
    pthread_t tp, tc;
    atomic_store_explicit(&pa->ring->head, 0, memory_order_relaxed);
    atomic_store_explicit(&pa->ring->tail, 0, memory_order_relaxed);
    pa->count = ca->count = count;
    pa->error = ca->error = 0;
    perf_check(pthread_create(&tc, NULL, consumer_main, ca), "pthread_create");
    perf_check(pthread_create(&tp, NULL, producer_main, pa), "pthread_create");
    perf_check(pthread_join(tp, NULL), "pthread_join");
    perf_check(pthread_join(tc, NULL), "pthread_join");
    if (pa->error != 0 || ca->error != 0) {
        fprintf(stderr, "arena_bench: cross: producer %s, consumer %s\n",
                bfc_err_name(pa->error), ca->error ? "a free failed" : "ok");
        exit(1);
    }
}

static int section_cross(const struct params *P)
{
    static struct perf_ring ring;
    struct pair_op *ops = make_ops(P->seed + 3000u, THREAD_SEQ_LEN);
    double cons[MAX_RUNS], prod[MAX_RUNS], wall[MAX_RUNS], shc[MAX_RUNS], shp[MAX_RUNS];
    unsigned runs = P->cross_runs;
    int fail = 0;

    printf("\n== cross: producer allocates on stream A, consumer frees on stream B ==\n");
    printf("  sizes log-uniform %u B .. %u B (cycled sequence of %u, seed %" PRIu64
           "+3000), SPSC ring of %u slots, calls timed in batches of %u\n",
           SIZE_MIN, 1u << SIZE_MAX_LOG2, THREAD_SEQ_LEN, P->seed, PERF_RING_CAP,
           CROSS_BATCH);
    printf("  %" PRIu64 " blocks per run after a warm-up of %" PRIu64
           ", %u runs (fresh context each), median reported\n",
           P->cross_blocks, P->cross_warmup, runs);
    printf("  rates count time inside the library only (waits on the ring excluded);"
           " wall = blocks / elapsed\n");

    for (unsigned r = 0; r < runs; r++) {
        bfc_ctx_t *ctx = make_ctx((size_t)8 << 30);
        struct cross_arg pa, ca;
        bfc_stats_t st;
        uint64_t frees;

        memset(&pa, 0, sizeof(pa));
        memset(&ca, 0, sizeof(ca));
        pa.ctx = ca.ctx = ctx;
        pa.ring = ca.ring = &ring;
        pa.ops = ca.ops = ops;
        pa.stream = make_stream(ctx);
        ca.stream = make_stream(ctx);

        perf_progress("cross: run %u/%u warm-up", r + 1, runs);
        run_cross_once(&pa, &ca, P->cross_warmup);
        frees = ca.count;
        perf_progress("cross: run %u/%u", r + 1, runs);
        run_cross_once(&pa, &ca, P->cross_blocks);
        frees += ca.count;
        shp[r] = pa.cpu_ns / pa.wall_ns;
        shc[r] = ca.cpu_ns / ca.wall_ns;
        prod[r] = (double)pa.count / (pa.busy_ns * 1e-9);
        cons[r] = (double)ca.count / (ca.busy_ns * 1e-9);
        wall[r] = (double)ca.count /
                  ((pa.wall_ns > ca.wall_ns ? pa.wall_ns : ca.wall_ns) * 1e-9);

        must_stats(ctx, &st);
        if (st.num_remote_frees != frees || st.num_frees != frees ||
            st.bytes_in_use != 0 || st.num_allocs != frees) {
            fprintf(stderr, "arena_bench: cross run %u: VERIFY FAILED: frees %" PRIu64
                    ", num_allocs %" PRIu64 ", num_frees %" PRIu64
                    ", num_remote_frees %" PRIu64 ", bytes_in_use %" PRIu64
                    ", num_pending_frees %" PRIu64 "\n", r + 1, frees, st.num_allocs,
                    st.num_frees, st.num_remote_frees, st.bytes_in_use,
                    st.num_pending_frees);
            fail = 1;
        } else if (r == 0) {
            perf_progress_done();
            printf("  verify (run 1): frees %" PRIu64 " == num_remote_frees %" PRIu64
                   ", bytes_in_use %" PRIu64 ", num_pending_frees %" PRIu64
                   ", num_shards %" PRIu64 ": OK\n", frees, st.num_remote_frees,
                   st.bytes_in_use, st.num_pending_frees, st.num_shards);
        }
        bfc_sim_stream_destroy(ctx, pa.stream);
        bfc_sim_stream_destroy(ctx, ca.stream);
        bfc_ctx_destroy(ctx);
    }
    perf_progress_done();

    {
        double mc = median(cons, runs), mp = median(prod, runs), mw = median(wall, runs);
        struct result *r;
        printf("\n  %-36s %14s %14s %14s\n", "", "median /s", "min /s", "max /s");
        printf("  %-36s %14.0f %14.0f %14.0f\n", "consumer cross-stream frees", mc,
               vmin(cons, runs), vmax(cons, runs));
        printf("  %-36s %14.0f %14.0f %14.0f\n", "producer allocs (drains queue)", mp,
               vmin(prod, runs), vmax(prod, runs));
        printf("  %-36s %14.0f %14.0f %14.0f\n", "wall: blocks through the pipeline", mw,
               vmin(wall, runs), vmax(wall, runs));
        printf("  cpu share over the run: producer %.0f%%, consumer %.0f%% (both spin"
               " on the ring, so anything under ~90%% is other load)\n",
               100 * median(shp, runs), 100 * median(shc, runs));
        load_warning(median(shp, runs) < median(shc, runs) ? median(shp, runs)
                                                           : median(shc, runs));
        printf("  verification over all runs: %s\n\n", fail ? "FAILED" : "OK");

        r = add_result("cross", "shardbfc", 2);
        r->ops_per_sec = mc;
        memcpy(r->runs, cons, runs * sizeof(double));
        r->nruns = runs;
        snprintf(r->unit, sizeof(r->unit), "frees_per_sec");
        snprintf(r->extra, sizeof(r->extra),
                 "\"consumers\": 1, \"producers\": 1, \"producer_allocs_per_sec\": %.1f, "
                 "\"wall_blocks_per_sec\": %.1f, \"verified\": %s, "
                 "\"cpu_share_producer\": %.3f, \"cpu_share_consumer\": %.3f", mp, mw,
                 fail ? "false" : "true", median(shp, runs), median(shc, runs));
        add_target("cross: frees/s per consumer", mc, TARGET_CROSS_FREES, false);
    }
    free(ops);
    return fail;
}

/* ------------------------------------------------------------------ json */

static int write_json(const struct params *P, const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "arena_bench: cannot write %s: %s\n", path, strerror(errno));
        return 1;
    }
    fprintf(f, "{\n  \"program\": \"arena_bench\",\n  \"machine\": {\"cores\": %ld, \"cpu\": ",
            mach.cores);
    perf_json_str(f, mach.cpu);
    fprintf(f, ", \"backend\": \"sim\", \"gpu\": null, \"loadavg\": ");
    perf_json_str(f, mach.loadavg);
    fprintf(f, ", \"loadavg_end\": ");
    perf_json_str(f, loadavg_end);
    fprintf(f, ", \"disturbed\": %s", disturbed ? "true" : "false");
    fprintf(f, "},\n  \"parameters\": {\"quick\": %s, \"seed\": %" PRIu64
            ", \"live_blocks\": %u, \"size_min\": %u, \"size_max\": %u"
            ", \"arena_runs\": %u, \"arena_pairs\": %u, \"fragment_blocks\": %u"
            ", \"fragment_min\": %u, \"fragment_max\": %u, \"thread_seconds\": %.3f"
            ", \"thread_runs\": %u, \"lock_scope\": \"%s\", \"cross_runs\": %u"
            ", \"cross_blocks\": %" PRIu64 ", \"cross_warmup\": %" PRIu64 "},\n",
            P->quick ? "true" : "false", P->seed, LIVE_BLOCKS, SIZE_MIN,
            1u << SIZE_MAX_LOG2, P->arena_runs, P->arena_pairs, P->frag_blocks,
            P->frag_min, P->frag_max, P->thread_seconds, P->thread_runs,
            P->lock_per_pair ? "pair" : "call", P->cross_runs, P->cross_blocks,
            P->cross_warmup);
    fprintf(f, "  \"results\": [\n");
    for (unsigned i = 0; i < nresults; i++) {
        const struct result *r = &results[i];
        fprintf(f, "    {\"workload\": \"%s\", \"allocator\": \"%s\", \"threads\": %u, "
                "\"ops_per_sec\": %.1f, \"ns_per_op\": ", r->workload, r->allocator,
                r->threads, r->ops_per_sec);
        if (r->ns_per_op > 0)
            fprintf(f, "%.2f", r->ns_per_op);
        else
            fprintf(f, "null");
        fprintf(f, ", \"p50_ns\": null, \"p99_ns\": null, \"p999_ns\": null, "
                "\"fragmentation\": null, \"unit\": \"%s\", \"runs\": [", r->unit);
        for (unsigned k = 0; k < r->nruns; k++)
            fprintf(f, "%s%.2f", k ? ", " : "", r->runs[k]);
        fprintf(f, "]%s%s}%s\n", r->extra[0] ? ", " : "", r->extra,
                i + 1 < nresults ? "," : "");
    }
    fprintf(f, "  ],\n  \"targets\": [\n");
    for (unsigned i = 0; i < ntargets; i++) {
        const struct target *t = &targets[i];
        fprintf(f, "    {\"name\": ");
        perf_json_str(f, t->name);
        fprintf(f, ", \"value\": %.4f, \"limit\": %.4f, \"op\": \"%s\", \"met\": %s}%s\n",
                t->value, t->limit, t->upper ? "<=" : ">=", t->met ? "true" : "false",
                i + 1 < ntargets ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "arena_bench: writing %s: %s\n", path, strerror(errno));
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ main */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: arena_bench [--quick] [--workload arena,threads,cross]\n"
            "                   [--threads 1,2,4,8] [--seconds S] [--runs N]\n"
            "                   [--lock-scope call|pair] [--seed N] [--json FILE]\n"
            "  --quick        short runs (< 15 s in all)\n"
            "  --workload L   sections to run (default: all three); also --arena,\n"
            "                 --threaded, --cross to pick one each\n"
            "  --threads L    thread counts for the threads section (default 1,2,4,8)\n"
            "  --seconds S    duration of one threads measurement\n"
            "  --runs N       repetitions per figure (all sections)\n"
            "  --lock-scope   single-lock mode: mutex around each call (default, as\n"
            "                 TensorFlow) or once around each alloc+free pair\n"
            "  --seed N       base seed of every sequence (default 42)\n"
            "  --json FILE    write every figure as JSON\n");
}

static bool parse_list(const char *s, struct params *P)
{
    char buf[256], *save = NULL, *tok;
    snprintf(buf, sizeof(buf), "%s", s);
    P->n_nthreads = 0;
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long v = strtol(tok, &end, 10);
        if (*end != '\0' || v < 1 || v > MAX_THREADS || P->n_nthreads == 16)
            return false;
        P->nthreads_list[P->n_nthreads++] = (unsigned)v;
    }
    return P->n_nthreads > 0;
}

static bool parse_workloads(const char *s, struct params *P)
{
    char buf[256], *save = NULL, *tok;
    snprintf(buf, sizeof(buf), "%s", s);
    P->do_arena = P->do_threads = P->do_cross = false;
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (strcmp(tok, "arena") == 0)
            P->do_arena = true;
        else if (strcmp(tok, "threads") == 0)
            P->do_threads = true;
        else if (strcmp(tok, "cross") == 0)
            P->do_cross = true;
        else
            return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    struct params P;
    bool picked = false, have_seconds = false;
    unsigned runs_override = 0;
    double seconds = 0.0, t_start;
    int rc = 0;

    memset(&P, 0, sizeof(P));
    P.seed = 42;
    P.do_arena = P.do_threads = P.do_cross = true;
    P.nthreads_list[0] = 1;
    P.nthreads_list[1] = 2;
    P.nthreads_list[2] = 4;
    P.nthreads_list[3] = 8;
    P.n_nthreads = 4;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--quick") == 0) {
            P.quick = true;
        } else if (strcmp(a, "--arena") == 0 || strcmp(a, "--threaded") == 0 ||
                   strcmp(a, "--cross") == 0) {
            if (!picked)
                P.do_arena = P.do_threads = P.do_cross = false;
            picked = true;
            if (a[2] == 'a')
                P.do_arena = true;
            else if (a[2] == 't')
                P.do_threads = true;
            else
                P.do_cross = true;
        } else if ((strcmp(a, "--workload") == 0 || strcmp(a, "--section") == 0) && v) {
            if (!parse_workloads(v, &P)) {
                usage(stderr);
                return 2;
            }
            picked = true;
            i++;
        } else if (strcmp(a, "--threads") == 0 && v) {
            if (!parse_list(v, &P)) {
                usage(stderr);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--seconds") == 0 && v) {
            seconds = strtod(v, NULL);
            if (!(seconds > 0.0 && seconds < 3600.0)) {
                usage(stderr);
                return 2;
            }
            have_seconds = true;
            i++;
        } else if (strcmp(a, "--runs") == 0 && v) {
            long n = strtol(v, NULL, 10);
            if (n < 1 || n > MAX_RUNS) {
                usage(stderr);
                return 2;
            }
            runs_override = (unsigned)n;
            i++;
        } else if (strcmp(a, "--lock-scope") == 0 && v) {
            if (strcmp(v, "pair") == 0)
                P.lock_per_pair = true;
            else if (strcmp(v, "call") == 0)
                P.lock_per_pair = false;
            else {
                usage(stderr);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--seed") == 0 && v) {
            P.seed = strtoull(v, NULL, 0);
            i++;
        } else if (strcmp(a, "--json") == 0 && v) {
            P.json_path = v;
            i++;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }

    if (P.quick) {
        P.arena_runs = 5;
        P.arena_pairs = 100000;
        P.thread_seconds = 0.5;
        P.thread_runs = 1;
        P.cross_runs = 1;
        P.cross_blocks = 2000000;
        P.cross_warmup = 100000;
    } else {
        P.arena_runs = 11;
        P.arena_pairs = 200000;
        P.thread_seconds = 1.5;
        P.thread_runs = 3;
        P.cross_runs = 3;
        P.cross_blocks = 6000000;
        P.cross_warmup = 500000;
    }
    P.frag_blocks = 200000;
    P.frag_min = 256;
    P.frag_max = 4096;
    if (have_seconds)
        P.thread_seconds = seconds;
    if (runs_override) {
        P.arena_runs = P.thread_runs = P.cross_runs = runs_override;
    }

    perf_progress_init("arena_bench");
    perf_machine_read(&mach);
    t_start = (double)perf_now_ns();

    printf("arena_bench: libshardbfc arena and shard performance, SIM backend\n");
    printf("  machine: %ld online CPUs, %s; loadavg at start: %s\n", mach.cores, mach.cpu,
           mach.loadavg);
    printf("  mode: %s; clock CLOCK_MONOTONIC; nothing pinned\n",
           P.quick ? "--quick" : "default");

    if (P.do_arena && rc == 0)
        rc = section_arena(&P);
    if (P.do_threads && rc == 0)
        rc = section_threads(&P);
    if (P.do_cross && rc == 0)
        rc = section_cross(&P);

    printf("\n== targets ==\n");
    for (unsigned i = 0; i < ntargets; i++)
        printf("  %-56s %14.3f %s %-12.3f %s\n", targets[i].name, targets[i].value,
               targets[i].upper ? "<=" : ">=", targets[i].limit,
               targets[i].met ? "MET" : "NOT MET");
    perf_read_loadavg(loadavg_end, sizeof(loadavg_end));
    printf("  total time %.1f s; loadavg at end: %s\n", ((double)perf_now_ns() - t_start) * 1e-9,
           loadavg_end);
    if (disturbed)
        printf("  NOTE: some figures were taken while other processes held the CPUs"
               " (see the WARNING lines); rerun on a quiet machine before judging targets\n");

    if (P.json_path != NULL && write_json(&P, P.json_path) != 0)
        rc = 1;
    return rc;
}
