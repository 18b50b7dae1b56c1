// Matmul family on the CPU: GEMMs through kernels/cpu/gemm.h (OpenBLAS, or bf16 operands through
// oneDNN), bias and bias-gradient by hand.
#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, float beta, const Bf16Gemm* g) {
    if (bias) {
        // Seed out with the bias (plus the residual when beta = 1), then let the GEMM accumulate.
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float* o = out + (int64_t)n * OC;
            if (beta == 0.0f) {
                for (int j = 0; j < OC; j++) o[j] = bias[j];
            } else {
                for (int j = 0; j < OC; j++) o[j] = beta * o[j] + bias[j];
            }
        }
        beta = 1.0f;
    }
    gemm(g, false, false, N, OC, IC, inp, IC, weight, OC, beta, out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC, float beta, const Bf16Gemm* g) {
    if (g && (dinp || dweight)) {
        // d(out) is rounded once for both products: scratch = [dout (N,OC) | weight or inp].
        const std::size_t nd = (std::size_t)N * OC;
        const std::size_t need =
            nd + std::max(dinp ? (std::size_t)IC * OC : 0, dweight ? (std::size_t)N * IC : 0);
        if (need > g->elems)
            fail(
                "bf16 matmul backward ({} x {} x {}): needs {} bf16 elements, the scratch holds {}",
                N, IC, OC, need, g->elems);
        uint16_t* d = g->scratch;
        uint16_t* o = g->scratch + nd;
        to_bf16(d, dout, N, OC, OC);
        if (dinp) {
            if (beta != 0.0f && beta != 1.0f) fail("matmul_backward: beta = {} (0 or 1)", beta);
            to_bf16(o, weight, IC, OC, OC);
            gemm_bf16(false, true, N, IC, OC, d, o, beta, dinp, IC);
        }
        if (dweight) {
            to_bf16(o, inp, N, IC, IC);
            gemm_bf16(true, false, IC, OC, N, o, d, 1.0f, dweight, OC);
        }
    } else {
        if (dinp) gemm(nullptr, false, true, N, IC, OC, dout, OC, weight, OC, beta, dinp, IC);
        if (dweight) gemm(nullptr, true, false, IC, OC, N, inp, IC, dout, OC, 1.0f, dweight, OC);
    }
    if (!dweight) return;
    if (dbias) {
        // Each thread owns a block of columns and walks every row in order: deterministic.
        constexpr int kBlock = 64;
        int nblocks = (OC + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
        for (int blk = 0; blk < nblocks; blk++) {
            int j0 = blk * kBlock, j1 = std::min(OC, j0 + kBlock);
            float acc[kBlock] = {};
            for (int n = 0; n < N; n++) {
                const float* d = dout + (int64_t)n * OC;
                for (int j = j0; j < j1; j++) acc[j - j0] += d[j];
            }
            for (int j = j0; j < j1; j++) dbias[j] += acc[j - j0];
        }
    }
}

}  // namespace memtrain::cpu
