// Autoregressive sampling from a GPT: temperature and top-k over the last position's logits.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "model/gpt.h"

namespace memtrain {

struct SampleOptions {
    int max_tokens = 64;
    double temperature = 1.0;
    int top_k = 40;           // 0 = the whole vocabulary
    int64_t stop_token = -1;  // stop after emitting this token (e.g. end of text); -1 = never
};

// Logits (T,V) of the real vocabulary for one window of T tokens (a model's forward_logits).
using LogitsFn = std::function<void(const int32_t* window, int T, float* logits)>;

// Returns only the generated tokens. The context window slides when it exceeds block_size.
std::vector<int32_t> generate(const ModelConfig& cfg, const LogitsFn& logits,
                              std::vector<int32_t> prompt, const SampleOptions& opt, Rng& rng);
std::vector<int32_t> generate(GPT& model, std::vector<int32_t> prompt, const SampleOptions& opt,
                              Rng& rng);

}  // namespace memtrain
