// GPT-2 forward and backward on the CPU, block by block, over the kernels in kernels/cpu.
#include "model/gpt.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

std::vector<ArenaEntry> activation_layout(const ModelConfig& cfg, int B, int T, int loss_chunk) {
    const std::size_t BT = (std::size_t)B * T, C = cfg.n_embd, NH = cfg.n_head;
    const auto A = MemCategory::Activations, W = MemCategory::Workspace;
    std::vector<ArenaEntry> e;
    e.push_back({"residual stream x n_layer+1", BT * C * (cfg.n_layer + 1), A});
    const std::size_t per_block[] = {BT * C, BT, BT, 3 * BT * C, NH * B * (std::size_t)T * T,
                                     BT * C, BT * C, BT * C, BT, BT, 4 * BT * C, 4 * BT * C};
    const char* names[] = {"ln_1",       "ln_1 mean", "ln_1 rstd", "qkv",
                           "attention probabilities", "attention out", "residual mid",
                           "ln_2",       "ln_2 mean", "ln_2 rstd", "mlp fc",   "mlp gelu"};
    for (int i = 0; i < 12; i++)
        e.push_back({fmt::format("{} x n_layer", names[i]), per_block[i] * cfg.n_layer, A});
    e.push_back({"ln_f (+ mean, rstd)", BT * C + 2 * BT, A});
    e.push_back({"d residual", BT * C, W});
    e.push_back({"d layernorm input", BT * C, W});
    e.push_back({"d qkv / d mlp hidden", 4 * BT * C, W});
    e.push_back({"logits chunk", (std::size_t)std::min<std::size_t>(loss_chunk, BT) *
                                     cfg.padded_vocab(),
                 W});
    return e;
}

std::size_t arena_bytes(const std::vector<ArenaEntry>& layout, MemCategory c) {
    std::size_t n = 0;
    for (const auto& e : layout)
        if (e.category == c) n += e.floats;
    return n * sizeof(float);
}

GPT::GPT(const ModelConfig& cfg) : cfg_(cfg) {
    cfg_.validate();
    layout_ = make_param_layout(cfg_);
    params_ = Buffer<float>(layout_.total, MemCategory::Parameters);
    p_ = view_params(layout_, params_.data(), cfg_.n_layer);
}

float* GPT::grads() {
    if (grads_.size() == 0) {
        grads_ = Buffer<float>(layout_.total, MemCategory::Gradients);
        g_ = view_params(layout_, grads_.data(), cfg_.n_layer);
    }
    return grads_.data();
}

void GPT::zero_grads() { std::memset(grads(), 0, grads_.bytes()); }

void GPT::init_weights(uint64_t seed) {
    Rng rng(seed);
    const double resid_std = cfg_.init_std / std::sqrt(2.0 * cfg_.n_layer);
    for (const auto& t : layout_.tensors) {
        float* w = params_.data() + t.offset;
        bool is_weight = t.name.ends_with(".weight");
        if (t.name.starts_with("ln") || t.name.find(".ln_") != std::string::npos) {
            for (std::size_t i = 0; i < t.numel; i++) w[i] = is_weight ? 1.0f : 0.0f;
        } else if (!is_weight) {
            std::memset(w, 0, t.numel * sizeof(float));
        } else {
            bool resid = t.name.ends_with("c_proj.weight");
            double std = resid ? resid_std : cfg_.init_std;
            for (std::size_t i = 0; i < t.numel; i++) w[i] = (float)(rng.normal() * std);
        }
    }
    // Padded vocabulary rows are never looked up; keep them exactly zero.
    std::size_t C = cfg_.n_embd;
    std::memset(p_.wte + (std::size_t)cfg_.vocab_size * C, 0,
                (std::size_t)(cfg_.padded_vocab() - cfg_.vocab_size) * C * sizeof(float));
}

void GPT::ensure_arena(int B, int T) {
    if (T > cfg_.block_size)
        fail("sequence length {} exceeds model.block_size {}", T, cfg_.block_size);
    if (B == arena_B_ && T == arena_T_) return;
    auto lay = activation_layout(cfg_, B, T, kLossChunk);
    std::size_t nact = arena_bytes(lay, MemCategory::Activations) / sizeof(float);
    std::size_t nwork = arena_bytes(lay, MemCategory::Workspace) / sizeof(float);
    if (nact > acts_.size()) acts_ = Buffer<float>(nact, MemCategory::Activations);
    if (nwork > work_.size()) work_ = Buffer<float>(nwork, MemCategory::Workspace);
    arena_B_ = B;
    arena_T_ = T;

    const std::size_t BT = (std::size_t)B * T, C = cfg_.n_embd, L = cfg_.n_layer;
    float* a = acts_.data();
    auto take = [&](std::size_t n) {
        float* p = a;
        a += n;
        return p;
    };
    resid_.resize(L + 1);
    for (auto& r : resid_) r = take(BT * C);
    saved_.resize(L);
    for (auto& s : saved_) {
        s.ln1 = take(BT * C);
        s.ln1_mean = take(BT);
        s.ln1_rstd = take(BT);
        s.qkv = take(3 * BT * C);
        s.att = take((std::size_t)cfg_.n_head * B * T * T);
        s.atty = take(BT * C);
        s.resid_mid = take(BT * C);
        s.ln2 = take(BT * C);
        s.ln2_mean = take(BT);
        s.ln2_rstd = take(BT);
        s.fch = take(4 * BT * C);
        s.fch_gelu = take(4 * BT * C);
    }
    lnf_ = take(BT * C);
    lnf_mean_ = take(BT);
    lnf_rstd_ = take(BT);
    float* w = work_.data();
    dres_ = w;
    dln_ = w + BT * C;
    dbig_ = w + 2 * BT * C;
    logits_ = w + 6 * BT * C;
}

