// Builds the named parameter layout of a GPT-2 model and views into flat buffers.
#include "model/param_layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain {

const ParamSpec& ParamLayout::get(std::string_view name) const {
    for (const auto& t : tensors)
        if (t.name == name) return t;
    fail("no parameter named '{}' in the model", name);
}

ParamLayout make_param_layout(const ModelConfig& cfg) {
    const int64_t C = cfg.n_embd, Vp = cfg.padded_vocab();
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
    add("wpe.weight", {cfg.block_size, C}, true);
    for (int l = 0; l < cfg.n_layer; l++) {
        std::string h = fmt::format("h.{}.", l);
        add(h + "ln_1.weight", {C}, false);
        add(h + "ln_1.bias", {C}, false);
        add(h + "attn.c_attn.weight", {C, 3 * C}, true);
        add(h + "attn.c_attn.bias", {3 * C}, false);
        add(h + "attn.c_proj.weight", {C, C}, true);
        add(h + "attn.c_proj.bias", {C}, false);
        add(h + "ln_2.weight", {C}, false);
        add(h + "ln_2.bias", {C}, false);
        add(h + "mlp.c_fc.weight", {C, 4 * C}, true);
        add(h + "mlp.c_fc.bias", {4 * C}, false);
        add(h + "mlp.c_proj.weight", {4 * C, C}, true);
        add(h + "mlp.c_proj.bias", {C}, false);
    }
    add("ln_f.weight", {C}, false);
    add("ln_f.bias", {C}, false);
    return layout;
}

ModelParams view_params(const ParamLayout& layout, float* base, int n_layer) {
    // The layout is built in a fixed order, so views are taken by position.
    const auto& t = layout.tensors;
    auto at = [&](std::size_t i) { return base + t[i].offset; };
    ModelParams p;
    p.wte = at(0);
    p.wpe = at(1);
    for (int l = 0; l < n_layer; l++) {
        std::size_t i = 2 + 12 * (std::size_t)l;
        p.blocks.push_back(BlockParams{at(i), at(i + 1), at(i + 2), at(i + 3), at(i + 4), at(i + 5),
                                       at(i + 6), at(i + 7), at(i + 8), at(i + 9), at(i + 10),
                                       at(i + 11)});
    }
    std::size_t f = 2 + 12 * (std::size_t)n_layer;
    p.lnf_w = at(f);
    p.lnf_b = at(f + 1);
    return p;
}

}  // namespace memtrain
