/*
 * pool.h -- the device-wide region pool: hands ranges of device memory to
 * shards as regions and takes them back, fenced (see pool.c for the essay).
 *
 * The pool owns its backend handle, its limit and its growth mode; its API
 * takes the pool itself, never the context.
 */
#ifndef BFC_POOL_H
#define BFC_POOL_H

#include <pthread.h>

#include "backend.h"
#include "fence.h"

/* A piece of memory held from the backend (growth: one per backend
 * allocation; no growth: the one reservation of the whole limit). */
struct bfc__segment {
    uintptr_t base;
    size_t size;
    size_t free_bytes;
    struct bfc__segment *next;
};

/*
 * A free range of a segment, in address order.  `fence` NULL: any stream may
 * take it.  Otherwise it departed from the shard of stream `sid` and may
 * still be in use by that stream's work queued before the departure: only
 * that stream may take it until the fence completes.  Adjacent spans of one
 * segment are merged when they carry the same guard (none, or the same
 * stream: the fences that no newer one of the stream covers, chained
 * through `extra`; pool.c, "Order").
 */
struct bfc__span {
    uintptr_t base;
    size_t size;
    struct bfc__segment *seg;
    struct bfc__span *next, *prev;
    struct bfc__fence *fence;
    uint64_t sid;
};

/*
 * What giving memory back may need: a span record and a departure fence,
 * taken before anything changes so that the give-back itself cannot fail
 * (every region holds one for its own departure).
 */
struct bfc__pool_ticket {
    struct bfc__span *span;
    struct bfc__fence *fence;
};

/* A reservation an expandable arena gave back with granules still mapped:
 * released (va_release) once its departure fence completes, unless a new
 * shard of the same stream adopts it first (bfc__pool_vmm_adopt).  The
 * record is reserved with the arena, so the departure never allocates. */
struct bfc__vmm_gone {
    uintptr_t base;
    size_t size, mapped;
    struct bfc__fence *fence;    /* NULL: release at once */
    uint64_t sid;                /* the stream whose shard it left */
    bfc_stream_t stream;         /* that stream's handle (the trace's rows) */
    uint64_t *bits;              /* its mapped granules, one bit each (freed with it) */
    size_t words;                /* of bits */
    bool refused;                /* the device refused its release part way:
                                    never adopted, offered again at each poll */
    struct bfc__vmm_gone *next;
};

struct bfc__pool {
    bfc__mutex_t lock;           /* device-wide: slow paths only (see pool.c) */
    bfc__backend_t *be;
    size_t limit;
    bool growth;
    /* Growth: wholly free segments go back to the backend to make room for
     * a new one (garbage_collection; without it only trim frees them, and
     * a request the cached segments cannot hold fails, as TensorFlow's
     * allocator keeps its regions). */
    bool recycle;
    struct bfc__segment *segs;
    struct bfc__span *spans;     /* address order */
    size_t held;                 /* bytes held from the backend */
    size_t peak_held;
    /* Bytes in regions lent to shards.  Written under `lock`; read without
     * it (relaxed) as an estimate by shards sizing a new region. */
    _Atomic size_t committed;
    size_t fenced_bytes;         /* free bytes still behind a departure fence */
    struct bfc__fence *fcache;   /* departure fence records ready for reuse */
    uint64_t backend_allocs, backend_frees;
    uint64_t refusals;           /* frees, unmaps and releases the device
                                    refused (the memory stays, held) */
    uint64_t departures, fenced_departures, fence_waits;
    /* Fenced departures taken in so far: written (release) under `lock`,
     * read (acquire) without it when a departure is armed (pool.c,
     * "Order"). */
    _Atomic uint64_t inserted;
    /* Expandable arenas: bytes mapped (counted in held and committed, so
     * the limit covers them), reservations waiting for their fences, and
     * the backend calls made. */
    size_t vmm_mapped;
    struct bfc__vmm_gone *vmm_gone;
    /* The context's trace (set after bfc__pool_init; NULL: none): a
     * departed reservation's granules going back write its "release"
     * rows here, as a shard's own unmaps write theirs (expand.c). */
    struct bfc__obs *obs;
    uint64_t vmm_maps, vmm_unmaps;
    uint64_t peak_rise_maps;     /* vmm_maps when a map last raised peak_held:
                                    how long the peak has stayed put */
    uint64_t peak_gen;           /* counts changes of peak_held other than
                                    falls: a refused map takes back its own
                                    rise only while this is unchanged */
    uint64_t vmm_adoptions;      /* departed reservations taken back by their stream */
    /* Mapped-but-free bytes that the expandable arenas published at their
     * last policy check (expand.c): a hint, read and written relaxed. */
    _Atomic size_t vmm_idle;
    /* And what their open loans of slack would add (expand.c, "When"). */
    _Atomic size_t vmm_lendable;
};

