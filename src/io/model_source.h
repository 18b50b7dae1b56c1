// What `memtrain sample` and `memtrain eval` read a model from: a memtrain checkpoint (or an
// out_dir whose `latest` names one) or a Hugging Face model directory (config.json, one or
// sharded safetensors files, tokenizer files), resolved to one description.
#pragma once

#include <optional>
#include <string>

#include "model/config.h"
#include "train/run_config.h"

namespace memtrain {

struct ModelSource {
    std::string dir;               // the directory the model was read from
    ModelConfig model;             // its architecture
    std::string weights;           // for load_hf_weights: a safetensors file or an index
    std::string tokenizer;         // tokenizer.json, or a directory with encoder.json + vocab.bpe;
                                   // empty when the directory has neither
    std::optional<RunConfig> run;  // the run config of a memtrain checkpoint
};

ModelSource open_model_source(const std::string& path);

}  // namespace memtrain
