// Block-scaled int8 saved activations (kernels/cpu/act_int8.h).
#include "kernels/cpu/act_int8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace memtrain::cpu {

namespace {

// The block's power-of-two scale: the least s = 2^e with amax <= 127 s; 0 for an all-zero block,
// NaN where the block is not finite.
float block_scale(const float* x, std::size_t n) {
    float amax = 0;
    int bad = 0;
#pragma omp simd reduction(max : amax) reduction(| : bad)
    for (std::size_t i = 0; i < n; i++) {
        const float a = std::fabs(x[i]);
        amax = std::max(amax, a);
        bad |= !(a <= std::numeric_limits<float>::max());  // inf or NaN
    }
    if (bad) return std::numeric_limits<float>::quiet_NaN();
    if (amax == 0) return 0;
    int e = 0;
    std::frexp(amax / 127.0f, &e);  // amax / 127 = m 2^e, m in [0.5, 1): 2^e >= amax / 127
    float s = std::ldexp(1.0f, e);
    while (s / 2 * 127.0f >= amax && s / 2 > 0) s /= 2;  // the least such power (rounding)
    while (amax > 127.0f * s) s *= 2;
    return s;
}

// v[i] / s for a power of two s: a product by 1 / s where that is a normal float (exact), a
// division where s is so small that it is not.
inline void scale_round(float* out, const float* v, std::size_t m, float s) {
    if (s >= std::numeric_limits<float>::min() * 4) {
        const float inv = 1.0f / s;
#pragma omp simd
        for (std::size_t i = 0; i < m; i++) out[i] = std::nearbyint(v[i] * inv);
    } else {
        for (std::size_t i = 0; i < m; i++) out[i] = std::nearbyint(v[i] / s);
    }
}

}  // namespace

void qdq_int8(float* x, std::size_t n) {
    const std::size_t nb = (n + kInt8Block - 1) / kInt8Block;
#pragma omp parallel for schedule(static)
    for (std::size_t b = 0; b < nb; b++) {
        float* v = x + b * kInt8Block;
        const std::size_t m = std::min(kInt8Block, n - b * kInt8Block);
        const float s = block_scale(v, m);
        if (s == 0) continue;
        if (std::isnan(s)) {
            std::fill(v, v + m, s);
            continue;
        }
        scale_round(v, v, m, s);
        // (+ 0: a value rounded to -0 stores as 0 and comes back +0; so it must be +0 here.)
#pragma omp simd
        for (std::size_t i = 0; i < m; i++) v[i] = v[i] * s + 0.0f;
    }
}

namespace {

// The blocks [first, last) of a part [begin, begin + count) of an n-value store; fails where a
// block of the part would not be one of the store's.
void part_blocks(std::size_t n, std::size_t begin, std::size_t count, std::size_t& first,
                 std::size_t& last) {
    const std::size_t end = begin + count;
    if (begin % kInt8Block != 0 || end > n || (end % kInt8Block != 0 && end != n))
        fail("internal: int8 part [{}, {}) of {} values is off the {}-value block grid", begin, end,
             n, kInt8Block);
    first = begin / kInt8Block;
    last = (end + kInt8Block - 1) / kInt8Block;
}

}  // namespace

void to_int8(void* out, const float* x, std::size_t n) {
    to_int8_part(out, n, 0, x, n);
}

void from_int8(float* x, const void* in, std::size_t n) {
    from_int8_part(x, in, n, 0, n);
}

namespace {

// The part's blocks of x stored into `out` (an n-value store); with write_back, x itself is
// rounded to the stored values too (qdq_int8's), in the same pass.
void store_blocks(float* x, bool write_back, void* out, std::size_t n, std::size_t begin,
                  std::size_t count) {
    std::size_t first = 0, last = 0;
    part_blocks(n, begin, count, first, last);
    float* scales = static_cast<float*>(out);
    int8_t* q = reinterpret_cast<int8_t*>(scales + (n + kInt8Block - 1) / kInt8Block);
#pragma omp parallel for schedule(static)
    for (std::size_t b = first; b < last; b++) {
        float* v = x + (b * kInt8Block - begin);
        const std::size_t m = std::min(kInt8Block, n - b * kInt8Block);
        const float s = block_scale(v, m);
        scales[b] = s;
        int8_t* qb = q + b * kInt8Block;
        std::fill(qb, qb + m, int8_t{0});
        if (s == 0) continue;  // (as qdq_int8: the values stay, zeros of either sign)
        if (std::isnan(s)) {
            if (write_back) std::fill(v, v + m, s);
            continue;
        }
        // Exact when v is already rounded: a multiple of a power of two >= s, |v| <= 127 s.
        float r[kInt8Block];
        scale_round(r, v, m, s);
#pragma omp simd
        for (std::size_t i = 0; i < m; i++) qb[i] = (int8_t)r[i];
        if (write_back) {
#pragma omp simd
            for (std::size_t i = 0; i < m; i++) v[i] = r[i] * s + 0.0f;
        }
    }
}

}  // namespace

void to_int8_part(void* out, std::size_t n, std::size_t begin, const float* x, std::size_t count) {
    store_blocks(const_cast<float*>(x), false, out, n, begin, count);  // (x is only read)
}

void qdq_int8_store(float* x, void* out, std::size_t n, std::size_t begin, std::size_t count) {
    store_blocks(x, true, out, n, begin, count);
}

void from_int8_part(float* x, const void* in, std::size_t n, std::size_t begin, std::size_t count) {
    std::size_t first = 0, last = 0;
    part_blocks(n, begin, count, first, last);
    const float* scales = static_cast<const float*>(in);
    const int8_t* q = reinterpret_cast<const int8_t*>(scales + (n + kInt8Block - 1) / kInt8Block);
#pragma omp parallel for schedule(static)
    for (std::size_t b = first; b < last; b++) {
        float* v = x + (b * kInt8Block - begin);
        const std::size_t m = std::min(kInt8Block, n - b * kInt8Block);
        const float s = scales[b];
        const int8_t* qb = q + b * kInt8Block;
        if (std::isnan(s)) {
            std::fill(v, v + m, s);
            continue;
        }
#pragma omp simd
        for (std::size_t i = 0; i < m; i++) v[i] = (float)qb[i] * s;
    }
}

}  // namespace memtrain::cpu
