// The optimizer on the GPU: AdamW with torch.optim.AdamW's arithmetic.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace memtrain::cuda {

constexpr int kThreads = 256;

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

}  // namespace memtrain::cuda
