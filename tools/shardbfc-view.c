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

#include "toolutil.h"
#include "view.h"

static void help(void)
{
    printf("usage: shardbfc-view SNAPSHOT.json -o PAGE.html\n"
           "\n"
           "Turns a libshardbfc snapshot (bfc_ctx_snapshot_json, or the file that\n"
           "SHARDBFC_CONF=oom_dump=PATH writes when an allocation fails) into one\n"
           "self-contained HTML page: the context and each shard in tables, every\n"
           "region drawn to scale with its chunks coloured by state, and, for a\n"
           "snapshot taken after an allocation failed, the OOM report first (why it\n"
           "failed, each shard's largest free chunk, the pool's free spans).  The\n"
           "page needs no network; open it in any browser.\n"
           "\n"
           "  -o PAGE.html   where to write the page (\"-\": standard output)\n"
           "  -h, --help     this text\n"
           "\n"
           "SNAPSHOT.json may be \"-\" (standard input).  Exit status: 0; 1 on a bad\n"
           "input or a write error; 2 on a usage error.  See shardbfc-view(1) and\n"
           "snapshot.md (share/doc/shardbfc).\n");
}

int main(int argc, char **argv)
{
    const char *in = NULL, *outp = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            help();
            return 0;
        }
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
    char *json = tool_read_all(f, &len);
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
