/*
 * json_mini.h -- a small, strict JSON (RFC 8259) parser into a tree, for the
 * tools (shardbfc-view, shardbfc-stat) and the tests that read snapshots.
 * Not part of the library.  Plain C11, malloc'ed tree, no global state.
 *
 * Non-negative integers are also kept exactly as uint64_t (byte counts
 * beyond 2^53 would lose precision as doubles).  Strings are decoded
 * (escapes, \uXXXX with surrogate pairs, to UTF-8); a string with an
 * embedded NUL is rejected.  Nesting is limited to 64 levels.
 */
#ifndef SHARDBFC_JSON_MINI_H
#define SHARDBFC_JSON_MINI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { BFC_JSON_NULL, BFC_JSON_BOOL, BFC_JSON_NUM, BFC_JSON_STR, BFC_JSON_ARR, BFC_JSON_OBJ } bfc_json_type_t;

typedef struct bfc_json {
    bfc_json_type_t type;
    bool b;
    double num;
    bool is_u64;      /* num was a non-negative integer that fits u64 */
    uint64_t u64;
    char *str;        /* BFC_JSON_STR */
    size_t n;         /* items of an array / members of an object */
    struct bfc_json *items;
    char **keys;      /* BFC_JSON_OBJ: keys[i] names items[i] */
} bfc_json_t;

/* Parses text[0..len) (one value, surrounding whitespace allowed).  NULL
 * with a message ("offset 12: expected ':'") on error. */
bfc_json_t *bfc_json_parse(const char *text, size_t len, char *err, size_t errlen);
void bfc_json_free(bfc_json_t *v);

/* Member of an object (first match) or NULL; element i of an array or NULL. */
const bfc_json_t *bfc_json_get(const bfc_json_t *obj, const char *key);
const bfc_json_t *bfc_json_at(const bfc_json_t *arr, size_t i);
/* Convenience: the u64 / double / string of obj[key], or the default. */
uint64_t bfc_json_u64(const bfc_json_t *obj, const char *key, uint64_t dflt);
double bfc_json_num(const bfc_json_t *obj, const char *key, double dflt);
const char *bfc_json_str(const bfc_json_t *obj, const char *key, const char *dflt);

#endif /* SHARDBFC_JSON_MINI_H */
