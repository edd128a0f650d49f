/*
 * report.c -- shardbfc-perf's output: the scaling figures (speed-up over
 * one thread, the machine's own speed-up from the ALU loop timed beside it,
 * and their ratio, the efficiency), the table on stdout (ratios against
 * libshardbfc), the JSON file other tools read (its `machine` and `results`
 * members are a stable contract, see perf/README.md), and an SVG chart drawn
 * here, with no external tool: churn throughput against threads (one line
 * per allocator) and churn latency percentiles (bars, log scale).  Both
 * axes are fitted to the data: the linear one ends at the first nice
 * gridline above the largest rate (not up to a decade above it), the log
 * one spans the decades from the smallest percentile to the largest (not
 * from 1 ns), so the bars and lines use the height of their panel.
 *
 * Pure functions of a struct perf_report (perf_report_scaling fills the
 * scaling members in place); called by the main thread after all
 * measurements.  Numbers that an allocator cannot report, or that a row
 * does not have (latencies of a counted run, speed-ups of a 1-thread row),
 * are null in the JSON and "-" in the table.
 */
#include "perf.h"
#include "perfutil.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

struct perf_result *perf_report_find(const struct perf_report *rp, const char *workload,
                                     const char *allocator, unsigned threads)
{
    for (unsigned i = 0; i < rp->nres; i++) {
        struct perf_result *r = &rp->res[i];
        if (strcmp(r->workload, workload) == 0 && strcmp(r->allocator, allocator) == 0 &&
            r->threads == threads)
            return r->failed ? NULL : r;
    }
    return NULL;
}

struct perf_base *perf_report_find_base(const struct perf_report *rp, const char *workload,
                                        unsigned kind, unsigned threads)
{
    for (unsigned i = 0; i < rp->nbase; i++) {
        struct perf_base *b = &rp->base[i];
        if (strcmp(b->workload, workload) == 0 && b->kind == kind && b->threads == threads)
            return b;
    }
    return NULL;
}

/* ------------------------------------------------------------- scaling */

const char *const perf_base_names[PERF_BASE_N] = {"alu", "mem", "ports"};

double perf_speedup(double rate_n, double rate_1)
{
    if (!(rate_n > 0) || !(rate_1 > 0) || !isfinite(rate_n) || !isfinite(rate_1))
        return NAN;
    return rate_n / rate_1;
}

double perf_efficiency(double speedup, double alu_speedup)
{
    if (!(speedup > 0) || !(alu_speedup > 0) || !isfinite(speedup) || !isfinite(alu_speedup))
        return NAN;
    return speedup / alu_speedup;
}

static double base_speedup(const struct perf_report *rp, const char *workload, unsigned kind,
                           unsigned threads)
{
    const struct perf_base *n = perf_report_find_base(rp, workload, kind, threads);
    const struct perf_base *one = perf_report_find_base(rp, workload, kind, 1);
    if (n == NULL || one == NULL || threads < 2)
        return NAN;
    return perf_speedup(n->ops_per_sec, one->ops_per_sec);
}

void perf_report_scaling(struct perf_report *rp)
{
    for (unsigned i = 0; i < rp->nbase; i++) {
        struct perf_base *b = &rp->base[i];
        b->speedup = base_speedup(rp, b->workload, b->kind, b->threads);
    }
    for (unsigned i = 0; i < rp->nres; i++) {
        struct perf_result *r = &rp->res[i];
        const struct perf_result *one =
            r->threads > 1 ? perf_report_find(rp, r->workload, r->allocator, 1) : NULL;
        if (r->failed)
            one = NULL; /* no speed-up of a failed run (nor against one: find) */
        r->speedup = one ? perf_speedup(r->ops_per_sec, one->ops_per_sec) : NAN;
        r->per_cpu_efficiency = one ? perf_speedup(r->ops_per_cpu_sec, one->ops_per_cpu_sec)
                                    : NAN;
        r->alu_speedup = base_speedup(rp, r->workload, PERF_BASE_ALU, r->threads);
        r->mem_speedup = base_speedup(rp, r->workload, PERF_BASE_MEM, r->threads);
        r->ports_speedup = base_speedup(rp, r->workload, PERF_BASE_PORTS, r->threads);
        r->efficiency = perf_efficiency(r->speedup, r->alu_speedup);
    }
}

