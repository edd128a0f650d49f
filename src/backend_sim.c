/*
 * backend_sim.c -- the simulated device: host memory, modelled streams and
 * events, fault injection.  Always built; every test without a GPU runs on it.
 *
 * Memory: each mem_alloc is its own mmap(MAP_PRIVATE | MAP_ANONYMOUS |
 * MAP_NORESERVE), so a 16 GiB (or 64 GiB) "device" costs nothing until it is
 * touched, and every block is page aligned (hence 256-byte aligned).
 * mem_free munmaps with the size the caller passes (the allocator always
 * knows its region sizes).  The backend does not enforce memory_limit (the
 * context does); an optional ceiling makes mem_alloc fail with BFC_ENOMEM
 * once held + size would exceed it, and fault injection fails every Nth
 * allocation, or every Nth event record/query.
 *
 * Virtual memory: the same pages, split in two steps.  va_reserve is an
 * mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE) of the size
 * plus a granule less a page, trimmed to a granule-aligned base and the
 * size (the kernel aligns to pages only): address space only, so a 64 GiB
 * reservation costs nothing.  va_map makes granules read-write
 * in place (mprotect); their pages are fresh, zero at first touch, because
 * the kernel has never given this private mapping pages there or va_unmap
 * dropped them.  va_unmap drops the pages (madvise(MADV_DONTNEED): private
 * anonymous memory is freed at once) and makes the range inaccessible again
 * (mprotect(PROT_NONE)), so a stray access faults as it would on a GPU.  The
 * range never stops being ours: no step unmaps it, so no other mmap of the
 * process can land in a hole (a MAP_FIXED remap could, on failure, leave
 * one).  Mapped granules count in `held`, against the ceiling, and under the
 * fail_alloc_every injection, like mem_alloc; va_release munmaps the whole
 * range, whatever is still mapped in it.  The book of reservations and
 * mapped granules (backend_vmm.c) rejects double maps and stray ranges and
 * answers bfc_sim_mapped.  The granule is 2 MiB (CUDA's usual one); tests
 * set smaller ones with bfc__sim_set_vmm_granule.
 *
 * Streams: one process-wide table of SIM_MAX_STREAMS cache-line records,
 * shared by every SIM backend instance (like CUDA streams, which belong to
 * the process, not to an allocator: a stream made for one context can fence
 * a block of another, e.g. a host pinned arena), mapped once with
 * MAP_NORESERVE (only records in use are ever touched) and never unmapped.  A
 * stream handle is the address of its record, so validating a handle is a
 * range check: no hash, no lock.  Record 0 is the default stream (the NULL
 * handle); the per-thread default stream's handle (BFC_SIM_STREAM_PER_THREAD,
 * cudaStreamPerThread's value) names a record of each thread's own.
 * Records are never reused: a destroyed stream stays in the table, drained
 * and marked dead, so events that still name it stay valid.
 *
 * Handles SIM never made are refused.  On CUDA a made-up handle
 * ((bfc_stream_t)0x1234) or a destroyed stream is undefined behaviour -- a
 * crash at best -- so the simulated device must not paper over it: a test
 * that passes such a handle has to fail here.  stream_id answers BFC_EINVAL
 * for a handle outside the table (or not yet handed out) and for a
 * destroyed stream, and every public call that names a stream asks for its
 * id first (allocation, a free on another stream, record_stream, release),
 * so they all return BFC_EINVAL.  Destroying a stream also advances the
 * shard directory's epoch, so that no thread's cached (stream, shard) pair
 * serves the dead handle.  Internal uses of a stream recorded earlier, when
 * it was alive, stay lenient: an event recorded on a destroyed stream is
 * complete at once and synchronising it succeeds (its work is all done), so
 * a block fenced on a stream that went away is not stranded.  Event record
 * and sync on a handle never made are BFC_EINVAL.
 *
 * The model of one stream: `state` packs hold_gen << 1 | held; `done_gen` is
 * the last generation known complete.  hold: if not held, hold_gen++ and set
 * held (one CAS).  drain: clear held, then raise done_gen to that hold_gen.
 * An event recorded on a held stream remembers (stream, hold_gen) and is
 * complete once done_gen >= hold_gen; recorded on an idle stream it is
 * complete at once.  The pair is packed into one 64-bit word of the event so
 * that a concurrent record and query never see a torn pair.
 *
 * Locking: every operation is lock-free atomics, except stream creation,
 * which takes `g_reg_lock` only to hand out the next table index (a rare path:
 * streams are created once per simulated CUDA stream), and the va_* calls,
 * which hold their book's lock for the whole call: they are as rare as a
 * device allocation, and the lock keeps the book and the page protections
 * in step (a check and its mprotect cannot be split by another map).  The
 * fork handlers hold the registry lock across fork() (bfc__sim_fork_lock), so
 * a child never inherits it taken.
 */
#include "backend.h"
#include "meta.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define SIM_DEFAULT_LIMIT (16 * BFC__GiB)
#define SIM_VMM_GRANULE (2 * BFC__MiB)
#define SIM_MAX_STREAMS 65536u
/* Event word: (stream index + 1) << SIM_EV_GEN_BITS | hold_gen; 0 = complete. */
#define SIM_EV_GEN_BITS 44
#define SIM_EV_GEN_MASK ((1ull << SIM_EV_GEN_BITS) - 1)
#define SIM_POLL_NS 50000L

