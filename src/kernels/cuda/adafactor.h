// Adafactor on the GPU (optim.name = "adafactor"): the CPU optimizer's step (optim/optimizer.h)
// over every tensor of a range, each stepped whole, in seven launches whatever the tensor count.
// Included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/optimizer_types.h"

namespace memtrain::cuda {

// Adafactor's device state and scratch (device pointers), laid out by optim/device_update.h's
// AdafactorLayout: the tensors' table, their state back to back (a matrix's row factors then
// column factors, another tensor's whole second moment), a double per row and the column
// partials, and the per-tensor scalars between launches.
struct AdafactorStores {
    float* state = nullptr;
    const AdafactorTensor* tensors = nullptr;
    AdafactorScalars* scalars = nullptr;
    double* rows = nullptr;
    double* parts = nullptr;
    int ntensors = 0;
    int64_t nrows = 0, items = 0, tiles = 0;
    int64_t max_cols = 0;  // the widest row: the row kernels' blocks are no wider than needed
};

// One Adafactor update of the range: Adafactor::step_part's arithmetic in optim/optimizer.cpp
// (its sums in double, its other operations in float), g = float(grads[i]) * s->grad_scale, the
// scalars' af_rho, af_w, af_clip and decay_factor; nothing when s->skip. The sums run in a fixed
// tree instead of the CPU's row order, so the result is the CPU's to the last bits of a double
// sum rounded to float, and the same bits on every run. `master` and `round` as adamw_step's.
template <typename T>
void adafactor_step(T* params, float* master, const AdafactorStores& st, const T* grads,
                    const StepScalars* s, cudaStream_t stream = 0, const ParamRounding& round = {});

}  // namespace memtrain::cuda
