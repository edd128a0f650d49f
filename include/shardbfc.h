/*
 * shardbfc.h -- public API of libshardbfc, a sharded Best-Fit-with-Coalescing
 * allocator for GPU (and pinned host) memory.
 *
 * Each CUDA stream owns its own BFC arena ("shard"); allocation and same-stream
 * free touch only that shard.  A free issued on another stream is fenced with an
 * event recorded on the freeing stream and handed back to the owner through a
 * wait-free queue, so no block is reused while another stream may still use it.
 *
 * This header needs no CUDA header: bfc_stream_t is the same type as
 * cudaStream_t (struct CUstream_st *).  NULL means the default stream.
 *
 * Status codes: every function returning int returns BFC_OK (0) or a negative
 * BFC_E* code; bfc_strerror() describes it.  Functions returning a pointer
 * return NULL on failure; bfc_last_error() then gives the calling thread's
 * status for its most recent failed call.
 *
 * fork(): the library's pthread_atfork handlers hold every lock of the
 * library (and of liburcu, which it uses) across fork(), so a child forked
 * while other threads allocate, free or trim can go on using the library
 * (SIM and host memory; CUDA itself does not support use in a forked
 * child).  A cross-stream free in flight in another thread at the instant of
 * fork may be lost in the child (the block stays allocated there); the
 * parent is unaffected.  The library shares liburcu's urcu-bp domain with
 * the application: inside its own RCU read-side critical sections or
 * call_rcu callbacks, an application must not create or destroy contexts,
 * start or stop a trace or set an OOM callback while another thread may
 * fork (the fork would wait for a grace period that waits for that code).
 */
#ifndef SHARDBFC_H
#define SHARDBFC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define BFC_API __attribute__((visibility("default")))
#else
#define BFC_API
#endif

/* ---------------------------------------------------------------- types */

typedef struct CUstream_st *bfc_stream_t; /* == cudaStream_t; NULL = default stream */
typedef struct bfc_ctx bfc_ctx_t;         /* one allocator service for one device */

/* ---------------------------------------------------------------- errors */

/*
 * The one table of status codes: X(NAME, value, description).
 * BFC_OK and every BFC_E* constant, and bfc_strerror(), are generated from it.
 */
#define BFC_ERRNO_MAP(X)                                                        \
    X(OK, 0, "success")                                                        \
    X(ENOMEM, -1, "out of memory: the request cannot be served within the limit") \
    X(EINVAL, -2, "invalid argument or configuration")                         \
    X(ENOTOWNED, -3, "pointer was not allocated by this context")              \
    X(EDOUBLEFREE, -4, "pointer was already freed")                            \
    X(EBACKEND, -5, "device or runtime call failed")                           \
    X(ENODEV, -6, "no usable device for the chosen backend")                   \
    X(ECORRUPT, -7, "allocator invariant violated")                            \
    X(EBUSY, -8, "resource busy")                                              \
    X(ESTATE, -9, "operation not valid in the current state")

enum {
#define BFC__ERRNO_ENUM(name, val, desc) BFC_##name = (val),
    BFC_ERRNO_MAP(BFC__ERRNO_ENUM)
#undef BFC__ERRNO_ENUM
};

/*
 * Returns a static, human-readable description of a status code ("unknown
 * status" for a value not in the table).  Never NULL.
 * Context: thread-safe, lock-free, never blocks.
 */
BFC_API const char *bfc_strerror(int status);

/*
 * Returns the name of a status code ("BFC_ENOMEM"), or "BFC_UNKNOWN".
 * Context: thread-safe, lock-free, never blocks.
 */
BFC_API const char *bfc_err_name(int status);

/*
 * Returns the status of the calling thread's most recent call that failed
 * while returning a pointer (bfc_ctx_alloc, bfc_stream_alloc, bfc_host_alloc):
 * BFC_ENOMEM, BFC_EINVAL, ...  A successful pointer-returning call resets it to
 * BFC_OK; n == 0 (which returns NULL) sets BFC_OK too.
 * Context: thread-local, lock-free, never blocks.
 */
BFC_API int bfc_last_error(void);

/* --------------------------------------------------------- configuration */

typedef enum { BFC_BACKEND_AUTO, BFC_BACKEND_CUDA, BFC_BACKEND_SIM } bfc_backend_t;

typedef enum {
    BFC_HOST_NUMA_THREAD = -1, /* the node of the calling thread */
    BFC_HOST_NUMA_GPU = -2     /* the node nearest the context's GPU */
    /* >= 0: that NUMA node */
} bfc_host_numa_t;

