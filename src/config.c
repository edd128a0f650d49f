/*
 * config.c -- runtime configuration: defaults, the "key=value,..." spec
 * parser shared by bfc_config_parse and SHARDBFC_CONF, and validation.
 *
 * The parser is all-or-nothing: it works on a private copy of the caller's
 * struct and copies it back only after every item has parsed, so a spec
 * with one bad item leaves *cfg byte-for-byte as it was (padding included,
 * which is why the copies are memcpy rather than struct assignment).  It
 * never allocates and never writes outside that copy: items are read in
 * place as (pointer, length) spans of the caller's string, and numbers are
 * converted by hand.  Hand conversion is deliberate, not thrift: strtoul
 * silently accepts "-1" (wrapping it to ULONG_MAX), leading '+' and
 * whitespace, and strtod honours LC_NUMERIC, so a server that set a German
 * locale would read "0.5" as 0.  Every key has a closed grammar, so any
 * byte that does not fit it (non-ASCII, control characters, a stray '=')
 * is a plain BFC_EINVAL.
 *
 * Grammar: items separated by ',', each "key=value" with ASCII whitespace
 * allowed around key and value; empty items are skipped; a later duplicate
 * key overrides an earlier one.  An item longer than MAX_ITEM bytes is
 * rejected, which bounds the work per item and lets the limit be stated.
 *
 * Paths (oom_dump, trace) are the one open grammar: any bytes but control
 * characters (and ',', the item separator), shorter than their char array.
 *
 * Range checks that concern a single field (initial_region != 0, a memory
 * limit of 0 or >= 256 bytes, fraction in [0, 1], retry_ms <= 1 hour) are
 * made by the parser too, so a spec applied to a valid config yields a valid
 * config; bfc_config_validate repeats them for structs filled in by hand.
 *
 * Errors say which item failed and why (bfc_config_parse_err): the first
 * bad item is quoted back as key=value (at most 64 bytes of each, anything
 * unprintable shown as '?', so the message itself is safe to log) with one
 * reason.  A misspelt key must never go unnoticed: a server that started
 * on the defaults instead of "memory_limt=1G" would take the whole device.
 * That is why the process-wide service refuses to start on an invalid
 * SHARDBFC_CONF (api.c, host.c) and why the message is printed here, once
 * per process, when the variable is first read.
 *
 * Locking: bfc_config_* touch only the caller's struct.  The SHARDBFC_CONF
 * cache is written once inside pthread_once and only read afterwards;
 * pthread_once orders the write before every reader's return.
 */
#include "internal.h"
#include "mutex.h" /* bfc__nocancel_begin/end */

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ITEM 4096
/* The smallest non-zero memory_limit: one 256-byte granule. */
#define MIN_LIMIT BFC__MIN_ALLOC
#define MAX_RETRY_MS 3600000u
/* slack_decay_ms in a spec: 1 ms to 2^32 - 1 (49.7 days), or never. */
#define MAX_DECAY_MS 4294967295u

enum kind {
    K_BACKEND,
    K_DEVICE,
    K_SIZE,
    K_BOOL,
    K_FRACTION,
    K_UINT,
    K_HOST_NUMA,
    K_PATH,
    K_VMM,
    K_DECAY,
};

