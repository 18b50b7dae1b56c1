// LoRA in the model: B = 0 is exactly the base, gradients match finite differences (GPT-2's fused
// c_attn and Llama's separate q/k/v/gate/up adapters), remat does not change them, dropout is
// one mask per micro-batch, merging equals the unmerged model, and the PEFT files reload.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "io/hf_weights.h"
#include "io/lora_files.h"
#include "io/safetensors.h"
#include "io/text_file.h"
#include "model/lora.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "remat/policy.h"
#include "test_util.h"

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

// Every micro-batch here: kBatch sequences of kSeq tokens.
constexpr int kBatch = 2, kSeq = 8;

// An exact Llama (rmsnorm, swiglu, rope, no bias, untied, GQA): its adapters are per projection.
ModelConfig tiny_exact_llama() {
    ModelConfig c = test::tiny_llama();
    c.bias = false;
    return c;
}

// A base model, its adapters in a store of their own, and the tokens of one micro-batch.
struct LoraModel {
    GPT model;
    LoraConfig lc;
    LoraLayout lay;
    FullUnitStore adapters;
    LoraAdapters lora;
    std::vector<int32_t> x, y;
    LoraModel(const ModelConfig& cfg, LoraConfig c, bool random_b)
        : model(cfg),
          lc(c),
          lay(make_lora_layout(cfg, c)),
          adapters(lay.params),
          lora(lc, lay, adapters, 7),
          x(test::random_tokens(kBatch * kSeq, cfg.vocab_size, 3)),
          y(test::random_tokens(kBatch * kSeq, cfg.vocab_size, 4)) {
        model.init_weights(11);
        init_lora_weights(adapters, lay, 5);
        if (random_b) {  // so A's gradients are not zero
            Rng r(9);
            for (const ParamSpec& t : lay.params.tensors)
                if (t.name.ends_with("lora_B.weight"))
                    for (std::size_t k = 0; k < t.numel; k++)
                        adapters.full_params()[t.offset + k] = (float)(0.2 * r.normal());
        }
        model.set_lora(&lora);
    }
    float* a() { return adapters.full_params(); }
    std::size_t n() const { return lay.params.total; }
    double loss() { return model.forward_loss(x.data(), y.data(), kBatch, kSeq); }
    // The training pass's loss (model.dropout drops there only).
    double train_loss() { return model.forward_backward(x.data(), y.data(), kBatch, kSeq, 0.0f); }
    std::vector<float> grads() {
        adapters.zero_grads();
        model.forward_backward(x.data(), y.data(), kBatch, kSeq, 1.0f / (kBatch * kSeq));
        return {adapters.full_grads(), adapters.full_grads() + n()};
    }
};

LoraConfig lora_cfg(const std::string& targets, double dropout = 0) {
    LoraConfig c;
    c.rank = 3;
    c.alpha = 6;
    c.targets = targets;
    c.dropout = dropout;
    return c;
}

// Central differences of the (training-mode) loss at a few coordinates of every adapter tensor;
// under model.dropout of the training pass's loss, with a smaller step (its 1 / (1 - p) raises
// the curvature).
void check_fd(LoraModel& s) {
    s.lora.set_training(true);
    const std::vector<float> g = s.grads();
    const bool dropout = s.model.config().dropout > 0;
    const float h = dropout ? 3e-3f : 1e-2f;
    int checked = 0;
    for (const ParamSpec& t : s.lay.params.tensors)
        for (std::size_t k = 0; k < t.numel; k += std::max<std::size_t>(1, t.numel / 5)) {
            float* p = s.a() + t.offset + k;
            const float v = *p;
            *p = v + h;
            const double lp = dropout ? s.train_loss() : s.loss();
            *p = v - h;
            const double lm = dropout ? s.train_loss() : s.loss();
            *p = v;
            const double num = (lp - lm) / (2 * h);
            EXPECT_NEAR(g[t.offset + k], num, 2e-3 + 2e-2 * std::abs(num))
                << t.name << "[" << k << "]";
            checked++;
        }
    EXPECT_GT(checked, 20);
}

}  // namespace

