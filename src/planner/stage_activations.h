// A pipeline stage's activations as the engine allocates them, for the planner: the trainer's
// stage split (parallel/pipeline/stage_split.h), the trainer's per-block remat plan for the
// planner's recompute option, the arena of the engine that would run the layout
// (model/activation_layout.h: plan_stage_arena), and the micro-batches each rank holds at once
// under the executor's schedule (parallel/pipeline/schedule.h). `memtrain estimate --pp P` prices a
// stage's activations with these, so the planner, `memtrain pipeline` and the pipeline engine
// cannot drift apart (STYLE lesson 2).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "model/activation_layout.h"
#include "model/config.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_split.h"
#include "planner/model_shape.h"
#include "planner/run_layout.h"

namespace memtrain::plan {

// The planner's recompute option as the trainer's per-block plan, one meaning per name: exactly
// the plan `train.remat` of the same name gives (remat::solve_policy of remat::parse_policy):
//   none      -> BlockKeep::All        every saved field kept
//   selective -> BlockKeep::Selective  ln_1, ln_2 and the MLP activation recomputed in backward
//   full      -> BlockKeep::Input      only the block input kept; the block is recomputed
// (The formulas, layer_activation_bytes, read "selective" as Korthikanti's: the attention core
// recomputed. The layout paths, here and planner/rank_layout.h, use this mapping.)
BlockKeep block_keep(Recompute r);
RematPlan remat_plan(Recompute r, int blocks);
// The run's plan: its block_plan when it has one for `blocks` blocks, else r.recompute's.
RematPlan remat_plan(const RunSpec& r, int blocks);
// "full = Input blocks", or for a per-block plan "per block: 2 All, 1 Selective, 3 Input".
std::string remat_label(const RunSpec& r);

// The arena format of the engine that would run `r` for `cfg`: with flash attention the CUDA
// engine's (cuda_arena_format: fused attention keeping the log-sum-exp, 256-byte aligned regions,
// activations of activation_bytes(precision)); without it the CPU engine's layout (attention
// probabilities, or their log-sum-exp under lse_attention; 4-byte alignment) at
// activation_bytes(precision), which for fp32 is exactly cpu_arena_format(cfg).
ActFormat arena_format(const ModelConfig& cfg, const RunSpec& r);

// Whether estimate_memory prices activations with the engine's layout: pipeline layouts
// (pp > 1), and with tp > 1 those the tp x pp mesh runs (uses_engine_layout: sequence
// parallelism included, no dropout or LoRA), whose stages hold arenas of the tensor-parallel
// shard's config; other tensor-parallel pipelines keep Korthikanti's per-layer formulas.
bool uses_stage_layout(const ModelSpec& m, const RunSpec& r);

// One pipeline rank: its chunks (virtual stages rank, rank + pp, ...; one unless interleaved),
// their blocks, and the activation slots it allocates.
struct RankActivations {
    std::vector<int> chunks;           // virtual stages this rank runs
    std::vector<int> first_block;      // per chunk: its first block
    std::vector<int> blocks;           // per chunk: how many blocks
    std::vector<std::size_t> arena;    // per chunk: plan_stage_arena(...).activation_bytes
    std::vector<int> slots;            // per chunk: most of its micro-batches held at once
    int total_blocks = 0;              // over the chunks
    std::size_t bytes = 0;             // sum over chunks of slots x arena
    int total_slots() const;           // over the chunks
    std::string block_ranges() const;  // "0..5" or, interleaved, "0..2,6..8"
};

struct PipelineActivations {
    ModelConfig config;     // config_from_model of the spec
    ActFormat format;       // arena_format
    RematPlan plan;         // remat_plan for the whole model (the trainer slices it per stage)
    pp::StageSplit split;   // split_stages(config, pp x v, micro_batch, seq)
    pp::Schedule schedule;  // make_schedule(schedule, pp, micro_batches, v)
    std::vector<RankActivations> ranks;
};

// Every rank's activations for the pipeline layout of `r` (pp > 1), as the executor allocates
// them (pp::Executor::make_schedule, engine/host_memory.h stage_footprint): each chunk gets as many
// slots as the simulator's most micro-batches in flight on its virtual stage (between F and B, or W
// when the backward is split; at least 1), each slot one plan_stage_arena of the chunk's blocks.
PipelineActivations pipeline_activations(const ModelSpec& m, const RunSpec& r);

}  // namespace memtrain::plan