double perf_median(const double *v, unsigned n, unsigned *at)
{
    /* Rank by selection: n is at most PERF_MAX_RUNS. */
    unsigned want = (n - 1) / 2;
    for (unsigned i = 0; i < n; i++) {
        unsigned below = 0, equal_before = 0;
        for (unsigned k = 0; k < n; k++) {
            if (v[k] < v[i])
                below++;
            else if (v[k] == v[i] && k < i)
                equal_before++;
        }
        if (below + equal_before == want) {
            if (at != NULL)
                *at = i;
            return v[i];
        }
    }
    if (at != NULL)
        *at = 0;
    return n > 0 ? v[0] : NAN;
}

/* mark: "" or a marker put before the figure ("~", "<="). */
static void fmt_bytes(char *buf, size_t len, const char *mark, uint64_t v)
{
    if (v >= (1ull << 30))
        snprintf(buf, len, "%s%.2f GiB", mark, (double)v / (double)(1ull << 30));
    else
        snprintf(buf, len, "%s%.1f MiB", mark, (double)v / (double)(1ull << 20));
}

static void fmt_rate(char *buf, size_t len, double v)
{
    if (v >= 1e6)
        snprintf(buf, len, "%.2fM", v / 1e6);
    else if (v >= 1e3)
        snprintf(buf, len, "%.1fk", v / 1e3);
    else
        snprintf(buf, len, "%.0f", v);
}

static bool is_arena(const char *workload)
{
    return strncmp(workload, "arena", 5) == 0;
}

/* Wall time of one thread's alloc+free pair: threads / (pairs per second). */
static double ns_per_pair(const struct perf_result *r)
{
    return r->ops_per_sec > 0 ? 2e9 * r->threads / r->ops_per_sec : NAN;
}

static void fmt_x(char *buf, size_t len, double v, bool times)
{
    if (isfinite(v))
        snprintf(buf, len, times ? "%.2fx" : "%.2f", v);
    else
        snprintf(buf, len, "-");
}

/* The row the others are compared with: shardbfc, else shardbfc-ctx. */
static const struct perf_result *base_row(const struct perf_report *rp, const char *workload,
                                          unsigned threads)
{
    const struct perf_result *b = perf_report_find(rp, workload, "shardbfc", threads);
    return b ? b : perf_report_find(rp, workload, "shardbfc-ctx", threads);
}

