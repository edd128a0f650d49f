/*
 * gen.c -- the event programs of the workloads (see perf.h), generated from
 * fixed seeds before any clock starts.
 *
 * churn      a steady population of `live` blocks; each pair frees a random
 *            slot and allocates a log-uniform size into it.  The arena
 *            workloads are churn programs too (1000 live, 256 B .. 1 MiB).
 * fragments  a prologue added in front of a program's: small blocks
 *            allocated and every other one freed, so the free ones cannot
 *            coalesce and the program runs against that many fragments.
 * inference  a synthetic transformer serving trace for one stream, from a
 *            real model's published shape (Llama-2-7B by default: hidden
 *            4096, 32 heads, 32 KV heads, 32 layers, intermediate 11008,
 *            vocabulary 32000, fp16).  A scheduler loop: groups of requests
 *            arrive at random; waiting requests are admitted while fewer
 *            than max_batch are running and get a prefill iteration (all
 *            their prompt tokens at once); otherwise one decode iteration
 *            advances every running request by one token.  An iteration
 *            allocates the hidden state, then per layer the activations of
 *            that layer in the order a PyTorch-style forward pass creates
 *            and drops them (norm, fused QKV, attention output and its
 *            softmax statistics, output projection, norm, gate and up
 *            projections, SiLU product, down projection), then the final
 *            norm and the logits of the last token of each request.  The
 *            KV cache is paged (as vLLM): blocks of kv_block_tokens tokens,
 *            one per layer (K and V together), allocated as a request's
 *            sequence reaches a new block and all freed when the request
 *            has generated its last token.
 * replay     an RMM CSV trace read with tools/trace_csv.c.
 *
 * Slots are handed out from a stack of free slot numbers, so the slot table
 * a runner needs is as large as the most blocks ever live at once.
 * Single-threaded; the result belongs to the caller (perf_prog_free).
 */
#include "perf.h"
#include "perfutil.h"

#include <stdlib.h>
#include <string.h>

#include "trace_csv.h"

/* Llama-2-7B (config.json of meta-llama/Llama-2-7b-hf), fp16. */
const struct perf_model perf_llama2_7b = {
    .name = "Llama-2-7B (hidden 4096, 32 heads, 32 KV heads, 32 layers, "
            "intermediate 11008, vocab 32000, fp16)",
    .hidden = 4096,
    .heads = 32,
    .kv_heads = 32,
    .layers = 32,
    .intermediate = 11008,
    .vocab = 32000,
    .dtype_bytes = 2,
    .kv_block_tokens = 16,
    .max_batch = 8,
    .prompt_min = 16,
    .prompt_max = 512,
    .output_min = 16,
    .output_max = 256,
    .arrival_p = 0.1,
    .group_max = 4,
};

uint64_t perf_model_kv_block(const struct perf_model *m)
{
    uint64_t head_dim = m->hidden / m->heads;
    return (uint64_t)m->kv_block_tokens * 2u * m->kv_heads * head_dim * m->dtype_bytes;
}

void perf_prog_free(struct perf_prog *p)
{
    free(p->pro);
    free(p->ev);
    memset(p, 0, sizeof(*p));
}

/* ------------------------------------------------------------ builder */

struct builder {
    struct perf_ev *ev;
    size_t n, cap;
    uint32_t *free_slots; /* stack */
    unsigned nfree, cap_slots, nslots;
    uint64_t *slot_size;
};

static void b_push(struct builder *b, const struct perf_ev *e)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 4096;
        struct perf_ev *ev = realloc(b->ev, cap * sizeof(*ev));
        if (ev == NULL) {
            fprintf(stderr, "shardbfc-perf: out of host memory (trace)\n");
            exit(1);
        }
        b->ev = ev;
        b->cap = cap;
    }
    b->ev[b->n++] = *e;
}

static void b_grow_slots(struct builder *b)
{
    unsigned cap = b->cap_slots ? 2 * b->cap_slots : 1024;
    uint32_t *fs = realloc(b->free_slots, cap * sizeof(*fs));
    uint64_t *sz = fs ? realloc(b->slot_size, cap * sizeof(*sz)) : NULL;
    if (fs == NULL || sz == NULL) {
        fprintf(stderr, "shardbfc-perf: out of host memory (slots)\n");
        exit(1);
    }
    b->free_slots = fs;
    b->slot_size = sz;
    b->cap_slots = cap;
}

