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
 * cudaStream_t (struct CUstream_st *).  On CUDA the library works in each
 * device's primary context, the CUDA runtime's: its calls make that
 * context current for their duration (pushed over the caller's and popped,
 * so the caller's own context and device are as they were, and a thread
 * that never chose a device gets no context made on GPU 0), and streams
 * must belong to it (cudaStreamCreate's; not streams of a context of the
 * caller's own, cuCtxCreate or green contexts).  NULL means the default stream: the
 * legacy one (cudaStreamLegacy), as libshardbfc is built -- a program built
 * with nvcc --default-stream per-thread must pass cudaStreamPerThread, not
 * 0, for its threads' default streams.  cudaStreamPerThread names the
 * calling thread's own stream, and libshardbfc treats it so: each thread
 * gets a shard of its own, which lives until that thread releases it
 * (bfc_ctx_stream_release(ctx, cudaStreamPerThread), bfc_stream_release
 * for the service) or exits.  An exited thread's shard is retired, as a
 * release would, by the next call on the context that makes a shard (the
 * first allocation of a new thread or stream) or trims (bfc_ctx_trim), on
 * that call's thread -- the exiting thread itself makes no call, since the
 * order of its exit handlers and the CUDA runtime's is unknown -- so
 * threads that come and go do not accumulate shards; until then the shard
 * keeps its metadata and its cached memory (other streams still reclaim
 * its free memory under pressure), and its blocks stay valid until freed
 * (bfc_free, from any thread).  (A thread whose first use of the stream on
 * a context comes from a thread-specific-data destructor in the last of
 * the PTHREAD_DESTRUCTOR_ITERATIONS rounds is not seen exiting: that shard
 * stays until the context goes.)  A block of one thread's per-thread
 * stream freed by another thread on its per-thread stream is a
 * cross-stream free (bfc_free frees on the owner's stream from any
 * thread); and when memory leaves such
 * a shard on another thread's call (reclaim, trim, a stream's release,
 * record_stream), its fence, which that thread cannot record on the owner's
 * stream, is recorded on the legacy default stream, whose work waits for
 * every blocking stream's earlier work (later than needed, never earlier).
 * CUDA graphs: a stream being captured is not a stream libshardbfc can
 * fence (an event recorded there becomes a node of the graph, and querying
 * it fails until the graph runs), so do not free on, or record_stream, a
 * capturing stream, nor let a capture in global mode run while other
 * threads allocate (a device allocation or event query of theirs would end
 * it): allocate a graph's memory before the capture and free it after.
 *
 * Status codes: every function returning int returns BFC_OK (0) or a negative
 * BFC_E* code; bfc_strerror() describes it.  Functions returning a pointer
 * return NULL on failure; bfc_last_error() then gives the calling thread's
 * status for its most recent failed call.
 *
 * Blocking: each function's comment says whether it is thread-safe and what
 * it may wait for (its "Context:" line) and, where it frees memory, when
 * that memory may be reused and by which stream.  The locks it names are
 * the library's own.  Most are held briefly, but a shard's lock is held
 * across its stream's allocation slow path (backend allocations and, on
 * CUDA, waits for device work: see "Memory") and across the backend calls
 * that map, unmap or give back its memory, the pool lock across cudaMalloc
 * and cudaFree, and a context's observability lock across a trace's start
 * and stop (see bfc_ctx_trace_start) and a snapshot's writes of its OOM
 * report: a call that takes one of them may wait that long.  Every lock is
 * also held while another thread forks (see "After fork()").  Wherever the
 * library records an event and the backend refuses, it synchronises the
 * stream instead: a wait for device work.  While a trace runs, a call that
 * records one of its events may write a batch of them to its file.  A call
 * that "does not block" waits for no device work, RCU grace period or file
 * itself (a running trace aside); it may still wait for the locks it names.
 *
 * Thread cancellation (deferred, the default): no call acts on a
 * cancellation request (an OOM callback's own code aside: no lock of the
 * library is held there).  The calls that may meet a cancellation point --
 * those that write a file, report on stderr, wait while they hold the
 * library's locks (the allocation slow path, trim, context creation and
 * destruction, bfc_shutdown, dumps and snapshots, a trace's start, stop and
 * writes) or set the process up -- turn cancellation off until they
 * return, so a thread cancelled while in one is cancelled at its next
 * cancellation point after it, never with a lock of the library held nor
 * with a dump cut short.  The library's fork handlers and its exit handler
 * (which stops running traces) do the same, so fork() and exit() from such
 * a thread complete.  Asynchronous cancellation
 * (PTHREAD_CANCEL_ASYNCHRONOUS) must be off across every call, as POSIX
 * requires for all but a few functions.
 *
 * After fork(): the library's fork handlers take every allocator lock
 * around the fork, so no lock another parent thread held is left locked in
 * the child; a fork during another thread's first host call (which loads
 * the hwloc topology) waits for that set-up to end.  On the SIM backend the child may go on using the library:
 * every context, stream, block and statistic of the parent is there as a
 * copy of its own (a block allocated before the fork is the child's copy;
 * freeing it in the child does not free it in the parent), and it may
 * create new contexts.  On CUDA a forked child cannot use the parent's CUDA
 * context at all -- CUDA does not survive fork() -- so it must not call any
 * bfc_ function on a context, stream or block inherited from the parent
 * (device or pinned host memory), nor use the process-wide service the
 * parent had started; a child that needs the GPU must exec() (or be
 * spawned) and start afresh.  In every case a trace the parent started
 * stays the parent's: the child writes nothing to it, and its exit does not
 * close it for the parent.  SHARDBFC_CONF is not read again in the child.
 * A cross-stream free in flight in another parent thread at the instant of
 * fork may be lost in the child (the block stays allocated there); the
 * parent is unaffected.  The library shares liburcu's urcu-bp domain with
 * the application: inside its own RCU read-side critical sections or
 * call_rcu callbacks, an application must not create or destroy contexts,
 * start or stop a trace or set an OOM callback while another thread may
 * fork (the fork would wait for a grace period that waits for that code).
 * The handlers are registered when the library is loaded (before main, or
 * inside dlopen), so that every fork runs them, also one that catches the
 * set-up at the first context half done (liburcu's call_rcu thread is made
 * there, not at load: a process that only links the library stays
 * single-threaded); a process that loads the library with dlopen while
 * another of its threads forks is not covered.
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

/* -------------------------------------------------------------- version */

/*
 * The version of this header; bfc_version() gives the library's ("0.9.0").
 * A program can compare the two at run time to notice a mismatch.
 *
 * ABI rules (what 1.0 will promise): functions are only ever added, never
 * changed or removed; bfc_config_t and bfc_stats_t keep their size and
 * layout, and new fields take space from their `reserved` words, which
 * bfc_config_init and the stats calls zero, so a program built against an
 * older header keeps working with a newer library (its new settings get
 * their defaults, which are always what a zero means).  The shared
 * library's libtool -version-info follows these rules (Makefile.am).
 */
#define BFC_VERSION_MAJOR 0
#define BFC_VERSION_MINOR 9
#define BFC_VERSION_PATCH 0

/*
 * The library's version, "MAJOR.MINOR.PATCH".  Never NULL.
 * Context: thread-safe, lock-free, never blocks.
 */
BFC_API const char *bfc_version(void);

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
 * Returns the status of the calling thread's most recent call among those
 * that return a pointer, a size or an id rather than a status
 * (bfc_ctx_alloc, bfc_stream_alloc, bfc_host_alloc, bfc_ctx_requested_size,
 * bfc_ctx_allocated_size, bfc_ctx_allocation_id): BFC_ENOMEM, BFC_EINVAL, ...
 * Each of them sets it, BFC_OK on success; n == 0 (which returns NULL) sets
 * BFC_OK too.
 * Context: thread-local, lock-free, never blocks.
 */
BFC_API int bfc_last_error(void);

/* --------------------------------------------------------- configuration */

typedef enum { BFC_BACKEND_AUTO, BFC_BACKEND_CUDA, BFC_BACKEND_SIM } bfc_backend_t;

typedef enum {
    BFC_HOST_NUMA_THREAD = -1, /* the node of the calling thread */
    BFC_HOST_NUMA_GPU = -2     /* the node nearest the context's GPU */
    /* A thread's node is the one local to the CPUs it is bound to, else to
       the CPU it runs on at its first host call, chosen once per thread:
       where several nodes hold memory for those CPUs, the one whose CPUs
       are fewest (a memory-only node that hwloc attaches to the whole
       machine, as CXL or persistent memory often is, is no CPU's own), then
       the one hwloc gives no subtype (DRAM before MCDRAM or HBM), then the
       lowest number. */
    /* >= 0: that NUMA node; one the machine lacks is served as THREAD,
       and stderr says so once (not a refusal: one spec may serve machines
       of several shapes) */
} bfc_host_numa_t;

