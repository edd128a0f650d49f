/*
 * fake_cudart.h -- the controls of the fake CUDA runtime (fake_cudart.c), a
 * host-only libcudart.so.13 for tests on machines without a GPU.  The
 * model they drive is described at the top of fake_cudart.c.
 *
 * These functions exist only in the fake: a program that calls them cannot
 * run on the real runtime (and, linked with -z now, does not even start
 * there), which is how tests/fakecuda/kernels_host.c makes sure that the
 * fake is the runtime it runs on.  Every control is thread-safe: it takes
 * the fake's one lock, as every runtime call does.
 */
#ifndef BFC_FAKE_CUDART_H
#define BFC_FAKE_CUDART_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

/* Queues on s work that ends only at fake_stream_drain(s) (or when a
 * blocking call needs it to end: see fake_blocking_syncs).  Work queued
 * behind it waits. */
void fake_stream_hold(cudaStream_t s);

/* Ends the held work queued on s so far; what was waiting for it runs. */
void fake_stream_drain(cudaStream_t s);

/* Queues on s a kernel that uses [p, p + n): freeing, unregistering or
 * unmapping that memory before the kernel has run is a violation, and so is
 * the kernel finding it no longer device memory when it runs. */
void fake_launch(cudaStream_t s, const void *p, size_t n);

/* tests/gpu/kernels.h's kernels, run on the host in stream order by the
 * fake's executor (tests/fakecuda/kernels_host.c): a spin that keeps s busy
 * for ns of wall time from when it starts, a fill of [p, p + n) with
 * bfc_test_word(tag, i), a count into *bad of the words of [p, p + n) that
 * do not hold that pattern, and a trapping kernel (every later call fails
 * with cudaErrorLaunchFailure).  cudaErrorInvalidResourceHandle for a bad
 * stream. */
cudaError_t fake_enqueue_spin(cudaStream_t s, uint64_t ns);
cudaError_t fake_enqueue_fill(cudaStream_t s, void *p, size_t n, uint32_t tag);
cudaError_t fake_enqueue_count(cudaStream_t s, const void *p, size_t n, uint32_t tag,
                               unsigned long long *bad);
cudaError_t fake_trap(cudaStream_t s);

/* Makes the k-th call from now (k >= 1) of the runtime or driver function
 * named fn fail with `code`, or with its natural error when code is 0 (out
 * of memory for cudaMalloc, cuMemCreate and cuMemAddressReserve, else
 * cudaErrorUnknown / CUDA_ERROR_UNKNOWN).  FAKE_CUDA_FAIL does the same
 * from the environment, counting from the process's first call.  False
 * when the table of pending failures (64) is full. */
bool fake_fail_next(const char *fn, unsigned long k, int code);

/* The number of calls of the function named fn so far (process-wide). */
unsigned long fake_calls(const char *fn);

/* Whether device dev's primary context has been made (bound by
 * cudaSetDevice or a device-initialising call, or retained): on a GPU it
 * holds memory of that device. */
bool fake_primary_made(int dev);

/* Violations reported so far (each also a "FAKE_CUDA VIOLATION" line on
 * stderr), and blocking calls that had to end held work to return (a GPU
 * would have blocked until that work ended). */
unsigned long fake_violations(void);
unsigned long fake_blocking_syncs(void);

/* Writes a line to f for each object still alive: cudaMalloc blocks, VMM
 * mappings and reservations, host registrations, events, device memory
 * still accounted (a handle never released).  Returns their number, or -1
 * when f could not be written. */
int fake_report(FILE *f);

#endif /* BFC_FAKE_CUDART_H */
