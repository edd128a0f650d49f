/*
 * test_config.c -- bfc_config_init defaults, the bfc_config_parse grammar
 * (every key, every class of bad value, all-or-nothing commit),
 * bfc_config_validate, and the once-per-process SHARDBFC_CONF cache.
 *
 * The SHARDBFC_CONF tests rely on Check forking each test (the cache is
 * filled once per process); they are left out, with a note, when CK_FORK=no.
 */
#include "internal.h"

#include <check.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A config with every field off its default, so "unchanged" means something. */
static void nondefault(bfc_config_t *c)
{
    bfc_config_init(c);
    c->backend = BFC_BACKEND_SIM;
    c->device = 3;
    c->memory_limit = 1u << 30;
    c->allow_growth = false;
    c->initial_region = 4096;
    c->fragmentation_fraction = 0.75;
    c->garbage_collection = true;
    c->large_alloc = 0;
    c->retry_ms = 17;
    c->debug_check = true;
    c->poison = true;
    c->host_numa = 1;
}

/* ------------------------------------------------------------ defaults */

START_TEST(test_init_defaults)
{
    bfc_config_t c;
    memset(&c, 0x5a, sizeof c);
    bfc_config_init(&c);
    ck_assert_int_eq(c.backend, BFC_BACKEND_AUTO);
    ck_assert_int_eq(c.device, 0);
    ck_assert_uint_eq(c.memory_limit, 0);
    ck_assert(c.allow_growth);
    ck_assert_uint_eq(c.initial_region, 2u << 20);
    ck_assert(c.fragmentation_fraction == 0.0);
    ck_assert(c.garbage_collection); /* TensorFlow's default (TF_ENABLE_GPU_GARBAGE_COLLECTION) */
    ck_assert_uint_eq(c.large_alloc, 32u << 20);
    ck_assert_uint_eq(c.retry_ms, 0);
    ck_assert(!c.debug_check);
    ck_assert(!c.poison);
    ck_assert_int_eq(c.host_numa, BFC_HOST_NUMA_THREAD);
    for (size_t k = 0; k < sizeof c.reserved / sizeof c.reserved[0]; k++)
        ck_assert_uint_eq(c.reserved[k], 0);
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
}
END_TEST

START_TEST(test_init_padding_deterministic)
{
    bfc_config_t a, b;
    memset(&a, 0x00, sizeof a);
    memset(&b, 0xff, sizeof b);
    bfc_config_init(&a);
    bfc_config_init(&b);
    ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0);
}
END_TEST

/* ------------------------------------------------------- good values */

/*
 * Parses spec into defaults, expects BFC_OK, and that the result equals the
 * defaults with exactly `field` set to `val` (so no other field moved).
 */
#define GOOD(spec, field, val)                                                   \
    do {                                                                         \
        bfc_config_t got_, want_;                                                \
        bfc_config_init(&got_);                                                  \
        bfc_config_init(&want_);                                                 \
        want_.field = (val);                                                     \
        ck_assert_msg(bfc_config_parse(&got_, (spec)) == BFC_OK, "rejected: %s", \
                      (spec));                                                   \
        ck_assert_msg(memcmp(&got_, &want_, sizeof got_) == 0, "wrong result: %s", \
                      (spec));                                                   \
        ck_assert_msg(bfc_config_validate(&got_) == BFC_OK, "invalid: %s", (spec)); \
    } while (0)

START_TEST(test_good_backend)
{
    GOOD("backend=auto", backend, BFC_BACKEND_AUTO);
    GOOD("backend=cuda", backend, BFC_BACKEND_CUDA);
    GOOD("backend=sim", backend, BFC_BACKEND_SIM);
    GOOD("backend=SIM", backend, BFC_BACKEND_SIM);
    GOOD("backend=Cuda", backend, BFC_BACKEND_CUDA);
}
END_TEST

START_TEST(test_good_device)
{
    GOOD("device=0", device, 0);
    GOOD("device=1", device, 1);
    GOOD("device=7", device, 7);
    GOOD("device=007", device, 7);
    GOOD("device=2147483647", device, INT_MAX);
}
END_TEST

START_TEST(test_good_sizes)
{
    GOOD("memory_limit=0", memory_limit, 0);
    GOOD("memory_limit=256", memory_limit, 256);
    GOOD("memory_limit=1000000", memory_limit, 1000000);
    GOOD("memory_limit=1K", memory_limit, 1024);
    GOOD("memory_limit=1k", memory_limit, 1024);
    GOOD("memory_limit=5KB", memory_limit, 5 * 1024);
    GOOD("memory_limit=5kib", memory_limit, 5 * 1024);
    GOOD("memory_limit=5KiB", memory_limit, 5 * 1024);
    GOOD("memory_limit=3M", memory_limit, (size_t)3 << 20);
    GOOD("memory_limit=3mb", memory_limit, (size_t)3 << 20);
    GOOD("memory_limit=3MiB", memory_limit, (size_t)3 << 20);
    GOOD("memory_limit=4G", memory_limit, (size_t)4 << 30);
    GOOD("memory_limit=4g", memory_limit, (size_t)4 << 30);
    GOOD("memory_limit=4GB", memory_limit, (size_t)4 << 30);
    GOOD("memory_limit=4GiB", memory_limit, (size_t)4 << 30);
    GOOD("memory_limit=4gib", memory_limit, (size_t)4 << 30);
    GOOD("memory_limit=1024G", memory_limit, (size_t)1 << 40);
    if (SIZE_MAX == UINT64_MAX) {
        GOOD("memory_limit=18446744073709551615", memory_limit, SIZE_MAX);
        GOOD("memory_limit=17179869183G", memory_limit, (size_t)17179869183u << 30);
    }
    GOOD("initial_region=1", initial_region, 1);
    GOOD("initial_region=2M", initial_region, (size_t)2 << 20);
    GOOD("initial_region=64K", initial_region, (size_t)64 << 10);
    GOOD("large_alloc=0", large_alloc, 0);
    GOOD("large_alloc=64M", large_alloc, (size_t)64 << 20);
    GOOD("large_alloc=1G", large_alloc, (size_t)1 << 30);
}
END_TEST

