// LoRA and QLoRA through the Trainer: the engine's predicted bytes equal the measured ones per
// category (and the adapters' states are a small fraction of full fine-tuning's), a LoRA run
// learns with the base unchanged, its checkpoint (PEFT files + optimizer) resumes bitwise, and
// bad [lora] values are refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "io/lora_files.h"
#include "io/model_source.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

RunConfig lora_run(const std::string& dir, int steps, const std::string& base = "fp32") {
    RunConfig c = test::tiny_run(dir, steps);
    c.model.n_embd = 32;  // int4/nf4 groups of 32 divide every block matrix's inputs
    c.lora.rank = 4;
    c.lora.alpha = 8;
    c.lora.targets = "all";
    c.lora.base = base;
    c.lora.base_group = 32;
    c.optim.lr = 1e-2;
    c.optim.weight_decay = 0;
    return c;
}

using test::quiet;

}  // namespace

TEST(LoraTrain, PredictedBytesEqualMeasuredForEveryCategory) {
    for (const char* base : {"fp32", "int8", "int4", "nf4"}) {
        const std::string dir = test::temp_dir(std::string("lora_mem_") + base);
        RunConfig c = lora_run(dir, 2, base);
        c.lora.dropout = 0.1;
        const MemoryStats before = host_memory().snapshot();
        Trainer t(c, quiet());
        t.run();
        const MemoryStats after = host_memory().snapshot();
        for (const MemoryPrediction& p :
             t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
            const int i = (int)p.category;
            EXPECT_EQ(after.used[i] - before.used[i], p.bytes)
                << base << ": " << category_name(p.category) << " (" << p.formula << ")";
        }
        auto& e = dynamic_cast<CpuEngine&>(t.engine());
        // Adapters only: gradients and Adam states of Ψa floats.
        EXPECT_EQ(
            after.used[(int)MemCategory::Gradients] - before.used[(int)MemCategory::Gradients],
            4 * e.lora_layout().params.total);
        if (std::string(base) != "fp32") {
            // The packed base (plus the small adapters) is under half the fp32 base.
            EXPECT_LT(t.engine().predicted_memory(2, 8)[0].bytes,
                      4 * t.engine().weights().layout.total / 2)
                << base;
        }
    }
}

TEST(LoraTrain, LearnsWithTheBaseFrozenAndResumesBitwise) {
    const std::string d1 = test::temp_dir("lora_full"), d2 = test::temp_dir("lora_split");
    // With dropout: the resumed run must draw the masks the uninterrupted one drew.
    // Rank-4 adapters learn little through a random base at GPT-2's init_std (its logits span a
    // fraction of a nat), and each step's batch is noisy: a wider base, 30 steps, and the mean
    // of the last five losses against the first five.
    constexpr int kSteps = 30, kStop = 5;
    RunConfig c = lora_run(d1, kSteps);
    c.model.init_std = 0.1;
    c.lora.dropout = 0.1;
    Trainer a(c, quiet());
    const std::vector<float> base_before = a.params();
    auto sa = a.run();
    const auto mean5 = [](auto first) {
        return (first[0] + first[1] + first[2] + first[3] + first[4]) / 5;
    };
    EXPECT_LT(mean5(sa.losses.end() - 5), mean5(sa.losses.begin()) - 0.1f);
    EXPECT_EQ(a.params(), base_before) << "the frozen base changed";
    EXPECT_TRUE(fs::exists(d1 + "/out/ckpt_000030/adapter_model.safetensors"));
    EXPECT_TRUE(fs::exists(d1 + "/out/ckpt_000030/adapter_config.json"));
    EXPECT_FALSE(fs::exists(d1 + "/out/ckpt_000030/model.safetensors"));

    TrainSummary resumed;
    RunConfig c2 = lora_run(d2, kSteps);
    c2.model.init_std = c.model.init_std;
    c2.lora.dropout = 0.1;
    auto b = test::train_stop_and_resume(c2, kStop, resumed);
    ASSERT_EQ(resumed.losses.size(), (std::size_t)(kSteps - kStop));
    for (int i = 0; i < kSteps - kStop; i++)
        EXPECT_EQ(resumed.losses[i], sa.losses[kStop + i]) << i;
    auto& ea = dynamic_cast<CpuEngine&>(a.engine());
    auto& eb = dynamic_cast<CpuEngine&>(b->engine());
    EXPECT_EQ(0, std::memcmp(ea.zero_store().full_params(), eb.zero_store().full_params(),
                             4 * ea.lora_layout().params.total));

    // eval/sample/merge read the checkpoint as base + merged adapters: its loss is the run's.
    const ModelSource src = open_model_source(d1 + "/out");
    ASSERT_TRUE(src.lora);
    GPT merged(src.model);
    load_source_weights(src, merged.weights());
    std::vector<int32_t> x = test::random_tokens(2 * 8, 50, 1), y = test::random_tokens(16, 50, 2);
    EXPECT_NEAR(merged.forward_loss(x.data(), y.data(), 2, 8),
                a.engine().forward_loss(x.data(), y.data(), 2, 8), 1e-5);
}