void perf_report_table(const struct perf_report *rp, const char *workload, FILE *f)
{
    unsigned threads[64], nt = 0;
    bool lat = false, multi = false;
    for (unsigned i = 0; i < rp->nres; i++) {
        const struct perf_result *r = &rp->res[i];
        bool seen = false;
        if (strcmp(r->workload, workload) != 0)
            continue;
        lat |= r->have_lat;
        multi |= r->threads > 1;
        for (unsigned k = 0; k < nt; k++)
            seen |= threads[k] == r->threads;
        if (!seen && nt < 64)
            threads[nt++] = r->threads;
    }
    if (nt == 0)
        return;
    if (lat)
        fprintf(f, "  %3s %-12s %10s %7s %8s %8s %9s %9s", "thr", "allocator", "ops/s",
                "vs bfc", "p50 ns", "p99 ns", "p99.9 ns", "alloc p99");
    else
        fprintf(f, "  %3s %-12s %10s %7s %8s", "thr", "allocator", "ops/s", "vs bfc",
                "ns/pair");
    fprintf(f, " %11s %11s %6s %5s %8s %6s %5s %7s %9s %11s\n", "peak resv", "peak req", "ovhd", "cpu",
            "speed-up", "ALU", "eff", "maps/1k", "unmaps/1k", "window m/u");
    bool marked_req = false, marked_resv = false, marked_part = false;
    for (unsigned k = 0; k < nt; k++) {
        const struct perf_result *base = base_row(rp, workload, threads[k]);
        for (unsigned i = 0; i < rp->nres; i++) {
            const struct perf_result *r = &rp->res[i];
            char rate[32], ratio[16], resv[24], req[24], ovhd[16], sp[16], alu[16], eff[16];
            char maps[16], unmaps[16], win[40];
            if (strcmp(r->workload, workload) != 0 || r->threads != threads[k])
                continue;
            if (r->failed) {
                fprintf(f, "  %3u %-12s FAILED: an allocation or free failed (the message above says"
                           " which); no figure\n",
                        r->threads, r->allocator);
                continue;
            }
            fmt_rate(rate, sizeof(rate), r->ops_per_sec);
            if (base != NULL && base->ops_per_sec > 0)
                snprintf(ratio, sizeof(ratio), "%.2fx", r->ops_per_sec / base->ops_per_sec);
            else
                snprintf(ratio, sizeof(ratio), "-");
            /* "~": sampled, "<=": an upper bound, "*": of part of the
             * program (legend below the table). */
            bool part = r->have_cycles && r->prog_cycles == 0;
            fmt_bytes(req, sizeof(req), part ? "*" : r->req_sampled ? "~" : "", r->peak_requested);
            if (r->have_mem) {
                fmt_bytes(resv, sizeof(resv), r->resv_bound ? "<=" : "", r->peak_reserved);
                snprintf(ovhd, sizeof(ovhd), "%s%.3f",
                         part ? "*" : r->req_sampled || r->resv_bound ? "~" : "", r->overhead);
                marked_resv |= r->resv_bound;
            } else {
                snprintf(resv, sizeof(resv), "-");
                snprintf(ovhd, sizeof(ovhd), "-");
            }
            if (r->have_vmm) {
                snprintf(maps, sizeof(maps), "%.2f", r->maps_per_1k);
                snprintf(unmaps, sizeof(unmaps), "%.2f", r->unmaps_per_1k);
            } else {
                snprintf(maps, sizeof(maps), "-");
                snprintf(unmaps, sizeof(unmaps), "-");
            }
            if (r->have_win_vmm)
                snprintf(win, sizeof(win), "%.2f/%.2f", r->win_maps_per_1k, r->win_unmaps_per_1k);
            else
                snprintf(win, sizeof(win), "-");
            fmt_x(sp, sizeof(sp), r->speedup, true);
            fmt_x(alu, sizeof(alu), r->alu_speedup, true);
            fmt_x(eff, sizeof(eff), r->efficiency, false);
            fprintf(f, "  %3u %-12s %10s %7s", r->threads, r->allocator, rate, ratio);
            if (lat && r->have_lat)
                fprintf(f, " %8" PRIu64 " %8" PRIu64 " %9" PRIu64 " %9" PRIu64, r->p50_ns,
                        r->p99_ns, r->p999_ns, r->alloc_p99_ns);
            else if (lat)
                fprintf(f, " %8s %8s %9s %9s", "-", "-", "-", "-");
            else
                fprintf(f, " %8.1f", ns_per_pair(r));
            fprintf(f, " %11s %11s %6s %4.0f%% %8s %6s %5s %7s %9s %11s\n", resv, req, ovhd,
                    100 * r->cpu_share, sp, alu, eff, maps, unmaps, win);
            marked_req |= r->req_sampled && !part;
            marked_part |= part;
        }
    }
    if (marked_req)
        fprintf(f, "  ~ peak req: sampled, not exact: with N threads the harness sums the threads'"
                   " live requested bytes at every (16 x P)th allocation, so it can miss a short"
                   " peak (low) or count a block freed on one thread with one allocated on another"
                   " meanwhile (high, by a few blocks); ovhd then carries it (exact at 1 thread)\n");
    if (marked_part)
        fprintf(f, "  * peak req, ovhd: the run did not go once through its program (a short window"
                   " for its speed): its peaks are of the events it reached, and rows that reached"
                   " different events are not comparable (sampled too with N threads)\n");
    if (marked_resv)
        fprintf(f, "  <= peak resv: the sum of several contexts' peaks (a context per thread, or"
                   " host contexts of several NUMA nodes): an upper bound on the true peak\n");
    /* The load-independent side: work per CPU-second, and sleeping. */
    fprintf(f, "  %3s %-12s %12s %11s %10s\n", "thr", "allocator", "ops/CPU-s", "per-CPU eff",
            "sleeps/s");
    for (unsigned k = 0; k < nt; k++) {
        for (unsigned i = 0; i < rp->nres; i++) {
            const struct perf_result *r = &rp->res[i];
            char rate[32], eff[16];
            if (strcmp(r->workload, workload) != 0 || r->threads != threads[k] || r->failed)
                continue;
            fmt_rate(rate, sizeof(rate), r->ops_per_cpu_sec);
            fmt_x(eff, sizeof(eff), r->per_cpu_efficiency, false);
            fprintf(f, "  %3u %-12s %12s %11s %10.0f\n", r->threads, r->allocator, rate, eff,
                    r->sleeps_per_sec);
        }
    }
    /* The machine's own scaling, timed beside each thread count. */
    for (unsigned kind = 0; kind < PERF_BASE_N; kind++) {
        bool any = false;
        for (unsigned k = 0; k < nt; k++) {
            const struct perf_base *b = perf_report_find_base(rp, workload, kind, threads[k]);
            char rate[32];
            if (b == NULL)
                continue;
            if (!any)
                fprintf(f, "  %s loop (%s/s, all threads):", perf_base_names[kind],
                        kind == PERF_BASE_MEM ? "lines" : "iterations");
            any = true;
            fmt_rate(rate, sizeof(rate), b->ops_per_sec);
            fprintf(f, " %u thr %s", b->threads, rate);
            if (isfinite(b->speedup))
                fprintf(f, " = %.2fx", b->speedup);
            fprintf(f, " (cpu %.0f%%)%s", 100 * b->cpu_share, k + 1 < nt ? ";" : "");
        }
        if (any)
            fputc('\n', f);
    }
    if (multi)
        fprintf(f, "  speed-up = ops/s at N threads / at 1 thread; ALU = the ALU loop's;"
                   " eff = speed-up / ALU speed-up (1.00: the allocator gains what the"
                   " machine gives)\n");
    for (unsigned i = 0; i < rp->nres; i++) {
        const struct perf_result *r = &rp->res[i];
        if (strcmp(r->workload, workload) == 0 && r->disturbed && !r->failed)
            fprintf(f, "  WARNING: %s %u thr: its threads ran %.0f%% of the window without"
                       " sleeping in a lock: other load on the machine; the figure"
                       " understates the allocator\n", r->allocator, r->threads,
                    100 * r->cpu_share);
    }
    for (unsigned i = 0; i < rp->nbase; i++) {
        const struct perf_base *b = &rp->base[i];
        if (strcmp(b->workload, workload) == 0 && b->disturbed)
            fprintf(f, "  WARNING: %s loop %u thr ran %.0f%% of the window: other load on"
                       " the machine\n", perf_base_names[b->kind], b->threads,
                    100 * b->cpu_share);
    }
}

