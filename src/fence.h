/*
 * fence.h -- fences: "this memory may still be in use by the work queued on
 * stream X before now".
 *
 * A fence is an event recorded on a stream.  Memory guarded by a fence is
 * handed to a stream other than X only once the event has completed; X
 * itself may reuse it at once, because its later work runs after its
 * earlier work (stream order).  Fences guard memory on every path where it
 * changes hands:
 *   - a block freed on a stream other than its owner's (remote.c): the
 *     owner's shard keeps it pending until the fence completes;
 *   - a block whose free must also wait for streams named by record_stream
 *     (one fence per named stream, chained through `extra`);
 *   - memory leaving a shard for the region pool (a large block's region, a
 *     fully free region, the free tail of a region, a retired shard's
 *     regions): a departure fence recorded on the owner stream (pool.c).
 *
 * Recording can fail (a device error, an injected fault, a stream that no
 * longer exists).  bfc__fence_arm then falls back, in order, to waiting for
 * the stream (stream_sync), to waiting for the whole device (device_sync),
 * and last to an "unfenced" fence that bfc__fence_query tries to record
 * again each time it is asked -- a later record fences more work, never
 * less -- and that never reports complete before one succeeds.  So a fence
 * never reports complete too early, whatever fails.
 *
 * Who touches a fence: whoever holds the structure it hangs on (the owner
 * arena's lock for pending frees, the pool lock for departed memory); the
 * hand-off of a cross-stream free's fence through the owner's queue is
 * ordered by `handoff` (remote.c).
 */
#ifndef BFC_FENCE_H
#define BFC_FENCE_H

#include <urcu/list.h>
#include <urcu/wfcqueue.h>

#include "backend.h"

struct bfc__chunk;

struct bfc__fence {
    struct cds_wfcq_node qnode;  /* owner's remote queue or fence pool */
    struct bfc__chunk *chunk;    /* pending free: the block it guards */
    /* Written (release) last before every enqueue and read (acquire) first
     * after every dequeue: orders the record's plain fields across the
     * queue, whose own synchronisation lives in liburcu. */
    _Atomic uint32_t handoff;
    int ev_err;                  /* ev NULL: the status its creation failed with */
    bfc__event_t ev;             /* NULL: no event (creation failed) */
    bool synced;                 /* fenced by a stream or device synchronisation instead */
    /* Neither recorded nor synchronised (every fallback failed):
     * bfc__fence_query records the event on unfenced_stream before it may
     * report complete. */
    bool unfenced;
    bfc_stream_t unfenced_stream;
    uint64_t unfenced_sid;       /* its id, for stream_for (backend.h) */
    /* A cross-stream free's own fence (remote.c): the id of the freeing
     * stream, on which the freeing thread recorded the event just before
     * it queued the fence.  0 for every other fence (record_stream's,
     * departures', one fenced by synchronisation), which are armed at
     * other moments than their place in the owner's pending list says.
     * Events of one stream complete in the order they were recorded, and a
     * thread's queued fences reach the pending list in the order it
     * recorded them, so a drain that finds one of them in flight need not
     * ask about the stream's later ones (arena.c, "Stuck streams"). */
    uint64_t sid;
    struct bfc__fence *extra;    /* further fences of the same block (recorded streams) */
    /* A fence is pending in its owner, idle in the pool's cache, or
     * guarding departed memory in the pool, never two at once. */
    union {
        struct cds_list_head plink; /* owner's pending list, oldest first (owner's lock) */
        struct bfc__fence *cnext;   /* pool's fence cache (pool lock) */
        /* A departure fence (pool.c, "Order"): how many departures the
         * pool had taken in when it was armed, and its own number there. */
        struct {
            uint64_t armed_after;
            uint64_t inserted;
        } order;
    };
};

/* Streams named by record_stream for a live chunk, each with the fence
 * record its free will use (taken when the stream is named, so that the
 * free itself never needs to allocate). */
struct bfc__recorded {
    bfc_stream_t stream;
    uint64_t id;
    struct bfc__fence *fence;
    struct bfc__recorded *next;
};

/* Records f on stream s, whose id is sid, with the fallbacks above, from
 * whatever thread: through the backend's stream_for, so that a per-thread
 * default stream armed by another thread is still fenced.  Never fails: at
 * worst f is left unfenced (to be recorded at a later query). */
void bfc__fence_arm(bfc__backend_t *be, struct bfc__fence *f, bfc_stream_t s, uint64_t sid);

/* BFC_OK when every fence of the chain f (through `extra`) has completed,
 * BFC_EBUSY if not (a query error counts as "not yet"). */
int bfc__fence_query(bfc__backend_t *be, struct bfc__fence *f);

/* Waits up to timeout_ms (UINT32_MAX: without bound) for every recorded
 * event of the chain f.  The caller queries afterwards. */
void bfc__fence_wait(bfc__backend_t *be, struct bfc__fence *f, uint32_t timeout_ms);

/* A fresh record with an event (ev NULL if the backend could not create
 * one: arming then falls back to synchronisation), or NULL when metadata is
 * exhausted.  bfc__fence_destroy frees a record and its event. */
struct bfc__fence *bfc__fence_new(bfc__backend_t *be);
void bfc__fence_destroy(bfc__backend_t *be, struct bfc__fence *f);

/* Resets the per-use fields of a record taken for a new use. */
static inline void bfc__fence_reset(struct bfc__fence *f)
{
    f->extra = NULL;
    f->chunk = NULL;
    f->synced = false;
    f->unfenced = false;
    f->unfenced_stream = NULL;
    f->unfenced_sid = 0;
    f->sid = 0;
    f->plink.next = f->plink.prev = NULL;
}

#endif /* BFC_FENCE_H */
