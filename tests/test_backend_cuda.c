/*
 * test_backend_cuda.c -- backend selection (src/backend.c) and, with a GPU,
 * the CUDA backend's contract (src/backend_cuda.c).
 *
 * Always checked: asking for CUDA without a usable device is BFC_ENODEV and
 * AUTO then falls back to SIM.  Built without CUDA, that is all there is and
 * the program passes.  Built with CUDA but no usable device (no driver: the
 * runtime reports cudaErrorInsufficientDriver), the selection checks run and
 * the program then exits 77 (skip), saying so; the driver's virtual memory
 * API is then unreachable, and the probe must say "no virtual memory"
 * (granule 0) without crashing.  With a device: real allocations, events,
 * stream ids, memory info, host registration, and virtual memory (reserve,
 * map granules, unmap any of them, release; the rollback of a map the
 * device cannot serve) when the device supports it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr */
#endif
#include "backend.h"

#include <check.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#if BFC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static bool have_device(void)
{
#if BFC_HAVE_CUDA
    return bfc__cuda_device_count() > 0;
#else
    return false;
#endif
}

START_TEST(test_no_device_selection)
{
    bfc_config_t cfg;
    bfc__backend_t *be = (bfc__backend_t *)&cfg; /* must be reset to NULL */

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_CUDA;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_ENODEV);
    ck_assert_ptr_null(be);
#if BFC_HAVE_CUDA
    ck_assert_int_eq(bfc__cuda_device_count(), 0);
    be = (bfc__backend_t *)&cfg;
    ck_assert_int_eq(bfc__backend_cuda_open(&cfg, &be), BFC_ENODEV);
    ck_assert_ptr_null(be);
    /* A missing driver is a persistent runtime error (every later call
     * reports it again); probing again must still read as zero devices. */
    ck_assert_int_eq(bfc__cuda_device_count(), 0);
#endif

    cfg.backend = BFC_BACKEND_AUTO;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_OK);
    ck_assert_ptr_nonnull(be);
    ck_assert_int_eq(be->kind, BFC_BACKEND_SIM);
    ck_assert_str_eq(be->name, "sim");
    be->ops->close(be);
}
END_TEST

#if BFC_HAVE_CUDA
/* Without a driver the driver's entry points cannot be resolved: no virtual
 * memory, no crash, the runtime's error state as it was (without a driver
 * every call, cudaGetLastError included, reports the missing driver), and
 * the device probe still reads "no device" afterwards. */
START_TEST(test_no_driver_vmm)
{
    cudaError_t before = cudaGetLastError();

    ck_assert_uint_eq(bfc__cuda_vmm_granule(0), 0);
    ck_assert_uint_eq(bfc__cuda_vmm_granule(0), 0); /* resolved once, same answer */
    ck_assert_uint_eq(bfc__cuda_vmm_granule(-1), 0);
    ck_assert_uint_eq(bfc__cuda_vmm_granule(1000), 0);
    ck_assert_int_eq(cudaGetLastError(), before);
    ck_assert_int_eq(bfc__cuda_device_count(), 0);
}
END_TEST
#endif

#if BFC_HAVE_CUDA
/*
 * The toolkit's stub libcuda (lib64/stubs, which containers often put on
 * the library path) loads but fails every call with cudaErrorStubLibrary:
 * no usable device, so CUDA is BFC_ENODEV (as without a driver) and AUTO
 * falls back to SIM.  Checked in a child started with the stub first on
 * LD_LIBRARY_PATH, which works on a machine with a real driver as well.
 * Then the toolkit's library folder (the stub's parent: its runtime,
 * ahead of any other libcudart, such as the fake one tests/fakecuda.sh
 * puts first), then the inherited path: this program's own dependencies
 * may be found only there (the GPU machine's run unpacks liburcu and
 * jemalloc into a private prefix), and an exec that cannot load them
 * fails with status 127 before the check runs.
 */
static int stub_child(void)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;
    int st;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_CUDA;
    st = bfc__backend_open(&cfg, &be);
    if (st != BFC_ENODEV || be != NULL) {
        fprintf(stderr, "stub driver: backend=cuda gave %d, not BFC_ENODEV\n", st);
        return 1;
    }
    if (bfc__cuda_device_count() != 0) {
        fprintf(stderr, "stub driver: devices counted\n");
        return 1;
    }
    cfg.backend = BFC_BACKEND_AUTO;
    st = bfc__backend_open(&cfg, &be);
    if (st != BFC_OK || be->kind != BFC_BACKEND_SIM) {
        fprintf(stderr, "stub driver: AUTO gave %d, not SIM\n", st);
        return 1;
    }
    be->ops->close(be);
    return 0;
}

