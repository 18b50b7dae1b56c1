// Activations: GELU (tanh approximation, as GPT-2), fp32 and bf16.
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

}  // namespace memtrain::cuda
