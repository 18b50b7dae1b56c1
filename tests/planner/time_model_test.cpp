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

// GEMM efficiency by shape (issue 26): a large square GEMM reaches the preset's efficiency but
// for its K loop; one tile more than the SMs run at once costs a second, nearly empty wave;
// padded edge tiles and a GEMV's memory bound cost their share; a small model split over 8 GPUs
// runs its GEMMs at a fraction of the rate the same model reaches on one.
TEST(PlanTime, GemmEfficiencyByShape) {
    const GpuSpec h100 = gpu_preset("h100-80gb");
    const double peak = h100.peak_flops;
    // 64 x 64 tiles in 32 waves of 132 SMs, the last one not full.
    const double big = gemm_efficiency(8192, 8192, 8192, 2, peak, h100);
    EXPECT_NEAR(big, h100.efficiency * 8192 / (8192 + 128.0) * 4096 / (32 * 132), 1e-12);
    // 132 tiles fill one wave of 132 SMs; 133 need two (the memory bound set aside: one row of
    // tiles is a thin GEMM).
    GpuSpec h100_fast_memory = h100;
    h100_fast_memory.hbm_bandwidth = 1e18;
    const double full = gemm_efficiency(128, 128 * 132, 8192, 2, peak, h100_fast_memory);
    const double spill = gemm_efficiency(128, 128 * 133, 8192, 2, peak, h100_fast_memory);
    EXPECT_NEAR(spill / full, 133.0 / 264, 1e-9);
    // A 129-wide edge pads a second tile column: 129 / 256 of it is used.
    EXPECT_NEAR(gemm_efficiency(128 * 132, 129, 8192, 2, peak, h100_fast_memory) /
                    gemm_efficiency(128 * 132, 256, 8192, 2, peak, h100_fast_memory),
                129.0 / 256, 1e-9);
    // A matrix-vector product is memory bound: far below a GEMM's rate.
    EXPECT_LT(gemm_efficiency(1, 8192, 8192, 2, peak, h100), 0.01);
    // GPT-2 124M at tp = 8 against tp = 1.
    const ModelSpec m = load_model("gpt2");
    RunSpec r;
    r.micro_batch = 1;
    const double one = block_gemm_efficiency(m, r, 2, peak, h100, true);
    r.tp = 8;
    const double eight = block_gemm_efficiency(m, r, 2, peak, h100, true);
    EXPECT_LT(eight, 0.5 * one);
    EXPECT_GT(one, 0.3);
}

}  // namespace memtrain::plan
