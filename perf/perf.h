/*
 * perf.h -- the pieces of perf/shardbfc-perf and how they meet.
 *
 *   allocators.c  every allocator behind one small interface (struct
 *                 perf_alloc_ops): libshardbfc sharded, the same library
 *                 behind one mutex (TensorFlow's design), jemalloc, glibc
 *                 malloc, cudaMalloc and cudaMallocAsync (CUDA builds, run
 *                 only when a device is usable).
 *   gen.c         the workloads' event programs, generated from fixed seeds
 *                 before any clock starts: churn pairs, the synthetic
 *                 transformer serving trace, a replayed RMM CSV trace.
 *   workloads.c   the threads that run a program (or the cross-stream
 *                 pipeline) against an allocator and time every call.
 *   report.c      the table on stdout, the JSON file, the SVG chart.
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
    /* Peak bytes held from the device (or the OS) since init, if it can say. */
    bool (*stats)(struct perf_allocator *a, uint64_t *peak_reserved);
    /* Bytes still in use by the program (0 after a clean run), if it can say. */
    bool (*in_use)(struct perf_allocator *a, uint64_t *bytes);
    void (*fini)(struct perf_allocator *a);
};

struct perf_allocator {
    const struct perf_alloc_ops *ops;
    enum perf_mem mem;
    bfc_stream_t *streams; /* nstreams entries (single-lock: all the same) */
    unsigned nstreams;
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
    double seconds;          /* timed window */
    uint64_t ops;            /* calls (allocations + frees) */
    double ops_per_sec;
    struct perf_hist *hist;  /* all calls, merged over threads (owned) */
    uint64_t p50_ns, p99_ns, p999_ns;
    uint64_t alloc_p99_ns, free_p99_ns;
    double cpu_share;        /* thread CPU time / (wall x usable CPUs) */
    bool have_mem;           /* peak_reserved / fragmentation known */
    uint64_t peak_reserved;
    uint64_t peak_requested; /* always measured by the harness */
    double fragmentation;    /* peak_reserved / peak_requested */
    double frees_per_sec_per_consumer; /* cross: frees / time inside free; else 0 */
    unsigned consumers;
};

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
};

/* Runs prog[t] on thread t (t < cfg->threads) against a; fills r (ops,
 * latencies, peaks).  0, or -1 after printing why (an allocation failed). */
int perf_run_prog(struct perf_allocator *a, struct perf_prog *const *prog,
                  const struct perf_run_cfg *cfg, struct perf_result *r);

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
    char params_json[2048];  /* members of "parameters", already formatted */
    struct perf_result *res;
    unsigned nres;
    struct perf_skip *skip;
    unsigned nskip;
    struct perf_target *tgt;
    unsigned ntgt;
};

/* The result for (workload, allocator, threads), or NULL. */
struct perf_result *perf_report_find(const struct perf_report *rp, const char *workload,
                                     const char *allocator, unsigned threads);
void perf_report_table(const struct perf_report *rp, const char *workload, FILE *f);
int perf_report_json(const struct perf_report *rp, FILE *f);
int perf_report_svg(const struct perf_report *rp, FILE *f);

#endif /* SHARDBFC_PERF_H */
