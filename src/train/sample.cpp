// Sampling: temperature and top-k (or greedy) over the last position's logits. The CPU model
// decodes through a KV cache (model/kv_decoder.h); other engines pass a window-logits function.
#include "train/sample.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/kv_decoder.h"

namespace memtrain {

std::vector<int32_t> prompt_tokens(const data::Tokenizer& tok, std::string_view text) {
    std::vector<int32_t> ids;
    for (uint32_t t : tok.encode(text, true)) ids.push_back((int32_t)t);
    if (ids.empty()) {
        if (!tok.eot_token()) fail("the tokenizer has no end-of-text token; give a prompt");
        ids.push_back((int32_t)*tok.eot_token());
    }
    return ids;
}

int32_t pick_token(const float* logits, int V, const SampleOptions& opt, Rng& rng) {
    if (opt.temperature == 0) {  // greedy: the most likely token, the lowest id among ties
        int best = 0;
        for (int v = 1; v < V; v++)
            if (logits[v] > logits[best]) best = v;
        return best;
    }
    std::vector<std::pair<float, int>> order;
    order.reserve(V);
    for (int v = 0; v < V; v++) order.push_back({logits[v], v});
    const int k = opt.top_k > 0 ? std::min(opt.top_k, V) : V;
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
    for (int j = 0; j < k; j++) {
        acc += probs[j];
        if (u < acc) return order[j].second;
    }
    return order[k - 1].second;
}

std::vector<int32_t> generate(GPT& model, std::vector<int32_t> ctx, const SampleOptions& opt,
                              Rng& rng) {
    if (ctx.empty()) fail("sampling needs at least one prompt token");
    const ModelConfig& cfg = model.config();
    KvDecoder dec(cfg, model.layout(), model.params(), cfg.block_size);
    std::vector<float> logits(cfg.vocab_size);
    std::vector<int32_t> out;
    // The cache holds the prompt's last block_size tokens; when it fills up, the newest half is
    // re-encoded into an empty cache (a sliding window moved half a block at a time, so the
    // cost stays linear in the number of tokens).
    auto refill = [&](std::size_t keep) {
        dec.reset();
        dec.append(std::span<const int32_t>(ctx.data() + ctx.size() - keep, keep), logits.data());
    };
    refill(std::min<std::size_t>(ctx.size(), cfg.block_size));
    for (int i = 0; i < opt.max_tokens; i++) {
        const int32_t pick = pick_token(logits.data(), cfg.vocab_size, opt, rng);
        ctx.push_back(pick);
        out.push_back(pick);
        if (pick == opt.stop_token || i + 1 == opt.max_tokens) break;
        if (dec.length() == dec.capacity())
            refill(std::max<std::size_t>(1, cfg.block_size / 2));
        else
            dec.append(std::span<const int32_t>(&ctx.back(), 1), logits.data());
    }
    return out;
}

std::vector<int32_t> generate(const ModelConfig& cfg, const LogitsFn& logits_of,
                              std::vector<int32_t> ctx, const SampleOptions& opt, Rng& rng) {
    if (ctx.empty()) fail("sampling needs at least one prompt token");
    std::vector<int32_t> out;
    std::vector<float> logits;
    for (int i = 0; i < opt.max_tokens; i++) {
        int T = std::min<int>((int)ctx.size(), cfg.block_size);
        const int32_t* window = ctx.data() + ctx.size() - T;
        logits.resize((std::size_t)T * cfg.vocab_size);
        logits_of(window, T, logits.data());
        const int32_t pick = pick_token(logits.data() + (std::size_t)(T - 1) * cfg.vocab_size,
                                        cfg.vocab_size, opt, rng);
        ctx.push_back(pick);
        out.push_back(pick);
        if (pick == opt.stop_token) break;
    }
    return out;
}

}  // namespace memtrain
