/*
 * internal.h -- definitions shared by every translation unit of libshardbfc.
 * Not installed.  Internal non-static names start with bfc__.
 */
#ifndef BFC_INTERNAL_H
#define BFC_INTERNAL_H

#include "config.h" /* autoconf: BFC_HAVE_CUDA, BFC_META_JEMALLOC, BFC_DEBUG */

/*
 * The same sources are compiled a second time into the PyTorch plug-in
 * (libshardbfc_torch.so), which a Python process dlopen()s long after it
 * started.  Debian's jemalloc cannot be loaded that way (it needs static
 * TLS and replaces malloc), so that build passes -DBFC_FORCE_META_LIBC and
 * gets libc metadata whatever --with-metadata chose for the main library.
 * The override sits here, right after config.h, because every translation
 * unit reads the switch through this header.
 */
#ifdef BFC_FORCE_META_LIBC
#undef BFC_META_JEMALLOC
#define BFC_META_JEMALLOC 0
#endif

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <shardbfc.h>

#define BFC__LIKELY(x) __builtin_expect(!!(x), 1)
#define BFC__UNLIKELY(x) __builtin_expect(!!(x), 0)
#define BFC__CACHELINE 64
/* What separates records that different threads write: two lines, since
 * x86's adjacent-line prefetcher moves 128-byte-aligned pairs (C++'s
 * hardware_destructive_interference_size is 128 there for this reason). */
#define BFC__SHARE_SPAN 128

/* Nanoseconds on `clock` (CLOCK_MONOTONIC, CLOCK_MONOTONIC_COARSE, ...); 0
 * when it cannot be read, which callers take as "unknown". */