/* Allocates `size` into a fresh slot; returns the slot. */
static uint32_t b_alloc(struct builder *b, uint64_t size, unsigned stream, unsigned kind,
                        uint32_t req)
{
    struct perf_ev e = {.size = size, .req = req, .op = PERF_OP_ALLOC,
                        .stream = (uint8_t)stream, .kind = (uint8_t)kind};
    if (b->nfree > 0) {
        e.slot = b->free_slots[--b->nfree];
    } else {
        if (b->nslots == b->cap_slots)
            b_grow_slots(b);
        e.slot = b->nslots++;
    }
    b->slot_size[e.slot] = size;
    b_push(b, &e);
    return e.slot;
}

static void b_free(struct builder *b, uint32_t slot, unsigned stream, unsigned kind,
                   uint32_t req)
{
    struct perf_ev e = {.size = b->slot_size[slot], .slot = slot, .req = req,
                        .op = PERF_OP_FREE, .stream = (uint8_t)stream,
                        .kind = (uint8_t)kind};
    /* The stack has room: a slot number is pushed at most once per alloc. */
    b->free_slots[b->nfree++] = slot;
    b_push(b, &e);
}

static void b_done(struct builder *b, struct perf_prog *out)
{
    out->ev = b->ev;
    out->nev = b->n;
    out->nslots = b->nslots;
    out->pro = NULL;
    out->npro = 0;
    out->nstreams = 1;
    free(b->free_slots);
    free(b->slot_size);
}

/* ---------------------------------------------------------------- churn */

void perf_gen_churn(uint64_t seed, unsigned live, unsigned n_pairs, uint64_t lo,
                    uint64_t hi, struct perf_prog *out)
{
    uint64_t s = seed;
    uint64_t *size = perf_xmalloc(live * sizeof(*size));
    memset(out, 0, sizeof(*out));
    out->pro = perf_xmalloc(live * sizeof(*out->pro));
    out->ev = perf_xmalloc(2 * (size_t)n_pairs * sizeof(*out->ev));
    for (unsigned i = 0; i < live; i++) {
        size[i] = perf_rng_logu(&s, lo, hi);
        out->pro[i] = (struct perf_ev){.size = size[i], .slot = i, .op = PERF_OP_ALLOC};
    }
    for (unsigned i = 0; i < n_pairs; i++) {
        uint32_t k = (uint32_t)(perf_rng_next(&s) % live);
        uint64_t n = perf_rng_logu(&s, lo, hi);
        out->ev[2 * i] = (struct perf_ev){.size = size[k], .slot = k, .op = PERF_OP_FREE};
        out->ev[2 * i + 1] = (struct perf_ev){.size = n, .slot = k, .op = PERF_OP_ALLOC};
        size[k] = n;
    }
    out->npro = live;
    out->nev = 2 * (size_t)n_pairs;
    out->nslots = live;
    out->nstreams = 1;
    free(size);
}

/* ------------------------------------------------------------ fragments */

void perf_gen_fragments(struct perf_prog *p, uint64_t seed, unsigned blocks, uint64_t lo,
                        uint64_t hi)
{
    uint64_t s = seed, span = (hi - lo) / 256u + 1u;
    size_t nfree = (blocks + 1u) / 2u, n = (size_t)blocks + nfree + p->npro, k = 0;
    struct perf_ev *pro = perf_xmalloc(n * sizeof(*pro));
    unsigned base = p->nslots;
    uint64_t *size = perf_xmalloc((blocks ? blocks : 1) * sizeof(*size));

    for (unsigned i = 0; i < blocks; i++) {
        size[i] = lo + 256u * (perf_rng_next(&s) % span);
        pro[k++] = (struct perf_ev){.size = size[i], .slot = base + i, .op = PERF_OP_ALLOC};
    }
    for (unsigned i = 0; i < blocks; i += 2)
        pro[k++] = (struct perf_ev){.size = size[i], .slot = base + i, .op = PERF_OP_FREE};
    memcpy(pro + k, p->pro, p->npro * sizeof(*pro));
    k += p->npro;
    free(p->pro);
    free(size);
    p->pro = pro;
    p->npro = k;
    p->nslots = base + blocks;
}

/* ----------------------------------------------------------- inference */

struct req {
    uint32_t id;
    uint32_t prompt, output;
    uint32_t tokens;     /* tokens whose KV is stored */
    uint32_t generated;
    uint32_t nblocks;    /* KV blocks per layer */
    uint32_t *kv;        /* layers x nblocks_cap slots, layer-major per block */
    uint32_t kv_cap;     /* entries */
    uint32_t kv_n;
};

