// Analytic FLOPs and the solver chain for a GPT model (see cost.h).
#include "remat/cost.h"

namespace memtrain::remat {

BlockFlops block_flops(const ModelConfig& cfg, int B, int T) {
    const int64_t N = (int64_t)B * T, C = cfg.n_embd, NH = cfg.n_head;
    // Widths from the config (GPT-2: QKV = 3C, F = H = 4C); RMSNorm, SwiGLU and RoPE are
    // counted at LayerNorm's and GELU's per-element cost: close enough to rank plans.
    const int64_t QKV = cfg.qkv_dim(), F = cfg.fc_dim(), H = cfg.mlp_hidden();
    BlockFlops f;
    f.ln = kLayerNormFlopsPerElem * N * C;
    f.qkv = 2 * N * C * QKV;
    f.attention = 4 * (int64_t)B * T * T * C + kSoftmaxFlopsPerElem * (int64_t)B * NH * T * T;
    f.proj = 2 * N * C * C;
    f.fc = 2 * N * C * F;
    f.gelu = kGeluFlopsPerElem * H * N;
    f.fc_proj = 2 * N * H * C;
    return f;
}

int64_t step_flops(const ModelConfig& cfg, int B, int T) {
    const int64_t N = (int64_t)B * T, C = cfg.n_embd;
    int64_t fwd = cfg.n_layer * block_flops(cfg, B, T).forward() + kLayerNormFlopsPerElem * N * C +
                  2 * N * C * cfg.padded_vocab();
    return 3 * fwd;
}

Chain make_chain(const ModelConfig& cfg, int B, int T, const ActFormat& fmt) {
    return make_chain(cfg, B, T, block_flops(cfg, B, T), fmt);
}

Chain make_chain(const ModelConfig& cfg, int B, int T, const BlockFlops& f, const ActFormat& fmt) {
    // Residual streams and ln_f, exactly as activation_layout lists them.
    Chain c;
    c.fixed_bytes = fixed_bytes(cfg, B, T, fmt);
    // Under a tiled MLP an Input block's redo stops at ln_2 (its backward makes each tile's
    // c_fc output and activation itself), so mlp.c_proj's forward is never re-run; a rebuild of
    // a later input still runs the whole forward.
    const int64_t redo = fmt.mlp_tile > 0 ? f.forward() - f.fc_proj : f.forward();
    const int64_t recompute[] = {0, f.selective(), redo};
    std::array<Option, 3> opts;
    for (BlockKeep k : {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input}) {
        int i = static_cast<int>(k);
        opts[i].kept_bytes = kept_bytes(cfg, B, T, k, fmt);
        opts[i].scratch_bytes = scratch_bytes(cfg, B, T, k, fmt);
        opts[i].recompute_flops = recompute[i];
    }
    c.blocks.assign(cfg.n_layer, opts);
    c.resid_bytes = resid_bytes(cfg, B, T, fmt);
    if (redo != f.forward()) c.forward_flops.assign(cfg.n_layer, f.forward());
    return c;
}

}  // namespace memtrain::remat
