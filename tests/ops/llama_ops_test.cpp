// The Llama-style kernels (RMSNorm, SwiGLU, RoPE, grouped-query attention): forwards against
// naive double-precision loops, backwards against central finite differences of
// L = sum(out * w), as in ops_grad_test.cpp, and thread-count independence of the reductions.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "grad_check.h"
#include "kernels/cpu/ops.h"

using namespace memtrain;
using test::check_grad;
using test::dot;
using test::randn;

TEST(LlamaOps, RmsNorm) {
    const int N = 4, C = 9;
    const float eps = 1e-6f;
    auto inp = randn(N * C, 11), w = randn(C, 12), dout = randn(N * C, 14);
    std::vector<float> out(N * C), rstd(N);
    auto f = [&]() {
        cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
        return dot(out, dout);
    };
    f();
    for (int n = 0; n < N; n++) {
        double ms = 0;
        for (int i = 0; i < C; i++) ms += (double)inp[n * C + i] * inp[n * C + i];
        double r = 1.0 / std::sqrt(ms / C + eps);
        EXPECT_NEAR(rstd[n], r, 1e-5 * r);
        for (int i = 0; i < C; i++) EXPECT_NEAR(out[n * C + i], inp[n * C + i] * r * w[i], 1e-5);
    }
    // dinp accumulates (residual stream): start from a known value and subtract it.
    std::vector<float> dinp(N * C, 0.5f), dw(C, 0.25f);
    cpu::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N,
                          C);
    for (auto& v : dinp) v -= 0.5f;
    for (auto& v : dw) v -= 0.25f;
    check_grad("dinp", inp, dinp, f);
    check_grad("dweight", w, dw, f);
}

TEST(LlamaOps, RmsNormWeightGradIsThreadCountIndependent) {
    const int N = 300, C = 130;
    auto inp = randn(N * C, 1), w = randn(C, 2), dout = randn(N * C, 3);
    std::vector<float> out(N * C), rstd(N);
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
    std::vector<std::vector<float>> dws;
    int saved = omp_get_max_threads();
    for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        std::vector<float> dinp(N * C), dw(C);
        cpu::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(),
                              rstd.data(), N, C);
        dws.push_back(dw);
    }
    omp_set_num_threads(saved);
    for (std::size_t k = 1; k < dws.size(); k++)
        EXPECT_EQ(0, std::memcmp(dws[0].data(), dws[k].data(), C * sizeof(float)));
}

TEST(LlamaOps, SwiGlu) {
    const int N = 5, H = 7;
    auto inp = randn(N * 2 * H, 21, 2.0f), dout = randn(N * H, 22);
    std::vector<float> out(N * H), dinp(N * 2 * H);
    auto f = [&]() {
        cpu::swiglu_forward(out.data(), inp.data(), N, H);
        return dot(out, dout);
    };
    f();
    for (int n = 0; n < N; n++)
        for (int i = 0; i < H; i++) {
            double g = inp[n * 2 * H + i], u = inp[n * 2 * H + H + i];
            EXPECT_NEAR(out[n * H + i], g / (1 + std::exp(-g)) * u, 1e-5);
        }
    cpu::swiglu_backward(dinp.data(), inp.data(), dout.data(), N, H);
    check_grad("dinp", inp, dinp, f, 2e-2, N * 2 * H);
}

