// The build step: the engine a RunPlan names, built as planned (engine/cpu, engine/cuda). A CUDA
// engine needs a CUDA build and a GPU: otherwise an Error says which.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"

namespace memtrain {

std::unique_ptr<Engine> make_engine(const RunPlan& plan, dist::Communicator& comm);

}  // namespace memtrain
