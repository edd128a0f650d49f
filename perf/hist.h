/*
 * hist.h -- a log-linear latency histogram, one per timed thread.
 *
 * Values (ns) below 2^PERF_HIST_SUB_BITS are counted exactly; above, each
 * power of two is cut into 2^PERF_HIST_SUB_BITS equal buckets, so a bucket is
 * at most 1/16 of its value wide (6.25%) and a percentile read back is the
 * middle of its bucket: within ~3.2% of the true value.  Recording is an
 * index computation (one count-leading-zeros) and an increment: no lock, no
 * atomic, no allocation.  Each thread owns its histogram while it runs; the
 * main thread merges them after joining the threads.  count, sum, min and
 * max are exact.
 */
#ifndef SHARDBFC_PERF_HIST_H
#define SHARDBFC_PERF_HIST_H

#include <stdint.h>

#define PERF_HIST_SUB_BITS 4
#define PERF_HIST_SUB (1u << PERF_HIST_SUB_BITS)
#define PERF_HIST_MAX_LOG2 48 /* values >= 2^48 ns (~3 days) share the last bucket */
#define PERF_HIST_BUCKETS ((PERF_HIST_MAX_LOG2 - PERF_HIST_SUB_BITS + 1) * PERF_HIST_SUB)

struct perf_hist {
    uint64_t count;
    uint64_t sum;
    uint64_t min;
    uint64_t max;
    uint64_t bucket[PERF_HIST_BUCKETS];
};

void perf_hist_reset(struct perf_hist *h);

static inline unsigned perf_hist_index(uint64_t v)
{
    unsigned e, idx;
    if (v < PERF_HIST_SUB)
        return (unsigned)v;
    e = 63u - (unsigned)__builtin_clzll(v); /* >= SUB_BITS */
    if (e >= PERF_HIST_MAX_LOG2)
        return PERF_HIST_BUCKETS - 1;
    idx = (e - PERF_HIST_SUB_BITS + 1) * PERF_HIST_SUB +
          (unsigned)((v >> (e - PERF_HIST_SUB_BITS)) & (PERF_HIST_SUB - 1));
    return idx;
}

static inline void perf_hist_add(struct perf_hist *h, uint64_t v)
{
    h->bucket[perf_hist_index(v)]++;
    h->count++;
    h->sum += v;
    if (v < h->min)
        h->min = v;
    if (v > h->max)
        h->max = v;
}

/* Lowest value and width of bucket i. */
void perf_hist_bucket_range(unsigned i, uint64_t *lo, uint64_t *width);

/* dst += src. */
void perf_hist_merge(struct perf_hist *dst, const struct perf_hist *src);

/* The q-quantile (0 < q <= 1): the middle of the bucket that holds the
 * ceil(q * count)-th smallest value, clamped to [min, max]; 0 when empty. */
uint64_t perf_hist_quantile(const struct perf_hist *h, double q);

double perf_hist_mean(const struct perf_hist *h);

#endif /* SHARDBFC_PERF_HIST_H */
