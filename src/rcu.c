/*
 * rcu.c -- the two globals of rcu.h.
 *
 * bfc__rcu_sync is never read or written: its address is the one sync
 * object ThreadSanitizer builds use for every grace period (rcu.h).  The
 * liburcu gate serialises nothing but the library's enqueues on liburcu's
 * wait-free queues against fork(): the fork handlers take it last of the
 * library's locks but one (ctx.c, "Fork").
 */
#include "rcu.h"

char bfc__rcu_sync;
bfc__mutex_t bfc__urcu_gate = BFC__MUTEX_INIT(BFC__RANK_URCU_GATE, "the liburcu gate");