typedef struct bfc_config {
    bfc_backend_t backend;        /* AUTO: CUDA when a device is usable, else SIM */
    int device;                   /* CUDA ordinal (SIM has one device: 0) */
    size_t memory_limit;          /* bytes the context may hold from the device; 0 = backend default */
    bool allow_growth;            /* true: regions grown on demand (doubling from initial_region);
                                     false: the whole limit reserved at create, and a stream's first
                                     region is all of it (TensorFlow's layout, see "Memory") */
    size_t initial_region;        /* first region size when growing (default 2 MiB) */
    double fragmentation_fraction;/* split threshold as a fraction of the limit as configured (at least 256
                                     bytes: an exact fit is never split); 0 = 128 MiB rule */
    bool garbage_collection;      /* under pressure, a shard also gives its own fully free regions
                                     back and the pool returns cached memory to the backend (without
                                     it only bfc_ctx_trim frees device memory: no cudaFree on the
                                     allocation path) */
    size_t large_alloc;           /* classic regions with allow_growth (expandable arenas and
                                     allow_growth=false ignore it): requests whose 256-rounded size is
                                     >= this get a region of their own, sized to the request rounded
                                     to 2 MiB (or its exact size where the pool has no such piece),
                                     all of it the block's chunk (not split: it goes back whole;
                                     default 32 MiB; 0 = off) */
    unsigned retry_ms;            /* on OOM, wait up to this long for memory other threads free
                                     before failing (TensorFlow's allow_retry_on_failure; default 0) */
    /* ---- libshardbfc's own additions (bfc_config_init sets them too) ---- */
    bool debug_check;             /* run bfc_ctx_check after every operation (slow) */
    bool poison;                  /* SIM: fill freed memory with 0xDB, verify on reuse (a debugging
                                     aid: it writes every byte of memory the context takes, so the
                                     pages are touched at once: 4 s for a fresh 1 GiB block on a busy
                                     2-core VM, where without it no page is touched) */
    int host_numa;                /* bfc_host_numa_t or a node number (host arenas) */
    char oom_dump[256];           /* "": off; else on OOM the snapshot JSON is written to this path
                                     (see bfc_ctx_set_oom_callback: it must be writable when the
                                     context is created) */
    char trace[256];              /* "": off; else every context traces to this path from its
                                     creation (see bfc_ctx_trace_start) */
    /* ---- added in 0.9 from the reserved words (zero is the default) ---- */
    uint64_t release_threshold;   /* expandable arenas: mapped-but-free bytes a shard keeps before it
                                     unmaps pages (cudaMemPoolAttrReleaseThreshold; default 0) */
    int32_t vmm;                  /* bfc_vmm_t: expandable (virtual-memory) arenas; default AUTO */
    uint32_t reserved_flags;      /* zero */
    /* ---- also from the reserved words, after 0.9.0 (zero is the default) ---- */
    uint64_t slack_decay_ms;      /* expandable arenas: free memory a shard keeps beyond
                                     release_threshold and left unused this long is released;
                                     0: the default, 10000 (10 s); BFC_DECAY_NEVER: kept */
    uint64_t reserved[13];        /* room for the settings of later versions: zero (see "version") */
} bfc_config_t;

/* bfc_config_t.slack_decay_ms: never ("slack_decay_ms=never"). */
#define BFC_DECAY_NEVER UINT64_MAX
/* bfc_config_t.slack_decay_ms = 0 means this many milliseconds. */
#define BFC_DECAY_DEFAULT_MS 10000

/* bfc_config_t.vmm (see "Expandable arenas" below). */
typedef enum {
    BFC_VMM_AUTO = 0, /* on when the backend has virtual memory and allow_growth is true,
                         unless large_alloc=0 with initial_region >= the limit (below) */
    BFC_VMM_ON = 1,   /* on; BFC_EINVAL at create without backend support or with allow_growth=false */
    BFC_VMM_OFF = 2   /* classic regions */
} bfc_vmm_t;

/*
 * Sets every field of *cfg to its default: backend AUTO, device 0,
 * memory_limit 0 (backend default: SIM 16 GiB, CUDA the device's free memory),
 * allow_growth true, initial_region 2 MiB, fragmentation_fraction 0,
 * garbage_collection true (as TensorFlow, whose TF_ENABLE_GPU_GARBAGE_COLLECTION
 * defaults to true), large_alloc 32 MiB, retry_ms 0, debug off,
 * host_numa thread, no oom_dump, no trace, vmm AUTO, release_threshold 0,
 * slack_decay_ms 0 (10 s), reserved words zero.  (Fault
 * injection, a test facility, is set on a context through shardbfc_sim.h.)
 * Context: thread-safe (touches only *cfg), never blocks.
 */
BFC_API void bfc_config_init(bfc_config_t *cfg);

/*
 * Applies a "key=value,key=value" spec to *cfg (fields not named keep their
 * value).  Keys are the field names above plus "backend" (auto|cuda|sim),
 * "host_numa" (thread|gpu|N) and "vmm" (auto|on|off, or any boolean
 * spelling below for on/off; keywords in any case).  Sizes are decimal
 * digits with an optional K/M/G suffix (KiB, MiB, GiB: binary, in any case,
 * also written KB/KiB, MB/MiB, GB/GiB); booleans are true/false/1/0 (also
 * yes/no/on/off).  ASCII whitespace around a key or value is ignored,
 * empty items are skipped, and a later item overrides an earlier one with
 * the same key.  Paths (oom_dump,
 * trace) are taken as written, less that surrounding whitespace (so a path
 * cannot begin or end with a space; no commas, no control characters, at
 * most 255 bytes).  An unknown key, a malformed, negative or out-of-range value
 * returns BFC_EINVAL and leaves *cfg exactly as it was.  An empty or NULL
 * spec is BFC_OK.
 *
 * Limits of the values:
 *   memory_limit      0 (the backend's default) or at least 256 bytes
 *   initial_region    at least 1 byte (rounded up to 256 when used)
 *   large_alloc       any size; 0 turns the large-request rule off
 *   fragmentation_fraction   a decimal number from 0 to 1 (a non-zero one
 *                     that underflows to 0, below about 2.5e-324, is refused)
 *   retry_ms          0 to 3600000 (one hour)
 *   release_threshold any size
 *   slack_decay_ms    1 to 4294967295 milliseconds, or never (0 is the
 *                     struct's default, 10 s, and not accepted in a spec)
 *   device, host_numa node   0 to 2147483647
 *   oom_dump, trace   at most 255 bytes
 *   one item          at most 4096 bytes (the spec itself is unbounded)
 * Context: thread-safe (touches only *cfg), never blocks.
 */
BFC_API int bfc_config_parse(bfc_config_t *cfg, const char *spec);

/*
 * bfc_config_parse, plus a reason: on BFC_EINVAL, err receives one line
 * that quotes the first bad item and says why it was refused, e.g.
 *   memory_limt=1G: unknown key 'memory_limt' (keys: backend, device, ...)
 *   memory_limit=1X: invalid value for memory_limit: expected a size: ...
 * (key and value quoted up to 64 bytes each, unprintable bytes as '?', so
 * the line is safe to log).  On BFC_OK err is "".  err is always
 * NUL-terminated when errlen > 0 and truncated to fit; err == NULL or
 * errlen == 0 asks for no message.  512 bytes hold any message.  *cfg
 * follows bfc_config_parse's contract exactly.
 * Context: thread-safe (touches only *cfg and err), never blocks.
 */
BFC_API int bfc_config_parse_err(bfc_config_t *cfg, const char *spec, char *err, size_t errlen);

/*
 * Checks a configuration for consistency (non-zero initial_region, fraction in
 * [0, 1], vmm=on only with allow_growth=true, ...).  BFC_OK or BFC_EINVAL.
 * What it cannot know without a device (whether the device has virtual
 * memory, its granule, whether a trace= path can be created) only
 * bfc_ctx_create checks.
 * Context: thread-safe, never blocks.
 */
BFC_API int bfc_config_validate(const bfc_config_t *cfg);

/*
 * bfc_config_validate, plus a reason: on BFC_EINVAL, err receives one line
 * naming the first refused field and its rule, e.g.
 *   vmm=on needs allow_growth=true (expandable arenas grow; ...)
 *   initial_region is 0 (at least 1 byte)
 * On BFC_OK err is "".  err is always NUL-terminated when errlen > 0 and
 * truncated to fit; err == NULL or errlen == 0 asks for no message.  256
 * bytes hold any message.
 * Context: thread-safe (touches only err), never blocks.
 */
