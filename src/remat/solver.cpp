// Knapsack DP for budget-optimal recompute schedules (see solver.h and docs/checkpointing.md).
#include "remat/solver.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace memtrain::remat {

const Option& option(const Chain& c, std::size_t l, BlockKeep k) {
    const bool as_input = k == BlockKeep::Offload || rebuilds_input(k);
    return c.blocks[l][static_cast<int>(as_input ? BlockKeep::Input : k)];
}

namespace {

constexpr BlockKeep kKeeps[] = {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input,
                                BlockKeep::Offload};

// Residual streams an Offload set of `n` blocks frees: all but the ring's.
std::size_t offload_saving(const Chain& c, std::size_t n) {
    return (n - std::min<std::size_t>(n, kOffloadSlots)) * c.resid_bytes;
}

}  // namespace

std::size_t peak_bytes(const Chain& chain, const RematPlan& plan) {
    std::size_t sum = chain.fixed_bytes, scratch = 0, offloaded = 0;
    for (std::size_t l = 0; l < plan.size(); l++) {
        sum += option(chain, l, plan[l]).kept_bytes;
        scratch = std::max(scratch, option(chain, l, plan[l]).scratch_bytes);
        offloaded += plan[l] == BlockKeep::Offload;
    }
    sum += scratch;
    // Rebuilt inputs (Segment, Dropped): their streams are not kept; two temporaries and the
    // hold slots are (plan_arena's layout).
    const InputRebuild r = input_rebuild(plan);
    if (r.any) {
        const std::size_t rebuilt = std::count_if(plan.begin(), plan.end(), rebuilds_input);
        sum = sum - rebuilt * chain.resid_bytes + (2 + r.slots) * chain.resid_bytes;
    }
    return sum - offload_saving(chain, offloaded);
}

int64_t recompute_flops(const Chain& chain, const RematPlan& plan) {
    int64_t f = 0;
    for (std::size_t l = 0; l < plan.size(); l++)
        f += option(chain, l, plan[l]).recompute_flops + (plan[l] == BlockKeep::Offload ? 1 : 0);
    // Rebuilding an input re-runs the forwards of blocks [from, block).
    const InputRebuild r = input_rebuild(plan);
    for (std::size_t l = 0; l < plan.size(); l++)
        for (int m = r.from[l]; m >= 0 && m < (int)l; m++)
            f += option(chain, m, BlockKeep::Input).recompute_flops;
    return f;
}

Solution evaluate(const Chain& chain, const RematPlan& plan) {
    return {plan, peak_bytes(chain, plan), recompute_flops(chain, plan)};
}

std::size_t min_feasible_bytes(const Chain& chain) {
    // For each scratch level W, every block takes its smallest option that fits in W.
    std::size_t best = std::numeric_limits<std::size_t>::max();
    for (const auto& b : chain.blocks) {
        for (const auto& level : b) {
            std::size_t W = level.scratch_bytes, sum = chain.fixed_bytes;
            bool ok = true;
            for (const auto& blk : chain.blocks) {
                std::size_t m = std::numeric_limits<std::size_t>::max();
                for (const auto& o : blk)
                    if (o.scratch_bytes <= W) m = std::min(m, o.kept_bytes);
                if (m == std::numeric_limits<std::size_t>::max())
                    ok = false;
                else
                    sum += m;
            }
            if (ok) best = std::min(best, sum + W);
        }
    }
    if (chain.blocks.empty()) best = chain.fixed_bytes;
    if (chain.allow_offload && !chain.blocks.empty()) {
        // Every block offloaded: the least kept, and the most streams freed.
        const RematPlan all(chain.blocks.size(), BlockKeep::Offload);
        best = std::min(best, peak_bytes(chain, all));
    }
    return best;
}

RematPlan chen_plan(std::size_t n, std::size_t K) {
    RematPlan p(n, BlockKeep::Segment);
    for (std::size_t l = 0; l < n; l += K) p[l] = BlockKeep::Input;
    return p;
}

RematPlan memory_poor_plan(std::size_t n) {
    RematPlan p(n, BlockKeep::Dropped);
    if (n > 0) p[0] = BlockKeep::Input;
    return p;
}

std::vector<RematPlan> rebuild_plans(std::size_t n) {
    std::vector<RematPlan> out;
    if (n < 2) return out;
    for (std::size_t K = 2; K <= n; K++) out.push_back(chen_plan(n, K));
    out.push_back(memory_poor_plan(n));
    return out;
}

std::optional<Solution> solve_rebuild(const Chain& chain, std::size_t budget) {
    std::optional<Solution> best;
    for (const RematPlan& p : rebuild_plans(chain.blocks.size())) {
        const Solution s = evaluate(chain, p);
        if (s.peak_bytes > budget) continue;
        if (!best || s.recompute_flops < best->recompute_flops ||
            (s.recompute_flops == best->recompute_flops && s.peak_bytes < best->peak_bytes))
            best = s;
    }
    return best;
}

