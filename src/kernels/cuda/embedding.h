// Token + position embedding on the GPU (see cpu/ops.h for the semantics).
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- embedding -------------------------------------------------------------------------------
void embedding_forward(float* out /*(B,T,C)*/, const int32_t* inp /*(B,T)*/,
                       const float* wte /*(V,C)*/, const float* wpe /*(maxT,C) or null*/, int B,
                       int T, int C, cudaStream_t stream = 0);
// Accumulates into dwte and dwpe (null: no position table). dwte is summed per token id over the
// positions that hold it, in (b,t) order: the ids are copied to the host and bucketed there (a
// counting sort), so this call waits for `stream` once. Same order as the CPU: same bits.
void embedding_backward(float* dwte /*(V,C)*/, float* dwpe /*(maxT,C) or null*/,
                        const float* dout /*(B,T,C)*/, const int32_t* inp /*(B,T)*/, int B, int T,
                        int C, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
