// The CUDA engine: see cuda_engine.h.
#include "train/cuda_engine.h"

#include "core/error.h"

namespace memtrain {

std::unique_ptr<Engine> make_cuda_engine(const RunConfig&) {
    fail("train.device = \"cuda\": the CUDA engine is not built yet");
}

void inject_overflow_for_test(Engine&) {
    fail("internal: inject_overflow_for_test needs the CUDA engine");
}

}  // namespace memtrain
