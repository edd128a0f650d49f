/*
 * test_pool.c -- the region pool alone (src/pool.c), driven through its own
 * API on a SIM backend with no context around it: segments from the backend
 * (growth) or one reservation of the limit (no growth), spans carved and
 * given back, coalescing within a segment, departure fences that keep
 * memory for its own stream until they complete (also when two departures
 * of one stream are taken in out of order), best fit over the runs a
 * stream may take, waiting for other streams' fences, fits_with, tickets
 * that make a give-back never allocate, release to the backend, statistics
 * (also the peak when a refused map was in flight while another map was
 * made), and metadata and backend faults.  bfc__pool_check runs after every step
 * that changes the pool.
 */
#define BFC_TESTUTIL_NO_CTX
#include "testutil.h"

#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <shardbfc_sim.h>

#include "backend.h"
#include "meta.h"
#include "pool.h"

/* ------------------------------------------------------------ helpers */

struct fix {
    bfc__backend_t *be;
    struct bfc__pool pool;
    bfc_stream_t s1, s2;
    uint64_t sid1, sid2;
};

static bfc__backend_t *sim_open(void)
{
    bfc_config_t cfg;
    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_SIM;
    bfc__backend_t *be = NULL;
    ck_assert_int_eq(bfc__backend_sim_open(&cfg, &be), BFC_OK);
    ck_assert_ptr_nonnull(be);
    return be;
}

static uint64_t sid_of(bfc__backend_t *be, bfc_stream_t s)
{
    uint64_t id = 0;
    ck_assert_int_eq(be->ops->stream_id(be, s, &id), BFC_OK);
    return id;
}

static void pcheck(struct bfc__pool *p)
{
    char buf[256] = "";
    int bad = bfc__pool_check(p, buf, sizeof buf);
    ck_assert_msg(bad == 0, "bfc__pool_check: %s", buf);
}

static void fix_init(struct fix *f, size_t limit, bool growth)
{
    memset(f, 0, sizeof *f);
    f->be = sim_open();
    ck_assert_int_eq(bfc__pool_init(&f->pool, f->be, limit, growth, true), BFC_OK);
    f->s1 = bfc__sim_stream_create(f->be);
    f->s2 = bfc__sim_stream_create(f->be);
    ck_assert_ptr_nonnull(f->s1);
    ck_assert_ptr_nonnull(f->s2);
    f->sid1 = sid_of(f->be, f->s1);
    f->sid2 = sid_of(f->be, f->s2);
    ck_assert_uint_ne(f->sid1, f->sid2);
    pcheck(&f->pool);
}

/* Tears down and checks that every byte went back to the backend. */
static void fix_fini(struct fix *f)
{
    pcheck(&f->pool);
    bfc__sim_stream_drain(f->be, f->s1);
    bfc__sim_stream_drain(f->be, f->s2);
    bfc__pool_fini(&f->pool);
    ck_assert_uint_eq(bfc__sim_bytes_held(f->be), 0);
    bfc__sim_stream_destroy(f->be, f->s1);
    bfc__sim_stream_destroy(f->be, f->s2);
    f->be->ops->close(f->be);
}

struct rgn {
    uintptr_t base;
    size_t size;
    struct bfc__segment *seg;
    bool used;
};

/* A region of `size` for stream sid that must be served. */
static struct rgn xget(struct fix *f, size_t size, uint64_t sid)
{
    struct rgn r = { 0, size, NULL, true };
    bool others = true;
    int rc = bfc__pool_get(&f->pool, size, sid, &r.base, &r.seg, &r.used, &others);
    ck_assert_msg(rc == BFC_OK, "pool_get(%zu, sid %llu): %s", size, (unsigned long long)sid, bfc_err_name(rc));
    ck_assert_ptr_nonnull(r.seg);
    ck_assert_uint_eq(r.base % 256, 0);
    ck_assert_uint_ge(r.base, r.seg->base);
    ck_assert_uint_le(r.base + size, r.seg->base + r.seg->size);
    ck_assert(!others); /* only set on failure */
    pcheck(&f->pool);
    return r;
}

/* A request that must fail; returns *fenced_others. */
static bool xget_fails(struct fix *f, size_t size, uint64_t sid)
{
    uintptr_t base = 0;
    struct bfc__segment *seg = NULL;
    bool used = true, others = false;
    int rc = bfc__pool_get(&f->pool, size, sid, &base, &seg, &used, &others);
    ck_assert_msg(rc == BFC_ENOMEM, "pool_get(%zu, sid %llu) = %s, %#lx: expected ENOMEM", size,
                  (unsigned long long)sid, bfc_err_name(rc), (unsigned long)base);
    ck_assert(!used);
    pcheck(&f->pool);
    return others;
}

/* Gives r back; fenced on stream s (id sid) when `used`. */
static void xput(struct fix *f, struct rgn r, bool used, bfc_stream_t s, uint64_t sid)
{
    struct bfc__pool_ticket t;
    ck_assert_int_eq(bfc__pool_ticket_get(&f->pool, &t), BFC_OK);
    bfc__pool_put(&f->pool, r.base, r.size, r.seg, used, s, sid, &t);
    ck_assert_ptr_null(t.span);
    ck_assert_ptr_null(t.fence);
    pcheck(&f->pool);
}

static struct bfc__pool_stats pstats(struct fix *f)
{
    struct bfc__pool_stats s;
    bfc__pool_stats(&f->pool, &s);
    return s;
}

static size_t nspans(struct fix *f)
{
    return bfc__pool_spans(&f->pool, NULL, 0);
}

/* Polls the fences (a wait that does not wait). */
static void poll_pool(struct fix *f)
{
    (void)bfc__pool_wait(&f->pool, 0, true, 0);
    pcheck(&f->pool);
}

/* ------------------------------------------------------------- growth */

START_TEST(test_growth_segments)
{
    struct fix f;
    fix_init(&f, 64 * MiB, true);
    struct bfc__pool_stats s = pstats(&f);
    ck_assert_uint_eq(s.held, 0);
    ck_assert_uint_eq(s.segments, 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 0);

    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    ck_assert(!a.used); /* fresh memory carries no fence */
    struct rgn b = xget(&f, 4 * MiB, f.sid1);
    s = pstats(&f);
    ck_assert_uint_eq(s.held, 6 * MiB);
    ck_assert_uint_eq(s.peak_held, 6 * MiB);
    ck_assert_uint_eq(s.committed, 6 * MiB);
    ck_assert_uint_eq(s.free_bytes, 0);
    ck_assert_uint_eq(s.segments, 2);
    ck_assert_uint_eq(s.spans, 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 6 * MiB);
    ck_assert_uint_eq(f.pool.backend_allocs, 2);

    /* An unfenced give-back is served to another stream, from the cached
     * segment, without the backend. */
    xput(&f, a, false, f.s1, f.sid1);
    s = pstats(&f);
    ck_assert_uint_eq(s.free_bytes, 2 * MiB);
    ck_assert_uint_eq(s.committed, 4 * MiB);
    ck_assert_uint_eq(s.departures, 1);
    ck_assert_uint_eq(s.fenced_departures, 0);
    ck_assert_uint_eq(s.fenced_bytes, 0);
    struct rgn c = xget(&f, 2 * MiB, f.sid2);
    ck_assert_uint_eq(c.base, a.base);
    ck_assert(!c.used);
    ck_assert_uint_eq(f.pool.backend_allocs, 2);

    /* A smaller request carves the front of a free span. */
    xput(&f, b, false, f.s1, f.sid1);
    struct rgn d = xget(&f, 1 * MiB, f.sid2);
    ck_assert_uint_eq(d.base, b.base);
    ck_assert_uint_eq(pstats(&f).free_bytes, 3 * MiB);
    xput(&f, d, false, f.s2, f.sid2);
    ck_assert_uint_eq(nspans(&f), 1); /* merged back with the rest of b */
    xput(&f, c, false, f.s2, f.sid2);
    ck_assert_uint_eq(nspans(&f), 2); /* two segments never merge */
    fix_fini(&f);
}
END_TEST

