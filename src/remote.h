/*
 * remote.h -- cross-stream frees (remote.c): a block freed on a stream other
 * than its owner's travels to the owner as a {chunk, event} fence on the
 * owner's wait-free queue, taking no arena lock on the common path.
 */
#ifndef BFC_REMOTE_H
#define BFC_REMOTE_H

#include "arena.h"

/* Cross-stream free of chunk c (claimed: FREEING) of owner a, on stream s
 * whose id is sid (the calling thread's stream: its fence is recorded
 * there).  When the
 * owner is retired the free drains it, and *dead tells the caller that the
 * owner is now dead: the caller unlinks and reclaims it (bfc__shard_reclaim)
 * -- the arena layer never reaches up into the shard directory. */
int bfc__remote_free(struct bfc__arena *a, struct bfc__chunk *c, bfc_stream_t s, uint64_t sid, bool *dead);

/* The two halves of the handshake between cross-stream frees and the
 * owner's retirement (remote.c, "Retirement").  The freer's, after its
 * enqueue on a's queue: is a retired (so that the freer must drain it)?
 * The retirer's: marks a retired; a drain after it sees the enqueue of
 * every freer that saw a not retired. */
bool bfc__remote_owner_retired(struct bfc__arena *a);
void bfc__remote_mark_retired(struct bfc__arena *a);
/* Once per process, before any context exists: picks the handshake. */
void bfc__remote_init(void);
/* Freers use the light handshake (a compiler barrier, the retirer runs
 * membarrier): set by bfc__remote_init where membarrier works, cleared if
 * it ever fails.  Tests may set it before they start threads. */
extern _Atomic bool bfc__remote_light;

#endif /* BFC_REMOTE_H */
