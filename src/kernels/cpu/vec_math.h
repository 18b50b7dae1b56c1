// Branch-free float math the CPU kernels' loops vectorise (libm's expf and exp are scalar calls).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace memtrain::cpu {

// exp(x), x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r), and 2^n built in the exponent bits. Relative error about 2e-7.
inline float exp_vec(float x) {
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

// tanh through exp_vec: absolute error about 2e-7, which is what GELU's (1 + tanh) needs.
inline float tanh_vec(float x) {
    return 1.0f - 2.0f / (exp_vec(2.0f * x) + 1.0f);
}

}  // namespace memtrain::cpu
