/*
 * interleave.c -- the harness's inference workload, N streams of one
 * context, interleaved on one thread: a deterministic replay of what N
 * serving threads do to the expandable arenas' policy, without the timing
 * that makes the threaded harness's device-call counts vary from run to
 * run by a factor of two.
 *
 *   perf/interleave [--streams N] [--passes P] [--quantum Q] [--steps S]
 *                   [--seed X] [--conf SPEC]
 *
 * Stream t replays perf_gen_inference(Llama-2-7B, seed 42 + 3000 + t, S
 * steps) -- the program the harness's thread t runs -- P times over.  The
 * streams take turns at random (perfutil's generator, seed X): a turn is
 * 1..Q events of one stream.  With one thread the peak requested is exact
 * (the sum of the live requested bytes, after every event).
 *
 * Output: one line per pass -- cumulative allocations, map and unmap calls
 * of the pass per 1,000 of its allocations, peak reserved and overhead so
 * far -- then a summary line.  The last pass's calls are the steady state:
 * the first pass includes the growth to the peak.  Exit 0, or 1 when an
 * allocation fails, 2 on a bad command line.
 */
#include <shardbfc.h>
#include <shardbfc_sim.h>

#include "perf.h"
#include "perfutil.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_STREAMS 64

static int usage(void)
{
    fprintf(stderr, "usage: interleave [--streams N (1..%d, default 16)] [--passes P (default 6)]\n"
                    "                  [--quantum Q (default 20000)] [--steps S (default 256)]\n"
                    "                  [--seed X (default 7)] [--conf SPEC]\n",
            MAX_STREAMS);
    return 2;
}

/* One count in 1..max (perf_parse_uint_list's rules). */
static bool num(const char *v, unsigned max, unsigned *out)
{
    unsigned n = 0;
    return v != NULL && perf_parse_uint_list(v, out, 1, &n, max);
}

