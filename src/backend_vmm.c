/*
 * backend_vmm.c -- the book a backend keeps of its virtual memory.
 *
 * A backend with virtual memory (vmm_granule != 0) must answer questions its
 * OS or driver answers badly or not at all: is this range inside one of my
 * reservations, is every granule of it mapped (or none), what is still
 * mapped in a reservation being released?  mmap happily maps over anything,
 * and the CUDA driver reports a double map or a stray unmap as a generic
 * error, if at all.  So each backend records its reservations here, sorted
 * by base, each with one bit per granule (1: mapped), and checks every
 * va_* call against the book before it acts.
 *
 * Cost: a lookup is a binary search over the reservations (an arena keeps a
 * few), a range check or update is a pass over size / granule bits, a word
 * at a time.  The bitmap of a 64 GiB reservation is 4 KiB with 2 MiB
 * granules (2 MiB with the 4 KiB granules tests use); it comes from the
 * metadata shim, whose large allocations are zero pages until touched.
 *
 * Locking: the caller holds bk->lock around a whole va_* call (check, act,
 * record), except for bfc__vmm_book_mapped, which takes it itself.  Record
 * pointers are valid until the next add or remove (the array moves).
 */
#include "backend.h"
#include "meta.h"

#include <string.h>

#define WORD_BITS 64u

/* ------------------------------------------------------------- bitmaps */

static size_t words_for(size_t nbits)
{
    return (nbits + WORD_BITS - 1) / WORD_BITS;
}

/* The bits of word i that fall in [lo, hi) (lo inside word i). */
static uint64_t word_mask(size_t lo, size_t hi, size_t *take)
{
    size_t b = lo % WORD_BITS;
    size_t n = WORD_BITS - b < hi - lo ? WORD_BITS - b : hi - lo;

    *take = n;
    return (n == WORD_BITS ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1)) << b;
}

/* Ones among bits [lo, hi). */
static size_t bits_count(const uint64_t *w, size_t lo, size_t hi)
{
    size_t n = 0, take;

    while (lo < hi) {
        uint64_t m = word_mask(lo, hi, &take);

        n += (size_t)__builtin_popcountll(w[lo / WORD_BITS] & m);
        lo += take;
    }
    return n;
}

static void bits_fill(uint64_t *w, size_t lo, size_t hi, bool v)
{
    size_t take;

    while (lo < hi) {
        uint64_t m = word_mask(lo, hi, &take);

        if (v)
            w[lo / WORD_BITS] |= m;
        else
            w[lo / WORD_BITS] &= ~m;
        lo += take;
    }
}

/* The first bit in [lo, hi) equal to v, or hi. */
static size_t bits_find(const uint64_t *w, size_t lo, size_t hi, bool v)
{
    while (lo < hi) {
        size_t i = lo / WORD_BITS;
        uint64_t x = (v ? w[i] : ~w[i]) & (~(uint64_t)0 << (lo % WORD_BITS));

        if (x) {
            size_t at = i * WORD_BITS + (size_t)__builtin_ctzll(x);

            return at < hi ? at : hi;
        }
        lo = (i + 1) * WORD_BITS;
    }
    return hi;
}

/* ------------------------------------------------------------- the book */

int bfc__vmm_book_init(bfc__vmm_book_t *bk, size_t granule)
{
    memset(bk, 0, sizeof(*bk));
    if (bfc__mutex_init(&bk->lock, BFC__RANK_BACKEND_BOOK, "a VMM reservation book") != 0)
        return BFC_ENOMEM;
    bk->granule = granule;
    return BFC_OK;
}

/* Bytes of a reservation's bitmaps: mapped, then stranded. */
static size_t res_bits_bytes(const bfc__vmm_book_t *bk, size_t size)
{
    return 2 * words_for(size / bk->granule) * sizeof(uint64_t);
}

