/*
 * replay.c -- replays a trace against a SIM context (see replay.h).
 *
 * Single-threaded and deterministic: the same trace on the same
 * configuration gives the same sequence of operations, hence the same
 * addresses relative to the regions, the same peaks and the same OOMs.
 * Threads of the trace are not re-created: what shards memory is the stream,
 * and the order within each thread is kept because the replay order
 * (bfc_trace_order in trace_csv.c, shared with the perf harness) is either
 * the file order or a stable sort by time of per-thread monotone
 * sequences.
 *
 * Measures: the trace's own peak requested comes from its rows alone
 * (bfc_replay_peak_requested), the same for every configuration; the
 * replay itself tracks the peak of live chunk bytes (allocated) exactly,
 * since it issues every call from one thread, and reads the peak reserved
 * from the pool, which keeps it exactly.  The context's own
 * peak_bytes_in_use is not used: with several shards it is a bound.
 *
 * Two open-addressing hash tables (linear probing, power-of-two sizes, no
 * deletion tombstones needed for streams; pointers use backward-shift
 * deletion) map trace streams to SIM streams and trace pointers to live
 * replay pointers.
 */
#include "replay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>

#include "toolutil.h"

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* ------------------------------------------------- pointer map */

struct pslot {
    uint64_t key; /* trace pointer; 0 = empty (a trace never allocates 0) */
    void *val;
    size_t size;  /* allocated (chunk) size */
    bfc_stream_t stream; /* the stream it was allocated on */
};

struct pmap {
    struct pslot *s;
    size_t cap, n;
};

static bool pmap_grow(struct pmap *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    struct pslot *ns = calloc(ncap, sizeof(*ns));
    if (!ns)
        return false;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->s[i].key)
            continue;
        size_t j = mix(m->s[i].key) & (ncap - 1);
        while (ns[j].key)
            j = (j + 1) & (ncap - 1);
        ns[j] = m->s[i];
    }
    free(m->s);
    m->s = ns;
    m->cap = ncap;
    return true;
}

static struct pslot *pmap_find(struct pmap *m, uint64_t key)
{
    if (!m->cap)
        return NULL;
    for (size_t j = mix(key) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        if (m->s[j].key == key)
            return &m->s[j];
        if (!m->s[j].key)
            return NULL;
    }
}

/* Inserts or overwrites (a trace may re-use an address after a free we
 * skipped). */
static bool pmap_put(struct pmap *m, uint64_t key, void *val, size_t size, bfc_stream_t stream)
{
    if ((m->n + 1) * 2 > m->cap && !pmap_grow(m))
        return false;
    size_t j = mix(key) & (m->cap - 1);
    while (m->s[j].key && m->s[j].key != key)
        j = (j + 1) & (m->cap - 1);
    if (!m->s[j].key)
        m->n++;
    m->s[j] = (struct pslot){key, val, size, stream};
    return true;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void pmap_del(struct pmap *m, struct pslot *slot)
{
    size_t i = (size_t)(slot - m->s), mask = m->cap - 1;
    m->s[i].key = 0;
    m->n--;
    for (size_t j = (i + 1) & mask; m->s[j].key; j = (j + 1) & mask) {
        size_t home = mix(m->s[j].key) & mask;
        /* Move j into the hole at i if its home is not in (i, j]. */
        bool between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            m->s[i] = m->s[j];
            m->s[j].key = 0;
            i = j;
        }
    }
}

/* -------------------------------------------------- stream map */

struct smap {
    uint64_t key[2 * (BFC_REPLAY_MAX_STREAMS + 1)];
    bfc_stream_t val[2 * (BFC_REPLAY_MAX_STREAMS + 1)];
    bool used[2 * (BFC_REPLAY_MAX_STREAMS + 1)];
    size_t n;
};

/* The stream an event names: its handle, but the per-thread default
 * stream's handle (cudaStreamPerThread, 2) is a stream of each thread's
 * own, so it is keyed by the thread (bit 63 set: no user-space handle has
 * it).  A free another thread made on the owner's per-thread stream
 * (bfc_free) is then replayed as that thread's cross-stream free. */
static uint64_t stream_key(const bfc_trace_event_t *e)
{
    return e->stream == 2 ? (UINT64_C(1) << 63) | e->thread : e->stream;
}

static int key_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

