/*
 * backend_host.c -- the backend of host pinned-memory arenas.
 *
 * Memory: each region is mapped by the library (mmap), bound to one NUMA
 * node with hwloc (hwloc_set_area_membind, strict, by nodeset), touched so
 * that its pages are placed now rather than at first use, then pinned for DMA
 * through the inner device backend (cudaHostRegister on CUDA; a no-op on
 * SIM).  Unmapping reverses it.  On a machine with one NUMA node there is
 * nothing to choose and the binding is skipped.
 *
 * Streams and events: a host arena is owned by a thread, not a stream.  Each
 * thread gets a pseudo-stream handle: the address of its slot in the thread
 * table below, which host.c hands out (bfc__backend_host_thread_take) and
 * this backend recognises (bfc__backend_host_thread_id); events "recorded"
 * on a pseudo-stream are complete at once (a thread has no queued device
 * work), while events on real streams (bfc_host_record_stream) are the
 * inner backend's events.
 *
 * The thread table: MAX_THREADS slots mapped once, with MAP_NORESERVE, so
 * that a handle is recognised by its address alone (in the table, on a slot
 * boundary, below the high-water mark) with no lock.  A slot's id is unique
 * for its owner (a reused slot gets a new one), so a shard keyed by the id
 * never outlives its thread into the next.  Taking and giving back slots is
 * serialised by the caller (host.c's lock, which the fork handlers take);
 * readers need only the release stores of the id and the high-water mark.
 *
 * Virtual memory: none (vmm_granule 0).  Host arenas keep classic regions:
 * each is bound to a node and pinned as a whole, which reserving and mapping
 * piecemeal would only complicate.  The va_* calls answer BFC_EINVAL.
 *
 * Thread safety: as every backend; the shared state is the topology
 * (read-only after load), counters (relaxed atomics) and the thread table.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <hwloc.h>

#include "backend_host.h"
#include "meta.h"

#define MAX_THREADS (1u << 16)
#define THREAD_ID_BIT (1ull << 62)
#define TABLE_BYTES ((size_t)MAX_THREADS * sizeof(struct bfc__host_thread))

static struct bfc__host_thread *g_threads; /* MAX_THREADS slots, mapped */
static atomic_uint g_hw;                   /* slots ever handed out */
static uint32_t g_free = UINT32_MAX;       /* free slot list (the caller's lock) */
static uint64_t g_next_id = 1;             /* the caller's lock */

int bfc__backend_host_threads_init(void)
{
    void *tab = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (tab == MAP_FAILED)
        return BFC_ENOMEM;
    g_threads = tab;
    return BFC_OK;
}

struct bfc__host_thread *bfc__backend_host_thread_take(int node)
{
    uint32_t idx = g_free;
    if (idx != UINT32_MAX) {
        g_free = g_threads[idx].next_free;
    } else {
        /* relaxed: only the caller, serialised, writes g_hw. */
        idx = atomic_load_explicit(&g_hw, memory_order_relaxed);
        if (idx >= MAX_THREADS)
            return NULL;
    }
    struct bfc__host_thread *t = &g_threads[idx];
    t->node = node;
    /* release: pairs with the acquire load of the id in
     * bfc__backend_host_thread_id. */
    atomic_store_explicit(&t->id, g_next_id++, memory_order_release);
    /* relaxed load: as above.  release store: pairs with the acquire load
     * of g_hw in bfc__backend_host_thread_id (the slot's id is set). */
    if (idx == atomic_load_explicit(&g_hw, memory_order_relaxed))
        atomic_store_explicit(&g_hw, idx + 1, memory_order_release);
    return t;
}

void bfc__backend_host_thread_give(struct bfc__host_thread *t)
{
    /* release: pairs with the acquire load in bfc__backend_host_thread_id. */
    atomic_store_explicit(&t->id, 0, memory_order_release);
    t->next_free = g_free;
    g_free = (uint32_t)(t - g_threads);
}

bool bfc__backend_host_thread_id(bfc_stream_t s, uint64_t *id)
{
    uintptr_t base = (uintptr_t)g_threads, a = (uintptr_t)s;
    if (!base || a < base)
        return false;
    uintptr_t off = a - base;
    if (off >= TABLE_BYTES || off % sizeof(struct bfc__host_thread))
        return false;
    /* acquire: pairs with the release store of g_hw in
     * bfc__backend_host_thread_take. */
    if (off / sizeof(struct bfc__host_thread) >= atomic_load_explicit(&g_hw, memory_order_acquire))
        return false;
    /* acquire: pairs with the release stores of the slot's id in
     * bfc__backend_host_thread_take and _give. */
    *id = atomic_load_explicit(&((struct bfc__host_thread *)s)->id, memory_order_acquire) | THREAD_ID_BIT;
    return true;
}

