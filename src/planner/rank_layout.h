// One rank's model states and activations as the CPU engines allocate them, for the planner:
// the parameter layout (model/param_layout.h: make_param_layout, of the tensor-parallel shard's
// config under tp), a pipeline stage's units (the trainer's split, parallel/pipeline/stage_split.h,
// as CpuEngine hands them to its StageStore), the balanced ZeRO shard (dist::shard_ranges) and
// the activation arena (model/activation_layout.h: plan_arena). `memtrain estimate` prices every
// layout the engines run with these, so the planner and the engines cannot drift apart
// (STYLE lesson 2); Korthikanti's formulas (planner/memory_model.h) remain for the rest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/config.h"
#include "parallel/pipeline/stage_split.h"
#include "planner/model_shape.h"
#include "planner/run_layout.h"

namespace memtrain::plan {

// Which rank of a layout: its pipeline stage (0 .. pp-1) and its data-parallel replica
// (0 .. dp-1). Tensor-parallel ranks of memtrain's layout all hold the same amounts.
struct RankCoord {
    int stage = 0;
    int replica = 0;
};

// Whether `r` is priced by the engines' layout functions: the layouts the CPU engines run
// (tensor parallelism, with or without sequence parallelism, pipelines, both (the tp x pp x dp
// mesh), side by side, any ZeRO stage the shard table prices) for a model the trainer's config
// expresses (no dropout masks; biases on every linear layer or none; tp dividing heads, kv
// heads, MLP and vocabulary), trained in full (no LoRA). Sequence parallelism needs each
// micro-batch's tokens divisible by tp, as the trainer does.
bool uses_engine_layout(const ModelSpec& m, const RunSpec& r);
// Whether the trainer runs sequence parallelism for r's tp and micro-batch (whatever
// r.sequence_parallel says): tp > 1 with each micro-batch's tokens divisible by tp
// (RunConfig::validate_tp), so every rank holds as many rows.
bool sequence_parallel_runs(const ModelSpec& m, const RunSpec& r);

// Whether `r`'s activations are the engine's arena (plan_arena, arena_activation_bytes): the
// layouts above, and LoRA on a whole model (tp = pp = 1) the trainer expresses. Only models the
// trainer cannot express (dropout masks) are left to the per-layer formulas, so each remat name
// means the trainer's policy wherever the trainer could run the layout.
bool uses_engine_arena(const ModelSpec& m, const RunSpec& r);

// The trainer's config of `m` as one tensor-parallel rank holds it (ModelConfig::tp = r.tp,
// ModelConfig::sequence_parallel = r.sequence_parallel under tp).
ModelConfig rank_config(const ModelSpec& m, const RunSpec& r);

// Element counts of one rank's model states (before bytes per element).
struct RankStates {
    int64_t params = 0;     // floats this rank computes with: the tp shard's, or the stage's
                            // units plus, on a pipeline's last stage, a copy of a tied embedding
    int64_t optimized = 0;  // of which the optimizer updates (the copy has no state): what ZeRO
                            // shards over the replicas
    int64_t shard = 0;      // this replica's piece of `optimized` (dist::shard_ranges)
    // Gradients ZeRO-1 in the pipeline engine (pipelines, or tp stages, side by side) keeps
    // beside the stage's full ones: the reduce-scattered piece its optimizer reads.
    int64_t reduce_buffer = 0;
    std::string source;  // how they were counted, for the table
};
// `split`: the trainer's split of a pipeline when the caller has it (PipelineActivations::split),
// else computed here.
RankStates rank_states(const ModelSpec& m, const RunSpec& r, RankCoord at,
                       const pp::StageSplit* split = nullptr);

// Activation bytes of one rank without a pipeline: plan_arena of rank_config for a micro-batch
// under remat_plan(r.recompute) in the format of the engine that would run it (arena_format).
// Pipelines: planner/stage_activations.h.
std::size_t arena_activation_bytes(const ModelSpec& m, const RunSpec& r);

}  // namespace memtrain::plan
