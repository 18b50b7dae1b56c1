#!/usr/bin/python3
"""Writes the PyTorch parity fixture for memtrain's GPT-2:  make_fixture.py OUT.safetensors
With --lora (make_fixture.py --lora OUT.safetensors) the GPT-2 gets LoRA adapters (PEFT's
semantics: y = x W + b + (alpha / r) (x A^T) B^T with A (r, in), B (out, r)) on all four linears
of every block, the base frozen; it holds the base weights, the adapters ("lora." + name), the
tokens, the loss and the adapters' gradients ("grad.lora." + name).
With --llama (make_fixture.py --llama OUT.safetensors) it writes the Llama-style fixture instead:
the same tiny sizes with Hugging Face Llama semantics (RMSNorm x * rsqrt(mean(x^2) + eps) * w,
rotate-half RoPE on q and k per head, grouped-query attention through repeat_kv, SwiGLU
down(silu(gate(x)) * up(x)), untied lm_head), under memtrain's GPT-2-family parameter names and
Conv1D layouts (c_attn columns [q | k | v], c_fc columns [gate | up], linear biases kept). It
holds the weights, tokens, logits, loss and every gradient (no optimizer steps).

A minimal GPT-2 (Hugging Face names and Conv1D layouts, tied embeddings, tanh GELU) is built in
PyTorch and run in float64, so the reference is as exact as we can make it; the float32 initial
weights and every result are stored as float32. The file holds the weights, the tokens, logits,
loss, every gradient, and five AdamW steps (warmup + cosine LR, clipping at norm 1.0); and the loss
and gradients of the float32 model under PyTorch's CPU autocast to bf16 ("autocast.*").
Needs only Debian's python3-torch and python3-numpy; safetensors is written by hand.
"""
import copy
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

V, BLOCK, N_LAYER, N_HEAD, C, B, T = 96, 32, 2, 4, 64, 2, 16
VOCAB_PAD = 64  # memtrain pads the embedding rows to a multiple of this; torch uses only V rows
SEED = 1337
LR, MIN_LR_RATIO, BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 0.1, (0.9, 0.95), 1e-8, 0.1, 1.0
WARMUP, STEPS = 2, 5
LN_EPS = 1e-5


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: weight is (in, out) and y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // N_HEAD
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, hs).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)

    def forward(self, x):
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(BLOCK, C)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(C, eps=LN_EPS)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied; only the V real rows
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