static void req_kv_push(struct req *r, uint32_t slot)
{
    if (r->kv_n == r->kv_cap) {
        uint32_t cap = r->kv_cap ? 2 * r->kv_cap : 256;
        uint32_t *kv = realloc(r->kv, cap * sizeof(*kv));
        if (kv == NULL) {
            fprintf(stderr, "shardbfc-perf: out of host memory (kv)\n");
            exit(1);
        }
        r->kv = kv;
        r->kv_cap = cap;
    }
    r->kv[r->kv_n++] = slot;
}

/* One forward pass over T tokens for the requests in run[0..nrun): `adds[i]`
 * new tokens for run[i] (their KV goes into the cache). */
static void gen_iteration(struct builder *b, const struct perf_model *m, struct req **run,
                          unsigned nrun, const uint32_t *adds)
{
    const uint64_t d = m->dtype_bytes, h = m->hidden, im = m->intermediate;
    const uint64_t kvb = perf_model_kv_block(m);
    uint64_t T = 0;
    uint32_t hidden, x, qkv, lse, attn, o, gate, up, act, down, fin, logits;

    for (unsigned i = 0; i < nrun; i++)
        T += adds[i];
    hidden = b_alloc(b, T * h * d, 0, PERF_KIND_LOGITS, 0);
    for (unsigned l = 0; l < m->layers; l++) {
        /* KV blocks this layer needs for the new tokens. */
        for (unsigned i = 0; i < nrun; i++) {
            struct req *r = run[i];
            uint32_t need = (r->tokens + adds[i] + m->kv_block_tokens - 1) / m->kv_block_tokens;
            for (uint32_t k = r->nblocks; k < need; k++)
                req_kv_push(r, b_alloc(b, kvb, 0, PERF_KIND_KV, r->id));
        }
        x = b_alloc(b, T * h * d, 0, PERF_KIND_ACT, 0);
        qkv = b_alloc(b, T * (h + 2 * (h / m->heads) * m->kv_heads) * d, 0, PERF_KIND_ACT, 0);
        b_free(b, x, 0, PERF_KIND_ACT, 0);
        attn = b_alloc(b, T * h * d, 0, PERF_KIND_ACT, 0);
        lse = b_alloc(b, T * m->heads * 4u, 0, PERF_KIND_ACT, 0); /* fp32 softmax stats */
        b_free(b, qkv, 0, PERF_KIND_ACT, 0);
        b_free(b, lse, 0, PERF_KIND_ACT, 0);
        o = b_alloc(b, T * h * d, 0, PERF_KIND_ACT, 0);
        b_free(b, attn, 0, PERF_KIND_ACT, 0);
        b_free(b, o, 0, PERF_KIND_ACT, 0); /* added into hidden in place */
        x = b_alloc(b, T * h * d, 0, PERF_KIND_ACT, 0);
        gate = b_alloc(b, T * im * d, 0, PERF_KIND_ACT, 0);
        up = b_alloc(b, T * im * d, 0, PERF_KIND_ACT, 0);
        b_free(b, x, 0, PERF_KIND_ACT, 0);
        act = b_alloc(b, T * im * d, 0, PERF_KIND_ACT, 0);
        b_free(b, gate, 0, PERF_KIND_ACT, 0);
        b_free(b, up, 0, PERF_KIND_ACT, 0);
        down = b_alloc(b, T * h * d, 0, PERF_KIND_ACT, 0);
        b_free(b, act, 0, PERF_KIND_ACT, 0);
        b_free(b, down, 0, PERF_KIND_ACT, 0);
    }
    for (unsigned i = 0; i < nrun; i++) {
        struct req *r = run[i];
        r->tokens += adds[i];
        r->nblocks = (r->tokens + m->kv_block_tokens - 1) / m->kv_block_tokens;
    }
    /* The last token of each request goes through the final norm and the
     * LM head. */
    fin = b_alloc(b, nrun * h * d, 0, PERF_KIND_LOGITS, 0);
    b_free(b, hidden, 0, PERF_KIND_LOGITS, 0);
    logits = b_alloc(b, (uint64_t)nrun * m->vocab * d, 0, PERF_KIND_LOGITS, 0);
    b_free(b, fin, 0, PERF_KIND_LOGITS, 0);
    b_free(b, logits, 0, PERF_KIND_LOGITS, 0);
}

