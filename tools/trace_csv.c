/*
 * trace_csv.c -- reads allocation traces in RMM's CSV format (see trace_csv.h
 * and doc/trace.md).
 *
 * The file is read line by line; the header row maps column names to
 * positions, so files with the columns in another order (or an RMM log
 * without a Stream column) still read.  Fields are split on commas; RMM never
 * quotes, but surrounding spaces and double quotes are stripped anyway.
 *
 * Number formats follow what the writers produce, and what RMM's own parser
 * (benchmarks/utilities/log_parser.hpp) accepts:
 *   Pointer  hex with or without 0x (RMM parses it base 16); "(nil)",
 *            "nullptr", "nil" and empty mean 0 (allocate-failure rows).
 *   Size     decimal.
 *   Thread   decimal, or hex with 0x.
 *   Stream   hex with 0x (fmt::ptr, as RMM writes it), else decimal.
 *   Time     an integer: ns (libshardbfc); HH:MM:SS.fraction (RMM): ns since
 *            midnight.
 * No state is kept between calls; everything is malloc'ed and freed here
 * except the returned array.
 */
#include "trace_csv.h"

#include <ctype.h>
#include <stdbool.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "toolutil.h"

static const char *const action_names[] = {
#define ACTION_NAME(name, csv) [BFC_TRACE_##name] = csv,
    BFC_TRACE_ACTIONS(ACTION_NAME)
#undef ACTION_NAME
};
#define N_ACTIONS (sizeof(action_names) / sizeof(action_names[0]))

const char *bfc_trace_action_name(int action)
{
    if (action < 0 || (size_t)action >= N_ACTIONS)
        return "?";
    return action_names[action];
}

int bfc_trace_action_parse(const char *s)
{
    for (size_t i = 0; i < N_ACTIONS; i++)
        if (strcmp(s, action_names[i]) == 0)
            return (int)i;
    return -1;
}

enum { COL_THREAD, COL_TIME, COL_ACTION, COL_POINTER, COL_SIZE, COL_STREAM, NCOLS };
static const char *const col_names[NCOLS] = {"Thread", "Time", "Action",
                                             "Pointer", "Size", "Stream"};

/* Trims spaces, CR and double quotes in place; returns the start. */
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t' || *s == '"')
        s++;
    size_t len = strlen(s);
    while (len > 0 && (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '"' ||
                       s[len - 1] == '\r' || s[len - 1] == '\n'))
        s[--len] = '\0';
    return s;
}

/* Splits line on commas into at most max fields; returns the count. */
static size_t split(char *line, char **fields, size_t max)
{
    size_t n = 0;
    char *p = line;
    for (;;) {
        char *c = strchr(p, ',');
        if (c)
            *c = '\0';
        if (n < max)
            fields[n] = trim(p);
        n++;
        if (!c)
            break;
        p = c + 1;
    }
    return n;
}

/* Parses a whole string as an unsigned number in base; false on junk.  It
 * must start with a digit: strtoull would skip white space (a vertical tab,
 * which trim keeps) and then take a sign, reading "\v-5" as 2^64 - 5. */
static bool parse_u64(const char *s, int base, uint64_t *v)
{
    if (base == 16 ? !isxdigit((unsigned char)*s) : !isdigit((unsigned char)*s))
        return false;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(s, &end, base);
    if (errno != 0 || *end != '\0')
        return false;
    *v = x;
    return true;
}

static bool is_hex_prefixed(const char *s)
{
    return s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
}

static bool parse_ptr(const char *s, uint64_t *v)
{
    if (*s == '\0' || strcmp(s, "(nil)") == 0 || strcmp(s, "nullptr") == 0 ||
        strcmp(s, "nil") == 0 || strcmp(s, "NULL") == 0) {
        *v = 0;
        return true;
    }
    return parse_u64(s, 16, v);
}

static bool parse_num(const char *s, uint64_t *v)
{
    if (is_hex_prefixed(s))
        return parse_u64(s, 16, v);
    return parse_u64(s, 10, v);
}

