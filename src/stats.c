/*
 * stats.c -- statistics, invariant checks, the memory map and the JSON
 * snapshot.
 *
 * Counters live in each arena (written under its lock, no shared counter on
 * the hot path) and are summed on read.  A read drains each shard's
 * remote-free queue first, so the figures are exact at the moment of the
 * call.  The context's peak_bytes_in_use and peak_bytes_requested are the
 * sums of the shards' peaks, capped by what the context held (what is
 * requested sits in chunks, and chunks in reserved memory, at every moment):
 * exact for one shard, an upper bound when several shards peak at different
 * times (an exact context-wide peak would need a shared counter on every
 * allocation).  bytes_reserved / peak_bytes_reserved of the context are the
 * pool's figures, exact: memory held from the backend.  The dump and the
 * snapshot name the bounds (ctx_bound below).
 *
 * The snapshot (schema: doc/snapshot.md) walks the same structures under
 * the same locks as the dump; its "oom" object is the context's latest OOM
 * report (obs_oom.c), printed under obs.lock before any allocator lock is
 * taken.
 *
 * Locking: ctx->arenas_lock, then each arena lock in turn (never two), then
 * the pool lock.  Entry points that start with the arenas lock register the
 * thread with urcu-bp first: a drain under an arena lock can release a region
 * (call_rcu), and registering under a library lock can deadlock a fork
 * (ctx.c, "Fork").  These are rare, observational paths.  bfc_ctx_check is the
 * exception: it holds every lock at once (bfc__shard_lock_all) to compare
 * shards, pool and region map in one consistent state.  obs.lock, when
 * taken, is outermost.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ctx.h"

/* doc/snapshot.md: bump on any change a reader could notice other than an
 * added field. */
#define BFC__SNAPSHOT_VERSION 2

_Static_assert(sizeof(bfc_stats_t) == BFC__STATS_WORDS * sizeof(uint64_t), "bfc_stats_t keeps its size");

static void add_arena(bfc_stats_t *o, const struct bfc__arena *a)
{
    const struct bfc__astats *s = &a->st;
    o->num_allocs += s->num_allocs;
    o->num_frees += s->num_frees;
    o->bytes_in_use += s->bytes_in_use;
    o->peak_bytes_in_use += s->peak_in_use;
    o->bytes_requested += s->bytes_requested;
    o->peak_bytes_requested += s->peak_requested;
    if (s->largest_alloc > o->largest_alloc_size)
        o->largest_alloc_size = s->largest_alloc;
    o->num_regions += s->num_regions;
    o->num_remote_frees += s->remote_frees;
    o->num_pending_frees += s->pending;
    o->bytes_pending += s->pending_bytes;
    o->num_ooms += s->ooms;
    size_t lf;
    if (a->x) {
        /* An expandable shard's free chunks are mostly addresses (its
         * range is twice the limit): count memory.  Blocks in use or
         * pending lie wholly on mapped granules, so what is mapped beyond
         * them (bfc__expand_idle_bytes) is exactly the free mapped bytes. */
        o->bytes_free += bfc__expand_idle_bytes(a);
        lf = bfc__expand_largest_mapped_free(a);
    } else {
        o->bytes_free += bfc__arena_free_bytes(a);
        lf = bfc__bins_largest(&a->bins);
    }
    if (lf > o->largest_free_chunk)
        o->largest_free_chunk = lf;
    o->num_chunks += s->chunks;
    o->num_vmm_maps += s->vmm_maps;
    o->num_vmm_unmaps += s->vmm_unmaps;
}

