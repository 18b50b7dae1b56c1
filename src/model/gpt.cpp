// GPT-2 forward and backward on the CPU, block by block, over the kernels in kernels/cpu.
#include "model/gpt.h"

#include <cmath>
#include <cstring>
#include <iterator>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

// The fields of BlockSaved, in one table that sizes the arena, carves it and reports it (STYLE
// lesson 2). Size = btc * B*T*C + bt * B*T + att * NH*B*T*T floats.
struct SavedField {
    const char* name;
    float* BlockSaved::*ptr;
    int btc, bt, att;
    bool selective_drops;  // recomputed in backward by the Selective policy
};
constexpr SavedField kFields[] = {
    {"ln_1", &BlockSaved::ln1, 1, 0, 0, true},
    {"ln_1 mean", &BlockSaved::ln1_mean, 0, 1, 0, false},
    {"ln_1 rstd", &BlockSaved::ln1_rstd, 0, 1, 0, false},
    {"qkv", &BlockSaved::qkv, 3, 0, 0, false},
    {"attention probabilities", &BlockSaved::att, 0, 0, 1, false},
    {"attention out", &BlockSaved::atty, 1, 0, 0, false},
    {"residual mid", &BlockSaved::resid_mid, 1, 0, 0, false},
    {"ln_2", &BlockSaved::ln2, 1, 0, 0, true},
    {"ln_2 mean", &BlockSaved::ln2_mean, 0, 1, 0, false},
    {"ln_2 rstd", &BlockSaved::ln2_rstd, 0, 1, 0, false},
    {"mlp fc", &BlockSaved::fch, 4, 0, 0, false},
    {"mlp gelu", &BlockSaved::fch_gelu, 4, 0, 0, true},
};
static_assert(sizeof(BlockSaved) == std::size(kFields) * sizeof(float*),
              "every BlockSaved field must be listed in kFields");

std::size_t field_floats(const SavedField& f, const ModelConfig& cfg, int B, int T) {
    const std::size_t BT = (std::size_t)B * T;
    return f.btc * BT * cfg.n_embd + f.bt * BT + f.att * (std::size_t)cfg.n_head * BT * T;
}

bool keeps(BlockKeep k, const SavedField& f) {
    return k == BlockKeep::All || (k == BlockKeep::Selective && !f.selective_drops);
}

// The scratch holds a field when some block drops it.
bool in_scratch(const RematPlan& plan, const SavedField& f) {
    for (BlockKeep k : plan)
        if (!keeps(k, f)) return true;
    return false;
}

}  // namespace

const char* keep_name(BlockKeep k) {
    switch (k) {
        case BlockKeep::All:
            return "all";
        case BlockKeep::Selective:
            return "selective";
        case BlockKeep::Input:
            return "input";
    }
    return "?";
}

std::size_t kept_floats(const ModelConfig& cfg, int B, int T, BlockKeep k) {
    std::size_t n = 0;
    for (const auto& f : kFields)
        if (keeps(k, f)) n += field_floats(f, cfg, B, T);
    return n;
}

std::size_t scratch_floats(const ModelConfig& cfg, int B, int T, BlockKeep k) {
    std::size_t n = 0;
    for (const auto& f : kFields)
        if (!keeps(k, f)) n += field_floats(f, cfg, B, T);
    return n;
}

