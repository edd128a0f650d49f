#!/usr/bin/env python3
"""torch_check.py -- a real model on the GPU, with PyTorch's own allocator
and with libshardbfc's plug-in, must compute exactly the same thing.

    scripts/torch_check.py [--plugin FILE] [--out DIR] [--steps N] [--warn-only]
    scripts/torch_check.py --dry [--plugin FILE]

Two small causal language models built by transformers from a config with
random weights -- a 2-layer GPT-2 and a 2-layer Llama, so no weights are
downloaded -- train for --steps steps (forward, backward, SGD) on two CUDA
streams at once, one model per stream, from fixed seeds with deterministic
algorithms and TF32 off.  Each step also hands a tensor from the first
stream to the second (wait_stream + record_stream), the pattern that goes
wrong when an allocator reuses memory across streams too early.

The run happens twice, each time in a fresh Python process: PyTorch's
allocator must be chosen before the first CUDA allocation, and cannot be
changed afterwards.  One child keeps the default caching allocator, the
other installs libshardbfc_torch.so through
torch.cuda.memory.CUDAPluggableAllocator.  Each saves its losses, final
parameters and gradients; this process then requires them to be bitwise
identical, prints both allocators' peak reserved memory (and peak allocated
and requested, each named for what it counts), and writes a JSON summary
to DIR/torch_check.json.

--warn-only: should some operation of a future PyTorch or transformers lack
a deterministic CUDA implementation (the run then stops with PyTorch's
error naming it), torch.use_deterministic_algorithms(True, warn_only=True)
lets it run -- and the comparison tells whether its results still agree.

PyTorch does not forward Tensor.record_stream to a plug-in, so the plug-in
child also calls shardbfc_torch_record_stream through ctypes for the handed
tensor (the same library handle PyTorch loaded).

Exit status: 0 when identical, 1 when not (or a child failed), 2 on a bad
command line, 77 with --dry or without a CUDA device when the run cannot
happen here (the reason is printed).
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
SKIP = 77


def find_plugin(explicit):
    """The plug-in to load: --plugin, else the build tree's, else None."""
    if explicit:
        return os.path.abspath(explicit)
    for cand in (os.path.join(TOP, "build", ".libs", "libshardbfc_torch.so"),
                 os.path.join(TOP, ".libs", "libshardbfc_torch.so")):
        if os.path.exists(cand):
            return cand
    return None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plugin", help="libshardbfc_torch.so (default: build/.libs/)")
    ap.add_argument("--out", default=".", help="directory for torch_check.json")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--warn-only", action="store_true",
                    help="only warn about operations without a deterministic implementation")
    ap.add_argument("--dry", action="store_true",
                    help="check the arguments and the environment only")
    ap.add_argument("--child", choices=("default", "plugin"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.steps > 1000:
        ap.error("--steps must be in 1..1000")
    return a


# ---------------------------------------------------------------- child


def child(a):
    """One run: the chosen allocator first, then the models."""
    # Deterministic cuBLAS needs this before cuBLAS starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import ctypes

    import torch

    lib = None
    if a.child == "plugin":
        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            a.plugin, "shardbfc_torch_alloc", "shardbfc_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
        lib = ctypes.CDLL(a.plugin)  # the handle PyTorch opened: same state
        lib.shardbfc_torch_stat.restype = ctypes.c_uint64
        lib.shardbfc_torch_stat.argtypes = (ctypes.c_int, ctypes.c_char_p)
        lib.shardbfc_torch_record_stream.restype = ctypes.c_int
        lib.shardbfc_torch_record_stream.argtypes = (ctypes.c_void_p, ctypes.c_void_p)

    import transformers
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(1234)
    torch.cuda.manual_seed_all(1234)
    torch.use_deterministic_algorithms(True, warn_only=a.warn_only)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda", 0)

    vocab, seq, batch = 1024, 128, 4
    configs = {
        "gpt2": GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=256, n_layer=2,
                           n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=seq),
    }
    models, opts, ids = {}, {}, {}
    for name, cfg in configs.items():
        torch.manual_seed(1000 + len(models))
        try:
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        except TypeError:  # older transformers
            m = AutoModelForCausalLM.from_config(cfg)
        models[name] = m.to(dev).train()
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=0.05)
        g = torch.Generator().manual_seed(2000 + len(ids))
        ids[name] = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)

    streams = {"gpt2": torch.cuda.Stream(dev), "llama": torch.cuda.Stream(dev)}
    for s in streams.values():
        s.wait_stream(torch.cuda.current_stream(dev))  # weights and inputs are ready
    losses = {name: [] for name in models}
    handed = []
    for step in range(a.steps):
        for name, m in models.items():
            with torch.cuda.stream(streams[name]):
                opts[name].zero_grad(set_to_none=False)
                out = m(input_ids=ids[name], labels=ids[name])
                out.loss.backward()
                opts[name].step()
                losses[name].append(out.loss.detach())
        # A tensor made on the first stream, used on the second, freed while
        # the second may still read it.
        s1, s2 = streams["gpt2"], streams["llama"]
        with torch.cuda.stream(s1), torch.no_grad():
            h = models["gpt2"].transformer(input_ids=ids["gpt2"]).last_hidden_state * 1.0
        s2.wait_stream(s1)
        with torch.cuda.stream(s2), torch.no_grad():
            handed.append((h.double() ** 2).sum())
            h.record_stream(s2)
            if lib is not None:
                st = lib.shardbfc_torch_record_stream(h.data_ptr(), s2.cuda_stream)
                if st != 0:
                    raise RuntimeError("shardbfc_torch_record_stream: status %d" % st)
        del h
    torch.cuda.synchronize(dev)

    result = {"loss/" + n: torch.stack(v).cpu() for n, v in losses.items()}
    result["handed"] = torch.stack(handed).cpu()
    for name, m in models.items():
        for pn, p in m.named_parameters():
            result["param/%s/%s" % (name, pn)] = p.detach().cpu()
            result["grad/%s/%s" % (name, pn)] = p.grad.detach().cpu()
    torch.save(result, a.result)

    if lib is None:
        peaks = {"peak_reserved": torch.cuda.max_memory_reserved(dev),
                 "peak_allocated": torch.cuda.max_memory_allocated(dev)}
    else:
        # peak_bytes_in_use and peak_bytes_requested of a context are the
        # sums of its shards' (streams') peaks: upper bounds, not exact.
        peaks = {"peak_reserved": lib.shardbfc_torch_stat(0, b"peak_bytes_reserved"),
                 "peak_allocated_bound": lib.shardbfc_torch_stat(0, b"peak_bytes_in_use"),
                 "peak_requested_bound": lib.shardbfc_torch_stat(0, b"peak_bytes_requested"),
                 "alloc_failures": lib.shardbfc_torch_stat(0, b"alloc_failures"),
                 "free_errors": lib.shardbfc_torch_stat(0, b"free_errors")}
    peaks["torch"] = torch.__version__
    peaks["transformers"] = transformers.__version__
    peaks["gpu"] = torch.cuda.get_device_name(dev)
    print("CHILD-RESULT " + json.dumps(peaks), flush=True)
    return 0


