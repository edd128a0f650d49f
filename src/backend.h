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
 *
 * Virtual memory.  A backend with vmm_granule != 0 also lets the allocator
 * separate address space from memory, the model of the CUDA driver's
 * virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap):
 *
 *   va_reserve   takes a range of addresses, aligned to the granule, with no
 *                memory behind it: reserving 64 GiB costs nothing but
 *                address space, so an arena can reserve far more than it
 *                will ever use and never move;
 *   va_map       puts fresh physical memory (zero on SIM, undefined content
 *                on CUDA) behind granule-aligned sub-ranges of a reservation;
 *                only this call counts as device memory held (and against
 *                the SIM ceiling);
 *   va_unmap     gives the memory of a granule-aligned sub-range back while
 *                the addresses stay reserved, so a later va_map of the same
 *                addresses refills the hole in place;
 *   va_release   gives the range back, unmapping whatever is still mapped.
 *
 * The granule is the unit of everything: every address and size passed to
 * these calls is a multiple of it (2 MiB on SIM by default and on most
 * GPUs).  Any granule-aligned sub-range may be unmapped on its own, however
 * it was mapped: a backend whose device API can only unmap whole mappings
 * (CUDA's cuMemUnmap) maps granule by granule to keep that promise.
 * A backend keeps a book of its reservations and mapped granules (struct
 * bfc__vmm_book below), so a map of a granule already mapped, an unmap of
 * one that is not, or a range that leaves its reservation is BFC_EINVAL and
 * changes nothing.  A failed va_map leaves nothing of the range mapped.
 * These calls are rare by design (each granule costs driver calls of up to
 * tens of microseconds on a GPU, and an unmap may wait for the device): they
 * serialise on the book's lock and must stay off the alloc/free fast path.
 */
#ifndef BFC_BACKEND_H
#define BFC_BACKEND_H

#include "internal.h"
#include "mutex.h"

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
    /* The handle by which the calling thread reaches the stream whose id is
     * sid, named by the handle s (on the thread that gave stream_id sid for
     * it): s itself, but for the per-thread default stream
     * (BFC__STREAM_PER_THREAD, internal.h) on a thread where that handle
     * names another stream -- the owner's stream seen from a thread that
     * reclaims, trims or releases its memory, or arms a record_stream
     * fence.  CUDA then gives the legacy default stream, whose work waits
     * for every blocking stream's earlier work, per-thread default streams
     * included: an event recorded there completes only after the owner's
     * work queued before it (later than needed, never earlier); SIM gives
     * the simulated stream sid itself.  A synchronisation through a
     * substituted handle must wait for the device (fence.c). */
    bfc_stream_t (*stream_for)(bfc__backend_t *be, bfc_stream_t s, uint64_t sid);
    /* Waits for all work queued on every stream of the device: the last
     * fallback fence, when neither an event nor a stream synchronisation
     * works on the stream (one already destroyed, say).  SIM: BFC_EBUSY while
     * any simulated stream is held (only a test's drain can finish it). */
    int (*device_sync)(bfc__backend_t *be);
    int (*mem_info)(bfc__backend_t *be, size_t *free_bytes, size_t *total_bytes);
    /* Pins host memory for DMA (cudaHostRegister); SIM: no-op. */
    int (*host_register)(bfc__backend_t *be, void *p, size_t n);
    int (*host_unregister)(bfc__backend_t *be, void *p);
    /*
     * Virtual memory (see above); present only when vmm_granule != 0 (the
     * backends without it fill these with calls that return BFC_EINVAL, so
     * none is ever NULL).  All four: BFC_EINVAL for a size of 0, an
     * address or size not a multiple of the granule, a range outside one
     * reservation, or a granule in the wrong state; BFC_EBACKEND when the
     * OS or the driver fails otherwise.
     *
     * va_reserve: *base (granule aligned) of `size` bytes of addresses with
     * no memory behind them.  BFC_ENOMEM when the address space (or the
     * book's metadata) is exhausted.
     */
    int (*va_reserve)(bfc__backend_t *be, size_t size, uintptr_t *base);
    /* va_release: gives back a whole reservation (base and size exactly as
     * reserved); granules still mapped are unmapped first, their bytes no
     * longer held.  On BFC_EBACKEND the reservation stays in the book with
     * what could not be unmapped, and may be released again. */
    int (*va_release)(bfc__backend_t *be, uintptr_t base, size_t size);
    /* va_mapped: the bytes of [addr, addr + size) that are mapped, as the
     * book says, for a granule-aligned sub-range of one reservation (the
     * whole reservation included); 0 for anything else.  What a refused
     * va_release left, and where. */
    size_t (*va_mapped)(bfc__backend_t *be, uintptr_t addr, size_t size);
    /* va_map: fresh physical memory, read-write for the backend's device,
     * at [addr, addr + size), every granule of which must be unmapped.
     * BFC_ENOMEM when the device refuses (SIM: its ceiling or fault
     * injection).  On any failure nothing of the range is mapped (CUDA:
     * unless the driver also refuses to undo a granule it had just mapped;
     * the book then keeps that granule mapped, and va_release frees it). */
    int (*va_map)(bfc__backend_t *be, uintptr_t addr, size_t size);
    /* va_unmap: gives the memory of [addr, addr + size), every granule of
     * which must be mapped, back to the device; the addresses stay reserved
     * and must not be touched until mapped again (SIM: they fault).
     * *done (done may be NULL) says how much of the range, from addr, was
     * unmapped: size on BFC_OK, 0 on BFC_EINVAL.  On BFC_EBACKEND (the
     * driver refused part way) the granules from addr + *done on are still
     * mapped, as the book says, hold their memory and may be used or
     * unmapped again. */
    int (*va_unmap)(bfc__backend_t *be, uintptr_t addr, size_t size, size_t *done);
    /* va_settle: gives back the memory the device kept when it refused to
     * free it and that no reservation's book counts (CUDA: the handles
     * whose cuMemRelease va_map saw refused, kept to be released again;
     * va_map, va_unmap and va_release settle them too as they pass).
     * BFC_OK when none is left (always on SIM), BFC_EBACKEND when the
     * device still refuses. */
    int (*va_settle)(bfc__backend_t *be);
    void (*close)(bfc__backend_t *be);
};

