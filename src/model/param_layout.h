// One flat buffer holds every parameter; this layout names the views into it, in Hugging Face
// GPT-2 order and with Hugging Face shapes (Conv1D weights are (in, out)). The same layout
// indexes the gradient buffer and the optimizer moments.
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
struct BlockParams {
    float *ln1_w, *ln1_b;
    float *qkv_w, *qkv_b;    // (C, 3C), (3C)
    float *proj_w, *proj_b;  // (C, C), (C)
    float *ln2_w, *ln2_b;
    float *fc_w, *fc_b;    // (C, 4C), (4C)
    float *fcp_w, *fcp_b;  // (4C, C), (C)
};

struct ModelParams {
    float* wte;  // (Vp, C)
    float* wpe;  // (block_size, C)
    std::vector<BlockParams> blocks;
    float *lnf_w, *lnf_b;
};

ModelParams view_params(const ParamLayout& layout, float* base, int n_layer);

}  // namespace memtrain
