/*
 * shardbfc-replay.c -- replays an allocation trace against configurations
 * of libshardbfc on the simulated device and compares them.
 *
 *   shardbfc-replay [--config SPEC]... [--json] [--trace-out PATH] TRACE
 *   shardbfc-replay [--json] --compare SPEC... TRACE
 *
 * TRACE ("-": standard input) is a libshardbfc trace
 * (SHARDBFC_CONF=trace=PATH) or an RMM logging_resource_adaptor CSV log.
 * Each SPEC (SHARDBFC_CONF syntax, e.g.
 * "memory_limit=4G,allow_growth=false") is one run on a fresh SIM context;
 * no SPEC means one run on the defaults.  The table (or, with --json, a list
 * of objects with config, peak_requested, peak_reserved, peak_allocated,
 * overhead, fragmentation, fragmentation_max_at_peaks, ooms, allocs, frees, skipped,
 * unmatched_frees, replaced, maps_per_1k, unmaps_per_1k, seconds) goes to stdout: the trace's own exact peak of
 * requested bytes beside what each configuration reserved and allocated at
 * its peak, and overhead = peak reserved / peak requested; maps_per_1k and
 * unmaps_per_1k are the device map and unmap calls of expandable arenas per
 * 1,000 allocations replayed (0 with classic regions).  Events are read in replay order
 * (bfc_trace_csv_read_ordered: time order when each thread's rows are in
 * time order).  Frees of pointers no earlier allocate row returned are
 * skipped, counted in the table, and warned about on stderr: the blocks
 * they would have freed stay live in the replay.  --trace-out traces the
 * (single) replay itself.  A bad SPEC is reported with the item and reason.
 * Exit status: 0, 1 when a run failed, 2 on a usage error.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <shardbfc.h>

#include "replay.h"
#include "trace_csv.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: shardbfc-replay [--config SPEC]... [--json] [--trace-out PATH] TRACE\n"
               "       shardbfc-replay [--json] --compare SPEC... TRACE\n");
}

/* Why bfc_ctx_create refused a configuration that validates (BFC_EINVAL),
 * found by creating it again without each setting that can cause that. */
static const char *create_refusal(const bfc_config_t *cfg)
{
    bfc_config_t c = *cfg;
    bfc_ctx_t *ctx;
    if (c.oom_dump[0]) {
        c.oom_dump[0] = '\0';
        if (bfc_ctx_create(&c, &ctx) == BFC_OK) {
            bfc_ctx_destroy(ctx);
            return "its oom_dump= path cannot be written (a directory missing or not writable, a path that "
                   "is a directory or ends in '/', a file name over 229 bytes)";
        }
    }
    if (c.vmm == BFC_VMM_ON)
        return "vmm=on needs a memory_limit of at least one granule of the backend";
    return bfc_strerror(BFC_EINVAL);
}

static void help(void)
{
    usage(stdout);
    printf("\n"
           "Replays an allocation trace against configurations of libshardbfc on the\n"
           "simulated device and compares them.  TRACE is a libshardbfc trace\n"
           "(SHARDBFC_CONF=trace=PATH) or an RMM logging_resource_adaptor CSV log.\n"
           "\n"
           "  --config SPEC     one run with SPEC (SHARDBFC_CONF syntax, e.g.\n"
           "                    memory_limit=4G,allow_growth=false); repeat to compare;\n"
           "                    none: one run on the defaults\n"
           "  --compare SPEC... the same, every argument but the last is a SPEC\n"
           "  --json            a JSON list instead of the table\n"
           "  --trace-out PATH  trace the (single) replay itself to PATH\n"
           "  -h, --help        this text\n"
           "\n"
           "Events are replayed in time order when each thread's rows are in time\n"
           "order (libshardbfc writes per-thread batches), else in file order.  The\n"
           "table gives peak_requested (the trace's own peak of live requested bytes,\n"
           "the same for every configuration), peak_reserved (device memory held),\n"
           "peak_allocated (live chunk bytes), overhead (peak_reserved /\n"
           "peak_requested), frag (1 - largest free chunk / free bytes at the peak\n"
           "of allocated bytes), ooms, skipped (frees of blocks the replay never\n"
           "handed out, allocate failure rows), maps/1k and unmaps/1k (device map\n"
           "and unmap calls of expandable arenas per 1,000 allocations) and\n"
           "seconds; all but seconds exact.\n"
           "Frees that match no earlier allocation are also warned about on stderr,\n"
           "since the blocks they would free stay live and the peaks may be\n"
           "overstated.\n"
           "\n"
           "Exit status: 0; 1 when a run failed (bad SPEC, unreadable trace); 2 on a\n"
           "usage error.  See shardbfc-replay(1) and trace.md\n"
           "(share/doc/shardbfc/doc).\n");
}

/* Length of the well-formed UTF-8 sequence at s (RFC 3629: no overlong
 * forms, no surrogates, nothing past U+10FFFF), or 0. */
static size_t utf8_len(const unsigned char *s)
{
    unsigned char c = s[0];
    size_t n;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else
        return 0;
    if (s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xbf)
            return 0;
    return n;
}

