/*
 * backend.h -- the one interface between the allocator and a device runtime.
 *
 * A backend hands out device memory (256-byte aligned), creates, records,
 * queries and destroys events, names streams with a stable id and reports
 * device memory.  Two implementations: backend_sim.c (always built: host
 * memory, streams and events modelled so tests can hold a stream busy) and
 * backend_cuda.c (built when configure finds CUDA; wraps cudart only).
 *
 * Every backend operation is thread-safe.  None takes an allocator lock; the
 * SIM backend's own state is atomics plus a registry lock taken only when a
 * simulated stream is created.
 */
#ifndef BFC_BACKEND_H
#define BFC_BACKEND_H

#include "internal.h"

typedef void *bfc__event_t; /* cudaEvent_t on CUDA; a struct pointer on SIM */

typedef struct bfc__backend bfc__backend_t;

struct bfc__backend_ops {
    /* Device memory: BFC_OK and *out (256-byte aligned), BFC_ENOMEM when the
     * device refuses (out of memory, fault injection), BFC_EBACKEND on any
     * other runtime error. */
    int (*mem_alloc)(bfc__backend_t *be, size_t size, void **out);
    int (*mem_free)(bfc__backend_t *be, void *p, size_t size);
    /* Events (created without timing on CUDA). */
    int (*event_create)(bfc__backend_t *be, bfc__event_t *out);
    int (*event_destroy)(bfc__backend_t *be, bfc__event_t ev);
    int (*event_record)(bfc__backend_t *be, bfc__event_t ev, bfc_stream_t s);
    /* BFC_OK when complete, BFC_EBUSY when not yet, other < 0 on error. */
    int (*event_query)(bfc__backend_t *be, bfc__event_t ev);
    /* Waits up to timeout_ms (UINT32_MAX = forever) for completion: BFC_OK,
     * BFC_EBUSY on timeout.  SIM: a held stream only completes when a test
     * drains it, so SIM polls until the timeout. */
    int (*event_wait)(bfc__backend_t *be, bfc__event_t ev, uint32_t timeout_ms);
    /* Stable id of a stream: cudaStreamGetId on CUDA (never the handle value:
     * cudaStreamPerThread is one handle on every thread); SIM: the simulated
     * stream's index, NULL = 0. */
    int (*stream_id)(bfc__backend_t *be, bfc_stream_t s, uint64_t *id);
    /* Waits for all work queued on s (fallback fence when an event fails). */
    int (*stream_sync)(bfc__backend_t *be, bfc_stream_t s);
    int (*mem_info)(bfc__backend_t *be, size_t *free_bytes, size_t *total_bytes);
    /* Pins host memory for DMA (cudaHostRegister); SIM: no-op. */
    int (*host_register)(bfc__backend_t *be, void *p, size_t n);
    int (*host_unregister)(bfc__backend_t *be, void *p);
    void (*close)(bfc__backend_t *be);
};

struct bfc__backend {
    const struct bfc__backend_ops *ops;
    bfc_backend_t kind;     /* BFC_BACKEND_SIM or BFC_BACKEND_CUDA, never AUTO */
    int device;
    size_t default_limit;   /* memory_limit when the config says 0 */
    bool host_accessible;   /* device memory can be read/written by the CPU (SIM) */
    char name[64];          /* "sim" or the GPU's name */
};

/*
 * Opens the backend the config asks for.  AUTO picks CUDA when a device is
 * usable, else SIM.  BFC_ENODEV when CUDA is asked for but unusable (not built,
 * no driver -- cudaErrorInsufficientDriver --, no device, bad ordinal).
 * The SIM backend takes its fault-injection settings from cfg.
 */
int bfc__backend_open(const bfc_config_t *cfg, bfc__backend_t **out);

/* Implementations (backend_open dispatches to them). */
int bfc__backend_sim_open(const bfc_config_t *cfg, bfc__backend_t **out);
#if BFC_HAVE_CUDA
int bfc__backend_cuda_open(const bfc_config_t *cfg, bfc__backend_t **out);
/* Number of usable CUDA devices; 0 (not an error) without a driver. */
int bfc__cuda_device_count(void);
/* Device of a stream (cudaStreamGetDevice; NULL: current device). */
int bfc__cuda_stream_device(bfc_stream_t s, int *dev);
#endif

/* SIM only: per-backend controls behind shardbfc_sim.h.  be must be SIM. */
/* The stream-table lock, held across fork() by the fork handlers (ctx.c). */
void bfc__sim_fork_lock(void);
void bfc__sim_fork_unlock(void);
bfc_stream_t bfc__sim_stream_create(bfc__backend_t *be);
void bfc__sim_stream_destroy(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_stream_hold(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_stream_drain(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_fail_alloc_every(bfc__backend_t *be, unsigned n);
void bfc__sim_fail_event_every(bfc__backend_t *be, unsigned n);
void bfc__sim_set_alloc_ceiling(bfc__backend_t *be, size_t bytes);
uint64_t bfc__sim_allocs(bfc__backend_t *be);
uint64_t bfc__sim_failures(bfc__backend_t *be);
/* Bytes the SIM backend currently holds (allocated, not freed). */
size_t bfc__sim_bytes_held(bfc__backend_t *be);

#endif /* BFC_BACKEND_H */
