// Hugging Face model files in and out: the tensor names and layouts of GPT2LMHeadModel and
// LlamaForCausalLM, one safetensors file or the shards a model.safetensors.index.json names, and
// the config.json beside them. One table (hf_pieces) says where every Hugging Face tensor lives
// in memtrain's parameter layout; import and export both read it, so they cannot disagree.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"

namespace memtrain::data {
class Tokenizer;
}

namespace memtrain {

// The safetensors files of one model: a single file, or the shards of an index.
class HfTensorSource {
  public:
    // `path`: a model directory (holding model.safetensors or model.safetensors.index.json), a
    // .safetensors file, or a model.safetensors.index.json file. Errors name the file at fault.
    static HfTensorSource open(const std::string& path);
    const std::string& path() const { return path_; }
    bool has(std::string_view name) const { return where_.count(name) != 0; }
    // Every tensor name, sorted.
    std::vector<std::string> names() const;
    // Tensor `name` (F32, BF16 or F16 on disk) as fp32 into `out`; it must have `shape`.
    void read(std::string_view name, std::span<float> out, std::span<const int64_t> shape) const;

  private:
    std::string path_;
    std::vector<io::SafetensorsFile> files_;
    std::map<std::string, std::size_t, std::less<>> where_;  // tensor name -> index in files_
};

// Which names a file uses: GPT-2's (wte.weight, h.0.attn.c_attn.weight, ...; also under a
// "transformer." prefix) or Llama's (model.embed_tokens.weight, model.layers.0.self_attn...).
enum class HfNaming { Gpt2, Llama };
// Llama names for models that are exactly Llama (ModelConfig::is_llama()), GPT-2's otherwise.
HfNaming hf_naming(const ModelConfig& cfg);

// One Hugging Face tensor and where its values sit in memtrain's layout. memtrain keeps linear
// weights as (in, out) (GPT-2's Conv1D) with q, k, v fused in c_attn and gate, up fused in
// c_fc; nn.Linear (Llama) stores (out, in). A transposed piece is columns [col0, col0 + rows)
// of memtrain's (in, out) tensor `ours`, stored transposed as (rows, in). A plain piece is the
// first `rows` rows of `ours` (the real vocabulary of a padded embedding, or all of it).
struct HfPiece {
    std::string name;            // Hugging Face name
    std::vector<int64_t> shape;  // Hugging Face shape
    std::string ours;            // memtrain tensor name
    bool transposed = false;
    int64_t col0 = 0;  // transposed pieces: first column of `ours`
};
// Every tensor of the model under `naming`, in the order a writer stores them (unit order).
std::vector<HfPiece> hf_pieces(const ModelConfig& cfg, HfNaming naming);

// Writes the model's weights as one safetensors file with Hugging Face names (Llama names for
// Llama models, GPT-2's otherwise; wte and lm_head with their real vocabulary rows only). Goes
// unit by unit through the store, so a ZeRO-3 run never holds more than one unit whole; every
// rank must call it (the gathers are collectives) and only the one with `write` writes.
void save_hf_weights(const ModelWeights& weights, const std::string& path, bool write = true);
// Loads weights by Hugging Face name from `path` (as HfTensorSource::open takes it), GPT-2 or
// Llama names, F32/BF16/F16; every tensor must be there with the expected shape, else an Error
// names it. Every rank reads and keeps what its store holds. With `refuse_unused`, a source
// holding tensors the model does not use (the blocks of a deeper model, an untied lm_head for a
// tied one) is refused, naming them; the buffers Hugging Face files carry beside the weights
// (GPT-2's attn.bias/masked_bias masks, rotary inv_freq, the tied copy of lm_head) are not
// tensors of a model.
void load_hf_weights(const ModelWeights& weights, const std::string& path,
                     bool refuse_unused = false);

// config.json for the model: GPT2Config for GPT-2, LlamaConfig for Llama (both load in
// `transformers`), and a memtrain-specific record for the variants between them.
std::string hf_config_json(const ModelConfig& cfg);
// The same with the token ids `transformers` generates with: eos_token_id the tokenizer's end of
// text, bos_token_id the token its post-processor puts first (Llama 3's <|begin_of_text|>) or,
// as GPT-2's config has it, the end of text. `tokenizer` as data::Tokenizer::load takes it; empty:
// no ids.
std::string hf_config_json(const ModelConfig& cfg, const std::string& tokenizer);
std::string hf_config_json(const ModelConfig& cfg, const data::Tokenizer& tokenizer);
// The model a config.json describes: model_type "gpt2", "llama" or memtrain's
// "memtrain-llama-style". Anything else (mixtures of experts, other families, RoPE scaling) is
// refused with a message naming the key.
ModelConfig model_config_from_hf(const std::string& config_json_path);

}  // namespace memtrain
