/*
 * json_read.c -- json-c, strict, and typed lookups into its tree (see
 * json_read.h).
 *
 * json-c's tokener reads the text in one call plus, when the text ends
 * inside a value that has no end mark of its own (a top-level number), one
 * more call with the terminating NUL, as json-c asks.  Its strict mode
 * refuses trailing commas, comments, bad escapes, anything after the value
 * and most leading zeros (not 00 or -01: lexical_fault refuses those); it
 * still accepts NaN, Infinity, "1." and numbers too large for a double,
 * and decodes \u0000 into a string.  So
 * the parsed tree is walked once more: every double must have kept a text
 * of RFC 8259's number grammar (json-c keeps the text a double was parsed
 * from) and a finite value, and every string its full length as a C
 * string.
 */
#include "json_read.h"

#include <shardbfc.h>

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <regex.h>
#include <string.h>

#include "toolutil.h"

#define MAX_DEPTH 64

/* RFC 8259, section 6. */
static const char number_grammar[] = "^-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?$";

/* True (with a message) when v or anything in it is what strict JSON has
 * not: a number outside the grammar or beyond a double, a NUL in a string. */
static bool not_strict(json_object *v, const regex_t *number, char *err, size_t errlen)
{
    switch (json_object_get_type(v)) {
    case json_type_double: {
        const char *text = json_object_to_json_string_ext(v, JSON_C_TO_STRING_PLAIN);
        if (regexec(number, text, 0, NULL, 0) != 0 || !isfinite(json_object_get_double(v))) {
            set_err(err, errlen, "not a JSON number: %s", text);
            return true;
        }
        return false;
    }
    case json_type_string:
        if ((size_t)json_object_get_string_len(v) != strlen(json_object_get_string(v))) {
            set_err(err, errlen, "NUL in a string");
            return true;
        }
        return false;
    case json_type_array:
        for (size_t i = 0; i < json_object_array_length(v); i++)
            if (not_strict(json_object_array_get_idx(v, i), number, err, errlen))
                return true;
        return false;
    case json_type_object: {
        json_object_object_foreach(v, key, member) {
            (void)key;
            if (not_strict(member, number, err, errlen))
                return true;
        }
        return false;
    }
    default:
        return false;
    }
}

/* Does the integer token t[0..n) (an optional '-', then digits) lie
 * outside what json-c keeps exact (int64_t below zero, uint64_t above)?
 * json-c clamps such a number to the nearest bound, silently. */
static bool integer_clamped(const char *t, size_t n)
{
    bool neg = *t == '-';
    const char *d = t + neg;
    size_t nd = n - neg;
    const char *bound = neg ? "9223372036854775808" : "18446744073709551615";
    size_t nb = strlen(bound);
    while (nd > 1 && *d == '0') { /* leading zeros: refused, by the tokener or lexical_fault */
        d++;
        nd--;
    }
    return nd > nb || (nd == nb && memcmp(d, bound, nb) > 0);
}

/* What json-c's strict mode still lets through at the level of characters:
 * a single-quoted string, a raw control character inside a string
 * (RFC 8259 wants them escaped; a browser's JSON.parse refuses both), an
 * integer json-c would clamp, and a number with a leading zero.  The
 * offset of the first, or len. */
static size_t lexical_fault(const char *text, size_t len, const char **what)
{
    bool in = false;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (!in && (c == '-' || isdigit(c))) {
            /* A number token, read whole (digits of its exponent are not
             * seen again): an integer, unless it has a fraction or an
             * exponent (a double, checked after parsing). */
            size_t j = i + 1;
            bool integer = true;
            while (j < len && (isdigit((unsigned char)text[j]) || strchr(".eE+-", text[j]))) {
                if (!isdigit((unsigned char)text[j]))
                    integer = false;
                j++;
            }
            if (integer && j - i > (c == '-') && integer_clamped(text + i, j - i)) {
                *what = "an integer beyond 64 bits (json-c would change it)";
                return i;
            }
            /* json-c refuses 01 but lets 00, -01 and -007 through. */
            const char *d = text + i + (c == '-');
            if (d + 1 < text + j && d[0] == '0' && isdigit((unsigned char)d[1])) {
                *what = "a number with a leading zero";
                return i;
            }
            i = j - 1;
            continue;
        }
        if (in) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in = false;
            else if (c < 0x20) {
                *what = "a control character in a string";
                return i;
            }
        } else if (c == '"') {
            in = true;
        } else if (c == '\'') {
            *what = "a single quote";
            return i;
        }
    }
    return len;
}