START_TEST(test_good_booleans)
{
    static const char *const names[] = {"allow_growth", "garbage_collection", "debug_check",
                                        "poison"};
    static const struct {
        const char *word;
        bool val;
    } words[] = {
        {"true", true},  {"false", false}, {"1", true},    {"0", false},
        {"yes", true},   {"no", false},    {"on", true},   {"off", false},
        {"TRUE", true},  {"False", false}, {"YES", true},  {"No", false},
        {"On", true},    {"OFF", false},
    };
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
            char spec[64];
            snprintf(spec, sizeof spec, "%s=%s", names[k], words[w].word);
            /* Start from the opposite value so the parse must write it. */
            bfc_config_t c, want;
            bfc_config_init(&c);
            bool *field = k == 0 ? &c.allow_growth
                          : k == 1 ? &c.garbage_collection
                          : k == 2 ? &c.debug_check
                                   : &c.poison;
            *field = !words[w].val;
            memcpy(&want, &c, sizeof c);
            bool *wfield = (bool *)((char *)&want + ((char *)field - (char *)&c));
            *wfield = words[w].val;
            ck_assert_msg(bfc_config_parse(&c, spec) == BFC_OK, "rejected: %s", spec);
            ck_assert_msg(*field == words[w].val, "wrong value: %s", spec);
            ck_assert_msg(memcmp(&c, &want, sizeof c) == 0, "other field moved: %s", spec);
        }
    }
}
END_TEST

START_TEST(test_good_fraction)
{
    GOOD("fragmentation_fraction=0", fragmentation_fraction, 0.0);
    GOOD("fragmentation_fraction=0.0", fragmentation_fraction, 0.0);
    GOOD("fragmentation_fraction=1", fragmentation_fraction, 1.0);
    GOOD("fragmentation_fraction=1.0", fragmentation_fraction, 1.0);
    GOOD("fragmentation_fraction=1.", fragmentation_fraction, 1.0);
    GOOD("fragmentation_fraction=0.5", fragmentation_fraction, 0.5);
    GOOD("fragmentation_fraction=.5", fragmentation_fraction, 0.5);
    GOOD("fragmentation_fraction=+0.5", fragmentation_fraction, 0.5);
    GOOD("fragmentation_fraction=00.25", fragmentation_fraction, 0.25);
    GOOD("fragmentation_fraction=0.1", fragmentation_fraction, 0.1);
    GOOD("fragmentation_fraction=0.3", fragmentation_fraction, 0.3);
    GOOD("fragmentation_fraction=1e-1", fragmentation_fraction, 0.1);
    GOOD("fragmentation_fraction=5E-1", fragmentation_fraction, 0.5);
    GOOD("fragmentation_fraction=100e-2", fragmentation_fraction, 1.0);
    GOOD("fragmentation_fraction=0.05e+1", fragmentation_fraction, 0.5);
    GOOD("fragmentation_fraction=0e999", fragmentation_fraction, 0.0);
    GOOD("fragmentation_fraction=0.000000000000000000000000000001", fragmentation_fraction,
         1e-30);
    GOOD("fragmentation_fraction=1e-300", fragmentation_fraction, 1e-300);
    GOOD("fragmentation_fraction=5e-324", fragmentation_fraction, 5e-324); /* the least double */
    GOOD("fragmentation_fraction=0e-400", fragmentation_fraction, 0.0);
}
END_TEST

START_TEST(test_fraction_matches_strtod)
{
    /* Up to 15 digits the mantissa is below 2^53, so the result must equal
     * strtod's (the test runs in the C locale); up to 19, within an ulp. */
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < 4000; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int digits = 1 + (int)(x % 19);
        char spec[64], *v;
        int off = snprintf(spec, sizeof spec, "fragmentation_fraction=0.");
        v = spec + off - 2;
        for (int d = 0; d < digits; d++)
            spec[off++] = (char)('0' + (x >> (3 * d + 5)) % 10);
        spec[off] = '\0';
        double want = strtod(v, NULL);
        bfc_config_t c;
        bfc_config_init(&c);
        ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
        if (digits <= 15)
            ck_assert_msg(c.fragmentation_fraction == want, "%s", spec);
        else
            ck_assert_msg(c.fragmentation_fraction == want ||
                              c.fragmentation_fraction == nextafter(want, 0.0) ||
                              c.fragmentation_fraction == nextafter(want, 1.0),
                          "%s", spec);
    }
}
END_TEST

START_TEST(test_good_retry_numa_sim)
{
    GOOD("retry_ms=0", retry_ms, 0);
    GOOD("retry_ms=1000", retry_ms, 1000);
    GOOD("retry_ms=3600000", retry_ms, 3600000);
    GOOD("host_numa=thread", host_numa, BFC_HOST_NUMA_THREAD);
    GOOD("host_numa=gpu", host_numa, BFC_HOST_NUMA_GPU);
    GOOD("host_numa=GPU", host_numa, BFC_HOST_NUMA_GPU);
    GOOD("host_numa=0", host_numa, 0);
    GOOD("host_numa=3", host_numa, 3);
    GOOD("host_numa=2147483647", host_numa, INT_MAX);
}
END_TEST

/* The room for later versions' settings must be zero; the version is one
 * string everywhere. */
START_TEST(test_reserved_and_version)
{
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
    c.reserved[5] = 1;
    ck_assert_int_eq(bfc_config_validate(&c), BFC_EINVAL);
    bfc_ctx_t *ctx = (bfc_ctx_t *)&c;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_EINVAL);
    ck_assert_ptr_null(ctx);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", BFC_VERSION_MAJOR, BFC_VERSION_MINOR, BFC_VERSION_PATCH);
    ck_assert_str_eq(bfc_version(), want);
    ck_assert_str_eq(bfc_version(), PACKAGE_VERSION);
}
END_TEST

