/*
 * pairs.c -- the allocation fast path in isolation, for instruction counts.
 *
 * One SIM context, one stream, 1000 live blocks; each step frees a random
 * live block on its own stream and allocates a new one, sizes log-uniform
 * between 256 B and 1 MiB (a fixed sequence, seed 42).  A warm-up of 20,000
 * pairs grows the regions first, so that the timed pairs run the steady
 * state: bins, splits and merges, no region growth.
 *
 *   perf/pairs N     runs N pairs after the warm-up (N = 0: warm-up only)
 *
 * PAIRS_CONF (SHARDBFC_CONF syntax) is applied after the defaults, e.g.
 * PAIRS_CONF=vmm=off for classic regions.  PAIRS_CROSS=1 frees every block
 * on a second stream instead: each free then crosses streams (a fence
 * record, an event, the owner's queue) and the owner's next allocation
 * drains it, all on one thread -- the cross-stream path's instructions,
 * without the cost of moving lines between cores.  The defaults here include
 * slack_decay_ms=never: the decay is timed in milliseconds, and under
 * callgrind, fifty times slower, a run lasts long enough for it to give
 * memory back and map it again, so the count would depend on the machine's
 * speed.  Its cost on the fast path, one test per free, is counted all the
 * same; a run at native speed ends long before the default 10 s.
 *
 * perf/pair_instructions.sh runs it under callgrind with N and with 0 and
 * divides the difference by N: instructions per alloc+free pair, exact and
 * repeatable (unlike a timing on a shared machine).
 */
#include <shardbfc.h>
#include <shardbfc_sim.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define LIVE 1000
#define SEQ 65536
#define WARM 20000

static uint64_t rng = 42;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    bfc_config_t cfg;
    bfc_ctx_t *ctx;
    static size_t sizes[SEQ];
    void *live[LIVE];

    bfc_config_init(&cfg);
    if (bfc_config_parse(&cfg, "backend=sim,memory_limit=4G,slack_decay_ms=never") != BFC_OK ||
        bfc_config_parse(&cfg, getenv("PAIRS_CONF")) != BFC_OK || bfc_ctx_create(&cfg, &ctx) != BFC_OK) {
        fprintf(stderr, "pairs: cannot create a SIM context\n");
        return 1;
    }
    bfc_stream_t s = bfc_sim_stream_create(ctx);
    bfc_stream_t t = getenv("PAIRS_CROSS") && atoi(getenv("PAIRS_CROSS")) ? bfc_sim_stream_create(ctx) : s;
    if (!s || !t) {
        fprintf(stderr, "pairs: cannot create a SIM stream\n");
        return 1;
    }
    for (int i = 0; i < SEQ; i++)
        sizes[i] = (size_t)exp2(8.0 + 12.0 * (double)(next() % 1000000) / 1e6); /* 256 B .. 1 MiB */
    for (int i = 0; i < LIVE; i++)
        live[i] = bfc_ctx_alloc(ctx, s, sizes[i]);
    for (long i = 0; i < WARM + n; i++) {
        int k = (int)(next() % LIVE);
        if (bfc_ctx_free(ctx, live[k], t) != BFC_OK || !(live[k] = bfc_ctx_alloc(ctx, s, sizes[i % SEQ]))) {
            fprintf(stderr, "pairs: step %ld failed: %s\n", i, bfc_strerror(bfc_last_error()));
            return 1;
        }
    }
    for (int i = 0; i < LIVE; i++)
        bfc_ctx_free(ctx, live[i], s);
    bfc_ctx_destroy(ctx);
    return 0;
}
