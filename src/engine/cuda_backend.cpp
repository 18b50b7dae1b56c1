// The GPU engines through the CUDA backend (see cuda_backend.h).
#include "engine/cuda_backend.h"

#include <atomic>

#include "core/cuda_backend.h"
#include "core/error.h"

namespace memtrain {

namespace {
std::atomic<CudaEngineFactory> g_factory{nullptr};  // constant-initialised, as in core/device.cpp
}  // namespace

void register_cuda_engine_factory(CudaEngineFactory factory) {
    g_factory.store(factory);
}

std::unique_ptr<Engine> make_cuda_backend_engine(const RunPlan& plan, dist::Communicator& comm) {
    if (!load_cuda_backend() || !g_factory.load())
        fail("train.device = \"cuda\": {}", load_cuda_backend()
                                                ? std::string("the CUDA backend has no engines")
                                                : cuda_backend_status());
    return g_factory.load()(plan, comm);
}

}  // namespace memtrain