TEST(Lora, LayoutHasPeftShapesAndTargets) {
    const LoraLayout g = make_lora_layout(test::tiny_model(), lora_cfg("attn"));
    ASSERT_EQ(g.sites.size(), 4u);  // c_attn and attn.c_proj of 2 blocks
    EXPECT_EQ(g.params.tensors[0].name, "h.0.attn.c_attn.lora_A.weight");
    EXPECT_EQ(g.params.tensors[0].shape, (std::vector<int64_t>{3, 16}));
    EXPECT_EQ(g.params.tensors[1].shape, (std::vector<int64_t>{48, 3}));
    EXPECT_EQ(g.params.total, 2u * 3 * ((16 + 48) + (16 + 16)));
    const LoraLayout l = make_lora_layout(tiny_exact_llama(), lora_cfg("all"));
    ASSERT_EQ(l.sites.size(), 14u);
    EXPECT_EQ(l.sites[1].module, "model.layers.0.self_attn.k_proj");
    EXPECT_EQ(l.sites[1].col0, 16);
    EXPECT_EQ(l.sites[1].out, 8);  // 2 kv heads x 4
    EXPECT_EQ(l.sites[5].module, "model.layers.0.mlp.up_proj");
    EXPECT_EQ(l.sites[5].col0, 24);
    // Each (block, linear) pair's adapters, as GPT runs them: q, k, v on c_attn's GEMM.
    const auto qkv = l.sites_of(1, BlockLinear::Qkv);
    ASSERT_EQ(qkv.size(), 3u);
    EXPECT_EQ(qkv[0].module, "model.layers.1.self_attn.q_proj");
    EXPECT_EQ(qkv[2].module, "model.layers.1.self_attn.v_proj");
    EXPECT_EQ(l.sites_of(1, BlockLinear::FcProj).front().module, "model.layers.1.mlp.down_proj");
    EXPECT_TRUE(g.sites_of(1, BlockLinear::Fc).empty());
    EXPECT_EQ(l.max_in, 24);  // down_proj's input: the MLP's hidden width
    EXPECT_EQ(make_lora_layout(tiny_exact_llama(), lora_cfg("q_proj,v_proj")).sites.size(), 4u);
    EXPECT_EQ(make_lora_layout(test::tiny_model(), lora_cfg("c_proj")).sites.size(), 4u);
    EXPECT_EQ(make_lora_layout(test::tiny_model(), lora_cfg("mlp.c_proj")).sites.size(), 2u);
    try {
        make_lora_layout(test::tiny_model(), lora_cfg("q_proj"));
        ADD_FAILURE() << "q_proj on a GPT-2 was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("attn.c_attn"), std::string::npos) << e.what();
    }
    LoraConfig bad = lora_cfg("attn", 1.0);
    EXPECT_THROW(bad.validate(), Error);
}

TEST(Lora, ZeroBIsExactlyTheBaseModel) {
    for (const ModelConfig& cfg : {test::tiny_model(), tiny_exact_llama()}) {
        GPT base(cfg);
        base.init_weights(11);
        LoraModel s(cfg, lora_cfg("all"), false);
        const double want = base.forward_loss(s.x.data(), s.y.data(), kBatch, kSeq);
        EXPECT_EQ(s.loss(), want);
        s.lora.set_training(true);
        EXPECT_EQ(
            s.model.forward_backward(s.x.data(), s.y.data(), kBatch, kSeq, 1.0f / (kBatch * kSeq)),
            base.forward_backward(s.x.data(), s.y.data(), kBatch, kSeq, 1.0f / (kBatch * kSeq)));
    }
}

