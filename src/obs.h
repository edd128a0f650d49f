/*
 * obs.h -- observability state of a context: the allocation trace (trace.c)
 * and the out-of-memory report (obs_oom.c); set up and torn down by the
 * context (ctx.c), which also writes the OOM dump.
 *
 * Embedded in struct bfc_ctx (ctx.h).  The fast paths read one field of it,
 * `trace`, with a relaxed load: NULL (no trace running) costs one predictable
 * branch.  Everything else is touched only on slow paths: trace start/stop
 * and OOM reports serialise on `lock`.
 */
#ifndef BFC_OBS_H
#define BFC_OBS_H

#include "internal.h"
#include "mutex.h"

struct bfc_ctx;
struct bfc__trace; /* trace.c */
struct bfc__oom_report; /* obs_oom.c */

struct bfc__obs {
    /* Non-NULL while a trace runs.  Set (release) by trace_start after the
     * record is initialised, cleared by trace_stop before a grace period;
     * dereferenced only inside an RCU read-side section (trace.c). */
    struct bfc__trace *_Atomic trace;
    bfc__mutex_t lock;     /* trace start/stop, the OOM callback, oom_dump */
    bool lock_ready;
    bfc_oom_fn oom_fn;     /* under lock */
    void *oom_arg;
    uint64_t last_dump_ns; /* under lock: oom_dump rate limit (0: never dumped) */
    bool dumping;          /* under lock: an oom_dump file is being written */
    bool dump_failed_said; /* under lock: stderr said a dump could not be written */
    struct bfc__oom_report *last_oom; /* under lock: the most recent OOM report */
};

/* Trace actions; the CSV spellings are in trace.c (and tools/trace_csv.c). */
enum bfc__trace_action {
    BFC__TR_ALLOC,
    BFC__TR_ALLOC_FAIL,
    BFC__TR_FREE,
    BFC__TR_FREE_COMPLETE,
    BFC__TR_GROW,
    BFC__TR_RELEASE
};

/* Is a trace running?  The one test on the allocation and free paths.
 * relaxed: a stale answer only drops or adds an event at the edges of a
 * trace; trace.c re-reads the pointer inside its RCU section. */
static inline bool bfc__tracing(struct bfc__obs *o)
{
    return BFC__UNLIKELY(atomic_load_explicit(&o->trace, memory_order_relaxed) != NULL);
}


/* Records one event of the calling thread (trace.c).  Call with or without
 * an arena lock held (the trace's locks nest inside arena locks); never with
 * the trace registry lock.  A no-op when no trace runs. */
void bfc__trace_event(struct bfc__obs *obs, enum bfc__trace_action action, uintptr_t ptr, size_t size,
                      bfc_stream_t stream);

/* OOM report (obs_oom.c), called with no allocator lock held: makes the
 * report (bfc_ctx_oom_info), then calls the callback: true when it asks for
 * a retry.  `stats` fills the statistics the callback is given: the context
 * passes bfc_ctx_stats, so the report does not call up into the snapshot
 * code (stats.c), which itself prints the report (bfc__oom_json). */
bool bfc__oom_callback(struct bfc_ctx *ctx, size_t n, bfc_stream_t stream,
                       int (*stats)(bfc_ctx_t *ctx, bfc_stats_t *out));
/* The "oom" member of the snapshot: `,"oom":{...}` or `,"oom":null`.  Takes
 * obs.lock; call with no allocator lock held. */
void bfc__oom_json(struct bfc_ctx *ctx, FILE *f);
/* Context destruction: frees the last report. */
void bfc__oom_fini(struct bfc_ctx *ctx);

#endif /* BFC_OBS_H */
