#!/usr/bin/python3
"""The PyTorch peer for the CPU benchmark: trains memtrain's GPT-2 (float32, tied embeddings,
tanh GELU, AdamW, clipping at norm 1.0) on random tokens and prints throughput and peak memory.

    /usr/bin/python3 bench/torch_gpt2.py --n-layer 6 --n-head 6 --n-embd 384 --vocab 4096 \
        --seq 128 --batch 8 --steps 20 --warmup-steps 3 --threads 2 [--json] [--autocast]
"""
import argparse
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: weight is (in, out) and y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.attn.c_proj = Conv1D(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(n_embd, 4 * n_embd)
        self.mlp.c_proj = Conv1D(4 * n_embd, n_embd)

    def attention(self, x, mask):
        b, t, c = x.shape
        hs = c // self.n_head
        q, k, v = self.attn.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.attn.c_proj(y)

    def forward(self, x, mask):
        x = x + self.attention(self.ln_1(x), mask)
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(h)


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab, block_size):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        # True above the diagonal: the future positions each query may not see.
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size,
                                                           dtype=torch.bool), diagonal=1))

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied embeddings
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, foreach=True, **kwargs), "foreach"
    except TypeError:  # a torch without the multi-tensor path
        return torch.optim.AdamW(groups, **kwargs), "for-loop"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--n-head", type=int, required=True)
    ap.add_argument("--n-embd", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--autocast", action="store_true",
                    help="forward under torch.autocast('cpu', bfloat16): bf16 matmuls, fp32 weights")
    a = ap.parse_args()
    if a.n_embd % a.n_head:
        ap.error("--n-embd %d is not a multiple of --n-head %d" % (a.n_embd, a.n_head))
    if a.steps < 1 or a.warmup_steps < 0:
        ap.error("--steps must be at least 1 and --warmup-steps at least 0")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = GPT(a.n_layer, a.n_head, a.n_embd, a.vocab, a.seq)
    opt, opt_impl = make_optimizer(model, 3e-4)
    n_params = sum(p.numel() for p in model.parameters())
    total = a.warmup_steps + a.steps
    data = torch.randint(0, a.vocab, (total, a.batch, a.seq + 1))

    losses, t0 = [], None
    for step in range(total):
        if step == a.warmup_steps:
            t0 = time.perf_counter()
        x, y = data[step, :, :-1], data[step, :, 1:]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # also a sync point, as memtrain's per-step loss is
    elapsed = time.perf_counter() - t0
    ms = 1000.0 * elapsed / a.steps
    res = {
        "tokens_per_s": a.batch * a.seq * a.steps / elapsed,
        "ms_per_step": ms,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": n_params,
        "threads": a.threads,
        "torch_version": torch.__version__,
        "optimizer": "AdamW (%s)" % opt_impl,
        "final_loss": losses[-1],
        "autocast": a.autocast,
    }
    if not a.json:
        print("PyTorch %s GPT-2: %d layers x %d wide, %d heads, vocab %d, batch %d x %d, %d "
              "threads, %d params" % (torch.__version__, a.n_layer, a.n_embd, a.n_head, a.vocab,
                                      a.batch, a.seq, a.threads, n_params))
        print("%.1f ms/step, %.0f tokens/s, peak RSS %.1f MiB, loss %.4f -> %.4f" %
              (ms, res["tokens_per_s"], res["peak_rss_bytes"] / 2**20, losses[0], losses[-1]))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
