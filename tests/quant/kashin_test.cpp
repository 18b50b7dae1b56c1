// Kashin-2D against the paper's mechanism: exact greedy contraction, convergence in about 29
// steps on a 500x200 Gaussian matrix, exact reconstruction before quantization, four peaks per
// factor (a 4x4 grid of 2-D clusters), and fallback for tensors that do not converge.
#include <gtest/gtest.h>

#include <cblas.h>

#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "quant/kashin.h"
#include "test_util.h"

namespace memtrain::quant {
namespace {

using test::gaussian;

TEST(QuantKashin, HaarBasisIsOrthogonalAndSeeded) {
    Rng a(7), b(7);
    const auto q = haar_orthogonal(50, a);
    EXPECT_EQ(q, haar_orthogonal(50, b));
    std::vector<double> qtq(50 * 50);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, 50, 50, 50, 1.0, q.data(), 50, q.data(),
                50, 0.0, qtq.data(), 50);
    for (int i = 0; i < 50; i++)
        for (int j = 0; j < 50; j++) EXPECT_NEAR(qtq[i * 50 + j], i == j ? 1.0 : 0.0, 1e-12);
}

TEST(QuantKashin, EveryGreedyStepRemovesExactlyItsProjection) {
    const int64_t m = 60, n = 40;
    const auto w = gaussian(m * n, 8);
    const auto q = kashin_basis(m, n, 3);
    std::vector<KashinStep> trace;
    const auto d = kashin_decompose({w.data(), m, n}, q, 200, 1e-6, &trace);
    ASSERT_EQ((int)trace.size(), d.iterations);
    int u_steps = 0;
    for (const auto& s : trace) {
        EXPECT_NEAR(s.r2_after, s.r2_before - s.proj2, 1e-6 * s.r2_before);
        EXPECT_LE(s.r2_after, s.r2_before);
        u_steps += s.u_step;
    }
    EXPECT_GT(u_steps, 0);
    EXPECT_LT(u_steps, d.iterations);  // both factors are used
    EXPECT_TRUE(d.converged) << d.residual;
}

TEST(QuantKashin, PaperMatrixConvergesAndQuantizesToFourPeaksPerFactor) {
    // The paper's Fig. 6: a 500x200 N(0,1) matrix, "Residual 7.14e-07 after 29 iterations".
    const int64_t m = 500, n = 200, mn = m * n;
    const auto w = gaussian(mn, 11);
    const uint64_t seed = 5;
    const auto q = kashin_basis(m, n, seed);
    const auto d = kashin_decompose({w.data(), m, n}, q, 200, 1e-6);
    EXPECT_TRUE(d.converged);
    EXPECT_LT(d.residual, 1e-6);
    EXPECT_LE(d.iterations, 40);
    const auto rec = kashin_reconstruct(d.u, d.v, q, d.norm);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < mn; i++) {
        err += std::pow((double)w[(std::size_t)i] - rec[(std::size_t)i], 2);
        ref += std::pow((double)w[(std::size_t)i], 2);
    }
    EXPECT_LT(std::sqrt(err / ref), 1e-5);

    Options o;
    o.method = "kashin";
    o.bits = 4;
    o.seed = seed;
    const Result r = quantize(o, {w.data(), m, n});
    EXPECT_EQ(r.method, "kashin");
    EXPECT_FALSE(r.fell_back);
    EXPECT_EQ(r.iterations, d.iterations);
    err = 0;
    for (int64_t i = 0; i < mn; i++)
        err += std::pow((double)w[(std::size_t)i] - r.dequant[(std::size_t)i], 2);
    EXPECT_LE(std::sqrt(err / ref), 0.15);
    const auto codes = unpack_bits(part(r, "qweight").bytes, 4, (std::size_t)mn);
    std::vector<int64_t> count(16, 0);
    for (uint32_t c : codes) count[c]++;
    for (int k = 0; k < 16; k++) EXPECT_GE((double)count[(std::size_t)k] / (double)mn, 0.03) << k;
    // b bits per weight + a 2^b x 2 fp32 codebook + the fp32 norm + the 64-bit seed.
    EXPECT_EQ(r.stored_bits(), 4 * (uint64_t)mn + 16 * 2 * 32 + 32 + 64);
    EXPECT_EQ(dequantize(r), r.dequant);  // Q1, Q2 regenerated from the stored seed
}

TEST(QuantKashin, NonConvergedTensorFallsBackOrIsForced) {
    const int64_t m = 48, n = 64;
    const auto w = gaussian(m * n, 12);
    Options o;
    o.method = "kashin";
    o.bits = 4;
    o.max_iter = 3;
    const Result r = quantize(o, {w.data(), m, n});
    EXPECT_TRUE(r.fell_back);
    EXPECT_FALSE(r.converged);
    EXPECT_EQ(r.method, "rtn");
    EXPECT_EQ(r.bits, 4);
    EXPECT_EQ(r.iterations, 3);
    EXPECT_GT(r.residual, 1e-6);
    o.kashin_force = true;
    const Result f = quantize(o, {w.data(), m, n});
    EXPECT_FALSE(f.fell_back);
    EXPECT_FALSE(f.converged);
    EXPECT_EQ(f.method, "kashin");
    o.kashin_force = false;
    o.fallback = "nf4";
    EXPECT_EQ(quantize(o, {w.data(), m, n}).method, "nf4");
}

TEST(QuantKashinDct, PerChannelTwoPlusTwoBits) {
    const int64_t n = 128;
    const auto p = signed_dct_involution(n, 4);
    std::vector<double> pp((std::size_t)(n * n));
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, p.data(), n, p.data(), n,
                0.0, pp.data(), n);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            EXPECT_NEAR(pp[(std::size_t)(i * n + j)], i == j ? 1.0 : 0.0, 1e-12);
            EXPECT_NEAR(p[(std::size_t)(i * n + j)], p[(std::size_t)(j * n + i)], 1e-14);
        }
    const int64_t m = 48, mn = m * n;
    auto w = gaussian(mn, 13);
    for (int64_t i = 0; i < m; i++) w[(std::size_t)(i * n + 7)] *= 10;  // an outlier input
    Options o;
    o.method = "kashin-dct";
    o.bits = 4;
    o.seed = 4;
    o.max_iter = 160;
    const Result r = quantize(o, {w.data(), m, n});
    EXPECT_EQ(r.method, "kashin-dct");
    EXPECT_LE(r.iterations, 160);
    EXPECT_TRUE(r.converged) << r.residual;  // the decomposition itself, relative to ||W||_F
    // 2 + 2 bits per weight, 4 fp16 levels per output channel, the 64-bit seed.
    EXPECT_EQ(r.stored_bits(), 4 * (uint64_t)mn + 64 * m + 64);
    EXPECT_EQ(dequantize(r), r.dequant);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < mn; i++) {
        err += std::pow((double)w[(std::size_t)i] - r.dequant[(std::size_t)i], 2);
        ref += std::pow((double)w[(std::size_t)i], 2);
    }
    std::printf("kashin-dct residual %.3g, relative error %.4f\n", r.residual,
                std::sqrt(err / ref));
    EXPECT_LT(std::sqrt(err / ref), 0.2);
}

}  // namespace
}  // namespace memtrain::quant
