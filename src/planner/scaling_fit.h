// Scaling laws fitted to your own runs: L(N, D) = E + A / N^alpha + B / D^beta by Chinchilla's
// third approach (Hoffmann et al. 2022, section 3.3 and appendix D.2): the Huber loss (delta =
// 1e-3) of log L against the log of the prediction, written as LSE(a - alpha log N, b - beta log
// D, e) with A = exp(a), B = exp(b), E = exp(e), minimised by L-BFGS from a grid of starts, the
// best kept. Confidence intervals come from a bootstrap over the points.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/scaling.h"

namespace memtrain::plan {

// One training run: N parameters, D tokens trained on, its final loss.
struct LossPoint {
    double params = 0, tokens = 0, loss = 0;
    std::string origin;  // the run directory, for messages
};

struct FitOptions {
    double huber_delta = 1e-3;
    int bootstrap = 200;  // resamples for the intervals (0: none)
    uint64_t seed = 1;    // of the resampling
};

// A 95% interval (2.5th and 97.5th percentiles of the bootstrap fits).
struct Interval {
    double lo = 0, hi = 0;
};

struct ScalingLawFit {
    ChinchillaFit law;
    double objective = 0;  // the Huber sum at the optimum
    int points = 0;
    // Bootstrap intervals of E, A, B, alpha, beta (empty without a bootstrap).
    Interval E, A, B, alpha, beta;
    // The fits of the resamples (for the intervals of anything derived from the law).
    std::vector<ChinchillaFit> resamples;
};

// The 2.5th and 97.5th percentiles of `v` (non-empty), interpolated.
Interval percentile_interval(std::vector<double> v);

// Fits the law to `points` (at least 5, with at least 2 distinct N and 2 distinct D, all
// positive and finite: an Error names the first that is not).
ScalingLawFit fit_scaling_law(const std::vector<LossPoint>& points, const FitOptions& opts = {});

}  // namespace memtrain::plan
