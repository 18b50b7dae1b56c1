// Normalisation layers on the GPU: LayerNorm (and RMSNorm), fp32 statistics.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- layernorm -------------------------------------------------------------------------------
void layernorm_forward(float* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                       const float* inp /*(N,C)*/, const float* weight /*(C)*/,
                       const float* bias /*(C)*/, int N, int C, float eps = 1e-5f,
                       cudaStream_t stream = 0);
// bf16 activations and parameters, fp32 statistics and arithmetic.
void layernorm_forward_bf16(__nv_bfloat16* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                            const __nv_bfloat16* inp /*(N,C)*/, const __nv_bfloat16* weight /*(C)*/,
                            const __nv_bfloat16* bias /*(C)*/, int N, int C, float eps = 1e-5f,
                            cudaStream_t stream = 0);
// dinp is accumulated into; dweight and dbias too (per-chunk partial sums, then a fixed-order
// pass).
void layernorm_backward(float* dinp /*(N,C)*/, float* dweight /*(C)*/, float* dbias /*(C)*/,
                        const float* dout /*(N,C)*/, const float* inp /*(N,C)*/,
                        const float* weight /*(C)*/, const float* mean /*(N)*/,
                        const float* rstd /*(N)*/, int N, int C, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
