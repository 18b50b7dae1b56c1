// The vocabulary-parallel embedding and cross-entropy (model/vocab_parallel.h).
#include "model/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/vec_math.h"

namespace memtrain {

void vocab_parallel_embedding(TpComm& tp, float* out, const int32_t* inp, const float* wte_local,
                              const float* wpe, int B, int T, int C, int v0, int Vl,
                              float* sp_scratch) {
    const int64_t N = (int64_t)B * T;
    float* lookup = sp_scratch ? sp_scratch : out;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float* o = lookup + n * C;
        const int32_t v = inp[n] - v0;
        if (v >= 0 && v < Vl)
            std::memcpy(o, wte_local + (int64_t)v * C, sizeof(float) * C);
        else
            std::memset(o, 0, sizeof(float) * C);
    }
    // This rank's rows [row0, row0 + rows) of the sum: all of them, or its sequence shard.
    int64_t row0 = 0, rows = N;
    if (sp_scratch) {
        rows = N / tp.size();
        row0 = rows * tp.rank();
        tp.reduce_scatter(TpSite::SpEmbedding, sp_scratch, out, N * C);
    } else {
        tp.all_reduce(TpSite::Embedding, out, N * C);
    }
    if (!wpe) return;
        // The same sum as cpu::embedding_forward's (the other ranks added exact zeros), at each
        // row's position in its sequence.
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        float* o = out + n * C;
        const float* p = wpe + ((row0 + n) % T) * C;
        for (int i = 0; i < C; i++) o[i] += p[i];
    }
}

void vocab_parallel_embedding_backward(float* dwte_local, float* dwpe, const float* dout,
                                       const int32_t* inp, int B, int T, int C, int v0, int Vl) {
    // As cpu::embedding_backward: threads split the channels, every element summed in (b, t)
    // order.
    constexpr int kBlock = 32;
    const int nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int i0 = blk * kBlock, i1 = std::min(C, i0 + kBlock);
        for (int64_t n = 0; n < (int64_t)B * T; n++) {
            const float* d = dout + n * C;
            const int32_t v = inp[n] - v0;
            if (v >= 0 && v < Vl) {
                float* e = dwte_local + (int64_t)v * C;
                for (int i = i0; i < i1; i++) e[i] += d[i];
            }
            if (dwpe) {
                float* p = dwpe + (n % T) * C;
                for (int i = i0; i < i1; i++) p[i] += d[i];
            }
        }
    }
}

double vocab_parallel_loss(TpComm& tp, float* dx, float* dwte_local, float* logits_buf,
                           const float* x, const float* wte_local, const int32_t* targets, int N,
                           int C, int V, int v0, int Vl, int chunk, float grad_scale,
                           float* dx_rows, const cpu::Bf16Gemm* g) {
    // Columns of this slice inside the real vocabulary (the rest are padding rows).
    const int real = std::clamp(V - v0, 0, Vl);
    double total = 0.0;
    std::vector<double> maxv(chunk);
    std::vector<float> sums(2 * (std::size_t)chunk);
    for (int r0 = 0; r0 < N; r0 += chunk) {
        const int R = std::min(chunk, N - r0);
        const float* xr = x + (int64_t)r0 * C;
        cpu::gemm(g, false, true, R, Vl, C, xr, C, wte_local, C, 0.0f, logits_buf, Vl);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < R; r++) {
            const float* l = logits_buf + (int64_t)r * Vl;
            float m = -INFINITY;
            for (int v = 0; v < real; v++) m = std::max(m, l[v]);
            maxv[r] = m;
        }
        tp.all_reduce_max(TpSite::LossMax, maxv.data(), R);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < R; r++) {
            const float* l = logits_buf + (int64_t)r * Vl;
            const float m = (float)maxv[r];
            double s = 0.0;
#pragma omp simd reduction(+ : s)
            for (int v = 0; v < real; v++) s += cpu::exp_vec(l[v] - m);
            const int y = targets[r0 + r] - v0;
            sums[r] = (float)s;
            sums[R + r] = y >= 0 && y < real ? l[y] : 0.0f;
        }
        tp.all_reduce(TpSite::LossSum, sums.data(), 2 * (int64_t)R);
        for (int r = 0; r < R; r++) {
            const double lse = (float)maxv[r] + std::log((double)sums[r]);
            total += lse - sums[R + r];
            if (!dx) continue;
            // dlogits = (softmax - onehot) * grad_scale; padded columns get no gradient.
            float* l = logits_buf + (int64_t)r * Vl;
            const float m = (float)maxv[r], norm = (float)(grad_scale / (double)sums[r]);
#pragma omp simd
            for (int v = 0; v < real; v++) l[v] = cpu::exp_vec(l[v] - m) * norm;
            for (int v = real; v < Vl; v++) l[v] = 0.0f;
            const int y = targets[r0 + r] - v0;
            if (y >= 0 && y < real) l[y] -= grad_scale;
        }
        if (dx) {
            cpu::gemm(g, false, false, R, C, Vl, logits_buf, Vl, wte_local, C, 0.0f,
                      dx + (int64_t)r0 * C, C);
            if (dwte_local)
                cpu::gemm(g, true, false, Vl, C, R, logits_buf, Vl, xr, C, 1.0f, dwte_local, C);
        }
    }
    if (dx && dx_rows)
        tp.reduce_scatter(TpSite::SpHeadScatter, dx, dx_rows, (int64_t)N * C);
    else if (dx)
        tp.all_reduce(TpSite::HeadBackward, dx, (int64_t)N * C);
    return total;
}

void vocab_parallel_logits(TpComm& tp, float* out, const float* x, const float* wte_local, int N,
                           int C, int V, int Vl) {
    std::vector<float> mine((std::size_t)N * Vl), all((std::size_t)N * Vl * tp.size());
    cpu::gemm(nullptr, false, true, N, Vl, C, x, C, wte_local, C, 0.0f, mine.data(), Vl);
    tp.all_gather(TpSite::Gather, mine.data(), all.data(), (int64_t)N * Vl);
    for (int64_t n = 0; n < N; n++)
        for (int v = 0; v < V; v++) out[n * V + v] = all[((int64_t)(v / Vl) * N + n) * Vl + v % Vl];
}

}  // namespace memtrain
