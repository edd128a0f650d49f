/*
 * mutex.c -- the slow half of the futex lock (mutex.h) and bfc__fatal.
 *
 * The lock's word is 0 (unlocked), 1 (locked) or 2 (locked, and a thread
 * may be asleep on it): Drepper's "Futexes Are Tricky", mutex 3.  A locker
 * that finds it taken spins a little -- critical sections are short and
 * the holder is usually running -- then marks it 2 and sleeps in the
 * kernel; an unlock that finds 2 wakes one sleeper, which marks it 2 again
 * (it cannot know whether others sleep), so no wake-up is ever lost.
 * Built with --enable-pthread-mutex, the lock is a pthread_mutex_t and only
 * initialisation and destruction are here.
 *
 * The witness of debug builds (mutex.h, "Ranks") is here too: per thread,
 * the list of locks held, checked before each lock is taken.
 */
#include <errno.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "mutex.h"

void bfc__fatal(const char *what, int err)
{
    (void)bfc__nocancel_begin(); /* the report, then the abort */
    fprintf(stderr, "libshardbfc: fatal: %s failed: %s\n", what, strerror(err));
    abort();
}

#if !BFC_PTHREAD_MUTEX
static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long futex(_Atomic uint32_t *uaddr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)uaddr, op, val, NULL, NULL, 0);
}

void bfc__mutex_lock_slow(bfc__mutex_t *m, uint32_t c)
{
    /* Short critical sections: a brief spin usually finds the lock free. */
    for (int i = 0; i < 100 && c != 0; i++) {
        cpu_relax();
        c = atomic_load_explicit(&m->v, memory_order_relaxed);
        if (c == 0) {
            uint32_t z = 0;
            if (atomic_compare_exchange_strong_explicit(&m->v, &z, 1, memory_order_acquire, memory_order_relaxed))
                return;
            c = z;
        }
    }
    /* Mark contended (2) and sleep until an unlock finds the mark.
     * acquire: pairs with the release exchange in bfc__unlock. */
    if (c != 2)
        c = atomic_exchange_explicit(&m->v, 2, memory_order_acquire);
    while (c != 0) {
        long r = futex(&m->v, FUTEX_WAIT_PRIVATE, 2);
        if (r != 0 && errno != EAGAIN && errno != EINTR)
            bfc__fatal("futex wait", errno);
        c = atomic_exchange_explicit(&m->v, 2, memory_order_acquire);
    }
}

void bfc__mutex_wake(bfc__mutex_t *m)
{
    if (futex(&m->v, FUTEX_WAKE_PRIVATE, 1) < 0)
        bfc__fatal("futex wake", errno);
}
#endif /* !BFC_PTHREAD_MUTEX */

int bfc__mutex_init(bfc__mutex_t *m, enum bfc__lock_rank rank, const char *name)
{
    m->rank = rank;
    m->name = name;
    m->held_next = NULL;
#if BFC_PTHREAD_MUTEX
    return pthread_mutex_init(&m->pm, NULL);
#else
    atomic_init(&m->v, 0);
    return 0;
#endif
}

void bfc__mutex_destroy(bfc__mutex_t *m)
{
#if BFC_PTHREAD_MUTEX
    int e = pthread_mutex_destroy(&m->pm);
    if (e != 0)
        bfc__fatal("pthread_mutex_destroy", e);
#else
    (void)m;
#endif
}

/* ------------------------------------------------------------ witness */

/*
 * The locks the calling thread holds, most recently taken first, linked
 * through their held_next fields.  Each was taken at a rank at least that
 * of every lock already held, so the head has the highest rank held, and
 * it stays so whatever order the locks are released in.  A forked child
 * inherits the forking thread's list, and the after-fork handler releases
 * what it lists.
 */
static _Thread_local bfc__mutex_t *witness_held;

static void witness_fatal(const char *what, const bfc__mutex_t *m, const bfc__mutex_t *held)
{
    if (held)
        fprintf(stderr, "libshardbfc: fatal: lock order: %s %s (rank %u) while holding %s (rank %u)\n", what,
                m->name ? m->name : "?", (unsigned)m->rank, held->name ? held->name : "?", (unsigned)held->rank);
    else
        fprintf(stderr, "libshardbfc: fatal: lock order: %s %s (rank %u)\n", what, m->name ? m->name : "?",
                (unsigned)m->rank);
    abort();
}

void bfc__witness_check(bfc__mutex_t *m, bool nested)
{
    if (m->rank == BFC__RANK_NONE)
        witness_fatal("taking the uninitialised lock", m, NULL);
    const bfc__mutex_t *top = witness_held;
    for (const bfc__mutex_t *h = top; h; h = h->held_next)
        if (h == m)
            witness_fatal("taking again", m, h);
    if (top && (m->rank < top->rank || (m->rank == top->rank && !nested)))
        witness_fatal("taking", m, top);
}

void bfc__witness_acquired(bfc__mutex_t *m)
{
    m->held_next = witness_held;
    witness_held = m;
}

void bfc__witness_release(bfc__mutex_t *m)
{
    for (bfc__mutex_t **pp = &witness_held; *pp; pp = &(*pp)->held_next)
        if (*pp == m) {
            *pp = m->held_next;
            m->held_next = NULL;
            return;
        }
    witness_fatal("releasing the lock not held", m, NULL);
}
