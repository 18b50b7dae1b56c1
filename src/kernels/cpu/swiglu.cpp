// SwiGLU (Llama's MLP activation) on the CPU: out = silu(gate) * up over a fused [gate | up]
// input, so c_fc stays one GEMM. libm's exp keeps the result within float rounding of PyTorch.
#include <cmath>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void swiglu_forward(float* out, const float* inp, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* g = inp + (int64_t)n * 2 * H;
        const float* u = g + H;
        float* o = out + (int64_t)n * H;
        for (int i = 0; i < H; i++) {
            float sig = 1.0f / (1.0f + std::exp(-g[i]));
            o[i] = g[i] * sig * u[i];
        }
    }
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* g = inp + (int64_t)n * 2 * H;
        const float* u = g + H;
        const float* d = dout + (int64_t)n * H;
        float* dg = dinp + (int64_t)n * 2 * H;
        float* du = dg + H;
        for (int i = 0; i < H; i++) {
            float sig = 1.0f / (1.0f + std::exp(-g[i]));
            float silu = g[i] * sig;
            // d silu / dg = sig * (1 + g * (1 - sig))
            dg[i] = d[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
            du[i] = d[i] * silu;
        }
    }
}

}  // namespace memtrain::cpu
