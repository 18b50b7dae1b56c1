// Activations on the GPU: GELU (tanh approximation).
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- activation ------------------------------------------------------------------------------
void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                   cudaStream_t stream = 0);
void gelu_forward_bf16(__nv_bfloat16* out, const __nv_bfloat16* inp, int64_t n,
                       cudaStream_t stream = 0);
void gelu_backward_bf16(__nv_bfloat16* dinp, const __nv_bfloat16* inp, const __nv_bfloat16* dout,
                        int64_t n, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