BFC_API int bfc_config_validate_err(const bfc_config_t *cfg, char *err, size_t errlen);

/* -------------------------------------------------------------- contexts */

/*
 * Memory.  Each stream owns a shard: a BFC arena of regions (pieces of device
 * memory) cut into chunks.  A region-level pool holds the memory no shard
 * owns.  The rules a caller can rely on:
 *
 *   - Stream order.  A block freed on stream S is reusable at once by later
 *     allocations on S; any other stream gets that memory only after the work
 *     queued on S before the free -- and on every stream named with
 *     bfc_ctx_record_stream -- has completed.  This holds on every path on
 *     which memory changes hands: a cross-stream free, a large block's region
 *     going back to the pool, bfc_ctx_stream_release, another shard
 *     reclaiming free regions or free region tails under memory pressure,
 *     garbage collection, bfc_ctx_trim.  Memory leaving a shard carries an
 *     event recorded on the shard's stream when it leaves (unless the shard
 *     never handed any of it out; of a free region tail, the part above
 *     every block the region ever held leaves unfenced); the pool gives it
 *     to another stream only once that event has completed, and to the same
 *     stream at once.  A block given other streams with bfc_ctx_record_stream
 *     is reusable, even on S, only once their work queued before its free
 *     has completed.
 *   - Out of memory.  Before a request fails the allocator, in order: drains
 *     the shard's cross-stream frees; grows a new region within the limit;
 *     waits for the shard's own pending frees; gives the shard's fully free
 *     regions back to the pool so that they coalesce (allow_growth=false, or
 *     garbage_collection); takes other shards' fully free regions (handed
 *     over as they are once their events complete; only then, with
 *     garbage_collection, does the pool give its cached regions back to the
 *     backend and try again); gives free
 *     region tails back -- its own and other shards' -- when that makes the
 *     request fit; and waits for the events that still fence memory other
 *     streams gave back.  A request that the limit cannot hold beside the
 *     blocks in use (every shard's, blocks freed but not yet drained
 *     counted as free, pending ones too) skips what takes other shards'
 *     memory or gives cached memory back: it would fail all the same, the
 *     shards that cached the memory taking it again at their next block
 *     (TensorFlow's DeallocateFreeRegions makes the same test).  On CUDA
 *     the waits for events are unbounded (queued device work finishes); on
 *     SIM a held stream finishes only when drained, so the
 *     allocator does not wait there, and retry_ms bounds how long it polls
 *     (on either backend) for memory other threads free or drain.
 *   - Expandable arenas (vmm=on; vmm=auto, the default, picks them when
 *     the backend has virtual memory -- SIM always, CUDA where the device
 *     reports it -- allow_growth is true and the limit holds one granule,
 *     and is a whole number of granules or at least 64 of them: granules
 *     are mapped whole, so the rest of a last partial granule goes unused,
 *     which auto accepts only below 1/64 of the limit (a 3 MiB limit
 *     keeps classic regions and serves 3 MiB; vmm=on serves 2), and
 *     large_alloc=0 with initial_region at least the limit is not asked
 *     (that is TensorFlow's allocator with allow_growth=false exactly: one
 *     region of the limit, its split rule, which auto keeps); vmm=on
 *     without the first two makes bfc_ctx_create fail with BFC_EINVAL; host
 *     contexts always keep classic regions).  A shard then reserves, at its
 *     first allocation, addresses for twice the limit as its one region
 *     (mapped memory never passes the limit, but best fit leaves holes
 *     between live blocks that a larger block does not fit; where the
 *     address space refuses that, the limit, and where it refuses that
 *     too -- RLIMIT_AS, valgrind, a limit beyond it, thousands of
 *     shards -- a sixteenth of the limit, halved
 *     until it fits but never below the first block: that shard grows
 *     within its range only, but a block larger than the range, asked for
 *     while the shard holds no block (none live, none whose free waits for
 *     a fence), makes it reserve again -- the full range where the address
 *     space takes it by then, or a departed reservation of its stream --
 *     and give the old range up, which it keeps where the address space
 *     still refuses; an allocation fails with BFC_ENOMEM when not even its
 *     block's addresses can be had) and
 *     maps device memory behind it granule by granule (2 MiB on SIM and
 *     most GPUs): an allocation maps exactly the granules its block lacks
 *     -- no doubling --, and bytes_reserved counts mapped bytes.  Free
 *     granules (wholly inside free chunks) are unmapped only after an
 *     event recorded on the shard's stream has completed, and never on
 *     the common path (a map or unmap costs tens of microseconds on a
 *     GPU): a shard keeps its free granules mapped until another shard
 *     needs the limit for a request the limit can hold (then every free
 *     granule goes, its slow path
 *     waiting for those events, without bound on CUDA, not at all on
 *     SIM, so shards that peak at different times need no higher limit
 *     than one allocator would); until another shard grows within the
 *     limit while this one holds free granules beyond what it keeps for
 *     its own churn (release_threshold plus the slack below); until
 *     another shard's growth would raise the context's peak reserved
 *     (peak_bytes_reserved, which bfc_ctx_clear_peaks restarts), which
 *     this shard's slack then covers too, as much as that growth needs
 *     (a loan, counted by the granules lenders actually give: a shard
 *     that maps again while its loan is out lends no more for 256 of its
 *     allocations, twice as many at each such take-back up to 16,384, so
 *     shards whose use swings do not hand granules back and forth at
 *     every swing); until this shard grows while it holds free granules
 *     beyond release_threshold and the growth would raise the context's
 *     peak reserved (as many go as it would raise it), or the peak is
 *     still rising (a map raised it within the context's last 64; as many
 *     go as it maps: fragmentation while the peak rises must not raise
 *     it, and once it has settled, free granules under it cost no memory
 *     the context has not held; a shard whose growth keeps mapping again
 *     what its growth unmapped -- eight times within 256 allocations --
 *     keeps a granule more at growth, twice as much at each recurrence,
 *     halved after 1,024 allocations without it); until its frees
 *     leave more than release_threshold bytes mapped but free plus a
 *     slack that doubles whenever such a release is mapped again soon
 *     after and halves at the next such release when it was not (checked
 *     only when bytes in use drop a granule below the last check; such a
 *     release gives back the whole free granules beyond release_threshold
 *     and keeps the threshold, as a CUDA pool trims to it, and the next
 *     one marks granules once another threshold's worth (a granule at
 *     least) is free, until the shard next maps: so a shard holds from the
 *     threshold to the threshold plus that much plus the slack; granules
 *     still waiting for their event count as gone, and every release but
 *     trim, bfc_ctx_stream_release and a request the limit cannot
 *     otherwise serve keeps the threshold); until
 *     free memory beyond release_threshold has lain unused for
 *     slack_decay_ms (10 s by default; the shard looks at the first free
 *     after every 1,024 of its allocations, and gives back the least it
 *     held free at any such look during that time: a shard that stops
 *     allocating altogether keeps its memory until loans, trim or
 *     bfc_ctx_stream_release take it); and on bfc_ctx_trim.  The
 *     default threshold is 0, as cudaMemPoolAttrReleaseThreshold's: the
 *     slack, not the threshold, keeps frees that cycle memory from
 *     unmapping it, and a larger threshold makes a shard keep more (a
 *     higher peak: at 64 MiB, overhead 1.012 -> 1.265 on server2 of
 *     tests/traces, +7% and +5% on detect_frcnn and train_resnet18, no
 *     change on the other three) without saving device calls on every
 *     workload (vit_b16: 14 unmap calls per 1,000 allocations at 0, 39 at
 *     4 MiB, 11 at 64 MiB).  An
 *     allocation that lands on a granule waiting for its event takes it
 *     back at no cost.  So one stream's peak never keeps
 *     another stream out: a request succeeds when the limit minus what is
 *     mapped, plus what other shards can unmap, covers it (granules aside:
 *     a shard with a live block holds at least the granule under it, so at
 *     most limit / granule streams hold blocks at once -- 512 per GiB at
 *     2 MiB, however small their blocks; a server with more streams than
 *     that wants vmm=off, whose regions shrink to the block).
 *     large_alloc is ignored (a big block is a chunk like any other and its
 *     granules go back when freed); bins, best fit, the split rule and
 *     coalescing are TensorFlow's, except that a leftover with unmapped
 *     granules is always split off.  num_vmm_maps / num_vmm_unmaps count
 *     the device calls.  On CUDA the pages are read-write for the
 *     context's device only, and GPUDirect RDMA capable where the device
 *     supports that for such memory: peers (cudaDeviceEnablePeerAccess)
 *     cannot reach them, cudaIpcGetMemHandle does not apply, and
 *     cuMemGetAddressRange spans one granule.  Memory shared with other
 *     GPUs or processes wants vmm=off (cudaMalloc regions).
 *   - allow_growth=false.  The whole limit is reserved at create and a
 *     stream's first region is all of it: one stream gets exactly
 *     TensorFlow's layout (one region, exact splits from its front, large
 *     requests included).  A second stream is served from the free tail of
 *     that region, which the first shard gives back to the pool when the
 *     second needs memory (the region then ends at its last live block).
 *   - Classic regions with several shards (either allow_growth).  One
 *     shard alone follows TensorFlow's Extend exactly, garbage collection
 *     included (the region after it is min(curr, available)); a shard left
 *     with no region by trim or by another shard's reclaim starts its
 *     schedule again from initial_region.  While others exist,
 *     a new region takes at most half of the limit's free memory (one busy
 *     shard must not double its way to all of it while little is live), in
 *     whole multiples of the request (a stream whose blocks are of one size
 *     fills it to the end), and a region the split rule would hand to its
 *     one block whole (less than twice the block) is made the block's size:
 *     what is left stays in the pool for the other streams.  A shard that is
 *     not the context's only one, or not its first, grows into memory the
 *     pool already holds before new memory: where no free run of the pool
 *     covers the region, the largest run that covers the request is its
 *     region (released streams' and exited host threads' region tails,
 *     kept apart by their live blocks, are used, not left beside new
 *     regions), and the shard's schedule does not double for it: the next
 *     region is sized as if that one had not been taken (so a stream
 *     released once and used again may hold 2, 2 and 4 MiB where a fresh
 *     context holds 2, 4 and 8).
 */

