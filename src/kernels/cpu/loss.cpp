// Classifier (tied embedding) + softmax cross-entropy on the CPU, a chunk of rows at a time, so
// the full (B*T, V) logits never exist: for GPT-2's 50257-token vocabulary at B*T = 8192 that
// is 1.6 GB of fp32 we never hold. The backward is fused into the same pass.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace memtrain::cpu {

double classifier_loss(float* dx, float* dwte, float* logits_buf, const float* x, const float* wte,
                       const int32_t* targets, int N, int C, int V, int Vp, int chunk,
                       float grad_scale, const Bf16Gemm* g) {
    // bf16: scratch = [wte (Vp,C) | x chunk (chunk,C) | d(logits) chunk (chunk,Vp)].
    uint16_t *wb = nullptr, *xb = nullptr, *lb = nullptr;
    if (g) {
        const std::size_t rows = std::min(chunk, N);  // rows of the largest chunk
        const std::size_t need = (std::size_t)Vp * C + rows * (C + Vp);
        if (need > g->elems)
            fail(
                "bf16 classifier ({} x {} rows of {}): needs {} bf16 elements, the scratch holds "
                "{}",
                rows, Vp, C, need, g->elems);
        wb = g->scratch;
        xb = wb + (std::size_t)Vp * C;
        lb = xb + rows * C;
        to_bf16(wb, wte, Vp, C, C);
    }
    double total = 0.0;
    std::vector<double> row_loss(chunk);
    for (int r0 = 0; r0 < N; r0 += chunk) {
        int R = std::min(chunk, N - r0);
        const float* xr = x + (int64_t)r0 * C;
        // logits (R, Vp) = x (R, C) @ wte^T (C, Vp); only the first V columns are real.
        if (g) {
            to_bf16(xb, xr, R, C, C);
            gemm_bf16(false, true, R, Vp, C, xb, wb, 0.0f, logits_buf, Vp);
        } else {
            gemm(nullptr, false, true, R, Vp, C, xr, C, wte, C, 0.0f, logits_buf, Vp);
        }
#pragma omp parallel for schedule(static)
        for (int r = 0; r < R; r++) {
            float* l = logits_buf + (int64_t)r * Vp;
            float maxv = -INFINITY;
            for (int v = 0; v < V; v++) maxv = std::max(maxv, l[v]);
            double sum = 0.0;
#pragma omp simd reduction(+ : sum)
            for (int v = 0; v < V; v++) sum += exp_vec(l[v] - maxv);
            double lse = maxv + std::log(sum);
            int y = targets[r0 + r];
            row_loss[r] = lse - l[y];
            if (dx) {
                // dlogits = (softmax - onehot) * grad_scale; padded columns get no gradient.
                const float norm = (float)(grad_scale / sum);
#pragma omp simd
                for (int v = 0; v < V; v++) l[v] = exp_vec(l[v] - maxv) * norm;
                l[y] -= grad_scale;
                for (int v = V; v < Vp; v++) l[v] = 0.0f;
            }
        }
        for (int r = 0; r < R; r++) total += row_loss[r];
        if (dx && g) {
            to_bf16(lb, logits_buf, R, Vp, Vp);
            gemm_bf16(false, false, R, C, Vp, lb, wb, 0.0f, dx + (int64_t)r0 * C, C);
            if (dwte) gemm_bf16(true, false, Vp, C, R, lb, xb, 1.0f, dwte, C);
        } else if (dx) {
            gemm(nullptr, false, false, R, C, Vp, logits_buf, Vp, wte, C, 0.0f,
                 dx + (int64_t)r0 * C, C);
            if (dwte)  // null: a frozen classifier (LoRA)
                gemm(nullptr, true, false, Vp, C, R, logits_buf, Vp, xr, C, 1.0f, dwte, C);
        }
    }
    return total;
}

void classifier_logits(float* out, const float* x, const float* wte, int N, int C, int V,
                       const Bf16Gemm* g) {
    gemm(g, false, true, N, V, C, x, C, wte, C, 0.0f, out, V);
}

}  // namespace memtrain::cpu