_Static_assert(SIM_MAX_STREAMS < (1u << (64 - SIM_EV_GEN_BITS)), "event packing");

struct sim_stream {
    alignas(BFC__CACHELINE) _Atomic uint64_t state; /* hold_gen << 1 | held */
    _Atomic uint64_t done_gen;
    atomic_bool dead;
};

_Static_assert(sizeof(struct sim_stream) == BFC__CACHELINE, "one line per stream");

struct sim_event {
    _Atomic uint64_t word; /* see SIM_EV_GEN_BITS */
};

struct sim_backend {
    struct bfc__backend base; /* first: bfc__backend_t * casts to this */
    size_t limit;
    struct sim_stream *streams; /* the process-wide table */

    /* Counters bumped by every allocating thread. */
    alignas(BFC__CACHELINE) atomic_size_t held;
    atomic_size_t ceiling;
    atomic_uint fail_alloc_every;
    atomic_uint alloc_calls;
    _Atomic uint64_t allocs;
    _Atomic uint64_t failures;

    /* Counters bumped by every event record / query. */
    alignas(BFC__CACHELINE) atomic_uint fail_event_every;
    atomic_uint event_calls;

    /* Counters bumped by every device free and every granule unmapped. */
    alignas(BFC__CACHELINE) atomic_uint fail_free_every;
    atomic_uint free_calls;

    /* Reservations and mapped granules, under book.lock; so are the bytes
     * of live reservations and their ceiling (bfc__sim_set_va_ceiling). */
    alignas(BFC__CACHELINE) bfc__vmm_book_t book;
    size_t va_reserved;
    size_t va_ceiling;
    /* The modelled driver's cost of one granule mapped or unmapped, in
     * nanoseconds (bfc_sim_set_vmm_cost; 0: none). */
    _Atomic uint32_t vmm_cost_ns;
};

/* The process-wide stream table (see above).  g_n_streams is written under
 * g_reg_lock and read lock-free by handle validation. */
static struct sim_stream *g_streams;
static atomic_uint g_n_streams = 1; /* record 0: the default stream */
static bfc__mutex_t g_reg_lock = BFC__MUTEX_INIT(BFC__RANK_SIM_STREAMS, "the SIM stream table");

/* The table, mapped at the first open (zero-filled: every stream idle,
 * generation 0).  Under g_reg_lock, not in pthread_once: an open that
 * finds no addresses for it (ulimit -v) fails, and a later one maps it. */
