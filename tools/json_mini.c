/*
 * json_mini.c -- recursive-descent JSON parser (see json_mini.h).
 *
 * Strict: no trailing commas, no comments, no leading zeros, no NaN or
 * Infinity, control characters inside strings rejected.  Arrays and objects
 * grow by doubling.  On error everything built so far is freed.
 */
#include "json_mini.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

struct parser {
    const char *s;
    size_t len, pos;
    char *err;
    size_t errlen;
    bool failed;
};

static void fail(struct parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(struct parser *p, const char *fmt, ...)
{
    if (p->failed)
        return;
    p->failed = true;
    if (!p->err || p->errlen == 0)
        return;
    int w = snprintf(p->err, p->errlen, "offset %zu: ", p->pos);
    if (w < 0 || (size_t)w >= p->errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + w, p->errlen - (size_t)w, fmt, ap);
    va_end(ap);
}

static void skip_ws(struct parser *p)
{
    while (p->pos < p->len &&
           (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int peek(struct parser *p)
{
    return p->pos < p->len ? (unsigned char)p->s[p->pos] : -1;
}

static void free_value(bfc_json_t *v)
{
    if (v->type == BFC_JSON_STR) {
        free(v->str);
    } else if (v->type == BFC_JSON_ARR || v->type == BFC_JSON_OBJ) {
        for (size_t i = 0; i < v->n; i++) {
            free_value(&v->items[i]);
            if (v->keys)
                free(v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    memset(v, 0, sizeof(*v));
}

static bool parse_value(struct parser *p, bfc_json_t *v, int depth);

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool read_hex4(struct parser *p, unsigned *out)
{
    if (p->pos + 4 > p->len) {
        fail(p, "truncated \\u escape");
        return false;
    }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval((unsigned char)p->s[p->pos + (size_t)i]);
        if (h < 0) {
            fail(p, "bad \\u escape");
            return false;
        }
        v = v * 16 + (unsigned)h;
    }
    p->pos += 4;
    *out = v;
    return true;
}

/* Parses a string at p->pos (which is '"') into a malloc'ed UTF-8 copy. */
static char *parse_string(struct parser *p)
{
    p->pos++; /* '"' */
    size_t cap = 16, n = 0;
    char *out = malloc(cap);
    if (!out) {
        fail(p, "out of memory");
        return NULL;
    }
    for (;;) {
        if (p->pos >= p->len) {
            fail(p, "unterminated string");
            goto bad;
        }
        unsigned char c = (unsigned char)p->s[p->pos++];
        char buf[4];
        size_t bn = 0;
        if (c == '"')
            break;
        if (c < 0x20) {
            fail(p, "control character in string");
            goto bad;
        }
        if (c != '\\') {
            buf[bn++] = (char)c;
        } else {
            if (p->pos >= p->len) {
                fail(p, "truncated escape");
                goto bad;
            }
            char e = p->s[p->pos++];
            unsigned cp;
            switch (e) {
            case '"': buf[bn++] = '"'; break;
            case '\\': buf[bn++] = '\\'; break;
            case '/': buf[bn++] = '/'; break;
            case 'b': buf[bn++] = '\b'; break;
            case 'f': buf[bn++] = '\f'; break;
            case 'n': buf[bn++] = '\n'; break;
            case 'r': buf[bn++] = '\r'; break;
            case 't': buf[bn++] = '\t'; break;
            case 'u':
                if (!read_hex4(p, &cp))
                    goto bad;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned lo;
                    if (p->pos + 2 > p->len || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                        fail(p, "unpaired surrogate");
                        goto bad;
                    }
                    p->pos += 2;
                    if (!read_hex4(p, &lo))
                        goto bad;
                    if (lo < 0xDC00 || lo > 0xDFFF) {
                        fail(p, "unpaired surrogate");
                        goto bad;
                    }
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    fail(p, "unpaired surrogate");
                    goto bad;
                }
                if (cp == 0) {
                    fail(p, "NUL in string");
                    goto bad;
                }
                if (cp < 0x80) {
                    buf[bn++] = (char)cp;
                } else if (cp < 0x800) {
                    buf[bn++] = (char)(0xC0 | (cp >> 6));
                    buf[bn++] = (char)(0x80 | (cp & 0x3F));
                } else if (cp < 0x10000) {
                    buf[bn++] = (char)(0xE0 | (cp >> 12));
                    buf[bn++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    buf[bn++] = (char)(0x80 | (cp & 0x3F));
                } else {
                    buf[bn++] = (char)(0xF0 | (cp >> 18));
                    buf[bn++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                    buf[bn++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    buf[bn++] = (char)(0x80 | (cp & 0x3F));
                }
                break;
            default:
                fail(p, "bad escape '\\%c'", e);
                goto bad;
            }
        }
        if (n + bn + 1 > cap) {
            cap *= 2;
            char *nb = realloc(out, cap);
            if (!nb) {
                fail(p, "out of memory");
                goto bad;
            }
            out = nb;
        }
        memcpy(out + n, buf, bn);
        n += bn;
    }
    out[n] = '\0';
    return out;
bad:
    free(out);
    return NULL;
}

static bool parse_number(struct parser *p, bfc_json_t *v)
{
    size_t start = p->pos;
    bool integer = true, neg = false;
    if (peek(p) == '-') {
        neg = true;
        p->pos++;
    }
    if (peek(p) == '0') {
        p->pos++;
    } else if (peek(p) >= '1' && peek(p) <= '9') {
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    } else {
        fail(p, "bad number");
        return false;
    }
    if (peek(p) == '.') {
        integer = false;
        p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9')) {
            fail(p, "bad fraction");
            return false;
        }
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        integer = false;
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-')
            p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9')) {
            fail(p, "bad exponent");
            return false;
        }
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    }
    char buf[64];
    size_t n = p->pos - start;
    if (n >= sizeof(buf)) {
        fail(p, "number too long");
        return false;
    }
    memcpy(buf, p->s + start, n);
    buf[n] = '\0';
    v->type = BFC_JSON_NUM;
    v->num = strtod(buf, NULL);
    if (integer && !neg) {
        errno = 0;
        unsigned long long u = strtoull(buf, NULL, 10);
        if (errno == 0) {
            v->is_u64 = true;
            v->u64 = u;
        }
    }
    if (!isfinite(v->num)) {
        fail(p, "number out of range");
        return false;
    }
    return true;
}

static bool literal(struct parser *p, const char *word)
{
    size_t n = strlen(word);
    if (p->pos + n > p->len || memcmp(p->s + p->pos, word, n) != 0) {
        fail(p, "unexpected character");
        return false;
    }
    p->pos += n;
    return true;
}

static bool push(struct parser *p, bfc_json_t *v, size_t *cap, bool obj)
{
    if (v->n < *cap)
        return true;
    size_t ncap = *cap ? *cap * 2 : 8;
    bfc_json_t *ni = realloc(v->items, ncap * sizeof(*ni));
    if (!ni) {
        fail(p, "out of memory");
        return false;
    }
    v->items = ni;
    if (obj) {
        char **nk = realloc(v->keys, ncap * sizeof(*nk));
        if (!nk) {
            fail(p, "out of memory");
            return false;
        }
        v->keys = nk;
    }
    *cap = ncap;
    return true;
}

static bool parse_container(struct parser *p, bfc_json_t *v, int depth, bool obj)
{
    size_t cap = 0;
    v->type = obj ? BFC_JSON_OBJ : BFC_JSON_ARR;
    p->pos++; /* '{' or '[' */
    skip_ws(p);
    if (peek(p) == (obj ? '}' : ']')) {
        p->pos++;
        return true;
    }
    for (;;) {
        skip_ws(p);
        if (!push(p, v, &cap, obj))
            return false;
        char *key = NULL;
        if (obj) {
            if (peek(p) != '"') {
                fail(p, "expected a member name");
                return false;
            }
            key = parse_string(p);
            if (!key)
                return false;
            skip_ws(p);
            if (peek(p) != ':') {
                free(key);
                fail(p, "expected ':'");
                return false;
            }
            p->pos++;
        }
        bfc_json_t *item = &v->items[v->n];
        memset(item, 0, sizeof(*item));
        if (obj)
            v->keys[v->n] = key;
        v->n++; /* counted now so that a failure frees key and partial item */
        if (!parse_value(p, item, depth + 1))
            return false;
        skip_ws(p);
        int c = peek(p);
        if (c == ',') {
            p->pos++;
            continue;
        }
        if (c == (obj ? '}' : ']')) {
            p->pos++;
            return true;
        }
        fail(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        return false;
    }
}

static bool parse_value(struct parser *p, bfc_json_t *v, int depth)
{
    if (depth > MAX_DEPTH) {
        fail(p, "nesting too deep");
        return false;
    }
    skip_ws(p);
    int c = peek(p);
    switch (c) {
    case '{':
        return parse_container(p, v, depth, true);
    case '[':
        return parse_container(p, v, depth, false);
    case '"':
        v->type = BFC_JSON_STR;
        v->str = parse_string(p);
        return v->str != NULL;
    case 't':
        v->type = BFC_JSON_BOOL;
        v->b = true;
        return literal(p, "true");
    case 'f':
        v->type = BFC_JSON_BOOL;
        return literal(p, "false");
    case 'n':
        v->type = BFC_JSON_NULL;
        return literal(p, "null");
    case -1:
        fail(p, "unexpected end of input");
        return false;
    default:
        if (c == '-' || (c >= '0' && c <= '9'))
            return parse_number(p, v);
        fail(p, "unexpected character '%c'", c);
        return false;
    }
}

bfc_json_t *bfc_json_parse(const char *text, size_t len, char *err, size_t errlen)
{
    struct parser p = {text, len, 0, err, errlen, false};
    bfc_json_t *v = calloc(1, sizeof(*v));
    if (!v) {
        fail(&p, "out of memory");
        return NULL;
    }
    if (!parse_value(&p, v, 0)) {
        free_value(v);
        free(v);
        return NULL;
    }
    skip_ws(&p);
    if (p.pos != p.len) {
        fail(&p, "trailing characters");
        free_value(v);
        free(v);
        return NULL;
    }
    return v;
}

void bfc_json_free(bfc_json_t *v)
{
    if (!v)
        return;
    free_value(v);
    free(v);
}

const bfc_json_t *bfc_json_get(const bfc_json_t *obj, const char *key)
{
    if (!obj || obj->type != BFC_JSON_OBJ)
        return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (strcmp(obj->keys[i], key) == 0)
            return &obj->items[i];
    return NULL;
}

const bfc_json_t *bfc_json_at(const bfc_json_t *arr, size_t i)
{
    if (!arr || (arr->type != BFC_JSON_ARR && arr->type != BFC_JSON_OBJ) || i >= arr->n)
        return NULL;
    return &arr->items[i];
}

uint64_t bfc_json_u64(const bfc_json_t *obj, const char *key, uint64_t dflt)
{
    const bfc_json_t *v = bfc_json_get(obj, key);
    return v && v->type == BFC_JSON_NUM && v->is_u64 ? v->u64 : dflt;
}

double bfc_json_num(const bfc_json_t *obj, const char *key, double dflt)
{
    const bfc_json_t *v = bfc_json_get(obj, key);
    return v && v->type == BFC_JSON_NUM ? v->num : dflt;
}

const char *bfc_json_str(const bfc_json_t *obj, const char *key, const char *dflt)
{
    const bfc_json_t *v = bfc_json_get(obj, key);
    return v && v->type == BFC_JSON_STR ? v->str : dflt;
}
