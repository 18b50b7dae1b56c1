// Autoregressive sampling from a GPT: temperature and top-k over the last position's logits, or
// greedy decoding (temperature 0).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/gpt.h"

namespace memtrain {

struct SampleOptions {
    int max_tokens = 64;
    double temperature = 1.0;  // 0 = greedy (argmax, the lowest id among ties)
    int top_k = 40;            // 0 = the whole vocabulary
    int64_t stop_token = -1;   // stop after emitting this token (e.g. end of text); -1 = never
};

// Logits (T,V) of the real vocabulary for one window of T tokens (a model's forward_logits).
using LogitsFn = std::function<void(const int32_t* window, int T, float* logits)>;

// A prompt as the model sees it: the text's ids wrapped as Hugging Face's `tokenizer(text)` does
// (Llama 3: <|begin_of_text|> first), or the end-of-text token alone for an empty prompt with no
// BOS (a GPT-2 document start). Throws when neither gives a token.
std::vector<int32_t> prompt_tokens(const data::Tokenizer& tok, std::string_view text);

// The next token from one position's logits over the real vocabulary (V).
int32_t pick_token(const float* logits, int V, const SampleOptions& opt, Rng& rng);

// Both return only the generated tokens. This one runs the whole window per token (any engine);
// the window slides one token at a time once it exceeds block_size.
std::vector<int32_t> generate(const ModelConfig& cfg, const LogitsFn& logits,
                              std::vector<int32_t> prompt, const SampleOptions& opt, Rng& rng);
// The CPU model through a KV cache: one block pass per generated token. Past block_size the
// window moves half a block at a time (the newest half is re-encoded).
std::vector<int32_t> generate(GPT& model, std::vector<int32_t> prompt, const SampleOptions& opt,
                              Rng& rng);

}  // namespace memtrain
