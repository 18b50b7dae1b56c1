// Model-level tests: memory accounting against 4Ψ/4Ψ/8Ψ, determinism, gradient accumulation
// equivalence, and a finite-difference check of the whole model's gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "model/gpt.h"
#include "optim/optimizer.h"
#include "test_util.h"

using namespace memtrain;

TEST(Gpt, ParameterCountMatchesGpt2Formula) {
    ModelConfig c = test::tiny_model();
    GPT m(c);
    std::size_t C = c.n_embd, L = c.n_layer;
    std::size_t expect =
        c.padded_vocab() * C + c.block_size * C + L * (12 * C * C + 13 * C) + 2 * C;
    EXPECT_EQ(m.num_params(), expect);
    EXPECT_EQ(c.padded_vocab(), 48);
}

TEST(Gpt, ModelStateBytesAre4_4_8Psi) {
    auto before = host_memory().snapshot();
    {
        ModelConfig c = test::tiny_model();
        GPT m(c);
        m.grads();
        OptimConfig oc;
        auto opt = make_optimizer(oc, m.layout());
        auto s = host_memory().snapshot();
        std::size_t psi = m.num_params();
        EXPECT_EQ(s[MemCategory::Parameters] - before[MemCategory::Parameters], 4 * psi);
        EXPECT_EQ(s[MemCategory::Gradients] - before[MemCategory::Gradients], 4 * psi);
        EXPECT_EQ(s[MemCategory::OptimizerState] - before[MemCategory::OptimizerState], 8 * psi);
        OptimConfig sgd;
        sgd.name = "sgd";
        auto opt2 = make_optimizer(sgd, m.layout());
        auto s2 = host_memory().snapshot();
        EXPECT_EQ(s2[MemCategory::OptimizerState] - s[MemCategory::OptimizerState], 4 * psi);
    }
    auto after = host_memory().snapshot();
    EXPECT_EQ(after.total_used, before.total_used) << "buffers must be released";
}

TEST(Gpt, ActivationBytesMatchLayout) {
    ModelConfig c = test::tiny_model();
    GPT m(c);
    m.init_weights(1);
    auto before = host_memory().snapshot();
    auto x = test::random_tokens(2 * 8, c.vocab_size, 3),
         y = test::random_tokens(2 * 8, c.vocab_size, 4);
    m.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    auto s = host_memory().snapshot();
    auto lay = activation_layout(c, 2, 8);
    EXPECT_EQ(s[MemCategory::Activations] - before[MemCategory::Activations],
              arena_bytes(lay, MemCategory::Activations));
    EXPECT_EQ(s[MemCategory::Workspace] - before[MemCategory::Workspace],
              arena_bytes(lay, MemCategory::Workspace));
    // Per block, 16 BTC + 4 BT + NH B T^2 floats, plus L+1 residual streams and ln_f.
    std::size_t BT = 16, C = c.n_embd, L = c.n_layer;
    std::size_t expect =
        L * (15 * BT * C + 4 * BT + c.n_head * 2 * 64) + (L + 1) * BT * C + BT * C + 2 * BT;
    EXPECT_EQ(arena_bytes(lay, MemCategory::Activations), 4 * expect);
}

TEST(Gpt, SameSeedSameBits) {
    ModelConfig c = test::tiny_model();
    auto x = test::random_tokens(16, c.vocab_size, 5), y = test::random_tokens(16, c.vocab_size, 6);
    GPT a(c), b(c);
    a.init_weights(42);
    b.init_weights(42);
    ASSERT_EQ(0, std::memcmp(a.params(), b.params(), a.num_params() * 4));
    a.zero_grads();
    b.zero_grads();
    float la = a.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    float lb = b.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    EXPECT_EQ(la, lb);
    EXPECT_EQ(0, std::memcmp(a.grads(), b.grads(), a.num_params() * 4));
    GPT d(c);
    d.init_weights(43);
    EXPECT_NE(0, std::memcmp(a.params(), d.params(), a.num_params() * 4));
}

TEST(Gpt, LossAtInitIsNearLogVocab) {
    ModelConfig c = test::tiny_model();
    GPT m(c);
    m.init_weights(7);
    auto x = test::random_tokens(16, c.vocab_size, 8), y = test::random_tokens(16, c.vocab_size, 9);
    EXPECT_NEAR(m.forward_loss(x.data(), y.data(), 2, 8), std::log(37.0), 0.1);
}

TEST(Gpt, GradientAccumulationEqualsOneLargeBatch) {
    ModelConfig c = test::tiny_model();
    const int T = 8, K = 4, b = 1;
    auto x = test::random_tokens(K * b * T, c.vocab_size, 10),
         y = test::random_tokens(K * b * T, c.vocab_size, 11);
    GPT big(c), acc(c);
    big.init_weights(3);
    acc.init_weights(3);
    big.zero_grads();
    acc.zero_grads();
    float scale = 1.0f / (K * b * T);
    float lbig = big.forward_backward(x.data(), y.data(), K * b, T, scale);
    double lacc = 0;
    for (int k = 0; k < K; k++)
        lacc += acc.forward_backward(x.data() + k * b * T, y.data() + k * b * T, b, T, scale);
    EXPECT_NEAR(lbig, lacc / K, 1e-6);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < big.num_params(); i++) {
        double d = (double)big.grads()[i] - acc.grads()[i];
        num += d * d;
        den += (double)big.grads()[i] * big.grads()[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-5);
    // And one AdamW update from each gives the same parameters.
    OptimConfig oc;
    auto o1 = make_optimizer(oc, big.layout()), o2 = make_optimizer(oc, acc.layout());
    o1->step(big.params(), big.grads(), 1e-3);
    o2->step(acc.params(), acc.grads(), 1e-3);
    for (std::size_t i = 0; i < big.num_params(); i++)
        ASSERT_NEAR(big.params()[i], acc.params()[i], 1e-6) << "param " << i;
}

