// Builds the named parameter layout of a GPT-2 (or Llama-style) model and views into flat
// buffers. The tensor list is documented in param_layout.h.
#include "model/param_layout.h"

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
    const int64_t C = cfg.n_embd, Vp = cfg.padded_vocab(), QKV = cfg.qkv_dim(), F = cfg.fc_dim(),
                  H = cfg.mlp_hidden();
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
        add(h + "attn.c_attn.bias", {QKV}, false);
        add(h + "attn.c_proj.weight", {C, C}, true);
        add(h + "attn.c_proj.bias", {C}, false);
        add(h + "ln_2.weight", {C}, false);
        if (norm_bias) add(h + "ln_2.bias", {C}, false);
        add(h + "mlp.c_fc.weight", {C, F}, true);
        add(h + "mlp.c_fc.bias", {F}, false);
        add(h + "mlp.c_proj.weight", {H, C}, true);
        add(h + "mlp.c_proj.bias", {C}, false);
    }
    add("ln_f.weight", {C}, false);
    if (norm_bias) add("ln_f.bias", {C}, false);
    if (!cfg.tied_embeddings) add("lm_head.weight", {Vp, C}, true);
    return layout;
}

ModelParams view_params(const ParamLayout& layout, float* base, int n_layer) {
    std::unordered_map<std::string_view, std::size_t> offset;
    for (const auto& t : layout.tensors) offset.emplace(t.name, t.offset);
    // Absent tensors (the config does not have them) view as null.
    auto at = [&](const std::string& name) -> float* {
        auto it = offset.find(name);
        return it == offset.end() ? nullptr : base + it->second;
    };
    auto need = [&](const std::string& name) {
        float* p = at(name);
        if (!p) fail("internal: parameter layout has no '{}'", name);
        return p;
    };
    ModelParams p;
    p.wte = need("wte.weight");
    p.wpe = at("wpe.weight");
    for (int l = 0; l < n_layer; l++) {
        std::string h = fmt::format("h.{}.", l);
        p.blocks.push_back(BlockParams{need(h + "ln_1.weight"), at(h + "ln_1.bias"),
                                       need(h + "attn.c_attn.weight"), need(h + "attn.c_attn.bias"),
                                       need(h + "attn.c_proj.weight"), need(h + "attn.c_proj.bias"),
                                       need(h + "ln_2.weight"), at(h + "ln_2.bias"),
                                       need(h + "mlp.c_fc.weight"), need(h + "mlp.c_fc.bias"),
                                       need(h + "mlp.c_proj.weight"), need(h + "mlp.c_proj.bias")});
    }
    p.lnf_w = need("ln_f.weight");
    p.lnf_b = at("ln_f.bias");
    p.lm_head = at("lm_head.weight");
    if (!p.lm_head) p.lm_head = p.wte;
    return p;
}

}  // namespace memtrain
