/*
 * shardbfc-view.c -- turns a libshardbfc snapshot (bfc_ctx_snapshot_json, or
 * the oom_dump file) into one self-contained HTML page.
 *
 *   shardbfc-view SNAPSHOT.json -o PAGE.html      ("-" reads stdin / writes stdout)
 *
 * The page needs nothing else: open it in any browser, offline.  Exit
 * status: 0, 1 on a bad input or write error, 2 on a usage error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "view.h"

static char *slurp(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    for (;;) {
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0)
            break;
    }
    if (ferror(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

int main(int argc, char **argv)
{
    const char *in = NULL, *outp = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-o") == 0 && i + 1 < argc)
            outp = argv[++i];
        else if (!in)
            in = argv[i];
        else
            in = NULL, i = argc; /* too many: usage */
    }
    if (!in || !outp) {
        fprintf(stderr, "usage: shardbfc-view SNAPSHOT.json -o PAGE.html\n");
        return 2;
    }
    FILE *f = strcmp(in, "-") == 0 ? stdin : fopen(in, "rb");
    if (!f) {
        perror(in);
        return 1;
    }
    size_t len;
    char *json = slurp(f, &len);
    if (f != stdin)
        fclose(f);
    if (!json) {
        fprintf(stderr, "shardbfc-view: cannot read %s\n", in);
        return 1;
    }
    FILE *out = strcmp(outp, "-") == 0 ? stdout : fopen(outp, "w");
    if (!out) {
        perror(outp);
        free(json);
        return 1;
    }
    char err[300], title[512];
    snprintf(title, sizeof(title), "libshardbfc memory map: %s", in);
    int rc = bfc_view_write_html(json, len, title, out, err, sizeof(err));
    free(json);
    if (out != stdout && fclose(out) != 0 && rc == 0) {
        snprintf(err, sizeof(err), "write error");
        rc = -1;
    }
    if (rc != 0) {
        fprintf(stderr, "shardbfc-view: %s: %s\n", in, err);
        if (out != stdout)
            remove(outp);
        return 1;
    }
    return 0;
}
