/*
 * obs_oom.c -- the out-of-memory report: what was asked, where the free
 * memory was, and one line saying why the request could not be served.
 *
 * "Out of memory" alone does not tell a user what to change.  With 270 MiB
 * free in the pool a 50 MB request can still fail, and the remedy depends on
 * why: the limit is simply reached (free live blocks or raise the limit),
 * the free memory sits in other streams' shards or behind fences on streams
 * still running (release idle streams, synchronise), it is cut into pieces
 * none of which is large enough (garbage_collection, fewer streams, a
 * larger initial_region), or the device itself refused (other processes
 * hold the GPU).  So every failed allocation builds a report, right after
 * the failure and before the callback runs:
 *
 *   - the request: size, chunk bytes needed, stream;
 *   - every live shard's free bytes, largest free chunk, pending (fenced)
 *     bytes, in-use and reserved bytes (bfc__shard_free_info, shard.c);
 *   - the pool's free spans, with the stream still fencing each where the
 *     pool records one (bfc__pool_spans, pool.c);
 *   - limit, reserved and unreserved bytes, and the diagnosis.
 *
 * The diagnosis is the first of these that holds (R = chunk bytes needed):
 *   R > limit                                     too large
 *   in use + R > limit                            limit reached
 *   limit - reserved >= R                         the backend refused
 *   own largest chunk or an unfenced span >= R,
 *     or limit - reserved + W >= R                memory was freed meanwhile
 *   another shard's largest chunk, a fenced run
 *     of adjacent spans, or the pending bytes >= R, or
 *     limit - reserved + W + fenced W >= R, or
 *     our run of free and pending chunks >= R, or
 *     (vmm) that + free and pending granules >= R  held by other streams
 *   otherwise                                     too fragmented
 * where W is the pool's wholly free segments with no fenced span, with
 * allow_growth and garbage collection (fenced W: those with one; a segment
 * may be free as several spans, and a run of adjacent spans with a fenced
 * one is one piece once the fences complete): the slow path
 * gives them back to the backend to make room, so they are room, not
 * pieces (four 16 MiB large blocks' segments, freed on a stream still
 * busy, are what a 32 MiB request waits for, not fragments).  W also holds
 * the granules released expandable shards left mapped, which go back to
 * the backend once their fence completes, whatever the configuration.
 * The last case is sound because limit - in use = unreserved + free in
 * shards + pending + free in the pool: when none of the pieces is as large
 * as R but their sum is, the bytes exist, only not in one piece.
 *
 * The report is gathered with no allocator lock held across it: each shard
 * and the pool are read under their own locks in turn (as bfc_ctx_stats
 * does), so each part is exact but the whole is not one instant.  That is
 * the price of never stopping the other streams to explain one failure.
 *
 * Where it goes: the callback reads it with bfc_ctx_oom_info (a pointer to
 * the caller's own copy, thread-local, so a concurrent failure elsewhere
 * cannot swap it); the context keeps the latest one (obs.lock) for
 * bfc_ctx_oom_info outside a callback and for the snapshot's "oom" object,
 * which the oom_dump file, shardbfc-stat and shardbfc-view show.
 *
 * Locking: obs.lock guards the callback, the latest report and the dump's
 * rate limit; it is never held while an allocator lock is taken, nor while
 * the callback runs or an oom_dump file is written, except that a snapshot
 * (the oom_dump file's too) prints the report to its file under it.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ctx.h"

/* Entries kept when the report's own arrays cannot be allocated. */
#define OOM_FALLBACK 16
/* Extra room for shards or spans that appear between counting and copying. */
#define OOM_SLACK 8

struct bfc__oom_report {
    bfc_oom_info_t info;
    uint64_t time_unix_ns;
    size_t nshards, nshards_total; /* copied, and listed when gathered (retired ones too) */
    size_t nshards_live;           /* of those, not retired: bfc_stats_t.num_shards */
    size_t nspans, nspans_total;
    uint64_t stream_id;             /* info.stream's, when have_id */
    bool have_id;
    struct bfc__shard_free *shards; /* meta-allocated (heap reports) */
    struct bfc__span_info *spans;
    size_t shards_cap, spans_cap;   /* bytes freed with them: cap entries */
    bool heap;                      /* the record itself is meta-allocated */
};

/* Is s the requesting stream's own shard?  By stream id, not handle: every
 * thread's per-thread default stream has the same handle (internal.h).  A
 * shard the stream released (retired) serves it nothing more. */
