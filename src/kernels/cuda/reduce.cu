// Reductions and elementwise helpers: the deterministic sums to a scalar (sum of squares for the
// gradient norm, the sum of the per-row losses), the fixed-order column sums shared by the bias
// and norm-parameter gradients, a += b, a *= s, and casts between float, bf16 and fp16.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kThreads = 256;

// ---- elementwise -------------------------------------------------------------------------------
template <typename T>
static __global__ void add_kernel(T* a, const T* b, int64_t n) {
    MT_GRID_STRIDE(i, n) a[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}
template <typename T>
static __global__ void scale_kernel(T* a, float s, int64_t n) {
    MT_GRID_STRIDE(i, n) a[i] = from_float<T>(to_float(a[i]) * s);
}
// Through fp32, which holds every bf16 and fp16 value exactly: one rounding, to nearest even.
template <typename To, typename From>
static __global__ void cast_kernel(To* out, const From* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = from_float<To>(to_float(inp[i]));
}

template <typename T>
void add_inplace(T* a, const T* b, int64_t n, cudaStream_t stream) {
    if (n < 0) fail("cuda::add_inplace: n is {}, expected >= 0", n);
    if (n == 0) return;
    MT_LAUNCH(add_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, a, b, n);
}

template <typename T>
void scale_inplace(T* a, float s, int64_t n, cudaStream_t stream) {
    if (n < 0) fail("cuda::scale_inplace: n is {}, expected >= 0", n);
    if (n == 0) return;
    MT_LAUNCH(scale_kernel<T>, elementwise_blocks(n, kThreads), kThreads, 0, stream, a, s, n);
}

template <typename To, typename From>
void cast(To* out, const From* inp, int64_t n, cudaStream_t stream) {
    if (n < 0) fail("cuda::cast: n is {}, expected >= 0", n);
    if (n == 0) return;
    MT_LAUNCH((cast_kernel<To, From>), elementwise_blocks(n, kThreads), kThreads, 0, stream, out,
              inp, n);
}

// ---- sums to a scalar: fixed chunks of kSumChunk values, one block each, then one block adds the
// chunk results in order. The order depends on n alone. ------------------------------------------
constexpr int64_t kSumChunk = 1 << 16;

template <typename T, bool kSquare>
static __global__ void sum_chunks_kernel(double* partial, const T* a, int64_t n) {
    __shared__ double shared[32];
    const int64_t begin = blockIdx.x * kSumChunk;
    const int64_t end = begin + kSumChunk < n ? begin + kSumChunk : n;
    double s = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const double x = to_float(a[i]);
        s += kSquare ? x * x : x;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: thread t sums entries t, t + blockDim, ... in order, then a fixed tree. n = 0
// writes 0.
static __global__ void sum_in_order_kernel(double* out, const double* in, int64_t n) {
    __shared__ double shared[32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) *out = s;
}

void sum_doubles_to_device(double* result, const double* values, int64_t n, cudaStream_t stream) {
    if (n < 0) fail("cuda::sum_doubles_to_device: n is {}, expected >= 0", n);
    MT_LAUNCH(sum_in_order_kernel, 1, 1024, 0, stream, result, values, n);
}

double sum_doubles(const double* values, int64_t n, double* result_device, cudaStream_t stream) {
    sum_doubles_to_device(result_device, values, n, stream);
    double result = 0.0;
    MT_CUDA_CHECK(
        cudaMemcpyAsync(&result, result_device, sizeof(double), cudaMemcpyDeviceToHost, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return result;
}

template <typename T, bool kSquare>
static void sum_to_device(const char* op, double* result, const T* a, int64_t n,
                          cudaStream_t stream) {
    if (n < 0) fail("cuda::{}: n is {}, expected >= 0", op, n);
    if (!result) fail("cuda::{}: null result pointer", op);
    const int64_t nchunks = ceil_div(n, kSumChunk);
    if (nchunks > INT32_MAX) fail("cuda::{}: n is {}, too large", op, n);
    double* partial = nullptr;
    if (nchunks > 0) {
        partial = static_cast<double*>(device_scratch((std::size_t)nchunks * sizeof(double)));
        MT_LAUNCH((sum_chunks_kernel<T, kSquare>), (unsigned)nchunks, kThreads, 0, stream, partial,
                  a, n);
    }
    MT_LAUNCH(sum_in_order_kernel, 1, 1024, 0, stream, result, partial, nchunks);
}

template <typename T>
void sum_squares(double* result, const T* a, int64_t n, cudaStream_t stream) {
    sum_to_device<T, true>("sum_squares", result, a, n, stream);
}

void sum_floats(double* result, const float* a, int64_t n, cudaStream_t stream) {
    sum_to_device<float, false>("sum_floats", result, a, n, stream);
}

// ---- column sums for bias and norm-parameter gradients: one thread per (column, chunk of
// kColumnChunkRows rows) writes an fp32 partial, then one thread per column adds the chunks in
// order. -----------------------------------------------------------------------------------------
template <typename T>
static __global__ void column_sum_partials_kernel(float* partial, const T* x, int N, int C,
                                                  int nchunks) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int k = blockIdx.y; k < nchunks; k += gridDim.y) {
        const int r0 = k * kColumnChunkRows;
        const int r1 = r0 + kColumnChunkRows < N ? r0 + kColumnChunkRows : N;
        float s = 0.0f;
        for (int r = r0; r < r1; r++) s += to_float(x[(int64_t)r * C + c]);
        partial[(int64_t)k * C + c] = s;
    }
}

template <typename T>
static __global__ void finish_column_sums_kernel(T* dst, const float* partial, int nchunks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int k = 0; k < nchunks; k++) s += partial[(int64_t)k * C + c];
    dst[c] = from_float<T>(to_float(dst[c]) + s);
}

void finish_column_sums(float* dst, const float* partial, int nchunks, int C, cudaStream_t stream) {
    MT_LAUNCH(finish_column_sums_kernel<float>, (unsigned)ceil_div(C, kThreads), kThreads, 0,
              stream, dst, partial, nchunks, C);
}

template <typename T>
void column_sums_accumulate(T* dst, const T* x, int N, int C, cudaStream_t stream) {
    if (N < 0 || C < 0) fail("cuda::column_sums_accumulate: N {} C {}, expected sizes >= 0", N, C);
    if (N == 0 || C == 0) return;
    const int nchunks = (int)ceil_div(N, kColumnChunkRows);
    float* partial = static_cast<float*>(device_scratch((size_t)nchunks * C * sizeof(float)));
    dim3 grid((unsigned)ceil_div(C, kThreads), (unsigned)(nchunks < 65535 ? nchunks : 65535));
    MT_LAUNCH(column_sum_partials_kernel<T>, grid, kThreads, 0, stream, partial, x, N, C, nchunks);
    MT_LAUNCH(finish_column_sums_kernel<T>, (unsigned)ceil_div(C, kThreads), kThreads, 0, stream,
              dst, partial, nchunks, C);
}

void column_sums_accumulate(float* dst, const float* x, int N, int C, cudaStream_t stream) {
    column_sums_accumulate<float>(dst, x, N, C, stream);
}

// ---- instantiations ----------------------------------------------------------------------------
#define MT_INSTANTIATE(T)                                                                  \
    template void sum_squares<T>(double*, const T*, int64_t, cudaStream_t);                \
    template void column_sums_accumulate<T>(T*, const T*, int, int, cudaStream_t);         \
    template void add_inplace<T>(T*, const T*, int64_t, cudaStream_t);                     \
    template void scale_inplace<T>(T*, float, int64_t, cudaStream_t);                      \
    template void cast<T, float>(T*, const float*, int64_t, cudaStream_t);                 \
    template void cast<T, __nv_bfloat16>(T*, const __nv_bfloat16*, int64_t, cudaStream_t); \
    template void cast<T, __half>(T*, const __half*, int64_t, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
