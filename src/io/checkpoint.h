// Checkpoints: a directory per save, written under a temporary name and renamed into place, so
// a crash never leaves a half-written checkpoint. It holds
//   model.safetensors           weights with Hugging Face GPT-2 names and shapes
//   config.json                 Hugging Face GPT2Config, so `transformers` can load the folder
//   training_state.safetensors  optimizer moments per parameter + step, RNG, data position
//   memtrain.toml               the resolved run config
//   tokenizer.json              the run's tokenizer, when it has one
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "model/gpt.h"
#include "optim/optimizer.h"
#include "train/run_config.h"

namespace memtrain {

struct TrainState {
    int64_t step = 0;               // optimizer steps completed
    std::array<uint64_t, 4> rng{};  // sampling RNG
    uint64_t data_epoch = 0, data_cursor = 0;
};

// Hugging Face weights: wte is written with its real vocab rows only.
void save_hf_weights(const GPT& model, const std::string& path);
// Loads GPT-2 weights by Hugging Face name (with or without the "transformer." prefix);
// every tensor must be present with the expected shape, else an Error names it.
void load_hf_weights(GPT& model, const std::string& path);
std::string hf_config_json(const ModelConfig& cfg);

// Writes out_dir/ckpt_<step>/ atomically and points out_dir/latest at it. Returns its path.
std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg, const GPT& model,
                            Optimizer& opt, const TrainState& state);
// Accepts a checkpoint directory or an out_dir holding `latest`.
std::string resolve_checkpoint_dir(const std::string& path);
// Reads the run config saved in a checkpoint.
RunConfig checkpoint_config(const std::string& dir);
// Restores weights, optimizer state and the training state; the model's config must match.
TrainState load_checkpoint(const std::string& dir, GPT& model, Optimizer& opt);

}  // namespace memtrain