std::vector<ArenaEntry> activation_layout(const ModelConfig& cfg, int B, int T, int loss_chunk,
                                          const RematPlan& plan_in) {
    const std::size_t BT = (std::size_t)B * T, C = cfg.n_embd;
    const auto A = MemCategory::Activations, W = MemCategory::Workspace;
    RematPlan plan = plan_in.empty() ? RematPlan(cfg.n_layer, BlockKeep::All) : plan_in;
    if (plan.size() != (std::size_t)cfg.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg.n_layer);
    std::vector<ArenaEntry> e;
    e.push_back({"residual stream x n_layer+1", BT * C * (cfg.n_layer + 1), A});
    std::string scratch_names;
    std::size_t scratch = 0;
    for (const auto& f : kFields) {
        std::size_t n = 0;
        for (BlockKeep k : plan) n += keeps(k, f);
        if (n > 0)
            e.push_back(
                {fmt::format("{} x {} blocks", f.name, n), field_floats(f, cfg, B, T) * n, A});
        if (in_scratch(plan, f)) {
            scratch += field_floats(f, cfg, B, T);
            scratch_names += scratch_names.empty() ? f.name : std::string(", ") + f.name;
        }
    }
    e.push_back({"ln_f (+ mean, rstd)", BT * C + 2 * BT, A});
    if (scratch > 0)
        e.push_back({fmt::format("recompute scratch, one block ({})", scratch_names), scratch, A});
    e.push_back({"d residual", BT * C, W});
    e.push_back({"d layernorm input", BT * C, W});
    e.push_back({"d qkv / d mlp hidden", 4 * BT * C, W});
    e.push_back({"logits chunk",
                 (std::size_t)std::min<std::size_t>(loss_chunk, BT) * cfg.padded_vocab(), W});
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

void GPT::zero_grads() {
    std::memset(grads(), 0, grads_.bytes());
}

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

void GPT::set_remat(const RematPlan& plan) {
    if (!plan.empty() && plan.size() != (std::size_t)cfg_.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg_.n_layer);
    plan_ = plan;
    arena_B_ = arena_T_ = 0;  // re-carve (and re-size) at the next forward
}

void GPT::ensure_arena(int B, int T) {
    if (T > cfg_.block_size)
        fail("sequence length {} exceeds model.block_size {}", T, cfg_.block_size);
    if (B == arena_B_ && T == arena_T_) return;
    auto lay = activation_layout(cfg_, B, T, kLossChunk, plan_);
    std::size_t nact = arena_bytes(lay, MemCategory::Activations) / sizeof(float);
    std::size_t nwork = arena_bytes(lay, MemCategory::Workspace) / sizeof(float);
    // Exactly the layout's size (free first: no transient double peak), so measured == predicted.
    if (nact != acts_.size()) {
        acts_.reset();
        acts_ = Buffer<float>(nact, MemCategory::Activations);
    }
    if (nwork != work_.size()) {
        work_.reset();
        work_ = Buffer<float>(nwork, MemCategory::Workspace);
    }
    arena_B_ = B;
    arena_T_ = T;

    const std::size_t BT = (std::size_t)B * T, C = cfg_.n_embd, L = cfg_.n_layer;
    const RematPlan plan = plan_.empty() ? RematPlan(L, BlockKeep::All) : plan_;
    float* a = acts_.data();
    auto take = [&](std::size_t n) {
        float* p = a;
        a += n;
        return p;
    };
    resid_.resize(L + 1);
    for (auto& r : resid_) r = take(BT * C);
    saved_.assign(L, BlockSaved{});
    for (std::size_t l = 0; l < L; l++)
        for (const auto& f : kFields)
            if (keeps(plan[l], f)) saved_[l].*f.ptr = take(field_floats(f, cfg_, B, T));
    lnf_ = take(BT * C);
    lnf_mean_ = take(BT);
    lnf_rstd_ = take(BT);
    // One shared scratch block: dropped fields of every block alias it, so the forward of a
    // dropped block writes there (overwritten by the next) and backward recomputes into it.
    for (const auto& f : kFields) {
        if (!in_scratch(plan, f)) continue;
        float* p = take(field_floats(f, cfg_, B, T));
        for (std::size_t l = 0; l < L; l++)
            if (!keeps(plan[l], f)) saved_[l].*f.ptr = p;
    }
    if (a != acts_.data() + nact) fail("internal: activation arena carving disagrees with layout");
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

// Recomputes what Selective dropped (ln1, ln2, fch_gelu) with the same kernel calls, on the same
// inputs, as block_forward: the kernels are deterministic, so the bits are those of the forward.
// The LayerNorm kernels also rewrite the kept mean/rstd, with identical values.
void GPT::recompute_selective(int l, const float* x, BlockSaved& s, int B, int T) {
    const BlockParams& p = p_.blocks[l];
    const int N = B * T, C = cfg_.n_embd;
    cpu::layernorm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N, C);
    cpu::layernorm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N, C);
    cpu::gelu_forward(s.fch_gelu, s.fch, (int64_t)N * 4 * C);
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
    cpu::layernorm_backward(dres, g.ln1_w, g.ln1_b, dln_, x, p.ln1_w, s.ln1_mean, s.ln1_rstd, N, C);
}

static void check_tokens(const int32_t* tokens, std::size_t n, int vocab, const char* what) {
    for (std::size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail("{} token {} at position {} is outside the vocabulary [0, {})", what, tokens[i], i,
                 vocab);
    }
}

void GPT::forward(const int32_t* inputs, int B, int T) {
    ensure_arena(B, T);
    check_tokens(inputs, (std::size_t)B * T, cfg_.vocab_size, "input");
    const int N = B * T, C = cfg_.n_embd;
    cpu::embedding_forward(resid_[0], inputs, p_.wte, p_.wpe, B, T, C);
    for (int l = 0; l < cfg_.n_layer; l++)
        block_forward(l, resid_[l], resid_[l + 1], saved_[l], B, T);
    cpu::layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, resid_[cfg_.n_layer], p_.lnf_w, p_.lnf_b, N,
                           C);
}

float GPT::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                            float grad_scale) {
    grads();
    forward(inputs, B, T);
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const int N = B * T, C = cfg_.n_embd, L = cfg_.n_layer;
    double loss =
        cpu::classifier_loss(dln_, g_.wte, logits_, lnf_, p_.wte, targets, N, C, cfg_.vocab_size,
                             cfg_.padded_vocab(), kLossChunk, grad_scale);
    std::memset(dres_, 0, sizeof(float) * N * C);
    cpu::layernorm_backward(dres_, g_.lnf_w, g_.lnf_b, dln_, resid_[L], p_.lnf_w, lnf_mean_,
                            lnf_rstd_, N, C);
    for (int l = L - 1; l >= 0; l--) {
        // An Input block re-runs block_forward into the scratch; its output rewrites
        // resid_[l + 1] with the same bits, which nothing reads any more.
        if (keep(l) == BlockKeep::Input)
            block_forward(l, resid_[l], resid_[l + 1], saved_[l], B, T);
        else if (keep(l) == BlockKeep::Selective)
            recompute_selective(l, resid_[l], saved_[l], B, T);
        block_backward(l, dres_, resid_[l], saved_[l], B, T);
    }
    cpu::embedding_backward(g_.wte, g_.wpe, dres_, inputs, B, T, C);
    return (float)(loss / N);
}

float GPT::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    forward(inputs, B, T);
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const int N = B * T;
    double loss =
        cpu::classifier_loss(nullptr, nullptr, logits_, lnf_, p_.wte, targets, N, cfg_.n_embd,
                             cfg_.vocab_size, cfg_.padded_vocab(), kLossChunk, 0.0f);
    return (float)(loss / N);
}

void GPT::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    forward(inputs, B, T);
    cpu::classifier_logits(out, lnf_, p_.wte, B * T, cfg_.n_embd, cfg_.vocab_size);
}

}  // namespace memtrain
