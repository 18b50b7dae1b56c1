// Optimizer, clipping and LR-schedule tests against hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

using namespace memtrain;

namespace {

ParamLayout two_tensors() {
    ParamLayout l;
    l.tensors.push_back({"w", {2}, 0, 2, true});
    l.tensors.push_back({"b", {1}, 2, 1, false});
    l.total = 3;
    return l;
}

}  // namespace

TEST(Optim, AdamWMatchesHandComputedSteps) {
    OptimConfig c;
    c.beta1 = 0.9;
    c.beta2 = 0.95;
    c.eps = 1e-8;
    c.weight_decay = 0.1;
    auto opt = make_optimizer(c, two_tensors());
    float p[3] = {1.0f, -2.0f, 0.5f};
    double ref[3] = {1.0, -2.0, 0.5}, m[3] = {}, v[3] = {};
    float g[3] = {0.3f, -0.1f, 2.0f};
    for (int t = 1; t <= 3; t++) {
        double lr = 0.01 * t;
        opt->step(p, g, lr);
        for (int i = 0; i < 3; i++) {
            double wd = i < 2 ? 0.1 : 0.0;
            m[i] = 0.9 * m[i] + 0.1 * g[i];
            v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
            double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.95, t));
            ref[i] = ref[i] * (1 - lr * wd) - lr * mh / (std::sqrt(vh) + 1e-8);
            EXPECT_NEAR(p[i], ref[i], 1e-6) << "step " << t << " param " << i;
        }
    }
    EXPECT_EQ(opt->steps_taken(), 3);
}

// An interleaved pipeline rank's optimizer: one part per range of the layout, each updating its
// floats with the bits one optimizer over the whole buffer gives them; checkpoints see the parts'
// states one after another.
TEST(Optim, RangeOptimizersAreTheWholeOptimizerOnTheirRanges) {
    ParamLayout l = two_tensors();
    l.tensors.push_back({"c", {2}, 3, 2, true});
    l.total = 5;
    OptimConfig c;
    c.weight_decay = 0.1;
    auto whole = make_optimizer(c, l);
    std::vector<std::unique_ptr<Optimizer>> parts;
    parts.push_back(make_optimizer(c, l, 0, 2));  // [0, 2): "w"
    parts.push_back(make_optimizer(c, l, 3, 2));  // [3, 5): "c"; "b" is another rank's
    RangeOptimizers ro(std::move(parts));
    EXPECT_EQ(ro.count(), 4u);
    EXPECT_EQ(ro.offset(), 0u);
    ASSERT_EQ(ro.ranges().size(), 2u);
    EXPECT_EQ(ro.ranges()[1].offset, 3u);
    EXPECT_EQ(ro.ranges()[1].count, 2u);
    EXPECT_EQ(ro.host_state("exp_avg"), nullptr);  // apart: read_state concatenates
    float p[5] = {1.0f, -2.0f, 0.5f, 0.25f, 3.0f}, q[5];
    std::copy(p, p + 5, q);
    const float g[5] = {0.3f, -0.1f, 2.0f, -0.7f, 0.05f};
    for (int t = 1; t <= 3; t++) {
        whole->step(p, g, 0.01 * t);
        ro.part(0).step(q, g, 0.01 * t);
        ro.part(1).step(q + 3, g + 3, 0.01 * t);
    }
    for (int i : {0, 1, 3, 4}) EXPECT_EQ(q[i], p[i]) << i;
    EXPECT_EQ(ro.steps_taken(), 3);
    std::vector<float> m(4);
    ro.read_state("exp_avg", m.data());
    const float* wm = whole->host_state("exp_avg");
    EXPECT_EQ(m, (std::vector<float>{wm[0], wm[1], wm[3], wm[4]}));
    // A write across the parts' boundary lands in both.
    const float src[2] = {7.0f, 8.0f};
    ro.write_state("exp_avg_sq", 1, 2, src);
    EXPECT_EQ(ro.part(0).host_state("exp_avg_sq")[1], 7.0f);
    EXPECT_EQ(ro.part(1).host_state("exp_avg_sq")[0], 8.0f);
    ro.set_steps_taken(9);
    EXPECT_EQ(ro.part(1).steps_taken(), 9);
    std::vector<std::unique_ptr<Optimizer>> overlapping;
    overlapping.push_back(make_optimizer(c, l, 0, 3));
    overlapping.push_back(make_optimizer(c, l, 2, 3));
    EXPECT_THROW(RangeOptimizers(std::move(overlapping)), Error);
}

TEST(Optim, SgdMomentumMatchesTorchSemantics) {
    OptimConfig c;
    c.name = "sgd";
    c.momentum = 0.9;
    c.weight_decay = 0.0;
    auto opt = make_optimizer(c, two_tensors());
    float p[3] = {1, 1, 1}, g[3] = {1, 2, 3};
    opt->step(p, g, 0.1);  // buf = g
    EXPECT_NEAR(p[1], 1 - 0.1 * 2, 1e-7);
    opt->step(p, g, 0.1);  // buf = 0.9 g + g
    EXPECT_NEAR(p[1], 1 - 0.1 * 2 - 0.1 * 1.9 * 2, 1e-6);
}