/* ----------------------------------------------------------------- JSON */

static void json_num(FILE *f, double v, bool valid)
{
    if (valid && isfinite(v))
        fprintf(f, "%.6g", v);
    else
        fputs("null", f);
}

static void json_u64(FILE *f, uint64_t v, bool valid)
{
    if (valid)
        fprintf(f, "%" PRIu64, v);
    else
        fputs("null", f);
}

static void json_runs(FILE *f, const double *v, unsigned n)
{
    fputc('[', f);
    for (unsigned k = 0; k < n; k++) {
        if (k)
            fputs(", ", f);
        json_num(f, v[k], true);
    }
    fputc(']', f);
}

static void json_result(FILE *f, const struct perf_result *r)
{
    fprintf(f, "{\"workload\": ");
    perf_json_str(f, r->workload);
    fprintf(f, ", \"allocator\": ");
    perf_json_str(f, r->allocator);
    fprintf(f, ", \"threads\": %u, \"failed\": %s", r->threads, r->failed ? "true" : "false");
    if (r->failed) { /* no figure: what ran was not the measurement */
        fputc('}', f);
        return;
    }
    fprintf(f, ", \"ops_per_sec\": ");
    json_num(f, r->ops_per_sec, true);
    fprintf(f, ", \"p50_ns\": ");
    json_u64(f, r->p50_ns, r->have_lat);
    fprintf(f, ", \"p99_ns\": ");
    json_u64(f, r->p99_ns, r->have_lat);
    fprintf(f, ", \"p999_ns\": ");
    json_u64(f, r->p999_ns, r->have_lat);
    fprintf(f, ", \"peak_reserved\": ");
    json_u64(f, r->peak_reserved, r->have_mem);
    fprintf(f, ", \"peak_reserved_bound\": %s", r->have_mem ? (r->resv_bound ? "true" : "false") : "null");
    fprintf(f, ", \"peak_requested\": %" PRIu64 ", \"peak_requested_sampled\": %s, \"overhead\": ",
            r->peak_requested, r->req_sampled ? "true" : "false");
    json_num(f, r->overhead, r->have_mem);
    fprintf(f, ", \"overhead_exact\": %s",
            r->have_mem ? (!r->req_sampled && !r->resv_bound ? "true" : "false") : "null");
    fprintf(f, ", \"program_cycles\": ");
    json_u64(f, r->prog_cycles, r->have_cycles);
    fprintf(f, ", \"maps_per_1k\": ");
    json_num(f, r->maps_per_1k, r->have_vmm);
    fprintf(f, ", \"unmaps_per_1k\": ");
    json_num(f, r->unmaps_per_1k, r->have_vmm);
    fprintf(f, ", \"window_maps_per_1k\": ");
    json_num(f, r->win_maps_per_1k, r->have_win_vmm);
    fprintf(f, ", \"window_unmaps_per_1k\": ");
    json_num(f, r->win_unmaps_per_1k, r->have_win_vmm);
    fprintf(f, ", \"alloc_p99_ns\": ");
    json_u64(f, r->alloc_p99_ns, r->have_lat);
    fprintf(f, ", \"free_p99_ns\": ");
    json_u64(f, r->free_p99_ns, r->have_lat);
    fprintf(f, ", \"ops\": %" PRIu64 ", \"seconds\": ", r->ops);
    json_num(f, r->seconds, true);
    fprintf(f, ", \"cpu_share\": ");
    json_num(f, r->cpu_share, true);
    fprintf(f, ", \"ops_per_cpu_sec\": ");
    json_num(f, r->ops_per_cpu_sec, true);
    fprintf(f, ", \"sleeps_per_sec\": ");
    json_num(f, r->sleeps_per_sec, true);
    fprintf(f, ", \"disturbed\": %s", r->disturbed ? "true" : "false");
    fprintf(f, ", \"runs\": ");
    json_runs(f, r->runs, r->nruns);
    fprintf(f, ", \"speedup\": ");
    json_num(f, r->speedup, true);
    fprintf(f, ", \"alu_speedup\": ");
    json_num(f, r->alu_speedup, true);
    fprintf(f, ", \"mem_speedup\": ");
    json_num(f, r->mem_speedup, true);
    fprintf(f, ", \"ports_speedup\": ");
    json_num(f, r->ports_speedup, true);
    fprintf(f, ", \"efficiency\": ");
    json_num(f, r->efficiency, true);
    fprintf(f, ", \"per_cpu_efficiency\": ");
    json_num(f, r->per_cpu_efficiency, true);
    fprintf(f, ", \"calls_alloc\": %" PRIu64 ", \"calls_free\": %" PRIu64 ", \"verified\": %s",
            r->calls_alloc, r->calls_free,
            r->verified < 0 ? "null" : r->verified ? "true" : "false");
    if (strcmp(r->workload, "cross") == 0) {
        fprintf(f, ", \"consumers\": %u, \"frees_per_sec_per_consumer\": ", r->consumers);
        json_num(f, r->frees_per_sec_per_consumer, true);
        fprintf(f, ", \"allocs_per_sec_per_producer\": ");
        json_num(f, r->allocs_per_sec_per_producer, true);
        fprintf(f, ", \"blocks_per_sec\": ");
        json_num(f, r->blocks_per_sec, true);
        fprintf(f, ", \"cpu_share_producer\": ");
        json_num(f, r->cpu_share_producer, true);
        fprintf(f, ", \"cpu_share_consumer\": ");
        json_num(f, r->cpu_share_consumer, true);
    }
    if (is_arena(r->workload)) {
        fprintf(f, ", \"ns_per_pair\": ");
        json_num(f, ns_per_pair(r), true);
        fprintf(f, ", \"free_chunks_before\": ");
        json_u64(f, r->free_chunks_before, r->have_chunks);
        fprintf(f, ", \"free_chunks_after\": ");
        json_u64(f, r->free_chunks_after, r->have_chunks);
    }
    fputc('}', f);
}