void perf_gen_inference(const struct perf_model *m, uint64_t seed, unsigned steps,
                        struct perf_prog *out, struct perf_req_info **reqs_out,
                        unsigned *nreqs_out)
{
    struct builder b;
    struct req **queue = NULL, **run = perf_xmalloc(m->max_batch * sizeof(*run));
    struct perf_req_info *info = NULL;
    uint32_t *adds = perf_xmalloc(m->max_batch * sizeof(*adds));
    unsigned nqueue = 0, capqueue = 0, nrun = 0, nreq = 0, capreq = 0;
    uint64_t s = seed;

    memset(&b, 0, sizeof(b));
    for (unsigned step = 0; step < steps || nrun > 0 || nqueue > 0; step++) {
        bool arrive = step < steps &&
                      (perf_rng_unit(&s) < m->arrival_p || (nrun == 0 && nqueue == 0));
        unsigned first_new;
        if (arrive) {
            unsigned g = (unsigned)perf_rng_range(&s, 1, m->group_max);
            for (unsigned k = 0; k < g; k++) {
                struct req *r = perf_xcalloc(1, sizeof(*r));
                r->id = nreq;
                r->prompt = (uint32_t)perf_rng_logu(&s, m->prompt_min, m->prompt_max);
                r->output = (uint32_t)perf_rng_range(&s, m->output_min, m->output_max);
                if (nreq == capreq) {
                    capreq = capreq ? 2 * capreq : 64;
                    info = realloc(info, capreq * sizeof(*info));
                    if (info == NULL) {
                        fprintf(stderr, "shardbfc-perf: out of host memory\n");
                        exit(1);
                    }
                }
                info[nreq].prompt = r->prompt;
                info[nreq].output = r->output;
                nreq++;
                if (nqueue == capqueue) {
                    capqueue = capqueue ? 2 * capqueue : 16;
                    queue = realloc(queue, capqueue * sizeof(*queue));
                    if (queue == NULL) {
                        fprintf(stderr, "shardbfc-perf: out of host memory\n");
                        exit(1);
                    }
                }
                queue[nqueue++] = r;
            }
        }
        /* Admit waiting requests (FIFO) and prefill them together. */
        first_new = nrun;
        while (nqueue > 0 && nrun < m->max_batch) {
            run[nrun++] = queue[0];
            memmove(queue, queue + 1, (nqueue - 1) * sizeof(*queue));
            nqueue--;
        }
        if (nrun > first_new) {
            for (unsigned i = first_new; i < nrun; i++)
                adds[i - first_new] = run[i]->prompt;
            gen_iteration(&b, m, run + first_new, nrun - first_new, adds);
            for (unsigned i = first_new; i < nrun; i++)
                run[i]->generated = 1; /* the prefill emits the first token */
        } else if (nrun > 0) {
            for (unsigned i = 0; i < nrun; i++)
                adds[i] = 1;
            gen_iteration(&b, m, run, nrun, adds);
            for (unsigned i = 0; i < nrun; i++)
                run[i]->generated++;
        }
        /* Finished requests give back their whole KV cache. */
        for (unsigned i = 0; i < nrun;) {
            struct req *r = run[i];
            if (r->generated >= r->output) {
                for (uint32_t k = 0; k < r->kv_n; k++)
                    b_free(&b, r->kv[k], 0, PERF_KIND_KV, r->id);
                free(r->kv);
                free(r);
                run[i] = run[--nrun];
            } else {
                i++;
            }
        }
    }
    memset(out, 0, sizeof(*out));
    b_done(&b, out);
    free(queue);
    free(run);
    free(adds);
    if (reqs_out != NULL) {
        *reqs_out = info;
        *nreqs_out = nreq;
    } else {
        free(info);
    }
}

/* --------------------------------------------------------------- replay */

struct ptrmap {
    uint64_t *key; /* 0 = empty */
    uint32_t *val;
    size_t cap;    /* power of two */
    size_t n;
};

static size_t pm_find(const struct ptrmap *pm, uint64_t key)
{
    size_t i = (size_t)(key * 0x9e3779b97f4a7c15ull) & (pm->cap - 1);
    while (pm->key[i] != 0 && pm->key[i] != key)
        i = (i + 1) & (pm->cap - 1);
    return i;
}