START_TEST(test_growth_limit)
{
    struct fix f;
    fix_init(&f, 8 * MiB, true);
    xget_fails(&f, 0, f.sid1);
    xget_fails(&f, 8 * MiB + 256, f.sid1);
    struct rgn a = xget(&f, 4 * MiB, f.sid1);
    struct rgn b = xget(&f, 4 * MiB, f.sid1);
    xget_fails(&f, 256, f.sid1);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 8 * MiB);

    /* Half of each segment free: 4 MiB under the limit, but in no one
     * run, and no segment is wholly free to go back to the backend. */
    struct rgn a1 = { a.base, 2 * MiB, a.seg, false }, a2 = { a.base + 2 * MiB, 2 * MiB, a.seg, false };
    struct rgn b1 = { b.base, 2 * MiB, b.seg, false }, b2 = { b.base + 2 * MiB, 2 * MiB, b.seg, false };
    xput(&f, a1, false, f.s1, f.sid1);
    xput(&f, b2, false, f.s1, f.sid1);
    xget_fails(&f, 4 * MiB, f.sid1);
    ck_assert_uint_eq(pstats(&f).held, 8 * MiB);
    ck_assert_uint_eq(f.pool.backend_frees, 0);

    /* a wholly free goes back to make room, which is still not enough
     * for 6 MiB while b1 is lent. */
    xput(&f, a2, false, f.s1, f.sid1);
    xget_fails(&f, 6 * MiB, f.sid1);
    ck_assert_uint_eq(pstats(&f).held, 4 * MiB);
    ck_assert_uint_eq(f.pool.backend_frees, 1);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 4 * MiB);

    /* All free: b goes back too and one segment of the limit is made. */
    xput(&f, b1, false, f.s1, f.sid1);
    struct rgn c = xget(&f, 8 * MiB, f.sid2);
    ck_assert_uint_eq(pstats(&f).held, 8 * MiB);
    ck_assert_uint_eq(pstats(&f).segments, 1);
    ck_assert_uint_eq(f.pool.backend_frees, 2);
    xput(&f, c, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/* Without recycle (garbage_collection off) a wholly free segment stays
 * cached: a request it cannot hold fails, rather than free it to the
 * backend, and bfc__pool_largest does not count on it; only an explicit
 * release (trim) gives it back. */
START_TEST(test_growth_no_recycle)
{
    struct fix f;
    fix_init(&f, 8 * MiB, true);
    f.pool.recycle = false;
    struct rgn a = xget(&f, 4 * MiB, f.sid1);
    struct rgn b = xget(&f, 2 * MiB, f.sid1);
    xput(&f, a, false, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid1), 4 * MiB);
    xget_fails(&f, 6 * MiB, f.sid1);
    ck_assert_uint_eq(f.pool.backend_frees, 0);
    ck_assert_uint_eq(pstats(&f).held, 6 * MiB);
    /* What is cached still serves what it can hold. */
    struct rgn c = xget(&f, 4 * MiB, f.sid2);
    ck_assert_uint_eq(c.base, a.base);
    xput(&f, c, false, f.s2, f.sid2);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 4 * MiB);
    struct rgn d = xget(&f, 6 * MiB, f.sid1);
    ck_assert_uint_eq(f.pool.backend_frees, 1);
    xput(&f, d, false, f.s1, f.sid1);
    xput(&f, b, false, f.s1, f.sid1);
    fix_fini(&f);
}
END_TEST

START_TEST(test_release_free)
{
    struct fix f;
    fix_init(&f, 64 * MiB, true);
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    struct rgn b = xget(&f, 2 * MiB, f.sid1);
    struct rgn c = xget(&f, 2 * MiB, f.sid1);
    struct rgn d = xget(&f, 2 * MiB, f.sid1);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 0); /* nothing free */
    xput(&f, a, false, f.s1, f.sid1);
    xput(&f, b, false, f.s1, f.sid1);
    /* A partly free segment stays. */
    struct rgn c1 = { c.base, 1 * MiB, c.seg, false };
    xput(&f, c1, false, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 4 * MiB);
    pcheck(&f.pool);
    ck_assert_uint_eq(pstats(&f).held, 4 * MiB);
    ck_assert_uint_eq(pstats(&f).peak_held, 8 * MiB);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 4 * MiB);

    /* A fenced segment stays until its fence completes. */
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, d, true, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 0);
    bfc__sim_stream_drain(f.be, f.s1);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 2 * MiB);
    pcheck(&f.pool);

    bfc__pool_clear_peak(&f.pool);
    ck_assert_uint_eq(pstats(&f).peak_held, 2 * MiB);
    struct rgn c2 = { c.base + 1 * MiB, 1 * MiB, c.seg, false };
    xput(&f, c2, false, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 2 * MiB);
    ck_assert_uint_eq(pstats(&f).held, 0);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 0);
    fix_fini(&f);
}
END_TEST

/* ---------------------------------------------------------- no growth */

START_TEST(test_reservation)
{
    struct fix f;
    fix_init(&f, 16 * MiB, false);
    struct bfc__pool_stats s = pstats(&f);
    ck_assert_uint_eq(s.held, 16 * MiB);
    ck_assert_uint_eq(s.free_bytes, 16 * MiB);
    ck_assert_uint_eq(s.segments, 1);
    ck_assert_uint_eq(s.spans, 1);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 16 * MiB);

    struct rgn a = xget(&f, 4 * MiB, f.sid1);
    struct rgn b = xget(&f, 4 * MiB, f.sid2);
    ck_assert_uint_eq(b.base, a.base + 4 * MiB); /* carved in address order */
    ck_assert_ptr_eq(a.seg, b.seg);
    xget_fails(&f, 16 * MiB, f.sid1);
    struct rgn c = xget(&f, 8 * MiB, f.sid1);
    xget_fails(&f, 256, f.sid1);
    ck_assert_uint_eq(f.pool.backend_allocs, 1); /* never the backend again */

    xput(&f, a, false, f.s1, f.sid1);
    xput(&f, c, false, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 2);
    xput(&f, b, false, f.s2, f.sid2);
    ck_assert_uint_eq(nspans(&f), 1); /* coalesced over the whole reservation */
    ck_assert_uint_eq(bfc__pool_release_free(&f.pool), 0); /* never given back */
    struct rgn w = xget(&f, 16 * MiB, f.sid2);
    ck_assert_uint_eq(w.base, a.base);
    xput(&f, w, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/* ------------------------------------------------- departure fences */

START_TEST(test_fence_own_stream_only)
{
    struct fix f;
    fix_init(&f, 2 * MiB, false);
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, a, true, f.s1, f.sid1);
    struct bfc__pool_stats s = pstats(&f);
    ck_assert_uint_eq(s.fenced_bytes, 2 * MiB);
    ck_assert_uint_eq(s.fenced_departures, 1);
    struct bfc__span_info info[4];
    ck_assert_uint_eq(bfc__pool_spans(&f.pool, info, 4), 1);
    ck_assert(info[0].fenced);
    ck_assert_uint_eq(info[0].stream_id, f.sid1);
    ck_assert_uint_eq(info[0].base, a.base);
    ck_assert_uint_eq(info[0].size, 2 * MiB);

    /* Another stream may not take it while s1's work may still use it,
     * and learns that waiting could help. */
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2));
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2));
    /* Its own stream may: stream order covers it, and it is told so. */
    struct rgn b = xget(&f, 1 * MiB, f.sid1);
    ck_assert(b.used);
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 1 * MiB);
    xput(&f, b, true, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 1); /* same guard: merged */
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2));

    /* Once the work has completed, anyone may, and nothing is "used". */
    bfc__sim_stream_drain(f.be, f.s1);
    struct rgn c = xget(&f, 2 * MiB, f.sid2);
    ck_assert(!c.used);
    s = pstats(&f);
    ck_assert_uint_eq(s.fenced_bytes, 0);
    ck_assert_uint_eq(s.departures, 2);
    ck_assert_uint_eq(s.fenced_departures, 2);
    xput(&f, c, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/* Unlike guards never merge; a completed fence merges with its neighbours. */
START_TEST(test_fence_merge_rules)
{
    struct fix f;
    fix_init(&f, 4 * MiB, false);
    struct rgn r[4];
    for (int i = 0; i < 4; i++)
        r[i] = xget(&f, 1 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    bfc__sim_stream_hold(f.be, f.s2);
    xput(&f, r[0], true, f.s1, f.sid1);
    xput(&f, r[1], true, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 1);
    xput(&f, r[2], true, f.s2, f.sid2);
    ck_assert_uint_eq(nspans(&f), 2);
    xput(&f, r[3], false, f.s2, f.sid2);
    ck_assert_uint_eq(nspans(&f), 3);
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 3 * MiB);
    poll_pool(&f);
    ck_assert_uint_eq(nspans(&f), 3);

    bfc__sim_stream_drain(f.be, f.s2);
    poll_pool(&f);
    ck_assert_uint_eq(nspans(&f), 2); /* r[2] joined r[3] */
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 2 * MiB);
    bfc__sim_stream_drain(f.be, f.s1);
    poll_pool(&f);
    ck_assert_uint_eq(nspans(&f), 1);
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 0);
    fix_fini(&f);
}
END_TEST

