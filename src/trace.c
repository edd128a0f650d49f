/*
 * trace.c -- the allocation trace: every allocation, free, fenced-free
 * completion, region grow and release of one context, written as CSV in
 * RMM's logging format (doc/trace.md), and the context's observability
 * set-up (bfc__obs_init / fini).
 *
 * Cost model.  With no trace running, each allocation and free path reads
 * ctx->obs.trace once (relaxed) and branches: nothing else.  With a trace
 * running, an event is a clock read and a store into the calling thread's
 * buffer; a full buffer (TB_EVENTS events) is formatted by its thread and
 * written to the file under the trace's file lock -- the only lock an event
 * may take, once per TB_EVENTS events.
 *
 * Buffers.  Each thread owns at most one buffer (thread-local `tls_tb`),
 * attached to at most one trace at a time; the trace lists its buffers.  A
 * thread recording for another trace than its buffer's flushes to the old
 * one and re-attaches.  A thread's exit flushes and frees its buffer (a
 * pthread key destructor).
 *
 * Stopping without stopping the world.  An event is recorded inside an RCU
 * read-side section that loaded ctx->obs.trace non-NULL.  bfc_ctx_trace_stop
 * clears the pointer, waits for a grace period -- after which no thread is
 * writing into any buffer for this trace, and none will -- and then flushes
 * and detaches every listed buffer itself.  Buffers are matched to traces by
 * a generation number, never by address, so a trace record freed and
 * reallocated at the same address cannot be confused with its predecessor.
 *
 * Locking, outermost first: obs.lock (start/stop) -> reg_lock (buffer lists,
 * attachment) -> trace->flock (the FILE).  An event may be recorded under an
 * arena lock: arena lock -> reg_lock / flock.  Nothing here takes an arena
 * lock.  tb->gen is written under reg_lock and read lock-free by its owner
 * thread (see trace_event for why a stale read is harmless).  obs.lock is an
 * "outer" lock in the fork order (ctx.c): bfc_ctx_trace_stop waits for a
 * grace period under it.  reg_lock and flock are "inner": their holders never
 * wait for liburcu.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ctx.h"

#define TB_EVENTS 512
/* Longest row: 20 + 1 + 20 + 1 + 16 + 1 + 18 + 1 + 20 + 1 + 18 + 1 = 118. */
#define ROW_MAX 128

static const char *const action_csv[] = {
    [BFC__TR_ALLOC] = "allocate",
    [BFC__TR_ALLOC_FAIL] = "allocate failure",
    [BFC__TR_FREE] = "free",
    [BFC__TR_FREE_COMPLETE] = "free_complete",
    [BFC__TR_GROW] = "grow",
    [BFC__TR_RELEASE] = "release",
};

struct tev {
    uint64_t t;
    uintptr_t ptr;
    uint64_t size;
    uintptr_t stream;
    uint32_t action;
};

struct bfc__trace {
    uint64_t gen;            /* unique per trace, never 0 */
    uint64_t t0;             /* CLOCK_MONOTONIC ns at start: times are relative to it */
    FILE *f;
    pthread_mutex_t flock;   /* f and werr */
    bool werr;               /* a write failed */
    struct tbuf *bufs;       /* attached buffers (reg_lock) */
    _Atomic uint64_t dropped;/* events lost for want of a buffer */
};

