// The typed run plan (engine/run_plan.h): one decision of the engine from the config, the layout
// as data, the remat schedule for the engine's arena format, and this rank's memory predicted by
// the engine's own functions before anything is allocated.
#include <gtest/gtest.h>

#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "engine/run_plan.h"
#include "model/gpt.h"
#include "test_util.h"
#include "train/plan.h"

using namespace memtrain;

namespace {

RunConfig tiny_one_step_run() {
    return test::tiny_run_config(test::temp_dir("run_plan"), 1);
}

}  // namespace

TEST(RunPlan, OneDecisionOfTheEngine) {
    RunConfig c = tiny_one_step_run();
    EXPECT_EQ(engine_kind(c), EngineKind::Cpu);
    c.lora.rank = 2;
    EXPECT_EQ(engine_kind(c), EngineKind::Lora);
    c = tiny_one_step_run();
    c.world = 2;
    c.train.tp = 2;
    EXPECT_EQ(engine_kind(c), EngineKind::TensorParallel);
    c.world = 4;
    c.train.batch_size = 4;
    EXPECT_EQ(engine_kind(c), EngineKind::Mesh) << "tp x dp runs as the mesh";
    c = tiny_one_step_run();
    c.world = 2;
    c.train.pp = 2;
    EXPECT_EQ(engine_kind(c), EngineKind::Mesh);
    c.train.device = "cuda";
    c.train.precision = "bf16";
    EXPECT_EQ(engine_kind(c), EngineKind::CudaPipeline);
    c.train.pp_schedule = "zb-h1";
    EXPECT_THROW(engine_kind(c), Error) << "zero-bubble runs on the CPU only";
    c = tiny_one_step_run();
    c.train.device = "cuda";
    c.train.precision = "bf16";
    EXPECT_EQ(engine_kind(c), EngineKind::Cuda);
    c.lora.rank = 2;
    EXPECT_EQ(engine_kind(c), EngineKind::CudaLora);
    c = tiny_one_step_run();
    c.world = 3;
    c.train.dp_mode = "ps";
    c.train.batch_size = 4;
    EXPECT_EQ(engine_kind(c), EngineKind::ParameterServer);
    c.train.device = "cuda";
    EXPECT_THROW(engine_kind(c), Error);
}

TEST(RunPlan, HoldsTheLayoutScheduleAndMemoryBeforeAllocation) {
    RunConfig c = tiny_one_step_run();
    c.train.remat = "full";
    dist::LocalCommunicator one;
    const RunPlan p = plan_run(c, one);
    EXPECT_EQ(p.engine, EngineKind::Cpu);
    EXPECT_EQ(p.mesh.size(), 1);
    EXPECT_EQ(p.precision, Precision::fp32);
    EXPECT_EQ(p.format, ActFormat::cpu());
    ASSERT_EQ(p.remat.plan.size(), (std::size_t)c.model.n_layer);
    for (BlockKeep k : p.remat.plan) EXPECT_EQ(k, BlockKeep::Input);
    EXPECT_EQ(p.memory_on, MemoryOn::Host);
    EXPECT_FALSE(p.memory.empty());
    EXPECT_NE(p.describe().find("parameters replicated"), std::string::npos) << p.describe();
    // ZeRO-3's row of the shard table.
    c.train.zero_stage = 3;
    EXPECT_EQ(plan_run(c, one).states.params, dist::Placement::Sharded);
}
