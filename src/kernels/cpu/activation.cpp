// GELU (tanh approximation) on the CPU, plus the small elementwise helpers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"

namespace memtrain::cpu {

static constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

// exp(x) for x in [-87, 88], branch-free so the loops below vectorise (libm's expf/tanhf are
// scalar calls): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r), and 2^n
// built in the exponent bits. Relative error about 2e-7.
static inline float exp_vec(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    float n = std::floor(x * 1.4426950408889634f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

// tanh through exp: absolute error about 2e-7, which is what GELU's (1 + tanh) needs.
static inline float tanh_vec(float x) {
    return 1.0f - 2.0f / (exp_vec(2.0f * x) + 1.0f);
}

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