/*
 * Creates an allocator context for one device.  cfg may be NULL (defaults).
 * With allow_growth=false the whole memory_limit is reserved from the backend
 * here.  Returns BFC_OK and *out, or BFC_EINVAL (bad config; also a trace=
 * path that cannot be created -- a process out of descriptors, memory or
 * disk gets bfc_ctx_trace_start's BFC_ENOMEM or BFC_EBACKEND instead --,
 * an oom_dump= path that cannot be written
 * (see bfc_ctx_set_oom_callback); vmm=on where the
 * backend has no virtual memory or the limit holds no granule), BFC_ENODEV (the
 * chosen backend has no usable device), BFC_ENOMEM (also: the process's
 * first context starts liburcu's call_rcu thread, and a context made when
 * no other exists its hash tables' resize thread; no thread could be made
 * -- RLIMIT_NPROC, a container's pids limit, no addresses for its stack; a
 * later call tries again), BFC_EBACKEND.
 * Context: thread-safe; may block in the backend (opening the device,
 * device memory reservation), on liburcu (the first context starts its
 * thread), on a thread it makes and joins first to learn that liburcu can
 * make its own, and, with config trace=PATH, on creating the file.
 */
BFC_API int bfc_ctx_create(const bfc_config_t *cfg, bfc_ctx_t **out);

/*
 * Returns all device memory of the context to the backend and frees the
 * context.  Outstanding pointers become invalid.  No other thread may use ctx
 * during or after the call.  NULL is a no-op.  Work still queued on the
 * device may use the memory: cudaFree waits for the device by itself, and
 * an expandable context (vmm) waits for it (cudaDeviceSynchronize) before
 * it unmaps its pages, whose unmapping does not; a host context (whose
 * destruction bfc_shutdown does) likewise before it unpins its memory.
 * Context: not thread-safe with respect to ctx; blocks for an RCU grace
 * period and until pending RCU callbacks have run (rcu_barrier), for a
 * running trace's last file writes (as bfc_ctx_trace_stop), and for the
 * device as above.
 */
BFC_API void bfc_ctx_destroy(bfc_ctx_t *ctx);

/*
 * Allocates n bytes usable in stream order on `stream`.  The size is rounded
 * up to a multiple of 256 and the pointer is 256-byte aligned.  Returns NULL
 * with bfc_last_error() == BFC_OK for n == 0, NULL with BFC_ENOMEM when the
 * request cannot be served (also when rounding would overflow or n exceeds the
 * limit: no memory moves, and the failure is counted in num_ooms and
 * reported, cause BFC_OOM_TOO_LARGE, like any other), and NULL with
 * BFC_EBACKEND when the device failed a call the allocation needed (a
 * runtime or driver error, not a lack of memory: the OOM callback and
 * report do not run; a later allocation may succeed).
 * Context: thread-safe.  Common path: lock-free shard lookup plus the stream's
 * own arena lock (uncontended when one thread drives the stream).  May block
 * on the slow path (growing, reclaiming memory from other shards, retry_ms;
 * on CUDA, waits for device work: see "Memory"), after a failure (the OOM
 * report, callback and oom_dump file) and, with a trace running, on a write
 * to its file.  A stream's first allocation also takes the arenas list
 * lock, and retires the shards of exited threads (see the top of this
 * file): each arena lock of those, and the pool lock.
 */
BFC_API void *bfc_ctx_alloc(bfc_ctx_t *ctx, bfc_stream_t stream, size_t n);

/*
 * Frees p in the order of `stream`.  If `stream` is the stream p was allocated
 * on and no other stream was named with bfc_ctx_record_stream, the block is
 * reusable at once by later allocations on that stream.  Otherwise an event
 * is recorded on `stream` (unless it is p's own) and on every stream named
 * with bfc_ctx_record_stream, and the block is reusable, by any stream, only
 * after all those events have completed.  free(NULL) is BFC_OK.  A pointer this
 * context did not return (foreign, interior, from another context) gives
 * BFC_ENOTOWNED; a second free gives BFC_EDOUBLEFREE; in both cases nothing
 * changes.  A second free is recognised also after the block's memory left
 * its shard (a large block's region at its free, trim, garbage collection,
 * a released stream): the library remembers the last 256 such ranges,
 * where any 256-byte boundary (a large block's: its start) reads as a
 * double free, until the library gives the memory out again (memory it
 * gave back to the device and that another allocator has handed out since
 * reads so too while its range is remembered).  If the event cannot be
 * recorded, the block is fenced by a full synchronisation of `stream`
 * instead (BFC_OK); if that fails too, BFC_EBACKEND and the block stays
 * allocated (free it again later).  A cross-stream free that cannot have
 * the host memory for its fence record, or for the record's event where
 * the synchronisation fails too, returns BFC_ENOMEM, the block likewise
 * still allocated.
 * Context: thread-safe; lock-free lookup; a same-stream free takes the owner
 * arena's lock; a cross-stream free takes the owner's fence-pool lock for a
 * few instructions (a pooled event), records the event, and enqueues
 * wait-free to the owner; for a block given streams by record_stream it
 * also tries the owner arena's lock once, to record their events at the
 * free (when another thread holds it, the owner records them as it takes
 * the block back: later than needed, never earlier), and takes the owner
 * arena's lock when the owner's stream was released.  A free that gives
 * memory back (a large block's region, an expandable arena's free granules)
 * also takes the pool lock and calls the backend (an event, an unmap).
 * Does not block, except for the synchronisation above and, with a trace
 * running, a write to its file.
 */
BFC_API int bfc_ctx_free(bfc_ctx_t *ctx, void *p, bfc_stream_t stream);

/*
 * Declares that p is also used by `stream`: when p is freed, its reuse is
 * fenced on the work queued on `stream` up to the free, too (PyTorch's
 * recordStream).  Recording the owner stream is a no-op.
 * BFC_OK; BFC_ENOTOWNED / BFC_EDOUBLEFREE as for bfc_ctx_free; BFC_EINVAL
 * (ctx or p NULL, or a stream the backend refuses); BFC_ENOMEM if the
 * record cannot be stored; BFC_EBACKEND if the runtime fails to name the
 * stream (cudaStreamGetId, or making the stream's device current).  On any
 * failure nothing is recorded.
 * Context: thread-safe; takes the owner arena's lock; does not block.
 */
BFC_API int bfc_ctx_record_stream(bfc_ctx_t *ctx, void *p, bfc_stream_t stream);

/*
 * The stream is going away: its shard leaves the directory, its free regions
 * and free region tails return to the region pool, fenced by an event
 * recorded on `stream` now (other streams get that memory once the work
 * queued on `stream` so far has completed), its live blocks stay valid and
 * are freed normally later (the arena is reclaimed after its last block,
 * after an RCU grace period; when that block's free was fenced on work
 * still queued, at the next shard made or released once that work has
 * ended).  Call it before destroying the stream.  Memory that leaves the
 * shard later (the regions its last blocks empty) is fenced by an event
 * recorded on the stream at that moment, since the stream may still run
 * work on those blocks; once the stream is destroyed that record fails,
 * and the free that empties such a region waits for the whole device
 * instead (cudaDeviceSynchronize: safe, but it blocks on every stream's
 * work).  So free a released stream's blocks before destroying it where
 * you can.  A later
 * allocation on the same stream creates a new shard, which may take back at
 * once what the old one left fenced on the stream (its later work runs
 * after the earlier), without waiting for that work.
 * BFC_OK; BFC_EINVAL if the stream has no shard (or the backend refuses
 * it); BFC_EBACKEND if the runtime fails to name the stream
 * (cudaStreamGetId, or making the stream's device current), the shard
 * left as it was.
 * Context: thread-safe; takes the shard's lock and the device-wide pool lock
 * (a rare path); calls the backend (the event; an expandable shard's unmaps
 * of granules whose fences have completed); does not block: it waits for
 * no grace period and no device work (the event is recorded, not waited
 * for).
 */
