/*
 * alloc_trace.c -- an LD_PRELOAD interposer that records the CPU tensor
 * allocator of PyTorch (c10's alloc_cpu / free_cpu) as an allocation trace
 * in libshardbfc's format (RMM's CSV log, doc/trace.md), so that real
 * models' allocation sequences can be replayed with tools/shardbfc-replay.
 * Not part of the library; scripts/capture_traces.sh builds and uses it.
 *
 * What is recorded.  c10 allocates every CPU tensor's storage with
 * posix_memalign(64) and releases it with free().  The interposer wraps
 * posix_memalign, aligned_alloc and memalign; a call counts as the tensor
 * allocator's only when its return address lies in libc10 (found with
 * dladdr, cached per call site), because other libraries in the process
 * (the BLAS, Python extensions) use aligned allocations too.  Pointers so
 * obtained go into a hash table of live blocks with their size; free() and
 * realloc() of a pointer in the table record a `free` row and drop it, and
 * every other free() is passed through untouched, so frees of pointers the
 * table never saw are never recorded.  realloc() of a recorded block (c10
 * never does it) is recorded as its free and counted in the summary.
 *
 * Threads and streams.  Each capturing thread is one stream of the trace:
 * the first thread to allocate is stream 0x1, the next 0x2, and so on,
 * unless the thread named its stream with alloc_trace_set_stream() (ids
 * given automatically start above the highest one named so far).  The
 * Thread column is the kernel thread id.
 *
 * Order and time.  One mutex guards the table and the output buffer; the
 * time (ns of CLOCK_MONOTONIC since the capture started) is read under it,
 * so rows are in time order across threads, which is also file order.  A
 * free is recorded and its pointer dropped before the real free() runs,
 * and an allocation is recorded after the real call returns, so the same
 * address can never be live twice in the table.
 *
 * Memory.  The table and the output buffer live in mmap'ed memory and rows
 * are written with write(2): the interposer never calls the allocator it
 * wraps while holding its lock.
 *
 * Environment:
 *   ALLOC_TRACE=PATH          the CSV to write (nothing is recorded without it)
 *   ALLOC_TRACE_FILTER=c10    aligned calls from libc10 only (default);
 *                  =all       every aligned call in the process
 *   ALLOC_TRACE_START=1       record from the start (default); 0: wait for
 *                             alloc_trace_start()
 * Control, from the traced process (Python: ctypes.CDLL(None)):
 *   void alloc_trace_start(void)          begin recording (time 0 is now)
 *   void alloc_trace_stop(void)           end recording, flush, print the summary
 *   void alloc_trace_set_stream(int)      the calling thread's stream id
 * The summary (to stderr) counts recorded allocations and frees, blocks
 * still live at the end, aligned calls left out and the libraries they came
 * from, and realloc() of recorded blocks.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The trace's actions and their CSV spellings: the library's own table
 * (not installed, so by path), of which the interposer writes the first
 * three -- RMM's. */
#include "../../src/trace_actions.h"

enum action {
#define ACTION_ENUM(name, csv) ACT_##name,
    BFC_TRACE_ACTIONS(ACTION_ENUM)
#undef ACTION_ENUM
};

static const char *const action_csv[] = {
#define ACTION_CSV(name, csv) [ACT_##name] = csv,
    BFC_TRACE_ACTIONS(ACTION_CSV)
#undef ACTION_CSV
};

#define EXPORT __attribute__((visibility("default")))

extern void __libc_free(void *);
extern void *__libc_realloc(void *, size_t);

static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static void (*real_free)(void *);
static void *(*real_realloc)(void *, size_t);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* Set once the capture runs; read without the lock on every call (the
 * acquire pairs with the release in start/stop), re-checked under it. */
static atomic_bool recording;
/* Number of live recorded blocks: lets free() skip the lock when zero. */
static atomic_size_t live_blocks;
static atomic_int next_stream;
static bool filter_all;
static bool finished;
static int out_fd = -1;
static struct timespec t0;

