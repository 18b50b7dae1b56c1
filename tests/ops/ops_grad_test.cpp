// Backward of every CPU op against central finite differences, and forwards against naive loops.
// Each case builds inputs, defines a scalar objective L = sum(out * w) with random w, and
// compares the analytic gradient of every input and parameter to (L(x+h) - L(x-h)) / 2h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "grad_check.h"
#include "kernels/cpu/ops.h"

using namespace memtrain;
using test::check_grad;
using test::dot;
using test::randn;

TEST(OpsGrad, Matmul) {
    const int N = 6, IC = 5, OC = 7;
    auto inp = randn(N * IC, 1), w = randn(IC * OC, 2), b = randn(OC, 3), dout = randn(N * OC, 4);
    std::vector<float> out(N * OC);
    auto f = [&]() {
        cpu::matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, IC, OC);
        return dot(out, dout);
    };
    f();
    // Forward against a naive loop.
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = b[o];
            for (int i = 0; i < IC; i++) s += (double)inp[n * IC + i] * w[i * OC + o];
            EXPECT_NEAR(out[n * OC + o], s, 1e-5);
        }
    std::vector<float> dinp(N * IC), dw(IC * OC), db(OC);
    cpu::matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N,
                         IC, OC);
    check_grad("dinp", inp, dinp, f);
    check_grad("dweight", w, dw, f);
    check_grad("dbias", b, db, f);
}

TEST(OpsGrad, MatmulResidualBeta) {
    const int N = 3, IC = 4, OC = 2;
    auto inp = randn(N * IC, 5), w = randn(IC * OC, 6), res = randn(N * OC, 7);
    std::vector<float> out = res;
    cpu::matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, IC, OC, 1.0f);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = res[n * OC + o];
            for (int i = 0; i < IC; i++) s += (double)inp[n * IC + i] * w[i * OC + o];
            EXPECT_NEAR(out[n * OC + o], s, 1e-5);
        }
}

TEST(OpsGrad, LayerNorm) {
    const int N = 4, C = 9;
    auto inp = randn(N * C, 11), w = randn(C, 12), b = randn(C, 13), dout = randn(N * C, 14);
    std::vector<float> out(N * C), mean(N), rstd(N);
    auto f = [&]() {
        cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                               N, C);
        return dot(out, dout);
    };
    f();
    for (int n = 0; n < N; n++) {
        double m = 0, v = 0;
        for (int i = 0; i < C; i++) m += inp[n * C + i];
        m /= C;
        for (int i = 0; i < C; i++) v += (inp[n * C + i] - m) * (inp[n * C + i] - m);
        v /= C;
        for (int i = 0; i < C; i++)
            EXPECT_NEAR(out[n * C + i], (inp[n * C + i] - m) / std::sqrt(v + 1e-5) * w[i] + b[i],
                        1e-4);
    }
    std::vector<float> dinp(N * C), dw(C), db(C);
    cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                            mean.data(), rstd.data(), N, C);
    check_grad("dinp", inp, dinp, f);
    check_grad("dweight", w, dw, f);
    check_grad("dbias", b, db, f);
}

TEST(OpsGrad, Gelu) {
    const int n = 50;
    auto inp = randn(n, 21, 2.0f), dout = randn(n, 22);
    std::vector<float> out(n), dinp(n);
    auto f = [&]() {
        cpu::gelu_forward(out.data(), inp.data(), n);
        return dot(out, dout);
    };
    f();
    for (int i = 0; i < n; i++) {
        double x = inp[i];
        double ref = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
        EXPECT_NEAR(out[i], ref, 1e-5);
    }
    cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    check_grad("dinp", inp, dinp, f, 2e-2, n);
}

TEST(OpsGrad, Attention) {
    for (int T : {1, 5}) {
        const int B = 2, C = 8, NH = 2;
        auto qkv = randn(B * T * 3 * C, 31), dout = randn(B * T * C, 32);
        std::vector<float> out(B * T * C), att(B * NH * T * T), dqkv(B * T * 3 * C);
        auto f = [&]() {
            cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NH);
            return dot(out, dout);
        };
        f();
        // Causality: row i of the probabilities is zero beyond i and sums to one.
        for (int r = 0; r < B * NH * T; r++) {
            int i = r % T;
            double s = 0;
            for (int j = 0; j < T; j++) {
                s += att[r * T + j];
                if (j > i) {
                    EXPECT_EQ(att[r * T + j], 0.0f);
                }
            }
            EXPECT_NEAR(s, 1.0, 1e-5);
        }
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NH);
        check_grad("dqkv", qkv, dqkv, f, 2e-2, 200);
    }
}

