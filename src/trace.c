/*
 * trace.c -- the allocation trace: every allocation, free, fenced-free
 * completion, region grow and release of one context, written as CSV in
 * RMM's logging format (doc/trace.md).
 *
 * Cost model.  With no trace running, each allocation and free path reads
 * ctx->obs.trace once (relaxed) and branches: nothing else (the fast paths
 * read ctx->fast_off instead, whose BFC__FAST_TRACE bit set_trace keeps
 * with the pointer).  With a trace
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
 * Exit.  A program that returns from main (or calls exit) without
 * bfc_shutdown or bfc_ctx_trace_stop must still get every event: the main
 * thread's buffer is never flushed by a thread-exit destructor (pthread key
 * destructors run only for threads that exit themselves), and idle worker
 * threads still hold theirs.  So the first trace start registers an atexit
 * handler (and the library's destructor does the same work when the
 * library is unloaded), which stops every trace still running exactly as
 * bfc_ctx_trace_stop would: clear the pointer, wait for a grace period
 * (threads still inside an allocation finish recording first), flush every
 * buffer, close the file.  Each running trace is on `running` (reg_lock);
 * whoever takes it off that list -- bfc_ctx_trace_stop or the exit handler
 * -- finishes it, so the two can race without a double close.  A trace on
 * the list has a live context: context destruction stops (and unlists) it
 * first.
 *
 * Output goes through write(2) on a plain descriptor, in whole batches, not
 * through stdio: a stdio buffer would be copied by fork() and written twice
 * (once by each process's exit), and it is one more buffer an exit would
 * have to reach.  After fork() the child's copy of a trace belongs to the
 * parent: it writes nothing (flush_to compares the process id), and the
 * exit handler leaves it alone.
 *
 * Locking, outermost first: obs.lock (start/stop) -> reg_lock (buffer lists,
 * attachment, the running list) -> trace->flock (the file).  An event may be
 * recorded under an arena lock: arena lock -> reg_lock / flock.  Nothing
 * here takes an arena lock, and no one waits for a grace period holding
 * reg_lock (a reader may be waiting for it in attach).  tb->gen is written
 * under reg_lock and read lock-free by its owner thread (see trace_event for
 * why a stale read is harmless).  obs.lock is an "outer" lock in the fork
 * order (ctx.c): bfc_ctx_trace_stop waits for a grace period under it.
 * reg_lock and flock are "inner": their holders never wait for liburcu.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ctx.h"
#include "trace_actions.h"

/* Publishes or clears ctx's running trace, and with it the fast paths' bit
 * (ctx.h: they then step aside to the paths that read obs.trace).  Set
 * after the pointer, cleared before it: a fast path that sees the bit clear
 * while a trace starts misses the event, as a call racing the start would. */
static void set_trace(struct bfc_ctx *ctx, struct bfc__trace *t, memory_order mo)
{
    if (!t)
        atomic_fetch_and_explicit(&ctx->fast_off, ~BFC__FAST_TRACE, memory_order_relaxed);
    atomic_store_explicit(&ctx->obs.trace, t, mo);
    if (t)
        atomic_fetch_or_explicit(&ctx->fast_off, BFC__FAST_TRACE, memory_order_relaxed);
}

#define TB_EVENTS 512
/* Longest row: 20 + 1 + 20 + 1 + 16 + 1 + 18 + 1 + 20 + 1 + 18 + 1 = 118. */
#define ROW_MAX 128

static const char *const action_csv[] = {
#define ACTION_CSV(name, csv) [BFC__TR_##name] = csv,
    BFC_TRACE_ACTIONS(ACTION_CSV)
#undef ACTION_CSV
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
    int fd;
    pid_t pid;               /* the process that started it: the only one that writes */
    bfc__mutex_t flock;      /* fd and werr */
    bool werr;               /* a write failed */
    struct tbuf *bufs;       /* attached buffers (reg_lock) */
    struct bfc_ctx *ctx;     /* traced context (alive while listed) */
    struct bfc__trace *run_next, *run_prev; /* `running` (reg_lock) */
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

static bfc__mutex_t reg_lock = BFC__MUTEX_INIT(BFC__RANK_TRACE_REGISTRY, "the trace buffer registry");
static struct bfc__trace *running; /* traces not yet claimed by a stopper (reg_lock) */
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static int exit_status;            /* BFC_OK once the exit handler is registered */
static _Atomic uint64_t next_gen = 1;
static __thread struct tbuf *tls_tb;
static pthread_key_t tb_key;
static pthread_once_t tb_key_once = PTHREAD_ONCE_INIT;
static int tb_key_status;

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

/* write(2) until done; false on an error (EINTR is retried). */
static bool write_all(int fd, const char *p, size_t len)
{
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return false;
        }
        p += w;
        len -= (size_t)w;
    }
    return true;
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
    /* A forked child's copy of the trace (and of the buffers) is the
     * parent's: writing it would duplicate the parent's events. */
    if (getpid() != t->pid)
        return;
    /* Not cancellable while the file's lock (and maybe an arena's) is
     * held across write(2) (mutex.h). */
    int cs = bfc__nocancel_begin();
    bfc__lock(&t->flock);
    if (!write_all(t->fd, tb->out, len))
        t->werr = true;
    bfc__unlock(&t->flock);
    bfc__nocancel_end(cs);
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
    bfc__lock(&reg_lock);
    if (tb->sess) {
        flush_to(tb, tb->sess);
        unlink_buf(tb);
    }
    bfc__unlock(&reg_lock);
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
    bfc__lock(&reg_lock);
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
    bfc__unlock(&reg_lock);
    return tb;
}

