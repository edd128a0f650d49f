/*
 * host.h -- host pinned-memory arenas (host.c) over their backend
 * (backend_host.h).  Not installed.
 */
#ifndef BFC_HOST_H
#define BFC_HOST_H

#include "backend_host.h"
#include "ctx.h"

/* The NUMA node (os index) a thread bound to `cpuset` (hwloc_const_cpuset_t)
 * belongs to: the single node its CPUs cover, or -1 if they span several or
 * none.  White-box tested with synthetic topologies. */
int bfc__host_node_of_cpuset(void *topo, const void *cpuset);

/* Destroys the host contexts (bfc_shutdown). */
void bfc__host_shutdown(void);

#endif /* BFC_HOST_H */
