// Analytic FLOPs and the solver chain for a GPT model (see cost.h).
#include "remat/cost.h"

#include "model/gpt.h"

namespace memtrain::remat {

BlockFlops block_flops(const ModelConfig& cfg, int B, int T) {
    const int64_t N = (int64_t)B * T, C = cfg.n_embd, NH = cfg.n_head;
    BlockFlops f;
    f.ln = kLayerNormFlopsPerElem * N * C;
    f.qkv = 2 * N * C * 3 * C;
    f.attention = 4 * (int64_t)B * T * T * C + kSoftmaxFlopsPerElem * (int64_t)B * NH * T * T;
    f.proj = 2 * N * C * C;
    f.fc = 2 * N * C * 4 * C;
    f.gelu = kGeluFlopsPerElem * 4 * N * C;
    f.fc_proj = 2 * N * 4 * C * C;
    return f;
}

int64_t step_flops(const ModelConfig& cfg, int B, int T) {
    const int64_t N = (int64_t)B * T, C = cfg.n_embd;
    int64_t fwd = cfg.n_layer * block_flops(cfg, B, T).forward() + kLayerNormFlopsPerElem * N * C +
                  2 * N * C * cfg.padded_vocab();
    return 3 * fwd;
}

Chain make_chain(const ModelConfig& cfg, int B, int T) {
    const std::size_t BT = (std::size_t)B * T;
    // Residual streams and ln_f, exactly as activation_layout lists them.
    Chain c;
    c.fixed_bytes =
        sizeof(float) * (BT * cfg.n_embd * (cfg.n_layer + 1) + BT * cfg.n_embd + 2 * BT);
    const BlockFlops f = block_flops(cfg, B, T);
    const int64_t recompute[] = {0, f.selective(), f.forward()};
    std::array<Option, 3> opts;
    for (BlockKeep k : {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input}) {
        int i = static_cast<int>(k);
        opts[i].kept_bytes = sizeof(float) * kept_floats(cfg, B, T, k);
        opts[i].scratch_bytes = sizeof(float) * scratch_floats(cfg, B, T, k);
        opts[i].recompute_flops = recompute[i];
    }
    c.blocks.assign(cfg.n_layer, opts);
    return c;
}

}  // namespace memtrain::remat