// Attention dropout (model.dropout): the probabilities that weight v are dropped by the hash
// mask, the saved ones are not, and the backward through the same mask is the gradient. GQA too.
TEST(OpsGrad, AttentionWithDropout) {
    for (int NKV : {2, 1}) {
        const int B = 2, T = 6, C = 8, NH = 2, QKV = C + 2 * NKV * (C / NH);
        DropoutMask m{0.3, 77, 5, 1};
        auto qkv = randn(B * T * QKV, 33), dout = randn(B * T * C, 34);
        std::vector<float> out(B * T * C), plain(B * T * C), att(B * NH * T * T),
            att0(B * NH * T * T), dqkv(B * T * QKV);
        auto f = [&]() {
            cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NKV, &m);
            return dot(out, dout);
        };
        f();
        cpu::attention_forward(plain.data(), att0.data(), qkv.data(), B, T, C, NH, NKV);
        EXPECT_EQ(att, att0) << "the saved probabilities are the undropped ones";
        EXPECT_NE(out, plain) << "nothing was dropped";
        // Output row (b, i) of head h is sum_j drop(a_ij) v_j: check one against the mask.
        const int b = 1, h = 1, i = T - 1, hs = C / NH;
        for (int d = 0; d < hs; d++) {
            double want = 0;
            for (int j = 0; j <= i; j++)
                want += (double)att[((b * NH + h) * T + i) * T + j] *
                        m.factor(m.key(b), ((uint64_t)h * T + i) * T + j) *
                        qkv[(b * T + j) * QKV + C + NKV * hs + (h / (NH / NKV)) * hs + d];
            EXPECT_NEAR(out[(b * T + i) * C + h * hs + d], want, 1e-5);
        }
        cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV,
                                &m);
        check_grad("dqkv with dropout", qkv, dqkv, f, 2e-2, 200);
    }
}

// The residual and in-place dropout: a fraction near p dropped, the rest scaled by 1 / (1 - p),
// each sequence's mask its own (keyed by first + b) and the same at any batch split.
TEST(OpsGrad, DropoutMaskIsKeyedBySequence) {
    const int B = 4, T = 16, C = 32, n = B * T * C;
    DropoutMask m{0.25, 9, 100, 2};
    auto x = randn(n, 51), r = randn(n, 52);
    std::vector<float> y(n), z = x;
    cpu::dropout(y.data(), x.data(), m, B, T, C);
    int dropped = 0;
    for (int i = 0; i < n; i++) {
        if (y[i] == 0.0f)
            dropped++;
        else
            EXPECT_FLOAT_EQ(y[i], x[i] / 0.75f);
    }
    EXPECT_NEAR((double)dropped / n, 0.25, 0.02);
    // Sequences 2 and 3 alone (first = 102) drop what they dropped in the batch of 4.
    DropoutMask tail = m;
    tail.first = 102;
    std::vector<float> y2(n / 2);
    cpu::dropout(y2.data(), x.data() + n / 2, tail, 2, T, C);
    EXPECT_TRUE(std::equal(y2.begin(), y2.end(), y.begin() + n / 2));
    // out = resid + drop(branch) (to rounding: the compiler may fuse the multiply-add); in
    // place equals out of place.
    cpu::dropout_residual(z.data(), r.data(), m, B, T, C);
    for (int i = 0; i < n; i++)
        ASSERT_NEAR(z[i], r[i] + y[i], 1e-6f * (std::abs(r[i]) + std::abs(y[i])));
    cpu::dropout(x.data(), x.data(), m, B, T, C);
    EXPECT_EQ(x, y);
    // Another site, seed or first sequence draws another mask.
    for (DropoutMask o : {DropoutMask{0.25, 9, 100, 3}, DropoutMask{0.25, 10, 100, 2},
                          DropoutMask{0.25, 9, 101, 2}}) {
        std::vector<float> w(n);
        cpu::dropout(w.data(), z.data(), o, B, T, C);
        std::vector<float> v(n);
        cpu::dropout(v.data(), z.data(), m, B, T, C);
        EXPECT_NE(w, v);
    }
}

