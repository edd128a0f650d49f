/*
 * rcu.c -- the two globals of rcu.h.
 *
 * bfc__rcu_sync is never read or written: its address is the one sync
 * object ThreadSanitizer builds use for every grace period (rcu.h).  The
 * liburcu gate serialises nothing but the library's enqueues on liburcu's
 * wait-free queues against fork(): the fork handlers take it last of the
 * library's locks but one (ctx.c, "Fork").
 *
 * bfc__rcu_ctr is the inlined read side's cache of the counter of the
 * thread's urcu-bp reader record (rcu.h): filled here on a thread's first
 * section where urcu-bp uses membarrier, emptied by a thread_local
 * destructor before urcu-bp's key destructor can free the record.
 * bfc__rcu_ctr_fenced is the same where urcu-bp has no membarrier, for the
 * sections here that fence (rcu.h).
 */
#include "rcu.h"

/* glibc's thread_local destructor registration (what C++ thread_local
 * uses); these run at thread exit before any pthread key destructor. */
extern int __cxa_thread_atexit_impl(void (*fn)(void *), void *obj, void *dso);
extern void *__dso_handle;

/* The counter is the record's first member: its address is the record's. */
_Static_assert(offsetof(struct urcu_bp_reader, ctr) == 0, "urcu-bp's reader counter comes first");

__thread unsigned long *bfc__rcu_ctr BFC__TLS_IE;
__thread unsigned long *bfc__rcu_ctr_fenced BFC__TLS_IE;
/* Set once the thread's exit has begun: the cache stays empty from then on. */
static __thread bool rcu_exiting;
static __thread bool rcu_hooked;

/*
 * ThreadSanitizer: urcu-bp hands a freed record to the next thread that
 * registers through its registry lock, inside the uninstrumented library,
 * so TSan would see our last counter stores in one thread and the next
 * owner's first load in another as a race.  The exit hook releases the
 * counter and the filling acquires it: the edge the registry lock gives
 * (our hook runs before urcu-bp's key destructor frees the record).
 */
static void rcu_thread_exit(void *arg)
{
    (void)arg;
    rcu_exiting = true;
    if (bfc__rcu_ctr)
        BFC__TSAN_RELEASE(bfc__rcu_ctr);
    if (bfc__rcu_ctr_fenced)
        BFC__TSAN_RELEASE(bfc__rcu_ctr_fenced);
    bfc__rcu_ctr = NULL;
    bfc__rcu_ctr_fenced = NULL;
}

/*
 * The second hook: a key of ours, set when the cache is filled, whose
 * destructor is the same.  The thread_local destructor is the one that
 * runs before urcu-bp's key destructor frees the record -- but only for a
 * thread that filled its cache before its exit began: glibc runs a thread's
 * thread_local destructors once, before its key destructors, and never
 * one registered from a key destructor.  A thread whose first section
 * comes from a key destructor is registered by urcu-bp then, and in the
 * next round urcu-bp's key destructor frees its record; our key is made at
 * load, right after urcu-bp's (its constructor runs first), so its
 * destructor empties the cache next in that round, before the destructor
 * of any key the application made.  The thread_local destructor such a
 * thread registers never runs, and glibc never frees its record (32 bytes
 * of glibc's, which LeakSanitizer reports): nothing can tell a key
 * destructor's call from any other.  Without our key (none could be made,
 * or it could not be set) the cache is never filled: sections take
 * urcu-bp's calls.
 */
static pthread_key_t rcu_key;
static bool rcu_key_ok;

__attribute__((constructor)) static void rcu_key_make(void)
{
    rcu_key_ok = pthread_key_create(&rcu_key, rcu_thread_exit) == 0;
}

/* Rank: outermost (mutex.h).  Taken only by a thread that registers, which
 * holds no lock of the library then (rcu.h), and by the fork handlers. */
bfc__mutex_t bfc__rcu_reg_gate = BFC__MUTEX_INIT(BFC__RANK_RCU_REG, "urcu-bp registration");

void bfc__rcu_register_slow(void)
{
    bfc__lock(&bfc__rcu_reg_gate);
    urcu_bp_register_thread();
    bfc__unlock(&bfc__rcu_reg_gate);
}

/* urcu-bp's read-side steps with full fences (urcu_bp_smp_mb_slave without
 * membarrier), on the thread's record: the sections of a process without
 * membarrier (rcu.h). */
static void lock_fenced(unsigned long *ctr)
{
    cmm_barrier();
    unsigned long tmp = *ctr;
    if (BFC__LIKELY(!(tmp & URCU_BP_GP_CTR_NEST_MASK))) {
        CMM_STORE_SHARED(*ctr, CMM_LOAD_SHARED(urcu_bp_gp.ctr));
        cmm_smp_mb();
    } else {
        CMM_STORE_SHARED(*ctr, tmp + URCU_BP_GP_COUNT);
    }
}

void bfc__rcu_lock_slow(void)
{
    if (BFC__LIKELY(bfc__rcu_ctr_fenced != NULL)) {
        lock_fenced(bfc__rcu_ctr_fenced);
        return;
    }
    /* Registered through the gate even while exiting: urcu-bp's read lock
     * would otherwise register a thread whose record its key destructor
     * already freed, ungated. */
    bfc__rcu_register();
    if (!rcu_exiting) {
        /* The destructor first, so that a thread whose hook could not be
         * registered (out of memory) never caches the record. */
        if (!rcu_hooked && rcu_key_ok && pthread_setspecific(rcu_key, &rcu_hooked) == 0 &&
            __cxa_thread_atexit_impl(rcu_thread_exit, NULL, &__dso_handle) == 0)
            rcu_hooked = true;
        /* Converted, not dereferenced: the record may lie below its type's
         * alignment (rcu.h). */
        if (rcu_hooked) {
            unsigned long *rec = (unsigned long *)(void *)URCU_TLS(urcu_bp_reader);
            BFC__TSAN_ACQUIRE(rec);
            if (urcu_bp_has_sys_membarrier)
                bfc__rcu_ctr = rec;
            else
                bfc__rcu_ctr_fenced = rec;
        }
    }
    if (bfc__rcu_ctr)
        bfc__rcu_lock();
    else if (bfc__rcu_ctr_fenced)
        lock_fenced(bfc__rcu_ctr_fenced);
    else
        urcu_bp_read_lock();
}

void bfc__rcu_unlock_slow(void)
{
    unsigned long *ctr = bfc__rcu_ctr_fenced;
    if (BFC__UNLIKELY(!ctr)) {
        urcu_bp_read_unlock();
        return;
    }
    unsigned long tmp = *ctr;
    cmm_smp_mb();
    CMM_STORE_SHARED(*ctr, tmp - URCU_BP_GP_COUNT);
    cmm_barrier();
}

char bfc__rcu_sync;
bfc__mutex_t bfc__urcu_gate = BFC__MUTEX_INIT(BFC__RANK_URCU_GATE, "the liburcu gate");
