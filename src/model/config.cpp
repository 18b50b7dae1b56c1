// Validation of the [model] section: every message names the key and the expected form.
#include "model/config.h"

#include "core/error.h"

namespace memtrain {

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
    if (n_embd % n_head != 0)
        fail("model.n_embd ({}) must be divisible by model.n_head ({})", n_embd, n_head);
    if (n_kv_head != 0 && n_kv_head != n_head)
        fail(
            "model.n_kv_head = {}: grouped-query attention is not implemented yet; use 0 (= "
            "n_head)",
            n_kv_head);
    if (norm != "layernorm")
        fail("model.norm = \"{}\": only \"layernorm\" is implemented (\"rmsnorm\" is planned)",
             norm);
    if (activation != "gelu")
        fail("model.activation = \"{}\": only \"gelu\" is implemented (\"swiglu\" is planned)",
             activation);
    if (positions != "learned")
        fail("model.positions = \"{}\": only \"learned\" is implemented (\"rope\" is planned)",
             positions);
    if (!tied_embeddings)
        fail("model.tied_embeddings = false: untied output embeddings are not implemented yet");
    if (init_std <= 0.0) fail("model.init_std must be positive, got {}", init_std);
}

}  // namespace memtrain
