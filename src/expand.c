/*
 * expand.c -- expandable arenas: one shard's chunks in one reserved range of
 * virtual addresses, device memory mapped behind it granule by granule.
 *
 * With virtual memory (vmm=on, or auto where the backend has it) a shard
 * reserves, at its first allocation, a range of addresses twice as large as
 * the memory limit (rounded up to the granule; less only where the address
 * space refuses that: reserve(), below) and makes it its one region: one
 * free chunk covering it, cut by TensorFlow's BFC exactly as a classic
 * region is (bins, best fit, the split rule, coalescing: arena.c).  Only the
 * granules under blocks handed out are backed by memory:
 *
 *   - Mapping.  When the chunk an allocation takes covers granules that are
 *     not mapped, exactly those are mapped (bfc__pool_vmm_map charges them
 *     against the limit first) before the block is returned.  The unmapped
 *     end of the range is one big free chunk, so an arena grows by the
 *     granules a request needs at its end -- no doubling -- and a hole left
 *     by an unmap is refilled the same way.  The common path tests one
 *     address: every granule below ready_end is ready, and a block that
 *     ends below it is taken as in a classic region.
 *   - Unmapping.  Granules wholly inside free chunks may go back to the
 *     device.  Queued work of the owner stream may still use them (a free on
 *     the owner's stream is reusable at once), so they are first marked
 *     "leaving" (ready cleared, mapped kept) and a departure fence is
 *     recorded on the owner stream; they are unmapped only once it has
 *     completed.  An allocation that lands on a leaving granule before then
 *     simply takes it back (sets ready again): only allocations make work
 *     touch memory, so a granule still leaving when the fence completes has
 *     been free since before the fence, and nothing queued can touch it.  A
 *     newer record of the fence covers every older mark.
 *   - When.  Map and unmap calls cost tens of microseconds on a GPU, so
 *     none is made on the common path, and a shard keeps free granules
 *     mapped (hysteresis, as jemalloc keeps dirty pages and a CUDA memory
 *     pool keeps memory between its synchronisation points) until one of:
 *     (a) Growth elsewhere.  An allocation whose block lacks mapped granules,
 *     while other shards say they hold spare granules (pool.vmm_idle, a hint
 *     each shard publishes at its policy checks, never at a plain free: its
 *     free whole granules beyond what it keeps -- the threshold and its
 *     slack, see (c) --, granules its releases marked to leave included),
 *     goes to the slow path, which asks every other shard to mark and fence
 *     its spare granules and unmap those whose fence has completed, then
 *     maps.  Granules marked while the owner's stream was busy (on a GPU, the
 *     usual case at a free) are offered so: left for the owner's next check,
 *     they would stay mapped beside what the growth maps (a 16-granule free
 *     behind queued work, then 12 granules grown elsewhere: 30 granules held
 *     instead of 14).  What a shard keeps for its own churn stays, with one
 *     exception, the loan: when the growth would raise the most the context
 *     has held (bfc__pool_would_peak), shards whose slack is lendable
 *     (pool.vmm_lendable, the second hint) give it too, as much as the growth
 *     needs.  Below that peak a shard's slack costs no memory the context has
 *     not held already, and handing it over would cost a pair of device calls
 *     each way every time the two shards' use swings (two threads churning
 *     one context made 28 map calls per 1,000 allocations that way and ran at
 *     a sixth of their speed); at the peak, it is what one allocator over the
 *     device would reuse -- a stream gone quiet no longer holds what a busy
 *     one must map afresh (tests/traces server2: overhead 1.265 without
 *     loans, 1.012 with).  A loan stays out, each such growth taking its
 *     part, until the lender maps again: it needed the memory back, so it
 *     stops lending for lend_every of its allocations (256, doubled at each
 *     take-back up to 16,384, halved when a loan stayed out that long; it
 *     lends again at its first policy check after that).  The cap is low on
 *     purpose: a shard that does not lend keeps its slack while the others
 *     peak, and shards whose use swings all end up at the cap (perf's
 *     inference workload, 4 and 8 threads: peak reserved 1.10-1.19 times the
 *     peak requested with a cap of 2^24, 1.03-1.08 with 2^14, at 0.6-1.5 map
 *     calls per 1,000 allocations instead of 0.3-1.1).  A loan counts what
 *     the lender gives -- granules unmapped or marked to leave -- not what it
 *     was asked for: free bytes in granules shared with live blocks cannot be
 *     unmapped, and the growth then asks the next shard.
 *     When another shard cannot map within the limit, its slow path takes
 *     everything free, slack included, and waits for those fences with no
 *     lock held (on a device; not on SIM, where a held stream only ends
 *     when a test drains it): memory changes hands between streams, so
 *     shards that peak at different times need no higher limit than one
 *     allocator over the device would.
 *     (b) Growth here.  Before mapping, the shard marks and fences its own
 *     free granules beyond release_threshold (the largest free chunks
 *     first) and unmaps them if the fence has completed, so that growth in
 *     one place while memory lies free in another -- fragmentation -- does
 *     not raise the peak reserved: as many bytes as the map would raise
 *     the most the context has held (bfc__pool_peak_excess); below that
 *     peak, as many as it maps while the peak is still rising (a map call
 *     raised it within the last PEAK_SETTLED_MAPS of the context's), and
 *     none once it has settled.  While the peak rises, whole free granules
 *     taken early are what keeps it down later, when small blocks have
 *     cut them (train_resnet18 in tests/traces: 1.088 times its peak
 *     requested without it, 1.057 with; four streams, server4: 1.087 and
 *     1.031).  Once it has settled, holding them costs no memory the
 *     context has not held -- the loans' rule, (a) -- and unmapping them
 *     only buys a map call when they are used again: sixteen streams of
 *     perf's inference workload in one context made 1.60 map and 1.72
 *     unmap calls per 1,000 allocations in steady state when every growth
 *     released (perf/interleave, last of six passes), 1.00 and 0.96 with
 *     this rule, at the same overhead (1.050, 1.052), and a driver that
 *     runs such calls one at a time queues on them (--sim-vmm-cost, perf/
 *     README.md).  The cost is at most one unmap call per run, beside a
 *     map call that is made anyway -- unless the next growth maps those
 *     granules again, and the one after unmaps them again: blocks that
 *     take turns over the same granules (5 MiB, then 7 MiB, beside a live
 *     256 KiB block: two map and two unmap calls per turn, for ever).
 *     Such churn at growth (GROW_CHURN_MAPS maps of what growth unmapped
 *     within GROW_CHURN_WINDOW allocations) earns a slack at growth,
 *     grow_slack, a granule and twice as much at each recurrence, kept
 *     beside the threshold, halved after CALM_ALLOCS allocations without
 *     such churn; the traces' rarer cases leave it at 0.
 *     (c) Frees.  A free tests one figure: bytes_in_use against a low-water
 *     mark (rearm()); crossing it -- the free mapped bytes exceed what the
 *     shard keeps by a granule more than at the last check, or, after a
 *     map, at all -- makes the shard release its free granules beyond
 *     release_threshold (free_budget(): it keeps the threshold, as a CUDA
 *     pool trims to its threshold; granules still waiting for their fence
 *     count as gone, staying_idle()) when they exceed the threshold plus
 *     its slack; with a threshold, the next such release marks granules
 *     only once another threshold's worth (a granule at least) stays free
 *     (x->band, cleared by a map), while the checks in between unmap what
 *     has left.  Every release but trim, retirement and the slow path keeps
 *     the threshold, in whole granules (to_threshold()).  The slack tracks
 *     churn:
 *     when a release at a free is followed by a map of memory again, it
 *     was a wasted pair of calls and the slack doubles (from a granule);
 *     when nothing of it came back before the next such release and a
 *     thousand allocations (CALM_ALLOCS) passed without churn, it halves.
 *     A shard that frees and reuses the same memory thus settles
 *     with no device calls and no scans; one that shrinks gives back what
 *     exceeds its slack.  The slack shrinks only at such a release,
 *     though: one grown past all the shard ever holds free stays (shards
 *     of perf's inference workload reach the reservation's size), and
 *     the memory it covers would leave only by loans -- when another
 *     shard's growth would raise the peak reserved -- or by trim, as a
 *     caching allocator's segments do.  Hence the decay: the first free
 *     after every 1,024 allocations (BFC__DECAY_CHECK_ALLOCS; the free's
 *     second test: num_allocs against decay_at) notes what the shard
 *     holds free, and once slack_decay_ms (10 s by default) have passed,
 *     the least it held free at any check of that period, beyond the
 *     threshold, was never used in it and goes (decay_check(), below),
 *     slack or no.
 *     (d) trim, and retirement (departure, below).
 *     The default threshold is 0, as cudaMemPoolAttrReleaseThreshold's:
 *     with (a) and (b), what the shards hold grows only when their free
 *     whole granules are spent, so the peak stays close to the blocks'
 *     (the rest lies in granules shared with live blocks), and (c)'s
 *     slack, not the threshold, keeps the device calls off the common
 *     path.  A larger threshold makes a shard keep more (and raises the
 *     peak: detect and train traces, tests/traces, by 8 and 5% at 64 MiB)
 *     without saving device calls on every workload (vit_b16: 14 unmap
 *     calls per 1,000 allocations at 0, 39 at 4 MiB, 11 at 64 MiB).
 *     A release marks only granules wholly inside free chunks, found in
 *     the bins of chunks of a granule or more: it never walks the chunks
 *     in use.
 *   - Stream safety across shards.  An unmapped granule has no memory; the
 *     next va_map of the same address, by this shard, gets fresh memory.
 *     Another shard never sees this address range: it maps its own range,
 *     with memory the device gives afresh, so memory changes hands only
 *     through unmap -> map, and the unmap waited for the fence.
 *   - Departure.  A shard with nothing live that sheds its regions (trim,
 *     retirement, garbage collection) gives its whole reservation to the
 *     pool with its departure fence; the pool releases it once the fence
 *     completed, and counts its mapped bytes against the limit until then.
 *     A new shard of the same stream takes it back instead of reserving
 *     afresh (bfc__pool_vmm_adopt), fence or not, its granules mapped and
 *     ready: the stream's earlier work may still use them, and its later
 *     work runs after that, as a classic span guarded by the stream is the
 *     stream's to take.  Without it a stream whose shard was released while
 *     its work was queued could not allocate what its own departed memory
 *     held back from the limit until that work finished (found by make
 *     fuzz: limit 8 MiB, 6 MiB departed, 2.5 MB refused).  A shard that
 *     already holds a reservation when its stream's old one departs (the
 *     released shard still owned a block pending on another stream) trades
 *     its own for it once it has nothing live and cannot fit (ctx.c,
 *     expand_trade); the pool hands out the one with the most mapped.  A
 *     shard in a fallback range (reserve(), below) with nothing live that
 *     is asked for a block its range cannot hold makes a new reservation
 *     first, then lets the old one depart (ctx.c, expand_regrow).
 *
 * large_alloc is ignored: a big block is one chunk like any other, and its
 * granules go back when it is freed.
 *
 * Invariants (bfc__expand_check_locked, under the arena lock): ready is a
 * subset of mapped; every granule below ready_end is ready; mapped_bytes
 * and leaving_bytes are the counts of the bits; every granule under a chunk in use or pending is ready; the
 * arena's bytes_reserved is mapped_bytes.
 *
 * Layering: the arena (arena.c) calls in here; this file calls only the
 * layers below -- the pool, fences, regions, the backend -- never back
 * into the arena: the arena makes the reservation's region itself
 * (bfc__arena_expand_locked).  The escalation that strings these
 * primitives together -- (a) above, waits, retry_ms -- is the context's
 * (ctx.c), as the classic arena's is.
 *
 * Locking: everything here runs under the owner arena's lock, which the
 * callers hold; the pool lock is taken beneath it for charges and the
 * backend's book lock beneath that (backend.h), never the other way.  The
 * escalation (ctx.c) drops the arena lock to reach other shards
 * (arenas_lock, then each arena lock in turn, never two) and to wait for
 * fences.
 */