START_TEST(test_all_keys_together)
{
    bfc_config_t c, want;
    bfc_config_init(&c);
    nondefault(&want);
    ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,device=3,memory_limit=1G,"
                                          "allow_growth=false,initial_region=4K,"
                                          "fragmentation_fraction=0.75,garbage_collection=on,"
                                          "large_alloc=0,retry_ms=17,debug_check=yes,"
                                          "poison=1,host_numa=1"),
                     BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
}
END_TEST

/* -------------------------------------------------------- bad values */

static const char *const all_keys[] = {
    "backend",     "device",           "memory_limit",
    "allow_growth", "initial_region",  "fragmentation_fraction",
    "garbage_collection", "large_alloc", "retry_ms",
    "debug_check", "poison",           "host_numa",
};
#define N_KEYS (sizeof all_keys / sizeof all_keys[0])

/* Expects BFC_EINVAL and a byte-identical config. */
static void expect_bad(const char *spec)
{
    bfc_config_t c, before;
    nondefault(&c);
    memcpy(&before, &c, sizeof c);
    ck_assert_msg(bfc_config_parse(&c, spec) == BFC_EINVAL, "accepted: \"%s\"", spec);
    ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "changed by: \"%s\"", spec);
    /* The explaining variant agrees, leaves *cfg alone too, and always
     * says something printable. */
    char err[512];
    memset(err, 'x', sizeof err);
    ck_assert_msg(bfc_config_parse_err(&c, spec, err, sizeof err) == BFC_EINVAL, "accepted: \"%s\"", spec);
    ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "changed by: \"%s\"", spec);
    ck_assert_msg(memchr(err, '\0', sizeof err) != NULL, "unterminated message for \"%s\"", spec);
    ck_assert_msg(strlen(err) > 10, "no reason for \"%s\": \"%s\"", spec, err);
    for (const char *q = err; *q; q++)
        ck_assert_msg((unsigned char)*q >= 0x20 && (unsigned char)*q < 0x7f, "unprintable byte in \"%s\"", err);
}

static void expect_bad_kv(const char *key, const char *val)
{
    char spec[256];
    snprintf(spec, sizeof spec, "%s=%s", key, val);
    expect_bad(spec);
}

START_TEST(test_bad_every_key)
{
    /* Bad for every key, whatever its type. */
    static const char *const bad[] = {
        "",                         /* empty value */
        "   ",                      /* empty after trimming */
        "-1",                       /* negative: must not wrap like strtoul */
        "-0x1",
        "99999999999999999999",     /* overflow */
        "99999999999999999999G",    /* overflow with suffix */
        "12Q",                      /* suffix garbage */
        "abc",                      /* non-numeric */
        "=1",                       /* embedded '=' */
        "1=1",
        "\x80",                     /* non-ASCII */
        "1\x01",                    /* control character */
        "\xff\xfe",
        "1 2",
        "nan",
        "tr ue",
    };
    for (size_t k = 0; k < N_KEYS; k++) {
        for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++)
            expect_bad_kv(all_keys[k], bad[b]);
        expect_bad(all_keys[k]); /* missing '=' */
        char spec[128];
        snprintf(spec, sizeof spec, " %s ", all_keys[k]);
        expect_bad(spec);
    }
}
END_TEST

