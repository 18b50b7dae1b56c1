// The scalar quantizers (RTN, per-tensor uniform and k-means, NF4): error bounds element by
// element, stored bits equal to the bytes of the stored form, and decoding from that form alone.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "quant/quant.h"
#include "test_util.h"

namespace memtrain::quant {
namespace {

using test::gaussian;

// quantize() with `method`, `bits` and `group` on the rows x cols matrix `w`.
Result quantize_with(const std::string& method, int bits, int group, const std::vector<float>& w,
                     int64_t rows, int64_t cols) {
    Options o;
    o.method = method;
    o.bits = bits;
    o.group = group;
    return quantize(o, {w.data(), rows, cols});
}

uint64_t packed_bits(int64_t n, int bits) {
    return 8 * (uint64_t)((n * bits + 7) / 8);
}

TEST(QuantPack, BitsAndHalvesRoundTrip) {
    Rng rng(1);
    for (int b = 1; b <= 8; b++) {
        std::vector<uint32_t> codes(101);
        for (auto& c : codes) c = (uint32_t)(rng.next_u64() % (1u << b));
        const auto bytes = pack_bits(codes, b);
        EXPECT_EQ(bytes.size(), (101u * b + 7) / 8);
        EXPECT_EQ(unpack_bits(bytes, b, 101), codes);
    }
    for (float x : {0.0f, 1.0f, 0.1f, 3.14159f, 6e-8f, 1e-5f, 65504.0f, 0.000123f}) {
        EXPECT_GE(f16_to_f32(f32_to_f16_up(x)), x) << x;
        EXPECT_NEAR(f16_to_f32(f32_to_f16(x)), x, std::fabs(x) * 1e-3 + 6e-8) << x;
        EXPECT_NEAR(f16_to_f32(f32_to_f16(-x)), -x, std::fabs(x) * 1e-3 + 6e-8) << x;
    }
    EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
    EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
    EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
}

TEST(QuantRtn, PerRowErrorIsAtMostHalfAScale) {
    const int64_t rows = 24, cols = 96;
    auto w = gaussian(rows * cols, 2, 0.02f);
    w[5] = 0.3f;  // an outlier only widens its own row's scale
    for (int bits : {8, 4, 3}) {
        const Result r = quantize_with("rtn", bits, 0, w, rows, cols);
        const auto scales = part_values<uint16_t>(part(r, "scales"));
        ASSERT_EQ(scales.size(), (std::size_t)rows);
        for (int64_t i = 0; i < rows; i++) {
            const float s = f16_to_f32(scales[(std::size_t)i]);
            float amax = 0;
            for (int64_t j = 0; j < cols; j++) {
                const std::size_t e = (std::size_t)(i * cols + j);
                amax = std::max(amax, std::fabs(w[e]));
                EXPECT_LE(std::fabs(w[e] - r.dequant[e]), 0.5f * s * (1 + 1e-6f)) << bits;
            }
            EXPECT_GE(s * (float)((1 << (bits - 1)) - 1), amax);
        }
        EXPECT_EQ(r.stored_bits(), packed_bits(rows * cols, bits) + 16 * rows);
        EXPECT_DOUBLE_EQ(r.bpw(), bits + 16.0 / cols);
        EXPECT_EQ(dequantize(r), r.dequant);
    }
}

TEST(QuantRtn, GroupwiseAndAsymmetricBounds) {
    const int64_t rows = 16, cols = 128;
    auto w = gaussian(rows * cols, 3, 0.02f);
    for (int g : {32, 64, 128}) {
        const Result r = quantize_with("rtn", 4, g, w, rows, cols);
        const auto scales = part_values<uint16_t>(part(r, "scales"));
        ASSERT_EQ(scales.size(), (std::size_t)(rows * cols / g));
        for (int64_t e = 0; e < rows * cols; e++) {
            const float s = f16_to_f32(scales[(std::size_t)(e / g)]);
            EXPECT_LE(std::fabs(w[(std::size_t)e] - r.dequant[(std::size_t)e]),
                      0.5f * s * 1.000001f);
        }
        EXPECT_DOUBLE_EQ(r.bpw(), 4 + 16.0 / g);
        EXPECT_EQ(dequantize(r), r.dequant);
    }
    // The integer zero point moves the grid by up to half a step, so the ends may be clipped by
    // up to a whole step; inside the grid the error is at most half a step.
    const Result a = quantize_with("rtn-asym", 4, 0, w, rows, cols);
    const auto scales = part_values<uint16_t>(part(a, "scales"));
    for (int64_t e = 0; e < rows * cols; e++) {
        const float s = f16_to_f32(scales[(std::size_t)(e / cols)]);
        EXPECT_LE(std::fabs(w[(std::size_t)e] - a.dequant[(std::size_t)e]), s * 1.000001f);
    }
    EXPECT_EQ(a.stored_bits(), packed_bits(rows * cols, 4) + (16 + 8) * rows);
    EXPECT_EQ(dequantize(a), a.dequant);
}

TEST(QuantPerTensor, UniformAndKmeans) {
    const int64_t rows = 32, cols = 64, n = rows * cols;
    auto w = gaussian(n, 4, 0.02f);
    const Result u = quantize_with("uniform", 4, 0, w, rows, cols);
    const auto grid = part_values<float>(part(u, "grid"));
    for (int64_t e = 0; e < n; e++)
        EXPECT_LE(std::fabs(w[(std::size_t)e] - u.dequant[(std::size_t)e]), grid[1] * 0.5001f);
    EXPECT_EQ(u.stored_bits(), packed_bits(n, 4) + 64);

    const Result k = quantize_with("kmeans", 4, 0, w, rows, cols);
    const auto book = part_values<float>(part(k, "codebook"));
    ASSERT_EQ(book.size(), 16u);
    double err = 0, ref = 0;
    for (int64_t e = 0; e < n; e++) {
        const float x = w[(std::size_t)e], q = k.dequant[(std::size_t)e];
        for (float c : book) EXPECT_LE(std::fabs(x - q), std::fabs(x - c) + 1e-9f);  // nearest
        err += (x - q) * (x - q);
        ref += x * x;
    }
    // Lloyd-Max for a Gaussian with 16 levels: relative error 0.0975.
    EXPECT_LT(std::sqrt(err / ref), 0.11);
    EXPECT_EQ(k.stored_bits(), packed_bits(n, 4) + 16 * 32);
    EXPECT_EQ(dequantize(k), k.dequant);
}

TEST(QuantNf4, BlockErrorBoundAndBitsBothWays) {
    const int64_t rows = 8, cols = 64 * 40, n = rows * cols, nb = n / 64;
    auto w = gaussian(n, 5, 0.02f);
    float half_gap = 0;
    for (int k = 0; k < 15; k++)
        half_gap = std::max(half_gap, 0.5f * (kNf4Levels[k + 1] - kNf4Levels[k]));
    const Result r = quantize_with("nf4", 4, 0, w, rows, cols);
    const auto absmax = part_values<float>(part(r, "absmax"));
    for (int64_t e = 0; e < n; e++)
        EXPECT_LE(std::fabs(w[(std::size_t)e] - r.dequant[(std::size_t)e]),
                  absmax[(std::size_t)(e / 64)] * half_gap * 1.00001f);
    EXPECT_EQ(r.stored_bits(), 4 * (uint64_t)n + 32 * nb);
    EXPECT_DOUBLE_EQ(r.bpw(), 4.5);

    const Result d = quantize_with("nf4-dq", 4, 0, w, rows, cols);
    const auto q = part(d, "absmax_q").bytes;
    const auto s2 = part_values<float>(part(d, "absmax_scale"));
    ASSERT_EQ(s2.size(), (std::size_t)((nb + 255) / 256));
    for (int64_t b = 0; b < nb; b++) {
        const float decoded = q[(std::size_t)b] * s2[(std::size_t)(b / 256)];
        EXPECT_GE(decoded, absmax[(std::size_t)b]);  // rounded up: nothing clipped
        for (int64_t j = 0; j < 64; j++) {
            const std::size_t e = (std::size_t)(b * 64 + j);
            EXPECT_LE(std::fabs(w[e] - d.dequant[e]), decoded * half_gap * 1.00001f);
        }
    }
    EXPECT_EQ(d.stored_bits(), 4 * (uint64_t)n + 8 * nb + 32 * s2.size());
    // 320 absmaxes fill 2 second-level blocks, so a bit above the 4.127 of large tensors.
    EXPECT_NEAR(d.bpw(), 4 + 8.0 / 64 + 32.0 / (64 * 256), 2e-3);
    EXPECT_EQ(dequantize(r), r.dequant);
    EXPECT_EQ(dequantize(d), d.dequant);
}

TEST(QuantOptions, RefusesWhatAMethodCannotStore) {
    Options o;
    o.method = "gptq";
    EXPECT_THROW(check_options(o, 8, 64), Error);
    o.method = "nf4";
    o.bits = 3;
    EXPECT_THROW(check_options(o, 8, 64), Error);
    o.bits = 4;
    EXPECT_THROW(check_options(o, 8, 96), Error);  // block 64 does not divide 96
    o.method = "rtn";
    o.group = 48;
    EXPECT_THROW(check_options(o, 8, 64), Error);
    o.group = 32;
    EXPECT_NO_THROW(check_options(o, 8, 64));
    o.bits = 9;
    EXPECT_THROW(check_options(o, 8, 64), Error);
    o.method = "kashin";
    o.bits = 4;
    o.group = 0;
    o.fallback = "kashin";
    EXPECT_THROW(check_options(o, 8, 64), Error);
}

}  // namespace
}  // namespace memtrain::quant