int perf_report_json(const struct perf_report *rp, FILE *f)
{
    fprintf(f, "{\n  \"program\": ");
    perf_json_str(f, rp->program);
    fprintf(f, ",\n  \"machine\": {\"cores\": %ld, \"cpu\": ", rp->cores);
    perf_json_str(f, rp->cpu);
    fprintf(f, ", \"backend\": ");
    perf_json_str(f, rp->backend);
    fprintf(f, ", \"gpu\": ");
    if (rp->gpu != NULL)
        perf_json_str(f, rp->gpu);
    else
        fputs("null", f);
    fprintf(f, ", \"loadavg\": ");
    perf_json_str(f, rp->loadavg);
    fprintf(f, ", \"loadavg_end\": ");
    perf_json_str(f, rp->loadavg_end);
    fprintf(f, ", \"malloc\": ");
    perf_json_str(f, rp->malloc_note ? rp->malloc_note : "");
    fprintf(f, ", \"disturbed\": %s", rp->disturbed ? "true" : "false");
    fprintf(f, "},\n  \"parameters\": {%s},\n  \"results\": [", rp->params_json);
    for (unsigned i = 0; i < rp->nres; i++) {
        fprintf(f, "%s\n    ", i ? "," : "");
        json_result(f, &rp->res[i]);
    }
    fprintf(f, "\n  ],\n  \"baselines\": [");
    for (unsigned i = 0; i < rp->nbase; i++) {
        const struct perf_base *b = &rp->base[i];
        fprintf(f, "%s\n    {\"workload\": ", i ? "," : "");
        perf_json_str(f, b->workload);
        fprintf(f, ", \"kind\": ");
        perf_json_str(f, b->kind < PERF_BASE_N ? perf_base_names[b->kind] : "?");
        fprintf(f, ", \"threads\": %u, \"ops_per_sec\": ", b->threads);
        json_num(f, b->ops_per_sec, true);
        fprintf(f, ", \"ops\": %" PRIu64 ", \"seconds\": ", b->ops);
        json_num(f, b->seconds, true);
        fprintf(f, ", \"cpu_share\": ");
        json_num(f, b->cpu_share, true);
        fprintf(f, ", \"disturbed\": %s, \"runs\": ", b->disturbed ? "true" : "false");
        json_runs(f, b->runs, b->nruns);
        fprintf(f, ", \"speedup\": ");
        json_num(f, b->speedup, true);
        fputc('}', f);
    }
    fprintf(f, "\n  ],\n  \"skipped\": [");
    for (unsigned i = 0; i < rp->nskip; i++) {
        fprintf(f, "%s\n    {\"workload\": ", i ? "," : "");
        perf_json_str(f, rp->skip[i].workload);
        fprintf(f, ", \"allocator\": ");
        perf_json_str(f, rp->skip[i].allocator);
        fprintf(f, ", \"reason\": ");
        perf_json_str(f, rp->skip[i].reason);
        fputc('}', f);
    }
    fprintf(f, "\n  ],\n  \"targets\": [");
    for (unsigned i = 0; i < rp->ntgt; i++) {
        const struct perf_target *t = &rp->tgt[i];
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        perf_json_str(f, t->name);
        fprintf(f, ", \"value\": ");
        json_num(f, t->value, t->measured);
        fprintf(f, ", \"limit\": ");
        json_num(f, t->limit, true);
        fprintf(f, ", \"op\": \"%s\", \"met\": %s}", t->upper ? "<=" : ">=",
                !t->measured ? "null" : t->met ? "true" : "false");
    }
    fprintf(f, "\n  ]\n}\n");
    return ferror(f) ? -1 : 0;
}

