// The planner search: the 200B-on-40GB example, rejection reasons, bad input.
#include <gtest/gtest.h>

#include "config/run_config.h"
#include "core/error.h"
#include "planner/report.h"
#include "planner/search.h"
#include "train/validate.h"

namespace memtrain::plan {

namespace {
ModelSpec model_200b() {
    ModelSpec m = load_model("gpt3-175b");
    m.name = "gpt-200b";
    m.n_layer = 100, m.n_embd = 12800, m.n_head = 100;
    return m;
}
}  // namespace

TEST(PlanSearch, TwoHundredBillionOnFortyGigabyteGpus) {
    ModelSpec m = model_200b();
    ASSERT_NEAR(m.total_params() / 1e9, 197.5, 1.0);
    ClusterSpec c;
    c.gpu = gpu_preset("a100-40gb");
    c.gpus = 512;
    SearchSpec s;
    s.global_batch = 1024;
    s.seq = 2048;
    SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    for (const auto& p : r.plans) EXPECT_LE(p.memory.total, 40e9);
    // Fastest first among the plans the trainer runs, then parameter offload (priced only).
    for (size_t i = 1; i < r.plans.size(); ++i) {
        const bool a = trainer_runs(r.plans[i - 1].run), b = trainer_runs(r.plans[i].run);
        EXPECT_TRUE(a || !b) << i;
        if (a == b) {
            EXPECT_GE(r.plans[i - 1].time.tokens_per_s, r.plans[i].time.tokens_per_s);
        }
    }
    EXPECT_TRUE(trainer_runs(r.plans[0].run));
    // Pure DP without ZeRO needs 16 bytes x 197.5B = 3.2 TB of states per GPU.
    bool found = false;
    for (const auto& rej : r.rejected) {
        if (rej.family != "pure DP, ZeRO-0") continue;
        found = true;
        EXPECT_GT(rej.best_bytes, 3.1e12);
        EXPECT_NE(rej.reason.find("TB"), std::string::npos) << rej.reason;
    }
    EXPECT_TRUE(found);
    // Output renders without surprises.
    EXPECT_NE(format_plans(r, 3, 5, c).find("rejected:"), std::string::npos);
    EXPECT_NE(memory_svg(r, 3, 40e9).find("<svg"), std::string::npos);
    EXPECT_NE(emit_config_toml(m, r.plans[0]).find("[model]"), std::string::npos);
}

TEST(PlanSearch, SmallModelPrefersPlainDataParallel) {
    ClusterSpec c;
    c.gpu = gpu_preset("h100-80gb");
    c.gpus = 8;
    SearchSpec s;
    s.global_batch = 64;
    SearchResult r = search_plans(load_model("gpt2"), c, s);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_EQ(r.plans[0].run.tp, 1);
    EXPECT_EQ(r.plans[0].run.pp, 1);
    EXPECT_EQ(r.plans[0].run.dp, 8);
}

TEST(PlanSearch, EmittedConfigLoadsInTheTrainer) {
    ClusterSpec c;
    c.gpu = gpu_preset("h100-80gb");
    c.gpus = 1;
    SearchSpec s;
    s.global_batch = 64;
    ModelSpec m = load_model("gpt2");
    SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    memtrain::RunConfig cfg =
        memtrain::parse_run_config(emit_config_toml(m, r.plans[0]), "emitted.toml", {});
    EXPECT_EQ(cfg.model.n_layer, 12);
    EXPECT_EQ(cfg.model.vocab_size, 50257);
    EXPECT_EQ(cfg.train.batch_size, 64);
    EXPECT_EQ(cfg.train.micro_batch_size, r.plans[0].run.micro_batch);
    EXPECT_EQ(cfg.train.remat, to_string(r.plans[0].run.recompute));
    // The layout and precision as the trainer's keys.
    EXPECT_EQ(cfg.train.precision, "bf16");
    EXPECT_EQ(cfg.train.zero_stage, r.plans[0].run.zero);
    EXPECT_EQ(cfg.train.offload_optimizer, r.plans[0].run.offload != Offload::none);
    EXPECT_EQ(cfg.train.tp, r.plans[0].run.tp);
    EXPECT_EQ(cfg.train.pp, r.plans[0].run.pp);
    EXPECT_NO_THROW(validate_config(cfg));
    EXPECT_EQ(cfg.lora.rank, 0);

    // A QLoRA plan writes the trainer's [lora] keys.
    Plan q = r.plans[0];
    q.run.lora_rank = 16;
    q.run.frozen_bits = 4;
    q.run.lora_targets = LoraTargets::all;
    memtrain::RunConfig qc = memtrain::parse_run_config(emit_config_toml(m, q), "emitted.toml", {});
    EXPECT_EQ(qc.lora.rank, 16);
    EXPECT_EQ(qc.lora.targets, "all");
    EXPECT_EQ(qc.lora.base, "nf4");
    qc.train.device = "cpu";  // the plan's bf16 is a GPU's; the CPU engine trains LoRA in fp32
    qc.train.precision = "fp32";
    EXPECT_NO_THROW(validate_config(qc));
}

// One GPU too small for GPT-2 1.5B's 16 bytes of model states per parameter: ZeRO-Offload (on
// one GPU: ZeRO-0, as the trainer runs it) is the plan, as long as the host holds its 18 bytes
// per parameter; with too little host memory the offload family says so with the numbers.
TEST(PlanSearch, OneGpuOffloadsTheOptimizerWhenTheHostHoldsIt) {
    ModelSpec m = load_model("gpt2-xl");
    ClusterSpec c;
    c.gpu = gpu_preset("h100-80gb");
    c.gpu.memory_bytes = 20e9;
    c.gpus = 1;
    SearchSpec s;
    s.global_batch = 8;
    s.seq = 1024;
    SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    for (const auto& p : r.plans) EXPECT_NE(p.run.offload, Offload::none) << describe(p.run);
    // Offloading the parameters too (ZeRO-3) moves them every micro-batch: slower.
    EXPECT_EQ(r.plans[0].run.offload, Offload::optimizer) << describe(r.plans[0].run);
    EXPECT_EQ(r.plans[0].run.zero, 0) << describe(r.plans[0].run);
    c.host_memory_bytes = 16e9;  // < 18 x 1.56B
    r = search_plans(m, c, s);
    EXPECT_TRUE(r.plans.empty());
    bool named = false;
    for (const auto& rej : r.rejected) {
        if (rej.family != "pure DP, ZeRO-0 + optimizer offload") continue;
        named = true;
        EXPECT_NE(rej.reason.find("host memory per node > 16.0 GB"), std::string::npos)
            << rej.reason;
    }
    EXPECT_TRUE(named);
    c.host_memory_bytes = 128e9;
    EXPECT_FALSE(search_plans(m, c, s).plans.empty());
}

TEST(PlanSearch, NothingFitsSaysWhy) {
    ClusterSpec c;
    c.gpu = gpu_preset("a100-40gb");
    c.gpus = 1;
    SearchSpec s;
    s.global_batch = 8;
    s.allow_offload = false;
    SearchResult r = search_plans(load_model("llama2-70b"), c, s);
    EXPECT_TRUE(r.plans.empty());
    ASSERT_FALSE(r.rejected.empty());
    EXPECT_NE(r.rejected[0].reason.find("> 40.0 GB"), std::string::npos) << r.rejected[0].reason;
}

TEST(PlanSearch, BadInput) {
    ClusterSpec c;
    c.gpus = 0;
    EXPECT_THROW(search_plans(load_model("gpt2"), c, {}), memtrain::Error);
    c.gpus = 12;  // not whole nodes of 8
    EXPECT_THROW(search_plans(load_model("gpt2"), c, {}), memtrain::Error);
    try {
        gpu_preset("h100");
        FAIL();
    } catch (const memtrain::Error& e) {
        EXPECT_NE(std::string(e.what()).find("did you mean"), std::string::npos);
    }
}

}  // namespace memtrain::plan

