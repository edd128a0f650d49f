/*
 * view.h -- renders a libshardbfc snapshot (doc/snapshot.md) as one
 * self-contained HTML page: the JSON is embedded and drawn by the page's own
 * script, with inline CSS; no network resource is referenced.  Used by
 * tools/shardbfc-view and tests/test_obs.
 */
#ifndef SHARDBFC_VIEW_H
#define SHARDBFC_VIEW_H

#include <stddef.h>
#include <stdio.h>

/*
 * Checks that json[0..len) is a JSON object with a "shards" array (a
 * snapshot), then writes the page to out.  title may be NULL.  Returns 0, or
 * -1 with a message in err (invalid JSON, not a snapshot, write error).
 */
int bfc_view_write_html(const char *json, size_t len, const char *title, FILE *out, char *err,
                        size_t errlen);

#endif /* SHARDBFC_VIEW_H */