int bfc_json_parse(const char *text, size_t len, json_object **out, char *err, size_t errlen)
{
    *out = NULL;
    if (len >= INT_MAX) {
        set_err(err, errlen, "%zu bytes: too large", len);
        return -1;
    }
    const char *what = NULL;
    size_t at = lexical_fault(text, len, &what);
    if (at < len) {
        set_err(err, errlen, "offset %zu: %s", at, what);
        return -1;
    }
    json_tokener *tok = json_tokener_new_ex(MAX_DEPTH);
    if (!tok) {
        set_err(err, errlen, "out of memory");
        return -1;
    }
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
    json_object *v = json_tokener_parse_ex(tok, text, (int)len);
    size_t end = json_tokener_get_parse_end(tok);
    enum json_tokener_error e = json_tokener_get_error(tok);
    if (e == json_tokener_continue) {
        v = json_tokener_parse_ex(tok, "", 1);
        e = json_tokener_get_error(tok);
        end = len; /* everything was read; the NUL ended it */
    }
    int rc = -1;
    if (e != json_tokener_success) {
        set_err(err, errlen, "offset %zu: %s", end, json_tokener_error_desc(e));
    } else if (end != len) {
        set_err(err, errlen, "offset %zu: trailing characters", end);
    } else {
        regex_t number;
        if (regcomp(&number, number_grammar, REG_EXTENDED | REG_NOSUB) != 0) {
            set_err(err, errlen, "out of memory");
        } else {
            if (!not_strict(v, &number, err, errlen))
                rc = 0;
            regfree(&number);
        }
    }
    json_tokener_free(tok);
    if (rc == 0)
        *out = v;
    else
        json_object_put(v);
    return rc;
}

json_object *bfc_json_get(const json_object *obj, const char *key)
{
    json_object *v = NULL;
    if (!json_object_is_type(obj, json_type_object) || !json_object_object_get_ex(obj, key, &v))
        return NULL;
    return v;
}

bool bfc_json_is_null(const json_object *obj, const char *key)
{
    json_object *v = NULL;
    return json_object_is_type(obj, json_type_object) && json_object_object_get_ex(obj, key, &v) && v == NULL;
}

size_t bfc_json_len(const json_object *arr)
{
    return json_object_is_type(arr, json_type_array) ? json_object_array_length(arr) : 0;
}

json_object *bfc_json_at(const json_object *arr, size_t i)
{
    return i < bfc_json_len(arr) ? json_object_array_get_idx(arr, i) : NULL;
}

uint64_t bfc_json_u64(const json_object *obj, const char *key, uint64_t dflt)
{
    /* An integer above INT64_MAX reads as INT64_MAX through get_int64,
     * so a negative one is the only one that gives a negative value. */
    const json_object *v = bfc_json_get(obj, key);
    if (!json_object_is_type(v, json_type_int) || json_object_get_int64(v) < 0)
        return dflt;
    return json_object_get_uint64(v);
}

double bfc_json_num(const json_object *obj, const char *key, double dflt)
{
    const json_object *v = bfc_json_get(obj, key);
    if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double))
        return dflt;
    return json_object_get_double(v);
}

const char *bfc_json_str(const json_object *obj, const char *key, const char *dflt)
{
    json_object *v = bfc_json_get(obj, key);
    return json_object_is_type(v, json_type_string) ? json_object_get_string(v) : dflt;
}

