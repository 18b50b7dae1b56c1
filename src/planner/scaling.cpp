// Scaling-law arithmetic. All closed forms; tests check them against brute-force minimisation.
#include "planner/scaling.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace memtrain::plan {

namespace {
void check_flops(double flops) {
    if (!(flops > 0) || !std::isfinite(flops))
        fail("compute budget must be a positive number of FLOPs, got {}", flops);
}
}  // namespace

double chinchilla_loss(double n, double d, const ChinchillaFit& f) {
    return f.E + f.A / std::pow(n, f.alpha) + f.B / std::pow(d, f.beta);
}

Allocation chinchilla_optimal(double flops, const ChinchillaFit& f) {
    check_flops(flops);
    double g = std::pow(f.alpha * f.A / (f.beta * f.B), 1.0 / (f.alpha + f.beta));
    Allocation a;
    a.params = g * std::pow(flops / 6.0, f.beta / (f.alpha + f.beta));
    a.tokens = flops / (6.0 * a.params);
    a.loss = chinchilla_loss(a.params, a.tokens, f);
    return a;
}

Allocation chinchilla_20x(double flops, const ChinchillaFit& f) {
    check_flops(flops);
    Allocation a;
    a.params = std::sqrt(flops / 120.0);
    a.tokens = 20.0 * a.params;
    a.loss = chinchilla_loss(a.params, a.tokens, f);
    return a;
}

Allocation kaplan_optimal(double flops, const ChinchillaFit& f) {
    check_flops(flops);
    const double pf_day = 1e15 * 86400.0;
    Allocation a;
    a.params = 1.3e9 * std::pow(flops / pf_day, 0.73);
    a.tokens = flops / (6.0 * a.params);
    a.loss = chinchilla_loss(a.params, a.tokens, f);
    return a;
}

ModelSpec shape_for_params(double params, int seq, int vocab) {
    if (!(params > 0)) fail("parameter count must be positive, got {}", params);
    ModelSpec m;
    m.name = "scaled";
    m.rmsnorm = m.swiglu = m.rope = true;
    m.tied_embeddings = m.attn_bias = m.mlp_bias = m.dropout = false;
    m.vocab_size = vocab;
    m.block_size = seq;
    // 12 L d^2 with d = 128 L (GPT-3 175B has d/L = 128), ignoring the embeddings at first.
    int best_l = 1;
    double best_err = 1e300;
    for (int l = 1; l <= 256; ++l) {
        int d = 128 * l;
        double n = 12.0 * l * d * d + 2.0 * vocab * d;
        double err = std::abs(std::log(n / params));
        if (err < best_err) best_err = err, best_l = l;
    }
    m.n_layer = std::max(2, best_l);
    m.n_embd = 128 * best_l;
    m.n_head = m.n_embd / 128;
    m.n_kv_head = 0;
    return m;
}

}  // namespace memtrain::plan
