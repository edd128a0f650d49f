/*
 * test_torch_plugin.c -- libshardbfc_torch.so, driven as PyTorch drives it.
 *
 * The program links nothing of libshardbfc: it dlopen()s the plug-in from
 * the build tree (.libs/libshardbfc_torch.so; SHARDBFC_TORCH_PLUGIN names
 * another copy, an installed one say) the way Python does, RTLD_LOCAL, and
 * reaches everything through dlsym: PyTorch's alloc_fn/free_fn ABI, the
 * plug-in's record_stream and statistics, and the public bfc_* API it
 * exports (SIM streams, bfc_ctx_stats, bfc_ctx_check) to cross-check them.
 *
 * SHARDBFC_CONF is set to backend=sim before the plug-in is loaded, so the
 * service runs on the simulated device and "device" memory is host memory
 * the test can read and write.  The file itself is checked too: it exports
 * only shardbfc_torch_* and bfc_* names, does not depend on jemalloc,
 * needs no static TLS (either would stop a late dlopen()) and is never
 * unmapped (liburcu's call_rcu thread may run its callbacks at any time).
 *
 * Each test runs in a child of its own (Check's fork mode), after the
 * parent loaded the plug-in without touching the service; each test also
 * starts with bfc_shutdown, so CK_FORK=no runs pass too.
 */
#include <check.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <shardbfc.h>
#include <shardbfc_sim.h>
#include <shardbfc_torch.h>

static const char *plugin_path;
static void *plugin;

/*
 * LeakSanitizer (ASan builds) scans every thread's TLS for pointers, and
 * its tracer crashes now and then ("Tracer caught signal 11") on the
 * dynamic TLS blocks of a dlopen()ed library -- here the plug-in's -- once
 * threads that used them have exited: the sanitizer's fault, not a leak,
 * and it goes away with use_tls=0.  Leaks are still checked; a block
 * reachable only from some thread's TLS would now be reported, not hidden.
 * Only the sanitizer runtime calls this.
 */
__attribute__((visibility("default"), used)) const char *__lsan_default_options(void)
{
    return "use_tls=0";
}

/* The plug-in's entry points (dlsym). */
static shardbfc_torch_alloc_fn p_alloc;
static shardbfc_torch_free_fn p_free;
static int (*p_record)(void *, bfc_stream_t);
static int (*p_stats)(int, bfc_stats_t *);
static uint64_t (*p_stat)(int, const char *);
static int (*p_reset_peaks)(int);
static int (*p_empty_cache)(int);
/* Its public bfc_* API. */
static bfc_ctx_t *(*p_default_ctx)(void);
static bfc_stream_t (*p_stream_create)(bfc_ctx_t *);
static void (*p_stream_hold)(bfc_ctx_t *, bfc_stream_t);
static void (*p_stream_drain)(bfc_ctx_t *, bfc_stream_t);
static int (*p_ctx_stats)(bfc_ctx_t *, bfc_stats_t *);
static int (*p_ctx_check)(bfc_ctx_t *);
static size_t (*p_allocated_size)(bfc_ctx_t *, const void *);
static int (*p_last_error)(void);
static void (*p_shutdown)(void);
static int (*p_ctx_config)(bfc_ctx_t *, bfc_config_t *);

#define SYM(var, name)                                                         \
    do {                                                                       \
        *(void **)&(var) = dlsym(plugin, name);                                \
        if (!(var)) {                                                          \
            fprintf(stderr, "test_torch_plugin: %s: no symbol %s\n", plugin_path, name); \
            exit(EXIT_FAILURE);                                                \
        }                                                                      \
    } while (0)

static void load_plugin(void)
{
    plugin = dlopen(plugin_path, RTLD_NOW | RTLD_LOCAL);
    if (!plugin) {
        fprintf(stderr, "test_torch_plugin: dlopen: %s\n", dlerror());
        exit(EXIT_FAILURE);
    }
    SYM(p_alloc, "shardbfc_torch_alloc");
    SYM(p_free, "shardbfc_torch_free");
    SYM(p_record, "shardbfc_torch_record_stream");
    SYM(p_stats, "shardbfc_torch_stats");
    SYM(p_stat, "shardbfc_torch_stat");
    SYM(p_reset_peaks, "shardbfc_torch_reset_peaks");
    SYM(p_empty_cache, "shardbfc_torch_empty_cache");
    SYM(p_default_ctx, "bfc_default_ctx");
    SYM(p_stream_create, "bfc_sim_stream_create");
    SYM(p_stream_hold, "bfc_sim_stream_hold");
    SYM(p_stream_drain, "bfc_sim_stream_drain");
    SYM(p_ctx_stats, "bfc_ctx_stats");
    SYM(p_ctx_check, "bfc_ctx_check");
    SYM(p_allocated_size, "bfc_ctx_allocated_size");
    SYM(p_last_error, "bfc_last_error");
    SYM(p_shutdown, "bfc_shutdown");
    SYM(p_ctx_config, "bfc_ctx_config");
}