size_t bfc_replay_streams(const bfc_trace_event_t *ev, size_t n)
{
    uint64_t *k = malloc((n ? n : 1) * sizeof(*k));
    struct pmap pm = {0};
    size_t m = 0, distinct = 0;
    if (!k)
        return SIZE_MAX; /* unknown: the run will say if it is too many */
    /* As the run meets them: every allocate row's stream, and the stream
     * of a free of a live pointer (a nil or unknown one is skipped). */
    for (size_t i = 0; i < n; i++) {
        const bfc_trace_event_t *e = &ev[i];
        bool uses = e->action == BFC_TRACE_ALLOC;
        if (e->action == BFC_TRACE_ALLOC && e->ptr && !pmap_put(&pm, e->ptr, NULL, 0, NULL)) {
            free(pm.s);
            free(k);
            return SIZE_MAX;
        }
        if (e->action == BFC_TRACE_FREE) {
            struct pslot *sl = e->ptr ? pmap_find(&pm, e->ptr) : NULL;
            if (sl) {
                uses = true;
                pmap_del(&pm, sl);
            }
        }
        if (uses && stream_key(e) != 0)
            k[m++] = stream_key(e);
    }
    free(pm.s);
    qsort(k, m, sizeof(*k), key_cmp);
    for (size_t i = 0; i < m; i++)
        distinct += i == 0 || k[i] != k[i - 1];
    free(k);
    return distinct;
}

static bfc_stream_t stream_for(bfc_ctx_t *ctx, struct smap *m, uint64_t key, bool *ok)
{
    *ok = true;
    if (key == 0)
        return NULL;
    size_t cap = sizeof(m->key) / sizeof(m->key[0]);
    for (size_t j = mix(key) & (cap - 1);; j = (j + 1) & (cap - 1)) {
        if (m->used[j] && m->key[j] == key)
            return m->val[j];
        if (!m->used[j]) {
            if (m->n + 1 >= cap / 2) {
                *ok = false;
                return NULL;
            }
            bfc_stream_t s = bfc_sim_stream_create(ctx);
            if (!s) {
                *ok = false;
                return NULL;
            }
            m->used[j] = true;
            m->key[j] = key;
            m->val[j] = s;
            m->n++;
            return s;
        }
    }
}

