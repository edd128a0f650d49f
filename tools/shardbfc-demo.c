/*
 * shardbfc-demo.c -- a short tour of libshardbfc on the simulated device.
 *
 * What it does: creates a context on the SIM backend (host memory standing in
 * for device memory, 1 GiB limit), creates three simulated streams and drives
 * a deterministic mix of allocations and frees on each:
 *
 *   1. churn: on every stream, a few hundred allocations of mixed sizes
 *      (mostly small, some medium, a few large) with frees interleaved, so
 *      chunks are split, freed and coalesced;
 *   2. cross-stream frees: stream B is held busy (bfc_sim_stream_hold) and
 *      frees a third of stream A's blocks, which must stay fenced (pending)
 *      until B is drained; one block of C is also marked as used by A
 *      (bfc_ctx_record_stream) before C frees it;
 *   3. drain and clean-up: B is drained, every block left is freed (some on
 *      a stream other than the owner's), and the context is trimmed.
 *
 * After each phase it prints per-stream (per-shard) and whole-context
 * statistics and runs bfc_ctx_check, which verifies every allocator
 * invariant.  It exits non-zero if any call fails, any invariant check
 * fails, or the allocation and free counts do not balance at the end.
 *
 * Only the public API is used (shardbfc.h, shardbfc_sim.h): this program is
 * also an example of how an application drives the library.  It is single-
 * threaded, so no locking is involved on its side.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>

#define NSTREAMS 3
#define STEPS_PER_STREAM 300
#define MAX_LIVE 4096

struct block {
    void *p;
    int owner; /* index of the stream it was allocated on */
    size_t n;
};

struct demo {
    bfc_ctx_t *ctx;
    bfc_stream_t streams[NSTREAMS];
    struct block live[MAX_LIVE];
    size_t nlive;
    uint64_t rng;
    int failures;
};

static const char *const stream_names[NSTREAMS] = {"A", "B", "C"};

/* xorshift64*: deterministic, so every run prints the same numbers. */
static uint64_t next_rand(struct demo *d)
{
    d->rng ^= d->rng >> 12;
    d->rng ^= d->rng << 25;
    d->rng ^= d->rng >> 27;
    return d->rng * UINT64_C(2685821657736338717);
}

/* Mostly small requests, some medium, a few large: the shape of a model's
 * activations and weights, which exercises splitting and all the bins. */
static size_t random_size(struct demo *d)
{
    uint64_t r = next_rand(d) % 100;

    if (r < 70)
        return 1 + next_rand(d) % (16 << 10);        /* up to 16 KiB */
    if (r < 95)
        return (16 << 10) + next_rand(d) % (1 << 20); /* up to ~1 MiB */
    return (1 << 20) + next_rand(d) % (8 << 20);      /* up to ~9 MiB */
}

static void fail(struct demo *d, const char *what, int status)
{
    fprintf(stderr, "shardbfc-demo: %s: %s (%s)\n", what, bfc_strerror(status),
            bfc_err_name(status));
    d->failures++;
}

static void alloc_one(struct demo *d, int s)
{
    size_t n = random_size(d);
    void *p;

    if (d->nlive == MAX_LIVE)
        return;
    p = bfc_ctx_alloc(d->ctx, d->streams[s], n);
    if (p == NULL) {
        fail(d, "bfc_ctx_alloc", bfc_last_error());
        return;
    }
    if (((uintptr_t)p & 255) != 0) {
        fprintf(stderr, "shardbfc-demo: %p is not 256-byte aligned\n", p);
        d->failures++;
    }
    d->live[d->nlive++] = (struct block){.p = p, .owner = s, .n = n};
}

/* Frees live block i on stream `on` (the owner's or another one). */
static void free_one(struct demo *d, size_t i, int on)
{
    int st = bfc_ctx_free(d->ctx, d->live[i].p, d->streams[on]);

    if (st != BFC_OK)
        fail(d, "bfc_ctx_free", st);
    d->live[i] = d->live[--d->nlive];
}

/* Index of a random live block owned by stream s, or -1. */
static long pick_owned_by(struct demo *d, int s)
{
    size_t start, k;

    if (d->nlive == 0)
        return -1;
    start = (size_t)(next_rand(d) % d->nlive);
    for (k = 0; k < d->nlive; k++) {
        size_t i = (start + k) % d->nlive;
        if (d->live[i].owner == s)
            return (long)i;
    }
    return -1;
}

static double mib(uint64_t bytes)
{
    return (double)bytes / (1024.0 * 1024.0);
}

static void print_row(const char *name, const bfc_stats_t *st)
{
    printf("  %-7s %7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64
           " %10.2f %10.2f %10.2f %7" PRIu64 "\n",
           name, st->num_allocs, st->num_frees, st->num_remote_frees,
           st->num_pending_frees, mib(st->bytes_in_use), mib(st->peak_bytes_in_use),
           mib(st->bytes_reserved), st->num_regions);
}