#include <string.h>

#include "arena.h"

#define GRAN(x) ((size_t)1 << (x)->shift)

/* A shard whose loan of slack was taken back (it mapped again while the
 * loan was out) lends again after lend_every of its own allocations, at
 * its next policy check: LEND_MIN at first, doubled at each take-back,
 * halved when a loan stayed out that long, between LEND_MIN and LEND_MAX
 * ("When", (a)). */
#define LEND_MIN 256
#define LEND_MAX ((uint64_t)1 << 14)

/* Growth below the peak reserved releases free granules of its shard only
 * while the peak is still rising: until this many of the context's map
 * calls have passed since one raised it ("When", (b)). */
#define PEAK_SETTLED_MAPS 64

static bool bit(const uint64_t *w, size_t g)
{
    return (w[g >> 6] >> (g & 63)) & 1;
}

static void set_bit(uint64_t *w, size_t g, bool on)
{
    if (on)
        w[g >> 6] |= (uint64_t)1 << (g & 63);
    else
        w[g >> 6] &= ~((uint64_t)1 << (g & 63));
}

/* The first of n bits at or after g that is clear (n if none), a word at
 * a time. */
static size_t first_clear(const uint64_t *w, size_t n, size_t g)
{
    while (g < n) {
        uint64_t v = ~w[g >> 6] >> (g & 63);
        if (v) {
            g += (size_t)__builtin_ctzll(v);
            break;
        }
        g = (g | 63) + 1;
    }
    return g < n ? g : n;
}

/* The decay's clock: CLOCK_MONOTONIC_COARSE in milliseconds (a tick or so
 * of resolution is plenty for a decay of seconds; 0 if the clock fails,
 * which only postpones a decay), or the environment's own (tests). */
static uint64_t now_ms(const struct bfc__arena_env *env)
{
    if (env->decay_clock)
        return env->decay_clock();
    return bfc__clock_ns(CLOCK_MONOTONIC_COARSE) / 1000000u;
}

/* ------------------------------------------------------------- set-up */

static void expand_free(struct bfc__arena *a, struct bfc__expand *x)
{
    if (x->fence)
        bfc__pool_fence_put(a->env->pool, x->fence);
    bfc__meta_free(x->gone, sizeof(*x->gone));
    bfc__meta_free(x->mapped, ((x->ngran + 63) / 64) * sizeof(uint64_t));
    bfc__meta_free(x->ready, ((x->ngran + 63) / 64) * sizeof(uint64_t));
    bfc__meta_free(x, sizeof(*x));
}