static __thread int my_stream;
static __thread long my_tid;

/* ------------------------------------------------------------ counters */

static uint64_t n_alloc, n_free, n_fail, n_realloc_tracked, n_ignored, n_lost;
static uint64_t n_unaligned_align; /* recorded calls whose alignment was not 64 */

struct mod_count {
    const char *name;
    uint64_t calls;
};
static struct mod_count ignored_mods[16];

/* ----------------------------------------------------- live block table */

struct slot {
    uintptr_t key; /* 0 = empty */
    size_t size;
};
static struct slot *tab;
static size_t tab_cap, tab_n;

static size_t hash_ptr(uintptr_t p)
{
    uint64_t x = (uint64_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x;
}

static void *map_pages(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static bool tab_grow(void)
{
    size_t ncap = tab_cap ? tab_cap * 2 : 1u << 16;
    struct slot *ns = map_pages(ncap * sizeof(*ns));
    if (!ns)
        return false;
    for (size_t i = 0; i < tab_cap; i++) {
        if (!tab[i].key)
            continue;
        size_t j = hash_ptr(tab[i].key) & (ncap - 1);
        while (ns[j].key)
            j = (j + 1) & (ncap - 1);
        ns[j] = tab[i];
    }
    if (tab)
        munmap(tab, tab_cap * sizeof(*tab));
    tab = ns;
    tab_cap = ncap;
    return true;
}

static bool tab_put(uintptr_t key, size_t size)
{
    if ((tab_n + 1) * 2 > tab_cap && !tab_grow())
        return false;
    size_t j = hash_ptr(key) & (tab_cap - 1);
    while (tab[j].key && tab[j].key != key)
        j = (j + 1) & (tab_cap - 1);
    if (!tab[j].key)
        tab_n++;
    tab[j] = (struct slot){key, size};
    return true;
}

/* Removes key; returns true and its size when it was there. */
static bool tab_take(uintptr_t key, size_t *size)
{
    if (!tab_cap)
        return false;
    size_t mask = tab_cap - 1, i = hash_ptr(key) & mask;
    while (tab[i].key != key) {
        if (!tab[i].key)
            return false;
        i = (i + 1) & mask;
    }
    *size = tab[i].size;
    tab[i].key = 0;
    tab_n--;
    /* Backward-shift deletion: no tombstones. */
    for (size_t j = (i + 1) & mask; tab[j].key; j = (j + 1) & mask) {
        size_t home = hash_ptr(tab[j].key) & mask;
        bool between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            tab[i] = tab[j];
            tab[j].key = 0;
            i = j;
        }
    }
    return true;
}

/* -------------------------------------------------------------- output */

enum { OUT_CAP = 1 << 20 };
static char *out_buf;
static size_t out_len;
static uint64_t out_lost;  /* bytes of rows a failed write dropped */
static int out_errno;      /* the first failure's errno (write or close) */

static void out_flush(void)
{
    size_t off = 0;
    while (off < out_len) {
        ssize_t w = write(out_fd, out_buf + off, out_len - off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (!out_errno)
                out_errno = errno;
            out_lost += out_len - off; /* said by summary(): the trace is cut */
            break;
        }
        off += (size_t)w;
    }
    out_len = 0;
}

static char *put_dec(char *p, uint64_t v)
{
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

static char *put_hex(char *p, uint64_t v)
{
    char tmp[24];
    int n = 0;
    *p++ = '0';
    *p++ = 'x';
    do {
        tmp[n++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

static char *put_str(char *p, const char *s)
{
    while (*s)
        *p++ = *s++;
    return p;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)(ts.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)ts.tv_nsec -
           (uint64_t)t0.tv_nsec;
}

static int stream_of_thread(void)
{
    if (!my_stream)
        my_stream = atomic_fetch_add_explicit(&next_stream, 1, memory_order_relaxed) + 1;
    if (!my_tid)
        my_tid = (long)syscall(SYS_gettid);
    return my_stream;
}

/* One row; called with the lock held. */
static void emit(enum action action, uintptr_t ptr, size_t size)
{
    if (OUT_CAP - out_len < 160)
        out_flush();
    int stream = stream_of_thread();
    char *p = out_buf + out_len;
    p = put_dec(p, (uint64_t)my_tid);
    *p++ = ',';
    p = put_dec(p, now_ns());
    *p++ = ',';
    p = put_str(p, action_csv[action]);
    *p++ = ',';
    p = put_hex(p, ptr);
    *p++ = ',';
    p = put_dec(p, size);
    *p++ = ',';
    p = put_hex(p, (uint64_t)stream);
    *p++ = '\n';
    out_len = (size_t)(p - out_buf);
}

/* ------------------------------------------------------------ set-up */

static void resolve(void)
{
    static atomic_bool done;
    if (atomic_load_explicit(&done, memory_order_acquire))
        return;
    real_posix_memalign = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
    real_memalign = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "memalign");
    real_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    if (!real_posix_memalign || !real_aligned_alloc || !real_memalign) {
        /* free and realloc fall back to glibc's own entry points; these
         * have none: nothing can be served without them. */
        static const char msg[] = "alloc_trace: the C library's aligned allocation functions not found\n";
        if (write(2, msg, sizeof msg - 1) < 0) {
            /* nothing left to say it with */
        }
        abort();
    }
    /* Pairs with the acquire above: the pointers are visible once done is. */
    atomic_store_explicit(&done, true, memory_order_release);
}

EXPORT void alloc_trace_start(void)
{
    pthread_mutex_lock(&lock);
    if (!finished && !atomic_load_explicit(&recording, memory_order_relaxed) && out_fd >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        /* Pairs with the acquire loads in the wrappers. */
        atomic_store_explicit(&recording, true, memory_order_release);
    }
    pthread_mutex_unlock(&lock);
}

EXPORT void alloc_trace_set_stream(int stream)
{
    my_stream = stream;
    /* Threads numbered automatically later must not get this id too. */
    int cur = atomic_load_explicit(&next_stream, memory_order_relaxed);
    while (cur < stream &&
           !atomic_compare_exchange_weak_explicit(&next_stream, &cur, stream,
                                                  memory_order_relaxed, memory_order_relaxed))
        ;
}

static void summary(void)
{
    char line[512];
    int n = snprintf(line, sizeof line,
                     "alloc_trace: %llu allocations, %llu frees, %llu allocation failures, "
                     "%zu blocks live at the end, %llu aligned calls left out, "
                     "%llu realloc of recorded blocks, %llu recorded with alignment != 64, "
                     "%llu lost (table full)\n",
                     (unsigned long long)n_alloc, (unsigned long long)n_free,
                     (unsigned long long)n_fail, tab_n, (unsigned long long)n_ignored,
                     (unsigned long long)n_realloc_tracked, (unsigned long long)n_unaligned_align,
                     (unsigned long long)n_lost);
    if (n > 0 && write(2, line, (size_t)n) < 0)
        return;
    if (out_errno) {
        n = snprintf(line, sizeof line,
                     "alloc_trace: the trace is incomplete: %llu bytes of rows not written (%s)\n",
                     (unsigned long long)out_lost, strerror(out_errno));
        if (n > 0 && write(2, line, (size_t)n) < 0)
            return;
    }
    for (size_t i = 0; i < sizeof(ignored_mods) / sizeof(ignored_mods[0]); i++) {
        if (!ignored_mods[i].name)
            break;
        n = snprintf(line, sizeof line, "alloc_trace:   left out: %llu aligned calls from %s\n",
                     (unsigned long long)ignored_mods[i].calls, ignored_mods[i].name);
        if (n > 0 && write(2, line, (size_t)n) < 0)
            return;
    }
}

EXPORT void alloc_trace_stop(void)
{
    pthread_mutex_lock(&lock);
    if (!finished && out_fd >= 0) {
        atomic_store_explicit(&recording, false, memory_order_release);
        finished = true;
        out_flush();
        if (close(out_fd) != 0 && !out_errno)
            out_errno = errno; /* a delayed write error (NFS, a full disk) */
        out_fd = -1;
        summary();
    }
    pthread_mutex_unlock(&lock);
}

/* A forked child (a subprocess started by the workload) must not write into
 * the parent's file: it stops recording and drops the rows it inherited.
 * The lock is held across fork() so the child's copy is consistent. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&lock);
}

static void fork_parent(void)
{
    pthread_mutex_unlock(&lock);
}

static void fork_child(void)
{
    atomic_store_explicit(&recording, false, memory_order_relaxed);
    finished = true;
    out_len = 0;
    if (out_fd >= 0)
        close(out_fd);
    out_fd = -1;
    pthread_mutex_unlock(&lock);
}

__attribute__((constructor)) static void init(void)
{
    resolve();
    const char *path = getenv("ALLOC_TRACE");
    if (!path || !*path)
        return;
    const char *f = getenv("ALLOC_TRACE_FILTER");
    filter_all = f && strcmp(f, "all") == 0;
    out_buf = map_pages(OUT_CAP);
    out_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (!out_buf || out_fd < 0) {
        static const char msg[] = "alloc_trace: cannot open ALLOC_TRACE; nothing recorded\n";
        if (write(2, msg, sizeof msg - 1) < 0) {
            /* nothing left to say it with; still close the file below */
        }
        if (out_fd >= 0)
            close(out_fd);
        out_fd = -1;
        return;
    }
    static const char hdr[] = "Thread,Time,Action,Pointer,Size,Stream\n";
    memcpy(out_buf, hdr, sizeof hdr - 1);
    out_len = sizeof hdr - 1;
    if (pthread_atfork(fork_prepare, fork_parent, fork_child) != 0) {
        static const char msg[] = "alloc_trace: pthread_atfork failed; nothing recorded\n";
        if (write(2, msg, sizeof msg - 1) < 0) {
            /* nothing left to say it with; still close the file below */
        }
        close(out_fd);
        out_fd = -1;
        return;
    }
    const char *s = getenv("ALLOC_TRACE_START");
    if (!s || strcmp(s, "0") != 0)
        alloc_trace_start();
}

