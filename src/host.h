/*
 * host.h -- host pinned-memory arenas (host.c) and their backend
 * (backend_host.c).  Not installed.
 */
#ifndef BFC_HOST_H
#define BFC_HOST_H

#include "ctx.h"

/* Is s a thread's pseudo-stream handle (host arenas are owned by threads)?
 * If so, *id is its unique id.  Lock-free. */
bool bfc__host_thread_id(bfc_stream_t s, uint64_t *id);

/* A host backend for one NUMA node over a newly opened device backend (SIM
 * or CUDA, per cfg) that provides pinning and stream events.  topo is the
 * loaded hwloc topology (hwloc_topology_t); bind=false skips membind. */
int bfc__backend_host_open(const bfc_config_t *cfg, void *topo, int node, bool bind, size_t limit,
                           bfc__backend_t **out);
uint64_t bfc__backend_host_bind_failures(bfc__backend_t *be);

/* The NUMA node (os index) a thread bound to `cpuset` (hwloc_const_cpuset_t)
 * belongs to: the single node its CPUs cover, or -1 if they span several or
 * none.  White-box tested with synthetic topologies. */
int bfc__host_node_of_cpuset(void *topo, const void *cpuset);

/* Destroys the host contexts (bfc_shutdown). */
void bfc__host_shutdown(void);

#endif /* BFC_HOST_H */
