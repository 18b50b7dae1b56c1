// The whole configuration of a run: one struct per TOML section, each owned by its component,
// loaded from a TOML file plus `--set section.key=value` overrides. Every key is registered
// once (name, type, default, doc); an unknown key is an error that suggests the nearest one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/lora.h"
#include "optim/optim_config.h"

namespace memtrain {

struct TrainConfig {
    std::string device = "auto";  // "cpu" | "cuda" | "auto" (cuda where a GPU answers)
    // "fp32" | "bf16" | "fp16" | "auto": bf16 on cuda and on a CPU with bf16 instructions
    // (AVX512-BF16 or AMX, kernels/cpu/gemm.h), fp32 on other CPUs.
    std::string precision = "auto";
    int seq_len = 256;         // tokens per sequence (<= model.block_size)
    int batch_size = 8;        // sequences per optimizer step (global batch)
    int64_t batch_tokens = 0;  // alternatively, tokens per step (a multiple of seq_len); 0 = off
    // Sequences per forward/backward on each data-parallel rank; 0 = batch_size / ranks;
    // kAutoMicroBatch ("auto"): the largest that fits, chosen before anything is allocated.
    int micro_batch_size = 0;
    static constexpr int kAutoMicroBatch = -1;
    int max_steps = 200;
    uint64_t seed = 1337;  // weights and data order
    int eval_every = 50;   // steps between validation losses; 0 = only at the end
    int eval_batches = 8;  // micro-batches per validation
    int log_every = 1;
    int threads = 0;             // OpenMP/BLAS threads; 0 = all cores
    std::string remat = "none";  // activation checkpointing policy (remat/policy.h)
    std::string remat_costs =
        "analytic";  // recompute priced by "analytic" FLOPs or "measured" time
    // What the CPU engine keeps for attention's backward: "probs" (B,NH,T,T) or "lse" (B,NH,T),
    // recomputing the probabilities (ModelConfig::lse_attention).
    std::string cpu_attention = "probs";
    // The CPU engine's MLP over row tiles of this many token rows, forward and backward, so a
    // block whose MLP activations are recomputed needs only a tile of them (0: all rows at
    // once; ModelConfig::mlp_tile).
    int mlp_tile = 0;
    // How the CPU engine stores each block's saved activations: "bf16" (rounded where made,
    // half the bytes), "int8" (blocks of 256 with a power-of-two scale, about a quarter),
    // "fp32", or "auto": bf16 under precision = "bf16", else fp32
    // (ModelConfig::saved_activations).
    std::string cpu_activations = "auto";
    int zero_stage =
        0;       // data-parallel sharding (parallel/data/zero_store.h): 0 DDP .. 3 parameters
    int pp = 1;  // pipeline stages (ranks per pipeline; engine/cpu/cpu_engine.h)
    int tp = 1;  // tensor-parallel ranks (Megatron; parallel/tensor/tp.h, engine/cpu/cpu_engine.h)
    // Sequence parallelism over the tensor-parallel group (needs tp > 1 and micro_batch x
    // seq_len divisible by tp): norms and the residual stream hold 1/tp of the token rows.
    bool sequence_parallel = false;
    std::string pp_schedule = "1f1b";  // naive | gpipe | 1f1b | interleaved | zb-h1
                                       // (parallel/pipeline/schedule.h)
    int pp_virtual = 1;  // interleaved: model chunks (virtual stages) per pipeline rank
    // How data-parallel ranks combine gradients: "allreduce" (DDP/ZeRO, parallel/data/zero_store.h)
    // or "ps", a parameter server (engine/cpu/ps_engine.h): the last ps_servers ranks hold the
    // parameters and the optimizer, the others are workers; workers compute on parameters at most
    // ps_staleness optimizer steps old (0: synchronous).
    std::string dp_mode = "allreduce";
    int ps_servers = 1;
    int ps_staleness = 0;
    bool cuda_graphs = false;        // cuda: replay each micro-batch as one captured CUDA graph
    bool offload_optimizer = false;  // cuda: optimizer states and update on the CPU (ZeRO-Offload)
    // "amp": every diagnostics_every steps (and at the run's first), histograms of log2|g| of
    // every parameter tensor's gradient and what fp16 and bf16 would make of them.
    std::string diagnostics = "none";
    int diagnostics_every = 50;
};

struct DataConfig {
    std::string train;      // token shard for training (memtrain tokenize writes train.bin)
    std::string val;        // token shard for validation; empty = no validation
    std::string tokenizer;  // tokenizer used for samples (copied into checkpoints)
};

struct IoConfig {
    std::string out_dir = "out";
    int checkpoint_every = 0;  // steps between checkpoints; 0 = only the final one
    bool save_final = true;
    std::string metrics = "metrics.jsonl";  // inside out_dir
    // Retention (io/checkpoint.h, prune_checkpoints): after each save only the newest keep_last
    // checkpoints stay (0 = all), besides those at multiples of keep_every steps and any with a
    // file named `keep` in it.
    int keep_last = 0;
    int keep_every = 0;
};

struct SampleConfig {
    std::string prompt;   // printed sample at the end of training; empty = start of text
    int max_tokens = 64;  // 0 = no sample
    double temperature = 0.8;
    int top_k = 40;
};

// The divergence guard (train/guard.h, docs/training.md "The divergence guard"): a step whose
// loss or gradient norm is not finite, whose loss is a spike (a robust z-score over the last
// `window` clean steps) or whose gradient norm explodes (a multiple of their median) is undone:
// the run goes back to a snapshot and skips that step's batch; a second one within `window`
// steps also lowers the learning rate for `cooldown` steps; after `max_rollbacks` it gives up.
struct GuardConfig {
    bool enabled = true;
    int window = 50;          // clean steps the median and spread are taken over
    int min_history = 20;     // clean steps before spikes and explosions are judged
    double spike_z = 6;       // a loss this many robust deviations above the median is a spike
    double norm_factor = 10;  // a gradient norm above this multiple of the median explodes
    int snapshot_every = 50;  // steps between rollback snapshots (out_dir/guard_snapshots)
    double lr_factor = 0.5;   // a repeat lowers the learning rate by this factor ...
    int cooldown = 100;       // ... for this many steps
    int max_rollbacks = 5;    // rollbacks in one run before the guard gives up
};

struct RunConfig {
    ModelConfig model;
    TrainConfig train;
    OptimConfig optim;
    DataConfig data;
    IoConfig io;
    SampleConfig sample;
    GuardConfig guard;
    LoraConfig lora;  // model/lora.h: rank 0 = full-parameter training

