/*
 * main.c -- perf/shardbfc-perf: libshardbfc against what a user would pick
 * instead, in one run, on the same workloads.
 *
 *   shardbfc-perf [--quick] [--workload churn,cross,inference,host,arena,
 *                 arena-frag,replay] [--threads 1,2,4,8]
 *                 [--allocators shardbfc,shardbfc-ctx,single-lock,jemalloc,
 *                 malloc,cuda,cuda-async,torch] [--contexts shared|per-thread|both]
 *                 [--seconds S] [--runs N] [--baseline alu,mem,ports|none]
 *                 [--lock-scope call|pair] [--backend sim|cuda]
 *                 [--json FILE] [--svg FILE] [--trace FILE] [--seed N]
 *
 * For every workload and thread count: time the machine's own capacity at
 * that thread count (the baselines: a pure ALU loop, optionally a loop over
 * 1 MiB per thread and one on eight chains per thread), then for every allocator (in that order, so that the
 * figures of one thread count run next to each other in time) prepare it
 * (fresh libshardbfc contexts each time), run the measurement
 * (workloads.c), read its peak reservation, check its own counters against
 * the calls made, release it; with --runs N all of that N times,
 * interleaved, and the median run kept.  An allocator that cannot run here
 * (no GPU, not built) is listed as skipped with the reason.  The scaling
 * figures (speed-up over one thread, the ALU loop's, their ratio: the
 * efficiency) come from the rows of one run (report.c).  Every sequence
 * comes from --seed (default 42) and is printed with its parameters.  The
 * performance targets (perf/README.md) are printed (MET / NOT MET), never
 * asserted: the exit status is 1 only when an allocation or a verification
 * fails, 2 on a bad command line.
 */
#define _GNU_SOURCE
#include "perf.h"
#include "perfutil.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PROG "shardbfc-perf"
#define MAX_RESULTS 1024

enum { W_CHURN, W_CROSS, W_INFER, W_HOST, W_ARENA, W_FRAG, W_REPLAY, NW };
static const char *const wl_names[NW] = {"churn", "cross", "inference", "host",
                                         "arena", "arena-frag", "replay"};

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
/* arena: the pair of one arena, no clock read per call */
#define ARENA_LIVE 1000u
#define ARENA_MIN 256u
#define ARENA_MAX (1u << 20)
#define ARENA_PAIRS 65536u
/* arena-frag: the same after FRAG_BLOCKS / 2 free fragments per thread */
#define FRAG_BLOCKS 200000u
#define FRAG_MIN 256u
#define FRAG_MAX 4096u

enum contexts { CTX_SHARED, CTX_PER_THREAD, CTX_BOTH };
static const char *const ctx_names[] = {"shared", "per-thread", "both"};

struct opts {
    bool quick;
    bool wl[NW];
    unsigned threads[16], nthreads;
    bool alloc_on[16];
    double seconds;
    unsigned runs;
    enum contexts contexts;
    bool base_on[PERF_BASE_N];
    bool lock_pair;
    bool backend_cuda;
    const char *conf;
    unsigned sim_vmm_cost; /* --sim-vmm-cost: ns per granule, 0 = off */
    double warmup;         /* --warmup: seconds, or -1: 20% of the window (at least 50 ms) */
    const char *json, *svg, *trace;
    uint64_t seed;
    unsigned infer_steps;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: " PROG " [--quick] [--workload churn,cross,inference,host,arena,arena-frag,"
            "replay]\n"
            "       [--threads 1,2,4,8] [--allocators shardbfc,shardbfc-ctx,single-lock,"
            "jemalloc,malloc,cuda,cuda-async,torch]\n"
            "       [--contexts shared|per-thread|both] [--seconds S] [--runs N]\n"
            "       [--baseline alu,mem,ports|none] [--lock-scope call|pair] [--backend sim|cuda]\n"
            "       [--warmup S] [--conf SPEC] [--sim-vmm-cost NS] [--json FILE] [--svg FILE] [--trace FILE] [--seed N]\n"
            "  --quick       short suite (threads 1,2; 0.2 s windows): under 30 s\n"
            "  --workload    default churn,cross,inference,host,arena (+ replay with"
            " --trace);\n"
            "                arena-frag only when named\n"
            "  --threads     thread counts (default 1,2,4,8; at most %d)\n"
            "  --allocators  default: all but shardbfc-ctx (those that cannot run here are"
            " listed as skipped)\n"
            "  --contexts    libshardbfc with one context for all threads (shared, default:"
            " shardbfc),\n"
            "                one per thread (per-thread: shardbfc-ctx instead), or both\n"
            "  --seconds S   timed window of one measurement (default 1, quick 0.2)\n"
            "  --warmup S    the same loop, untimed, before each window (default a fifth of it,\n"
            "                at least 0.05; on a device, growth to the peak can take longer)\n"
            "  --runs N      repetitions of every figure, interleaved; the median is kept"
            " (default 1, at most %d)\n"
            "  --baseline    the machine's own scaling, timed beside each thread count: alu"
            " (default),\n"
            "                mem (1 MiB per thread), ports (eight chains per thread: shows\n"
            "                CPUs that share a core), a list of them, both (alu,mem) or none\n"
            "  --lock-scope  single-lock on the arena workloads: the mutex around each call"
            " (default)\n"
            "                or once around each free+allocation pair\n"
            "  --backend     libshardbfc's backend: sim (default) or cuda\n"
            "  --conf SPEC   libshardbfc's configuration on top of the harness's"
            " (SHARDBFC_CONF syntax, e.g. vmm=off)\n"
            "  --sim-vmm-cost NS  SIM: model a driver's virtual-memory calls, NS per granule mapped or\n"
            "                unmapped, one call at a time process-wide (a GPU: tens of us; default 0)\n"
            "  --json FILE   every figure and the machine description as JSON\n"
            "  --svg FILE    chart: churn throughput vs threads, churn latency percentiles\n"
            "  --trace FILE  RMM CSV trace (Thread,Time,Action,Pointer,Size,Stream) for replay\n"
            "  --seed N      base seed of every generated sequence (default 42)\n",
            PERF_MAX_THREADS, PERF_MAX_RUNS);
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

static bool parse_baselines(const char *s, struct opts *o)
{
    char buf[64], *save = NULL, *tok;
    if (strlen(s) >= sizeof(buf))
        return false;
    snprintf(buf, sizeof(buf), "%s", s);
    memset(o->base_on, 0, sizeof(o->base_on));
    if (strcmp(s, "none") == 0)
        return true;
    if (strcmp(s, "both") == 0) { /* as --help says: alu and mem */
        o->base_on[PERF_BASE_ALU] = o->base_on[PERF_BASE_MEM] = true;
        return true;
    }
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned k;
        for (k = 0; k < PERF_BASE_N; k++)
            if (strcmp(tok, perf_base_names[k]) == 0)
                break;
        if (k == PERF_BASE_N)
            return false;
        o->base_on[k] = true;
    }
    return true;
}

