/*
 * perf.h -- the pieces of perf/shardbfc-perf and how they meet.
 *
 *   allocators.c  every allocator behind one small interface (struct
 *                 perf_alloc_ops): libshardbfc sharded (one context, or one
 *                 context per thread), the same library behind one mutex
 *                 (TensorFlow's design), jemalloc, glibc malloc, cudaMalloc
 *                 and cudaMallocAsync (CUDA builds, run only when a device
 *                 is usable).
 *   gen.c         the workloads' event programs, generated from fixed seeds
 *                 before any clock starts: churn pairs (also the arena
 *                 workloads', with or without a prologue of free
 *                 fragments), the synthetic transformer serving trace, a
 *                 replayed RMM CSV trace.
 *   workloads.c   the threads that run a program (or the cross-stream
 *                 pipeline) against an allocator, timing every call or
 *                 only counting them; the machine's own capacity at the
 *                 same thread count (a pure ALU loop, a loop over 1 MiB
 *                 per thread) for the scaling efficiency.
 *   report.c      the scaling figures (speed-up, efficiency), the table on
 *                 stdout, the JSON file, the SVG chart.
 *   main.c        the command line and the suite.
 *
 * A program is a list of events over "slots" (a slot holds one live block)
 * that a thread executes in order, cyclically: an event allocates `size`
 * bytes into a free slot or frees a live one, on one of the thread's
 * streams.  The cycled part is balanced (what it allocates it frees, or it
 * keeps the live population constant), so it can be repeated for as long as
 * a measurement lasts; a prologue (run once, untimed) builds the initial
 * population.  Everything a generator decides is in the events, so the
 * timed loop only calls the allocator and reads the clock.
 */
#ifndef SHARDBFC_PERF_H
#define SHARDBFC_PERF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <shardbfc.h>

#include "hist.h"

#define PERF_MAX_THREADS 64
#define PERF_MAX_STREAMS_PER_THREAD 16
#define PERF_MAX_RUNS 15 /* --runs: repetitions of one figure */

/* ------------------------------------------------------------- programs */

enum perf_op { PERF_OP_ALLOC = 0, PERF_OP_FREE = 1 };

/* What an inference event is for (tests check the generator with it). */
enum perf_kind {
    PERF_KIND_OTHER = 0,
    PERF_KIND_ACT = 1,    /* per-layer activation of one step */
    PERF_KIND_KV = 2,     /* a KV-cache block of one layer of one request */
    PERF_KIND_LOGITS = 3, /* hidden state / logits of a step */
};

struct perf_ev {
    uint64_t size;   /* bytes (ALLOC); FREE: the size on the first pass (runners
                        track what a slot holds, since passes repeat) */
    uint32_t slot;
    uint32_t req;    /* inference: request id (KV blocks), else 0 */
    uint8_t op;      /* enum perf_op */
    uint8_t stream;  /* index among the thread's streams */
    uint8_t kind;    /* enum perf_kind */
};

struct perf_prog {
    struct perf_ev *pro; /* prologue: run once, untimed */
    size_t npro;
    struct perf_ev *ev;  /* cycled while timed */
    size_t nev;
    unsigned nslots;     /* slots 0..nslots-1 */
    unsigned nstreams;   /* streams per thread (1..PERF_MAX_STREAMS_PER_THREAD) */
};

void perf_prog_free(struct perf_prog *p);

/* churn: `live` slots filled by the prologue; each of the n_pairs cycled
 * pairs frees a random slot and allocates a log-uniform size in [lo, hi]
 * into it.  One stream. */
void perf_gen_churn(uint64_t seed, unsigned live, unsigned n_pairs, uint64_t lo,
                    uint64_t hi, struct perf_prog *out);

/* Prepends free fragments to p's prologue: `blocks` blocks of lo..hi bytes
 * (multiples of 256, seeded) into new slots after p's, then frees every
 * other one (the even ones), so each freed block lies between two live ones
 * and cannot coalesce: blocks / 2 free fragments that the cycled events
 * (which never touch these slots) must search past.  The live half stays
 * allocated until the run ends. */
void perf_gen_fragments(struct perf_prog *p, uint64_t seed, unsigned blocks, uint64_t lo,
                        uint64_t hi);

