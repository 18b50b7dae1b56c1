// What the GPU optimizer kernels (kernels/cuda/optimizer.h) read, in plain C++17 so that host code
// (the trainer, tests) can build it without the CUDA headers: the pieces of the parameter range
// the multi-tensor kernels hand to one block each, and the per-step scalars they read on the
// device (so a step captured into a CUDA graph replays with new values). optim/device_update.h
// fills them from a parameter layout and an optimizer config.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace memtrain::cuda {

// A piece of one tensor: floats [begin, begin + n) of the optimizer's range (begin relative to
// the range's first float), with the tensor's weight-decay flag. The multi-tensor kernels take a
// device array of these and give each piece to one block.
struct TensorChunk {
    int64_t begin;
    int32_t n;
    int32_t decay;
};

// Where a chunk's moments live when optim.state_format is not fp32 (a device array beside the
// chunks, one per chunk): the index of its first element in the fp32 store (`fp32` = 1: a tensor
// that keeps fp32 moments, optim/state_format.h's rule), else in the bf16 store, or (int8, int4:
// the chunk is one quantization block) the byte of its first code and the index of its scale.
struct StateChunk {
    int64_t at;
    int32_t fp32;
    int32_t scale;
};

// int8 / int4: how the CUDA blocks of a step map onto its chunks. A chunk of a quantized tensor is
// a whole segment (the tensor's piece in the range) and takes one CUDA block per quantization
// block: its first grid block, and the length of its first quantization block (the grid of
// block_size elements over the flat buffer cuts it: MomentBuffer::span); a chunk of a tensor that
// keeps fp32 moments takes one CUDA block and has first_len 0. The kernels find their chunk by
// binary search, so the tables cost a few bytes per tensor instead of 32 per quantization block.
struct ChunkGrid {
    int32_t first_block;
    int32_t first_len;
};

// The constants of one code map (optim/state_format.h's int8 and int4 maps), so that a kernel
// rounds to the codes encode_code gives: `m` mantissa bits, exponent `bias`, and the Encoder's
// to_map, min_normal and sub_scale.
struct QuantMap {
    int32_t bits, is_signed, m, bias;
    float to_map, min_normal, sub_scale;
};

// How the parameters are stored after an update. By default each is the new value rounded to
// nearest even (T(master), or the fp32 value itself). optim.master = "none" (bf16 parameters and
// no master copy): rounded stochastically with f32_to_bf16_stochastic's draws
// (optim/state_format.h) of (seed, the step, base + the element's index in the range), `base`
// being the range's first float in the flat parameter buffer, so an element draws as the CPU
// engine's does at every world size and ZeRO stage.
struct ParamRounding {
    int32_t stochastic = 0;
    uint64_t seed = 0;
    int64_t base = 0;
};

// Adafactor (kernels/cuda/adafactor.h): one tensor of the range, stepped whole. A matrix of at
// least 2 x 2 is factored (rows x cols, its state the rows' then the columns' factors); any other
// tensor is one row of numel elements with its whole second moment as state. The kernels give a
// CUDA block to each row (row0: the tensor's first among the range's rows), to each piece of
// at most kAdafactorChunkRows rows of 256 columns (item0, its partial sums of g^2 at part0) and
// to each 256-column tile (tile0); an unfactored tensor has no items and no tiles.
struct AdafactorTensor {
    int64_t begin;  // its first float in the range
    int64_t state;  // its state's first float
    int64_t rows, cols;
    int64_t row0, item0, tile0, part0;
    int32_t factored, decay;
    // The floats of its state: rows + cols factored, else numel (optim's adafactor_floats).
    int64_t state_floats() const { return factored ? rows + cols : cols; }
};
constexpr int kAdafactorChunkRows = 256;
constexpr int kAdafactorTile = 256;

// What the Adafactor kernels compute per tensor between launches: alpha = max(eps2, RMS(W)) rho
// and 1 / max(mean(R), eps1), then the step -alpha / max(1, RMS(U) / clip).
struct AdafactorScalars {
    double alpha;
    float inv_mean_r;
    float step;
};

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
    // optim.step_in_backward_clip = "previous-norm": the norm the clip coefficient comes from
    // (the previous step's); 0: this step's own.
    double clip_norm;
    int64_t step;  // the update's 1-based count (optim.master = "none": the rounding's draw)
    // Adafactor: min(lr, 1 / sqrt(t)), optim.adafactor_clip (double, as the CPU computes with
    // them) and 1 - beta2_t = t^optim.adafactor_beta2_decay (float, as the CPU rounds it).
    double af_rho, af_clip;
    float af_w;
    // Muon: lr_muon = optim.muon_lr x (lr / optim.lr) (double, for each matrix's step), its decay
    // factor 1 - lr_muon wd and the momentum (float, as the CPU rounds them).
    double muon_lr;
    float muon_decay, muon_momentum;
    // set on the device by finish_grad_norm
    float grad_norm;   // L2 norm of the true (unscaled) gradients
    float grad_scale;  // what the update multiplies stored gradients by: clip coefficient /
                       // loss_scale
    int skip;          // 1 when the norm is not finite: the step changes nothing
};

}  // namespace memtrain::cuda
