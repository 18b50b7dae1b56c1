#!/usr/bin/env python3
"""The PyTorch peer for the GPU benchmark: trains memtrain's GPT-2 on random tokens the way a
PyTorch user would for speed, and prints throughput and peak memory as one JSON line.

The model is the one of bench/torch_gpt2.py (tied embeddings, learned positions, tanh GELU,
LayerNorm eps 1e-5, Hugging Face Conv1D-style linear layers with (in, out) weights), with the
GPU idioms: fp32 parameters under torch.autocast(bf16) (or fp16 with a GradScaler, or plain
fp32 with PyTorch's default of no TF32 for matmuls, as memtrain's fp32), attention through F.scaled_dot_product_attention(is_causal=True), AdamW(fused=True) with
weight decay 0.1 on matrices and embeddings only, betas (0.9, 0.95), gradient clipping at 1.0
and zero_grad(set_to_none=True). Options: --mode compile wraps the model in torch.compile
(default options; the warm-up steps absorb the compile time), --checkpoint block recomputes each
transformer block in the backward (torch.utils.checkpoint, use_reentrant=False).

What it measures:
  - time: CUDA events around the timed steps (after --warmup-steps), synchronised at both ends;
    no host synchronisation inside the timed loop (losses stay on the device until the end);
  - memory: torch.cuda.max_memory_allocated() and max_memory_reserved() over the WHOLE run,
    warm-up and compilation included (never reset before the end: the same convention as
    memtrain's tracker, whose peak covers every step), plus the peak over the timed steps alone
    ("timed" fields, after a reset at the end of the warm-up).

    python3 bench/torch_gpt2_gpu.py --n-layer 12 --n-head 12 --n-embd 768 --vocab 50257 \
        --vocab-pad 128 --seq 1024 --micro-batch 16 --steps 50 --warmup-steps 10 \
        [--mode eager|compile] [--checkpoint none|block] [--precision bf16|fp16|fp32] [--json]
    python3 bench/torch_gpt2_gpu.py --gemm-peak          # bf16 8192^3 matmul TFLOP/s
    python3 bench/torch_gpt2_gpu.py --probe              # torch version, GPU, features (JSON)

--device cpu runs the same model in fp32 on the CPU (no autocast, AdamW foreach instead of
fused) so that the script can be smoke-tested without a GPU, e.g. with Debian's torch 1.13:
    /usr/bin/python3 bench/torch_gpt2_gpu.py --device cpu --n-layer 2 --n-head 4 --n-embd 64 \
        --vocab 512 --seq 64 --micro-batch 4 --steps 5 --warmup-steps 2
On a torch without F.scaled_dot_product_attention (before 2.0) attention is computed
explicitly (masked softmax); the JSON's "attention" field says which was used.
"""
import argparse
import contextlib
import json
import math
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")
HAVE_COMPILE = hasattr(torch, "compile")


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: weight is (in, out) and y = x @ W + b."""

    def __init__(self, n_in, n_out, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out, device=device).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(n_out, device=device))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


class Block(nn.Module):
    def __init__(self, n_embd, n_head, device):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5, device=device)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(n_embd, 3 * n_embd, device)
        self.attn.c_proj = Conv1D(n_embd, n_embd, device)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5, device=device)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(n_embd, 4 * n_embd, device)
        self.mlp.c_proj = Conv1D(4 * n_embd, n_embd, device)

    def attention(self, x):
        b, t, c = x.shape
        hs = c // self.n_head
        q, k, v = self.attn.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
        if HAVE_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0: the masked softmax, as bench/torch_gpt2.py computes it
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(diagonal=1)
            y = att.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        return self.attn.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(h)


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab_rows, block_size, checkpoint, device):
        super().__init__()
        self.checkpoint = checkpoint
        self.wte = nn.Embedding(vocab_rows, n_embd, device=device)
        self.wpe = nn.Embedding(block_size, n_embd, device=device)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList(Block(n_embd, n_head, device) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5, device=device)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # Tied embeddings; the padded rows (vocab_pad) are classes no target ever names. Under
        # autocast the logits are bf16 and cross_entropy runs in fp32 (autocast's op list).
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model, lr, device):
    """AdamW with decay on matrices and embeddings (every parameter of 2+ dimensions)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if device == "cuda":
        return torch.optim.AdamW(groups, fused=True, **kwargs), "fused"
    try:
        return torch.optim.AdamW(groups, foreach=True, **kwargs), "foreach"
    except TypeError:  # a torch without the multi-tensor path
        return torch.optim.AdamW(groups, **kwargs), "for-loop"


