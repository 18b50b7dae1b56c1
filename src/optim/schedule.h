// Learning-rate schedules and batch-size LR scaling rules, as pure functions of the step.
#pragma once

#include <cstdint>

#include "optim/optim_config.h"

namespace memtrain {

// Peak LR after the batch-size scaling rule: linear (Goyal et al.) multiplies by
// batch/reference, sqrt (Krizhevsky; Malladi et al. for Adam) by sqrt(batch/reference).
double scaled_peak_lr(const OptimConfig& cfg, int64_t batch_tokens);

// LR at 0-based `step` of `total_steps`: linear warmup to the peak over warmup_steps
// (peak * (step+1) / warmup), then constant, cosine decay to min_lr_ratio * peak, or
// warmup-stable-decay with a linear or 1-sqrt cooldown over the last decay_fraction of steps.
double lr_at(const OptimConfig& cfg, double peak_lr, int64_t step, int64_t total_steps);

}  // namespace memtrain
