/*
 * toolutil.h -- what the sources in tools/ share: the message of a call
 * that reports failure through an (err, errlen) buffer, and reading a
 * whole stream into memory.
 *
 * Not part of the library.  Header-only, so that every program compiling a
 * tools/ source (the command-line tools, the perf harness, the tests) has
 * them without another file in its source list.  Plain C11, no state.
 */
#ifndef SHARDBFC_TOOLUTIL_H
#define SHARDBFC_TOOLUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

/* printf into err[0..errlen), truncated; nothing when err is NULL or
 * errlen 0 (the caller did not ask for a message). */
static inline void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Everything f has left, malloc'ed and NUL-terminated (the NUL not counted
 * in *len), or NULL on a read error or out of memory. */
static inline char *tool_read_all(FILE *f, size_t *len)
{
    size_t cap = (size_t)1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0)
            break;
    }
    if (ferror(f)) {
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

#endif /* SHARDBFC_TOOLUTIL_H */