/* The limit rounded up to the granule; rounded down where that would not
 * fit a size_t (a limit within a granule of 2^64: rounding up wrapped to
 * 0, and every reservation failed with BFC_EBACKEND). */
static size_t limit_bytes(const struct bfc__arena_env *env)
{
    size_t g = env->be->vmm_granule, full = bfc__round_up(env->limit, g);
    return full ? full : env->limit & ~(g - 1);
}

/* The addresses a shard reserves: twice the limit (rounded up to the
 * granule; the limit itself where twice would not fit a size_t).  Mapped
 * memory never passes the limit, but addresses are not reused as freely:
 * best fit leaves holes between live blocks that a larger request does
 * not fit, and a range of exactly the limit ran out while the limit still
 * had room (limit 64 MiB, one stream: three blocks of 20 MiB, the outer
 * two freed, a 30 MiB request refused with 20 MiB mapped).  The spare half
 * costs addresses only (and the bitmaps' bits). */
static size_t range_bytes(const struct bfc__arena_env *env)
{
    size_t full = limit_bytes(env);
    return full <= SIZE_MAX / 2 ? 2 * full : full;
}

/*
 * The reservation.  Twice the limit when the address space takes it
 * (range_bytes), else the limit, so that this shard can grow to everything
 * the others give back.  Where neither fits -- a process under RLIMIT_AS
 * (ulimit -v), valgrind, thousands of shards each reserving a large limit
 * (128 TiB of user addresses hold about 1,000 ranges of 128 GiB and their
 * handle tables) -- a sixteenth of the limit, halved until the
 * address space takes it but never below `need` (the block that asks,
 * rounded to the granule): the shard then grows within that range only
 * (until, holding nothing live, it is asked for a block the range cannot
 * hold: ctx.c's expand_regrow reserves again and only then gives the range
 * up), and
 * the sixteenth leaves room for many more shards where a plain halving would
 * let each next shard take half of what is left.  BFC_ENOMEM when not even
 * `need` fits.
 */
static int reserve(const struct bfc__arena_env *env, size_t need, size_t most, size_t *size, uintptr_t *base)
{
    size_t g = env->be->vmm_granule, range = range_bytes(env), full = limit_bytes(env);
    size_t min = need < full ? bfc__round_up(need ? need : 1, g) : full;
    int st = BFC_ENOMEM;
    if (range <= most && (st = bfc__pool_vmm_reserve(env->pool, range, base)) == BFC_OK)
        *size = range;
    if (st == BFC_ENOMEM && range > full && full <= most &&
        (st = bfc__pool_vmm_reserve(env->pool, full, base)) == BFC_OK)
        *size = full;
    for (size_t s = full / 16 & ~(g - 1); st == BFC_ENOMEM && min < full && min <= most; s = s / 2 & ~(g - 1)) {
        if (s < min)
            s = min;
        if (s > most)
            continue;
        st = bfc__pool_vmm_reserve(env->pool, s, base);
        if (st == BFC_OK)
            *size = s;
        if (s == min)
            break;
    }
    return st;
}

static void rearm(struct bfc__arena *a, bool mapped);
static size_t first_unready(const struct bfc__expand *x, size_t g);

/* A departed reservation of our own stream, adopted (bfc__pool_vmm_adopt),
 * becomes ours with its granules still mapped: all of them ready, since
 * whatever our stream queued on them before the departure runs before what
 * it queues now.  Its record serves as ours. */
static void adopt(struct bfc__arena *a, struct bfc__expand *x, struct bfc__vmm_gone *g0)
{
    x->mapped = g0->bits;
    x->gone = g0;
    memcpy(x->ready, x->mapped, g0->words * sizeof(uint64_t));
    x->mapped_bytes = g0->mapped;
    for (size_t i = 0; i < x->ngran; i++)
        if (bit(x->mapped, i))
            x->map_top = i + 1;
    x->ready_end = x->base + (first_unready(x, 0) << x->shift);
    a->st.bytes_reserved += x->mapped_bytes;
    if (a->st.bytes_reserved > a->st.peak_reserved)
        a->st.peak_reserved = a->st.bytes_reserved;
}

int bfc__expand_create_locked(struct bfc__arena *a, size_t need, size_t most)
{
    const struct bfc__arena_env *env = a->env;
    size_t g = env->be->vmm_granule;
    struct bfc__expand *x = bfc__meta_zalloc(sizeof(*x));
    if (!x)
        return BFC_ENOMEM;
    x->shift = (unsigned)__builtin_ctzll(g);
    /* The departure fence record first: once a reservation is adopted,
     * nothing may fail but what can give it back (below). */
    x->fence = bfc__pool_fence_get(env->pool);
    if (!x->fence) {
        bfc__meta_free(x, sizeof(*x));
        return BFC_ENOMEM;
    }
    size_t full = range_bytes(env);
    struct bfc__vmm_gone *g0 =
        bfc__pool_vmm_adopt(env->pool, a->stream_id, need < full ? bfc__round_up(need ? need : 1, g) : full);
    int st = BFC_OK;
    if (g0) {
        x->base = g0->base;
        x->size = g0->size;
    } else {
        st = reserve(env, need, most, &x->size, &x->base);
    }
    if (st != BFC_OK) {
        expand_free(a, x);
        return st;
    }
    x->ngran = x->size >> x->shift;
    size_t words = (x->ngran + 63) / 64;
    x->ready = bfc__meta_zalloc(words * sizeof(uint64_t));
    if (g0 && !x->ready) {
        /* Back to the pool as it came, fenced on our stream again (a later
         * record covers the work the first one did). */
        bfc__fence_arm(env->be, x->fence, a->stream, a->stream_id);
        bfc__pool_vmm_depart(env->pool, g0, g0->base, g0->size, g0->mapped, x->fence, a->stream_id, a->stream,
                             g0->bits, g0->words);
        x->fence = NULL;
        expand_free(a, x);
        return BFC_ENOMEM;
    }
    if (g0) {
        adopt(a, x, g0);
    } else {
        x->mapped = bfc__meta_zalloc(words * sizeof(uint64_t));
        x->gone = bfc__meta_zalloc(sizeof(*x->gone));
    }
    if (!x->mapped || !x->ready || !x->gone) {
        bfc__pool_vmm_unreserve(env->pool, x->base, x->size);
        expand_free(a, x);
        return BFC_ENOMEM;
    }
    x->threshold = env->release_threshold;
    x->lend_every = LEND_MIN;
    x->decay_at = env->slack_decay_ms ? a->st.num_allocs + env->decay_check_allocs : UINT64_MAX;
    x->decay_since_ms = now_ms(env);
    x->decay_idle_min = SIZE_MAX;
    if (!g0)
        x->ready_end = x->base;
    a->x = x; /* before the region (arena.c): its accounting reads it */
    if (g0)
        rearm(a, true); /* as after a map: what it does not use goes at its frees */
    return BFC_OK;
}