/* The stub next to the runtime this program loaded (its lib64/stubs), or
 * under /usr/local/cuda; "" when there is none. */
static void find_stub(char *out, size_t n)
{
    Dl_info info;
    char dir[PATH_MAX - 32];

    out[0] = '\0';
    if (dladdr((void *)cudaGetDeviceCount, &info) && info.dli_fname && strstr(info.dli_fname, "libcudart")) {
        snprintf(dir, sizeof dir, "%s", info.dli_fname);
        char *slash = strrchr(dir, '/');
        if (slash) {
            *slash = '\0';
            snprintf(out, n, "%s/stubs/libcuda.so", dir);
            if (access(out, R_OK) == 0)
                return;
        }
    }
    snprintf(out, n, "/usr/local/cuda/lib64/stubs/libcuda.so");
    if (access(out, R_OK) != 0)
        out[0] = '\0';
}

START_TEST(test_stub_driver)
{
    char stub[PATH_MAX], dir[] = "/tmp/test_backend_cuda_XXXXXX", link[PATH_MAX], self[PATH_MAX];
    char toolkit[PATH_MAX];
    const char *inherited = getenv("LD_LIBRARY_PATH");
    char *env;
    ssize_t len;
    pid_t pid;
    int status;

    find_stub(stub, sizeof stub);
    if (!stub[0]) {
        printf("test_stub_driver: no stub libcuda found; not checked\n");
        return;
    }
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(link, sizeof link, "%s/libcuda.so.1", dir);
    ck_assert_int_eq(symlink(stub, link), 0);
    len = readlink("/proc/self/exe", self, sizeof self - 1);
    ck_assert_int_gt(len, 0);
    self[len] = '\0';
    snprintf(toolkit, sizeof toolkit, "%s", stub);
    *strrchr(toolkit, '/') = '\0'; /* .../lib64/stubs */
    *strrchr(toolkit, '/') = '\0'; /* .../lib64 */
    ck_assert_int_gt(asprintf(&env, "LD_LIBRARY_PATH=%s:%s%s%s", dir, toolkit,
                              inherited && inherited[0] ? ":" : "", inherited ? inherited : ""),
                     0);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        char *argv[] = {self, "--stub-child", NULL};
        char *envp[] = {env, NULL};
        execve(self, argv, envp);
        _exit(127);
    }
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    free(env);
    unlink(link);
    rmdir(dir);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the stub-driver child failed (status %d)",
                  status);
}
END_TEST

static bfc__backend_t *open_cuda(void)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_CUDA;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_OK);
    ck_assert_ptr_nonnull(be);
    ck_assert_int_eq(be->kind, BFC_BACKEND_CUDA);
    return be;
}

START_TEST(test_cuda_selection)
{
    bfc_config_t cfg;
    bfc__backend_t *be = NULL;
    size_t f = 0, t = 0;

    bfc_config_init(&cfg);
    cfg.backend = BFC_BACKEND_AUTO;
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_OK);
    ck_assert_int_eq(be->kind, BFC_BACKEND_CUDA);
    ck_assert(!be->host_accessible);
    ck_assert_uint_gt(strlen(be->name), 0);
    ck_assert_uint_gt(be->default_limit, 0);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);
    ck_assert_uint_le(f, t);
    be->ops->close(be);

    cfg.backend = BFC_BACKEND_CUDA;
    cfg.device = bfc__cuda_device_count(); /* one past the last */
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_ENODEV);
    cfg.backend = BFC_BACKEND_AUTO; /* out of range: SIM */
    ck_assert_int_eq(bfc__backend_open(&cfg, &be), BFC_OK);
    ck_assert_int_eq(be->kind, BFC_BACKEND_SIM);
    be->ops->close(be);
}
END_TEST