static unsigned alloc_index(const char *name)
{
    for (unsigned i = 0; i < perf_n_allocators; i++)
        if (strcmp(perf_allocators[i]->name, name) == 0)
            return i;
    return perf_n_allocators;
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    bool have_wl = false, have_thr = false, have_sec = false, have_alloc = false;
    unsigned ictx = alloc_index("shardbfc-ctx"), ibfc = alloc_index("shardbfc");
    memset(o, 0, sizeof(*o));
    o->seed = 42;
    o->runs = 1;
    o->warmup = -1;
    o->base_on[PERF_BASE_ALU] = true;
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
                fprintf(stderr, PROG ": --workload %s: expected churn,cross,inference,host,"
                        "arena,arena-frag,replay\n", v);
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
            have_alloc = true;
        } else if (strcmp(a, "--contexts") == 0) {
            unsigned k;
            for (k = 0; k < 3; k++)
                if (strcmp(v, ctx_names[k]) == 0)
                    break;
            if (k == 3) {
                fprintf(stderr, PROG ": --contexts %s: expected shared, per-thread or both\n",
                        v);
                return -1;
            }
            o->contexts = (enum contexts)k;
        } else if (strcmp(a, "--seconds") == 0) {
            char *end;
            errno = 0;
            o->seconds = strtod(v, &end);
            if (errno != 0 || *end != '\0' || !(o->seconds > 0) || o->seconds > 3600) {
                fprintf(stderr, PROG ": --seconds %s: expected a number in (0, 3600]\n", v);
                return -1;
            }
            have_sec = true;
        } else if (strcmp(a, "--warmup") == 0) {
            char *end;
            errno = 0;
            o->warmup = strtod(v, &end);
            if (errno != 0 || *end != '\0' || end == v || !(o->warmup >= 0) || o->warmup > 3600) {
                fprintf(stderr, PROG ": --warmup %s: expected a number in [0, 3600]\n", v);
                return -1;
            }
        } else if (strcmp(a, "--runs") == 0) {
            unsigned n = 0, one[1];
            if (!perf_parse_uint_list(v, one, 1, &n, PERF_MAX_RUNS)) {
                fprintf(stderr, PROG ": --runs %s: expected a number in 1..%d\n", v,
                        PERF_MAX_RUNS);
                return -1;
            }
            o->runs = one[0];
        } else if (strcmp(a, "--baseline") == 0) {
            if (!parse_baselines(v, o)) {
                fprintf(stderr, PROG ": --baseline %s: expected alu, mem, ports, a comma list of them (both is alu,mem) or none\n",
                        v);
                return -1;
            }
        } else if (strcmp(a, "--lock-scope") == 0) {
            if (strcmp(v, "call") == 0) {
                o->lock_pair = false;
            } else if (strcmp(v, "pair") == 0) {
                o->lock_pair = true;
            } else {
                fprintf(stderr, PROG ": --lock-scope %s: expected call or pair\n", v);
                return -1;
            }
        } else if (strcmp(a, "--backend") == 0) {
            if (strcmp(v, "sim") == 0) {
                o->backend_cuda = false;
            } else if (strcmp(v, "cuda") == 0) {
                o->backend_cuda = true;
            } else {
                fprintf(stderr, PROG ": --backend %s: expected sim or cuda\n", v);
                return -1;
            }
        } else if (strcmp(a, "--conf") == 0) {
            bfc_config_t probe;
            bfc_config_init(&probe);
            if (bfc_config_parse(&probe, v) != BFC_OK) {
                fprintf(stderr, PROG ": --conf %s: not a libshardbfc configuration\n", v);
                return -1;
            }
            o->conf = v;
        } else if (strcmp(a, "--sim-vmm-cost") == 0) {
            char *end;
            unsigned long ns;
            errno = 0;
            ns = strtoul(v, &end, 10);
            if (errno != 0 || *end != '\0' || end == v || v[0] == '-' || ns > 10000000ul) {
                fprintf(stderr, PROG ": --sim-vmm-cost %s: expected nanoseconds, 0 to 10000000\n", v);
                return -1;
            }
            o->sim_vmm_cost = (unsigned)ns;
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
            if (errno != 0 || *end != '\0' || end == v || !isdigit((unsigned char)v[0])) { /* strtoull takes "-1" */
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
    if (!have_alloc) {
        /* All, but one context per thread only when asked for. */
        for (unsigned i = 0; i < perf_n_allocators; i++)
            o->alloc_on[i] = i != ictx;
    }
    if (o->contexts == CTX_PER_THREAD && o->alloc_on[ibfc]) {
        o->alloc_on[ibfc] = false;
        o->alloc_on[ictx] = true;
    } else if (o->contexts == CTX_BOTH && o->alloc_on[ibfc]) {
        o->alloc_on[ictx] = true;
    }
    /* What runs, however it was asked for (--allocators names them too). */
    if (o->alloc_on[ibfc] && o->alloc_on[ictx])
        o->contexts = CTX_BOTH;
    else if (o->alloc_on[ictx])
        o->contexts = CTX_PER_THREAD;
    else
        o->contexts = CTX_SHARED;
    if (!have_wl) {
        /* arena-frag only when asked for: the fragment prologue costs each
         * allocator seconds (glibc's malloc most), not the window. */
        for (int w = 0; w < NW; w++)
            o->wl[w] = w != W_REPLAY && w != W_FRAG;
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
static struct perf_base bases[MAX_RESULTS];
static struct perf_skip skips[MAX_RESULTS];
static struct perf_target targets[48];
static unsigned nresults, nbases, nskips, ntargets;

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
    printf("  skipped: %-12s %-10s %s\n", alloc, wl, why);
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
    measured = measured && isfinite(value);
    t->value = measured ? value : 0;
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
        case W_ARENA:
        case W_FRAG:
            /* arena-frag cycles the very events of arena: only the
             * fragments in front differ. */
            perf_gen_churn(o->seed + 5000u + t, ARENA_LIVE, ARENA_PAIRS, ARENA_MIN, ARENA_MAX,
                           p);
            if (wl == W_FRAG)
                perf_gen_fragments(p, o->seed + 6000u + t, FRAG_BLOCKS, FRAG_MIN, FRAG_MAX);
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

static double warmup_of(double seconds)
{
    return seconds * 0.2 < 0.05 ? 0.05 : seconds * 0.2;
}

/* The baselines' window: a quarter of the allocators' (at least 50 ms). */
static double base_seconds_of(double seconds)
{
    return seconds / 4 < 0.05 ? 0.05 : seconds / 4;
}

static void print_params(const struct opts *o, const struct perf_prog *replay, char *pj,
                         size_t pjlen)
{
    const struct perf_model *m = &perf_llama2_7b;
    double bs = base_seconds_of(o->seconds);
    char bl[32] = "";
    printf("parameters: seed %" PRIu64 ", timed window %.2f s after a %.2f s warm-up, threads",
           o->seed, o->seconds, o->warmup >= 0 ? o->warmup : warmup_of(o->seconds));
    for (unsigned i = 0; i < o->nthreads; i++)
        printf("%s%u", i ? "," : " ", o->threads[i]);
    printf("; %u run%s per figure%s; libshardbfc contexts: %s%s%s\n", o->runs,
           o->runs == 1 ? "" : "s", o->runs > 1 ? " (interleaved, median kept)" : "",
           ctx_names[o->contexts], o->conf ? "; libshardbfc configuration: " : "",
           o->conf ? o->conf : "");
    if (o->sim_vmm_cost && !o->backend_cuda)
        printf("  SIM driver model: %u ns per granule mapped or unmapped, one call at a time"
               " across the process, its thread on a CPU\n", o->sim_vmm_cost);
    for (unsigned k = 0; k < PERF_BASE_N; k++)
        if (o->base_on[k])
            snprintf(bl + strlen(bl), sizeof(bl) - strlen(bl), "%s\"%s\"", bl[0] ? ", " : "",
                     perf_base_names[k]);
    if (bl[0]) {
        static const char *const what[PERF_BASE_N] = {
            "alu = a register-only chain of integer multiply, add, shift, xor per thread",
            "mem = a word of every 64-byte line of 1 MiB per thread, read and written",
            ("ports = alu's step on eight independent chains per thread (as fast as a core"
             " issues them: CPUs sharing a core gain less here than in alu)"),
        };
        const char *sep = "";
        printf("  baselines: timed at every thread count of every workload, just before its"
               " allocators, %.2f s window: ", bs);
        for (unsigned k = 0; k < PERF_BASE_N; k++)
            if (o->base_on[k]) {
                printf("%s%s", sep, what[k]);
                sep = "; ";
            }
        putchar('\n');
    }
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
    if (o->wl[W_ARENA] || o->wl[W_FRAG])
        printf("  arena:     per thread %u live blocks, log-uniform %u B .. %u MiB, %u pairs"
               " cycled, seed %" PRIu64 "+5000+thread; no clock read per call (calls"
               " counted: ns/pair = threads / pairs per second); single-lock's mutex %s\n",
               ARENA_LIVE, ARENA_MIN, ARENA_MAX >> 20, ARENA_PAIRS, o->seed,
               o->lock_pair ? "once per free+allocation pair" : "around each call");
    if (o->wl[W_FRAG])
        printf("  arena-frag: the arena events after %u blocks of %u..%u B (multiples of 256,"
               " seed %" PRIu64 "+6000+thread) allocated and every other one freed per"
               " thread: %u free fragments each, that cannot coalesce\n", FRAG_BLOCKS,
               FRAG_MIN, FRAG_MAX, o->seed, FRAG_BLOCKS / 2);
    if (o->wl[W_REPLAY] && replay != NULL)
        printf("  replay:    %s: %zu events, %u slots, %u streams; each thread replays its own"
               " copy in shardbfc-replay's order (time order when each thread's rows are)\n",
               o->trace, replay->nev, replay->nslots, replay->nstreams);
    snprintf(pj, pjlen,
             "\"quick\": %s, \"seed\": %" PRIu64 ", \"seconds\": %.3f, \"runs\": %u, "
             "\"contexts\": \"%s\", \"baseline\": [%s], \"baseline_seconds\": %.3f, "
             "\"lock_scope\": \"%s\", \"sim_vmm_cost_ns\": %u, \"warmup_seconds\": %.3f, "
             "\"churn\": {\"live\": %u, \"size_min\": %u, \"size_max\": %u, \"pairs\": %u}, "
             "\"cross\": {\"ring\": %u, \"size_min\": %u, \"size_max\": %u, \"sizes\": %u}, "
             "\"inference\": {\"model\": \"Llama-2-7B\", \"hidden\": %u, \"heads\": %u, "
             "\"kv_heads\": %u, \"layers\": %u, \"intermediate\": %u, \"vocab\": %u, "
             "\"dtype_bytes\": %u, \"kv_block_tokens\": %u, \"max_batch\": %u, "
             "\"prompt_min\": %u, \"prompt_max\": %u, \"output_min\": %u, \"output_max\": %u, "
             "\"arrival_p\": %.3f, \"group_max\": %u, \"steps\": %u}, "
             "\"host\": {\"live\": %u, \"size_min\": %u, \"size_max\": %u, \"pairs\": %u}, "
             "\"arena\": {\"live\": %u, \"size_min\": %u, \"size_max\": %u, \"pairs\": %u, "
             "\"fragment_blocks\": %u, \"fragment_min\": %u, \"fragment_max\": %u}",
             o->quick ? "true" : "false", o->seed, o->seconds, o->runs, ctx_names[o->contexts],
             bl, bs, o->lock_pair ? "pair" : "call", o->backend_cuda ? 0u : o->sim_vmm_cost,
             o->warmup >= 0 ? o->warmup : warmup_of(o->seconds), CHURN_LIVE, CHURN_MIN,
             CHURN_MAX, CHURN_PAIRS, PERF_RING_CAP, CROSS_MIN, CROSS_MAX, CROSS_SIZES,
             m->hidden, m->heads, m->kv_heads, m->layers, m->intermediate, m->vocab,
             m->dtype_bytes, m->kv_block_tokens, m->max_batch, m->prompt_min, m->prompt_max,
             m->output_min, m->output_max, m->arrival_p, m->group_max, o->infer_steps,
             HOST_LIVE, HOST_MIN, HOST_MAX, CHURN_PAIRS, ARENA_LIVE, ARENA_MIN, ARENA_MAX,
             ARENA_PAIRS, FRAG_BLOCKS, FRAG_MIN, FRAG_MAX);
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

static double pair_ns(const struct perf_result *r)
{
    return r != NULL && r->ops_per_sec > 0 ? 2e9 * r->threads / r->ops_per_sec : NAN;
}

static void efficiency_targets(const struct perf_report *rp, const char *alloc)
{
    static const char *const wls[] = {"churn", "cross", "inference", "arena"};
    char name[96];
    for (unsigned k = 0; k < sizeof(wls) / sizeof(wls[0]); k++) {
        const struct perf_result *r = perf_report_find(rp, wls[k], alloc, 2);
        snprintf(name, sizeof(name), "%s 2 threads: %s efficiency (speed-up / ALU's)", wls[k],
                 alloc);
        add_target(name, r ? r->efficiency : NAN, r != NULL, 0.9, false);
    }
}

static void report_targets(const struct perf_report *rp, const struct opts *o)
{
    char name[96];
    const struct perf_result *s, *l;
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
        /* With N threads the requested peak is sampled (see the table's
         * legend): the target is then read from a sampled figure. */
        const char *how = (s->have_cycles && s->prog_cycles == 0) ||
                                  (l != NULL && l->have_cycles && l->prog_cycles == 0)
                              ? " (part of the program)"
                          : s->req_sampled ? " (sampled)"
                                           : "";
        if (l != NULL && l->have_mem)
            snprintf(name, sizeof(name), "inference %u thr: shardbfc overhead%s"
                     " (single-lock %.3f)", o->threads[k], how, l->overhead);
        else
            snprintf(name, sizeof(name), "inference %u thr: shardbfc overhead%s",
                     o->threads[k], how);
        add_target(name, s->overhead, s->have_mem, 1.10, true);
    }
    /* The arena's own pair, alone and among free fragments. */
    s = perf_report_find(rp, "arena", "shardbfc", 1);
    l = perf_report_find(rp, "arena-frag", "shardbfc", 1);
    add_target("arena 1 thread: shardbfc ns per pair", pair_ns(s), s != NULL, 100.0, true);
    add_target("arena-frag 1 thread: shardbfc ns per pair", pair_ns(l), l != NULL, 200.0, true);
    add_target("arena-frag / arena 1 thread: shardbfc ns per pair (x)",
               pair_ns(l) / pair_ns(s), s && l, 2.0, true);
    for (unsigned k = 0; k < o->nthreads; k++) {
        if (o->threads[k] < 2)
            continue;
        s = perf_report_find(rp, "arena", "shardbfc", o->threads[k]);
        l = perf_report_find(rp, "arena", "single-lock", o->threads[k]);
        if (s == NULL || l == NULL)
            continue;
        snprintf(name, sizeof(name), "arena %u threads: shardbfc / single-lock pairs/s",
                 o->threads[k]);
        add_target(name, l->ops_per_sec > 0 ? s->ops_per_sec / l->ops_per_sec : 0, true, 2.0,
                   false);
    }
    /* Scaling: what the allocator gains from a second thread over what the
     * machine gives, with one context and with one per thread. */
    efficiency_targets(rp, "shardbfc");
    for (unsigned i = 0; i < rp->nres; i++)
        if (strcmp(rp->res[i].allocator, "shardbfc-ctx") == 0) {
            efficiency_targets(rp, "shardbfc-ctx");
            break;
        }
    /* Sixteen threads on sixteen cores (the GPU machine's): at least 12x one
     * thread, where the run measured both (SIM: the allocator alone; arena
     * without a clock read per call). */
    if (!o->backend_cuda)
        for (unsigned i = 0; i < rp->nres; i++) {
            const struct perf_result *r = &rp->res[i];
            if (r->threads != 16 || strncmp(r->allocator, "shardbfc", 8) != 0 ||
                (strcmp(r->workload, "churn") != 0 && strcmp(r->workload, "cross") != 0 &&
                 strcmp(r->workload, "inference") != 0 && strcmp(r->workload, "arena") != 0))
                continue;
            if (isfinite(r->ports_speedup))
                snprintf(name, sizeof(name),
                         "%s 16 threads: %s speed-up (x 1 thread; ALU %.2fx, ports %.2fx)",
                         r->workload, r->allocator, r->alu_speedup, r->ports_speedup);
            else
                snprintf(name, sizeof(name), "%s 16 threads: %s speed-up (x 1 thread; ALU %.2fx)",
                         r->workload, r->allocator, r->alu_speedup);
            add_target(name, r->speedup, r->speedup > 0, 12.0, false);
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

/*
 * libshardbfc's own counters against the calls the harness made (s0: after
 * init, s1: after the run, everything freed): as many allocations and
 * frees, nothing in use, and in cross every free remote when the pair's
 * streams differ (none when single-lock's one stream serves both).  Prints
 * what disagrees; 1 when all agree, 0 when not.
 */
static int verify_counts(const struct perf_allocator *a, int w, const bfc_stats_t *s0,
                         const bfc_stats_t *s1, const struct perf_result *r)
{
    uint64_t allocs = s1->num_allocs - s0->num_allocs, frees = s1->num_frees - s0->num_frees;
    uint64_t remote = s1->num_remote_frees - s0->num_remote_frees;
    bool ok = allocs == r->calls_alloc && frees == r->calls_free && s1->bytes_in_use == 0;
    bool check_remote = w == W_CROSS && a->nstreams >= 2;
    uint64_t want_remote = 0;
    if (check_remote) {
        want_remote = a->streams[0] != a->streams[1] ? r->calls_free : 0;
        ok = ok && remote == want_remote;
    }
    if (!ok) {
        perf_progress_done();
        printf("  VERIFY FAILED: %s %s %u threads: the harness made %" PRIu64
               " allocations and %" PRIu64 " frees; the library counted %" PRIu64 " and %" PRIu64
               ", bytes_in_use %" PRIu64, wl_names[w], r->allocator, r->threads, r->calls_alloc,
               r->calls_free, allocs, frees, s1->bytes_in_use);
        if (check_remote)
            printf(", remote frees %" PRIu64 " (expected %" PRIu64 ")", remote, want_remote);
        printf("\n");
    }
    return ok ? 1 : 0;
}

/* The allocator's counters at the timed window's ends, read while the
 * threads run (bfc_ctx_stats locks one shard at a time): the window's own
 * map and unmap calls, without the growth of the prologue and warm-up. */
struct window_snap {
    struct perf_allocator *a;
    bfc_stats_t at[2];
    bool ok[2];
};

static void window_snap_fn(void *arg, bool end)
{
    struct window_snap *ws = arg;
    ws->ok[end] = ws->a->ops->snapshot(ws->a, &ws->at[end]);
}

/* One measurement of allocator ops on workload w with n threads into r;
 * NULL, or why it cannot run here (r is then untouched).  *failed is set
 * when an allocation or a verification failed. */
static const char *measure(const struct opts *o, const struct perf_env *env, int w, unsigned n,
                           const struct perf_alloc_ops *ops, struct progs *ps,
                           struct perf_prog *cross1, const uint64_t *cross_sizes,
                           struct perf_result *r, bool *failed)
{
    struct perf_allocator a;
    struct perf_run_cfg cfg;
    struct window_snap ws = {.a = &a};
    bfc_stats_t s0, s1;
    bool snap;
    const char *why;
    uint64_t used = 0;
    int rc;

    memset(&a, 0, sizeof(a));
    a.ops = ops;
    if (w == W_CROSS) {
        a.nstreams = n == 1 ? 2 : 2 * (n / 2);
        a.ncontexts = n == 1 ? 1 : n / 2;
        a.callers_per_ctx = n == 1 ? 1 : 2;
    } else {
        a.nstreams = n * ps->p[0]->nstreams;
        a.ncontexts = n;
        a.callers_per_ctx = 1;
    }
    why = ops->init(&a, env, w == W_HOST ? PERF_MEM_HOST : PERF_MEM_DEVICE, a.nstreams);
    if (why != NULL) {
        ops->fini(&a);
        return why;
    }
    memset(r, 0, sizeof(*r));
    snprintf(r->workload, sizeof(r->workload), "%s", wl_names[w]);
    snprintf(r->allocator, sizeof(r->allocator), "%s", ops->name);
    memset(&cfg, 0, sizeof(cfg));
    cfg.seconds = o->seconds;
    cfg.warmup_seconds = o->warmup >= 0 ? o->warmup : warmup_of(o->seconds);
    cfg.threads = n;
    if (ops->snapshot != NULL) {
        cfg.window_mark = window_snap_fn;
        cfg.mark_arg = &ws;
    }
    cfg.pin = w == W_HOST;
    cfg.count_only = w == W_ARENA || w == W_FRAG;
    cfg.lock_pair = cfg.count_only && o->lock_pair;
    snap = ops->snapshot != NULL && ops->snapshot(&a, &s0);
    if (w == W_CROSS && n > 1)
        rc = perf_run_cross(&a, cross_sizes, CROSS_SIZES, &cfg, r);
    else if (w == W_CROSS) {
        cfg.bracket = true; /* as the pipeline times its calls */
        rc = perf_run_prog(&a, &cross1, &cfg, r);
    }
    else
        rc = perf_run_prog(&a, ps->p, &cfg, r);
    if (rc != 0)
        *failed = r->failed = true;
    r->have_mem = ops->stats(&a, &r->peak_reserved, &r->resv_bound) && r->peak_requested > 0;
    r->overhead = r->have_mem ? (double)r->peak_reserved / (double)r->peak_requested : 0.0;
    /* Map and unmap calls cost tens of microseconds each on a GPU: how
     * many the run made per 1,000 allocations, prologue included. */
    if (ops->snapshot != NULL && ops->snapshot(&a, &s1) && s1.num_allocs > 0) {
        r->have_vmm = true;
        r->maps_per_1k = 1000.0 * (double)s1.num_vmm_maps / (double)s1.num_allocs;
        r->unmaps_per_1k = 1000.0 * (double)s1.num_vmm_unmaps / (double)s1.num_allocs;
    }
    if (ws.ok[0] && ws.ok[1] && ws.at[1].num_allocs > ws.at[0].num_allocs) {
        double allocs = (double)(ws.at[1].num_allocs - ws.at[0].num_allocs);
        r->have_win_vmm = true;
        r->win_maps_per_1k = 1000.0 * (double)(ws.at[1].num_vmm_maps - ws.at[0].num_vmm_maps) / allocs;
        r->win_unmaps_per_1k =
            1000.0 * (double)(ws.at[1].num_vmm_unmaps - ws.at[0].num_vmm_unmaps) / allocs;
    }
    if (ops->in_use(&a, &used) && used != 0) {
        perf_progress_done();
        printf("  VERIFY FAILED: %s %s %u threads: %" PRIu64
               " bytes still in use after every block was freed\n", wl_names[w], ops->name, n,
               used);
        *failed = true;
    }
    r->verified = -1;
    if (snap && rc == 0 && ops->snapshot(&a, &s1)) {
        r->verified = verify_counts(&a, w, &s0, &s1, r);
        if (!r->verified)
            *failed = true;
    }
    ops->fini(&a);
    return NULL;
}

/* Keeps the median of the runs of one figure (its other runs' histograms
 * are dropped) in results[]. */
static void keep_median(struct perf_result *runs, unsigned nruns)
{
    double rate[PERF_MAX_RUNS];
    unsigned at = 0;
    for (unsigned k = 0; k < nruns; k++)
        rate[k] = runs[k].ops_per_sec;
    (void)perf_median(rate, nruns, &at);
    /* A figure of which one run failed is a failed figure: the others
     * did not run what it would have. */
    bool failed = false;
    for (unsigned k = 0; k < nruns; k++)
        failed |= runs[k].failed;
    for (unsigned k = 0; k < nruns; k++)
        if (k != at)
            free(runs[k].hist);
    if (nresults == MAX_RESULTS) {
        free(runs[at].hist);
        return;
    }
    results[nresults] = runs[at];
    results[nresults].failed = failed;
    memcpy(results[nresults].runs, rate, nruns * sizeof(double));
    results[nresults].nruns = nruns;
    nresults++;
}

static void keep_base_median(struct perf_base *runs, unsigned nruns)
{
    double rate[PERF_MAX_RUNS];
    unsigned at = 0;
    if (nruns == 0 || nbases == MAX_RESULTS)
        return;
    for (unsigned k = 0; k < nruns; k++)
        rate[k] = runs[k].ops_per_sec;
    (void)perf_median(rate, nruns, &at);
    bases[nbases] = runs[at];
    memcpy(bases[nbases].runs, rate, nruns * sizeof(double));
    bases[nbases].nruns = nruns;
    nbases++;
}

/* The lines under a workload's table that the table does not carry. */
static void workload_notes(int w, unsigned first, const struct opts *o)
{
    unsigned nver = 0, nok = 0, nfailed = 0;
    for (unsigned i = first; i < nresults; i++) {
        const struct perf_result *r = &results[i];
        if (r->failed) {
            nfailed++;
            continue;
        }
        if (w == W_CROSS)
            printf("  cross %-12s %u thr: %.2fM frees/s per consumer, %.2fM allocs/s per"
                   " producer (time inside the calls only; %u pair%s); pipeline %.2fM"
                   " blocks/s; cpu producer %.0f%%, consumer %.0f%%\n", r->allocator,
                   r->threads, r->frees_per_sec_per_consumer / 1e6,
                   r->allocs_per_sec_per_producer / 1e6, r->consumers,
                   r->consumers == 1 ? "" : "s", r->blocks_per_sec / 1e6,
                   100 * r->cpu_share_producer, 100 * r->cpu_share_consumer);
        if (w == W_FRAG && r->have_chunks) {
            printf("  arena-frag %-12s %u thr: %" PRIu64 " free fragments (the library's free"
                   " chunks) before the warm-up, %" PRIu64 " when the window closed\n",
                   r->allocator, r->threads, r->free_chunks_before, r->free_chunks_after);
            /* The live set, allocated after the fragments, may fill one
             * fragment per block; fewer than that left means the prologue
             * did not make what it should.  Single-lock's threads share
             * one arena, where one thread's fragments may border another's
             * and coalesce. */
            if (r->free_chunks_before < (uint64_t)(FRAG_BLOCKS / 2 - ARENA_LIVE) * r->threads &&
                (r->threads == 1 || strcmp(r->allocator, "single-lock") != 0))
                printf("  WARNING: fewer free fragments than the %u per thread meant\n",
                       FRAG_BLOCKS / 2 - ARENA_LIVE);
        }
        if (r->nruns > 1) {
            double lo = r->runs[0], hi = r->runs[0];
            for (unsigned k = 1; k < r->nruns; k++) {
                lo = r->runs[k] < lo ? r->runs[k] : lo;
                hi = r->runs[k] > hi ? r->runs[k] : hi;
            }
            printf("  runs %-12s %u thr: %u, ops/s %.3gM .. %.3gM (median in the table)\n",
                   r->allocator, r->threads, r->nruns, lo / 1e6, hi / 1e6);
        }
        nver += r->verified >= 0;
        nok += r->verified == 1;
    }
    if (nver > 0)
        printf("  verified: libshardbfc's counters against the calls made (allocations, frees,"
               " nothing in use%s): %u of %u rows agree\n",
               w == W_CROSS ? ", every cross-stream free remote" : "", nok, nver);
    if (nfailed > 0)
        printf("  FAILED: %u row%s (an allocation or free failed: the messages above say which; no"
               " figure of %s is reported)\n",
               nfailed, nfailed == 1 ? "" : "s", nfailed == 1 ? "it" : "them");
    (void)o;
}

int main(int argc, char **argv)
{
    struct opts o;
    struct perf_env env;
    struct perf_machine mach;
    struct perf_report rp;
    struct perf_prog replay;
    uint64_t *cross_sizes = NULL;
    unsigned total = 0, done = 0, nalloc_on = 0;
    uint64_t t_start;
    int status = 0;

    perf_progress_init(PROG);
    if (parse_args(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    memset(&rp, 0, sizeof(rp));
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
    env.conf = o.conf;
    env.sim_vmm_cost = o.sim_vmm_cost;
    setvbuf(stdout, NULL, _IOLBF, 0);

    printf("shardbfc-perf: libshardbfc against the alternatives, same workloads, same run\n");
    printf("machine: %ld cores, %s; backend %s; GPU: %s\n", mach.cores, mach.cpu,
           o.backend_cuda ? "cuda" : "sim", env.gpu ? env.gpu_name : env.no_gpu_reason);
    printf("load average at start: %s\n", mach.loadavg);
    printf("allocators:\n");
    for (unsigned i = 0; i < perf_n_allocators; i++)
        if (o.alloc_on[i]) {
            printf("  %-12s %s\n", perf_allocators[i]->name, perf_allocators[i]->desc);
            nalloc_on++;
        }
    print_params(&o, o.wl[W_REPLAY] ? &replay : NULL, rp.params_json, sizeof(rp.params_json));
    printf("measures: ops/s = allocation and free calls of all threads per second of the"
           " window; latency per call from per-thread log-linear histograms (1 clock read"
           " per call, ~20 ns included; cross: 2 reads around each call; none in the arena"
           " workloads); overhead = peak"
           " bytes reserved / peak bytes requested (null where the allocator cannot say);"
           " cpu = CPU time of the timed threads / (window x usable CPUs); maps/1k, unmaps/1k"
           " = libshardbfc's device map and unmap calls per 1,000 allocations, whole run;"
           " window m/u = the same in the timed window alone; speed-up, ALU,"
           " eff: see below each table\n");

    if (o.wl[W_CROSS]) {
        uint64_t s = o.seed + 2;
        cross_sizes = perf_xmalloc(CROSS_SIZES * sizeof(*cross_sizes));
        for (unsigned i = 0; i < CROSS_SIZES; i++)
            cross_sizes[i] = perf_rng_logu(&s, CROSS_MIN, CROSS_MAX);
    }
    for (int w = 0; w < NW; w++)
        if (o.wl[w])
            total += nalloc_on * o.nthreads * o.runs;

    t_start = perf_now_ns();
    for (int w = 0; w < NW; w++) {
        struct progs ps;
        unsigned first = nresults;
        if (!o.wl[w])
            continue;
        memset(&ps, 0, sizeof(ps));
        printf("\n== %s ==\n", wl_names[w]);
        for (unsigned k = 0; k < o.nthreads; k++) {
            unsigned n = o.threads[k];
            if (w == W_CROSS && n > 1 && n % 2 != 0) {
                /* Producer/consumer pairs: an odd count would run n - 1
                 * threads beside an ALU loop timed on n. */
                char why[96];
                snprintf(why, sizeof why, "%u threads: cross runs producer/consumer pairs (1 or an even count)", n);
                add_skip(wl_names[w], "*", why);
                continue;
            }
            static struct perf_result runs[16][PERF_MAX_RUNS];
            static struct perf_base bruns[PERF_BASE_N][PERF_MAX_RUNS];
            unsigned nruns[16] = {0}, nbruns[PERF_BASE_N] = {0};
            bool skipped[16] = {false};
            struct perf_prog cross1;
            bool have_cross1 = false;
            if (w != W_CROSS) {
                if (progs_make(&ps, w, &o, n, &replay) != 0)
                    return 1;
            } else if (n == 1) {
                perf_gen_cross1(cross_sizes, CROSS_SIZES, &cross1);
                have_cross1 = true;
            }
            for (unsigned rep = 0; rep < o.runs; rep++) {
                struct perf_run_cfg bcfg;
                memset(&bcfg, 0, sizeof(bcfg));
                bcfg.seconds = base_seconds_of(o.seconds);
                bcfg.warmup_seconds = bcfg.seconds * 0.2 < 0.02 ? 0.02 : bcfg.seconds * 0.2;
                bcfg.threads = n;
                for (unsigned kind = 0; kind < PERF_BASE_N; kind++) {
                    struct perf_base *b = &bruns[kind][nbruns[kind]];
                    if (!o.base_on[kind])
                        continue;
                    perf_progress("%s, %u thread%s, %s loop (%.0f s elapsed)", wl_names[w], n,
                                  n == 1 ? "" : "s", perf_base_names[kind],
                                  (double)(perf_now_ns() - t_start) * 1e-9);
                    memset(b, 0, sizeof(*b));
                    if (perf_run_base(kind, &bcfg, b) == 0) {
                        snprintf(b->workload, sizeof(b->workload), "%s", wl_names[w]);
                        nbruns[kind]++;
                    }
                }
                for (unsigned i = 0; i < perf_n_allocators && i < 16; i++) {
                    const struct perf_alloc_ops *ops = perf_allocators[i];
                    const char *why;
                    bool failed = false;
                    if (!o.alloc_on[i] || skipped[i])
                        continue;
                    done++;
                    perf_progress("%s, %u thread%s, %s%s (%u/%u, %.0f s elapsed)", wl_names[w],
                                  n, n == 1 ? "" : "s", ops->name,
                                  o.runs > 1 ? ", run" : "", done, total,
                                  (double)(perf_now_ns() - t_start) * 1e-9);
                    why = measure(&o, &env, w, n, ops, &ps, have_cross1 ? &cross1 : NULL,
                                  cross_sizes, &runs[i][nruns[i]], &failed);
                    if (why != NULL) {
                        perf_progress_done();
                        add_skip(wl_names[w], ops->name, why);
                        skipped[i] = true;
                        done += o.runs - 1 - rep;
                        continue;
                    }
                    nruns[i]++;
                    if (failed)
                        status = 1;
                }
            }
            for (unsigned kind = 0; kind < PERF_BASE_N; kind++)
                keep_base_median(bruns[kind], nbruns[kind]);
            for (unsigned i = 0; i < perf_n_allocators && i < 16; i++)
                if (nruns[i] > 0)
                    keep_median(runs[i], nruns[i]);
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
            tab.base = bases;
            tab.nbase = nbases;
            perf_report_scaling(&tab);
            perf_report_table(&tab, wl_names[w], stdout);
        }
        workload_notes(w, first, &o);
    }
    perf_progress_done();

    /* The report. */
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
    rp.base = bases;
    rp.nbase = nbases;
    rp.skip = skips;
    rp.nskip = nskips;
    perf_report_scaling(&rp);
    for (unsigned i = 0; i < nresults; i++)
        rp.disturbed |= results[i].disturbed && !results[i].failed;
    for (unsigned i = 0; i < nbases; i++)
        rp.disturbed |= bases[i].disturbed;
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
    if (rp.disturbed)
        printf("NOTE: some figures were taken while other processes held the CPUs (the"
               " WARNING lines): rerun on a quiet machine before judging the targets\n");
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