/* The plug-in's own counters are process-wide (they outlive bfc_shutdown):
 * tests read them relative to their values when the test began. */
static uint64_t base_alloc_failures, base_free_errors;

static uint64_t alloc_failures(void)
{
    return p_stat(0, "alloc_failures") - base_alloc_failures;
}

static uint64_t free_errors(void)
{
    return p_stat(0, "free_errors") - base_free_errors;
}

/* A fresh service on SIM; its context. */
static bfc_ctx_t *fresh_ctx(void)
{
    bfc_config_t cfg;
    bfc_ctx_t *ctx;

    p_shutdown();
    base_alloc_failures = p_stat(0, "alloc_failures");
    base_free_errors = p_stat(0, "free_errors");
    ctx = p_default_ctx();
    ck_assert_ptr_nonnull(ctx);
    ck_assert_int_eq(p_ctx_config(ctx, &cfg), BFC_OK);
    ck_assert_int_eq(cfg.backend, BFC_BACKEND_SIM);
    return ctx;
}

/* ------------------------------------------------------ the file itself */

struct elf_facts {
    unsigned exported;       /* defined global/weak dynamic symbols */
    char bad_export[128];    /* first one outside shardbfc_torch_ / bfc_ */
    bool needs_jemalloc;
    bool static_tls;
    bool nodelete;
    bool has_alloc, has_free;
};

static bool allowed_export(const char *n)
{
    return strncmp(n, "shardbfc_torch_", 15) == 0 ||
           (strncmp(n, "bfc_", 4) == 0 && n[4] >= 'a' && n[4] <= 'z');
}

static void read_elf(const char *path, struct elf_facts *f)
{
    struct stat stbuf;
    const unsigned char *m;
    const Elf64_Ehdr *eh;
    const Elf64_Shdr *sh;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    memset(f, 0, sizeof(*f));
    ck_assert_msg(fd >= 0, "cannot open %s", path);
    ck_assert_int_eq(fstat(fd, &stbuf), 0);
    m = mmap(NULL, (size_t)stbuf.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    ck_assert(m != MAP_FAILED);
    ck_assert_int_eq(close(fd), 0);
    ck_assert_int_eq(memcmp(m, ELFMAG, SELFMAG), 0);
    ck_assert_int_eq(m[EI_CLASS], ELFCLASS64);
    eh = (const Elf64_Ehdr *)m;
    ck_assert_uint_le(eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr),
                      (uint64_t)stbuf.st_size);
    sh = (const Elf64_Shdr *)(m + eh->e_shoff);
    for (unsigned i = 0; i < eh->e_shnum; i++) {
        const char *str;

        if (sh[i].sh_type != SHT_DYNSYM && sh[i].sh_type != SHT_DYNAMIC)
            continue;
        ck_assert_uint_lt(sh[i].sh_link, eh->e_shnum);
        str = (const char *)(m + sh[sh[i].sh_link].sh_offset);
        if (sh[i].sh_type == SHT_DYNSYM) {
            const Elf64_Sym *sym = (const Elf64_Sym *)(m + sh[i].sh_offset);
            size_t n = sh[i].sh_size / sizeof(*sym);

            for (size_t k = 1; k < n; k++) {
                const char *name = str + sym[k].st_name;
                unsigned bind = ELF64_ST_BIND(sym[k].st_info);

                if (sym[k].st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK))
                    continue;
                f->exported++;
                if (!allowed_export(name) && f->bad_export[0] == '\0')
                    snprintf(f->bad_export, sizeof(f->bad_export), "%s", name);
                if (strcmp(name, "shardbfc_torch_alloc") == 0)
                    f->has_alloc = true;
                if (strcmp(name, "shardbfc_torch_free") == 0)
                    f->has_free = true;
            }
        } else {
            const Elf64_Dyn *d = (const Elf64_Dyn *)(m + sh[i].sh_offset);

            for (; d->d_tag != DT_NULL; d++) {
                if (d->d_tag == DT_NEEDED && strstr(str + d->d_un.d_val, "jemalloc"))
                    f->needs_jemalloc = true;
                if (d->d_tag == DT_FLAGS && (d->d_un.d_val & DF_STATIC_TLS))
                    f->static_tls = true;
                if (d->d_tag == DT_FLAGS_1 && (d->d_un.d_val & DF_1_NODELETE))
                    f->nodelete = true;
            }
        }
    }
    ck_assert_int_eq(munmap((void *)m, (size_t)stbuf.st_size), 0);
}