namespace memtrain::plan {

// Llama-2-7B fine-tuned in full on one 80 GB GPU without offload: fp32 Adam moments (16 B per
// parameter with the master copy) do not fit, int8 moments (about 10 B) do. The search says so,
// keeps training every weight, and the emitted config asks for optim.state_format = "int8".
TEST(PlanSearch, CompressedMomentsComeBeforeLora) {
    const ModelSpec m = load_model("llama2-7b");
    ClusterSpec c;
    c.gpu = gpu_preset("a100-80gb");
    c.gpus = 1;
    SearchSpec s;
    s.global_batch = 16;
    s.seq = 4096;
    s.allow_offload = false;
    s.lora_fallback = true;
    s.state_fallback = true;
    const SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_TRUE(r.moments_instead_of_plain);
    EXPECT_FALSE(r.lora_instead_of_full);
    EXPECT_EQ(r.plans[0].run.lora_rank, 0);
    EXPECT_EQ(r.plans[0].run.state_format, StateFormat::Int8);  // int8 before int4
    ASSERT_GE(r.methods.size(), 2u);
    EXPECT_EQ(r.methods[1].name, "full-parameter training, int8 moments");
    ASSERT_FALSE(r.rejected.empty());
    EXPECT_NE(r.rejected[0].reason.find("int8 moments fits"), std::string::npos)
        << r.rejected[0].reason;
    const std::string text = format_plans(r, 3, 4, c);
    EXPECT_NE(text.find("store Adam's moments in int8"), std::string::npos) << text;
    const std::string toml = emit_config_toml(m, r.plans[0]);
    EXPECT_NE(toml.find("state_format = 'int8'"), std::string::npos) << toml;
    const memtrain::RunConfig rc = memtrain::parse_run_config(toml, "emitted.toml", {});
    EXPECT_EQ(rc.optim.state_format, "int8");
    // The optimizer row prices two int8 moments and the fp32 master copy.
    EXPECT_NEAR(state_bytes(r.plans[0].run).optim, 4 + 2 * (1 + 4.0 / 256), 1e-12);
    EXPECT_FALSE(r.weights_instead_of_master);
    // On a 40 GB GPU neither int8 nor int4 beside the master fits (10 and 9 B per parameter):
    // bf16 weights without it do (6 B), written as optim.master = "none".
    ClusterSpec small = c;
    small.gpu = gpu_preset("a100-40gb");
    const SearchResult w = search_plans(m, small, s);
    ASSERT_FALSE(w.plans.empty());
    EXPECT_TRUE(w.weights_instead_of_master);
    EXPECT_EQ(w.plans[0].run.lora_rank, 0);
    EXPECT_FALSE(w.plans[0].run.fp32_master);
    EXPECT_EQ(w.methods.back().name.find("full-parameter training, bf16 weights"), 0u)
        << w.methods.back().name;
    const std::string wtext = format_plans(w, 3, 4, small);
    EXPECT_NE(wtext.find("optim.master = \"none\""), std::string::npos) << wtext;
    const memtrain::RunConfig wc =
        memtrain::parse_run_config(emit_config_toml(m, w.plans[0]), "emitted.toml", {});
    EXPECT_EQ(wc.optim.master, "none");
    EXPECT_NEAR(state_bytes(w.plans[0].run).optim,
                2 * moment_bytes_per_param(w.plans[0].run.state_format), 1e-12);
    // Without the fallback nothing full-parameter fits, and LoRA is next.
    s.state_fallback = false;
    const SearchResult lora = search_plans(m, c, s);
    ASSERT_FALSE(lora.plans.empty());
    EXPECT_TRUE(lora.lora_instead_of_full);
}

}  // namespace memtrain::plan
