// Knapsack DP for budget-optimal recompute schedules (see solver.h and docs/checkpointing.md).
#include "remat/solver.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace memtrain::remat {

const Option& option(const Chain& c, std::size_t l, BlockKeep k) {
    const bool as_input = k == BlockKeep::Offload || rebuilds_input(k);
    return c.blocks[l][static_cast<int>(as_input ? BlockKeep::Input : k)];
}

int64_t rebuild_flops(const Chain& c, std::size_t l) {
    return c.forward_flops.empty() ? option(c, l, BlockKeep::Input).recompute_flops
                                   : c.forward_flops.at(l);
}

namespace {

constexpr BlockKeep kKeeps[] = {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input,
                                BlockKeep::Offload};

// Whether s beats the best so far: less recompute, then the smaller peak.
bool better(const Solution& s, const std::optional<Solution>& best) {
    return !best || s.recompute_flops < best->recompute_flops ||
           (s.recompute_flops == best->recompute_flops && s.peak_bytes < best->peak_bytes);
}

// The distinct scratch sizes of the chain's options, ascending: the levels the max-scratch term
// of the peak can take, which the solvers fix one at a time.
std::vector<std::size_t> scratch_levels(const Chain& chain) {
    std::vector<std::size_t> levels;
    for (const auto& b : chain.blocks)
        for (const auto& o : b) levels.push_back(o.scratch_bytes);
    std::sort(levels.begin(), levels.end());
    levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
    return levels;
}

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
        for (int m = r.from[l]; m >= 0 && m < (int)l; m++) f += rebuild_flops(chain, m);
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

namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max() / 4;  // sums of two stay finite

// The backward between two kept inputs. Reversal(a, b, c): the least rebuild forwards that run
// the backward of blocks [a, b) when block a's input is available, the inputs of (a, b) are not,
// and c hold slots are free. The rebuild before block b-1's backward re-runs the forward from a
// and either holds nothing (then [a, b-1) is left, with c slots) or first holds the input of some
// k in (a, b-1), which stays until block k's backward (then [k, b) with c - 1 slots, and after
// it [a, k) with c again). Every schedule of rebuilds from the nearest available input is one
// of these (the rightmost held input below the backward is where the next rebuild starts), so
// the recursion is exact; on equal costs of one block it is Griewank's binomial reversal.
class Reversals {
  public:
    Reversals(const Chain& chain, int slots) : n_((int)chain.blocks.size()), c_(slots) {
        prefix_.assign(n_ + 1, 0);
        for (int l = 0; l < n_; l++) prefix_[l + 1] = prefix_[l] + rebuild_flops(chain, l);
        const std::size_t cells = (std::size_t)(c_ + 1) * (n_ + 1) * (n_ + 1);
        cost_.assign(cells, 0);
        split_.assign(cells, -1);
        for (int c = 0; c <= c_; c++)
            for (int len = 2; len <= n_; len++)
                for (int a = 0; a + len <= n_; a++) {
                    const int b = a + len;
                    int64_t best = sweep(a, b - 1) + cost(a, b - 1, c);
                    int split = -1;
                    for (int k = a + 1; c > 0 && k < b - 1; k++) {
                        const int64_t v = sweep(a, k) + cost(k, b, c - 1) + cost(a, k, c);
                        if (v < best) best = v, split = k;
                    }
                    cost_[at(a, b, c)] = best;
                    split_[at(a, b, c)] = split;
                }
    }
    int64_t cost(int a, int b, int c) const { return cost_[at(a, b, c)]; }
    // Whether c slots do better than c - 1 somewhere (beyond that, slots only cost memory).
    bool helps(int c) const {
        for (int a = 0; a < n_; a++)
            for (int b = a + 2; b <= n_; b++)
                if (cost(a, b, c) < cost(a, b, c - 1)) return true;
        return false;
    }
    // Marks the Segment blocks of the reversal's schedule and which rebuild holds each.
    void schedule(int a, int b, int c, RematPlan& plan) const {
        while (b - a > 1) {
            const int k = split_[at(a, b, c)];
            if (k < 0) {
                b--;
                continue;
            }
            plan[k] = BlockKeep::Segment;
            plan.hold_by[k] = b - 1;
            schedule(k, b, c - 1, plan);
            b = k;
        }
    }

