// GELU (tanh approximation) on the CPU, plus the small elementwise helpers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/vec_math.h"

namespace memtrain::cpu {

static constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = inp[i];
        float cube = 0.044715f * x * x * x;
        out[i] = 0.5f * x * (1.0f + tanh_vec(kGeluScale * (x + cube)));
    }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = inp[i];
        float cube = 0.044715f * x * x * x;
        float arg = kGeluScale * (x + cube);
        float th = tanh_vec(arg);
        float sech2 = 1.0f - th * th;
        float local =
            0.5f * (1.0f + th) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = local * dout[i];
    }
}

void add_inplace(float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] += b[i];
}

void scale_inplace(float* a, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] *= s;
}

double sum_squares(const float* a, int64_t n) {
    // A fixed chunking (not one chunk per thread), summed in order afterwards, keeps the result
    // independent of the thread count.
    constexpr int64_t kChunk = 1 << 14;
    int64_t nchunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(nchunks);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
        double s = 0.0;
        for (int64_t i = i0; i < i1; i++) s += (double)a[i] * a[i];
        partial[c] = s;
    }
    double total = 0.0;
    for (double s : partial) total += s;
    return total;
}

}  // namespace memtrain::cpu