/* ns integer, or H:M:S[.fraction] (ns since midnight). */
static bool parse_time(const char *s, uint64_t *v)
{
    if (*s == '\0') {
        *v = 0;
        return true;
    }
    if (!strchr(s, ':'))
        return parse_u64(s, 10, v);
    /* H:M:S as digits only (sscanf's %u would take a sign, white space and
     * numbers past UINT_MAX), each at most 10^6, so that ns cannot wrap. */
    uint64_t hms[3];
    const char *f = s;
    for (int i = 0; i < 3; i++) {
        if (i > 0 && *f++ != ':')
            return false;
        if (!isdigit((unsigned char)*f))
            return false;
        uint64_t x = 0;
        for (; isdigit((unsigned char)*f); f++) {
            x = x * 10u + (uint64_t)(*f - '0');
            if (x > 1000000u) /* 114 years of hours: junk, and ns stays below 2^64 */
                return false;
        }
        hms[i] = x;
    }
    uint64_t ns = (hms[0] * 3600u + hms[1] * 60u + hms[2]) * 1000000000u;
    if (*f == '.' || *f == ':') {
        /* RMM's documentation calls the separator ':'; its logger writes '.'. */
        f++;
        if (!isdigit((unsigned char)*f))
            return false; /* a separator with no fraction after it */
        uint64_t scale = 100000000u;
        for (; isdigit((unsigned char)*f); f++) {
            ns += (uint64_t)(*f - '0') * scale;
            scale /= 10u;
        }
    }
    if (*f != '\0')
        return false;
    *v = ns;
    return true;
}

int bfc_trace_csv_read_stream(FILE *f, const char *name, bfc_trace_event_t **out,
                              size_t *n, char *err, size_t errlen)
{
    int col[NCOLS];
    char *line = NULL;
    size_t cap = 0, count = 0, lineno = 0;
    bfc_trace_event_t *ev = NULL;
    bool header = false;
    ssize_t len;

    if (!out || !n || !f) {
        set_err(err, errlen, "bad arguments");
        return -1;
    }
    *out = NULL;
    *n = 0;
    if (!name)
        name = "trace";
    for (int i = 0; i < NCOLS; i++)
        col[i] = -1;

    size_t linecap = 0;
    char **fields = NULL; /* as many as the widest line has */
    size_t fcap = 0;
    while ((len = getline(&line, &linecap, f)) >= 0) {
        lineno++;
        char *l = line;
        /* gzip's magic: the traces of tests/traces are kept so. */
        if (lineno == 1 && len >= 2 && (unsigned char)line[0] == 0x1f && (unsigned char)line[1] == 0x8b) {
            set_err(err, errlen, "%s: gzip-compressed; gunzip it first (zcat %s > trace.csv)", name, name);
            goto fail;
        }
        /* The fields are read as C strings: a NUL would end the line there,
         * silently (a size of 40 for 40\0096). */
        if (memchr(line, '\0', (size_t)len)) {
            set_err(err, errlen, "%s:%zu: a NUL byte", name, lineno);
            goto fail;
        }
        /* A UTF-8 byte-order mark (spreadsheets write one) is not part of
         * the first column's name. */
        if (lineno == 1 && strncmp(l, "\xEF\xBB\xBF", 3) == 0)
            l += 3;
        l = trim(l);
        if (*l == '\0')
            continue;
        size_t want = 1;
        for (const char *c = l; (c = strchr(c, ',')) != NULL; c++)
            want++;
        if (want > fcap) {
            char **nfields = realloc(fields, want * sizeof(*fields));
            if (!nfields) {
                set_err(err, errlen, "%s: out of memory", name);
                goto fail;
            }
            fields = nfields;
            fcap = want;
        }
        size_t nf = split(l, fields, want);
        if (!header) {
            for (size_t i = 0; i < nf; i++)
                for (int c = 0; c < NCOLS; c++)
                    if (strcmp(fields[i], col_names[c]) == 0)
                        col[c] = (int)i;
            if (col[COL_ACTION] < 0 || col[COL_POINTER] < 0 || col[COL_SIZE] < 0) {
                set_err(err, errlen, "%s:%zu: header lacks Action, Pointer or Size column", name, lineno);
                goto fail;
            }
            header = true;
            continue;
        }
        int maxcol = 0;
        for (int c = 0; c < NCOLS; c++)
            if (col[c] > maxcol)
                maxcol = col[c];
        if (nf <= (size_t)maxcol) {
            set_err(err, errlen, "%s:%zu: %zu fields, expected %d", name, lineno, nf,
                    maxcol + 1);
            goto fail;
        }
        bfc_trace_event_t e = {0};
        const char *bad = NULL;
        e.action = bfc_trace_action_parse(fields[col[COL_ACTION]]);
        if (e.action < 0) {
            set_err(err, errlen, "%s:%zu: unknown action '%s'", name, lineno,
                    fields[col[COL_ACTION]]);
            goto fail;
        }
        if (!parse_ptr(fields[col[COL_POINTER]], &e.ptr))
            bad = "Pointer";
        else if (!parse_u64(fields[col[COL_SIZE]], 10, &e.size))
            bad = "Size";
        else if (col[COL_THREAD] >= 0 && !parse_num(fields[col[COL_THREAD]], &e.thread))
            bad = "Thread";
        else if (col[COL_TIME] >= 0 && !parse_time(fields[col[COL_TIME]], &e.time_ns))
            bad = "Time";
        else if (col[COL_STREAM] >= 0 && !parse_num(fields[col[COL_STREAM]], &e.stream))
            bad = "Stream";
        if (bad) {
            set_err(err, errlen, "%s:%zu: malformed %s", name, lineno, bad);
            goto fail;
        }
        if (count == cap) {
            size_t ncap = cap ? cap * 2 : 1024;
            bfc_trace_event_t *nev = realloc(ev, ncap * sizeof(*ev));
            if (!nev) {
                set_err(err, errlen, "%s: out of memory", name);
                goto fail;
            }
            ev = nev;
            cap = ncap;
        }
        ev[count++] = e;
    }
    if (ferror(f)) {
        set_err(err, errlen, "%s: read error", name);
        goto fail;
    }
    if (!header) {
        set_err(err, errlen, "%s: empty file (no header)", name);
        goto fail;
    }
    free(line);
    free(fields);
    *out = ev;
    *n = count;
    return 0;
fail:
    free(line);
    free(fields);
    free(ev);
    return -1;
}

