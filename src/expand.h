/*
 * expand.h -- expandable arenas: a shard's chunks in one reserved virtual
 * address range whose granules are mapped on demand and unmapped when free
 * (expand.c has the essay).
 *
 * Every field is the owner arena's: written and read under its lock only.
 */
#ifndef BFC_EXPAND_H
#define BFC_EXPAND_H

#include "backend.h"
#include "pool.h"

struct bfc__arena;
struct bfc__region;

/* The decay's check comes at the first free after this many allocations
 * (the arena env's decay_check_allocs; white-box tests lower it). */
#define BFC__DECAY_CHECK_ALLOCS 1024

struct bfc__expand {
    uintptr_t base;             /* the reservation: one region of the arena */
    size_t size;
    unsigned shift;             /* log2 of the granule */
    size_t ngran;
    /* One bit per granule.  mapped: memory behind it.  ready: mapped and
     * not marked to leave -- what an allocation needs; the one test on the
     * common path.  mapped & ~ready: leaving, unmapped once `fence` (armed
     * after they were marked) has completed, unless an allocation takes
     * them back first (which costs no backend call). */
    uint64_t *mapped, *ready;
    size_t map_top;             /* no granule at or above it has been mapped */
    size_t mapped_bytes;
    size_t leaving_bytes;
    /* Every granule below ready_end is ready: a block that ends below it
     * needs nothing (the common path's one test). */
    uintptr_t ready_end;
    struct bfc__fence *fence;   /* a pool record, held for the arena's life */
    bool armed;                 /* fence recorded after the leaving granules were marked */
    size_t threshold;           /* release_threshold */
    /* The amortised check at frees: a free that leaves bytes_in_use below
     * low_water asks the policy (expand.c); no other free does anything. */
    size_t low_water;
    /* ... and so does the first free once num_allocs reaches decay_at:
     * the decay's check (expand.c, (c)), every env->decay_check_allocs
     * allocations; never when env->slack_decay_ms is 0. */
    uint64_t decay_at;
    uint64_t decay_since_ms;    /* CLOCK_MONOTONIC ms: the decay's period began */
    size_t decay_idle_min;      /* the least idle_bytes() seen at its checks since */
    size_t slack;               /* kept beyond the threshold at frees: grows with churn */
    size_t unmapped_at_free;    /* unmapped at the last release at a free, not mapped again since */
    bool remapped;              /* some of it was mapped again */
    size_t grow_slack;          /* kept beyond the threshold at growth: grows when what growth unmapped is mapped again */
    size_t unmapped_at_growth;  /* unmapped by growth, not mapped again since */
    uint64_t churn_window;      /* num_allocs when the current window of GROW_CHURN_WINDOW began */
    unsigned churn_maps;        /* maps in it of what growth had unmapped */
    uint64_t churn_last;        /* num_allocs at the last such map, or at the last halving */
    uintptr_t spared;           /* the free chunk whose granules the last release at the limit
                                   spared (bfc__expand_release_for_locked), until the fit after it */
    uint64_t calm_since;        /* num_allocs at the last churn or slack decay */
    /* Loans of the slack to other shards' growth (expand.c, "When", (a)):
     * each growth elsewhere that would raise the peak reserved takes what
     * it needs, until this shard maps again -- which takes the loan back
     * and shuts lending for lend_every of its allocations (doubled at
     * each take-back). */
    uint64_t lent_at;           /* num_allocs when the loan went out or was taken back */
    uint64_t lend_every;
    bool lending;               /* a loan is out */
    bool lend_shut;             /* taken back: no loan until lend_every allocations passed */
    size_t published;           /* its share of pool.vmm_idle: free mapped bytes above idle_floor and keep */
    size_t published_lend;      /* its share of pool.vmm_lendable: what an open loan adds */
    size_t idle_floor;          /* free mapped bytes the last release at a free left staying (leaving
                                   granules are above it), less the threshold it kept */
    size_t band;                /* with a threshold: staying free bytes past which a release at a free
                                   marks granules again (0 until one trims; cleared by a map) */
    bool deferred;              /* a growth went to the slow path: other shards hold free memory */
    int map_status;             /* why the last fit failed to map */
    struct bfc__region *region;
    struct bfc__vmm_gone *gone; /* the record its departure uses */
};

/* Is every granule under a block ending at `end` ready, without a look at
 * the bits?  (The common path: false sends it to take the long way.) */
static inline bool bfc__expand_backed(const struct bfc__expand *x, uintptr_t end)
{
    return end <= x->ready_end;
}

/* Are the granules under [p, p + size) all ready? */
static inline bool bfc__expand_ready(const struct bfc__expand *x, uintptr_t p, size_t size)
{
    size_t g = (p - x->base) >> x->shift, last = (p + size - 1 - x->base) >> x->shift;
    for (; g <= last; g++)
        if (!((x->ready[g >> 6] >> (g & 63)) & 1))
            return false;
    return true;
}

