// Causal grouped-query self-attention on the CPU (multi-head when NKV == NH), in blocks of kRows
// query rows: each block's scores are one GEMM (the rows' q against the keys up to the block's
// last row), its causal softmax a row at a time, and its output one GEMM of the probabilities
// with v; the backward forms the block's d(probabilities), d(q), and the d(k), d(v) updates as
// GEMMs too. Every GEMM of one (batch, head) runs on the thread that owns it (single-threaded
// inside the parallel loop), so the bits never depend on the thread count. Under bf16 the GEMMs
// take bf16 operands with fp32 accumulation (kernels/cpu/gemm.h), as PyTorch's autocast runs
// attention's products; the softmax is fp32 either way.
// The (B,NH,T,T) probabilities are kept for the backward pass, or (lse) each row's log-sum-exp,
// from which the backward recomputes them. Forward parallelises over (batch, query head);
// backward over (batch, kv head), walking that kv head's query heads in order, so the d(k) and
// d(v) sums shared by a group never race and are summed in a fixed order. Attention dropout
// (model.dropout) drops the probabilities that weight v, by the hash mask of
// kernels/dropout_mask.h: nothing more is stored.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace memtrain::cpu {

namespace {

constexpr int kRows = 64;  // query rows per block

// One thread's GEMMs inside the attention's parallel loop: fp32 through OpenBLAS, or bf16
// operands rounded into this thread's own scratch.
struct TileGemm {
    bool bf16;
    std::vector<uint16_t> buf;
    void operator()(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
                    int ldb, float beta, float* C, int ldc) {
        if (!bf16) {
            gemm(nullptr, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
            return;
        }
        const std::size_t need = (std::size_t)M * K + (std::size_t)K * N;
        if (buf.size() < need) buf.resize(need);
        const Bf16Gemm g{buf.data(), buf.size()};
        gemm(&g, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    }
};

}  // namespace

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       int NKV, const DropoutMask* drop, float* lse, bool bf16) {
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
            float* a = att ? att + ((int64_t)b * NH + h) * T * T : nullptr;
            const uint64_t key = dropping ? drop->key(b) : 0;
            TileGemm mm{bf16, {}};
            std::vector<float> p((std::size_t)kRows * T);  // a block's scores, then probabilities
            for (int i0 = 0; i0 < T; i0 += kRows) {
                const int R = std::min(kRows, T - i0), n = i0 + R;  // rows, keys they may see
                mm(false, true, R, n, hs, qbase + (int64_t)i0 * QKV, QKV, kbase, QKV, 0.0f,
                   p.data(), n);
                for (int r = 0; r < R; r++) {
                    const int i = i0 + r;
                    float* row = p.data() + (int64_t)r * n;
                    float maxv = -INFINITY;
                    for (int j = 0; j <= i; j++) {
                        row[j] *= scale;
                        maxv = std::max(maxv, row[j]);
                    }
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int j = 0; j <= i; j++) {
                        const float e = exp_vec(row[j] - maxv);
                        row[j] = e;
                        sum += e;
                    }
                    const float inv = 1.0f / sum;
                    for (int j = 0; j <= i; j++) row[j] *= inv;
                    for (int j = i + 1; j < n; j++) row[j] = 0.0f;
                    if (a) {
                        float* arow = a + (int64_t)i * T;
                        std::memcpy(arow, row, sizeof(float) * n);
                        std::fill(arow + n, arow + T, 0.0f);
                    } else {
                        lse[((int64_t)b * NH + h) * T + i] = maxv + std::log(sum);
                    }
                    if (dropping)
                        for (int j = 0; j <= i; j++)
                            row[j] *= drop->factor(key, ((uint64_t)h * T + i) * T + j);
                }
                mm(false, false, R, hs, n, p.data(), n, vbase, QKV, 0.0f,
                   out + ((int64_t)b * T + i0) * C + h * hs, C);
            }
        }
    }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH, int NKV, const DropoutMask* drop, const float* lse,
                        bool bf16) {
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
            const uint64_t key = dropping ? drop->key(b) : 0;
            TileGemm mm{bf16, {}};
            // One block of rows at a time: P (the probabilities), its dropped copy, d(P) then
            // d(scores); no (T,T) scratch.
            std::vector<float> p((std::size_t)kRows * T), pd((std::size_t)kRows * T),
                dp((std::size_t)kRows * T);
            for (int t = 0; t < T; t++) {
                std::memset(dkbase + (int64_t)t * QKV, 0, hs * sizeof(float));
                std::memset(dvbase + (int64_t)t * QKV, 0, hs * sizeof(float));
            }
            for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                const float* qbase = qkv + (int64_t)b * T * QKV + h * hs;
                float* dqbase = dqkv + (int64_t)b * T * QKV + h * hs;
                const float* a = att ? att + ((int64_t)b * NH + h) * T * T : nullptr;
                for (int i0 = 0; i0 < T; i0 += kRows) {
                    const int R = std::min(kRows, T - i0), n = i0 + R;
                    const float* q = qbase + (int64_t)i0 * QKV;
                    const float* d = dout + ((int64_t)b * T + i0) * C + h * hs;
                    if (!a)  // p_ij = exp(s_ij - lse_i), s the forward's scaled scores
                        mm(false, true, R, n, hs, q, QKV, kbase, QKV, 0.0f, p.data(), n);
                    // d(P) = d(out) v^T, before the dropout mask.
                    mm(false, true, R, n, hs, d, C, vbase, QKV, 0.0f, dp.data(), n);
                    for (int r = 0; r < R; r++) {
                        const int i = i0 + r;
                        float* prow = p.data() + (int64_t)r * n;
                        float* pdrow = pd.data() + (int64_t)r * n;
                        float* dprow = dp.data() + (int64_t)r * n;
                        if (a) {
                            std::memcpy(prow, a + (int64_t)i * T, sizeof(float) * n);
                        } else {
                            const float l = lse[((int64_t)b * NH + h) * T + i];
#pragma omp simd
                            for (int j = 0; j <= i; j++) prow[j] = exp_vec(prow[j] * scale - l);
                            for (int j = i + 1; j < n; j++) prow[j] = 0.0f;
                        }
                        // Under dropout v was weighted by the dropped probabilities, and d(P)
                        // is d(dropped) through the same mask.
                        for (int j = 0; j <= i; j++) {
                            float f = 1.0f;
                            if (dropping) f = drop->factor(key, ((uint64_t)h * T + i) * T + j);
                            pdrow[j] = prow[j] * f;
                            dprow[j] *= f;
                        }
                        for (int j = i + 1; j < n; j++) pdrow[j] = dprow[j] = 0.0f;
                        // softmax backward: d(score)_j = p_j (dp_j - sum_k p_k dp_k) * scale
                        float s = 0.0f;
                        for (int j = 0; j <= i; j++) s += prow[j] * dprow[j];
                        for (int j = 0; j <= i; j++) dprow[j] = prow[j] * (dprow[j] - s) * scale;
                    }
                    // d(v) += P_dropped^T d(out); d(q) = d(S) k; d(k) += d(S)^T q.
                    mm(true, false, n, hs, R, pd.data(), n, d, C, 1.0f, dvbase, QKV);
                    mm(false, false, R, hs, n, dp.data(), n, kbase, QKV, 0.0f,
                       dqbase + (int64_t)i0 * QKV, QKV);
                    mm(true, false, n, hs, R, dp.data(), n, q, QKV, 1.0f, dkbase, QKV);
                }
            }
        }
    }
}

}  // namespace memtrain::cpu