int main(int argc, char **argv)
{
    unsigned n = 16, passes = 6, quantum = 20000, steps = 256;
    uint64_t rng = 7;
    const char *conf = NULL;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = false;
        if (strcmp(a, "--streams") == 0) {
            ok = num(v, MAX_STREAMS, &n);
        } else if (strcmp(a, "--passes") == 0) {
            ok = num(v, 1000, &passes);
        } else if (strcmp(a, "--quantum") == 0) {
            ok = num(v, 1u << 30, &quantum);
        } else if (strcmp(a, "--steps") == 0) {
            ok = num(v, 1u << 20, &steps);
        } else if (strcmp(a, "--seed") == 0 && v != NULL) {
            char *end;
            errno = 0;
            rng = strtoull(v, &end, 10);
            ok = errno == 0 && end != v && *end == '\0' && v[0] != '-';
        } else if (strcmp(a, "--conf") == 0) {
            ok = (conf = v) != NULL;
        }
        if (!ok)
            return usage();
    }

    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    cfg.memory_limit = (size_t)64 << 30; /* address space only, as the harness's */
    if (conf != NULL && bfc_config_parse(&cfg, conf) != BFC_OK) {
        fprintf(stderr, "interleave: --conf %s: not a libshardbfc configuration\n", conf);
        return 2;
    }
    int rc = bfc_ctx_create(&cfg, &ctx);
    if (rc != BFC_OK) {
        fprintf(stderr, "interleave: bfc_ctx_create: %s\n", bfc_strerror(rc));
        return 1;
    }

    struct perf_prog prog[MAX_STREAMS];
    bfc_stream_t s[MAX_STREAMS];
    void **live[MAX_STREAMS];
    uint64_t *lsize[MAX_STREAMS];
    size_t pos[MAX_STREAMS], done[MAX_STREAMS], total = 0;
    for (unsigned t = 0; t < n; t++) {
        perf_gen_inference(&perf_llama2_7b, 42u + 3000u + t, steps, &prog[t], NULL, NULL);
        s[t] = bfc_sim_stream_create(ctx);
        if (s[t] == NULL) {
            fprintf(stderr, "interleave: bfc_sim_stream_create failed\n");
            return 1;
        }
        live[t] = perf_xcalloc(prog[t].nslots, sizeof(void *));
        lsize[t] = perf_xcalloc(prog[t].nslots, sizeof(uint64_t));
        pos[t] = done[t] = 0;
        total += prog[t].nev;
    }
    printf("interleave: %u streams of perf's inference workload (%u steps), one SIM context,"
           " one thread; turns of 1..%u events; %u passes of %zu events%s%s\n",
           n, steps, quantum, passes, total, conf ? "; configuration: " : "", conf ? conf : "");
    printf("%5s %12s %8s %10s %12s %12s %8s\n", "pass", "allocations", "maps/1k", "unmaps/1k",
           "peak req", "peak resv", "ovhd");

    int64_t sum = 0, peak = 0;
    uint64_t pass_allocs = 0, pass_maps = 0, pass_unmaps = 0;
    double last_maps = 0, last_unmaps = 0;
    bfc_stats_t st;
    for (unsigned p = 1; p <= passes; p++) {
        unsigned finished = 0;
        while (finished < n) {
            unsigned t = (unsigned)perf_rng_range(&rng, 0, n - 1);
            size_t end = p * prog[t].nev;
            if (done[t] >= end)
                continue;
            uint64_t q = perf_rng_range(&rng, 1, quantum);
            for (uint64_t k = 0; k < q && done[t] < end; k++) {
                const struct perf_ev *e = &prog[t].ev[pos[t]];
                if (e->op == PERF_OP_ALLOC) {
                    void *x = bfc_ctx_alloc(ctx, s[t], e->size);
                    if (x == NULL) {
                        fprintf(stderr, "interleave: allocation of %" PRIu64 " B failed: %s\n",
                                e->size, bfc_strerror(bfc_last_error()));
                        return 1;
                    }
                    live[t][e->slot] = x;
                    lsize[t][e->slot] = e->size;
                    sum += (int64_t)e->size;
                    if (sum > peak)
                        peak = sum;
                } else {
                    if (bfc_ctx_free(ctx, live[t][e->slot], s[t]) != BFC_OK) {
                        fprintf(stderr, "interleave: a free failed\n");
                        return 1;
                    }
                    live[t][e->slot] = NULL;
                    sum -= (int64_t)lsize[t][e->slot];
                }
                if (++pos[t] == prog[t].nev)
                    pos[t] = 0;
                if (++done[t] == end)
                    finished++;
            }
        }
        if (bfc_ctx_stats(ctx, &st) != BFC_OK)
            return 1;
        uint64_t allocs = st.num_allocs - pass_allocs;
        last_maps = allocs ? 1000.0 * (double)(st.num_vmm_maps - pass_maps) / (double)allocs : 0;
        last_unmaps = allocs ? 1000.0 * (double)(st.num_vmm_unmaps - pass_unmaps) / (double)allocs : 0;
        printf("%5u %12" PRIu64 " %8.2f %10.2f %9.3f GiB %8.3f GiB %8.3f\n", p, st.num_allocs,
               last_maps, last_unmaps, (double)peak / (1u << 30),
               (double)st.peak_bytes_reserved / (1u << 30), (double)st.peak_bytes_reserved / (double)peak);
        pass_allocs = st.num_allocs;
        pass_maps = st.num_vmm_maps;
        pass_unmaps = st.num_vmm_unmaps;
    }
    printf("summary: overhead %.3f; map calls per 1,000 allocations %.2f over the run, %.2f in the last"
           " pass; unmap calls %.2f, %.2f\n",
           (double)st.peak_bytes_reserved / (double)peak,
           1000.0 * (double)st.num_vmm_maps / (double)st.num_allocs, last_maps,
           1000.0 * (double)st.num_vmm_unmaps / (double)st.num_allocs, last_unmaps);
    for (unsigned t = 0; t < n; t++) {
        for (unsigned i = 0; i < prog[t].nslots; i++)
            if (live[t][i] != NULL)
                (void)bfc_ctx_free(ctx, live[t][i], s[t]);
        free(live[t]);
        free(lsize[t]);
        perf_prog_free(&prog[t]);
    }
    rc = bfc_ctx_check(ctx);
    bfc_ctx_destroy(ctx);
    return rc == BFC_OK ? 0 : 1;
}
