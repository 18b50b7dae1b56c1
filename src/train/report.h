// The report step: the end-of-run memory breakdown, measured beside the plan's rows (decided
// before the engine allocated) and what the engine sized once built (the GPU's ZeRO-2/3
// buckets), every rank's peak model states and activations, and the planner's estimate of the
// same layout. io/run_report.h turns a run's files into one HTML page.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "planner/memory_model.h"

namespace memtrain {

// The planner's estimate of the run's layout (plan::estimate_rank_memory for rank 0), with the
// engine's per-block remat plan: the report's "planner estimate" line, equal to the predicted
// rows for every layout the planner prices with the engines' layout functions.
plan::MemoryEstimate planner_estimate(const RunConfig& cfg, const Engine& engine);

// The predicted rows: the plan's, then what the engine sized once built; the engine's own where
// the plan has none or `plan_rows` is false (a test's engine).
std::vector<MemoryPrediction> report_rows(const RunPlan& plan, const Engine& engine,
                                          bool plan_rows = true);
// The report's text on rank 0, "" on the others. A collective over `comm`: every rank sends its
// peaks.
std::string memory_report(const RunPlan& plan, Engine& engine, dist::Communicator& comm,
                          bool plan_rows = true);

// The same, as memory.json for `memtrain report` (io/run_report.h): measured peaks beside the
// predicted rows and the planner's estimate.
void write_memory_json(const RunPlan& plan, Engine& engine, const std::string& path,
                       bool plan_rows = true);

}  // namespace memtrain
