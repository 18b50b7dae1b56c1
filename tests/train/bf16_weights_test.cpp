// optim.master = "none": bf16 weights without an fp32 master copy, updated by seeded stochastic
// rounding. The rounding is unbiased over many draws and reproducible from its seed; a run tracks
// the fp32 one, holds the bytes its plan predicts (half the fp32 parameters, plus the decoded
// units), repeats itself bitwise, resumes bitwise, and composes with the step in the backward and
// int8 moments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "model/param_layout.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"
#include "parallel/data/zero_store.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

// The bf16 neighbours of x: the one toward zero (truncation) and the next away from zero.
std::pair<float, float> neighbours(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint16_t lo = (uint16_t)(u >> 16);
    return {bf16_to_f32(lo), bf16_to_f32((uint16_t)(lo + 1))};
}

}  // namespace

TEST(StochasticRounding, IsUnbiasedOverManyDraws) {
    const int n = 200000;
    for (float x : {1.0f + 1.0f / 1024, -3.14159f, 0.1f, 1e-30f, -7.7e20f, 123.456f}) {
        const auto [a, b] = neighbours(x);
        double sum = 0;
        for (int i = 0; i < n; i++) {
            const float r = bf16_to_f32(f32_to_bf16_stochastic(x, 42, 7, (uint64_t)i));
            ASSERT_TRUE(r == a || r == b) << x << " rounded to " << r;
            sum += r;
        }
        // The mean of n Bernoulli draws between a and b: within 5 standard deviations of x.
        const double gap = std::fabs((double)b - (double)a);
        EXPECT_NEAR(sum / n, (double)x, 5 * gap / (2 * std::sqrt((double)n))) << x;
    }
    // bf16 values stay exactly themselves; not-finite values keep their class; the largest
    // finite value never rounds to infinity.
    for (uint64_t i = 0; i < 1000; i++) {
        EXPECT_EQ(f32_to_bf16_stochastic(1.5f, 1, 1, i), f32_to_bf16(1.5f));
        EXPECT_TRUE(std::isinf(
            bf16_to_f32(f32_to_bf16_stochastic(std::numeric_limits<float>::infinity(), 1, 1, i))));
        EXPECT_TRUE(std::isnan(
            bf16_to_f32(f32_to_bf16_stochastic(std::numeric_limits<float>::quiet_NaN(), 1, 1, i))));
        EXPECT_TRUE(std::isfinite(
            bf16_to_f32(f32_to_bf16_stochastic(std::numeric_limits<float>::max(), 1, 1, i))));
    }
}

TEST(StochasticRounding, IsReproducibleFromItsSeed) {
    const float x = 0.3f;
    std::vector<uint16_t> a, b, other_seed, other_step;
    for (uint64_t i = 0; i < 4096; i++) {
        a.push_back(f32_to_bf16_stochastic(x, 9, 3, i));
        b.push_back(f32_to_bf16_stochastic(x, 9, 3, i));
        other_seed.push_back(f32_to_bf16_stochastic(x, 10, 3, i));
        other_step.push_back(f32_to_bf16_stochastic(x, 9, 4, i));
    }
    EXPECT_EQ(a, b);
    EXPECT_NE(a, other_seed);
    EXPECT_NE(a, other_step);
}

namespace {

constexpr int kParams = static_cast<int>(MemCategory::Parameters);

// c with fp32 weights, then with optim.master = "none" (in out_dir + "_none"): the bf16 run holds
// its predicted parameter bytes, under 3/4 of fp32's, and every weight is a bf16 value.
std::pair<test::MeasuredRun, test::MeasuredRun> fp32_and_bf16_weights(RunConfig& c) {
    test::MeasuredRun fp32 = test::measured_run(c);
    c.optim.master = "none";
    c.io.out_dir += "_none";
    test::MeasuredRun none = test::measured_run(c);
    EXPECT_EQ(none.peak[kParams], none.predicted[kParams]);
    EXPECT_LT(none.peak[kParams], fp32.peak[kParams] * 3 / 4);
    for (float w : none.params) EXPECT_EQ(bf16_to_f32(f32_to_bf16(w)), w);
    return {std::move(fp32), std::move(none)};
}

}  // namespace