/* The fences guarding the span at `base` (0 when there is none). */
static unsigned fences_at(struct fix *f, uintptr_t base)
{
    struct bfc__span_info info[16];
    size_t n = bfc__pool_spans(&f->pool, info, 16);
    ck_assert_uint_le(n, 16);
    for (size_t i = 0; i < n; i++)
        if (info[i].base == base) {
            ck_assert(info[i].fenced == (info[i].fences > 0));
            return info[i].fences;
        }
    ck_abort_msg("no span at %#lx", (unsigned long)base);
    return 0;
}

static void ticket(struct fix *f, struct bfc__pool_ticket *t)
{
    ck_assert_int_eq(bfc__pool_ticket_get(&f->pool, t), BFC_OK);
}

/* Departures of one stream armed in one order and taken in in the other,
 * as two arenas of one stream id (a released stream's shard and its new
 * one) do from two threads: the older fence must not guard the newer's
 * memory.  A departure armed on the idle stream stands for the older one
 * (its work has all run); the stream is then held and the newer departure
 * armed behind that work, and taken in first. */
START_TEST(test_fence_order)
{
    struct fix f;
    fix_init(&f, 4 * MiB, false);
    struct rgn a = xget(&f, 1 * MiB, f.sid1);
    struct rgn m = xget(&f, 1 * MiB, f.sid1);
    struct rgn b = xget(&f, 1 * MiB, f.sid1);
    struct rgn rest = xget(&f, 1 * MiB, f.sid2);
    ck_assert_uint_eq(m.base, a.base + 1 * MiB);
    ck_assert_uint_eq(b.base, m.base + 1 * MiB);
    struct bfc__pool_ticket tm, tb;
    ticket(&f, &tm);
    ticket(&f, &tb);

    /* Two that meet (the new range after the span: joins its end). */
    bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &tb);
    bfc__sim_stream_hold(f.be, f.s1);
    bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &tm);
    bfc__pool_put_armed(&f.pool, m.base, m.size, m.seg, true, f.sid1, &tm);
    bfc__pool_put_armed(&f.pool, b.base, b.size, b.seg, true, f.sid1, &tb);
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 1);
    ck_assert_uint_eq(fences_at(&f, m.base), 2);
    /* m's fence has not completed: no other stream may take any of it. */
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2));
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2));
    /* Its own stream still may (stream order). */
    struct rgn own = xget(&f, 2 * MiB, f.sid1);
    ck_assert(own.used);
    xput(&f, own, true, f.s1, f.sid1); /* armed after both: covers them */
    ck_assert_uint_eq(fences_at(&f, m.base), 1);
    bfc__sim_stream_drain(f.be, f.s1);
    struct rgn c = xget(&f, 2 * MiB, f.sid2);
    ck_assert(!c.used);
    xput(&f, c, false, f.s2, f.sid2);

    /* Three: the middle one, armed first, taken in last between two
     * fenced spans (joins both). */
    m = xget(&f, 1 * MiB, f.sid1);
    b = xget(&f, 1 * MiB, f.sid1);
    ck_assert_uint_eq(m.base, a.base + 1 * MiB);
    ck_assert_uint_eq(b.base, m.base + 1 * MiB);
    ticket(&f, &tm);
    bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &tm);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, a, true, f.s1, f.sid1);
    xput(&f, b, true, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 2);
    bfc__pool_put_armed(&f.pool, m.base, m.size, m.seg, true, f.sid1, &tm);
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 1);
    ck_assert_uint_eq(fences_at(&f, a.base), 3);
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2));
    bfc__sim_stream_drain(f.be, f.s1);
    c = xget(&f, 3 * MiB, f.sid2);
    ck_assert(!c.used);
    xput(&f, c, false, f.s2, f.sid2);

    /* In order, one after the other: the newer fence alone guards both. */
    a = xget(&f, 1 * MiB, f.sid1);
    m = xget(&f, 1 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, m, true, f.s1, f.sid1);
    xput(&f, a, true, f.s1, f.sid1);
    ck_assert_uint_eq(fences_at(&f, a.base), 1);
    bfc__sim_stream_drain(f.be, f.s1);
    xput(&f, rest, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/*
 * The same at random (seed _i; odd seeds with growth): stream 1 takes
 * regions, arms their departures at random moments -- its stream held
 * (busy) or idle, one in 8 with the event record failing -- and has them
 * taken in later in any order; stream 2 takes and gives back memory, and
 * the fences are polled and waited for (without waiting).  The model: a
 * departure armed while stream 1 was held guards its range until the next
 * drain, and stream 2 must never get any of it.  bfc__pool_check after
 * every step (which also says no chained fence is covered by its span's
 * newest).  The old rule (keep only the fence taken in last) fails 5 of
 * the 8 seeds.
 */
#define ORDER_MAX 64
#define ORDER_STEPS 4000

struct order_rgn {
    struct rgn r;
    struct bfc__pool_ticket t;
    bool armed, busy;
};

static uint64_t order_rand(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

static bool order_get(struct fix *f, uint64_t *x, uint64_t sid, struct rgn *r)
{
    bool others;
    *r = (struct rgn){ 0, (1 + order_rand(x) % 12) * 256 * 1024, NULL, true };
    return bfc__pool_get(&f->pool, r->size, sid, &r->base, &r->seg, &r->used, &others) == BFC_OK;
}

START_TEST(test_fence_order_model)
{
    struct fix f;
    fix_init(&f, 16 * MiB, (_i & 1) != 0);
    uint64_t x = (uint64_t)_i * 7919 + 17;
    struct order_rgn own[ORDER_MAX]; /* stream 1's: live, or armed and not yet taken in */
    static struct rgn busy[ORDER_STEPS]; /* at most one per step */
    struct rgn o2[ORDER_MAX];
    size_t nown = 0, nbusy = 0, no2 = 0;
    bool held = false;
    unsigned gets2 = 0, chained = 0;
    for (int step = 0; step < ORDER_STEPS; step++) {
        unsigned op = order_rand(&x) % 100;
        if (op < 20 && nown < ORDER_MAX) {
            struct order_rgn o = { .armed = false };
            if (order_get(&f, &x, f.sid1, &o.r))
                own[nown++] = o;
        } else if (op < 40 && nown) {
            struct order_rgn *o = &own[order_rand(&x) % nown];
            if (!o->armed) {
                ticket(&f, &o->t);
                bfc__sim_fail_event_every(f.be, order_rand(&x) % 8 == 0);
                bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &o->t);
                bfc__sim_fail_event_every(f.be, 0);
                o->armed = true;
                o->busy = held;
            }
        } else if (op < 60 && nown) {
            size_t k = order_rand(&x) % nown;
            struct order_rgn *o = &own[k];
            if (o->armed) {
                bfc__pool_put_armed(&f.pool, o->r.base, o->r.size, o->r.seg, true, f.sid1, &o->t);
                if (o->busy)
                    busy[nbusy++] = o->r;
                own[k] = own[--nown];
            }
        } else if (op < 66) {
            if (!held)
                bfc__sim_stream_hold(f.be, f.s1);
            held = true;
        } else if (op < 70) {
            /* Completes everything recorded so far, taken in or not. */
            bfc__sim_stream_drain(f.be, f.s1);
            held = false;
            nbusy = 0;
            for (size_t i = 0; i < nown; i++)
                own[i].busy = false;
        } else if (op < 85 && no2 < ORDER_MAX) {
            struct rgn r;
            if (order_get(&f, &x, f.sid2, &r)) {
                gets2++;
                ck_assert(!r.used);
                for (size_t i = 0; i < nbusy; i++)
                    ck_assert_msg(r.base + r.size <= busy[i].base || busy[i].base + busy[i].size <= r.base,
                                  "seed %d step %d: stream 2 got %#lx+%zu over busy %#lx+%zu", _i, step,
                                  (unsigned long)r.base, r.size, (unsigned long)busy[i].base, busy[i].size);
                o2[no2++] = r;
            }
        } else if (op < 95 && no2) {
            size_t k = order_rand(&x) % no2;
            xput(&f, o2[k], order_rand(&x) & 1, f.s2, f.sid2);
            o2[k] = o2[--no2];
        } else if (op < 97) {
            (void)bfc__pool_wait(&f.pool, f.sid2, false, 0);
        } else {
            bfc__pool_poll(&f.pool);
        }
        struct bfc__span_info info[4 * ORDER_MAX];
        size_t n = bfc__pool_spans(&f.pool, info, 4 * ORDER_MAX);
        ck_assert_uint_le(n, 4 * ORDER_MAX);
        for (size_t i = 0; i < n; i++)
            chained += info[i].fences > 1;
        pcheck(&f.pool);
    }
    bfc__sim_stream_drain(f.be, f.s1);
    for (size_t i = 0; i < nown; i++) {
        if (!own[i].armed) {
            ticket(&f, &own[i].t);
            bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &own[i].t);
        }
        bfc__pool_put_armed(&f.pool, own[i].r.base, own[i].r.size, own[i].r.seg, true, f.sid1, &own[i].t);
    }
    for (size_t i = 0; i < no2; i++)
        xput(&f, o2[i], false, f.s2, f.sid2);
    /* The model saw what it is for: stream 2 served, spans with chains. */
    ck_assert_uint_gt(gets2, 100);
    ck_assert_uint_gt(chained, 0);
    fix_fini(&f);
}
END_TEST

