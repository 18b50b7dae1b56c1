// The CUDA engine: see cuda_engine.h.
#include "train/cuda_engine.h"

#include "core/error.h"

namespace memtrain {

std::unique_ptr<Engine> make_cuda_engine(const RunConfig&) {
    fail("train.device = \"cuda\": the CUDA engine is not built yet");
}

}  // namespace memtrain