typedef struct bfc_config {
    bfc_backend_t backend;        /* AUTO: CUDA when a device is usable, else SIM */
    int device;                   /* CUDA ordinal */
    size_t memory_limit;          /* bytes the context may hold from the device; 0 = backend default */
    bool allow_growth;            /* true: regions grown on demand (doubling from initial_region);
                                     false: the whole limit reserved at create */
    size_t initial_region;        /* first region size when growing (default 2 MiB) */
    double fragmentation_fraction;/* split threshold as a fraction of the limit; 0 = 128 MiB rule */
    bool garbage_collection;      /* under pressure, release fully free regions and retry */
    size_t large_alloc;           /* requests whose 256-rounded size is >= this get a region of their own,
                                     sized to the request rounded to 2 MiB (default 32 MiB; 0 = off) */
    unsigned retry_ms;            /* on OOM, wait up to this long for memory other threads free
                                     before failing (TensorFlow's allow_retry_on_failure; default 0) */
    /* ---- fields beyond API.md's minimum ---- */
    bool debug_check;             /* run bfc_ctx_check after every operation (slow) */
    bool poison;                  /* SIM: fill freed memory with 0xDB, verify on reuse */
    int host_numa;                /* bfc_host_numa_t or a node number (host arenas) */
    unsigned sim_fail_alloc_every;/* SIM fault injection: every Nth device allocation fails (0 = off) */
    unsigned sim_fail_event_every;/* SIM fault injection: every Nth event record/query fails (0 = off) */
    char oom_dump[256];           /* "": off; else on OOM the snapshot JSON is written to this path
                                     (see bfc_ctx_set_oom_callback) */
    char trace[256];              /* "": off; else every context traces to this path from its
                                     creation (see bfc_ctx_trace_start) */
} bfc_config_t;

/*
 * Sets every field of *cfg to its default: backend AUTO, device 0,
 * memory_limit 0 (backend default: SIM 16 GiB, CUDA the device's free memory),
 * allow_growth true, initial_region 2 MiB, fragmentation_fraction 0,
 * garbage_collection false, large_alloc 32 MiB, retry_ms 0, debug off,
 * host_numa thread, no fault injection, no oom_dump, no trace.
 * Context: thread-safe (touches only *cfg), never blocks.
 */
BFC_API void bfc_config_init(bfc_config_t *cfg);

/*
 * Applies a "key=value,key=value" spec to *cfg (fields not named keep their
 * value).  Keys are the field names above plus "backend" (auto|cuda|sim) and
 * "host_numa" (thread|gpu|N).  Sizes take an optional K/M/G suffix (KiB, MiB,
 * GiB); booleans are true/false/1/0 (also yes/no/on/off).  Paths (oom_dump,
 * trace) are taken verbatim (no commas, no control characters, at most 255
 * bytes).  An unknown key, a
 * malformed, negative or out-of-range value returns BFC_EINVAL and leaves *cfg
 * exactly as it was.  An empty or NULL spec is BFC_OK.
 * Context: thread-safe (touches only *cfg), never blocks.
 */
BFC_API int bfc_config_parse(bfc_config_t *cfg, const char *spec);

/*
 * Checks a configuration for consistency (non-zero initial_region, fraction in
 * [0, 1], ...).  BFC_OK or BFC_EINVAL.
 * Context: thread-safe, never blocks.
 */
BFC_API int bfc_config_validate(const bfc_config_t *cfg);

/* -------------------------------------------------------------- contexts */

/*
 * Creates an allocator context for one device.  cfg may be NULL (defaults).
 * With allow_growth=false the whole memory_limit is reserved from the backend
 * here.  Returns BFC_OK and *out, or BFC_EINVAL (bad config), BFC_ENODEV (the
 * chosen backend has no usable device), BFC_ENOMEM, BFC_EBACKEND.
 * Context: thread-safe; may block in the backend (device memory reservation).
 */
BFC_API int bfc_ctx_create(const bfc_config_t *cfg, bfc_ctx_t **out);

/*
 * Returns all device memory of the context to the backend and frees the
 * context.  Outstanding pointers become invalid.  No other thread may use ctx
 * during or after the call.  NULL is a no-op.
 * Context: not thread-safe with respect to ctx; blocks until pending RCU
 * callbacks have run (rcu_barrier).
 */
BFC_API void bfc_ctx_destroy(bfc_ctx_t *ctx);

/*
 * Allocates n bytes usable in stream order on `stream`.  The size is rounded
 * up to a multiple of 256 and the pointer is 256-byte aligned.  Returns NULL
 * with bfc_last_error() == BFC_OK for n == 0, NULL with BFC_ENOMEM when the
 * request cannot be served (also when rounding would overflow or n exceeds the
 * limit: state untouched).
 * Context: thread-safe.  Common path: lock-free shard lookup plus the stream's
 * own arena lock (uncontended when one thread drives the stream).  May block
 * on the slow path (growing, reclaiming memory from other shards, retry_ms).
 */