void bfc__trace_event(struct bfc__obs *obs, enum bfc__trace_action action, uintptr_t ptr, size_t size,
                      bfc_stream_t stream)
{
    uint64_t now = bfc__clock_ns(CLOCK_MONOTONIC);
    bfc__rcu_lock();
    /* acquire: pairs with the release store in bfc_ctx_trace_start (the
     * record's fields are initialised). */
    struct bfc__trace *t = atomic_load_explicit(&obs->trace, memory_order_acquire);
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

/* Why an open of a trace's path failed: BFC_ENOMEM for descriptors or
 * memory exhausted, BFC_EBACKEND for a file system out of space or failing
 * (as a header that cannot be written), else BFC_EINVAL: the path (no such
 * directory, no permission, a directory, a read-only file system...). */
static int open_status(int err)
{
    switch (err) {
    case EMFILE:
    case ENFILE:
    case ENOMEM:
        return BFC_ENOMEM;
    case ENOSPC:
    case EDQUOT:
    case EIO:
        return BFC_EBACKEND;
    default:
        return BFC_EINVAL;
    }
}

static void run_unlink(struct bfc__trace *t)
{
    if (t->run_prev)
        t->run_prev->run_next = t->run_next;
    else
        running = t->run_next;
    if (t->run_next)
        t->run_next->run_prev = t->run_prev;
    t->run_next = t->run_prev = NULL;
}

/*
 * Finishes traces already taken off `running` (and whose contexts no longer
 * point at them): after one grace period no thread writes into a buffer for
 * any of them; their buffers are flushed and detached, their files closed.
 * BFC_OK, or BFC_EBACKEND when a write of any of them failed.  Call without
 * reg_lock.
 */
static int finish(struct bfc__trace *list)
{
    if (!list)
        return BFC_OK;
    /* Every section that saw one of them has ended: its events are in the
     * buffers, and no thread will write into a buffer for them again. */
    synchronize_rcu();
    bfc__rcu_reclaim();
    int st = BFC_OK;
    while (list) {
        struct bfc__trace *t = list;
        list = t->run_next;
        bfc__lock(&reg_lock);
        while (t->bufs) {
            struct tbuf *tb = t->bufs;
            flush_to(tb, t);
            unlink_buf(tb);
        }
        bfc__unlock(&reg_lock);
        if (t->werr)
            st = BFC_EBACKEND;
        if (close(t->fd) != 0 && errno != EINTR)
            st = BFC_EBACKEND;
        bfc__mutex_destroy(&t->flock);
        bfc__meta_free(t, sizeof(*t));
    }
    return st;
}

/*
 * The process is exiting (atexit), or the library is being unloaded (its
 * destructor): stop every trace this process started and that is still
 * running, so that the file holds every event up to here.  Idempotent.
 */
static void stop_all_at_exit(void)
{
    struct bfc__trace *mine = NULL, *last = NULL;
    pid_t self = getpid();
    /* A grace period and the files' writes and closes: exit() (or
     * dlclose) must not end here on a pending cancellation (mutex.h). */
    int cs = bfc__nocancel_begin();
    bfc__lock(&reg_lock);
    for (struct bfc__trace *t = running, *next; t; t = next) {
        next = t->run_next;
        if (t->pid != self)
            continue; /* a parent's trace inherited through fork */
        run_unlink(t);
        /* relaxed: the grace period in finish orders this store before
         * every buffer access that follows (as in bfc_ctx_trace_stop). */
        set_trace(t->ctx, NULL, memory_order_relaxed);
        if (last)
            last->run_next = t;
        else
            mine = t;
        last = t;
    }
    bfc__unlock(&reg_lock);
    (void)finish(mine); /* nothing left to report a write error to */
    bfc__nocancel_end(cs);
}

static void exit_register(void)
{
    exit_status = atexit(stop_all_at_exit) == 0 ? BFC_OK : BFC_ENOMEM;
}

/* Unloading the library (dlclose) without exit: the same flush.  At exit
 * the atexit handler has already run and this finds nothing to do. */
__attribute__((destructor)) static void trace_unload(void)
{
    stop_all_at_exit();
}

int bfc_ctx_trace_start(bfc_ctx_t *ctx, const char *path)
{
    if (!ctx || !path || !path[0] || !ctx->obs.lock_ready)
        return BFC_EINVAL;
    int e = pthread_once(&exit_once, exit_register);
    if (e != 0)
        bfc__fatal("pthread_once", e);
    if (exit_status != BFC_OK)
        return exit_status; /* a trace that would lose its tail at exit */
    int cs = bfc__nocancel_begin(); /* open and write under obs.lock (mutex.h) */
    bfc__lock(&ctx->obs.lock);
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
    e = bfc__mutex_init(&t->flock, BFC__RANK_TRACE_FILE, "a trace's file");
    if (e != 0) {
        bfc__meta_free(t, sizeof(*t));
        st = BFC_ENOMEM;
        goto out;
    }
    static const char header[] = "Thread,Time,Action,Pointer,Size,Stream\n";
    do
        t->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    while (t->fd < 0 && errno == EINTR);
    if (t->fd < 0 || !write_all(t->fd, header, sizeof header - 1)) {
        /* A path that cannot be opened is the caller's, unless the process
         * or the file system is short of something for now (a later start
         * may not be); a header that cannot be written (a full disk) is
         * the file system's, as a failed write is at bfc_ctx_trace_stop. */
        st = t->fd < 0 ? open_status(errno) : BFC_EBACKEND;
        if (t->fd >= 0)
            (void)close(t->fd);
        bfc__mutex_destroy(&t->flock);
        bfc__meta_free(t, sizeof(*t));
        goto out;
    }
    t->pid = getpid();
    t->ctx = ctx;
    /* relaxed: uniqueness is all that matters. */
    t->gen = atomic_fetch_add_explicit(&next_gen, 1, memory_order_relaxed);
    t->t0 = bfc__clock_ns(CLOCK_MONOTONIC);
    bfc__lock(&reg_lock);
    t->run_next = running;
    if (running)
        running->run_prev = t;
    running = t;
    /* release: pairs with the acquire load in bfc__trace_event.  Under
     * reg_lock, so the exit handler sees the trace listed and published
     * together. */
    set_trace(ctx, t, memory_order_release);
    bfc__unlock(&reg_lock);
out:
    bfc__unlock(&ctx->obs.lock);
    bfc__nocancel_end(cs);
    return st;
}

int bfc_ctx_trace_stop(bfc_ctx_t *ctx)
{
    if (!ctx || !ctx->obs.lock_ready)
        return BFC_EINVAL;
    /* A grace period, the buffers' writes and close under obs.lock (mutex.h). */
    int cs = bfc__nocancel_begin();
    bfc__lock(&ctx->obs.lock);
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (t) {
        /* Claim it, unless the exit handler did first (it clears the
         * pointer under reg_lock when it takes a trace). */
        bfc__lock(&reg_lock);
        if (atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed) == t) {
            run_unlink(t);
            set_trace(ctx, NULL, memory_order_relaxed);
        } else {
            t = NULL;
        }
        bfc__unlock(&reg_lock);
    }
    int st = t ? finish(t) : BFC_ESTATE;
    bfc__unlock(&ctx->obs.lock);
    bfc__nocancel_end(cs);
    return st;
}

/* ------------------------------------------------------------- fork */

void bfc__trace_fork_lock(void)
{
    bfc__lock(&reg_lock);
}

void bfc__trace_fork_unlock(void)
{
    bfc__unlock(&reg_lock);
}

/* Under ctx->obs.lock (held by the fork handlers), so no trace starts or
 * stops meanwhile: the one that runs, if any, keeps its file lock. */
void bfc__trace_fork_lock_file(struct bfc_ctx *ctx)
{
    /* relaxed: obs.lock orders every store of the pointer before us. */
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (t)
        bfc__lock_nested(&t->flock);
}

void bfc__trace_fork_unlock_file(struct bfc_ctx *ctx)
{
    struct bfc__trace *t = atomic_load_explicit(&ctx->obs.trace, memory_order_relaxed);
    if (t)
        bfc__unlock(&t->flock);
}