TEST(Bf16Weights, TrackFp32InTheirPredictedBytesAndRepeatBitwise) {
    const int steps = 40;
    RunConfig c = test::wide_tiny_run("bfw_fp32", steps);
    c.model.n_layer = 8;  // so the decoded units and the scratch are a small share
    const auto [fp32, none] = fp32_and_bf16_weights(c);
    // Stated tolerance: the final training and validation losses within 2% of fp32's.
    ASSERT_EQ(none.summary.losses.size(), fp32.summary.losses.size());
    EXPECT_NEAR(none.summary.losses.back(), fp32.summary.losses.back(),
                0.02 * fp32.summary.losses.back());
    EXPECT_NEAR(none.summary.val_losses.back().second, fp32.summary.val_losses.back().second,
                0.02 * fp32.summary.val_losses.back().second);
    EXPECT_LT(none.summary.losses.back(), none.summary.losses.front() - 0.5);
    // The same seed, the same run.
    c.io.out_dir += "_again";
    const test::MeasuredRun again = test::measured_run(c);
    EXPECT_EQ(again.summary.losses, none.summary.losses);
    EXPECT_EQ(0, std::memcmp(again.params.data(), none.params.data(),
                             none.params.size() * sizeof(float)));
}

TEST(Bf16Weights, ComposeWithTheStepInBackwardAndInt8Moments) {
    RunConfig c = test::wide_tiny_run("bfw_sib", 6);
    c.optim.master = "none";
    c.optim.state_format = "int8";
    c.train.micro_batch_size = 4;
    const test::MeasuredRun two = test::measured_run(c);
    c.optim.step_in_backward = true;
    c.io.out_dir += "_sib";
    const test::MeasuredRun sib = test::measured_run(c);
    // The update inside the backward rounds each element with the same draw: bitwise the same.
    EXPECT_EQ(two.summary.losses, sib.summary.losses);
    EXPECT_EQ(0, std::memcmp(two.params.data(), sib.params.data(), two.params.size() * 4));
    EXPECT_EQ(sib.peak[kParams], sib.predicted[kParams]);
}

// A remat plan that rebuilds block inputs re-runs blocks below the one in its backward: the
// rebuild runs before that block's unit is acquired, so one block's weights are decoded at a
// time, as the parameters' row predicts, and the run is bitwise the one that keeps everything.
TEST(Bf16Weights, RebuiltBlockInputsDecodeOneBlockAtATime) {
    RunConfig c = test::wide_tiny_run("bfw_rebuild", 3);
    c.model.n_layer = 6;
    c.optim.master = "none";
    const test::MeasuredRun keep = test::measured_run(c);
    for (const char* remat : {"memory-poor", "chen:2", "revolve:1"}) {
        RunConfig r = c;
        r.train.remat = remat;
        r.io.out_dir += std::string("_") + remat;
        const test::MeasuredRun run = test::measured_run(r);
        EXPECT_EQ(run.peak[kParams], run.predicted[kParams]) << remat;
        EXPECT_EQ(run.peak[kParams], keep.peak[kParams]) << remat;
        EXPECT_EQ(run.summary.losses, keep.summary.losses) << remat;
        EXPECT_EQ(0, std::memcmp(run.params.data(), keep.params.data(), keep.params.size() * 4))
            << remat;
    }
}