static struct bfc__span *span_at(struct fix *f, uintptr_t base)
{
    for (struct bfc__span *s = f->pool.spans; s; s = s->next)
        if (s->base == base)
            return s;
    ck_abort_msg("no span at %#lx", (unsigned long)base);
    return NULL;
}

/*
 * A departure of stream 1 taken in while another of its departures is
 * being armed, between its event record and its look at `inserted` (a
 * second thread's departure, here run from a hooked event_record): the
 * fence being armed was recorded before that departure's, so it must not
 * count as covering it.  Its own record is on the idle stream (complete),
 * the other's behind held work: stream 2 may take nothing until the drain.
 */
static const struct bfc__backend_ops *g_rec_real;
static struct bfc__backend_ops g_rec_ops;
static struct fix *g_rec_fix;
static struct rgn g_rec_rgn;
static int g_rec_state; /* 1: the next record takes in g_rec_rgn after it; 2: done */

static int racing_record(bfc__backend_t *be, bfc__event_t ev, bfc_stream_t s)
{
    int st = g_rec_real->event_record(be, ev, s);
    if (g_rec_state == 1) {
        struct fix *f = g_rec_fix;
        struct bfc__pool_ticket t;
        g_rec_state = 2;
        be->ops = g_rec_real; /* the SIM's own calls know their backend by its ops */
        ck_assert_int_eq(bfc__pool_ticket_get(&f->pool, &t), BFC_OK);
        bfc__sim_stream_hold(f->be, f->s1);
        bfc__pool_put(&f->pool, g_rec_rgn.base, g_rec_rgn.size, g_rec_rgn.seg, true, f->s1, f->sid1, &t);
        be->ops = &g_rec_ops;
    }
    return st;
}

START_TEST(test_fence_order_arm_race)
{
    struct fix f;
    fix_init(&f, 2 * MiB, false);
    struct rgn a = xget(&f, 1 * MiB, f.sid1);
    g_rec_rgn = xget(&f, 1 * MiB, f.sid1);
    ck_assert_uint_eq(g_rec_rgn.base, a.base + 1 * MiB);
    g_rec_real = f.be->ops;
    g_rec_ops = *f.be->ops;
    g_rec_ops.event_record = racing_record;
    f.be->ops = &g_rec_ops;
    g_rec_fix = &f;
    g_rec_state = 1;
    struct bfc__pool_ticket ta;
    ticket(&f, &ta);
    bfc__pool_put_arm(&f.pool, true, f.s1, f.sid1, &ta);
    ck_assert_int_eq(g_rec_state, 2);
    bfc__pool_put_armed(&f.pool, a.base, a.size, a.seg, true, f.sid1, &ta);
    f.be->ops = g_rec_real;
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 1);
    ck_assert_uint_eq(fences_at(&f, a.base), 2);
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2));
    bfc__sim_stream_drain(f.be, f.s1);
    struct rgn c = xget(&f, 2 * MiB, f.sid2);
    ck_assert(!c.used);
    xput(&f, c, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/*
 * The release/acquire pair on the pool's `inserted` count ("Order"): a
 * fence counts as covering the departures taken in when it was armed
 * (armed_after) because each of them was recorded before it, and "before"
 * must be a happens-before edge from that departure's event record
 * (thread A, before bfc__pool_put_armed numbers it with the release
 * store) to the covering fence's record (thread B, after its acquire load
 * in bfc__pool_put_arm).  Nothing else orders the two records: B takes no
 * pool lock between its look and its record, and SIM's record is a
 * lock-free load of the stream's state and a store to the event, so B's
 * record could read the stream as idle while A's fence covered queued
 * work; B's fence would then complete at once, with A's already sent back
 * to the cache.  A hooked event_record keeps a plain "driver log" word,
 * written by A's record and read by B's once B's armed_after counts A's
 * departure: under ThreadSanitizer either side weakened to relaxed is a
 * data race on it (TSan never shows a stale atomic value, so the
 * stream-safety failure itself cannot be forced on x86).
 */
static const struct bfc__backend_ops *g_hb_real;
static struct bfc__backend_ops g_hb_ops;
static __thread int t_hb_role; /* 1: departure A, 2: covering fence B */
static int g_hb_log;           /* plain: the "driver's" record log */
static int g_hb_seen = -1;     /* what B's covering record read (plain, B only) */
static struct bfc__pool_ticket g_hb_tb;
static uint64_t g_hb_target; /* A's departure number */

static int hb_record(bfc__backend_t *be, bfc__event_t ev, bfc_stream_t s)
{
    int st = g_hb_real->event_record(be, ev, s);
    /* After the real record: SIM's own atomics must not carry the edge. */
    if (t_hb_role == 1)
        g_hb_log = 1;
    else if (t_hb_role == 2 && g_hb_tb.fence->order.armed_after >= g_hb_target)
        g_hb_seen = g_hb_log;
    return st;
}

struct hb_dep {
    struct fix *f;
    struct rgn r;
    struct bfc__pool_ticket t;
};

static void *hb_depart_a(void *arg)
{
    struct hb_dep *d = arg;
    t_hb_role = 1;
    bfc__pool_put_arm(&d->f->pool, true, d->f->s1, d->f->sid1, &d->t);
    bfc__pool_put_armed(&d->f->pool, d->r.base, d->r.size, d->r.seg, true, d->f->sid1, &d->t);
    return NULL;
}

static void *hb_arm_b(void *arg)
{
    struct fix *f = arg;
    t_hb_role = 2;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        /* Re-arms B's fence: a later record fences more, never less. */
        bfc__pool_put_arm(&f->pool, true, f->s1, f->sid1, &g_hb_tb);
        if (g_hb_tb.fence->order.armed_after >= g_hb_target)
            break;
        sched_yield();
        clock_gettime(CLOCK_MONOTONIC, &t1);
    } while (t1.tv_sec - t0.tv_sec < 20);
    return NULL;
}