# --------------------------------------------------------------- parent


def run_child(which, a, result):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which,
           "--result", result, "--steps", str(a.steps)]
    if a.plugin:
        cmd += ["--plugin", a.plugin]
    if a.warn_only:
        cmd.append("--warn-only")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, check=False)
    info = None
    for line in p.stdout.splitlines():
        if line.startswith("CHILD-RESULT "):
            info = json.loads(line[len("CHILD-RESULT "):])
        else:
            print("  [%s] %s" % (which, line))
    if p.returncode != 0 or info is None:
        print("torch_check: the %s run failed (exit %d)" % (which, p.returncode))
        return None
    return info


def compare(fa, fb):
    import torch

    a = torch.load(fa, map_location="cpu")
    b = torch.load(fb, map_location="cpu")
    diffs = []
    if sorted(a) != sorted(b):
        return ["the two runs saved different tensors"], 0.0
    worst = 0.0
    for k in sorted(a):
        if not torch.equal(a[k], b[k]):
            d = (a[k].double() - b[k].double()).abs().max().item()
            worst = max(worst, d)
            diffs.append("%s differs (max |diff| %.3g)" % (k, d))
    return diffs, worst


def main(argv):
    a = parse_args(argv)
    if a.child:
        return child(a)

    a.plugin = find_plugin(a.plugin)
    if a.plugin is None or not os.path.exists(a.plugin):
        print("torch_check: libshardbfc_torch.so not found (build it, or pass --plugin)")
        return 1 if not a.dry else SKIP
    try:
        import torch
    except ImportError as e:
        print("torch_check: SKIP: PyTorch is not importable here (%s)" % e)
        return SKIP
    if a.dry:
        print("torch_check: dry run: would compare PyTorch %s's allocator with %s"
              % (torch.__version__, a.plugin))
        return SKIP
    if not torch.cuda.is_available():
        print("torch_check: SKIP: PyTorch %s sees no CUDA device" % torch.__version__)
        return SKIP

    os.makedirs(a.out, exist_ok=True)
    files = {w: os.path.join(a.out, "torch_check_%s.pt" % w) for w in ("default", "plugin")}
    info = {}
    for which in ("default", "plugin"):
        print("torch_check: %s allocator, %d steps, two streams" % (which, a.steps))
        info[which] = run_child(which, a, files[which])
        if info[which] is None:
            return 1
    diffs, worst = compare(files["default"], files["plugin"])
    pd, pp = info["default"]["peak_reserved"], info["plugin"]["peak_reserved"]
    summary = {
        "identical": not diffs,
        "differences": diffs[:20],
        "max_abs_diff": worst,
        "steps": a.steps,
        "plugin": a.plugin,
        "default": info["default"],
        "shardbfc": info["plugin"],
        "target_peak_reserved_le_default": pp <= pd,
    }
    with open(os.path.join(a.out, "torch_check.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for w in files.values():
        os.unlink(w)

    mib = 1 << 20
    print("torch_check: PyTorch %s, transformers %s, %s" % (
        info["default"]["torch"], info["default"]["transformers"], info["default"]["gpu"]))
    print("  peak reserved:  PyTorch %8.1f MiB   libshardbfc %8.1f MiB   (target: "
          "libshardbfc <= PyTorch: %s)" % (pd / mib, pp / mib, "MET" if pp <= pd else "NOT MET"))
    # Not the same measure on both sides: PyTorch's "allocated" is its
    # blocks' bytes (requests rounded up to 512 B), exact; libshardbfc's are
    # chunk bytes (rounded to 256 B, plus what the split rule leaves in a
    # chunk) and requested bytes, each summed over the streams' own peaks.
    print("  peak allocated: PyTorch %8.1f MiB (its blocks, exact)   libshardbfc %8.1f MiB "
          "(chunks, bound: the streams' peaks summed)" % (
              info["default"]["peak_allocated"] / mib,
              info["plugin"]["peak_allocated_bound"] / mib))
    print("  peak requested: libshardbfc %8.1f MiB (bound: the streams' peaks summed)" % (
        info["plugin"]["peak_requested_bound"] / mib))
    print("  plug-in failures: %d allocations, %d frees" % (
        info["plugin"]["alloc_failures"], info["plugin"]["free_errors"]))
    if diffs:
        print("torch_check: FAIL: %d tensors differ:" % len(diffs))
        for d in diffs[:20]:
            print("    " + d)
        return 1
    if info["plugin"]["alloc_failures"] or info["plugin"]["free_errors"]:
        print("torch_check: FAIL: the plug-in reported failures")
        return 1
    print("torch_check: PASS: losses, parameters and gradients are bitwise identical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