START_TEST(test_file_exports)
{
    struct elf_facts f;

    read_elf(plugin_path, &f);
    ck_assert_msg(f.has_alloc && f.has_free, "PyTorch's two entry points are not exported");
    ck_assert_msg(f.bad_export[0] == '\0', "exports %s (only shardbfc_torch_* and bfc_*)",
                  f.bad_export);
    ck_assert_uint_gt(f.exported, 40); /* the public API is there too */
    ck_assert_msg(!f.needs_jemalloc, "the plug-in depends on jemalloc: no late dlopen()");
    ck_assert_msg(!f.static_tls, "the plug-in needs static TLS: no late dlopen()");
    /* Its RCU callbacks and thread-exit destructors outlive a dlclose(). */
    ck_assert_msg(f.nodelete, "the plug-in can be unmapped by dlclose()");
}
END_TEST

/* ------------------------------------------------------------ the ABI */

START_TEST(test_same_stream)
{
    bfc_ctx_t *ctx = fresh_ctx();
    bfc_stream_t a = p_stream_create(ctx);
    bfc_stats_t s;
    unsigned char *p, *q;

    ck_assert_ptr_nonnull(a);
    p = p_alloc(1000, 0, a);
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_eq((uintptr_t)p % 256, 0);
    ck_assert_uint_eq(p_allocated_size(ctx, p), 1024);
    memset(p, 0x5a, 1000); /* SIM memory is host memory */
    ck_assert_uint_eq(p_stat(0, "num_allocs"), 1);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 1024);
    ck_assert_uint_eq(p_stat(0, "bytes_requested"), 1000);

    /* PyTorch frees with the size, device and stream of the allocation: a
     * same-stream free, so the next request of that size on that stream
     * gets the same block back at once (best fit, lowest address). */
    p_free(p, 1000, 0, a);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 0);
    q = p_alloc(1000, 0, a);
    ck_assert_ptr_eq(q, p);
    p_free(q, 1000, 0, a);

    ck_assert_int_eq(p_ctx_stats(ctx, &s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, 2);
    ck_assert_uint_eq(s.num_frees, 2);
    ck_assert_uint_eq(s.num_remote_frees, 0);
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(alloc_failures(), 0);
    ck_assert_uint_eq(free_errors(), 0);
    ck_assert_int_eq(p_ctx_check(ctx), BFC_OK);
}
END_TEST

START_TEST(test_default_stream_and_device)
{
    bfc_ctx_t *ctx = fresh_ctx();
    void *p, *q;

    /* The NULL stream works, and on SIM the device argument does not pick
     * another context: every device maps to the one service. */
    p = p_alloc(4096, 0, NULL);
    q = p_alloc(4096, 3, NULL);
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_ne(p, q);
    ck_assert_uint_eq(p_allocated_size(ctx, p), 4096);
    ck_assert_uint_eq(p_allocated_size(ctx, q), 4096);
    ck_assert_uint_eq(p_stat(3, "num_allocs"), 2);
    p_free(q, 4096, 3, NULL);
    p_free(p, 4096, 0, NULL);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 0);
    ck_assert_uint_eq(p_stat(0, "num_shards"), 1);
}
END_TEST

