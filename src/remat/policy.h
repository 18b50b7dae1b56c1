// Activation-checkpointing policies: parsed from `train.remat` / `--budget`, turned into a
// per-block BlockKeep plan for a model and micro-batch (the budget form through the DP solver).
#pragma once

#include <cstddef>
#include <string>

#include "model/config.h"
#include "remat/cost.h"
#include "remat/solver.h"

namespace memtrain::remat {

// none | full | every:K | sqrt | selective | budget:BYTES (suffix B, KB, MB, GB, KiB, MiB, GiB) |
// budget:BYTES+offload (the solver may also move block inputs to host memory) | offload (the
// CUDA engine: full recompute with the block inputs in pinned host memory) | memory-poor (only
// the first block's input kept; every other input rebuilt from it, BlockKeep::Dropped) | chen:K
// (the inputs of every K-th block kept, each segment's rebuilt once, BlockKeep::Segment) |
// revolve:S (only the first block's input kept, the others rebuilt on Griewank's binomial
// schedule with at most S inputs held at once).
struct RematPolicy {
    enum class Kind {
        None,
        Full,
        Every,
        Sqrt,
        Selective,
        Budget,
        Offload,
        MemoryPoor,
        Chen,
        Revolve
    };
    Kind kind = Kind::None;
    int every = 0;                // Every: blocks with index % every == 0 keep all, others input;
                                  // Chen: the segment length K; Revolve: the hold slots S
    std::size_t budget = 0;       // Budget: peak activation bytes (MemCategory::Activations)
    bool budget_offload = false;  // Budget: Offload is one of the solver's options
    std::string text = "none";    // as written
    // Whether the schedule may keep block inputs in host memory (offload, budget:...+offload):
    // the CUDA engine only, without CUDA graphs.
    bool may_offload() const { return kind == Kind::Offload || budget_offload; }
    // Whether it rebuilds block inputs (memory-poor, chen:K, revolve:S): the CPU engine (in a
    // pipeline, each chunk of blocks on its own).
    bool rebuilds_inputs() const {
        return kind == Kind::MemoryPoor || kind == Kind::Chen || kind == Kind::Revolve;
    }
};

inline constexpr const char* kPolicyForms =
    "none, full, every:K (K >= 1), sqrt, selective, budget:BYTES (e.g. budget:200MiB; "
    "suffixes B KB MB GB KiB MiB GiB), budget:BYTES+offload (cuda: the budget solver may also "
    "keep block inputs in host memory), offload (cuda: full, with block inputs in host "
    "memory), memory-poor (only the first block's input kept, the others rebuilt from it), "
    "chen:K (the inputs of every K-th block kept, each segment rebuilt once), or revolve:S (only "
    "the first block's input kept, the others rebuilt on the binomial schedule holding at most S "
    "at once; S >= 0)";

RematPolicy parse_policy(const std::string& text);
// Bytes with an optional suffix ("200MiB", "1.5GB", "4096").
std::size_t parse_bytes(const std::string& text);
// The schedule of `policy` for this model and micro-batch B x T. A budget below every plan's
// peak fails with a message naming the smallest feasible budget. Recompute is priced by `costs`
// (null: analytic FLOPs; else e.g. measure_block's nanoseconds), in the Solution's
// recompute_flops field; bytes are those of the arenas of format `fmt`.
Solution solve_policy(const RematPolicy& policy, const ModelConfig& cfg, int B, int T,
                      const BlockFlops* costs = nullptr, const ActFormat& fmt = ActFormat::cpu());
std::string format_bytes(std::size_t bytes);  // "12.3 MiB (12897280 B)"

}  // namespace memtrain::remat