START_TEST(test_fence_order_happens_before)
{
    struct fix f;
    fix_init(&f, 2 * MiB, false);
    struct hb_dep a = { &f, xget(&f, 1 * MiB, f.sid1), { 0 } };
    struct rgn b = xget(&f, 1 * MiB, f.sid1);
    ticket(&f, &a.t);
    ticket(&f, &g_hb_tb);
    g_hb_target = atomic_load_explicit(&f.pool.inserted, memory_order_relaxed) + 1;
    g_hb_real = f.be->ops;
    g_hb_ops = *f.be->ops;
    g_hb_ops.event_record = hb_record;
    f.be->ops = &g_hb_ops;
    pthread_t tb, ta;
    ck_assert_int_eq(pthread_create(&tb, NULL, hb_arm_b, &f), 0);
    ck_assert_int_eq(pthread_create(&ta, NULL, hb_depart_a, &a), 0);
    ck_assert_int_eq(pthread_join(ta, NULL), 0);
    ck_assert_int_eq(pthread_join(tb, NULL), 0);
    f.be->ops = g_hb_real;
    ck_assert_uint_ge(g_hb_tb.fence->order.armed_after, g_hb_target);
    /* B's covering record saw A's record: the departure it counts. */
    ck_assert_int_eq(g_hb_seen, 1);
    bfc__pool_put_armed(&f.pool, b.base, b.size, b.seg, true, f.sid1, &g_hb_tb);
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 1); /* the two meet, B's fence covering A's */
    fix_fini(&f);
}
END_TEST

/* Builds, on a fresh 3 MiB pool with one earlier fenced departure taken in
 * and back (so that armed_after counts are not 0), one span of stream 1
 * guarded by two fences: the head, taken in last, armed on the idle stream
 * (complete), and behind it one armed later behind held work.  *zp: the
 * pool's other megabyte, out. */
static uintptr_t chain_of_two(struct fix *f, struct rgn *zp)
{
    fix_init(f, 3 * MiB, false);
    struct rgn z = xget(f, 1 * MiB, f->sid1);
    xput(f, z, true, f->s1, f->sid1);
    z = xget(f, 1 * MiB, f->sid1);
    struct rgn m = xget(f, 1 * MiB, f->sid1);
    struct rgn b = xget(f, 1 * MiB, f->sid1);
    ck_assert_uint_eq(b.base, m.base + 1 * MiB);
    struct bfc__pool_ticket tm, tb;
    ticket(f, &tm);
    ticket(f, &tb);
    bfc__pool_put_arm(&f->pool, true, f->s1, f->sid1, &tb);
    bfc__sim_stream_hold(f->be, f->s1);
    bfc__pool_put_arm(&f->pool, true, f->s1, f->sid1, &tm);
    bfc__pool_put_armed(&f->pool, m.base, m.size, m.seg, true, f->sid1, &tm);
    bfc__pool_put_armed(&f->pool, b.base, b.size, b.seg, true, f->sid1, &tb);
    pcheck(&f->pool);
    ck_assert_uint_eq(fences_at(f, m.base), 2);
    *zp = z; /* still out: the chain's span is the only free memory */
    return m.base;
}

static void *drain_s1_later(void *arg)
{
    struct fix *f = arg;
    usleep(100 * 1000);
    bfc__sim_stream_drain(f->be, f->s1);
    return NULL;
}

/* Waiting for a chained span waits for every fence of the chain, not the
 * head alone (complete here): the drain comes while it waits. */
START_TEST(test_fence_chain_wait)
{
    struct fix f;
    struct rgn z;
    uintptr_t base = chain_of_two(&f, &z);
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2));
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, drain_s1_later, &f), 0);
    ck_assert(bfc__pool_wait(&f.pool, f.sid2, false, 10 * 1000));
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_uint_eq(fences_at(&f, base), 0);
    struct rgn c = xget(&f, 2 * MiB, f.sid2);
    xput(&f, c, false, f.s2, f.sid2);
    xput(&f, z, false, f.s1, f.sid1);
    fix_fini(&f);
}
END_TEST

/* A chain's fences all go back to the pool's cache (none lost: every
 * metadata byte comes back with the pool and backend), whether the chain
 * is carved by its stream or freed by a poll. */
START_TEST(test_fence_chain_recycled)
{
    size_t meta0 = bfc__meta_bytes();
    struct fix f;
    struct rgn z;
    uintptr_t base = chain_of_two(&f, &z);
    struct rgn own = xget(&f, 2 * MiB, f.sid1); /* carves the chain's span whole */
    ck_assert(own.used);
    ck_assert_uint_eq(own.base, base);
    bfc__sim_stream_drain(f.be, f.s1);
    xput(&f, own, false, f.s1, f.sid1);
    xput(&f, z, false, f.s1, f.sid1);
    fix_fini(&f);
    ck_assert_uint_eq(bfc__meta_bytes(), meta0);

    base = chain_of_two(&f, &z);
    bfc__sim_stream_drain(f.be, f.s1);
    bfc__pool_poll(&f.pool); /* the whole chain completes */
    ck_assert_uint_eq(fences_at(&f, base), 0);
    xput(&f, z, false, f.s1, f.sid1);
    fix_fini(&f);
    ck_assert_uint_eq(bfc__meta_bytes(), meta0);
}
END_TEST

/* bfc__pool_check sees a broken chain: a chained fence its head covers,
 * one never numbered, one numbered past the pool's count. */
START_TEST(test_fence_chain_check)
{
    struct fix f;
    struct rgn z;
    uintptr_t base = chain_of_two(&f, &z);
    struct bfc__span *s = span_at(&f, base);
    struct bfc__fence *head = s->fence, *second = head->extra;
    ck_assert_ptr_nonnull(second);
    ck_assert_uint_ge(head->order.armed_after, 1);
    uint64_t count = atomic_load(&f.pool.inserted);
    struct { struct bfc__fence *f; uint64_t v; } bad[] = {
        { second, head->order.armed_after }, /* covered by the head */
        { second, 0 },
        { second, count + 1 },
        { head, 0 },
        { head, count + 1 },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char buf[256] = "";
        uint64_t saved = bad[i].f->order.inserted;
        bad[i].f->order.inserted = bad[i].v;
        int r = bfc__pool_check(&f.pool, buf, sizeof buf);
        bad[i].f->order.inserted = saved;
        ck_assert_msg(r == -1 && strstr(buf, "invariant 6"), "case %zu: check says %d (%s)", i, r, buf);
    }
    pcheck(&f.pool);
    bfc__sim_stream_drain(f.be, f.s1);
    xput(&f, z, false, f.s1, f.sid1);
    fix_fini(&f);
}
END_TEST

/* A departure whose event cannot be recorded on a busy stream: never
 * complete before the stream's work is, whatever fails. */
