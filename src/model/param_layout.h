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
// With bias = false (Llama) the four linear biases are absent.
#pragma once

#include <array>
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
    // A tensor-parallel shard's tensor: the whole tensor's numel (dist::make_tp_layout), so that
    // rules written on the whole tensor (the moments' fp32 rule) read it; 0: numel.
    std::size_t whole_numel = 0;
    std::vector<int64_t> whole_shape = {};  // and its shape (empty: shape)
    std::size_t global_numel() const { return whole_numel ? whole_numel : numel; }
    const std::vector<int64_t>& global_shape() const {
        return whole_shape.empty() ? shape : whole_shape;
    }
    // A tensor-parallel slice of a larger whole tensor.
    bool sliced() const { return whole_numel != 0 && whole_numel != numel; }
};

// A contiguous run of the flat buffer that is used (and, under ZeRO-3, gathered) as one piece:
// unit 0 "embedding" = wte (+ wpe), units 1..n_layer = the blocks h.0 .. h.{n_layer-1}, and
// unit n_layer + 1 "head" = ln_f (+ lm_head when untied). Units tile the buffer in order.
struct ParamUnit {
    std::string name;                               // "embedding", "h.3", "head"
    std::size_t begin = 0;                          // first float of the unit in the flat buffer
    std::size_t end = 0;                            // one past its last float
    std::size_t first_tensor = 0, last_tensor = 0;  // tensors [first, last) of the layout
    std::size_t size() const { return end - begin; }
};

struct ParamLayout {
    std::vector<ParamSpec> tensors;
    std::vector<ParamUnit> units;  // embedding, blocks, head (see ParamUnit)
    std::size_t total = 0;         // Ψ, the number of floats in the flat buffer (padding included)
    const ParamSpec& get(std::string_view name) const;
    static int embedding_unit() { return 0; }
    int block_unit(int l) const { return 1 + l; }
    int head_unit() const { return (int)units.size() - 1; }
    std::size_t largest_unit() const;  // floats of the biggest unit
};

ParamLayout make_param_layout(const ModelConfig& cfg);

// Pointers to one block's tensors inside a flat buffer (parameters or gradients), of any element
// type (the CPU's fp32, the GPU's bf16/fp16). Tensors the config does not have (norm biases
// under rmsnorm) are null.
template <typename T>
struct BasicBlockParams {
    T *ln1_w, *ln1_b;
    T *qkv_w, *qkv_b;    // (C, QKV), (QKV)
    T *proj_w, *proj_b;  // (C, C), (C)
    T *ln2_w, *ln2_b;
    T *fc_w, *fc_b;    // (C, F), (F)
    T *fcp_w, *fcp_b;  // (H, C), (C)
};
using BlockParams = BasicBlockParams<float>;

// Views into one unit's floats, `unit_base` pointing at the unit's first float (the unit may
// live in a buffer of its own, as when ZeRO-3 gathers it).
struct EmbeddingParams {
    float* wte;  // (Vp, C)
    float* wpe;  // (block_size, C) or null under rope
};
struct HeadParams {
    float *lnf_w, *lnf_b;  // lnf_b null under rmsnorm
    float* lm_head;        // null when tied (the output embedding is wte, in the embedding unit)
};
EmbeddingParams embedding_view(const ParamLayout& layout, float* unit_base);
// The offset of tensor `suffix` (e.g. "attn.c_attn.weight") of unit u from the unit's first
// element, or SIZE_MAX when the unit has no such tensor.
std::size_t unit_tensor_offset(const ParamLayout& layout, int u, std::string_view suffix);
// One block's tensors as offsets from its unit's first element, in BasicBlockParams' field
// order (SIZE_MAX where the config has no such tensor), and the views they give into a unit
// that may live in a buffer of its own (the GPU's ZeRO-3 gathers a unit of bf16 into one).
using BlockOffsets = std::array<std::size_t, 12>;
BlockOffsets block_offsets(const ParamLayout& layout, int l);
template <typename T>
BasicBlockParams<T> block_at(const BlockOffsets& o, T* unit_base) {
    auto at = [&](int i) -> T* { return o[i] == SIZE_MAX ? nullptr : unit_base + o[i]; };
    return {at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
}
BlockParams block_view(const ParamLayout& layout, int l, float* unit_base);
HeadParams head_view(const ParamLayout& layout, float* unit_base);

// The most gradient floats alive at once when each unit's gradient lives only from its first
// write in the backward to its update (optim.step_in_backward with one micro-batch per step,
// parallel/data/zero_store.h): one unit at a time, except that with tied embeddings the head's
// backward opens the embedding's, which stays open to the end.
std::size_t step_in_backward_grad_floats(const ParamLayout& layout, bool tied_embeddings);
// Its second term: the largest unit, not counting the embedding's when `tied_embeddings` (whose
// gradient then has a bucket of its own).
std::size_t largest_other_unit_floats(const ParamLayout& layout, bool tied_embeddings);
// The most parameter floats a model's step holds decoded at once when each unit is decoded from
// its storage at acquire and freed at release (optim.master = "none"): the head's unit with the
// tied embedding's (the classifier reads wte while the head is held), else the largest unit.
std::size_t decoded_unit_floats(const ParamLayout& layout, bool tied_embeddings);

}  // namespace memtrain