void bfc__expand_destroy_locked(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    if (x->mapped_bytes) {
        /* An adopted reservation: mapped, maybe still in use by our
         * stream's earlier work; it departs as it came. */
        bfc__expand_depart_locked(a, true);
        return;
    }
    a->x = NULL;
    bfc__pool_vmm_unreserve(a->env->pool, x->base, x->size);
    expand_free(a, x);
}

static void publish(struct bfc__arena *a, size_t spare, size_t lend);

void bfc__expand_depart_locked(struct bfc__arena *a, bool fence)
{
    struct bfc__expand *x = a->x;
    struct bfc__fence *f = NULL;
    if (fence && x->mapped_bytes) {
        f = x->fence;
        x->fence = NULL;
        bfc__fence_reset(f);
        bfc__fence_arm(a->env->be, f, a->stream, a->stream_id);
    }
    publish(a, 0, 0);
    a->st.bytes_reserved -= x->mapped_bytes;
    struct bfc__vmm_gone *rec = x->gone;
    x->gone = NULL;
    /* The mapped bits go with the record: a new shard of this stream may
     * adopt the reservation (bfc__pool_vmm_adopt). */
    uint64_t *bits = x->mapped;
    x->mapped = NULL;
    bfc__pool_vmm_depart(a->env->pool, rec, x->base, x->size, x->mapped_bytes, f, a->stream_id, a->stream, bits,
                         (x->ngran + 63) / 64);
    a->x = NULL;
    expand_free(a, x);
}

/* ------------------------------------------------------------ mapping */

/* ------------------------------------------------------------- policy */

static size_t busy_bytes(const struct bfc__arena *a)
{
    return a->st.bytes_in_use + a->st.pending_bytes;
}

size_t bfc__expand_idle_bytes(const struct bfc__arena *a)
{
    size_t busy = busy_bytes(a);
    return a->x->mapped_bytes > busy ? a->x->mapped_bytes - busy : 0;
}

/* The free mapped bytes that stay: less the granules already marked to
 * leave (still mapped until their fence completes).  What a release may
 * take beyond what the shard keeps -- the threshold, the slack -- is
 * counted from this, or a release made while earlier granules wait for
 * their fence would leave it short of what it keeps once they go (on a
 * GPU, the usual case: the stream has work queued at the free).  The
 * free's own test still reads every free byte, leaving ones included, so
 * that a check comes to unmap them once their fence completes. */
static size_t staying_idle(const struct bfc__arena *a)
{
    size_t idle = bfc__expand_idle_bytes(a), leaving = a->x->leaving_bytes;
    return idle > leaving ? idle - leaving : 0;
}

/* Caps a release's budget so that the shard keeps release_threshold
 * mapped: whole granules of the staying free bytes beyond it (a release
 * marks a whole granule while any budget is left, so an uneven budget
 * would take up to a granule of the threshold).  Unchanged at threshold
 * 0: every ready whole free granule fits in the staying bytes. */
static size_t to_keep(const struct bfc__arena *a, size_t keep, size_t budget)
{
    const struct bfc__expand *x = a->x;
    if (keep == 0)
        return budget;
    size_t stay = staying_idle(a);
    size_t room = stay > keep ? (stay - keep) & ~(GRAN(x) - 1) : 0;
    return budget < room ? budget : room;
}

static size_t to_threshold(const struct bfc__arena *a, size_t budget)
{
    return to_keep(a, a->x->threshold, budget);
}

struct mapped_front {
    const struct bfc__expand *x;
    size_t best;
};

static int mapped_front(struct bfc__chunk *c, void *arg)
{
    struct mapped_front *m = arg;
    const struct bfc__expand *x = m->x;
    uintptr_t end = c->ptr + c->size;
    /* Where the first unmapped granule from c's own begins. */
    uintptr_t p = x->base + (first_clear(x->mapped, x->ngran, (c->ptr - x->base) >> x->shift) << x->shift);
    size_t front = p <= c->ptr ? 0 : (p < end ? p : end) - c->ptr;
    if (front > m->best)
        m->best = front;
    return 0;
}

size_t bfc__expand_largest_mapped_free(const struct bfc__arena *a)
{
    struct mapped_front m = { a->x, 0 };
    /* The bins from the largest down; a bin whose chunks are all smaller
     * than the best front found cannot beat it. */
    for (uint32_t i = BFC__NUM_BINS; i-- > 0;) {
        if (i + 1 < BFC__NUM_BINS && m.best >= (size_t)BFC__MIN_ALLOC << (i + 1))
            break;
        if (bfc__bins_slots_of(&a->bins, i))
            (void)bfc__bins_walk(&a->bins, i, mapped_front, &m);
    }
    return m.best;
}

struct mapped_fit {
    const struct bfc__expand *x;
    size_t rounded;
    struct bfc__chunk *found;
};

static int mapped_fit(struct bfc__chunk *c, void *arg)
{
    struct mapped_fit *m = arg;
    const struct bfc__expand *x = m->x;
    if (c->size < m->rounded)
        return 0;
    size_t g = (c->ptr - x->base) >> x->shift;
    uintptr_t p = x->base + (first_clear(x->mapped, x->ngran, g) << x->shift);
    if (p < c->ptr + m->rounded)
        return 0;
    m->found = c;
    return 1;
}

struct bfc__chunk *bfc__expand_mapped_fit(const struct bfc__arena *a, size_t rounded)
{
    struct mapped_fit m = { a->x, rounded, NULL };
    /* Bins from the request's up, each in (size, address) order: the
     * first chunk found is the smallest, the lowest address among equals. */
    for (uint32_t i = bfc__bin_for_size(rounded); i < BFC__NUM_BINS && !m.found; i++)
        if (bfc__bins_slots_of(&a->bins, i))
            (void)bfc__bins_walk(&a->bins, i, mapped_fit, &m);
    return m.found;
}

/* Mapped granules of [lo, hi) that lie wholly inside it. */
static size_t mapped_within(const struct bfc__expand *x, uintptr_t lo, uintptr_t hi)
{
    size_t ga = (lo - x->base + GRAN(x) - 1) >> x->shift, gb = (hi - x->base) >> x->shift, bytes = 0;
    if (gb > x->map_top)
        gb = x->map_top;
    for (size_t g = ga; g < gb; g++)
        if (bit(x->mapped, g))
            bytes += GRAN(x);
    return bytes;
}

size_t bfc__expand_free_granule_bytes(const struct bfc__arena *a)
{
    const struct bfc__expand *x = a->x;
    size_t bytes = 0;
    uintptr_t run = 0; /* start of the current run of free or pending chunks, 0: none */
    for (struct bfc__chunk *c = bfc__region_handle(x->region, x->base); c; c = c->next) {
        if (bfc__chunk_idle(c)) {
            if (!run)
                run = c->ptr;
        } else if (run) {
            bytes += mapped_within(x, run, c->ptr);
            run = 0;
        }
        if (!c->next && run)
            bytes += mapped_within(x, run, c->ptr + c->size);
    }
    return bytes;
}

static void publish_one(_Atomic size_t *h, size_t *mine, size_t v)
{
    if (v > *mine)
        atomic_fetch_add_explicit(h, v - *mine, memory_order_relaxed);
    else if (v < *mine)
        atomic_fetch_sub_explicit(h, *mine - v, memory_order_relaxed);
    *mine = v;
}

