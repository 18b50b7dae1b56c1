// Activations: GELU (tanh approximation, as GPT-2) and SwiGLU (Llama), elementwise over 128-bit
// packs where the pointers and widths allow (pack.cuh), one pass over memory.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

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

// Pack i covers elements [i W, i W + W); the last one may be partial and goes element by element.
template <typename T, int W>
static __global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
    MT_GRID_STRIDE(i, (n + W - 1) / W) {
        const int64_t e = i * W;
        if (e + W <= n) {
            float x[W];
            load_floats<T, W>(inp + e, x);
#pragma unroll
            for (int j = 0; j < W; j++) x[j] = gelu(x[j]);
            store_floats<T, W>(out + e, x);
        } else {
            for (int64_t k = e; k < n; k++) out[k] = from_float<T>(gelu(to_float(inp[k])));
        }
    }
}

// dinp may alias dout: each element is read before the same thread writes it.
template <typename T, int W>
static __global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
    MT_GRID_STRIDE(i, (n + W - 1) / W) {
        const int64_t e = i * W;
        if (e + W <= n) {
            float x[W], d[W];
            load_floats<T, W>(inp + e, x);
            load_floats<T, W>(dout + e, d);
#pragma unroll
            for (int j = 0; j < W; j++) x[j] = gelu_grad(x[j]) * d[j];
            store_floats<T, W>(dinp + e, x);
        } else {
            for (int64_t k = e; k < n; k++) {
                dinp[k] = from_float<T>(gelu_grad(to_float(inp[k])) * to_float(dout[k]));
            }
        }
    }
}

// ---- SwiGLU, same formulas as cpu/swiglu.cpp ----------------------------------------------------
// Pack i of the (N, H) output: row i / (H / W), columns from (i % (H / W)) W; H is a multiple of W.
template <typename T, int W>
static __global__ void swiglu_forward_kernel(T* out, const T* inp, int N, int H) {
    const int hp = H / W;
    MT_GRID_STRIDE(i, (int64_t)N * hp) {
        const int64_t n = i / hp;
        const int h = (int)(i % hp) * W;
        const T* g = inp + n * 2 * H + h;
        float gv[W], uv[W];
        load_floats<T, W>(g, gv);
        load_floats<T, W>(g + H, uv);
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float sig = 1.0f / (1.0f + expf(-gv[j]));
            gv[j] = gv[j] * sig * uv[j];
        }
        store_floats<T, W>(out + n * H + h, gv);
    }
}

template <typename T, int W>
static __global__ void swiglu_backward_kernel(T* dinp, const T* inp, const T* dout, int N, int H) {
    const int hp = H / W;
    MT_GRID_STRIDE(i, (int64_t)N * hp) {
        const int64_t n = i / hp;
        const int h = (int)(i % hp) * W;
        const T* g = inp + n * 2 * H + h;
        float gv[W], uv[W], d[W];
        load_floats<T, W>(g, gv);
        load_floats<T, W>(g + H, uv);
        load_floats<T, W>(dout + n * H + h, d);
        float dg[W], du[W];
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float sig = 1.0f / (1.0f + expf(-gv[j]));
            const float silu = gv[j] * sig;
            // d silu / dg = sig * (1 + g * (1 - sig))
            dg[j] = d[j] * uv[j] * sig * (1.0f + gv[j] * (1.0f - sig));
            du[j] = d[j] * silu;
        }
        T* di = dinp + n * 2 * H + h;
        store_floats<T, W>(di, dg);
        store_floats<T, W>(di + H, du);
    }
}

// ---- launch ------------------------------------------------------------------------------------
// kBackward: dinp from inp and dout; else out from inp (dout unused).
template <typename T, int W, bool kBackward>
static void launch_gelu(T* out_or_dinp, const T* inp, const T* dout, int64_t n,
                        cudaStream_t stream) {
    const unsigned blocks = elementwise_blocks(ceil_div(n, W), kThreads);
    if constexpr (kBackward) {
        MT_LAUNCH((gelu_backward_kernel<T, W>), blocks, kThreads, 0, stream, out_or_dinp, inp, dout,
                  n);
    } else {
        MT_LAUNCH((gelu_forward_kernel<T, W>), blocks, kThreads, 0, stream, out_or_dinp, inp, n);
    }
}

template <typename T, bool kBackward>
static void run_gelu(const char* op, T* out_or_dinp, const T* inp, const T* dout, int64_t n,
                     cudaStream_t stream) {
    if (n < 0) fail("cuda::{}: n is {}, expected >= 0", op, n);
    if (n == 0) return;
    const bool vec = aligned16(out_or_dinp) && aligned16(inp) && (!kBackward || aligned16(dout));
    if (vec) {
        launch_gelu<T, kPackWidth<T>, kBackward>(out_or_dinp, inp, dout, n, stream);
    } else {
        launch_gelu<T, 1, kBackward>(out_or_dinp, inp, dout, n, stream);
    }
}

template <typename T, int W, bool kBackward>
static void launch_swiglu(T* out_or_dinp, const T* inp, const T* dout, int N, int H,
                          cudaStream_t stream) {
    const unsigned blocks = elementwise_blocks((int64_t)N * (H / W), kThreads);
    if constexpr (kBackward) {
        MT_LAUNCH((swiglu_backward_kernel<T, W>), blocks, kThreads, 0, stream, out_or_dinp, inp,
                  dout, N, H);
    } else {
        MT_LAUNCH((swiglu_forward_kernel<T, W>), blocks, kThreads, 0, stream, out_or_dinp, inp, N,
                  H);
    }
}

template <typename T, bool kBackward>
static void run_swiglu(const char* op, T* out_or_dinp, const T* inp, const T* dout, int N, int H,
                       cudaStream_t stream) {
    if (N < 0 || H <= 0) fail("cuda::{}: N = {}, H = {}, expected N >= 0 and H > 0", op, N, H);
    if (N == 0) return;
    // Full packs need every row of gate, up and out to start on a 16-byte boundary.
    const bool vec = H % kPackWidth<T> == 0 && aligned16(out_or_dinp) && aligned16(inp) &&
                     (!kBackward || aligned16(dout));
    if (vec) {
        launch_swiglu<T, kPackWidth<T>, kBackward>(out_or_dinp, inp, dout, N, H, stream);
    } else {
        launch_swiglu<T, 1, kBackward>(out_or_dinp, inp, dout, N, H, stream);
    }
}

// ---- entry points ------------------------------------------------------------------------------
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n, cudaStream_t stream) {
    run_gelu<T, false>("gelu_forward", out, inp, nullptr, n, stream);
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream) {
    run_gelu<T, true>("gelu_backward", dinp, inp, dout, n, stream);
}

template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H, cudaStream_t stream) {
    run_swiglu<T, false>("swiglu_forward", out, inp, nullptr, N, H, stream);
}

template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int N, int H, cudaStream_t stream) {
    run_swiglu<T, true>("swiglu_backward", dinp, inp, dout, N, H, stream);
}

#define MT_INSTANTIATE(T)                                                          \
    template void gelu_forward<T>(T*, const T*, int64_t, cudaStream_t);            \
    template void gelu_backward<T>(T*, const T*, const T*, int64_t, cudaStream_t); \
    template void swiglu_forward<T>(T*, const T*, int, int, cudaStream_t);         \
    template void swiglu_backward<T>(T*, const T*, const T*, int, int, cudaStream_t);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