struct host_backend {
    struct bfc__backend base;
    bfc__backend_t *inner;
    hwloc_topology_t topo;
    int node;               /* os index of the node */
    bool bind;              /* false on a one-node machine */
    _Atomic uint64_t bind_failures;
};

struct host_event {
    bfc__event_t inner;
    bool trivial;           /* recorded on a thread's pseudo-stream */
};

static struct host_backend *hb(bfc__backend_t *be)
{
    return (struct host_backend *)be;
}

static int host_mem_alloc(bfc__backend_t *be, size_t size, void **out)
{
    struct host_backend *h = hb(be);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return errno == ENOMEM ? BFC_ENOMEM : BFC_EBACKEND;
    if (h->bind) {
        hwloc_nodeset_t ns = hwloc_bitmap_alloc();
        int rc = -1;
        if (ns && hwloc_bitmap_only(ns, (unsigned)h->node) == 0)
            rc = hwloc_set_area_membind(h->topo, p, size, ns, HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_STRICT | HWLOC_MEMBIND_BYNODESET);
        hwloc_bitmap_free(ns);
        if (rc != 0) {
            /* The memory is still usable; bfc_host_numa_node reports where
             * it really landed.  relaxed: a statistic. */
            atomic_fetch_add_explicit(&h->bind_failures, 1, memory_order_relaxed);
        }
    }
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    for (size_t off = 0; off < size; off += (size_t)page)
        ((volatile char *)p)[off] = 0;
    int st = h->inner->ops->host_register(h->inner, p, size);
    if (st != BFC_OK) {
        (void)munmap(p, size); /* fails only for a bad range: ours is not */
        return st;
    }
    *out = p;
    return BFC_OK;
}

static int host_mem_free(bfc__backend_t *be, void *p, size_t size)
{
    struct host_backend *h = hb(be);
    /* Still registered, the pages stay mapped: the driver may still reach
     * them.  The region pool keeps a segment whose free failed and offers
     * it again. */
    int st = h->inner->ops->host_unregister(h->inner, p);
    if (st != BFC_OK)
        return st;
    return munmap(p, size) == 0 ? BFC_OK : BFC_EBACKEND;
}

static int host_event_create(bfc__backend_t *be, bfc__event_t *out)
{
    struct host_backend *h = hb(be);
    struct host_event *ev = bfc__meta_zalloc(sizeof(*ev));
    if (!ev)
        return BFC_ENOMEM;
    int st = h->inner->ops->event_create(h->inner, &ev->inner);
    if (st != BFC_OK) {
        bfc__meta_free(ev, sizeof(*ev));
        return st;
    }
    *out = ev;
    return BFC_OK;
}

static int host_event_destroy(bfc__backend_t *be, bfc__event_t e)
{
    struct host_event *ev = e;
    int st = hb(be)->inner->ops->event_destroy(hb(be)->inner, ev->inner);
    bfc__meta_free(ev, sizeof(*ev));
    return st;
}

static int host_event_record(bfc__backend_t *be, bfc__event_t e, bfc_stream_t s)
{
    struct host_event *ev = e;
    uint64_t id;
    if (bfc__backend_host_thread_id(s, &id)) {
        ev->trivial = true;
        return BFC_OK;
    }
    ev->trivial = false;
    return hb(be)->inner->ops->event_record(hb(be)->inner, ev->inner, s);
}

static int host_event_query(bfc__backend_t *be, bfc__event_t e)
{
    struct host_event *ev = e;
    return ev->trivial ? BFC_OK : hb(be)->inner->ops->event_query(hb(be)->inner, ev->inner);
}

static int host_event_wait(bfc__backend_t *be, bfc__event_t e, uint32_t timeout_ms)
{
    struct host_event *ev = e;
    return ev->trivial ? BFC_OK : hb(be)->inner->ops->event_wait(hb(be)->inner, ev->inner, timeout_ms);
}