/* What other shards read of our free mapped bytes (their growth asks us
 * for them): the spare, and what an open loan would lend beyond it.
 * relaxed: hints; the slow path reads the truth under locks. */
static void publish(struct bfc__arena *a, size_t spare, size_t lend)
{
    struct bfc__expand *x = a->x;
    publish_one(&a->env->pool->vmm_idle, &x->published, spare);
    publish_one(&a->env->pool->vmm_lendable, &x->published_lend, lend);
}

/* Does a hint say other shards hold a granule or more for our growth? */
static bool others_hold(const struct bfc__arena *a, _Atomic size_t *h, size_t mine)
{
    size_t all = atomic_load_explicit(h, memory_order_relaxed);
    return all > mine && all - mine >= GRAN(a->x);
}

bool bfc__expand_ask_others(const struct bfc__arena *a, size_t need)
{
    struct bfc__pool *pool = a->env->pool;
    return others_hold(a, &pool->vmm_idle, a->x->published) ||
           (others_hold(a, &pool->vmm_lendable, a->x->published_lend) && bfc__pool_would_peak(pool, need));
}

/* Free mapped bytes the shard keeps beyond its granules shared with live
 * blocks, at its own frees and when another shard grows: the threshold and
 * the churn slack (saturating: a threshold near SIZE_MAX keeps all). */
static size_t beyond_threshold(const struct bfc__expand *x, size_t more)
{
    size_t keep = x->threshold + more;
    return keep < x->threshold ? SIZE_MAX : keep;
}

static size_t keep_bytes(const struct bfc__expand *x)
{
    return beyond_threshold(x, x->slack);
}

/* Free mapped bytes a loan leaves the shard: idle_floor (what the last
 * release at a free left staying beyond the threshold: bytes in granules
 * shared with live blocks) and the threshold (saturating).  The hint (rearm)
 * and the loan (bfc__expand_release_spare_locked) both count from it, so a
 * loan takes on no more than the hint offered. */
static size_t lend_floor(const struct bfc__expand *x)
{
    return beyond_threshold(x, x->idle_floor);
}

/* May another shard's growth take some of the slack now? */
static bool lend_open(const struct bfc__arena *a)
{
    return !a->x->lend_shut;
}


/* Sets the low-water mark of bytes_in_use below which a free asks the
 * policy again: once the free mapped bytes (by bytes_in_use, the one
 * figure the free's test reads) exceed what they are now by a granule;
 * after a map, also as soon as they exceed what the shard keeps (memory
 * was short: the first free past it checks).  Frees that merely cycle
 * memory the shard reuses never cross it; a shard that goes idle crosses
 * it once a granule, publishing what it holds free. */
static void rearm(struct bfc__arena *a, bool mapped)
{
    struct bfc__expand *x = a->x;
    size_t in_use = a->st.bytes_in_use;
    size_t idle = x->mapped_bytes > in_use ? x->mapped_bytes - in_use : 0;
    size_t keep = keep_bytes(x);
    if (x->lend_shut && a->st.num_allocs - x->lent_at >= x->lend_every)
        x->lend_shut = false;
    /* A granule more free than now: publish it (other shards' growth
     * reads it) and see whether it passed what the shard keeps. */
    size_t trigger = idle + GRAN(x);
    if (mapped && keep < trigger)
        trigger = keep;
    x->low_water = x->mapped_bytes > trigger ? x->mapped_bytes - trigger : 0;
    /* Published: what another shard's growth would get here (above the
     * granules shared with live blocks, beyond what this shard keeps).  Called
     * by make_ready, `now` still counts the block being handed out (the arena
     * counts it in use afterwards), so the hint offers it and the next growth
     * elsewhere takes the slow path, which asks every shard for its spare,
     * counted afresh.  Left so on purpose: the hint is a lower estimate --
     * free bytes above idle_floor, the part of the last release that lay in
     * granules shared with live blocks -- and whole free granules formed
     * since (blocks freed beside that part) show only when a shard is asked:
     * in a four-stream trace (server4 in tests/traces_smoke.sh) 8 of the 19
     * asks that got memory went to shards whose two hints together showed
     * less than a granule (the other 11 lent their slack).  With the block
     * counted out the trace held 1.151 times its peak requested instead of
     * 1.031. */
    size_t now = bfc__expand_idle_bytes(a), floor = x->idle_floor + keep, lend = lend_floor(x);
    if (floor < keep)
        floor = SIZE_MAX;
    if (!lend_open(a))
        lend = floor;
    size_t spare = now > floor ? now - floor : 0;
    publish(a, spare, now > lend ? now - lend - spare : 0);
}

/* The first granule at or after g that is not ready (ngran if none). */
static size_t first_unready(const struct bfc__expand *x, size_t g)
{
    return first_clear(x->ready, x->ngran, g);
}

/* A granule became not ready: the ready prefix ends at it at the latest. */
static void unready(struct bfc__expand *x, size_t g)
{
    set_bit(x->ready, g, false);
    uintptr_t at = x->base + (g << x->shift);
    if (at < x->ready_end)
        x->ready_end = at;
}

/* Churn at growth (release_for_growth): GROW_CHURN_MAPS maps of what
 * growth had unmapped within a window of GROW_CHURN_WINDOW allocations
 * grow grow_slack (a granule, then twice as much each time).  Rare such
 * maps are the rule's price and leave it alone: the traces of tests/traces
 * make them at most a few times per window while their peak settles, and
 * keeping memory for them raised detect_frcnn's overhead from 1.053 to
 * 1.085 (a map of it within 4 allocations grew the slack) and
 * train_resnet18's from 1.057 to 1.108 (any map of it). */
#define GROW_CHURN_MAPS 8
#define GROW_CHURN_WINDOW 256
/* Allocations without churn after which a slack halves. */
#define CALM_ALLOCS 1024

/* A slack after churn: a granule, then twice as much, up to the range. */
static size_t doubled(const struct bfc__expand *x, size_t slack)
{
    return slack ? (slack < x->size / 2 ? 2 * slack : x->size) : GRAN(x);
}

static void account_map(struct bfc__arena *a, size_t bytes)
{
    struct bfc__expand *x = a->x;
    x->band = 0; /* memory was short: the next release at a free trims to the threshold */
    x->mapped_bytes += bytes;
    a->st.vmm_maps++;
    a->st.bytes_reserved += bytes;
    if (a->st.bytes_reserved > a->st.peak_reserved)
        a->st.peak_reserved = a->st.bytes_reserved;
    /* Churn: memory that a release at a free gave back is needed again.
     * The shard keeps more at frees from now on (twice, from a granule):
     * releasing it only bought a map call. */
    if (x->unmapped_at_free) {
        x->unmapped_at_free -= bytes < x->unmapped_at_free ? bytes : x->unmapped_at_free;
        x->remapped = true;
        x->calm_since = a->st.num_allocs;
        x->slack = doubled(x, x->slack);
    }
    /* Churn at growth: what a growth unmapped is mapped again. */
    if (x->unmapped_at_growth) {
        x->unmapped_at_growth -= bytes < x->unmapped_at_growth ? bytes : x->unmapped_at_growth;
        if (a->st.num_allocs - x->churn_window > GROW_CHURN_WINDOW) {
            x->churn_window = a->st.num_allocs;
            x->churn_maps = 0;
        }
        x->churn_last = a->st.num_allocs;
        if (++x->churn_maps >= GROW_CHURN_MAPS) {
            x->churn_maps = 0;
            x->grow_slack = doubled(x, x->grow_slack);
        }
    }
    /* A map while a loan of the slack is out: the shard needed what it
     * lent (or more).  It stops lending, for twice as long as last time. */
    if (x->lending) {
        x->lending = false;
        x->lend_shut = true;
        x->lent_at = a->st.num_allocs;
        if (x->lend_every < LEND_MAX)
            x->lend_every *= 2;
    }
}

