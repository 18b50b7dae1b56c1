// The CPU engine's bf16 GEMMs (kernels/cpu/gemm.h, train.precision = "bf16" on the CPU): the
// product of bf16-rounded operands accumulated in fp32, for every transpose and beta, against a
// double loop over the rounded operands; and the matmul and classifier kernels in bf16 against
// their fp32 selves within bf16's tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "grad_check.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

using namespace memtrain;
using test::randn;

namespace {

float round_bf16(float x) {
    return bf16_to_f32(f32_to_bf16(x));
}

// Relative error of a against b over the whole tensor: |a - b|_2 / |b|_2.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return std::sqrt(num / den);
}

struct Scratch {
    std::vector<uint16_t> buf;
    cpu::Bf16Gemm g;
    explicit Scratch(std::size_t n) : buf(n) { g = {buf.data(), n}; }
};

}  // namespace

TEST(GemmBf16, RoundsTheOperandsAndAccumulatesInFp32) {
    const int M = 37, N = 53, K = 300;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (float beta : {0.0f, 1.0f}) {
                const auto A = randn((std::size_t)M * K, 1 + ta),
                           B = randn((std::size_t)K * N, 3 + tb);
                const auto C0 = randn((std::size_t)M * N, 5);
                // Stored shapes: A (M,K) or (K,M), B (K,N) or (N,K).
                auto a = [&](int m, int k) {
                    return ta ? A[(std::size_t)k * M + m] : A[(std::size_t)m * K + k];
                };
                auto b = [&](int k, int n) {
                    return tb ? B[(std::size_t)n * K + k] : B[(std::size_t)k * N + n];
                };
                std::vector<float> C = C0;
                Scratch s((std::size_t)M * K + (std::size_t)K * N);
                cpu::gemm(&s.g, ta, tb, M, N, K, A.data(), ta ? M : K, B.data(), tb ? K : N, beta,
                          C.data(), N);
                double worst_rounded = 0, worst_exact = 0;
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double rounded = beta * C0[(std::size_t)m * N + n], exact = rounded,
                               mag = 0;
                        for (int k = 0; k < K; k++) {
                            rounded += (double)round_bf16(a(m, k)) * round_bf16(b(k, n));
                            exact += (double)a(m, k) * b(k, n);
                            mag += std::fabs((double)a(m, k) * b(k, n));
                        }
                        const double got = C[(std::size_t)m * N + n];
                        worst_rounded = std::max(worst_rounded, std::fabs(got - rounded) / mag);
                        worst_exact = std::max(worst_exact, std::fabs(got - exact) / mag);
                    }
                // Products of bf16 values are exact in fp32: what remains is fp32 accumulation.
                EXPECT_LT(worst_rounded, 1e-5) << "ta " << ta << " tb " << tb << " beta " << beta;
                // And the operands really were rounded: the unrounded product is bf16's error away.
                EXPECT_GT(worst_exact, 1e-4) << "ta " << ta << " tb " << tb;
            }
}

TEST(GemmBf16, ARoundedOperandIsNearestEven) {
    // 1 + 2^-8 lies halfway between bf16's 1 and 1 + 2^-7: ties go to the even one (1).
    EXPECT_EQ(round_bf16(1.0f + 1.0f / 256), 1.0f);
    EXPECT_EQ(round_bf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);
    EXPECT_TRUE(std::isnan(round_bf16(NAN)));
    EXPECT_TRUE(std::isinf(round_bf16(INFINITY)));
    std::vector<float> in = {1.0f + 1.0f / 256, 3.0f, -2.5f, 1e-3f};
    std::vector<uint16_t> out(4);
    cpu::to_bf16(out.data(), in.data(), 1, 4, 4);
    for (int i = 0; i < 4; i++) EXPECT_EQ(out[i], f32_to_bf16(in[i])) << i;
}

