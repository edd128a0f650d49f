/*
 * shardbfc_sim.h -- controls of the simulated device (SIM backend).
 *
 * The SIM backend serves "device" memory from host memory and models streams
 * and events, so that stream-ordering logic is testable without a GPU.  A
 * simulated stream is idle unless held: events recorded on an idle stream are
 * complete at once; events recorded while it is held stay incomplete until the
 * stream is drained.
 *
 * Stream handles are checked as strictly as CUDA would need them to be
 * valid: on a SIM context the only streams are NULL (the default stream)
 * and handles made by bfc_sim_stream_create (by any SIM context: streams
 * belong to the process) and not yet destroyed.  Any other handle -- made
 * up, (bfc_stream_t)0x1234, a pointer to something else, a destroyed
 * stream -- makes every call that names it fail with BFC_EINVAL and change
 * nothing: bfc_ctx_alloc (NULL, bfc_last_error() == BFC_EINVAL),
 * bfc_ctx_free on a stream other than the block's own, bfc_ctx_record_stream,
 * bfc_ctx_stream_release, bfc_ctx_stream_stats, and the process-wide and
 * host equivalents.  On CUDA the same mistake is undefined behaviour, so a
 * test that makes it fails here first.
 */
#ifndef SHARDBFC_SIM_H
#define SHARDBFC_SIM_H

#include <shardbfc.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The simulated per-thread default stream, as cudaStreamPerThread (the same
 * value): one handle that names a different stream on every thread (made at
 * the thread's first use of it, as by bfc_sim_stream_create; never
 * destroyed: each takes one of the 65,535 simulated streams a process can
 * make; once they are all made, it is refused, BFC_EINVAL, on a thread that
 * has not used it yet).  Hold and drain act on the
 * calling thread's, so a thread must drain its own before it exits: nothing
 * else can, and fences on it would never complete.  A block freed by one
 * thread on its per-thread stream but allocated on another thread's is a
 * cross-stream free.
 */
#define BFC_SIM_STREAM_PER_THREAD ((bfc_stream_t)(uintptr_t)2)

/*
 * Creates a simulated stream for ctx (which must use the SIM backend; NULL is
 * returned otherwise).  A process can make 65,535 simulated streams in its
 * lifetime, shared by every SIM context and by the per-thread streams
 * (BFC_SIM_STREAM_PER_THREAD: one per thread that uses it); record 0 is the
 * default (NULL) stream, and a destroyed stream's record is never reused.
 * Once all 65,535 are made it returns NULL for good.  Sets
 * bfc_last_error(): BFC_OK, BFC_EINVAL (ctx NULL or not SIM; a host
 * context, bfc_host_ctx, is not, though its memory may come from SIM) or
 * BFC_ENOMEM (every stream made).
 * Context: thread-safe; takes the SIM backend's stream-registry lock (rare)
 * for a few instructions; does not block.
 */
BFC_API bfc_stream_t bfc_sim_stream_create(bfc_ctx_t *ctx);

/*
 * Destroys a simulated stream: its queued work is considered complete (as by
 * bfc_sim_stream_drain) before it goes.  Does not release its shard: call
 * bfc_ctx_stream_release first, as with cudaStreamDestroy (afterwards the
 * handle is refused, BFC_EINVAL).  From now on every call naming the stream
 * fails with BFC_EINVAL; blocks allocated on it stay valid and are freed as
 * usual (bfc_free, or bfc_ctx_free on that same stream, which needs no
 * stream operation), and fences that named it complete.  NULL or an unknown
 * stream is a no-op.
 * Context: thread-safe; lock-free, never blocks (it also makes every
 * thread's cached stream lookup miss once).
 */
BFC_API void bfc_sim_stream_destroy(bfc_ctx_t *ctx, bfc_stream_t s);

/*
 * Work is in flight on s: events recorded on s from now on stay incomplete
 * (until bfc_sim_stream_drain).  s may be NULL (the default stream).
 * Context: thread-safe, lock-free, never blocks (but a thread's first use of
 * BFC_SIM_STREAM_PER_THREAD makes its stream under bfc_sim_stream_create's
 * lock).
 */
BFC_API void bfc_sim_stream_hold(bfc_ctx_t *ctx, bfc_stream_t s);

/*
 * All work queued on s has completed: every event recorded on s completes,
 * and the hold ends.
 * Context: thread-safe, lock-free, never blocks (but a thread's first use of
 * BFC_SIM_STREAM_PER_THREAD makes its stream under bfc_sim_stream_create's
 * lock).
 */
