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

#include "trace_csv.h"

typedef struct bfc_replay_result {
    uint64_t peak_reserved;   /* bfc_stats_t.peak_bytes_reserved at the end */
    uint64_t peak_in_use;     /* bfc_stats_t.peak_bytes_in_use at the end */
    uint64_t peak_live;       /* exact context-wide peak of live chunk bytes seen by the replay */
    double fragmentation;     /* bfc_stats_fragmentation when peak_live was reached */
    double fragmentation_max; /* largest value seen at any new peak */
    uint64_t ooms;            /* trace allocations the replay could not serve */
    uint64_t allocs, frees;   /* operations replayed */
    uint64_t skipped;         /* frees of pointers the replay never handed out, failure rows */
    uint64_t unmatched_frees; /* of those, frees whose pointer no earlier allocate row (in
                                 replay order) returned: the trace began after the block was
                                 allocated, or its rows are out of order.  Those blocks stay
                                 live in the trace's program, so figures may be off. */
    uint64_t streams;         /* distinct streams of the trace */
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
int bfc_replay_run(const bfc_trace_event_t *ev, size_t n, const char *spec, const char *trace_out,
                   bfc_replay_result_t *out, char *err, size_t errlen);

#endif /* SHARDBFC_REPLAY_H */