def init_weights(model):
    """normal(0, 0.02) matrices and embeddings, 1 + 0.1 randn LayerNorm weights, 0.01 randn
    biases, drawn in float32 in Hugging Face parameter order from torch.manual_seed(SEED)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, dtype=torch.float32)
            is_norm = ".ln_" in name or name.startswith("ln_f.")
            if p.dim() >= 2:
                p.copy_(0.02 * r)
            elif is_norm and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * r)
            else:
                p.copy_(0.01 * r)


# ---- the Llama-style variant (--llama) -----------------------------------------------------------
N_KV_HEAD = 2
FFN_HIDDEN = (8 * C // 3 + 255) // 256 * 256  # memtrain's default for swiglu: 256 at C = 64
RMS_EPS = 1e-6
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(C))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(t, hs, dtype):
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def repeat_kv(x, n_rep):
    """(B, nkv, T, hs) -> (B, nkv * n_rep, T, hs), each kv head repeated for its query group."""
    b, nkv, t, hs = x.shape
    return x[:, :, None, :, :].expand(b, nkv, n_rep, t, hs).reshape(b, nkv * n_rep, t, hs)


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        hs = C // N_HEAD
        self.c_attn = Conv1D(C, C + 2 * N_KV_HEAD * hs)
        self.c_proj = Conv1D(C, C)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // N_HEAD
        q, k, v = self.c_attn(x).split([c, N_KV_HEAD * hs, N_KV_HEAD * hs], dim=2)
        q = q.view(b, t, N_HEAD, hs).transpose(1, 2)
        k = k.view(b, t, N_KV_HEAD, hs).transpose(1, 2)
        v = v.view(b, t, N_KV_HEAD, hs).transpose(1, 2)
        cos, sin = rope_cos_sin(t, hs, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, N_HEAD // N_KV_HEAD), repeat_kv(v, N_HEAD // N_KV_HEAD)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(C, 2 * FFN_HIDDEN)  # [gate | up]
        self.c_proj = Conv1D(FFN_HIDDEN, C)  # down

    def forward(self, x):
        gate, up = self.c_fc(x).split(FFN_HIDDEN, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = RMSNorm()
        self.attn = LlamaAttention()
        self.ln_2 = RMSNorm()
        self.mlp = SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.h = nn.ModuleList(LlamaBlock() for _ in range(N_LAYER))
        self.ln_f = RMSNorm()
        self.lm_head = nn.Linear(C, V, bias=False)  # untied: weight (V, C), like wte

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


def main_llama(out_path):
    torch.manual_seed(SEED)
    model = LlamaStyle()
    init_weights(model)
    tokens = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    init = [(n, f32(p)) for n, p in model.named_parameters()]
    model = model.double()
    x, y = tokens[:, :T], tokens[:, 1:]
    logits, loss = model(x, y)
    loss.backward()
    out = list(init)
    out.append(("tokens", tokens.to(torch.int32).numpy()))
    out.append(("logits", f32(logits)))
    out.append(("loss", f32(loss.reshape(1))))
    out += [("grad." + n, f32(p.grad)) for n, p in model.named_parameters()]
    for name, arr in out:
        if arr.dtype == np.float32 and not np.isfinite(arr).all():
            raise ValueError("tensor %s has non-finite values" % name)
    metadata = {
        "fixture_version": "1", "generator": "tests/parity/make_fixture.py --llama",
        "torch_version": torch.__version__, "precision": "computed in float64, stored as float32",
        "vocab_size": str(V), "vocab_pad": str(VOCAB_PAD), "block_size": str(BLOCK),
        "n_layer": str(N_LAYER), "n_head": str(N_HEAD), "n_kv_head": str(N_KV_HEAD),
        "n_embd": str(C), "ffn_hidden": str(FFN_HIDDEN), "batch": str(B), "seq": str(T),
        "seed": str(SEED), "norm": "rmsnorm", "norm_eps": repr(RMS_EPS), "activation": "swiglu",
        "positions": "rope", "rope_theta": repr(ROPE_THETA), "tied_embeddings": "false",
    }
    write_safetensors(out_path, out, metadata)
    print("wrote %s: %d tensors, loss %.6f" % (out_path, len(out), float(loss)))


LORA_R, LORA_ALPHA = 4, 8.0


class LoraConv1D(nn.Module):
    """A frozen Conv1D plus a LoRA adapter on its output, as PEFT's lora.Linear on a Conv1D."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape
        self.lora_A = nn.Parameter(0.1 * torch.randn(LORA_R, n_in, dtype=torch.float32))
        self.lora_B = nn.Parameter(0.1 * torch.randn(n_out, LORA_R, dtype=torch.float32))

    def forward(self, x):
        return self.base(x) + (LORA_ALPHA / LORA_R) * ((x @ self.lora_A.t()) @ self.lora_B.t())