BFC_API void bfc_sim_stream_drain(bfc_ctx_t *ctx, bfc_stream_t s);

/*
 * Fault injection (tests and the perf harness): from now on, every Nth device
 * memory allocation / every Nth event record or query / every Nth device
 * free of ctx's SIM backend fails (0 turns it off).  A refused free keeps
 * its memory held, as a driver's would: a region's free, or the unmap of
 * one granule (with this injection on, unmaps and the release of a
 * reservation go a granule at a time, so that a refusal can come part way
 * through a range).  The allocator must
 * go on counting what the device still holds, and may offer it again.
 * bfc_sim_set_alloc_ceiling: device allocations succeed only while the
 * backend holds at most `bytes` (SIZE_MAX = off).
 * Context: thread-safe, lock-free, never blocks.
 */
BFC_API void bfc_sim_fail_alloc_every(bfc_ctx_t *ctx, unsigned n);
BFC_API void bfc_sim_fail_event_every(bfc_ctx_t *ctx, unsigned n);
BFC_API void bfc_sim_fail_free_every(bfc_ctx_t *ctx, unsigned n);
BFC_API void bfc_sim_set_alloc_ceiling(bfc_ctx_t *ctx, size_t bytes);

/*
 * A driver's cost for virtual-memory calls, modelled (the perf harness's
 * --sim-vmm-cost; 0, the default, turns it off).  On a GPU each granule
 * mapped or unmapped costs the calling thread tens of microseconds in the
 * driver (cuMemCreate, cuMemMap and cuMemSetAccess, or cuMemUnmap), and the
 * driver runs such calls one at a time across the whole process.  With a
 * cost set, every map and unmap of ctx's SIM backend waits for a lock shared
 * by every SIM context of the process and then keeps its CPU busy for
 * ns_per_granule times the granules it covers, so that the allocator's
 * policy meets the same scarcity of device calls here as on a device.
 * Memory and its accounting are unchanged: no memory is freed, and when
 * freed memory may be reused, by which stream, is as without the model.
 * Context: thread-safe, lock-free, never blocks (the map and unmap calls
 * it slows may); calls already in progress pay the cost they started
 * with.
 */
BFC_API void bfc_sim_set_vmm_cost(bfc_ctx_t *ctx, unsigned ns_per_granule);

/*
 * Fault injection for the library's own host metadata (chunk and region
 * records, pool spans, fences, queue nodes): from now on every Nth metadata
 * allocation of the process fails (0 turns it off).  Process-wide, like the
 * metadata allocator itself, and independent of the backend.  Every such
 * failure must surface as a status (BFC_ENOMEM) or be absorbed, never leave
 * an allocator inconsistent.  bfc_sim_meta_failures: failures injected so far.
 * Context: thread-safe, lock-free, never blocks.
 */
BFC_API void bfc_sim_fail_meta_every(unsigned n);
BFC_API uint64_t bfc_sim_meta_failures(void);

/* Number of device allocations the SIM backend has served and failed so far.
 * Context: thread-safe, lock-free, never blocks. */
BFC_API uint64_t bfc_sim_backend_allocs(bfc_ctx_t *ctx);
BFC_API uint64_t bfc_sim_backend_failures(bfc_ctx_t *ctx);

/* Bytes of device memory ctx's SIM backend holds right now (allocated and not
 * yet returned, plus the pages mapped into virtual-memory arenas): 0 after
 * every block is freed and bfc_ctx_trim ran (growth mode), which is how leak
 * tests see that nothing stayed behind.  0 for a context that is not SIM.
 * Context: thread-safe, lock-free, never blocks. */
BFC_API uint64_t bfc_sim_backend_bytes_held(bfc_ctx_t *ctx);

/*
 * Whether device memory is mapped behind [p, p + n) in ctx's virtual-memory
 * arenas: 1 when every byte of it lies in pages mapped in one of the SIM
 * backend's reserved address ranges, 0 when some or none do.  This is how a
 * test sees that memory was given back without touching it (an unmapped
 * page faults, as on a GPU).  Memory outside those ranges (classic regions
 * with vmm=off, foreign addresses), n == 0, p == NULL and a context that is
 * not SIM all answer 0.
 * Context: thread-safe; takes the SIM backend's virtual-memory lock, which
 * only map and unmap calls take (it may wait for one in progress).  The
 * answer is a snapshot: another thread's allocation or trim may change it.
 */
BFC_API int bfc_sim_mapped(bfc_ctx_t *ctx, const void *p, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* SHARDBFC_SIM_H */
