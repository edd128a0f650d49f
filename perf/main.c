/*
 * main.c -- perf/shardbfc-perf: libshardbfc against what a user would pick
 * instead, in one run, on the same workloads.
 *
 *   shardbfc-perf [--quick] [--workload churn,cross,inference,host,replay]
 *                 [--threads 1,2,4,8] [--allocators shardbfc,single-lock,
 *                 jemalloc,malloc,cuda,cuda-async,torch] [--seconds S]
 *                 [--backend sim|cuda] [--json FILE] [--svg FILE]
 *                 [--trace FILE] [--seed N]
 *
 * For every workload, thread count and allocator (in that order, so that
 * the allocators of one figure run next to each other in time): prepare the
 * allocator (a fresh libshardbfc context each time), run the measurement
 * (workloads.c), read its peak reservation, release it.  An allocator that
 * cannot run here (no GPU, not built) is listed as skipped with the reason.
 * Every sequence comes from --seed (default 42) and is printed with its
 * parameters.  The performance targets (perf/README.md) are printed (MET /
 * NOT MET), never asserted: the exit status is 1 only when an allocation or a verification
 * fails, 2 on a bad command line.
 */
#define _GNU_SOURCE
#include "perf.h"
#include "perfutil.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define PROG "shardbfc-perf"
#define MAX_RESULTS 1024

enum { W_CHURN, W_CROSS, W_INFER, W_HOST, W_REPLAY, NW };
static const char *const wl_names[NW] = {"churn", "cross", "inference", "host", "replay"};

/* Workload parameters (printed, and written to the JSON). */
#define CHURN_LIVE 512u
#define CHURN_PAIRS 65536u
#define CHURN_MIN 256u
#define CHURN_MAX (4u << 20)
#define CROSS_SIZES 65536u
#define CROSS_MIN 256u
#define CROSS_MAX (1u << 20)
#define HOST_LIVE 256u
#define HOST_MIN 4096u
#define HOST_MAX (4u << 20)

struct opts {
    bool quick;
    bool wl[NW];
    unsigned threads[16], nthreads;
    bool alloc_on[16];
    double seconds;
    bool backend_cuda;
    const char *json, *svg, *trace;
    uint64_t seed;
    unsigned infer_steps;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: " PROG " [--quick] [--workload churn,cross,inference,host,replay]\n"
            "       [--threads 1,2,4,8] [--allocators shardbfc,single-lock,jemalloc,malloc,"
            "cuda,cuda-async,torch]\n"
            "       [--seconds S] [--backend sim|cuda] [--json FILE] [--svg FILE]\n"
            "       [--trace FILE] [--seed N]\n"
            "  --quick       short suite (threads 1,2; 0.2 s windows): under 20 s\n"
            "  --workload    default churn,cross,inference,host (+ replay with --trace)\n"
            "  --threads     thread counts (default 1,2,4,8; at most %d)\n"
            "  --allocators  default: all (those that cannot run here are listed as skipped)\n"
            "  --seconds S   timed window of one measurement (default 1, quick 0.2)\n"
            "  --backend     libshardbfc's backend: sim (default) or cuda\n"
            "  --json FILE   every figure and the machine description as JSON\n"
            "  --svg FILE    chart: churn throughput vs threads, churn latency percentiles\n"
            "  --trace FILE  RMM CSV trace (Thread,Time,Action,Pointer,Size,Stream) for replay\n"
            "  --seed N      base seed of every generated sequence (default 42)\n",
            PERF_MAX_THREADS);
}

static bool parse_workloads(const char *s, struct opts *o)
{
    char buf[256], *save = NULL, *tok;
    if (strlen(s) >= sizeof(buf))
        return false;
    snprintf(buf, sizeof(buf), "%s", s);
    memset(o->wl, 0, sizeof(o->wl));
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned w;
        for (w = 0; w < NW; w++)
            if (strcmp(tok, wl_names[w]) == 0)
                break;
        if (w == NW)
            return false;
        o->wl[w] = true;
    }
    return true;
}