__attribute__((destructor)) static void fini(void)
{
    alloc_trace_stop();
}

/* ------------------------------------------------------ caller filter */

/* Call sites seen so far and whether they are libc10's.  Lock-free, and
 * dladdr() runs with no lock of ours held: the dynamic linker calls free()
 * while holding its own lock, so taking that lock under ours could
 * deadlock. */
enum { SITES = 1024 };
static struct {
    _Atomic uintptr_t ra;
    _Atomic int state; /* 0 unknown yet, 1 libc10, 2 elsewhere */
} sites[SITES];

static const char *module_of(void *ra)
{
    Dl_info info;
    if (dladdr(ra, &info) && info.dli_fname)
        return info.dli_fname;
    return "?";
}

static bool from_c10(void *ra, const char **module)
{
    uintptr_t key = (uintptr_t)ra;
    size_t j = hash_ptr(key) & (SITES - 1);
    size_t probes = 0;
    for (; probes < SITES; probes++, j = (j + 1) & (SITES - 1)) {
        /* Acquire pairs with the release CAS below. */
        uintptr_t r = atomic_load_explicit(&sites[j].ra, memory_order_acquire);
        if (r == key) {
            /* Acquire pairs with the release store of the state. */
            int st = atomic_load_explicit(&sites[j].state, memory_order_acquire);
            if (st) {
                *module = NULL;
                return st == 1;
            }
            break;
        }
        if (!r) {
            uintptr_t zero = 0;
            if (atomic_compare_exchange_strong_explicit(&sites[j].ra, &zero, key,
                                                        memory_order_release,
                                                        memory_order_acquire) ||
                zero == key)
                break;
        }
    }
    const char *name = module_of(ra);
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    bool c10 = strncmp(base, "libc10.so", 9) == 0;
    if (probes < SITES)
        atomic_store_explicit(&sites[j].state, c10 ? 1 : 2, memory_order_release);
    *module = name;
    return c10;
}