static const struct key {
    const char *name;
    enum kind kind;
    size_t off;
    /* K_SIZE: smallest accepted non-zero value, and whether 0 is allowed.
     * K_UINT: hi is the largest accepted value.  K_PATH: hi is the size of
     * the char array (the path must leave room for its NUL). */
    size_t lo;
    bool zero_ok;
    uint64_t hi;
} keys[] = {
    {"backend", K_BACKEND, offsetof(bfc_config_t, backend), 0, false, 0},
    {"device", K_DEVICE, offsetof(bfc_config_t, device), 0, false, 0},
    {"memory_limit", K_SIZE, offsetof(bfc_config_t, memory_limit), MIN_LIMIT, true, 0},
    {"allow_growth", K_BOOL, offsetof(bfc_config_t, allow_growth), 0, false, 0},
    {"initial_region", K_SIZE, offsetof(bfc_config_t, initial_region), 1, false, 0},
    {"fragmentation_fraction", K_FRACTION, offsetof(bfc_config_t, fragmentation_fraction), 0,
     false, 0},
    {"garbage_collection", K_BOOL, offsetof(bfc_config_t, garbage_collection), 0, false, 0},
    {"large_alloc", K_SIZE, offsetof(bfc_config_t, large_alloc), 0, true, 0},
    {"retry_ms", K_UINT, offsetof(bfc_config_t, retry_ms), 0, false, MAX_RETRY_MS},
    {"debug_check", K_BOOL, offsetof(bfc_config_t, debug_check), 0, false, 0},
    {"poison", K_BOOL, offsetof(bfc_config_t, poison), 0, false, 0},
    {"host_numa", K_HOST_NUMA, offsetof(bfc_config_t, host_numa), 0, false, 0},
    {"oom_dump", K_PATH, offsetof(bfc_config_t, oom_dump), 0, false,
     sizeof(((bfc_config_t *)0)->oom_dump)},
    {"trace", K_PATH, offsetof(bfc_config_t, trace), 0, false, sizeof(((bfc_config_t *)0)->trace)},
    {"vmm", K_VMM, offsetof(bfc_config_t, vmm), 0, false, 0},
    {"release_threshold", K_SIZE, offsetof(bfc_config_t, release_threshold), 0, true, 0},
    {"slack_decay_ms", K_DECAY, offsetof(bfc_config_t, slack_decay_ms), 0, false, MAX_DECAY_MS},
};

/* A piece of the spec string, not NUL-terminated. */
struct span {
    const char *p;
    size_t n;
};

/* The C locale's isspace, independent of the process locale. */
static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static char lower(char c)
{
    return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
}

static struct span trim(struct span s)
{
    while (s.n > 0 && is_ws(s.p[0])) {
        s.p++;
        s.n--;
    }
    while (s.n > 0 && is_ws(s.p[s.n - 1]))
        s.n--;
    return s;
}

static bool eq(struct span s, const char *word)
{
    size_t n = strlen(word);
    return s.n == n && memcmp(s.p, word, n) == 0;
}

/* Case-insensitive ASCII comparison; `word` is lower case. */
static bool eq_nocase(struct span s, const char *word)
{
    size_t n = strlen(word);
    if (s.n != n)
        return false;
    for (size_t i = 0; i < n; i++)
        if (lower(s.p[i]) != word[i])
            return false;
    return true;
}

/*
 * Reads the leading decimal digits of s into *out.  Returns the number of
 * digits read, or 0 when there is none or the value exceeds `max`.
 */
static size_t read_digits(struct span s, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    size_t i = 0;
    while (i < s.n && is_digit(s.p[i])) {
        unsigned d = (unsigned)(s.p[i] - '0');
        if (v > (max - d) / 10)
            return 0;
        v = v * 10 + d;
        i++;
    }
    *out = v;
    return i;
}

/* The whole span is decimal digits with a value <= max. */
static bool parse_uint(struct span s, uint64_t max, uint64_t *out)
{
    size_t used = read_digits(s, max, out);
    return used > 0 && used == s.n;
}

/* Digits with an optional binary suffix: K, KB, KiB (any case), M..., G... */
static bool parse_size(struct span s, size_t *out)
{
    uint64_t v;
    size_t used = read_digits(s, SIZE_MAX, &v);
    if (used == 0)
        return false;
    struct span suf = {s.p + used, s.n - used};
    unsigned shift;
    if (suf.n == 0)
        shift = 0;
    else if (eq_nocase(suf, "k") || eq_nocase(suf, "kb") || eq_nocase(suf, "kib"))
        shift = 10;
    else if (eq_nocase(suf, "m") || eq_nocase(suf, "mb") || eq_nocase(suf, "mib"))
        shift = 20;
    else if (eq_nocase(suf, "g") || eq_nocase(suf, "gb") || eq_nocase(suf, "gib"))
        shift = 30;
    else
        return false;
    if (v > (uint64_t)(SIZE_MAX >> shift))
        return false;
    *out = (size_t)v << shift;
    return true;
}

