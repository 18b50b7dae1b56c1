// The model's shape and architecture choices: the [model] section of a run's config.
// GPT-2 is the default; a Llama-style block (norm = "rmsnorm", activation = "swiglu",
// positions = "rope", n_kv_head < n_head, tied_embeddings = false) is a config, not a separate
// model: each choice is independent and validated here.
#pragma once

#include <cstdint>
#include <string>

namespace memtrain {

// The largest values ModelConfig::validate accepts: with them every derived width (fc_dim, the
// padded vocabulary) fits an int and every tensor's and the layout's element count fits 64 bits
// with room to multiply by bytes per element.
constexpr int kMaxLayers = 16384;
constexpr int kMaxWidth = 1 << 17;     // n_embd
constexpr int kMaxHidden = 1 << 20;    // ffn_hidden
constexpr int kMaxContext = 1 << 20;   // block_size
constexpr int kMaxVocab = 1 << 24;     // vocab_size
constexpr int kMaxVocabPad = 1 << 16;  // vocab_pad

// How saved activations are stored (ModelConfig::saved_activations, ActFormat::saved).
enum class SavedStore { fp32, bf16, int8 };
const char* saved_store_name(SavedStore s);  // "fp32", "bf16", "int8"

struct ModelConfig {
    int n_layer = 6;
    int n_head = 6;
    int n_embd = 384;
    int block_size = 256;   // maximum sequence length (learned position table rows)
    int vocab_size = 4096;  // real tokens
    int vocab_pad = 64;     // embedding rows are padded to a multiple of this
    int n_kv_head = 0;      // 0 means n_head (no grouped-query attention)
    int ffn_hidden = 0;     // MLP hidden size; 0 = 4 n_embd (gelu), 8 n_embd / 3 rounded up to 256
    std::string norm = "layernorm";     // or "rmsnorm" (weight only, no bias)
    std::string activation = "gelu";    // or "swiglu" (c_fc produces [gate | up])
    std::string positions = "learned";  // or "rope" (no wpe tensor)
    bool tied_embeddings = true;        // false: a separate lm_head.weight (padded_vocab, n_embd)
    bool bias = true;                   // linear layers have biases (GPT-2); Llama has none
    double norm_eps = 1e-5;
    double rope_theta = 10000.0;
    double init_std = 0.02;
    // Dropout in training (GPT-2's embd/attn/resid_pdrop as one probability, as nanoGPT has it):
    // on the embedding output, the attention probabilities and both residual branches. The masks
    // are hashes (kernels/dropout_mask.h), so they take no memory. 0 = off; never in evaluation.
    double dropout = 0;
    // Tensor parallelism (parallel/tensor/tp.h): this config describes one of `tp` ranks' shards,
    // whose local_* sizes below are the whole model's divided by tp (heads, kv heads, MLP hidden,
    // padded vocabulary rows). Set by the tensor-parallel engine from train.tp, never read from a
    // file; 1 everywhere else, where the local sizes are the whole model's.
    int tp = 1;
    // Sequence parallelism (Korthikanti et al. 2022; parallel/tensor/tp.h) on a tensor-parallel
    // shard: the residual stream and the norm regions hold only this rank's contiguous tp-th of a
    // micro-batch's B x T token rows. Set by the tensor-parallel engine from
    // train.sequence_parallel, never read from a file.
    bool sequence_parallel = false;
    // The CPU model keeps each attention row's log-sum-exp, not its T probabilities, and
    // recomputes them in the backward (train.cpu_attention = "lse"). Set from that key by
    // resolve_config, never read from a file; the CUDA model always does.
    bool lse_attention = false;
    // The CPU model runs each block's MLP (c_fc, the activation, mlp.c_proj) over row tiles of
    // this many token rows, in the forward and the backward (the weight gradients summed tile by
    // tile), so that a block whose MLP activations are not kept recomputes them one tile at a
    // time into a tile-sized scratch (train.mlp_tile; 0: all rows at once). Set by
    // resolve_config, never read from a file.
    int mlp_tile = 0;
    // The CPU model in bf16 (train.precision = "bf16" on the CPU): every GEMM's operands are
    // rounded to bf16 and multiplied with fp32 accumulation (kernels/cpu/gemm.h). Weights,
    // gradients, the residual streams, norms' statistics, softmax and the loss stay fp32. Set by
    // resolve_config, never read from a file; the CUDA model's precision is its storage type.
    bool cpu_bf16 = false;
    // How the CPU model stores each block's saved activations (train.cpu_activations; bf16 by
    // default with cpu_bf16): fp32, bf16, or block-scaled int8 (kernels/cpu/act_int8.h), each
    // field rounded where the forward makes it, so the backward and any recompute read the same
    // values. Set by resolve_config, never read from a file.
    SavedStore saved_activations = SavedStore::fp32;
    // Weights to start from: a Hugging Face model directory, a memtrain checkpoint or an out_dir
    // with `latest`, a .safetensors file, or a sharded model.safetensors.index.json, with GPT-2 or
    // Llama tensor names (io/hf_weights.h, io/model_source.h).
    std::string init_from;
    // Load only the tensors of init_from this model has (the first blocks of a deeper model, say);
    // false: a source holding tensors the model does not use is refused.
    bool init_partial = false;

