// LoRA adapters on disk in the layout the PEFT library reads and writes: adapter_config.json and
// adapter_model.safetensors with tensors "base_model.model.<module>.lora_A.weight" (r, in) and
// ".lora_B.weight" (out, r), <module> the Hugging Face module path (GPT2LMHeadModel's
// "transformer.h.0.attn.c_attn", LlamaForCausalLM's "model.layers.0.self_attn.q_proj"). A LoRA
// run's checkpoint holds these instead of model.safetensors; the base is the run's
// model.init_from (or its seeded initialisation), named in memtrain.toml.
#pragma once

#include <string>
#include <vector>

#include "config/run_config.h"
#include "model/lora.h"
#include "model/unit_store.h"
#include "model/weights.h"

namespace memtrain {

// The PEFT name of an adapter tensor of `layout` (a tensor name of LoraLayout::params).
std::string peft_tensor_name(const ModelConfig& cfg, const std::string& tensor);
std::string adapter_config_json(const RunConfig& cfg, const LoraLayout& layout);

// Writes DIR/adapter_model.safetensors and DIR/adapter_config.json from the adapters' store.
// Every rank calls it (under ZeRO-3 the units are gathered); only `write` writes.
void save_lora_adapters(const std::string& dir, const RunConfig& cfg, const LoraLayout& layout,
                        WeightWindow& store, bool write);
// Loads every adapter tensor by its PEFT name from DIR/adapter_model.safetensors (or the file
// itself), checking shapes; an Error names a missing or misshapen tensor.
void load_lora_adapters(const std::string& path, const ModelConfig& cfg, const LoraLayout& layout,
                        WeightWindow& store);
// Whether `dir` holds LoRA adapters (adapter_model.safetensors).
bool has_lora_adapters(const std::string& dir);

// The merged model of a LoRA checkpoint into `weights` (a whole model of `cfg.model`): the base
// from cfg.model.init_from or seeded with cfg.train.seed (for QLoRA: as its quantized form
// decodes), plus scale * B A of every adapter.
void load_merged_lora_model(const std::string& ckpt_dir, const RunConfig& cfg,
                            const ModelWeights& weights);

}  // namespace memtrain