START_TEST(test_bad_input)
{
    bfc_ctx_t *ctx = fresh_ctx();
    bfc_stream_t a = p_stream_create(ctx);
    long on_stack = 0;
    void *p;

    ck_assert_ptr_null(p_alloc(0, 0, a));
    ck_assert_int_eq(p_last_error(), BFC_OK);
    ck_assert_ptr_null(p_alloc(-1, 0, a));
    ck_assert_int_eq(p_last_error(), BFC_EINVAL);
    ck_assert_ptr_null(p_alloc((ssize_t)1 << 62, 0, a)); /* beyond any limit */
    ck_assert_int_eq(p_last_error(), BFC_ENOMEM);
    ck_assert_uint_eq(alloc_failures(), 2);

    p_free(NULL, 0, 0, a); /* PyTorch frees the NULL of a size-0 tensor */
    ck_assert_uint_eq(free_errors(), 0);
    p_free(&on_stack, 8, 0, a); /* foreign: counted, nothing changes */
    ck_assert_uint_eq(free_errors(), 1);

    p = p_alloc(512, 0, a);
    ck_assert_ptr_nonnull(p);
    p_free((char *)p + 256, 256, 0, a); /* interior */
    ck_assert_uint_eq(free_errors(), 2);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 512);
    p_free(p, 512, 0, a);
    p_free(p, 512, 0, a); /* double free */
    ck_assert_uint_eq(free_errors(), 3);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 0);

    ck_assert_int_eq(p_record(NULL, a), BFC_EINVAL);
    ck_assert_int_eq(p_record(&on_stack, a), BFC_ENOTOWNED);
    ck_assert_uint_eq(p_stat(0, "no_such_statistic"), UINT64_MAX);
    ck_assert_uint_eq(p_stat(0, NULL), UINT64_MAX);
    ck_assert_int_eq(p_stats(0, NULL), BFC_EINVAL);
    ck_assert_int_eq(p_ctx_check(ctx), BFC_OK);
}
END_TEST

/*
 * PyTorch's recordStream: a block used on a second stream must not be
 * reused -- not even by its own stream -- until that stream's work queued
 * before the free has completed.
 */
START_TEST(test_record_stream)
{
    bfc_ctx_t *ctx = fresh_ctx();
    bfc_stream_t a = p_stream_create(ctx);
    bfc_stream_t b = p_stream_create(ctx);
    void *p, *q, *r;

    p = p_alloc(8192, 0, a);
    ck_assert_ptr_nonnull(p);
    p_stream_hold(ctx, b); /* b is busy with p */
    ck_assert_int_eq(p_record(p, b), BFC_OK);
    p_free(p, 8192, 0, a);
    ck_assert_uint_eq(p_stat(0, "num_pending_frees"), 1);

    q = p_alloc(8192, 0, a);
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_ne(q, p); /* p still in use on b */

    p_stream_drain(ctx, b); /* b's work completed: p comes back */
    p_free(q, 8192, 0, a);
    r = p_alloc(8192, 0, a);
    ck_assert_ptr_eq(r, p);
    ck_assert_uint_eq(p_stat(0, "num_pending_frees"), 0);
    p_free(r, 8192, 0, a);
    ck_assert_uint_eq(p_stat(0, "bytes_in_use"), 0);
    ck_assert_int_eq(p_ctx_check(ctx), BFC_OK);
}
END_TEST

/* Statistics entry points against bfc_ctx_stats; peaks; empty_cache. */
START_TEST(test_stats)
{
    bfc_ctx_t *ctx = fresh_ctx();
    bfc_stream_t a = p_stream_create(ctx);
    bfc_stats_t s, t;
    void *p[8];

    for (int i = 0; i < 8; i++) {
        p[i] = p_alloc((ssize_t)(i + 1) << 20, 0, a);
        ck_assert_ptr_nonnull(p[i]);
    }
    ck_assert_int_eq(p_stats(0, &s), BFC_OK);
    ck_assert_int_eq(p_ctx_stats(ctx, &t), BFC_OK);
    ck_assert_int_eq(memcmp(&s, &t, sizeof(s)), 0);
    ck_assert_uint_eq(p_stat(0, "num_allocs"), s.num_allocs);
    ck_assert_uint_eq(p_stat(0, "bytes_requested"), 36u << 20);
    ck_assert_uint_eq(p_stat(0, "bytes_reserved"), s.bytes_reserved);
    ck_assert_uint_eq(p_stat(0, "peak_bytes_reserved"), s.peak_bytes_reserved);
    ck_assert_uint_eq(p_stat(0, "bytes_limit"), s.bytes_limit);
    ck_assert_uint_eq(p_stat(0, "num_regions"), s.num_regions);
    ck_assert_uint_ge(s.bytes_reserved, s.bytes_in_use);

    for (int i = 0; i < 8; i++)
        p_free(p[i], (ssize_t)(i + 1) << 20, 0, a);
    ck_assert_uint_eq(p_stat(0, "peak_bytes_in_use"), s.bytes_in_use);
    ck_assert_int_eq(p_reset_peaks(0), BFC_OK);
    ck_assert_uint_eq(p_stat(0, "peak_bytes_in_use"), 0);
    ck_assert_uint_gt(p_stat(0, "bytes_reserved"), 0);
    ck_assert_int_eq(p_empty_cache(0), BFC_OK);
    ck_assert_uint_eq(p_stat(0, "bytes_reserved"), 0);
    ck_assert_int_eq(p_ctx_check(ctx), BFC_OK);
}
END_TEST