BFC_API void *bfc_ctx_alloc(bfc_ctx_t *ctx, bfc_stream_t stream, size_t n);

/*
 * Frees p in the order of `stream`.  If `stream` is the stream p was allocated
 * on, the block is reusable at once by later allocations on that stream.
 * Otherwise an event is recorded on `stream` (and on every stream named with
 * bfc_ctx_record_stream) and the block is reusable, by any stream, only after
 * all those events have completed.  free(NULL) is BFC_OK.  A pointer this
 * context did not return (foreign, interior, from another context) gives
 * BFC_ENOTOWNED; a second free gives BFC_EDOUBLEFREE; in both cases nothing
 * changes.  If the event cannot be recorded, the block is fenced by a full
 * synchronisation of `stream` instead (BFC_OK); if that fails too, BFC_EBACKEND
 * and the block stays allocated (free it again later).
 * Context: thread-safe; lock-free lookup; a same-stream free takes the owner
 * arena's lock; a cross-stream free takes the freeing stream's own arena lock
 * (for a pooled event) and enqueues wait-free to the owner.  Does not block.
 */
BFC_API int bfc_ctx_free(bfc_ctx_t *ctx, void *p, bfc_stream_t stream);

/*
 * Declares that p is also used by `stream`: when p is freed, its reuse is
 * fenced on the work queued on `stream` up to the free, too (PyTorch's
 * recordStream).  Recording the owner stream is a no-op.
 * BFC_ENOTOWNED / BFC_EDOUBLEFREE as for bfc_ctx_free; BFC_ENOMEM if the
 * record cannot be stored.
 * Context: thread-safe; takes the owner arena's lock; does not block.
 */
BFC_API int bfc_ctx_record_stream(bfc_ctx_t *ctx, void *p, bfc_stream_t stream);

/*
 * The stream is going away: its shard leaves the directory, its free regions
 * return to the region pool, its live blocks stay valid and are freed
 * normally later (the arena is reclaimed after its last block, after an RCU
 * grace period).  A later allocation on the same stream creates a new shard.
 * BFC_OK, or BFC_EINVAL if the stream has no shard.
 * Context: thread-safe; takes the shard's lock and the device-wide pool lock
 * (a rare path); does not wait for a grace period.
 */
BFC_API int bfc_ctx_stream_release(bfc_ctx_t *ctx, bfc_stream_t stream);

/*
 * Releases every fully free region (of every shard and of the pool) to the
 * backend.  Blocks whose fences are still pending are not touched.
 * Context: thread-safe; takes each arena lock in turn and the pool lock;
 * may block in the backend.
 */
BFC_API int bfc_ctx_trim(bfc_ctx_t *ctx);

/*
 * Introspection of a live block p returned by this context: the size asked
 * for, the size of its chunk (rounded), its allocation id (unique within the
 * context, increasing within a shard).  0 / 0 / -1 (or a negative status for
 * the id) when p is not a live block of ctx.
 * Context: thread-safe; takes the owner arena's lock.
 */
BFC_API size_t bfc_ctx_requested_size(bfc_ctx_t *ctx, const void *p);
BFC_API size_t bfc_ctx_allocated_size(bfc_ctx_t *ctx, const void *p);
BFC_API int64_t bfc_ctx_allocation_id(bfc_ctx_t *ctx, const void *p);

/* Returns the configuration the context runs with (backend resolved, limit
 * filled in).  Context: thread-safe, lock-free. */
BFC_API int bfc_ctx_config(bfc_ctx_t *ctx, bfc_config_t *out);

/* ------------------------------------------------- process-wide service */

/*
 * The process-wide service: one context per CUDA device, each created lazily
 * from SHARDBFC_CONF (read once) on first use.  The stream's own device picks
 * the context; NULL means the calling thread's current device (device 0 on
 * SIM).  A pointer finds its context by itself.
 *
 * bfc_stream_alloc / bfc_stream_free / bfc_record_stream / bfc_stream_release
 * behave exactly as their bfc_ctx_* counterparts on that context.
 * bfc_free(p) frees on the stream p was allocated on (immediately reusable by
 * that stream).
 * Context: thread-safe; same locking as the bfc_ctx_* calls; the first call
 * for a device creates its context (one-time lock).
 */