static int host_stream_id(bfc__backend_t *be, bfc_stream_t s, uint64_t *id)
{
    if (bfc__backend_host_thread_id(s, id))
        return BFC_OK;
    return hb(be)->inner->ops->stream_id(hb(be)->inner, s, id);
}

static int host_stream_sync(bfc__backend_t *be, bfc_stream_t s)
{
    uint64_t id;
    if (bfc__backend_host_thread_id(s, &id))
        return BFC_OK;
    return hb(be)->inner->ops->stream_sync(hb(be)->inner, s);
}

static bfc_stream_t host_stream_for(bfc__backend_t *be, bfc_stream_t s, uint64_t sid)
{
    uint64_t id;
    if (bfc__backend_host_thread_id(s, &id))
        return s; /* a thread's own handle: one value per thread */
    return hb(be)->inner->ops->stream_for(hb(be)->inner, s, sid);
}

static int host_device_sync(bfc__backend_t *be)
{
    return hb(be)->inner->ops->device_sync(hb(be)->inner);
}

static int host_mem_info(bfc__backend_t *be, size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = be->default_limit;
    return BFC_OK;
}

static int host_register(bfc__backend_t *be, void *p, size_t n)
{
    return hb(be)->inner->ops->host_register(hb(be)->inner, p, n);
}

static int host_unregister(bfc__backend_t *be, void *p)
{
    return hb(be)->inner->ops->host_unregister(hb(be)->inner, p);
}

static int host_va_reserve(bfc__backend_t *be, size_t size, uintptr_t *base)
{
    (void)be;
    (void)size;
    if (base)
        *base = 0;
    return BFC_EINVAL;
}

static int host_va_range(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    (void)be;
    (void)addr;
    (void)size;
    return BFC_EINVAL;
}

static size_t host_va_mapped(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    (void)be;
    (void)addr;
    (void)size;
    return 0;
}

static int host_va_unmap(bfc__backend_t *be, uintptr_t addr, size_t size, size_t *done)
{
    if (done)
        *done = 0;
    return host_va_range(be, addr, size);
}

static int host_va_settle(bfc__backend_t *be)
{
    (void)be;
    return BFC_OK; /* no virtual memory, nothing kept */
}

static void host_close(bfc__backend_t *be)
{
    struct host_backend *h = hb(be);
    h->inner->ops->close(h->inner);
    bfc__meta_free(h, sizeof(*h));
}

static const struct bfc__backend_ops host_ops = {
    .mem_alloc = host_mem_alloc,
    .mem_free = host_mem_free,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_record = host_event_record,
    .event_query = host_event_query,
    .event_wait = host_event_wait,
    .stream_id = host_stream_id,
    .stream_sync = host_stream_sync,
    .stream_for = host_stream_for,
    .device_sync = host_device_sync,
    .mem_info = host_mem_info,
    .host_register = host_register,
    .host_unregister = host_unregister,
    .va_reserve = host_va_reserve,
    .va_release = host_va_range,
    .va_mapped = host_va_mapped,
    .va_map = host_va_range,
    .va_unmap = host_va_unmap,
    .va_settle = host_va_settle,
    .close = host_close,
};

int bfc__backend_host_open(const bfc_config_t *cfg, void *topo, int node, bool bind, size_t limit,
                           bfc__backend_t **out)
{
    struct host_backend *h = bfc__meta_zalloc(sizeof(*h));
    if (!h)
        return BFC_ENOMEM;
    int st = bfc__backend_open(cfg, &h->inner);
    if (st != BFC_OK) {
        bfc__meta_free(h, sizeof(*h));
        return st;
    }
    h->topo = topo;
    h->node = node;
    h->bind = bind;
    h->base.ops = &host_ops;
    h->base.kind = h->inner->kind;
    h->base.device = h->inner->device;
    h->base.default_limit = limit;
    h->base.host_accessible = true;
    h->base.vmm_granule = 0; /* classic regions only (see above) */
    snprintf(h->base.name, sizeof(h->base.name), "host-node%d/%.32s", node, h->inner->name);
    *out = &h->base;
    return BFC_OK;
}

bfc__backend_t *bfc__backend_host_inner(bfc__backend_t *be)
{
    return hb(be)->inner;
}

uint64_t bfc__backend_host_bind_failures(bfc__backend_t *be)
{
    return be->ops == &host_ops ? atomic_load_explicit(&hb(be)->bind_failures, memory_order_relaxed) : 0;
}