int bfc_ctx_stats(bfc_ctx_t *ctx, bfc_stats_t *out)
{
    if (!ctx || !out)
        return BFC_EINVAL;
    bfc__rcu_register(); /* before the arenas lock: a drain may call call_rcu */
    memset(out, 0, sizeof(*out));
    struct bfc__arena *a;
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        bfc__lock(&a->lock);
        /* A dead shard still listed is counted until unlink folds its
         * counters into ctx->retired (under arenas_lock, which we hold). */
        if (!a->dead)
            bfc__arena_drain_locked(a, true);
        add_arena(out, a);
        bfc__unlock(&a->lock);
    }
    const struct bfc__astats *r = &ctx->retired;
    out->num_allocs += r->num_allocs;
    out->num_frees += r->num_frees;
    out->num_remote_frees += r->remote_frees;
    out->num_ooms += r->ooms;
    out->peak_bytes_in_use += r->peak_in_use;
    out->peak_bytes_requested += r->peak_requested;
    if (r->largest_alloc > out->largest_alloc_size)
        out->largest_alloc_size = r->largest_alloc;
    bfc__unlock(&ctx->arenas_lock);
    /* What the drains above sent to the pool, and what it held fenced:
     * fences that completed are seen now, as the shards' were. */
    bfc__pool_poll(&ctx->pool);
    struct bfc__pool_stats ps;
    bfc__pool_stats(&ctx->pool, &ps);
    out->bytes_reserved = ps.held;
    out->peak_bytes_reserved = ps.peak_held;
    /* The pool makes every device call (a departed reservation's too). */
    out->num_vmm_maps = ps.vmm_maps;
    out->num_vmm_unmaps = ps.vmm_unmaps;
    /* The caps keep the bounds honest when shards peaked at different
     * times: chunks never outgrow what the pool held, nor requests their
     * chunks. */
    if (out->peak_bytes_in_use > out->peak_bytes_reserved)
        out->peak_bytes_in_use = out->peak_bytes_reserved;
    if (out->peak_bytes_requested > out->peak_bytes_in_use)
        out->peak_bytes_requested = out->peak_bytes_in_use;
    out->bytes_limit = ctx->limit;
    out->num_shards = atomic_load_explicit(&ctx->shards_live, memory_order_relaxed);
    out->num_ooms += atomic_load_explicit(&ctx->ooms, memory_order_relaxed);
    out->num_poison_errors = atomic_load_explicit(&ctx->poison_errors, memory_order_relaxed);
    return BFC_OK;
}

int bfc_ctx_stream_stats(bfc_ctx_t *ctx, bfc_stream_t s, bfc_stats_t *out)
{
    if (!ctx || !out)
        return BFC_EINVAL;
    memset(out, 0, sizeof(*out));
    bfc__rcu_lock();
    struct bfc__arena *a = bfc__shard_find(ctx, s);
    int st = BFC_EINVAL;
    if (a) {
        bfc__lock(&a->lock);
        if (!a->dead && !atomic_load_explicit(&a->retired, memory_order_acquire)) {
            bfc__arena_drain_locked(a, true);
            add_arena(out, a);
            out->bytes_reserved = a->st.bytes_reserved;
            out->peak_bytes_reserved = a->st.peak_reserved;
            out->bytes_limit = ctx->limit;
            out->num_shards = 1;
            st = BFC_OK;
        }
        bfc__unlock(&a->lock);
    }
    bfc__rcu_unlock();
    return st;
}

int bfc_ctx_clear_peaks(bfc_ctx_t *ctx)
{
    if (!ctx)
        return BFC_EINVAL;
    bfc__rcu_register(); /* before the arenas lock: a drain may call call_rcu */
    /* The pool first: its new peak then covers the shards' whole new
     * window, so the cap in bfc_ctx_stats never cuts below a true peak. */
    bfc__pool_clear_peak(&ctx->pool);
    struct bfc__arena *a;
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        bfc__lock(&a->lock);
        bfc__arena_drain_locked(a, true);
        a->st.peak_in_use = a->st.bytes_in_use;
        a->st.peak_requested = a->st.bytes_requested;
        a->st.peak_reserved = a->st.bytes_reserved;
        bfc__unlock(&a->lock);
    }
    ctx->retired.peak_in_use = 0;
    ctx->retired.peak_requested = 0;
    bfc__unlock(&ctx->arenas_lock);
    return BFC_OK;
}

