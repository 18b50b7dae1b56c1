// The build step (see build.h).
#include "train/build.h"

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/cpu/lora_engine.h"
#include "engine/cpu/mesh_engine.h"
#include "engine/cpu/ps_engine.h"
#include "engine/cpu/tp_engine.h"
#include "engine/cuda_backend.h"

namespace memtrain {

std::unique_ptr<Engine> make_engine(const RunPlan& plan, dist::Communicator& comm) {
    switch (plan.engine) {
        case EngineKind::Cpu:
            return std::make_unique<CpuEngine>(plan, comm);
        case EngineKind::Lora:
            return std::make_unique<LoraEngine>(plan, comm);
        case EngineKind::TensorParallel:
            return std::make_unique<TpEngine>(plan, comm);
        case EngineKind::Mesh:
            return std::make_unique<MeshEngine>(plan, comm);
        case EngineKind::ParameterServer:
            return std::make_unique<PsEngine>(plan, comm);
        case EngineKind::Cuda:
        case EngineKind::CudaLora:
        case EngineKind::CudaPipeline:
            return make_cuda_backend_engine(plan, comm);  // loads the CUDA backend
    }
    fail("internal: no engine for train.device '{}'", plan.cfg.train.device);
}

}  // namespace memtrain
