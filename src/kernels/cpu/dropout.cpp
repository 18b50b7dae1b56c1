// Dropout on the CPU (model.dropout): the mask of kernels/dropout_mask.h, element t * C + c of
// sequence b, recomputed wherever it is needed and never stored.
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

namespace {

// out[i] = f(i's factor, i) over each sequence's T x C elements, sequence b's mask keyed by b.
template <class F>
void each_sequence(const DropoutMask& m, int B, int T, int C, F&& f) {
    const int64_t n = (int64_t)T * C;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const uint64_t key = m.key(b);
        for (int64_t i = 0; i < n; i++) f(b * n + i, m.factor(key, (uint64_t)i));
    }
}

}  // namespace

void dropout(float* out, const float* inp, const DropoutMask& m, int B, int T, int C) {
    each_sequence(m, B, T, C, [&](int64_t i, float f) { out[i] = inp[i] * f; });
}

void dropout_residual(float* out, const float* resid, const DropoutMask& m, int B, int T, int C) {
    each_sequence(m, B, T, C, [&](int64_t i, float f) { out[i] = resid[i] + out[i] * f; });
}

}  // namespace memtrain::cpu