static bool requesting(const struct bfc__oom_report *r, const struct bfc__shard_free *s)
{
    return r->have_id && s->stream_id == r->stream_id && !s->retired;
}

/* The OOM callbacks the calling thread is inside, innermost first, each
 * with the report it is about (its own copy): a callback that allocates
 * and fails calls another context's callback, never its own again. */
struct oom_frame {
    const struct bfc_ctx *ctx;
    const bfc_oom_info_t *info;
    const struct oom_frame *outer;
};
static __thread const struct oom_frame *tls_frame;

/* A callback left by cancellation: its frame goes with it. */
static void frame_pop(void *v)
{
    tls_frame = ((const struct oom_frame *)v)->outer;
}

static const struct oom_frame *frame_of(const struct bfc_ctx *ctx)
{
    const struct oom_frame *f = tls_frame;
    while (f && f->ctx != ctx)
        f = f->outer;
    return f;
}

static void fmt_bytes(char *buf, size_t len, uint64_t v)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double d = (double)v;
    int i = 0;
    while (d >= 1024.0 && i < 4) {
        d /= 1024.0;
        i++;
    }
    if (i == 0) {
        snprintf(buf, len, "%" PRIu64 " B", v);
    } else {
        /* One decimal, written from integers: %f would follow the
         * application's LC_NUMERIC ("57,1 MiB" under a German locale). */
        uint64_t tenths = (uint64_t)llround(d * 10.0);
        snprintf(buf, len, "%" PRIu64 ".%u %s", tenths / 10, (unsigned)(tenths % 10), unit[i]);
    }
}

static const char *cause_name(bfc_oom_cause_t c)
{
    switch (c) {
    case BFC_OOM_TOO_LARGE:
        return "too_large";
    case BFC_OOM_LIMIT:
        return "limit";
    case BFC_OOM_BACKEND:
        return "backend";
    case BFC_OOM_TRANSIENT:
        return "transient";
    case BFC_OOM_HELD:
        return "held";
    case BFC_OOM_FRAGMENTED:
        return "fragmented";
    default:
        return "none";
    }
}

static void report_free(struct bfc__oom_report *r)
{
    if (!r || !r->heap)
        return;
    if (r->shards_cap)
        bfc__meta_free(r->shards, r->shards_cap * sizeof(*r->shards));
    if (r->spans_cap)
        bfc__meta_free(r->spans, r->spans_cap * sizeof(*r->spans));
    bfc__meta_free(r, sizeof(*r));
}

/* Fills r's lists: sized to what is there (plus slack) when the arrays can
 * be allocated, else the caller's fallback arrays of OOM_FALLBACK. */
static void gather(struct bfc_ctx *ctx, struct bfc__oom_report *r, struct bfc__shard_free *fb_shards,
                   struct bfc__span_info *fb_spans)
{
    size_t cap = bfc__shard_free_info(ctx, NULL, 0, NULL) + OOM_SLACK;
    r->shards = r->heap ? bfc__meta_alloc(cap * sizeof(*r->shards)) : NULL;
    if (r->shards) {
        r->shards_cap = cap;
    } else {
        cap = OOM_FALLBACK;
        r->shards_cap = 0;
    }
    struct bfc__shard_free *sh = r->shards ? r->shards : fb_shards;
    r->nshards_total = bfc__shard_free_info(ctx, sh, cap, &r->nshards_live);
    r->nshards = r->nshards_total < cap ? r->nshards_total : cap;
    if (!r->shards)
        r->shards = fb_shards;

    /* Fenced spans whose fences completed are free for every stream: a
     * report must not call them fenced (no allocation may have polled the
     * pool before this failure: a request above the limit does not). */
    bfc__pool_poll(&ctx->pool);
    cap = bfc__pool_spans(&ctx->pool, NULL, 0) + OOM_SLACK;
    r->spans = r->heap ? bfc__meta_alloc(cap * sizeof(*r->spans)) : NULL;
    if (r->spans) {
        r->spans_cap = cap;
    } else {
        cap = OOM_FALLBACK;
        r->spans_cap = 0;
    }
    struct bfc__span_info *sp = r->spans ? r->spans : fb_spans;
    r->nspans_total = bfc__pool_spans(&ctx->pool, sp, cap);
    r->nspans = r->nspans_total < cap ? r->nspans_total : cap;
    if (!r->spans)
        r->spans = fb_spans;
}

