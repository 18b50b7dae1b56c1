// Knapsack DP for budget-optimal recompute schedules (see solver.h and docs/checkpointing.md).
#include "remat/solver.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace memtrain::remat {

namespace {

const Option& option(const Chain& c, std::size_t l, BlockKeep k) {
    return c.blocks[l][static_cast<int>(k)];
}

constexpr BlockKeep kKeeps[] = {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input};

}  // namespace

std::size_t peak_bytes(const Chain& chain, const RematPlan& plan) {
    std::size_t sum = chain.fixed_bytes, scratch = 0;
    for (std::size_t l = 0; l < plan.size(); l++) {
        sum += option(chain, l, plan[l]).kept_bytes;
        scratch = std::max(scratch, option(chain, l, plan[l]).scratch_bytes);
    }
    return sum + scratch;
}

int64_t recompute_flops(const Chain& chain, const RematPlan& plan) {
    int64_t f = 0;
    for (std::size_t l = 0; l < plan.size(); l++) f += option(chain, l, plan[l]).recompute_flops;
    return f;
}

Schedule evaluate(const Chain& chain, const RematPlan& plan) {
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
    return best;
}

std::optional<Schedule> solve_budget(const Chain& chain, std::size_t budget) {
    const std::size_t n = chain.blocks.size();
    if (n == 0) {
        if (chain.fixed_bytes > budget) return std::nullopt;
        return Schedule{{}, chain.fixed_bytes, 0};
    }
    // The max-scratch term is not additive, so fix it: for each scratch level W allow only the
    // options whose working set fits in W, and knapsack the kept bytes into budget - fixed - W.
    std::vector<std::size_t> levels;
    for (const auto& b : chain.blocks)
        for (const auto& o : b) levels.push_back(o.scratch_bytes);
    std::sort(levels.begin(), levels.end());
    levels.erase(std::unique(levels.begin(), levels.end()), levels.end());

    std::size_t unit = 0;  // gcd of all kept sizes: the DP over units is then exact
    for (const auto& b : chain.blocks)
        for (const auto& o : b) unit = std::gcd(unit, o.kept_bytes);
    if (unit == 0) unit = 1;

    std::optional<Schedule> best;
    constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
    for (std::size_t W : levels) {
        if (chain.fixed_bytes + W > budget) continue;
        const std::size_t cap_bytes = budget - chain.fixed_bytes - W;
        std::size_t u = unit;
        if (cap_bytes / u > kMaxUnits) u = (cap_bytes + kMaxUnits - 1) / kMaxUnits;
        const std::size_t cap = cap_bytes / u;
        // dp[j] = least recompute FLOPs of the blocks so far using exactly j units.
        std::vector<int64_t> dp(cap + 1, kInf), next(cap + 1);
        std::vector<std::vector<int8_t>> choice(n, std::vector<int8_t>(cap + 1, -1));
        dp[0] = 0;
        for (std::size_t l = 0; l < n; l++) {
            std::fill(next.begin(), next.end(), kInf);
            for (int k = 0; k < 3; k++) {
                const Option& o = chain.blocks[l][k];
                if (o.scratch_bytes > W) continue;
                const std::size_t w = (o.kept_bytes + u - 1) / u;  // round up: never over budget
                if (w > cap) continue;
                for (std::size_t j = w; j <= cap; j++) {
                    if (dp[j - w] == kInf) continue;
                    int64_t c = dp[j - w] + o.recompute_flops;
                    if (c < next[j]) {
                        next[j] = c;
                        choice[l][j] = (int8_t)k;
                    }
                }
            }
            std::swap(dp, next);
        }
        for (std::size_t j = 0; j <= cap; j++) {
            if (dp[j] == kInf) continue;
            RematPlan plan(n);
            std::size_t jj = j;
            for (std::size_t l = n; l-- > 0;) {
                int k = choice[l][jj];
                plan[l] = kKeeps[k];
                jj -= (chain.blocks[l][k].kept_bytes + u - 1) / u;
            }
            Schedule s = evaluate(chain, plan);
            if (s.peak_bytes <= budget &&
                (!best || s.recompute_flops < best->recompute_flops ||
                 (s.recompute_flops == best->recompute_flops && s.peak_bytes < best->peak_bytes)))
                best = s;
        }
    }
    return best;
}

}  // namespace memtrain::remat