def make_grad_scaler():
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Elapsed seconds between start() and stop(): CUDA events on the GPU, the host clock on the
    CPU. Both ends synchronise the device."""

    def __init__(self, device):
        self.device = device

    def start(self):
        sync(self.device)
        if self.device == "cuda":
            self.begin, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.begin.record()
        self.t0 = time.perf_counter()

    def stop(self):
        if self.device == "cuda":
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000.0
        return time.perf_counter() - self.t0


def progress(msg):
    """A line on stderr, so that a run killed by a timeout still shows how far it got."""
    print("torch_gpt2_gpu.py: " + msg, file=sys.stderr, flush=True)


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    import platform
    return "cpu (%s, %d threads)" % (platform.processor() or platform.machine(),
                                     torch.get_num_threads())


def probe():
    cuda = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
        "sdpa": HAVE_SDPA,
        "compile": HAVE_COMPILE,
    }


def gemm_peak(a):
    """Best TFLOP/s of a square matmul (bf16 on the GPU, fp32 on the CPU) over --gemm-repeats
    timed runs of --gemm-iters back-to-back matmuls each."""
    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    n = a.gemm_size
    x = torch.randn(n, n, device=dev, dtype=dtype)
    y = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    for _ in range(a.gemm_iters):  # warm-up: cuBLAS heuristics, clocks up
        torch.matmul(x, y, out=out)
    timer, runs = Timer(dev), []
    for _ in range(a.gemm_repeats):
        timer.start()
        for _ in range(a.gemm_iters):
            torch.matmul(x, y, out=out)
        runs.append(2.0 * n ** 3 * a.gemm_iters / timer.stop() / 1e12)
    return {
        "gemm": "%s matmul %d x %d x %d" % (str(dtype).replace("torch.", ""), n, n, n),
        "iters": a.gemm_iters, "repeats": a.gemm_repeats,
        "tflops": max(runs), "tflops_runs": runs,
        "device": dev, "device_name": device_name(dev), "torch_version": torch.__version__,
    }


def train(a, ap):
    dev = a.device
    precision = a.precision or ("bf16" if dev == "cuda" else "fp32")
    if dev == "cpu" and precision != "fp32":
        ap.error("--device cpu trains in fp32 only (got --precision %s)" % precision)
    if a.mode == "compile" and not HAVE_COMPILE:
        sys.exit("torch_gpt2_gpu.py: --mode compile needs torch.compile (torch >= 2.0); this is "
                 "torch %s" % torch.__version__)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    vocab_rows = (a.vocab + a.vocab_pad - 1) // a.vocab_pad * a.vocab_pad
    model = GPT(a.n_layer, a.n_head, a.n_embd, vocab_rows, a.seq, a.checkpoint == "block", dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt, opt_impl = make_optimizer(model, 6e-4, dev)
    params = list(model.parameters())
    runner = torch.compile(model) if a.mode == "compile" else model
    scaler = make_grad_scaler() if precision == "fp16" else None
    if precision == "fp32":
        autocast = contextlib.nullcontext
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        autocast = lambda: torch.autocast(device_type=dev, dtype=dtype)  # noqa: E731

    # A few batches of random tokens on the device, reused in turn: no host-to-device copies
    # or token generation inside the timed steps. Each input is its own contiguous tensor, so
    # every step hands torch.compile the same sizes, strides and storage offset (no recompiles).
    batches = []
    for _ in range(min(8, a.warmup_steps + a.steps)):
        tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), device=dev)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = runner(x, y)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    losses = []
    t_start = time.perf_counter()
    losses.append(step(0))  # compiles under --mode compile
    sync(dev)
    first_step_s = time.perf_counter() - t_start
    progress("first step (%s) took %.1f s" % (a.mode, first_step_s))
    for i in range(1, a.warmup_steps):
        losses.append(step(i))
    warmup_end = 1 if a.warmup_steps == 0 else a.warmup_steps

    sync(dev)
    progress("warm-up done after %.1f s; timing %d steps" % (time.perf_counter() - t_start,
                                                               a.steps))
    timer = Timer(dev)
    timer.start()
    warm_alloc = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    warm_reserved = torch.cuda.max_memory_reserved() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup_end, warmup_end + a.steps):
        losses.append(step(i))
    elapsed = timer.stop()
    total_s = time.perf_counter() - t_start
    losses = [float(v) for v in torch.stack(losses).cpu()]

    tokens = a.micro_batch * a.seq * a.steps
    res = {
        "tokens_per_s": tokens / elapsed,
        "ms_per_step": 1000.0 * elapsed / a.steps,
        "steps": a.steps,
        "warmup_steps": warmup_end,
        "first_step_s": first_step_s,
        "total_s": total_s,
        "params": n_params,
        "mode": a.mode,
        "checkpoint": a.checkpoint,
        "precision": precision,
        "autocast": None if precision == "fp32" else precision,
        "attention": "sdpa (is_causal)" if HAVE_SDPA else
                     "explicit masked softmax (torch %s has no F.scaled_dot_product_attention)"
                     % torch.__version__,
        "optimizer": "AdamW (%s)" % opt_impl,
        "shape": dict(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, vocab=a.vocab,
                      vocab_rows=vocab_rows, seq=a.seq, micro_batch=a.micro_batch),
        "device": dev,
        "device_name": device_name(dev),
        "torch_version": torch.__version__,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_convention": "max_memory_allocated/reserved: peak over the whole run, warm-up "
                             "and compilation included; *_timed: the timed steps only",
    }
    if dev == "cuda":
        free, total = torch.cuda.mem_get_info()
        res.update({
            "max_memory_allocated": max(warm_alloc, torch.cuda.max_memory_allocated()),
            "max_memory_reserved": max(warm_reserved, torch.cuda.max_memory_reserved()),
            "max_memory_allocated_timed": torch.cuda.max_memory_allocated(),
            "max_memory_reserved_timed": torch.cuda.max_memory_reserved(),
            "device_in_use_bytes_at_end": total - free,
            "device_total_bytes": total,
        })
    else:
        res.update({"max_memory_allocated": None, "max_memory_reserved": None})
    if not all(math.isfinite(v) for v in losses):
        res["error"] = "non-finite loss"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--checkpoint", choices=["none", "block"], default="none")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"],
                    help="autocast dtype (default bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--vocab-pad", type=int, default=1,
                    help="pad embedding rows to a multiple of this (memtrain's model.vocab_pad)")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--probe", action="store_true",
                    help="print torch version, GPU and features as JSON, then exit")
    ap.add_argument("--gemm-peak", action="store_true",
                    help="measure the matmul peak (bf16 on cuda, fp32 on cpu) instead of training")
    ap.add_argument("--gemm-size", type=int, default=8192)
    ap.add_argument("--gemm-iters", type=int, default=100)
    ap.add_argument("--gemm-repeats", type=int, default=5)
    a = ap.parse_args()

    if a.probe:
        print(json.dumps(probe()))
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_gpt2_gpu.py: --device cuda but torch %s sees no CUDA device"
                 % torch.__version__)
    if a.gemm_peak:
        if a.threads:
            torch.set_num_threads(a.threads)
        res = gemm_peak(a)
        if not a.json:
            print("%s on %s: %.1f TFLOP/s (best of %d x %d)" %
                  (res["gemm"], res["device_name"], res["tflops"], a.gemm_repeats, a.gemm_iters))
        print(json.dumps(res))
        return

    missing = [n for n in ("n_layer", "n_head", "n_embd", "vocab", "seq", "micro_batch")
               if getattr(a, n) is None]
    if missing:
        ap.error("training needs " + ", ".join("--" + n.replace("_", "-") for n in missing))
    if a.n_embd % a.n_head:
        ap.error("--n-embd %d is not a multiple of --n-head %d" % (a.n_embd, a.n_head))
    if a.steps < 1 or a.warmup_steps < 0 or a.vocab_pad < 1:
        ap.error("--steps and --vocab-pad must be at least 1 and --warmup-steps at least 0")

    res = train(a, ap)
    if not a.json:
        mem = ("peak allocated %.1f MiB, reserved %.1f MiB" %
               (res["max_memory_allocated"] / 2**20, res["max_memory_reserved"] / 2**20)
               if a.device == "cuda" else "peak RSS %.1f MiB" % (res["peak_rss_bytes"] / 2**20))
        print("PyTorch %s GPT-2 on %s (%s, %s, checkpoint %s, %s): %d layers x %d wide, %d heads, "
              "vocab %d (%d rows), micro-batch %d x %d, %d params" %
              (torch.__version__, res["device_name"], a.mode, res["precision"], a.checkpoint,
               res["attention"].split(" (")[0], a.n_layer, a.n_embd, a.n_head, a.vocab,
               res["shape"]["vocab_rows"], a.micro_batch, a.seq, res["params"]))
        print("%.1f ms/step, %.0f tokens/s, %s, first step %.1f s, loss %.4f -> %.4f" %
              (res["ms_per_step"], res["tokens_per_s"], mem, res["first_step_s"],
               res["first_loss"], res["final_loss"]))
    print(json.dumps(res))
    if "error" in res:
        sys.exit("torch_gpt2_gpu.py: " + res["error"])


if __name__ == "__main__":
    main()
