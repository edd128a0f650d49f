/*
 * mutex.c -- the slow half of the futex lock (mutex.h) and bfc__fatal.
 *
 * The lock's word is 0 (unlocked), 1 (locked) or 2 (locked, and a thread
 * may be asleep on it): Drepper's "Futexes Are Tricky", mutex 3.  A locker
 * that finds it taken spins a little -- critical sections are short and
 * the holder is usually running -- then marks it 2 and sleeps in the
 * kernel; an unlock that finds 2 wakes one sleeper, which marks it 2 again
 * (it cannot know whether others sleep), so no wake-up is ever lost.
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
    fprintf(stderr, "libshardbfc: fatal: %s failed: %s\n", what, strerror(err));
    abort();
}

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
     * acquire: pairs with the release exchange in bfc__munlock. */
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