/* What the pool's free spans make, beside the figures they add to r->info
 * (pool_free, pool_largest_span, pool_fenced). */
struct pool_pieces {
    uint64_t open_largest;   /* largest unfenced span: usable now (touching ones have merged) */
    uint64_t fenced_largest; /* largest run of adjacent spans of one segment with a fenced one */
    uint64_t fenced_stream;  /* a stream fencing it */
    size_t fenced_spans;     /* its spans */
    /* Whole free segments (allow_growth with garbage collection) are not
     * pieces of a fixed size: the slow path gives them back to the backend
     * to make room for a segment as large as the request, so they count
     * with the unreserved bytes -- those with a fenced span once their
     * fences complete.  A segment may be free as several spans (fenced by
     * different streams, or one fenced beside an open one). */
    uint64_t whole_open, whole_fenced;
    uint64_t whole_stream;   /* a stream fencing whole_fenced */
    bool whole_several;      /* and not the only one */
    uint64_t whole_others;   /* of whole_fenced: fenced by other than own_sid */
};

static void run_end(struct pool_pieces *pp, uint64_t run, bool fenced, uint64_t sid, size_t spans)
{
    if (fenced && run > pp->fenced_largest) {
        pp->fenced_largest = run;
        pp->fenced_stream = sid;
        pp->fenced_spans = spans;
    }
}

/* The spans of one segment are adjacent in the list, in address order;
 * adjacent ones merge as their fences complete. */
static void pool_pieces(struct bfc__oom_report *r, uint64_t own_sid, bool whole_rule, struct pool_pieces *pp)
{
    bfc_oom_info_t *in = &r->info;
    memset(pp, 0, sizeof(*pp));
    for (size_t i = 0, j; i < r->nspans; i = j) {
        uint64_t seg_free = 0, seg_sid = 0, run = 0, run_sid = 0;
        uintptr_t end = 0;
        size_t run_n = 0;
        bool seg_fenced = false, seg_several = false, seg_others = false, run_fenced = false;
        for (j = i; j < r->nspans && r->spans[j].seg_base == r->spans[i].seg_base; j++) {
            const struct bfc__span_info *s = &r->spans[j];
            in->pool_free += s->size;
            if (s->size > in->pool_largest_span)
                in->pool_largest_span = s->size;
            if (s->fenced) {
                in->pool_fenced += s->size;
                seg_several |= seg_fenced && s->stream_id != seg_sid;
                seg_fenced = true;
                seg_sid = s->stream_id;
                seg_others |= s->stream_id != own_sid;
            } else if (s->size > pp->open_largest) {
                pp->open_largest = s->size;
            }
            seg_free += s->size;
            if (run_n && s->base != end) {
                run_end(pp, run, run_fenced, run_sid, run_n);
                run = 0, run_n = 0, run_fenced = false;
            }
            run += s->size;
            run_n++;
            if (s->fenced && !run_fenced)
                run_fenced = true, run_sid = s->stream_id;
            end = s->base + s->size;
        }
        run_end(pp, run, run_fenced, run_sid, run_n);
        if (!whole_rule || seg_free != r->spans[i].seg_size)
            continue;
        if (!seg_fenced) {
            pp->whole_open += seg_free;
            continue;
        }
        pp->whole_several |= seg_several || (pp->whole_fenced && pp->whole_stream != seg_sid);
        pp->whole_fenced += seg_free;
        pp->whole_stream = seg_sid;
        if (seg_others)
            pp->whole_others += seg_free;
    }
}

/* The diagnosis line, built a clause at a time: "; " between clauses,
 * nothing past its end. */
struct line {
    char *o;
    size_t len;
    size_t w;
    const char *sep;
};

