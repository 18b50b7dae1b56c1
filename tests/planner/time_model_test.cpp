// Time model: FLOPs per token against Megatron's formula, collective costs, the bubble.
#include <gtest/gtest.h>

#include "planner/time_model.h"

namespace memtrain::plan {

TEST(PlanTime, Gpt3FlopsPerTokenMatchesMegatron) {
    ModelSpec m = load_model("gpt3-175b");
    RunSpec r;
    r.seq = 2048;
    // 72 L h^2 (1 + s/(6h) + V/(12 h L)) per token = 6 x 174,563,733,504 + 12 x 96 x 12288 x 2048
    EXPECT_DOUBLE_EQ(model_flops_per_token(m, r), 1'076'373'430'272.0);
    r.recompute = Recompute::full;  // one more forward of the blocks
    double fwd_blocks = 2.0 * 96 * 12 * 12288.0 * 12288 + 4.0 * 96 * 12288 * 2048;
    EXPECT_DOUBLE_EQ(hardware_flops_per_token(m, r), 1'076'373'430'272.0 + fwd_blocks);
}

TEST(PlanTime, RingCollectives) {
    EXPECT_DOUBLE_EQ(ring_all_reduce_s(1e9, 8, 100e9), 2.0 * 7 / 8 * 1e9 / 100e9);
    EXPECT_DOUBLE_EQ(ring_gather_s(1e9, 8, 100e9), 7.0 / 8 * 1e9 / 100e9);
    EXPECT_EQ(ring_all_reduce_s(1e9, 1, 100e9), 0);
}

TEST(PlanTime, BubbleAndThroughput) {
    ModelSpec m = load_model("gpt3-175b");
    ClusterSpec c;
    c.gpu = gpu_preset("a100-80gb");
    c.gpus = 1024;
    RunSpec r;
    r.tp = 8, r.pp = 8, r.dp = 16, r.seq = 2048, r.micro_batches = 32;
    r.sequence_parallel = true, r.recompute = Recompute::selective;
    TimeEstimate t = estimate_time(m, r, c);
    EXPECT_DOUBLE_EQ(t.bubble_fraction, 7.0 / 32);
    EXPECT_GT(t.mfu, 0.3);
    EXPECT_LT(t.mfu, 0.6);
    EXPECT_NEAR(t.tokens_per_s, 16.0 * 32 * 2048 / t.step_s, 1e-6);
    r.schedule = memtrain::pp::Kind::Interleaved, r.virtual_stages = 4;
    EXPECT_DOUBLE_EQ(estimate_time(m, r, c).bubble_fraction, 7.0 / 4 / 32);
}

}  // namespace memtrain::plan
