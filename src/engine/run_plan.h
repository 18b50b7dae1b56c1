// The run, decided before anything is allocated: a typed value computed from the RunConfig and
// the job's communicator, which the Trainer builds the run from. It holds
//   - which engine runs it (one decision, EngineKind, instead of the configuration's strings
//     compared where each engine is chosen);
//   - the layout: the mesh of tensor-parallel shards x pipeline stages x data-parallel replicas
//     (parallel/mesh.h) and where each model state lives (parallel/placement.h: ZeRO stage and
//     offload as a row of one table);
//   - the precision, the engine's activation arena format and the remat schedule solved for it;
//   - this rank's memory, predicted by the same functions the engine reports its predicted
//     column with (engine/host_memory.h, engine/device_memory.h), checked against the
//     host or the device before the engine allocates.
// The planner's estimate (planner/) prices the same layouts with the same layout functions.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "engine/engine.h"
#include "model/activation_layout.h"
#include "parallel/mesh.h"
#include "parallel/placement.h"
#include "remat/cost.h"
#include "remat/solver.h"

namespace memtrain {

enum class EngineKind {
    Cpu,              // CpuEngine: one process, DDP or ZeRO 0-3 (parallel/data/zero_store.h)
    Lora,             // LoraEngine: adapters over a frozen (or packed) base
    TensorParallel,   // TpEngine: train.tp alone (and sequence parallelism)
    Pipeline,         // PipelineEngine: train.pp, pipelines side by side, the tp x pp x dp mesh
    ParameterServer,  // PsEngine: train.dp_mode = "ps"
    Cuda,             // CudaEngine: one GPU, DDP or ZeRO over NCCL, ZeRO-Offload
    CudaLora,         // CudaLoraEngine
    CudaPipeline,     // CudaPipelineEngine: train.pp stages on GPUs
};
const char* engine_name(EngineKind k);
// The engine a (validated, resolved) config runs on; fails for a combination no engine runs.
EngineKind engine_kind(const RunConfig& cfg);

enum class Precision { fp32, bf16, fp16 };

struct RunPlan {
    EngineKind engine = EngineKind::Cpu;
    dist::MeshLayout mesh;  // tp x pp x dp of the job (a parameter server's workers as dp)
    dist::ShardSpec states;
    Precision precision = Precision::fp32;
    ActFormat format;       // how the engine's model lays out its arenas
    remat::Schedule remat;  // train.remat solved for this model, micro-batch and format
    // This rank's predicted bytes, on `memory_on` ("host" or "device"): the engine's own
    // formulas (engine/host_memory.h, engine/device_memory.h), or the planner's per-rank
    // estimate for the CPU mesh; empty where the engine sizes itself once built (the parameter
    // server, GPU LoRA and pipelines, naive and PipeDream schedules). The Trainer fails if the
    // built engine predicts other bytes for these rows, and its memory report prints them.
    std::vector<MemoryPrediction> memory;
    std::string memory_on;
    // "cpu, tp 2 x pp 2 x dp 1, parameters replicated, ..., fp32, remat none"
    std::string describe() const;
};

// The plan of `cfg` on `comm` (`measured`: profiled block costs for train.remat_costs =
// "measured", else null), with its memory checked: fails before anything is allocated, naming
// what would fit, when this rank's predicted bytes exceed the host's or the device's free memory.
RunPlan plan_run(const RunConfig& cfg, const dist::Communicator& comm,
                 const remat::BlockFlops* measured = nullptr);

// The engine the plan names, built as planned (the GPU engine shards its model states by
// plan.states). A CUDA engine needs a CUDA build and a GPU: otherwise an Error says which.
std::unique_ptr<Engine> make_engine(const RunPlan& plan, const RunConfig& cfg,
                                    dist::Communicator& comm);

}  // namespace memtrain
