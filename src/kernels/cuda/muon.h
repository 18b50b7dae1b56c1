// Muon on the GPU (optim.name = "muon"): the orthogonalization of one block matrix and its update,
// the CPU's newton_schulz5 and Muon step (optim/optimizer.h) on device buffers. The momentum that
// feeds it is kernels/cuda/optimizer.h's muon_momentum; the other tensors take adamw_step.
// Included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/optimizer_types.h"

namespace memtrain::cuda {

// Five quintic Newton-Schulz steps on the rows x cols row-major matrix x (fp32 GEMMs, no TF32):
// x / (||x||_F + 1e-7), then X = a X + (b A + c A A) X with A = X X^T (or, for a tall matrix,
// X = a X + X (b A + c A A) with A = X^T X: the transpose of the wide orientation's iteration,
// without transposing). y (rows x cols), ga and gb (r x r, r = min(rows, cols)) are scratch,
// sumsq one device double. Returns x or y, whichever holds the result. Queues only; nothing is
// read from s but the skip flag (a skipped step normalizes nothing).
float* newton_schulz5(float* x, float* y, float* ga, float* gb, double* sumsq, int rows, int cols,
                      const StepScalars* s, cudaStream_t stream = 0);

// W = W (1 - lr_muon wd) - lr_muon sqrt(max(1, cols / rows)) o over n floats of one rows x cols
// matrix (all of it, or the piece a ZeRO shard holds) at `begin` of the range (`decays`: its
// weight-decay flag), o the orthogonalized update of those n floats; into the fp32 master and
// params as adamw_step stores them (`round`); nothing when s->skip.
template <typename T>
void muon_apply(T* params, float* master, const float* o, int64_t begin, int64_t n, int rows,
                int cols, int decays, const StepScalars* s, cudaStream_t stream = 0,
                const ParamRounding& round = {});

}  // namespace memtrain::cuda
