// The CUDA backend seen from code that must not load it. A run on the CPU never loads the CUDA
// runtime, cuBLASLt or NCCL (about 150 MiB of mappings): they are linked into
// libmemtrain_cuda.so, the backend (the kernels of src/**/*.cu and the host code that calls the
// runtime), which is loaded the first time a run asks about a device on a machine where a GPU
// driver is present. Executables that link a backend in (the simulator's memtrain_sim, the CUDA
// tests) register it at start-up instead. docs/cuda.md, "Build".
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace memtrain {

// The device functions of core/device.h that CPU code asks, as the backend implements them
// (core/cuda_device.cpp). The rest of core/device.h (allocation, copies) is only called from
// the backend's own code, which links them directly.
struct CudaDeviceApi {
    int (*device_count)();
    std::string (*device_name)();
    void (*synchronize)();
    void (*select)(int local_rank);
    std::pair<std::size_t, std::size_t> (*memory_info)();
};

// Called once by the backend as it is loaded (a static initialiser).
void register_cuda_backend(const CudaDeviceApi* api);

// Whether the backend is there: registered at start-up, or loaded now (tried once) where a GPU
// driver's device node exists or MEMTRAIN_CUDA_BACKEND names the library. Never throws.
bool load_cuda_backend();

// Why the backend is not there ("" when it is), for error messages.
std::string cuda_backend_status();

}  // namespace memtrain