TEST(Lora, GradientsMatchFiniteDifferences) {
    LoraModel g(test::tiny_model(), lora_cfg("all"), true);
    check_fd(g);
    LoraModel l(tiny_exact_llama(), lora_cfg("all"), true);
    check_fd(l);
    LoraModel d(tiny_exact_llama(), lora_cfg("attn", 0.3),
                true);  // one dropout mask per micro-batch
    check_fd(d);
    // model.dropout with adapters on every linear: each adapter's output is inside the branch
    // that is dropped (as PEFT's LoRA sits inside GPT-2's attention and MLP).
    ModelConfig dropped = test::tiny_model();
    dropped.dropout = 0.2;
    LoraModel m(dropped, lora_cfg("all", 0.1), true);
    m.model.set_dropout_seed(3);
    m.model.set_dropout_rows(8);
    check_fd(m);
    EXPECT_NE(m.train_loss(), m.loss());
}

TEST(Lora, BaseGetsNoGradientsAndRematKeepsTheBits) {
    LoraModel s(test::tiny_model(), lora_cfg("all"), true);
    s.lora.set_training(true);
    const std::vector<float> want = s.grads();
    for (const char* policy : {"full", "selective", "every:2", "memory-poor", "chen:2"}) {
        s.model.set_remat(remat::solve_policy(remat::parse_policy(policy), s.model.config(), kBatch,
                                              kSeq, nullptr, ActFormat::cpu())
                              .plan);
        EXPECT_EQ(s.grads(), want) << policy;
    }
    // The base store was never asked for gradients (FullUnitStore allocates them on first use):
    // the only gradients alive are the adapters'.
    EXPECT_EQ(host_memory().snapshot().used[(int)MemCategory::Gradients], 4 * s.n());
}

// ModelConfig::mlp_tile with adapters: c_attn's, c_fc's and mlp.c_proj's adapters run on each
// tile's rows (their dropout masks indexed by the tile's rows in the micro-batch), so the
// adapters' gradients are the untiled model's to rounding, with and without LoRA dropout, every
// remat policy gives the tiled model's bits, and without dropout they match finite differences.
TEST(Lora, TiledNormsAndMlpKeepTheAdaptersGradients) {
    for (bool llama : {false, true})
        for (double dropout : {0.0, 0.5}) {
            const std::string what =
                std::string(llama ? "llama" : "gpt2") + (dropout > 0 ? " dropout" : "");
            const ModelConfig whole = llama ? tiny_exact_llama() : test::tiny_model();
            ModelConfig tiled = whole;
            tiled.mlp_tile = 5;  // tiles of 5, 5, 5 and 1 of the 16 rows
            LoraModel a(whole, lora_cfg("all", dropout), true),
                b(tiled, lora_cfg("all", dropout), true);
            a.lora.set_training(true);
            b.lora.set_training(true);
            const std::vector<float> want = a.grads(), got = b.grads();
            ASSERT_EQ(got.size(), want.size());
            for (std::size_t i = 0; i < want.size(); i++)
                ASSERT_NEAR(got[i], want[i], 1e-6 + 1e-4 * std::abs(want[i])) << what << " " << i;
            for (const char* policy : {"full", "selective", "memory-poor"}) {
                b.model.set_remat(remat::solve_policy(remat::parse_policy(policy), tiled, kBatch,
                                                      kSeq, nullptr, cpu_arena_format(tiled))
                                      .plan);
                EXPECT_EQ(b.grads(), got) << what << " " << policy;
            }
            b.model.set_remat({});
            if (dropout == 0) check_fd(b);
        }
}

TEST(Lora, DropoutIsOneMaskPerMicroBatchAndOffInEvaluation) {
    LoraModel s(test::tiny_model(), lora_cfg("all", 0.5), true);
    const double eval = s.loss();
    s.lora.set_training(true);
    const double t1 = s.loss(), t1_again = s.loss();
    s.lora.set_micro_batch(1);
    const double t2 = s.loss();
    EXPECT_EQ(t1, t1_again);
    EXPECT_NE(t1, eval);
    EXPECT_NE(t1, t2);
    s.lora.set_training(false);
    EXPECT_EQ(s.loss(), eval);
}

