/*
 * clockfail.h -- a clock_gettime that can be made to fail, for the tests
 * of waits that must keep their bound without a clock (a seccomp policy
 * that refuses the call).  Included by one file of a test program, it
 * replaces the C library's for the whole program, the library's calls
 * included (symbol interposition); until clock_broken is set it asks the
 * kernel as the C library would.
 */
#ifndef BFC_TEST_CLOCKFAIL_H
#define BFC_TEST_CLOCKFAIL_H

#include <errno.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static atomic_bool clock_broken;

int clock_gettime(clockid_t clock, struct timespec *ts)
{
    if (atomic_load(&clock_broken)) {
        errno = EPERM;
        return -1;
    }
    return (int)syscall(SYS_clock_gettime, clock, ts);
}

#endif