START_TEST(test_cuda_memory)
{
    bfc__backend_t *be = open_cuda();
    void *p = NULL, *q = NULL;
    size_t f0 = 0, f1 = 0, t = 0;

    ck_assert_int_eq(be->ops->mem_info(be, &f0, &t), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 64 * BFC__MiB, &p), BFC_OK);
    ck_assert_uint_eq((uintptr_t)p % 256, 0);
    ck_assert_int_eq(be->ops->mem_alloc(be, 1000, &q), BFC_OK);
    ck_assert_uint_eq((uintptr_t)q % 256, 0);
    ck_assert_int_eq(cudaMemset(p, 1, 64 * BFC__MiB), cudaSuccess);
    ck_assert_int_eq(be->ops->mem_info(be, &f1, &t), BFC_OK);
    ck_assert_uint_lt(f1, f0);
    ck_assert_int_eq(be->ops->mem_free(be, p, 64 * BFC__MiB), BFC_OK);
    ck_assert_int_eq(be->ops->mem_free(be, q, 1000), BFC_OK);

    /* Far more than any GPU: ENOMEM, error slot cleared, next call works. */
    ck_assert_int_eq(be->ops->mem_alloc(be, (size_t)1 << 50, &p), BFC_ENOMEM);
    ck_assert_ptr_null(p);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(be->ops->mem_alloc(be, 4096, &p), BFC_OK);
    ck_assert_int_eq(be->ops->mem_free(be, p, 4096), BFC_OK);
    be->ops->close(be);
}
END_TEST

