// The typed run plan (see run_plan.h).
#include "engine/run_plan.h"
#include "train/validate.h"

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "engine/cpu/lora_engine.h"
#include "engine/cpu/mesh_engine.h"
#include "engine/cpu/ps_engine.h"
#include "engine/cpu/tp_engine.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/device_memory.h"
#include "engine/host_memory.h"
#include "model/gpt.h"
#include "remat/policy.h"

namespace memtrain {

const char* engine_name(EngineKind k) {
    switch (k) {
        case EngineKind::Cpu:
            return "cpu";
        case EngineKind::Lora:
            return "cpu lora";
        case EngineKind::TensorParallel:
            return "cpu tensor parallel";
        case EngineKind::Pipeline:
            return "cpu pipeline";
        case EngineKind::ParameterServer:
            return "cpu parameter server";
        case EngineKind::Cuda:
            return "cuda";
        case EngineKind::CudaLora:
            return "cuda lora";
        case EngineKind::CudaPipeline:
            return "cuda pipeline";
    }
    return "?";
}

EngineKind engine_kind(const RunConfig& cfg) {
    const bool gpu = cfg.train.device == "cuda";
    if (!gpu && cfg.train.device != "cpu")
        fail("internal: train.device '{}' was not resolved to cpu or cuda", cfg.train.device);
    if (cfg.ps()) {
        if (gpu)
            fail(
                "train.dp_mode = \"ps\" runs on the CPU engine only so far, not on cuda: set "
                "train.device = \"cpu\"");
        return EngineKind::ParameterServer;
    }
    if (cfg.train.tp > 1 && gpu)
        fail(
            "train.tp = {} runs on the CPU engine only so far, not on cuda: set train.device = "
            "\"cpu\"",
            cfg.train.tp);
    if (cfg.train.pp > 1) {
        if (gpu) {
            validate_cuda_pipeline(cfg);
            return EngineKind::CudaPipeline;
        }
        return EngineKind::Pipeline;
    }
    // Tensor parallelism alone, or with data parallelism: the mesh's engine (a pipeline of one
    // stage per tensor-parallel group) where there are several groups.
    if (cfg.train.tp > 1) return cfg.dp() > 1 ? EngineKind::Pipeline : EngineKind::TensorParallel;
    if (cfg.lora.enabled()) return gpu ? EngineKind::CudaLora : EngineKind::Lora;
    return gpu ? EngineKind::Cuda : EngineKind::Cpu;
}

std::string RunPlan::describe() const {
    return fmt::format("{}, tp {} x pp {} x dp {}, {}, {}", engine_name(engine), mesh.tp, mesh.pp,
                       mesh.dp, dist::describe(states),
                       precision == Precision::fp32   ? "fp32"
                       : precision == Precision::bf16 ? "bf16"
                                                      : "fp16");
}

RunPlan plan_run(const RunConfig& cfg, const dist::Communicator& comm,
                 const remat::BlockFlops* measured) {
    RunPlan p;
    p.engine = engine_kind(cfg);
    const int tp = std::max(1, cfg.train.tp), pp = std::max(1, cfg.train.pp);
    p.mesh = dist::MeshLayout{pp, cfg.dp(), tp};
    const bool gpu = cfg.train.device == "cuda";
    const bool nccl = gpu && cuda_data_parallel(cfg, comm);
    // One GPU without mpirun holds everything (ZeRO needs NCCL between launched ranks).
    p.states =
        dist::shard_spec(gpu && !nccl ? 0 : cfg.train.zero_stage, cfg.train.offload_optimizer);
    p.precision = cfg.train.precision == "bf16"   ? Precision::bf16
                  : cfg.train.precision == "fp16" ? Precision::fp16
                                                  : Precision::fp32;
    const int B = cfg.micro_batch(), T = cfg.train.seq_len;
    p.format = gpu ? device_arena_format(cfg, B, T) : GPT::arena_format();
    p.remat = remat::make_schedule(remat::parse_policy(cfg.train.remat), cfg.model, B, T, measured,
                                   p.format);
    if (gpu) {
        const DevicePlacement where{comm.size(), comm.rank(), nccl};
        p.memory = predict_cuda_memory(cfg, p.remat.plan, where, B, T);
        p.memory_on = "device";
        // (Without a device the engine's construction says so.)
        if (!p.memory.empty() && cuda_available()) {
            select_device(comm.local_rank());  // this rank's GPU, as the engine takes it
            const auto [free_b, total_b] = device_memory_info();
            check_device_fit(cfg, p.remat.plan, where, free_b, total_b);
        }
    } else {
        p.memory = predict_cpu_memory(cfg, p.remat.plan, comm.rank(), B, T);
        if (p.memory.empty()) p.memory = predict_pipeline_memory(cfg, comm.rank());
        p.memory_on = "host";
        check_host_fit(cfg, p.memory, comm.rank(), comm.local_size());
    }
    return p;
}

std::unique_ptr<Engine> make_engine(const RunPlan& plan, const RunConfig& cfg,
                                    dist::Communicator& comm) {
    switch (plan.engine) {
        case EngineKind::Cpu:
            return std::make_unique<CpuEngine>(cfg, comm);
        case EngineKind::Lora:
            return std::make_unique<LoraEngine>(cfg, comm);
        case EngineKind::TensorParallel:
            return std::make_unique<TpEngine>(cfg, comm);
        case EngineKind::Pipeline:
            return std::make_unique<PipelineEngine>(cfg, comm);
        case EngineKind::ParameterServer:
            return std::make_unique<PsEngine>(cfg, comm);
        case EngineKind::Cuda:
            return make_cuda_engine(cfg, comm, plan.states);
        case EngineKind::CudaLora:
            return make_cuda_lora_engine(cfg, comm);
        case EngineKind::CudaPipeline:
            return make_cuda_pipeline_engine(cfg, comm);
    }
    fail("internal: no engine for train.device '{}'", cfg.train.device);
}

}  // namespace memtrain