/* A 7B-class decoder's published shape and the serving mix around it. */
struct perf_model {
    const char *name;
    unsigned hidden, heads, kv_heads, layers, intermediate, vocab;
    unsigned dtype_bytes;      /* 2: fp16 */
    unsigned kv_block_tokens;  /* tokens per KV-cache block (paged, as vLLM) */
    unsigned max_batch;        /* requests decoding together at most */
    unsigned prompt_min, prompt_max;   /* prompt tokens, log-uniform */
    unsigned output_min, output_max;   /* generated tokens, uniform */
    double arrival_p;          /* chance that a group of requests arrives per step */
    unsigned group_max;        /* group size uniform in [1, group_max] */
};

extern const struct perf_model perf_llama2_7b;

/* Bytes of one KV-cache block of one layer (K and V of kv_block_tokens). */
uint64_t perf_model_kv_block(const struct perf_model *m);

struct perf_req_info {
    uint32_t prompt;  /* prompt tokens */
    uint32_t output;  /* generated tokens */
};

/* The serving trace of one stream: `steps` scheduler iterations with
 * arrivals, then iterations without arrivals until every request has
 * finished (so the program is balanced: it ends with nothing live).  When
 * reqs is not NULL it receives the requests' lengths (malloc'ed, by id). */
void perf_gen_inference(const struct perf_model *m, uint64_t seed, unsigned steps,
                        struct perf_prog *out, struct perf_req_info **reqs,
                        unsigned *nreqs);

/* The events of an RMM CSV trace (tools/trace_csv.h): allocations and frees
 * in replay order (bfc_trace_csv_read_ordered, as shardbfc-replay: by time
 * when each thread's events are in time order, else file order), pointers
 * mapped to slots, each distinct stream to one of up
 * to PERF_MAX_STREAMS_PER_THREAD streams (round robin beyond), frees of
 * pointers allocated before the trace began dropped, blocks still live at
 * the end freed by appended events.  0, or -1 with a message in err. */
int perf_gen_replay(const char *path, struct perf_prog *out, char *err, size_t errlen);

/* ----------------------------------------------------------- allocators */

enum perf_mem { PERF_MEM_DEVICE, PERF_MEM_HOST };

struct perf_env {
    bool backend_cuda;   /* --backend cuda: libshardbfc on the CUDA backend */
    const char *conf;    /* --conf: libshardbfc configuration applied last, or NULL */
    unsigned sim_vmm_cost; /* --sim-vmm-cost: SIM's modelled driver ns per granule (0: off) */
    bool gpu;            /* a CUDA device is usable */
    char gpu_name[256];  /* or "" */
    char no_gpu_reason[160];
};

struct perf_allocator;

struct perf_alloc_ops {
    const char *name;
    const char *desc; /* one line for the report */
    /* Prepares nstreams streams (a->streams) for a run; NULL, or why this
     * allocator cannot run here (it is then listed as skipped). */
    const char *(*init)(struct perf_allocator *a, const struct perf_env *env,
                        enum perf_mem mem, unsigned nstreams);
    /* Thread-safe; NULL on failure. */
    void *(*alloc)(struct perf_allocator *a, unsigned thread, bfc_stream_t stream, size_t n);
    /* Thread-safe; 0 or a nonzero error. */
    int (*free)(struct perf_allocator *a, unsigned thread, void *p, bfc_stream_t stream,
                size_t n);
    /* Peak bytes held from the device (or the OS) since init, if it can say;
     * *bound: true where that is a sum of several pools' peaks (an upper
     * bound on the true peak), false where it is exact. */
    bool (*stats)(struct perf_allocator *a, uint64_t *peak_reserved, bool *bound);
    /* Bytes still in use by the program (0 after a clean run), if it can say. */
    bool (*in_use)(struct perf_allocator *a, uint64_t *bytes);
    void (*fini)(struct perf_allocator *a);
    /* Optional (NULL: the runner calls free, then alloc).  Frees p (n_free
     * bytes) and allocates n bytes on s as one unit: single-lock takes its
     * mutex once for both (--lock-scope pair).  *free_rc receives free's
     * status.  Thread-safe. */
    void *(*pair)(struct perf_allocator *a, unsigned thread, void *p, size_t n_free,
                  bfc_stream_t s, size_t n, int *free_rc);
    /* Optional (NULL: cannot say).  libshardbfc's own counters, summed over
     * the allocator's contexts (bfc_ctx_stats, bfc_host_stats): the harness
     * checks them against the calls it made and reads the free fragments.
     * Thread-safe (called by the main thread while the workers wait). */
    bool (*snapshot)(struct perf_allocator *a, bfc_stats_t *out);
};

