// The CUDA engines' device memory predicted from the plan alone, before anything is allocated
// (the GPU side of host_memory.h), for each GPU engine kind: the whole model's states (whole, or
// a rank's ZeRO shard, the optimizer on the host under train.offload_optimizer), LoRA's frozen
// base (whole or QLoRA-packed) and adapters, or a pipeline stage's units and activation slots;
// the activation arenas of the remat plan from the same layout functions CudaGPT allocates with,
// and the workspace. The engines report exactly these rows beside what they measured (plus the
// ZeRO-2/3 buckets, sized once built), and plan_run refuses a run whose rows do not fit the GPU
// before the engine allocates. Plain C++: it builds (and answers) without the CUDA toolkit.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/activation_layout.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain {

// Bytes per stored value of train.precision on the GPU (fp32 4, bf16 and fp16 2).
int device_elem_bytes(const RunConfig& cfg);
// How CudaGPT lays out its arenas for this run (CudaGPT<T>::arena_format).
ActFormat device_arena_format(const RunConfig& cfg, int B, int T);
// Device bytes of the host token ids of a B x T micro-batch (inputs, targets, the embedding
// backward's plan), and of the CUDA graph's loss slot (CudaGPT::token_bytes, kGraphBytes).
std::size_t device_token_bytes(int B, int T);
inline constexpr std::size_t kDeviceGraphBytes = sizeof(double);
// The device optimizer's state per parameter of its range (DeviceOptimizer): the fp32 master
// weights when the storage is not fp32, then Adam's m and v or SGD's momentum; and its name.
// Whether the GPU optimizer keeps fp32 master weights: in 16-bit precision unless optim.master =
// "none" (the bf16 parameters are then the weights).
bool device_master(int elem_bytes, const OptimConfig& optim);
std::size_t device_optimizer_bytes_per_param(bool master, bool adamw);
std::string device_optimizer_states(bool master, bool adamw);  // "fp32 master, Adam m, v"
// The device bytes of the engines' shared step (DeviceStep): its scalars, the loss sums of
// `accum_steps` micro-batches and the sums of squares of `units` parameter units.
std::size_t device_step_bytes(int accum_steps, std::size_t units);
// The activation slots of the GPU pipeline's stage `stage` under schedule `s`: the most
// micro-batches it holds between their forward and backward (at least one).
int pipeline_stage_slots(const pp::Schedule& s, int stage);

// Whether the CUDA engine runs data parallelism over NCCL on `comm`: launched by mpirun (an MPI
// communicator, even of one rank), without CUDA graphs (which run one process, the plain path).
bool cuda_data_parallel(const RunConfig& cfg, const dist::Communicator& comm);

// Where the engine stands among `world` ranks: `data_parallel` when it runs DDP or ZeRO over
// NCCL (launched by mpirun, even at one rank, without CUDA graphs), which pads the flat buffer
// to equal shards and shards the states by train.zero_stage.
struct DevicePlacement {
    int world = 1, rank = 0;
    bool data_parallel = false;
};

// The rows CudaEngine allocates over the whole model for micro-batches of B x T with `plan` (no
// ZeRO-2/3 buckets: those are sized by the built engine); empty for LoRA and pipeline stages
// (the functions below).
std::vector<MemoryPrediction> predict_cuda_memory(const RunConfig& cfg, const RematPlan& plan,
                                                  const DevicePlacement& where, int B, int T);
// The rows CudaEngine allocates over LoRA's adapters (plan.lora): the frozen base whole in the
// storage precision or packed (plan.lora_base) with its decode slots, the adapters' parameters,
// gradients and optimizer state, the arenas and the adapters' GEMM workspace.
std::vector<MemoryPrediction> predict_cuda_lora_memory(const RunPlan& plan, const RematPlan& remat,
                                                       int B, int T);
// The rows CudaPipelineEngine allocates on this rank's stage (plan.mesh.stage_of(plan.rank)):
// the stage's units (and the last stage's mirror of a tied embedding), its optimizer state, one
// activation arena per slot the schedule keeps in flight, the shared workspace.
std::vector<MemoryPrediction> predict_cuda_stage_memory(const RunPlan& plan, const RematPlan& remat,
                                                        int B, int T);
// The rows of the plan's GPU engine kind (one of the three above).
std::vector<MemoryPrediction> predict_device_memory(const RunPlan& plan, const RematPlan& remat,
                                                    int B, int T);

// Fails before anything is allocated, naming every category, the device's size and what would
// fit instead, when the plan's rows (plan.memory) exceed `free_bytes` (the device's free memory)
// of `total_bytes`.
void check_device_fit(const RunPlan& plan, std::size_t free_bytes, std::size_t total_bytes);
// The same for the whole model's rows (predict_cuda_memory) of `cfg`.
void check_device_fit(const RunConfig& cfg, const RematPlan& plan, const DevicePlacement& where,
                      std::size_t free_bytes, std::size_t total_bytes);

}  // namespace memtrain
