// Reductions, elementwise helpers and casts on the GPU.
// Same argument order and semantics as kernels/cpu/ops.h, on device pointers, with the stream
// last (kernels/README.md); included through kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- small helpers -----------------------------------------------------------------------------
void add_inplace(float* a, const float* b, int64_t n, cudaStream_t stream = 0);  // a += b
// Sum of squares in double: fixed chunks, then one fixed-order pass; waits for `stream`.
double sum_squares(const float* a, int64_t n, cudaStream_t stream = 0);
void scale_inplace(float* a, float s, int64_t n, cudaStream_t stream = 0);

// ---- casts (round to nearest even) -------------------------------------------------------------
void cast_f32_to_bf16(__nv_bfloat16* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void cast_bf16_to_f32(float* out, const __nv_bfloat16* inp, int64_t n, cudaStream_t stream = 0);
void cast_f32_to_f16(__half* out, const float* inp, int64_t n, cudaStream_t stream = 0);
void cast_f16_to_f32(float* out, const __half* inp, int64_t n, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
