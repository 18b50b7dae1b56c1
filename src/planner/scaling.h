// Compute-optimal model size from scaling laws: Chinchilla (Hoffmann et al. 2022, the D = 20N
// rule and the fitted loss L(N, D) = E + A/N^alpha + B/D^beta with its closed-form optimum)
// and Kaplan et al. 2020's allocation for comparison. Compute is C = 6 N D.
#pragma once

#include "planner/model_shape.h"

namespace memtrain::plan {

struct ChinchillaFit {
    double E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28;
};

struct Allocation {
    double params = 0;  // N
    double tokens = 0;  // D
    double loss = 0;    // predicted by the Chinchilla fit at (N, D)
};

double chinchilla_loss(double params, double tokens, const ChinchillaFit& fit = {});
// argmin over N of L(N, C/(6N)): N = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta
// B))^(1/(alpha+beta)).
Allocation chinchilla_optimal(double flops, const ChinchillaFit& fit = {});
// D = 20 N with C = 6 N D: N = sqrt(C / 120).
Allocation chinchilla_20x(double flops, const ChinchillaFit& fit = {});
// Kaplan: N_opt = 1.3e9 * (C in PF-days)^0.73 (non-embedding parameters).
Allocation kaplan_optimal(double flops, const ChinchillaFit& fit = {});

// A GPT-style shape with about `params` parameters (d_model ~ 128 x n_layer, head_dim 128,
// Llama blocks), so the planner can time a model that does not exist yet.
ModelSpec shape_for_params(double params, int seq = 2048, int vocab = 32000);

}  // namespace memtrain::plan