START_TEST(test_bad_backend)
{
    static const char *const bad[] = {"gpu", "cuda1", "au to", "0", "1", "simulator", "s"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad_kv("backend", bad[i]);
}
END_TEST

START_TEST(test_bad_device)
{
    static const char *const bad[] = {"2147483648", "4294967296", "1K", "1.5", "+1",
                                      "0x1", "-0",  "1e2", "true"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad_kv("device", bad[i]);
}
END_TEST

START_TEST(test_bad_sizes)
{
    static const char *const sizes[] = {"memory_limit", "initial_region", "large_alloc"};
    static const char *const bad[] = {
        "1T",    "1KK",  "1 K",   "K",     "G",        "1.5G", "0x10", "+5",    "1KiBB",
        "1Ki",   "1iB",  "1B",    "1e3",   "4G4",      "true", "1,5",
        "18446744073709551616", "17179869184G", "18014398509481984K",
        "17592186044416M",
    };
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
            expect_bad_kv(sizes[s], bad[i]);
    /* Per-field ranges. */
    expect_bad("memory_limit=1");
    expect_bad("memory_limit=255");
    expect_bad("initial_region=0");
    expect_bad("initial_region=0K");
}
END_TEST

START_TEST(test_bad_booleans)
{
    static const char *const names[] = {"allow_growth", "garbage_collection", "debug_check",
                                        "poison"};
    static const char *const bad[] = {"2", "tru", "yess", "01", "t", "f", "y", "n",
                                      "oN1", "truefalse", "-0"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
            expect_bad_kv(names[k], bad[i]);
}
END_TEST

START_TEST(test_bad_fraction)
{
    static const char *const bad[] = {
        "nan",  "NaN",   "NAN(1)", "inf", "-inf", "INF", "infinity", "1.5",   "1.0000001",
        "2",    "-0.1",  "-0",     "1e1", "10e-1x", "0.5e", "0.5e+", ".",   "e5",
        "0x0.8p0", "0..5", "--1", "0.5 0.5", "1e100", "0.5f", "++0.5", "+",  "0,5",
        "99999999999999999999e-19",
        /* non-zero, but below the smallest double: they would read as 0,
         * the 128 MiB rule, which nobody who wrote them meant */
        "1e-400", "0.0000001e-320", "1e-99999999",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad_kv("fragmentation_fraction", bad[i]);
}
END_TEST

START_TEST(test_bad_retry_numa_sim)
{
    expect_bad("retry_ms=3600001");
    expect_bad("retry_ms=4294967296");
    expect_bad("retry_ms=1K");
    expect_bad("retry_ms=1.5");
    expect_bad("retry_ms=+1");
    static const char *const numa_bad[] = {"-1", "-2", "-3", "threads", "Thread1",
                                           "2147483648", "1K", "node0", "gpu0"};
    for (size_t i = 0; i < sizeof numa_bad / sizeof numa_bad[0]; i++)
        expect_bad_kv("host_numa", numa_bad[i]);
    /* Fault injection is a test facility of shardbfc_sim.h, not a setting:
     * its old keys are unknown. */
    static const char *const sim[] = {"sim_fail_alloc_every", "sim_fail_event_every"};
    for (size_t s = 0; s < 2; s++) {
        expect_bad_kv(sim[s], "0");
        expect_bad_kv(sim[s], "3");
    }
}
END_TEST

START_TEST(test_unknown_key)
{
    static const char *const bad[] = {
        "foo=1",          "Memory_limit=1G", "memory-limit=1G", "memorylimit=1G",
        "memory_limit_=1G", "=1",            " = ",             "backend sim=1",
        "back end=sim",   "\x80=1",          "\x01memory_limit=1G",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad(bad[i]);
}
END_TEST

START_TEST(test_mixed_good_bad_unchanged)
{
    static const char *const bad[] = {
        "memory_limit=4G,backend=cuda,retry_ms=oops",
        "retry_ms=oops,memory_limit=4G",
        "memory_limit=4G,allow_growth=true,nosuchkey=1",
        "device=0,,,poison=0,debug_check",
        "memory_limit=4G,fragmentation_fraction=nan",
        "backend=auto,memory_limit=-1",
        "host_numa=gpu,large_alloc=12Q,",
        "device=1,device=2,device=-3",
        "a==b",
        "backend=sim,backend==sim",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_bad(bad[i]);

    /* Padding bytes survive a failed parse too. */
    bfc_config_t c, before;
    memset(&c, 0xa5, sizeof c);
    c.backend = BFC_BACKEND_SIM;
    c.device = 0;
    c.initial_region = 1;
    c.fragmentation_fraction = 0.5;
    memcpy(&before, &c, sizeof c);
    ck_assert_int_eq(bfc_config_parse(&c, "device=4,memory_limit=1G,poison=maybe"), BFC_EINVAL);
    ck_assert_int_eq(memcmp(&c, &before, sizeof c), 0);
}
END_TEST

/* --------------------------------------------------------- structure */

START_TEST(test_null_and_empty)
{
    ck_assert_int_eq(bfc_config_parse(NULL, "device=1"), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse(NULL, NULL), BFC_EINVAL);

    static const char *const empty[] = {"", ",", ",,,", " ", " , \t, ", "\n"};
    bfc_config_t c, before;
    nondefault(&c);
    memcpy(&before, &c, sizeof c);
    ck_assert_int_eq(bfc_config_parse(&c, NULL), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &before, sizeof c), 0);
    for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
        ck_assert_int_eq(bfc_config_parse(&c, empty[i]), BFC_OK);
        ck_assert_int_eq(memcmp(&c, &before, sizeof c), 0);
    }
}
END_TEST

START_TEST(test_whitespace_and_empty_items)
{
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(
        bfc_config_parse(&c, "  memory_limit = 4G ,\tbackend=\tsim  ,, poison= on,\n"), BFC_OK);
    ck_assert_uint_eq(c.memory_limit, (size_t)4 << 30);
    ck_assert_int_eq(c.backend, BFC_BACKEND_SIM);
    ck_assert(c.poison);

    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, ",device=1,,retry_ms=2,"), BFC_OK);
    ck_assert_int_eq(c.device, 1);
    ck_assert_uint_eq(c.retry_ms, 2);
}
END_TEST

START_TEST(test_fields_not_named_keep_value)
{
    bfc_config_t c, want;
    nondefault(&c);
    memcpy(&want, &c, sizeof c);
    want.retry_ms = 5;
    ck_assert_int_eq(bfc_config_parse(&c, "retry_ms=5"), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
}
END_TEST

START_TEST(test_duplicate_last_wins)
{
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, "device=1,device=2,backend=cuda,backend=sim"),
                     BFC_OK);
    ck_assert_int_eq(c.device, 2);
    ck_assert_int_eq(c.backend, BFC_BACKEND_SIM);
    ck_assert_int_eq(bfc_config_parse(&c, "poison=1,poison=0"), BFC_OK);
    ck_assert(!c.poison);
}
END_TEST

START_TEST(test_item_length_limit)
{
    /* "memory_limit=" then leading zeros then "256": exactly 4096 bytes is
     * accepted, 4097 is not. */
    static char spec[5000];
    const char *key = "memory_limit=";
    size_t klen = strlen(key);
    for (size_t total = 4095; total <= 4097; total++) {
        memcpy(spec, key, klen);
        memset(spec + klen, '0', total - klen - 3);
        memcpy(spec + total - 3, "256", 4);
        ck_assert_uint_eq(strlen(spec), total);
        if (total <= 4096) {
            bfc_config_t c;
            bfc_config_init(&c);
            ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
            ck_assert_uint_eq(c.memory_limit, 256);
        } else {
            expect_bad(spec);
        }
    }
}
END_TEST

START_TEST(test_long_spec)
{
    /* Many short items: the total length is not limited, only each item. */
    size_t n = 20000;
    char *spec = malloc(n * 16 + 32); /* "retry_ms=999," is 13 bytes */
    ck_assert_ptr_nonnull(spec);
    char *w = spec;
    for (size_t i = 0; i < n; i++)
        w += sprintf(w, "retry_ms=%zu,", i % 1000);
    strcpy(w, "retry_ms=777");
    bfc_config_t c;
    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_OK);
    ck_assert_uint_eq(c.retry_ms, 777);
    /* A bad item at the very end still rolls everything back. */
    strcpy(w, "retry_ms=x");
    bfc_config_init(&c);
    bfc_config_t before;
    memcpy(&before, &c, sizeof c);
    ck_assert_int_eq(bfc_config_parse(&c, spec), BFC_EINVAL);
    ck_assert_int_eq(memcmp(&c, &before, sizeof c), 0);
    free(spec);
}
END_TEST