static struct sim_stream *streams_init(void)
{
    bfc__lock(&g_reg_lock);
    if (!g_streams) {
        void *tab = mmap(NULL, (size_t)SIM_MAX_STREAMS * sizeof(struct sim_stream), PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (tab != MAP_FAILED)
            g_streams = tab;
    }
    struct sim_stream *t = g_streams;
    bfc__unlock(&g_reg_lock);
    return t;
}

/*
 * The modelled driver (bfc_sim_set_vmm_cost): on a GPU the driver serialises
 * its virtual-memory calls process-wide (an H100 sustained the same rate of
 * our map and unmap calls from one context and from a context per thread,
 * about 15,000 a second in all), and each costs the calling thread its CPU
 * for tens of microseconds per granule.  With a cost set, va_map and va_unmap
 * take this lock and spin for cost x granules before they do their work:
 * one thread at a time is "in the driver", on a CPU, as on the device.  Taken
 * under a backend's book lock (which the CUDA backend also holds across its
 * driver calls), never while waiting for anything else; only map and unmap
 * calls of a SIM backend with a cost set take it.  Not held across fork():
 * every map and unmap runs under an arena or pool lock, which the fork
 * handlers hold (ctx.c, "Fork"), except perf/vmm_calls' direct calls.
 */
static bfc__mutex_t g_driver_lock = BFC__MUTEX_INIT(BFC__RANK_SIM_DRIVER, "the SIM driver model");

static void driver_cost(bfc__backend_t *be, struct sim_backend *b, size_t size)
{
    /* relaxed: a knob; a call racing the store pays the old cost or the new. */
    uint64_t ns = atomic_load_explicit(&b->vmm_cost_ns, memory_order_relaxed);
    if (ns == 0 || be->vmm_granule == 0)
        return;
    ns *= (size + be->vmm_granule - 1) / be->vmm_granule;
    bfc__lock(&g_driver_lock);
    uint64_t end = bfc__deadline_in(ns);
    while (!bfc__deadline_passed(end))
        ; /* a CPU busy in the driver, as a real call keeps it */
    bfc__unlock(&g_driver_lock);
}

static const struct bfc__backend_ops sim_ops;

static inline struct sim_backend *sim_of(bfc__backend_t *be)
{
    return (struct sim_backend *)be;
}

static inline bool is_sim(bfc__backend_t *be)
{
    return be && be->kind == BFC_BACKEND_SIM && be->ops == &sim_ops;
}

/* A new record's index (under g_reg_lock), or SIM_MAX_STREAMS when the
 * table is full. */
static unsigned sim_next_index(void)
{
    unsigned idx;

    /* The lock only hands out the next index; creation is a rare path. */
    bfc__lock(&g_reg_lock);
    idx = atomic_load_explicit(&g_n_streams, memory_order_relaxed);
    if (idx < SIM_MAX_STREAMS) {
        /* The record is fresh from the zero-filled mapping (indices are
         * never reused).  release: pairs with the acquire in sim_lookup. */
        atomic_store_explicit(&g_n_streams, idx + 1, memory_order_release);
    }
    bfc__unlock(&g_reg_lock);
    return idx;
}

/*
 * The per-thread default stream (BFC_SIM_STREAM_PER_THREAD, as
 * cudaStreamPerThread): a record of its own for each thread that names it,
 * made at its first use and kept for the process (records are never
 * reused).  Only its thread can hold or drain it: one that exits holding
 * it leaves it held for good (shardbfc_sim.h says so).  0: none yet
 * (record 0 is the NULL stream).
 */
static __thread uint32_t tl_per_thread;

static struct sim_stream *sim_per_thread(struct sim_backend *b, uint32_t *idx_out)
{
    if (tl_per_thread == 0) {
        unsigned idx = sim_next_index();
        if (idx >= SIM_MAX_STREAMS)
            return NULL;
        tl_per_thread = idx;
    }
    *idx_out = tl_per_thread;
    return &b->streams[tl_per_thread];
}

/* The table record of s, or NULL when s is unknown to this backend. */
static struct sim_stream *sim_lookup(struct sim_backend *b, bfc_stream_t s,
                                     uint32_t *idx_out)
{
    uintptr_t a = (uintptr_t)s;
    uintptr_t base = (uintptr_t)b->streams;
    uintptr_t off;
    uint32_t idx;

    if (!s) {
        *idx_out = 0;
        return &b->streams[0];
    }
    if (s == BFC__STREAM_PER_THREAD)
        return sim_per_thread(b, idx_out);
    if (a < base)
        return NULL;
    off = a - base;
    if (off >= (uintptr_t)SIM_MAX_STREAMS * sizeof(struct sim_stream) ||
        off % sizeof(struct sim_stream) != 0)
        return NULL;
    idx = (uint32_t)(off / sizeof(struct sim_stream));
    /* acquire: pairs with the release store in bfc__sim_stream_create, so a
     * handed-out index's record is seen initialised. */
    if (idx >= atomic_load_explicit(&g_n_streams, memory_order_acquire))
        return NULL;
    *idx_out = idx;
    return &b->streams[idx];
}

/* ------------------------------------------------------------- memory */

static size_t sim_page_size(void)
{
    long pg = sysconf(_SC_PAGESIZE);

    if (pg <= 0 || ((size_t)pg & ((size_t)pg - 1)) != 0)
        return 4096;
    return (size_t)pg;
}

static size_t sim_map_size(size_t size)
{
    return bfc__round_up(size, sim_page_size());
}

/* True when the every-Nth injector fires for this call. */
static bool every_nth(atomic_uint *every, atomic_uint *calls)
{
    /* relaxed: a test knob and a call counter; no data is published. */
    unsigned n = atomic_load_explicit(every, memory_order_relaxed);
    unsigned c;

    if (n == 0)
        return false;
    c = atomic_fetch_add_explicit(calls, 1, memory_order_relaxed) + 1;
    return c % n == 0;
}

/* True when the free-fault injector refuses this free (counted as a
 * failure): a region's free, a granule's unmap, a host unregistration. */
static bool free_refused(struct sim_backend *b)
{
    if (!every_nth(&b->fail_free_every, &b->free_calls))
        return false;
    /* relaxed: a statistic. */
    atomic_fetch_add_explicit(&b->failures, 1, memory_order_relaxed);
    return true;
}

/*
 * Counts `size` more bytes held, unless the fault injector fires or the
 * ceiling would be passed (true: refused, counted as a failure).  Shared by
 * mem_alloc and va_map: both are the device handing out memory.
 */
static bool sim_take(struct sim_backend *b, size_t size)
{
    size_t ceiling, prev;

    if (every_nth(&b->fail_alloc_every, &b->alloc_calls))
        goto fail;
    /*
     * Count before mapping, so that concurrent allocations cannot both pass
     * the ceiling.  relaxed: `held` is a byte count, it guards no other
     * memory; the mapping itself is published by the return value.
     */
    ceiling = atomic_load_explicit(&b->ceiling, memory_order_relaxed);
    prev = atomic_fetch_add_explicit(&b->held, size, memory_order_relaxed);
    if (prev + size < prev || prev + size > ceiling) {
        atomic_fetch_sub_explicit(&b->held, size, memory_order_relaxed);
        goto fail;
    }
    return false;
fail:
    /* relaxed: a statistic. */
    atomic_fetch_add_explicit(&b->failures, 1, memory_order_relaxed);
    return true;
}

static int sim_mem_alloc(bfc__backend_t *be, size_t size, void **out)
{
    struct sim_backend *b = sim_of(be);
    size_t map = sim_map_size(size);
    void *p;

    if (!out || size == 0)
        return BFC_EINVAL;
    *out = NULL;
    if (map == 0)
        return BFC_ENOMEM; /* rounded up to pages it overflows: no memory is that large */
    if (sim_take(b, size))
        return BFC_ENOMEM;
    p = mmap(NULL, map, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        /* relaxed: a byte count and a statistic (see sim_take). */
        atomic_fetch_sub_explicit(&b->held, size, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->failures, 1, memory_order_relaxed);
        return BFC_ENOMEM;
    }
    atomic_fetch_add_explicit(&b->allocs, 1, memory_order_relaxed);
    *out = p;
    return BFC_OK;
}

static int sim_mem_free(bfc__backend_t *be, void *p, size_t size)
{
    struct sim_backend *b = sim_of(be);

    if (!p)
        return BFC_OK;
    if (size == 0 || ((uintptr_t)p & (BFC__MIN_ALLOC - 1)) != 0)
        return BFC_EINVAL;
    if (free_refused(b))
        return BFC_EBACKEND; /* the memory stays, held */
    if (munmap(p, sim_map_size(size)) != 0)
        return BFC_EBACKEND;
    atomic_fetch_sub_explicit(&b->held, size, memory_order_relaxed);
    return BFC_OK;
}

static int sim_mem_info(bfc__backend_t *be, size_t *free_bytes, size_t *total_bytes)
{
    struct sim_backend *b = sim_of(be);
    size_t held = atomic_load_explicit(&b->held, memory_order_relaxed);

    if (free_bytes)
        *free_bytes = held < b->limit ? b->limit - held : 0;
    if (total_bytes)
        *total_bytes = b->limit;
    return BFC_OK;
}

static int sim_host_register(bfc__backend_t *be, void *p, size_t n)
{
    (void)be;
    (void)p;
    (void)n;
    return BFC_OK; /* host memory needs no pinning to be "device" visible */
}

static int sim_host_unregister(bfc__backend_t *be, void *p)
{
    struct sim_backend *b = sim_of(be);

    (void)p;
    /* A device free too, for fault injection: a driver that will not let
     * go of a registration. */
    return free_refused(b) ? BFC_EBACKEND : BFC_OK;
}

/* ------------------------------------------------------ virtual memory */

static void va_unreserved(struct sim_backend *b, size_t size)
{
    bfc__lock(&b->book.lock);
    b->va_reserved -= size;
    bfc__unlock(&b->book.lock);
}

static int sim_va_reserve(bfc__backend_t *be, size_t size, uintptr_t *base)
{
    struct sim_backend *b = sim_of(be);
    size_t g = be->vmm_granule;
    size_t pg = sim_page_size();
    size_t span, head, tail;
    uintptr_t a;
    void *p;
    int st;

    if (!base)
        return BFC_EINVAL;
    *base = 0;
    if (size == 0 || (size & (g - 1)) != 0)
        return BFC_EINVAL;
    /* mmap aligns to pages only: take g - page more and trim both ends. */
    span = size + (g - pg);
    if (span < size)
        return BFC_ENOMEM;
    /* A test's address space smaller than the machine's (a ceiling on the
     * bytes of live reservations): refused as a full one is. */
    bfc__lock(&b->book.lock);
    bool room = size <= b->va_ceiling - b->va_reserved;
    if (room)
        b->va_reserved += size; /* taken back below if the reservation fails */
    bfc__unlock(&b->book.lock);
    if (!room)
        return BFC_ENOMEM;
    p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        va_unreserved(b, size);
        return BFC_ENOMEM; /* the address space refused (as mem_alloc reads it) */
    }
    a = ((uintptr_t)p + g - 1) & ~(uintptr_t)(g - 1);
    head = a - (uintptr_t)p;
    tail = span - head - size;
    if ((head && munmap(p, head) != 0) ||
        (tail && munmap((void *)(a + size), tail) != 0)) {
        /* Cannot happen for page-aligned pieces of our own mapping; if it
         * did, give back what we can and report it. */
        (void)munmap(p, span);
        va_unreserved(b, size);
        return BFC_EBACKEND;
    }
    bfc__lock(&b->book.lock);
    st = bfc__vmm_book_add(&b->book, a, size);
    if (st != BFC_OK)
        b->va_reserved -= size;
    bfc__unlock(&b->book.lock);
    if (st != BFC_OK) {
        (void)munmap((void *)a, size); /* nothing more to undo if it fails */
        return st;
    }
    *base = a;
    return BFC_OK;
}

