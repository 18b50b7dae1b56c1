// The model's shape and architecture choices: the [model] section of a run's config.
// GPT-2 is the default; the fields that make a Llama-style block (norm, activation, positions,
// grouped-query heads, untied embeddings) exist so that such a model is a config, and are
// validated against what the kernels implement today.
#pragma once

#include <cstdint>
#include <string>

namespace memtrain {

struct ModelConfig {
    int n_layer = 6;
    int n_head = 6;
    int n_embd = 384;
    int block_size = 256;   // maximum sequence length (learned position table rows)
    int vocab_size = 4096;  // real tokens
    int vocab_pad = 64;     // embedding rows are padded to a multiple of this
    int n_kv_head = 0;      // 0 means n_head (no grouped-query attention)
    std::string norm = "layernorm";
    std::string activation = "gelu";
    std::string positions = "learned";
    bool tied_embeddings = true;
    double init_std = 0.02;
    std::string init_from;  // a Hugging Face GPT-2 safetensors file to start from

    int padded_vocab() const { return (vocab_size + vocab_pad - 1) / vocab_pad * vocab_pad; }
    int head_dim() const { return n_embd / n_head; }
    // Throws memtrain::Error naming the offending key when the config is inconsistent or asks
    // for a variant the engine does not implement yet.
    void validate() const;
};

}  // namespace memtrain
