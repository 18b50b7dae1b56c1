// Rotary position embedding on the CPU, rotate-half convention (Hugging Face Llama), in place on
// the q and k heads of the packed qkv buffer. The angles are computed in double per call: the
// table is tiny next to the attention it feeds, and no state has to be kept per model.
#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward: the inverse rotation, which
// is the transpose of the forward's Jacobian).
void rope_apply(float* qkv, int B, int T, int NH, int NKV, int hs, float theta, float sign,
                int pos0) {
    const int half = hs / 2, QKV = (NH + 2 * NKV) * hs, heads = NH + NKV;
    std::vector<float> cs((std::size_t)T * half), sn((std::size_t)T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double inv_freq = std::pow((double)theta, -2.0 * i / hs);
            double a = (double)(pos0 + t) * inv_freq;
            cs[(std::size_t)t * half + i] = (float)std::cos(a);
            sn[(std::size_t)t * half + i] = sign * (float)std::sin(a);
        }
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float* row = qkv + ((int64_t)b * T + t) * QKV;
            const float* c = cs.data() + (std::size_t)t * half;
            const float* s = sn.data() + (std::size_t)t * half;
            // q heads then k heads are contiguous: [q (NH*hs) | k (NKV*hs) | v].
            for (int h = 0; h < heads; h++) {
                float* x = row + h * hs;
                for (int i = 0; i < half; i++) {
                    float x1 = x[i], x2 = x[i + half];
                    x[i] = x1 * c[i] - x2 * s[i];
                    x[i + half] = x2 * c[i] + x1 * s[i];
                }
            }
        }
    }
}

}  // namespace

void rope_forward(float* qkv, int B, int T, int NH, int NKV, int hs, float theta, int pos0) {
    rope_apply(qkv, B, T, NH, NKV, hs, theta, 1.0f, pos0);
}

void rope_backward(float* dqkv, int B, int T, int NH, int NKV, int hs, float theta) {
    rope_apply(dqkv, B, T, NH, NKV, hs, theta, -1.0f, 0);
}

}  // namespace memtrain::cpu
