#!/usr/bin/python3
"""A float64 reference of Hugging Face's LlamaForCausalLM, for memtrain's Llama import/export tests.

  hf_llama_reference.py make DIR      writes a tiny Llama model directory in Hugging Face layout:
                                      config.json, two safetensors shards (one F32, one BF16) and
                                      model.safetensors.index.json, with random weights
  hf_llama_reference.py ref DIR OUT   reads a Llama model directory (single file or sharded),
                                      runs the forward in float64 and writes OUT (JSON): the loss
                                      of fixed tokens, the logits of their first row, and a greedy
                                      continuation of a fixed prompt

The forward follows transformers' modeling_llama: RMSNorm x * rsqrt(mean(x^2) + eps) * w,
rotate-half RoPE on q and k with inv_freq = theta^(-2i/d), grouped-query attention through
repeat_kv (query head h reads kv head h // (n_head / n_kv)), causal softmax(q k^T / sqrt(d)),
o_proj, and the MLP down(silu(gate(x)) * up(x)); nn.Linear weights are (out, in), y = x W^T.
Needs only Debian's python3-torch and python3-numpy; safetensors is read and written by hand.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)

# The tiny model: GQA (4 query heads over 2 kv heads), untied head, vocabulary not a multiple of 64.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
B, T, SEED = 2, 24, 20261125
PROMPT, GREEDY = [5, 17, 42, 7], 12


def tokens():
    g = np.random.default_rng(SEED + 1)
    x = g.integers(0, CONFIG["vocab_size"], size=(B, T + 1))
    return x[:, :-1], x[:, 1:]


# ---- safetensors by hand ---------------------------------------------------------------------
def to_bf16_bits(a):
    """float32 -> bfloat16 bits, round to nearest even (as torch does)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def write_safetensors(path, tensors, dtype):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors:
        raw = (to_bf16_bits(a) if dtype == "BF16" else a.astype(np.float32)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        if info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype=np.float32)
        elif info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: tensor {name} has dtype {info['dtype']}")
        out[name] = torch.from_numpy(arr.astype(np.float64).reshape(info["shape"]))
    return out


def read_model(d):
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return read_safetensors(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    w = {}
    for shard in sorted(set(weight_map.values())):
        w.update(read_safetensors(os.path.join(d, shard)))
    return w


# ---- the model -------------------------------------------------------------------------------
def make(d):
    os.makedirs(d, exist_ok=True)
    c = CONFIG
    C, H, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = C // c["num_attention_heads"]
    KV = c["num_key_value_heads"] * hd
    g = np.random.default_rng(SEED)
    n = lambda *s: (g.standard_normal(s) * 0.08).astype(np.float32)
    ones = lambda s: (1.0 + 0.1 * g.standard_normal(s)).astype(np.float32)
    shards = [[("model.embed_tokens.weight", n(V, C))], []]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shards[l % 2] += [
            (p + "input_layernorm.weight", ones(C)),
            (p + "self_attn.q_proj.weight", n(C, C)),
            (p + "self_attn.k_proj.weight", n(KV, C)),
            (p + "self_attn.v_proj.weight", n(KV, C)),
            (p + "self_attn.o_proj.weight", n(C, C)),
            (p + "post_attention_layernorm.weight", ones(C)),
            (p + "mlp.gate_proj.weight", n(H, C)),
            (p + "mlp.up_proj.weight", n(H, C)),
            (p + "mlp.down_proj.weight", n(C, H)),
        ]
    shards[1] += [("model.norm.weight", ones(C)), ("lm_head.weight", n(V, C))]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for shard, name, dtype in zip(shards, names, ["F32", "BF16"]):
        write_safetensors(os.path.join(d, name), shard, dtype)
        weight_map.update({t: name for t, _ in shard})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def forward(w, c, ids):
    """logits (b, t, V) of token ids (b, t), float64."""
    C, NH, NKV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, eps, theta = C // NH, c["rms_norm_eps"], c.get("rope_theta", 10000.0)
    ids = torch.as_tensor(ids)
    b, t = ids.shape
    rms = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g
    lin = lambda x, name: x @ w[name].T
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2) / hd)
    ang = torch.arange(t)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    mask = torch.full((t, t), -math.inf).triu(1)
    x = w["model.embed_tokens.weight"][ids]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj.weight").view(b, t, NH, hd).transpose(1, 2)
        k = lin(h, p + "self_attn.k_proj.weight").view(b, t, NKV, hd).transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj.weight").view(b, t, NKV, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(NH // NKV, dim=1)  # repeat_kv
        v = v.repeat_interleave(NH // NKV, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, C)
        x = x + lin(y, p + "self_attn.o_proj.weight")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = lin(h, p + "mlp.gate_proj.weight"), lin(h, p + "mlp.up_proj.weight")
        x = x + lin(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj.weight")
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T


def ref(d, out):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    w = read_model(d)
    x, y = tokens()
    logits = forward(w, c, x)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.as_tensor(y).reshape(-1))
    seq, margins = list(PROMPT), []
    for _ in range(GREEDY):
        last = forward(w, c, [seq])[0, -1]
        top = torch.topk(last, 2).values
        margins.append(float(top[0] - top[1]))
        seq.append(int(torch.argmax(last)))
    with open(out, "w") as f:
        json.dump({"inputs": x.tolist(), "targets": y.tolist(), "loss": float(loss),
                   "logits_row0": logits[0].reshape(-1).tolist(), "prompt": PROMPT,
                   "greedy": seq[len(PROMPT):], "min_margin": min(margins)}, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "ref":
        ref(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
