/*
 * replay.c -- runs the fuzz target (fuzz_ops.c) without libFuzzer: every
 * file of the corpus (tests/fuzz/corpus, or the directories and files named
 * on the command line), then a fixed set of pseudo-random inputs.  A `make
 * check` test: the target aborts on the first violated expectation, so a
 * clean exit means every input ran clean.  Keeps to a few seconds.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    static uint8_t buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    return 1;
}

static int run_path(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        perror(path);
        return -1;
    }
    if (!S_ISDIR(sb.st_mode))
        return run_file(path);
    DIR *d = opendir(path);
    if (!d) {
        perror(path);
        return -1;
    }
    int count = 0;
    struct dirent *e;
    char full[4096];
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (stat(full, &sb) != 0 || !S_ISREG(sb.st_mode))
            continue;
        if (run_file(full) < 0) {
            closedir(d);
            return -1;
        }
        count++;
    }
    closedir(d);
    return count;
}

static uint64_t rng(uint64_t *x)
{
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return *x * 0x2545F4914F6CDD1Dull;
}

int main(int argc, char **argv)
{
    int files = 0;
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            int n = run_path(argv[i]);
            if (n < 0)
                return EXIT_FAILURE;
            files += n;
        }
    } else {
        const char *top = getenv("top_srcdir");
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus", top ? top : ".");
        files = run_path(dir);
        if (files <= 0) {
            fprintf(stderr, "replay: no corpus in %s\n", dir);
            return EXIT_FAILURE;
        }
    }
    /* Random inputs of all lengths, fixed seed. */
    const char *env = getenv("FUZZ_REPLAY_RANDOM");
    int nrand = env ? atoi(env) : 40;
    uint64_t x = 0x5eed5eed12345678ull;
    static uint8_t buf[3 * 300];
    for (int i = 0; i < nrand; i++) {
        size_t n = (size_t)(rng(&x) % sizeof buf);
        for (size_t k = 0; k < n; k++)
            buf[k] = (uint8_t)rng(&x);
        LLVMFuzzerTestOneInput(buf, n);
    }
    printf("replay: %d corpus inputs and %d random inputs ran clean\n", files, nrand);
    return EXIT_SUCCESS;
}