TEST(LoraTrain, Bf16AdaptersTrackFp32InTheirPredictedBytesAndResumeBitwise) {
    // optim.master = "none": the adapters in bf16, rounded stochastically; the base as ever.
    constexpr int kSteps = 30, kStop = 5;
    // The adapters' weights, unit by unit through the store (decoded when in bf16).
    auto adapters = [](Trainer& t) {
        auto& e = dynamic_cast<CpuEngine&>(t.engine());
        std::vector<float> w;
        for (int u = 0; u < (int)e.lora_layout().params.units.size(); u++) {
            const ParamUnit& unit = e.lora_layout().params.units[u];
            const float* p = e.zero_store().acquire(u);
            w.insert(w.end(), p, p + unit.size());
            e.zero_store().release(u);
        }
        return w;
    };
    std::vector<float> last;
    for (const char* master : {"fp32", "none"}) {
        RunConfig c = lora_run(test::temp_dir(std::string("lora_bf16_") + master), kSteps, "int8");
        c.model.init_std = 0.1;
        c.lora.dropout = 0.1;
        c.optim.master = master;
        // Peaks: bf16 adapters are decoded while in use (the plan's row is the peak).
        host_memory().reset_peak();
        const MemoryStats before = host_memory().snapshot();
        Trainer t(c, quiet());
        const TrainSummary s = t.run();
        const MemoryStats after = host_memory().snapshot();
        for (const MemoryPrediction& p :
             t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
            const int i = (int)p.category;
            EXPECT_EQ(after.peak_used[i] - before.used[i], p.bytes)
                << master << ": " << category_name(p.category) << " (" << p.formula << ")";
        }
        last.push_back(s.losses.back());
        if (std::string(master) == "fp32") continue;
        // Every adapter weight is a bf16 value; the losses track fp32 adapters' within 2%.
        const std::vector<float> w = adapters(t);
        ASSERT_FALSE(w.empty());
        for (float x : w) ASSERT_EQ(bf16_to_f32(f32_to_bf16(x)), x);
        EXPECT_NEAR(last[1], last[0], 0.02 * last[0]);
        TrainSummary resumed;
        RunConfig c2 = c;
        c2.io.out_dir += "_split";
        auto b = test::train_stop_and_resume(c2, kStop, resumed);
        ASSERT_EQ(resumed.losses.size(), (std::size_t)(kSteps - kStop));
        for (int i = 0; i < kSteps - kStop; i++)
            EXPECT_EQ(resumed.losses[i], s.losses[kStop + i]) << i;
        EXPECT_EQ(adapters(*b), w);
        // Inside the backward the adapters take the same draws: bitwise the two-phase run.
        RunConfig c3 = c;
        c3.io.out_dir += "_sib";
        c3.optim.step_in_backward = true;
        Trainer sib(c3, quiet());
        EXPECT_EQ(sib.run().losses, s.losses);
        EXPECT_EQ(adapters(sib), w);
    }
}

TEST(LoraTrain, QLoraTrainsOnTheDecodedBaseAndMergesIntoIt) {
    const std::string dir = test::temp_dir("qlora_nf4");
    RunConfig c = lora_run(dir, 8, "nf4");
    Trainer t(c, quiet());
    auto s = t.run();
    EXPECT_LT(s.losses.back(), s.losses.front());
    const ModelSource src = open_model_source(dir + "/out");
    GPT merged(src.model);
    load_source_weights(src, merged.weights());
    std::vector<int32_t> x = test::random_tokens(16, 50, 1), y = test::random_tokens(16, 50, 2);
    EXPECT_NEAR(merged.forward_loss(x.data(), y.data(), 2, 8),
                t.engine().forward_loss(x.data(), y.data(), 2, 8), 1e-5);
}

TEST(LoraTrain, BadLoraValuesAreRefusedByName) {
    const std::string dir = test::temp_dir("lora_bad");
    test::tiny_run(dir, 1);
    auto refused = [&](std::vector<std::string> sets, const std::string& word) {
        try {
            RunConfig c = load_run_config("", sets);
            ADD_FAILURE() << "accepted " << sets[0];
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
        }
    };
    refused({"lora.rank=-1"}, "lora.rank");
    refused({"lora.rank=4", "lora.dropout=1.5"}, "lora.dropout");
    refused({"lora.rank=4", "lora.base=fp8"}, "lora.base");
    refused({"lora.base=nf4"}, "lora.rank > 0");
    refused({"lora.rank=4", "lora.targets=q_proj"}, "matches no module");
    refused({"lora.rank=4", "train.pp=2"}, "pipeline");
}
