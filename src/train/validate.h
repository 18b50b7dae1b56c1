// The run config checked across its keys before anything is planned or allocated, and "auto"
// resolved to this machine's device: the first part of the plan step (train/plan.h). Each check
// fails with one line naming the keys and what would run instead.
#pragma once

#include <string>
#include <vector>

#include "config/run_config.h"
#include "engine/run_plan.h"  // validate_cuda_pipeline

namespace memtrain {

// config/run_config.h's read_run_config, then the checks across keys at the fewest ranks the
// layout runs on (the launcher's world size comes at start-up, where the Trainer checks again):
// what `memtrain train` starts from. "auto" in train.device and train.precision stays as written
// (so --print-config and a checkpoint's memtrain.toml keep it, and a resume on another machine
// resolves it there); the Trainer and plan_run resolve their own copies.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const RunConfig* base = nullptr);

// Replaces "auto" in train.device and train.precision by what this machine runs: cuda and bf16
// where a GPU answers, else cpu, in bf16 where the CPU has bf16 instructions, fp32 elsewhere; and
// sets the model's flags that follow from train (lse_attention, set_cpu_bf16).
void resolve_config(RunConfig& cfg);
// Whether the CPU engine at `precision` stores its saved activations in bf16
// (train.cpu_activations: "auto" follows the precision).
SavedStore cpu_saved_activations(const TrainConfig& train, const std::string& precision);
// The row multiple of train.mlp_tile: under int8 saved fields on the CPU every tile but the last
// must end on the 256-value block grid of each tiled width; 1 otherwise.
int64_t mlp_tile_multiple(const RunConfig& cfg);
// The CPU model's bf16 flags (ModelConfig::cpu_bf16, saved_activations) from cfg.train's device,
// precision and cpu_activations, as resolve_config sets them; both false off the CPU.
void set_cpu_bf16(RunConfig& cfg);
// Every check below, and the model's, optimizer's and sampling keys'.
void validate_config(const RunConfig& cfg);
// What a valid config probably did not mean, one line each (the Trainer prints them as
// warnings): a warmup as long as the run, a pipeline with fewer micro-batches than stages, LoRA
// adapters over a random base.
std::vector<std::string> config_warnings(const RunConfig& cfg);
// train.pp and train.pp_schedule against the world size and the model.
void validate_pipeline(const RunConfig& cfg);
// train.tp against the model, the world size and what it does not combine with yet.
void validate_tp(const RunConfig& cfg);
// train.dp_mode and the parameter server's keys.
void validate_ps(const RunConfig& cfg);
// io.metrics: a plain file name inside io.out_dir, not one of memtrain's own files there.
void validate_metrics_name(const std::string& name);
// optim.state_format, optim.name = "muon" and optim.step_in_backward against the layouts and
// engines they are built for.
void validate_optimizer_layout(const RunConfig& cfg);
// model.dropout against the engines and layouts it is built for.
void validate_dropout(const RunConfig& cfg);
// The [lora] keys and what LoRA runs with.
void validate_lora(const RunConfig& cfg);

}  // namespace memtrain
