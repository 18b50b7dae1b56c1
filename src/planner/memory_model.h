// The per-GPU memory estimate: one line per category (model states, activations, temporary
// buffers, reserve, fragmentation), for the most loaded pipeline stage. This is the entry
// point the trainer calls at start-up to print its prediction beside the measured peak.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "planner/model_shape.h"
#include "planner/rank_layout.h"
#include "planner/run_layout.h"

namespace memtrain::plan {

struct MemoryLine {
    std::string name;    // "parameters", "gradients", "optimizer states", "activations", ...
    int64_t bytes = 0;   // per GPU
    std::string detail;  // how the number was formed, for the table
};

struct MemoryEstimate {
    std::vector<MemoryLine> lines;  // fixed order; lines with 0 bytes are kept
    int64_t total = 0;              // sum of lines (device bytes, fragmentation included)
    int64_t cpu_bytes = 0;          // host memory of offloaded states, per GPU
    int stage = 0;                  // pipeline stage the numbers are for (0 = first)
    int replica = 0;                // data-parallel replica (its ZeRO piece) they are for
    // Model states and, without a pipeline, activations from the engines' layout functions
    // (planner/rank_layout.h: uses_engine_layout); otherwise the formulas.
    bool engine_layout = false;
    int layers_on_stage = 0;
    double in_flight = 1;          // micro-batches whose activations are alive at the peak
    int64_t params_on_gpu = 0;     // parameters held by this GPU before ZeRO sharding
    int64_t trainable_on_gpu = 0;  // of which trainable (LoRA: only the adapters)
    // Pipeline layouts priced by the engine's layout (uses_stage_layout: pp > 1, tp only where the
    // mesh runs it): every stage's activations line, stage 0 first; empty otherwise.
    std::vector<int64_t> stage_activations;
    std::vector<std::string> not_included;

    int64_t bytes(std::string_view name) const;  // 0 when there is no such line
    int64_t model_states() const;                // parameters + gradients + optimizer states
};

// Activation bytes of one transformer layer for one micro-batch (Korthikanti et al. 2022,
// generalised to GQA, SwiGLU and fp32): what the backward pass needs kept.
struct LayerActivations {
    int64_t saved = 0;  // kept per layer under the run's recompute policy
    int64_t full = 0;   // kept per layer with no recomputation (the recompute working set)
};
LayerActivations layer_activation_bytes(const ModelSpec& model, const RunSpec& run);

// LoRA parameters of one transformer block: an adapter on a linear layer of fan_in x fan_out has
// rank x (fan_in + fan_out) parameters (A is rank x fan_in, B fan_out x rank). Targets as the
// trainer places them (LoraTargets): Llama (ModelSpec::is_llama) q, k, v, o [+ gate, up, down],
// k and v of width kv_heads x head_dim; otherwise GPT-2's c_attn (n_embd -> n_embd + 2 kv_dim),
// attn.c_proj [+ mlp.c_fc, mlp.c_proj].
int64_t lora_params_per_layer(const ModelSpec& model, int rank, LoraTargets targets);

// Validates the run, then estimates every pipeline stage (of replica 0, which holds the largest
// ZeRO piece) and returns the largest.
//
// A layout the CPU engines run (uses_engine_layout: tp with or without sequence parallelism,
// pipelines side by side, the tp x pp x dp mesh, any ZeRO stage, a model without dropout or
// LoRA) is priced as they allocate it: model states from make_param_layout (of the tp shard; a
// stage's units under the trainer's split) and the shard table (parallel/placement.h) with the
// balanced ZeRO piece; activations from plan_arena (pp = 1, in the arena format of the engine
// that would run it) or plan_stage_arena per micro-batch in flight (pipelines,
// planner/stage_activations.h), of the shard's config (sequence-parallel when the run is).
// Everything else (dropout masks, LoRA) keeps the formulas: parameters counted per layer and
// split over tp and dp, activations from Korthikanti's per-layer formulas
// (layer_activation_bytes) x the stage's layers x the micro-batches in flight; a pipeline
// without tensor parallelism still takes its activations from the stage layout.
MemoryEstimate estimate_memory(const ModelSpec& model, const RunSpec& run);
// One stage (0 .. pp-1) of replica 0; stage 0 holds the embedding, stage pp-1 the head and the
// logits.
MemoryEstimate estimate_stage_memory(const ModelSpec& model, const RunSpec& run, int stage);
// One rank: its stage and replica (the per-rank numbers `memtrain train` measures).
MemoryEstimate estimate_rank_memory(const ModelSpec& model, const RunSpec& run, RankCoord at);

}  // namespace memtrain::plan