static void clause(struct line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void clause(struct line *l, const char *fmt, ...)
{
    if (l->w >= l->len)
        return;
    int n = snprintf(l->o + l->w, l->len - l->w, "%s", l->sep);
    l->w += n > 0 ? (size_t)n : 0;
    if (l->w >= l->len)
        return;
    va_list ap;
    va_start(ap, fmt);
    n = vsnprintf(l->o + l->w, l->len - l->w, fmt, ap);
    va_end(ap);
    l->w += n > 0 ? (size_t)n : 0;
    l->sep = "; ";
}

/* The figures of r->info from the lists, and the diagnosis. */
static void diagnose(struct bfc_ctx *ctx, struct bfc__oom_report *r)
{
    bfc_oom_info_t *in = &r->info;
    struct bfc__pool_stats ps;
    bfc__pool_stats(&ctx->pool, &ps); /* free bytes are summed from the spans below, to match the list */
    size_t held = ps.held;
    in->bytes_limit = ctx->limit;
    in->bytes_reserved = held;
    in->bytes_unreserved = ctx->limit > held ? ctx->limit - held : 0;
    in->num_shards = r->nshards_live;
    in->num_pool_spans = r->nspans_total;
    /* The requesting stream's id: pool memory it fences is its own work's. */
    const uint64_t own_sid = r->have_id ? r->stream_id : UINT64_MAX;
    uint64_t own_pending = 0, own_range = 0, own_run = 0, own_in_use = 0, granule_room = 0;
    bool own = false;
    for (size_t i = 0; i < r->nshards; i++) {
        const struct bfc__shard_free *s = &r->shards[i];
        in->bytes_in_use += s->in_use;
        in->bytes_pending += s->pending_bytes;
        /* Expandable shards' whole free granules are room, not pieces:
         * unmapped, they can be mapped under any block (the escalation
         * takes them, once the fences of their streams allow). */
        granule_room += s->free_granules;
        if (requesting(r, s)) {
            /* What this stream could take with no map: an expandable
             * shard's bound (largest_free) counts mapped bytes scattered
             * over several chunks, which no retry would get in one. */
            in->stream_free += s->free_bytes;
            if (s->largest_ready > in->stream_largest_free)
                in->stream_largest_free = s->largest_ready;
            if (s->largest_range > own_range)
                own_range = s->largest_range;
            own = true;
            own_in_use += s->in_use;
            if (s->largest_run > own_run)
                own_run = s->largest_run;
            own_pending += s->pending_bytes;
        } else {
            in->other_free += s->free_bytes;
            if (s->largest_free > in->other_largest_free) {
                in->other_largest_free = s->largest_free;
                in->other_largest_stream = s->stream;
            }
        }
    }
    /* So do the mapped granules of reservations that released expandable
     * shards left in the pool's keeping: unmapped once their fence
     * completes, they are room under the limit (they are pool memory free
     * for no shard: in pool_free, and in pool_fenced while fenced). */
    const uint64_t gone_fenced = ps.gone_fenced, gone_all = ps.gone_fenced + ps.gone_open;
    in->pool_free += gone_all;
    in->pool_fenced += gone_fenced;
    struct pool_pieces pp;
    pool_pieces(r, own_sid, ctx->pool.growth && ctx->pool.recycle, &pp);

    const uint64_t R = in->rounded;
    /* Expandable arenas map whole granules: a request takes them whole, and
     * a limit that is not a multiple of the granule holds only the whole
     * ones (limit 3 MiB, granule 2 MiB: 2.5 MiB can never be mapped). */
    const uint64_t gran = ctx->vmm ? ctx->be->vmm_granule : 0;
    const uint64_t RG = !gran ? R : R > UINT64_MAX - gran ? UINT64_MAX : (R + gran - 1) / gran * gran;
    const uint64_t LG = gran ? in->bytes_limit / gran * gran : in->bytes_limit;
    const uint64_t unreserved = LG > held ? LG - held : 0;
    /* What holds the request, each once (the HELD rules, above). */
    const uint64_t room = unreserved + pp.whole_open + pp.whole_fenced + gone_all;
    const bool held_chunk = in->other_largest_free >= R, held_span = pp.fenced_largest >= R,
               held_pending = in->bytes_pending >= R, held_room = room >= RG, held_run = own_run >= R,
               held_granules = ctx->vmm && room + granule_room >= RG;
    char need[32], lim[32], a[32], b[32], c[32], d[32], e[32];
    fmt_bytes(need, sizeof need, R);
    fmt_bytes(lim, sizeof lim, in->bytes_limit);
    char *o = in->diagnosis;
    size_t len = sizeof in->diagnosis;
    if (R == 0 || R > in->bytes_limit) {
        in->cause = BFC_OOM_TOO_LARGE;
        fmt_bytes(a, sizeof a, in->size);
        snprintf(o, len, "request too large: %s (%zu bytes) is more than the whole %s limit", a, in->size, lim);
    } else if (RG > LG) {
        in->cause = BFC_OOM_TOO_LARGE;
        fmt_bytes(a, sizeof a, in->size);
        fmt_bytes(b, sizeof b, gran);
        fmt_bytes(c, sizeof c, LG);
        snprintf(o, len,
                 "request too large: %s (%zu bytes) needs more %s granules than the %s limit holds whole (%s)",
                 a, in->size, b, lim, c);
    } else if (in->bytes_in_use + R > LG) {
        in->cause = BFC_OOM_LIMIT;
        fmt_bytes(a, sizeof a, in->bytes_in_use);
        fmt_bytes(b, sizeof b, LG);
        if (LG == in->bytes_limit)
            snprintf(o, len,
                     "limit reached: %s in use + %s requested > %s limit; only freeing live blocks (or a "
                     "higher memory_limit) helps",
                     a, need, lim);
        else
            snprintf(o, len,
                     "limit reached: %s in use + %s requested > %s, what the %s limit holds in whole "
                     "granules; only freeing live blocks (or a higher memory_limit) helps",
                     a, need, b, lim);
    } else if (ctx->vmm && own && own_range < R && own_in_use == 0 && own_pending == 0) {
        /* Nothing in the shard's range, yet too short for the block: a
         * fallback range, and the larger one asked for was refused (ctx.c,
         * expand_regrow); or no range at all (expand.c, reserve()). */
        in->cause = BFC_OOM_FRAGMENTED;
        static const char again[] =
            "it reserves again once addresses come back (other ranges released, a higher RLIMIT_AS)";
        fmt_bytes(a, sizeof a, own_range);
        if (own_range)
            snprintf(o, len,
                     "address space: this stream's reserved range (%s, a fallback taken while addresses "
                     "were short) cannot hold %s, and a larger range was refused; %s",
                     a, need, again);
        else
            snprintf(o, len, "address space: no range for %s could be reserved for this stream; %s", need, again);
    } else if (ctx->vmm && own && own_range < R) {
        /* Addresses, not memory: the shard's reserved range has no free
         * run for the block (or the address space refused a range). */
        in->cause = BFC_OOM_FRAGMENTED;
        fmt_bytes(a, sizeof a, own_range);
        snprintf(o, len,
                 "fragmented addresses: this stream's reserved range has no free run of %s (its largest is "
                 "%s), though the limit may have room; freeing blocks between its holes, or "
                 "bfc_ctx_stream_release once it holds none, gives them back",
                 need, a);
    } else if (unreserved >= RG) {
        in->cause = BFC_OOM_BACKEND;
        fmt_bytes(a, sizeof a, in->bytes_unreserved);
        snprintf(o, len,
                 "the device refused: %s of the limit is unreserved, but the backend could not provide %s "
                 "for %s (device memory taken by others?)",
                 a, ctx->vmm ? "the granules" : "a region", need);
    } else if (in->stream_largest_free >= R || pp.open_largest >= R) {
        in->cause = BFC_OOM_TRANSIENT;
        fmt_bytes(a, sizeof a, in->stream_largest_free > pp.open_largest ? in->stream_largest_free : pp.open_largest);
        snprintf(o, len,
                 "memory was freed meanwhile: %s in one piece is usable by this stream now; a retry may "
                 "succeed",
                 a);
    } else if (unreserved + pp.whole_open + ps.gone_open >= RG) {
        in->cause = BFC_OOM_TRANSIENT;
        fmt_bytes(a, sizeof a, pp.whole_open + ps.gone_open);
        fmt_bytes(b, sizeof b, unreserved);
        snprintf(o, len,
                 "memory was freed meanwhile: wholly free pool segments or released reservations (%s) and "
                 "the unreserved %s make room for %s once given back to the device; a retry may succeed",
                 a, b, need);
    } else if (held_chunk || held_span || held_pending || held_room || held_run || held_granules) {
        in->cause = BFC_OOM_HELD;
        /* Segments fenced by the requesting stream alone: its own queued
         * work holds them (it may take them as they are, but not give them
         * back to make one piece before that work is done). */
        bool own_work = held_room && !held_chunk && !held_span && !held_pending && !held_run && gone_fenced == 0 &&
                        pp.whole_others == 0;
        int w = snprintf(o, len, own_work ? "memory free but held by this stream's own queued work:"
                                          : "memory free but held by other streams:");
        struct line l = {o, len, w > 0 ? (size_t)w : 0, " "};
        if (held_chunk) {
            fmt_bytes(a, sizeof a, in->other_largest_free);
            fmt_bytes(b, sizeof b, in->other_free);
            char why[192] = "";
            if (ctx->vmm && !held_granules && !held_pending) {
                /* No unmap makes room, and no pending free is large enough
                 * to: the chunk's granules hold that stream's live blocks
                 * too, and stay its own until they are freed -- the bound
                 * of one granule per stream with a block (many streams'
                 * small blocks fill the limit).  With the pending clause
                 * too the line would pass the diagnosis's 320 bytes. */
                fmt_bytes(c, sizeof c, gran);
                snprintf(why, sizeof why,
                         " in granules its live blocks hold (a stream with a block holds a %s granule or more: "
                         "%" PRIu64 " fill this limit)",
                         c, LG / gran);
            }
            clause(&l, "stream %p's shard has a free chunk of %s (%s free in other shards)%s",
                   (void *)in->other_largest_stream, a, b, why);
        }
        if (held_span) {
            fmt_bytes(a, sizeof a, pp.fenced_largest);
            if (pp.fenced_spans > 1)
                clause(&l, "%zu adjacent pool spans, %s in all, one piece once the fences of stream id %" PRIu64
                           " and any others complete",
                       pp.fenced_spans, a, pp.fenced_stream);
            else
                clause(&l, "a pool span of %s is still fenced by stream id %" PRIu64, a, pp.fenced_stream);
        } else if (held_room && gone_fenced) {
            fmt_bytes(a, sizeof a, gone_fenced);
            clause(&l,
                   "reservations that shards gave up (a stream release or a trim) with %s mapped, still "
                   "fenced (stream id %" PRIu64
                   "'s the largest), make room for %s once their fences complete",
                   a, ps.gone_stream, need);
        } else if (held_room) {
            fmt_bytes(a, sizeof a, pp.whole_fenced);
            clause(&l,
                   "wholly free pool segments of %s, still fenced (stream id %" PRIu64
                   "%s), make room for %s once their fences complete",
                   a, pp.whole_stream, own_work ? ", this stream" : pp.whole_several ? " among others" : "", need);
        }
        if (held_run && !held_pending) {
            fmt_bytes(a, sizeof a, own_run);
            clause(&l, "this stream's pending frees and the free memory beside them make %s in one piece once "
                       "their fences complete",
                   a);
        }
        if (held_granules && !held_chunk && !held_span && !held_pending && !held_run && !held_room) {
            fmt_bytes(a, sizeof a, granule_room);
            clause(&l, "granules of %s under free and pending chunks of the shards can be unmapped and mapped "
                       "again for it once the work of their streams completes",
                   a);
        }
        if (held_pending) {
            fmt_bytes(a, sizeof a, in->bytes_pending);
            fmt_bytes(b, sizeof b, own_pending);
            clause(&l, "%s of freed blocks wait for the earlier work of the streams that freed them (%s of it in "
                       "this stream's shard)",
                   a, b);
        }
        fmt_bytes(a, sizeof a, in->stream_largest_free);
        l.sep = "; ";
        clause(&l, "this stream's largest free chunk is %s, %s needed", a, need);
    } else {
        in->cause = BFC_OOM_FRAGMENTED;
        uint64_t largest = in->stream_largest_free;
        if (in->other_largest_free > largest)
            largest = in->other_largest_free;
        if (in->pool_largest_span > largest)
            largest = in->pool_largest_span;
        if (in->bytes_unreserved > largest)
            largest = in->bytes_unreserved;
        fmt_bytes(a, sizeof a, in->stream_free + in->other_free + in->pool_free + in->bytes_unreserved);
        fmt_bytes(b, sizeof b, in->stream_free);
        fmt_bytes(c, sizeof c, in->other_free);
        fmt_bytes(d, sizeof d, in->pool_free);
        fmt_bytes(e, sizeof e, largest);
        int w = snprintf(o, len,
                         "free memory too fragmented: %s free (this stream %s, other streams %s, pool %s, the "
                         "rest unreserved) but the largest piece is %s, %s needed",
                         a, b, c, d, e, need);
        /* Growth without garbage collection: the pool keeps the segments it
         * holds (no cudaFree on the allocation path), even where freeing them
         * would make room for one of the size wanted. */
        if (w > 0 && (size_t)w < len && ctx->cfg.allow_growth && !ctx->vmm && !ctx->cfg.garbage_collection &&
            in->pool_free + in->bytes_unreserved >= R)
            snprintf(o + w, len - (size_t)w,
                     "; the pool keeps its cached segments (%s) without garbage_collection: bfc_ctx_trim "
                     "gives them back",
                     d);
    }
}

/* A report of the failure just seen.  Heap-allocated when it can be, else
 * built in *local with the caller's fallback arrays (and not kept). */
static struct bfc__oom_report *report_make(struct bfc_ctx *ctx, size_t n, bfc_stream_t stream,
                                           struct bfc__oom_report *local, struct bfc__shard_free *fb_shards,
                                           struct bfc__span_info *fb_spans)
{
    struct bfc__oom_report *r = bfc__meta_zalloc(sizeof(*r));
    if (r) {
        r->heap = true;
    } else {
        r = local;
        memset(r, 0, sizeof(*r));
    }
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) == 0)
        r->time_unix_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    r->info.size = n;
    /* Saturated where the rounding would wrap (no chunk is that large). */
    r->info.rounded = n > SIZE_MAX - (BFC__MIN_ALLOC - 1) ? SIZE_MAX : bfc__round256(n);
    r->info.stream = stream;
    /* On the requesting thread, which alone can name its per-thread stream;
     * in a read section of its own, as the thread-local hit reads the
     * cached shard, which a retirement may free after a grace period (the
     * failed allocation has left its section). */
    bfc__rcu_lock();
    r->have_id = bfc__shard_stream_id(ctx, stream, &r->stream_id) == BFC_OK;
    bfc__rcu_unlock();
    gather(ctx, r, fb_shards, fb_spans);
    diagnose(ctx, r);
    /* A kept report must not point at the caller's stack: a list that
     * could not be allocated is left out (its totals still count). */
    if (r->heap && !r->shards_cap) {
        r->shards = NULL;
        r->nshards = 0;
    }
    if (r->heap && !r->spans_cap) {
        r->spans = NULL;
        r->nspans = 0;
    }
    return r;
}

