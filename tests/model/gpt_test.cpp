// Model-level tests: memory accounting against 4Ψ/4Ψ/8Ψ, determinism, gradient accumulation
// equivalence, and a finite-difference check of the whole model's gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

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