static bool parse_allocators(const char *s, struct opts *o)
{
    char buf[256], *save = NULL, *tok;
    if (strlen(s) >= sizeof(buf))
        return false;
    snprintf(buf, sizeof(buf), "%s", s);
    memset(o->alloc_on, 0, sizeof(o->alloc_on));
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned i;
        for (i = 0; i < perf_n_allocators; i++)
            if (strcmp(tok, perf_allocators[i]->name) == 0)
                break;
        if (i == perf_n_allocators)
            return false;
        o->alloc_on[i] = true;
    }
    return true;
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    bool have_wl = false, have_thr = false, have_sec = false;
    memset(o, 0, sizeof(*o));
    o->seed = 42;
    for (unsigned i = 0; i < perf_n_allocators; i++)
        o->alloc_on[i] = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = true;
        if (strcmp(a, "--quick") == 0) {
            o->quick = true;
            takes = false;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            exit(0);
        } else if (v == NULL) {
            fprintf(stderr, PROG ": %s: unknown option or missing value\n", a);
            return -1;
        } else if (strcmp(a, "--workload") == 0) {
            if (!parse_workloads(v, o)) {
                fprintf(stderr, PROG ": --workload %s: expected churn,cross,inference,host,replay\n", v);
                return -1;
            }
            have_wl = true;
        } else if (strcmp(a, "--threads") == 0) {
            if (!perf_parse_uint_list(v, o->threads, 16, &o->nthreads, PERF_MAX_THREADS)) {
                fprintf(stderr, PROG ": --threads %s: expected a list of 1..%d\n", v,
                        PERF_MAX_THREADS);
                return -1;
            }
            have_thr = true;
        } else if (strcmp(a, "--allocators") == 0) {
            if (!parse_allocators(v, o)) {
                fprintf(stderr, PROG ": --allocators %s: unknown allocator\n", v);
                return -1;
            }
        } else if (strcmp(a, "--seconds") == 0) {
            char *end;
            errno = 0;
            o->seconds = strtod(v, &end);
            if (errno != 0 || *end != '\0' || !(o->seconds > 0) || o->seconds > 3600) {
                fprintf(stderr, PROG ": --seconds %s: expected a number in (0, 3600]\n", v);
                return -1;
            }
            have_sec = true;
        } else if (strcmp(a, "--backend") == 0) {
            if (strcmp(v, "sim") == 0) {
                o->backend_cuda = false;
            } else if (strcmp(v, "cuda") == 0) {
                o->backend_cuda = true;
            } else {
                fprintf(stderr, PROG ": --backend %s: expected sim or cuda\n", v);
                return -1;
            }
        } else if (strcmp(a, "--json") == 0) {
            o->json = v;
        } else if (strcmp(a, "--svg") == 0) {
            o->svg = v;
        } else if (strcmp(a, "--trace") == 0) {
            o->trace = v;
        } else if (strcmp(a, "--seed") == 0) {
            char *end;
            errno = 0;
            o->seed = strtoull(v, &end, 10);
            if (errno != 0 || *end != '\0' || end == v) {
                fprintf(stderr, PROG ": --seed %s: expected an unsigned integer\n", v);
                return -1;
            }
        } else {
            fprintf(stderr, PROG ": %s: unknown option\n", a);
            return -1;
        }
        if (takes)
            i++;
    }
    if (!have_wl) {
        o->wl[W_CHURN] = o->wl[W_CROSS] = o->wl[W_INFER] = o->wl[W_HOST] = true;
        o->wl[W_REPLAY] = o->trace != NULL;
    }
    if (o->wl[W_REPLAY] && o->trace == NULL) {
        fprintf(stderr, PROG ": --workload replay needs --trace FILE\n");
        return -1;
    }
    if (!have_thr) {
        static const unsigned def[] = {1, 2, 4, 8};
        o->nthreads = o->quick ? 2 : 4;
        memcpy(o->threads, def, o->nthreads * sizeof(unsigned));
    }
    if (!have_sec)
        o->seconds = o->quick ? 0.2 : 1.0;
    o->infer_steps = o->quick ? 96 : 256;
    return 0;
}

/* ----------------------------------------------------------------- state */

