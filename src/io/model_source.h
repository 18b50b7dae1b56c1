// What `memtrain sample` and `memtrain eval` read a model from: a memtrain checkpoint (or an
// out_dir whose `latest` names one) or a Hugging Face model directory (config.json, one or
// sharded safetensors files, tokenizer files), resolved to one description.
#pragma once

#include <optional>
#include <string>

#include "config/run_config.h"
#include "model/config.h"
#include "model/weights.h"

namespace memtrain {

struct ModelSource {
    std::string dir;               // the directory the model was read from
    ModelConfig model;             // its architecture
    std::string weights;           // for load_hf_weights: a safetensors file or an index
    std::string tokenizer;         // tokenizer.json, or a directory with encoder.json + vocab.bpe;
                                   // empty when the directory has neither
    std::optional<RunConfig> run;  // the run config of a memtrain checkpoint
    bool lora = false;             // a LoRA run's checkpoint: adapters over run->model.init_from
};

ModelSource open_model_source(const std::string& path);
// The source's weights into a whole model of src.model; a LoRA checkpoint's adapters are merged
// into its base (io/lora_files.h). `refuse_unused` as load_hf_weights takes it.
void load_source_weights(const ModelSource& src, const ModelWeights& weights,
                         bool refuse_unused = false);

// model.init_from's weights into a model of weights.cfg: a directory as open_model_source reads
// it (a memtrain checkpoint, an out_dir with `latest`, a Hugging Face model directory; a LoRA
// checkpoint merged into its base), or a .safetensors file or index. Unless `partial`, a source
// holding tensors the model does not use is refused (load_hf_weights).
void load_init_weights(const ModelWeights& weights, const std::string& path, bool partial);
// The architecture of model.init_from's directory (its memtrain.toml's or config.json's model),
// for a config that gives no [model]: init_from and init_partial as `cfg` has them.
ModelConfig init_source_model(const ModelConfig& cfg);

}  // namespace memtrain