BFC_API int bfc_ctx_stream_release(bfc_ctx_t *ctx, bfc_stream_t stream);

/*
 * Releases every fully free region (of every shard and of the pool) to the
 * backend.  Blocks whose fences are still pending are not touched.  With
 * allow_growth=false nothing is released: the whole limit, reserved at
 * create, stays reserved until the context is destroyed (TensorFlow's
 * layout; bytes_reserved stays the limit).  Memory
 * that leaves a shard here is fenced on the shard's stream (see "Memory"):
 * on CUDA trim waits for that work, as PyTorch's empty_cache does; on SIM
 * memory of a held stream stays cached in the pool until a later trim.
 * First it retires the shards of threads that exited without releasing
 * their per-thread streams (see the top of this file).
 * BFC_OK, BFC_EINVAL (ctx NULL), or BFC_EBACKEND when the device refused to
 * take some of it back (a runtime failure): that memory stays held and
 * counted in bytes_reserved and against the limit, the allocator may use
 * it again, and a later trim (or the context's destruction) offers it
 * back once more.  (Two exceptions, after driver failures, where the
 * device holds a granule beyond bytes_reserved for a while.  A map that
 * fails part way and whose undoing the driver refuses leaves a granule
 * mapped that the allocator does not count, until the next map over it
 * gives it back first or the reservation is released.  And a granule's
 * physical handle that the driver refused to release at its map is kept
 * and released again by the next map, unmap or trim (trim says
 * BFC_EBACKEND while the driver still refuses): once that granule is
 * unmapped, or where its map failed, the handle alone holds it.)
 * Context: thread-safe; takes each arena lock in turn and the pool lock;
 * blocks while it waits for device work (CUDA) and in the backend.
 */
BFC_API int bfc_ctx_trim(bfc_ctx_t *ctx);

/*
 * Introspection of a live block p returned by this context: the size asked
 * for, the size of its chunk (rounded), its allocation id (unique within the
 * context, increasing within a shard, always > 0).  One convention for all
 * three: when p is not a live block of ctx they return a value no block can
 * have -- 0 for the sizes, the negative status for the id -- and every call
 * sets bfc_last_error() (BFC_OK, or BFC_ENOTOWNED, BFC_EDOUBLEFREE,
 * BFC_EINVAL).
 * Context: thread-safe; takes the owner arena's lock; does not block.
 */
BFC_API size_t bfc_ctx_requested_size(bfc_ctx_t *ctx, const void *p);
BFC_API size_t bfc_ctx_allocated_size(bfc_ctx_t *ctx, const void *p);
BFC_API int64_t bfc_ctx_allocation_id(bfc_ctx_t *ctx, const void *p);

/* Returns the configuration the context runs with: backend, device (0 on
 * SIM, which has one) and vmm resolved (BFC_VMM_ON or BFC_VMM_OFF, never
 * AUTO), the limit filled in and
 * rounded down to 256 bytes as the context counts it (bytes_limit); for a
 * host context (bfc_host_ctx) trace and oom_dump are "", since host
 * contexts follow neither (bfc_ctx_trace_start still traces one), and
 * memory_limit and allow_growth are the node's memory and true, whatever
 * SHARDBFC_CONF says (see "host pinned memory").  The split threshold is
 * fragmentation_fraction of the limit as configured, so a context made
 * from this output may split differently where that limit was not a
 * multiple of 256 bytes.
 * Context: thread-safe, lock-free, never blocks. */
BFC_API int bfc_ctx_config(bfc_ctx_t *ctx, bfc_config_t *out);

/* ------------------------------------------------- process-wide service */

/*
 * The process-wide service: one context per CUDA device, each created lazily
 * from SHARDBFC_CONF (read once) on first use.  The stream's own device picks
 * the context; NULL means the calling thread's current device (device 0 on
 * SIM).  A pointer finds its context by itself.
 *
 * SHARDBFC_CONF (bfc_config_parse syntax) is read once, at the first call.
 * If it is invalid (an unknown key, a malformed or out-of-range value) the
 * service does not start: it never falls back to the defaults, which on
 * CUDA would mean the device's whole free memory.  Every call of this
 * section and of the host section below then fails with BFC_EINVAL
 * (pointer-returning calls return NULL with bfc_last_error() ==
 * BFC_EINVAL; freeing NULL is still BFC_OK), and stderr says once, e.g.
 *   libshardbfc: SHARDBFC_CONF is invalid: memory_limt=1G: unknown key
 *   'memory_limt' (keys: ...); the allocator will not start (every call
 *   fails with BFC_EINVAL)
 * Settings valid alone but not together (vmm=on with allow_growth=false)
 * stop it the same way.  So does a spec on which the first device context
 * cannot be made (bfc_ctx_create says BFC_EINVAL: a trace= path that cannot
 * be created, an oom_dump= path that cannot be written, vmm=on where the device has no virtual memory or the limit
 * holds no granule), from the call that found it on, with its own line on
 * stderr (a host section already started keeps working, so that its
 * blocks stay valid); a context that cannot be made for want of memory,
 * file descriptors or disk is tried again at the next call.  Where another
 * device's context already runs, only the device that cannot be served
 * is refused.  No usable device (backend=cuda on a machine without a GPU
 * or a driver) is not a refusal: those calls fail with BFC_ENODEV, the
 * context is tried again at each call (a device that becomes usable is
 * used), and stderr says so once per device.  Contexts made with
 * bfc_ctx_create do not read SHARDBFC_CONF and are not affected: their
 * bfc_ctx_* calls work as ever, but this section's calls refuse their
 * blocks too (bfc_free of one is BFC_EINVAL while the service is
 * refused; bfc_ctx_free frees it).
 *
 * bfc_stream_alloc / bfc_stream_free / bfc_record_stream / bfc_stream_release
 * behave exactly as their bfc_ctx_* counterparts on that context.
 * bfc_free(p) frees on the stream p was allocated on (immediately reusable by
 * that stream unless other streams were named for it, by other streams as
 * bfc_ctx_free says).  The three calls taking a pointer find its context
 * from the pointer, as a free needs no device: a block of a context made with
 * bfc_ctx_create is freed in its own context too; a host block
 * (bfc_host_alloc) is BFC_ENOTOWNED here, as for bfc_ctx_free on a device
 * context -- bfc_host_free frees it.
 * Context: thread-safe; same locking and blocking as the bfc_ctx_* calls,
 * and: the process's first call reads SHARDBFC_CONF (once; on CUDA it also
 * counts the devices); on CUDA, bfc_stream_alloc and bfc_stream_release ask
 * the runtime for the stream's device.  Of these calls only
 * bfc_stream_alloc creates a context (bfc_default_ctx, below, and the
 * PyTorch plug-in's statistics calls do too): a call that finds none for
 * its device creates it under a process-wide lock, blocking as
 * bfc_ctx_create does (a concurrent call that finds none waits for it).
 */
BFC_API void *bfc_stream_alloc(bfc_stream_t stream, size_t n);
BFC_API int bfc_stream_free(void *p, bfc_stream_t stream);
BFC_API int bfc_free(void *p);
BFC_API int bfc_record_stream(void *p, bfc_stream_t stream);
BFC_API int bfc_stream_release(bfc_stream_t stream);

/*
 * The process-wide context of the calling thread's current device (created on
 * first use), or NULL with bfc_last_error() set when it cannot be created.
 * Context: thread-safe; as bfc_stream_alloc's lookup: a call that finds no
 * context for the device creates it under a process-wide lock, blocking as
 * bfc_ctx_create does (backend reservation, a trace= file); once it exists,
 * one atomic load (on CUDA, plus asking the runtime for the current device).
 */
BFC_API bfc_ctx_t *bfc_default_ctx(void);