    // Ranks of this run: set at start-up from the launcher (mpirun), not a TOML key. They form
    // dp() pipelines of train.pp consecutive ranks, or under a parameter server dp() workers and
    // train.ps_servers servers (which take no data). train.batch_size is the global batch;
    // train.micro_batch_size is per data-parallel rank.
    int world = 1;
    bool ps() const { return train.dp_mode == "ps"; }
    // (At least 1, so a config read before the launcher's world size is known still divides.)
    // (train.pp and train.tp are read as at least 1 here: validate_config refuses others, and
    // may ask for dp() before it has.)
    int dp() const {
        const int64_t mesh = (int64_t)std::max(1, train.pp) * std::max(1, train.tp);
        return std::max(1, ps() ? world - train.ps_servers : (int)(world / mesh));
    }
    // The fewest ranks the layout the file asks for runs on (train.pp, or the servers and one
    // worker): the config is checked at that world size until the launcher gives the real one.
    int min_world() const {
        const int64_t n = ps() ? (int64_t)std::max(1, train.ps_servers) + 1
                               : (int64_t)std::max(1, train.pp) * std::max(1, train.tp);
        return (int)std::min<int64_t>(n, INT32_MAX);
    }

    // Sequences per forward/backward on each rank (default: the global batch split over the
    // data-parallel ranks).
    int micro_batch() const {
        return train.micro_batch_size > 0 ? train.micro_batch_size : train.batch_size / dp();
    }
    int accum_steps() const { return train.batch_size / (micro_batch() * dp()); }
    // optim.step_in_backward with one micro-batch per step: no gradient buffer at all (the
    // engine's store and its memory rows both follow this).
    bool no_grad_buffer() const { return optim.step_in_backward && accum_steps() == 1; }
    int64_t tokens_per_step() const { return (int64_t)train.batch_size * train.seq_len; }
    // (Checked across keys, and "auto" resolved, by train/validate.h.)
};

// Reads a TOML file (path may be empty: defaults) and applies "section.key=value" overrides.
// With `base` (a checkpoint's saved config, for --resume) the layers start from it instead of
// the defaults: the file, then the overrides, replace only the keys they set. Relative paths the
// file sets are resolved against the file's directory, those --set gives against the working
// directory (both made absolute). Each key is checked alone; train/validate.h's
// load_run_config also checks them together. `given`, if not null, receives the names of the
// keys the file and the overrides set.
RunConfig read_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const RunConfig* base = nullptr,
                          std::vector<std::string>* given = nullptr);
RunConfig parse_run_config(const std::string& toml_text, const std::string& source_name,
                           const std::vector<std::string>& overrides,
                           const RunConfig* base = nullptr);
// Refuses TOML text that toml++ cannot be trusted with: more than kMaxConfigBytes (1 MiB), a
// dotted key or table name of 32 parts or more, or brackets and braces nested more than 32
// deep (toml++ recurses per part and overflows the stack on a 100 KB file of them). Every TOML
// memtrain reads (a run's config, a checkpoint's memtrain.toml, --set, the planner's model
// files, the report) passes here first. `src` names the text in the error.
void check_toml_text(std::string_view text, const std::string& src);
// The fully resolved config as TOML (saved beside checkpoints; `memtrain train --print-config`)
// and as a compact printout: a line or a few per section, key=value pairs wrapped at `width`.
std::string to_toml(const RunConfig& cfg);
std::string format_table(const RunConfig& cfg, int width = 100);
// One key's value as its TOML literal ("128", "\"/data/train.bin\""); an Error for an
// unknown key.
std::string config_value(const RunConfig& cfg, const std::string& key);
// All registered keys "section.key", for documentation and suggestions.
std::vector<std::string> config_keys();

}  // namespace memtrain