/* ---------------------------------------------------------- validate */

START_TEST(test_validate)
{
    bfc_config_t c;
    ck_assert_int_eq(bfc_config_validate(NULL), BFC_EINVAL);

    bfc_config_init(&c);
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
    nondefault(&c);
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);

    /* bfc_config_validate_err agrees, and gives a reason exactly when it
     * refuses. */
    char why[256];
#define VALID(stmt, expect)                                                   \
    do {                                                                      \
        bfc_config_init(&c);                                                  \
        stmt;                                                                 \
        ck_assert_msg(bfc_config_validate(&c) == (expect), "%s", #stmt);      \
        memset(why, 'x', sizeof why);                                         \
        ck_assert_msg(bfc_config_validate_err(&c, why, sizeof why) == (expect), "%s", #stmt); \
        ck_assert_msg((why[0] == '\0') == ((expect) == BFC_OK), "%s: '%s'", #stmt, why); \
    } while (0)

    VALID(c.backend = (bfc_backend_t)3, BFC_EINVAL);
    VALID(c.backend = (bfc_backend_t)-1, BFC_EINVAL);
    VALID(c.backend = BFC_BACKEND_CUDA, BFC_OK);
    VALID(c.backend = BFC_BACKEND_SIM, BFC_OK);
    VALID(c.device = -1, BFC_EINVAL);
    VALID(c.device = INT_MIN, BFC_EINVAL);
    VALID(c.device = 5, BFC_OK);
    VALID(c.initial_region = 0, BFC_EINVAL);
    VALID(c.initial_region = 1, BFC_OK);
    VALID(c.fragmentation_fraction = -0.1, BFC_EINVAL);
    VALID(c.fragmentation_fraction = 1.1, BFC_EINVAL);
    VALID(c.fragmentation_fraction = NAN, BFC_EINVAL);
    VALID(c.fragmentation_fraction = INFINITY, BFC_EINVAL);
    VALID(c.fragmentation_fraction = -INFINITY, BFC_EINVAL);
    VALID(c.fragmentation_fraction = 0.0, BFC_OK);
    VALID(c.fragmentation_fraction = 1.0, BFC_OK);
    VALID(c.memory_limit = 1, BFC_EINVAL);
    VALID(c.memory_limit = 255, BFC_EINVAL);
    VALID(c.memory_limit = 256, BFC_OK);
    VALID(c.memory_limit = 0, BFC_OK);
    VALID(c.memory_limit = SIZE_MAX, BFC_OK);
    VALID(c.host_numa = -3, BFC_EINVAL);
    VALID(c.host_numa = INT_MIN, BFC_EINVAL);
    VALID(c.host_numa = BFC_HOST_NUMA_GPU, BFC_OK);
    VALID(c.host_numa = BFC_HOST_NUMA_THREAD, BFC_OK);
    VALID(c.host_numa = 7, BFC_OK);
    VALID((c.vmm = BFC_VMM_ON, c.allow_growth = false), BFC_EINVAL);
    VALID((c.vmm = BFC_VMM_ON, c.allow_growth = true), BFC_OK);
    VALID((c.vmm = BFC_VMM_AUTO, c.allow_growth = false), BFC_OK);
    VALID((c.vmm = BFC_VMM_OFF, c.allow_growth = false), BFC_OK);
    /* What the parser refuses, validate refuses too. */
    VALID(c.slack_decay_ms = 4294967295u, BFC_OK);
    VALID(c.slack_decay_ms = 4294967296u, BFC_EINVAL);
    VALID(c.slack_decay_ms = BFC_DECAY_NEVER - 1, BFC_EINVAL);
    VALID(c.slack_decay_ms = BFC_DECAY_NEVER, BFC_OK);
    VALID(strcpy(c.trace, "/tmp/a\nb"), BFC_EINVAL);
    VALID(strcpy(c.oom_dump, "/tmp/a\x7f"), BFC_EINVAL);
    VALID(strcpy(c.trace, "/tmp/caf\xc3\xa9,x.csv"), BFC_OK);
    VALID(c.reserved[0] = 1, BFC_EINVAL);
#undef VALID

    /* The reason names the field and its rule. */
#define WHY(stmt, words)                                                      \
    do {                                                                      \
        bfc_config_init(&c);                                                  \
        stmt;                                                                 \
        ck_assert_int_eq(bfc_config_validate_err(&c, why, sizeof why), BFC_EINVAL); \
        ck_assert_msg(strstr(why, words) != NULL, "%s: '%s'", #stmt, why);  \
    } while (0)
    WHY((c.vmm = BFC_VMM_ON, c.allow_growth = false), "vmm=on needs allow_growth=true");
    WHY(c.initial_region = 0, "initial_region");
    WHY(c.fragmentation_fraction = NAN, "fragmentation_fraction");
    WHY(c.memory_limit = 255, "memory_limit");
    WHY(c.retry_ms = 3600001, "retry_ms");
    WHY(c.device = -1, "device");
    WHY(strcpy(c.oom_dump, "/tmp/a\x7f"), "oom_dump");
    WHY(strcpy(c.trace, "/tmp/a\nb"), "trace");
    WHY(c.reserved_flags = 1, "reserved");
#undef WHY
    ck_assert_int_eq(bfc_config_validate_err(NULL, why, sizeof why), BFC_EINVAL);
    ck_assert_str_ne(why, "");
    /* No room asked for: no write; a short buffer: cut, terminated. */
    bfc_config_init(&c);
    c.initial_region = 0;
    ck_assert_int_eq(bfc_config_validate_err(&c, NULL, 0), BFC_EINVAL);
    why[0] = 'q';
    ck_assert_int_eq(bfc_config_validate_err(&c, why, 0), BFC_EINVAL);
    ck_assert_int_eq(why[0], 'q');
    ck_assert_int_eq(bfc_config_validate_err(&c, why, 8), BFC_EINVAL);
    ck_assert_str_eq(why, "initial");
}
END_TEST

/* Sizes at the top of size_t: a config that validates either creates a
 * context or is refused for want of memory, never as invalid. */
START_TEST(test_extreme_sizes_create)
{
    bfc_config_t c;
    bfc_ctx_t *ctx = NULL;
    const char *vmm[] = {"vmm=off", "vmm=auto"};
    for (int i = 0; i < 2; i++) {
        /* initial_region within 255 bytes of SIZE_MAX: rounding it up to
         * 256 bytes used to wrap to 0, and create said BFC_EINVAL. */
        for (size_t ir = SIZE_MAX - 300; ir != 0; ir = ir == SIZE_MAX ? 0 : ir + 100) {
            bfc_config_init(&c);
            ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,memory_limit=64M"), BFC_OK);
            ck_assert_int_eq(bfc_config_parse(&c, vmm[i]), BFC_OK);
            c.initial_region = ir;
            ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
            ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_OK);
            void *p = bfc_ctx_alloc(ctx, NULL, 1 << 20);
            ck_assert_ptr_nonnull(p);
            ck_assert_int_eq(bfc_ctx_free(ctx, p, NULL), BFC_OK);
            ck_assert_int_eq(bfc_ctx_check(ctx), BFC_OK);
            bfc_ctx_destroy(ctx);
            if (ir == SIZE_MAX)
                break;
        }
    }
    /* The whole of a limit no memory has, reserved up front: out of memory
     * (a region that page rounding overflows used to read as invalid). */
    const char *huge[] = {"memory_limit=18446744073709551615", "memory_limit=18446744073709551360",
                          "memory_limit=17179869183G"};
    for (int i = 0; i < 3; i++) {
        bfc_config_init(&c);
        ck_assert_int_eq(bfc_config_parse(&c, "backend=sim,allow_growth=false"), BFC_OK);
        ck_assert_int_eq(bfc_config_parse(&c, huge[i]), BFC_OK);
        ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
        ctx = NULL;
        ck_assert_msg(bfc_ctx_create(&c, &ctx) == BFC_ENOMEM, "%s", huge[i]);
        ck_assert_ptr_null(ctx);
    }
}
END_TEST

/* ------------------------------------------------------- error messages */

/* parse_err on spec fails and its message contains every one of parts. */
static void expect_msg(const char *spec, const char *const *parts)
{
    bfc_config_t c;
    bfc_config_init(&c);
    char err[512];
    ck_assert_int_eq(bfc_config_parse_err(&c, spec, err, sizeof err), BFC_EINVAL);
    for (; *parts; parts++)
        ck_assert_msg(strstr(err, *parts) != NULL, "\"%s\": message \"%s\" lacks \"%s\"", spec, err, *parts);
}

#define MSG(spec, ...) expect_msg(spec, (const char *const[]){__VA_ARGS__, NULL})

START_TEST(test_err_names_key_value_reason)
{
    /* A typo in a key: key and value quoted, the reason, the keys known. */
    MSG("memory_limt=1G", "memory_limt=1G", "unknown key 'memory_limt'", "memory_limit", "retry_ms");
    /* The first bad item is the one reported, wherever it is. */
    MSG("backend=sim, memory_limit=1X ,retry_ms=5", "memory_limit=1X", "invalid value for memory_limit",
        "expected a size", "K, M or G");
    MSG("memory_limit=100", "memory_limit=100", "256 bytes");
    MSG("retry_ms=3600001", "retry_ms=3600001", "3600000", "one hour");
    MSG("initial_region=0", "initial_region=0", "at least 1 byte");
    MSG("backend=gpu", "backend=gpu", "auto, cuda or sim");
    MSG("device=-1", "device=-1", "device ordinal");
    MSG("host_numa=near", "host_numa=near", "thread, gpu or a NUMA node");
    MSG("fragmentation_fraction=1.5", "fragmentation_fraction=1.5", "from 0 to 1");
    MSG("fragmentation_fraction=1e-400", "fragmentation_fraction=1e-400", "does not read as 0");
    MSG("poison=maybe", "poison=maybe", "true/false");
    MSG("sim_fail_alloc_every=3", "sim_fail_alloc_every=3", "unknown key");
    MSG("retry_ms=4294967296", "retry_ms=4294967296", "3600000");
    MSG("oom_dump=/tmp/a\tb", "oom_dump=/tmp/a?b", "control character");
    MSG("trace=/tmp/a,b", "b: expected key=value", "separates items");
    MSG("=5", "=5", "empty key");
    MSG("retry_ms=", "retry_ms=", "empty value");
    MSG("allow_growth", "allow_growth", "expected key=value");
}
END_TEST

START_TEST(test_err_bounded_and_quoted)
{
    char err[512];
    bfc_config_t c;
    bfc_config_init(&c);

    /* Long keys and values are cut at 64 bytes with "...", so the message
     * fits and still starts with what the user wrote. */
    static char spec[1000];
    memset(spec, 'k', 300);
    spec[300] = '=';
    memset(spec + 301, 'v', 300);
    spec[601] = '\0';
    ck_assert_int_eq(bfc_config_parse_err(&c, spec, err, sizeof err), BFC_EINVAL);
    ck_assert_uint_lt(strlen(err), sizeof err - 1);
    ck_assert_msg(strspn(err, "k") == 64 && strncmp(err + 64, "...=", 4) == 0, "%s", err);
    ck_assert_msg(strspn(err + 68, "v") == 64 && strncmp(err + 132, "...: ", 5) == 0, "%s", err);
    ck_assert_ptr_nonnull(strstr(err, "unknown key"));

    /* An over-long item says so (and which item). */
    static char big[6000];
    memcpy(big, "retry_ms=1,", 11);
    memset(big + 11, ' ', 4200);
    memcpy(big + 4211, "retry_ms=2", 11);
    ck_assert_int_eq(bfc_config_parse_err(&c, big, err, sizeof err), BFC_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "item 2 is longer than 4096 bytes"));

    /* Non-ASCII bytes come back as '?'. */
    ck_assert_int_eq(bfc_config_parse_err(&c, "m\xc3\xa9moire=1", err, sizeof err), BFC_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "m??moire=1"));

    /* Truncated to errlen, always terminated; errlen 0 / NULL: no write. */
    char small[16];
    memset(small, 'x', sizeof small);
    ck_assert_int_eq(bfc_config_parse_err(&c, "memory_limt=1G", small, sizeof small), BFC_EINVAL);
    ck_assert_uint_eq(strlen(small), sizeof small - 1);
    ck_assert_int_eq(strncmp(small, "memory_limt=1G:", 15), 0);
    char one = 'x';
    ck_assert_int_eq(bfc_config_parse_err(&c, "bogus=1", &one, 0), BFC_EINVAL);
    ck_assert_int_eq(one, 'x');
    ck_assert_int_eq(bfc_config_parse_err(&c, "bogus=1", NULL, 100), BFC_EINVAL);
    ck_assert_int_eq(bfc_config_parse_err(NULL, "retry_ms=1", err, sizeof err), BFC_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "NULL"));

    /* Success: the message is empty and the result is bfc_config_parse's. */
    bfc_config_t a, b;
    nondefault(&a);
    nondefault(&b);
    strcpy(err, "stale");
    ck_assert_int_eq(bfc_config_parse_err(&a, "memory_limit=4G,retry_ms=9", err, sizeof err), BFC_OK);
    ck_assert_str_eq(err, "");
    ck_assert_int_eq(bfc_config_parse(&b, "memory_limit=4G,retry_ms=9"), BFC_OK);
    ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0);
    strcpy(err, "stale");
    ck_assert_int_eq(bfc_config_parse_err(&a, NULL, err, sizeof err), BFC_OK);
    ck_assert_str_eq(err, "");
}
END_TEST

