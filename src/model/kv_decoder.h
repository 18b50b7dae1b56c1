// Incremental decoding on the CPU with a KV cache: each new token runs through the blocks once,
// attending to the keys and values kept from the tokens before it, so generating n tokens costs
// O(n) block passes instead of the O(n^2) of re-running the whole window per token. It reads
// the same flat fp32 parameters as the training model, through the same CPU kernels.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/param_layout.h"

namespace memtrain {

class KvDecoder {
  public:
    // `params` is the model's flat buffer in `layout` order (GPT::params()); it must outlive the
    // decoder. The cache holds up to `capacity` positions (at most model.block_size).
    KvDecoder(const ModelConfig& cfg, const ParamLayout& layout, const float* params, int capacity);
    // Forgets every cached position.
    void reset() { length_ = 0; }
    int length() const { return length_; }
    int capacity() const { return capacity_; }
    // Runs `tokens` at positions length() .. length() + n - 1, caches their keys and values, and
    // writes the logits over the real vocabulary (V) of the last of them. Needs
    // length() + n <= capacity().
    void append(std::span<const int32_t> tokens, float* last_logits);

  private:
    ModelConfig cfg_;
    const ParamLayout& layout_;
    const float* params_;
    int capacity_, length_ = 0;
    std::vector<float> k_, v_;  // (n_layer, capacity, kv_heads * head_dim) each
};

}  // namespace memtrain