TEST(Bf16Weights, ResumeIsBitwise) {
    RunConfig c = test::wide_tiny_run("bfw_resume_whole", 8);
    c.optim.master = "none";
    Trainer a(c, test::quiet());
    const TrainSummary sa = a.run();
    RunConfig s = test::wide_tiny_run("bfw_resume_split", 8);
    s.optim.master = "none";
    TrainSummary sb;
    auto b = test::train_stop_and_resume(s, 4, sb);
    ASSERT_EQ(sb.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(sb.losses[i], sa.losses[4 + i]) << i;
    EXPECT_EQ(a.params(), b->params());
}

TEST(Bf16Weights, StepMuonAndAdafactorTensorsWholeInTheirPredictedBytes) {
    // Muon's matrices and Adafactor's tensors are decoded and updated whole (their update reads
    // the whole tensor), the rest a chunk at a time; the scratch grows to the largest of them.
    for (const std::string name : {"muon", "adafactor"}) {
        SCOPED_TRACE(name);
        RunConfig c = test::wide_tiny_run("bfw_whole_" + name, 12);
        c.model.n_layer = 8;
        c.optim.name = name;
        if (name == "adafactor") c.optim.lr = 0.05;  // a relative step of the weights' RMS
        // What makes this test bite: a tensor stepped whole crosses a multiple of the chunk, so
        // a chunked update would hand the optimizer part of it (which it refuses).
        const ParamLayout layout = make_param_layout(c.model);
        const std::vector<char> whole = whole_step_tensors(c.optim, layout);
        bool crosses = false;
        for (std::size_t i = 0; i < whole.size(); i++) {
            const ParamSpec& t = layout.tensors[i];
            const std::size_t k = dist::ZeroStore::kRoundChunk;
            crosses |= whole[i] && t.offset / k != (t.offset + t.numel - 1) / k;
        }
        ASSERT_TRUE(crosses);
        const auto [fp32, none] = fp32_and_bf16_weights(c);
        // Stated tolerance: the final training loss within 3% of the fp32 master's.
        EXPECT_NEAR(none.summary.losses.back(), fp32.summary.losses.back(),
                    0.03 * fp32.summary.losses.back());
        EXPECT_LT(none.summary.losses.back(), none.summary.losses.front() - 0.3);
        // Inside the backward each whole tensor takes the same draws: bitwise the same run.
        c.optim.step_in_backward = true;
        c.io.out_dir += "_sib";
        const test::MeasuredRun sib = test::measured_run(c);
        EXPECT_EQ(sib.summary.losses, none.summary.losses);
        EXPECT_EQ(0, std::memcmp(sib.params.data(), none.params.data(), none.params.size() * 4));
        EXPECT_EQ(sib.peak[kParams], sib.predicted[kParams]);
    }
}

TEST(Bf16Weights, RefusesTheLayoutsItDoesNotRunWithByName) {
    RunConfig base = test::tiny_run_config("/nonexistent/bfw", 2);
    base.optim.master = "none";
    auto refused = [&](auto edit, const std::string& key) {
        RunConfig c = base;
        edit(c);
        test::expect_refused_naming(validate_optimizer_layout, c, "optim.master", key);
    };
    // On the GPU the bf16 parameters are the weights (tests/cuda/train_test.cpp): bf16 only.
    refused(
        [](RunConfig& c) {
            c.train.device = "cuda";
            c.train.precision = "fp32";
        },
        "train.device = \"cuda\" and train.precision = \"fp32\"");
    RunConfig gpu = base;
    gpu.train.device = "cuda";
    gpu.train.precision = "bf16";
    gpu.train.zero_stage = 3;
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    // ZeRO-3 shards the bf16 weights (tests/mpi/step_in_backward_dist_test.cpp); pipelines do not
    // take them on the CPU engine.
    RunConfig z3 = base;
    z3.train.zero_stage = 3;
    EXPECT_NO_THROW(validate_optimizer_layout(z3));
    refused(
        [](RunConfig& c) {
            c.world = 2;
            c.train.pp = 2;
        },
        "train.pp = 2");
    // Muon and Adafactor under ZeRO: the shards gather the tensors they cut
    // (StepInBackwardDist.Bf16WeightsUnderZeroAreDdpsBitwise).
    for (const char* name : {"muon", "adafactor"}) {
        RunConfig z = base;
        z.world = 2;
        z.train.zero_stage = 1;
        z.optim.name = name;
        EXPECT_NO_THROW(validate_optimizer_layout(z)) << name;
    }
    // Tensor parallelism alone takes them (tests/mpi/tp_test.cpp); the CPU's tp x dp mesh and
    // the GPU's tp shards do not.
    RunConfig tp = base;
    tp.world = 2;
    tp.train.tp = 2;
    EXPECT_NO_THROW(validate_optimizer_layout(tp));
    refused(
        [](RunConfig& c) {
            c.world = 4;
            c.train.tp = 2;
        },
        "train.tp = 2 with 2 data-parallel groups");
    refused(
        [](RunConfig& c) {
            c.world = 2;
            c.train.tp = 2;
            c.train.device = "cuda";
            c.train.precision = "bf16";
        },
        "train.tp = 2 and train.device = \"cuda\"");
    RunConfig bad = base;
    bad.optim.master = "bf16";
    EXPECT_THROW(bad.optim.validate(), Error);
}
