// The divergence guard: its judgement on known sequences, and whole runs with a corrupted batch,
// a step at 1000x the learning rate, a divergence that does not go away, and a non-finite weight.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "io/run_report.h"
#include "io/text_file.h"
#include "test_util.h"
#include "train/guard.h"
#include "train/trainer.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;

GuardConfig guard_config() {
    GuardConfig g;
    g.window = 20;
    g.min_history = 10;
    g.spike_z = 6;
    g.norm_factor = 10;
    return g;
}

// A guard that has seen `n` clean steps of loss 3 +- 0.05 and gradient norm 1 +- 0.1.
DivergenceGuard guard_with_history(int n) {
    DivergenceGuard g(guard_config());
    for (int i = 1; i <= n; i++) g.accept(i, 3.0 + 0.05 * std::sin(i), 1.0 + 0.1 * std::cos(i));
    return g;
}

// Under the guard, a tiny run to disturb at step 80: snapshots every 10 steps.
RunConfig guarded_run(const std::string& name, int steps = 100) {
    RunConfig c = test::tiny_run(test::temp_dir(name), steps);
    c.optim.lr = 1e-2;        // (the model is confident by step 80: bad targets cost it much)
    c.train.batch_size = 16;  // (and the loss of a step is not too noisy)
    c.train.micro_batch_size = 8;
    c.guard.window = 20;
    c.guard.min_history = 10;
    c.guard.snapshot_every = 10;
    c.train.eval_every = 0;
    c.train.eval_batches = 4;
    return c;
}

float final_val_loss(const TrainSummary& s) {
    EXPECT_FALSE(s.val_losses.empty());
    return s.val_losses.empty() ? NAN : s.val_losses.back().second;
}

}  // namespace

TEST(GuardJudge, NonFiniteIsAlwaysAnAnomaly) {
    DivergenceGuard g(guard_config());  // no history yet
    EXPECT_NE(g.judge(NAN, 1.0).find("not both finite"), std::string::npos);
    EXPECT_NE(g.judge(3.0, INFINITY).find("not both finite"), std::string::npos);
    EXPECT_EQ(g.judge(30.0, 1000.0), "") << "spikes are judged only after guard.min_history";
}

TEST(GuardJudge, SpikesAndExplosionsAgainstTheWindow) {
    DivergenceGuard g = guard_with_history(20);
    EXPECT_EQ(g.judge(3.06, 1.1), "") << "ordinary noise";
    EXPECT_EQ(g.judge(2.0, 0.5), "") << "a drop is no anomaly";
    // The window's losses spread +-0.05 (MAD-scale about 0.05, below the 1% floor of 0.03 x 1.4826
    // ...): 3 + 6 x spread is about 3.3; 4 is far beyond it.
    const std::string spike = g.judge(4.0, 1.0);
    EXPECT_NE(spike.find("robust deviations above the median"), std::string::npos) << spike;
    const std::string boom = g.judge(3.0, 12.0);
    EXPECT_NE(boom.find("x the median"), std::string::npos) << boom;
    EXPECT_EQ(g.judge(3.0, 9.0), "") << "9x the median norm is below guard.norm_factor = 10";
}

TEST(GuardJudge, RepeatsLowerTheLearningRateAndTheGuardGivesUp) {
    GuardConfig c = guard_config();
    c.max_rollbacks = 3;
    c.cooldown = 30;
    c.lr_factor = 0.5;
    DivergenceGuard g(c);
    for (int i = 1; i <= 40; i++) g.accept(i, 3.0, 1.0);
    auto a = g.on_anomaly(41, 30, "x");
    EXPECT_FALSE(a.lower_lr) << "the first anomaly skips its batch only";
    EXPECT_EQ(g.lr_scale(41), 1.0);
    a = g.on_anomaly(45, 30, "x");
    EXPECT_TRUE(a.lower_lr) << "a second within guard.window steps";
    EXPECT_EQ(a.lr_scale, 0.5);
    EXPECT_EQ(a.lr_until, 75);
    EXPECT_EQ(g.lr_scale(75), 0.5);
    EXPECT_EQ(g.lr_scale(76), 1.0);
    a = g.on_anomaly(50, 30, "x");
    EXPECT_EQ(a.lr_scale, 0.25) << "a repeat inside the cool-down compounds";
    EXPECT_THROW(g.on_anomaly(51, 30, "the loss is 1e9"), Error);
    try {
        g.on_anomaly(51, 30, "the loss is 1e9");
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("training diverged at step 51: the loss is 1e9"), std::string::npos) << m;
        EXPECT_NE(m.find("guard.max_rollbacks = 3"), std::string::npos) << m;
    }
}

TEST(GuardJudge, ARollbackForgetsTheStepsItUndoes) {
    DivergenceGuard g(guard_config());
    for (int i = 1; i <= 10; i++) g.accept(i, 3.0, 1.0);
    for (int i = 11; i <= 20; i++) g.accept(i, 9.0, 1.0);  // (drifted up, then rolled back)
    g.on_anomaly(21, 10, "x");
    // Only steps 1..10 remain: fewer than... exactly min_history, all at 3.
    EXPECT_NE(g.judge(5.0, 1.0), "") << "the window holds steps up to 10 only";
}

