// One flat buffer holds every parameter; this layout names the views into it, in Hugging Face
// GPT-2 order and with Hugging Face shapes (Conv1D weights are (in, out)). The same layout
// indexes the gradient buffer and the optimizer moments.
//
// Llama-style variants keep the GPT-2 names; only which tensors exist and their shapes change
// (C = n_embd, QKV = ModelConfig::qkv_dim(), F = fc_dim(), H = mlp_hidden(), Vp = padded vocab):
//   wte.weight (Vp,C); wpe.weight (block_size,C) only for positions = "learned";
//   per block h.{i}.: ln_1.weight (C) [+ ln_1.bias (C) for layernorm];
//     attn.c_attn.weight (C,QKV) + bias (QKV), columns [q | k | v], k and v with kv_heads;
//     attn.c_proj.weight (C,C) + bias (C); ln_2 as ln_1;
//     mlp.c_fc.weight (C,F) + bias (F), for swiglu F = 2H with columns [gate | up];
//     mlp.c_proj.weight (H,C) + bias (C);
//   ln_f.weight (C) [+ ln_f.bias]; lm_head.weight (Vp,C) only for tied_embeddings = false.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"

namespace memtrain {

struct ParamSpec {
    std::string name;            // e.g. "h.0.attn.c_attn.weight"
    std::vector<int64_t> shape;  // in-memory shape (wte has padded_vocab rows)
    std::size_t offset = 0;      // in floats, into the flat buffer
    std::size_t numel = 0;
    bool decay = false;  // weight decay applies (matrices and embeddings only)
};

struct ParamLayout {
    std::vector<ParamSpec> tensors;
    std::size_t total = 0;  // Ψ, the number of floats in the flat buffer (padding included)
    const ParamSpec& get(std::string_view name) const;
};

ParamLayout make_param_layout(const ModelConfig& cfg);

// Pointers to one block's tensors inside a flat buffer (parameters or gradients).
// Tensors the config does not have (norm biases under rmsnorm) are null.
struct BlockParams {
    float *ln1_w, *ln1_b;
    float *qkv_w, *qkv_b;    // (C, QKV), (QKV)
    float *proj_w, *proj_b;  // (C, C), (C)
    float *ln2_w, *ln2_b;
    float *fc_w, *fc_b;    // (C, F), (F)
    float *fcp_w, *fcp_b;  // (H, C), (C)
};

struct ModelParams {
    float* wte;  // (Vp, C)
    float* wpe;  // (block_size, C), null under rope
    std::vector<BlockParams> blocks;
    float *lnf_w, *lnf_b;  // lnf_b null under rmsnorm
    float* lm_head;        // (Vp, C): lm_head.weight when untied, else the same pointer as wte
};

// Views by name (not by position), so the set of tensors can vary with the config.
ModelParams view_params(const ParamLayout& layout, float* base, int n_layer);

}  // namespace memtrain