int bfc_ctx_set_oom_callback(bfc_ctx_t *ctx, bfc_oom_fn fn, void *arg)
{
    if (!ctx || !ctx->obs.lock_ready)
        return BFC_EINVAL;
    bfc__lock(&ctx->obs.lock);
    ctx->obs.oom_fn = fn;
    ctx->obs.oom_arg = fn ? arg : NULL;
    bfc__unlock(&ctx->obs.lock);
    return BFC_OK;
}

bool bfc__oom_callback(struct bfc_ctx *ctx, size_t n, bfc_stream_t stream,
                       int (*stats)(bfc_ctx_t *ctx, bfc_stats_t *out))
{
    if (!ctx->obs.lock_ready)
        return false;
    struct bfc__oom_report local;
    struct bfc__shard_free fb_shards[OOM_FALLBACK];
    struct bfc__span_info fb_spans[OOM_FALLBACK];
    struct bfc__oom_report *r = report_make(ctx, n, stream, &local, fb_shards, fb_spans);
    bfc_oom_info_t info = r->info; /* the callback's own copy */
    struct bfc__oom_report *old = NULL;

    bfc__lock(&ctx->obs.lock);
    if (r->heap) {
        old = ctx->obs.last_oom;
        ctx->obs.last_oom = r;
    }
    bfc_oom_fn fn = ctx->obs.oom_fn;
    void *arg = ctx->obs.oom_arg;
    bfc__unlock(&ctx->obs.lock);
    report_free(old);
    /* A failure inside this context's own callback on this thread is
     * final: calling the callback again would recurse for as long as it
     * allocates (until the stack ran out). */
    if (!fn || frame_of(ctx))
        return false;
    bfc_stats_t s;
    (void)stats(ctx, &s);
    /* No lock held: the callback may free (or allocate) on this context,
     * and may fail again inside (that failure's report is the last one;
     * bfc_ctx_oom_info inside still gives this one). */
    struct oom_frame frame = {ctx, &info, tls_frame};
    tls_frame = &frame;
    int retry;
    pthread_cleanup_push(frame_pop, &frame);
    retry = fn(ctx, n, stream, &s, arg);
    pthread_cleanup_pop(1);
    return retry != 0;
}

