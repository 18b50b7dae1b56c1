// How a model is cut into pipeline stages, and what each stage costs: contiguous runs of blocks,
// the embedding on the first stage and the head (ln_f, classifier and loss) on the last,
// balanced so the slowest stage is as fast as it can be. Costs are the remat cost model's FLOPs
// (remat/cost.h) and bytes come from the activation layout the engine allocates with, so
// `memtrain pipeline`, the planner and the executor price a stage the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain::pp {

struct StageSplit {
    std::vector<int> first_block;       // per virtual stage: its first block; blocks [first, next)
    std::vector<int> blocks;            // per virtual stage: how many blocks
    std::vector<double> forward_flops;  // per virtual stage, one micro-batch
    // Per virtual stage: the activations one micro-batch in flight keeps, plan_stage_arena's
    // bytes (what the CPU executor allocates per slot without remat).
    std::vector<std::size_t> act_bytes;
};

// Splits cfg's blocks over `stages` virtual stages (at least one block each) for micro-batches
// of B x T tokens, minimising the largest stage cost. Refuses more stages than blocks.
StageSplit split_stages(const ModelConfig& cfg, int stages, int B, int T);

// Per-stage costs for the simulator: forward, backward = 2 x forward, and its split into equal
// input- and weight-gradient halves, in seconds at `flops_per_s`.
StageCosts stage_costs(const StageSplit& split, double flops_per_s);

}  // namespace memtrain::pp
