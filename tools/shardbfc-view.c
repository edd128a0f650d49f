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
           "snapshot.md (share/doc/shardbfc/doc).\n");
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
        else if (argv[i][0] == '-' && argv[i][1] != '\0')
            in = NULL, i = argc; /* an unknown option: usage */
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
    /* The page is made in memory first, and PAGE.html opened only once it
     * is whole: a bad snapshot leaves an older page (or whatever -o names,
     * a device included) as it was.  A write error is reported; what was
     * written stays, as with any program's output. */
    char *page = NULL;
    size_t page_len = 0;
    FILE *mem = open_memstream(&page, &page_len);
    if (!mem) {
        perror("shardbfc-view");
        free(json);
        return 1;
    }
    char err[300], title[512];
    snprintf(title, sizeof(title), "libshardbfc memory map: %s", in);
    int rc = bfc_view_write_html(json, len, title, mem, err, sizeof(err));
    free(json);
    if (fclose(mem) != 0 && rc == 0) {
        snprintf(err, sizeof(err), "out of memory");
        rc = -1;
    }
    if (rc != 0) {
        fprintf(stderr, "shardbfc-view: %s: %s\n", in, err);
        free(page);
        return 1;
    }
    FILE *out = strcmp(outp, "-") == 0 ? stdout : fopen(outp, "w");
    if (!out) {
        perror(outp);
        free(page);
        return 1;
    }
    int bad = fwrite(page, 1, page_len, out) != page_len;
    free(page);
    bad |= out == stdout ? fflush(out) != 0 : fclose(out) != 0;
    if (bad) {
        fprintf(stderr, "shardbfc-view: %s: write error\n", outp);
        return 1;
    }
    return 0;
}