/*
 * Destroys every process-wide context (for tests and orderly shutdown), and
 * every host context (see "host pinned memory").  Pointers from the
 * process-wide service and from bfc_host_alloc become invalid; later calls
 * create fresh contexts.  The memory goes back to the backend, for any use,
 * as bfc_ctx_destroy says: device memory after the work queued on the device
 * (cudaFree, or a device synchronisation, waits for it); host memory after
 * the work queued on the device its events live on (SHARDBFC_CONF's
 * device, 0 by default: a synchronisation of that device; copies queued on
 * other devices' streams must be finished by the caller), then unpinned
 * and unmapped.
 * Context: no other thread may use the process-wide service or host memory
 * concurrently; blocks as bfc_ctx_destroy does, for each context (an RCU
 * grace period and pending RCU callbacks, a running trace's last writes,
 * the device).
 */
BFC_API void bfc_shutdown(void);

/* ------------------------------------------------- host pinned memory */

/*
 * Pinned (CUDA) or plain (SIM) host memory placed on the calling thread's
 * NUMA node (see host_numa).  Same rounding, alignment and NULL rules as
 * bfc_ctx_alloc.  bfc_host_free frees from any thread (another thread's block
 * returns to its owner's arena).  bfc_host_numa_node reports where the pages
 * of a live block actually are (NULL: BFC_EINVAL; a freed block:
 * BFC_EDOUBLEFREE; a pointer that is not a block's start: BFC_ENOTOWNED).
 * bfc_host_record_stream: the block is not reused until the stream's work
 * queued before the free has completed.  Otherwise nothing
 * waits for device work still using a freed block (a queued copy): it is
 * reusable at once by its owner thread's later allocations (freed by
 * another thread: from the owner's next allocation on, which takes it
 * back), and by other threads once its memory leaves the owner's arena
 * (memory pressure, trim, the owner's exit).  An exited thread's arena keeps
 * the regions under its live blocks and gives the rest (free regions, free
 * region tails) to its node's pool, which later threads' arenas grow into
 * before they pin new memory.
 * Configuration: one host context per NUMA node, from SHARDBFC_CONF like the
 * device contexts, except that its limit is the node's memory (hwloc's
 * local memory; 16 GiB where the topology does not say) and it always
 * grows: memory_limit and allow_growth=false bound device memory, never
 * host memory, and trace and oom_dump apply to device contexts only
 * (bfc_host_node_stats reports a node's limit as bytes_limit, bfc_host_stats
 * the sum over the nodes that have host contexts).
 * Context: thread-safe; the calling thread's own arena lock on the common path.
 * bfc_host_alloc blocks as bfc_ctx_alloc does, where growing maps, binds,
 * touches and pins a region (mmap, hwloc, cudaHostRegister on CUDA).
 * bfc_host_free locks and blocks as bfc_ctx_free (another thread's block:
 * its cross-stream free); bfc_host_record_stream as bfc_ctx_record_stream;
 * bfc_host_numa_node takes the owner arena's lock and asks the kernel where
 * the pages are; none of these three blocks.  The process's first call of
 * the four reads SHARDBFC_CONF and the machine's topology (hwloc, from
 * /sys) once (a set-up that fails for want of memory or of the topology
 * is tried again at the next call; an invalid SHARDBFC_CONF is final); a
 * thread's first bfc_host_alloc or bfc_host_free picks its node and takes
 * the host context table lock briefly; a node's first
 * allocation creates its host context under that lock (the backend, as
 * bfc_ctx_create), which other threads' first calls then wait for.
 */
BFC_API void *bfc_host_alloc(size_t n);
BFC_API int bfc_host_free(void *p);
BFC_API int bfc_host_numa_node(const void *p);
BFC_API int bfc_host_record_stream(void *p, bfc_stream_t stream);


/* ------------------------------------------------------- introspection */

/*
 * The statistics, one table: X(name, combine, description).  bfc_stats_t is
 * generated from it, and every place that sums, prints or serialises stats
 * (the context's totals over shards, host stats over NUMA nodes, the dump,
 * the JSON snapshot, the tools) walks it, so a field added here is added
 * everywhere.  combine: how figures of several shards or nodes make one --
 * SUM, MAX, or SAME (a setting, e.g. the limit, taken from any of them;
 * bfc_host_stats sums it over NUMA nodes, whose limits are their own).
 *
 * Measures, one vocabulary in the header, the snapshot, the tools and the
 * harness: requested bytes are what callers asked for; allocated bytes are
 * the chunks that hold them (rounded up, possibly split-rule slack:
 * bytes_in_use); reserved bytes are device memory held from the backend
 * (bytes_reserved); overhead = peak reserved / peak requested, what the
 * allocator cost over what the program needed.  Fragmentation means only
 * the scatter of free memory (bfc_stats_fragmentation).
 *
 * Exact or bound: every figure is exact at the moment of the call except two
 * peaks of a context, peak_bytes_in_use and peak_bytes_requested.  Each shard
 * keeps its own peaks (no counter is shared on the allocation path), so a
 * context knows only its shards' peaks, which may fall at different times:
 * it reports the sum of its shards' peaks (retired shards included), capped
 * by what it held (peak_bytes_in_use <= peak_bytes_reserved, and
 * peak_bytes_requested <= peak_bytes_in_use, at every moment).  That is an
 * upper bound on the true peak, never above the limit, and the true peak
 * while the context has had one shard.  peak_bytes_reserved is exact: the
 * pool's own peak, kept under the pool's lock where memory is taken from the
 * device or given back (slow-path events; an expandable shard's map counts
 * from its charge, just before the driver call, and a map the device
 * refuses is taken back out of the peak -- unless another map raised the
 * peak meanwhile, or the peaks were cleared, when the peak keeps it and is
 * an upper bound).  bfc_host_stats sums its nodes'
 * figures, so its peaks are bounds too.  The JSON snapshot names a context's
 * bounds as such (doc/snapshot.md); a shard's figures are all exact.
 *
 * ABI: a new figure goes at the end of the table, where it takes a word of
 * `reserved` (the struct keeps BFC__STATS_WORDS words).
 */
#define BFC_STATS_FIELDS(X)                                                                     \
    X(num_allocs, SUM, "cumulative successful allocations")                                    \
    X(num_frees, SUM, "cumulative frees (a fenced free counts when it is issued)")             \
    X(bytes_in_use, SUM, "allocated bytes, live: the sum of chunk sizes (bfc_ctx_allocated_size)") \
    X(peak_bytes_in_use, SUM, "peak allocated bytes: exact for a shard, an upper bound for a context") \
    X(bytes_requested, SUM, "requested bytes, live: the sum of the sizes callers asked for")     \
    X(largest_alloc_size, MAX, "largest chunk handed out (TensorFlow counts the chunk size)")   \
    X(bytes_limit, SAME, "the memory limit")                                                   \
    X(bytes_reserved, SUM, "reserved bytes, held from the device: context = all, shard = its regions") \
    X(peak_bytes_reserved, SUM, "peak reserved bytes: exact (a context's is the pool's own)")  \
    X(num_regions, SUM, "regions owned by shards (context) / by this shard")                  \
    X(num_shards, SUM, "live shards (context) / 1")                                           \
    X(num_remote_frees, SUM, "frees issued on a stream other than the owner's")                \
    X(num_pending_frees, SUM, "freed blocks still waiting for their fence")                    \
    X(num_ooms, SUM, "allocations that failed for lack of memory (each once, callback retry included)") \
    X(bytes_free, SUM, "free chunk bytes in the shards' bins (vmm: mapped ones)")              \
    X(largest_free_chunk, MAX, "largest free chunk of any shard (vmm: largest mapped block)")  \
    X(bytes_pending, SUM, "bytes of blocks waiting for their fences")                         \
    X(num_chunks, SUM, "chunk records in use (free + in use + pending)")                      \
    X(num_poison_errors, SUM, "poison=true: blocks found written after free when reused")      \
    X(num_vmm_maps, SUM, "expandable arenas: map calls to the device (each a run of granules)") \
    X(num_vmm_unmaps, SUM, "expandable arenas: unmap calls to the device")                     \
    X(peak_bytes_requested, SUM, "peak requested bytes: exact for a shard, an upper bound for a context")

/* Words of bfc_stats_t, figures and `reserved` together: fixed. */
#define BFC__STATS_WORDS 35

#define BFC__STATS_ONE(name, combine, desc) +1
enum { BFC__STATS_COUNT = 0 BFC_STATS_FIELDS(BFC__STATS_ONE) };
#undef BFC__STATS_ONE

typedef struct bfc_stats {
#define BFC__STATS_STRUCT(name, combine, desc) uint64_t name;
    BFC_STATS_FIELDS(BFC__STATS_STRUCT)
#undef BFC__STATS_STRUCT
    /* room for the figures of later versions: zero (see "version") */
    uint64_t reserved[BFC__STATS_WORDS - BFC__STATS_COUNT];
} bfc_stats_t;

