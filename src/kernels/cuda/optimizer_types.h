// What the GPU optimizer kernels (kernels/cuda/optimizer.h) read, in plain C++17 so that host code
// (the trainer, tests) can build it without the CUDA headers: the pieces of the parameter range
// the multi-tensor kernels hand to one block each, and the per-step scalars they read on the
// device (so a step captured into a CUDA graph replays with new values).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/param_layout.h"
#include "optim/optim_config.h"

namespace memtrain::cuda {

// A piece of one tensor: floats [begin, begin + n) of the optimizer's range (begin relative to
// the range's first float), with the tensor's weight-decay flag. The multi-tensor kernels take a
// device array of these and give each piece to one block.
struct TensorChunk {
    int64_t begin;
    int32_t n;
    int32_t decay;
};

// The pieces (at most max_n floats each) tiling [offset, offset + count) of the layout's flat
// buffer, split at tensor boundaries, in buffer order. Floats of the range that belong to no
// tensor (the layout has none today) get no piece, as the CPU optimizer skips them. Fails
// (memtrain::Error) when the range is outside the layout or max_n < 1.
std::vector<TensorChunk> tensor_chunks(const ParamLayout& layout, std::size_t offset,
                                       std::size_t count, int max_n = 1 << 16);

// What one optimizer step reads on the device, so that a captured step replays with new values:
// the host sets the first group each step (pinned copy), finish_grad_norm the second.
struct StepScalars {
    // set by the host
    float lr, beta1, beta2, eps;
    float decay_factor;            // 1 - lr * weight_decay (AdamW), applied to decay tensors
    float step_size;               // lr / (1 - beta1^t)
    float bc2_sqrt;                // sqrt(1 - beta2^t)
    float momentum, weight_decay;  // SGD
    int first_step;                // SGD: the momentum buffer starts as the gradient
    int nesterov;                  // SGD: torch's Nesterov variant (OptimConfig::nesterov)
    float loss_scale;  // the gradients hold loss_scale x the true gradient (1 unless fp16)
    float max_norm;    // clipping threshold; <= 0: no clipping
    // set on the device by finish_grad_norm
    float grad_norm;   // L2 norm of the true (unscaled) gradients
    float grad_scale;  // what the update multiplies stored gradients by: clip coefficient /
                       // loss_scale
    int skip;          // 1 when the norm is not finite: the step changes nothing
};

// The host group of StepScalars for step `step` (1-based, counting this update) of the optimizer
// cfg.name names, with the constants computed exactly as optim/optimizer.cpp computes them (double
// on the host, then rounded to float), so that the GPU update can match the CPU's bits. The device
// group is zero (finish_grad_norm fills it). max_norm is cfg.grad_clip rounded to float.
StepScalars make_step_scalars(const OptimConfig& cfg, double lr, int64_t step,
                              float loss_scale = 1.0f);

}  // namespace memtrain::cuda