TEST(Gpt, WholeModelGradientMatchesFiniteDifferences) {
    ModelConfig c = test::tiny_model();
    GPT m(c);
    m.init_weights(12);
    auto x = test::random_tokens(16, c.vocab_size, 13),
         y = test::random_tokens(16, c.vocab_size, 14);
    EXPECT_GT(test::check_model_gradient(m, x, y, 2, 8, 3), 50);
}

TEST(Gpt, RejectsOutOfVocabularyTokens) {
    ModelConfig c = test::tiny_model();
    GPT m(c);
    std::vector<int32_t> x(8, 0), y(8, 0);
    x[3] = 37;
    EXPECT_THROW(m.forward_loss(x.data(), y.data(), 1, 8), Error);
}

TEST(Gpt, RejectsUnimplementedVariantsByName) {
    ModelConfig c = test::tiny_model();
    c.norm = "batchnorm";
    try {
        GPT m(c);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("model.norm"), std::string::npos);
    }
}

// model.dropout: the whole model's gradient under a fixed mask is the finite difference of the
// same masked loss (forward_backward with the same sequence ordinal), GPT-2 and Llama-style.
TEST(Gpt, DropoutGradientMatchesFiniteDifferences) {
    for (bool llama : {false, true}) {
        ModelConfig c = llama ? test::tiny_llama() : test::tiny_model();
        c.dropout = 0.2;
        GPT m(c);
        m.init_weights(12);
        m.set_dropout_seed(5);
        m.set_dropout_rows(40);
        const int B = 2, T = 8;
        auto x = test::random_tokens(B * T, c.vocab_size, 13),
             y = test::random_tokens(B * T, c.vocab_size, 14);
        m.zero_grads();
        m.forward_backward(x.data(), y.data(), B, T, 1.0f / (B * T));
        std::vector<float> g(m.grads(), m.grads() + m.num_params());
        auto loss = [&] { return (double)m.forward_backward(x.data(), y.data(), B, T, 0.0f); };
        // (A smaller step than the dropout-free check's 1e-2: the kept elements' 1 / (1 - p)
        // raises the curvature, and 1e-2 then misses the biases' gradients by its truncation.)
        const float h = 3e-3f;
        int checked = 0;
        for (const auto& t : m.layout().tensors) {
            const bool vocab_rows = t.name == "wte.weight" || t.name == "lm_head.weight";
            for (std::size_t k = 0; k < t.numel; k += std::max<std::size_t>(1, t.numel / 3)) {
                if (vocab_rows && k >= (std::size_t)c.vocab_size * c.n_embd) continue;
                float& w = m.params()[t.offset + k];
                const float s = w;
                w = s + h;
                const double lp = loss();
                w = s - h;
                const double lm = loss();
                w = s;
                const double num = (lp - lm) / (2 * h);
                EXPECT_NEAR(g[t.offset + k], num, 2e-3 + 2e-2 * std::abs(num))
                    << t.name << "[" << k << "] llama=" << llama;
                checked++;
            }
        }
        EXPECT_GT(checked, 40);
    }
}

// Dropout runs in forward_backward only: evaluation and logits are the model without it. The
// masks are a function of (seed, sequence ordinal): the same ordinal draws the same bits, another
// ordinal or seed another mask, and a sequence's mask does not depend on the batch it is in.
TEST(Gpt, DropoutIsTrainingOnlyAndKeyedBySequence) {
    ModelConfig c = test::tiny_model();
    ModelConfig plain = c;
    c.dropout = 0.3;
    GPT m(c), ref(plain);
    m.init_weights(3);
    ref.init_weights(3);
    const int B = 2, T = 8;
    auto x = test::random_tokens(B * T, c.vocab_size, 1),
         y = test::random_tokens(B * T, c.vocab_size, 2);
    EXPECT_EQ(m.forward_loss(x.data(), y.data(), B, T), ref.forward_loss(x.data(), y.data(), B, T));
    std::vector<float> l1(B * T * c.vocab_size), l2(l1.size());
    m.forward_logits(x.data(), B, T, l1.data());
    ref.forward_logits(x.data(), B, T, l2.data());
    EXPECT_EQ(l1, l2);

    auto train_loss = [&](uint64_t seed, uint64_t rows, int b0, int nb) {
        m.set_dropout_seed(seed);
        m.set_dropout_rows(rows);
        return m.forward_backward(x.data() + b0 * T, y.data() + b0 * T, nb, T, 0.0f);
    };
    const float base = train_loss(1, 10, 0, B);
    EXPECT_NE(base, ref.forward_backward(x.data(), y.data(), B, T, 0.0f));
    EXPECT_EQ(base, train_loss(1, 10, 0, B));
    EXPECT_NE(base, train_loss(1, 12, 0, B));
    EXPECT_NE(base, train_loss(2, 10, 0, B));
    // Sequence 11 alone, and with sequence 10 before it: the same mask.
    const double halves = (train_loss(1, 10, 0, 1) + train_loss(1, 11, 1, 1)) / 2;
    EXPECT_NEAR(base, halves, 1e-6);
    // The evaluation after training passes still drops nothing.
    EXPECT_EQ(m.forward_loss(x.data(), y.data(), B, T), ref.forward_loss(x.data(), y.data(), B, T));
}