/*
 * Unmaps [addr, addr + size), mapped granules of r, under the book's lock:
 * the pages go back to the kernel, the range faults again, the book and
 * the held count follow.  *done: the bytes unmapped from addr.  With free
 * faults injected the granules go one at a time, as a driver's do, so
 * that a refusal can come part way (BFC_EBACKEND).
 */
static int unmap_locked(struct sim_backend *b, struct bfc__vmm_res *r, uintptr_t addr, size_t size,
                        size_t *done)
{
    size_t g = b->book.granule, len = size;
    int st = BFC_OK;

    if (atomic_load_explicit(&b->fail_free_every, memory_order_relaxed) != 0)
        len = g;
    for (*done = 0; *done < size; *done += len) {
        if (len == g && free_refused(b)) {
            st = BFC_EBACKEND;
            break;
        }
        /*
         * Drop the pages first: if the mprotect below failed, the granules
         * would still be mapped (fresh zero pages), as the book says.  The
         * other order could leave inaccessible pages the book calls mapped.
         */
        if (madvise((void *)(addr + *done), len, MADV_DONTNEED) != 0 ||
            mprotect((void *)(addr + *done), len, PROT_NONE) != 0) {
            st = BFC_EBACKEND;
            break;
        }
    }
    bfc__vmm_book_mark(&b->book, r, addr, *done, false);
    /* relaxed: a byte count (see sim_take). */
    atomic_fetch_sub_explicit(&b->held, *done, memory_order_relaxed);
    return st;
}

