/*
 * fence.c -- recording, querying and waiting for fences (see fence.h).
 *
 * These functions touch only the fence records they are given and the
 * backend; the caller holds whatever lock protects the records.
 */
#include "fence.h"
#include "meta.h"

struct bfc__fence *bfc__fence_new(bfc__backend_t *be)
{
    struct bfc__fence *f = bfc__meta_zalloc(sizeof(*f));
    if (!f)
        return NULL;
    if ((f->ev_err = be->ops->event_create(be, &f->ev)) != BFC_OK)
        f->ev = NULL;
    return f;
}

void bfc__fence_destroy(bfc__backend_t *be, struct bfc__fence *f)
{
    /* An event the device refuses to destroy is lost to us either way:
     * nothing waits on it, and the record goes. */
    if (f->ev)
        (void)be->ops->event_destroy(be, f->ev);
    bfc__meta_free(f, sizeof(*f));
}

void bfc__fence_arm(bfc__backend_t *be, struct bfc__fence *f, bfc_stream_t s, uint64_t sid)
{
    bfc_stream_t here = be->ops->stream_for(be, s, sid);
    f->synced = false;
    f->unfenced = false;
    f->unfenced_stream = NULL;
    f->sid = 0; /* only a cross-stream free's own fence carries it (fence.h) */
    if (f->ev && be->ops->event_record(be, f->ev, here) == BFC_OK)
        return;
    /* No event: make the work complete now instead (the whole device's
     * when the stream is reached through another handle, whose own
     * synchronisation need not wait for it). */
    if ((here == s && be->ops->stream_sync(be, s) == BFC_OK) || be->ops->device_sync(be) == BFC_OK) {
        f->synced = true;
        return;
    }
    f->unfenced = true;
    f->unfenced_stream = s;
    f->unfenced_sid = sid;
}

int bfc__fence_query(bfc__backend_t *be, struct bfc__fence *f)
{
    for (; f; f = f->extra) {
        if (f->synced)
            continue;
        if (BFC__UNLIKELY(f->unfenced)) {
            /* Recording failed when the fence was armed: record now and
             * only then ask (see the opening comment of fence.h). */
            if (!f->ev && be->ops->event_create(be, &f->ev) != BFC_OK) {
                f->ev = NULL;
                return BFC_EBUSY;
            }
            if (be->ops->event_record(be, f->ev, be->ops->stream_for(be, f->unfenced_stream, f->unfenced_sid)) !=
                BFC_OK)
                return BFC_EBUSY;
            f->unfenced = false;
        }
        if (!f->ev)
            return BFC_EBUSY;
        if (be->ops->event_query(be, f->ev) != BFC_OK)
            return BFC_EBUSY; /* in flight, or a query error: ask again later */
    }
    return BFC_OK;
}

void bfc__fence_wait(bfc__backend_t *be, struct bfc__fence *f, uint32_t timeout_ms)
{
    for (; f; f = f->extra)
        if (f->ev && !f->synced && !f->unfenced)
            (void)be->ops->event_wait(be, f->ev, timeout_ms);
}
