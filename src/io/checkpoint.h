// Checkpoints: a directory per save, written under a temporary name and renamed into place, so
// a crash never leaves a half-written checkpoint. It holds
//   model.safetensors           weights with Hugging Face names and shapes: LlamaForCausalLM's
//                               for Llama models, GPT2LMHeadModel's otherwise; a LoRA run
//                               writes its adapters instead, in PEFT's adapter_model.safetensors
//                               and adapter_config.json (io/lora_files.h)
//   config.json                 the matching Hugging Face config (io/hf_weights.h), so
//                               `transformers` can load the folder
//   training_state.safetensors  step, RNG, data position, optimizer step count (metadata)
//   optimizer.RRRRR-of-NNNNN.safetensors
//                               optimizer state (Adam m and v, or SGD momentum) as flat slices
//                               of the parameter layout: one file when every rank holds it
//                               whole, else one per range a rank holds (its ZeRO shard, its
//                               pipeline stage or shard of it, or each chunk of an interleaved
//                               stage); pipelines side by side repeat their ranges, and loading
//                               accepts overlapping files
//   memtrain.toml               the resolved run config
//   tokenizer.json              the run's tokenizer, when it has one
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "io/hf_weights.h"
#include "model/gpt.h"
#include "optim/optimizer.h"

namespace memtrain {

struct TrainState {
    int64_t step = 0;               // optimizer steps completed
    std::array<uint64_t, 4> rng{};  // sampling RNG
    uint64_t data_epoch = 0, data_cursor = 0;
    // fp16's dynamic loss scale and its clean-step count (0: the run has none).
    double loss_scale = 0;
    int64_t loss_scale_clean = 0;
    // optim.step_in_backward_clip = "previous-norm": the last step's global gradient norm, which
    // the next step clips with (0: none, the next step takes the norm pass).
    double clip_norm = 0;
    // What the run trained on, so a resume can tell when it changed (0: not recorded, as in
    // checkpoints of older versions): the training shard's token count and its tokenizer's
    // fingerprint, and the fingerprint of data.tokenizer.
    uint64_t data_tokens = 0, data_fingerprint = 0, tokenizer_fingerprint = 0;
};

// Hugging Face weights of the CPU model (io/hf_weights.h has the store-level functions).
void save_hf_weights(GPT& model, const std::string& path, bool write = true);
void load_hf_weights(GPT& model, const std::string& path);

// The weights a checkpoint holds and the layout its optimizer files are slices of: the whole
// model in Hugging Face files (hf_checkpoint_model), or a LoRA run's adapters in PEFT's.
struct CheckpointModel {
    const ModelConfig& model;
    const ParamLayout& layout;  // of the parameters the optimizer updates
    // Every rank calls save (it may gather); only the one with `root` writes into `dir`.
    std::function<void(const std::string& dir, bool root)> save;
    std::function<void(const std::string& dir)> load;
};
CheckpointModel hf_checkpoint_model(const ModelWeights& weights);

// Writes out_dir/ckpt_<step>/ atomically and points out_dir/latest at it. Returns its path.
// Every rank of `comm` calls it: rank 0 writes the weights and the shared files; each rank
// writes its optimizer shard when the optimizer covers less than the whole layout (ZeRO).
// The files go into .ckpt_<step>.tmp.<pid of rank 0> (a temporary of this writer's own),
// fsynced, and are checked: weights or optimizer state that are not finite are refused (the
// temporary is removed, `latest` stays where it was, an Error names the tensor), as is any
// failure to write (the temporary is removed too). Then the directory is renamed into place,
// `latest` replaced by rename, and out_dir fsynced after each rename.
std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg,
                            const CheckpointModel& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm);
std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg,
                            const ModelWeights& weights, OptimizerState& opt,
                            const TrainState& state, dist::Communicator& comm);
std::string save_checkpoint(const std::string& out_dir, const RunConfig& cfg, GPT& model,
                            Optimizer& opt, const TrainState& state);
// Checkpoint retention (io.keep_last, io.keep_every), by the one process that writes `latest`,
// after a save of step `saved`: of the ckpt_* directories up to that step, all but the newest
// `keep_last` go (the newest is the one just saved, which `latest` names), except those at
// multiples of `keep_every` steps and those holding a file named `keep`. Checkpoints after `saved`
// (an older branch's, when a run resumed an earlier checkpoint) are not this run's to judge. Each
// is renamed to a temporary name before it is removed, so a crash never leaves a half-removed
// checkpoint under a checkpoint's name. Returns the names removed; nothing with keep_last = 0.
std::vector<std::string> prune_checkpoints(const std::string& out_dir, int keep_last,
                                           int keep_every, int64_t saved);
// Whether resuming checkpoint directory `ckpt_dir` (as resolve_checkpoint_dir gives it) into
// `out_dir` continues that checkpoint's own run: its parent is out_dir (a fork goes elsewhere).
bool resumes_in_place(const std::string& ckpt_dir, const std::string& out_dir);
// Accepts a checkpoint directory or an out_dir holding `latest`. `latest` must name a direct
// ckpt_* child of the out_dir (anything else, "../other/ckpt_000002" for one, is refused);
// when it is empty or names a checkpoint that is missing or incomplete (a power cut between
// a rename and its sync), the newest complete ckpt_* is taken instead, with a warning on
// stderr. With `note`, the warning goes there instead.
std::string resolve_checkpoint_dir(const std::string& path, std::string* note = nullptr);
// Reads the run config saved in a checkpoint (at most 1 MiB, its model checked).
RunConfig checkpoint_config(const std::string& dir);
// The training state a checkpoint records (step, RNG, data position, what it trained on),
// without loading anything else.
TrainState checkpoint_state(const std::string& dir);
// Restores weights, optimizer state and the training state; the model's config must match.
// Works at any world size and ZeRO stage: each rank reads the slice of the optimizer files that
// its optimizer covers, whatever layout of files the checkpoint was written with (resharding).
TrainState load_checkpoint(const std::string& dir, const CheckpointModel& weights,
                           OptimizerState& opt);
TrainState load_checkpoint(const std::string& dir, const ModelWeights& weights,
                           OptimizerState& opt);
TrainState load_checkpoint(const std::string& dir, GPT& model, Optimizer& opt);

}  // namespace memtrain
