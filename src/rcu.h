/*
 * rcu.h -- the library's one door to liburcu's urcu-bp flavour: read-side
 * sections, thread registration, call_rcu, and the edges that let
 * ThreadSanitizer see what a grace period orders.
 *
 * Every translation unit that enters RCU includes this header and no other
 * urcu flavour (one flavour per process: the application shares urcu-bp's
 * domain with us).  A leaf: it needs internal.h and mutex.h only.  Its two
 * globals, the TSan sync object and the liburcu gate, live in rcu.c.
 */
#ifndef BFC_RCU_H
#define BFC_RCU_H

#include <urcu-bp.h>
/* struct urcu_bp_reader, urcu_bp_gp and urcu_bp_smp_mb_slave: the ABI
 * liburcu-bp publishes for inlined read sides (_LGPL_SOURCE users), fixed
 * for its soname. */
#include <urcu/static/urcu-bp.h>

#include "internal.h"
#include "mutex.h"

/*
 * The read side, inlined.  rcu_read_lock through the shared library costs
 * a call, and its thread-local reader pointer lives in liburcu-bp.so, so
 * every access is a __tls_get_addr call: ~84 instructions per pair of
 * sections, a fifth of an alloc+free pair.  Instead each thread caches the
 * counter of its urcu-bp reader record in an initial-exec thread-local of
 * ours (one %fs load) and runs urcu-bp's own read-side steps on it: the
 * counter takes the grace-period phase at the outermost lock and a nest
 * count otherwise, exactly as _urcu_bp_read_lock does.  The cache points at
 * the counter, the record's first member, as a plain unsigned long: urcu-bp
 * places its records 32 bytes into 128-byte lines, below the alignment its
 * own type declares, so an access through struct urcu_bp_reader would be
 * undefined behaviour (UBSan reports it).
 *
 * The cache is filled on a thread's first section (rcu.c, registering the
 * thread with urcu-bp if needed), and only where urcu-bp found the
 * membarrier system call: urcu-bp's grace periods then order the readers'
 * accesses themselves, and its read side's fence is a compiler barrier, so
 * ours is one outright, without urcu-bp's test of its global flag (a load
 * through the GOT and a branch at each fence, 16 instructions per
 * alloc+free pair).  That flag is set once, by urcu-bp's constructor, before
 * any thread can enter a section.  Without membarrier (an old kernel, a
 * sandbox that filters it) readers must fence: the inline cache stays
 * empty, and every section is the same steps with full fences, out of line
 * in rcu.c on a second cache of the same record (urcu-bp's own calls would
 * add ~170 instructions per pair: a PLT call and __tls_get_addr each).
 * The caches are valid until the thread exits:
 * urcu-bp never moves a reader record, and a fork child keeps the forking
 * thread's.  At exit urcu-bp frees the record in a pthread key destructor,
 * after which another thread may take it; so rcu.c clears the cache in a
 * thread_local destructor, which glibc runs before every key destructor
 * (and, for a thread whose first section comes from a key destructor,
 * when that one never runs, in a key destructor of its own, right after
 * urcu-bp's), and from then on the exiting thread uses urcu-bp's own calls
 * (a key destructor of the application may still free memory).
 */
extern __thread unsigned long *bfc__rcu_ctr BFC__TLS_IE;
/* Without membarrier: the fenced sections' cache of the same counter. */
extern __thread unsigned long *bfc__rcu_ctr_fenced BFC__TLS_IE;
void bfc__rcu_lock_slow(void);
void bfc__rcu_unlock_slow(void);

/* RCU read side, and the matching edge for reclamation (BFC__TSAN_RELEASE, internal.h). */
extern char bfc__rcu_sync;
/* The section's steps on a counter already read from the cache (non-NULL):
 * for a fast path that tests the cache once, with its other conditions,
 * and so makes no call (ctx.c). */
