// A GPU run that cannot fit the device is refused before anything is allocated
// (engine/device_memory.h): the prediction is computed from the config alone, names every
// category and what would fit. The engine reports these very rows (CudaEngine::predicted_memory
// calls predict_cuda_memory), and the CUDA tests check them against its allocations to the byte
// (tests/cuda/train_test.cpp, on cudasim); here the arithmetic, without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "engine/device_memory.h"
#include "remat/policy.h"
#include "test_util.h"

using namespace memtrain;

namespace {

RunConfig gpu_run(const std::string& precision) {
    RunConfig c = test::tiny_run_config(test::temp_dir("device_fit"), 1);
    c.train.device = "cuda";
    c.train.precision = precision;
    return c;
}

std::size_t bytes_of(const std::vector<MemoryPrediction>& rows, MemCategory k) {
    for (const auto& r : rows)
        if (r.category == k) return r.bytes;
    return 0;
}

std::size_t total(const std::vector<MemoryPrediction>& rows) {
    std::size_t s = 0;
    for (const auto& r : rows) s += r.bytes;
    return s;
}

}  // namespace

TEST(DeviceFit, ModelStatesFollowPrecisionAndZeroStage) {
    const std::size_t psi = make_param_layout(gpu_run("fp32").model).total;
    const int B = 2, T = 8;
    {
        const auto rows = predict_cuda_memory(gpu_run("bf16"), {}, {}, B, T);
        EXPECT_EQ(bytes_of(rows, MemCategory::Parameters), 2 * psi);
        EXPECT_EQ(bytes_of(rows, MemCategory::Gradients), 2 * psi);
        // fp32 master + Adam's m and v, and the chunk table
        EXPECT_GE(bytes_of(rows, MemCategory::OptimizerState), 12 * psi);
        EXPECT_LT(bytes_of(rows, MemCategory::OptimizerState), 12 * psi + 4096);
    }
    {
        const auto rows = predict_cuda_memory(gpu_run("fp32"), {}, {}, B, T);
        EXPECT_EQ(bytes_of(rows, MemCategory::Parameters), 4 * psi);
        EXPECT_GE(bytes_of(rows, MemCategory::OptimizerState), 8 * psi);
        EXPECT_LT(bytes_of(rows, MemCategory::OptimizerState), 8 * psi + 4096);
    }
    // ZeRO-3 over 4 data-parallel ranks: every state a quarter (of the padded buffer).
    RunConfig z = gpu_run("bf16");
    z.train.zero_stage = 3;
    z.world = 4;
    z.train.batch_size = 8;
    const std::size_t shard = (psi + 3) / 4;
    const auto rows = predict_cuda_memory(z, {}, DevicePlacement{4, 1, true}, B, T);
    EXPECT_EQ(bytes_of(rows, MemCategory::Parameters), 2 * shard);
    EXPECT_EQ(bytes_of(rows, MemCategory::Gradients), 2 * shard);
    EXPECT_LT(bytes_of(rows, MemCategory::OptimizerState), 12 * shard + 4096);
    // Without mpirun (no data parallelism) the stage shards nothing.
    const auto alone = predict_cuda_memory(z, {}, DevicePlacement{4, 1, false}, B, T);
    EXPECT_EQ(bytes_of(alone, MemCategory::Parameters), 2 * psi);
    // ZeRO-Offload: no optimizer state on the device.
    RunConfig o = gpu_run("bf16");
    o.train.offload_optimizer = true;
    EXPECT_EQ(bytes_of(predict_cuda_memory(o, {}, {}, B, T), MemCategory::OptimizerState), 0u);
    // Engines that size themselves once built have no rows here.
    RunConfig l = gpu_run("bf16");
    l.lora.rank = 2;
    EXPECT_TRUE(predict_cuda_memory(l, {}, {}, B, T).empty());
}

TEST(DeviceFit, ActivationsFollowTheRematPlan) {
    const RunConfig c = gpu_run("bf16");
    const int B = 2, T = 8;
    const RematPlan full = remat::solve_policy(remat::parse_policy("full"), c.model, B, T, nullptr,
                                               device_arena_format(c, B, T))
                               .plan;
    const auto keep = predict_cuda_memory(c, {}, {}, B, T);
    const auto recompute = predict_cuda_memory(c, full, {}, B, T);
    EXPECT_LT(bytes_of(recompute, MemCategory::Activations),
              bytes_of(keep, MemCategory::Activations));
    EXPECT_EQ(bytes_of(keep, MemCategory::Activations),
              arena_bytes(activation_layout(c.model, B, T, {}, device_arena_format(c, B, T)),
                          MemCategory::Activations));
}

TEST(DeviceFit, ARunThatCannotFitIsRefusedNamingWhatWouldFit) {
    RunConfig c = gpu_run("fp32");
    const std::size_t need =
        total(predict_cuda_memory(c, {}, {}, c.micro_batch(), c.train.seq_len));
    EXPECT_NO_THROW(check_device_fit(c, {}, {}, need, need));
    try {
        check_device_fit(c, {}, {}, need - 1, 8u << 20);
        ADD_FAILURE() << "a run one byte too large was accepted";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("of device memory per GPU"), std::string::npos) << m;
        EXPECT_NE(m.find("parameters"), std::string::npos) << m;
        EXPECT_NE(m.find("the device has 8.0 MiB"), std::string::npos) << m;
        EXPECT_NE(m.find("nothing was allocated"), std::string::npos) << m;
        EXPECT_NE(m.find("To fit:"), std::string::npos) << m;
    }
    // Long sequences: the activations are most of it, and the advice is about them.
    c.model.block_size = 512;
    c.train.seq_len = 512;
    c.train.micro_batch_size = 4;
    c.train.batch_size = 4;
    try {
        check_device_fit(c, {}, {}, 1u << 20, 1u << 20);
        ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("for activations"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("train.remat"), std::string::npos) << e.what();
    }
}
