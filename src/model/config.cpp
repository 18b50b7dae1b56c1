// Validation of the [model] section: every message names the key and the expected form.
#include "model/config.h"

#include "core/error.h"

namespace memtrain {

const char* saved_store_name(SavedStore s) {
    switch (s) {
        case SavedStore::fp32:
            return "fp32";
        case SavedStore::bf16:
            return "bf16";
        case SavedStore::int8:
            return "int8";
    }
    return "?";
}

void ModelConfig::check_bounds() const {
    // Upper bounds, far above any real model (Llama 3 405B: 126 blocks, width 16384, MLP 53248,
    // 128256 tokens), so that every size derived from the config (fc_dim() is 2 ffn_hidden as
    // an int; a tensor's element count n_embd x fc_dim in 64 bits; the whole layout) fits its
    // type, and a config.json of 10^9 layers is refused before a layout of 10^9 blocks is built.
    auto at_most = [](const char* key, int v, int limit) {
        if (v > limit)
            fail("model.{} = {} is more than memtrain supports ({} at most)", key, v, limit);
    };
    at_most("n_layer", n_layer, kMaxLayers);
    at_most("n_embd", n_embd, kMaxWidth);
    at_most("block_size", block_size, kMaxContext);
    at_most("vocab_size", vocab_size, kMaxVocab);
    at_most("vocab_pad", vocab_pad, kMaxVocabPad);
    at_most("ffn_hidden", ffn_hidden, kMaxHidden);
}

void ModelConfig::validate() const {
    auto positive = [](const char* key, int v) {
        if (v <= 0) fail("model.{} must be a positive integer, got {}", key, v);
    };
    positive("n_layer", n_layer);
    positive("n_head", n_head);
    positive("n_embd", n_embd);
    positive("block_size", block_size);
    positive("vocab_size", vocab_size);
    positive("vocab_pad", vocab_pad);
    check_bounds();
    if (n_embd % n_head != 0)
        fail("model.n_embd ({}) must be divisible by model.n_head ({})", n_embd, n_head);
    if (n_kv_head < 0) fail("model.n_kv_head must be 0 (= n_head) or positive, got {}", n_kv_head);
    if (n_kv_head > 0 && n_head % n_kv_head != 0)
        fail("model.n_head ({}) must be a multiple of model.n_kv_head ({})", n_head, n_kv_head);
    if (ffn_hidden < 0)
        fail("model.ffn_hidden must be 0 (the activation's default) or positive, got {}",
             ffn_hidden);
    if (norm != "layernorm" && norm != "rmsnorm")
        fail("model.norm = \"{}\": expected \"layernorm\" or \"rmsnorm\"", norm);
    if (activation != "gelu" && activation != "swiglu")
        fail("model.activation = \"{}\": expected \"gelu\" or \"swiglu\"", activation);
    if (positions != "learned" && positions != "rope")
        fail("model.positions = \"{}\": expected \"learned\" or \"rope\"", positions);
    // Rotate-half pairs channel i with i + head_dim / 2.
    if (positions == "rope" && head_dim() % 2 != 0)
        fail(
            "model.positions = \"rope\" needs an even head size, but model.n_embd / model.n_head "
            "= {}",
            head_dim());
    if (!(norm_eps > 0.0)) fail("model.norm_eps must be positive, got {}", norm_eps);
    if (!(rope_theta > 0.0)) fail("model.rope_theta must be positive, got {}", rope_theta);
    if (init_std <= 0.0) fail("model.init_std must be positive, got {}", init_std);
    if (!(dropout >= 0.0 && dropout < 1.0))
        fail("model.dropout = {} must be in [0, 1) (the probability of dropping an element)",
             dropout);
    if (tp != 1) validate_tp(tp);
    if (sequence_parallel && tp == 1)
        fail("train.sequence_parallel = true needs train.tp > 1 (it shards the norms over them)");
}

void ModelConfig::validate_tp(int ranks) const {
    if (ranks < 1) fail("train.tp = {} must be >= 1 (1: no tensor parallelism)", ranks);
    if (n_head % ranks != 0)
        fail("train.tp = {} must divide model.n_head = {}: each rank holds whole attention heads",
             ranks, n_head);
    if (kv_heads() % ranks != 0)
        fail(
            "train.tp = {} must divide model.n_kv_head = {}: each rank holds whole key/value "
            "heads",
            ranks, kv_heads());
    if (mlp_hidden() % ranks != 0)
        fail("train.tp = {} must divide the MLP hidden size {} (model.ffn_hidden)", ranks,
             mlp_hidden());
    if (padded_vocab() % ranks != 0)
        fail(
            "train.tp = {} must divide the padded vocabulary {} (model.vocab_size rounded up to "
            "model.vocab_pad): each rank holds as many embedding rows",
            ranks, padded_vocab());
}

}  // namespace memtrain
