// GPT-2 (or Llama-style, per ModelConfig) forward and backward on the CPU, block by block, over
// the kernels in kernels/cpu.
#include "model/gpt.h"

#include <cmath>
#include <cstring>
#include <iterator>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

// BlockSaved's members in SavedField order (model/activation_layout.h).
constexpr float* BlockSaved::*kMembers[kSavedFields] = {
    &BlockSaved::ln1,      &BlockSaved::ln1_mean, &BlockSaved::ln1_rstd,  &BlockSaved::qkv,
    &BlockSaved::att,      &BlockSaved::atty,     &BlockSaved::resid_mid, &BlockSaved::ln2,
    &BlockSaved::ln2_mean, &BlockSaved::ln2_rstd, &BlockSaved::fch,       &BlockSaved::fch_act,
};
static_assert(sizeof(BlockSaved) == kSavedFields * sizeof(float*),
              "every BlockSaved field must be listed in kMembers");

}  // namespace

FullParamStore::FullParamStore(const ParamLayout& layout)
    : layout_(&layout), params_(layout.total, MemCategory::Parameters) {}

float* FullParamStore::full_grads() {
    if (grads_.size() == 0) grads_ = Buffer<float>(layout_->total, MemCategory::Gradients);
    return grads_.data();
}

void FullParamStore::zero_grads() {
    std::memset(full_grads(), 0, grads_.bytes());
}

GPT::GPT(const ModelConfig& cfg, ParamStore* store) : cfg_(cfg) {
    cfg_.validate();
    layout_ = make_param_layout(cfg_);
    if (!store) {
        own_store_ = std::make_unique<FullParamStore>(layout_);
        store = own_store_.get();
    }
    store_ = store;
}

float* GPT::params() {
    float* p = store_->full_params();
    if (!p) fail("internal: the parameters are sharded (ZeRO-3); use the model's store per unit");
    return p;
}

const float* GPT::params() const {
    return const_cast<GPT*>(this)->params();
}

float* GPT::grads() {
    float* g = store_->full_grads();
    if (!g) fail("internal: the gradients are sharded (ZeRO-2/3); use the model's store per unit");
    return g;
}

void GPT::init_weights(uint64_t seed) {
    init_gpt2_weights(weights(), seed);
}

void GPT::set_remat(const RematPlan& plan) {
    if (!plan.empty() && plan.size() != (std::size_t)cfg_.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg_.n_layer);
    for (BlockKeep k : plan)
        if (k == BlockKeep::Offload)
            fail(
                "train.remat = offload keeps block inputs in pinned host memory beside a GPU: "
                "use train.device = \"cuda\" (on the CPU, `full` keeps the same)");
    plan_ = plan;
    arena_B_ = arena_T_ = 0;  // re-carve (and re-size) at the next forward
}

void GPT::ensure_arena(int B, int T) {
    if (T > cfg_.block_size)
        fail("sequence length {} exceeds model.block_size {}", T, cfg_.block_size);
    if (B == arena_B_ && T == arena_T_) return;
    const ActFormat fmt = arena_format();
    const ArenaPlan p = plan_arena(cfg_, B, T, plan_, fmt);
    const std::size_t nact = p.activation_bytes / sizeof(float);
    const std::size_t nwork = p.workspace_bytes / sizeof(float);
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

    auto act = [&](std::size_t at) { return acts_.data() + at / sizeof(float); };
    auto wrk = [&](std::size_t at) { return work_.data() + at / sizeof(float); };
    resid_.resize(cfg_.n_layer + 1);
    for (int l = 0; l <= cfg_.n_layer; l++) resid_[l] = act(p.resid[l]);
    saved_.assign(cfg_.n_layer, BlockSaved{});
    for (int l = 0; l < cfg_.n_layer; l++)
        for (int i = 0; i < kSavedFields; i++)
            if (p.block[l][i] != kNoOffset) saved_[l].*kMembers[i] = act(p.block[l][i]);
    lnf_ = act(p.lnf);
    lnf_mean_ = p.lnf_mean == kNoOffset ? nullptr : act(p.lnf_mean);
    lnf_rstd_ = act(p.lnf_rstd);
    dres_ = wrk(p.dres);
    dln_ = wrk(p.dln);
    dbig_ = wrk(p.dbig);
    dact_ = p.dact == kNoOffset ? nullptr : wrk(p.dact);
    logits_ = wrk(p.logits);
}

void GPT::norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int N) const {
    if (cfg_.rmsnorm())
        cpu::rmsnorm_forward(out, rstd, inp, w, N, cfg_.n_embd, (float)cfg_.norm_eps);
    else
        cpu::layernorm_forward(out, mean, rstd, inp, w, b, N, cfg_.n_embd, (float)cfg_.norm_eps);
}

void GPT::norm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int N) const {
    if (cfg_.rmsnorm())
        cpu::rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, cfg_.n_embd);
    else
        cpu::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, cfg_.n_embd);
}