int bfc_ctx_oom_info(bfc_ctx_t *ctx, bfc_oom_info_t *out)
{
    if (!ctx || !out)
        return BFC_EINVAL;
    const struct oom_frame *f = frame_of(ctx);
    if (f) {
        *out = *f->info;
        return BFC_OK;
    }
    memset(out, 0, sizeof(*out));
    if (!ctx->obs.lock_ready)
        return BFC_ESTATE;
    bfc__lock(&ctx->obs.lock);
    const struct bfc__oom_report *r = ctx->obs.last_oom;
    if (r)
        *out = r->info;
    bfc__unlock(&ctx->obs.lock);
    return r ? BFC_OK : BFC_ESTATE;
}

/* A JSON string of our own making (printable ASCII): quotes and
 * backslashes escaped all the same. */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fputc('\\', f);
        if ((unsigned char)*s >= 0x20)
            fputc(*s, f);
    }
    fputc('"', f);
}

void bfc__oom_json(struct bfc_ctx *ctx, FILE *f)
{
    if (!ctx->obs.lock_ready) {
        fputs(",\"oom\":null", f);
        return;
    }
    bfc__lock(&ctx->obs.lock);
    const struct bfc__oom_report *r = ctx->obs.last_oom;
    if (!r) {
        bfc__unlock(&ctx->obs.lock);
        fputs(",\"oom\":null", f);
        return;
    }
    const bfc_oom_info_t *in = &r->info;
    fprintf(f,
            ",\"oom\":{\"time_unix_ns\":%" PRIu64 ",\"size\":%zu,\"rounded\":%zu,\"stream\":\"0x%" PRIxPTR
            "\",\"cause\":\"%s\",\"diagnosis\":",
            r->time_unix_ns, in->size, in->rounded, (uintptr_t)in->stream, cause_name(in->cause));
    json_str(f, in->diagnosis);
    fprintf(f,
            ",\"bytes_limit\":%" PRIu64 ",\"bytes_reserved\":%" PRIu64 ",\"bytes_unreserved\":%" PRIu64
            ",\"bytes_in_use\":%" PRIu64 ",\"bytes_pending\":%" PRIu64 ",\"stream_free\":%" PRIu64
            ",\"stream_largest_free\":%" PRIu64 ",\"other_free\":%" PRIu64 ",\"other_largest_free\":%" PRIu64
            ",\"other_largest_stream\":\"0x%" PRIxPTR "\",\"pool_free\":%" PRIu64 ",\"pool_largest_span\":%" PRIu64
            ",\"pool_fenced\":%" PRIu64 ",\"num_pool_spans\":%" PRIu64 ",\"num_shards\":%" PRIu64 ",\"shards\":[",
            in->bytes_limit, in->bytes_reserved, in->bytes_unreserved, in->bytes_in_use, in->bytes_pending,
            in->stream_free, in->stream_largest_free, in->other_free, in->other_largest_free,
            (uintptr_t)in->other_largest_stream, in->pool_free, in->pool_largest_span, in->pool_fenced,
            in->num_pool_spans, in->num_shards);
    for (size_t i = 0; i < r->nshards; i++) {
        const struct bfc__shard_free *s = &r->shards[i];
        fprintf(f,
                "%s{\"stream_id\":%" PRIu64 ",\"stream\":\"0x%" PRIxPTR "\",\"requesting\":%s,\"retired\":%s"
                ",\"expandable\":%s,\"free\":%zu,\"largest_free\":%zu,\"largest_ready\":%zu,\"pending\":%zu"
                ",\"in_use\":%zu,\"reserved\":%zu}",
                i ? "," : "", s->stream_id, (uintptr_t)s->stream,
                requesting(r, s) ? "true" : "false", s->retired ? "true" : "false",
                s->expandable ? "true" : "false", s->free_bytes, s->largest_free, s->largest_ready,
                s->pending_bytes, s->in_use, s->reserved);
    }
    fputs("],\"pool_spans\":[", f);
    for (size_t i = 0; i < r->nspans; i++) {
        const struct bfc__span_info *s = &r->spans[i];
        fprintf(f, "%s{\"base\":\"0x%" PRIxPTR "\",\"size\":%zu,\"fenced\":%s,\"stream_id\":%" PRIu64 "}",
                i ? "," : "", s->base, s->size, s->fenced ? "true" : "false", s->stream_id);
    }
    fprintf(f, "],\"shards_omitted\":%zu,\"spans_omitted\":%zu}", r->nshards_total - r->nshards,
            r->nspans_total - r->nspans);
    bfc__unlock(&ctx->obs.lock);
}

void bfc__oom_fini(struct bfc_ctx *ctx)
{
    report_free(ctx->obs.last_oom);
    ctx->obs.last_oom = NULL;
}
