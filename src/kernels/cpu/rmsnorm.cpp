// RMSNorm on the CPU (Llama): no mean subtraction and no bias; 1/rms is saved for backward.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* x = inp + (int64_t)n * C;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < C; i++) ss += x[i] * x[i];
        float s = 1.0f / std::sqrt(ss / C + eps);
        float* o = out + (int64_t)n * C;
        for (int i = 0; i < C; i++) o[i] = x[i] * s * weight[i];
        rstd[n] = s;
    }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
    // With n = x * s: dx = s * (w*d - n * mean(w*d * n)); the mean term is d(s)/dx's share.
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* d = dout + (int64_t)n * C;
        const float* x = inp + (int64_t)n * C;
        float s = rstd[n];
        float dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_norm_mean)
        for (int i = 0; i < C; i++) dnorm_norm_mean += weight[i] * d[i] * x[i] * s;
        dnorm_norm_mean /= C;
        float* di = dinp + (int64_t)n * C;
        for (int i = 0; i < C; i++) di[i] += (weight[i] * d[i] - x[i] * s * dnorm_norm_mean) * s;
    }
    if (!dweight) return;  // a frozen norm (LoRA): only the input gradient
    // Parameter gradient: column blocks per thread, rows in order (deterministic).
    constexpr int kBlock = 64;
    int nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        int i0 = blk * kBlock, i1 = std::min(C, i0 + kBlock);
        float dw[kBlock] = {};
        for (int n = 0; n < N; n++) {
            const float* d = dout + (int64_t)n * C;
            const float* x = inp + (int64_t)n * C;
            float s = rstd[n];
            for (int i = i0; i < i1; i++) dw[i - i0] += x[i] * s * d[i];
        }
        for (int i = i0; i < i1; i++) dweight[i] += dw[i - i0];
    }
}

}  // namespace memtrain::cpu
