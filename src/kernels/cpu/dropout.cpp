// Dropout on the CPU (model.dropout): the mask of kernels/dropout_mask.h, element t * C + c of
// sequence b, recomputed wherever it is needed and never stored.
#include <cstring>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

void dropout(float* out, const float* inp, const DropoutMask& m, int B, int T, int C) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const uint64_t key = m.key(b);
        const int64_t n = (int64_t)T * C;
        float* o = out + (int64_t)b * n;
        const float* x = inp + (int64_t)b * n;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] * m.factor(key, (uint64_t)i);
    }
}

void dropout_residual(float* out, const float* resid, const DropoutMask& m, int B, int T, int C) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const uint64_t key = m.key(b);
        const int64_t n = (int64_t)T * C;
        float* o = out + (int64_t)b * n;
        const float* r = resid + (int64_t)b * n;
        for (int64_t i = 0; i < n; i++) o[i] = r[i] + o[i] * m.factor(key, (uint64_t)i);
    }
}

}  // namespace memtrain::cpu