/* ------------------------------------------------------------------ SVG */

static const char *const colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                      "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

static void svg_text(FILE *f, double x, double y, const char *anchor, int size,
                     const char *text)
{
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"%d\">", x, y,
            anchor, size);
    for (; *text; text++) {
        if (*text == '<')
            fputs("&lt;", f);
        else if (*text == '>')
            fputs("&gt;", f);
        else if (*text == '&')
            fputs("&amp;", f);
        else
            fputc(*text, f);
    }
    fputs("</text>\n", f);
}

/* The smallest "nice" step >= v: 1, 2, 2.5 or 5 times a power of ten. */
static double nice_step(double v)
{
    double p;
    if (!(v > 0))
        return 1;
    p = pow(10, floor(log10(v)));
    if (v <= p)
        return p;
    if (v <= 2 * p)
        return 2 * p;
    if (v <= 2.5 * p)
        return 2.5 * p;
    if (v <= 5 * p)
        return 5 * p;
    return 10 * p;
}

/*
 * A linear axis from 0 that fits v (the largest value, plus 5% headroom so
 * no point sits on the frame): at most 5 gridlines at a nice step, and the
 * top the first gridline at or above v -- never a whole decade above the
 * data, as "round up to 1, 2 or 5 x 10^k" would give (57 M -> 100 M).
 * *nsteps receives the number of steps (1..5).
 */