BFC_API void *bfc_stream_alloc(bfc_stream_t stream, size_t n);
BFC_API int bfc_stream_free(void *p, bfc_stream_t stream);
BFC_API int bfc_free(void *p);
BFC_API int bfc_record_stream(void *p, bfc_stream_t stream);
BFC_API int bfc_stream_release(bfc_stream_t stream);

/*
 * The process-wide context of the calling thread's current device (created on
 * first use), or NULL with bfc_last_error() set when it cannot be created.
 * Context: thread-safe.
 */
BFC_API bfc_ctx_t *bfc_default_ctx(void);

/*
 * Destroys every process-wide context (for tests and orderly shutdown).
 * Pointers from the process-wide service become invalid; later calls create
 * fresh contexts.
 * Context: no other thread may use the process-wide service concurrently.
 */
BFC_API void bfc_shutdown(void);

/* ------------------------------------------------- host pinned memory */

/*
 * Pinned (CUDA) or plain (SIM) host memory placed on the calling thread's
 * NUMA node (see host_numa).  Same rounding, alignment and NULL rules as
 * bfc_ctx_alloc.  bfc_host_free frees from any thread (another thread's block
 * returns to its owner's arena).  bfc_host_numa_node reports where the pages
 * actually are.  bfc_host_record_stream: the block is not reused until the
 * stream's work queued before the free has completed.
 * Context: thread-safe; the calling thread's own arena lock on the common path.
 */
BFC_API void *bfc_host_alloc(size_t n);
BFC_API int bfc_host_free(void *p);
BFC_API int bfc_host_numa_node(const void *p);
BFC_API int bfc_host_record_stream(void *p, bfc_stream_t stream);


/* ------------------------------------------------------- introspection */

typedef struct bfc_stats {
    uint64_t num_allocs;         /* cumulative successful allocations */
    uint64_t num_frees;          /* cumulative frees (a fenced free counts when issued) */
    uint64_t bytes_in_use;       /* sum of live chunk sizes (bfc_ctx_allocated_size) */
    uint64_t peak_bytes_in_use;
    uint64_t bytes_requested;    /* sum of requested sizes live */
    uint64_t largest_alloc_size; /* largest chunk handed out (TensorFlow counts the chunk size) */
    uint64_t bytes_limit;
    uint64_t bytes_reserved;     /* held from the device: context = all backend memory, shard = its regions */
    uint64_t peak_bytes_reserved;
    uint64_t num_regions;        /* regions owned by shards (context) / by this shard */
    uint64_t num_shards;         /* live shards (context) / 1 */
    uint64_t num_remote_frees;   /* frees issued on a stream other than the owner's */
    uint64_t num_pending_frees;  /* freed blocks still waiting for their fence */
    uint64_t num_ooms;           /* allocations that failed for lack of memory */
    /* ---- beyond API.md's minimum ---- */
    uint64_t bytes_free;         /* free chunk bytes in bins */
    uint64_t largest_free_chunk;
    uint64_t bytes_pending;      /* bytes of blocks waiting for fences */
    uint64_t num_chunks;         /* chunk records in use (free + in use + pending) */
    uint64_t num_poison_errors;  /* poison=true: blocks found written after free when reused */
} bfc_stats_t;

/*
 * Statistics of the whole context (shards summed, pool included) or of one
 * stream's shard.  Exact at the moment of the call: each shard's remote-free
 * queue is drained first.  bfc_ctx_stream_stats gives BFC_EINVAL when the
 * stream has no shard.
 * Context: thread-safe; takes each arena lock in turn (never two at once).
 */
BFC_API int bfc_ctx_stats(bfc_ctx_t *ctx, bfc_stats_t *out);
BFC_API int bfc_ctx_stream_stats(bfc_ctx_t *ctx, bfc_stream_t s, bfc_stats_t *out);

/*
 * External fragmentation of the free memory in *s (context or shard figures):
 * 1 - largest_free_chunk / bytes_free, in [0, 1).  0 when nothing is free or
 * all free bytes are one chunk; near 1 when the free bytes are scattered over
 * many small chunks, so a request much smaller than bytes_free can fail.  A
 * context's value uses the largest chunk of any shard over the free bytes of
 * all shards (a block never spans shards).  0 for s == NULL.
 * Context: pure function of *s; thread-safe, never blocks.
 */
BFC_API double bfc_stats_fragmentation(const bfc_stats_t *s);

/*
 * Host statistics: all NUMA nodes summed, or one node's (os index), in the
 * same bfc_stats_t as device memory (num_shards = live thread arenas).
 * bfc_host_node_stats gives BFC_EINVAL for a node with no host arena yet.
 * bfc_host_ctx returns the host context of a node (for bfc_ctx_dump,
 * bfc_ctx_check, bfc_ctx_snapshot_json), or NULL if it has none yet.
 * bfc_host_numa_nodes is the number of NUMA nodes hwloc reports.
 * Context: thread-safe; takes each host arena lock in turn.
 */
