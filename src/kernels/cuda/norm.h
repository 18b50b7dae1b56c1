// Normalisation layers on the GPU: LayerNorm and RMSNorm, for T in {float, __nv_bfloat16,
// __half}, with fp32 statistics and arithmetic whatever T is.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- LayerNorm -------------------------------------------------------------------------------
template <typename T>
void layernorm_forward(T* out /*(N,C)*/, float* mean /*(N)*/, float* rstd /*(N)*/,
                       const T* inp /*(N,C)*/, const T* weight /*(C)*/, const T* bias /*(C)*/,
                       int N, int C, float eps, cudaStream_t stream = 0);
// dinp is accumulated into (the residual stream's gradient); dweight, dbias accumulated
// (fixed-order column sums, no atomics); a null dweight (a frozen norm) skips both.
template <typename T>
void layernorm_backward(T* dinp /*(N,C)*/, T* dweight /*(C)*/, T* dbias /*(C)*/,
                        const T* dout /*(N,C)*/, const T* inp /*(N,C)*/, const T* weight /*(C)*/,
                        const float* mean /*(N)*/, const float* rstd /*(N)*/, int N, int C,
                        cudaStream_t stream = 0);

// ---- RMSNorm ---------------------------------------------------------------------------------
template <typename T>
void rmsnorm_forward(T* out /*(N,C)*/, float* rstd /*(N)*/, const T* inp /*(N,C)*/,
                     const T* weight /*(C)*/, int N, int C, float eps, cudaStream_t stream = 0);
// dinp and dweight are accumulated into, as for LayerNorm (null dweight: skipped).
template <typename T>
void rmsnorm_backward(T* dinp /*(N,C)*/, T* dweight /*(C)*/, const T* dout /*(N,C)*/,
                      const T* inp /*(N,C)*/, const T* weight /*(C)*/, const float* rstd /*(N)*/,
                      int N, int C, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