static size_t release(struct bfc__arena *a, uint32_t wait_ms, size_t g0, size_t g1, size_t budget);

/* Granules [g0, g1), `need` bytes, are about to be mapped for a block: the
 * shard's own free granules beyond the threshold and grow_slack (churn at
 * growth, account_map) go first, so that growth
 * in one place while memory lies free in another -- fragmentation -- does
 * not raise the peak reserved ("When", (b)).  As many as the growth would
 * raise the peak; below the peak, as many as it maps while the peak is
 * still rising (a map raised it within the last PEAK_SETTLED_MAPS of the
 * context's), none once it has settled.  The map call is made anyway;
 * this adds at most one unmap call per run of free granules, and only at
 * growth. */
static size_t release_for_growth(struct bfc__arena *a, size_t g0, size_t g1, size_t need)
{
    struct bfc__expand *x = a->x;
    /* No churn at growth for CALM_ALLOCS allocations: it keeps half. */
    if (x->grow_slack && a->st.num_allocs - x->churn_last >= CALM_ALLOCS) {
        x->grow_slack /= 2;
        x->churn_last = a->st.num_allocs;
    }
    size_t keep = beyond_threshold(x, x->grow_slack);
    if (staying_idle(a) <= keep)
        return 0;
    uint64_t since_rise;
    size_t over = bfc__pool_peak_excess(a->env->pool, need, &since_rise);
    size_t want = over ? over : since_rise < PEAK_SETTLED_MAPS ? need : 0;
    return want ? release(a, 0, g0, g1, to_keep(a, keep, want)) : 0;
}

int bfc__expand_make_ready_locked(struct bfc__arena *a, uintptr_t p, size_t size)
{
    struct bfc__expand *x = a->x;
    const struct bfc__arena_env *env = a->env;
    size_t g0 = (p - x->base) >> x->shift, g1 = ((p + size - 1 - x->base) >> x->shift) + 1;
    size_t need = 0, runs = 0, out = 0;
    int st;
    /* Leaving granules come back at no cost. */
    for (size_t g = g0; g < g1; g++)
        if (!bit(x->mapped, g)) {
            need += GRAN(x);
            runs += g == g0 || bit(x->mapped, g - 1);
        } else if (!bit(x->ready, g)) {
            set_bit(x->ready, g, true);
            x->leaving_bytes -= GRAN(x);
        }
    if (need) {
        /* Growth while other shards hold free memory: the slow path
         * (the context's, ctx.c) takes theirs first, as one allocator
         * over the device would reuse it, and comes back with `deferred`
         * set to map. */
        if (!x->deferred && bfc__expand_ask_others(a, need)) {
            x->deferred = true;
            x->map_status = BFC_ENOMEM;
            return BFC_ENOMEM;
        }
        out = release_for_growth(a, g0, g1, need);
        /* Holes in a free chunk take a map call each: all of them must
         * fit the limit before the first is mapped, or a request the limit
         * refuses would map some (raising the peak reserved) and leave
         * them to be unmapped again.  One run is checked by its map. */
        if (runs > 1 && !bfc__pool_vmm_fits(env->pool, need)) {
            st = BFC_ENOMEM;
            goto refused;
        }
    }
    for (size_t g = g0; g < g1;) {
        if (bit(x->mapped, g)) {
            g++;
            continue;
        }
        size_t e = g + 1;
        while (e < g1 && !bit(x->mapped, e))
            e++;
        uintptr_t addr = x->base + (g << x->shift);
        size_t len = (e - g) << x->shift;
        st = bfc__pool_vmm_map(env->pool, addr, len);
        if (st != BFC_OK)
            goto refused;
        for (size_t i = g; i < e; i++) {
            set_bit(x->mapped, i, true);
            set_bit(x->ready, i, true);
        }
        if (e > x->map_top)
            x->map_top = e;
        account_map(a, len);
        if (env->poison)
            memset((void *)addr, 0xDB, len);
        if (bfc__tracing(env->obs))
            bfc__trace_event(env->obs, BFC__TR_GROW, addr, len, a->stream);
        g = e;
    }
    /* What the growth unmapped goes on its churn book once its own maps
     * are counted: later maps find it there (account_map).  Else a shard
     * whose blocks take turns over the same granules (5 MiB, then 7 MiB,
     * beside a live 256 KiB block) unmapped at each growth what the next
     * one mapped again: two map and two unmap calls per turn, for ever. */
    x->unmapped_at_growth += out;
    size_t pg = (x->ready_end - x->base) >> x->shift;
    if (g0 <= pg)
        x->ready_end = x->base + (first_unready(x, pg) << x->shift);
    rearm(a, need != 0);
    return BFC_OK;

refused:
    x->unmapped_at_growth += out;
    x->map_status = st;
    rearm(a, false);
    return st;
}

/* ---------------------------------------------------------- unmapping */

/* Unmaps every leaving granule (their fence has completed). */
static size_t unmap_leaving(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    const struct bfc__arena_env *env = a->env;
    size_t freed = 0;
    for (size_t g = 0; g < x->ngran && x->leaving_bytes;) {
        uint64_t w = x->mapped[g >> 6] & ~x->ready[g >> 6];
        if ((g & 63) == 0 && w == 0) {
            g += 64;
            continue;
        }
        if (!bit(x->mapped, g) || bit(x->ready, g)) {
            g++;
            continue;
        }
        size_t e = g + 1;
        while (e < x->ngran && bit(x->mapped, e) && !bit(x->ready, e))
            e++;
        uintptr_t addr = x->base + (g << x->shift);
        size_t len = (e - g) << x->shift, done;
        /* Granules the device refuses to take back stay mapped and held:
         * ready again, as if an allocation had taken them back, so that
         * they serve this shard and a later release offers them again. */
        (void)bfc__pool_vmm_unmap(env->pool, addr, len, &done);
        size_t gd = g + (done >> x->shift);
        for (size_t i = g; i < gd; i++)
            set_bit(x->mapped, i, false);
        for (size_t i = gd; i < e; i++)
            set_bit(x->ready, i, true);
        x->mapped_bytes -= done;
        x->leaving_bytes -= len;
        a->st.vmm_unmaps++;
        a->st.bytes_reserved -= done;
        freed += done;
        if (done && bfc__tracing(env->obs))
            bfc__trace_event(env->obs, BFC__TR_RELEASE, addr, done, a->stream);
        g = e;
    }
    x->armed = false;
    return freed;
}

/* Unmaps the leaving granules if their fence has completed (a release and
 * the decay's check start here). */