START_TEST(test_cuda_events_streams)
{
    bfc__backend_t *be = open_cuda();
    cudaStream_t s1, s2;
    bfc__event_t ev;
    uint64_t id1 = 0, id2 = 0, id1b = 0, idn = 0;
    int dev = -1;
    void *p = NULL;

    ck_assert_int_eq(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
    ck_assert_int_eq(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
    ck_assert_int_eq(be->ops->stream_id(be, s1, &id1), BFC_OK);
    ck_assert_int_eq(be->ops->stream_id(be, s2, &id2), BFC_OK);
    ck_assert_int_eq(be->ops->stream_id(be, s1, &id1b), BFC_OK);
    ck_assert_int_eq(be->ops->stream_id(be, NULL, &idn), BFC_OK);
    ck_assert_uint_ne(id1, id2);
    ck_assert_uint_eq(id1, id1b);
    ck_assert_uint_ne(idn, id1);
    ck_assert_int_eq(bfc__cuda_stream_device(s1, &dev), BFC_OK);
    ck_assert_int_eq(dev, 0);
    ck_assert_int_eq(bfc__cuda_stream_device(NULL, &dev), BFC_OK);

    ck_assert_int_eq(be->ops->event_create(be, &ev), BFC_OK);
    ck_assert_int_eq(be->ops->mem_alloc(be, 256 * BFC__MiB, &p), BFC_OK);
    /* Queue real work, record behind it: the event completes eventually. */
    ck_assert_int_eq(cudaMemsetAsync(p, 0, 256 * BFC__MiB, s1), cudaSuccess);
    ck_assert_int_eq(be->ops->event_record(be, ev, s1), BFC_OK);
    {
        int st = be->ops->event_query(be, ev);

        ck_assert(st == BFC_OK || st == BFC_EBUSY);
    }
    ck_assert_int_eq(be->ops->event_wait(be, ev, 10000), BFC_OK);
    ck_assert_int_eq(be->ops->event_query(be, ev), BFC_OK);
    ck_assert_int_eq(be->ops->event_record(be, ev, NULL), BFC_OK);
    ck_assert_int_eq(be->ops->event_wait(be, ev, UINT32_MAX), BFC_OK);
    ck_assert_int_eq(be->ops->stream_sync(be, s1), BFC_OK);
    ck_assert_int_eq(be->ops->event_destroy(be, ev), BFC_OK);
    ck_assert_int_eq(be->ops->mem_free(be, p, 256 * BFC__MiB), BFC_OK);
    ck_assert_int_eq(cudaStreamDestroy(s1), cudaSuccess);
    ck_assert_int_eq(cudaStreamDestroy(s2), cudaSuccess);
    be->ops->close(be);
}
END_TEST

START_TEST(test_cuda_host_register)
{
    bfc__backend_t *be = open_cuda();
    size_t n = 4 * BFC__MiB;
    void *h = aligned_alloc(4096, n);

    ck_assert_ptr_nonnull(h);
    ck_assert_int_eq(be->ops->host_register(be, h, n), BFC_OK);
    ck_assert_int_eq(be->ops->host_unregister(be, h), BFC_OK);
    free(h);
    be->ops->close(be);
}
END_TEST

/* Fills [p, p + n) of device memory with v and reads it back. */
static bool device_fill_check(uintptr_t p, size_t n, unsigned char v)
{
    unsigned char *h = malloc(n);
    bool ok = h != NULL;

    ok = ok && cudaMemset((void *)p, v, n) == cudaSuccess;
    ok = ok && cudaMemcpy(h, (void *)p, n, cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t i = 0; ok && i < n; i++)
        ok = h[i] == v;
    free(h);
    return ok;
}

/*
 * Mapping n granules at va takes about n granules of the device's free
 * memory and unmapping gives them back, as the driver reports it.  Other
 * processes change that figure too (the rest of a parallel make check, say),
 * so each try measures across one map and one unmap only, and a try that
 * another process disturbed is made again, up to eight times.
 */
static bool footprint_ok(bfc__backend_t *be, uintptr_t va, size_t n, size_t g)
{
    for (int i = 0; i < 8; i++) {
        size_t f0 = 0, f1 = 0, f2 = 0, t = 0;

        ck_assert_int_eq(be->ops->mem_info(be, &f0, &t), BFC_OK);
        ck_assert_int_eq(be->ops->va_map(be, va, n * g), BFC_OK);
        ck_assert_int_eq(be->ops->mem_info(be, &f1, &t), BFC_OK);
        ck_assert_int_eq(be->ops->va_unmap(be, va, n * g, NULL), BFC_OK);
        ck_assert_int_eq(be->ops->mem_info(be, &f2, &t), BFC_OK);
        /* (a granule of slack for the driver's own use) */
        if (f1 + n * g <= f0 + g && f2 + g >= f1 + n * g)
            return true;
        printf("footprint of %zu granules, try %d: free %zu -> %zu -> %zu (another process?)\n",
               n, i + 1, f0, f1, f2);
    }
    return false;
}

/* Releasing a reservation with granules still mapped unmaps and frees
 * them: measured as footprint_ok does, on a fresh reservation per try. */
static bool release_frees_ok(bfc__backend_t *be, size_t g)
{
    for (int i = 0; i < 8; i++) {
        uintptr_t r = 0;
        size_t f0 = 0, f1 = 0, t = 0;

        ck_assert_int_eq(be->ops->va_reserve(be, 8 * g, &r), BFC_OK);
        ck_assert_int_eq(be->ops->va_map(be, r + g, 2 * g), BFC_OK);
        ck_assert_int_eq(be->ops->va_map(be, r + 5 * g, g), BFC_OK);
        ck_assert_int_eq(be->ops->mem_info(be, &f0, &t), BFC_OK);
        ck_assert_int_eq(be->ops->va_release(be, r, 8 * g), BFC_OK);
        ck_assert_int_eq(be->ops->mem_info(be, &f1, &t), BFC_OK);
        if (f1 + g >= f0 + 3 * g)
            return true;
        printf("release of 3 mapped granules, try %d: free %zu -> %zu (another process?)\n",
               i + 1, f0, f1);
    }
    return false;
}

START_TEST(test_cuda_vmm)
{
    bfc__backend_t *be = open_cuda();
    size_t g = be->vmm_granule;
    uintptr_t base = 0, other = 0;
    size_t t = 0, f = 0;

    if (g == 0) {
        printf("device has no virtual memory management: VMM checks not run\n");
        ck_assert_uint_eq(bfc__cuda_vmm_granule(be->device), 0);
        be->ops->close(be);
        return;
    }
    ck_assert_uint_eq(g & (g - 1), 0);
    ck_assert_uint_eq(g, bfc__cuda_vmm_granule(be->device));
    ck_assert_int_eq(be->ops->va_reserve(be, 64 * g, &base), BFC_OK);
    ck_assert_uint_eq(base % g, 0);
    ck_assert_int_eq(be->ops->mem_info(be, &f, &t), BFC_OK);

    /* Four granules mapped in one call take device memory, unmapped give
     * it back; mapped, they are usable by the device. */
    ck_assert_msg(footprint_ok(be, base + 40 * g, 4, g),
                  "mapping 4 granules did not take (or unmapping give back) 4 granules of the "
                  "device's free memory in 8 tries");
    ck_assert_int_eq(be->ops->va_map(be, base + 2 * g, 4 * g), BFC_OK);
    ck_assert(device_fill_check(base + 2 * g, 4 * g, 0x5A));

    /* One granule out of the middle, its neighbours intact, then back. */
    ck_assert_int_eq(be->ops->va_unmap(be, base + 3 * g, g, NULL), BFC_OK);
    ck_assert(device_fill_check(base + 2 * g, g, 0x11));
    ck_assert(device_fill_check(base + 4 * g, 2 * g, 0x22));
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * g, g), BFC_OK);
    ck_assert(device_fill_check(base + 2 * g, 4 * g, 0x33));

    /* Bad ranges never reach the driver. */
    ck_assert_int_eq(be->ops->va_map(be, base + 3 * g, g), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, base + g, 2 * g), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, base + 1, g), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_map(be, base + 63 * g, 2 * g), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_unmap(be, base, g, NULL), BFC_EINVAL);
    ck_assert_int_eq(be->ops->va_release(be, base, 32 * g), BFC_EINVAL);

    /* Unmap across what were two maps. */
    ck_assert_int_eq(be->ops->va_unmap(be, base + 2 * g, 3 * g, NULL), BFC_OK);
    ck_assert(device_fill_check(base + 5 * g, g, 0x44));

    /* More than the device has: refused, and nothing of it stays mapped
     * (the same range maps piecemeal afterwards). */
    {
        size_t big = (t / g + 8) * g;

        ck_assert_int_eq(be->ops->va_reserve(be, big, &other), BFC_OK);
        ck_assert_int_eq(be->ops->va_map(be, other, big), BFC_ENOMEM);
        ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
        ck_assert_int_eq(be->ops->va_map(be, other, 2 * g), BFC_OK);
        ck_assert_int_eq(be->ops->va_map(be, other + big - g, g), BFC_OK);
    }

    /* Release with granules still mapped: they are unmapped and freed. */
    ck_assert_int_eq(be->ops->va_release(be, base, 64 * g), BFC_OK);
    ck_assert_msg(release_frees_ok(be, g),
                  "releasing a reservation did not give its 3 mapped granules back in 8 tries");
    ck_assert_int_eq(be->ops->va_release(be, base, 64 * g), BFC_EINVAL);
    /* `other` is left for close to release. */
    be->ops->close(be);
}
END_TEST
#endif /* BFC_HAVE_CUDA */