START_TEST(test_fence_record_fails)
{
    struct fix f;
    fix_init(&f, 2 * MiB, false);
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    bfc__sim_fail_event_every(f.be, 1);
    xput(&f, a, true, f.s1, f.sid1);
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2));
    bfc__sim_fail_event_every(f.be, 0);
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2)); /* recorded now, still held */
    bfc__sim_stream_drain(f.be, f.s1);
    struct rgn b = xget(&f, 2 * MiB, f.sid2);
    xput(&f, b, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/* -------------------------------------------------------- best fit */

START_TEST(test_best_fit_runs)
{
    struct fix f;
    fix_init(&f, 16 * MiB, false);
    struct rgn r[16];
    for (int i = 0; i < 16; i++)
        r[i] = xget(&f, 1 * MiB, f.sid1);
    for (int i = 1; i < 16; i++)
        ck_assert_uint_eq(r[i].base, r[i - 1].base + 1 * MiB);
    bfc__sim_stream_hold(f.be, f.s1);
    /* Free: r1 (1 MiB), r5-r7 (3 MiB), r9 fenced by s1 + r10 (2 MiB for s1,
     * 1 MiB for anyone else), r12-r13 (2 MiB). */
    xput(&f, r[1], false, f.s1, f.sid1);
    for (int i = 5; i <= 7; i++)
        xput(&f, r[i], false, f.s1, f.sid1);
    xput(&f, r[9], true, f.s1, f.sid1);
    xput(&f, r[10], false, f.s1, f.sid1);
    xput(&f, r[12], false, f.s1, f.sid1);
    xput(&f, r[13], false, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 5);

    /* s1: runs of 2 MiB at r9 and r12, the lower wins; it was s1's. */
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    ck_assert_uint_eq(a.base, r[9].base);
    ck_assert(a.used);
    struct rgn a9 = { a.base, 1 * MiB, a.seg, false }, a10 = { a.base + 1 * MiB, 1 * MiB, a.seg, false };
    xput(&f, a9, true, f.s1, f.sid1);
    xput(&f, a10, false, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 5);
    /* s2: r9 is not its to take, so its best 2 MiB run is r12-r13. */
    struct rgn b = xget(&f, 2 * MiB, f.sid2);
    ck_assert_uint_eq(b.base, r[12].base);
    ck_assert(!b.used);
    /* s2, 1 MiB: r1 and r10 are the smallest runs, r1 the lower. */
    struct rgn c = xget(&f, 1 * MiB, f.sid2);
    ck_assert_uint_eq(c.base, r[1].base);
    struct rgn d = xget(&f, 1 * MiB, f.sid2);
    ck_assert_uint_eq(d.base, r[10].base);
    /* s2, 3 MiB: only r5-r7. */
    struct rgn e = xget(&f, 3 * MiB, f.sid2);
    ck_assert_uint_eq(e.base, r[5].base);
    ck_assert(xget_fails(&f, 1 * MiB, f.sid2)); /* r9 only, s1's */
    bfc__sim_stream_drain(f.be, f.s1);
    struct rgn g = xget(&f, 1 * MiB, f.sid2); /* r9, now free for all */
    ck_assert_uint_eq(g.base, r[9].base);
    ck_assert(!g.used);
    fix_fini(&f);
}
END_TEST

/* --------------------------------------------------------- waiting */

struct drainer {
    bfc__backend_t *be;
    bfc_stream_t s;
    unsigned delay_ms;
};

static void *drain_later(void *arg)
{
    struct drainer *d = arg;
    struct timespec ts = { 0, (long)d->delay_ms * 1000000L };
    nanosleep(&ts, NULL);
    bfc__sim_stream_drain(d->be, d->s);
    return NULL;
}

START_TEST(test_wait)
{
    struct fix f;
    fix_init(&f, 2 * MiB, false);
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, a, true, f.s1, f.sid1);

    /* Timeout 0 polls and does not wait. */
    ck_assert(!bfc__pool_wait(&f.pool, f.sid2, false, 0));
    ck_assert_uint_eq(pstats(&f).fence_waits, 1);
    /* s1's own fences keep nothing from s1: no wait at all. */
    uint64_t t0 = now_ns();
    ck_assert(!bfc__pool_wait(&f.pool, f.sid1, false, 2000));
    ck_assert_uint_lt(now_ns() - t0, 1000000000u);
    ck_assert_uint_eq(pstats(&f).fence_waits, 1);
    /* A bounded wait on a fence that does not complete times out. */
    t0 = now_ns();
    ck_assert(!bfc__pool_wait(&f.pool, f.sid2, false, 50));
    ck_assert_uint_ge(now_ns() - t0, 40000000u);
    ck_assert(xget_fails(&f, 2 * MiB, f.sid2));

    /* Another thread completes the work while we wait without bound. */
    struct drainer d = { f.be, f.s1, 50 };
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, drain_later, &d), 0);
    ck_assert(bfc__pool_wait(&f.pool, f.sid2, false, UINT32_MAX));
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 0);
    struct rgn b = xget(&f, 2 * MiB, f.sid2);
    xput(&f, b, false, f.s2, f.sid2);

    /* all = true waits for the asker's own fences too. */
    b = xget(&f, 2 * MiB, f.sid1);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, b, true, f.s1, f.sid1);
    d.delay_ms = 20;
    ck_assert_int_eq(pthread_create(&th, NULL, drain_later, &d), 0);
    ck_assert(bfc__pool_wait(&f.pool, f.sid1, true, UINT32_MAX));
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 0);
    fix_fini(&f);
}
END_TEST

/* ------------------------------------------------------ fits_with */

START_TEST(test_fits_with)
{
    struct fix f;
    fix_init(&f, 8 * MiB, false);
    struct rgn r[8];
    for (int i = 0; i < 8; i++)
        r[i] = xget(&f, 1 * MiB, f.sid1);
    xput(&f, r[2], false, f.s1, f.sid1);
    struct bfc__range next = { r[3].base, 1 * MiB, r[3].seg };
    struct bfc__range apart = { r[4].base, 1 * MiB, r[4].seg };
    struct bfc__range both[2] = { next, apart };

    ck_assert(bfc__pool_fits_with(&f.pool, f.sid2, NULL, 0, 1 * MiB));
    ck_assert(!bfc__pool_fits_with(&f.pool, f.sid2, NULL, 0, 2 * MiB));
    ck_assert(bfc__pool_fits_with(&f.pool, f.sid2, &next, 1, 2 * MiB)); /* r2 + r3 */
    ck_assert(!bfc__pool_fits_with(&f.pool, f.sid2, &apart, 1, 2 * MiB));
    ck_assert(bfc__pool_fits_with(&f.pool, f.sid2, both, 2, 3 * MiB)); /* r2..r4 */
    ck_assert(!bfc__pool_fits_with(&f.pool, f.sid2, both, 2, 3 * MiB + 256));
    /* An extra range alone can make it fit. */
    ck_assert(bfc__pool_fits_with(&f.pool, f.sid2, &apart, 1, 1 * MiB));

    /* A span fenced by s1 counts for s1 only. */
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, r[5], true, f.s1, f.sid1);
    struct bfc__range six = { r[6].base, 1 * MiB, r[6].seg };
    ck_assert(bfc__pool_fits_with(&f.pool, f.sid1, &six, 1, 2 * MiB));
    ck_assert(!bfc__pool_fits_with(&f.pool, f.sid2, &six, 1, 2 * MiB));

    /* Asking changes nothing. */
    struct bfc__pool_stats s = pstats(&f);
    ck_assert_uint_eq(s.free_bytes, 2 * MiB);
    ck_assert_uint_eq(s.committed, 6 * MiB);
    ck_assert_uint_eq(nspans(&f), 2);
    bfc__sim_stream_drain(f.be, f.s1);
    ck_assert(bfc__pool_fits_with(&f.pool, f.sid2, &six, 1, 2 * MiB));
    fix_fini(&f);
}
END_TEST

/* The largest region bfc__pool_get would give a stream: runs of spans it
 * may take, and with growth the limit's headroom once wholly free segments
 * went back; each figure is then served. */
START_TEST(test_largest)
{
    struct fix f;
    fix_init(&f, 8 * MiB, false);
    struct rgn r[8];
    for (int i = 0; i < 8; i++)
        r[i] = xget(&f, 1 * MiB, f.sid1);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 0);
    bfc__sim_stream_hold(f.be, f.s1);
    xput(&f, r[2], false, f.s1, f.sid1);
    xput(&f, r[3], false, f.s1, f.sid1);
    xput(&f, r[5], true, f.s1, f.sid1); /* fenced: s1's alone */
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid1), 2 * MiB);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 2 * MiB);
    xput(&f, r[4], false, f.s1, f.sid1);
    xput(&f, r[6], false, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid1), 5 * MiB); /* r2..r6 */
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 3 * MiB); /* r2..r4 */
    xget_fails(&f, 3 * MiB + 256, f.sid2);
    struct rgn a = xget(&f, 3 * MiB, f.sid2);
    ck_assert_uint_eq(a.base, r[2].base);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 1 * MiB); /* r6 */
    bfc__sim_stream_drain(f.be, f.s1);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 2 * MiB); /* r5..r6 */
    fix_fini(&f);

    fix_init(&f, 16 * MiB, true);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid1), 16 * MiB);
    struct rgn x = xget(&f, 4 * MiB, f.sid1), y = xget(&f, 4 * MiB, f.sid1);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 8 * MiB);
    xput(&f, x, false, f.s1, f.sid1); /* a wholly free segment: it can go back */
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 12 * MiB);
    xget_fails(&f, 12 * MiB + 256, f.sid2);
    struct rgn z = xget(&f, 12 * MiB, f.sid2);
    ck_assert_uint_eq(bfc__pool_largest(&f.pool, f.sid2), 0);
    xput(&f, y, false, f.s1, f.sid1);
    xput(&f, z, false, f.s2, f.sid2);
    fix_fini(&f);
}
END_TEST

/* ---------------------------------------------------- metadata faults */

