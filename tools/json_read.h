/*
 * json_read.h -- reading JSON with json-c, for the tools (shardbfc-view,
 * shardbfc-stat) and the tests that read what the library and the perf
 * harness write.  Not part of the library, which writes its JSON itself
 * and depends on no JSON library.
 *
 * bfc_json_parse is json-c's parser made strict (RFC 8259): json-c's
 * strict mode and its UTF-8 check, one value filling the whole text, and
 * on top of them what that mode still lets through -- numbers that are not
 * JSON (NaN, Infinity, "1.", 1e400), strings with a NUL, single-quoted
 * strings and raw control characters inside strings.  The lookups
 * read a tree that json-c owns: a missing member, a member of another
 * type and JSON null all give the caller's default.
 *
 * Integers are exact: json-c keeps them up to UINT64_MAX (down to
 * INT64_MIN) and would clamp larger ones to that bound, silently, so an
 * integer beyond them is refused; nesting is limited to 64 levels.
 */
#ifndef SHARDBFC_JSON_READ_H
#define SHARDBFC_JSON_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <json-c/json.h>

/* Parses text[0..len) (one value, surrounding whitespace allowed) into
 * *out, which the caller releases with json_object_put (JSON null parses
 * to NULL).  Returns 0, or -1 with a message ("offset 12: unexpected
 * character") in err and *out NULL. */
int bfc_json_parse(const char *text, size_t len, json_object **out, char *err, size_t errlen);

/* Member key of an object; NULL when obj is not an object, has no such
 * member, or the member is null. */
json_object *bfc_json_get(const json_object *obj, const char *key);
/* Does the object have a member key whose value is JSON null? */
bool bfc_json_is_null(const json_object *obj, const char *key);
/* Elements of an array (0 when arr is not one), element i or NULL. */
size_t bfc_json_len(const json_object *arr);
json_object *bfc_json_at(const json_object *arr, size_t i);

/* obj[key] as, in turn: a non-negative integer (a negative one, a
 * fraction or an exponent gives dflt), any number, a string, a boolean;
 * dflt when the member is missing, null or of another type. */
uint64_t bfc_json_u64(const json_object *obj, const char *key, uint64_t dflt);
double bfc_json_num(const json_object *obj, const char *key, double dflt);
const char *bfc_json_str(const json_object *obj, const char *key, const char *dflt);
bool bfc_json_bool(const json_object *obj, const char *key, bool dflt);

/* Whether v has a libshardbfc snapshot's shape (doc/snapshot.md), as far
 * as a reader walks it: an object with an integer version >= 1 and a
 * shards array; totals and pool objects, oom an object or null, where
 * present; every element of shards (and of oom.shards, oom.pool_spans) an
 * object; a shard's stats an object, its regions and bins arrays of
 * objects, a region's chunks an array of objects and its base an address
 * ("0x" and hex digits).  Figures are not checked one by one: a member of
 * another type reads as the caller's default.
 * Returns 0, or -1 with what is wrong ("shards[3] is not an object") in
 * err. */
int bfc_json_snapshot_check(const json_object *v, char *err, size_t errlen);

#endif /* SHARDBFC_JSON_READ_H */
