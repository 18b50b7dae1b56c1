// What the GPU optimizer kernels are handed for one update, computed on the host from the
// parameter layout and the optimizer config: the per-tensor pieces of a parameter range and the
// per-step scalars (kernels/cuda/optimizer_types.h holds the types). Plain C++, built everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/optimizer_types.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"
#include "optim/state_format.h"

namespace memtrain::cuda {

// The pieces (at most max_n floats each) tiling [offset, offset + count) of the layout's flat
// buffer, split at tensor boundaries, in buffer order. Floats of the range that belong to no
// tensor (the layout has none today) get no piece, as the CPU optimizer skips them. Fails
// (memtrain::Error) when the range is outside the layout or max_n < 1.
std::vector<TensorChunk> tensor_chunks(const ParamLayout& layout, std::size_t offset,
                                       std::size_t count, int max_n = 1 << 16);

// Where each of `chunks` (tensor_chunks of [offset, offset + count)) keeps its moments under
// `format`: for bf16, a chunk of a tensor that keeps fp32 (keeps_fp32, the CPU's rule on the
// global tensor) in the fp32 store, the others in the bf16 store, each store filled in chunk
// order; *n32 and *n16 receive the stores' lengths. For fp32: no table (the moments are indexed
// like the parameters), *n32 = count, *n16 = 0. int8 and int4 are not built on the GPU (fails).
std::vector<StateChunk> state_chunks(const ParamLayout& layout, std::size_t offset,
                                     std::size_t count, const std::vector<TensorChunk>& chunks,
                                     StateFormat format, std::size_t* n32, std::size_t* n16);

// The host group of StepScalars for step `step` (1-based, counting this update) of the optimizer
// cfg.name names, with the constants computed exactly as optim/optimizer.cpp computes them (double
// on the host, then rounded to float), so that the GPU update can match the CPU's bits. The device
// group is zero (finish_grad_norm fills it). max_norm is cfg.grad_clip rounded to float.
StepScalars make_step_scalars(const OptimConfig& cfg, double lr, int64_t step,
                              float loss_scale = 1.0f);

}  // namespace memtrain::cuda