void GPT::act_forward(float* out, const float* inp, int N) const {
    if (cfg_.swiglu())
        cpu::swiglu_forward(out, inp, N, cfg_.mlp_hidden());
    else
        cpu::gelu_forward(out, inp, (int64_t)N * cfg_.mlp_hidden());
}

void GPT::block_forward(const BlockParams& p, const float* x, float* out, BlockSaved& s, int B,
                        int T) {
    const int N = B * T, C = cfg_.n_embd, QKV = cfg_.qkv_dim(), F = cfg_.fc_dim(),
              H = cfg_.mlp_hidden();
    norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N);
    cpu::matmul_forward(s.qkv, s.ln1, p.qkv_w, p.qkv_b, N, C, QKV);
    // Rotating in place means qkv holds what attention reads (and backward needs); c_attn's
    // backward reads ln1, not qkv, so the unrotated values are never needed again.
    if (cfg_.rope())
        cpu::rope_forward(s.qkv, B, T, cfg_.n_head, cfg_.kv_heads(), cfg_.head_dim(),
                          (float)cfg_.rope_theta);
    cpu::attention_forward(s.atty, s.att, s.qkv, B, T, C, cfg_.n_head, cfg_.kv_heads());
    std::memcpy(s.resid_mid, x, sizeof(float) * N * C);
    cpu::matmul_forward(s.resid_mid, s.atty, p.proj_w, p.proj_b, N, C, C, 1.0f);
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N);
    cpu::matmul_forward(s.fch, s.ln2, p.fc_w, p.fc_b, N, C, F);
    act_forward(s.fch_act, s.fch, N);
    std::memcpy(out, s.resid_mid, sizeof(float) * N * C);
    cpu::matmul_forward(out, s.fch_act, p.fcp_w, p.fcp_b, N, H, C, 1.0f);
}

// Recomputes what Selective dropped (ln1, ln2, fch_act) with the same kernel calls, on the same
// inputs, as block_forward: the kernels are deterministic, so the bits are those of the forward.
// The norm kernels also rewrite the kept mean/rstd, with identical values.
void GPT::recompute_selective(const BlockParams& p, const float* x, BlockSaved& s, int B, int T) {
    const int N = B * T;
    norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N);
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N);
    act_forward(s.fch_act, s.fch, N);
}

// On entry dres holds d(block output); on exit d(block input).
void GPT::block_backward(const BlockParams& p, BlockParams& g, float* dres, const float* x,
                         const BlockSaved& s, int B, int T) {
    const int N = B * T, C = cfg_.n_embd, QKV = cfg_.qkv_dim(), F = cfg_.fc_dim(),
              H = cfg_.mlp_hidden();
    float* dfch = dbig_;
    if (cfg_.swiglu()) {
        // d(product) (N,H) and d(fch) (N,2H) cannot share rows, so the product's gradient has
        // its own workspace.
        cpu::matmul_backward(dact_, g.fcp_w, g.fcp_b, dres, s.fch_act, p.fcp_w, N, H, C);
        cpu::swiglu_backward(dfch, s.fch, dact_, N, H);
    } else {
        cpu::matmul_backward(dfch, g.fcp_w, g.fcp_b, dres, s.fch_act, p.fcp_w, N, H, C);
        cpu::gelu_backward(dfch, s.fch, dfch, (int64_t)N * H);
    }
    cpu::matmul_backward(dln_, g.fc_w, g.fc_b, dfch, s.ln2, p.fc_w, N, C, F);
    norm_backward(dres, g.ln2_w, g.ln2_b, dln_, s.resid_mid, p.ln2_w, s.ln2_mean, s.ln2_rstd, N);
    float* datty = dln_;
    cpu::matmul_backward(datty, g.proj_w, g.proj_b, dres, s.atty, p.proj_w, N, C, C);
    float* dqkv = dbig_;
    cpu::attention_backward(dqkv, datty, s.qkv, s.att, B, T, C, cfg_.n_head, cfg_.kv_heads());
    if (cfg_.rope())
        cpu::rope_backward(dqkv, B, T, cfg_.n_head, cfg_.kv_heads(), cfg_.head_dim(),
                           (float)cfg_.rope_theta);
    cpu::matmul_backward(dln_, g.qkv_w, g.qkv_b, dqkv, s.ln1, p.qkv_w, N, C, QKV);
    norm_backward(dres, g.ln1_w, g.ln1_b, dln_, x, p.ln1_w, s.ln1_mean, s.ln1_rstd, N);
}

static void check_tokens(const int32_t* tokens, std::size_t n, int vocab, const char* what) {
    for (std::size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail("{} token {} at position {} is outside the vocabulary [0, {})", what, tokens[i], i,
                 vocab);
    }
}