START_TEST(test_validate_retry_limit)
{
    /* The struct filled in by hand is held to the parser's limits. */
    bfc_config_t c;
    bfc_config_init(&c);
    c.retry_ms = 3600000;
    ck_assert_int_eq(bfc_config_validate(&c), BFC_OK);
    c.retry_ms = 3600001;
    ck_assert_int_eq(bfc_config_validate(&c), BFC_EINVAL);
    bfc_ctx_t *ctx = (bfc_ctx_t *)&c;
    ck_assert_int_eq(bfc_ctx_create(&c, &ctx), BFC_EINVAL);
    ck_assert_ptr_null(ctx);
}
END_TEST

/* ------------------------------------------------------ SHARDBFC_CONF */

START_TEST(test_env_good_and_cached)
{
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "backend=sim,memory_limit=1G,poison=true", 1), 0);
    bfc_config_t c, want;
    bfc_config_init(&want);
    want.backend = BFC_BACKEND_SIM;
    want.memory_limit = (size_t)1 << 30;
    want.poison = true;
    memset(&c, 0xee, sizeof c);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);

    /* Read once: a later change of the variable is not seen. */
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "backend=cuda,device=-1", 1), 0);
    memset(&c, 0x11, sizeof c);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
    ck_assert_int_eq(unsetenv("SHARDBFC_CONF"), 0);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
}
END_TEST

