// train.precision = "bf16" on the CPU engine (ModelConfig::cpu_bf16): the run tracks the fp32
// run's loss over 50 steps, holds exactly the bytes its plan predicts (bf16 saved fields and an
// fp32 working block in the activations, the GEMM operand scratch in the workspace), keeps every
// remat policy bitwise and resumes bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "test_util.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

RunConfig bf16_run(const std::string& name, int steps, const std::string& precision = "bf16") {
    RunConfig c = test::wide_tiny_run(name, steps);
    c.model.n_layer = 4;  // bf16 keeps half a block per block beside one fp32 working block
    c.train.precision = precision;
    c.train.eval_every = 10;
    return c;
}

}  // namespace

TEST(CpuBf16Train, TracksTheFp32RunOver50StepsInItsPredictedBytes) {
    const int steps = 50;
    const test::MeasuredRun fp32 = test::measured_run(bf16_run("cpubf16_fp32", steps, "fp32"));
    const test::MeasuredRun bf16 = test::measured_run(bf16_run("cpubf16_bf16", steps));
    // Stated tolerance: the final training loss and the last validation loss within 2% of fp32's.
    const double a = bf16.summary.losses.back(), b = fp32.summary.losses.back();
    EXPECT_NEAR(a, b, 0.02 * b);
    ASSERT_FALSE(bf16.summary.val_losses.empty());
    const double va = bf16.summary.val_losses.back().second;
    const double vb = fp32.summary.val_losses.back().second;
    EXPECT_NEAR(va, vb, 0.02 * vb);
    EXPECT_LT(a, bf16.summary.losses.front() - 0.5) << "it learned";
    // Not the fp32 run under another name: rounding the operands changes the bits.
    EXPECT_NE(bf16.summary.losses[1], fp32.summary.losses[1]);
    // Measured == predicted in every category; the operand scratch is the workspace's growth.
    for (int k = 0; k < kNumMemCategories; k++)
        EXPECT_EQ(bf16.peak[k], bf16.predicted[k]) << category_name(MemCategory(k));
    EXPECT_GT(test::category_bytes(bf16.peak, MemCategory::Workspace),
              test::category_bytes(fp32.peak, MemCategory::Workspace));
    // Saved fields in bf16 beside one fp32 working block: about (4 / 2 + 1) / 4 of fp32's.
    EXPECT_LT(test::category_bytes(bf16.peak, MemCategory::Activations),
              test::category_bytes(fp32.peak, MemCategory::Activations));
    EXPECT_EQ(test::category_bytes(bf16.peak, MemCategory::Parameters),
              test::category_bytes(fp32.peak, MemCategory::Parameters));
}

TEST(CpuBf16Train, RematIsBitwiseAndResumeIsBitwise) {
    // Every policy recomputes from the values the forward stored (each saved field is rounded
    // where it is made), so the weights are the same bits as without remat, in their bytes.
    const test::MeasuredRun a = test::measured_run(bf16_run("cpubf16_remat_none", 6));
    for (const char* policy : {"selective", "full", "memory-poor"}) {
        RunConfig c = bf16_run(std::string("cpubf16_remat_") + policy, 6);
        c.train.remat = policy;
        const test::MeasuredRun b = test::measured_run(c);
        EXPECT_EQ(a.summary.losses, b.summary.losses) << policy;
        EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)))
            << policy << " changed the bf16 run's weights";
        for (int k = 0; k < kNumMemCategories; k++)
            EXPECT_EQ(b.peak[k], b.predicted[k]) << policy << " " << category_name(MemCategory(k));
        EXPECT_LT(test::category_bytes(b.peak, MemCategory::Activations),
                  test::category_bytes(a.peak, MemCategory::Activations))
            << policy;
    }

    RunConfig whole = bf16_run("cpubf16_resume_whole", 8);
    Trainer w(whole, test::quiet());
    const TrainSummary sw = w.run();
    RunConfig split = bf16_run("cpubf16_resume_split", 8);
    TrainSummary sr;
    auto r = test::train_stop_and_resume(split, 4, sr);
    ASSERT_EQ(sr.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(sr.losses[i], sw.losses[4 + i]) << i;
    EXPECT_EQ(0, std::memcmp(w.model().params(), r->model().params(),
                             w.model().num_params() * sizeof(float)));
}

