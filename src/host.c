/*
 * host.c -- host pinned-memory arenas, one per thread, placed on the
 * thread's NUMA node with hwloc.
 *
 * The same arena code as device memory, keyed by thread instead of stream:
 * each NUMA node has a host context (regions mapped, bound to the node,
 * touched and pinned by backend_host.c), and each thread that allocates gets
 * a pseudo-stream handle -- the address of its slot in a process-wide table,
 * which the backend keeps since it is what must tell a pseudo-stream from a
 * real stream -- so its arena is that node context's shard for the handle.  A free from
 * another thread is a "cross-stream" free: it goes back through the owner's
 * wait-free remote-free queue (its fence, recorded on a thread handle, is
 * complete at once).  bfc_host_record_stream adds real stream fences, so a
 * buffer used by asynchronous copies is not reused before they complete.
 *
 * Node choice (config host_numa): the node local to the CPUs the thread is
 * bound to (hwloc_get_cpubind), else the node local to the CPU it runs on at
 * its first allocation (hwloc_get_last_cpu_location); `gpu` picks the node
 * local to the GPU's CPUs (its PCI device's local_cpus, CUDA builds); a
 * number picks that node.  The choice is made once per thread.  "Local"
 * (bfc__host_node_of_cpuset) is the node whose CPUs are the fewest that
 * still cover the set: a memory-only node attached at the machine's level
 * (CXL, persistent memory) spans more CPUs than the DRAM node of a core;
 * of two nodes of one locality (a package's DRAM and its MCDRAM or HBM),
 * the one hwloc gives no subtype, ordinary DRAM, which is also the
 * kernel's default; then the lower number.
 *
 * When a thread exits, a thread-specific key destructor retires its arena
 * (live blocks stay valid and are freed later by anyone; free regions go back
 * to the node's pool at once, the rest when the last block is freed).
 *
 * Locking: `bfc__ctx_host_lock` (defined in ctx.c, which takes it across
 * fork) guards the thread table's slot list (backend_host.c leaves that
 * to its caller) and host context creation: once
 * per thread and once per node, never per allocation.  It is
 * held while a host context is created or destroyed, which waits for liburcu,
 * so it is an "outer" lock in the fork order (ctx.c), taken by the fork
 * handlers before liburcu's hooks.  The process set-up (and with it the fork
 * handlers) is done in host_init, before the lock is first taken.
 * host_init runs once, under `bfc__host_setup_lock` (ctx.c), the first lock
 * the fork handlers take: a fork never catches it half done.
 */
#include "host.h" /* first: config.h decides what follows */

#include <string.h>

#include <hwloc.h>
#if BFC_HAVE_CUDA
#include <hwloc/linux.h>
#endif

static int g_status = BFC_OK;
static hwloc_topology_t g_topo;
static int g_nnodes;
static bfc_config_t g_cfg;
static pthread_key_t g_key;
/* The host contexts, indexed by node number (os index), which can be sparse
 * and large (POWER9 numbers its GPUs' memory nodes 252 to 255): g_nslots is
 * the topology's largest node number + 1 (at most HOST_MAX_NODE + 1).
 * Allocated by host_init and, once the set-up succeeded, never freed
 * (bfc__host_shutdown empties it); read only after g_init_done (slot()). */
static bfc_ctx_t *_Atomic *g_ctx;
static int g_nslots;
static __thread struct bfc__host_thread *tls_thread;

static void thread_exit(void *arg);

/* Node numbers the table serves: Linux numbers nodes below 1024
 * (MAX_NUMNODES); a topology file may say anything. */
#define HOST_MAX_NODE 65535

static bool node_exists(int n)
{
    return n >= 0 && n <= HOST_MAX_NODE && hwloc_get_numanode_obj_by_os_index(g_topo, (unsigned)n) != NULL;
}