int bfc_replay_peak_requested(const bfc_trace_event_t *ev, size_t n, const size_t *order, uint64_t *peak)
{
    struct pmap pm = {0};
    uint64_t live = 0;
    *peak = 0;
    for (size_t k = 0; k < n; k++) {
        const bfc_trace_event_t *e = &ev[order[k]];
        if (e->action == BFC_TRACE_ALLOC) {
            struct pslot *sl = e->ptr ? pmap_find(&pm, e->ptr) : NULL;
            if (sl)
                live -= sl->size;
            if (e->ptr && !pmap_put(&pm, e->ptr, NULL, (size_t)e->size, NULL)) {
                free(pm.s);
                return -1;
            }
            if (e->size > UINT64_MAX - live) {
                free(pm.s);
                return -2; /* more than 2^64 - 1 bytes live: not a real trace */
            }
            live += e->size;
            if (live > *peak)
                *peak = live;
        } else if (e->action == BFC_TRACE_FREE) {
            struct pslot *sl = e->ptr ? pmap_find(&pm, e->ptr) : NULL;
            if (sl) {
                live -= sl->size;
                pmap_del(&pm, sl);
            }
        }
    }
    free(pm.s);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int bfc_replay_config(const char *spec, bfc_config_t *cfg, char *err, size_t errlen)
{
    bfc_config_init(cfg);
    if (spec && bfc_config_parse_err(cfg, spec, err, errlen) != BFC_OK)
        return BFC_EINVAL;
    cfg->backend = BFC_BACKEND_SIM;
    cfg->trace[0] = '\0'; /* the replay traces only where asked to */
    /* One thread replays: an allocation that fails would wait retry_ms for
     * frees no other thread makes (75 failures of retry_ms=100 took 7.5 s),
     * and end as it began. */
    cfg->retry_ms = 0;
    return BFC_OK;
}

int bfc_replay_run(const bfc_trace_event_t *ev, size_t n, const char *spec, const char *trace_out,
                   bfc_replay_result_t *out, char *err, size_t errlen)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx = NULL;
    struct pmap pm = {0};
    struct smap *sm = NULL;
    size_t *order = NULL;
    int rc = -1;

    memset(out, 0, sizeof(*out));
    char why[512];
    if (bfc_replay_config(spec, &cfg, why, sizeof(why)) != BFC_OK) {
        set_err(err, errlen, "bad configuration: %s", why);
        return -1;
    }
    int st = bfc_ctx_create(&cfg, &ctx);
    if (st != BFC_OK) {
        set_err(err, errlen, "bfc_ctx_create: %s", bfc_strerror(st));
        return -1;
    }
    if (trace_out && (st = bfc_ctx_trace_start(ctx, trace_out)) != BFC_OK) {
        set_err(err, errlen, "bfc_ctx_trace_start(%s): %s", trace_out, bfc_strerror(st));
        goto done;
    }
    sm = calloc(1, sizeof(*sm));
    order = malloc((n ? n : 1) * sizeof(*order));
    if (!sm || !order || bfc_trace_order(ev, n, order) < 0) {
        set_err(err, errlen, "out of memory");
        goto done;
    }
    int prc = bfc_replay_peak_requested(ev, n, order, &out->peak_requested);
    if (prc < 0) {
        set_err(err, errlen, prc == -2 ? "the trace's live requested bytes pass 2^64 - 1" : "out of memory");
        goto done;
    }

    uint64_t live = 0;
    double t0 = now_s();
    for (size_t k = 0; k < n; k++) {
        const bfc_trace_event_t *e = &ev[order[k]];
        bool ok;
        if (e->action == BFC_TRACE_ALLOC) {
            bfc_stream_t s = stream_for(ctx, sm, stream_key(e), &ok);
            if (!ok) {
                set_err(err, errlen, "too many streams in the trace");
                goto done;
            }
            /* A pointer allocated again while live: its free is missing
             * from the trace, and the peak of requested bytes counts the
             * old block gone.  So does the replay, freeing it (on its own
             * stream) before the new allocation, which may reuse it. */
            struct pslot *old = e->ptr ? pmap_find(&pm, e->ptr) : NULL;
            if (old && old->val) {
                st = bfc_ctx_free(ctx, old->val, old->stream);
                if (st != BFC_OK && st != BFC_EBACKEND) {
                    set_err(err, errlen, "bfc_ctx_free: %s", bfc_strerror(st));
                    goto done;
                }
                live -= old->size;
                out->frees++;
                out->replaced++;
                old->val = NULL;
            }
            void *p = bfc_ctx_alloc(ctx, s, (size_t)e->size);
            if (!p) {
                if (e->size)
                    out->ooms++;
                /* Remember the pointer (with no block), so that its free is
                 * known to be skipped for a failure here, not unmatched. */
                if (e->ptr && !pmap_put(&pm, e->ptr, NULL, 0, NULL)) {
                    set_err(err, errlen, "out of memory");
                    goto done;
                }
                continue;
            }
            out->allocs++;
            size_t sz = bfc_ctx_allocated_size(ctx, p);
            if (!pmap_put(&pm, e->ptr, p, sz, s)) {
                set_err(err, errlen, "out of memory");
                goto done;
            }
            live += sz;
            if (live > out->peak_allocated) {
                bfc_stats_t stt;
                out->peak_allocated = live;
                if (bfc_ctx_stats(ctx, &stt) == BFC_OK) {
                    out->fragmentation = bfc_stats_fragmentation(&stt);
                    if (out->fragmentation > out->fragmentation_max_at_peaks)
                        out->fragmentation_max_at_peaks = out->fragmentation;
                }
            }
        } else if (e->action == BFC_TRACE_FREE) {
            if (!e->ptr)
                continue; /* free(NULL): nothing to free, nothing missing */
            struct pslot *sl = pmap_find(&pm, e->ptr);
            if (!sl) {
                out->skipped++;
                out->unmatched_frees++;
                continue;
            }
            if (!sl->val) {
                out->skipped++; /* its allocation failed in this replay */
                pmap_del(&pm, sl);
                continue;
            }
            bfc_stream_t s = stream_for(ctx, sm, stream_key(e), &ok);
            if (!ok) {
                set_err(err, errlen, "too many streams in the trace");
                goto done;
            }
            st = bfc_ctx_free(ctx, sl->val, s);
            if (st != BFC_OK && st != BFC_EBACKEND) {
                set_err(err, errlen, "bfc_ctx_free: %s", bfc_strerror(st));
                goto done;
            }
            live -= sl->size;
            out->frees++;
            pmap_del(&pm, sl);
        } else if (e->action == BFC_TRACE_ALLOC_FAIL) {
            out->skipped++;
        }
    }
    out->seconds = now_s() - t0;
    bfc_stats_t stt;
    if (bfc_ctx_stats(ctx, &stt) == BFC_OK) {
        out->peak_reserved = stt.peak_bytes_reserved;
        out->vmm_maps = stt.num_vmm_maps;
        out->vmm_unmaps = stt.num_vmm_unmaps;
    }
    if (out->allocs) {
        /* Each a device call: tens of microseconds on a GPU. */
        out->maps_per_1k = 1000.0 * (double)out->vmm_maps / (double)out->allocs;
        out->unmaps_per_1k = 1000.0 * (double)out->vmm_unmaps / (double)out->allocs;
    }
    if (out->peak_requested)
        out->overhead = (double)out->peak_reserved / (double)out->peak_requested;
    out->streams = sm->n;
    rc = 0;
done:
    if (ctx && trace_out && bfc_ctx_trace_stop(ctx) != BFC_OK && rc == 0) {
        set_err(err, errlen, "trace of the replay incomplete");
        rc = -1;
    }
    if (sm)
        for (size_t j = 0; j < sizeof(sm->key) / sizeof(sm->key[0]); j++)
            if (sm->used[j])
                bfc_sim_stream_destroy(ctx, sm->val[j]);
    bfc_ctx_destroy(ctx);
    free(pm.s);
    free(sm);
    free(order);
    return rc;
}
