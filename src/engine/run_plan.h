// The run, decided before anything is allocated: a typed value computed from the RunConfig and
// the job's communicator (train/plan.h), which every engine is built from (train/build.h). It
// holds
//   - which engine runs it (one decision, EngineKind, instead of the configuration's strings
//     compared where each engine is chosen);
//   - the layout: the mesh of tensor-parallel shards x pipeline stages x data-parallel replicas
//     (parallel/mesh.h), where each model state lives (parallel/placement.h: ZeRO stage and
//     offload as a row of one table), the pipeline schedule, sequence parallelism, LoRA and its
//     quantized base;
//   - the precision, the engine's activation arena format and the remat schedule solved for it;
//   - this rank's memory, predicted by the same functions the engine allocates by
//     (engine/host_memory.h, engine/device_memory.h), checked against the host or the device
//     before the engine allocates.
// The planner's estimate (planner/) prices the same layouts with the same layout functions.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "model/activation_layout.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/placement.h"
#include "quant/quantized_store.h"
#include "remat/solver.h"

namespace memtrain {

enum class EngineKind {
    // CpuEngine composes the first four (engine/cpu/cpu_engine.h):
    Cpu,              // one process, DDP or ZeRO 0-3 (parallel/data/zero_store.h)
    Lora,             // adapters over a frozen (or packed) base
    TensorParallel,   // train.tp alone (and sequence parallelism)
    Mesh,             // train.pp, pipelines side by side, the tp x pp x dp mesh (the executor)
    ParameterServer,  // PsEngine: train.dp_mode = "ps"
    Cuda,             // CudaEngine: one GPU, DDP or ZeRO over NCCL, ZeRO-Offload
    CudaLora,         // CudaEngine over LoRA's adapters (engine/cuda/model_states.h)
    CudaPipeline,     // CudaPipelineEngine: train.pp stages on GPUs
};
const char* engine_name(EngineKind k);
bool on_gpu(EngineKind k);
// The engine a (validated, resolved) config runs on; fails for a combination no engine runs.
EngineKind engine_kind(const RunConfig& cfg);
// train.pp > 1 on the GPU: what the GPU pipeline engine is built for (part of the config's
// checks, and again once "auto" has resolved to the GPU).
void validate_cuda_pipeline(const RunConfig& cfg);

// train.precision once resolved (core/dtype.h's Precision); fails on "auto".
Precision resolved_precision(const std::string& name);

// Where a plan's memory rows live.
enum class MemoryOn { Host, Device };

struct RunPlan {
    // The resolved, checked config. Engines read its model, optimizer, LoRA and seed from it;
    // every decision about the layout is one of the fields below.
    RunConfig cfg;
    EngineKind engine = EngineKind::Cpu;
    int rank = 0, world = 1;  // this process in the job
    dist::MeshLayout mesh;    // tp x pp x dp of the job (a parameter server's workers as dp)
    int ps_servers = 0;       // parameter-server ranks (the job's last); 0 = none
    int ps_staleness = 0;
    dist::ShardSpec states;
    int zero_stage = 0;        // the stage `states` is the row of
    bool collective = false;   // GPU: NCCL between the launched ranks (even at world size 1)
    bool cuda_graphs = false;  // GPU: each micro-batch replayed as one captured CUDA graph
    Precision precision = Precision::fp32;
    pp::Kind schedule = pp::Kind::OneFOneB;  // train.pp_schedule (run with mesh.pp > 1)
    int virtual_stages = 1;                  // interleaved: chunks per rank
    bool sequence_parallel = false;
    bool lora = false;
    std::optional<quant::BaseQuant> lora_base;  // QLoRA: the packed base; none: fp32
    ActFormat format;                           // how the engine's model lays out its arenas
    remat::Solution remat;  // train.remat solved for this model, micro-batch and format
    // What the solver priced recompute against: a step's cost in FLOPs (analytic) or in ns
    // (train.remat_costs = "measured": rank 0's profile of one block, the same on every rank).
    double step_cost = 0;
    bool costs_measured = false;
    // train.remat as written ("full", "budget:2GiB", ...), and the step's shape (RunConfig's
    // micro_batch(), train.seq_len, accum_steps()): micro-batches of micro_batch x seq_len tokens,
    // accum_steps of them per step on each data-parallel rank.
    std::string remat_policy;
    int micro_batch = 1, seq_len = 1, accum_steps = 1;
    // This rank's predicted bytes on `memory_on`: the engine's own formulas
    // (engine/host_memory.h for every CPU engine, engine/device_memory.h). The Trainer fails if
    // the built engine predicts other bytes for these rows, and its memory report prints them.
    std::vector<MemoryPrediction> memory;
    MemoryOn memory_on = MemoryOn::Host;

    bool gpu() const { return on_gpu(engine); }
    // The data-parallel replica whose rows of each global micro-batch this rank reads: the ranks
    // of one pipeline and of one tensor-parallel group read the same rows; parameter servers
    // (the last ranks) take no data and are handed replica 0's rows, unread.
    int dp_rank() const;
    // Whether a loss the engine returns is already the job's (a pipeline's last stage's,
    // broadcast; a tensor-parallel group's; the parameter server's workers' mean) or this
    // data-parallel rank's own, which the Trainer averages over the ranks.
    bool loss_is_global() const;
    // "cpu, tp 2 x pp 2 x dp 1, parameters replicated, ..., fp32"
    std::string describe() const;
    // The start-up line: "cpu | tp 1 x pp 1 x dp 2 | ZeRO-1 | fp32 | remat full | 41.2 MiB on
    // the host per rank".
    std::string summary() const;
    // Every field, one per line, with this rank's memory rows (`memtrain train --print-plan`).
    std::string table() const;
};

}  // namespace memtrain