struct perf_allocator {
    const struct perf_alloc_ops *ops;
    enum perf_mem mem;
    bfc_stream_t *streams; /* nstreams entries (single-lock: all the same) */
    unsigned nstreams;
    /* Set by the caller before init, for an allocator that gives each
     * group of streams a context of its own (shardbfc-ctx): the streams
     * split into ncontexts equal consecutive groups, and the `thread`
     * argument of alloc/free belongs to group thread / callers_per_ctx
     * (1 for a program run: one context per thread; 2 for cross: one per
     * producer/consumer pair).  0 means 1. */
    unsigned ncontexts;
    unsigned callers_per_ctx;
    void *state;
};

extern const struct perf_alloc_ops *const perf_allocators[];
extern const unsigned perf_n_allocators;

const struct perf_alloc_ops *perf_alloc_find(const char *name);
/* Probes CUDA (when built with it) and fills env. */
void perf_env_probe(struct perf_env *env, bool backend_cuda);

/* ------------------------------------------------------------- results */

struct perf_result {
    char workload[16];
    char allocator[16];
    unsigned threads;
    bool failed;             /* an allocation or free failed (a message said which): its
                                figures are not measurements and are not reported */
    double seconds;          /* timed window */
    uint64_t ops;            /* calls (allocations + frees) */
    double ops_per_sec;
    bool have_lat;           /* latencies measured (false: calls only counted) */
    struct perf_hist *hist;  /* all calls, merged over threads (owned); NULL if !have_lat */
    uint64_t p50_ns, p99_ns, p999_ns;
    uint64_t alloc_p99_ns, free_p99_ns;
    double cpu_share;        /* thread CPU time / (wall x usable CPUs) */
    double ops_per_cpu_sec;  /* ops / CPU-seconds of the timed threads (load-independent) */
    double sleeps_per_sec;   /* voluntary context switches of the timed threads per second */
    bool disturbed;          /* perf_disturbed(): other load took the CPUs */
    bool have_mem;           /* peak_reserved / overhead known */
    uint64_t peak_reserved;
    bool resv_bound;         /* peak_reserved is a sum of contexts' peaks: an upper bound */
    uint64_t peak_requested; /* always measured by the harness */
    bool req_sampled;        /* peak_requested is sampled (N threads), not exact */
    double overhead;         /* peak_reserved / peak_requested */
    bool have_cycles;        /* prog_cycles known (the program workloads; not cross's pipeline) */
    uint64_t prog_cycles;    /* full passes of the slowest thread through its cycled events:
                                0 means the peaks are of the part of the program it reached */
    bool have_vmm;           /* maps_per_1k / unmaps_per_1k known (libshardbfc) */
    double maps_per_1k;      /* device map calls of expandable arenas per 1,000 allocations, whole run */
    double unmaps_per_1k;
    bool have_win_vmm;       /* win_*: the same in the timed window alone (read while running) */
    double win_maps_per_1k, win_unmaps_per_1k;
    double frees_per_sec_per_consumer; /* cross: frees / time inside free; else 0 */
    unsigned consumers;
    /* cross: the producers' side and the pipeline */
    double allocs_per_sec_per_producer; /* allocations / time inside alloc */
    double blocks_per_sec;   /* blocks freed by all consumers per second of the window */
    double cpu_share_producer, cpu_share_consumer; /* mean over threads of CPU / own window */
    /* Every successful call of the run, prologue and clean-up included
     * (the harness's count, checked against the allocator's). */
    uint64_t calls_alloc, calls_free;
    int verified;            /* 1: the allocator's counters agree; 0: they do not; -1: cannot say */
    /* libshardbfc: free chunks (num_chunks - live - pending) when the
     * window opens and when it closes (have_chunks) */
    bool have_chunks;
    uint64_t free_chunks_before, free_chunks_after;
    /* --runs: ops/s of every repetition; the row is the median one */
    double runs[PERF_MAX_RUNS];
    unsigned nruns;
    /* Scaling (perf_report_scaling): NAN on 1-thread rows and where the
     * 1-thread row or a baseline is missing. */
    double speedup;          /* ops_per_sec / ops_per_sec at 1 thread */
    double alu_speedup;      /* the ALU loop's, timed beside this thread count */
    double efficiency;       /* speedup / alu_speedup */
    double mem_speedup;      /* the 1 MiB loop's (--baseline mem) */
    double ports_speedup;    /* the eight-chain loop's (--baseline ports) */
    double per_cpu_efficiency; /* ops_per_cpu_sec / that at 1 thread */
};

