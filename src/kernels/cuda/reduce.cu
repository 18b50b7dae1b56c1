// Reductions and elementwise helpers: a += b, a *= s, the deterministic sum of squares, the
// fixed-order column sums shared by the bias and norm-parameter gradients, and casts.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kThreads = 256;

// ---- small helpers -----------------------------------------------------------------------------
static __global__ void add_kernel(float* a, const float* b, int64_t n) {
    MT_GRID_STRIDE(i, n) a[i] += b[i];
}
static __global__ void scale_kernel(float* a, float s, int64_t n) {
    MT_GRID_STRIDE(i, n) a[i] *= s;
}

void add_inplace(float* a, const float* b, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(add_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, a, b, n);
}

void scale_inplace(float* a, float s, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(scale_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, a, s, n);
}

// ---- sum of squares: fixed chunks of kSumChunk elements, one block each, then one block sums the
// chunk results in order. The order depends on n alone.
constexpr int64_t kSumChunk = 1 << 16;

static __global__ void sum_squares_chunks_kernel(double* partial, const float* a, int64_t n) {
    __shared__ double shared[32];
    const int64_t begin = blockIdx.x * kSumChunk;
    const int64_t end = begin + kSumChunk < n ? begin + kSumChunk : n;
    double s = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        double x = a[i];
        s += x * x;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: thread t sums entries t, t + blockDim, ... in order, then a fixed tree.
static __global__ void sum_in_order_kernel(double* out, const double* in, int64_t n) {
    __shared__ double shared[32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) *out = s;
}

double sum_doubles(const double* values, int64_t n, double* result_device, cudaStream_t stream) {
    MT_LAUNCH(sum_in_order_kernel, 1, 1024, 0, stream, result_device, values, n);
    double result = 0.0;
    MT_CUDA_CHECK(
        cudaMemcpyAsync(&result, result_device, sizeof(double), cudaMemcpyDeviceToHost, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return result;
}

double sum_squares(const float* a, int64_t n, cudaStream_t stream) {
    if (n <= 0) return 0.0;
    const int64_t nchunks = ceil_div(n, kSumChunk);
    double* partial = static_cast<double*>(device_scratch((nchunks + 1) * sizeof(double)));
    MT_LAUNCH(sum_squares_chunks_kernel, (unsigned)nchunks, kThreads, 0, stream, partial, a, n);
    return sum_doubles(partial, nchunks, partial + nchunks, stream);
}

// ---- column sums for bias gradients: thread per (column, chunk of kColumnChunkRows rows) --------
static __global__ void column_sum_partials_kernel(float* partial, const float* x, int N, int C,
                                                  int nchunks) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int k = blockIdx.y; k < nchunks; k += gridDim.y) {
        const int r0 = k * kColumnChunkRows;
        const int r1 = r0 + kColumnChunkRows < N ? r0 + kColumnChunkRows : N;
        float s = 0.0f;
        for (int r = r0; r < r1; r++) s += x[(int64_t)r * C + c];
        partial[(int64_t)k * C + c] = s;
    }
}

static __global__ void finish_column_sums_kernel(float* dst, const float* partial, int nchunks,
                                                 int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int k = 0; k < nchunks; k++) s += partial[(int64_t)k * C + c];
    dst[c] += s;
}

void finish_column_sums(float* dst, const float* partial, int nchunks, int C, cudaStream_t stream) {
    MT_LAUNCH(finish_column_sums_kernel, (unsigned)ceil_div(C, kThreads), kThreads, 0, stream, dst,
              partial, nchunks, C);
}

void column_sums_accumulate(float* dst, const float* x, int N, int C, cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    const int nchunks = (int)ceil_div(N, kColumnChunkRows);
    float* partial = static_cast<float*>(device_scratch((size_t)nchunks * C * sizeof(float)));
    dim3 grid((unsigned)ceil_div(C, kThreads), (unsigned)(nchunks < 65535 ? nchunks : 65535));
    MT_LAUNCH(column_sum_partials_kernel, grid, kThreads, 0, stream, partial, x, N, C, nchunks);
    finish_column_sums(dst, partial, nchunks, C, stream);
}

// ---- casts -------------------------------------------------------------------------------------
static __global__ void f32_to_bf16_kernel(__nv_bfloat16* out, const float* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = __float2bfloat16_rn(inp[i]);
}
static __global__ void bf16_to_f32_kernel(float* out, const __nv_bfloat16* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = __bfloat162float(inp[i]);
}
static __global__ void f32_to_f16_kernel(__half* out, const float* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = __float2half_rn(inp[i]);
}
static __global__ void f16_to_f32_kernel(float* out, const __half* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = __half2float(inp[i]);
}

void cast_f32_to_bf16(__nv_bfloat16* out, const float* inp, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(f32_to_bf16_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, inp,
              n);
}
void cast_bf16_to_f32(float* out, const __nv_bfloat16* inp, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(bf16_to_f32_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, inp,
              n);
}
void cast_f32_to_f16(__half* out, const float* inp, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(f32_to_f16_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, inp, n);
}
void cast_f16_to_f32(float* out, const __half* inp, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(f16_to_f32_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, out, inp, n);
}

}  // namespace memtrain::cuda
