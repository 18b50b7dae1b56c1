// The GPT model on the CPU: parameters in one flat buffer, an explicit forward and backward per
// block, and a `BlockSaved` struct per block holding what backward needs. No tape: the forward
// fills the structs, the backward reads them, and what exists is placed by `plan_arena`
// (model/activation_layout.h), the one function that both sizes the allocation and reports its
// bytes. Activation
// checkpointing is a per-block `BlockKeep` plan (chosen in remat/) that this file obeys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/rng.h"
#include "model/activation_layout.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "model/param_store.h"
#include "model/weights.h"

namespace memtrain {

// What one block's forward keeps for its backward. Shapes for a micro-batch of B x T, with
// QKV = ModelConfig::qkv_dim(), F = fc_dim(), H = mlp_hidden() (GPT-2: 3C, 4C, 4C).
// Fields a config does not need are null and take no bytes (rmsnorm keeps no mean).
struct BlockSaved {
    float* ln1;        // (B,T,C)   ln_1 output
    float* ln1_mean;   // (B,T)     layernorm only
    float* ln1_rstd;   // (B,T)
    float* qkv;        // (B,T,QKV) q and k after rope when positions = "rope"
    float* att;        // (B,NH,T,T) softmax probabilities
    float* atty;       // (B,T,C)   attention output before c_proj
    float* resid_mid;  // (B,T,C)   x + attn(ln_1(x))
    float* ln2;        // (B,T,C)
    float* ln2_mean;   // (B,T)     layernorm only
    float* ln2_rstd;   // (B,T)
    float* fch;        // (B,T,F)   c_fc output (pre-activation; [gate | up] for swiglu)
    float* fch_act;    // (B,T,H)   GELU(fch), or silu(gate) * up
};

class GPT {
  public:
    // Parameters and gradients live in a ParamStore: by default one of the model's own that keeps
    // them whole (FullParamStore); a data-parallel run passes its sharding store, which must
    // outlive the model.
    explicit GPT(const ModelConfig& cfg, ParamStore* store = nullptr);
    GPT(const GPT&) = delete;
    GPT& operator=(const GPT&) = delete;

    const ModelConfig& config() const { return cfg_; }
    const ParamLayout& layout() const { return layout_; }
    std::size_t num_params() const { return layout_.total; }
    ParamStore& store() { return *store_; }
    // The whole flat buffers; an Error if the store shards them (ZeRO-3 parameters, ZeRO-2/3
    // gradients), where callers go unit by unit through store() instead.
    float* params();
    const float* params() const;
    float* grads();

    // The weights through the model's store (initialisation, import, checkpoints).
    ModelWeights weights() { return ModelWeights{*store_, layout_, cfg_}; }
    // init_gpt2_weights (weights.h) on this model.
    void init_weights(uint64_t seed);
    void zero_grads() { store_->zero_grads(); }

    // Forward, loss and backward of one micro-batch. Gradients accumulate; the loss gradient of
    // every token is `grad_scale` (1 / tokens in the whole batch). Returns the mean loss.
    float forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                           float grad_scale);
    // Mean loss only (evaluation).
    float forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T);
    // Logits over the real vocabulary: out (B,T,V).
    void forward_logits(const int32_t* inputs, int B, int T, float* out);

    // Activation checkpointing: what each block keeps (size n_layer, or empty = keep all).
    // Takes effect at the next forward; the arena is re-sized to activation_layout(plan).
    void set_remat(const RematPlan& plan);
    const RematPlan& remat_plan() const { return plan_; }

    static constexpr int kLossChunk = 256;  // rows of logits alive at once
    // How this model lays out its arenas (fp32, attention probabilities kept, kLossChunk).
    static ActFormat arena_format() { return ActFormat::cpu(); }

  private:
    void ensure_arena(int B, int T);
    // Embedding, blocks and ln_f: fills resid_, saved_, lnf_. Returns with the head unit
    // acquired (the caller releases it).
    HeadParams forward(const int32_t* inputs, int B, int T);
    // The output embedding's weights (lm_head, or wte when tied), acquired; and its release.
    const float* acquire_output_embedding(const HeadParams& head);
    void release_output_embedding();
    void block_forward(const BlockParams& p, const float* x, float* out, BlockSaved& s, int B,
                       int T);
    void block_backward(const BlockParams& p, BlockParams& g, float* dres, const float* x,
                        const BlockSaved& s, int B, int T);
    void recompute_selective(const BlockParams& p, const float* x, BlockSaved& s, int B, int T);
    // LayerNorm or RMSNorm per the config (mean and bias unused by RMSNorm).
    void norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                      const float* b, int N) const;
    void norm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                       const float* w, const float* mean, const float* rstd, int N) const;
    void act_forward(float* out, const float* inp, int N) const;
    BlockKeep keep(int l) const { return plan_.empty() ? BlockKeep::All : plan_[l]; }

    ModelConfig cfg_;
    ParamLayout layout_;
    std::unique_ptr<FullParamStore> own_store_;  // when no store was passed in
    ParamStore* store_;

    int arena_B_ = 0, arena_T_ = 0;
    Buffer<float> acts_;             // MemCategory::Activations
    Buffer<float> work_;             // MemCategory::Workspace
    std::vector<float*> resid_;      // n_layer + 1 residual streams (B,T,C)
    std::vector<BlockSaved> saved_;  // dropped fields point into the shared recompute scratch
    RematPlan plan_;
    float *lnf_, *lnf_mean_, *lnf_rstd_;
    float *dres_, *dln_, *dbig_, *dact_, *logits_;
};

}  // namespace memtrain
