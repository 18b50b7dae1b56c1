// The GPT model on the CPU: parameters in one flat buffer, an explicit forward and backward per
// block, and a `BlockSaved` struct per block holding what backward needs. No tape: the forward
// fills the structs, the backward reads them, and what exists is listed by `activation_layout`,
// the one function that both sizes the allocation and reports its bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/param_layout.h"

namespace memtrain {

// What one block's forward keeps for its backward. Shapes for a micro-batch of B x T.
struct BlockSaved {
    float* ln1;        // (B,T,C)   ln_1 output
    float* ln1_mean;   // (B,T)
    float* ln1_rstd;   // (B,T)
    float* qkv;        // (B,T,3C)
    float* att;        // (B,NH,T,T) softmax probabilities
    float* atty;       // (B,T,C)   attention output before c_proj
    float* resid_mid;  // (B,T,C)   x + attn(ln_1(x))
    float* ln2;        // (B,T,C)
    float* ln2_mean;   // (B,T)
    float* ln2_rstd;   // (B,T)
    float* fch;        // (B,T,4C)  c_fc output (pre-GELU)
    float* fch_gelu;   // (B,T,4C)
};

// One named region of the activation or workspace arena.
struct ArenaEntry {
    std::string name;
    std::size_t floats;
    MemCategory category;
};

// Every activation and workspace tensor a training step of micro-batch B x T allocates.
std::vector<ArenaEntry> activation_layout(const ModelConfig& cfg, int B, int T, int loss_chunk);
std::size_t arena_bytes(const std::vector<ArenaEntry>& layout, MemCategory c);

class GPT {
public:
    explicit GPT(const ModelConfig& cfg);

    const ModelConfig& config() const { return cfg_; }
    const ParamLayout& layout() const { return layout_; }
    std::size_t num_params() const { return layout_.total; }
    float* params() { return params_.data(); }
    const float* params() const { return params_.data(); }
    float* grads();  // allocated on first use: inference never pays for them

    // GPT-2 initialisation: N(0, init_std), residual projections scaled by 1/sqrt(2 n_layer),
    // LayerNorm weights 1, biases 0, padded vocabulary rows 0.
    void init_weights(uint64_t seed);
    void zero_grads();

    // Forward, loss and backward of one micro-batch. Gradients accumulate; the loss gradient of
    // every token is `grad_scale` (1 / tokens in the whole batch). Returns the mean loss.
    float forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                           float grad_scale);
    // Mean loss only (evaluation).
    float forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T);
    // Logits over the real vocabulary: out (B,T,V).
    void forward_logits(const int32_t* inputs, int B, int T, float* out);

    static constexpr int kLossChunk = 256;  // rows of logits alive at once

private:
    void ensure_arena(int B, int T);
    void forward(const int32_t* inputs, int B, int T);  // fills resid_, saved_, lnf_
    void block_forward(int l, const float* x, float* out, BlockSaved& s, int B, int T);
    void block_backward(int l, float* dres, const float* x, const BlockSaved& s, int B, int T);

    ModelConfig cfg_;
    ParamLayout layout_;
    Buffer<float> params_;
    Buffer<float> grads_;
    ModelParams p_;
    ModelParams g_;

    int arena_B_ = 0, arena_T_ = 0;
    Buffer<float> acts_;       // MemCategory::Activations
    Buffer<float> work_;       // MemCategory::Workspace
    std::vector<float*> resid_;  // n_layer + 1 residual streams (B,T,C)
    std::vector<BlockSaved> saved_;
    float *lnf_, *lnf_mean_, *lnf_rstd_;
    float *dres_, *dln_, *dbig_, *logits_;
};

}  // namespace memtrain