/* ------------------------------------------------------------ baselines */

/*
 * The machine's own capacity, timed beside each thread count: what a
 * perfectly scaling allocator would gain from N threads here, now.
 *   alu  a dependent chain of integer multiply, add, shift and xor on one
 *        register per thread: no memory traffic at all;
 *   mem  each thread reads and writes one word of every 64-byte line of its
 *        own 1 MiB buffer, pass after pass (caches shared between cores
 *        show here, not in alu);
 *   ports  alu's step on eight independent chains per thread: the core's
 *        multiplier and issue width set the pace, not the chain's latency.
 *        Two hardware threads of one core (SMT siblings, which a virtual
 *        machine may present as two cores) each run alu at nearly full
 *        speed, since one chain leaves most of the core idle, but share
 *        ports' units: where ports gains about half of what alu gains, the
 *        CPUs are pairs of siblings, and an allocator's branchy, load-bound
 *        code will gain like ports, not like alu.
 * An op is one iteration (alu: one step; ports: a step of each chain) or
 * one line (mem).
 */
enum perf_base_kind { PERF_BASE_ALU = 0, PERF_BASE_MEM = 1, PERF_BASE_PORTS = 2, PERF_BASE_N };
extern const char *const perf_base_names[PERF_BASE_N];

#define PERF_ALU_BATCH 4096u              /* iterations between looks at the flags */
#define PERF_MEM_BYTES ((size_t)1 << 20)  /* per thread */

struct perf_base {
    char workload[16];       /* the workload it was timed beside */
    unsigned kind;           /* enum perf_base_kind */
    unsigned threads;
    double seconds;          /* timed window */
    uint64_t ops;
    double ops_per_sec;
    double cpu_share;
    bool disturbed;
    double runs[PERF_MAX_RUNS];
    unsigned nruns;
    double speedup;          /* ops_per_sec / that at 1 thread (same workload); NAN at 1 */
};

/* The ALU loop's body, `iters` times from x.  Pure: the same x and count
 * give the same value, and f(f(x, a), b) == f(x, a + b). */
uint64_t perf_alu_kernel(uint64_t x, uint64_t iters);

/* The ports loop's body: alu's step `iters` times on each of the
 * PERF_PORTS_LANES chains of x, in place.  Lane i ends where
 * perf_alu_kernel(x[i], iters) does. */
#define PERF_PORTS_LANES 8
void perf_ports_kernel(uint64_t x[PERF_PORTS_LANES], uint64_t iters);

/* One pass of the memory loop: adds 1 to the first word of each 64-byte
 * line of buf (bytes long, a multiple of 64); returns the sum it read. */
uint64_t perf_mem_kernel(uint64_t *buf, size_t bytes);

struct perf_skip {
    char workload[16];
    char allocator[16];
    char reason[160];
};

/* One measurement parameters. */
struct perf_run_cfg {
    double seconds;         /* timed window */
    double warmup_seconds;  /* the same loop, untimed, before the window */
    unsigned threads;
    bool pin;               /* pin thread t to CPU t % cores (host workload) */
    bool count_only;        /* no clock read per call: calls counted, no latencies
                               (the arena workloads: a pair's cost alone) */
    bool lock_pair;         /* a free followed by an allocation into the same
                               slot goes through ops->pair when it has one */
    bool bracket;           /* each call between two clock reads (time inside
                               the call only), not chained: cross on one
                               thread, timed as the pipeline times its calls */
    /* Called by the main thread, while the threads run, once every thread
     * has opened its window (end false) and just before the window closes
     * (end true); NULL: not called. */
    void (*window_mark)(void *arg, bool end);
    void *mark_arg;
};