static int sim_va_release(bfc__backend_t *be, uintptr_t base, size_t size)
{
    struct sim_backend *b = sim_of(be);
    struct bfc__vmm_res *r;
    int st = BFC_EINVAL;

    bfc__lock(&b->book.lock);
    r = bfc__vmm_book_exact(&b->book, base, size);
    /* With free faults injected the mapped runs are unmapped first, as a
     * driver's are, so that a refusal can come part way: the reservation
     * then stays in the book with the rest. */
    if (r && atomic_load_explicit(&b->fail_free_every, memory_order_relaxed) != 0) {
        uintptr_t a = base;
        size_t len, done;
        while (bfc__vmm_book_next_run(&b->book, r, &a, &len))
            if ((st = unmap_locked(b, r, a, len, &done)) != BFC_OK) {
                r = NULL;
                break;
            }
    }
    if (r) {
        size_t mapped = r->n_mapped * b->book.granule;

        st = BFC_EBACKEND;
        if (munmap((void *)base, size) == 0) {
            /* relaxed: a byte count (see sim_take). */
            atomic_fetch_sub_explicit(&b->held, mapped, memory_order_relaxed);
            bfc__vmm_book_remove(&b->book, r);
            b->va_reserved -= size;
            st = BFC_OK;
        }
    }
    bfc__unlock(&b->book.lock);
    return st;
}

static size_t sim_va_mapped(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    return bfc__vmm_book_res_mapped(&sim_of(be)->book, addr, size);
}

static int sim_va_settle(bfc__backend_t *be)
{
    (void)be;
    return BFC_OK; /* nothing kept outside the book: a refused unmap stays mapped there */
}

static int sim_va_map(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    struct sim_backend *b = sim_of(be);
    struct bfc__vmm_res *r;
    int st;

    bfc__lock(&b->book.lock);
    st = bfc__vmm_book_check(&b->book, addr, size, false, &r);
    if (st != BFC_OK)
        goto out;
    driver_cost(be, b, size);
    if (sim_take(b, size)) {
        st = BFC_ENOMEM;
        goto out;
    }
    if (mprotect((void *)addr, size, PROT_READ | PROT_WRITE) != 0) {
        /* ENOMEM: the kernel's map count limit.  The protection may have
         * changed on part of the range: put it back (untouched pages, so
         * nothing else to undo). */
        st = errno == ENOMEM ? BFC_ENOMEM : BFC_EBACKEND;
        (void)mprotect((void *)addr, size, PROT_NONE);
        /* relaxed: a byte count and a statistic (see sim_take). */
        atomic_fetch_sub_explicit(&b->held, size, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->failures, 1, memory_order_relaxed);
        goto out;
    }
    bfc__vmm_book_mark(&b->book, r, addr, size, true);
    /* relaxed: a statistic. */
    atomic_fetch_add_explicit(&b->allocs, 1, memory_order_relaxed);
out:
    bfc__unlock(&b->book.lock);
    return st;
}

static int sim_va_unmap(bfc__backend_t *be, uintptr_t addr, size_t size, size_t *donep)
{
    struct sim_backend *b = sim_of(be);
    size_t done = 0;
    struct bfc__vmm_res *r;
    int st;

    bfc__lock(&b->book.lock);
    st = bfc__vmm_book_check(&b->book, addr, size, true, &r);
    if (st == BFC_OK) {
        driver_cost(be, b, size);
        st = unmap_locked(b, r, addr, size, &done);
    }
    bfc__unlock(&b->book.lock);
    if (donep)
        *donep = done;
    return st;
}

/* ------------------------------------------------------------- events */

static int sim_event_create(bfc__backend_t *be, bfc__event_t *out)
{
    struct sim_event *ev;

    (void)be;
    if (!out)
        return BFC_EINVAL;
    ev = bfc__meta_alloc(sizeof(*ev));
    if (!ev)
        return BFC_ENOMEM;
    atomic_init(&ev->word, 0);
    *out = ev;
    return BFC_OK;
}

static int sim_event_destroy(bfc__backend_t *be, bfc__event_t ev)
{
    (void)be;
    bfc__meta_free(ev, sizeof(struct sim_event));
    return BFC_OK;
}