BFC_API int bfc_host_stats(bfc_stats_t *out);
BFC_API int bfc_host_node_stats(int node, bfc_stats_t *out);
BFC_API bfc_ctx_t *bfc_host_ctx(int node);
BFC_API int bfc_host_numa_nodes(void);

/* Peaks (in use, reserved) := current values.  Context: as bfc_ctx_stats. */
BFC_API int bfc_ctx_clear_peaks(bfc_ctx_t *ctx);

/*
 * Verifies every invariant of DESIGN.md.  Returns BFC_OK or BFC_ECORRUPT;
 * bfc_ctx_check_report() also writes which invariant broke and where
 * ("invariant 3: free chunk 0x... (size 512) not in bin 1") into buf.
 * Context: thread-safe; takes each arena lock in turn and the pool lock.
 */
BFC_API int bfc_ctx_check(bfc_ctx_t *ctx);
BFC_API int bfc_ctx_check_report(bfc_ctx_t *ctx, char *buf, size_t len);

/*
 * Human-readable memory map (regions, chunks in address order with state,
 * size, requested size; bin summary), like TensorFlow's memory log; and a
 * machine-readable JSON snapshot (schema in doc/snapshot.md).
 * Context: thread-safe; takes each arena lock in turn.
 */
BFC_API int bfc_ctx_dump(bfc_ctx_t *ctx, FILE *f);
BFC_API int bfc_ctx_snapshot_json(bfc_ctx_t *ctx, FILE *f);

/* ------------------------------------------------------- observability */

/*
 * Out-of-memory callback (RMM's failure callback): called when an allocation
 * of `size` bytes on `stream` fails for lack of memory (BFC_ENOMEM), with the
 * context's statistics at that moment in *summary, and the arg given to the
 * setter.  No allocator lock is held during the call, so the callback may
 * free memory (bfc_ctx_free, bfc_ctx_trim) or log; it must not destroy ctx.
 * A non-zero return asks for the allocation to be retried, once: the retry's
 * outcome is final (a second failure calls the callback no more).  Zero:
 * the allocation fails (NULL, BFC_ENOMEM) at once.
 */
typedef int (*bfc_oom_fn)(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream,
                          const bfc_stats_t *summary, void *arg);

/*
 * Sets (fn != NULL) or removes (fn == NULL) the context's OOM callback.
 * Independently, with config oom_dump=PATH the snapshot JSON
 * (bfc_ctx_snapshot_json) is written to PATH when an allocation finally
 * fails: at most once a second per context, each dump replacing the file
 * (written to PATH.tmp, then renamed).  BFC_OK or BFC_EINVAL (ctx NULL).
 * Context: thread-safe; a call racing an OOM may or may not see the new
 * callback.
 */
BFC_API int bfc_ctx_set_oom_callback(bfc_ctx_t *ctx, bfc_oom_fn fn, void *arg);

/*
 * Allocation trace: from bfc_ctx_trace_start until bfc_ctx_trace_stop (or
 * the context's destruction) every allocation, allocation failure, free call,
 * completion of a fenced free, region taken by a shard ("grow") and region
 * given back ("release") is written to `path` (created or truncated) as CSV
 * in RMM's logging format: header "Thread,Time,Action,Pointer,Size,Stream",
 * one row per event (doc/trace.md).  Events go to per-thread buffers and
 * reach the file in batches; everything recorded is in the file when
 * bfc_ctx_trace_stop returns.  Config trace=PATH starts a trace at
 * bfc_ctx_create.  With no trace running the allocation paths test one flag.
 * bfc_ctx_trace_start: BFC_OK, BFC_EBUSY (a trace is already running),
 * BFC_EINVAL (path cannot be created), BFC_ENOMEM.
 * bfc_ctx_trace_stop: BFC_OK, BFC_ESTATE (no trace running), BFC_EBACKEND
 * (a write to the file failed: the trace is incomplete).
 * Context: thread-safe; start/stop serialise on a per-context lock; stop
 * blocks for an RCU grace period (the moment every thread has left the
 * allocator's lock-free sections) and for the file writes.
 */
BFC_API int bfc_ctx_trace_start(bfc_ctx_t *ctx, const char *path);
BFC_API int bfc_ctx_trace_stop(bfc_ctx_t *ctx);

#ifdef __cplusplus
}
#endif
#endif /* SHARDBFC_H */