/* Linear probing with backward-shift deletion, so no tombstones pile up. */
static void pm_del(struct ptrmap *pm, size_t i)
{
    size_t j = i;
    pm->key[i] = 0;
    pm->n--;
    for (;;) {
        size_t home;
        j = (j + 1) & (pm->cap - 1);
        if (pm->key[j] == 0)
            return;
        home = (size_t)(pm->key[j] * 0x9e3779b97f4a7c15ull) & (pm->cap - 1);
        /* Move j back to i unless its home lies cyclically in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            pm->key[i] = pm->key[j];
            pm->val[i] = pm->val[j];
            pm->key[j] = 0;
            i = j;
        }
    }
}

int perf_gen_replay(const char *path, struct perf_prog *out, char *err, size_t errlen)
{
    bfc_trace_event_t *tev = NULL;
    size_t ntev = 0;
    struct builder b;
    struct ptrmap pm;
    uint64_t streams[PERF_MAX_STREAMS_PER_THREAD];
    unsigned nstreams = 0, rr = 0;
    uint8_t *slot_stream;

    /* The same reader and order as shardbfc-replay: libshardbfc writes
     * per-thread batches, so file order is not time order. */
    if (bfc_trace_csv_read_ordered(path, &tev, &ntev, NULL, err, errlen) != 0)
        return -1;
    memset(&b, 0, sizeof(b));
    pm.cap = 1024;
    while (pm.cap < 2 * ntev + 2)
        pm.cap *= 2;
    pm.key = perf_xcalloc(pm.cap, sizeof(*pm.key));
    pm.val = perf_xcalloc(pm.cap, sizeof(*pm.val));
    pm.n = 0;
    for (size_t i = 0; i < ntev; i++) {
        const bfc_trace_event_t *e = &tev[i];
        unsigned si;
        size_t at;
        if ((e->action != BFC_TRACE_ALLOC && e->action != BFC_TRACE_FREE) || e->ptr == 0)
            continue;
        for (si = 0; si < nstreams; si++)
            if (streams[si] == e->stream)
                break;
        if (si == nstreams) {
            if (nstreams < PERF_MAX_STREAMS_PER_THREAD)
                streams[nstreams++] = e->stream;
            else
                si = rr++ % PERF_MAX_STREAMS_PER_THREAD;
        }
        at = pm_find(&pm, e->ptr);
        if (e->action == BFC_TRACE_ALLOC) {
            if (pm.key[at] != 0) {
                /* Allocated twice without a free in between: the trace lost
                 * the free; free the old block first. */
                b_free(&b, pm.val[at], si, PERF_KIND_OTHER, 0);
                pm_del(&pm, at);
                at = pm_find(&pm, e->ptr);
            }
            pm.key[at] = e->ptr;
            pm.val[at] = b_alloc(&b, e->size ? e->size : 1, si, PERF_KIND_OTHER, 0);
            pm.n++;
        } else if (pm.key[at] != 0) {
            b_free(&b, pm.val[at], si, PERF_KIND_OTHER, 0);
            pm_del(&pm, at);
        }
    }
    /* Close the program: free what is still live, on the stream that
     * allocated it. */
    slot_stream = perf_xcalloc(b.nslots ? b.nslots : 1, 1);
    for (size_t i = 0; i < b.n; i++)
        if (b.ev[i].op == PERF_OP_ALLOC)
            slot_stream[b.ev[i].slot] = b.ev[i].stream;
    for (size_t i = 0; i < pm.cap; i++)
        if (pm.key[i] != 0)
            b_free(&b, pm.val[i], slot_stream[pm.val[i]], PERF_KIND_OTHER, 0);
    free(slot_stream);
    free(pm.key);
    free(pm.val);
    free(tev);
    if (b.n == 0) {
        snprintf(err, errlen, "%s: no allocation events", path);
        free(b.ev);
        free(b.free_slots);
        free(b.slot_size);
        return -1;
    }
    memset(out, 0, sizeof(*out));
    b_done(&b, out);
    out->nstreams = nstreams ? nstreams : 1;
    return 0;
}

/* ---------------------------------------------------------------- cross */

void perf_gen_cross1(const uint64_t *sizes, unsigned nsizes, struct perf_prog *out)
{
    memset(out, 0, sizeof(*out));
    out->ev = perf_xmalloc(2 * (size_t)nsizes * sizeof(*out->ev));
    for (unsigned i = 0; i < nsizes; i++) {
        out->ev[2 * i] = (struct perf_ev){.size = sizes[i], .op = PERF_OP_ALLOC, .stream = 0};
        out->ev[2 * i + 1] = (struct perf_ev){.size = sizes[i], .op = PERF_OP_FREE, .stream = 1};
    }
    out->nev = 2 * (size_t)nsizes;
    out->nslots = 1;
    out->nstreams = 2;
}