/* With growth == false the whole limit is reserved from the backend here;
 * `recycle`: see the field.  BFC_OK, BFC_ENOMEM (backend or metadata),
 * BFC_EBACKEND. */
int bfc__pool_init(struct bfc__pool *p, bfc__backend_t *be, size_t limit, bool growth, bool recycle);
/* Everything back to the backend (context teardown: no users left). */
void bfc__pool_fini(struct bfc__pool *p);

/* Reserves the records a later bfc__pool_put needs.  BFC_ENOMEM when
 * metadata is exhausted (nothing reserved). */
int bfc__pool_ticket_get(struct bfc__pool *p, struct bfc__pool_ticket *t);
/* Returns the unused parts of a ticket. */
void bfc__pool_ticket_put(struct bfc__pool *p, struct bfc__pool_ticket *t);

/*
 * A range of exactly `size` bytes for a new region of the shard of stream
 * `sid`: memory no fence guards, memory that departed from sid's own shard,
 * or (growth) fresh memory from the backend, within the limit.  *used is
 * set when any of it departed from sid's shard while possibly still in use
 * by sid's queued work (it must then be fenced again when it leaves).
 * BFC_ENOMEM when nothing fits; *fenced_others (may be NULL) then tells
 * whether memory guarded by other streams' fences could have served it
 * (waiting for them may help: bfc__pool_wait).
 */
int bfc__pool_get(struct bfc__pool *p, size_t size, uint64_t sid, uintptr_t *base, struct bfc__segment **seg,
                  bool *used, bool *fenced_others);

/*
 * Gives [base, base + size) of seg back.  With `used`, the memory may still
 * be in use by work queued on stream s (id sid): a departure fence is
 * recorded on s and only s may take it until the fence completes.  Consumes
 * the ticket (its unused records go back).  Never fails.
 * Context: may block only in the fence's fallbacks (a failed event record).
 */
void bfc__pool_put(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg, bool used,
                   bfc_stream_t s, uint64_t sid, struct bfc__pool_ticket *t);

/*
 * bfc__pool_put's two steps: bfc__pool_put_arm records the ticket's fence on
 * s when `used` (outside the pool lock: it may block in the fallbacks), and
 * bfc__pool_put_armed takes the range in under the lock.  Departures of one
 * stream id armed by different threads may be taken in in the other order
 * than they were armed; the pool keeps whichever fences that leaves
 * unordered (pool.c, "Order").  Call them in this order on one ticket, with
 * the same `used`.
 */
void bfc__pool_put_arm(struct bfc__pool *p, bool used, bfc_stream_t s, uint64_t sid, struct bfc__pool_ticket *t);
void bfc__pool_put_armed(struct bfc__pool *p, uintptr_t base, size_t size, struct bfc__segment *seg, bool used,
                         uint64_t sid, struct bfc__pool_ticket *t);

/* Waits up to timeout_ms (UINT32_MAX: without bound) for the departure
 * fences that keep memory from stream `sid` (all: every departure fence),
 * without holding the pool lock meanwhile.  Returns true when any memory
 * became free for sid. */