/*
 * Statistics of the whole context (shards summed, pool included) or of one
 * stream's shard.  Exact, not estimates: each shard's remote-free queue is
 * drained first, and a shard's figures are read under its lock, all at one
 * instant (bfc_ctx_stream_stats is one such instant).  The context's are
 * summed from shards read one after another, then the pool's: while other
 * threads allocate, free or give memory back, they are exact sums of
 * figures from slightly different instants, so a relation between them
 * may not hold in one result (bytes_in_use above bytes_reserved, when a
 * shard read early freed and unmapped before the pool was read: compute
 * bytes_reserved - bytes_in_use, PyTorch's cached memory, with a check).
 * Quiescent, every relation holds.  bfc_ctx_stream_stats gives BFC_EINVAL
 * when the stream has no shard.
 * Context: thread-safe; takes each arena lock in turn (never two at once)
 * and the pool lock (bfc_ctx_stream_stats: that shard's lock only); does
 * not block: it polls fences without waiting (a freed block whose fence
 * has completed is released as by a free; bfc_ctx_stats also asks the
 * region pool's departure fences, so memory whose fence completed is no
 * longer counted fenced).
 */
BFC_API int bfc_ctx_stats(bfc_ctx_t *ctx, bfc_stats_t *out);
BFC_API int bfc_ctx_stream_stats(bfc_ctx_t *ctx, bfc_stream_t s, bfc_stats_t *out);

/*
 * External fragmentation of the free memory in *s (context or shard figures):
 * 1 - largest_free_chunk / bytes_free, in [0, 1].  0 when nothing is free or
 * all free bytes are one chunk; near 1 when the free bytes are scattered over
 * many small chunks, so a request much smaller than bytes_free can fail.
 * Expandable arenas (vmm) count mapped memory only, and their largest free
 * chunk is the largest block they could hand out without mapping: mapped
 * free bytes that lie behind unmapped granules of their free chunk (a block
 * starts at its chunk's start) are free but usable only after a map, and
 * when all of them lie so the value is 1.  A
 * context's value uses the largest chunk of any shard over the free bytes of
 * all shards (a block never spans shards).  0 for s == NULL.
 * Context: pure function of *s; thread-safe, never blocks.
 */
BFC_API double bfc_stats_fragmentation(const bfc_stats_t *s);

/*
 * Host statistics: all NUMA nodes summed, or one node's (os index), in the
 * same bfc_stats_t as device memory (num_shards = live thread arenas); the
 * sum's peaks are sums of the nodes' peaks, upper bounds, and its
 * bytes_limit is the sum of those nodes' limits (each node's memory).
 * bfc_host_node_stats gives BFC_EINVAL for a node with no host arena yet.
 * bfc_host_ctx returns the host context of a node (for bfc_ctx_dump,
 * bfc_ctx_check, bfc_ctx_snapshot_json), or NULL if it has none yet.
 * bfc_host_numa_nodes is the number of NUMA nodes hwloc reports.
 * Context: thread-safe.  bfc_host_stats and bfc_host_node_stats: as
 * bfc_ctx_stats, for each node's host context in turn.  bfc_host_ctx: one
 * atomic load; lock-free, never blocks.  bfc_host_numa_nodes: lock-free,
 * never blocks, except that the process's first host call (this one,
 * bfc_host_stats, or one of "host pinned memory") reads SHARDBFC_CONF and
 * the machine's topology (hwloc, from /sys) once, which other threads'
 * first host calls wait for.
 */
BFC_API int bfc_host_stats(bfc_stats_t *out);
BFC_API int bfc_host_node_stats(int node, bfc_stats_t *out);
BFC_API bfc_ctx_t *bfc_host_ctx(int node);
BFC_API int bfc_host_numa_nodes(void);

/* Peaks (in use, requested, reserved) := current values.
 * Context: as bfc_ctx_stats (the pool lock, then each arena lock in turn;
 * does not block). */
BFC_API int bfc_ctx_clear_peaks(bfc_ctx_t *ctx);

/*
 * Verifies every invariant of the allocator:
 *   1. the chunks of a region tile it exactly, in address order, with
 *      consistent prev/next links;
 *   2. no two adjacent chunks are both free and reusable (they would have
 *      merged);
 *   3. every free chunk is in exactly the bin for its size, and no chunk
 *      in use is in a bin;
 *   4. the statistics equal the sums over the chunks;
 *   5. the region map resolves the start of every chunk in use to it;
 *   6. every region belongs to exactly one shard or to the region pool.
 * Returns BFC_OK or BFC_ECORRUPT;
 * bfc_ctx_check_report() also writes which invariant broke and where
 * ("invariant 3: free chunk 0x... (size 512) not in bin 1") into buf.
 * Context: thread-safe; holds every lock of the context at once (its list
 * of shards', every arena's and the pool's) while it checks, so the
 * context's other calls wait for it; makes no backend call; does not block.
 */
BFC_API int bfc_ctx_check(bfc_ctx_t *ctx);
BFC_API int bfc_ctx_check_report(bfc_ctx_t *ctx, char *buf, size_t len);

/*
 * Human-readable memory map (regions, chunks in address order with state,
 * size, requested size; bin summary), like TensorFlow's memory log; and a
 * machine-readable JSON snapshot (schema in doc/snapshot.md).
 * BFC_OK; BFC_EINVAL (ctx or f NULL); BFC_EBACKEND when a write to f
 * failed: f is flushed at the end, so that a full disk is reported here,
 * and its error indicator is left set.
 * Context: thread-safe; as bfc_ctx_stats, then writes to f while it holds
 * each arena lock in turn, so a write that blocks (a pipe, a slow disk)
 * also holds up that shard's stream; bfc_ctx_snapshot_json also writes the
 * OOM report to f under the context's observability lock (holding no other
 * lock; see bfc_ctx_oom_info).
 */
BFC_API int bfc_ctx_dump(bfc_ctx_t *ctx, FILE *f);
BFC_API int bfc_ctx_snapshot_json(bfc_ctx_t *ctx, FILE *f);

/* ------------------------------------------------------- observability */

/*
 * Out-of-memory callback (RMM's failure callback): called when an allocation
 * of `size` bytes on `stream` fails for lack of memory (BFC_ENOMEM), with the
 * context's statistics at that moment in *summary, and the arg given to the
 * setter.  The full report -- the request, each part's free memory and a
 * one-line diagnosis of why it failed -- is bfc_ctx_oom_info(ctx, &info)
 * from inside the callback.  No allocator lock is held during the call, so
 * the callback may free memory (bfc_ctx_free, bfc_ctx_trim) or log; it must
 * not destroy ctx.
 * A non-zero return asks for the allocation to be retried, once: the retry's
 * outcome is final (a second failure calls the callback no more).  Zero:
 * the allocation fails (NULL, BFC_ENOMEM) at once.  An allocation of ctx
 * that fails inside ctx's own callback, on the same thread, fails without
 * calling it again (it is counted and reported as any failure); one of
 * another context calls that context's callback.  The callback must
 * return: it must not longjmp out of the library nor throw through it
 * (the library's state for the call would be left behind); a thread
 * cancelled in it is cancelled cleanly, as at any cancellation point.  num_ooms counts the
 * allocation once, when it first fails (so *summary includes it), whatever
 * the retry does.
 */
typedef int (*bfc_oom_fn)(bfc_ctx_t *ctx, size_t size, bfc_stream_t stream,
                          const bfc_stats_t *summary, void *arg);

/*
 * Why an allocation failed, as the OOM report diagnoses it (first match):
 *   BFC_OOM_TOO_LARGE   the request alone is larger than the limit (with
 *                       expandable arenas: than the whole granules the
 *                       limit holds, its granules counted whole);
 *   BFC_OOM_LIMIT       the limit is reached: live blocks plus the request
 *                       exceed it (with expandable arenas, its whole
 *                       granules), so only freeing live blocks helps;
 *   BFC_OOM_BACKEND     the limit has room for it (whole granules, with
 *                       expandable arenas), but the device (or the SIM
 *                       ceiling) refused the memory;
 *   BFC_OOM_TRANSIENT   by the time the report looked, memory this stream
 *                       could use was free (freed concurrently; wholly
 *                       free, unfenced pool segments count as above): a
 *                       retry may succeed;
 *   BFC_OOM_HELD        memory free but held by other streams: another
 *                       shard has a free chunk large enough, or pool spans
 *                       or pending frees large enough are still fenced by
 *                       streams whose work may be running (with
 *                       allow_growth and garbage_collection, wholly free
 *                       pool segments count together with the unreserved
 *                       bytes: given back to the device they make room, so
 *                       four fenced 16 MiB segments hold a 32 MiB request;
 *                       the diagnosis says "held by this stream's own
 *                       queued work" where the requesting stream's own
 *                       fence is all that holds them; with expandable
 *                       arenas the granules under free and pending chunks
 *                       of every shard count so too, since they can be
 *                       unmapped and mapped again anywhere; and the
 *                       requesting shard's pending frees with the free
 *                       chunks beside them are one piece; where another
 *                       shard's free chunk lies in granules that its live
 *                       blocks hold, and neither an unmap nor a pending
 *                       free would make room, the diagnosis says so (that
 *                       chunk is its stream's until those blocks are
 *                       freed) and names how many streams with a block
 *                       fill the limit, one granule apiece);
 *   BFC_OOM_FRAGMENTED  enough bytes are free in total, but no free piece
 *                       (chunk, pool span, unreserved limit) is large enough;
 *                       with expandable arenas also (tested before
 *                       BFC_OOM_BACKEND): the stream's reserved range has
 *                       no free run of addresses for the block, or the
 *                       stream has no range that could hold it and the
 *                       address space refused one (the diagnosis then
 *                       begins "address space").
 */