TEST(LlamaOps, RopeMatchesRotateHalfAndInvertsInBackward) {
    const int B = 2, T = 5, NH = 4, NKV = 2, hs = 6, QKV = (NH + 2 * NKV) * hs;
    const float theta = 500.0f;
    auto qkv0 = randn(B * T * QKV, 31), dout = randn(B * T * QKV, 32);
    std::vector<float> qkv = qkv0;
    cpu::rope_forward(qkv.data(), B, T, NH, NKV, hs, theta);
    const int half = hs / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float* x = qkv0.data() + ((std::size_t)b * T + t) * QKV;
            const float* y = qkv.data() + ((std::size_t)b * T + t) * QKV;
            for (int h = 0; h < NH + 2 * NKV; h++)
                for (int i = 0; i < hs; i++) {
                    int c = h * hs + i;
                    if (h >= NH + NKV) {  // v is untouched
                        EXPECT_EQ(y[c], x[c]);
                        continue;
                    }
                    double a = t * std::pow((double)theta, -2.0 * (i % half) / hs);
                    // HF: q * cos + rotate_half(q) * sin, rotate_half(x) = [-x2, x1]
                    double rot = i < half ? -x[c + half] : x[c - half];
                    EXPECT_NEAR(y[c], x[c] * std::cos(a) + rot * std::sin(a), 1e-5);
                }
        }
    // Gradient: rope is linear, so d(sum(rope(x) * w)) / dx = rope_backward(w).
    std::vector<float> x = qkv0, grad = dout, out(x.size());
    cpu::rope_backward(grad.data(), B, T, NH, NKV, hs, theta);
    auto f = [&]() {
        out = x;
        cpu::rope_forward(out.data(), B, T, NH, NKV, hs, theta);
        return dot(out, dout);
    };
    check_grad("dqkv", x, grad, f, 2e-2, 200);
    // And backward undoes forward.
    std::vector<float> back = qkv;
    cpu::rope_backward(back.data(), B, T, NH, NKV, hs, theta);
    for (std::size_t i = 0; i < back.size(); i++) EXPECT_NEAR(back[i], qkv0[i], 1e-5);
}

TEST(LlamaOps, GroupedQueryAttention) {
    for (int T : {1, 5}) {
        const int B = 2, NH = 4, NKV = 2, hs = 3, C = NH * hs, QKV = C + 2 * NKV * hs;
        auto qkv = randn(B * T * QKV, 41), dout = randn(B * T * C, 42);
        std::vector<float> out(B * T * C), att(B * NH * T * T), dqkv(B * T * QKV);
        auto f = [&]() {
            cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NKV);
            return dot(out, dout);
        };
        f();
        // Against plain multi-head attention with k and v repeated per group (HF's repeat_kv).
        std::vector<float> full(B * T * 3 * C), out2(B * T * C), att2(B * NH * T * T);
        for (int bt = 0; bt < B * T; bt++)
            for (int h = 0; h < NH; h++)
                for (int d = 0; d < hs; d++) {
                    const float* r = qkv.data() + (std::size_t)bt * QKV;
                    float* o = full.data() + (std::size_t)bt * 3 * C;
                    int kv = h / (NH / NKV);
                    o[h * hs + d] = r[h * hs + d];
                    o[C + h * hs + d] = r[C + kv * hs + d];
                    o[2 * C + h * hs + d] = r[C + NKV * hs + kv * hs + d];
                }
        cpu::attention_forward(out2.data(), att2.data(), full.data(), B, T, C, NH, NH);
        for (std::size_t i = 0; i < out.size(); i++) EXPECT_NEAR(out[i], out2[i], 1e-6);
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV);
        check_grad("dqkv", qkv, dqkv, f, 2e-2, 300);
    }
}

TEST(LlamaOps, EmbeddingWithoutPositionTable) {
    const int B = 2, T = 3, C = 4, V = 5;
    std::vector<int32_t> tok = {0, 3, 3, 1, 4, 3};
    auto wte = randn(V * C, 51), dout = randn(B * T * C, 52);
    std::vector<float> out(B * T * C), dwte(V * C);
    auto f = [&]() {
        cpu::embedding_forward(out.data(), tok.data(), wte.data(), nullptr, B, T, C);
        return dot(out, dout);
    };
    f();
    for (int r = 0; r < B * T; r++)
        for (int i = 0; i < C; i++) EXPECT_EQ(out[r * C + i], wte[tok[r] * C + i]);
    cpu::embedding_backward(dwte.data(), nullptr, dout.data(), tok.data(), B, T, C);
    check_grad("dwte", wte, dwte, f);
}