std::size_t rebuild_floor(const Chain& chain) {
    std::size_t best = std::numeric_limits<std::size_t>::max();
    for (const RematPlan& p : rebuild_plans(chain.blocks.size()))
        best = std::min(best, peak_bytes(chain, p));
    return best;
}

std::optional<Solution> solve_budget(const Chain& chain, std::size_t budget) {
    const std::size_t n = chain.blocks.size();
    if (n == 0) {
        if (chain.fixed_bytes > budget) return std::nullopt;
        return Solution{{}, chain.fixed_bytes, 0};
    }
    // The max-scratch term is not additive, so fix it: for each scratch level W allow only the
    // options whose working set fits in W, and knapsack the kept bytes into budget - fixed - W.
    std::vector<std::size_t> levels;
    for (const auto& b : chain.blocks)
        for (const auto& o : b) levels.push_back(o.scratch_bytes);
    std::sort(levels.begin(), levels.end());
    levels.erase(std::unique(levels.begin(), levels.end()), levels.end());

    // With Offload allowed every block's residual stream joins its weight (an Offload block
    // weighs only its kept bytes, plus a ring slot while fewer than kOffloadSlots are taken), so
    // the weights stay non-negative: base = fixed - n streams, and the DP also tracks how many
    // ring slots are taken (0..kOffloadSlots).
    const bool off = chain.allow_offload && chain.resid_bytes > 0;
    const std::size_t stream = off ? chain.resid_bytes : 0;
    const std::size_t base = chain.fixed_bytes - n * stream;
    const int rings = off ? kOffloadSlots + 1 : 1;
    const int nk = off ? 4 : 3;
    // Weight of option k for block l when `c` ring slots are taken.
    auto weight = [&](std::size_t l, int k, int c) {
        const BlockKeep keep = kKeeps[k];
        const std::size_t kept = option(chain, l, keep).kept_bytes;
        if (keep != BlockKeep::Offload) return kept + stream;
        return kept + (c < kOffloadSlots ? stream : 0);
    };

    std::size_t unit = 0;  // gcd of all weights: the DP over units is then exact
    for (std::size_t l = 0; l < n; l++)
        for (int k = 0; k < nk; k++)
            for (int c = 0; c < rings; c++) unit = std::gcd(unit, weight(l, k, c));
    if (unit == 0) unit = 1;

    std::optional<Solution> best;
    constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
    for (std::size_t W : levels) {
        if (base + W > budget) continue;
        const std::size_t cap_bytes = budget - base - W;
        std::size_t u = unit;
        if (cap_bytes / u > kMaxUnits) u = (cap_bytes + kMaxUnits - 1) / kMaxUnits;
        const std::size_t cap = cap_bytes / u, width = cap + 1;
        // dp[c][j] = least recompute of the blocks so far using exactly j units with c ring
        // slots taken; choice[l] remembers (option, previous c) per state.
        std::vector<int64_t> dp(rings * width, kInf), next(rings * width);
        std::vector<std::vector<int8_t>> choice(n, std::vector<int8_t>(rings * width, -1));
        dp[0] = 0;
        for (std::size_t l = 0; l < n; l++) {
            std::fill(next.begin(), next.end(), kInf);
            for (int k = 0; k < nk; k++) {
                const BlockKeep keep = kKeeps[k];
                const Option& o = option(chain, l, keep);
                if (o.scratch_bytes > W) continue;
                const int64_t cost = o.recompute_flops + (keep == BlockKeep::Offload ? 1 : 0);
                for (int c = 0; c < rings; c++) {
                    const int c2 = keep == BlockKeep::Offload ? std::min(c + 1, rings - 1) : c;
                    const std::size_t w = (weight(l, k, c) + u - 1) / u;  // never over budget
                    if (w > cap) continue;
                    for (std::size_t j = w; j <= cap; j++) {
                        const int64_t from = dp[c * width + j - w];
                        if (from == kInf) continue;
                        if (from + cost < next[c2 * width + j]) {
                            next[c2 * width + j] = from + cost;
                            choice[l][c2 * width + j] = (int8_t)(k * rings + c);
                        }
                    }
                }
            }
            std::swap(dp, next);
        }
        for (int c = 0; c < rings; c++) {
            for (std::size_t j = 0; j <= cap; j++) {
                if (dp[c * width + j] == kInf) continue;
                RematPlan plan(n);
                std::size_t jj = j;
                int cc = c;
                for (std::size_t l = n; l-- > 0;) {
                    const int ch = choice[l][cc * width + jj];
                    const int k = ch / rings, prev = ch % rings;
                    plan[l] = kKeeps[k];
                    jj -= (weight(l, k, prev) + u - 1) / u;
                    cc = prev;
                }
                Solution s = evaluate(chain, plan);
                if (s.peak_bytes <= budget && (!best || s.recompute_flops < best->recompute_flops ||
                                               (s.recompute_flops == best->recompute_flops &&
                                                s.peak_bytes < best->peak_bytes)))
                    best = s;
            }
        }
    }
    return best;
}

}  // namespace memtrain::remat