int bfc_ctx_check_report(bfc_ctx_t *ctx, char *buf, size_t len)
{
    char local[512];
    if (!buf || len == 0) {
        buf = local;
        len = sizeof(local);
    }
    buf[0] = '\0';
    if (!ctx)
        return BFC_EINVAL;
    int bad = 0;
    uint64_t regions = 0, reserved = 0;
    /* One consistent picture: shards, pool and region map are compared with
     * every lock of the context held (bfc__shard_lock_all), so a check running
     * beside busy threads never sees a region half-way between them; the
     * read section keeps the region map array alive while it is read. */
    bfc__rcu_lock();
    bfc__shard_lock_all(ctx);
    struct bfc__arena *a;
    bfc__list_for_each(a, &ctx->arenas, all) {
        if (bad)
            break;
        if (!a->dead) {
            bad = bfc__arena_check_locked(a, buf, len);
            regions += a->st.num_regions;
            reserved += a->st.bytes_reserved;
        }
    }
    if (!bad) {
        size_t mapped = bfc__regionmap_count(ctx);
        if (mapped != regions) {
            snprintf(buf, len, "invariant 6: the region map holds %zu regions of this context, shards own %" PRIu64,
                     mapped, regions);
            bad = -1;
        }
    }
    if (!bad) {
        size_t committed = atomic_load_explicit(&ctx->pool.committed, memory_order_relaxed);
        /* Reservations of expandable arenas that departed are still
         * mapped (and counted) until their fences complete. */
        for (struct bfc__vmm_gone *g = ctx->pool.vmm_gone; g; g = g->next)
            reserved += g->mapped;
        if (committed != reserved) {
            snprintf(buf, len, "invariant 6: the pool lent %zu bytes of regions, shards hold %" PRIu64, committed,
                     reserved);
            bad = -1;
        }
    }
    if (!bad)
        bad = bfc__pool_check_locked(&ctx->pool, buf, len);
    bfc__shard_unlock_all(ctx);
    bfc__rcu_unlock();
    return bad ? BFC_ECORRUPT : BFC_OK;
}

int bfc_ctx_check(bfc_ctx_t *ctx)
{
    return bfc_ctx_check_report(ctx, NULL, 0);
}

/* ------------------------------------------------------------ dumps */

static const char *state_name(uint32_t s)
{
    switch (s) {
    case BFC__CHUNK_FREE:
        return "free";
    case BFC__CHUNK_INUSE:
        return "in_use";
    case BFC__CHUNK_FREEING:
        return "freeing";
    default:
        return "pending";
    }
}

/*
 * The figures of a context that are upper bounds, not exact (shardbfc.h,
 * "Exact or bound"): the dump and the snapshot print them with a "_bound"
 * suffix so that no reader takes them for a true peak.
 */
static bool ctx_bound(const char *name)
{
    return strcmp(name, "peak_bytes_in_use") == 0 || strcmp(name, "peak_bytes_requested") == 0;
}

static void dump_arena(struct bfc__arena *a, FILE *f)
{
    fprintf(f, "Shard stream_id=%" PRIu64 "%s: %" PRIu64 " regions, %" PRIu64 " bytes reserved, %" PRIu64
               " in use, %" PRIu64 " requested, %" PRIu64 " pending frees\n",
            a->stream_id, atomic_load(&a->retired) ? " (retired)" : "", a->st.num_regions, a->st.bytes_reserved,
            a->st.bytes_in_use, a->st.bytes_requested, a->st.pending);
    struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink) {
        fprintf(f, "  Region %#lx size %zu%s\n", (unsigned long)r->base, r->size, r->large ? " (large)" : "");
        for (struct bfc__chunk *c = bfc__region_handle(r, r->base); c; c = c->next) {
            uint32_t s = atomic_load_explicit(&c->state, memory_order_relaxed);
            fprintf(f, "    Chunk %#lx size %zu %s", (unsigned long)c->ptr, c->size, state_name(s));
            if (s != BFC__CHUNK_FREE)
                fprintf(f, " requested %zu id %" PRId64, c->requested, c->alloc_id);
            fputc('\n', f);
        }
    }
    fprintf(f, "  Bins:");
    for (uint32_t i = 0; i < BFC__NUM_BINS; i++) {
        size_t n, bytes;
        bfc__bins_tally(&a->bins, i, &n, &bytes);
        if (n)
            fprintf(f, " [%u: %zu chunks, %zu bytes, >= %zu]", i, n, bytes, BFC__MIN_ALLOC << i);
    }
    fputc('\n', f);
}