static int sim_event_record(bfc__backend_t *be, bfc__event_t evp, bfc_stream_t s)
{
    struct sim_backend *b = sim_of(be);
    struct sim_event *ev = evp;
    struct sim_stream *st;
    uint64_t word = 0;
    uint64_t state;
    uint32_t idx = 0;

    if (!ev)
        return BFC_EINVAL;
    if (every_nth(&b->fail_event_every, &b->event_calls))
        return BFC_EBACKEND;
    st = sim_lookup(b, s, &idx);
    if (!st)
        return BFC_EINVAL; /* a handle SIM never made */
    /* A destroyed stream was drained and can hold no more: the state read
     * below has its held bit clear, so the event is complete at once.
     * acquire: pairs with the acq_rel CAS in hold, so the generation read is
     * the one the holder published. */
    state = atomic_load_explicit(&st->state, memory_order_acquire);
    if (state & 1)
        word = ((uint64_t)idx + 1) << SIM_EV_GEN_BITS | ((state >> 1) & SIM_EV_GEN_MASK);
    /* release: pairs with the acquire load in sim_event_done. */
    atomic_store_explicit(&ev->word, word, memory_order_release);
    return BFC_OK;
}

static bool sim_event_done(struct sim_backend *b, struct sim_event *ev)
{
    /* acquire: pairs with the release store in sim_event_record. */
    uint64_t word = atomic_load_explicit(&ev->word, memory_order_acquire);
    struct sim_stream *st;

    if (word == 0)
        return true;
    st = &b->streams[(word >> SIM_EV_GEN_BITS) - 1];
    /* acquire: pairs with the release CAS on done_gen in sim_drain, so work
     * "completed" by the drainer happens-before the caller's reuse. */
    return atomic_load_explicit(&st->done_gen, memory_order_acquire) >=
           (word & SIM_EV_GEN_MASK);
}

static int sim_event_query(bfc__backend_t *be, bfc__event_t ev)
{
    struct sim_backend *b = sim_of(be);

    if (!ev)
        return BFC_EINVAL;
    if (every_nth(&b->fail_event_every, &b->event_calls))
        return BFC_EBACKEND;
    return sim_event_done(b, ev) ? BFC_OK : BFC_EBUSY;
}

/*
 * Polls (not counted by event fault injection: the wait is one call) until
 * the event completes or the timeout passes.  A held stream only completes
 * when some thread drains it, so SIM can do nothing but poll.
 */
static int sim_event_wait(bfc__backend_t *be, bfc__event_t ev, uint32_t timeout_ms)
{
    struct sim_backend *b = sim_of(be);
    uint64_t deadline;
    struct timespec nap = {0, SIM_POLL_NS};

    if (!ev)
        return BFC_EINVAL;
    deadline = bfc__deadline_in((uint64_t)timeout_ms * 1000000ull);
    for (;;) {
        if (sim_event_done(b, ev))
            return BFC_OK;
        if (timeout_ms != UINT32_MAX && bfc__deadline_passed(deadline))
            return BFC_EBUSY;
        nanosleep(&nap, NULL); /* EINTR: just poll again */
    }
}

/* ------------------------------------------------------------- streams */

/* Unknown and destroyed handles: BFC_EINVAL (see the top of this file). */
static int sim_stream_id(bfc__backend_t *be, bfc_stream_t s, uint64_t *id)
{
    uint32_t idx = 0;
    struct sim_stream *st;

    if (!id)
        return BFC_EINVAL;
    st = sim_lookup(sim_of(be), s, &idx);
    /* acquire: pairs with the release store of `dead` in
     * bfc__sim_stream_destroy (a destroy that happened before this call,
     * e.g. in the same thread, is seen). */
    if (!st || atomic_load_explicit(&st->dead, memory_order_acquire))
        return BFC_EINVAL;
    *id = idx;
    return BFC_OK;
}

/* SIM cannot make a held stream finish (only a drain can): BFC_EBUSY then. */
static int sim_stream_sync(bfc__backend_t *be, bfc_stream_t s)
{
    uint32_t idx;
    struct sim_stream *st = sim_lookup(sim_of(be), s, &idx);

    if (!st)
        return BFC_EINVAL; /* a handle SIM never made */
    /* A destroyed stream reads idle (it was drained and holds no more).
     * acquire: pairs with the acq_rel RMWs of hold and drain. */
    return (atomic_load_explicit(&st->state, memory_order_acquire) & 1) ? BFC_EBUSY
                                                                         : BFC_OK;
}

/* The per-thread handle named from a thread other than the one whose
 * stream sid is: that stream's own record (backend.h, stream_for). */
static bfc_stream_t sim_stream_for(bfc__backend_t *be, bfc_stream_t s, uint64_t sid)
{
    struct sim_backend *b = sim_of(be);

    if (s != BFC__STREAM_PER_THREAD || sid == tl_per_thread)
        return s;
    /* acquire: pairs with the release store in sim_next_index. */
    if (sid == 0 || sid >= atomic_load_explicit(&g_n_streams, memory_order_acquire))
        return s; /* not a stream SIM made: the record refuses it */
    return (bfc_stream_t)(void *)&b->streams[sid];
}

/* The device is idle when no simulated stream is held (a rare fallback:
 * scans the streams handed out so far). */
static int sim_device_sync(bfc__backend_t *be)
{
    struct sim_backend *b = sim_of(be);
    /* acquire: pairs with the release store in bfc__sim_stream_create. */
    unsigned n = atomic_load_explicit(&g_n_streams, memory_order_acquire);

    for (unsigned i = 0; i < n; i++)
        /* acquire: pairs with the acq_rel RMWs of hold and drain. */
        if (atomic_load_explicit(&b->streams[i].state, memory_order_acquire) & 1)
            return BFC_EBUSY;
    return BFC_OK;
}