bool bfc__pool_wait(struct bfc__pool *p, uint64_t sid, bool all, uint32_t timeout_ms);

/* A range of a region that a shard could give back (a free tail). */
struct bfc__range {
    uintptr_t base;
    size_t size;
    struct bfc__segment *seg;
};

/*
 * Would the pool serve `size` bytes to stream sid if the ranges `extra`
 * (sorted by base; regions' free tails, given back and their fences done)
 * were added to its free memory?  So that a shard gives up a tail -- which
 * changes its regions for good -- only when that makes the request fit.
 */
bool bfc__pool_fits_with(struct bfc__pool *p, uint64_t sid, const struct bfc__range *extra, size_t n, size_t size);

/* The largest `size` bfc__pool_get could give stream sid now (fences
 * polled): a run of spans sid may take, or, with growth, what the limit
 * leaves for a new segment once wholly free segments went back; never more
 * than the limit leaves uncommitted.  The backend may still refuse a new
 * segment.  A multiple of 256. */
size_t bfc__pool_largest(struct bfc__pool *p, uint64_t sid);
/* The largest run of free memory the pool already holds that stream sid
 * may take now (fences polled): bfc__pool_largest without new segments.  A
 * multiple of 256. */
size_t bfc__pool_largest_held(struct bfc__pool *p, uint64_t sid);

/* Gives wholly free, unfenced segments back to the backend (growth mode
 * only); returns the bytes released. */
size_t bfc__pool_release_free(struct bfc__pool *p);
/* Asks the backend to give back what it kept after a refusal and counts
 * nowhere (va_settle); a refusal again is counted as one.  For trim. */
int bfc__pool_settle(struct bfc__pool *p);
/* How many frees, unmaps and releases the device has refused so far (the
 * memory stays held and counted): trim compares it across its work. */
uint64_t bfc__pool_refusals(struct bfc__pool *p);

/*
 * Expandable arenas (expand.c).  The pool does their limit accounting and
 * their backend calls, so that mapped bytes of every shard and classic
 * regions share one limit:
 * vmm_reserve  an address range of `size` bytes (nothing mapped);
 * vmm_map      charges `size` bytes against the limit (BFC_ENOMEM when it
 *              would pass it, after releasing departed reservations whose
 *              fences completed), then maps them; the charge is undone when
 *              the backend refuses (its status is returned);
 * vmm_fits     whether vmm_map could charge `size` bytes now (after the
 *              same release of completed departures): a growth that needs
 *              several runs of granules asks before mapping any, so that a
 *              request the limit refuses maps nothing;
 * vmm_unmap    unmaps and uncharges (the caller has waited for the fences);
 *              *done: the bytes from addr that the device took back (on
 *              BFC_EBACKEND the rest stays mapped and charged);
 * vmm_depart   a whole reservation leaves its arena with `mapped` bytes
 *              still mapped (`bits`, `words`: which granules): released at
 *              once without fence, else once the fence completes (polled
 *              with the pool's other fences, waited for by bfc__pool_wait);
 *              consumes `rec`, `bits` and the fence;
 * vmm_adopt    a departed reservation of stream `sid` with memory mapped,
 *              at least `min` bytes, taken back for a new shard of the same
 *              stream, fenced or not: its memory may still be in use by
 *              sid's work queued before the departure, and work sid queues
 *              later runs after it (stream order), as a classic span
 *              guarded by sid is sid's to take.  Its mapped bytes stay
 *              charged, now the new shard's; the caller owns the record and
 *              its bits (the fence goes back to the pool).  The one with
 *              the most mapped when there are several.  NULL if none.
 * vmm_gone_mapped  the most bytes mapped in a departed reservation of
 *              `sid` of at least `min` bytes that vmm_adopt could take
 *              (0: none), after releasing those whose fences completed.
 * fence_get / fence_put  departure fence records owned by the pool (never
 *              destroyed before bfc__pool_fini, so a waiter may hold their
 *              event without a lock).
 */