def main_lora(out_path):
    torch.manual_seed(SEED)
    model = GPT()
    init_weights(model)
    tokens = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    init = [(n, f32(p)) for n, p in model.named_parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []  # (memtrain module name, LoraConv1D) in layout order
    for i, block in enumerate(model.h):
        for owner, attr, name in ((block.attn, "c_attn", "attn.c_attn"),
                                  (block.attn, "c_proj", "attn.c_proj"),
                                  (block.mlp, "c_fc", "mlp.c_fc"),
                                  (block.mlp, "c_proj", "mlp.c_proj")):
            lora = LoraConv1D(getattr(owner, attr))
            setattr(owner, attr, lora)
            adapters.append(("h.%d.%s" % (i, name), lora))
    lora_init = []
    for name, lora in adapters:
        lora_init.append(("lora.%s.lora_A.weight" % name, f32(lora.lora_A)))
        lora_init.append(("lora.%s.lora_B.weight" % name, f32(lora.lora_B)))
    model = model.double()
    x, y = tokens[:, :T], tokens[:, 1:]
    _, loss = model(x, y)
    loss.backward()
    out = init + lora_init
    out.append(("tokens", tokens.to(torch.int32).numpy()))
    out.append(("loss", f32(loss.reshape(1))))
    for name, lora in adapters:
        out.append(("grad.lora.%s.lora_A.weight" % name, f32(lora.lora_A.grad)))
        out.append(("grad.lora.%s.lora_B.weight" % name, f32(lora.lora_B.grad)))
    metadata = {
        "fixture_version": "1", "generator": "tests/parity/make_fixture.py --lora",
        "torch_version": torch.__version__, "precision": "computed in float64, stored as float32",
        "lora_r": str(LORA_R), "lora_alpha": repr(LORA_ALPHA),
        "lora_targets": "attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj",
    }
    write_safetensors(out_path, out, metadata)
    print("wrote %s: %d tensors, loss %.6f" % (out_path, len(out), float(loss)))


def lr_at(step):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    min_lr = MIN_LR_RATIO * LR
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return min_lr + 0.5 * (LR - min_lr) * (1.0 + math.cos(math.pi * progress))


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, numpy array) in file order. Written to a temporary, then renamed."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, arr in tensors:
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in dtypes:
            raise TypeError("tensor %s has dtype %s, expected float32 or int32" % (name, arr.dtype))
        blob = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = "%s.tmp.%d" % (path, os.getpid())  # concurrent test processes may build the same file
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def f32(t):
    return t.detach().to(torch.float32).numpy()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--llama":
        return main_llama(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--lora":
        return main_lora(sys.argv[2])
    if len(sys.argv) != 2:
        sys.exit("usage: make_fixture.py [--llama | --lora] OUT.safetensors")
    out_path = sys.argv[1]
    torch.manual_seed(SEED)
    model = GPT()
    init_weights(model)
    tokens = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    init = [(n, f32(p)) for n, p in model.named_parameters()]
    x, y = tokens[:, :T], tokens[:, 1:]
    # PyTorch's CPU autocast to bf16 on the float32 weights (the reference of memtrain's bf16
    # CPU engine): loss and every gradient, stored as "autocast.*".
    amp = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, amp_loss = amp(x, y)
    amp_loss.float().backward()
    model = model.double()  # the float32 weights, exactly, computed on in float64

    logits, loss = model(x, y)
    loss.backward()
    ref_loss = float(loss)
    out = list(init)
    out.append(("autocast.loss", f32(amp_loss.reshape(1))))
    out += [("autocast.grad." + n, f32(p.grad)) for n, p in amp.named_parameters()]
    out.append(("tokens", tokens.to(torch.int32).numpy()))
    out.append(("logits", f32(logits)))
    out.append(("loss", f32(loss.reshape(1))))
    out += [("grad." + n, f32(p.grad)) for n, p in model.named_parameters()]

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(float(loss))
        lrs.append(lr)
    out.append(("adam.losses", np.array(losses, dtype=np.float32)))
    out.append(("adam.grad_norms", np.array(norms, dtype=np.float32)))  # before clipping
    out.append(("adam.lrs", np.array(lrs, dtype=np.float32)))
    out += [("adam.final." + n, f32(p)) for n, p in model.named_parameters()]

    for name, arr in out:
        if arr.dtype == np.float32 and not np.isfinite(arr).all():
            raise ValueError("tensor %s has non-finite values" % name)
    metadata = {
        "fixture_version": "1", "generator": "tests/parity/make_fixture.py",
        "torch_version": torch.__version__, "precision": "computed in float64, stored as float32",
        "vocab_size": str(V), "vocab_pad": str(VOCAB_PAD),
        "padded_vocab": str((V + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD),
        "block_size": str(BLOCK), "n_layer": str(N_LAYER), "n_head": str(N_HEAD),
        "n_embd": str(C), "batch": str(B), "seq": str(T), "seed": str(SEED),
        "layernorm_eps": repr(LN_EPS), "gelu": "tanh", "tied_embeddings": "true",
        "optimizer": "AdamW", "lr": repr(LR), "min_lr": repr(MIN_LR_RATIO * LR),
        "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]), "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY), "weight_decay_applies_to": "parameters with dim >= 2",
        "grad_clip": repr(GRAD_CLIP),
        "grad_clip_fn": "clip_grad_norm_: grads *= clip / (norm + 1e-6) if norm > clip",
        "warmup_steps": str(WARMUP), "steps": str(STEPS),
        "schedule": "linear warmup to lr over warmup_steps, then cosine to min_lr at steps",
    }
    write_safetensors(out_path, out, metadata)
    print("wrote %s: %d tensors, loss %.6f, adam losses %s" %
          (out_path, len(out), ref_loss, ["%.6f" % l for l in losses]))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one clear line and a non-zero exit
        print("make_fixture.py: error: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        sys.exit(1)