static void sim_hold(struct sim_stream *st)
{
    uint64_t old = atomic_load_explicit(&st->state, memory_order_relaxed);

    for (;;) {
        if (old & 1)
            return; /* already held: later events share the generation */
        /* acq_rel: release pairs with the acquire load in sim_event_record
         * (an event recorded after the hold sees the new generation); acquire
         * orders us after the previous drain's clear. */
        if (atomic_compare_exchange_weak_explicit(&st->state, &old,
                                                  ((old >> 1) + 1) << 1 | 1,
                                                  memory_order_acq_rel,
                                                  memory_order_relaxed))
            return;
    }
}

static void sim_drain(struct sim_stream *st)
{
    /* acq_rel: acquire pairs with hold's release CAS (we learn its gen);
     * release orders the drainer's prior writes before the clear. */
    uint64_t old = atomic_fetch_and_explicit(&st->state, ~(uint64_t)1,
                                             memory_order_acq_rel);
    uint64_t gen = old >> 1;
    uint64_t done = atomic_load_explicit(&st->done_gen, memory_order_relaxed);

    /* Raise done_gen to gen (a max: concurrent drains may race).  release:
     * pairs with the acquire load in sim_event_done. */
    while (done < gen &&
           !atomic_compare_exchange_weak_explicit(&st->done_gen, &done, gen,
                                                  memory_order_release,
                                                  memory_order_relaxed))
        ;
}

bool bfc__sim_is(const bfc__backend_t *be)
{
    return is_sim((bfc__backend_t *)be);
}

bfc_stream_t bfc__sim_stream_create(bfc__backend_t *be)
{
    struct sim_backend *b;
    unsigned idx;

    if (!is_sim(be))
        return NULL;
    b = sim_of(be);
    idx = sim_next_index();
    if (idx >= SIM_MAX_STREAMS)
        return NULL;
    return (bfc_stream_t)(void *)&b->streams[idx];
}

void bfc__sim_stream_destroy(bfc__backend_t *be, bfc_stream_t s)
{
    struct sim_stream *st;
    uint32_t idx = 0;

    if (!is_sim(be) || !s || s == BFC__STREAM_PER_THREAD)
        return; /* the default streams are never destroyed */
    st = sim_lookup(sim_of(be), s, &idx);
    if (!st || idx == 0)
        return; /* unknown, or the default stream: nothing to destroy */
    /* dead first, then drain: a hold racing with the destroy either sees
     * dead and does nothing, or holds before the drain, which clears it.
     * release: pairs with the acquire load in sim_stream_id. */
    atomic_store_explicit(&st->dead, true, memory_order_release);
    sim_drain(st);
}

void bfc__sim_stream_hold(bfc__backend_t *be, bfc_stream_t s)
{
    struct sim_stream *st;
    uint32_t idx;

    if (!is_sim(be))
        return;
    st = sim_lookup(sim_of(be), s, &idx);
    if (!st || atomic_load_explicit(&st->dead, memory_order_relaxed))
        return; /* unknown and destroyed streams stay idle */
    sim_hold(st);
}

void bfc__sim_stream_drain(bfc__backend_t *be, bfc_stream_t s)
{
    struct sim_stream *st;
    uint32_t idx;

    if (!is_sim(be))
        return;
    st = sim_lookup(sim_of(be), s, &idx);
    if (st)
        sim_drain(st);
}

/* A leaf: its holder takes no other lock and never waits (ctx.c, "Fork"). */
void bfc__sim_fork_lock(void)
{
    bfc__lock(&g_reg_lock);
}

void bfc__sim_fork_unlock(void)
{
    bfc__unlock(&g_reg_lock);
}

/* ------------------------------------------------------- fault injection */

void bfc__sim_fail_alloc_every(bfc__backend_t *be, unsigned n)
{
    if (!is_sim(be))
        return;
    /* relaxed: test knobs; "from now on" counts from this call. */
    atomic_store_explicit(&sim_of(be)->alloc_calls, 0, memory_order_relaxed);
    atomic_store_explicit(&sim_of(be)->fail_alloc_every, n, memory_order_relaxed);
}

void bfc__sim_fail_event_every(bfc__backend_t *be, unsigned n)
{
    if (!is_sim(be))
        return;
    atomic_store_explicit(&sim_of(be)->event_calls, 0, memory_order_relaxed);
    atomic_store_explicit(&sim_of(be)->fail_event_every, n, memory_order_relaxed);
}

void bfc__sim_fail_free_every(bfc__backend_t *be, unsigned n)
{
    if (!is_sim(be))
        return;
    atomic_store_explicit(&sim_of(be)->free_calls, 0, memory_order_relaxed);
    atomic_store_explicit(&sim_of(be)->fail_free_every, n, memory_order_relaxed);
}

void bfc__sim_set_va_ceiling(bfc__backend_t *be, size_t bytes)
{
    if (!is_sim(be))
        return;
    struct sim_backend *b = sim_of(be);
    bfc__lock(&b->book.lock);
    b->va_ceiling = bytes;
    bfc__unlock(&b->book.lock);
}