  private:
    std::size_t at(int a, int b, int c) const {
        return ((std::size_t)c * (n_ + 1) + a) * (n_ + 1) + b;
    }
    int64_t sweep(int a, int b) const { return prefix_[b] - prefix_[a]; }
    int n_, c_;
    std::vector<int64_t> prefix_, cost_;
    std::vector<int> split_;
};

// The most slots a reversal table of n blocks is built for: about 2^24 cells (a few hundred MiB
// at 1000 blocks, nothing below 200). More slots than that are not tried: still feasible plans,
// possibly short of the optimum on chains far deeper than any model's.
int table_slots(int n) {
    const std::size_t per_slot = (std::size_t)(n + 1) * (n + 1);
    return (int)std::max<std::size_t>(1, (std::size_t{1} << 24) / per_slot) - 1;
}

// Whether every block of the chain prices its options alike (every model's chain: the blocks of
// a transformer share one shape).
bool uniform(const Chain& chain) {
    for (std::size_t l = 0; l < chain.blocks.size(); l++)
        if (rebuild_flops(chain, l) != rebuild_flops(chain, 0)) return false;
    for (const auto& b : chain.blocks)
        for (int k = 0; k < 3; k++) {
            const Option &o = b[k], &f = chain.blocks[0][k];
            if (o.kept_bytes != f.kept_bytes || o.scratch_bytes != f.scratch_bytes ||
                o.recompute_flops != f.recompute_flops)
                return false;
        }
    return true;
}

// The plan of kept inputs `kept` (ascending, starting at 0) with options `keep`, and the
// reversals between them at `slots`.
RematPlan rebuild_plan(const Reversals& rev, int n, int slots, const std::vector<int>& kept,
                       const std::vector<BlockKeep>& keep) {
    RematPlan plan(n, BlockKeep::Dropped);
    plan.hold_by.assign(n, -1);
    for (std::size_t i = 0; i < kept.size(); i++) {
        plan[kept[i]] = keep[i];
        rev.schedule(kept[i], i + 1 < kept.size() ? kept[i + 1] : n, slots, plan);
    }
    if (std::count(plan.begin(), plan.end(), BlockKeep::Segment) == 0) plan.hold_by.clear();
    return plan;
}

// Bytes every rebuild plan with `slots` hold slots and scratch level W pays beyond its blocks:
// ln_f, the last stream, the two temporaries and the slots (chain.fixed_bytes counts n + 1
// streams; each kept input adds its own back).
std::size_t rebuild_base(const Chain& chain, int slots, std::size_t W) {
    const std::size_t n = chain.blocks.size(), stream = chain.resid_bytes;
    return chain.fixed_bytes - n * stream + (2 + (std::size_t)slots) * stream + W;
}

// Chains whose blocks are alike: which blocks keep their input and what the reversals cost does
// not depend on the options of the kept blocks, so for every slot count the least reversal cost
// of each number of kept inputs is one DP over positions, and the options are counts.
std::optional<Solution> solve_rebuild_uniform(const Chain& chain, std::size_t budget,
                                              int max_slots) {
    const int n = (int)chain.blocks.size();
    const auto& o = chain.blocks[0];
    const std::size_t stream = chain.resid_bytes, W = o[2].scratch_bytes;
    const std::size_t kI = o[2].kept_bytes;
    const std::size_t row = (std::size_t)n + 1;
    std::optional<Solution> best;
    const Reversals rev(chain, max_slots);
    for (int C = 0; C <= max_slots; C++) {
        if (C > 0 && !rev.helps(C)) break;
        const std::size_t base = rebuild_base(chain, C, W);
        if (base > budget) break;
        // P[b][k]: least reversal cost of blocks [0, b) with b kept and k inputs kept in [0, b].
        std::vector<int64_t> P((std::size_t)n * row, kNever);
        std::vector<int> from((std::size_t)n * row, -1);
        P[1] = 0;
        for (int b = 1; b < n; b++)
            for (int k = 2; k <= b + 1; k++)
                for (int a = k - 2; a < b; a++) {
                    const int64_t v = P[a * row + k - 1];
                    if (v >= kNever) continue;
                    const int64_t w = v + rev.cost(a, b, C);
                    if (w < P[b * row + k]) P[b * row + k] = w, from[b * row + k] = a;
                }
        // The least (recompute, bytes) over k kept inputs (n - k rebuilt) and the counts of kept
        // blocks that keep all or selective fields; one plan built for it.
        int64_t least = kNever;
        std::size_t least_bytes = 0;
        int at_k = 0, at_last = 0, at_A = 0, at_S = 0;
        for (int k = 1; k < n; k++) {
            int64_t rev_cost = kNever;
            int last = -1;
            for (int a = k - 1; a < n; a++) {
                const int64_t v = P[a * row + k];
                if (v < kNever && v + rev.cost(a, n, C) < rev_cost)
                    rev_cost = v + rev.cost(a, n, C), last = a;
            }
            if (last < 0) continue;
            for (int nA = 0; nA <= k; nA++)
                for (int nS = 0; nA + nS <= k; nS++) {
                    const std::size_t bytes =
                        base + (std::size_t)k * stream + (std::size_t)nA * o[0].kept_bytes +
                        (std::size_t)nS * o[1].kept_bytes + (std::size_t)(n - nA - nS) * kI;
                    const int64_t cost = rev_cost + nA * o[0].recompute_flops +
                                         nS * o[1].recompute_flops +
                                         (n - nA - nS) * o[2].recompute_flops;
                    if (bytes > budget || cost > least || (cost == least && bytes >= least_bytes))
                        continue;
                    least = cost, least_bytes = bytes;
                    at_k = k, at_last = last, at_A = nA, at_S = nS;
                }
        }
        if (least == kNever) continue;
        std::vector<int> kept(at_k);
        for (int i = at_k - 1, b = at_last; i >= 0; i--) {
            kept[i] = b;
            b = from[b * row + i + 1];
        }
        std::vector<BlockKeep> keep(at_k, BlockKeep::Input);
        for (int i = 0; i < at_A + at_S; i++)
            keep[i] = i < at_A ? BlockKeep::All : BlockKeep::Selective;
        const Solution s = evaluate(chain, rebuild_plan(rev, n, C, kept, keep));
        if (s.peak_bytes <= budget && better(s, best)) best = s;
    }
    return best;
}

// Any chain: for each scratch level W and slot count, a knapsack over positions whose state is
// the kept bytes in units, each kept input weighing its stream and its option's fields, each
// rebuilt block its Input option's.
std::optional<Solution> solve_rebuild_general(const Chain& chain, std::size_t budget,
                                              int max_slots) {
    const int n = (int)chain.blocks.size();
    const std::size_t stream = chain.resid_bytes;
    constexpr BlockKeep kFieldKeeps[] = {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input};
    const auto weight = [&](int l, int k) {  // k < 3: kept with that option; 3: rebuilt
        return k < 3 ? chain.blocks[l][k].kept_bytes + stream : chain.blocks[l][2].kept_bytes;
    };
    std::size_t unit = 0;
    for (int l = 0; l < n; l++)
        for (int k = 0; k < 4; k++) unit = std::gcd(unit, weight(l, k));
    if (unit == 0) unit = 1;
    const std::vector<std::size_t> levels = scratch_levels(chain);
    const Reversals rev(chain, max_slots);
    std::optional<Solution> best;
    for (std::size_t W : levels) {
        for (int C = 0; C <= max_slots; C++) {
            if (C > 0 && !rev.helps(C)) break;
            const std::size_t base = rebuild_base(chain, C, W);
            if (base > budget) break;
            const std::size_t cap_bytes = budget - base;
            // Keep the table to about 2^24 cells: beyond that sizes round up to a coarser unit
            // (never over the budget, possibly slightly short of the optimum).
            const std::size_t most = std::max<std::size_t>(1024, (std::size_t{1} << 24) / n);
            std::size_t u = unit;
            if (cap_bytes / u > most) u = (cap_bytes + most - 1) / most;
            const std::size_t cap = cap_bytes / u, width = cap + 1;
            const auto units = [&](int l, int k) { return (weight(l, k) + u - 1) / u; };
            const auto allowed = [&](int l, int k) {
                return chain.blocks[l][k].scratch_bytes <= W;
            };
            // Between kept a and b: the rebuilt blocks' units and their reversal and own
            // recompute; false where one of them cannot recompute within W.
            const auto gap = [&](int a, int b, std::size_t& w, int64_t& cost) {
                w = 0;
                cost = rev.cost(a, b, C);
                for (int l = a + 1; l < b; l++) {
                    if (!allowed(l, 2)) return false;
                    w += units(l, 3);
                    cost += chain.blocks[l][2].recompute_flops;
                }
                return true;
            };
            // T[b][j]: least recompute of blocks [0, b] with b's input kept, j units.
            std::vector<int64_t> T((std::size_t)n * width, kNever);
            for (int k = 0; k < 3; k++)
                if (allowed(0, k) && units(0, k) <= cap)
                    T[units(0, k)] = std::min(T[units(0, k)], chain.blocks[0][k].recompute_flops);
            for (int b = 1; b < n; b++)
                for (int a = 0; a < b; a++) {
                    std::size_t wg = 0;
                    int64_t cg = 0;
                    if (!gap(a, b, wg, cg)) continue;
                    for (int k = 0; k < 3; k++) {
                        if (!allowed(b, k)) continue;
                        const std::size_t w = wg + units(b, k);
                        if (w > cap) continue;
                        const int64_t add = cg + chain.blocks[b][k].recompute_flops;
                        const int64_t* src = &T[(std::size_t)a * width];
                        int64_t* dst = &T[(std::size_t)b * width + w];
                        for (std::size_t j = 0; j + w <= cap; j++)
                            dst[j] = std::min(dst[j], src[j] + add);
                    }
                }
            // The last kept input a, blocks (a, n) rebuilt: the least cost, then units.
            int64_t cost = kNever;
            std::size_t at_j = 0;
            int last = -1;
            for (int a = 0; a < n; a++) {
                std::size_t wg = 0;
                int64_t cg = 0;
                if (!gap(a, n, wg, cg) || wg > cap) continue;
                for (std::size_t j = 0; j + wg <= cap; j++) {
                    const int64_t v = T[(std::size_t)a * width + j];
                    if (v < kNever && (v + cg < cost || (v + cg == cost && j + wg < at_j)))
                        cost = v + cg, at_j = j + wg, last = a;
                }
            }
            if (last < 0) continue;
            // Walk back: at kept b with j units and cost v, the kept a before it and b's option.
            std::vector<int> kept{last};
            std::vector<BlockKeep> keep;
            std::size_t wg = 0;
            int64_t cg = 0;
            gap(last, n, wg, cg);
            std::size_t j = at_j - wg;
            int64_t v = cost - cg;
            for (int b = last;;) {
                int prev = -2;
                for (int k = 0; k < 3 && prev == -2; k++) {
                    if (!allowed(b, k) || units(b, k) > j) continue;
                    const int64_t own = v - chain.blocks[b][k].recompute_flops;
                    if (b == 0) {
                        if (units(0, k) == j && own == 0) keep.push_back(kFieldKeeps[k]), prev = -1;
                        continue;
                    }
                    for (int a = 0; a < b && prev == -2; a++) {
                        if (!gap(a, b, wg, cg) || wg + units(b, k) > j) continue;
                        const std::size_t jj = j - wg - units(b, k);
                        if (T[(std::size_t)a * width + jj] != own - cg) continue;
                        keep.push_back(kFieldKeeps[k]);
                        j = jj, v = own - cg, prev = a;
                    }
                }
                if (prev == -2) fail("internal: the joint remat solver lost its way back");
                if (prev == -1) break;
                kept.push_back(prev);
                b = prev;
            }
            std::reverse(kept.begin(), kept.end());
            std::reverse(keep.begin(), keep.end());
            const Solution s = evaluate(chain, rebuild_plan(rev, n, C, kept, keep));
            if (s.peak_bytes <= budget && better(s, best)) best = s;
        }
    }
    return best;
}

}  // namespace

