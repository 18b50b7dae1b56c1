// ModelSpec: the shape of a transformer as the planner sees it (no weights, no kernels).
// Parameter counts are derived from real tensor shapes (GPT-2 and Llama variants), so the
// estimate is exact for the models memtrain builds. Presets, HF config.json and memtrain TOML.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memtrain {
struct ModelConfig;
}

namespace memtrain::plan {

struct ModelSpec {
    std::string name = "custom";
    int n_layer = 12;
    int n_head = 12;
    int n_embd = 768;
    int n_kv_head = 0;   // 0 = n_head (no grouped-query attention)
    int ffn_hidden = 0;  // 0 = 4*n_embd for gelu, Llama's 2/3*4h rounded to 256 for swiglu
    int vocab_size = 50257;
    int block_size = 1024;  // maximum context; the default sequence length
    bool rmsnorm = false;   // else LayerNorm (weight + bias)
    bool swiglu = false;    // else GELU MLP
    bool rope = false;      // else a learned position table of block_size rows
    bool tied_embeddings = true;
    bool attn_bias = true;  // biases on Q, K, V and the out-projection (GPT-2 has them)
    bool mlp_bias = true;   // biases on the MLP's linear layers (Llama has neither)
    bool dropout = true;    // dropout masks are saved activations (GPT-2/GPT-3 style)
    // No byte depends on these; they travel to `plan --emit-config` so it writes the model.
    double norm_eps = 1e-5;
    double rope_theta = 10000.0;

    int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
    int head_dim() const { return n_embd / n_head; }
    int64_t kv_dim() const { return static_cast<int64_t>(kv_heads()) * head_dim(); }
    int64_t ffn() const;
    // Exactly Llama's architecture (ModelConfig::is_llama): RMSNorm, SwiGLU, RoPE, no linear
    // biases. LoRA then gives q, k, v and gate, up their own adapters (the engine stores them
    // fused in c_attn and c_fc); any other shape gets one adapter per engine tensor, as GPT-2.
    bool is_llama() const { return rmsnorm && swiglu && rope && !attn_bias && !mlp_bias; }

    // Parameters of one transformer block, split by how tensor parallelism treats them.
    int64_t layer_matrix_params() const;      // QKV, out-proj, MLP weights: split over TP
    int64_t layer_split_bias_params() const;  // column-parallel biases: split over TP
    int64_t layer_replicated_params() const;  // norms and row-parallel biases: on every TP rank
    int64_t layer_params() const;
    int64_t embedding_params() const;  // token table (+ learned positions)
    int64_t head_params() const;       // final norm + untied LM head (tied: just the norm)
    int64_t total_params() const;
    // Matrix parameters that cost 2 FLOPs per token forward (blocks + LM head).
    int64_t matmul_params() const;

    // Throws memtrain::Error naming the field when the shape is impossible.
    void validate() const;
};

// Model presets by name (gpt2 ... llama-30b ... llama3-405b); `model_preset_names` lists them.
std::vector<std::string> model_preset_names();
// A preset name, a Hugging Face config.json path or a memtrain TOML path ([model] section).
// Unknown names fail with the nearest preset suggested.
ModelSpec load_model(const std::string& name_or_path);
// Reads model_type gpt2, llama, mistral and memtrain-llama-style (what memtrain's checkpoints
// write); a config without model_type is read by its keys. Mixture-of-experts and any other
// model_type are refused by name, never read as a dense model.
ModelSpec model_from_hf_json(const std::string& json_text, const std::string& origin);
// The model_type values model_from_hf_json reads.
std::vector<std::string> supported_model_types();
ModelSpec model_from_toml(const std::string& toml_text, const std::string& origin);
// The trainer's [model] config as a planner spec (same parameter count as the engine,
// using the padded vocabulary rows the engine allocates).
ModelSpec model_from_config(const ModelConfig& config);
// The reverse: the trainer's [model] config of a planner spec, so the planner can ask the
// engine's own functions (the activation layout, the pipeline stage split) about any preset.
// The vocabulary is taken as already padded (vocab_pad 1: padded_vocab() == vocab_size) and
// ffn_hidden is written out; model_from_config(config_from_model(m)) gives back m's shape.
// Lossy where ModelConfig has one switch for two of ModelSpec's: linear biases (bias = attn_bias
// || mlp_bias) and dropout masks (model.dropout hashes its masks and stores none). Neither
// changes an activation byte.
ModelConfig config_from_model(const ModelSpec& model);

}  // namespace memtrain::plan