/* Would the release at the limit have unmapped a granule under the
 * leftover [p + rounded, p + size) of free chunk [p, p + size), had it not
 * spared the chunk?  Every granule wholly inside a free chunk, the
 * leftover's first one included when the block ends inside it: the
 * leftover is then cut off, as it was when those granules went. */
static inline bool bfc__expand_spared_leftover(const struct bfc__expand *x, uintptr_t p, size_t size,
                                               size_t rounded)
{
    if (x->spared != p)
        return false;
    uintptr_t g = (uintptr_t)1 << x->shift, off = p - x->base; /* granules count from base */
    uintptr_t whole_lo = (off + g - 1) & ~(g - 1), whole_hi = (off + size) & ~(g - 1);
    return whole_lo < whole_hi && off + rounded < whole_hi;
}

/* All under a->lock. */
/* The reservation (twice the limit, or where the address space refuses
 * that, smaller but at least `need` bytes: expand.c; a new one never above
 * `most` bytes) and every record its departure needs; sets a->x.  The arena
 * then makes its region (bfc__arena_expand_locked) and, if that fails,
 * undoes this with bfc__expand_destroy_locked.  BFC_OK, BFC_ENOMEM, or the
 * backend's error. */
int bfc__expand_create_locked(struct bfc__arena *a, size_t need, size_t most);
void bfc__expand_destroy_locked(struct bfc__arena *a);
/* Maps (or takes back from leaving) the granules under [p, p + size).
 * BFC_OK, BFC_ENOMEM (limit or device), BFC_EBACKEND. */
int bfc__expand_make_ready_locked(struct bfc__arena *a, uintptr_t p, size_t size);
/* Shall a growth of `need` bytes ask the other shards first?  When they
 * hold spare granules; or granules an open loan would lend and the growth
 * would raise the peak reserved (bfc__pool_would_peak: below it, what a
 * shard keeps for its churn costs no memory the context has not held).
 * A hint (relaxed reads), net of what this shard publishes itself. */
bool bfc__expand_ask_others(const struct bfc__arena *a, size_t need);
/* Marks the free whole granules to leave, records the departure fence, and
 * unmaps what may go: waits up to wait_ms for the fence (0: only when it
 * has already completed).  Returns the bytes unmapped. */
size_t bfc__expand_release_locked(struct bfc__arena *a, uint32_t wait_ms);
/* The same, sparing the granules a block of `rounded` bytes would take in
 * the best fit (the fit that follows maps them: the slow path at the
 * limit). */
size_t bfc__expand_release_for_locked(struct bfc__arena *a, uint32_t wait_ms, size_t rounded);
/* Mapped bytes under no block in use or pending (granules shared with a
 * block included: an upper bound of what a release can unmap). */
size_t bfc__expand_idle_bytes(const struct bfc__arena *a);
/* The largest block the arena could hand out now without a map: over its
 * free chunks, the longest front whose granules are all mapped (exact; the
 * OOM report's own-stream figure).  Walks the bins: slow paths only. */
size_t bfc__expand_largest_mapped_free(const struct bfc__arena *a);
/* The smallest free chunk (lowest address among equals) whose front of
 * `rounded` bytes lies in mapped granules: a block the arena can hand out
 * with no map, for when best fit chose a chunk that needs one and the
 * limit refused it.  NULL if none.  Walks the bins: slow paths only. */
struct bfc__chunk *bfc__expand_mapped_fit(const struct bfc__arena *a, size_t rounded);
/* Mapped granules wholly inside runs of adjacent free and pending chunks,
 * in bytes (exact): what unmapping could give the limit once the fences of
 * the shard's stream and of its pending frees allow.  Walks the
 * reservation's chunks: slow paths only (the OOM report). */
size_t bfc__expand_free_granule_bytes(const struct bfc__arena *a);
/* Another shard grows within the limit: releases, without waiting, the
 * free granules beyond what this shard keeps (threshold and churn slack),
 * on the churn book of a release at a free -- and, when a loan of the
 * slack is open, up to *loan bytes of the slack too (*loan is reduced by
 * what it lends).  Returns the bytes unmapped. */
size_t bfc__expand_release_spare_locked(struct bfc__arena *a, size_t *loan);
/* After a free that left bytes_in_use below x->low_water, or came once
 * num_allocs had reached x->decay_at (the caller's inline test): releases
 * free memory left unused for slack_decay_ms, releases when the
 * mapped-but-free bytes passed the threshold and the shard's slack, and
 * sets the next low-water mark. */
void bfc__expand_after_free_locked(struct bfc__arena *a);
/* The reservation leaves the arena (the region is unlinked by the caller);
 * with `fence`, released once the owner stream's work has completed. */
void bfc__expand_depart_locked(struct bfc__arena *a, bool fence);
/* Invariants of the granule state (bfc_ctx_check): 0 or -1 and a message. */
int bfc__expand_check_locked(struct bfc__arena *a, char *buf, size_t len);

#endif /* BFC_EXPAND_H */