static inline void bfc__rcu_lock_on(unsigned long *ctr)
{
    cmm_barrier();
    unsigned long tmp = *ctr;
    if (BFC__LIKELY(!(tmp & URCU_BP_GP_CTR_NEST_MASK))) {
        CMM_STORE_SHARED(*ctr, CMM_LOAD_SHARED(urcu_bp_gp.ctr));
        cmm_barrier(); /* urcu_bp_smp_mb_slave with membarrier (above) */
    } else {
        CMM_STORE_SHARED(*ctr, tmp + URCU_BP_GP_COUNT);
    }
}
static inline void bfc__rcu_unlock_on(unsigned long *ctr)
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
    unsigned long tmp = *ctr;
    cmm_barrier(); /* urcu_bp_smp_mb_slave with membarrier (above) */
    CMM_STORE_SHARED(*ctr, tmp - URCU_BP_GP_COUNT);
    cmm_barrier();
}
static inline void bfc__rcu_lock(void)
{
    unsigned long *ctr = bfc__rcu_ctr;
    if (BFC__UNLIKELY(!ctr)) {
        bfc__rcu_lock_slow();
        return;
    }
    bfc__rcu_lock_on(ctr);
}
static inline void bfc__rcu_unlock(void)
{
    unsigned long *ctr = bfc__rcu_ctr;
    if (BFC__UNLIKELY(!ctr)) {
        BFC__TSAN_RELEASE(&bfc__rcu_sync);
        bfc__rcu_unlock_slow();
        return;
    }
    bfc__rcu_unlock_on(ctr);
}
/*
 * Registers the calling thread with urcu-bp if it is not yet (a thread-local
 * test when it is).  urcu-bp registers a thread at its first rcu_read_lock,
 * and registering takes liburcu's registry lock, which the fork handlers hold
 * while they wait for the library's locks (ctx.c, "Fork").  So a thread must
 * be registered before it takes any library lock on a path that may enter
 * RCU (call_rcu, a nested read section): the allocation and free paths are,
 * because they open a read section first; the slow entry points that start
 * with a lock (trim, statistics, dumps) call this first.
 *
 * Registering goes through bfc__rcu_reg_gate, which the fork handlers take
 * first of all (ctx.c, "Fork"): urcu-bp registers under a lock of its own
 * (init_lock, in _urcu_bp_init) that its fork hooks do not hold, so a fork
 * while another thread registered left that lock held in the child, whose
 * first registration -- its own, or its new call_rcu thread's -- then
 * waited for ever (test_hardening's fork loop, about one fork in 75,000).
 * The window was wide: a registration holds init_lock while it waits for
 * the registry lock, which the fork hooks hold throughout the fork.  A
 * thread's exit takes init_lock too (urcu_bp_exit), but only after it has
 * left the registry and for a few instructions; that is not gated (a thread
 * exit has no hook after urcu-bp's key destructor), and the fork loop has
 * not met it (0 hangs in 69,000 forks beside thousands of thread exits).
 */
void bfc__rcu_register_slow(void);
extern bfc__mutex_t bfc__rcu_reg_gate;
static inline void bfc__rcu_register(void)
{
    if (BFC__LIKELY(URCU_TLS(urcu_bp_reader) != NULL))
        return;
    bfc__rcu_register_slow();
}

/*
 * The liburcu gate: held around every call of the library that enqueues on
 * one of liburcu's wait-free queues (call_rcu; rculfhash add and delete,
 * which may queue a resize for its worker).  Such an enqueue is two stores
 * (swap the tail, then link the old tail); a thread stopped between them by
 * fork() would leave the child a queue whose consumer -- the child's new
 * call_rcu thread or hash-table worker -- waits forever for the link.  The
 * fork handlers take the gate, so no such enqueue is ever in flight at fork.
 * The gate is a leaf: its holder only enqueues (never blocking: the thread
 * is registered and the default call_rcu data exists from process set-up).
 */
extern bfc__mutex_t bfc__urcu_gate;

/* Every call_rcu goes through here: the caller's accesses happen before
 * the callback's (which starts with bfc__rcu_reclaim). */
static inline void bfc__call_rcu(struct rcu_head *h, void (*fn)(struct rcu_head *))
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
    bfc__rcu_register();
    bfc__lock(&bfc__urcu_gate);
    call_rcu(h, fn);
    bfc__unlock(&bfc__urcu_gate);
}
/* First thing in every call_rcu callback and after synchronize_rcu /
 * rcu_barrier. */
static inline void bfc__rcu_reclaim(void)
{
    BFC__TSAN_ACQUIRE(&bfc__rcu_sync);
}
/* Last thing in every call_rcu callback: what it did happens before the
 * return of a later rcu_barrier. */
static inline void bfc__rcu_reclaim_done(void)
{
    BFC__TSAN_RELEASE(&bfc__rcu_sync);
}

#endif /* BFC_RCU_H */
