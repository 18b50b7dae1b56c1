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
    // Each block's whole forward, which a rebuild of a later input re-runs; empty: the Input
    // option's recompute (they differ where Input's redo skips work its backward does itself,
    // as the tiled MLP's redo skips mlp.c_proj).
    std::vector<int64_t> forward_flops;
};

// Block l's whole forward as a rebuild runs it (Chain::forward_flops).
int64_t rebuild_flops(const Chain& chain, std::size_t l);

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

// The plans that rebuild block inputs (the CPU model): the least recompute whose peak <= budget
// (ties: the smaller peak) over every plan in which some block's input is rebuilt, jointly
// choosing which inputs stay from the forward, each such block's option (all, selective,
// input), and the backward's rebuild schedule: which rebuild holds which input in a slot
// (RematPlan::hold_by), the slots alive at once, and what is recomputed from where. A block
// whose input is rebuilt keeps no fields (it recomputes them from the rebuilt input). nullopt
// when no such plan fits (below memory-poor's floor, or a single block). Exact over that space
// (tests compare it with exhaustive search): between two kept inputs the rebuilds follow the
// recursion of Griewank and Walther's binomial schedules, generalised to blocks of unequal
// cost and to a slot count the solver chooses against the budget, as in Beaumont et al.'s
// dynamic program for heterogeneous chains (docs/checkpointing.md, "The joint solver").
std::optional<Solution> solve_rebuild(const Chain& chain, std::size_t budget);
// The least-recompute plan over every plan solve_budget and solve_rebuild consider: the
// budget:BYTES schedule of the CPU model.
std::optional<Solution> solve_joint(const Chain& chain, std::size_t budget);
// The least-recompute schedule that keeps only the first block's input and rebuilds the others
// with at most `slots` hold slots alive at once (train.remat = revolve:S): Griewank and Walther's
// binomial schedule, priced by each block's forward (on a uniform chain it runs
// binomial_forwards(n, slots) rebuild forwards). slots = 0 is memory-poor.
RematPlan binomial_plan(const Chain& chain, int slots);
// The least block forwards that reverse a uniform chain of `blocks` blocks from its first input
// with `slots` hold slots and nothing else kept: Griewank's binomial bound, which the joint
// solver's schedules meet (tests).
int64_t binomial_forwards(int blocks, int slots);
// The two structured schedules over n blocks: chen:K (blocks l % K == 0 `input`, the others
// `segment`) and memory-poor (block 0 `input`, the others `dropped`).
RematPlan chen_plan(std::size_t n, std::size_t K);
RematPlan memory_poor_plan(std::size_t n);
// chen:K for every K and memory-poor, and the least peak of any plan that rebuilds inputs
// (memory-poor's, for n > 1).
std::vector<RematPlan> rebuild_plans(std::size_t blocks);
std::size_t rebuild_floor(const Chain& chain);

}  // namespace memtrain::remat