void bfc__vmm_book_fini(bfc__vmm_book_t *bk)
{
    for (size_t i = 0; i < bk->n; i++)
        bfc__meta_free(bk->res[i].bits, res_bits_bytes(bk, bk->res[i].size));
    bfc__meta_free(bk->res, bk->cap * sizeof(*bk->res));
    bk->res = NULL;
    bk->n = bk->cap = 0;
    /* Fatal only for a lock still held: a va_* call racing close. */
    bfc__mutex_destroy(&bk->lock);
}

/* Index of the first reservation whose base is above addr. */
static size_t upper(const bfc__vmm_book_t *bk, uintptr_t addr)
{
    size_t lo = 0, hi = bk->n;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;

        if (bk->res[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The reservation holding addr, or NULL. */
static struct bfc__vmm_res *holder(bfc__vmm_book_t *bk, uintptr_t addr)
{
    size_t i = upper(bk, addr);
    struct bfc__vmm_res *r;

    if (i == 0)
        return NULL;
    r = &bk->res[i - 1];
    return addr - r->base < r->size ? r : NULL;
}

/* The reservation that holds all of [addr, addr + n), n > 0, and the
 * granules [*lo, *hi) that cover it; NULL when no one reservation does. */
static struct bfc__vmm_res *span(bfc__vmm_book_t *bk, uintptr_t addr, size_t n, size_t *lo, size_t *hi)
{
    size_t g = bk->granule;
    struct bfc__vmm_res *r = holder(bk, addr);

    if (!r || n == 0 || n > r->size - (addr - r->base))
        return NULL;
    *lo = (addr - r->base) / g;
    *hi = (addr - r->base + n + g - 1) / g;
    return r;
}

int bfc__vmm_book_add(bfc__vmm_book_t *bk, uintptr_t base, size_t size)
{
    size_t g = bk->granule;
    size_t i;
    uint64_t *bits;

    if (size == 0 || ((base | size) & (g - 1)) != 0 || base + size < base)
        return BFC_EINVAL;
    if (bk->n == bk->cap) {
        size_t cap = bk->cap ? 2 * bk->cap : 8;
        struct bfc__vmm_res *res =
            bfc__meta_realloc(bk->res, bk->cap * sizeof(*res), cap * sizeof(*res));

        if (!res)
            return BFC_ENOMEM;
        bk->res = res;
        bk->cap = cap;
    }
    bits = bfc__meta_zalloc(res_bits_bytes(bk, size));
    if (!bits)
        return BFC_ENOMEM;
    i = upper(bk, base);
    memmove(&bk->res[i + 1], &bk->res[i], (bk->n - i) * sizeof(*bk->res));
    bk->res[i] = (struct bfc__vmm_res){
        .base = base, .size = size, .n_mapped = 0, .bits = bits, .stranded = bits + words_for(size / g)};
    bk->n++;
    return BFC_OK;
}

struct bfc__vmm_res *bfc__vmm_book_exact(bfc__vmm_book_t *bk, uintptr_t base, size_t size)
{
    struct bfc__vmm_res *r = holder(bk, base);

    return r && r->base == base && r->size == size ? r : NULL;
}

size_t bfc__vmm_book_res_mapped(bfc__vmm_book_t *bk, uintptr_t addr, size_t size)
{
    size_t g = bk->granule, n = 0, lo, hi;
    struct bfc__vmm_res *r;

    if (g == 0 || size % g != 0 || addr % g != 0)
        return 0;
    bfc__lock(&bk->lock);
    r = span(bk, addr, size, &lo, &hi);
    if (r)
        n = bits_count(r->bits, lo, hi) * g;
    bfc__unlock(&bk->lock);
    return n;
}

void bfc__vmm_book_remove(bfc__vmm_book_t *bk, struct bfc__vmm_res *r)
{
    size_t i = (size_t)(r - bk->res);

    bfc__meta_free(r->bits, res_bits_bytes(bk, r->size));
    memmove(&bk->res[i], &bk->res[i + 1], (bk->n - i - 1) * sizeof(*bk->res));
    bk->n--;
}

int bfc__vmm_book_check(bfc__vmm_book_t *bk, uintptr_t addr, size_t size, bool mapped,
                        struct bfc__vmm_res **out)
{
    size_t g = bk->granule;
    struct bfc__vmm_res *r;
    size_t lo, hi, ones;

    *out = NULL;
    if (g == 0 || size == 0 || ((addr | size) & (g - 1)) != 0 || addr + size < addr)
        return BFC_EINVAL;
    r = holder(bk, addr);
    if (!r || addr - r->base > r->size - size || size > r->size)
        return BFC_EINVAL;
    lo = (addr - r->base) / g;
    hi = lo + size / g;
    ones = bits_count(r->bits, lo, hi);
    if (mapped ? ones != hi - lo : ones != 0)
        return BFC_EINVAL;
    *out = r;
    return BFC_OK;
}

void bfc__vmm_book_mark(bfc__vmm_book_t *bk, struct bfc__vmm_res *r, uintptr_t addr,
                        size_t size, bool mapped)
{
    size_t g = bk->granule;
    size_t lo = (addr - r->base) / g;
    size_t hi = lo + size / g;
    size_t ones = bits_count(r->bits, lo, hi);

    bits_fill(r->bits, lo, hi, mapped);
    if (mapped) {
        r->n_mapped += (hi - lo) - ones;
    } else {
        r->n_mapped -= ones;
        r->n_stranded -= bits_count(r->stranded, lo, hi);
        bits_fill(r->stranded, lo, hi, false);
    }
}

void bfc__vmm_book_strand(bfc__vmm_book_t *bk, struct bfc__vmm_res *r, uintptr_t addr, size_t size)
{
    size_t g = bk->granule;
    size_t lo = (addr - r->base) / g;
    size_t hi = lo + size / g;

    bfc__vmm_book_mark(bk, r, addr, size, true);
    r->n_stranded += (hi - lo) - bits_count(r->stranded, lo, hi);
    bits_fill(r->stranded, lo, hi, true);
}

bool bfc__vmm_book_stranded_run(bfc__vmm_book_t *bk, uintptr_t addr, size_t size, struct bfc__vmm_res **r,
                                uintptr_t *run, size_t *len)
{
    size_t g = bk->granule;
    struct bfc__vmm_res *h;
    size_t lo, hi, s, e;

    if (g == 0 || size == 0 || ((addr | size) & (g - 1)) != 0 || addr + size < addr)
        return false;
    h = holder(bk, addr);
    if (!h || h->n_stranded == 0 || size > h->size - (addr - h->base))
        return false;
    lo = (addr - h->base) / g;
    hi = lo + size / g;
    s = bits_find(h->stranded, lo, hi, true);
    if (s == hi)
        return false;
    e = bits_find(h->stranded, s, hi, false);
    *r = h;
    *run = h->base + s * g;
    *len = (e - s) * g;
    return true;
}

bool bfc__vmm_book_next_run(bfc__vmm_book_t *bk, const struct bfc__vmm_res *r,
                            uintptr_t *addr, size_t *len)
{
    size_t g = bk->granule;
    size_t n = r->size / g;
    size_t from = *addr <= r->base ? 0 : (*addr - r->base + g - 1) / g;
    size_t s, e;

    if (from >= n)
        return false;
    s = bits_find(r->bits, from, n, true);
    if (s == n)
        return false;
    e = bits_find(r->bits, s, n, false);
    *addr = r->base + s * g;
    *len = (e - s) * g;
    return true;
}

int bfc__vmm_book_mapped(bfc__vmm_book_t *bk, uintptr_t addr, size_t n)
{
    struct bfc__vmm_res *r;
    size_t lo, hi;
    int yes = 0;

    if (bk->granule == 0 || addr + n < addr)
        return 0;
    bfc__lock(&bk->lock);
    r = span(bk, addr, n, &lo, &hi);
    if (r)
        yes = bits_count(r->bits, lo, hi) == hi - lo;
    bfc__unlock(&bk->lock);
    return yes;
}