static void host_init(void)
{
    g_status = BFC_OK;
    bfc__process_init();
    /* An invalid SHARDBFC_CONF stops host memory as it stops device
     * memory (api.c): config.c has printed why. */
    if (bfc__config_from_env(&g_cfg) != BFC_OK) {
        g_status = BFC_EINVAL;
        return;
    }
    if (hwloc_topology_init(&g_topo) != 0) {
        g_status = BFC_EBACKEND;
        return;
    }
    if (hwloc_topology_load(g_topo) != 0) {
        hwloc_topology_destroy(g_topo);
        g_status = BFC_EBACKEND;
        return;
    }
    g_nnodes = hwloc_get_nbobjs_by_type(g_topo, HWLOC_OBJ_NUMANODE);
    if (g_nnodes < 1)
        g_nnodes = 1;
    int top = 0;
    for (hwloc_obj_t o = NULL; (o = hwloc_get_next_obj_by_type(g_topo, HWLOC_OBJ_NUMANODE, o)) != NULL;)
        if (o->os_index <= HOST_MAX_NODE && (int)o->os_index > top)
            top = (int)o->os_index;
    g_ctx = bfc__meta_zalloc((size_t)(top + 1) * sizeof(*g_ctx));
    if (!g_ctx) {
        hwloc_topology_destroy(g_topo);
        g_status = BFC_ENOMEM;
        return;
    }
    g_nslots = top + 1;
    /* A node number this machine does not have: not a refusal (one spec
     * may serve machines of several shapes), but said once, as the
     * operator asked for something else. */
    if (g_cfg.host_numa > HOST_MAX_NODE &&
        hwloc_get_numanode_obj_by_os_index(g_topo, (unsigned)g_cfg.host_numa) != NULL)
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF: host_numa=%d: host memory serves nodes numbered up to %d; "
                "it follows each thread's node instead\n",
                g_cfg.host_numa, HOST_MAX_NODE);
    else if (g_cfg.host_numa >= 0 && !node_exists(g_cfg.host_numa))
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF: host_numa=%d: this machine has no NUMA node %d (%d node%s); "
                "host memory follows each thread's node instead\n",
                g_cfg.host_numa, g_cfg.host_numa, g_nnodes, g_nnodes == 1 ? "" : "s");
    /* The key first: a table mapped for nothing is harmless, a table
     * without the key would leave arenas unretired. */
    int st = BFC_ENOMEM;
    if (pthread_key_create(&g_key, thread_exit) == 0) {
        st = bfc__backend_host_threads_init();
        if (st == BFC_OK)
            return;
        (void)pthread_key_delete(g_key); /* no thread has a value under it yet */
    }
    bfc__meta_free(g_ctx, (size_t)g_nslots * sizeof(*g_ctx));
    g_ctx = NULL;
    g_nslots = 0;
    hwloc_topology_destroy(g_topo);
    g_status = st;
}

static atomic_bool g_init_done; /* host_init has run: the common path's one test */

static int init(void)
{
    /* acquire: pairs with the release store below, after host_init. */
    if (BFC__UNLIKELY(!atomic_load_explicit(&g_init_done, memory_order_acquire))) {
        /* Under a lock the fork handlers take first (ctx.c), not in
         * pthread_once: hwloc holds a lock of its own while it loads the
         * topology, and a fork from another thread meanwhile left the
         * child to run host_init again from the start (glibc's
         * pthread_once restarts after a fork) and wait for ever on that
         * lock (10 of 270 fresh processes whose first host call raced a
         * fork).  Now a fork waits until the set-up is done or has not
         * begun.  hwloc reads /proc and /sys: not cancellable while the
         * lock is held (mutex.h). */
        int cs = bfc__nocancel_begin();
        bfc__lock(&bfc__host_setup_lock);
        /* Final once done, or for an invalid SHARDBFC_CONF (as device
         * memory refuses it); a failure for want of memory or of the
         * topology left nothing behind, and the next call tries again
         * (g_status is then read under the lock only). */
        if (!atomic_load_explicit(&g_init_done, memory_order_relaxed)) {
            host_init();
            if (g_status == BFC_OK || g_status == BFC_EINVAL)
                atomic_store_explicit(&g_init_done, true, memory_order_release);
        }
        int st = g_status;
        bfc__unlock(&bfc__host_setup_lock);
        bfc__nocancel_end(cs);
        return st;
    }
    return g_status;
}

/* Is a a better local node than b for the same CPUs (equal cpusets)? */
static bool plainer_node(hwloc_obj_t a, hwloc_obj_t b)
{
    if ((a->subtype == NULL) != (b->subtype == NULL))
        return a->subtype == NULL;
    return a->os_index < b->os_index;
}