/* Under the lock; name comes from dladdr (stable while the library is
 * loaded). */
static void count_ignored(const char *name)
{
    n_ignored++;
    for (size_t i = 0; i < sizeof(ignored_mods) / sizeof(ignored_mods[0]); i++) {
        if (!ignored_mods[i].name) {
            ignored_mods[i].name = name;
            ignored_mods[i].calls = 1;
            return;
        }
        if (strcmp(ignored_mods[i].name, name) == 0) {
            ignored_mods[i].calls++;
            return;
        }
    }
}

/* After a successful or failed aligned allocation from call site ra. */
static void record_alloc(void *p, size_t alignment, size_t size, void *ra)
{
    if (!atomic_load_explicit(&recording, memory_order_acquire))
        return;
    const char *module = NULL;
    bool keep = filter_all || from_c10(ra, &module);
    if (!keep && !module)
        module = module_of(ra); /* a cached site: name it for the summary */
    pthread_mutex_lock(&lock);
    if (atomic_load_explicit(&recording, memory_order_relaxed)) {
        if (!keep) {
            count_ignored(module);
        } else if (!p) {
            n_fail++;
            emit(ACT_ALLOC_FAIL, 0, size);
        } else if (tab_put((uintptr_t)p, size)) {
            n_alloc++;
            if (alignment != 64)
                n_unaligned_align++;
            atomic_store_explicit(&live_blocks, tab_n, memory_order_relaxed);
            emit(ACT_ALLOC, (uintptr_t)p, size);
        } else {
            n_lost++; /* the table could not grow: this block is not recorded */
        }
    }
    pthread_mutex_unlock(&lock);
}