std::optional<Solution> solve_rebuild(const Chain& chain, std::size_t budget) {
    const int n = (int)chain.blocks.size();
    if (n < 2 || chain.resid_bytes == 0) return std::nullopt;
    // Slots beyond n - 2 never shorten a reversal, nor beyond what the budget holds.
    const std::size_t base = rebuild_base(chain, 0, 0);
    if (base > budget) return std::nullopt;
    const int max_slots = (int)std::min<std::size_t>(
        {(std::size_t)n - 2, (budget - base) / chain.resid_bytes, (std::size_t)table_slots(n)});
    return uniform(chain) ? solve_rebuild_uniform(chain, budget, max_slots)
                          : solve_rebuild_general(chain, budget, max_slots);
}

RematPlan binomial_plan(const Chain& chain, int slots) {
    const int n = (int)chain.blocks.size();
    if (slots < 0) fail("internal: a binomial schedule with {} slots", slots);
    if (n < 2) return RematPlan(n, BlockKeep::Input);
    const int c = std::min({slots, n - 2, table_slots(n)});
    const Reversals rev(chain, c);
    return rebuild_plan(rev, n, c, {0}, {BlockKeep::Input});
}

std::optional<Solution> solve_joint(const Chain& chain, std::size_t budget) {
    std::optional<Solution> best = solve_budget(chain, budget);
    const std::optional<Solution> r = solve_rebuild(chain, budget);
    if (r && better(*r, best)) best = r;
    return best;
}

int64_t binomial_forwards(int l, int c) {
    // Griewank's t(l, s) = r l - beta(s + 1, r - 1), beta(s, r) = (s + r)! / (s! r!), for the
    // r with beta(s, r - 1) < l <= beta(s, r); s = c + 1 snapshots (the kept first input and
    // the c slots), every forward of the reversal's first sweep counted (here: rebuilds).
    if (l <= 1) return 0;
    const auto beta = [](int s, int r) {
        if (r < 0) return int64_t{0};
        int64_t v = 1;
        for (int i = 1; i <= r; i++) v = v * (s + i) / i;
        return v;
    };
    const int s = c + 1;
    int r = 0;
    while (beta(s, r) < l) r++;
    return (int64_t)r * l - beta(s + 1, r - 1);
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
    const std::vector<std::size_t> levels = scratch_levels(chain);

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
                if (s.peak_bytes <= budget && better(s, best)) best = s;
            }
        }
    }
    return best;
}

}  // namespace memtrain::remat