static size_t unmap_if_fenced(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    if (x->leaving_bytes && x->armed && bfc__fence_query(a->env->be, x->fence) == BFC_OK)
        return unmap_leaving(a);
    return 0;
}

struct marking {
    struct bfc__expand *x;
    size_t g0, g1;    /* granules not to mark: a block about to use them */
    size_t budget, marked;
};

/* Marks the ready granules of [ga, gb), the highest first, a word of bits
 * at a time. */
static void mark_range(struct marking *m, size_t ga, size_t gb)
{
    struct bfc__expand *x = m->x;
    while (gb > ga && m->marked < m->budget) {
        size_t wi = (gb - 1) >> 6, lo = ga > wi << 6 ? ga : wi << 6;
        unsigned hi = (unsigned)((gb - 1) & 63);
        uint64_t w = x->ready[wi] & (hi == 63 ? ~(uint64_t)0 : ((uint64_t)1 << (hi + 1)) - 1) &
                     ~(((uint64_t)1 << (lo & 63)) - 1);
        while (w && m->marked < m->budget) {
            unsigned b = 63u - (unsigned)__builtin_clzll(w);
            size_t g = (wi << 6) + b;
            w &= ~((uint64_t)1 << b);
            if (g >= m->g0 && g < m->g1)
                continue;
            unready(x, g);
            m->marked += GRAN(x);
        }
        gb = lo;
    }
}

static int mark_chunk(struct bfc__chunk *c, void *arg)
{
    struct marking *m = arg;
    struct bfc__expand *x = m->x;
    size_t ga = (c->ptr - x->base + GRAN(x) - 1) >> x->shift;
    size_t gb = (c->ptr + c->size - x->base) >> x->shift;
    if (gb > x->map_top) /* the unmapped end of the range */
        gb = x->map_top;
    mark_range(m, ga, gb);
    return m->marked >= m->budget;
}

/* Marks the ready granules wholly inside free chunks, outside [g0, g1),
 * as leaving, up to `budget` bytes; returns how many bytes it marked.
 * Only a free chunk of a granule or more can hold a whole granule: the
 * bins from the granule's up are all it reads, the largest chunks first
 * (the smaller ones are the likelier to be cut again soon). */
static size_t mark_free(struct bfc__arena *a, size_t g0, size_t g1, size_t budget)
{
    struct bfc__expand *x = a->x;
    struct marking m = { x, g0, g1, budget, 0 };
    uint32_t lo = bfc__bin_for_size(GRAN(x));
    for (uint32_t i = BFC__NUM_BINS; i-- > lo && m.marked < budget;)
        if (bfc__bins_slots_of(&a->bins, i))
            (void)bfc__bins_walk(&a->bins, i, mark_chunk, &m);
    x->leaving_bytes += m.marked;
    return m.marked;
}

static size_t release(struct bfc__arena *a, uint32_t wait_ms, size_t g0, size_t g1, size_t budget)
{
    struct bfc__expand *x = a->x;
    bfc__backend_t *be = a->env->be;
    size_t freed = unmap_if_fenced(a);
    if (mark_free(a, g0, g1, budget) || (x->leaving_bytes && !x->armed)) {
        /* Recorded after the marks: covers every use of what is leaving. */
        bfc__fence_reset(x->fence);
        bfc__fence_arm(be, x->fence, a->stream, a->stream_id);
        x->armed = true;
    }
    if (x->leaving_bytes) {
        if (wait_ms && bfc__fence_query(be, x->fence) != BFC_OK)
            bfc__fence_wait(be, x->fence, wait_ms);
        if (bfc__fence_query(be, x->fence) == BFC_OK)
            freed += unmap_leaving(a);
    }
    return freed;
}

static size_t release_all(struct bfc__arena *a, uint32_t wait_ms, size_t g0, size_t g1)
{
    size_t freed = release(a, wait_ms, g0, g1, SIZE_MAX);
    a->x->idle_floor = staying_idle(a);
    rearm(a, false);
    return freed;
}

size_t bfc__expand_release_locked(struct bfc__arena *a, uint32_t wait_ms)
{
    return a->x ? release_all(a, wait_ms, 0, 0) : 0;
}

size_t bfc__expand_release_for_locked(struct bfc__arena *a, uint32_t wait_ms, size_t rounded)
{
    struct bfc__expand *x = a->x;
    if (!x)
        return 0;
    /* Unmapping them would only make the fit map them again, in the same
     * call (at the limit, a chunk whose first granules were mapped and
     * free: an unmap of those beside the map of the whole block).  Every
     * granule the block touches; the fit then cuts the chunk's leftover
     * off wherever the release would have unmapped a granule under it
     * (bfc__expand_spared_leftover), as it did when those granules went:
     * else TensorFlow's rule keeps a chunk under twice the request whole,
     * and a 3 MiB block took a 4 MiB chunk whose last granule it shared
     * with the leftover, and a later request the limit could hold failed. */
    struct bfc__chunk *c = bfc__bins_best_fit(&a->bins, rounded);
    x->spared = c ? c->ptr : 0;
    if (!c)
        return release_all(a, wait_ms, 0, 0);
    return release_all(a, wait_ms, (c->ptr - x->base) >> x->shift,
                       ((c->ptr + rounded - 1 - x->base) >> x->shift) + 1);
}

/*
 * The decay ("When", (c)), checked at the first free after every
 * env->decay_check_allocs allocations (BFC__DECAY_CHECK_ALLOCS: one more
 * test on the free path, and a clock read per check).  Each check notes
 * the free bytes (bfc__expand_idle_bytes) and unmaps granules whose departure fence
 * has completed;
 * once slack_decay_ms have passed since the period began, the least free
 * figure its checks saw, beyond the threshold, is memory the shard held
 * and never used in that time: that much goes (marked and fenced, largest
 * free chunks first, as every release), and a new period begins.  A shard
 * whose use swings sees its free bytes near zero at some check of every
 * period and gives nothing; one that shrank gives back what it no longer
 * uses, however large a slack its churn once earned.  Not on the churn
 * book: memory unused for that long is not the slack's to keep.  Sampled,
 * not exact: a short dip between two checks goes unseen, and what it used
 * is mapped again when next needed.
 */
static void decay_check(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    x->decay_at = a->st.num_allocs + a->env->decay_check_allocs;
    (void)unmap_if_fenced(a);
    size_t idle = bfc__expand_idle_bytes(a);
    if (idle < x->decay_idle_min)
        x->decay_idle_min = idle;
    uint64_t now = now_ms(a->env);
    if (now == 0 || now < x->decay_since_ms || now - x->decay_since_ms < a->env->slack_decay_ms)
        return; /* (a failed clock read postpones the decay) */
    size_t stay = staying_idle(a), least = x->decay_idle_min < stay ? x->decay_idle_min : stay;
    size_t unused = least > x->threshold ? least - x->threshold : 0;
    if (unused >= GRAN(x))
        (void)release(a, 0, 0, 0, to_threshold(a, unused));
    x->decay_since_ms = now;
    x->decay_idle_min = bfc__expand_idle_bytes(a);
}

/* What a release at a free may unmap: the free bytes beyond the threshold,
 * in whole granules, so that the shard keeps at least release_threshold
 * mapped (as a CUDA pool trims to its threshold, not to nothing: a shard
 * with a 16 MiB threshold that frees 20 MiB keeps 16).  Everything with
 * the default threshold of 0. */