/* Runs prog[t] on thread t (t < cfg->threads) against a; fills r (ops,
 * latencies unless count_only, peaks, calls, CPU, sleeps, and with
 * ops->snapshot the free chunks at the window's ends).  0, or -1 after
 * printing why (an allocation failed). */
int perf_run_prog(struct perf_allocator *a, struct perf_prog *const *prog,
                  const struct perf_run_cfg *cfg, struct perf_result *r);

/* Times baseline `kind` on cfg->threads threads (the same warm-up and
 * window rules as a program run); fills ops, ops_per_sec, seconds,
 * cpu_share, threads, kind.  0, or -1 when cfg->threads is out of range. */
int perf_run_base(unsigned kind, const struct perf_run_cfg *cfg, struct perf_base *b);

/* CPU time of threads that never sleep below 90% of what they could use:
 * other load held the CPUs.  Threads that sleep in a lock (more than 50
 * voluntary switches a second each) are below 90% by design. */
bool perf_disturbed(double cpu_share, double sleeps_per_sec, unsigned threads);

/* cross: cfg->threads / 2 producer-consumer pairs, producer i allocating on
 * stream 2i and consumer i freeing on stream 2i+1 (a->nstreams >= 2 pairs),
 * producer i taking sizes[(i * 7919 + k) % nsizes] for its k-th block.  With
 * threads == 1 use perf_gen_cross1 and perf_run_prog instead. */
int perf_run_cross(struct perf_allocator *a, const uint64_t *sizes, unsigned nsizes,
                   const struct perf_run_cfg *cfg, struct perf_result *r);

/* cross on one thread: allocate on stream 0, free on stream 1. */
void perf_gen_cross1(const uint64_t *sizes, unsigned nsizes, struct perf_prog *out);

/* --------------------------------------------------------------- report */

struct perf_target {
    char name[96];
    double value, limit;
    bool upper; /* value <= limit is met */
    bool met;
    bool measured;
};

struct perf_report {
    const char *program;
    long cores;
    char cpu[128];
    const char *backend;     /* "sim" | "cuda" */
    const char *gpu;         /* NULL: none */
    char loadavg[64], loadavg_end[64];
    const char *malloc_note;
    bool disturbed;          /* some figure was taken under other load */
    char params_json[4096];  /* members of "parameters", already formatted */
    struct perf_result *res;
    unsigned nres;
    struct perf_base *base;
    unsigned nbase;
    struct perf_skip *skip;
    unsigned nskip;
    struct perf_target *tgt;
    unsigned ntgt;
};

/* The result for (workload, allocator, threads), or NULL (none, or a failed
 * one: no figure, target or speed-up is read from a failed run). */
struct perf_result *perf_report_find(const struct perf_report *rp, const char *workload,
                                     const char *allocator, unsigned threads);
/* The baseline of `kind` timed beside (workload, threads), or NULL. */
struct perf_base *perf_report_find_base(const struct perf_report *rp, const char *workload,
                                        unsigned kind, unsigned threads);

/* rate_n / rate_1: the speed-up of N threads over one; NAN unless both are
 * positive and finite. */
double perf_speedup(double rate_n, double rate_1);
/* Scaling efficiency: the allocator's speed-up over the ALU loop's (1.0:
 * it gains from N threads what the machine gives); NAN unless both are
 * positive and finite. */
double perf_efficiency(double speedup, double alu_speedup);
/* Fills the scaling members of every result and baseline from the rows
 * at 1 thread of the same workload (and allocator, or kind). */
void perf_report_scaling(struct perf_report *rp);
/* The median of v[0..n-1] (n >= 1): the middle value, or the lower middle
 * one for even n (a value that was measured, so a row can be the run it
 * came from); its index in v goes to *at. */
double perf_median(const double *v, unsigned n, unsigned *at);
void perf_report_table(const struct perf_report *rp, const char *workload, FILE *f);
int perf_report_json(const struct perf_report *rp, FILE *f);
int perf_report_svg(const struct perf_report *rp, FILE *f);

#endif /* SHARDBFC_PERF_H */
