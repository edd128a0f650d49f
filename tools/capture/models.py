#!/usr/bin/env python3
"""Runs one PyTorch workload on the CPU under tools/capture/alloc_trace.so.

    LD_PRELOAD=alloc_trace.so ALLOC_TRACE=out.csv ALLOC_TRACE_START=0 \\
        python3 tools/capture/models.py NAME

NAME is one of the workloads below (``--list`` prints them).  Models are
built from their constructors with random weights (no download), seeds are
fixed, and intra-op parallelism is off (torch.set_num_threads(1)) so every
tensor is allocated by the thread that runs the model: one thread, one
stream of the trace.  Recording starts after ``import torch`` and after the
seeds are set, so the trace begins with the model's construction (its
weights are allocations of the trace) and ends after everything the
workload made has been dropped.  Without the interposer the workload still
runs (nothing is recorded), which is how to time it.
"""
import ctypes
import gc
import sys
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

_lib = ctypes.CDLL(None)


def _ctl(name, *args):
    try:
        fn = getattr(_lib, name)
    except AttributeError:
        return  # not under the interposer
    fn(*args)


def start():
    _ctl("alloc_trace_start")


def stop():
    gc.collect()
    _ctl("alloc_trace_stop")


def set_stream(n):
    _ctl("alloc_trace_set_stream", ctypes.c_int(n))


def seed(n=0):
    torch.manual_seed(n)


# ------------------------------------------------------------ inference


def cnn_resnet18():
    """ResNet-18 inference, batch 8 at 224x224, 4 iterations."""
    import torchvision

    start()
    set_stream(1)
    model = torchvision.models.resnet18(weights=None).eval()
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(8, 3, 224, 224)
            y = model(x)
            top = y.softmax(dim=1).topk(5, dim=1)
            del x, y, top
    del model
    stop()


def vit_b16():
    """ViT-B/16 inference, batch 2 at 224x224, 2 iterations."""
    import torchvision

    start()
    set_stream(1)
    model = torchvision.models.vit_b_16(weights=None).eval()
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(2, 3, 224, 224)
            y = model(x)
            del x, y
    del model
    stop()


def detect_frcnn():
    """Faster R-CNN (MobileNetV3-Large FPN, 320 px) inference, 2 images of
    different sizes per batch, 3 iterations."""
    import torchvision

    start()
    set_stream(1)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None).eval()
    with torch.inference_mode():
        for i in range(3):
            imgs = [torch.rand(3, 480, 640), torch.rand(3, 360 + 40 * i, 500)]
            out = model(imgs)
            del imgs, out
    del model
    stop()


# -------------------------------------------------------------- training


def train_resnet18():
    """Training steps of ResNet-18 (10 classes) on 64x64 inputs, batch 16:
    forward, cross-entropy, backward, AdamW step; 4 iterations."""
    import torchvision

    start()
    set_stream(1)
    model = torchvision.models.resnet18(weights=None, num_classes=10).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        x = torch.randn(16, 3, 64, 64)
        t = torch.randint(0, 10, (16,))
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        del x, t, loss
    del model, opt
    stop()


# ----------------------------------------------------------- decoder


class DecoderBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x, cache):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        if cache is not None:
            # The KV cache grows by concatenation, a new tensor every step
            # (as Hugging Face's past_key_values do).
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = (q @ k.transpose(-2, -1)) / (d // h) ** 0.5
        if t > 1:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
            att = att.masked_fill(~mask, float("-inf"))
        y = att.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, (k, v)


class Decoder(nn.Module):
    def __init__(self, vocab=2000, d=256, heads=4, layers=4, ctx=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, caches, offset):
        pos = torch.arange(offset, offset + idx.shape[1])
        x = self.tok(idx) + self.pos(pos)
        new = []
        for blk, c in zip(self.blocks, caches):
            x, c = blk(x, c)
            new.append(c)
        return self.head(self.ln(x[:, -1:, :])), new


def decoder_gen():
    """A 4-layer GPT-style decoder (d=256, 4 heads, vocab 2000) with random
    weights: batch 4, a 32-token prompt, then 96 tokens generated one at a
    time by sampling, with a KV cache that grows by concatenation."""
    start()
    set_stream(1)
    model = Decoder().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        idx = torch.randint(0, 2000, (4, 32), generator=gen)
        caches = [None] * len(model.blocks)
        logits, caches = model(idx, caches, 0)
        out = [idx]
        for step in range(96):
            probs = (logits[:, -1, :] / 0.8).softmax(dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            out.append(nxt)
            logits, caches = model(nxt, caches, 32 + step)
        seq = torch.cat(out, dim=1)
        del idx, caches, logits, out, seq, probs, nxt
    del model
    stop()


# ------------------------------------------------------------ server


def server2():
    """Two server threads, each with its own ResNet-18 (its weights and
    activations on the thread's stream), serving 128x128 requests.  Phase 1:
    thread 1 serves a burst of batch-16 requests while thread 2 serves
    batch 1; phase 2 the other way round; so the two streams peak at
    different times.  4 requests per thread per phase."""
    import torchvision

    start()
    ready = threading.Barrier(2)
    phase = threading.Barrier(2)

    def serve(stream):
        torch.set_num_threads(1)
        set_stream(stream)
        torch.manual_seed(stream)
        model = torchvision.models.resnet18(weights=None).eval()
        ready.wait()
        with torch.inference_mode():
            for p in (1, 2):
                batch = 16 if p == stream else 1
                for _ in range(4):
                    x = torch.randn(batch, 3, 128, 128)
                    y = model(x).softmax(dim=1)
                    del x, y
                phase.wait()
        del model

    threads = [threading.Thread(target=serve, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop()


WORKLOADS = {
    "cnn_resnet18": cnn_resnet18,
    "vit_b16": vit_b16,
    "detect_frcnn": detect_frcnn,
    "train_resnet18": train_resnet18,
    "decoder_gen": decoder_gen,
    "server2": server2,
}


def main(argv):
    if len(argv) != 2 or argv[1] not in WORKLOADS and argv[1] != "--list":
        print("usage: models.py NAME|--list; NAME in " + " ".join(WORKLOADS), file=sys.stderr)
        return 2
    if argv[1] == "--list":
        for name, fn in WORKLOADS.items():
            print(f"{name}: {' '.join(fn.__doc__.split())}")
        return 0
    torch.set_num_threads(1)
    seed(0)
    WORKLOADS[argv[1]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