// train.cpu_attention = "lse": the forward keeps each row's log-sum-exp instead of its
// probabilities (the same output bits), and the backward recomputes them: the gradient of the
// probabilities' kernel to rounding, and the finite difference; with GQA and dropout too.
TEST(OpsGrad, AttentionKeepingTheLogSumExp) {
    for (int NKV : {2, 1}) {
        for (bool drop : {false, true}) {
            const int B = 2, T = 7, C = 8, NH = 2, QKV = C + 2 * NKV * (C / NH);
            DropoutMask m{drop ? 0.25 : 0.0, 3, 11, 4};
            auto qkv = randn(B * T * QKV, 35), dout = randn(B * T * C, 36);
            std::vector<float> out(B * T * C), ref(B * T * C), att(B * NH * T * T), lse(B * NH * T),
                dqkv(B * T * QKV), dref(B * T * QKV);
            cpu::attention_forward(ref.data(), att.data(), qkv.data(), B, T, C, NH, NKV, &m);
            auto f = [&]() {
                cpu::attention_forward(out.data(), nullptr, qkv.data(), B, T, C, NH, NKV, &m,
                                       lse.data());
                return dot(out, dout);
            };
            f();
            EXPECT_EQ(out, ref);
            // One row: its probabilities are exp(s_j - lse) for the scaled scores s_j.
            const int b = 1, h = 1, i = T - 2, hs = C / NH, kvh = h / (NH / NKV);
            for (int j = 0; j <= i; j++) {
                double sc = 0;
                for (int d = 0; d < hs; d++)
                    sc += (double)qkv[(b * T + i) * QKV + h * hs + d] *
                          qkv[(b * T + j) * QKV + C + kvh * hs + d];
                sc /= std::sqrt((double)hs);
                EXPECT_NEAR(std::exp(sc - lse[(b * NH + h) * T + i]),
                            att[((b * NH + h) * T + i) * T + j], 1e-6);
            }
            cpu::attention_backward(dref.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH,
                                    NKV, &m);
            cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), nullptr, B, T, C, NH, NKV,
                                    &m, lse.data());
            for (std::size_t i = 0; i < dqkv.size(); i++)
                ASSERT_NEAR(dqkv[i], dref[i], 1e-5f * (1 + std::abs(dref[i]))) << i;
            check_grad("dqkv keeping the log-sum-exp", qkv, dqkv, f, 2e-2, 200);
        }
    }
}

TEST(OpsGrad, Embedding) {
    const int B = 2, T = 3, C = 4, V = 5;
    std::vector<int32_t> tok = {0, 3, 3, 1, 4, 3};
    auto wte = randn(V * C, 41), wpe = randn(T * C, 42), dout = randn(B * T * C, 43);
    std::vector<float> out(B * T * C), dwte(V * C), dwpe(T * C);
    auto f = [&]() {
        cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
        return dot(out, dout);
    };
    f();
    cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
    check_grad("dwte", wte, dwte, f);
    check_grad("dwpe", wpe, dwpe, f);
}

TEST(OpsGrad, ClassifierLossChunked) {
    const int N = 7, C = 6, V = 10, Vp = 16;
    auto x = randn(N * C, 51), wte = randn(Vp * C, 52);
    for (int i = V * C; i < Vp * C; i++) wte[i] = 0.0f;
    std::vector<int32_t> y = {0, 9, 3, 3, 5, 1, 8};
    for (int chunk : {1, 3, 7, 64}) {
        std::vector<float> logits_buf((std::size_t)std::min(chunk, N) * Vp);
        auto f = [&]() {
            return cpu::classifier_loss(nullptr, nullptr, logits_buf.data(), x.data(), wte.data(),
                                        y.data(), N, C, V, Vp, chunk, 0.0f);
        };
        // Naive loss over full logits.
        double ref = 0;
        for (int n = 0; n < N; n++) {
            std::vector<double> l(V);
            double mx = -1e30;
            for (int v = 0; v < V; v++) {
                l[v] = 0;
                for (int c = 0; c < C; c++) l[v] += (double)x[n * C + c] * wte[v * C + c];
                mx = std::max(mx, l[v]);
            }
            double s = 0;
            for (int v = 0; v < V; v++) s += std::exp(l[v] - mx);
            ref += mx + std::log(s) - l[y[n]];
        }
        EXPECT_NEAR(f(), ref, 1e-4) << "chunk " << chunk;
        std::vector<float> dx(N * C), dwte(Vp * C);
        cpu::classifier_loss(dx.data(), dwte.data(), logits_buf.data(), x.data(), wte.data(),
                             y.data(), N, C, V, Vp, chunk, 1.0f);
        check_grad("dx", x, dx, f);
        check_grad("dwte", wte, dwte, f);
        for (int i = V * C; i < Vp * C; i++) EXPECT_EQ(dwte[i], 0.0f) << "padded row gradient";
    }
}

TEST(OpsGrad, SumSquaresIsThreadCountIndependent) {
    auto a = randn(100000, 61);
    double ref = 0;
    for (float v : a) ref += (double)v * v;
    EXPECT_NEAR(cpu::sum_squares(a.data(), (int64_t)a.size()), ref, 1e-6 * ref);
}