bool bfc_json_bool(const json_object *obj, const char *key, bool dflt)
{
    const json_object *v = bfc_json_get(obj, key);
    return json_object_is_type(v, json_type_boolean) ? json_object_get_boolean(v) : dflt;
}

/* A member that, where present and not null, must be of type t. */
static bool member_ok(const json_object *obj, const char *key, json_type t)
{
    const json_object *m = bfc_json_get(obj, key);
    return !m || json_object_is_type(m, t);
}

/* obj[key], where present, an array whose elements are all objects; on a
 * fault, its place ("shards[3].regions[0]") in err. */
static bool objects_ok(const json_object *obj, const char *key, const char *where, char *err, size_t errlen)
{
    const json_object *a = bfc_json_get(obj, key);
    if (!a)
        return true;
    if (!json_object_is_type(a, json_type_array)) {
        snprintf(err, errlen, "%s%s is not an array", where, key);
        return false;
    }
    for (size_t i = 0; i < bfc_json_len(a); i++)
        if (!json_object_is_type(bfc_json_at(a, i), json_type_object)) {
            snprintf(err, errlen, "%s%s[%zu] is not an object", where, key, i);
            return false;
        }
    return true;
}

/* "0x" and 1 to 16 hex digits. */
static bool is_address(const char *s)
{
    if (s[0] != '0' || (s[1] != 'x' && s[1] != 'X'))
        return false;
    size_t n = 0;
    for (s += 2; isxdigit((unsigned char)*s); s++)
        n++;
    return *s == '\0' && n >= 1 && n <= 16;
}

/* Keys that name a byte count, a count or an id wherever they appear in a
 * snapshot (doc/snapshot.md): the tools print them as unsigned integers, so
 * anything else there (a string, a negative or fractional number) is not a
 * snapshot rather than a 0 printed as a figure.  The statistics' names come
 * from the library's own table, with their "_bound" spellings. */
static bool is_figure_key(const char *key)
{
    static const char *const figures[] = {
#define BFC__FIGURE_NAME(name, combine, desc) #name,
        BFC_STATS_FIELDS(BFC__FIGURE_NAME)
#undef BFC__FIGURE_NAME
        "peak_bytes_in_use_bound", "peak_bytes_requested_bound", "version", "limit", "initial_region",
        "large_alloc", "max_internal_frag", "stream_id", "size", "requested", "offset", "bin", "count",
        "min_size", "free", "fenced", "held", "peak_held", "committed", "in_use", "reserved", "pending",
        "largest_free", "largest_ready", "rounded", "bytes", "pool_free", "pool_fenced", "pool_largest_span",
        "num_pool_spans", "bytes_unreserved", "device",
    };
    if (strcmp(key, "fragmentation") == 0)
        return false; /* a fraction in [0, 1] */
    for (size_t i = 0; i < sizeof(figures) / sizeof(figures[0]); i++)
        if (strcmp(key, figures[i]) == 0)
            return true;
    return false;
}

/* Every figure under v (recursively) a non-negative integer or null; on a
 * fault, its place ("shards[0].stats.bytes_in_use") in err. */
