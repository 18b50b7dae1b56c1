// The analytic cost model behind recompute schedules: forward FLOPs of each piece of a GPT-2
// block on the CPU, a step's FLOPs, and the solver's Chain (bytes from model/gpt.h's layout
// functions, so predicted bytes are the bytes the model allocates).
#pragma once

#include <cstdint>

#include "model/activation_layout.h"
#include "model/config.h"
#include "remat/solver.h"

namespace memtrain::remat {

// FLOPs per element of the elementwise kernels (counted from kernels/cpu: LayerNorm = mean,
// variance, normalise, scale and shift; GELU = tanh approximation with its polynomial).
inline constexpr int64_t kLayerNormFlopsPerElem = 8;
inline constexpr int64_t kGeluFlopsPerElem = 12;
inline constexpr int64_t kSoftmaxFlopsPerElem = 5;

struct BlockFlops {
    int64_t ln = 0;         // one LayerNorm forward: 8 BTC
    int64_t qkv = 0;        // 2 BT C 3C
    int64_t attention = 0;  // scores + weighted sum 4 B T^2 C, softmax 5 B NH T^2 (full square)
    int64_t proj = 0;       // 2 BT C^2
    int64_t fc = 0;         // 2 BT C 4C
    int64_t gelu = 0;       // 12 x 4 BTC
    int64_t fc_proj = 0;    // 2 BT 4C C
    int64_t forward() const { return 2 * ln + qkv + attention + proj + fc + gelu + fc_proj; }
    int64_t selective() const { return 2 * ln + gelu; }  // what Selective recomputes
};

BlockFlops block_flops(const ModelConfig& cfg, int B, int T);
// One training step of one micro-batch without recompute: backward = 2 x forward for every
// block, ln_f and the classifier (2 BT C V_padded forward); the embedding lookup is free.
int64_t step_flops(const ModelConfig& cfg, int B, int T);
// The per-block options for the solver, in bytes of the exact layout (activations category) of
// the model whose arenas have format `fmt` (the CPU's by default; the CUDA model's keeps bf16
// activations and the attention log-sum-exp), with recompute priced by `costs` (a block's pieces
// in any unit: the analytic FLOPs of block_flops by default, or measure_block's nanoseconds).
Chain make_chain(const ModelConfig& cfg, int B, int T, const ActFormat& fmt = ActFormat::cpu());
Chain make_chain(const ModelConfig& cfg, int B, int T, const BlockFlops& costs,
                 const ActFormat& fmt = ActFormat::cpu());

}  // namespace memtrain::remat
