// Causal multi-head self-attention on the CPU. The (B,NH,T,T) probabilities are kept for the
// backward pass; each (batch, head) pair is independent, which is the unit of parallel work.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

static inline float dot(const float* a, const float* b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    const int hs = C / NH;
    const int C3 = 3 * C;
    const float scale = 1.0f / std::sqrt((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float* base = qkv + (int64_t)b * T * C3 + h * hs;
            float* a = att + ((int64_t)b * NH + h) * T * T;
            for (int i = 0; i < T; i++) {
                const float* q = base + (int64_t)i * C3;
                float* row = a + (int64_t)i * T;
                float maxv = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    float s = dot(q, base + (int64_t)j * C3 + C, hs) * scale;
                    row[j] = s;
                    if (s > maxv) maxv = s;
                }
                float sum = 0.0f;
                for (int j = 0; j <= i; j++) {
                    float e = std::exp(row[j] - maxv);
                    row[j] = e;
                    sum += e;
                }
                float inv = 1.0f / sum;
                for (int j = 0; j <= i; j++) row[j] *= inv;
                for (int j = i + 1; j < T; j++) row[j] = 0.0f;
                float* o = out + ((int64_t)b * T + i) * C + h * hs;
                for (int d = 0; d < hs; d++) o[d] = 0.0f;
                for (int j = 0; j <= i; j++) {
                    const float* v = base + (int64_t)j * C3 + 2 * C;
                    float w = row[j];
#pragma omp simd
                    for (int d = 0; d < hs; d++) o[d] += w * v[d];
                }
            }
        }
    }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH) {
    const int hs = C / NH;
    const int C3 = 3 * C;
    const float scale = 1.0f / std::sqrt((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float* base = qkv + (int64_t)b * T * C3 + h * hs;
            float* dbase = dqkv + (int64_t)b * T * C3 + h * hs;
            const float* a = att + ((int64_t)b * NH + h) * T * T;
            std::vector<float> darow(T);  // one row of d(att) at a time: no (T,T) scratch
            for (int t = 0; t < T; t++) {
                float* r = dbase + (int64_t)t * C3;
                std::memset(r, 0, hs * sizeof(float));
                std::memset(r + C, 0, hs * sizeof(float));
                std::memset(r + 2 * C, 0, hs * sizeof(float));
            }
            for (int i = 0; i < T; i++) {
                const float* d = dout + ((int64_t)b * T + i) * C + h * hs;
                const float* arow = a + (int64_t)i * T;
                // d(att) and d(v)
                for (int j = 0; j <= i; j++) {
                    const float* v = base + (int64_t)j * C3 + 2 * C;
                    float* dv = dbase + (int64_t)j * C3 + 2 * C;
                    darow[j] = dot(d, v, hs);
                    float w = arow[j];
#pragma omp simd
                    for (int k = 0; k < hs; k++) dv[k] += w * d[k];
                }
                // softmax backward: dpre_j = a_j * (da_j - sum_k a_k da_k)
                float s = 0.0f;
                for (int j = 0; j <= i; j++) s += arow[j] * darow[j];
                const float* q = base + (int64_t)i * C3;
                float* dq = dbase + (int64_t)i * C3;
                for (int j = 0; j <= i; j++) {
                    float dpre = arow[j] * (darow[j] - s) * scale;
                    const float* k = base + (int64_t)j * C3 + C;
                    float* dk = dbase + (int64_t)j * C3 + C;
#pragma omp simd
                    for (int x = 0; x < hs; x++) {
                        dq[x] += dpre * k[x];
                        dk[x] += dpre * q[x];
                    }
                }
            }
        }
    }
}

}  // namespace memtrain::cpu
