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
 * freers dequeue under that queue's own small mutex, without waiting for an
 * enqueue in progress -- contended only by threads freeing into the same
 * owner at the same instant, held for a few instructions, and never an
 * arena lock.  An empty pool (or one whose last record is being put back)
 * creates a record and an event (a backend call): that happens while the
 * pool warms up, then records circulate.
 *
 * If recording the event fails, the free falls back to synchronising the
 * freeing stream; if that fails too, the block is not freed (its claim is
 * undone) and BFC_EBACKEND is returned, so no memory is reused unsafely.
 * A record_stream fence takes its record when the stream is named
 * (bfc_ctx_record_stream, which can fail cleanly with BFC_ENOMEM) and is
 * armed when the block is freed (arena.c, bfc__fence_arm with its
 * fallbacks), so an accepted free never needs to allocate.
 */
#include "remote.h"

int bfc__remote_free(struct bfc__arena *a, struct bfc__chunk *c, bfc_stream_t s, bool *dead)
{
    *dead = false;
    bfc__backend_t *be = a->env->be;
    struct bfc__fence *f = bfc__arena_fence_get(a);
    if (!f) {
        atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
        return BFC_ENOMEM;
    }
    f->chunk = c;
    if (!f->ev || be->ops->event_record(be, f->ev, s) != BFC_OK) {
        if (be->ops->stream_sync(be, s) != BFC_OK) {
            bfc__arena_fence_put(a, f);
            /* release: pairs with the acquire CAS of the next free. */
            atomic_store_explicit(&c->state, BFC__CHUNK_INUSE, memory_order_release);
            return BFC_EBACKEND;
        }
        f->synced = true;
    }
    cds_wfcq_node_init(&f->qnode);
    atomic_store_explicit(&f->handoff, 1, memory_order_release);
    cds_wfcq_enqueue(&a->rq_head, &a->rq_tail, &f->qnode);
    /* A retired owner has no thread of its own to drain its queue: whoever
     * enqueues after retirement drains it.  seq_cst fence: pairs with the
     * seq_cst store of `retired` in bfc__shard_retire, which drains after
     * it; at least one side sees the other. */
    atomic_thread_fence(memory_order_seq_cst);
    if (BFC__UNLIKELY(atomic_load_explicit(&a->retired, memory_order_relaxed))) {
        bfc__lock(&a->lock);
        bfc__arena_drain_locked(a, true);
        *dead = bfc__arena_maybe_dead_locked(a);
        bfc__unlock(&a->lock);
    }
    return BFC_OK;
}
