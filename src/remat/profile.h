// The measured cost model: a short profiling pass that times each piece of a block's forward with
// the real kernels at the run's shapes, and whole training steps under a plan. The budget solver
// can then minimise measured recompute time instead of FLOPs (on the CPU LayerNorm and GELU cost
// far more time than their FLOP share: they are memory-bound while the GEMMs are not).
#pragma once

#include <cstddef>

#include "model/gpt.h"
#include "remat/cost.h"

namespace memtrain::remat {

// Nanoseconds of each piece of one block's forward (same fields as the FLOP count; `ln` is one
// norm), the fastest of `reps` timed runs after a warm-up. Under rmsnorm/swiglu/rope the pieces
// time those kernels.
BlockFlops measure_block(const ModelConfig& cfg, int B, int T, int reps = 3);

// A step's time in the units of `measured` (measure_block's ns): the blocks' measured forward,
// times 3 for forward + backward, scaled by the analytic ratio of the whole step (head,
// classifier) to its blocks. Cheap: no step is run, so no extra activations are allocated.
double estimated_step_ns(const ModelConfig& cfg, int B, int T, const BlockFlops& measured);

struct MeasuredStep {
    double seconds = 0;                // one forward + backward of a micro-batch (fastest)
    std::size_t activation_bytes = 0;  // the model's activation arena, from the allocator
};
// Times `steps` training steps (forward + backward, no optimizer) of a freshly initialised model
// under `plan` on random tokens, after one warm-up step.
MeasuredStep measure_step(const ModelConfig& cfg, int B, int T, const RematPlan& plan,
                          int steps = 2);

}  // namespace memtrain::remat