// A checkpoint holds fp32 weights and moments at either precision: a bf16 run resumes as fp32 and
// an fp32 run as bf16, each from the other's exact state, and tracks the uninterrupted run.
TEST(CpuBf16Train, CheckpointsMoveBetweenBf16AndFp32) {
    for (const auto& [first, second] :
         std::vector<std::pair<std::string, std::string>>{{"bf16", "fp32"}, {"fp32", "bf16"}}) {
        RunConfig c = bf16_run("cpubf16_switch_" + first, 12, first);
        TrainOptions o = test::quiet();
        o.stop_after = 6;
        Trainer a(c, o);
        a.run();
        const std::vector<float> saved = a.params();
        c.train.precision = second;
        o.stop_after = -1;
        o.resume = c.io.out_dir;
        Trainer b(c, o);
        EXPECT_EQ(b.params(), saved) << first << " -> " << second << ": the loaded weights";
        const TrainSummary sb = b.run();
        ASSERT_EQ(sb.losses.size(), 6u);
        const TrainSummary whole =
            Trainer(bf16_run("cpubf16_switch_ref_" + first, 12, first), test::quiet()).run();
        EXPECT_NEAR(sb.losses.back(), whole.losses.back(), 0.02 * whole.losses.back())
            << first << " -> " << second;
    }
}

// train.cpu_activations = "bf16" under fp32 precision: fp32 GEMMs, bf16 saved fields. Fewer
// activation bytes, as predicted, every remat policy bitwise, and the loss within 2% of fp32's.
TEST(CpuBf16Train, Bf16ActivationsUnderFp32Compute) {
    const test::MeasuredRun fp32 = test::measured_run(bf16_run("cpuact_fp32", 20, "fp32"));
    RunConfig c = bf16_run("cpuact_bf16", 20, "fp32");
    c.train.cpu_activations = "bf16";
    const test::MeasuredRun act = test::measured_run(c);
    for (int k = 0; k < kNumMemCategories; k++)
        EXPECT_EQ(act.peak[k], act.predicted[k]) << category_name(MemCategory(k));
    EXPECT_LT(test::category_bytes(act.peak, MemCategory::Activations),
              test::category_bytes(fp32.peak, MemCategory::Activations));
    EXPECT_EQ(test::category_bytes(act.peak, MemCategory::Workspace),
              test::category_bytes(fp32.peak, MemCategory::Workspace))
        << "no GEMM operand scratch: the GEMMs are fp32";
    EXPECT_NE(act.summary.losses[1], fp32.summary.losses[1]) << "the fields were not rounded";
    EXPECT_NEAR(act.summary.losses.back(), fp32.summary.losses.back(),
                0.02 * fp32.summary.losses.back());
    c = bf16_run("cpuact_bf16_full", 20, "fp32");
    c.train.cpu_activations = "bf16";
    c.train.remat = "full";
    const test::MeasuredRun full = test::measured_run(c);
    EXPECT_EQ(
        0, std::memcmp(act.params.data(), full.params.data(), act.params.size() * sizeof(float)));
    // And "fp32" keeps a bf16 run's saved fields in fp32.
    c = bf16_run("cpuact_fp32_under_bf16", 2);
    c.train.cpu_activations = "fp32";
    const test::MeasuredRun wide = test::measured_run(c);
    const test::MeasuredRun narrow = test::measured_run(bf16_run("cpuact_bf16_under_bf16", 2));
    EXPECT_GT(test::category_bytes(wide.peak, MemCategory::Activations),
              test::category_bytes(narrow.peak, MemCategory::Activations));
    // A bad value is refused by name.
    c.train.cpu_activations = "fp8";
    test::expect_refused_naming(validate_config, c, "train.cpu_activations", "fp8");
}

TEST(CpuBf16Train, Fp16IsRefusedOnTheCpuByName) {
    RunConfig c = bf16_run("cpubf16_fp16", 1, "fp16");
    try {
        validate_config(c);
        ADD_FAILURE() << "fp16 on the CPU was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.precision = \"fp16\" on the CPU"),
                  std::string::npos)
            << e.what();
    }
}
