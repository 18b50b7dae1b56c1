// Stage balancing by the linear-partition dynamic programme (see stage_split.h).
#include "parallel/pipeline/stage_split.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "model/activation_layout.h"
#include "remat/cost.h"

namespace memtrain::pp {

StageSplit split_stages(const ModelConfig& cfg, int stages, int B, int T) {
    const int L = cfg.n_layer;
    if (stages <= 0) fail("pipeline stages must be positive, got {}", stages);
    if (stages > L)
        fail(
            "{} pipeline stages for {} layers: every stage needs at least one block (lower pp "
            "or pp_virtual)",
            stages, L);
    const double block = (double)remat::block_flops(cfg, B, T).forward();
    const double N = (double)B * T, C = cfg.n_embd;
    // The head: ln_f and the classifier's GEMM (the loss itself is small next to it).
    const double head = remat::kLayerNormFlopsPerElem * N * C + 2 * N * C * cfg.padded_vocab();
    // cost(s, a, b): stage s holding blocks [a, b).
    auto cost = [&](int s, int a, int b) {
        return (b - a) * block + (s == stages - 1 ? head : 0.0);
    };
    // best[s][b]: the smallest possible largest cost of stages 0..s covering blocks [0, b).
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(stages, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> cut(stages, std::vector<int>(L + 1, 0));
    for (int b = 1; b <= L; b++) best[0][b] = cost(0, 0, b);
    for (int s = 1; s < stages; s++)
        for (int b = s + 1; b <= L; b++)
            for (int a = s; a < b; a++) {
                const double v = std::max(best[s - 1][a], cost(s, a, b));
                if (v < best[s][b]) {
                    best[s][b] = v;
                    cut[s][b] = a;
                }
            }
    StageSplit split;
    split.first_block.assign(stages, 0);
    for (int s = stages - 1, b = L; s >= 0; s--) {
        split.first_block[s] = s == 0 ? 0 : cut[s][b];
        b = split.first_block[s];
    }
    for (int s = 0; s < stages; s++) {
        const int a = split.first_block[s], b = s + 1 < stages ? split.first_block[s + 1] : L;
        split.blocks.push_back(b - a);
        split.forward_flops.push_back(cost(s, a, b));
        // What the executor allocates per micro-batch in flight (GPT::stage_arena), no remat.
        split.act_bytes.push_back(
            plan_stage_arena(cfg, b - a, B, T, {}, cpu_arena_format(cfg)).activation_bytes);
    }
    return split;
}

StageCosts stage_costs(const StageSplit& split, double flops_per_s) {
    StageCosts c;
    for (double f : split.forward_flops) {
        const double t = f / flops_per_s;
        c.f.push_back(t);
        c.b.push_back(2 * t);
        c.i.push_back(t);
        c.w.push_back(t);
    }
    return c;
}

}  // namespace memtrain::pp
