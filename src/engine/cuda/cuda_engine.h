// The CUDA engines (engine/engine.h): the model, its gradients and the optimizer on one GPU, in
// fp32, or in bf16/fp16 with fp32 master weights and Adam moments (Micikevicius et al., Mixed
// Precision Training) and, for fp16, a dynamic loss scale. Two classes: CudaEngine (the whole
// model, or LoRA's adapters over it) and CudaPipelineEngine (a pipeline stage), one step between
// them (device_step.h). Declared here without CUDA types so the factories link in every build; a
// build without CUDA fails with a message.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"

namespace memtrain {

// The whole model (engine/cuda/cuda_engine.cpp), data parallelism over `comm`'s ranks (one GPU
// each, NCCL between them): ZeRO stage 0 (DDP, gradients all-reduced unit by unit during the
// last micro-batch's backward), 1 (optimizer state sharded, gradients reduce-scattered,
// parameters all-gathered), 2 (gradients sharded too, reduced unit by unit during every
// backward) or 3 (parameters sharded too, each unit gathered just before use and the next one
// prefetched: parallel/data/device_zero.h). Where the model states live is the plan's table
// (plan.states, parallel/placement.h). With plan.lora, LoRA / QLoRA: the frozen base whole in
// the storage precision, or packed (lora.base = int8 | int4 | nf4) and decoded block by block on
// the device; the adapters trained with the same optimizer and loss scaling, DDP over NCCL.
std::unique_ptr<Engine> make_cuda_engine(const RunPlan& plan, dist::Communicator& comm);

// train.pp stages on the GPU (engine/cuda/cuda_pipeline_engine.cpp): one rank per stage, NCCL
// between them.
std::unique_ptr<Engine> make_cuda_pipeline_engine(const RunPlan& plan, dist::Communicator& comm);

// Test hook: the engine's next finish_step finds a non-finite gradient, as an fp16 overflow in
// backward would leave it (tests/cuda: the step is skipped and the loss scale halves).
void inject_overflow_for_test(Engine& engine);
// Test hook: how many micro-batches the engine replayed as a CUDA graph (train.cuda_graphs).
int64_t cuda_graph_replays_for_test(Engine& engine);
// Test hook: ZeRO-3's parameter-unit gathers so far, and how many of them were made when the
// unit was acquired rather than prefetched ({0, 0} below stage 3).
std::pair<int64_t, int64_t> zero_gathers_for_test(Engine& engine);

}  // namespace memtrain
