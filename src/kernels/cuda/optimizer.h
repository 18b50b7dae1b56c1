// The optimizer on the GPU.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- optimizer -------------------------------------------------------------------------------
// One AdamW update over a flat buffer with torch.optim.AdamW's arithmetic, exactly as memtrain's
// CPU AdamW (optim/optimizer.cpp): `step` is the 1-based step count after this update, bias
// corrections are computed in double on the host. decay (null: decay everywhere) marks with a
// nonzero byte the elements weight decay applies to (matrices and embeddings).
void adamw_step(float* params /*(n)*/, float* m /*(n)*/, float* v /*(n)*/,
                const float* grads /*(n)*/, const uint8_t* decay /*(n) or null*/, int64_t n,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
