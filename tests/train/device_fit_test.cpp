// A GPU run that cannot fit the device is refused before anything is allocated
// (engine/device_memory.h): the prediction is computed from the plan alone, for every GPU engine
// kind (the whole model, LoRA and QLoRA, a pipeline stage), and names every category and what
// would fit. The engines report these very rows, and the CUDA tests check them against their
// allocations to the byte (tests/cuda/train_test.cpp, lora_test.cpp,
// tests/mpi/cuda_pipeline_test.cpp, on cudasim); here the arithmetic, without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "engine/device_memory.h"
#include "model/lora.h"
#include "quant/quantized_store.h"
#include "remat/policy.h"
#include "test_util.h"
#include "train/plan.h"

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

namespace {

// The plan of `c` in one process (the collective and the stage come from the job's communicator;
// tests of a pipeline stage set the rank afterwards).
RunPlan gpu_plan(const RunConfig& c) {
    dist::LocalCommunicator comm;
    RunPlan p = plan_layout(c, comm, nullptr);
    p.memory = predict_device_memory(p, p.remat.plan, p.cfg.micro_batch(), p.cfg.train.seq_len);
    p.memory_on = MemoryOn::Device;
    return p;
}

RunConfig lora_gpu_run(const std::string& base) {
    RunConfig c = gpu_run("bf16");
    c.model.n_embd = 32;  // int4/nf4 groups of 32 divide every block matrix's inputs
    c.lora.rank = 4;
    c.lora.targets = "all";
    c.lora.base = base;
    c.lora.base_group = 32;
    return c;
}

RunConfig pipeline_gpu_run() {
    RunConfig c = gpu_run("bf16");
    c.model.n_layer = 4;
    c.world = 2;
    c.train.pp = 2;
    return c;
}

}  // namespace

// GPU LoRA: the frozen base whole (or packed) and the adapters' gradients and optimizer state
// only, as CudaEngine allocates them over its adapter states.
TEST(DeviceFit, LoraRowsAreTheFrozenBaseAndTheAdapters) {
    const RunPlan p = gpu_plan(lora_gpu_run("fp32"));
    ASSERT_EQ(p.engine, EngineKind::CudaLora);
    const std::size_t psi = make_param_layout(p.cfg.model).total;
    const std::size_t n = make_lora_layout(p.cfg.model, p.cfg.lora).params.total;
    EXPECT_EQ(bytes_of(p.memory, MemCategory::Parameters), 2 * psi + 2 * n);
    EXPECT_EQ(bytes_of(p.memory, MemCategory::Gradients), 2 * n);
    EXPECT_GE(bytes_of(p.memory, MemCategory::OptimizerState), 12 * n);
    EXPECT_LT(bytes_of(p.memory, MemCategory::OptimizerState), 12 * n + 4096);
    // QLoRA: the block matrices packed in 4 bits, with two decode slots in the workspace.
    const RunPlan q = gpu_plan(lora_gpu_run("nf4"));
    ASSERT_TRUE(q.lora_base.has_value());
    const quant::DeviceBaseBytes b = quant::device_base_bytes(q.cfg.model, *q.lora_base, 2, 2);
    EXPECT_EQ(bytes_of(q.memory, MemCategory::Parameters), b.params + 2 * n);
    EXPECT_LT(b.params, 2 * psi);
    EXPECT_EQ(bytes_of(q.memory, MemCategory::Workspace),
              bytes_of(p.memory, MemCategory::Workspace) + b.slots);
}

// A GPU pipeline stage holds its own blocks' states (the last stage also a mirror of a tied
// embedding) and one activation arena per micro-batch the schedule keeps in flight on it.
TEST(DeviceFit, PipelineStageRowsHoldTheStageOnly) {
    RunPlan p = gpu_plan(pipeline_gpu_run());
    ASSERT_EQ(p.engine, EngineKind::CudaPipeline);
    const ParamLayout layout = make_param_layout(p.cfg.model);
    const std::size_t emb = layout.units[ParamLayout::embedding_unit()].size();
    const int B = p.cfg.micro_batch(), T = p.cfg.train.seq_len;
    const auto first = predict_cuda_stage_memory(p, {}, B, T);
    p.rank = 1;
    const auto last = predict_cuda_stage_memory(p, {}, B, T);
    EXPECT_EQ(bytes_of(first, MemCategory::Parameters) + bytes_of(last, MemCategory::Parameters),
              2 * (layout.total + emb));
    EXPECT_EQ(bytes_of(first, MemCategory::Gradients), bytes_of(first, MemCategory::Parameters));
    // 1F1B over 2 stages: the first stage holds both micro-batches of the step at once, the
    // last one.
    const pp::Schedule s = pp::make_schedule(pp::Kind::OneFOneB, 2, p.cfg.accum_steps());
    EXPECT_EQ(pipeline_stage_slots(s, 0), 2);
    EXPECT_EQ(pipeline_stage_slots(s, 1), 1);
    EXPECT_NE(first[3].formula.find("2 slots"), std::string::npos) << first[3].formula;
}

// Every GPU engine kind is refused by the plan's rows before anything is allocated, naming the
// categories (plan_run calls check_device_fit with the device's free memory).
TEST(DeviceFit, EveryGpuKindIsRefusedBeforeItAllocates) {
    RunPlan stage = gpu_plan(pipeline_gpu_run());
    stage.rank = 1;
    stage.memory = predict_device_memory(stage, {}, 2, 8);
    for (const RunPlan& p : {gpu_plan(gpu_run("bf16")), gpu_plan(lora_gpu_run("nf4")), stage}) {
        SCOPED_TRACE(engine_name(p.engine));
        ASSERT_FALSE(p.memory.empty());
        const std::size_t need = total(p.memory);
        EXPECT_NO_THROW(check_device_fit(p, need, need));
        try {
            check_device_fit(p, need - 1, 8u << 20);
            ADD_FAILURE() << "a run one byte too large was accepted";
        } catch (const Error& e) {
            const std::string m = e.what();
            EXPECT_NE(m.find("of device memory per GPU"), std::string::npos) << m;
            EXPECT_NE(m.find("parameters"), std::string::npos) << m;
            EXPECT_NE(m.find("activations"), std::string::npos) << m;
            EXPECT_NE(m.find("nothing was allocated"), std::string::npos) << m;
            EXPECT_NE(m.find("To fit:"), std::string::npos) << m;
            if (p.engine == EngineKind::CudaPipeline) {
                EXPECT_NE(m.find("on pipeline stage 1 of 2"), std::string::npos) << m;
            }
        }
    }
}