static void report(struct demo *d, const char *title)
{
    bfc_stats_t st;
    char why[256];
    int rc;

    printf("\n%s\n", title);
    printf("  %-7s %7s %7s %7s %7s %10s %10s %10s %7s\n", "stream", "allocs", "frees",
           "remote", "pending", "alloc MiB", "peak MiB", "resvd MiB", "regions");
    for (int s = 0; s < NSTREAMS; s++) {
        rc = bfc_ctx_stream_stats(d->ctx, d->streams[s], &st);
        if (rc == BFC_OK)
            print_row(stream_names[s], &st);
        else
            printf("  %-7s (no shard: %s)\n", stream_names[s], bfc_strerror(rc));
    }
    rc = bfc_ctx_stats(d->ctx, &st);
    if (rc != BFC_OK) {
        fail(d, "bfc_ctx_stats", rc);
        return;
    }
    print_row("total", &st);
    printf("  (allocated = chunk bytes; the total's peak is an upper bound: the shards'\n"
           "  peaks summed, capped by the peak reserved)\n");
    printf("  shards %" PRIu64 ", limit %.0f MiB, reserved peak %.2f MiB, "
           "largest request %.2f MiB, OOMs %" PRIu64 "\n",
           st.num_shards, mib(st.bytes_limit), mib(st.peak_bytes_reserved),
           mib(st.largest_alloc_size), st.num_ooms);

    rc = bfc_ctx_check(d->ctx);
    if (rc == BFC_OK) {
        printf("  bfc_ctx_check: all invariants hold\n");
    } else {
        why[0] = '\0';
        (void)bfc_ctx_check_report(d->ctx, why, sizeof why);
        printf("  bfc_ctx_check: FAILED (%s): %s\n", bfc_err_name(rc), why);
        d->failures++;
    }
}

int main(void)
{
    static struct demo d; /* large (the live table): keep it off the stack */
    bfc_config_t cfg;
    bfc_stats_t st;
    int rc;

    d.rng = UINT64_C(0x9E3779B97F4A7C15);

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    cfg.memory_limit = (size_t)1 << 30;
    rc = bfc_ctx_create(&cfg, &d.ctx);
    if (rc != BFC_OK) {
        fprintf(stderr, "shardbfc-demo: bfc_ctx_create: %s\n", bfc_strerror(rc));
        return EXIT_FAILURE;
    }
    for (int s = 0; s < NSTREAMS; s++) {
        d.streams[s] = bfc_sim_stream_create(d.ctx);
        if (d.streams[s] == NULL) {
            fprintf(stderr, "shardbfc-demo: bfc_sim_stream_create failed\n");
            bfc_ctx_destroy(d.ctx);
            return EXIT_FAILURE;
        }
    }
    printf("libshardbfc demo: SIM backend, 1 GiB limit, %d streams, %d steps each\n",
           NSTREAMS, STEPS_PER_STREAM);

    /* Phase 1: churn.  Two thirds of the steps allocate; the others free a
     * block of the same stream, occasionally on another stream (a remote
     * free, immediately reusable there since no stream is held). */
    for (int step = 0; step < STEPS_PER_STREAM; step++) {
        for (int s = 0; s < NSTREAMS; s++) {
            long i;

            if (next_rand(&d) % 3 != 0) {
                alloc_one(&d, s);
                continue;
            }
            i = pick_owned_by(&d, s);
            if (i >= 0)
                free_one(&d, (size_t)i, next_rand(&d) % 8 == 0 ? (s + 1) % NSTREAMS : s);
        }
    }
    report(&d, "after phase 1 (mixed allocations and frees on each stream):");

    /* Phase 2: B is busy; frees it issues are fenced on its work. */
    bfc_sim_stream_hold(d.ctx, d.streams[1]);
    {
        size_t owned_by_a = 0;
        long i;

        for (size_t k = 0; k < d.nlive; k++)
            owned_by_a += d.live[k].owner == 0;
        for (size_t k = 0; k < owned_by_a / 3; k++) {
            i = pick_owned_by(&d, 0);
            if (i >= 0)
                free_one(&d, (size_t)i, 1);
        }
        i = pick_owned_by(&d, 2);
        if (i >= 0) {
            rc = bfc_ctx_record_stream(d.ctx, d.live[i].p, d.streams[0]);
            if (rc != BFC_OK)
                fail(&d, "bfc_ctx_record_stream", rc);
            free_one(&d, (size_t)i, 2);
        }
        /* A keeps allocating while its freed blocks wait for B. */
        for (int k = 0; k < 20; k++)
            alloc_one(&d, 0);
    }
    report(&d, "during phase 2 (stream B held; A's blocks freed on B wait for B):");

    /* Phase 3: B's work completes; everything is freed, every fourth block
     * on the next stream rather than its owner. */
    bfc_sim_stream_drain(d.ctx, d.streams[1]);
    while (d.nlive > 0) {
        size_t i = d.nlive - 1;
        int owner = d.live[i].owner;

        free_one(&d, i, i % 4 == 0 ? (owner + 1) % NSTREAMS : owner);
    }
    rc = bfc_ctx_trim(d.ctx);
    if (rc != BFC_OK)
        fail(&d, "bfc_ctx_trim", rc);
    report(&d, "after phase 3 (B drained, every block freed, context trimmed):");

    rc = bfc_ctx_stats(d.ctx, &st);
    if (rc == BFC_OK && st.num_allocs != st.num_frees) {
        fprintf(stderr, "shardbfc-demo: %" PRIu64 " allocations but %" PRIu64 " frees\n",
                st.num_allocs, st.num_frees);
        d.failures++;
    }

    for (int s = 0; s < NSTREAMS; s++)
        bfc_sim_stream_destroy(d.ctx, d.streams[s]);
    bfc_ctx_destroy(d.ctx);

    if (d.failures != 0) {
        printf("\nshardbfc-demo: %d failure(s)\n", d.failures);
        return EXIT_FAILURE;
    }
    printf("\nshardbfc-demo: OK\n");
    return EXIT_SUCCESS;
}