static bool figures_ok(const json_object *v, const char *where, char *err, size_t errlen)
{
    char here[160];
    if (json_object_is_type(v, json_type_array)) {
        for (size_t i = 0; i < bfc_json_len(v); i++) {
            snprintf(here, sizeof here, "%.120s[%zu]", where, i);
            if (!figures_ok(bfc_json_at(v, i), here, err, errlen))
                return false;
        }
        return true;
    }
    if (!json_object_is_type(v, json_type_object))
        return true;
    json_object_object_foreach((json_object *)v, key, m) {
        snprintf(here, sizeof here, "%.100s%s%.50s", where, *where ? "." : "", key);
        bool bad = m && is_figure_key(key) && !json_object_is_type(m, json_type_boolean) &&
                   (!json_object_is_type(m, json_type_int) || json_object_get_int64(m) < 0);
        if (bad) {
            snprintf(err, errlen, "%s is not a non-negative integer", here);
            return false;
        }
        /* An id (below 2^63, as bfc_ctx_allocation_id returns it), or -1
         * for a free chunk. */
        if (m && strcmp(key, "allocation_id") == 0 &&
            (!json_object_is_type(m, json_type_int) || json_object_get_int64(m) < -1 ||
             (json_object_get_int64(m) == INT64_MAX && json_object_get_uint64(m) != (uint64_t)INT64_MAX))) {
            snprintf(err, errlen, "%s is not an allocation id (an integer, -1 when free)", here);
            return false;
        }
        /* A fraction in [0, 1] (doc/snapshot.md), or null. */
        if (m && strcmp(key, "fragmentation") == 0 &&
            (!(json_object_is_type(m, json_type_double) || json_object_is_type(m, json_type_int)) ||
             !(json_object_get_double(m) >= 0 && json_object_get_double(m) <= 1))) {
            snprintf(err, errlen, "%s is not a fraction from 0 to 1", here);
            return false;
        }
        if (!figures_ok(m, here, err, errlen))
            return false;
    }
    return true;
}

int bfc_json_snapshot_check(const json_object *v, char *err, size_t errlen)
{
    if (!json_object_is_type(v, json_type_object)) {
        snprintf(err, errlen, "not a libshardbfc snapshot (not a JSON object)");
        return -1;
    }
    const json_object *ver = bfc_json_get(v, "version");
    if (!json_object_is_type(ver, json_type_int) || json_object_get_int64(ver) < 1) {
        snprintf(err, errlen, "not a libshardbfc snapshot (no integer \"version\" >= 1)");
        return -1;
    }
    if (!json_object_is_type(bfc_json_get(v, "shards"), json_type_array)) {
        snprintf(err, errlen, "not a libshardbfc snapshot (no \"shards\" array)");
        return -1;
    }
    static const char *const objs[] = {"totals", "pool", "oom"};
    for (size_t i = 0; i < sizeof(objs) / sizeof(objs[0]); i++)
        if (!member_ok(v, objs[i], json_type_object)) {
            snprintf(err, errlen, "\"%s\" is not an object", objs[i]);
            return -1;
        }
    if (!objects_ok(v, "shards", "", err, errlen) || !figures_ok(v, "", err, errlen))
        return -1;
    const json_object *oom = bfc_json_get(v, "oom");
    if (!objects_ok(oom, "shards", "oom.", err, errlen) || !objects_ok(oom, "pool_spans", "oom.", err, errlen))
        return -1;
    const json_object *shards = bfc_json_get(v, "shards");
    for (size_t i = 0; i < bfc_json_len(shards); i++) {
        const json_object *sh = bfc_json_at(shards, i);
        char where[48];
        snprintf(where, sizeof where, "shards[%zu].", i);
        if (!member_ok(sh, "stats", json_type_object)) {
            snprintf(err, errlen, "%sstats is not an object", where);
            return -1;
        }
        if (!objects_ok(sh, "regions", where, err, errlen) || !objects_ok(sh, "bins", where, err, errlen))
            return -1;
        const json_object *regions = bfc_json_get(sh, "regions");
        for (size_t j = 0; j < bfc_json_len(regions); j++) {
            char rwhere[80];
            snprintf(rwhere, sizeof rwhere, "shards[%zu].regions[%zu].", i, j);
            const json_object *r = bfc_json_at(regions, j);
            if (!objects_ok(r, "chunks", rwhere, err, errlen))
                return -1;
            /* The page orders regions by address, as numbers. */
            if (!is_address(bfc_json_str(r, "base", ""))) {
                snprintf(err, errlen, "%sbase is not an address (\"0x\" and hex digits)", rwhere);
                return -1;
            }
        }
    }
    return 0;
}
