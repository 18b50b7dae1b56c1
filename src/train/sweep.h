// Scaling laws from your own runs: the isoFLOP grid `memtrain sweep` trains, and the loss point
// (N, D, L) of a finished run directory that `memtrain scale --fit` fits (planner/scaling_fit.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/run_config.h"
#include "planner/scaling_fit.h"

namespace memtrain {

// Non-embedding parameters (Kaplan's N: the token table and learned positions left out, which
// dominate small models and buy them little loss).
double non_embedding_params(const ModelConfig& model);

// A finished run: N of its model, D = steps x tokens per step of its newest checkpoint, and
// its validation loss at that step (the trainer evaluates at the last step when data.val is
// set). An Error names the directory and what it lacks.
plan::LossPoint run_loss_point(const std::string& run_dir);

struct SweepRun {
    double flops = 0;  // the budget C = 6 N D this run spends
    int n_layer = 0, n_embd = 0, n_head = 0;
    double params = 0;  // non-embedding N
    int64_t steps = 0;
    double tokens = 0;  // steps x tokens per step
    std::string out_dir;
    RunConfig config;  // `base` with the model, steps, warmup and out_dir of this run
};

// Sizes "LxW" (n_layer x n_embd, heads of 64 dimensions); an Error names a bad one.
std::vector<std::pair<int, int>> parse_sweep_sizes(const std::string& text);
// The isoFLOP grid: every budget with every size, at the steps that spend it (C = 6 N D, D in
// whole steps of `base`'s batch). A run of fewer than `min_steps` steps is left out (and
// `skipped` says which). Each run's warmup is base's, at most a tenth of its steps.
std::vector<SweepRun> plan_sweep(const RunConfig& base, const std::vector<double>& flops,
                                 const std::vector<std::pair<int, int>>& sizes,
                                 const std::string& dir, int min_steps,
                                 std::vector<std::string>* skipped);

}  // namespace memtrain