HeadParams GPT::forward(const int32_t* inputs, int B, int T) {
    ensure_arena(B, T);
    check_tokens(inputs, (std::size_t)B * T, cfg_.vocab_size, "input");
    const int N = B * T, C = cfg_.n_embd;
    const int E = ParamLayout::embedding_unit();
    // Each unit announces the next (ParamStore::prefetch), so ZeRO-3 gathers it meanwhile.
    EmbeddingParams e = embedding_view(layout_, store_->acquire(E));
    store_->prefetch(layout_.block_unit(0));  // the head when there are no blocks
    cpu::embedding_forward(resid_[0], inputs, e.wte, e.wpe, B, T, C);
    store_->release(E);
    for (int l = 0; l < cfg_.n_layer; l++) {
        const int u = layout_.block_unit(l);
        BlockParams p = block_view(layout_, l, store_->acquire(u));
        store_->prefetch(u + 1);  // the next block, or the head
        block_forward(p, resid_[l], resid_[l + 1], saved_[l], B, T);
        store_->release(u);
    }
    HeadParams h = head_view(layout_, store_->acquire(layout_.head_unit()));
    // Every caller goes on to the classifier, which reads wte again when it is tied.
    if (cfg_.tied_embeddings) store_->prefetch(E);
    norm_forward(lnf_, lnf_mean_, lnf_rstd_, resid_[cfg_.n_layer], h.lnf_w, h.lnf_b, N);
    return h;
}

const float* GPT::acquire_output_embedding(const HeadParams& head) {
    if (!cfg_.tied_embeddings) return head.lm_head;
    return embedding_view(layout_, store_->acquire(ParamLayout::embedding_unit())).wte;
}

void GPT::release_output_embedding() {
    if (cfg_.tied_embeddings) store_->release(ParamLayout::embedding_unit());
}

float GPT::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                            float grad_scale) {
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const HeadParams h = forward(inputs, B, T);
    const int N = B * T, C = cfg_.n_embd, L = cfg_.n_layer;
    const int E = ParamLayout::embedding_unit(), H = layout_.head_unit();
    HeadParams hg = head_view(layout_, store_->unit_grads(H));
    float* dwout =
        cfg_.tied_embeddings ? embedding_view(layout_, store_->unit_grads(E)).wte : hg.lm_head;
    const float* wout = acquire_output_embedding(h);
    if (L > 0) store_->prefetch(layout_.block_unit(L - 1));  // gathered during the classifier
    double loss =
        cpu::classifier_loss(dln_, dwout, logits_, lnf_, wout, targets, N, C, cfg_.vocab_size,
                             cfg_.padded_vocab(), kLossChunk, grad_scale);
    release_output_embedding();
    std::memset(dres_, 0, sizeof(float) * N * C);
    norm_backward(dres_, hg.lnf_w, hg.lnf_b, dln_, resid_[L], h.lnf_w, lnf_mean_, lnf_rstd_, N);
    store_->grads_done(H);
    store_->release(H);
    for (int l = L - 1; l >= 0; l--) {
        const int u = layout_.block_unit(l);
        BlockParams p = block_view(layout_, l, store_->acquire(u));
        // The embedding's backward needs no parameters, so block 0 announces nothing.
        if (l > 0) store_->prefetch(layout_.block_unit(l - 1));
        BlockParams g = block_view(layout_, l, store_->unit_grads(u));
        // An Input block re-runs block_forward into the scratch; its output rewrites
        // resid_[l + 1] with the same bits, which nothing reads any more.
        if (keep(l) == BlockKeep::Input)
            block_forward(p, resid_[l], resid_[l + 1], saved_[l], B, T);
        else if (keep(l) == BlockKeep::Selective)
            recompute_selective(p, resid_[l], saved_[l], B, T);
        block_backward(p, g, dres_, resid_[l], saved_[l], B, T);
        store_->grads_done(u);
        store_->release(u);
    }
    EmbeddingParams eg = embedding_view(layout_, store_->unit_grads(E));
    cpu::embedding_backward(eg.wte, eg.wpe, dres_, inputs, B, T, C);
    store_->grads_done(E);
    return (float)(loss / N);
}

float GPT::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    check_tokens(targets, (std::size_t)B * T, cfg_.vocab_size, "target");
    const HeadParams h = forward(inputs, B, T);
    const int N = B * T;
    double loss = cpu::classifier_loss(nullptr, nullptr, logits_, lnf_, acquire_output_embedding(h),
                                       targets, N, cfg_.n_embd, cfg_.vocab_size,
                                       cfg_.padded_vocab(), kLossChunk, 0.0f);
    release_output_embedding();
    store_->release(layout_.head_unit());
    return (float)(loss / N);
}

void GPT::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    const HeadParams h = forward(inputs, B, T);
    cpu::classifier_logits(out, lnf_, acquire_output_embedding(h), B * T, cfg_.n_embd,
                           cfg_.vocab_size);
    release_output_embedding();
    store_->release(layout_.head_unit());
}

}  // namespace memtrain