struct bfc__backend {
    const struct bfc__backend_ops *ops;
    bfc_backend_t kind;     /* BFC_BACKEND_SIM or BFC_BACKEND_CUDA, never AUTO */
    int device;
    size_t default_limit;   /* memory_limit when the config says 0 */
    bool host_accessible;   /* device memory can be read/written by the CPU (SIM) */
    size_t vmm_granule;     /* unit of the va_* calls, a power of two; 0: no
                               virtual memory (the allocator keeps classic
                               regions) */
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
/* A device's PCI domain, bus and device numbers (host_numa=gpu finds its
 * CPUs from them), the runtime's last-error slot left clear.  BFC_OK, or
 * BFC_ENODEV for an ordinal or a runtime that cannot say. */
int bfc__cuda_device_pci(int dev, int *domain, int *bus, int *slot);
/* Makes `dev` current for the calling thread as the backend's own calls do
 * ("Device switches" in backend_cuda.c: its primary context pushed where
 * it is retained, else cudaSetDevice), *saved for bfc__cuda_dev_leave
 * (-1: nothing to undo).  BFC_ENODEV for an ordinal the runtime refuses.
 * Leave restores the caller's context or device; its status is the
 * restore's. */
int bfc__cuda_dev_enter(int dev, int *saved);
int bfc__cuda_dev_leave(int saved);
/* The primary-context table's lock, made free again in a fork child (the
 * child fork handler, ctx.c): a child must not inherit it held by a thread
 * of the parent that was retaining a context (the plug-in retains before
 * any runtime call, so the child would block on it rather than fail).  Not
 * held across fork: its holder may be inside the driver, whose own fork
 * handlers run before ours.  bfc__cuda_pctx_lock/unlock: for tests. */
void bfc__cuda_fork_child(void);
void bfc__cuda_pctx_lock(void);
void bfc__cuda_pctx_unlock(void);
/* Granule of a device's virtual memory (the driver's recommended granularity
 * for pinned device memory), or 0 when the driver's entry points cannot be
 * resolved (no driver), the device has no virtual memory support or a query
 * fails.  What the CUDA backend's vmm_granule is set to at open. */
size_t bfc__cuda_vmm_granule(int device);
#endif

/* SIM only: per-backend controls behind shardbfc_sim.h.  be must be SIM. */
/* The stream-table lock, held across fork() by the fork handlers (ctx.c). */
void bfc__sim_fork_lock(void);
void bfc__sim_fork_unlock(void);
/* Whether be is a SIM backend itself (a host backend over SIM reports the
 * SIM kind but is not one: the SIM controls refuse it). */
bool bfc__sim_is(const bfc__backend_t *be);
bfc_stream_t bfc__sim_stream_create(bfc__backend_t *be);
void bfc__sim_stream_destroy(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_stream_hold(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_stream_drain(bfc__backend_t *be, bfc_stream_t s);
void bfc__sim_fail_alloc_every(bfc__backend_t *be, unsigned n);
void bfc__sim_fail_event_every(bfc__backend_t *be, unsigned n);
void bfc__sim_fail_free_every(bfc__backend_t *be, unsigned n);
void bfc__sim_set_alloc_ceiling(bfc__backend_t *be, size_t bytes);
/* Tests: va_reserve refuses (BFC_ENOMEM) a reservation that would take the
 * bytes of the backend's live reservations past `bytes` -- an address space
 * that small (SIZE_MAX, the default: only the machine's).  Thread-safe (the
 * book lock); reservations already made stay. */
void bfc__sim_set_va_ceiling(bfc__backend_t *be, size_t bytes);
uint64_t bfc__sim_allocs(bfc__backend_t *be);
uint64_t bfc__sim_failures(bfc__backend_t *be);
/* Bytes the SIM backend currently holds (allocated, not freed, plus mapped
 * granules). */
size_t bfc__sim_bytes_held(bfc__backend_t *be);
/* The modelled driver cost of a map or unmap call, per granule
 * (bfc_sim_set_vmm_cost). */
void bfc__sim_set_vmm_cost(bfc__backend_t *be, uint32_t ns_per_granule);
/* Sets the SIM granule (a power of two, at least the page size; the default
 * is 2 MiB) so that tests can map small pages.  BFC_EINVAL for a bad value
 * or while the backend holds a reservation. */
int bfc__sim_set_vmm_granule(bfc__backend_t *be, size_t granule);
/* 1 when every byte of [p, p + n) lies in granules mapped in one of the SIM
 * backend's reservations, else 0 (n == 0, memory of classic regions and
 * foreign addresses included).  Takes the book's lock. */
int bfc__sim_mapped(bfc__backend_t *be, const void *p, size_t n);

/*
 * The book of a backend's virtual memory: its reservations, sorted by base,
 * each with one bit per granule (1: mapped).  Every va_* call of a backend
 * holds the lock for its whole length, checks the range against the book,
 * acts on the OS or device, then records the outcome, so the book is always
 * what is really mapped, even after a failure half way.  One lock per
 * backend is enough: the calls are rare and slow anyway (a driver call each),
 * and the lock is innermost (under it only the OS, the driver and the
 * metadata shim are called).  The fork handlers do not take it: a fork
 * while another thread is inside a va_* call leaves the child's copy held,
 * so a child must not use that backend's virtual memory calls (were that
 * needed, the prepare handler could take it last, after every allocator
 * lock).
 */
struct bfc__vmm_res {
    uintptr_t base;
    size_t size;
    size_t n_mapped;        /* granules mapped */
    uint64_t *bits;         /* size / granule bits */
    /* Stranded granules (a subset of the mapped ones): left mapped by a
     * va_map that failed and whose roll-back the driver refused, so that
     * the allocator believes them unmapped.  The next va_map over them
     * unmaps them first; va_release frees them as any mapped granule. */
    uint64_t *stranded;     /* as many bits, in the same allocation */
    size_t n_stranded;
};

typedef struct bfc__vmm_book {
    bfc__mutex_t lock;
    size_t granule;
    struct bfc__vmm_res *res; /* sorted by base */
    size_t n, cap;
} bfc__vmm_book_t;

/* Initialises an empty book (BFC_OK or BFC_ENOMEM when the mutex cannot be
 * made); fini frees the records, whatever they still describe. */
int bfc__vmm_book_init(bfc__vmm_book_t *bk, size_t granule);
void bfc__vmm_book_fini(bfc__vmm_book_t *bk);
/* The rest is called with bk->lock held (bfc__lock / bfc__unlock). */
/* Records a new reservation: BFC_OK, or BFC_ENOMEM (metadata). */
int bfc__vmm_book_add(bfc__vmm_book_t *bk, uintptr_t base, size_t size);
/* The reservation [base, base + size) exactly, or NULL. */
struct bfc__vmm_res *bfc__vmm_book_exact(bfc__vmm_book_t *bk, uintptr_t base, size_t size);
/* va_mapped over a book: takes its lock. */
size_t bfc__vmm_book_res_mapped(bfc__vmm_book_t *bk, uintptr_t addr, size_t size);
/* Drops r (a record of bk) from the book. */
void bfc__vmm_book_remove(bfc__vmm_book_t *bk, struct bfc__vmm_res *r);
/* BFC_OK and *out when [addr, addr + size) is a non-empty, granule-aligned
 * sub-range of one reservation whose every granule is mapped (`mapped`
 * true) or unmapped (false); BFC_EINVAL otherwise. */
int bfc__vmm_book_check(bfc__vmm_book_t *bk, uintptr_t addr, size_t size, bool mapped,
                        struct bfc__vmm_res **out);
/* Records the granules of [addr, addr + size) (inside r) as (un)mapped. */
void bfc__vmm_book_mark(bfc__vmm_book_t *bk, struct bfc__vmm_res *r, uintptr_t addr,
                        size_t size, bool mapped);
/* Records the granules of [addr, addr + size) (inside r) as mapped and
 * stranded (see struct bfc__vmm_res); marking them unmapped clears both. */
void bfc__vmm_book_strand(bfc__vmm_book_t *bk, struct bfc__vmm_res *r, uintptr_t addr, size_t size);
/* The first run of stranded granules inside [addr, addr + size), within
 * one reservation: true with *r and [*run, *run + *len), else false. */
bool bfc__vmm_book_stranded_run(bfc__vmm_book_t *bk, uintptr_t addr, size_t size, struct bfc__vmm_res **r,
                                uintptr_t *run, size_t *len);
/* The first run of mapped granules of r at or after *addr: true and
 * [*addr, *addr + *len), false when there is none. */
bool bfc__vmm_book_next_run(bfc__vmm_book_t *bk, const struct bfc__vmm_res *r,
                            uintptr_t *addr, size_t *len);
/* 1 when every byte of [addr, addr + n) lies in mapped granules, else 0.
 * Takes the lock itself. */
int bfc__vmm_book_mapped(bfc__vmm_book_t *bk, uintptr_t addr, size_t n);

#endif /* BFC_BACKEND_H */
