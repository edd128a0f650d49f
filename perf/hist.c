/*
 * hist.c -- reading and merging the per-thread histograms of hist.h.
 * Called by the main thread after the timed threads have been joined, so
 * nothing here needs a lock.
 */
#include "hist.h"

#include <math.h>
#include <string.h>

void perf_hist_reset(struct perf_hist *h)
{
    memset(h, 0, sizeof(*h));
    h->min = UINT64_MAX;
}

void perf_hist_bucket_range(unsigned i, uint64_t *lo, uint64_t *width)
{
    unsigned e;
    if (i < PERF_HIST_SUB) {
        *lo = i;
        *width = 1;
        return;
    }
    e = i / PERF_HIST_SUB + PERF_HIST_SUB_BITS - 1;
    *width = 1ull << (e - PERF_HIST_SUB_BITS);
    *lo = (1ull << e) + (uint64_t)(i % PERF_HIST_SUB) * *width;
}

void perf_hist_merge(struct perf_hist *dst, const struct perf_hist *src)
{
    for (unsigned i = 0; i < PERF_HIST_BUCKETS; i++)
        dst->bucket[i] += src->bucket[i];
    dst->count += src->count;
    dst->sum += src->sum;
    if (src->min < dst->min)
        dst->min = src->min;
    if (src->max > dst->max)
        dst->max = src->max;
}

uint64_t perf_hist_quantile(const struct perf_hist *h, double q)
{
    uint64_t rank, seen = 0;
    if (h->count == 0)
        return 0;
    if (q <= 0)
        return h->min;
    rank = (uint64_t)ceil(q * (double)h->count);
    if (rank < 1)
        rank = 1;
    if (rank > h->count)
        rank = h->count;
    for (unsigned i = 0; i < PERF_HIST_BUCKETS; i++) {
        seen += h->bucket[i];
        if (seen >= rank) {
            uint64_t lo, w, v;
            perf_hist_bucket_range(i, &lo, &w);
            v = lo + w / 2;
            if (v < h->min)
                v = h->min;
            if (v > h->max)
                v = h->max;
            return v;
        }
    }
    return h->max;
}

double perf_hist_mean(const struct perf_hist *h)
{
    return h->count ? (double)h->sum / (double)h->count : 0.0;
}
