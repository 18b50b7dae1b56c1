// The divergence guard under mpirun (2 and 4 ranks, ZeRO-2): a corrupted batch and a step at
// 1000x the learning rate are undone on every rank at the same step, and the run ends within 1%
// of the undisturbed one's validation loss.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpi/dist_runs.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

RunConfig guard_dist_run(const std::string& name) {
    RunConfig c = shared_tiny_run_config(name, 100);
    c.optim.lr = 1e-2;
    c.train.batch_size = 16;
    c.train.micro_batch_size = 4;
    c.train.zero_stage = 2;
    c.train.eval_every = 0;
    c.train.eval_batches = 2;
    c.guard.window = 20;
    c.guard.min_history = 10;
    c.guard.snapshot_every = 10;
    return c;
}

// Every rank's actions, as (step, to_step) pairs: the same list on every rank.
void expect_same_actions_on_every_rank(const TrainSummary& s) {
    std::vector<int64_t> mine;
    for (const auto& a : s.guard_actions) {
        mine.push_back(a.step);
        mine.push_back(a.to_step);
    }
    int64_t n = (int64_t)mine.size(), most = n;
    comm().all_reduce_max(&most, 1);
    EXPECT_EQ(n, most) << "a rank took fewer guard actions than another";
    mine.resize((std::size_t)most, -1);
    std::vector<int64_t> all(mine.size() * (std::size_t)comm().size());
    if (!mine.empty()) comm().all_gather_bytes(mine.data(), all.data(), mine.size() * 8);
    for (int r = 0; r < comm().size(); r++)
        for (std::size_t i = 0; i < mine.size(); i++)
            EXPECT_EQ(all[(std::size_t)r * mine.size() + i], mine[i]) << "rank " << r;
}

}  // namespace

TEST(GuardDist, CorruptedBatchAndLearningRateSpikeAreUndoneOnEveryRank) {
    const TrainSummary clean =
        Trainer(guard_dist_run("guard_dist_clean"), test::quiet(), &comm()).run();
    EXPECT_TRUE(clean.guard_actions.empty());
    const float want = clean.val_losses.back().second;

    TrainOptions o = test::quiet();
    bool corrupted = false, boosted = false;
    o.on_batch = [&](int64_t step, int32_t*, int32_t* targets, std::size_t n) {
        if (step != 60 || corrupted) return;
        corrupted = true;
        for (std::size_t i = 0; i < n; i++) targets[i] = (int32_t)((i * 37 + 11) % 50);
    };
    o.on_lr = [&](int64_t step, double lr) {
        if (step != 80 || boosted) return lr;
        boosted = true;
        return lr * 1000;
    };
    const TrainSummary s = Trainer(guard_dist_run("guard_dist_hit"), o, &comm()).run();
    ASSERT_EQ(s.guard_actions.size(), 2u);
    EXPECT_EQ(s.guard_actions[0].step, 60) << s.guard_actions[0].reason;
    EXPECT_EQ(s.guard_actions[1].step, 81) << s.guard_actions[1].reason;
    EXPECT_EQ(s.guard_actions[1].to_step, 70);
    expect_same_actions_on_every_rank(s);
    EXPECT_NEAR(s.val_losses.back().second, want, 0.01 * want);
}

}  // namespace memtrain::dist

namespace memtrain::dist {

// Under ZeRO-2 each rank counts its shard of the gradients; the counts gathered cover every
// parameter once. Tensor parallelism cannot give them yet, and says so before training.
TEST(AmpDist, HistogramsCoverEveryParameterOnceAndTensorParallelismIsRefused) {
    RunConfig c = shared_tiny_run_config("amp_dist", 4);
    c.train.zero_stage = 2;
    c.train.micro_batch_size = 1;
    c.train.diagnostics = "amp";
    Trainer t(c, test::quiet(), &comm());
    const std::size_t params = t.params().size();
    t.engine().begin_step();
    std::vector<int32_t> x(64, 1), y(64, 2);
    t.engine().forward_backward(x.data(), y.data(), 1, 8, 1.0f / 64, true);
    int64_t total = 0;
    for (const auto& th : t.engine().gradient_histograms()) total += th.hist.total;
    EXPECT_EQ(total, (int64_t)params);
    if (comm().size() % 2 == 0) {
        RunConfig tp = shared_tiny_run_config("amp_dist_tp", 2);
        tp.train.tp = 2;
        tp.train.diagnostics = "amp";
        expect_refused(tp, "train.diagnostics = \"amp\" reads the gradients of the CPU engine");
    }
}

}  // namespace memtrain::dist
