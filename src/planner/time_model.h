// Step-time model: FLOPs per token, achievable GEMM throughput, TP/PP/DP communication over
// NVLink or the network, the pipeline bubble, overlap, and the optimizer step (on GPU or CPU).
// Output: step time, tokens/s, MFU (model FLOPs) and HFU (with recomputation).
#pragma once

#include "planner/hardware.h"
#include "planner/model_shape.h"
#include "planner/run_layout.h"

namespace memtrain::plan {

// Training FLOPs per token, Megatron's accounting: 6 x matmul params + 12 L h s for attention
// (scores and weighted sum, forward + backward); LoRA skips weight gradients (4x instead of 6x).
double model_flops_per_token(const ModelSpec& model, const RunSpec& run);
// The same plus what recomputation executes again (full: one more forward; selective without
// flash attention: the attention core's forward).
double hardware_flops_per_token(const ModelSpec& model, const RunSpec& run);

// Seconds for a ring all-reduce of `bytes` over n ranks at `bw` bytes/s per rank.
double ring_all_reduce_s(double bytes, int n, double bw);
// Reduce-scatter or all-gather: half the all-reduce traffic.
double ring_gather_s(double bytes, int n, double bw);

struct TimeEstimate {
    double step_s = 0;
    double compute_s = 0;    // GEMMs and attention of all micro-batches on one stage
    double tp_comm_s = 0;    // tensor-parallel all-reduces (not overlapped, as in Megatron)
    double pp_comm_s = 0;    // pipeline send/recv of activations and their gradients
    double bubble_s = 0;     // pipeline fill and drain
    double dp_comm_s = 0;    // exposed (not overlapped) data-parallel / ZeRO traffic
    double optimizer_s = 0;  // optimizer step on the GPU (HBM bound) or on the CPU
    double offload_s = 0;    // host<->device traffic of offloaded states
    double bubble_fraction = 0;
    double gemm_efficiency = 0;  // fraction of peak assumed for the GEMMs
    double tokens_per_s = 0;
    double mfu = 0;  // model FLOPs / (gpus x peak)
    double hfu = 0;  // hardware FLOPs (with recomputation) / (gpus x peak)
};

// The fraction of `peak` one GEMM of M x N x K (elements of elem_bytes) reaches on `g`: the
// large-GEMM efficiency g.efficiency times the losses NVIDIA's "Matrix Multiplication
// Background" guide names for a tiled GEMM: tile quantization (128 x 128 tiles pad the edges),
// wave quantization (tiles run in waves of one per SM; the last wave leaves SMs idle), the fixed
// cost of each tile's K loop, and the memory bound below the peak : bandwidth ridge.
double gemm_efficiency(double M, double N, double K, double elem_bytes, double peak,
                       const GpuSpec& g);
// A layer's GEMMs (forward, input and weight gradients) on a tp rank for one micro-batch, the
// head's too on the last stage: their FLOPs over their time at gemm_efficiency.
double block_gemm_efficiency(const ModelSpec& m, const RunSpec& r, double elem_bytes, double peak,
                             const GpuSpec& g, bool last_stage);

TimeEstimate estimate_time(const ModelSpec& model, const RunSpec& run, const ClusterSpec& cluster);

}  // namespace memtrain::plan