START_TEST(test_env_bad_gives_defaults)
{
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "memory_limit=1G,bogus=1", 1), 0);
    bfc_config_t c, want;
    bfc_config_init(&want);
    memset(&c, 0xee, sizeof c);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_EINVAL);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
    /* The status is cached with the config. */
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_EINVAL);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
}
END_TEST

START_TEST(test_env_unset_and_empty)
{
    ck_assert_int_eq(unsetenv("SHARDBFC_CONF"), 0);
    bfc_config_t c, want;
    bfc_config_init(&want);
    memset(&c, 0xee, sizeof c);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
    ck_assert_int_eq(bfc__config_from_env(NULL), BFC_EINVAL);
}
END_TEST

START_TEST(test_env_empty_string)
{
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "", 1), 0);
    bfc_config_t c, want;
    bfc_config_init(&want);
    ck_assert_int_eq(bfc__config_from_env(&c), BFC_OK);
    ck_assert_int_eq(memcmp(&c, &want, sizeof c), 0);
}
END_TEST

#define ENV_THREADS 8

struct env_reader {
    bfc_config_t cfg;
    int rc;
};

static void *env_reader_main(void *arg)
{
    struct env_reader *r = arg;
    r->rc = bfc__config_from_env(&r->cfg);
    return NULL;
}

START_TEST(test_env_concurrent_first_use)
{
    ck_assert_int_eq(setenv("SHARDBFC_CONF", "retry_ms=250,host_numa=gpu", 1), 0);
    pthread_t t[ENV_THREADS];
    static struct env_reader r[ENV_THREADS];
    for (int i = 0; i < ENV_THREADS; i++)
        ck_assert_int_eq(pthread_create(&t[i], NULL, env_reader_main, &r[i]), 0);
    for (int i = 0; i < ENV_THREADS; i++)
        ck_assert_int_eq(pthread_join(t[i], NULL), 0);
    for (int i = 0; i < ENV_THREADS; i++) {
        ck_assert_int_eq(r[i].rc, BFC_OK);
        ck_assert_uint_eq(r[i].cfg.retry_ms, 250);
        ck_assert_int_eq(r[i].cfg.host_numa, BFC_HOST_NUMA_GPU);
        ck_assert_int_eq(memcmp(&r[i].cfg, &r[0].cfg, sizeof r[0].cfg), 0);
    }
}
END_TEST

/* -------------------------------------------------------------- fuzz */

static uint64_t rng_state;

