/*
 * backend_host.h -- the backend of host pinned-memory arenas and the table
 * of threads' pseudo-streams it tells apart from real streams
 * (backend_host.c).  Not installed.
 *
 * The table is the backend's because the backend is what must recognise a
 * pseudo-stream (its events are complete at once); host.c, above the
 * context, hands the slots out and takes them back.
 */
#ifndef BFC_BACKEND_HOST_H
#define BFC_BACKEND_HOST_H

#include "backend.h"

/* One thread's slot; its address is the thread's pseudo-stream handle. */
struct bfc__host_thread {
    alignas(BFC__CACHELINE) _Atomic uint64_t id; /* unique per owner; 0 = free slot */
    int node;                                    /* the owner's NUMA node (host.c) */
    uint32_t next_free;                          /* the free slot list */
};

/* Maps the table (once, from host.c's process set-up): BFC_OK or
 * BFC_ENOMEM.  Not thread-safe: call under a pthread_once. */
int bfc__backend_host_threads_init(void);

/* Takes a free slot, gives it a new id and sets its node; NULL when every
 * slot is taken.  Gives a slot back (its id becomes 0).  Context: the
 * caller serialises both (host.c holds bfc__ctx_host_lock, which the fork
 * handlers take); the table never takes a lock of its own. */
struct bfc__host_thread *bfc__backend_host_thread_take(int node);
void bfc__backend_host_thread_give(struct bfc__host_thread *t);

/* Is s a thread's pseudo-stream handle (host arenas are owned by threads)?
 * If so, *id is its unique id.  Context: lock-free, any thread. */
bool bfc__backend_host_thread_id(bfc_stream_t s, uint64_t *id);

/* A host backend for one NUMA node over a newly opened device backend (SIM
 * or CUDA, per cfg) that provides pinning and stream events.  topo is the
 * loaded hwloc topology (hwloc_topology_t); bind=false skips membind. */
int bfc__backend_host_open(const bfc_config_t *cfg, void *topo, int node, bool bind, size_t limit,
                           bfc__backend_t **out);
uint64_t bfc__backend_host_bind_failures(bfc__backend_t *be);
/* The device backend it registers memory with (tests: SIM's fault
 * injection). */
bfc__backend_t *bfc__backend_host_inner(bfc__backend_t *be);

#endif /* BFC_BACKEND_HOST_H */
