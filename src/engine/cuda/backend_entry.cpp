// The CUDA backend's engine factory (engine/cuda_backend.h), registered as the backend is loaded:
// the one door from the CPU side to the engines of this folder.
#include "core/error.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda_backend.h"

namespace memtrain {

namespace {

std::unique_ptr<Engine> make(const RunPlan& plan, dist::Communicator& comm) {
    switch (plan.engine) {
        case EngineKind::Cuda:
        case EngineKind::CudaLora:  // the same class: LoRA is the plan's choice of model states
            return make_cuda_engine(plan, comm);
        case EngineKind::CudaPipeline:
            return make_cuda_pipeline_engine(plan, comm);
        default:
            break;
    }
    fail("internal: the CUDA backend was asked for a CPU engine");
}

[[maybe_unused]] const bool kEngineFactoryRegistered = (register_cuda_engine_factory(&make), true);

}  // namespace

}  // namespace memtrain