int bfc__host_node_of_cpuset(void *topo, const void *cpuset)
{
    hwloc_topology_t t = topo;
    hwloc_const_cpuset_t set = cpuset;
    hwloc_obj_t best = NULL;
    if (hwloc_bitmap_iszero(set))
        return -1;
    /* The nodes whose CPUs meet the set; of those, the ones whose CPUs
     * contain no other such node's (a node spanning the machine is not
     * local where a core's own node exists).  They must all have the same
     * CPUs, or the set spans several localities and has no node of its
     * own; of nodes with the same CPUs, the plainest. */
    for (hwloc_obj_t o = NULL; (o = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, o)) != NULL;) {
        if (!o->cpuset || !hwloc_bitmap_intersects(o->cpuset, set))
            continue;
        bool wider = false;
        for (hwloc_obj_t q = NULL; !wider && (q = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, q)) != NULL;)
            wider = q != o && q->cpuset && hwloc_bitmap_intersects(q->cpuset, set) &&
                    hwloc_bitmap_isincluded(q->cpuset, o->cpuset) && !hwloc_bitmap_isequal(q->cpuset, o->cpuset);
        if (wider)
            continue;
        if (best && !hwloc_bitmap_isequal(best->cpuset, o->cpuset))
            return -1;
        if (!best || plainer_node(o, best))
            best = o;
    }
    /* Its CPUs must cover the set: a set with a CPU whose only node is
     * wider (on the machine) spans two localities too. */
    if (!best || !hwloc_bitmap_isincluded(set, best->cpuset))
        return -1;
    return best->os_index < INT_MAX ? (int)best->os_index : -1;
}

/* The machine's first node that host memory serves, or -1 (every node
 * numbered above HOST_MAX_NODE: allocations then fail, BFC_EINVAL). */
static int first_node(void)
{
    for (hwloc_obj_t o = NULL; (o = hwloc_get_next_obj_by_type(g_topo, HWLOC_OBJ_NUMANODE, o)) != NULL;)
        if (o->os_index <= HOST_MAX_NODE)
            return (int)o->os_index;
    return -1;
}

#if BFC_HAVE_CUDA
/* The CPUs close to the configured GPU, as hwloc's
 * hwloc_cudart_get_device_cpuset finds them (its PCI device's local_cpus
 * in sysfs; all CPUs where sysfs does not say), but with the device's PCI
 * numbers asked through the backend, which leaves the runtime's last-error
 * slot clear (hwloc's inline call left an invalid ordinal's error there
 * for the application to find).  0, or -1 when the device cannot say. */
static int gpu_cpuset(hwloc_cpuset_t set)
{
    int domain, bus, slot;
    if (!hwloc_topology_is_thissystem(g_topo) || bfc__cuda_device_pci(g_cfg.device, &domain, &bus, &slot) != BFC_OK)
        return -1;
    char path[128];
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%04x:%02x:%02x.0/local_cpus", (unsigned)domain, (unsigned)bus,
             (unsigned)slot);
    if (hwloc_linux_read_path_as_cpumask(path, set) < 0 || hwloc_bitmap_iszero(set))
        return hwloc_bitmap_copy(set, hwloc_topology_get_complete_cpuset(g_topo));
    return 0;
}
#endif

static int pick_node(void)
{
    int node = -1;
    if (g_cfg.host_numa >= 0 && node_exists(g_cfg.host_numa))
        return g_cfg.host_numa;
    hwloc_cpuset_t set = hwloc_bitmap_alloc();
    if (!set)
        return first_node();
#if BFC_HAVE_CUDA
    if (g_cfg.host_numa == BFC_HOST_NUMA_GPU && gpu_cpuset(set) == 0)
        node = bfc__host_node_of_cpuset(g_topo, set);
#endif
    if (node < 0 && hwloc_get_cpubind(g_topo, set, HWLOC_CPUBIND_THREAD) == 0)
        node = bfc__host_node_of_cpuset(g_topo, set);
    if (node < 0 && hwloc_get_last_cpu_location(g_topo, set, HWLOC_CPUBIND_THREAD) == 0)
        node = bfc__host_node_of_cpuset(g_topo, set);
    hwloc_bitmap_free(set);
    return node_exists(node) ? node : first_node();
}

static struct bfc__host_thread *thread_slot(void)
{
    if (BFC__LIKELY(tls_thread != NULL))
        return tls_thread;
    int node = pick_node();
    bfc__lock(&bfc__ctx_host_lock);
    struct bfc__host_thread *t = bfc__backend_host_thread_take(node);
    bfc__unlock(&bfc__ctx_host_lock);
    if (!t)
        return NULL;
    if (pthread_setspecific(g_key, t) != 0) {
        /* Without the key the arena is never retired at exit; keep the
         * slot anyway (it is still a valid owner). */
    }
    tls_thread = t;
    return t;
}