TEST(GemmBf16, MatmulAndClassifierTrackFp32) {
    const int N = 64, IC = 48, OC = 80;
    const auto inp = randn((std::size_t)N * IC, 11), w = randn((std::size_t)IC * OC, 12, 0.2f);
    const auto bias = randn(OC, 13), dout = randn((std::size_t)N * OC, 14);
    // matmul_backward's: d(out) beside the larger of weight and input.
    Scratch s((std::size_t)N * OC + std::max((std::size_t)N * IC, (std::size_t)IC * OC));
    std::vector<float> out32(N * OC), out16(N * OC);
    cpu::matmul_forward(out32.data(), inp.data(), w.data(), bias.data(), N, IC, OC);
    cpu::matmul_forward(out16.data(), inp.data(), w.data(), bias.data(), N, IC, OC, 0.0f, &s.g);
    EXPECT_LT(rel_err(out16, out32), 1e-2);
    EXPECT_GT(rel_err(out16, out32), 1e-5) << "the bf16 path ran in fp32";
    std::vector<float> di32(N * IC), di16(N * IC), dw32(IC * OC, 0.5f), dw16(IC * OC, 0.5f);
    std::vector<float> db32(OC, 0.25f), db16(OC, 0.25f);
    cpu::matmul_backward(di32.data(), dw32.data(), db32.data(), dout.data(), inp.data(), w.data(),
                         N, IC, OC);
    cpu::matmul_backward(di16.data(), dw16.data(), db16.data(), dout.data(), inp.data(), w.data(),
                         N, IC, OC, 0.0f, &s.g);
    EXPECT_LT(rel_err(di16, di32), 1e-2);
    EXPECT_LT(rel_err(dw16, dw32), 1e-2);
    EXPECT_EQ(db16, db32) << "the bias gradient is an fp32 sum either way";

    // The classifier: loss, d(x) and d(wte) over a padded vocabulary, two chunks.
    const int R = 40, C = 32, V = 90, Vp = 96, chunk = 16;
    const auto x = randn((std::size_t)R * C, 21), wte = randn((std::size_t)Vp * C, 22, 0.3f);
    std::vector<int32_t> y(R);
    for (int r = 0; r < R; r++) y[r] = (r * 7) % V;
    std::vector<float> logits((std::size_t)chunk * Vp), dx32(R * C), dx16(R * C);
    std::vector<float> dwte32((std::size_t)Vp * C), dwte16((std::size_t)Vp * C);
    Scratch cs((std::size_t)Vp * C + (std::size_t)chunk * (C + Vp));
    const double l32 = cpu::classifier_loss(dx32.data(), dwte32.data(), logits.data(), x.data(),
                                            wte.data(), y.data(), R, C, V, Vp, chunk, 1.0f / R);
    const double l16 =
        cpu::classifier_loss(dx16.data(), dwte16.data(), logits.data(), x.data(), wte.data(),
                             y.data(), R, C, V, Vp, chunk, 1.0f / R, &cs.g);
    EXPECT_NEAR(l16, l32, 1e-2 * l32);
    EXPECT_NE(l16, l32);
    EXPECT_LT(rel_err(dx16, dx32), 2e-2);
    EXPECT_LT(rel_err(dwte16, dwte32), 2e-2);
}

TEST(GemmBf16, AScratchTooSmallIsAnErrorNotAnOverrun) {
    const int M = 8, N = 8, K = 8;
    const auto A = randn(M * K, 1), B = randn(K * N, 2);
    std::vector<float> C(M * N);
    Scratch s(M * K + K * N - 1);
    try {
        cpu::gemm(&s.g, false, false, M, N, K, A.data(), K, B.data(), N, 0.0f, C.data(), N);
        FAIL() << "expected an Error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("the scratch holds 127"), std::string::npos)
            << e.what();
    }
}

TEST(GemmBf16, NamesItsKernelPath) {
    const std::string path = cpu::bf16_gemm_path();
    EXPECT_EQ(path.rfind("oneDNN ", 0), 0u) << path;
    if (cpu::cpu_has_bf16())
        EXPECT_TRUE(path.find("AMX") != std::string::npos ||
                    path.find("AVX512-BF16") != std::string::npos)
            << path;
    else
        EXPECT_NE(path.find("fp32 FMAs"), std::string::npos) << path;
}
