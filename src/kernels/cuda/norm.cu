// LayerNorm on the GPU: one warp per row for the forward and for d(inp); the parameter gradients
// are column sums over rows, done as per-chunk partial sums and one fixed-order pass (no atomics).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kRowThreads = 256;  // 8 warps, 8 rows per block
constexpr int kRowsPerBlock = kRowThreads / 32;

template <typename T>
static __global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                                const T* weight, const T* bias, int N, int C,
                                                float eps) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together
    const T* x = inp + row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += to_float(x[i]);
    const float m = warp_sum(s) / C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float d = to_float(x[i]) - m;
        v += d * d;
    }
    v = warp_sum(v) / C;
    const float r = 1.0f / sqrtf(v + eps);
    T* o = out + row * C;
    for (int i = lane; i < C; i += 32) {
        o[i] = from_float<T>((to_float(x[i]) - m) * r * to_float(weight[i]) + to_float(bias[i]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

template <typename T>
static void launch_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                           const T* bias, int N, int C, float eps, cudaStream_t stream) {
    if (N <= 0) return;
    if (C <= 0) fail("cuda::layernorm_forward: C is {}, expected > 0", C);
    MT_LAUNCH(layernorm_forward_kernel<T>, (unsigned)ceil_div(N, kRowsPerBlock), kRowThreads, 0,
              stream, out, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps, cudaStream_t stream) {
    launch_forward(out, mean, rstd, inp, weight, bias, N, C, eps, stream);
}

void layernorm_forward_bf16(__nv_bfloat16* out, float* mean, float* rstd, const __nv_bfloat16* inp,
                            const __nv_bfloat16* weight, const __nv_bfloat16* bias, int N, int C,
                            float eps, cudaStream_t stream) {
    launch_forward(out, mean, rstd, inp, weight, bias, N, C, eps, stream);
}

// d(inp) += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = weight * dout.
static __global__ void layernorm_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                             const float* weight, const float* mean,
                                             const float* rstd, int N, int C) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
    if (row >= N) return;
    const float* d = dout + row * C;
    const float* x = inp + row * C;
    const float m = mean[row], s = rstd[row];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float norm = (x[i] - m) * s;
        float dnorm = weight[i] * d[i];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = warp_sum(dnorm_mean) / C;
    dnorm_norm_mean = warp_sum(dnorm_norm_mean) / C;
    float* di = dinp + row * C;
    for (int i = lane; i < C; i += 32) {
        float norm = (x[i] - m) * s;
        float dnorm = weight[i] * d[i];
        di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
}

// Partial sums over chunks of kColumnChunkRows rows: thread per (channel, chunk); pw and pb are
// (nchunks, C).
static __global__ void layernorm_param_partials_kernel(float* pw, float* pb, const float* dout,
                                                       const float* inp, const float* mean,
                                                       const float* rstd, int N, int C,
                                                       int nchunks) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int k = blockIdx.y; k < nchunks; k += gridDim.y) {
        const int r0 = k * kColumnChunkRows;
        const int r1 = r0 + kColumnChunkRows < N ? r0 + kColumnChunkRows : N;
        float dw = 0.0f, db = 0.0f;
        for (int r = r0; r < r1; r++) {
            float d = dout[(int64_t)r * C + c];
            dw += (inp[(int64_t)r * C + c] - mean[r]) * rstd[r] * d;
            db += d;
        }
        pw[(int64_t)k * C + c] = dw;
        pb[(int64_t)k * C + c] = db;
    }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, cudaStream_t stream) {
    if (N <= 0) return;
    if (C <= 0) fail("cuda::layernorm_backward: C is {}, expected > 0", C);
    MT_LAUNCH(layernorm_dinp_kernel, (unsigned)ceil_div(N, kRowsPerBlock), kRowThreads, 0, stream,
              dinp, dout, inp, weight, mean, rstd, N, C);

    const int nchunks = (int)ceil_div(N, kColumnChunkRows);
    float* pw = static_cast<float*>(device_scratch(2 * (size_t)nchunks * C * sizeof(float)));
    float* pb = pw + (size_t)nchunks * C;
    constexpr int kThreads = 256;
    dim3 grid((unsigned)ceil_div(C, kThreads), (unsigned)(nchunks < 65535 ? nchunks : 65535));
    MT_LAUNCH(layernorm_param_partials_kernel, grid, kThreads, 0, stream, pw, pb, dout, inp, mean,
              rstd, N, C, nchunks);
    finish_column_sums(dweight, pw, nchunks, C, stream);
    finish_column_sums(dbias, pb, nchunks, C, stream);
}

}  // namespace memtrain::cuda
