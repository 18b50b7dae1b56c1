// Builds the named parameter layout of a GPT-2 (or Llama-style) model and views into flat
// buffers. The tensor list is documented in param_layout.h.
#include "model/param_layout.h"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain {

const ParamSpec& ParamLayout::get(std::string_view name) const {
    for (const auto& t : tensors)
        if (t.name == name) return t;
    fail("no parameter named '{}' in the model", name);
}

ParamLayout make_param_layout(const ModelConfig& cfg) {
    // A tensor-parallel shard's sizes (the whole model's at cfg.tp = 1): A is the attention
    // width its heads produce, the rows of its c_proj.
    const int64_t C = cfg.n_embd, Vp = cfg.local_vocab(), QKV = cfg.local_qkv_dim(),
                  F = cfg.local_fc_dim(), H = cfg.local_hidden(), A = cfg.attn_dim();
    const bool norm_bias = !cfg.rmsnorm();
    ParamLayout layout;
    auto add = [&](std::string name, std::vector<int64_t> shape, bool decay) {
        ParamSpec s;
        s.name = std::move(name);
        s.shape = std::move(shape);
        s.numel = 1;
        for (auto d : s.shape) s.numel *= d;
        s.offset = layout.total;
        s.decay = decay;
        layout.total += s.numel;
        layout.tensors.push_back(std::move(s));
    };
    add("wte.weight", {Vp, C}, true);
    if (!cfg.rope()) add("wpe.weight", {cfg.block_size, C}, true);
    for (int l = 0; l < cfg.n_layer; l++) {
        std::string h = fmt::format("h.{}.", l);
        add(h + "ln_1.weight", {C}, false);
        if (norm_bias) add(h + "ln_1.bias", {C}, false);
        add(h + "attn.c_attn.weight", {C, QKV}, true);
        if (cfg.bias) add(h + "attn.c_attn.bias", {QKV}, false);
        add(h + "attn.c_proj.weight", {A, C}, true);
        if (cfg.bias) add(h + "attn.c_proj.bias", {C}, false);
        add(h + "ln_2.weight", {C}, false);
        if (norm_bias) add(h + "ln_2.bias", {C}, false);
        add(h + "mlp.c_fc.weight", {C, F}, true);
        if (cfg.bias) add(h + "mlp.c_fc.bias", {F}, false);
        add(h + "mlp.c_proj.weight", {H, C}, true);
        if (cfg.bias) add(h + "mlp.c_proj.bias", {C}, false);
    }
    add("ln_f.weight", {C}, false);
    if (norm_bias) add("ln_f.bias", {C}, false);
    if (!cfg.tied_embeddings) add("lm_head.weight", {Vp, C}, true);

    // Units: cut the tensor list where the block prefix changes.
    auto unit_of = [](const std::string& name) -> std::string {
        if (name.starts_with("h.")) return name.substr(0, name.find('.', 2));
        if (name.starts_with("wte") || name.starts_with("wpe")) return "embedding";
        return "head";
    };
    for (std::size_t i = 0; i < layout.tensors.size(); i++) {
        const ParamSpec& t = layout.tensors[i];
        std::string u = unit_of(t.name);
        if (layout.units.empty() || layout.units.back().name != u)
            layout.units.push_back({u, t.offset, t.offset, i, i});
        layout.units.back().end = t.offset + t.numel;
        layout.units.back().last_tensor = i + 1;
    }
    if (layout.units.size() != (std::size_t)cfg.n_layer + 2)
        fail("internal: parameter layout has {} units, expected n_layer + 2 = {}",
             layout.units.size(), cfg.n_layer + 2);
    return layout;
}

std::size_t ParamLayout::largest_unit() const {
    std::size_t n = 0;
    for (const auto& u : units) n = std::max(n, u.size());
    return n;
}

std::size_t unit_tensor_offset(const ParamLayout& layout, int u, std::string_view suffix) {
    const ParamUnit& unit = layout.units.at(u);
    for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
        const ParamSpec& t = layout.tensors[i];
        if (t.name.size() > suffix.size() && t.name.ends_with(suffix) &&
            t.name[t.name.size() - suffix.size() - 1] == '.')
            return t.offset - unit.begin;
        if (t.name == suffix) return t.offset - unit.begin;
    }
    return SIZE_MAX;
}

namespace {

// Pointer to tensor `suffix` of unit u (e.g. "attn.c_attn.weight" in "h.3"), or null if the
// unit has no such tensor.
float* unit_tensor(const ParamLayout& layout, int u, float* base, std::string_view suffix) {
    const std::size_t o = unit_tensor_offset(layout, u, suffix);
    return o == SIZE_MAX ? nullptr : base + o;
}

}  // namespace

EmbeddingParams embedding_view(const ParamLayout& layout, float* base) {
    const int u = ParamLayout::embedding_unit();
    return {unit_tensor(layout, u, base, "wte.weight"), unit_tensor(layout, u, base, "wpe.weight")};
}

BlockOffsets block_offsets(const ParamLayout& layout, int l) {
    const int u = layout.block_unit(l);
    BlockOffsets o{};
    const char* names[] = {"ln_1.weight",      "ln_1.bias",          "attn.c_attn.weight",
                           "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                           "ln_2.weight",      "ln_2.bias",          "mlp.c_fc.weight",
                           "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
    for (std::size_t i = 0; i < o.size(); i++) o[i] = unit_tensor_offset(layout, u, names[i]);
    return o;
}

BlockParams block_view(const ParamLayout& layout, int l, float* base) {
    return block_at(block_offsets(layout, l), base);
}

HeadParams head_view(const ParamLayout& layout, float* base) {
    const int u = layout.head_unit();
    return {unit_tensor(layout, u, base, "ln_f.weight"), unit_tensor(layout, u, base, "ln_f.bias"),
            unit_tensor(layout, u, base, "lm_head.weight")};
}

std::size_t largest_other_unit_floats(const ParamLayout& layout, bool tied_embeddings) {
    const std::size_t E = (std::size_t)ParamLayout::embedding_unit();
    std::size_t most = 0;
    for (std::size_t u = 0; u < layout.units.size(); u++)
        if (!tied_embeddings || u != E) most = std::max(most, layout.units[u].size());
    return most;
}

std::size_t step_in_backward_grad_floats(const ParamLayout& layout, bool tied_embeddings) {
    const std::size_t most = largest_other_unit_floats(layout, tied_embeddings);
    return tied_embeddings ? layout.units[(std::size_t)ParamLayout::embedding_unit()].size() + most
                           : most;
}

std::size_t decoded_unit_floats(const ParamLayout& layout, bool tied_embeddings) {
    std::size_t most = 0;
    for (const ParamUnit& u : layout.units) most = std::max(most, u.size());
    if (!tied_embeddings) return most;
    const std::size_t E = (std::size_t)ParamLayout::embedding_unit();
    return std::max(most, layout.units[E].size() + layout.units.back().size());
}

}  // namespace memtrain
