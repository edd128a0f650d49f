/*
 * mutex.h -- the library's locks: the futex lock that guards arenas, the
 * checked pthread wrappers, and bfc__fatal, what every lock calls when the
 * operating system reports a failure that only corrupted memory can cause.
 *
 * A leaf: it needs internal.h and nothing else of the library, so that every
 * layer, the backends included, may take a lock.  The slow half of the
 * futex lock (spin, then sleep in the kernel) is in mutex.c.
 */
#ifndef BFC_MUTEX_H
#define BFC_MUTEX_H

#include <pthread.h>

#include "internal.h"

/*
 * A pthread call on a lock the library initialised can only fail if memory
 * was corrupted; there is no state to return to, so it reports and aborts
 * (mutex.c).  Every other failure is a status code.
 */
void bfc__fatal(const char *what, int err) __attribute__((noreturn, cold));

static inline void bfc__plock(pthread_mutex_t *m)
{
    int e = pthread_mutex_lock(m);
    if (BFC__UNLIKELY(e != 0))
        bfc__fatal("pthread_mutex_lock", e);
}

static inline void bfc__punlock(pthread_mutex_t *m)
{
    int e = pthread_mutex_unlock(m);
    if (BFC__UNLIKELY(e != 0))
        bfc__fatal("pthread_mutex_unlock", e);
}

/*
 * The arena lock: a futex mutex (Drepper, "Futexes Are Tricky", mutex 3),
 * inline.  Uncontended -- the normal case, one thread per stream -- it costs
 * one compare-and-swap to lock and one exchange to unlock, without a call.
 * 0 = unlocked, 1 = locked, 2 = locked with (possible) waiters.  Contended,
 * it spins briefly (critical sections are short), then sleeps in the kernel.
 */
typedef struct {
    _Atomic uint32_t v;
} bfc__mutex_t;

#define BFC__MUTEX_INIT { 0 }
void bfc__mutex_lock_slow(bfc__mutex_t *m, uint32_t seen);
void bfc__mutex_wake(bfc__mutex_t *m);

static inline void bfc__mlock(bfc__mutex_t *m)
{
    uint32_t c = 0;
    /* acquire: pairs with the release exchange in bfc__munlock. */
    if (BFC__LIKELY(atomic_compare_exchange_strong_explicit(&m->v, &c, 1, memory_order_acquire,
                                                            memory_order_relaxed)))
        return;
    bfc__mutex_lock_slow(m, c);
}

static inline void bfc__munlock(bfc__mutex_t *m)
{
    /* release: pairs with the acquire CAS/exchange of the next locker. */
    if (BFC__UNLIKELY(atomic_exchange_explicit(&m->v, 0, memory_order_release) == 2))
        bfc__mutex_wake(m);
}

#define bfc__lock(m) _Generic((m), bfc__mutex_t * : bfc__mlock, pthread_mutex_t * : bfc__plock)(m)
#define bfc__unlock(m) _Generic((m), bfc__mutex_t * : bfc__munlock, pthread_mutex_t * : bfc__punlock)(m)

#endif /* BFC_MUTEX_H */
