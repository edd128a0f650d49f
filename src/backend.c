/*
 * backend.c -- picks the device backend a configuration asks for.
 *
 * SIM is always available.  CUDA exists only when configure found the
 * toolkit (BFC_HAVE_CUDA); even then it is usable only with a driver and a
 * device whose ordinal is in range.  AUTO therefore asks the CUDA backend
 * how many devices it sees (0 without a driver) and falls back to SIM.
 * No state of its own: every call is independent and thread-safe.
 */
#include "backend.h"

static int open_cuda(const bfc_config_t *cfg, bfc__backend_t **out)
{
#if BFC_HAVE_CUDA
    return bfc__backend_cuda_open(cfg, out);
#else
    (void)cfg;
    (void)out;
    return BFC_ENODEV;
#endif
}

/* True when AUTO should choose CUDA: a device exists at cfg->device. */
static bool cuda_usable(const bfc_config_t *cfg)
{
#if BFC_HAVE_CUDA
    int n = bfc__cuda_device_count();

    return n > 0 && cfg->device >= 0 && cfg->device < n;
#else
    (void)cfg;
    return false;
#endif
}

int bfc__backend_open(const bfc_config_t *cfg, bfc__backend_t **out)
{
    if (!cfg || !out)
        return BFC_EINVAL;
    *out = NULL;
    switch (cfg->backend) {
    case BFC_BACKEND_SIM:
        return bfc__backend_sim_open(cfg, out);
    case BFC_BACKEND_CUDA:
        return open_cuda(cfg, out);
    case BFC_BACKEND_AUTO:
        if (cuda_usable(cfg))
            return open_cuda(cfg, out);
        return bfc__backend_sim_open(cfg, out);
    }
    return BFC_EINVAL;
}
