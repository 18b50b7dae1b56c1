// Causal grouped-query self-attention on the CPU (multi-head when NKV == NH). The (B,NH,T,T)
// probabilities are kept for the backward pass. Forward parallelises over (batch, query head);
// backward over (batch, kv head), walking that kv head's query heads in order, so the d(k) and
// d(v) sums shared by a group never race and are summed in a fixed order. Attention dropout
// (model.dropout) drops the probabilities that weight v, by the hash mask of
// kernels/dropout_mask.h: nothing more is stored.
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

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       int NKV, const DropoutMask* drop, float* lse) {
    const bool dropping = drop && drop->on();
    const int hs = C / NH;
    const int QKV = C + 2 * NKV * hs;
    const int group = NH / NKV;
    const float scale = 1.0f / std::sqrt((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float* qbase = qkv + (int64_t)b * T * QKV + h * hs;
            const float* kbase = qkv + (int64_t)b * T * QKV + C + (h / group) * hs;
            const float* vbase = kbase + NKV * hs;
            // Without att, each row's probabilities live in a row of scratch and only their
            // log-sum-exp is kept: the same arithmetic, so the same output bits.
            std::vector<float> scratch(att ? 0 : T);
            float* a = att ? att + ((int64_t)b * NH + h) * T * T : nullptr;
            const uint64_t key = dropping ? drop->key(b) : 0;
            for (int i = 0; i < T; i++) {
                const float* q = qbase + (int64_t)i * QKV;
                float* row = a ? a + (int64_t)i * T : scratch.data();
                float maxv = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    float s = dot(q, kbase + (int64_t)j * QKV, hs) * scale;
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
                if (a)
                    for (int j = i + 1; j < T; j++) row[j] = 0.0f;
                else
                    lse[((int64_t)b * NH + h) * T + i] = maxv + std::log(sum);
                float* o = out + ((int64_t)b * T + i) * C + h * hs;
                for (int d = 0; d < hs; d++) o[d] = 0.0f;
                for (int j = 0; j <= i; j++) {
                    const float* v = vbase + (int64_t)j * QKV;
                    float w = row[j];
                    if (dropping) w *= drop->factor(key, ((uint64_t)h * T + i) * T + j);
#pragma omp simd
                    for (int d = 0; d < hs; d++) o[d] += w * v[d];
                }
            }
        }
    }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH, int NKV, const DropoutMask* drop, const float* lse) {
    const bool dropping = drop && drop->on();
    const int hs = C / NH;
    const int QKV = C + 2 * NKV * hs;
    const int group = NH / NKV;
    const float scale = 1.0f / std::sqrt((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int kvh = 0; kvh < NKV; kvh++) {
            const float* kbase = qkv + (int64_t)b * T * QKV + C + kvh * hs;
            const float* vbase = kbase + NKV * hs;
            float* dkbase = dqkv + (int64_t)b * T * QKV + C + kvh * hs;
            float* dvbase = dkbase + NKV * hs;
            std::vector<float> darow(T);           // one row of d(att) at a time: no (T,T) scratch
            std::vector<float> prow(att ? 0 : T);  // without att: one row recomputed from lse
            const uint64_t key = dropping ? drop->key(b) : 0;
            for (int t = 0; t < T; t++) {
                std::memset(dkbase + (int64_t)t * QKV, 0, hs * sizeof(float));
                std::memset(dvbase + (int64_t)t * QKV, 0, hs * sizeof(float));
            }
            for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                const float* qbase = qkv + (int64_t)b * T * QKV + h * hs;
                float* dqbase = dqkv + (int64_t)b * T * QKV + h * hs;
                const float* a = att ? att + ((int64_t)b * NH + h) * T * T : nullptr;
                for (int t = 0; t < T; t++)
                    std::memset(dqbase + (int64_t)t * QKV, 0, hs * sizeof(float));
                for (int i = 0; i < T; i++) {
                    const float* d = dout + ((int64_t)b * T + i) * C + h * hs;
                    const float* q = qbase + (int64_t)i * QKV;
                    const float* arow = a ? a + (int64_t)i * T : prow.data();
                    if (!a) {  // p_j = exp(s_j - lse_i), s_j the forward's scaled score
                        const float l = lse[((int64_t)b * NH + h) * T + i];
                        for (int j = 0; j <= i; j++)
                            prow[j] = std::exp(dot(q, kbase + (int64_t)j * QKV, hs) * scale - l);
                    }
                    // d(att) and d(v); under dropout v was weighted by the dropped
                    // probabilities, and d(att) is d(dropped) through the same mask.
                    for (int j = 0; j <= i; j++) {
                        const float* v = vbase + (int64_t)j * QKV;
                        float* dv = dvbase + (int64_t)j * QKV;
                        darow[j] = dot(d, v, hs);
                        float w = arow[j];
                        if (dropping) {
                            const float f = drop->factor(key, ((uint64_t)h * T + i) * T + j);
                            darow[j] *= f;
                            w *= f;
                        }
#pragma omp simd
                        for (int k = 0; k < hs; k++) dv[k] += w * d[k];
                    }
                    // softmax backward: dpre_j = a_j * (da_j - sum_k a_k da_k)
                    float s = 0.0f;
                    for (int j = 0; j <= i; j++) s += arow[j] * darow[j];
                    float* dq = dqbase + (int64_t)i * QKV;
                    for (int j = 0; j <= i; j++) {
                        float dpre = arow[j] * (darow[j] - s) * scale;
                        const float* k = kbase + (int64_t)j * QKV;
                        float* dk = dkbase + (int64_t)j * QKV;
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
}

}  // namespace memtrain::cpu
