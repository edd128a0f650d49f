/*
 * trace_actions.h -- the actions of an allocation trace and their CSV
 * spellings (doc/trace.md), in one table: the library's trace writer
 * (trace.c) and the trace reader of the tools (tools/trace_csv.c) both
 * expand it, so a new action, or a new spelling, is written once.
 *
 * X(NAME, "csv spelling") for each action, in the order of their numbers.
 * The first three are RMM's logging_resource_adaptor's own; the rest are
 * libshardbfc's additions.  Installed nowhere: a plain table with no
 * dependency, so a tool may include it by path.
 *
 *   ALLOC          ptr of size bytes returned
 *   ALLOC_FAIL     size bytes could not be served (ptr 0)
 *   FREE           ptr freed on stream (the requested size)
 *   FREE_COMPLETE  a fenced ptr became reusable
 *   GROW           region [ptr, ptr + size) taken by a shard (expandable
 *                  arenas: a run of granules mapped)
 *   RELEASE        region [ptr, ptr + size) given back (expandable arenas:
 *                  a run of granules unmapped)
 */
#ifndef SHARDBFC_TRACE_ACTIONS_H
#define SHARDBFC_TRACE_ACTIONS_H

#define BFC_TRACE_ACTIONS(X)               \
    X(ALLOC, "allocate")                   \
    X(ALLOC_FAIL, "allocate failure")      \
    X(FREE, "free")                        \
    X(FREE_COMPLETE, "free_complete")      \
    X(GROW, "grow")                        \
    X(RELEASE, "release")

#endif /* SHARDBFC_TRACE_ACTIONS_H */