    int padded_vocab() const { return (vocab_size + vocab_pad - 1) / vocab_pad * vocab_pad; }
    int head_dim() const { return n_embd / n_head; }
    int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
    // Width of a packed qkv row: [q (n_head) | k (kv_heads) | v (kv_heads)] heads of head_dim.
    int qkv_dim() const { return n_embd + 2 * kv_heads() * head_dim(); }
    int mlp_hidden() const {  // H: the input width of mlp.c_proj
        if (ffn_hidden > 0) return ffn_hidden;
        if (activation == "swiglu") return (8 * n_embd / 3 + 255) / 256 * 256;
        return 4 * n_embd;
    }
    // Output width of mlp.c_fc: H for GELU, 2H ([gate | up]) for SwiGLU.
    int fc_dim() const { return activation == "swiglu" ? 2 * mlp_hidden() : mlp_hidden(); }
    // One tensor-parallel rank's shard (equal to the whole model's sizes at tp = 1): its query
    // heads, kv heads, attention width (its heads x head_dim: c_proj's input rows), packed qkv
    // width, MLP hidden width, c_fc output width, and padded vocabulary rows.
    int local_heads() const { return n_head / tp; }
    int local_kv_heads() const { return kv_heads() / tp; }
    int attn_dim() const { return local_heads() * head_dim(); }
    int local_qkv_dim() const { return qkv_dim() / tp; }
    int local_hidden() const { return mlp_hidden() / tp; }
    int local_fc_dim() const { return fc_dim() / tp; }
    int local_vocab() const { return padded_vocab() / tp; }
    // Token rows of the sequence-sharded regions (residual stream, norms) for a micro-batch of N
    // rows: N / tp under sequence parallelism, N otherwise. A forward-only call whose N the ranks
    // do not divide (sampling a prompt of any length) runs without sequence parallelism, so N.
    int64_t sp_rows(int64_t N) const {
        return sequence_parallel && tp > 1 && N % tp == 0 ? N / tp : N;
    }
    bool rmsnorm() const { return norm == "rmsnorm"; }
    bool swiglu() const { return activation == "swiglu"; }
    bool rope() const { return positions == "rope"; }
    // Exactly GPT-2's architecture (what Hugging Face's GPT2LMHeadModel loads).
    bool is_gpt2() const {
        return !rmsnorm() && !swiglu() && !rope() && kv_heads() == n_head && tied_embeddings &&
               mlp_hidden() == 4 * n_embd && bias;
    }
    // Exactly the Llama architecture (what Hugging Face's LlamaForCausalLM loads): RMSNorm,
    // SwiGLU, rotate-half RoPE, no linear biases; GQA and a tied or untied head are both Llama.
    bool is_llama() const { return rmsnorm() && swiglu() && rope() && !bias; }
    // Throws memtrain::Error naming the offending key when the config is inconsistent or asks
    // for a variant the engine does not implement yet.
    void validate() const;
    // The upper bounds alone (validate() checks them too): for readers that derive sizes from a
    // config before validating the rest of it (the planner's).
    void check_bounds() const;
    // Whether the model splits over `ranks` tensor-parallel ranks (heads, kv heads, MLP hidden
    // and padded vocabulary rows all divisible); an Error naming train.tp and the key otherwise.
    // validate() runs it for a shard's config (tp > 1).
    void validate_tp(int ranks) const;
};

}  // namespace memtrain