/*
 * Many threads, each driving its own stream as PyTorch's workers do.  Each
 * block carries its owner's tag in its first and last words, checked before
 * the free: two live blocks that overlapped would overwrite each other's
 * tags.  A quarter of the blocks are freed by the next thread, still with
 * the allocating stream (PyTorch frees on the allocation's stream from
 * whichever thread drops the tensor).
 */
#define NTHREADS 8
#define ITERS 4000
#define LIVE 64

struct handoff {
    pthread_mutex_t lock;
    void *p[LIVE * 4];
    ssize_t size[LIVE * 4];
    bfc_stream_t stream[LIVE * 4];
    unsigned n;
};

struct worker {
    unsigned id;
    bfc_stream_t stream;
    struct handoff *out; /* this thread hands blocks to the next one */
    struct handoff *in;
    uint64_t allocs, frees, errors;
};

static uint64_t tag_of(const void *p, unsigned id)
{
    return ((uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull) ^ id;
}

static bool tags_ok(void *p, ssize_t n, unsigned id)
{
    uint64_t first, last;

    memcpy(&first, p, 8);
    memcpy(&last, (char *)p + n - 8, 8);
    return first == tag_of(p, id) && last == ~tag_of(p, id);
}

static void set_tags(void *p, ssize_t n, unsigned id)
{
    uint64_t first = tag_of(p, id), last = ~first;

    memcpy(p, &first, 8);
    memcpy((char *)p + n - 8, &last, 8);
}

static void drain_handoff(struct worker *w, bool all)
{
    void *p[LIVE * 4];
    ssize_t size[LIVE * 4];
    bfc_stream_t s[LIVE * 4];
    unsigned n;

    if (pthread_mutex_lock(&w->in->lock) != 0)
        abort();
    n = w->in->n;
    if (!all && n < LIVE) {
        if (pthread_mutex_unlock(&w->in->lock) != 0)
            abort();
        return;
    }
    memcpy(p, w->in->p, n * sizeof(p[0]));
    memcpy(size, w->in->size, n * sizeof(size[0]));
    memcpy(s, w->in->stream, n * sizeof(s[0]));
    w->in->n = 0;
    if (pthread_mutex_unlock(&w->in->lock) != 0)
        abort();
    for (unsigned i = 0; i < n; i++) {
        unsigned from = (w->id + NTHREADS - 1) % NTHREADS;

        if (!tags_ok(p[i], size[i], from))
            w->errors++;
        p_free(p[i], size[i], 0, s[i]);
        w->frees++;
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    void *live[LIVE] = {0};
    ssize_t size[LIVE] = {0};
    uint64_t rng = 0x12345u + w->id;

    for (unsigned it = 0; it < ITERS; it++) {
        unsigned k;
        ssize_t n;

        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        k = (unsigned)(rng >> 33) % LIVE;
        n = 16 + (ssize_t)((rng >> 13) % (256 * 1024));
        if (live[k]) {
            if (!tags_ok(live[k], size[k], w->id))
                w->errors++;
            if ((rng >> 7) % 4 == 0) { /* the next thread frees it */
                bool full;

                if (pthread_mutex_lock(&w->out->lock) != 0)
                    abort();
                full = w->out->n == LIVE * 4;
                if (!full) {
                    w->out->p[w->out->n] = live[k];
                    w->out->size[w->out->n] = size[k];
                    w->out->stream[w->out->n] = w->stream;
                    w->out->n++;
                }
                if (pthread_mutex_unlock(&w->out->lock) != 0)
                    abort();
                if (full) {
                    p_free(live[k], size[k], 0, w->stream);
                    w->frees++;
                }
            } else {
                p_free(live[k], size[k], 0, w->stream);
                w->frees++;
            }
        }
        live[k] = p_alloc(n, 0, w->stream);
        if (!live[k]) {
            w->errors++;
            continue;
        }
        w->allocs++;
        size[k] = n;
        set_tags(live[k], n, w->id);
        drain_handoff(w, false);
    }
    for (unsigned k = 0; k < LIVE; k++) {
        if (!live[k])
            continue;
        if (!tags_ok(live[k], size[k], w->id))
            w->errors++;
        p_free(live[k], size[k], 0, w->stream);
        w->frees++;
    }
    return NULL;
}

START_TEST(test_threads)
{
    bfc_ctx_t *ctx = fresh_ctx();
    struct handoff box[NTHREADS];
    struct worker w[NTHREADS];
    pthread_t th[NTHREADS];
    uint64_t allocs = 0, frees = 0, errors = 0;
    bfc_stats_t s;

    for (unsigned i = 0; i < NTHREADS; i++) {
        memset(&box[i], 0, sizeof(box[i]));
        ck_assert_int_eq(pthread_mutex_init(&box[i].lock, NULL), 0);
    }
    for (unsigned i = 0; i < NTHREADS; i++) {
        memset(&w[i], 0, sizeof(w[i]));
        w[i].id = i;
        w[i].stream = p_stream_create(ctx);
        ck_assert_ptr_nonnull(w[i].stream);
        w[i].out = &box[(i + 1) % NTHREADS];
        w[i].in = &box[i];
    }
    for (unsigned i = 0; i < NTHREADS; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    for (unsigned i = 0; i < NTHREADS; i++)
        ck_assert_int_eq(pthread_join(th[i], NULL), 0);
    /* What was handed over last is freed now, still by the receiver. */
    for (unsigned i = 0; i < NTHREADS; i++)
        drain_handoff(&w[i], true);
    for (unsigned i = 0; i < NTHREADS; i++) {
        allocs += w[i].allocs;
        frees += w[i].frees;
        errors += w[i].errors;
        ck_assert_int_eq(pthread_mutex_destroy(&box[i].lock), 0);
    }
    ck_assert_uint_eq(errors, 0);
    ck_assert_uint_eq(allocs, (uint64_t)NTHREADS * ITERS);
    ck_assert_uint_eq(frees, allocs);

    ck_assert_int_eq(p_ctx_stats(ctx, &s), BFC_OK);
    ck_assert_uint_eq(s.num_allocs, allocs);
    ck_assert_uint_eq(s.num_frees, frees);
    ck_assert_uint_eq(s.num_remote_frees, 0); /* every free named the allocating stream */
    ck_assert_uint_eq(s.bytes_in_use, 0);
    ck_assert_uint_eq(s.bytes_requested, 0);
    ck_assert_uint_eq(s.num_shards, NTHREADS);
    ck_assert_uint_eq(p_stat(0, "num_allocs"), allocs);
    ck_assert_uint_eq(alloc_failures(), 0);
    ck_assert_uint_eq(free_errors(), 0);
    ck_assert_int_eq(p_ctx_check(ctx), BFC_OK);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("torch_plugin");
    TCase *tc = tcase_create("abi");
    SRunner *sr;
    int failed;

    plugin_path = getenv("SHARDBFC_TORCH_PLUGIN");
    if (!plugin_path || !*plugin_path)
        plugin_path = BFC_TORCH_PLUGIN_PATH;
    if (access(plugin_path, R_OK) != 0) {
        /* --disable-shared builds have no .so to load. */
        printf("test_torch_plugin: %s not built (shared libraries disabled?): skipping\n",
               plugin_path);
        return 77;
    }
    /* Before the plug-in is loaded: the service reads it once. */
    /* vmm=off: the statistics test checks a caching allocator's
     * reserved memory staying until empty_cache. */
    if (setenv("SHARDBFC_CONF", "backend=sim,vmm=off", 1) != 0) {
        perror("setenv");
        return EXIT_FAILURE;
    }
    load_plugin();

    tcase_add_test(tc, test_file_exports);
    tcase_add_test(tc, test_same_stream);
    tcase_add_test(tc, test_default_stream_and_device);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_record_stream);
    tcase_add_test(tc, test_stats);
    tcase_add_test(tc, test_threads);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (dlclose(plugin) != 0)
        fprintf(stderr, "test_torch_plugin: dlclose: %s\n", dlerror());
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