// The undisturbed run has no anomaly (no false alarm); a batch of scrambled targets at step 80 is
// skipped (one rollback to the snapshot before it, no lower learning rate), and the run ends
// within 1% of the undisturbed run's validation loss.
TEST(Guard, ACorruptedBatchIsSkipped) {
    RunConfig base = guarded_run("guard_clean");
    const TrainSummary clean = Trainer(base, test::quiet()).run();
    EXPECT_TRUE(clean.guard_actions.empty()) << clean.guard_actions[0].reason;

    RunConfig c = guarded_run("guard_corrupt");
    TrainOptions o = test::quiet();
    bool corrupted = false;
    o.on_batch = [&](int64_t step, int32_t*, int32_t* targets, std::size_t n) {
        if (step != 80 || corrupted) return;  // the bad data is read once: the guard skips it
        corrupted = true;
        for (std::size_t i = 0; i < n; i++) targets[i] = (int32_t)((i * 37 + 11) % 50);
    };
    const TrainSummary s = Trainer(c, o).run();
    ASSERT_EQ(s.guard_actions.size(), 1u);
    EXPECT_EQ(s.guard_actions[0].step, 80);
    EXPECT_EQ(s.guard_actions[0].to_step, 70) << "the newest snapshot two steps before";
    EXPECT_FALSE(s.guard_actions[0].lower_lr);
    EXPECT_NE(s.guard_actions[0].reason.find("robust deviations"), std::string::npos)
        << s.guard_actions[0].reason;
    EXPECT_EQ(s.losses.size(), 100u) << "one loss per step of the run as it stands";
    EXPECT_NEAR(final_val_loss(s), final_val_loss(clean), 0.01 * final_val_loss(clean));
    EXPECT_FALSE(fs::exists(c.io.out_dir + "/guard_snapshots")) << "scratch, removed at the end";

    // The metrics log holds the event, and the report draws it on the loss chart.
    const io::RunMetrics m =
        io::parse_metrics(io::read_text_file(c.io.out_dir + "/metrics.jsonl"), "metrics.jsonl");
    ASSERT_EQ(m.guard.size(), 1u);
    EXPECT_EQ(m.guard[0].step, 80);
    EXPECT_EQ(m.guard[0].action, "skip");
    EXPECT_EQ(m.steps.size(), 100u) << "the replayed steps' first lines are dropped";
}

// One step at 1000x the learning rate wrecks the weights; the next step's loss shows it, and the
// guard goes back to the snapshot from before it: the run ends as the undisturbed one does.
TEST(Guard, OneStepAt1000xTheLearningRateIsRolledBack) {
    RunConfig base = guarded_run("guard_lr_clean");
    const TrainSummary clean = Trainer(base, test::quiet()).run();
    RunConfig c = guarded_run("guard_lr");
    TrainOptions o = test::quiet();
    bool done = false;
    o.on_lr = [&](int64_t step, double lr) {
        if (step != 80 || done) return lr;
        done = true;
        return lr * 1000;
    };
    const TrainSummary s = Trainer(c, o).run();
    ASSERT_GE(s.guard_actions.size(), 1u);
    EXPECT_EQ(s.guard_actions[0].step, 81) << s.guard_actions[0].reason;
    EXPECT_EQ(s.guard_actions[0].to_step, 70) << "before the step at 1000x (step 80)";
    EXPECT_NEAR(final_val_loss(s), final_val_loss(clean), 0.01 * final_val_loss(clean));
}

// A divergence that comes back on every replay: the guard lowers the learning rate on the
// repeat, then gives up after guard.max_rollbacks, naming the step and the limit.
TEST(Guard, APersistentDivergenceEndsTheRunAfterMaxRollbacks) {
    RunConfig c = guarded_run("guard_gives_up");
    c.guard.max_rollbacks = 2;
    c.io.checkpoint_every = 10;
    TrainOptions o = test::quiet();
    o.quiet = getenv("GUARD_LOUD") == nullptr;
    o.on_lr = [](int64_t step, double lr) { return step == 80 ? lr * 1e6 : lr; };
    Trainer t(c, o);
    const std::string e = test::error_of([&] { t.run(); });
    if (!o.quiet) std::fprintf(stderr, "%s\n", e.c_str());
    EXPECT_NE(e.find("training diverged at step 81"), std::string::npos) << e;
    EXPECT_NE(e.find("guard.max_rollbacks = 2"), std::string::npos) << e;
    EXPECT_TRUE(fs::exists(c.io.out_dir + "/ckpt_000080")) << "the run's own checkpoints stay";
    const std::string log = io::read_text_file(c.io.out_dir + "/metrics.jsonl");
    EXPECT_NE(log.find("\"action\": \"rollback\""), std::string::npos) << log;
}

// A weight set to NaN before step 3 (as in the hardening test without the guard): the guard goes
// back to the snapshot at step 0 (no snapshot is older than step 1) and the run completes.
TEST(Guard, ANonFiniteStepGoesBackToTheStartSnapshot) {
    RunConfig c = test::tiny_run(test::temp_dir("guard_nan"), 6);
    c.train.eval_every = 0;
    TrainOptions o = test::quiet();
    bool done = false;
    o.before_step = [&](int64_t step, Engine& engine) {
        if (step != 3 || done) return;
        done = true;
        auto w = engine.weights();
        float* p = const_cast<float*>(w.store.acquire(0));
        p[0] = std::numeric_limits<float>::quiet_NaN();
        w.store.release(0);
    };
    const TrainSummary s = Trainer(c, o).run();
    ASSERT_EQ(s.guard_actions.size(), 1u);
    EXPECT_EQ(s.guard_actions[0].step, 3);
    EXPECT_EQ(s.guard_actions[0].to_step, 0);
    EXPECT_NE(s.guard_actions[0].reason.find("not both finite"), std::string::npos);
    EXPECT_EQ(s.steps_done, 6);
    for (float l : s.losses) EXPECT_TRUE(std::isfinite(l));
}

}  // namespace memtrain