static inline uint64_t bfc__clock_ns(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A timed wait's deadline, `ns` from now on CLOCK_MONOTONIC, and whether it
 * has passed: also whenever the clock cannot be read, which spends the
 * budget at once, so that no wait outlives its bound for want of a clock
 * (a seccomp policy that refuses clock_gettime). */
static inline uint64_t bfc__deadline_in(uint64_t ns)
{
    return bfc__clock_ns(CLOCK_MONOTONIC) + ns;
}
static inline bool bfc__deadline_passed(uint64_t deadline)
{
    uint64_t now = bfc__clock_ns(CLOCK_MONOTONIC);
    return now == 0 || now >= deadline;
}

/*
 * Walks of liburcu's intrusive lists (<urcu/list.h>).  Not its
 * cds_list_for_each_entry: that one turns the list head itself into an
 * entry pointer to test the end (&pos->member != head), a pointer to no
 * object -- undefined behaviour that UBSan reports for entries aligned
 * more strictly than the head (an arena is cache-line aligned).  These
 * test the node and make an entry only of a node that is one.  The _safe
 * walk reads the next node before the body runs, so the body may unlink
 * (or free) the entry.
 */
#define bfc__list_for_each(pos, head, member)                                                  \
    for (struct cds_list_head *pos##_node = (head)->next;                                       \
         pos##_node != (head) && ((pos) = caa_container_of(pos##_node, __typeof__(*(pos)), member), 1); \
         pos##_node = pos##_node->next)
#define bfc__list_for_each_safe(pos, head, member)                                             \
    for (struct cds_list_head *pos##_node = (head)->next, *pos##_later = pos##_node->next;      \
         pos##_node != (head) && ((pos) = caa_container_of(pos##_node, __typeof__(*(pos)), member), 1); \
         pos##_node = pos##_later, pos##_later = pos##_node->next)

/* Granule of every chunk and of every returned pointer. */
#define BFC__MIN_ALLOC_BITS 8
#define BFC__MIN_ALLOC ((size_t)1 << BFC__MIN_ALLOC_BITS) /* 256 */

/*
 * The per-thread default stream's handle: cudaStreamPerThread, and SIM's
 * BFC_SIM_STREAM_PER_THREAD, which models it.  One handle names a
 * different stream on every thread, so equal handles do not mean the same
 * stream (a free by another thread on its own per-thread stream is a
 * cross-stream free), and a stream recorded by handle cannot be reached
 * from another thread (backend.h, stream_for).  backend_cuda.c checks that
 * the value is cudaStreamPerThread's.
 */
#define BFC__STREAM_PER_THREAD ((bfc_stream_t)(uintptr_t)2)

/*
 * The stream_key of a per-thread default stream's shard (arena.h): the
 * address of a private object of the library, which no stream handle is
 * and no caller can name by mistake.  (It was UINTPTR_MAX, which a made-up
 * handle, (bfc_stream_t)-1, matched: a free on it was taken as the owner's
 * and unfenced.)
 */
extern const char bfc__per_thread_key_obj;
#define BFC__PER_THREAD_KEY ((bfc_stream_t)(uintptr_t)&bfc__per_thread_key_obj)

#define BFC__NUM_BINS 21
#define BFC__KiB ((size_t)1 << 10)
#define BFC__MiB ((size_t)1 << 20)
#define BFC__GiB ((size_t)1 << 30)
/* TensorFlow's kMaxInternalFragmentation rule: 128 MiB. */
#define BFC__MAX_INTERNAL_FRAG (128 * BFC__MiB)

/*
 * Configure switches as constants (jemalloc's config_* idiom): debug code
 * always compiles and is removed by the optimiser when off.
 */
#ifndef BFC_HAVE_CUDA
#define BFC_HAVE_CUDA 0
#endif
#ifndef BFC_DEBUG
#define BFC_DEBUG 0
#endif
#ifndef BFC_META_JEMALLOC
#define BFC_META_JEMALLOC 0
#endif
static const bool bfc__config_cuda = BFC_HAVE_CUDA;
static const bool bfc__config_debug = BFC_DEBUG;
static const bool bfc__config_meta_jemalloc = BFC_META_JEMALLOC;

/*
 * Thread-locals the allocation and free paths touch (the RCU reader cache,
 * the last error, the shard cache): the initial-exec model, one
 * %fs-relative load, where a shared library's default model calls
 * __tls_get_addr (~11 instructions) on every access.  Initial-exec puts
 * them in the static TLS block, which marks the library DF_STATIC_TLS:
 * only builds with jemalloc metadata use it, since Debian's jemalloc needs
 * static TLS anyway.  Builds with libc metadata -- the PyTorch plug-in
 * among them -- keep the default model and can still be loaded late by
 * dlopen() (tests/test_torch_plugin checks the flag).
 */
#if BFC_META_JEMALLOC
#define BFC__TLS_IE __attribute__((tls_model("initial-exec")))
#else
#define BFC__TLS_IE
#endif

/*
 * ThreadSanitizer cannot see synchronisation done inside uninstrumented
 * libraries (liburcu's grace periods).  In TSan builds the RCU read-side
 * unlock releases, and every reclamation callback acquires, one sync object:
 * exactly the happens-before edge a grace period provides.  No-ops otherwise.
 */
#if defined(__SANITIZE_THREAD__)
#define BFC__TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define BFC__TSAN 1
#endif
#endif
#ifdef BFC__TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define BFC__TSAN_ACQUIRE(a) __tsan_acquire((void *)(a))
#define BFC__TSAN_RELEASE(a) __tsan_release((void *)(a))
#else
#define BFC__TSAN_ACQUIRE(a) ((void)0)
#define BFC__TSAN_RELEASE(a) ((void)0)
#endif

/* Rounds n up to a multiple of 256; returns 0 when that would overflow.
 * No test needed: above SIZE_MAX - 255 the sum wraps to [0, 254], which
 * the mask turns into 0 (one branch less on the allocation's fast path). */
static inline size_t bfc__round256(size_t n)
{
    return (n + BFC__MIN_ALLOC - 1) & ~(size_t)(BFC__MIN_ALLOC - 1);
}

/* Rounds n up to a multiple of a power of two `align`; 0 on overflow. */
static inline size_t bfc__round_up(size_t n, size_t align)
{
    if (n > SIZE_MAX - (align - 1))
        return 0;
    return (n + align - 1) & ~(align - 1);
}

/* Sets the calling thread's bfc_last_error() (errors.c). */
extern _Thread_local int bfc__last_error BFC__TLS_IE;
static inline void bfc__set_last_error(int status)
{
    bfc__last_error = status;
}

/*
 * The configuration read once from SHARDBFC_CONF (config.c): *out is filled
 * with the defaults plus the environment's spec; returns the parse status
 * (BFC_EINVAL for a bad spec, in which case *out holds the defaults).
 * Context: thread-safe (pthread_once).
 */
int bfc__config_from_env(bfc_config_t *out);

/*
 * SHARDBFC_CONF parsed but the service cannot run on it (api.c: the first
 * device context could not be created, BFC_EINVAL): from now on
 * bfc__config_from_env returns BFC_EINVAL, as for a bad spec, and stderr
 * says once why (`why`).  bfc__config_refused() says whether it happened.
 * Context: thread-safe.
 */
void bfc__config_refuse(const char *why);
bool bfc__config_refused(void);

#endif /* BFC_INTERNAL_H */