static uint64_t rng(void)
{
    /* xorshift64*: deterministic across libcs, unlike rand(). */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

/* The first N_KEYS tokens must be the keys, in all_keys order (the generator
 * indexes them as such). */
static const char *const tokens[] = {
    "backend", "device", "memory_limit", "allow_growth", "initial_region",
    "fragmentation_fraction", "garbage_collection", "large_alloc", "retry_ms",
    "debug_check", "poison", "host_numa",
    "=", "=", "=", ",", ",", ",", " ", "\t", "sim", "cuda", "auto", "thread", "gpu", "0", "1",
    "255", "256", "4G", "12Q", "-1", "0.5", ".5", "1e-1", "nan", "inf", "true", "off",
    "99999999999999999999", "K", "MiB", "3600000", "3600001", "\x80", "\x01", "x",
};

START_TEST(test_fuzz)
{
    rng_state = 0x9e3779b97f4a7c15ull;
    char buf[256];
    int ok_structured = 0, bad_structured = 0;
    for (int iter = 0; iter < 10000; iter++) {
        size_t len = 0;
        bool structured = iter & 1;
        if (structured) {
            size_t ntok = rng() % 12;
            for (size_t t = 0; t < ntok; t++) {
                /* Mostly well-formed "key=value," triples, sometimes not. */
                const char *tok;
                if (rng() % 4 != 0) {
                    size_t phase = t % 4;
                    tok = phase == 0   ? tokens[rng() % N_KEYS]
                          : phase == 1 ? "="
                          : phase == 2 ? tokens[N_KEYS + rng() % (sizeof tokens / sizeof tokens[0] - N_KEYS)]
                                       : ",";
                } else {
                    tok = tokens[rng() % (sizeof tokens / sizeof tokens[0])];
                }
                size_t tl = strlen(tok);
                if (len + tl >= sizeof buf)
                    break;
                memcpy(buf + len, tok, tl);
                len += tl;
            }
        } else {
            len = rng() % 100;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)(1 + rng() % 255); /* any byte but NUL */
        }
        buf[len] = '\0';

        bfc_config_t c, before;
        nondefault(&c);
        memcpy(&before, &c, sizeof c);
        int rc = bfc_config_parse(&c, buf);
        ck_assert_msg(rc == BFC_OK || rc == BFC_EINVAL, "rc %d for iteration %d", rc, iter);
        /* The explaining variant is the same parser: same status, same
         * result, and a message exactly when it fails. */
        bfc_config_t c2;
        char err[512];
        memcpy(&c2, &before, sizeof c2);
        ck_assert_int_eq(bfc_config_parse_err(&c2, buf, err, sizeof err), rc);
        ck_assert_int_eq(memcmp(&c2, &c, sizeof c), 0);
        ck_assert_int_eq(err[0] != '\0', rc != BFC_OK);
        if (rc == BFC_EINVAL)
            ck_assert_msg(memcmp(&c, &before, sizeof c) == 0, "changed on EINVAL, iter %d",
                          iter);
        else
            ck_assert_msg(bfc_config_validate(&c) == BFC_OK, "invalid after OK, iter %d", iter);
        if (structured && rc == BFC_OK)
            ok_structured++;
        else if (structured)
            bad_structured++;
    }
    /* The generator reaches both outcomes, or the loop proved little. */
    ck_assert_int_gt(ok_structured, 100);
    ck_assert_int_gt(bad_structured, 100);
}
END_TEST

static Suite *config_suite(bool with_env)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("parse");
    tcase_add_test(tc, test_init_defaults);
    tcase_add_test(tc, test_init_padding_deterministic);
    tcase_add_test(tc, test_good_backend);
    tcase_add_test(tc, test_good_device);
    tcase_add_test(tc, test_good_sizes);
    tcase_add_test(tc, test_good_booleans);
    tcase_add_test(tc, test_good_fraction);
    tcase_add_test(tc, test_fraction_matches_strtod);
    tcase_add_test(tc, test_good_retry_numa_sim);
    tcase_add_test(tc, test_all_keys_together);
    tcase_add_test(tc, test_reserved_and_version);
    tcase_add_test(tc, test_bad_every_key);
    tcase_add_test(tc, test_bad_backend);
    tcase_add_test(tc, test_bad_device);
    tcase_add_test(tc, test_bad_sizes);
    tcase_add_test(tc, test_bad_booleans);
    tcase_add_test(tc, test_bad_fraction);
    tcase_add_test(tc, test_bad_retry_numa_sim);
    tcase_add_test(tc, test_unknown_key);
    tcase_add_test(tc, test_mixed_good_bad_unchanged);
    tcase_add_test(tc, test_null_and_empty);
    tcase_add_test(tc, test_whitespace_and_empty_items);
    tcase_add_test(tc, test_fields_not_named_keep_value);
    tcase_add_test(tc, test_duplicate_last_wins);
    tcase_add_test(tc, test_item_length_limit);
    tcase_add_test(tc, test_long_spec);
    tcase_add_test(tc, test_validate);
    tcase_add_test(tc, test_err_names_key_value_reason);
    tcase_add_test(tc, test_err_bounded_and_quoted);
    tcase_add_test(tc, test_validate_retry_limit);
    tcase_add_test(tc, test_extreme_sizes_create);
    tcase_add_test(tc, test_fuzz);
    suite_add_tcase(s, tc);

    if (with_env) {
        TCase *te = tcase_create("env");
        tcase_add_test(te, test_env_good_and_cached);
        tcase_add_test(te, test_env_bad_gives_defaults);
        tcase_add_test(te, test_env_unset_and_empty);
        tcase_add_test(te, test_env_empty_string);
        tcase_add_test(te, test_env_concurrent_first_use);
        suite_add_tcase(s, te);
    }
    return s;
}

int main(void)
{
    /* The env tests need a fresh process each; Check's default is to fork. */
    const char *fork_env = getenv("CK_FORK");
    bool forking = !(fork_env != NULL && strcmp(fork_env, "no") == 0);
    if (!forking)
        fprintf(stderr, "test_config: CK_FORK=no, SHARDBFC_CONF tests left out\n");
    SRunner *sr = srunner_create(config_suite(forking));
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