TEST(Lora, MergedModelEqualsTheUnmergedOne) {
    for (const ModelConfig& cfg : {test::tiny_model(), tiny_exact_llama()}) {
        LoraModel s(cfg, lora_cfg("all"), true);
        std::vector<float> lu((std::size_t)kBatch * kSeq * cfg.vocab_size), lm(lu.size());
        s.model.forward_logits(s.x.data(), kBatch, kSeq, lu.data());
        GPT merged(cfg);
        std::memcpy(merged.params(), s.model.params(), merged.num_params() * sizeof(float));
        merge_lora(merged.params(), merged.layout(), s.a(), s.lay, s.lc.scale());
        merged.forward_logits(s.x.data(), kBatch, kSeq, lm.data());
        double num = 0, den = 0;
        for (std::size_t i = 0; i < lu.size(); i++) {
            num += ((double)lu[i] - lm[i]) * ((double)lu[i] - lm[i]);
            den += (double)lu[i] * lu[i];
        }
        EXPECT_LT(std::sqrt(num / den), 1e-5);
        EXPECT_NEAR(merged.forward_loss(s.x.data(), s.y.data(), kBatch, kSeq), s.loss(), 1e-5);
    }
}

TEST(Lora, PeftFilesHoldPeftNamesAndReload) {
    for (const ModelConfig& cfg : {test::tiny_model(), tiny_exact_llama()}) {
        const std::string dir = test::temp_dir("lora_peft");
        LoraModel s(cfg, lora_cfg("all"), true);
        RunConfig rc;
        rc.model = cfg;
        rc.lora = s.lc;
        save_lora_adapters(dir, rc, s.lay, s.adapters, true);
        auto f = io::SafetensorsFile::open(dir + "/adapter_model.safetensors");
        const std::string first = cfg.is_llama()
                                      ? "base_model.model.model.layers.0.self_attn.q_proj"
                                      : "base_model.model.transformer.h.0.attn.c_attn";
        const auto& a = f.get(first + ".lora_A.weight");
        EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 16}));
        EXPECT_EQ(f.get(first + ".lora_B.weight").shape[1], 3);
        EXPECT_EQ(f.tensors().size(), s.lay.params.tensors.size());
        const std::string json = io::read_text_file(dir + "/adapter_config.json");
        EXPECT_NE(json.find("\"peft_type\": \"LORA\""), std::string::npos);
        EXPECT_NE(json.find("\"r\": 3"), std::string::npos);
        EXPECT_NE(
            json.find(cfg.is_llama() ? "\"fan_in_fan_out\": false" : "\"fan_in_fan_out\": true"),
            std::string::npos);
        FullUnitStore back(s.lay.params);
        load_lora_adapters(dir, cfg, s.lay, back);
        EXPECT_EQ(0, std::memcmp(back.full_params(), s.a(), s.n() * sizeof(float)));
        // A subset of the targets loads; another rank does not (an Error naming the tensor).
        const LoraLayout attn = make_lora_layout(cfg, lora_cfg("attn"));
        FullUnitStore sa(attn.params);
        EXPECT_NO_THROW(load_lora_adapters(dir, cfg, attn, sa));
        LoraConfig r4 = lora_cfg("all");
        r4.rank = 4;
        const LoraLayout l4 = make_lora_layout(cfg, r4);
        FullUnitStore s4(l4.params);
        EXPECT_THROW(load_lora_adapters(dir, cfg, l4, s4), Error);
    }
}

// The planner counts exactly the adapters the trainer allocates (GPT-2 and exact Llama, attn and
// all), so `memtrain plan --lora-rank` and a LoRA run agree on Ψa.
TEST(Lora, PlannerCountsTheTrainersAdapters) {
    ModelConfig gpt2 = test::tiny_model();
    gpt2.n_layer = 3;
    gpt2.n_embd = 48;
    gpt2.n_head = 4;
    for (const ModelConfig& cfg : {gpt2, tiny_exact_llama()})
        for (const char* t : {"attn", "all"}) {
            const LoraLayout lay = make_lora_layout(cfg, lora_cfg(t));
            const int64_t per_layer = plan::lora_params_per_layer(plan::model_from_config(cfg), 3,
                                                                  plan::parse_lora_targets(t));
            EXPECT_EQ((int64_t)lay.params.total, per_layer * cfg.n_layer) << t;
        }
}
