// The budget solver for activation checkpointing: over a chain of blocks, each choosing one
// BlockKeep option, minimise recompute FLOPs subject to peak activation bytes <= budget. Pure
// functions over a `Chain` of per-option costs, so tests can compare against exhaustive search.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "model/gpt.h"

namespace memtrain::remat {

// The cost of one block under one BlockKeep option.
struct Option {
    std::size_t kept_bytes = 0;     // held from the block's forward to its backward
    std::size_t scratch_bytes = 0;  // recompute working set (the shared scratch must hold it)
    int64_t recompute_flops = 0;    // extra forward work in backward
};

// Options are indexed by BlockKeep (All, Selective, Input). Peak activation bytes of a plan =
// fixed_bytes + sum of kept_bytes + max scratch_bytes: the arena is allocated once, and the
// scratch is shared because the dropped field sets are nested (see model/gpt.h).
//
// Offload (the CUDA engine) is Input with the block's input in host memory: the same scratch,
// the same recompute (plus one unit, so that of two plans with the same recompute the solver
// moves fewer inputs), and the inputs of the plan's Offload blocks share a ring of
// min(count, kOffloadSlots) residual streams, so each Offload block beyond the first
// kOffloadSlots takes resid_bytes off the peak. Plans may hold Offload blocks whenever
// resid_bytes is set; solve_budget chooses them only when allow_offload is.
struct Chain {
    std::size_t fixed_bytes = 0;  // residual streams and ln_f: kept under every plan
    std::vector<std::array<Option, 3>> blocks;
    std::size_t resid_bytes = 0;  // one residual stream: what an offloaded input frees
    bool allow_offload = false;   // the solver may choose Offload
};

struct Solution {
    RematPlan plan;
    std::size_t peak_bytes = 0;
    int64_t recompute_flops = 0;
};

// Block l's option for `keep`; Offload, Segment and Dropped price as Input (their streams beyond
// that are the ring's or the rebuild's business, in peak_bytes; the rebuild's forwards in
// recompute_flops).
const Option& option(const Chain& chain, std::size_t l, BlockKeep keep);
std::size_t peak_bytes(const Chain& chain, const RematPlan& plan);
int64_t recompute_flops(const Chain& chain, const RematPlan& plan);
Solution evaluate(const Chain& chain, const RematPlan& plan);
// The smallest peak any plan reaches (the least budget solve_budget can satisfy).
std::size_t min_feasible_bytes(const Chain& chain);
// Least recompute FLOPs with peak <= budget, ties broken by the smaller peak; nullopt when no
// plan fits. Exact when the budget needs at most kMaxUnits units of the gcd of all byte sizes;
// beyond that sizes are rounded up to a coarser unit (still never over the budget).
std::optional<Solution> solve_budget(const Chain& chain, std::size_t budget);
inline constexpr std::size_t kMaxUnits = std::size_t{1} << 16;

// Below what solve_budget reaches (every block keeps its input): the plans that rebuild inputs,
// chen:K for every K (blocks l % K == 0 `input`, the others `segment`) and memory-poor (block 0
// `input`, the others `dropped`); the least recompute whose peak <= budget (ties: the smaller
// peak), nullopt when even memory-poor does not fit. Not a joint optimum with the knapsack's
// options (docs/checkpointing.md): the structured schedules of Chen and the lecture.
std::optional<Solution> solve_rebuild(const Chain& chain, std::size_t budget);
// The two structured schedules over n blocks: chen:K (blocks l % K == 0 `input`, the others
// `segment`) and memory-poor (block 0 `input`, the others `dropped`).
RematPlan chen_plan(std::size_t n, std::size_t K);
RematPlan memory_poor_plan(std::size_t n);
// The plans solve_rebuild tries, and the least peak among them (memory-poor's, for n > 1).
std::vector<RematPlan> rebuild_plans(std::size_t blocks);
std::size_t rebuild_floor(const Chain& chain);

}  // namespace memtrain::remat
