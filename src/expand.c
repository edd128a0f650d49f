/*
 * expand.c -- expandable arenas: one shard's chunks in one reserved range of
 * virtual addresses, device memory mapped behind it granule by granule.
 *
 * With virtual memory (vmm=on, or auto where the backend has it) a shard
 * reserves, at its first allocation, a range of addresses as large as the
 * memory limit (rounded up to the granule) and makes it its one region: one
 * free chunk covering it, cut by TensorFlow's BFC exactly as a classic
 * region is (bins, best fit, the split rule, coalescing: arena.c).  Only the
 * granules under blocks handed out are backed by memory:
 *
 *   - Mapping.  When the chunk an allocation takes covers granules that are
 *     not mapped, exactly those are mapped (bfc__pool_vmm_map charges them
 *     against the limit first) before the block is returned.  The unmapped
 *     end of the range is one big free chunk, so an arena grows by the
 *     granules a request needs at its end -- no doubling -- and a hole left
 *     by an unmap is refilled the same way.  The common path tests the
 *     `ready` bits only: no backend call, no lock, when they are mapped.
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
 *   - When.  (a) Another shard cannot map within the limit: its slow path
 *     asks every other shard to mark and fence its free granules, waits for
 *     those fences with no lock held (on a device; not on SIM, where a held
 *     stream only ends when a test drains it), and asks again to unmap.
 *     (b) A free leaves more than release_threshold bytes mapped but free in
 *     the shard: the shard marks and fences its free granules, and unmaps
 *     them at once if the fence has already completed, else at the next such
 *     check after it did.  Checks are spaced by a granule of growth of the
 *     free mapped bytes, so a shard that frees and reuses memory does not
 *     rescan at every free.  The default threshold is 0, as
 *     cudaMemPoolAttrReleaseThreshold's: free granules are returned at the
 *     first check after their fence completed -- our equivalent of the
 *     synchronisation points where a CUDA memory pool trims.  (c) trim.
 *   - Stream safety across shards.  An unmapped granule has no memory; the
 *     next va_map of the same address, by this shard, gets fresh memory.
 *     Another shard never sees this address range: it maps its own range,
 *     with memory the device gives afresh, so memory changes hands only
 *     through unmap -> map, and the unmap waited for the fence.
 *   - Departure.  A shard with nothing live that sheds its regions (trim,
 *     retirement, garbage collection) gives its whole reservation to the
 *     pool with its departure fence; the pool releases it once the fence
 *     completed, and counts its mapped bytes against the limit until then.
 *
 * large_alloc is ignored: a big block is one chunk like any other, and its
 * granules go back when it is freed.
 *
 * Invariants (bfc__expand_check_locked, under the arena lock): ready is a
 * subset of mapped; mapped_bytes and leaving_bytes are the counts of the
 * bits; every granule under a chunk in use or pending is ready; the
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

int bfc__expand_create_locked(struct bfc__arena *a)
{
    const struct bfc__arena_env *env = a->env;
    size_t g = env->be->vmm_granule;
    struct bfc__expand *x = bfc__meta_zalloc(sizeof(*x));
    if (!x)
        return BFC_ENOMEM;
    x->shift = (unsigned)__builtin_ctzll(g);
    x->size = bfc__round_up(env->limit, g);
    x->ngran = x->size >> x->shift;
    size_t words = (x->ngran + 63) / 64;
    x->mapped = bfc__meta_zalloc(words * sizeof(uint64_t));
    x->ready = bfc__meta_zalloc(words * sizeof(uint64_t));
    x->gone = bfc__meta_zalloc(sizeof(*x->gone));
    x->fence = x->mapped && x->ready && x->gone ? bfc__pool_fence_get(env->pool) : NULL;
    x->threshold = env->release_threshold;
    x->next_check = x->threshold;
    if (!x->fence) {
        expand_free(a, x);
        return BFC_ENOMEM;
    }
    int st = bfc__pool_vmm_reserve(env->pool, x->size, &x->base);
    if (st != BFC_OK) {
        expand_free(a, x);
        return st;
    }
    a->x = x; /* before the region (arena.c): its accounting reads it */
    return BFC_OK;
}

void bfc__expand_destroy_locked(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    a->x = NULL;
    bfc__pool_vmm_unreserve(a->env->pool, x->base, x->size);
    expand_free(a, x);
}

void bfc__expand_depart_locked(struct bfc__arena *a, bool fence)
{
    struct bfc__expand *x = a->x;
    struct bfc__fence *f = NULL;
    if (fence && x->mapped_bytes) {
        f = x->fence;
        x->fence = NULL;
        bfc__fence_reset(f);
        bfc__fence_arm(a->env->be, f, a->stream);
    }
    a->st.bytes_reserved -= x->mapped_bytes;
    struct bfc__vmm_gone *rec = x->gone;
    x->gone = NULL;
    bfc__pool_vmm_depart(a->env->pool, rec, x->base, x->size, x->mapped_bytes, f);
    a->x = NULL;
    expand_free(a, x);
}

/* ------------------------------------------------------------ mapping */

