// The build step (see build.h).
#include "train/build.h"

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/cpu/ps_engine.h"
#include "engine/cuda_backend.h"

namespace memtrain {

std::unique_ptr<Engine> make_engine(const RunPlan& plan, dist::Communicator& comm) {
    switch (plan.engine) {
        case EngineKind::Cpu:
        case EngineKind::Lora:
        case EngineKind::TensorParallel:
        case EngineKind::Mesh:
            return std::make_unique<CpuEngine>(plan, comm);
        case EngineKind::ParameterServer:
            return std::make_unique<PsEngine>(plan, comm);
        case EngineKind::Cuda:
        case EngineKind::CudaLora:  // the same class: LoRA is the plan's choice of model states
        case EngineKind::CudaPipeline:
            return make_cuda_backend_engine(plan, comm);  // loads the CUDA backend
    }
    fail("internal: no engine for train.device '{}'", plan.cfg.train.device);
}

}  // namespace memtrain
