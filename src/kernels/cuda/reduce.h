// Reductions, elementwise helpers and casts on the GPU, for the storage types float,
// __nv_bfloat16 and __half (arithmetic in fp32, sums to a scalar in double). Every entry only
// queues work on `stream`; results that are scalars stay on the device. Included through
// kernels/cuda/ops.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace memtrain::cuda {

// ---- reductions to a scalar: fixed chunks of 2^16 values (one block each, a fixed tree), then
// one block adds the chunk results in order. The order depends on n alone. -----------------------
// Sum of squares of n values, in double, into *result (device). Queues only.
template <typename T>
void sum_squares(double* result /*device*/, const T* a /*(n)*/, int64_t n, cudaStream_t stream = 0);
// Sum of n doubles (device) in a fixed order into *result (device): the order depends on n
// alone. Queues only.
void sum_doubles_to_device(double* result /*device*/, const double* values /*(n)*/, int64_t n,
                           cudaStream_t stream = 0);
// Sum of n floats in a fixed order into *result (device double). Queues only.
void sum_floats(double* result /*device*/, const float* a /*(n)*/, int64_t n,
                cudaStream_t stream = 0);

// dst (C) += column sums of x (N,C): fp32 partial sums of fixed 64-row chunks, then one ordered
// pass adding the chunks to float(dst); T storage (one rounding per column).
template <typename T>
void column_sums_accumulate(T* dst /*(C)*/, const T* x /*(N,C)*/, int N, int C,
                            cudaStream_t stream = 0);

// ---- elementwise -------------------------------------------------------------------------------
// Round-to-nearest-even conversions between any two of the three types (through the exact fp32
// value, so a single rounding). To == From is a copy.
template <typename To, typename From>
void cast(To* out /*(n)*/, const From* inp /*(n)*/, int64_t n, cudaStream_t stream = 0);
// a = T(float(a) + float(b)).
template <typename T>
void add_inplace(T* a /*(n)*/, const T* b /*(n)*/, int64_t n, cudaStream_t stream = 0);
// a = T(float(a) * s).
template <typename T>
void scale_inplace(T* a /*(n)*/, float s, int64_t n, cudaStream_t stream = 0);

}  // namespace memtrain::cuda