/* A JSON string: a spec is the user's bytes (an oom_dump path, say), and a
 * byte that is not part of well-formed UTF-8 is written as U+FFFD, so the
 * list stays JSON whatever the spec holds. */
static void json_string(const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    putchar('"');
    while (*s) {
        unsigned char c = *s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else if (c < 0x80)
            putchar(c);
        else {
            size_t n = utf8_len(s);
            if (n == 0) {
                printf("\\ufffd");
                s++;
                continue;
            }
            fwrite(s, 1, n, stdout);
            s += n;
            continue;
        }
        s++;
    }
    putchar('"');
}

int main(int argc, char **argv)
{
    const char **specs = calloc((size_t)argc, sizeof(*specs));
    const char *positional[2] = {NULL, NULL};
    size_t nspecs = 0, npos = 0;
    bool json = false, compare = false;
    const char *trace_out = NULL;

    if (!specs)
        return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0 && i + 1 < argc) {
            specs[nspecs++] = argv[++i];
        } else if (strncmp(a, "--config=", 9) == 0) {
            specs[nspecs++] = a + 9;
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (strcmp(a, "--trace-out") == 0 && i + 1 < argc) {
            trace_out = argv[++i];
        } else if (strcmp(a, "--compare") == 0) {
            compare = true;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            help();
            free(specs);
            return 0;
        } else if (a[0] == '-' && a[1] != '\0') {
            usage(stderr); /* an unknown option (a file of that name: ./-x) */
            free(specs);
            return 2;
        } else if (compare) {
            specs[nspecs++] = a; /* the last one is TRACE, moved below */
        } else if (npos < 2) {
            positional[npos++] = a;
        } else {
            usage(stderr);
            free(specs);
            return 2;
        }
    }
    const char *trace;
    if (compare && npos == 0 && nspecs > 0) {
        trace = specs[--nspecs];
    } else if (npos == 1) {
        trace = positional[0];
    } else {
        usage(stderr);
        free(specs);
        return 2;
    }
    if (nspecs == 0)
        specs[nspecs++] = "";
    if (trace_out && nspecs > 1) {
        fprintf(stderr, "shardbfc-replay: --trace-out takes one configuration\n");
        free(specs);
        return 2;
    }

    bfc_trace_event_t *ev;
    size_t n;
    char err[512];
    int sorted = 0;
    /* Every SPEC is checked before anything is replayed or printed: a typo
     * in the third of three must not cost the first two runs' time and
     * leave a table with a row missing. */
    for (size_t i = 0; i < nspecs; i++) {
        bfc_config_t probe;
        if (bfc_replay_config(specs[i], &probe, err, sizeof(err)) != BFC_OK) {
            fprintf(stderr, "shardbfc-replay: bad configuration: %s\n", err);
            free(specs);
            return 1;
        }
        /* What the replay leaves out (bfc_replay_config), said rather than
         * dropped: the SPEC as written. */
        bfc_config_t asked;
        bfc_config_init(&asked);
        (void)bfc_config_parse(&asked, specs[i]);
        if (asked.trace[0])
            fprintf(stderr, "shardbfc-replay: %s: trace= is not used (--trace-out traces a replay)\n", specs[i]);
        if (asked.retry_ms)
            fprintf(stderr,
                    "shardbfc-replay: %s: retry_ms is not used (the replay is one thread: no other would free "
                    "memory while it waited)\n",
                    specs[i]);
        if (asked.backend == BFC_BACKEND_CUDA)
            fprintf(stderr, "shardbfc-replay: %s: backend=cuda is not used (the replay runs on the simulated device)\n",
                    specs[i]);
        const char *name = specs[i][0] ? specs[i] : "(defaults)";
        if (bfc_config_validate_err(&probe, err, sizeof(err)) != BFC_OK) {
            fprintf(stderr, "shardbfc-replay: bad configuration: %s: %s\n", name, err);
            free(specs);
            return 1;
        }
        /* What only a context can refuse (an oom_dump= path that cannot
         * be written, vmm=on where the limit holds no granule): made once
         * here, so that a refusal comes before the table and says which
         * SPEC and why.  Other failures (no memory for allow_growth=false's
         * reservation) are the run's, reported with its row missing. */
        bfc_ctx_t *ctx;
        int st = bfc_ctx_create(&probe, &ctx);
        if (st == BFC_OK)
            bfc_ctx_destroy(ctx);
        else if (st == BFC_EINVAL) {
            fprintf(stderr, "shardbfc-replay: bad configuration: %s: bfc_ctx_create refused it: %s\n", name,
                    create_refusal(&probe));
            free(specs);
            return 1;
        }
    }
    if (bfc_trace_csv_read_ordered(trace, &ev, &n, &sorted, err, sizeof(err)) != 0) {
        fprintf(stderr, "shardbfc-replay: %s\n", err);
        free(specs);
        return 1;
    }
    /* Before the table: a trace with more streams than a run can serve
     * would fail every run after the header was printed. */
    size_t nstreams = bfc_replay_streams(ev, n);
    if (nstreams != SIZE_MAX && nstreams > BFC_REPLAY_MAX_STREAMS) {
        fprintf(stderr, "shardbfc-replay: %s names %zu streams; a replay serves at most %d\n", trace, nstreams,
                BFC_REPLAY_MAX_STREAMS);
        free(ev);
        free(specs);
        return 1;
    }
    int status = 0;
    if (json)
        printf("[");
    else
        printf("%-40s %14s %14s %14s %8s %8s %8s %8s %8s %9s %9s\n", "config", "peak_requested", "peak_reserved",
               "peak_allocated", "overhead", "frag", "ooms", "skipped", "maps/1k", "unmaps/1k", "seconds");
    uint64_t unmatched_max = 0, replaced_max = 0;
    size_t shown = 0; /* runs printed: a failed run prints nothing */
    for (size_t i = 0; i < nspecs; i++) {
        bfc_replay_result_t r;
        if (bfc_replay_run(ev, n, specs[i], trace_out, &r, err, sizeof(err)) != 0) {
            fprintf(stderr, "shardbfc-replay: %s: %s\n", specs[i][0] ? specs[i] : "(defaults)", err);
            status = 1;
            continue;
        }
        if (r.unmatched_frees > unmatched_max)
            unmatched_max = r.unmatched_frees;
        if (r.replaced > replaced_max)
            replaced_max = r.replaced;
        if (json) {
            printf("%s{\"config\":", shown ? "," : "");
            json_string(specs[i]);
            printf(",\"peak_requested\":%" PRIu64 ",\"peak_reserved\":%" PRIu64 ",\"peak_allocated\":%" PRIu64
                   ",\"overhead\":",
                   r.peak_requested, r.peak_reserved, r.peak_allocated);
            if (r.peak_requested)
                printf("%.6f", r.overhead);
            else
                printf("null");
            printf(",\"fragmentation\":%.6f,\"fragmentation_max_at_peaks\":%.6f,\"ooms\":%" PRIu64 ",\"allocs\":%" PRIu64
                   ",\"frees\":%" PRIu64 ",\"skipped\":%" PRIu64 ",\"unmatched_frees\":%" PRIu64
                   ",\"replaced\":%" PRIu64 ",\"maps_per_1k\":%.4f,\"unmaps_per_1k\":%.4f,\"seconds\":%.6f}",
                   r.fragmentation, r.fragmentation_max_at_peaks, r.ooms, r.allocs, r.frees, r.skipped, r.unmatched_frees,
                   r.replaced, r.maps_per_1k, r.unmaps_per_1k, r.seconds);
        } else {
            char ovh[32];
            if (r.peak_requested)
                snprintf(ovh, sizeof ovh, "%.3f", r.overhead);
            else
                snprintf(ovh, sizeof ovh, "-");
            printf("%-40s %14" PRIu64 " %14" PRIu64 " %14" PRIu64 " %8s %8.4f %8" PRIu64 " %8" PRIu64
                   " %8.2f %9.2f %9.4f\n",
                   specs[i][0] ? specs[i] : "(defaults)", r.peak_requested, r.peak_reserved, r.peak_allocated, ovh,
                   r.fragmentation, r.ooms, r.skipped, r.maps_per_1k, r.unmaps_per_1k, r.seconds);
        }
        shown++;
    }
    if (json)
        printf("]\n");
    else
        printf("%zu events (%s); overhead = peak_reserved / peak_requested; frag = 1 - largest free\n"
               "chunk / free bytes at the peak of allocated bytes; skipped = allocate failure rows + frees\n"
               "of blocks the replay never handed out; maps/1k, unmaps/1k = device map and unmap calls\n"
               "(expandable arenas) per 1,000 allocations\n",
               n, sorted ? "in time order" : "in file order: some thread's rows are not in time order");
    /* Skipped frees leave blocks live that the traced program had freed:
     * every peak above may be overstated, and that must not hide in --json. */
    if (unmatched_max > 0)
        fprintf(stderr,
                "shardbfc-replay: warning: %" PRIu64 " free%s of pointers no earlier allocate row returned %s "
                "skipped: those blocks stay live in the replay, so peaks may be overstated (the trace "
                "started after they were allocated, or its rows are out of order%s)\n",
                unmatched_max, unmatched_max == 1 ? "" : "s", unmatched_max == 1 ? "was" : "were",
                sorted ? "" : "; they were replayed in file order");
    if (replaced_max > 0)
        fprintf(stderr,
                "shardbfc-replay: warning: %" PRIu64 " allocation%s of a pointer still live: the trace lacks "
                "the earlier block's free, which the replay made just before (the peak of requested bytes "
                "counts that block gone too)\n",
                replaced_max, replaced_max == 1 ? "" : "s");
    free(ev);
    free(specs);
    /* A table that could not be written (full disk, closed pipe) fails. */
    if (fflush(stdout) != 0 || ferror(stdout)) {
        perror("shardbfc-replay: writing the table");
        return 1;
    }
    return status;
}