static double axis_linear(double v, unsigned *nsteps)
{
    double top = v * 1.05, step;
    if (!(top > 0)) {
        *nsteps = 5;
        return 5;
    }
    step = nice_step(top / 5);
    *nsteps = (unsigned)ceil(top / step - 1e-9);
    if (*nsteps < 1)
        *nsteps = 1;
    return step * *nsteps;
}

/* A log axis of whole decades that fits [lo, hi]: from the decade below
 * the smallest value (strictly, so that its bar has a height; never below
 * 1 ns) to the one at or above the largest, at least one decade. */
static void axis_log(double lo, double hi, double *lmin, double *lmax)
{
    if (!(lo >= 1))
        lo = 1;
    if (hi < lo)
        hi = lo;
    *lmin = pow(10, floor(log10(lo) - 1e-9));
    if (*lmin < 1)
        *lmin = 1;
    *lmax = pow(10, ceil(log10(hi) - 1e-9));
    if (*lmax <= *lmin)
        *lmax = *lmin * 10;
}

int perf_report_svg(const struct perf_report *rp, FILE *f)
{
    const double W = 960, H = 820, L = 90, R = 200, T1 = 70, B1 = 380, T2 = 470, B2 = 760;
    const char *wl = "churn";
    const char *allocs[16];
    unsigned na = 0, threads[64], nt = 0, lat_threads = 0;
    double ymax = 0;
    char buf[256];

    for (unsigned i = 0; i < rp->nres; i++) {
        const struct perf_result *r = &rp->res[i];
        bool seen = false;
        if (strcmp(r->workload, wl) != 0)
            continue;
        for (unsigned k = 0; k < na; k++)
            seen |= strcmp(allocs[k], r->allocator) == 0;
        if (!seen && na < 16)
            allocs[na++] = r->allocator;
        seen = false;
        for (unsigned k = 0; k < nt; k++)
            seen |= threads[k] == r->threads;
        if (!seen && nt < 64)
            threads[nt++] = r->threads;
        if (!r->failed && r->ops_per_sec > ymax) /* a failed run is not drawn (find) */
            ymax = r->ops_per_sec;
    }
    /* Thread counts ascending. */
    for (unsigned i = 1; i < nt; i++)
        for (unsigned k = i; k > 0 && threads[k - 1] > threads[k]; k--) {
            unsigned t = threads[k];
            threads[k] = threads[k - 1];
            threads[k - 1] = t;
        }
    for (unsigned k = 0; k < nt; k++)
        if (lat_threads == 0 || threads[k] == 2)
            lat_threads = threads[k];

    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
               "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H, W, H);
    snprintf(buf, sizeof(buf), "%s: %ld cores, %s, backend %s%s%s, load %s", rp->program,
             rp->cores, rp->cpu, rp->backend, rp->gpu ? ", GPU " : "", rp->gpu ? rp->gpu : "",
             rp->loadavg);
    svg_text(f, W / 2, 24, "middle", 13, buf);
    if (na == 0) {
        svg_text(f, W / 2, H / 2, "middle", 16, "no churn results in this run");
        fputs("</svg>\n", f);
        return ferror(f) ? -1 : 0;
    }

    /* Panel 1: throughput against threads. */
    unsigned ysteps;
    ymax = axis_linear(ymax, &ysteps);
    svg_text(f, (L + W - R) / 2, T1 - 16, "middle", 15,
             "churn: calls per second (alloc + free) vs threads");
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L,
            B1, W - R, B1);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L,
            T1, L, B1);
    for (unsigned g = 0; g <= ysteps; g++) {
        double y = B1 - (B1 - T1) * g / ysteps;
        char lab[32];
        fmt_rate(lab, sizeof(lab), ymax * g / ysteps);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                L, y, W - R, y);
        svg_text(f, L - 6, y + 4, "end", 11, lab);
    }
    for (unsigned k = 0; k < nt; k++) {
        double x = L + (W - R - L) * (nt == 1 ? 0.5 : (double)k / (nt - 1));
        char lab[16];
        snprintf(lab, sizeof(lab), "%u", threads[k]);
        svg_text(f, x, B1 + 18, "middle", 12, lab);
    }
    svg_text(f, (L + W - R) / 2, B1 + 38, "middle", 12, "threads");
    for (unsigned a = 0; a < na; a++) {
        const char *col = colours[a % 8];
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", col);
        for (unsigned k = 0; k < nt; k++) {
            const struct perf_result *r = perf_report_find(rp, wl, allocs[a], threads[k]);
            double x = L + (W - R - L) * (nt == 1 ? 0.5 : (double)k / (nt - 1));
            if (r != NULL)
                fprintf(f, "%.1f,%.1f ", x, B1 - (B1 - T1) * r->ops_per_sec / ymax);
        }
        fputs("\"/>\n", f);
        for (unsigned k = 0; k < nt; k++) {
            const struct perf_result *r = perf_report_find(rp, wl, allocs[a], threads[k]);
            double x = L + (W - R - L) * (nt == 1 ? 0.5 : (double)k / (nt - 1));
            if (r != NULL)
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\"/>\n", x,
                        B1 - (B1 - T1) * r->ops_per_sec / ymax, col);
        }
        fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"14\" height=\"4\" fill=\"%s\"/>\n",
                W - R + 20, T1 + 20 * a + 6, col);
        svg_text(f, W - R + 40, T1 + 20 * a + 12, "start", 12, allocs[a]);
    }

    /* Panel 2: latency percentiles at one thread count, log scale. */
    {
        const char *pname[3] = {"p50", "p99", "p99.9"};
        const double shade[3] = {1.0, 0.65, 0.35};
        double lmin, lmax, lo = 0, hi = 0;
        double gw = (W - R - L) / na, bw = gw / 4.5;
        for (unsigned a = 0; a < na; a++) {
            const struct perf_result *r = perf_report_find(rp, wl, allocs[a], lat_threads);
            if (r == NULL)
                continue;
            const uint64_t v[3] = {r->p50_ns, r->p99_ns, r->p999_ns};
            for (int q = 0; q < 3; q++) {
                if (lo == 0 || (double)v[q] < lo)
                    lo = (double)v[q];
                if ((double)v[q] > hi)
                    hi = (double)v[q];
            }
        }
        axis_log(lo, hi, &lmin, &lmax);
        snprintf(buf, sizeof(buf), "churn, %u thread%s: latency per call (ns, log scale)",
                 lat_threads, lat_threads == 1 ? "" : "s");
        svg_text(f, (L + W - R) / 2, T2 - 16, "middle", 15, buf);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n",
                L, B2, W - R, B2);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n",
                L, T2, L, B2);
        for (double v = lmin; v <= lmax * 1.0001; v *= 10) {
            double y = B2 - (B2 - T2) * log10(v / lmin) / log10(lmax / lmin);
            char lab[32];
            snprintf(lab, sizeof(lab), "%.0f", v);
            fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                    L, y, W - R, y);
            svg_text(f, L - 6, y + 4, "end", 11, lab);
        }
        for (unsigned a = 0; a < na; a++) {
            const struct perf_result *r = perf_report_find(rp, wl, allocs[a], lat_threads);
            uint64_t v[3];
            if (r == NULL)
                continue;
            v[0] = r->p50_ns;
            v[1] = r->p99_ns;
            v[2] = r->p999_ns;
            for (int q = 0; q < 3; q++) {
                double val = (double)v[q] < lmin ? lmin : (double)v[q];
                double y = B2 - (B2 - T2) * log10(val / lmin) / log10(lmax / lmin);
                double x = L + gw * a + bw * (0.75 + q);
                char lab[32];
                fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                           "fill=\"%s\" fill-opacity=\"%.2f\"><title>%s %s %" PRIu64
                           " ns</title></rect>\n", x, y, bw * 0.9, B2 - y, colours[a % 8],
                        shade[q], allocs[a], pname[q], v[q]);
                snprintf(lab, sizeof(lab), "%" PRIu64, v[q]);
                svg_text(f, x + bw * 0.45, y - 3, "middle", 9, lab);
            }
            svg_text(f, L + gw * (a + 0.5), B2 + 18, "middle", 12, allocs[a]);
        }
        for (int q = 0; q < 3; q++) {
            fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"14\" height=\"10\" fill=\"#444\" "
                       "fill-opacity=\"%.2f\"/>\n", W - R + 20, T2 + 20 * q, shade[q]);
            svg_text(f, W - R + 40, T2 + 20 * q + 9, "start", 12, pname[q]);
        }
    }
    fputs("</svg>\n", f);
    return ferror(f) ? -1 : 0;
}
