// The CPU engines' memory, predicted from the plan alone, before anything is allocated: the
// model states (whole, a ZeroStore shard, a tensor-parallel shard, a pipeline stage's units with
// its weight versions, a parameter server's units), the frozen base of a LoRA run, and the
// activation arenas of the remat plan (a pipeline stage's as many as its schedule keeps in
// flight), computed by the same layout functions the engines allocate with. The engines report
// the same rows (CpuEngine over a whole model exactly these; a pipeline stage and a parameter
// server from what they allocated, through the same row builders), and the plan refuses a run
// whose rows do not fit the host's memory before anything is allocated.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/activation_layout.h"
#include "planner/rank_layout.h"
#include "planner/run_layout.h"

namespace memtrain {

// The footer line every host engine's memory report starts with: the process's peak RSS.
std::string host_rss_line();

// The model-state rows of the memory report for the Ψ floats of `layout` in a ZeroStore at
// cfg.train.zero_stage over `world` ranks, on `rank`: Ψ per state, or the rank's shard (cut on
// the state format's grain) where the stage shards that state; the optimizer state in
// cfg.optim.state_format. `what` names the floats ("params", "adapters"). With
// optim.step_in_backward and one micro-batch per step, the gradients are the units' buckets
// (dist::in_backward_grad_floats; `tied_grads`: the layout is the model's, whose head opens the
// tied embedding's).
std::vector<MemoryPrediction> zero_state_rows(const RunConfig& cfg, const ParamLayout& layout,
                                              int world, int rank, const std::string& what,
                                              bool tied_grads = true);

// The rows one rank of a CPU run over a whole model (data parallel or not, full or LoRA, or one
// tensor-parallel group) allocates for micro-batches of B x T with `plan`; empty for the other
// layouts (pipeline stages and tensor-parallel groups side by side, a parameter server: see
// predict_host_memory; the GPU).
std::vector<MemoryPrediction> predict_cpu_memory(const RunConfig& cfg, const RematPlan& plan,
                                                 int rank, int B, int T);

// A pipeline stage's footprint (CpuEngine under EngineKind::Mesh): what its rows are made of.
struct StageFootprint {
    std::string units;              // "h.2..head" (", " between chunks) + " + a copy of wte"
    std::size_t params = 0;         // floats of the stage's units
    std::size_t mirror = 0;         // floats of the tied embedding's copy (last stage)
    std::size_t version_bytes = 0;  // the weight versions beside them (PipeDream, 2BW)
    std::string versions;           // what they add to the formula
    int replicas = 1;               // pipelines side by side
    bool piece = false;             // ZeRO-1: the optimizer updates a piece of the range
    std::size_t updated = 0;        // floats the optimizer updates (the range, or the piece)
    std::size_t state_bytes = 0;    // its optimizer state, in optim.state_format
    std::size_t reduce_buffer = 0;  // floats of the reduce-scattered piece (ZeRO-1)
    std::size_t activations = 0;    // bytes: every chunk's slots of its arena
    std::size_t workspace = 0;      // bytes: every chunk's workspace
    std::string slots;              // "2 x activation_layout(blocks 0..1) + ..."
    bool split_backward = false;    // zero bubble keeps output gradients for W
    int chunks = 1;
    // Tensor-parallel stages: the checkpoint's gathers (a chunk's optimizer state of this shard
    // beside every shard's, or a unit whole beside every shard's piece), bytes; 0 at tp = 1.
    std::size_t gathers = 0;
    int tp = 1;
};
// The checkpoint's gathers on a tensor-parallel rank (TpRangeOptimizer::read_state, the whole-
// weight views): the largest of a range's optimizer state of this shard beside every shard's
// ((1 + tp) x its floats) and of a unit whole beside every shard's piece of it, in bytes, over
// the units [first, last] of each range (`full` the whole model's layout, `shard` this rank's).
std::size_t tp_gather_bytes(const ParamLayout& full, const ParamLayout& shard,
                            const std::vector<std::pair<int, int>>& unit_ranges, int tp);
// The stage's rows from its footprint.
std::vector<MemoryPrediction> stage_memory_rows(const RunPlan& plan, const StageFootprint& f);
// Rank plan.rank's footprint, from the plan: the split of the blocks over the virtual stages,
// the schedule's slots per chunk (pp::simulate, as the executor sizes them), the chunk's arena
// under `remat` for micro-batches of B x T.
StageFootprint stage_footprint(const RunPlan& plan, const RematPlan& remat, int B, int T);

// A parameter-server rank's rows (engine/cpu/ps_engine.h): a server's `server_floats` of units,
// their gradient sum, optimizer state, a push buffer and the published versions in flight; a
// worker's whole replica, gradients and arenas (no optimizer state).
std::vector<MemoryPrediction> ps_memory_rows(const RunPlan& plan, const RematPlan& remat,
                                             bool server, std::size_t server_floats, int B, int T);

// The rows rank plan.rank of a CPU run allocates for micro-batches of B x T under `remat`,
// whichever engine the plan names (empty on the GPU).
std::vector<MemoryPrediction> predict_host_memory(const RunPlan& plan, const RematPlan& remat,
                                                  int B, int T);

// The planner's description of this run (`memtrain estimate` with the same layout): tp and
// sequence parallelism, pp and its schedule, dp, the ZeRO stage, offload, precision, optimizer,
// micro-batching and the remat policy (whole-model policies; per-block schedules such as every:K
// are priced by the engine's own layout only), for an engine whose arena has `format` (flash
// attention = fused).
plan::RunSpec planner_run_spec(const RunConfig& cfg, const ActFormat& format);
// Where job rank `rank` sits in the planner's layout: a pipeline's stage and replica (job rank =
// pipeline x pp + stage), a data-parallel rank's replica; tensor-parallel ranks are alike.
plan::RankCoord planner_rank(const RunConfig& cfg, int rank);

// The bytes this process may still allocate: the kernel's MemAvailable, or less under a cgroup
// memory limit. MEMTRAIN_HOST_MEMORY (bytes, or with a suffix such as 8GiB) replaces it, for
// tests and for running beside other jobs.
std::size_t host_available_bytes();

// One rank of the CPU mesh (train.pp > 1, or tensor-parallel groups side by side): the planner's
// estimate for it (plan::estimate_rank_memory), which prices these layouts with the engine's
// layout functions to the byte (ZB-H1's deferred output gradients among the activations, as the
// engine keeps them); empty where the planner does not price what the executor allocates
// (naive, PipeDream, per-block remat budgets). No workspace row. The plan's rows are
// stage_footprint's; tests check the planner against the engine.
std::vector<MemoryPrediction> predict_pipeline_memory(const RunConfig& cfg, int rank);

// Fails, naming every category and what would fit instead, when `ranks_on_node` ranks of the run
// need more than host_available_bytes(): the plan's rows are this rank's (predict_host_memory).
// A no-op without rows.
void check_host_fit(const RunPlan& plan, int ranks_on_node);

}  // namespace memtrain
