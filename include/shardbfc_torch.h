/*
 * shardbfc_torch.h -- the PyTorch plug-in, libshardbfc_torch.so.
 *
 * PyTorch lets a process replace its CUDA caching allocator with two C
 * functions found in a shared object:
 *
 *     import torch
 *     a = torch.cuda.memory.CUDAPluggableAllocator(
 *             "/usr/local/lib/libshardbfc_torch.so",
 *             "shardbfc_torch_alloc", "shardbfc_torch_free")
 *     torch.cuda.memory.change_current_allocator(a)   # before any CUDA tensor
 *
 * libshardbfc_torch.so is libshardbfc built a second time for that use: its
 * host metadata comes from libc malloc (a jemalloc-backed build cannot be
 * dlopen()ed into a Python process that did not start with jemalloc), and
 * it binds its own symbols to itself (-Bsymbolic), so a process that also
 * links libshardbfc.so has two independent allocators, never a mix of the
 * two.  It exports these functions and the public bfc_* API (so that, for
 * example, bfc_ctx_snapshot_json can be reached through ctypes); it reads
 * SHARDBFC_CONF like the process-wide service, which it uses.
 *
 * The signatures are PyTorch's (cudaStream_t is bfc_stream_t; ssize_t as
 * in <sys/types.h>), so this header needs no CUDA and no PyTorch header.
 */
#ifndef SHARDBFC_TORCH_H
#define SHARDBFC_TORCH_H

#include <sys/types.h>

#include <shardbfc.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * PyTorch's alloc_fn: `size` bytes for use in stream order on `stream` of
 * CUDA device `device` (PyTorch passes its current device and current
 * stream).  The process-wide service (bfc_stream_alloc) serves it: the
 * stream's shard, 256-byte alignment.  On the SIM backend `device` is not
 * used: every call goes to the one simulated device.  On CUDA a negative
 * `device` means the calling thread's current device, and one the runtime
 * does not have gives BFC_ENODEV.  Returns NULL for
 * size <= 0 and when the request cannot be served (counted, see
 * shardbfc_torch_stat "alloc_failures"; bfc_last_error() says why).
 * Context: thread-safe; the common path is lock-free up to the stream's own
 * shard lock.  May block on the slow path (growing, reclaiming memory from
 * other streams' shards, retry_ms), and as bfc_stream_alloc (the first call
 * for a device creates its context, as bfc_ctx_create); on CUDA, for the
 * NULL, legacy and per-thread streams, it also makes `device` current and
 * then the caller's context again (the device's primary context pushed
 * and popped: a thread that never chose a device is left without one).
 */
BFC_API void *shardbfc_torch_alloc(ssize_t size, int device, bfc_stream_t stream);

/*
 * PyTorch's free_fn: PyTorch passes the size, device and stream of the
 * allocation, so the block is freed in the order of the stream it was
 * allocated on and is reusable at once by later allocations on that stream;
 * other streams reuse it only after the work queued on it before the free
 * has completed.  Either way, every stream named with
 * shardbfc_torch_record_stream must first have completed its work queued up
 * to the free.
 * `size` and `device` are not needed (a pointer finds its context and chunk
 * by itself).  NULL is a no-op.  A pointer that is no live block of this
 * process's libshardbfc contexts (the plug-in's, or one made with
 * bfc_ctx_create, whose blocks it frees as bfc_free does), or a second
 * free, changes nothing and is counted ("free_errors"); the first such
 * error is reported once on stderr.
 * Context: thread-safe; may be called from any thread; takes the owner
 * shard's lock and does not block (as bfc_stream_free); the process's first
 * failing free also writes one line to stderr.
 */
BFC_API void shardbfc_torch_free(void *p, ssize_t size, int device, bfc_stream_t stream);

/*
 * PyTorch's recordStream: p is also used by `stream`, so its free is fenced
 * on the work queued on `stream` up to the free, too (bfc_record_stream).
 * torch.cuda.memory.CUDAPluggableAllocator does not forward
 * Tensor.record_stream to a plug-in, so a program that hands a tensor to a
 * second stream calls this itself (through ctypes) beside record_stream.
 * BFC_OK, BFC_EINVAL (p NULL), BFC_ENOTOWNED, BFC_EDOUBLEFREE, BFC_ENOMEM.
 * Context: thread-safe; takes the owner shard's lock; does not block.
 */
BFC_API int shardbfc_torch_record_stream(void *p, bfc_stream_t stream);

/*
 * Statistics of the context serving `device` (SIM: the one context), as
 * bfc_ctx_stats: BFC_OK, BFC_EINVAL (out NULL), or the status of creating
 * the context.  shardbfc_torch_stat returns one field by name, for ctypes:
 * any bfc_stats_t member ("peak_bytes_reserved", "bytes_in_use", ...) or the
 * plug-in's own counters "alloc_failures" and "free_errors"; UINT64_MAX for
 * an unknown name or when the statistics cannot be read.
 * Context: thread-safe; takes each shard lock in turn (never two at once)
 * and the pool lock, as bfc_ctx_stats (does not block), but the first call
 * for a device may create its context (as bfc_default_ctx: blocking as
 * bfc_ctx_create); on CUDA it calls the runtime to make `device` current
 * and back.  shardbfc_torch_stat of "alloc_failures", "free_errors" or an
 * unknown name reads no context: lock-free, never blocks.
 */
BFC_API int shardbfc_torch_stats(int device, bfc_stats_t *out);
BFC_API uint64_t shardbfc_torch_stat(int device, const char *name);

/*
 * Peaks (in use, reserved) := current values, as
 * torch.cuda.reset_peak_memory_stats; and the counterpart of
 * torch.cuda.empty_cache: every fully free region goes back to the device
 * (bfc_ctx_trim).  BFC_OK or a status.
 * Context: as shardbfc_torch_stats; empty_cache also blocks as bfc_ctx_trim
 * (it waits for the device work that fences what it gives back, and in the
 * device runtime: cudaFree synchronises the device).
 */
BFC_API int shardbfc_torch_reset_peaks(int device);
BFC_API int shardbfc_torch_empty_cache(int device);

/* The plug-in's function types, for dlsym(). */
typedef void *(*shardbfc_torch_alloc_fn)(ssize_t size, int device, bfc_stream_t stream);
typedef void (*shardbfc_torch_free_fn)(void *p, ssize_t size, int device, bfc_stream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* SHARDBFC_TORCH_H */