int bfc_trace_csv_read(const char *path, bfc_trace_event_t **out, size_t *n, char *err,
                       size_t errlen)
{
    bool in = strcmp(path, "-") == 0; /* standard input, as the other tools read it */
    FILE *f = in ? stdin : fopen(path, "r");
    if (!f) {
        set_err(err, errlen, "%s: %s", path, strerror(errno));
        if (out)
            *out = NULL;
        if (n)
            *n = 0;
        return -1;
    }
    int rc = bfc_trace_csv_read_stream(f, in ? "stdin" : path, out, n, err, errlen);
    if (!in)
        fclose(f);
    return rc;
}

/* ------------------------------------------------------------ replay order */

/* A key and the event's position: sorted by key, then position. */
struct ord {
    uint64_t key;
    size_t idx;
};

static int ord_cmp(const void *a, const void *b)
{
    const struct ord *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* The events' positions sorted by thread or by time, then by position (so
 * ties keep file order); NULL when out of memory.  The caller frees it. */
static struct ord *sorted_by(const bfc_trace_event_t *ev, size_t n, bool by_thread)
{
    struct ord *o = malloc((n ? n : 1) * sizeof(*o));
    if (!o)
        return NULL;
    for (size_t i = 0; i < n; i++)
        o[i] = (struct ord){by_thread ? ev[i].thread : ev[i].time_ns, i};
    qsort(o, n, sizeof(*o), ord_cmp);
    return o;
}

/* Is every thread's sequence non-decreasing in time?  Sorted by thread,
 * each thread's events stand side by side in file order.  -1: out of
 * memory. */
static int per_thread_monotone(const bfc_trace_event_t *ev, size_t n)
{
    struct ord *t = sorted_by(ev, n, true);
    if (!t)
        return -1;
    int ok = 1;
    for (size_t i = 1; ok && i < n; i++)
        if (t[i].key == t[i - 1].key && ev[t[i].idx].time_ns < ev[t[i - 1].idx].time_ns)
            ok = 0;
    free(t);
    return ok;
}

int bfc_trace_order(const bfc_trace_event_t *ev, size_t n, size_t *order)
{
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    int mono = per_thread_monotone(ev, n);
    if (mono != 1)
        return mono;
    /* Ties keep file order, so events of one thread with equal times stay
     * in the order they were recorded. */
    struct ord *o = sorted_by(ev, n, false);
    if (!o)
        return -1;
    for (size_t i = 0; i < n; i++)
        order[i] = o[i].idx;
    free(o);
    return 1;
}

int bfc_trace_sort(bfc_trace_event_t *ev, size_t n)
{
    size_t *order = malloc((n ? n : 1) * sizeof(*order));
    bfc_trace_event_t *tmp = malloc((n ? n : 1) * sizeof(*tmp));
    int rc = order && tmp ? bfc_trace_order(ev, n, order) : -1;
    if (rc == 1 && n > 0) { /* n = 0: ev may be NULL, which memcpy must not see */
        for (size_t i = 0; i < n; i++)
            tmp[i] = ev[order[i]];
        memcpy(ev, tmp, n * sizeof(*ev));
    }
    free(order);
    free(tmp);
    return rc;
}

int bfc_trace_csv_read_ordered(const char *path, bfc_trace_event_t **out, size_t *n, int *sorted,
                               char *err, size_t errlen)
{
    if (bfc_trace_csv_read(path, out, n, err, errlen) != 0)
        return -1;
    int rc = bfc_trace_sort(*out, *n);
    if (rc < 0) {
        set_err(err, errlen, "%s: out of memory sorting %zu events", path, *n);
        free(*out);
        *out = NULL;
        *n = 0;
        return -1;
    }
    if (sorted)
        *sorted = rc;
    return 0;
}