/* A give-back with its ticket needs no allocation: with every metadata
 * allocation failing, a put that needs a new span record still works. */
START_TEST(test_ticket_put_never_allocates)
{
    struct fix f;
    fix_init(&f, 8 * MiB, false);
    struct rgn a = xget(&f, 1 * MiB, f.sid1);
    struct rgn b = xget(&f, 1 * MiB, f.sid1);
    struct rgn c = xget(&f, 1 * MiB, f.sid1);
    struct bfc__pool_ticket t1, t2;
    ck_assert_int_eq(bfc__pool_ticket_get(&f.pool, &t1), BFC_OK);
    ck_assert_int_eq(bfc__pool_ticket_get(&f.pool, &t2), BFC_OK);
    ck_assert_ptr_nonnull(t1.span);
    ck_assert_ptr_nonnull(t1.fence);

    bfc_sim_fail_meta_every(1);
    uint64_t fails0 = bfc_sim_meta_failures();
    bfc__sim_stream_hold(f.be, f.s1);
    /* b between two lent regions: a span record of its own, fenced. */
    bfc__pool_put(&f.pool, b.base, b.size, b.seg, true, f.s1, f.sid1, &t1);
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 2);
    bfc__pool_put(&f.pool, a.base, a.size, a.seg, false, f.s1, f.sid1, &t2);
    pcheck(&f.pool);
    ck_assert_uint_eq(nspans(&f), 3);
    ck_assert_uint_eq(bfc_sim_meta_failures(), fails0); /* nothing even tried */
    ck_assert_uint_eq(pstats(&f).fenced_bytes, 1 * MiB);

    /* A ticket cannot be had now, and a failed one keeps nothing. */
    size_t bytes = bfc__meta_bytes();
    struct bfc__pool_ticket t3;
    ck_assert_int_eq(bfc__pool_ticket_get(&f.pool, &t3), BFC_ENOMEM);
    ck_assert_ptr_null(t3.span);
    ck_assert_ptr_null(t3.fence);
    ck_assert_uint_eq(bfc__meta_bytes(), bytes);
    bfc_sim_fail_meta_every(0);
    bfc__sim_stream_drain(f.be, f.s1);
    poll_pool(&f);
    ck_assert_uint_eq(nspans(&f), 2); /* a and b merged; c still lent */
    xput(&f, c, false, f.s1, f.sid1);
    ck_assert_uint_eq(nspans(&f), 1);
    fix_fini(&f);
}
END_TEST

START_TEST(test_ticket_unused_back)
{
    struct fix f;
    fix_init(&f, 8 * MiB, false);
    size_t bytes = bfc__meta_bytes();
    struct bfc__pool_ticket t;
    ck_assert_int_eq(bfc__pool_ticket_get(&f.pool, &t), BFC_OK);
    ck_assert_uint_gt(bfc__meta_bytes(), bytes);
    bfc__pool_ticket_put(&f.pool, &t);
    ck_assert_ptr_null(t.span);
    ck_assert_ptr_null(t.fence);
    /* The span record is freed; the fence is cached for the next ticket. */
    size_t cached = bfc__meta_bytes();
    ck_assert_int_eq(bfc__pool_ticket_get(&f.pool, &t), BFC_OK);
    bfc__pool_ticket_put(&f.pool, &t);
    ck_assert_uint_eq(bfc__meta_bytes(), cached);

    /* A put that merges with a neighbour leaves its span record unused:
     * it goes back with the rest of the ticket. */
    struct rgn a = xget(&f, 1 * MiB, f.sid1);
    bytes = bfc__meta_bytes();
    xput(&f, a, false, f.s1, f.sid1);
    ck_assert_uint_eq(bfc__meta_bytes(), bytes);
    fix_fini(&f);
}
END_TEST

/* Growth needs a segment record: when metadata fails, the request fails
 * and neither the pool nor the backend keeps anything of it. */
START_TEST(test_get_meta_fault)
{
    struct fix f;
    fix_init(&f, 64 * MiB, true);
    struct rgn a = xget(&f, 2 * MiB, f.sid1);
    bfc_sim_fail_meta_every(1);
    xget_fails(&f, 2 * MiB, f.sid1);
    bfc_sim_fail_meta_every(0);
    ck_assert_uint_eq(pstats(&f).held, 2 * MiB);
    ck_assert_uint_eq(pstats(&f).segments, 1);
    ck_assert_uint_eq(bfc__sim_bytes_held(f.be), 2 * MiB);
    struct rgn b = xget(&f, 2 * MiB, f.sid1);
    xput(&f, a, false, f.s1, f.sid1);
    xput(&f, b, false, f.s1, f.sid1);
    fix_fini(&f);
}
END_TEST

START_TEST(test_backend_refuses)
{
    struct fix f;
    fix_init(&f, 64 * MiB, true);
    bfc__sim_fail_alloc_every(f.be, 1);
    xget_fails(&f, 2 * MiB, f.sid1);
    ck_assert_uint_eq(pstats(&f).held, 0);
    ck_assert_uint_eq(pstats(&f).segments, 0);
    bfc__sim_fail_alloc_every(f.be, 0);
    bfc__sim_set_alloc_ceiling(f.be, 4 * MiB);
    struct rgn a = xget(&f, 4 * MiB, f.sid1);
    xget_fails(&f, 256, f.sid1);
    xput(&f, a, false, f.s1, f.sid1);
    fix_fini(&f);

    /* No growth: the reservation itself is refused at init. */
    bfc__backend_t *be = sim_open();
    bfc__sim_set_alloc_ceiling(be, 8 * MiB);
    struct bfc__pool p;
    ck_assert_int_eq(bfc__pool_init(&p, be, 16 * MiB, false, true), BFC_ENOMEM);
    ck_assert_uint_eq(bfc__sim_bytes_held(be), 0);
    ck_assert_int_eq(bfc__pool_init(&p, be, 8 * MiB, false, true), BFC_OK);
    bfc__pool_fini(&p);
    be->ops->close(be);
}
END_TEST

/* ------------------------------------------------------ concurrency */

enum { NTHREADS = 4, ITERS = 3000, HELD = 8 };

struct worker {
    struct fix *f;
    bfc_stream_t s;
    uint64_t sid;
    uint64_t seed;
    unsigned gets;
    char why[160];
};

static void *churn(void *arg)
{
    struct worker *w = arg;
    struct rgn held[HELD];
    size_t n = 0;
    for (int i = 0; i < ITERS && !w->why[0]; i++) {
        uint64_t x = rng_next(&w->seed);
        if (n < HELD && (x & 1)) {
            struct rgn r = { 0, (size_t)(1 + (x >> 8) % 16) * 64 * KiB, NULL, false };
            struct bfc__pool_ticket t;
            if (bfc__pool_ticket_get(&w->f->pool, &t) != BFC_OK) {
                snprintf(w->why, sizeof w->why, "ticket_get failed");
                break;
            }
            int rc = bfc__pool_get(&w->f->pool, r.size, w->sid, &r.base, &r.seg, &r.used, NULL);
            if (rc != BFC_OK) {
                bfc__pool_ticket_put(&w->f->pool, &t);
                continue;
            }
            /* The memory is ours alone: stamp it. */
            memset((void *)r.base, (int)(w->sid & 0xff), 256);
            bfc__pool_ticket_put(&w->f->pool, &t);
            held[n++] = r;
            w->gets++;
        } else if (n > 0) {
            size_t k = (size_t)(x >> 16) % n;
            struct rgn r = held[k];
            if (*(unsigned char *)r.base != (unsigned char)(w->sid & 0xff)) {
                snprintf(w->why, sizeof w->why, "region %#lx overwritten", (unsigned long)r.base);
                break;
            }
            held[k] = held[--n];
            struct bfc__pool_ticket t;
            if (bfc__pool_ticket_get(&w->f->pool, &t) != BFC_OK) {
                snprintf(w->why, sizeof w->why, "ticket_get failed");
                break;
            }
            bfc__pool_put(&w->f->pool, r.base, r.size, r.seg, (x >> 40) & 1, w->s, w->sid, &t);
        }
    }
    while (n > 0) {
        struct bfc__pool_ticket t;
        if (bfc__pool_ticket_get(&w->f->pool, &t) != BFC_OK)
            break;
        struct rgn r = held[--n];
        bfc__pool_put(&w->f->pool, r.base, r.size, r.seg, false, w->s, w->sid, &t);
    }
    return NULL;
}

