// Matmul family on the CPU: GEMMs through OpenBLAS, bias and bias-gradient by hand.
#include <cblas.h>

#include <algorithm>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, float beta) {
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
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, OC, IC, 1.0f, inp, IC, weight, OC,
                beta, out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC, float beta) {
    if (dinp) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, IC, OC, 1.0f, dout, OC, weight, OC,
                    beta, dinp, IC);
    }
    if (!dweight) return;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, IC, OC, N, 1.0f, inp, IC, dout, OC, 1.0f,
                dweight, OC);
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