typedef enum {
    BFC_OOM_NONE = 0, /* no allocation of the context has failed yet */
    BFC_OOM_TOO_LARGE,
    BFC_OOM_LIMIT,
    BFC_OOM_BACKEND,
    BFC_OOM_TRANSIENT,
    BFC_OOM_HELD,
    BFC_OOM_FRAGMENTED
} bfc_oom_cause_t;

/*
 * The OOM report: the failed request, where free memory was, and a one-line
 * diagnosis.  Gathered right after the failure with no allocator lock held
 * across it (each shard and the pool are read under their own locks in
 * turn), so it is a consistent picture of each part, not of the whole.
 * Byte figures are chunk bytes (multiples of 256).
 */
typedef struct bfc_oom_info {
    size_t size;                  /* bytes requested */
    size_t rounded;               /* chunk bytes the request needs (SIZE_MAX where
                                     rounding it up to 256 bytes would overflow) */
    bfc_stream_t stream;          /* the stream it was requested on */
    bfc_oom_cause_t cause;
    char diagnosis[320];          /* one line, e.g. "memory free but held by other
                                     streams: stream 0x... has a free chunk of
                                     64.0 MiB; ..." */
    uint64_t bytes_limit;
    uint64_t bytes_reserved;      /* held from the backend (shards and pool) */
    uint64_t bytes_unreserved;    /* limit - reserved: room to take from the backend */
    uint64_t bytes_in_use;        /* live chunk bytes, all shards */
    uint64_t bytes_pending;       /* freed blocks still waiting for fences, all shards */
    /* The shards' free memory.  An expandable shard (vmm) counts only what
     * is mapped: its free bytes are its mapped bytes under no live or
     * pending block, granules shared with one included (a bound), and the
     * other shards' largest free chunk is at most that (a bound of what
     * unmapping could give): the rest of their free chunks is address
     * space.  The requesting stream's largest free chunk is, under vmm, the
     * largest block its shard could hand out without mapping (exact). */
    uint64_t stream_free;         /* free chunk bytes of the requesting stream's shard */
    uint64_t stream_largest_free; /* its largest free chunk (vmm: above) */
    uint64_t other_free;          /* free chunk bytes of every other shard */
    uint64_t other_largest_free;  /* the largest free chunk of any other shard */
    bfc_stream_t other_largest_stream; /* the stream of that shard */
    uint64_t pool_free;           /* free spans of the region pool (lent to no shard), and
                                     the granules that released expandable shards left
                                     mapped behind their fence */
    uint64_t pool_largest_span;   /* its largest span */
    uint64_t pool_fenced;         /* pool bytes free but still fenced by a stream */
    uint64_t num_pool_spans;
    uint64_t num_shards;
} bfc_oom_info_t;

/*
 * The OOM report of ctx.  Called from inside the OOM callback, it returns
 * the report of the failure the callback is about; elsewhere, the report of
 * the context's most recent failure.  Every failed allocation (BFC_ENOMEM
 * for lack of memory) makes a report, callback or not; the oom_dump file
 * and bfc_ctx_snapshot_json carry it too, with each shard's largest free
 * chunk and the pool's spans (doc/snapshot.md, "oom").  BFC_OK;
 * BFC_ESTATE when no allocation of ctx has failed yet (*out then has cause
 * BFC_OOM_NONE); BFC_EINVAL for NULL arguments.
 * Context: thread-safe; takes the context's observability lock (not inside
 * the callback, where it reads the calling thread's report); never blocks
 * on allocator locks, but waits for a trace start or stop, or a snapshot's
 * OOM report, in progress on ctx (see "Blocking" at the top).
 */
BFC_API int bfc_ctx_oom_info(bfc_ctx_t *ctx, bfc_oom_info_t *out);

/*
 * Sets (fn != NULL) or removes (fn == NULL) the context's OOM callback.
 * Independently, with config oom_dump=PATH the snapshot JSON
 * (bfc_ctx_snapshot_json, whose "oom" object is the report) is written to
 * PATH when an allocation finally fails: at most once a second per
 * context, each dump replacing the file (written to a file of its own,
 * PATH.tmp.PID.N, opened close-on-exec, then renamed over PATH: contexts
 * and processes that share PATH leave it one complete snapshot, the last
 * written; a process killed mid-dump leaves its PATH.tmp.* behind).  A
 * PATH that cannot be written fails bfc_ctx_create (BFC_EINVAL), so a
 * dump that was asked for is not silently missing: its directory missing,
 * or not writable and searchable by the effective user; PATH a directory
 * (a symbolic link to one is fine: the rename replaces the link) or ending
 * in '/'; its last component over 229 bytes (PATH.tmp.PID.N must fit
 * NAME_MAX).  A relative PATH is checked against the working directory at
 * creation and resolved against the one at each dump.  A dump that fails
 * later (the directory removed, the disk full) is said on stderr, once
 * per context.  A
 * thread writing a dump does not act on cancellation meanwhile.  BFC_OK
 * or BFC_EINVAL (ctx NULL).
 * Context: thread-safe; takes the context's observability lock, as
 * bfc_ctx_oom_info (no allocator lock; does not block); a call racing an
 * OOM may or may not see the new callback.
 */
BFC_API int bfc_ctx_set_oom_callback(bfc_ctx_t *ctx, bfc_oom_fn fn, void *arg);

/*
 * Allocation trace: from bfc_ctx_trace_start until bfc_ctx_trace_stop (or
 * the context's destruction) every allocation, allocation failure, free call,
 * completion of a fenced free, region taken by a shard ("grow") and region
 * given back ("release") -- with expandable arenas (vmm), each run of
 * granules mapped ("grow") and unmapped ("release") -- is written to `path`
 * (created or truncated) as CSV
 * in RMM's logging format: header "Thread,Time,Action,Pointer,Size,Stream",
 * one row per event (doc/trace.md).  Events go to per-thread buffers and
 * reach the file in batches; everything recorded is in the file when
 * bfc_ctx_trace_stop returns.  A trace still running when the process exits
 * (return from main, exit()) or the library is unloaded is stopped the same
 * way by an exit handler, so nothing is lost without bfc_shutdown;
 * _exit() and crashes lose each thread's unwritten tail.  After fork() the
 * child writes nothing to a trace its parent started (see "After fork()"
 * at the top of this header).  Config trace=PATH starts a trace at
 * bfc_ctx_create.  With no trace running the allocation paths test one
 * flag.
 * bfc_ctx_trace_start: BFC_OK, BFC_EBUSY (a trace is already running),
 * BFC_EINVAL (path cannot be created: no such directory, no permission, a
 * directory...), BFC_EBACKEND (the file system is full or failing: the
 * file could not be created or its header line not written), BFC_ENOMEM
 * (no memory or no file descriptor left, or the exit handler could not be
 * registered); only BFC_EINVAL says the path will not do, so only it stops
 * the process-wide service (see "The process-wide service").
 * bfc_ctx_trace_stop: BFC_OK, BFC_ESTATE (no trace running), BFC_EBACKEND
 * (a write to the file failed: the trace is incomplete).
 * Context: thread-safe; start/stop serialise on a per-context lock (the
 * context's observability lock); start blocks on creating the file and
 * writing its header; stop blocks for an RCU grace period (the moment every
 * thread has left the allocator's lock-free sections) and for the file
 * writes; so does the exit handler, once, for all running traces.  While a
 * trace runs, a thread whose buffer fills writes it to the file (under the
 * trace's own lock) from whatever call recorded the event.
 */
BFC_API int bfc_ctx_trace_start(bfc_ctx_t *ctx, const char *path);
BFC_API int bfc_ctx_trace_stop(bfc_ctx_t *ctx);

#ifdef __cplusplus
}
#endif
#endif /* SHARDBFC_H */
