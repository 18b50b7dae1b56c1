// LayerNorm on the CPU (eps = 1e-5 by default, as GPT-2; model.norm_eps), with the mean and 1/std
// saved for backward.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* x = inp + (int64_t)n * C;
        float m = 0.0f;
#pragma omp simd reduction(+ : m)
        for (int i = 0; i < C; i++) m += x[i];
        m /= C;
        float v = 0.0f;
#pragma omp simd reduction(+ : v)
        for (int i = 0; i < C; i++) {
            float d = x[i] - m;
            v += d * d;
        }
        v /= C;
        float s = 1.0f / std::sqrt(v + eps);
        float* o = out + (int64_t)n * C;
        for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * weight[i] + bias[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* d = dout + (int64_t)n * C;
        const float* x = inp + (int64_t)n * C;
        float m = mean[n], s = rstd[n];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = weight[i] * d[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        float* di = dinp + (int64_t)n * C;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = weight[i] * d[i];
            di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
    if (!dweight) return;  // a frozen norm (LoRA): only the input gradient
    // Parameter gradients: column blocks per thread, rows in order (deterministic).
    constexpr int kBlock = 64;
    int nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        int i0 = blk * kBlock, i1 = std::min(C, i0 + kBlock);
        float dw[kBlock] = {}, db[kBlock] = {};
        for (int n = 0; n < N; n++) {
            const float* d = dout + (int64_t)n * C;
            const float* x = inp + (int64_t)n * C;
            float m = mean[n], s = rstd[n];
            for (int i = i0; i < i1; i++) {
                dw[i - i0] += (x[i] - m) * s * d[i];
                db[i - i0] += d[i];
            }
        }
        for (int i = i0; i < i1; i++) {
            dweight[i] += dw[i - i0];
            dbias[i] += db[i - i0];
        }
    }
}

}  // namespace memtrain::cpu
