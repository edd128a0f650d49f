/*
 * remote.c -- cross-stream frees: {chunk, event} fences travelling from the
 * freeing thread to the owner arena.
 *
 * A block freed on a stream t other than its owner's stream is claimed with a
 * compare-and-swap of its state (INUSE -> FREEING: exactly one of two racing
 * frees wins), fenced with an event recorded on t, and pushed on the owner's
 * wait-free queue (liburcu wfcqueue).  The owner drains the queue under its
 * own lock at its next allocation or when short of memory (arena.c, which
 * never waits for a freer still linking its node): a fence
 * that has completed returns the chunk to the bins; one still in flight puts
 * it on the pending list, where it is never merged or handed out.
 *
 * A retired owner has no thread to drain its queue, so a free into one
 * drains it; if that leaves the owner dead, the free says so (*dead) and
 * its caller -- the context, which owns the shard directory -- reclaims it.
 *
 * Fence records and their events come from the owner's pool (arena.c,
 * bfc__arena_fence_*), a second wfcqueue: the owner enqueues records whose fences completed (wait-free);
 * freers dequeue under the arena's small fpool_lock, without waiting for an
 * enqueue in progress -- contended only by threads freeing into the same
 * owner at the same instant, held for a few instructions, and never an
 * arena lock.  An empty pool (or one whose last record is being put back)
 * creates a record and an event (a backend call): that happens while the
 * pool warms up, then records circulate.
 *
 * If recording the event fails, the free falls back to synchronising the
 * freeing stream; if that fails too, the block is not freed (its claim is
 * undone) and BFC_EBACKEND is returned (BFC_ENOMEM where the record has no
 * event for want of host memory), so no memory is reused unsafely.
 * A record_stream fence takes its record when the stream is named
 * (bfc_ctx_record_stream, which can fail cleanly with BFC_ENOMEM) and is
 * armed when the block is freed (arena.c, bfc__fence_arm with its
 * fallbacks), so an accepted free never needs to allocate.
 *
 * Retirement.  A freer enqueues, then reads a->retired; the retirer stores
 * a->retired, then drains the queue.  Each side must see the other's write
 * (a store-load pattern, Dekker's), or a node would wait in a retired
 * queue that no thread drains.  With a full fence on each side that cost
 * every cross-stream free a seq_cst fence, and the fence waits for the
 * enqueue's last store -- the link into the previous node, a line the
 * owner last read -- to reach the cache: 98% of the samples of a free
 * (perf record, the harness's cross workload) sat on it.  So the fence
 * moves to the rare side, as liburcu's read side does (a consumer of the
 * cross workload then frees 5 to 12% faster on SIM; on a GPU the event
 * recorded per free costs more than either): where the kernel
 * has the membarrier system call (liburcu-bp registered the process for
 * it at start-up), a freer needs only a compiler barrier and the retirer,
 * after its store, runs membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED),
 * which puts a full barrier in every running thread of the process (and a
 * thread not running passes one at its next switch): either a freer's read
 * of `retired` follows that barrier and sees true, or its enqueue precedes
 * it and the retirer's drain sees the node.  Without membarrier both sides
 * fence as before.  Should membarrier ever fail (only a seccomp filter
 * installed after start-up could make it), freers fence from then on;
 * a free racing with that one retirement may stay queued until the
 * retired shard is next drained (the next free into it, collection under
 * pressure, trim or the context's end) -- memory held longer, never
 * handed out early.
 */
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rcu.h"
#include "remote.h"

_Atomic bool bfc__remote_light;

void bfc__remote_init(void)
{
    atomic_store_explicit(&bfc__remote_light, urcu_bp_has_sys_membarrier != 0, memory_order_relaxed);
}

void bfc__remote_mark_retired(struct bfc__arena *a)
{
    atomic_store_explicit(&a->retired, true, memory_order_seq_cst);
    if (!atomic_load_explicit(&bfc__remote_light, memory_order_relaxed))
        return; /* every freer fences: the seq_cst store pairs with theirs */
    if (syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0) != 0) {
        atomic_store_explicit(&bfc__remote_light, false, memory_order_seq_cst);
        /* The kernel's barrier did not run: put our own here. */
        cmm_smp_mb(); /* liburcu's full barrier (TSan rejects atomic_thread_fence) */
    }
}

bool bfc__remote_owner_retired(struct bfc__arena *a)
{
    if (BFC__LIKELY(atomic_load_explicit(&bfc__remote_light, memory_order_relaxed)))
        cmm_barrier();
    else
        cmm_smp_mb(); /* liburcu's full barrier (TSan rejects atomic_thread_fence) */
    return atomic_load_explicit(&a->retired, memory_order_relaxed);
}

int bfc__remote_free(struct bfc__arena *a, struct bfc__chunk *c, bfc_stream_t s, uint64_t sid, bool *dead)
{
    *dead = false;
    bfc__backend_t *be = a->env->be;
    struct bfc__fence *f = bfc__arena_fence_get(a);
    if (!f) {
        atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
        return BFC_ENOMEM;
    }
    f->chunk = c;
    if (BFC__LIKELY(f->ev && be->ops->event_record(be, f->ev, s) == BFC_OK)) {
        f->sid = sid; /* recorded on s itself, by this thread (fence.h) */
    } else {
        if (be->ops->stream_sync(be, s) != BFC_OK) {
            /* A record without its event for want of host memory is a
             * record the free could not have: BFC_ENOMEM, as above. */
            int st = !f->ev && f->ev_err == BFC_ENOMEM ? BFC_ENOMEM : BFC_EBACKEND;
            bfc__arena_fence_put(a, f);
            /* release: pairs with the acquire CAS of the next free. */
            atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
            return st;
        }
        f->synced = true;
    }
    /* The streams bfc_ctx_record_stream named are fenced now too, at the
     * free, as the freeing stream is: armed when the owner drained the
     * queue, each event would take that stream's later work as well, and
     * hold the block (pending, counted so) until it ended.  Past the point
     * where the free can fail, as arming cannot.  Their records hang on the
     * chunk under the owner's lock: blocks given a stream only (the common
     * cross-stream free reads one word) try it once, never wait for it (its
     * owner may be mapping memory, or on CUDA waiting for its pending
     * fences); when it is held, the owner arms them as it takes the block
     * (remote_arrived, arena.c): later than needed, never earlier. */
    if (BFC__UNLIKELY(atomic_load_explicit((struct bfc__recorded *_Atomic *)&c->recorded, memory_order_acquire)) &&
        bfc__trylock(&a->lock)) {
        bfc__arena_fence_recorded_locked(a, c, &f->extra);
        bfc__unlock(&a->lock);
    }
    cds_wfcq_node_init(&f->qnode);
    atomic_store_explicit(&f->handoff, 1, memory_order_release);
    cds_wfcq_enqueue(&a->rq_head, &a->rq_tail, &f->qnode);
    /* A retired owner has no thread of its own to drain its queue: whoever
     * enqueues after retirement drains it.  bfc__shard_retire drains after
     * bfc__remote_mark_retired: at least one side sees the other
     * ("Retirement", above). */
    if (BFC__UNLIKELY(bfc__remote_owner_retired(a))) {
        bfc__lock(&a->lock);
        bfc__arena_drain_locked(a, true);
        *dead = bfc__arena_maybe_dead_locked(a);
        bfc__unlock(&a->lock);
    }
    return BFC_OK;
}
