/*
 * errors.c -- status codes: their descriptions, their names, and the
 * per-thread "last error" of pointer-returning calls.
 *
 * Every string here is generated from the single BFC_ERRNO_MAP table in
 * shardbfc.h (libuv's UV_ERRNO_MAP idiom), so adding a code there adds its
 * description and name here with no second list to keep in step.  Both
 * lookups are switch statements over compile-time constants: no table to
 * initialise, no lock, and a value outside the table falls to the default
 * arm instead of indexing out of bounds.
 *
 * The last error is a _Thread_local int: each thread sees only its own
 * calls' outcomes, so no synchronisation is needed and a failing call on one
 * thread cannot be observed as another thread's failure.  A thread that has
 * made no failing call reads BFC_OK (static TLS initialisation).  It is
 * written by every allocation, so it is initial-exec (internal.h) and set
 * inline (bfc__set_last_error).
 */
#include "internal.h"

_Thread_local int bfc__last_error BFC__TLS_IE = BFC_OK;

const char *bfc_strerror(int status)
{
    switch (status) {
#define BFC__ERRNO_DESC(name, val, desc) \
    case BFC_##name:                    \
        return desc;
        BFC_ERRNO_MAP(BFC__ERRNO_DESC)
#undef BFC__ERRNO_DESC
    default:
        return "unknown status";
    }
}

const char *bfc_err_name(int status)
{
    switch (status) {
#define BFC__ERRNO_NAME(name, val, desc) \
    case BFC_##name:                    \
        return "BFC_" #name;
        BFC_ERRNO_MAP(BFC__ERRNO_NAME)
#undef BFC__ERRNO_NAME
    default:
        return "BFC_UNKNOWN";
    }
}

int bfc_last_error(void)
{
    return bfc__last_error;
}

/* The header's version as a string, and a check that configure's package
 * version (the tarball's name, shardbfc.pc) says the same. */
#define BFC__STR2(x) #x
#define BFC__STR(x) BFC__STR2(x)
#define BFC__VERSION_STRING                                                                                    \
    BFC__STR(BFC_VERSION_MAJOR) "." BFC__STR(BFC_VERSION_MINOR) "." BFC__STR(BFC_VERSION_PATCH)

const char *bfc_version(void)
{
    return BFC__VERSION_STRING;
}