int main(int argc, char **argv)
{
#if BFC_HAVE_CUDA
    if (argc > 1 && strcmp(argv[1], "--stub-child") == 0)
        return stub_child();
#else
    (void)argc;
    (void)argv;
#endif
    Suite *s = suite_create("backend_cuda");
    TCase *sel = tcase_create("selection");
    SRunner *sr;
    bool dev = have_device();
    int failed;

    if (!dev)
        tcase_add_test(sel, test_no_device_selection);
#if BFC_HAVE_CUDA
    if (!dev)
        tcase_add_test(sel, test_no_driver_vmm);
    tcase_add_test(sel, test_stub_driver);
    if (dev) {
        TCase *gpu = tcase_create("gpu");

        tcase_add_test(sel, test_cuda_selection);
        tcase_add_test(gpu, test_cuda_memory);
        tcase_add_test(gpu, test_cuda_events_streams);
        tcase_add_test(gpu, test_cuda_host_register);
        tcase_add_test(gpu, test_cuda_vmm);
        tcase_set_timeout(gpu, 60);
        suite_add_tcase(s, gpu);
    }
#endif
    suite_add_tcase(s, sel);
    sr = srunner_create(s);
    /* The probe above initialised CUDA in this process, and a forked child
     * cannot use a CUDA context its parent created: run in-process. */
    if (dev)
        srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_ENV);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (failed)
        return EXIT_FAILURE;
    if (!dev) {
        /* The GPU tests did not run: say so, and skip (automake's 77). */
        printf("%s: skipping the GPU tests, virtual memory included "
               "(selection%s checks passed)\n",
               BFC_HAVE_CUDA ? "no usable CUDA device" : "built without CUDA",
               BFC_HAVE_CUDA ? " and no-driver virtual memory" : "");
        return 77;
    }
    return EXIT_SUCCESS;
}
