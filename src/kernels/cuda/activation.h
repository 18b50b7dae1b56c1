// Activations on the GPU: GELU (tanh approximation) and SwiGLU, for T in {float, __nv_bfloat16,
// __half}: fp32 arithmetic, one rounding to T per stored value.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- GELU ------------------------------------------------------------------------------------
template <typename T>
void gelu_forward(T* out /*(n)*/, const T* inp /*(n)*/, int64_t n, cudaStream_t stream = 0);
// dinp = gelu'(inp) * dout; dinp may be the same buffer as dout.
template <typename T>
void gelu_backward(T* dinp /*(n)*/, const T* inp /*(n)*/, const T* dout /*(n)*/, int64_t n,
                   cudaStream_t stream = 0);

// ---- SwiGLU ----------------------------------------------------------------------------------
// out = silu(gate) * up on inp = [gate | up] (N, 2H); dinp (N, 2H) is overwritten.
template <typename T>
void swiglu_forward(T* out /*(N,H)*/, const T* inp /*(N,2H)*/, int N, int H,
                    cudaStream_t stream = 0);
template <typename T>
void swiglu_backward(T* dinp /*(N,2H)*/, const T* inp /*(N,2H)*/, const T* dout /*(N,H)*/, int N,
                     int H, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
