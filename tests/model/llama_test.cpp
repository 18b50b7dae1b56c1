// The Llama-style block as a config (rmsnorm + swiglu + rope + grouped-query attention + untied
// lm_head): parameter layout, validation by key name, same-seed bits, memory against the layout,
// a finite-difference check of the whole model, weights round-trip and a short training run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/allocator.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/gpt.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace memtrain;

namespace {

using test::tiny_llama;

void expect_error_naming(const ModelConfig& c, const std::string& key) {
    try {
        c.validate();
        ADD_FAILURE() << "expected an error naming " << key;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
}

}  // namespace

TEST(Llama, LayoutHasTheDocumentedTensors) {
    ModelConfig c = tiny_llama();
    GPT m(c);
    const auto& lay = m.layout();
    const int64_t C = 16, QKV = 16 + 2 * 2 * 4, Vp = 48;
    EXPECT_EQ(lay.get("wte.weight").shape, (std::vector<int64_t>{Vp, C}));
    EXPECT_EQ(lay.get("lm_head.weight").shape, (std::vector<int64_t>{Vp, C}));
    EXPECT_EQ(lay.get("h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{C, QKV}));
    EXPECT_EQ(lay.get("h.1.attn.c_attn.bias").shape, (std::vector<int64_t>{QKV}));
    EXPECT_EQ(lay.get("h.0.mlp.c_fc.weight").shape, (std::vector<int64_t>{C, 48}));
    EXPECT_EQ(lay.get("h.0.mlp.c_proj.weight").shape, (std::vector<int64_t>{24, C}));
    EXPECT_EQ(lay.get("h.0.ln_1.weight").shape, (std::vector<int64_t>{C}));
    EXPECT_THROW(lay.get("wpe.weight"), Error);
    EXPECT_THROW(lay.get("h.0.ln_1.bias"), Error);
    EXPECT_THROW(lay.get("ln_f.bias"), Error);
    std::size_t L = 2, H = 24;
    std::size_t per_block = 2 * C + C * QKV + QKV + C * C + C + C * 2 * H + 2 * H + H * C + C;
    EXPECT_EQ(m.num_params(), 2 * Vp * C + L * per_block + C);
    // The Llama default MLP width: 8 C / 3 rounded up to a multiple of 256.
    ModelConfig d = c;
    d.ffn_hidden = 0;
    EXPECT_EQ(d.mlp_hidden(), 256);
    d.n_embd = 768;
    d.n_head = 12;
    EXPECT_EQ(d.mlp_hidden(), 2048);
    EXPECT_EQ(test::tiny_model().mlp_hidden(), 64);
}

TEST(Llama, ValidationNamesTheKey) {
    ModelConfig c = tiny_llama();
    c.validate();
    ModelConfig bad = c;
    bad.n_kv_head = 3;
    expect_error_naming(bad, "model.n_kv_head");
    bad = c;
    bad.n_kv_head = -1;
    expect_error_naming(bad, "model.n_kv_head");
    bad = c;
    bad.ffn_hidden = -2;
    expect_error_naming(bad, "model.ffn_hidden");
    bad = c;
    bad.norm_eps = 0;
    expect_error_naming(bad, "model.norm_eps");
    bad = c;
    bad.rope_theta = -1;
    expect_error_naming(bad, "model.rope_theta");
    bad = c;
    bad.activation = "relu";
    expect_error_naming(bad, "model.activation");
    bad = c;
    bad.positions = "alibi";
    expect_error_naming(bad, "model.positions");
    bad = c;
    bad.n_head = 2;  // head size 8 is fine; 16 / 3 is not a head size at all
    bad.n_kv_head = 1;
    bad.validate();
    bad.n_embd = 18;  // head size 9: rope pairs channel i with i + hs/2
    expect_error_naming(bad, "model.positions");
}

TEST(Llama, ConfigKeysParseFromToml) {
    RunConfig r = parse_run_config(
        "[model]\nnorm = \"rmsnorm\"\nactivation = \"swiglu\"\npositions = \"rope\"\n"
        "n_kv_head = 2\ntied_embeddings = false\nffn_hidden = 24\nnorm_eps = 1e-6\n"
        "rope_theta = 500000.0\n",
        "x.toml", {"model.n_head=4"});
    EXPECT_EQ(r.model.ffn_hidden, 24);
    EXPECT_EQ(r.model.norm_eps, 1e-6);
    EXPECT_EQ(r.model.rope_theta, 500000.0);
    RunConfig again = parse_run_config(to_toml(r), "resolved", {});
    EXPECT_EQ(again.model.ffn_hidden, 24);
    EXPECT_EQ(again.model.rope_theta, 500000.0);
    EXPECT_EQ(again.model.norm, "rmsnorm");
}

TEST(Llama, SameSeedSameBitsAndMemoryMatchesLayout) {
    ModelConfig c = tiny_llama();
    auto x = test::random_tokens(16, c.vocab_size, 5), y = test::random_tokens(16, c.vocab_size, 6);
    auto before = host_memory().snapshot();
    GPT a(c), b(c);
    a.init_weights(42);
    b.init_weights(42);
    ASSERT_EQ(0, std::memcmp(a.params(), b.params(), a.num_params() * 4));
    // Untied: the output embedding is its own draw, padded rows zero.
    const auto& lm = a.layout().get("lm_head.weight");
    EXPECT_NE(0, std::memcmp(a.params(), a.params() + lm.offset, 16 * 4));
    for (std::size_t i = 37 * 16; i < 48 * 16; i++) EXPECT_EQ(a.params()[lm.offset + i], 0.0f);
    a.zero_grads();
    b.zero_grads();
    float la = a.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    float lb = b.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    EXPECT_EQ(la, lb);
    EXPECT_NEAR(la, std::log(37.0), 0.1);
    EXPECT_EQ(0, std::memcmp(a.grads(), b.grads(), a.num_params() * 4));
    auto s = host_memory().snapshot();
    auto lay = activation_layout(c, 2, 8);
    EXPECT_EQ(s[MemCategory::Activations] - before[MemCategory::Activations],
              2 * arena_bytes(lay, MemCategory::Activations));
    EXPECT_EQ(s[MemCategory::Workspace] - before[MemCategory::Workspace],
              2 * arena_bytes(lay, MemCategory::Workspace));
    // Per block: ln1, atty, resid_mid, ln2 (4 BTC), qkv (BT x 32), 2 rstd, probabilities,
    // fch (BT x 2H) and the product (BT x H); plus L+1 residual streams and ln_f with its rstd.
    std::size_t BT = 16, C = 16, L = 2, H = 24;
    std::size_t expect = L * (4 * BT * C + BT * 32 + 2 * BT + 4 * 2 * 64 + BT * 3 * H) +
                         (L + 1) * BT * C + BT * C + BT;
    EXPECT_EQ(arena_bytes(lay, MemCategory::Activations), 4 * expect);
}

TEST(Llama, WholeModelGradientMatchesFiniteDifferences) {
    ModelConfig c = tiny_llama();
    GPT m(c);
    m.init_weights(12);
    // Larger weights than the init, so every path (rope angles, gating) carries real signal.
    for (const auto& t : m.layout().tensors)
        if (t.name.find("ln_") == std::string::npos)
            for (std::size_t k = 0; k < t.numel; k++) m.params()[t.offset + k] *= 5.0f;
    for (const auto& t : m.layout().tensors)
        if (t.name.find("wte") != std::string::npos || t.name.find("lm_head") != std::string::npos)
            for (std::size_t k = 37 * 16; k < t.numel; k++) m.params()[t.offset + k] = 0.0f;
    auto x = test::random_tokens(16, c.vocab_size, 13),
         y = test::random_tokens(16, c.vocab_size, 14);
    EXPECT_GT(test::check_model_gradient(m, x, y, 2, 8, 5), 80);
}

TEST(Llama, HfWeightsRoundTripAndConfigJson) {
    ModelConfig c = tiny_llama();
    GPT a(c), b(c);
    a.init_weights(3);
    auto dir = test::temp_dir("llama_hf");
    save_hf_weights(a, dir + "/model.safetensors");
    load_hf_weights(b, dir + "/model.safetensors");
    EXPECT_EQ(0, std::memcmp(a.params(), b.params(), a.num_params() * 4));
    std::string j = hf_config_json(c);
    EXPECT_NE(j.find("\"model_type\": \"memtrain-llama-style\""), std::string::npos) << j;
    EXPECT_NE(j.find("\"n_kv_head\": 2"), std::string::npos) << j;
    EXPECT_NE(j.find("\"tie_word_embeddings\": false"), std::string::npos) << j;
    std::string g = hf_config_json(test::tiny_model());
    EXPECT_NE(g.find("\"model_type\": \"gpt2\""), std::string::npos);
    EXPECT_NE(g.find("\"layer_norm_epsilon\": 1e-05,"), std::string::npos) << g;
}

TEST(Llama, TrainsAndResumesBitwiseThroughTheTrainer) {
    auto llama = [](RunConfig r) {
        r.model.n_head = 4;
        r.model.n_kv_head = 2;
        r.model.norm = "rmsnorm";
        r.model.activation = "swiglu";
        r.model.positions = "rope";
        r.model.tied_embeddings = false;
        r.model.ffn_hidden = 32;
        return r;
    };
    TrainOptions q;
    q.quiet = true;
    RunConfig full = llama(test::tiny_run(test::temp_dir("llama_full"), 12));
    Trainer t(full, q);
    auto s = t.run();
    ASSERT_EQ(s.losses.size(), 12u);
    EXPECT_LT(s.losses.back(), s.losses.front());

    RunConfig split = llama(test::tiny_run(test::temp_dir("llama_split"), 12));
    TrainSummary s2;
    auto second = test::train_stop_and_resume(split, 6, s2);
    ASSERT_EQ(s2.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(s2.losses[i], s.losses[6 + i]) << "step " << 7 + i;
    EXPECT_EQ(
        0, std::memcmp(t.model().params(), second->model().params(), t.model().num_params() * 4));
}