struct tbuf {
    _Atomic uint64_t gen;    /* generation of the trace attached to; 0 = none (reg_lock) */
    struct bfc__trace *sess; /* that trace (reg_lock) */
    struct tbuf *next, *prev;/* sess->bufs (reg_lock) */
    uint64_t tid;
    uint32_t n;              /* events in ev (owner; others only after a grace period) */
    struct tev ev[TB_EVENTS];
    char out[TB_EVENTS * ROW_MAX];
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t next_gen = 1;
static __thread struct tbuf *tls_tb;
static pthread_key_t tb_key;
static pthread_once_t tb_key_once = PTHREAD_ONCE_INIT;
static int tb_key_status;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Hand-rolled number formatting: snprintf cost ~4x more per row, which was
 * most of a traced event's price. */
static char *put_dec(char *o, uint64_t v)
{
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *o++ = tmp[--n];
    return o;
}

static char *put_hex(char *o, uint64_t v)
{
    static const char digits[] = "0123456789abcdef";
    char tmp[16];
    int n = 0;
    *o++ = '0';
    *o++ = 'x';
    do {
        tmp[n++] = digits[v & 15];
        v >>= 4;
    } while (v);
    while (n)
        *o++ = tmp[--n];
    return o;
}

static char *put_str(char *o, const char *s)
{
    while (*s)
        *o++ = *s++;
    return o;
}

/* Formats and writes tb's events to t; empties tb.  Caller is tb's owner
 * (or holds reg_lock after a grace period, when the owner cannot write). */
static void flush_to(struct tbuf *tb, struct bfc__trace *t)
{
    if (tb->n == 0)
        return;
    char *o = tb->out;
    for (uint32_t i = 0; i < tb->n; i++) {
        const struct tev *e = &tb->ev[i];
        /* RMM's columns; pointers and streams as fmt::ptr writes them.
         * At most 20+1+20+1+16+1+18+1+20+1+18+1 < ROW_MAX bytes. */
        o = put_dec(o, tb->tid);
        *o++ = ',';
        o = put_dec(o, e->t >= t->t0 ? e->t - t->t0 : 0);
        *o++ = ',';
        o = put_str(o, action_csv[e->action]);
        *o++ = ',';
        o = put_hex(o, e->ptr);
        *o++ = ',';
        o = put_dec(o, e->size);
        *o++ = ',';
        o = put_hex(o, e->stream);
        *o++ = '\n';
    }
    size_t len = (size_t)(o - tb->out);
    tb->n = 0;
    bfc__plock(&t->flock);
    if (fwrite(tb->out, 1, len, t->f) != len)
        t->werr = true;
    bfc__punlock(&t->flock);
}

static void unlink_buf(struct tbuf *tb)
{
    struct bfc__trace *t = tb->sess;
    if (tb->prev)
        tb->prev->next = tb->next;
    else
        t->bufs = tb->next;
    if (tb->next)
        tb->next->prev = tb->prev;
    tb->next = tb->prev = NULL;
    tb->sess = NULL;
    atomic_store_explicit(&tb->gen, 0, memory_order_relaxed);
}

/* Thread exit: whatever the buffer holds goes to its trace. */
static void tb_destructor(void *arg)
{
    struct tbuf *tb = arg;
    bfc__plock(&reg_lock);
    if (tb->sess) {
        flush_to(tb, tb->sess);
        unlink_buf(tb);
    }
    bfc__punlock(&reg_lock);
    if (tls_tb == tb)
        tls_tb = NULL;
    bfc__meta_free(tb, sizeof(*tb));
}

static void tb_key_init(void)
{
    tb_key_status = pthread_key_create(&tb_key, tb_destructor);
}

/* The calling thread's buffer, attached to t (under t's RCU section).  NULL
 * when none can be had (the event is dropped and counted). */
static struct tbuf *attach(struct bfc__trace *t)
{
    struct tbuf *tb = tls_tb;
    if (!tb) {
        int e = pthread_once(&tb_key_once, tb_key_init);
        if (e != 0 || tb_key_status != 0)
            return NULL;
        tb = bfc__meta_zalloc(sizeof(*tb));
        if (!tb)
            return NULL;
        tb->tid = (uint64_t)syscall(SYS_gettid);
        if (pthread_setspecific(tb_key, tb) != 0) {
            bfc__meta_free(tb, sizeof(*tb));
            return NULL;
        }
        tls_tb = tb;
    }
    bfc__plock(&reg_lock);
    if (tb->sess) {
        /* Still attached to another trace, which cannot have been freed:
         * its stop detaches us under reg_lock before freeing it. */
        flush_to(tb, tb->sess);
        unlink_buf(tb);
    }
    tb->sess = t;
    tb->next = t->bufs;
    tb->prev = NULL;
    if (t->bufs)
        t->bufs->prev = tb;
    t->bufs = tb;
    atomic_store_explicit(&tb->gen, t->gen, memory_order_relaxed);
    bfc__punlock(&reg_lock);
    return tb;
}

void bfc__trace_event(struct bfc_ctx *ctx, enum bfc__trace_action action, uintptr_t ptr, size_t size,
                      bfc_stream_t stream)
{
    uint64_t now = now_ns();
    bfc__rcu_lock();
    /* acquire: pairs with the release store in bfc_ctx_trace_start (the
     * record's fields are initialised). */
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_acquire);
    if (t) {
        struct tbuf *tb = tls_tb;
        /* relaxed: only this thread and, under reg_lock, a stopper write
         * tb->gen.  A stopper of *this* trace cannot have run yet (it waits
         * for our read-side section), and any other trace has another
         * generation, so a stale value never makes a false match. */
        if (!tb || atomic_load_explicit(&tb->gen, memory_order_relaxed) != t->gen)
            tb = attach(t);
        if (tb) {
            struct tev *e = &tb->ev[tb->n++];
            e->t = now;
            e->ptr = ptr;
            e->size = size;
            e->stream = (uintptr_t)stream;
            e->action = (uint32_t)action;
            if (tb->n == TB_EVENTS)
                flush_to(tb, t);
        } else {
            /* relaxed: a statistic. */
            atomic_fetch_add_explicit(&t->dropped, 1, memory_order_relaxed);
        }
    }
    bfc__rcu_unlock();
}

