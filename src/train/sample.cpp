// Sampling: one forward per generated token over the current window (no KV cache yet: the demo
// models are small and this keeps one code path for training and inference).
#include "train/sample.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace memtrain {

std::vector<int32_t> generate(GPT& model, std::vector<int32_t> prompt, const SampleOptions& opt,
                              Rng& rng) {
    return generate(
        model.config(),
        [&](const int32_t* x, int T, float* logits) { model.forward_logits(x, 1, T, logits); },
        std::move(prompt), opt, rng);
}

std::vector<int32_t> generate(const ModelConfig& cfg, const LogitsFn& logits_of,
                              std::vector<int32_t> ctx, const SampleOptions& opt, Rng& rng) {
    if (ctx.empty()) fail("sampling needs at least one prompt token");
    std::vector<int32_t> out;
    std::vector<float> logits;
    std::vector<std::pair<float, int>> order;
    for (int i = 0; i < opt.max_tokens; i++) {
        int T = std::min<int>((int)ctx.size(), cfg.block_size);
        const int32_t* window = ctx.data() + ctx.size() - T;
        logits.resize((std::size_t)T * cfg.vocab_size);
        logits_of(window, T, logits.data());
        const float* last = logits.data() + (std::size_t)(T - 1) * cfg.vocab_size;
        order.clear();
        for (int v = 0; v < cfg.vocab_size; v++) order.push_back({last[v], v});
        int k = opt.top_k > 0 ? std::min(opt.top_k, cfg.vocab_size) : cfg.vocab_size;
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [](auto& a, auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        double maxv = order[0].first, sum = 0.0;
        std::vector<double> probs(k);
        for (int j = 0; j < k; j++) {
            probs[j] = std::exp((order[j].first - maxv) / opt.temperature);
            sum += probs[j];
        }
        double u = rng.uniform() * sum, acc = 0.0;
        int pick = order[k - 1].second;
        for (int j = 0; j < k; j++) {
            acc += probs[j];
            if (u < acc) {
                pick = order[j].second;
                break;
            }
        }
        ctx.push_back(pick);
        out.push_back(pick);
        if (pick == opt.stop_token) break;
    }
    return out;
}

}  // namespace memtrain