void bfc__sim_set_alloc_ceiling(bfc__backend_t *be, size_t bytes)
{
    if (is_sim(be))
        atomic_store_explicit(&sim_of(be)->ceiling, bytes, memory_order_relaxed);
}

uint64_t bfc__sim_allocs(bfc__backend_t *be)
{
    return is_sim(be) ? atomic_load_explicit(&sim_of(be)->allocs, memory_order_relaxed)
                      : 0;
}

uint64_t bfc__sim_failures(bfc__backend_t *be)
{
    return is_sim(be) ? atomic_load_explicit(&sim_of(be)->failures, memory_order_relaxed)
                      : 0;
}

size_t bfc__sim_bytes_held(bfc__backend_t *be)
{
    return is_sim(be) ? atomic_load_explicit(&sim_of(be)->held, memory_order_relaxed)
                      : 0;
}

void bfc__sim_set_vmm_cost(bfc__backend_t *be, uint32_t ns_per_granule)
{
    /* relaxed: a knob, read by driver_cost; it publishes nothing else. */
    if (is_sim(be))
        atomic_store_explicit(&sim_of(be)->vmm_cost_ns, ns_per_granule, memory_order_relaxed);
}

int bfc__sim_set_vmm_granule(bfc__backend_t *be, size_t granule)
{
    struct sim_backend *b;
    int st = BFC_EINVAL;

    if (!is_sim(be) || granule < sim_page_size() || (granule & (granule - 1)) != 0)
        return BFC_EINVAL;
    b = sim_of(be);
    bfc__lock(&b->book.lock);
    if (b->book.n == 0) {
        /* No reservation exists, so no call can be using the old granule
         * (a call racing this one is a test's own mistake). */
        b->book.granule = granule;
        be->vmm_granule = granule;
        st = BFC_OK;
    }
    bfc__unlock(&b->book.lock);
    return st;
}

int bfc__sim_mapped(bfc__backend_t *be, const void *p, size_t n)
{
    if (!is_sim(be) || !p)
        return 0;
    return bfc__vmm_book_mapped(&sim_of(be)->book, (uintptr_t)p, n);
}

/* ------------------------------------------------------- open / close */

static void sim_close(bfc__backend_t *be)
{
    struct sim_backend *b;

    if (!is_sim(be))
        return;
    b = sim_of(be);
    /* Reservations the allocator did not release go with the backend. */
    for (size_t i = 0; i < b->book.n; i++)
        (void)munmap((void *)b->book.res[i].base, b->book.res[i].size);
    bfc__vmm_book_fini(&b->book);
    /* The stream table is process-wide and stays. */
    bfc__meta_free(b, sizeof(*b));
}

static const struct bfc__backend_ops sim_ops = {
    .mem_alloc = sim_mem_alloc,
    .mem_free = sim_mem_free,
    .event_create = sim_event_create,
    .event_destroy = sim_event_destroy,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_wait = sim_event_wait,
    .stream_id = sim_stream_id,
    .stream_sync = sim_stream_sync,
    .stream_for = sim_stream_for,
    .device_sync = sim_device_sync,
    .mem_info = sim_mem_info,
    .host_register = sim_host_register,
    .host_unregister = sim_host_unregister,
    .va_reserve = sim_va_reserve,
    .va_release = sim_va_release,
    .va_mapped = sim_va_mapped,
    .va_map = sim_va_map,
    .va_unmap = sim_va_unmap,
    .va_settle = sim_va_settle,
    .close = sim_close,
};

int bfc__backend_sim_open(const bfc_config_t *cfg, bfc__backend_t **out)
{
    struct sim_backend *b;
    if (!cfg || !out)
        return BFC_EINVAL;
    *out = NULL;
    b = bfc__meta_aligned_alloc(BFC__CACHELINE, sizeof(*b));
    if (!b)
        return BFC_ENOMEM;
    memset(b, 0, sizeof(*b));
    b->streams = streams_init();
    if (!b->streams || bfc__vmm_book_init(&b->book, SIM_VMM_GRANULE) != BFC_OK) {
        bfc__meta_free(b, sizeof(*b));
        return BFC_ENOMEM;
    }
    b->base.ops = &sim_ops;
    b->base.kind = BFC_BACKEND_SIM;
    b->base.device = 0;
    b->base.default_limit = SIM_DEFAULT_LIMIT;
    b->base.host_accessible = true;
    b->base.vmm_granule = SIM_VMM_GRANULE;
    strcpy(b->base.name, "sim");
    b->limit = cfg->memory_limit ? cfg->memory_limit : SIM_DEFAULT_LIMIT;
    atomic_init(&b->held, 0);
    atomic_init(&b->ceiling, SIZE_MAX);
    b->va_ceiling = SIZE_MAX;
    atomic_init(&b->fail_alloc_every, 0);
    atomic_init(&b->alloc_calls, 0);
    atomic_init(&b->allocs, 0);
    atomic_init(&b->failures, 0);
    atomic_init(&b->fail_event_every, 0);
    atomic_init(&b->fail_free_every, 0);
    atomic_init(&b->free_calls, 0);
    atomic_init(&b->event_calls, 0);
    *out = &b->base;
    return BFC_OK;
}
