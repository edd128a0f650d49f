/*
 * replay.h -- replays an allocation trace (trace_csv.h) against a
 * libshardbfc configuration on the SIM backend.  Used by tools/shardbfc-replay
 * and by tests/test_obs; public API of libshardbfc only.
 */
#ifndef SHARDBFC_REPLAY_H
#define SHARDBFC_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <shardbfc.h>

#include "trace_csv.h"

/*
 * The measures (README, "Measures"): requested = what the trace's program
 * asked for; allocated = the chunks this configuration handed out; reserved
 * = what it held from the (simulated) device; overhead = peak reserved /
 * peak requested.  Every figure here is exact.
 */
typedef struct bfc_replay_result {
    uint64_t peak_requested;  /* the trace's own peak of live requested bytes (bfc_replay_peak_requested):
                                 the same for every configuration */
    uint64_t peak_allocated;  /* peak of live chunk bytes of this replay, context-wide */
    uint64_t peak_reserved;   /* bfc_stats_t.peak_bytes_reserved at the end (the pool's own peak) */
    double overhead;          /* peak_reserved / peak_requested; 0 when nothing was requested */
    double fragmentation;     /* bfc_stats_fragmentation when peak_allocated was reached */
    /* The largest of those read at each new peak of allocated bytes (not
     * after every event: a statistics read drains the cross-stream queues,
     * so reading after every event would change the replay it measures). */
    double fragmentation_max_at_peaks;
    uint64_t ooms;            /* trace allocations the replay could not serve */
    uint64_t allocs, frees;   /* operations replayed */
    uint64_t skipped;         /* frees of pointers the replay never handed out, failure rows */
    uint64_t unmatched_frees; /* of those, frees whose pointer no earlier allocate row (in
                                 replay order) returned: the trace began after the block was
                                 allocated, or its rows are out of order.  Those blocks stay
                                 live in the trace's program, so figures may be off. */
    uint64_t replaced;        /* allocate rows of a pointer still live: its free is missing
                                 from the trace; the replay freed the earlier block (on its
                                 own stream) first, as the peak of requested bytes counts it
                                 gone (counted in frees too) */
    uint64_t streams;         /* distinct streams of the trace */
    uint64_t vmm_maps;        /* bfc_stats_t.num_vmm_maps at the end: device map calls */
    uint64_t vmm_unmaps;      /* bfc_stats_t.num_vmm_unmaps at the end */
    double maps_per_1k;       /* vmm_maps per 1,000 allocations replayed (0 without allocations) */
    double unmaps_per_1k;
    double seconds;           /* wall time of the replay loop */
} bfc_replay_result_t;

/*
 * Replays ev[0..n) on a fresh SIM context configured by spec (SHARDBFC_CONF
 * syntax over the defaults; backend is forced to sim).  Events are replayed
 * in time order when every thread's events are in time order (libshardbfc's
 * traces, whose threads' buffers reach the file out of order), else in file
 * order (RMM logs whose clock wrapped at midnight).  Each distinct trace
 * stream gets a SIM stream (0: the default stream); trace pointers map to
 * the replay's own.  allocate and free are replayed; allocate failure rows
 * are skipped; free_complete, grow and release are outcomes, not inputs, and
 * are ignored.  trace_out: when non-NULL the replay itself is traced there.
 * Returns 0, or -1 with a message in err.
 */
/*
 * The exact peak of requested bytes of ev[0..n) taken in order[] (the replay
 * order, bfc_trace_order): the largest sum of the sizes of live blocks.
 * allocate rows add their size, a free of a live pointer subtracts its
 * allocation's, an allocate of a pointer already live replaces it (its free
 * row is missing), failure rows and frees of unknown pointers count nothing.
 * Independent of any configuration: what the program needed.
 * Returns 0, -1 when out of memory, or -2 when the live bytes would pass
 * 2^64 - 1 (sizes no real trace holds; the sum is not wrapped).
 */
int bfc_replay_peak_requested(const bfc_trace_event_t *ev, size_t n, const size_t *order, uint64_t *peak);

/* The configuration a replay of SPEC (NULL: the defaults) runs with: SPEC
 * parsed, on SIM, without trace= and retry_ms (see bfc_replay_run).
 * BFC_OK, or BFC_EINVAL with the parser's reason in err. */
int bfc_replay_config(const char *spec, bfc_config_t *cfg, char *err, size_t errlen);

int bfc_replay_run(const bfc_trace_event_t *ev, size_t n, const char *spec, const char *trace_out,
                   bfc_replay_result_t *out, char *err, size_t errlen);

/* The streams a replay can serve in one run (its stream map), and the
 * streams a run of ev[0..n), in replay order (as bfc_trace_csv_read_ordered
 * leaves it), makes: those of its allocate rows and of its frees of live
 * pointers, other than the default stream (the per-thread default stream
 * once per thread; a free of a block whose allocation failed in a run
 * counts too).  A trace needing more is refused by bfc_replay_run ("too
 * many streams").  SIZE_MAX when out of memory. */
#define BFC_REPLAY_MAX_STREAMS 2047
size_t bfc_replay_streams(const bfc_trace_event_t *ev, size_t n);

#endif /* SHARDBFC_REPLAY_H */