START_TEST(test_concurrent_churn)
{
    struct fix f;
    fix_init(&f, 64 * MiB, (_i & 1) != 0);
    struct worker w[NTHREADS];
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        w[i] = (struct worker){ &f, bfc__sim_stream_create(f.be), 0, (uint64_t)i * 77 + 1, 0, "" };
        ck_assert_ptr_nonnull(w[i].s);
        w[i].sid = sid_of(f.be, w[i].s);
        ck_assert_int_eq(pthread_create(&th[i], NULL, churn, &w[i]), 0);
    }
    for (int i = 0; i < NTHREADS; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    for (int i = 0; i < NTHREADS; i++) {
        ck_assert_msg(w[i].why[0] == '\0', "worker %d: %s", i, w[i].why);
        /* At most 32 MiB of the 64 are lent at once: most requests are
         * served (fragmentation may refuse a few). */
        ck_assert_uint_gt(w[i].gets, ITERS / 8);
    }
    poll_pool(&f);
    struct bfc__pool_stats s = pstats(&f);
    ck_assert_uint_eq(s.committed, 0);
    ck_assert_uint_eq(s.fenced_bytes, 0);
    ck_assert_uint_eq(s.free_bytes, s.held);
    for (int i = 0; i < NTHREADS; i++)
        bfc__sim_stream_destroy(f.be, w[i].s);
    fix_fini(&f);
}
END_TEST

/*
 * A map the device refuses takes back the rise of the peak its charge
 * made -- unless a map made while it was in flight built on that rise.
 * The refused map is held inside the device call (a va_map hooked to wait
 * for the test), another map completes and is unmapped meanwhile, then the
 * first is refused: the peak must still cover the memory the second map
 * really held (it stays at the charged figure, an upper bound).  Taking
 * the rise back regardless would leave the peak below it.
 */
static const struct bfc__backend_ops *g_real_ops;
static struct bfc__backend_ops g_hooked_ops;
static uintptr_t g_held_map; /* the map to hold, then refuse */
static pthread_mutex_t g_hook_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hook_cond = PTHREAD_COND_INITIALIZER;
static int g_hook_state; /* 0: hold the map, 1: it is held in the device call, 2: refuse it */

static int held_va_map(bfc__backend_t *be, uintptr_t addr, size_t size)
{
    if (addr != g_held_map)
        return g_real_ops->va_map(be, addr, size);
    pthread_mutex_lock(&g_hook_lock);
    if (g_hook_state == 0) {
        g_hook_state = 1;
        pthread_cond_broadcast(&g_hook_cond);
    }
    while (g_hook_state != 2)
        pthread_cond_wait(&g_hook_cond, &g_hook_lock);
    pthread_mutex_unlock(&g_hook_lock);
    return BFC_ENOMEM;
}

struct held_map {
    struct bfc__pool *pool;
    uintptr_t addr;
    size_t size;
    int status;
};

static void *map_thread(void *arg)
{
    struct held_map *m = arg;
    m->status = bfc__pool_vmm_map(m->pool, m->addr, m->size);
    return NULL;
}

START_TEST(test_refused_map_peak)
{
    struct fix f;
    fix_init(&f, 64 * MiB, true);
    ck_assert_uint_eq(f.be->vmm_granule, 2 * MiB);
    g_real_ops = f.be->ops;
    g_hooked_ops = *f.be->ops;
    g_hooked_ops.va_map = held_va_map;
    f.be->ops = &g_hooked_ops;
    uintptr_t base = 0;
    ck_assert_int_eq(bfc__pool_vmm_reserve(&f.pool, 16 * MiB, &base), BFC_OK);
    ck_assert_int_eq(bfc__pool_vmm_map(&f.pool, base, 4 * MiB), BFC_OK);
    ck_assert_uint_eq(pstats(&f).peak_held, 4 * MiB);

    uint64_t since = 0;
    ck_assert_uint_eq(bfc__pool_peak_excess(&f.pool, 0, &since), 0);
    ck_assert_uint_eq(since, 1); /* the first map raised it */

    /* Alone, a refused map leaves the peak as it was, and when it rose. */
    struct held_map m = { &f.pool, base + 4 * MiB, 2 * MiB, BFC_OK };
    g_held_map = m.addr;
    g_hook_state = 2;
    map_thread(&m);
    ck_assert_int_eq(m.status, BFC_ENOMEM);
    ck_assert_uint_eq(pstats(&f).peak_held, 4 * MiB);
    ck_assert_uint_eq(bfc__pool_peak_excess(&f.pool, 0, &since), 0);
    ck_assert_uint_eq(since, 1);

    /* With a map made and unmapped while it is held. */
    g_hook_state = 0;
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, map_thread, &m), 0);
    pthread_mutex_lock(&g_hook_lock);
    while (g_hook_state != 1)
        pthread_cond_wait(&g_hook_cond, &g_hook_lock);
    pthread_mutex_unlock(&g_hook_lock);
    ck_assert_uint_eq(pstats(&f).peak_held, 6 * MiB); /* charged before the call */
    size_t done = 0;
    ck_assert_int_eq(bfc__pool_vmm_map(&f.pool, base + 6 * MiB, 2 * MiB), BFC_OK);
    ck_assert_int_eq(bfc__pool_vmm_unmap(&f.pool, base + 6 * MiB, 2 * MiB, &done), BFC_OK);
    ck_assert_uint_eq(done, 2 * MiB);
    pthread_mutex_lock(&g_hook_lock);
    g_hook_state = 2;
    pthread_cond_broadcast(&g_hook_cond);
    pthread_mutex_unlock(&g_hook_lock);
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_int_eq(m.status, BFC_ENOMEM);
    struct bfc__pool_stats st = pstats(&f);
    ck_assert_uint_eq(st.held, 4 * MiB);
    /* The device held 6 MiB (4 + the second map) at one time. */
    ck_assert_uint_ge(st.peak_held, 6 * MiB);
    ck_assert_uint_eq(st.peak_held, 8 * MiB);
    ck_assert_uint_eq(bfc__pool_peak_excess(&f.pool, 0, &since), 0);
    ck_assert_uint_eq(since, 1); /* the second map's rise, one map ago */

    ck_assert_int_eq(bfc__pool_vmm_unmap(&f.pool, base, 4 * MiB, &done), BFC_OK);
    bfc__pool_vmm_unreserve(&f.pool, base, 16 * MiB);
    f.be->ops = g_real_ops;
    fix_fini(&f);
}
END_TEST

/* -------------------------------------------------------------- main */

static Suite *pool_suite(void)
{
    Suite *s = suite_create("pool");
    TCase *tc = tcase_create("pool");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_growth_segments);
    tcase_add_test(tc, test_growth_limit);
    tcase_add_test(tc, test_growth_no_recycle);
    tcase_add_test(tc, test_release_free);
    tcase_add_test(tc, test_reservation);
    tcase_add_test(tc, test_fence_own_stream_only);
    tcase_add_test(tc, test_fence_merge_rules);
    tcase_add_test(tc, test_fence_order);
    tcase_add_loop_test(tc, test_fence_order_model, 0, 8);
    tcase_add_test(tc, test_fence_order_arm_race);
    tcase_add_test(tc, test_fence_order_happens_before);
    tcase_add_test(tc, test_fence_chain_wait);
    tcase_add_test(tc, test_fence_chain_recycled);
    tcase_add_test(tc, test_fence_chain_check);
    tcase_add_test(tc, test_fence_record_fails);
    tcase_add_test(tc, test_best_fit_runs);
    tcase_add_test(tc, test_wait);
    tcase_add_test(tc, test_fits_with);
    tcase_add_test(tc, test_largest);
    tcase_add_test(tc, test_ticket_put_never_allocates);
    tcase_add_test(tc, test_ticket_unused_back);
    tcase_add_test(tc, test_get_meta_fault);
    tcase_add_test(tc, test_backend_refuses);
    tcase_add_loop_test(tc, test_concurrent_churn, 0, 2);
    tcase_add_test(tc, test_refused_map_peak);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return run_suite(pool_suite());
}