int bfc_ctx_trace_start(bfc_ctx_t *ctx, const char *path)
{
    if (!ctx || !path || !path[0] || !ctx->obs.lock_ready)
        return BFC_EINVAL;
    bfc__plock(&ctx->obs.lock);
    int st = BFC_OK;
    if (atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed)) {
        st = BFC_EBUSY;
        goto out;
    }
    struct bfc__trace *t = bfc__meta_zalloc(sizeof(*t));
    if (!t) {
        st = BFC_ENOMEM;
        goto out;
    }
    int e = pthread_mutex_init(&t->flock, NULL);
    if (e != 0) {
        bfc__meta_free(t, sizeof(*t));
        st = BFC_ENOMEM;
        goto out;
    }
    t->f = fopen(path, "w");
    if (!t->f || fputs("Thread,Time,Action,Pointer,Size,Stream\n", t->f) == EOF) {
        if (t->f)
            fclose(t->f);
        pthread_mutex_destroy(&t->flock);
        bfc__meta_free(t, sizeof(*t));
        st = BFC_EINVAL;
        goto out;
    }
    /* relaxed: uniqueness is all that matters. */
    t->gen = atomic_fetch_add_explicit(&next_gen, 1, memory_order_relaxed);
    t->t0 = now_ns();
    /* release: pairs with the acquire load in bfc__trace_event. */
    atomic_store_explicit(&ctx->obs.trace, t, memory_order_release);
out:
    bfc__punlock(&ctx->obs.lock);
    return st;
}

int bfc_ctx_trace_stop(bfc_ctx_t *ctx)
{
    if (!ctx || !ctx->obs.lock_ready)
        return BFC_EINVAL;
    bfc__plock(&ctx->obs.lock);
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (!t) {
        bfc__punlock(&ctx->obs.lock);
        return BFC_ESTATE;
    }
    atomic_store_explicit(&ctx->obs.trace, NULL, memory_order_relaxed);
    /* Every section that saw t has ended: its events are in the buffers,
     * and no thread will write into a buffer for t again. */
    synchronize_rcu();
    bfc__rcu_reclaim();
    bfc__plock(&reg_lock);
    while (t->bufs) {
        struct tbuf *tb = t->bufs;
        flush_to(tb, t);
        unlink_buf(tb);
    }
    bfc__punlock(&reg_lock);
    int st = BFC_OK;
    if (t->werr || fflush(t->f) != 0)
        st = BFC_EBACKEND;
    if (fclose(t->f) != 0)
        st = BFC_EBACKEND;
    int e = pthread_mutex_destroy(&t->flock);
    if (e != 0)
        bfc__fatal("pthread_mutex_destroy", e);
    bfc__meta_free(t, sizeof(*t));
    bfc__punlock(&ctx->obs.lock);
    return st;
}

/* ------------------------------------------------------------ set-up */

int bfc__obs_init(struct bfc_ctx *ctx)
{
    int e = pthread_mutex_init(&ctx->obs.lock, NULL);
    if (e != 0)
        return BFC_ENOMEM;
    ctx->obs.lock_ready = true;
    /* Host contexts share the process configuration with the device ones;
     * one file per context is what a trace means, so only device contexts
     * follow cfg.trace (a host context can still be traced by the call). */
    if (ctx->cfg.trace[0] && !ctx->is_host) {
        int st = bfc_ctx_trace_start(ctx, ctx->cfg.trace);
        if (st != BFC_OK) {
            ctx->obs.lock_ready = false;
            pthread_mutex_destroy(&ctx->obs.lock);
            return st;
        }
    }
    return BFC_OK;
}

void bfc__obs_fini(struct bfc_ctx *ctx)
{
    if (!ctx->obs.lock_ready)
        return;
    if (atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed))
        (void)bfc_ctx_trace_stop(ctx);
    ctx->obs.lock_ready = false;
    int e = pthread_mutex_destroy(&ctx->obs.lock);
    if (e != 0)
        bfc__fatal("pthread_mutex_destroy", e);
}

/* ------------------------------------------------------------- fork */

void bfc__trace_fork_lock(void)
{
    bfc__plock(&reg_lock);
}

void bfc__trace_fork_unlock(void)
{
    bfc__punlock(&reg_lock);
}

/* Under ctx->obs.lock (held by the fork handlers), so no trace starts or
 * stops meanwhile: the one that runs, if any, keeps its file lock. */
void bfc__trace_fork_lock_file(struct bfc_ctx *ctx)
{
    /* relaxed: obs.lock orders every store of the pointer before us. */
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (t)
        bfc__plock(&t->flock);
}

void bfc__trace_fork_unlock_file(struct bfc_ctx *ctx)
{
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (t)
        bfc__punlock(&t->flock);
}