void GPT::block_forward(int l, const float* x, float* out, BlockSaved& s, int B, int T) {
    const BlockParams& p = p_.blocks[l];
    const int N = B * T, C = cfg_.n_embd;
    cpu::layernorm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N, C);
    cpu::matmul_forward(s.qkv, s.ln1, p.qkv_w, p.qkv_b, N, C, 3 * C);
    cpu::attention_forward(s.atty, s.att, s.qkv, B, T, C, cfg_.n_head);
    std::memcpy(s.resid_mid, x, sizeof(float) * N * C);
    cpu::matmul_forward(s.resid_mid, s.atty, p.proj_w, p.proj_b, N, C, C, 1.0f);
    cpu::layernorm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N, C);
    cpu::matmul_forward(s.fch, s.ln2, p.fc_w, p.fc_b, N, C, 4 * C);
    cpu::gelu_forward(s.fch_gelu, s.fch, (int64_t)N * 4 * C);
    std::memcpy(out, s.resid_mid, sizeof(float) * N * C);
    cpu::matmul_forward(out, s.fch_gelu, p.fcp_w, p.fcp_b, N, 4 * C, C, 1.0f);
}

// On entry dres holds d(block output); on exit d(block input).
void GPT::block_backward(int l, float* dres, const float* x, const BlockSaved& s, int B, int T) {
    const BlockParams& p = p_.blocks[l];
    BlockParams& g = g_.blocks[l];
    const int N = B * T, C = cfg_.n_embd;
    float* dfch = dbig_;
    cpu::matmul_backward(dfch, g.fcp_w, g.fcp_b, dres, s.fch_gelu, p.fcp_w, N, 4 * C, C);
    cpu::gelu_backward(dfch, s.fch, dfch, (int64_t)N * 4 * C);
    cpu::matmul_backward(dln_, g.fc_w, g.fc_b, dfch, s.ln2, p.fc_w, N, C, 4 * C);
    cpu::layernorm_backward(dres, g.ln2_w, g.ln2_b, dln_, s.resid_mid, p.ln2_w, s.ln2_mean,
                            s.ln2_rstd, N, C);
    float* datty = dln_;
    cpu::matmul_backward(datty, g.proj_w, g.proj_b, dres, s.atty, p.proj_w, N, C, C);
    float* dqkv = dbig_;
    cpu::attention_backward(dqkv, datty, s.qkv, s.att, B, T, C, cfg_.n_head);
    cpu::matmul_backward(dln_, g.qkv_w, g.qkv_b, dqkv, s.ln1, p.qkv_w, N, C, 3 * C);
    cpu::layernorm_backward(dres, g.ln1_w, g.ln1_b, dln_, x, p.ln1_w, s.ln1_mean, s.ln1_rstd, N,
                            C);
}

static void check_tokens(const int32_t* tokens, std::size_t n, int vocab, const char* what) {
    for (std::size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail("{} token {} at position {} is outside the vocabulary [0, {})", what, tokens[i],
                 i, vocab);
    }
}

void GPT::forward(const int32_t* inputs, int B, int T) {
    ensure_arena(B, T);
    check_tokens(inputs, (std::size_t)B * T, cfg_.vocab_size, "input");
    const int N = B * T, C = cfg_.n_embd;
    cpu::embedding_forward(resid_[0], inputs, p_.wte, p_.wpe, B, T, C);
    for (int l = 0; l < cfg_.n_layer; l++) block_forward(l, resid_[l], resid_[l + 1], saved_[l], B, T);
    cpu::layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, resid_[cfg_.n_layer], p_.lnf_w, p_.lnf_b, N,
                           C);
}

float GPT::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                            float grad_scale) {
    grads();
    forward(inputs, B, T);
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const int N = B * T, C = cfg_.n_embd, L = cfg_.n_layer;
    double loss = cpu::classifier_loss(dln_, g_.wte, logits_, lnf_, p_.wte, targets, N, C,
                                       cfg_.vocab_size, cfg_.padded_vocab(), kLossChunk,
                                       grad_scale);
    std::memset(dres_, 0, sizeof(float) * N * C);
    cpu::layernorm_backward(dres_, g_.lnf_w, g_.lnf_b, dln_, resid_[L], p_.lnf_w, lnf_mean_,
                            lnf_rstd_, N, C);
    for (int l = L - 1; l >= 0; l--) block_backward(l, dres_, resid_[l], saved_[l], B, T);
    cpu::embedding_backward(g_.wte, g_.wpe, dres_, inputs, B, T, C);
    return (float)(loss / N);
}

float GPT::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    forward(inputs, B, T);
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const int N = B * T;
    double loss = cpu::classifier_loss(nullptr, nullptr, logits_, lnf_, p_.wte, targets, N,
                                       cfg_.n_embd, cfg_.vocab_size, cfg_.padded_vocab(),
                                       kLossChunk, 0.0f);
    return (float)(loss / N);
}

void GPT::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    forward(inputs, B, T);
    cpu::classifier_logits(out, lnf_, p_.wte, B * T, cfg_.n_embd, cfg_.vocab_size);
}

}  // namespace memtrain