static size_t free_budget(const struct bfc__arena *a)
{
    const struct bfc__expand *x = a->x;
    if (x->threshold == 0)
        return SIZE_MAX;
    if (staying_idle(a) <= x->band)
        return 0; /* within the band of the last trim (below) */
    return to_threshold(a, SIZE_MAX);
}

void bfc__expand_after_free_locked(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    if (a->st.num_allocs >= x->decay_at)
        decay_check(a);
    size_t keep = keep_bytes(x);
    if (bfc__expand_idle_bytes(a) > keep) {
        /* Nothing of the last release at a free was mapped again, and no
         * churn for CALM_ALLOCS allocations: the shard keeps less (one
         * burst of frees is not evidence: its releases follow each other
         * with no allocation between). */
        if (x->unmapped_at_free && !x->remapped && a->st.num_allocs - x->calm_since >= CALM_ALLOCS) {
            x->slack /= 2;
            x->calm_since = a->st.num_allocs;
        }
        size_t budget = free_budget(a);
        size_t freed = release(a, 0, 0, 0, budget);
        if (!budget) {
            /* Within the band of the last trim (below): only granules whose
             * fence completed went.  The churn book and the floor stay the
             * trim's, or its memory mapped again would not count as churn
             * (the slack would never grow: vit_b16 at 4 MiB made 186 map
             * calls per 1,000 allocations, 109 so), and the band's free
             * granules would sink into the floor, hidden from other
             * shards' growth. */
            x->unmapped_at_free += freed;
        } else {
            x->unmapped_at_free = freed;
            x->remapped = false;
            /* The floor: what the release left free and staying, less
             * the threshold kept on purpose, or loans (lend_floor) would
             * leave twice the threshold and raise the context's peak.
             * Granules still leaving are above it: the hint offers them
             * (rearm), so another shard's growth asks for them and
             * unmaps them once their fence completes
             * (bfc__expand_release_spare_locked), rather than mapping
             * afresh while they wait here for this shard's next check. */
            size_t left = staying_idle(a);
            x->idle_floor = left > x->threshold ? left - x->threshold : 0;
            /* Trimmed to the threshold: new granules are marked again once
             * another threshold's worth (a granule at least) stays free,
             * not at the next granule's check, or a shard that keeps
             * freeing would make an unmap call per granule (vit_b16 in
             * tests/traces at 16 MiB: 112 unmap calls per 1,000
             * allocations, against 14 with no threshold).  The checks in
             * between still unmap what has left. */
            if (x->threshold) {
                size_t step = x->threshold > GRAN(x) ? x->threshold : GRAN(x);
                size_t band = left + step;
                x->band = band < step ? SIZE_MAX : band;
            }
        }
    }
    rearm(a, false);
}

size_t bfc__expand_release_spare_locked(struct bfc__arena *a, size_t *loan)
{
    struct bfc__expand *x = a->x;
    if (!x)
        return 0;
    /* First what this shard's own releases marked and fenced, if the
     * fence has completed: they were going in any case (the hint offers
     * them, above the floor), and left for its next check they would make
     * the growth map afresh beside them.  On the churn book: added to what
     * the last release gave, as the checks in a release's band do, or
     * counted with what this call releases below (which starts a new
     * book). */
    size_t done = unmap_if_fenced(a);
    x->unmapped_at_free += done;
    size_t keep = keep_bytes(x), idle = staying_idle(a), freed = 0, given = 0;
    size_t spare = idle > keep ? idle - keep : 0, lend = 0;
    if (*loan && lend_open(a)) {
        size_t lendable = idle > lend_floor(x) ? idle - lend_floor(x) : 0;
        if (lendable > spare)
            lend = lendable - spare < *loan ? lendable - spare : *loan;
    }
    if (spare + lend) {
        /* On the churn book of a release at a free: if this shard maps the
         * memory again, the pair of calls was wasted and its slack doubles,
         * so shards whose use swings stop handing granules back and forth
         * (and a map closes an open loan: above). */
        size_t leaving = x->leaving_bytes;
        freed = release(a, 0, 0, 0, to_threshold(a, spare + lend));
        /* Given up: unmapped now, or marked to leave (unmapped once the
         * fence completes), less what was leaving before. */
        given = freed + x->leaving_bytes > leaving ? freed + x->leaving_bytes - leaving : 0;
        x->unmapped_at_free = done + freed; /* the granules that left first are on it too */
        x->remapped = false;
    }
    /* The loan is what was given beyond the spare (which goes in any
     * case), not what was meant: a shard whose free bytes lie in granules
     * shared with live blocks gives nothing, and the next shard is asked.
     * (lent <= lend <= *loan.) */
    size_t lent = given > spare ? given - spare : 0;
    if (lent > lend)
        lent = lend;
    *loan -= lent;
    if (lent) {
        if (!x->lending) {
            x->lending = true;
            x->lent_at = a->st.num_allocs;
        } else if (a->st.num_allocs - x->lent_at >= x->lend_every) {
            /* Out a whole period and not needed back: shut for less. */
            x->lent_at = a->st.num_allocs;
            if (x->lend_every > LEND_MIN)
                x->lend_every /= 2;
        }
    }
    rearm(a, false);
    return done + freed;
}

/* ------------------------------------------------------------- checks */

int bfc__expand_check_locked(struct bfc__arena *a, char *buf, size_t len)
{
    struct bfc__expand *x = a->x;
    size_t mapped = 0, leaving = 0;
    for (size_t g = 0; g < x->ngran; g++) {
        if (bit(x->ready, g) && !bit(x->mapped, g)) {
            snprintf(buf, len, "invariant 4: shard %lu: granule %zu ready but not mapped",
                     (unsigned long)a->stream_id, g);
            return -1;
        }
        mapped += bit(x->mapped, g);
        leaving += bit(x->mapped, g) && !bit(x->ready, g);
    }
    if (mapped << x->shift != x->mapped_bytes || leaving << x->shift != x->leaving_bytes ||
        x->mapped_bytes != a->st.bytes_reserved) {
        snprintf(buf, len,
                 "invariant 4: shard %lu: %zu granules mapped (%zu leaving), counted %zu bytes (%zu), reserved %lu",
                 (unsigned long)a->stream_id, mapped, leaving, x->mapped_bytes, x->leaving_bytes,
                 (unsigned long)a->st.bytes_reserved);
        return -1;
    }
    if (x->ready_end > x->base + (first_unready(x, 0) << x->shift)) {
        snprintf(buf, len, "invariant 4: shard %lu: ready prefix ends at %#lx, a granule below is not ready",
                 (unsigned long)a->stream_id, (unsigned long)x->ready_end);
        return -1;
    }
    for (struct bfc__chunk *c = bfc__region_handle(x->region, x->base); c; c = c->next)
        if (atomic_load_explicit(&c->state, memory_order_relaxed) != BFC__CHUNK_FREE &&
            !bfc__expand_ready(x, c->ptr, c->size)) {
            snprintf(buf, len, "invariant 4: shard %lu: block %#lx+%zu lies on granules not mapped",
                     (unsigned long)a->stream_id, (unsigned long)c->ptr, c->size);
            return -1;
        }
    return 0;
}
