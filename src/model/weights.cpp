// Weight initialisation and gathering over a ModelWeights (see weights.h).
#include "model/weights.h"

#include <cmath>
#include <cstring>

#include "core/rng.h"

namespace memtrain {

void init_gpt2_weights(const ModelWeights& weights, uint64_t seed) {
    const ModelConfig& cfg = weights.cfg;
    const ParamLayout& layout = weights.layout;
    const double resid_std = cfg.init_std / std::sqrt(2.0 * cfg.n_layer);
    const std::size_t C = cfg.n_embd;
    for (int u = 0; u < (int)layout.units.size(); u++) {
        const ParamUnit& unit = layout.units[u];
        float* base = weights.store.acquire(u, true);
        for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
            const ParamSpec& t = layout.tensors[i];
            float* w = base + (t.offset - unit.begin);
            bool is_weight = t.name.ends_with(".weight");
            if (t.name.starts_with("ln") || t.name.find(".ln_") != std::string::npos) {
                for (std::size_t k = 0; k < t.numel; k++) w[k] = is_weight ? 1.0f : 0.0f;
            } else if (!is_weight) {
                std::memset(w, 0, t.numel * sizeof(float));
            } else {
                bool resid = t.name.ends_with("c_proj.weight");
                double std = resid ? resid_std : cfg.init_std;
                fill_normal(w, t.numel, std, seed, t.name);
            }
            // Padded vocabulary rows are never looked up; keep them exactly zero (in lm_head
            // too: its padded logits are ignored, and zero rows get zero gradient, so they stay
            // zero).
            if (t.name == "wte.weight" || t.name == "lm_head.weight")
                std::memset(w + (std::size_t)cfg.vocab_size * C, 0,
                            (std::size_t)(cfg.padded_vocab() - cfg.vocab_size) * C * sizeof(float));
        }
        weights.store.release(u);
    }
}

std::vector<float> gather_params(const ModelWeights& w) {
    std::vector<float> all(w.layout.total);
    for (int u = 0; u < (int)w.layout.units.size(); u++) {
        const ParamUnit& unit = w.layout.units[u];
        const float* p = w.store.acquire(u);
        std::memcpy(all.data() + unit.begin, p, unit.size() * sizeof(float));
        w.store.release(u);
    }
    return all;
}

}  // namespace memtrain
