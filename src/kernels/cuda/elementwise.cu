// Elementwise and reduction kernels: GELU (fp32 and bf16), casts, AdamW, a += b, a *= s, the
// deterministic sum of squares, and the fixed-order column sums shared by the bias gradients.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kThreads = 256;

// ---- GELU (tanh approximation), same formulas as cpu/activation.cpp ---------------------------
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ __forceinline__ float gelu(float x) {
    float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

__device__ __forceinline__ float gelu_grad(float x) {
    float cube = 0.044715f * x * x * x;
    float th = tanhf(kGeluScale * (x + cube));
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

template <typename T>
static __global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
    MT_GRID_STRIDE(i, n) out[i] = from_float<T>(gelu(to_float(inp[i])));
}

template <typename T>
static __global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
    MT_GRID_STRIDE(i, n) dinp[i] = from_float<T>(gelu_grad(to_float(inp[i])) * to_float(dout[i]));
}

void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(gelu_forward_kernel<float>, elementwise_blocks(n, kThreads), kThreads, 0, stream, out,
              inp, n);
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                   cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(gelu_backward_kernel<float>, elementwise_blocks(n, kThreads), kThreads, 0, stream,
              dinp, inp, dout, n);
}

void gelu_forward_bf16(__nv_bfloat16* out, const __nv_bfloat16* inp, int64_t n,
                       cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(gelu_forward_kernel<__nv_bfloat16>, elementwise_blocks(n, kThreads), kThreads, 0,
              stream, out, inp, n);
}

void gelu_backward_bf16(__nv_bfloat16* dinp, const __nv_bfloat16* inp, const __nv_bfloat16* dout,
                        int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    MT_LAUNCH(gelu_backward_kernel<__nv_bfloat16>, elementwise_blocks(n, kThreads), kThreads, 0,
              stream, dinp, inp, dout, n);
}

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

// ---- AdamW, the arithmetic of optim/optimizer.cpp's AdamW::step
// -----------------------------------
static __global__ void adamw_kernel(float* p, float* m, float* v, const float* g,
                                    const uint8_t* decay, int64_t n, float b1, float b2, float eps,
                                    float step_size, float bc2_sqrt, float decay_factor) {
    MT_GRID_STRIDE(i, n) {
        float gi = g[i];
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        float d = (decay == nullptr || decay[i]) ? decay_factor : 1.0f;
        p[i] = p[i] * d - step_size * mi / denom;
    }
}

void adamw_step(float* params, float* m, float* v, const float* grads, const uint8_t* decay,
                int64_t n, double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, cudaStream_t stream) {
    if (step < 1) fail("cuda::adamw_step: step is {}, expected the 1-based count (>= 1)", step);
    if (n <= 0) return;
    // Host-side constants exactly as the CPU AdamW computes them.
    const double bc1 = 1.0 - std::pow(beta1, (double)step);
    const double bc2 = 1.0 - std::pow(beta2, (double)step);
    const float step_size = (float)(lr / bc1);
    const float bc2_sqrt = (float)std::sqrt(bc2);
    const float decay_factor = (float)(1.0 - lr * weight_decay);
    MT_LAUNCH(adamw_kernel, elementwise_blocks(n, kThreads), kThreads, 0, stream, params, m, v,
              grads, decay, n, (float)beta1, (float)beta2, (float)eps, step_size, bc2_sqrt,
              decay_factor);
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