static bool parse_bool(struct span s, bool *out)
{
    if (eq_nocase(s, "true") || eq(s, "1") || eq_nocase(s, "yes") || eq_nocase(s, "on")) {
        *out = true;
        return true;
    }
    if (eq_nocase(s, "false") || eq(s, "0") || eq_nocase(s, "no") || eq_nocase(s, "off")) {
        *out = false;
        return true;
    }
    return false;
}

/*
 * A decimal number in [0, 1]: [+]digits[.digits][e[+-]digits] or
 * [+].digits[...].  No nan, inf, hex or locale-specific decimal point, and
 * no non-zero value so small that it reads as 0 (below about 2.5e-324, half
 * the least double).
 * The first 19 significant digits are kept; the result is the mantissa
 * divided by an exact power of ten, which is correctly rounded whenever the
 * mantissa is below 2^53 and at most 22 fraction digits are given (every
 * realistic spelling), and within an ulp or two otherwise.
 */
static bool parse_fraction(struct span s, double *out)
{
    static const double pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                   1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                   1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    const uint64_t room = (UINT64_MAX - 9) / 10;
    uint64_t mant = 0;
    long exp10 = 0; /* value = mant * 10^exp10 */
    bool any = false;
    size_t i = 0;

    if (i < s.n && s.p[i] == '+')
        i++;
    for (; i < s.n && is_digit(s.p[i]); i++) {
        any = true;
        if (mant <= room)
            mant = mant * 10 + (uint64_t)(s.p[i] - '0');
        else
            exp10++; /* dropped integer digit still scales the value */
    }
    if (i < s.n && s.p[i] == '.') {
        for (i++; i < s.n && is_digit(s.p[i]); i++) {
            any = true;
            if (mant <= room) {
                mant = mant * 10 + (uint64_t)(s.p[i] - '0');
                exp10--;
            }
        }
    }
    if (!any)
        return false;
    if (i < s.n && (s.p[i] == 'e' || s.p[i] == 'E')) {
        long sign = 1, e = 0;
        bool edig = false;
        i++;
        if (i < s.n && (s.p[i] == '+' || s.p[i] == '-'))
            sign = s.p[i++] == '-' ? -1 : 1;
        for (; i < s.n && is_digit(s.p[i]); i++) {
            edig = true;
            if (e < 100000) /* far beyond any double's range; avoids overflow */
                e = e * 10 + (s.p[i] - '0');
        }
        if (!edig)
            return false;
        exp10 += sign * e;
    }
    if (i != s.n)
        return false;

    if (mant == 0) {
        *out = 0.0;
        return true;
    }
    if (exp10 > 0)
        return false; /* a non-zero mantissa times 10 or more is > 1 */
    double v = (double)mant;
    long k = -exp10;
    while (k > 22 && v != 0.0) {
        v /= pow10[22];
        k -= 22;
    }
    if (k > 22)
        k = 0; /* v is already 0 */
    v /= pow10[k];
    /* A non-zero spelling that underflows to 0 would silently select the
     * 0 setting's meaning (for fragmentation_fraction, the 128 MiB rule):
     * refused instead. */
    if (v > 1.0 || v == 0.0)
        return false;
    *out = v;
    return true;
}

/*
 * Applies one value to the field `k` names in *cfg.  Returns NULL, or why
 * the value is refused (a phrase that completes "invalid value: ...").
 */