/* The table entry of a node, or NULL: a number the topology has no slot
 * for, or before the set-up. */
static bfc_ctx_t *_Atomic *slot(int node)
{
    /* acquire: g_ctx and g_nslots were written before g_init_done. */
    if (!atomic_load_explicit(&g_init_done, memory_order_acquire) || node < 0 || node >= g_nslots)
        return NULL;
    return &g_ctx[node];
}

static bfc_ctx_t *node_ctx(int node, int *status)
{
    bfc_ctx_t *_Atomic *e = slot(node);
    if (!e) {
        *status = BFC_EINVAL;
        return NULL;
    }
    /* acquire: pairs with the release store below. */
    bfc_ctx_t *ctx = atomic_load_explicit(e, memory_order_acquire);
    if (BFC__LIKELY(ctx != NULL))
        return ctx;
    /* The backend's open and the context's creation wait (liburcu, the
     * CUDA runtime) under the host lock (mutex.h). */
    int cs = bfc__nocancel_begin();
    bfc__lock(&bfc__ctx_host_lock);
    ctx = atomic_load_explicit(e, memory_order_relaxed);
    if (!ctx) {
        hwloc_obj_t o = hwloc_get_numanode_obj_by_os_index(g_topo, (unsigned)node);
        size_t limit = o && o->attr && o->attr->numanode.local_memory ? (size_t)o->attr->numanode.local_memory
                                                                        : 16 * BFC__GiB;
        bfc_config_t cfg = g_cfg;
        cfg.memory_limit = limit & ~(BFC__MIN_ALLOC - 1);
        cfg.allow_growth = true;
        bfc__backend_t *be;
        int st = bfc__backend_host_open(&cfg, g_topo, node, g_nnodes > 1, cfg.memory_limit, &be);
        if (st == BFC_OK)
            st = bfc__ctx_create_with_backend(&cfg, be, true, &ctx);
        if (st == BFC_OK)
            atomic_store_explicit(e, ctx, memory_order_release);
        else
            *status = st;
    }
    bfc__unlock(&bfc__ctx_host_lock);
    bfc__nocancel_end(cs);
    return ctx;
}

static void thread_exit(void *arg)
{
    struct bfc__host_thread *t = arg;
    bfc_ctx_t *_Atomic *e = slot(t->node);
    bfc_ctx_t *ctx = e ? atomic_load_explicit(e, memory_order_acquire) : NULL;
    if (ctx)
        (void)bfc_ctx_stream_release(ctx, (bfc_stream_t)t);
    bfc__lock(&bfc__ctx_host_lock);
    bfc__backend_host_thread_give(t);
    bfc__unlock(&bfc__ctx_host_lock);
    tls_thread = NULL;
}

void *bfc_host_alloc(size_t n)
{
    int st = init();
    struct bfc__host_thread *t = st == BFC_OK ? thread_slot() : NULL;
    if (!t) {
        bfc__set_last_error(st == BFC_OK ? BFC_ENOMEM : st);
        return NULL;
    }
    bfc_ctx_t *ctx = node_ctx(t->node, &st);
    if (!ctx) {
        bfc__set_last_error(st);
        return NULL;
    }
    return bfc_ctx_alloc(ctx, (bfc_stream_t)t, n);
}

/* The host context holding p, and its owner: the thread's pseudo-stream and
 * its id (owner_id may be NULL). */
static int host_owner(const void *p, bfc_ctx_t **ctx, bfc_stream_t *owner, uint64_t *owner_id)
{
    int st = init();
    if (st != BFC_OK)
        return st;
    st = BFC_ENOTOWNED;
    bfc__rcu_lock();
    struct bfc__region *r = bfc__regionmap_lookup((uintptr_t)p);
    if (r && ((struct bfc_ctx *)r->tag)->is_host) {
        *ctx = r->tag;
        *owner = r->owner->stream;
        if (owner_id)
            *owner_id = r->owner->stream_id;
        st = BFC_OK;
    }
    bfc__rcu_unlock();
    if (!r) {
        /* A block whose memory left its shard after its free (a thread's
         * arena gone with the thread, trim): a double free, as on a device
         * (regionmap.h, departed memory). */
        const void *tag = NULL;
        if (bfc__regionmap_gone((uintptr_t)p, NULL, &tag) == BFC_EDOUBLEFREE && ((const struct bfc_ctx *)tag)->is_host)
            st = BFC_EDOUBLEFREE;
    }
    return st;
}