int bfc_ctx_dump(bfc_ctx_t *ctx, FILE *f)
{
    if (!ctx || !f)
        return BFC_EINVAL;
    bfc__rcu_register(); /* before the arenas lock: a drain may call call_rcu */
    bfc_stats_t s;
    bfc_ctx_stats(ctx, &s);
    /* f is written under arena locks: a cancellation at its write(2) would
     * leave them held, and one anywhere else would cut the dump short
     * (mutex.h). */
    int cs = bfc__nocancel_begin();
    fprintf(f, "libshardbfc memory map: backend %s, limit %" PRIu64 ", reserved %" PRIu64 ", in use %" PRIu64
               ", %" PRIu64 " shards, %" PRIu64 " regions\n",
            ctx->be->name, s.bytes_limit, s.bytes_reserved, s.bytes_in_use, s.num_shards, s.num_regions);
    struct bfc__arena *a;
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        bfc__lock(&a->lock);
        if (!a->dead)
            dump_arena(a, f);
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
    const char *sep = "Stats: ";
#define DUMP_FIELD(name, combine, desc)                                                                     \
    fprintf(f, "%s" #name "%s %" PRIu64, sep, ctx_bound(#name) ? "_bound" : "", s.name);                   \
    sep = ", ";
    BFC_STATS_FIELDS(DUMP_FIELD)
#undef DUMP_FIELD
    fputc('\n', f);
    /* Flushed: a write that fails in the buffer's last flush (a full disk)
     * is this call's to report.  Before cancellation is on again: no call
     * acts on a cancellation request (shardbfc.h). */
    int st = fflush(f) != 0 || ferror(f) ? BFC_EBACKEND : BFC_OK;
    bfc__nocancel_end(cs);
    return st;
}

double bfc_stats_fragmentation(const bfc_stats_t *s)
{
    if (!s || s->bytes_free == 0 || s->largest_free_chunk >= s->bytes_free)
        return 0.0;
    return 1.0 - (double)s->largest_free_chunk / (double)s->bytes_free;
}

/*
 * A JSON number for a double in [0, 1]: fixed notation with six decimals,
 * never nan/inf, and written from integers: printf's %f follows the
 * application's LC_NUMERIC, and a server that set a German locale would get
 * "0,025025", which is not JSON.
 */
static void json_fraction(FILE *f, double v)
{
    if (!(v >= 0.0 && v <= 1.0))
        v = 0.0;
    unsigned long micro = (unsigned long)lround(v * 1e6); /* 0 .. 1000000 */
    fprintf(f, "%lu.%06lu", micro / 1000000ul, micro % 1000000ul);
}

/* A context's figures name their bounds (bfc_ctx_stats); a shard's are exact. */
static void json_stats(FILE *f, const bfc_stats_t *s, bool context)
{
    char sep = '{';
#define JSON_FIELD(name, combine, desc)                                                                     \
    fprintf(f, "%c\"" #name "%s\":%" PRIu64, sep, context && ctx_bound(#name) ? "_bound" : "", s->name);   \
    sep = ',';
    BFC_STATS_FIELDS(JSON_FIELD)
#undef JSON_FIELD
    fprintf(f, ",\"fragmentation\":");
    json_fraction(f, bfc_stats_fragmentation(s));
    fputc('}', f);
}

static void json_arena(struct bfc__arena *a, FILE *f, struct bfc_ctx *ctx)
{
    bfc_stats_t s;
    memset(&s, 0, sizeof(s));
    add_arena(&s, a);
    s.bytes_reserved = a->st.bytes_reserved;
    s.peak_bytes_reserved = a->st.peak_reserved;
    s.bytes_limit = ctx->limit;
    s.num_shards = 1;
    fprintf(f, "{\"stream_id\":%" PRIu64 ",\"stream\":\"0x%" PRIxPTR "\",\"seq\":%" PRIu64 ",\"retired\":%s,\"stats\":",
            a->stream_id, (uintptr_t)a->stream, a->seq, atomic_load(&a->retired) ? "true" : "false");
    json_stats(f, &s, false);
    fprintf(f, ",\"regions\":[");
    struct bfc__region *r;
    bfc__list_for_each(r, &a->regions, alink) {
        fprintf(f,
                "%s{\"base\":\"0x%" PRIxPTR "\",\"size\":%zu,\"owner\":%" PRIu64
                ",\"large\":%s,\"live\":%zu,\"chunks\":[",
                r->alink.prev == &a->regions ? "" : ",", r->base, r->size, r->owner->stream_id, r->large ? "true" : "false",
                r->live);
        for (struct bfc__chunk *c = bfc__region_handle(r, r->base); c; c = c->next) {
            uint32_t st = atomic_load_explicit(&c->state, memory_order_relaxed);
            fprintf(f,
                    "%s{\"offset\":%zu,\"size\":%zu,\"requested\":%zu,\"state\":\"%s\",\"allocation_id\":%" PRId64
                    "}",
                    c == bfc__region_handle(r, r->base) ? "" : ",", (size_t)(c->ptr - r->base), c->size,
                    c->requested, state_name(st), c->alloc_id);
        }
        fprintf(f, "]}");
    }
    fprintf(f, "],\"bins\":[");
    for (uint32_t i = 0; i < BFC__NUM_BINS; i++) {
        size_t n, bytes;
        bfc__bins_tally(&a->bins, i, &n, &bytes);
        fprintf(f, "%s{\"bin\":%u,\"min_size\":%zu,\"count\":%zu,\"bytes\":%zu}", i ? "," : "", i,
                BFC__MIN_ALLOC << i, n, bytes);
    }
    fprintf(f, "]}");
}

int bfc_ctx_snapshot_json(bfc_ctx_t *ctx, FILE *f)
{
    if (!ctx || !f)
        return BFC_EINVAL;
    bfc__rcu_register(); /* before the arenas lock: a drain may call call_rcu */
    bfc_stats_t s;
    bfc_ctx_stats(ctx, &s);
    struct bfc__pool_stats ps;
    bfc__pool_stats(&ctx->pool, &ps);
    struct timespec ts = {0, 0};
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        ts = (struct timespec){0, 0}; /* time_unix_ns 0 rather than garbage */
    /* The OOM report under obs.lock, the shards under their locks: not
     * cancellable while f's write(2)s happen under them, nor anywhere a
     * cancellation would cut the snapshot short (mutex.h). */
    int cs = bfc__nocancel_begin();
    fprintf(f,
            "{\"version\":%d,\"time_unix_ns\":%" PRIu64 ",\"backend\":\"%s\",\"host\":%s,\"device\":%d,"
            "\"allow_growth\":%s,\"limit\":%zu,\"initial_region\":%zu,\"large_alloc\":%zu,\"max_internal_frag\":%zu",
            BFC__SNAPSHOT_VERSION, (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec,
            ctx->cfg.backend == BFC_BACKEND_CUDA ? "cuda" : "sim", ctx->is_host ? "true" : "false",
            ctx->cfg.device, ctx->cfg.allow_growth ? "true" : "false", ctx->limit, ctx->cfg.initial_region,
            ctx->cfg.large_alloc, ctx->env.max_frag);
    fprintf(f, ",\"totals\":");
    json_stats(f, &s, true);
    fprintf(f,
            ",\"pool\":{\"held\":%zu,\"peak_held\":%zu,\"committed\":%zu,\"free\":%zu,\"fenced\":%zu,"
            "\"departures\":%" PRIu64 ",\"fenced_departures\":%" PRIu64 ",\"fence_waits\":%" PRIu64 "}",
            ps.held, ps.peak_held, ps.committed, ps.free_bytes, ps.fenced_bytes, ps.departures, ps.fenced_departures,
            ps.fence_waits);
    bfc__oom_json(ctx, f); /* obs.lock only: no allocator lock is held here */
    fprintf(f, ",\"shards\":[");
    bool first = true;
    struct bfc__arena *a;
    bfc__lock(&ctx->arenas_lock);
    bfc__list_for_each(a, &ctx->arenas, all) {
        bfc__lock(&a->lock);
        if (!a->dead) {
            if (!first)
                fputc(',', f);
            first = false;
            json_arena(a, f, ctx);
        }
        bfc__unlock(&a->lock);
    }
    bfc__unlock(&ctx->arenas_lock);
    fprintf(f, "]}\n");
    int st = fflush(f) != 0 || ferror(f) ? BFC_EBACKEND : BFC_OK; /* as bfc_ctx_dump */
    bfc__nocancel_end(cs);
    return st;
}