/* Before the real free/realloc of p: records and drops a recorded block. */
static void record_free(void *p, bool from_realloc)
{
    /* Relaxed: a block this thread is about to free was recorded either by
     * this thread or handed to it through synchronization that orders it. */
    if (!p || !atomic_load_explicit(&live_blocks, memory_order_relaxed))
        return;
    pthread_mutex_lock(&lock);
    size_t size;
    if (tab_take((uintptr_t)p, &size)) {
        atomic_store_explicit(&live_blocks, tab_n, memory_order_relaxed);
        if (atomic_load_explicit(&recording, memory_order_relaxed)) {
            n_free++;
            if (from_realloc)
                n_realloc_tracked++;
            emit(ACT_FREE, (uintptr_t)p, size);
        }
    }
    pthread_mutex_unlock(&lock);
}

/* ------------------------------------------------------------ wrappers */

EXPORT int posix_memalign(void **memptr, size_t alignment, size_t size)
{
    resolve();
    int rc = real_posix_memalign(memptr, alignment, size);
    record_alloc(rc == 0 ? *memptr : NULL, alignment, size, __builtin_return_address(0));
    return rc;
}

EXPORT void *aligned_alloc(size_t alignment, size_t size)
{
    resolve();
    void *p = real_aligned_alloc(alignment, size);
    record_alloc(p, alignment, size, __builtin_return_address(0));
    return p;
}

EXPORT void *memalign(size_t alignment, size_t size)
{
    resolve();
    void *p = real_memalign(alignment, size);
    record_alloc(p, alignment, size, __builtin_return_address(0));
    return p;
}

EXPORT void free(void *p)
{
    record_free(p, false);
    if (real_free)
        real_free(p);
    else
        __libc_free(p); /* during dlsym, before resolve() finished */
}

EXPORT void *realloc(void *p, size_t size)
{
    record_free(p, true);
    if (real_realloc)
        return real_realloc(p, size);
    return __libc_realloc(p, size);
}