int bfc__pool_vmm_reserve(struct bfc__pool *p, size_t size, uintptr_t *base);
void bfc__pool_vmm_unreserve(struct bfc__pool *p, uintptr_t base, size_t size);
int bfc__pool_vmm_map(struct bfc__pool *p, uintptr_t addr, size_t size);
bool bfc__pool_vmm_fits(struct bfc__pool *p, size_t size);
int bfc__pool_vmm_unmap(struct bfc__pool *p, uintptr_t addr, size_t size, size_t *done);
void bfc__pool_vmm_depart(struct bfc__pool *p, struct bfc__vmm_gone *rec, uintptr_t base, size_t size,
                          size_t mapped, struct bfc__fence *fence, uint64_t sid, bfc_stream_t stream, uint64_t *bits,
                          size_t words);
struct bfc__vmm_gone *bfc__pool_vmm_adopt(struct bfc__pool *p, uint64_t sid, size_t min);
size_t bfc__pool_vmm_gone_mapped(struct bfc__pool *p, uint64_t sid, size_t min);
struct bfc__fence *bfc__pool_fence_get(struct bfc__pool *p);
void bfc__pool_fence_put(struct bfc__pool *p, struct bfc__fence *f);

struct bfc__pool_stats {
    size_t held, peak_held, committed;
    size_t free_bytes;           /* in free spans, fenced or not */
    size_t fenced_bytes;         /* of which behind an incomplete departure fence */
    size_t spans, segments;
    uint64_t departures, fenced_departures, fence_waits;
    uint64_t vmm_maps, vmm_unmaps, vmm_adoptions;
    /* Departed reservations' mapped bytes (released once their fence
     * completes, at the next poll): with a fence not yet seen complete,
     * and without (gone_stream: the stream fencing the largest). */
    size_t gone_fenced, gone_open;
    uint64_t gone_stream;
};
void bfc__pool_stats(struct bfc__pool *p, struct bfc__pool_stats *out);
/* Asks the fences of fenced spans and departed reservations once, without
 * waiting, so that figures read next (fenced bytes, spans) do not count
 * fences that completed since the pool's last allocation looked: such
 * spans become free for every stream, as at an allocation, and such
 * reservations open (released at the next allocation or trim: no device
 * memory is released here).  Under the pool lock. */
void bfc__pool_poll(struct bfc__pool *p);
void bfc__pool_clear_peak(struct bfc__pool *p);
/* By how much would `bytes` more held from the backend raise the most it
 * has held (peak_held, which the context reports as its peak reserved)?
 * 0: not at all.  *maps_since_rise (unless NULL): the map calls made
 * since a map last raised that peak -- how long it has stayed put.  A
 * snapshot: other shards map and unmap meanwhile. */
size_t bfc__pool_peak_excess(struct bfc__pool *p, size_t bytes, uint64_t *maps_since_rise);
/* Would they raise it at all? */
bool bfc__pool_would_peak(struct bfc__pool *p, size_t bytes);

/* Invariants (see pool.c); 0 or -1 with a message naming the broken one. */
int bfc__pool_check(struct bfc__pool *p, char *buf, size_t len);
int bfc__pool_check_locked(struct bfc__pool *p, char *buf, size_t len);

/* Every free span, for reports: up to max entries, returns the count. */
struct bfc__span_info {
    uintptr_t base;
    size_t size;
    bool fenced;                 /* behind an incomplete departure fence */
    uint64_t stream_id;          /* ... of this stream's shard */
    uintptr_t seg_base;          /* its segment (one backend allocation): spans of one */
    size_t seg_size;             /* segment are adjacent in the list, in address order */
    unsigned fences;             /* the fences guarding it: more than one only where
                                    departures of its stream crossed (pool.c, "Order") */
};
size_t bfc__pool_spans(struct bfc__pool *p, struct bfc__span_info *out, size_t max);

#endif /* BFC_POOL_H */
