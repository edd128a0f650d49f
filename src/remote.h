/*
 * remote.h -- cross-stream frees (remote.c): a block freed on a stream other
 * than its owner's travels to the owner as a {chunk, event} fence on the
 * owner's wait-free queue, taking no arena lock on the common path.
 */
#ifndef BFC_REMOTE_H
#define BFC_REMOTE_H

#include "arena.h"

/* Cross-stream free of chunk c (claimed: FREEING) of owner a.  When the
 * owner is retired the free drains it, and *dead tells the caller that the
 * owner is now dead: the caller unlinks and reclaims it (bfc__shard_reclaim)
 * -- the arena layer never reaches up into the shard directory. */
int bfc__remote_free(struct bfc__arena *a, struct bfc__chunk *c, bfc_stream_t s, bool *dead);

#endif /* BFC_REMOTE_H */