static void account_map(struct bfc__arena *a, size_t bytes)
{
    struct bfc__expand *x = a->x;
    x->mapped_bytes += bytes;
    a->st.vmm_maps++;
    a->st.bytes_reserved += bytes;
    if (a->st.bytes_reserved > a->st.peak_reserved)
        a->st.peak_reserved = a->st.bytes_reserved;
    /* Memory is short in this shard now: the next free that leaves more
     * than the threshold free checks again. */
    x->next_check = x->threshold;
}

int bfc__expand_make_ready_locked(struct bfc__arena *a, uintptr_t p, size_t size)
{
    struct bfc__expand *x = a->x;
    const struct bfc__arena_env *env = a->env;
    size_t g0 = (p - x->base) >> x->shift, g1 = ((p + size - 1 - x->base) >> x->shift) + 1;
    /* Leaving granules come back at no cost. */
    for (size_t g = g0; g < g1; g++)
        if (bit(x->mapped, g) && !bit(x->ready, g)) {
            set_bit(x->ready, g, true);
            x->leaving_bytes -= GRAN(x);
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
        int st = bfc__pool_vmm_map(env->pool, addr, len);
        if (st != BFC_OK) {
            x->map_status = st;
            return st;
        }
        for (size_t i = g; i < e; i++) {
            set_bit(x->mapped, i, true);
            set_bit(x->ready, i, true);
        }
        account_map(a, len);
        if (env->poison)
            memset((void *)addr, 0xDB, len);
        if (bfc__tracing(env->obs))
            bfc__trace_event(env->obs, BFC__TR_GROW, addr, len, a->stream);
        g = e;
    }
    return BFC_OK;
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
        size_t len = (e - g) << x->shift;
        /* On failure the range is given up all the same (pool.c): it is
         * free, and a later map of it fails rather than hand out memory
         * that might not be there. */
        (void)bfc__pool_vmm_unmap(env->pool, addr, len);
        for (size_t i = g; i < e; i++)
            set_bit(x->mapped, i, false);
        x->mapped_bytes -= len;
        x->leaving_bytes -= len;
        a->st.vmm_unmaps++;
        a->st.bytes_reserved -= len;
        freed += len;
        if (bfc__tracing(env->obs))
            bfc__trace_event(env->obs, BFC__TR_RELEASE, addr, len, a->stream);
        g = e;
    }
    x->armed = false;
    return freed;
}

/* Marks the ready granules wholly inside free chunks as leaving; returns
 * how many bytes it marked. */
static size_t mark_free(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    size_t marked = 0;
    for (struct bfc__chunk *c = bfc__region_handle(x->region, x->base); c; c = c->next) {
        if (atomic_load_explicit(&c->state, memory_order_relaxed) != BFC__CHUNK_FREE)
            continue;
        size_t ga = (c->ptr - x->base + GRAN(x) - 1) >> x->shift;
        size_t gb = (c->ptr + c->size - x->base) >> x->shift;
        for (size_t g = ga; g < gb; g++)
            if (bit(x->ready, g)) {
                set_bit(x->ready, g, false);
                marked += GRAN(x);
            }
    }
    x->leaving_bytes += marked;
    return marked;
}

size_t bfc__expand_release_locked(struct bfc__arena *a, uint32_t wait_ms)
{
    struct bfc__expand *x = a->x;
    bfc__backend_t *be = a->env->be;
    size_t freed = 0;
    if (!x)
        return 0;
    if (x->leaving_bytes && x->armed && bfc__fence_query(be, x->fence) == BFC_OK)
        freed += unmap_leaving(a);
    if (mark_free(a) || (x->leaving_bytes && !x->armed)) {
        /* Recorded after the marks: covers every use of what is leaving. */
        bfc__fence_reset(x->fence);
        bfc__fence_arm(be, x->fence, a->stream);
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

void bfc__expand_after_free_locked(struct bfc__arena *a)
{
    struct bfc__expand *x = a->x;
    size_t busy = a->st.bytes_in_use + a->st.pending_bytes;
    size_t free_mapped = x->mapped_bytes > busy ? x->mapped_bytes - busy : 0;
    if (BFC__LIKELY(free_mapped <= x->next_check))
        return;
    (void)bfc__expand_release_locked(a, 0);
    free_mapped = x->mapped_bytes > busy ? x->mapped_bytes - busy : 0;
    /* What could not go (granules shared with live blocks, or waiting for
     * the fence) does not trigger a rescan until a granule more is free. */
    x->next_check = (free_mapped > x->threshold ? free_mapped : x->threshold) + GRAN(x);
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
    for (struct bfc__chunk *c = bfc__region_handle(x->region, x->base); c; c = c->next)
        if (atomic_load_explicit(&c->state, memory_order_relaxed) != BFC__CHUNK_FREE &&
            !bfc__expand_ready(x, c->ptr, c->size)) {
            snprintf(buf, len, "invariant 4: shard %lu: block %#lx+%zu lies on granules not mapped",
                     (unsigned long)a->stream_id, (unsigned long)c->ptr, c->size);
            return -1;
        }
    return 0;
}
