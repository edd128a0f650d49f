/*
 * trace_csv.h -- reader of allocation traces in RMM's CSV format.
 *
 * A trace is the file libshardbfc writes with SHARDBFC_CONF=trace=PATH (or
 * bfc_ctx_trace_start), or a log of RMM's logging_resource_adaptor.  Both
 * have the header "Thread,Time,Action,Pointer,Size,Stream" and one event a
 * row.  RMM writes the actions "allocate", "allocate failure" and "free";
 * libshardbfc adds "free_complete" (a fenced block became reusable), "grow"
 * (a region was taken from the device) and "release" (a region went back).
 * doc/trace.md describes the columns.
 *
 * The reader is not part of the library: tools (shardbfc-replay, the perf
 * harness) and tests compile tools/trace_csv.c in.  It is plain C11 with no
 * dependency, allocates with malloc and keeps no state between calls, so it
 * is safe to call from any thread on different files.
 */
#ifndef SHARDBFC_TRACE_CSV_H
#define SHARDBFC_TRACE_CSV_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The table of actions the library writes (not installed; by path). */
#include "../src/trace_actions.h"

#ifdef __cplusplus
extern "C" {
#endif

/* BFC_TRACE_ALLOC ("allocate"), BFC_TRACE_ALLOC_FAIL ("allocate
 * failure"), ...: one per row of the table, numbered in its order; its
 * comment says what each means. */
typedef enum {
#define BFC_TRACE_ACTION_ENUM(name, csv) BFC_TRACE_##name,
    BFC_TRACE_ACTIONS(BFC_TRACE_ACTION_ENUM)
#undef BFC_TRACE_ACTION_ENUM
} bfc_trace_action_t;

typedef struct bfc_trace_event {
    uint64_t thread;    /* thread id as written (decimal) */
    uint64_t time_ns;   /* ns: as written by libshardbfc; RMM's HH:MM:SS.ffffff as ns since midnight */
    int action;         /* bfc_trace_action_t */
    uint64_t ptr;       /* 0 for a nil pointer ("0x0", "(nil)", "0", empty) */
    uint64_t size;      /* bytes */
    uint64_t stream;    /* stream handle value; 0 = default stream */
} bfc_trace_event_t;

/*
 * Reads the trace at path ("-": standard input) into a malloc'ed array
 * (*out, *n events, in file order; free it with free()).  The header row names the columns, in any
 * order; Action, Pointer and Size are required, Thread, Time and Stream
 * default to 0 when absent.  Blank lines and CR LF line ends are accepted.
 * Returns 0, or -1 with a message ("trace.csv:12: unknown action 'foo'") in
 * err (when errlen > 0) and *out == NULL.
 */
int bfc_trace_csv_read(const char *path, bfc_trace_event_t **out, size_t *n,
                       char *err, size_t errlen);

/* The same, from an open stream (name is used in messages only). */
int bfc_trace_csv_read_stream(FILE *f, const char *name,
                              bfc_trace_event_t **out, size_t *n,
                              char *err, size_t errlen);

/*
 * Replay order.  libshardbfc writes each thread's events in batches, so a
 * trace of several threads is in time order per thread but not across
 * threads (one thread's batch of 512 events can follow another's that
 * started later).  Read top to bottom, such a file overstates what was live
 * at once (a thread's frees show up before the allocations other threads
 * made meanwhile, or after).  The replay order is therefore a stable sort
 * by Time when every thread's events are in time order -- libshardbfc's
 * traces -- and the file order otherwise (RMM logs, whose wall-clock times
 * wrap at midnight; files edited by hand).  shardbfc-replay, the perf
 * harness's replay workload and the tests all use these functions, so they
 * all see the same sequence.
 *
 * bfc_trace_order fills order[0..n) with the indices of ev in replay order.
 * bfc_trace_sort puts ev itself in replay order.  Both return 1 when the
 * events were sorted by time, 0 when the file order was kept, -1 when out
 * of memory (order is then the identity; ev unchanged).
 */
int bfc_trace_order(const bfc_trace_event_t *ev, size_t n, size_t *order);
int bfc_trace_sort(bfc_trace_event_t *ev, size_t n);

/* bfc_trace_csv_read followed by bfc_trace_sort: the events a replay must
 * follow, in that order.  *sorted (when not NULL) receives the sort's 1 or
 * 0.  Returns 0, or -1 with a message in err. */
int bfc_trace_csv_read_ordered(const char *path, bfc_trace_event_t **out, size_t *n, int *sorted,
                               char *err, size_t errlen);

/* The CSV spelling of an action ("allocate", ...), or "?" when unknown. */
const char *bfc_trace_action_name(int action);

/* The action of a CSV spelling, or -1 when unknown. */
int bfc_trace_action_parse(const char *s);

#ifdef __cplusplus
}
#endif
#endif /* SHARDBFC_TRACE_CSV_H */
