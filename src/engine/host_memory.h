// The CPU engines' memory, predicted from the config alone, before anything is allocated: the
// model states (whole, or a ZeroStore shard), the frozen base of a LoRA run, and the activation
// arenas of the remat plan, computed by the same layout functions the engines allocate with.
// CpuEngine and LoraEngine report exactly these rows beside what they measured, and the
// Trainer refuses a run whose rows do not fit the host's memory before it allocates.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "engine/engine.h"
#include "model/activation_layout.h"
#include "planner/rank_layout.h"
#include "planner/run_layout.h"

namespace memtrain {

// The footer line every host engine's memory report starts with: the process's peak RSS.
std::string host_rss_line();

// The model-state rows of the memory report for `psi` floats in a ZeroStore at
// cfg.train.zero_stage over `world` ranks: Ψ per state, or the rank's `shard` where the stage
// shards that state. `what` names the floats ("params", "adapters").
std::vector<MemoryPrediction> zero_state_rows(const RunConfig& cfg, std::size_t shard,
                                              std::size_t psi, int world, const std::string& what);

// The rows one rank of a CPU run (data parallel or not, full or LoRA) allocates for
// micro-batches of B x T with `plan`; empty where the engine is another (pipeline stages and
// tensor-parallel groups side by side, a parameter server, the GPU).
std::vector<MemoryPrediction> predict_cpu_memory(const RunConfig& cfg, const RematPlan& plan,
                                                 int rank, int B, int T);

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

// One rank of the CPU mesh engine (train.pp > 1, or tensor-parallel groups side by side): the
// planner's estimate for it (plan::estimate_rank_memory), which prices these layouts with the
// engine's layout functions to the byte (ZB-H1's deferred output gradients among the
// activations, as the engine keeps them); empty where the planner does not price what the
// executor allocates (naive, PipeDream, per-block remat budgets). No workspace row. The Trainer
// checks these rows against the engine's own once it is built.
std::vector<MemoryPrediction> predict_pipeline_memory(const RunConfig& cfg, int rank);

// Fails, naming every category and what would fit instead, when `ranks_on_node` ranks of this
// run need more than host_available_bytes(): `rows` are this rank's, from predict_cpu_memory or,
// on the mesh's engine, predict_pipeline_memory (the run plan's). A no-op without rows.
void check_host_fit(const RunConfig& cfg, const std::vector<MemoryPrediction>& rows, int rank,
                    int ranks_on_node);

}  // namespace memtrain