static struct perf_result results[MAX_RESULTS];
static struct perf_skip skips[MAX_RESULTS];
static struct perf_target targets[32];
static unsigned nresults, nskips, ntargets;

static void add_skip(const char *wl, const char *alloc, const char *why)
{
    /* One line per (workload, allocator): later thread counts add nothing. */
    for (unsigned i = 0; i < nskips; i++)
        if (strcmp(skips[i].workload, wl) == 0 && strcmp(skips[i].allocator, alloc) == 0)
            return;
    if (nskips == MAX_RESULTS)
        return;
    snprintf(skips[nskips].workload, sizeof(skips[nskips].workload), "%s", wl);
    snprintf(skips[nskips].allocator, sizeof(skips[nskips].allocator), "%s", alloc);
    snprintf(skips[nskips].reason, sizeof(skips[nskips].reason), "%s", why);
    printf("  skipped: %-11s %-10s %s\n", alloc, wl, why);
    nskips++;
}

static void add_target(const char *name, double value, bool measured, double limit,
                       bool upper)
{
    struct perf_target *t;
    if (ntargets == sizeof(targets) / sizeof(targets[0]))
        return;
    t = &targets[ntargets++];
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->value = value;
    t->measured = measured;
    t->limit = limit;
    t->upper = upper;
    t->met = measured && (upper ? value <= limit : value >= limit);
}

/* Programs of one workload, one per thread (built lazily, kept for all
 * allocators so every allocator sees the same events). */
struct progs {
    struct perf_prog *p[PERF_MAX_THREADS];
    unsigned n;
};

static void progs_free(struct progs *ps)
{
    for (unsigned i = 0; i < ps->n; i++) {
        if (ps->p[i] != NULL) {
            perf_prog_free(ps->p[i]);
            free(ps->p[i]);
        }
    }
    memset(ps, 0, sizeof(*ps));
}