static const char *apply(bfc_config_t *cfg, const struct key *k, struct span v)
{
    char *field = (char *)cfg + k->off;
    uint64_t u;

    switch (k->kind) {
    case K_BACKEND: {
        bfc_backend_t b;
        if (eq_nocase(v, "auto"))
            b = BFC_BACKEND_AUTO;
        else if (eq_nocase(v, "cuda"))
            b = BFC_BACKEND_CUDA;
        else if (eq_nocase(v, "sim"))
            b = BFC_BACKEND_SIM;
        else
            return "expected auto, cuda or sim";
        *(bfc_backend_t *)(void *)field = b;
        return NULL;
    }
    case K_DEVICE:
        if (!parse_uint(v, INT_MAX, &u))
            return "expected a device ordinal from 0 to 2147483647";
        *(int *)(void *)field = (int)u;
        return NULL;
    case K_SIZE: {
        size_t sz;
        if (!parse_size(v, &sz))
            return "expected a size: decimal digits with an optional K, M or G suffix (KiB, MiB, GiB), "
                   "at most 2^64 - 1 bytes";
        if (sz == 0 && !k->zero_ok)
            return "must be at least 1 byte";
        if (sz != 0 && sz < k->lo)
            return "below the smallest memory_limit, 256 bytes (0 means the backend's default)";
        *(size_t *)(void *)field = sz;
        return NULL;
    }
    case K_BOOL: {
        bool b;
        if (!parse_bool(v, &b))
            return "expected true/false, 1/0, yes/no or on/off";
        *(bool *)(void *)field = b;
        return NULL;
    }
    case K_FRACTION: {
        double d;
        if (!parse_fraction(v, &d))
            return "expected a decimal number from 0 to 1 (a non-zero one that does not read as 0: about 2.5e-324 or more)";
        *(double *)(void *)field = d;
        return NULL;
    }
    case K_UINT:
        if (!parse_uint(v, k->hi, &u))
            return k->hi == MAX_RETRY_MS ? "expected milliseconds from 0 to 3600000 (one hour)"
                                         : "expected a count from 0 to 4294967295";
        *(unsigned *)(void *)field = (unsigned)u;
        return NULL;
    case K_HOST_NUMA: {
        int node;
        if (eq_nocase(v, "thread"))
            node = BFC_HOST_NUMA_THREAD;
        else if (eq_nocase(v, "gpu"))
            node = BFC_HOST_NUMA_GPU;
        else if (parse_uint(v, INT_MAX, &u))
            node = (int)u;
        else
            return "expected thread, gpu or a NUMA node number";
        *(int *)(void *)field = node;
        return NULL;
    }
    case K_VMM: {
        int32_t m;
        bool b;
        if (eq_nocase(v, "auto"))
            m = BFC_VMM_AUTO;
        else if (parse_bool(v, &b))
            m = b ? BFC_VMM_ON : BFC_VMM_OFF;
        else
            return "expected auto, on or off";
        *(int32_t *)(void *)field = m;
        return NULL;
    }
    case K_DECAY:
        /* 0 is the struct's "default" (zero-is-default rule), which a spec
         * would only make ambiguous: "immediately" or "never"? */
        if (eq_nocase(v, "never"))
            u = BFC_DECAY_NEVER;
        else if (!parse_uint(v, k->hi, &u) || u == 0)
            return "expected milliseconds from 1 to 4294967295, or never";
        *(uint64_t *)(void *)field = u;
        return NULL;
    case K_PATH:
        /* Taken verbatim (UTF-8 allowed), but no control character can be
         * part of a path a user meant; ',' never reaches here. */
        if (v.n >= k->hi)
            return "path longer than 255 bytes";
        for (size_t i = 0; i < v.n; i++)
            if ((unsigned char)v.p[i] < 0x20 || v.p[i] == 0x7f)
                return "control character in a path";
        memset(field, 0, k->hi);
        memcpy(field, v.p, v.n);
        return NULL;
    }
    return "unsupported key";
}

/* Where a message goes: NULL/0 when the caller wants none. */
struct errbuf {
    char *p;
    size_t n;
};

/* Appends at most `max` bytes of s to *o (bounded by end), unprintable
 * bytes as '?', "..." when cut. */