int bfc_host_free(void *p)
{
    if (!p)
        return BFC_OK;
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    uint64_t owner_id, id;
    int st = host_owner(p, &ctx, &owner, &owner_id);
    if (st != BFC_OK)
        return st;
    struct bfc__host_thread *t = thread_slot();
    if (!t)
        return bfc_ctx_free(ctx, p, owner);
    /* The slot of an exited owner goes to the next thread: a block of the
     * slot's former owner is another thread's, told by the ids (a
     * cross-stream free, counted as one); the handles are the same. */
    if ((bfc_stream_t)t == owner && bfc__backend_host_thread_id(owner, &id) && id != owner_id)
        return bfc__ctx_free_by_id(ctx, p, owner);
    return bfc_ctx_free(ctx, p, (bfc_stream_t)t);
}

int bfc_host_record_stream(void *p, bfc_stream_t stream)
{
    if (!p)
        return BFC_EINVAL;
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    int st = host_owner(p, &ctx, &owner, NULL);
    return st == BFC_OK ? bfc_ctx_record_stream(ctx, p, stream) : st;
}

int bfc_host_numa_node(const void *p)
{
    bfc_ctx_t *ctx;
    bfc_stream_t owner;
    if (!p)
        return BFC_EINVAL;
    int st = host_owner(p, &ctx, &owner, NULL);
    if (st != BFC_OK)
        return st;
    /* A live block only, as bfc_host_record_stream: a freed or interior
     * pointer gets the status that names it, not a node. */
    int64_t id = bfc_ctx_allocation_id(ctx, p);
    if (id < 0)
        return (int)id;
    hwloc_nodeset_t ns = hwloc_bitmap_alloc();
    if (!ns)
        return BFC_ENOMEM;
    int node = BFC_EBACKEND;
    if (hwloc_get_area_memlocation(g_topo, p, 1, ns, HWLOC_MEMBIND_BYNODESET) == 0 && !hwloc_bitmap_iszero(ns))
        node = hwloc_bitmap_first(ns);
    hwloc_bitmap_free(ns);
    return node;
}

/* One node's figures into the sum, each as its table entry says, except
 * that a setting the shards of one context share is each node's own here
 * (the limit: the node's memory), and the sum has the nodes' total. */
static void stats_add(bfc_stats_t *sum, const bfc_stats_t *s)
{
#define SUM(f) sum->f += s->f;
#define MAX(f) sum->f = sum->f > s->f ? sum->f : s->f;
#define SAME(f) sum->f += s->f;
#define ADD_FIELD(name, combine, desc) combine(name)
    BFC_STATS_FIELDS(ADD_FIELD)
#undef ADD_FIELD
#undef SUM
#undef MAX
#undef SAME
}

int bfc_host_stats(bfc_stats_t *out)
{
    if (!out)
        return BFC_EINVAL;
    memset(out, 0, sizeof(*out));
    int st = init();
    if (st != BFC_OK)
        return st;
    for (int i = 0; i < g_nslots; i++) {
        bfc_ctx_t *ctx = atomic_load_explicit(&g_ctx[i], memory_order_acquire);
        bfc_stats_t s;
        if (ctx && bfc_ctx_stats(ctx, &s) == BFC_OK)
            stats_add(out, &s);
    }
    return BFC_OK;
}

int bfc_host_node_stats(int node, bfc_stats_t *out)
{
    bfc_ctx_t *_Atomic *e = slot(node);
    bfc_ctx_t *ctx = e ? atomic_load_explicit(e, memory_order_acquire) : NULL;
    return out && ctx ? bfc_ctx_stats(ctx, out) : BFC_EINVAL;
}

bfc_ctx_t *bfc_host_ctx(int node)
{
    bfc_ctx_t *_Atomic *e = slot(node);
    return e ? atomic_load_explicit(e, memory_order_acquire) : NULL;
}

int bfc_host_numa_nodes(void)
{
    int st = init();
    return st == BFC_OK ? g_nnodes : st;
}

void bfc__host_shutdown(void)
{
    /* bfc_shutdown did the process set-up: the fork handlers cover bfc__ctx_host_lock. */
    bfc__lock(&bfc__ctx_host_lock);
    for (int i = 0; slot(i) != NULL; i++) {
        bfc_ctx_t *ctx = atomic_exchange_explicit(&g_ctx[i], NULL, memory_order_acq_rel);
        if (ctx)
            bfc_ctx_destroy(ctx);
    }
    bfc__unlock(&bfc__ctx_host_lock);
}