static int progs_make(struct progs *ps, int wl, const struct opts *o, unsigned n,
                      struct perf_prog *replay)
{
    for (unsigned t = ps->n; t < n; t++) {
        struct perf_prog *p = perf_xcalloc(1, sizeof(*p));
        switch (wl) {
        case W_CHURN:
            perf_gen_churn(o->seed + 1000u + t, CHURN_LIVE, CHURN_PAIRS, CHURN_MIN, CHURN_MAX, p);
            break;
        case W_HOST:
            perf_gen_churn(o->seed + 4000u + t, HOST_LIVE, CHURN_PAIRS, HOST_MIN, HOST_MAX, p);
            break;
        case W_INFER:
            perf_gen_inference(&perf_llama2_7b, o->seed + 3000u + t, o->infer_steps, p, NULL,
                               NULL);
            break;
        case W_REPLAY:
            /* Every thread replays its own copy of the same trace. */
            *p = *replay;
            p->pro = NULL;
            p->ev = perf_xmalloc(replay->nev * sizeof(*p->ev));
            memcpy(p->ev, replay->ev, replay->nev * sizeof(*p->ev));
            break;
        default:
            free(p);
            return -1;
        }
        ps->p[t] = p;
        ps->n = t + 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ main */

static void print_params(const struct opts *o, const struct perf_prog *replay, char *pj,
                         size_t pjlen)
{
    const struct perf_model *m = &perf_llama2_7b;
    printf("parameters: seed %" PRIu64 ", timed window %.2f s after a %.2f s warm-up, threads",
           o->seed, o->seconds, o->seconds * 0.2 < 0.05 ? 0.05 : o->seconds * 0.2);
    for (unsigned i = 0; i < o->nthreads; i++)
        printf("%s%u", i ? "," : " ", o->threads[i]);
    printf("\n");
    if (o->wl[W_CHURN])
        printf("  churn:     per thread %u live blocks, log-uniform %u B .. %u MiB, %u pairs"
               " (free a random slot, allocate into it) cycled; seed %" PRIu64 "+1000+thread;"
               " one stream per thread\n", CHURN_LIVE, CHURN_MIN, CHURN_MAX >> 20, CHURN_PAIRS,
               o->seed);
    if (o->wl[W_CROSS])
        printf("  cross:     threads/2 producer->consumer pairs over SPSC rings of %u slots;"
               " producer allocates on its stream, consumer frees on its own (1 thread:"
               " alloc on stream A, free on B); sizes log-uniform %u B .. %u MiB, %u cycled,"
               " seed %" PRIu64 "+2\n", PERF_RING_CAP, CROSS_MIN, CROSS_MAX >> 20, CROSS_SIZES,
               o->seed);
    if (o->wl[W_INFER])
        printf("  inference: %s; paged KV cache, %u-token blocks per layer (%" PRIu64
               " B each); one serving stream per thread; groups of 1..%u requests arrive"
               " with p=%.2f per step, prompts log-uniform %u..%u tokens, outputs uniform"
               " %u..%u tokens, at most %u decoding together; %u steps of arrivals then"
               " drain, cycled; seed %" PRIu64 "+3000+thread\n", m->name, m->kv_block_tokens,
               perf_model_kv_block(m), m->group_max, m->arrival_p, m->prompt_min,
               m->prompt_max, m->output_min, m->output_max, m->max_batch, o->infer_steps,
               o->seed);
    if (o->wl[W_HOST])
        printf("  host:      host buffers, per thread (pinned to CPU thread %% cores) %u live"
               " blocks, log-uniform %u KiB .. %u MiB, %u pairs cycled; seed %" PRIu64
               "+4000+thread; shardbfc = bfc_host_alloc/bfc_host_free\n", HOST_LIVE,
               HOST_MIN >> 10, HOST_MAX >> 20, CHURN_PAIRS, o->seed);
    if (o->wl[W_REPLAY] && replay != NULL)
        printf("  replay:    %s: %zu events, %u slots, %u streams; each thread replays its own"
               " copy in shardbfc-replay's order (time order when each thread's rows are)\n",
               o->trace, replay->nev, replay->nslots, replay->nstreams);
    snprintf(pj, pjlen,
             "\"quick\": %s, \"seed\": %" PRIu64 ", \"seconds\": %.3f, "
             "\"churn\": {\"live\": %u, \"size_min\": %u, \"size_max\": %u, \"pairs\": %u}, "
             "\"cross\": {\"ring\": %u, \"size_min\": %u, \"size_max\": %u, \"sizes\": %u}, "
             "\"inference\": {\"model\": \"Llama-2-7B\", \"hidden\": %u, \"heads\": %u, "
             "\"kv_heads\": %u, \"layers\": %u, \"intermediate\": %u, \"vocab\": %u, "
             "\"dtype_bytes\": %u, \"kv_block_tokens\": %u, \"max_batch\": %u, "
             "\"prompt_min\": %u, \"prompt_max\": %u, \"output_min\": %u, \"output_max\": %u, "
             "\"arrival_p\": %.3f, \"group_max\": %u, \"steps\": %u}, "
             "\"host\": {\"live\": %u, \"size_min\": %u, \"size_max\": %u, \"pairs\": %u}",
             o->quick ? "true" : "false", o->seed, o->seconds, CHURN_LIVE, CHURN_MIN,
             CHURN_MAX, CHURN_PAIRS, PERF_RING_CAP, CROSS_MIN, CROSS_MAX, CROSS_SIZES,
             m->hidden, m->heads, m->kv_heads, m->layers, m->intermediate, m->vocab,
             m->dtype_bytes, m->kv_block_tokens, m->max_batch, m->prompt_min, m->prompt_max,
             m->output_min, m->output_max, m->arrival_p, m->group_max, o->infer_steps,
             HOST_LIVE, HOST_MIN, HOST_MAX, CHURN_PAIRS);
}

static int write_file(const char *path, int (*fn)(const struct perf_report *, FILE *),
                      const struct perf_report *rp)
{
    FILE *f = fopen(path, "w");
    int rc;
    if (f == NULL) {
        fprintf(stderr, PROG ": cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    rc = fn(rp, f);
    if (fclose(f) != 0 || rc != 0) {
        fprintf(stderr, PROG ": writing %s failed\n", path);
        return -1;
    }
    return 0;
}

static void report_targets(const struct perf_report *rp, const struct opts *o)
{
    char name[96];
    const struct perf_result *s, *l;
    (void)o;
    s = perf_report_find(rp, "churn", "shardbfc", 2);
    l = perf_report_find(rp, "churn", "single-lock", 2);
    add_target("churn 2 threads: shardbfc / single-lock ops/s",
               s && l && l->ops_per_sec > 0 ? s->ops_per_sec / l->ops_per_sec : 0, s && l, 2.0,
               false);
    add_target("churn 2 threads: shardbfc p99 ns", s ? (double)s->p99_ns : 0, s != NULL,
               1000.0, true);
    for (unsigned k = 0; k < o->nthreads; k++) {
        s = perf_report_find(rp, "cross", "shardbfc", o->threads[k]);
        if (s == NULL)
            continue;
        snprintf(name, sizeof(name), "cross %u thread%s: frees/s per consumer", o->threads[k],
                 o->threads[k] == 1 ? "" : "s");
        add_target(name, s->frees_per_sec_per_consumer, true, 5e6, false);
    }
    for (unsigned k = 0; k < o->nthreads; k++) {
        s = perf_report_find(rp, "inference", "shardbfc", o->threads[k]);
        l = perf_report_find(rp, "inference", "single-lock", o->threads[k]);
        if (s == NULL)
            continue;
        if (l != NULL && l->have_mem)
            snprintf(name, sizeof(name), "inference %u thr: shardbfc fragmentation"
                     " (single-lock %.3f)", o->threads[k], l->fragmentation);
        else
            snprintf(name, sizeof(name), "inference %u thr: shardbfc fragmentation",
                     o->threads[k]);
        add_target(name, s->fragmentation, s->have_mem, 1.15, true);
    }
    /* On the CUDA backend, against the device allocators a server would use
     * instead: an alloc+free pair of the churn workload (ops/s ratios are
     * pair-rate ratios), and libshardbfc's scaling to 16 threads. */
    if (o->backend_cuda) {
        const struct perf_result *one = perf_report_find(rp, "churn", "shardbfc", 1);
        const struct perf_result *x;
        x = perf_report_find(rp, "churn", "cuda-async", 1);
        add_target("cuda churn 1 thread: shardbfc / cudaMallocAsync pairs/s",
                   one && x && x->ops_per_sec > 0 ? one->ops_per_sec / x->ops_per_sec : 0,
                   one && x, 10.0, false);
        x = perf_report_find(rp, "churn", "torch", 1);
        add_target("cuda churn 1 thread: shardbfc / PyTorch pairs/s",
                   one && x && x->ops_per_sec > 0 ? one->ops_per_sec / x->ops_per_sec : 0,
                   one && x, 5.0, false);
        x = perf_report_find(rp, "churn", "shardbfc", 16);
        add_target("cuda churn: shardbfc 16 threads / 1 thread pairs/s",
                   one && x && one->ops_per_sec > 0 ? x->ops_per_sec / one->ops_per_sec : 0,
                   one && x, 12.0, false);
    }
}

int main(int argc, char **argv)
{
    struct opts o;
    struct perf_env env;
    struct perf_machine mach;
    struct perf_report rp;
    struct perf_prog replay;
    uint64_t *cross_sizes = NULL;
    unsigned total = 0, done = 0;
    uint64_t t_start;
    int status = 0;

    perf_progress_init(PROG);
    if (parse_args(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    memset(&replay, 0, sizeof(replay));
    if (o.wl[W_REPLAY]) {
        char err[256];
        if (perf_gen_replay(o.trace, &replay, err, sizeof(err)) != 0) {
            fprintf(stderr, PROG ": %s\n", err);
            return 2;
        }
    }
    perf_machine_read(&mach);
    perf_env_probe(&env, o.backend_cuda);
    setvbuf(stdout, NULL, _IOLBF, 0);

    printf("shardbfc-perf: libshardbfc against the alternatives, same workloads, same run\n");
    printf("machine: %ld cores, %s; backend %s; GPU: %s\n", mach.cores, mach.cpu,
           o.backend_cuda ? "cuda" : "sim", env.gpu ? env.gpu_name : env.no_gpu_reason);
    printf("load average at start: %s\n", mach.loadavg);
    printf("allocators:\n");
    for (unsigned i = 0; i < perf_n_allocators; i++)
        if (o.alloc_on[i])
            printf("  %-12s %s\n", perf_allocators[i]->name, perf_allocators[i]->desc);
    print_params(&o, o.wl[W_REPLAY] ? &replay : NULL, rp.params_json, sizeof(rp.params_json));
    printf("measures: ops/s = allocation and free calls of all threads per second of the"
           " window; latency per call from per-thread log-linear histograms (1 clock read"
           " per call, ~20 ns included); fragmentation = peak bytes reserved / peak bytes"
           " requested (null where the allocator cannot say)\n");

    if (o.wl[W_CROSS]) {
        uint64_t s = o.seed + 2;
        cross_sizes = perf_xmalloc(CROSS_SIZES * sizeof(*cross_sizes));
        for (unsigned i = 0; i < CROSS_SIZES; i++)
            cross_sizes[i] = perf_rng_logu(&s, CROSS_MIN, CROSS_MAX);
    }
    for (int w = 0; w < NW; w++)
        if (o.wl[w])
            for (unsigned i = 0; i < perf_n_allocators; i++)
                total += o.alloc_on[i] ? o.nthreads : 0;

    t_start = perf_now_ns();
    for (int w = 0; w < NW; w++) {
        struct progs ps;
        if (!o.wl[w])
            continue;
        memset(&ps, 0, sizeof(ps));
        printf("\n== %s ==\n", wl_names[w]);
        for (unsigned k = 0; k < o.nthreads; k++) {
            unsigned n = o.threads[k];
            struct perf_prog cross1;
            bool have_cross1 = false;
            if (w != W_CROSS) {
                if (progs_make(&ps, w, &o, n, &replay) != 0)
                    return 1;
            } else if (n == 1) {
                perf_gen_cross1(cross_sizes, CROSS_SIZES, &cross1);
                have_cross1 = true;
            }
            for (unsigned i = 0; i < perf_n_allocators; i++) {
                const struct perf_alloc_ops *ops = perf_allocators[i];
                struct perf_allocator a;
                struct perf_run_cfg cfg;
                struct perf_result *r;
                unsigned nstreams;
                const char *why;
                double el;
                uint64_t used = 0;
                int rc;
                if (!o.alloc_on[i])
                    continue;
                done++;
                el = (double)(perf_now_ns() - t_start) * 1e-9;
                perf_progress("%s, %u thread%s, %s (%u/%u, %.0f s elapsed)", wl_names[w], n,
                              n == 1 ? "" : "s", ops->name, done, total, el);
                memset(&a, 0, sizeof(a));
                a.ops = ops;
                if (w == W_CROSS)
                    nstreams = n == 1 ? 2 : 2 * (n / 2);
                else
                    nstreams = n * ps.p[0]->nstreams;
                why = ops->init(&a, &env, w == W_HOST ? PERF_MEM_HOST : PERF_MEM_DEVICE,
                                nstreams);
                if (why != NULL) {
                    perf_progress_done();
                    add_skip(wl_names[w], ops->name, why);
                    ops->fini(&a);
                    continue;
                }
                if (nresults == MAX_RESULTS) {
                    ops->fini(&a);
                    continue;
                }
                r = &results[nresults++];
                memset(r, 0, sizeof(*r));
                snprintf(r->workload, sizeof(r->workload), "%s", wl_names[w]);
                snprintf(r->allocator, sizeof(r->allocator), "%s", ops->name);
                cfg.seconds = o.seconds;
                cfg.warmup_seconds = o.seconds * 0.2 < 0.05 ? 0.05 : o.seconds * 0.2;
                cfg.threads = n;
                cfg.pin = w == W_HOST;
                if (w == W_CROSS && n > 1) {
                    rc = perf_run_cross(&a, cross_sizes, CROSS_SIZES, &cfg, r);
                } else if (w == W_CROSS) {
                    struct perf_prog *one = &cross1;
                    rc = perf_run_prog(&a, &one, &cfg, r);
                } else {
                    rc = perf_run_prog(&a, ps.p, &cfg, r);
                }
                if (rc != 0)
                    status = 1;
                r->have_mem = ops->stats(&a, &r->peak_reserved) && r->peak_requested > 0;
                r->fragmentation =
                    r->have_mem ? (double)r->peak_reserved / (double)r->peak_requested : 0.0;
                if (ops->in_use(&a, &used) && used != 0) {
                    perf_progress_done();
                    printf("  VERIFY FAILED: %s %s %u threads: %" PRIu64
                           " bytes still in use after every block was freed\n", wl_names[w],
                           ops->name, n, used);
                    status = 1;
                }
                ops->fini(&a);
            }
            if (have_cross1)
                perf_prog_free(&cross1);
        }
        progs_free(&ps);
        perf_progress_done();
        {
            struct perf_report tab;
            memset(&tab, 0, sizeof(tab));
            tab.res = results;
            tab.nres = nresults;
            perf_report_table(&tab, wl_names[w], stdout);
        }
        if (w == W_CROSS) {
            for (unsigned i = 0; i < nresults; i++)
                if (strcmp(results[i].workload, "cross") == 0)
                    printf("  cross %-12s %u thr: %.2fM frees/s per consumer (time inside"
                           " free only; %u consumer%s)\n", results[i].allocator,
                           results[i].threads, results[i].frees_per_sec_per_consumer / 1e6,
                           results[i].consumers, results[i].consumers == 1 ? "" : "s");
        }
    }
    perf_progress_done();

    /* The report. */
    {
        char pj[sizeof(rp.params_json)];
        memcpy(pj, rp.params_json, sizeof(pj));
        memset(&rp, 0, sizeof(rp));
        memcpy(rp.params_json, pj, sizeof(pj));
    }
    rp.program = PROG;
    rp.cores = mach.cores;
    snprintf(rp.cpu, sizeof(rp.cpu), "%s", mach.cpu);
    rp.backend = o.backend_cuda ? "cuda" : "sim";
    rp.gpu = env.gpu ? env.gpu_name : NULL;
    snprintf(rp.loadavg, sizeof(rp.loadavg), "%s", mach.loadavg);
    perf_read_loadavg(rp.loadavg_end, sizeof(rp.loadavg_end));
    rp.malloc_note = "glibc malloc measured through __libc_malloc/__libc_free: this program "
                     "links jemalloc, which replaces malloc() process-wide";
    rp.res = results;
    rp.nres = nresults;
    rp.skip = skips;
    rp.nskip = nskips;
    report_targets(&rp, &o);
    rp.tgt = targets;
    rp.ntgt = ntargets;

    printf("\n== targets (reported, not asserted) ==\n");
    for (unsigned i = 0; i < ntargets; i++) {
        const struct perf_target *t = &targets[i];
        if (t->measured)
            printf("  %-62s %12.3f %s %-10.3g %s\n", t->name, t->value, t->upper ? "<=" : ">=",
                   t->limit, t->met ? "MET" : "NOT MET");
        else
            printf("  %-62s %12s %s %-10.3g not measured in this run\n", t->name, "-",
                   t->upper ? "<=" : ">=", t->limit);
    }
    printf("load average at end: %s (start: %s); %.1f s in all\n", rp.loadavg_end, rp.loadavg,
           (double)(perf_now_ns() - t_start) * 1e-9);
    if (o.json != NULL && write_file(o.json, perf_report_json, &rp) != 0)
        status = 1;
    if (o.svg != NULL && write_file(o.svg, perf_report_svg, &rp) != 0)
        status = 1;
    if (o.json != NULL)
        printf("JSON: %s\n", o.json);
    if (o.svg != NULL)
        printf("SVG: %s\n", o.svg);

    for (unsigned i = 0; i < nresults; i++)
        free(results[i].hist);
    free(cross_sizes);
    if (o.wl[W_REPLAY])
        perf_prog_free(&replay);
    return status;
}