TEST(Optim, ClipGradNorm) {
    float g[4] = {3, 4, 0, 0};
    EXPECT_NEAR(clip_grad_norm(g, 4, 1.0), 5.0, 1e-9);
    EXPECT_NEAR(g[0], 3.0 / (5.0 + 1e-6), 1e-6);
    EXPECT_NEAR(g[1], 4.0 / (5.0 + 1e-6), 1e-6);
    float h[2] = {0.3f, 0.4f};
    clip_grad_norm(h, 2, 1.0);  // below the bound: untouched
    EXPECT_EQ(h[0], 0.3f);
}

TEST(Schedule, WarmupCosine) {
    OptimConfig c;
    c.schedule = "cosine";
    c.warmup_steps = 2;
    c.min_lr_ratio = 0.1;
    EXPECT_NEAR(lr_at(c, 1.0, 0, 5), 0.5, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 1, 5), 1.0, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 2, 5), 1.0, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 3, 5), 0.1 + 0.45 * (1 + std::cos(M_PI / 3)), 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 5, 5), 0.1, 1e-12);
}

// Hugging Face's "linear": warmup, then a straight line from the peak to the floor at the end.
TEST(Schedule, WarmupLinear) {
    OptimConfig c;
    c.schedule = "linear";
    c.warmup_steps = 2;
    c.min_lr_ratio = 0.0;
    c.validate();
    EXPECT_NEAR(lr_at(c, 1.0, 0, 6), 0.5, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 2, 6), 1.0, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 3, 6), 0.75, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 4, 6), 0.5, 1e-12);
    EXPECT_NEAR(lr_at(c, 1.0, 6, 6), 0.0, 1e-12);
    c.min_lr_ratio = 0.1;
    EXPECT_NEAR(lr_at(c, 2.0, 4, 6), 0.2 + 1.8 * 0.5, 1e-12);
    c.schedule = "linearr";
    EXPECT_THROW(c.validate(), Error);
}

TEST(Schedule, ConstantAndWsd) {
    OptimConfig c;
    c.schedule = "constant";
    c.warmup_steps = 0;
    EXPECT_EQ(lr_at(c, 2.0, 50, 100), 2.0);
    c.schedule = "wsd";
    c.decay_fraction = 0.2;
    c.min_lr_ratio = 0.0;
    EXPECT_EQ(lr_at(c, 1.0, 79, 100), 1.0);
    EXPECT_NEAR(lr_at(c, 1.0, 89, 100), 0.5, 1e-12);  // linear: half-way through the cooldown
    EXPECT_NEAR(lr_at(c, 1.0, 99, 100), 0.0, 1e-12);
    c.cooldown = "1-sqrt";
    EXPECT_NEAR(lr_at(c, 1.0, 89, 100), 1 - std::sqrt(0.5), 1e-12);
}

TEST(Schedule, BatchSizeScalingRules) {
    OptimConfig c;
    c.lr = 1e-3;
    EXPECT_EQ(scaled_peak_lr(c, 4096), 1e-3);
    c.lr_scaling = "linear";
    c.lr_reference_batch = 1024;
    EXPECT_NEAR(scaled_peak_lr(c, 4096), 4e-3, 1e-15);
    c.lr_scaling = "sqrt";
    EXPECT_NEAR(scaled_peak_lr(c, 4096), 2e-3, 1e-15);
    c.lr_reference_batch = 0;
    EXPECT_THROW(c.validate(), Error);
}

// ---- dynamic loss scaling (fp16) -------------------------------------------------------------

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterTheWindow) {
    LossScaler s(1024, 3);
    EXPECT_EQ(s.scale(), 1024);
    s.update(true, 1);  // overflow: halve, count restarts
    EXPECT_EQ(s.scale(), 512);
    EXPECT_EQ(s.overflows(), 1);
    s.update(false, 2);
    s.update(false, 3);
    EXPECT_EQ(s.scale(), 512);
    EXPECT_EQ(s.clean_steps(), 2);
    s.update(false, 4);  // the third clean step in a row doubles
    EXPECT_EQ(s.scale(), 1024);
    EXPECT_EQ(s.clean_steps(), 0);
    s.update(false, 5);
    s.update(true, 6);  // an overflow resets the clean count
    EXPECT_EQ(s.scale(), 512);
    s.update(false, 7);
    s.update(false, 8);
    EXPECT_EQ(s.scale(), 512);
}

TEST(LossScaler, StaysWithinItsRange) {
    LossScaler s(LossScaler::kMaxScale, 1);
    s.update(false, 1);
    EXPECT_EQ(s.scale(), LossScaler::kMaxScale);
    LossScaler t(2, 5);
    t.update(true, 1);
    EXPECT_EQ(t.scale(), LossScaler::kMinScale);
}

TEST(LossScaler, OverflowAtTheMinimumScaleIsAnErrorThatNamesTheRemedy) {
    LossScaler s(1, 10);
    try {
        s.update(true, 42);
        FAIL() << "no error";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("step 42"), std::string::npos) << m;
        EXPECT_NE(m.find("bf16"), std::string::npos) << m;
    }
    EXPECT_THROW(LossScaler(0.5, 10), Error);
    EXPECT_THROW(LossScaler(1024, 0), Error);
}

TEST(LossScaler, RestoresFromACheckpoint) {
    LossScaler s(65536, 4);
    s.restore(256, 3);
    EXPECT_EQ(s.scale(), 256);
    s.update(false, 1);
    EXPECT_EQ(s.scale(), 512);
    EXPECT_THROW(s.restore(0, 0), Error);
}