static char *put_quoted(char *o, char *end, struct span s, size_t max)
{
    size_t n = s.n < max ? s.n : max;
    for (size_t i = 0; i < n && o < end; i++) {
        unsigned char c = (unsigned char)s.p[i];
        *o++ = (c < 0x20 || c >= 0x7f) ? '?' : (char)c;
    }
    for (const char *dots = "..."; n < s.n && *dots && o < end; dots++)
        *o++ = *dots;
    return o;
}

/*
 * Writes "KEY=VALUE: reason" (either part may be empty) into e.  KEY and
 * VALUE are quoted back from the spec, 64 bytes at most each.
 */
static void set_err(struct errbuf *e, struct span key, struct span val, bool has_eq, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void set_err(struct errbuf *e, struct span key, struct span val, bool has_eq, const char *fmt, ...)
{
    if (!e->p || e->n == 0)
        return;
    char line[512];
    char *o = line, *end = line + 200;
    o = put_quoted(o, end, key, 64);
    if (has_eq && o < end)
        *o++ = '=';
    o = put_quoted(o, end, val, 64);
    *o = '\0';
    char reason[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    snprintf(e->p, e->n, "%s%s%s", line, line[0] ? ": " : "", reason);
}

/* One comma-free item, the `index`th (from 1).  BFC_OK (also for an empty
 * item) or BFC_EINVAL with the reason in e. */
static int parse_item(bfc_config_t *cfg, struct span item, size_t index, struct errbuf *e)
{
    static const struct span none = {"", 0};
    if (item.n > MAX_ITEM) {
        set_err(e, none, none, false, "item %zu is longer than %d bytes", index, MAX_ITEM);
        return BFC_EINVAL;
    }
    item = trim(item);
    if (item.n == 0)
        return BFC_OK;
    const char *eqsign = memchr(item.p, '=', item.n);
    if (eqsign == NULL) {
        set_err(e, item, none, false,
                "expected key=value (',' separates items, so no value contains one)");
        return BFC_EINVAL;
    }
    struct span key = trim((struct span){item.p, (size_t)(eqsign - item.p)});
    struct span val = trim((struct span){eqsign + 1, item.n - (size_t)(eqsign - item.p) - 1});
    if (key.n == 0) {
        set_err(e, key, val, true, "empty key");
        return BFC_EINVAL;
    }
    if (val.n == 0) {
        set_err(e, key, val, true, "empty value");
        return BFC_EINVAL;
    }
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (eq(key, keys[i].name)) {
            const char *why = apply(cfg, &keys[i], val);
            if (!why)
                return BFC_OK;
            set_err(e, key, val, true, "invalid value for %s: %s", keys[i].name, why);
            return BFC_EINVAL;
        }
    char known[400], *o = known;
    known[0] = '\0';
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        size_t room = sizeof known - (size_t)(o - known);
        int n = snprintf(o, room, "%s%s", i ? ", " : "", keys[i].name);
        if (n < 0 || (size_t)n >= room) {
            *o = '\0'; /* the list cut short, at a whole key, rather than written past its end */
            break;
        }
        o += n;
    }
    char kq[80];
    *put_quoted(kq, kq + sizeof kq - 1, key, 64) = '\0';
    set_err(e, key, val, true, "unknown key '%s' (keys: %s)", kq, known);
    return BFC_EINVAL;
}

void bfc_config_init(bfc_config_t *cfg)
{
    if (cfg == NULL)
        return;
    /* Zero first so padding bytes are deterministic: callers memcmp configs. */
    memset(cfg, 0, sizeof *cfg);
    cfg->backend = BFC_BACKEND_AUTO;
    cfg->device = 0;
    cfg->memory_limit = 0;
    cfg->allow_growth = true;
    cfg->initial_region = 2 * BFC__MiB;
    cfg->fragmentation_fraction = 0.0;
    cfg->garbage_collection = true;
    cfg->large_alloc = 32 * BFC__MiB;
    cfg->retry_ms = 0;
    cfg->debug_check = false;
    cfg->poison = false;
    cfg->host_numa = BFC_HOST_NUMA_THREAD;
    cfg->vmm = BFC_VMM_AUTO;
    cfg->release_threshold = 0;
    cfg->slack_decay_ms = 0;
}

static int parse(bfc_config_t *cfg, const char *spec, struct errbuf *e)
{
    if (e->p && e->n)
        e->p[0] = '\0';
    if (cfg == NULL) {
        static const struct span none = {"", 0};
        set_err(e, none, none, false, "no configuration to apply the spec to (cfg is NULL)");
        return BFC_EINVAL;
    }
    if (spec == NULL)
        return BFC_OK;

    bfc_config_t tmp;
    memcpy(&tmp, cfg, sizeof tmp);
    const char *p = spec;
    for (size_t index = 1;; index++) {
        size_t n = strcspn(p, ",");
        if (parse_item(&tmp, (struct span){p, n}, index, e) != BFC_OK)
            return BFC_EINVAL;
        if (p[n] == '\0')
            break;
        p += n + 1;
    }
    memcpy(cfg, &tmp, sizeof tmp);
    return BFC_OK;
}

int bfc_config_parse(bfc_config_t *cfg, const char *spec)
{
    struct errbuf e = {NULL, 0};
    return parse(cfg, spec, &e);
}

int bfc_config_parse_err(bfc_config_t *cfg, const char *spec, char *err, size_t errlen)
{
    struct errbuf e = {err, err ? errlen : 0};
    return parse(cfg, spec, &e);
}

/* Settings each valid alone that bfc_config_validate refuses together,
 * said in words; NULL when there are none. */
static const char *config_conflict(const bfc_config_t *cfg)
{
    if (cfg->vmm == BFC_VMM_ON && !cfg->allow_growth)
        return "vmm=on needs allow_growth=true (expandable arenas grow; allow_growth=false reserves the "
               "whole limit up front)";
    return NULL;
}

/* A path field filled in by hand: a C string within its array, without
 * control characters. */
static bool path_ok(const char *p, size_t cap)
{
    const char *end = memchr(p, '\0', cap);
    if (!end)
        return false;
    for (; p < end; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return false;
    return true;
}

/* Why *cfg is refused, in words (the field and its rule), or NULL. */
static const char *config_refusal(const bfc_config_t *cfg)
{
    if (cfg == NULL)
        return "no configuration (NULL)";
    /* Compare as int: the struct may have been filled from outside the enum. */
    int backend = (int)cfg->backend;
    if (backend != BFC_BACKEND_AUTO && backend != BFC_BACKEND_CUDA && backend != BFC_BACKEND_SIM)
        return "backend is not one of BFC_BACKEND_AUTO, BFC_BACKEND_CUDA, BFC_BACKEND_SIM";
    if (cfg->device < 0)
        return "device is negative";
    if (cfg->initial_region == 0)
        return "initial_region is 0 (at least 1 byte)";
    /* Written so that NaN fails both comparisons and is rejected. */
    if (!(cfg->fragmentation_fraction >= 0.0 && cfg->fragmentation_fraction <= 1.0))
        return "fragmentation_fraction is not a number from 0 to 1";
    if (cfg->memory_limit != 0 && cfg->memory_limit < MIN_LIMIT)
        return "memory_limit is below 256 bytes (0 is the backend's default)";
    if (cfg->retry_ms > MAX_RETRY_MS)
        return "retry_ms is above 3600000 (one hour)";
    if (cfg->host_numa < BFC_HOST_NUMA_GPU)
        return "host_numa is not BFC_HOST_NUMA_THREAD, BFC_HOST_NUMA_GPU or a node number";
    /* Filled in by hand, a path must still be a C string, and hold no
     * control character (the parser's rule). */
    if (!path_ok(cfg->oom_dump, sizeof cfg->oom_dump))
        return "oom_dump is not a NUL-terminated path without control characters";
    if (!path_ok(cfg->trace, sizeof cfg->trace))
        return "trace is not a NUL-terminated path without control characters";
    /* 0 (the default), 1 ms .. MAX_DECAY_MS, or never: the parser's range. */
    if (cfg->slack_decay_ms > MAX_DECAY_MS && cfg->slack_decay_ms != BFC_DECAY_NEVER)
        return "slack_decay_ms is out of range (0, 1 to 4294967295 ms, or BFC_DECAY_NEVER)";
    if (cfg->vmm != BFC_VMM_AUTO && cfg->vmm != BFC_VMM_ON && cfg->vmm != BFC_VMM_OFF)
        return "vmm is not one of BFC_VMM_AUTO, BFC_VMM_ON, BFC_VMM_OFF";
    const char *conflict = config_conflict(cfg);
    if (conflict)
        return conflict;
    /* Room for later versions' settings: a non-zero word here means a
     * setting this library does not know (or an uninitialised struct). */
    bool reserved = cfg->reserved_flags != 0;
    for (size_t i = 0; i < sizeof cfg->reserved / sizeof cfg->reserved[0]; i++)
        reserved |= cfg->reserved[i] != 0;
    if (reserved)
        return "reserved fields are not zero (a setting this version does not know, or a struct "
               "that bfc_config_init did not fill)";
    return NULL;
}

int bfc_config_validate(const bfc_config_t *cfg)
{
    return config_refusal(cfg) ? BFC_EINVAL : BFC_OK;
}

int bfc_config_validate_err(const bfc_config_t *cfg, char *err, size_t errlen)
{
    const char *why = config_refusal(cfg);
    if (err && errlen > 0)
        snprintf(err, errlen, "%s", why ? why : "");
    return why ? BFC_EINVAL : BFC_OK;
}

/* ------------------------------------------------------- SHARDBFC_CONF */

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static bfc_config_t env_cfg;
static int env_status;

/*
 * Runs once per process.  getenv is read here and never again, so a later
 * setenv (which may race with getenv) cannot affect a running service.
 * A bad spec leaves the defaults in env_cfg, since the parse is
 * all-or-nothing, but the status says BFC_EINVAL and the callers refuse to
 * run on it: the one message below is all the user sees, so it names the
 * item and the reason.
 */
static void env_load(void)
{
    char err[512];
    bfc_config_init(&env_cfg);
    env_status = bfc_config_parse_err(&env_cfg, getenv("SHARDBFC_CONF"), err, sizeof err);
    const char *conflict = env_status == BFC_OK ? config_conflict(&env_cfg) : NULL;
    if (conflict) {
        snprintf(err, sizeof err, "%s", conflict);
        bfc_config_init(&env_cfg); /* the defaults, as for a bad spec */
        env_status = BFC_EINVAL;
    }
    if (env_status != BFC_OK)
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF is invalid: %s; the allocator will not start "
                "(every call fails with BFC_EINVAL)\n",
                err);
}

static atomic_bool env_refused;

void bfc__config_refuse(const char *why)
{
    if (!atomic_exchange_explicit(&env_refused, true, memory_order_relaxed))
        fprintf(stderr,
                "libshardbfc: SHARDBFC_CONF cannot be used: %s; the allocator will not start "
                "(every call fails with BFC_EINVAL)\n",
                why);
}

bool bfc__config_refused(void)
{
    /* relaxed: a flag that only ever goes up; a caller that misses it
     * by a moment runs as if it had come just before. */
    return atomic_load_explicit(&env_refused, memory_order_relaxed);
}

int bfc__config_from_env(bfc_config_t *out)
{
    if (out == NULL)
        return BFC_EINVAL;
    int rc = bfc__once(&env_once, env_load); /* may report on stderr */
    if (rc != 0) {
        /* pthread_once cannot fail on glibc; if it ever does, refuse
         * rather than read a half-initialised cache. */
        bfc_config_init(out);
        return BFC_ESTATE;
    }
    memcpy(out, &env_cfg, sizeof *out);
    return bfc__config_refused() ? BFC_EINVAL : env_status;
}
