// The GPU engines (engine/cuda) as the CPU side reaches them: through the CUDA backend
// (core/cuda_backend.h), so that a program that trains on the CPU never loads the CUDA runtime.
// The backend registers its factory when it is loaded (engine/cuda/backend_entry.cpp).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"

namespace memtrain {

// Builds the GPU engine for plan.engine (Cuda, CudaLora or CudaPipeline).
using CudaEngineFactory = std::unique_ptr<Engine> (*)(const RunPlan& plan,
                                                      dist::Communicator& comm);
void register_cuda_engine_factory(CudaEngineFactory factory);

// The GPU engine for `plan`, loading the backend if needed; fails naming why it is not there.
std::unique_ptr<Engine> make_cuda_backend_engine(const RunPlan& plan, dist::Communicator& comm);

}  // namespace memtrain
