// The device layer's CUDA half (core/device.h): device memory, copies, the scratch area and the
// error helpers over the CUDA runtime, and the answers core/device.cpp asks through
// core/cuda_backend.h. Part of the CUDA backend (libmemtrain_cuda.so, or linked into the
// simulator's executables): CPU-only code never links it.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <mutex>

#include "core/cuda_backend.h"
#include "core/device.h"
#include "core/error.h"

namespace memtrain {

// cudaMalloc returns 256-byte aligned blocks; that is the least it can hold for a request.
static constexpr std::size_t kDeviceAlign = 256;

static std::size_t device_reserved_bytes(std::size_t bytes) {
    std::size_t b = bytes == 0 ? 1 : bytes;
    return (b + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign;
}

void cuda_fail(int code, const char* expr, const char* file, int line) {
    fail("{}:{}: {} failed: {} ({})", file, line, expr,
         cudaGetErrorString(static_cast<cudaError_t>(code)), code);
}

void cublas_fail(int status, const char* expr, const char* file, int line) {
    fail("{}:{}: {} failed: {} ({})", file, line, expr,
         cublasLtGetStatusString(static_cast<cublasStatus_t>(status)), status);
}

namespace {

// The backend's answers to core/device.cpp (CudaDeviceApi); it asks only once a device counts.
int api_device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();  // leave no error behind for the next check
        return 0;
    }
    return n;
}

std::string api_device_name() {
    int dev = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    return prop.name;
}

void api_synchronize() {
    MT_CUDA_CHECK(cudaDeviceSynchronize());
}

void api_select(int local_rank) {
    MT_CUDA_CHECK(cudaSetDevice(local_rank % cuda_device_count()));
}

std::pair<std::size_t, std::size_t> api_memory_info() {
    std::size_t free_b = 0, total_b = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return {free_b, total_b};
}

const CudaDeviceApi kApi{api_device_count, api_device_name, api_synchronize, api_select,
                         api_memory_info};
// Registers as the library is loaded (or, linked into an executable, as it starts).
[[maybe_unused]] const bool kRegistered = (register_cuda_backend(&kApi), true);

}  // namespace

void* device_alloc(std::size_t bytes, MemCategory c) {
    if (!cuda_available()) {
        fail("no CUDA device: cannot allocate {} bytes of device memory for {}", bytes,
             category_name(c));
    }
    std::size_t reserved = device_reserved_bytes(bytes);
    void* p = nullptr;
    // Exactly the bytes asked for (the driver rounds on its own): under cudasim, a kernel that
    // reads or writes past them is then caught by AddressSanitizer.
    cudaError_t err = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        MemoryStats s = device_memory().snapshot();
        std::size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaGetLastError();
        // What would make it fit, by what was being allocated.
        const char* advice =
            c == MemCategory::Activations || c == MemCategory::Workspace
                ? "lower train.micro_batch_size or train.seq_len, or recompute activations "
                  "(train.remat = selective, full or budget:BYTES; `memtrain remat CONFIG "
                  "--frontier` lists the options)"
            : c == MemCategory::Parameters || c == MemCategory::Gradients ||
                    c == MemCategory::OptimizerState
                ? "the model states alone do not fit: train.precision = bf16 holds 16 bytes "
                  "per parameter, fp32 16 too but without master copies; a smaller model, or "
                  "`memtrain estimate` for the sizes"
                : "free device memory or use a smaller run";
        fail(
            "out of device memory: could not allocate {} MiB for {} ({} MiB tracked in use, {} "
            "MiB of it {}; the device has {} MiB, {} MiB free): {}. To fit: {}",
            bytes >> 20, category_name(c), s.total_used >> 20, s[c] >> 20, category_name(c),
            total_b >> 20, free_b >> 20, cudaGetErrorString(err), advice);
    }
    // cudaMemset is queued on the legacy stream, which the engines' non-blocking streams do not
    // wait for: the zeros must be there before the buffer is handed out.
    MT_CUDA_CHECK(cudaMemset(p, 0, bytes == 0 ? 1 : bytes));
    MT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    device_memory().on_alloc(c, bytes, reserved);
    return p;
}

void device_free(void* p, std::size_t bytes, MemCategory c) {
    // Called from destructors, so it must not throw. At process exit the runtime may already be
    // unloaded, which is harmless; anything else means the context is broken, and the next checked
    // call reports it, so a line on stderr is enough here.
    cudaError_t err = cudaFree(p);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
        std::fprintf(stderr, "memtrain: cudaFree failed: %s\n", cudaGetErrorString(err));
    }
    device_memory().on_free(c, bytes, device_reserved_bytes(bytes));
}

void copy_to_device(void* dst_device, const void* src_host, std::size_t bytes) {
    if (bytes) MT_CUDA_CHECK(cudaMemcpy(dst_device, src_host, bytes, cudaMemcpyHostToDevice));
}

void copy_to_host(void* dst_host, const void* src_device, std::size_t bytes) {
    if (bytes) MT_CUDA_CHECK(cudaMemcpy(dst_host, src_device, bytes, cudaMemcpyDeviceToHost));
}

void* device_scratch(std::size_t bytes) {
    // Never freed: it lives as long as the process (like cuBLASLt's own workspace), so no
    // destructor runs after the CUDA runtime has gone at exit.
    static std::mutex mu;
    static void* ptr = nullptr;
    static std::size_t size = 0;
    std::lock_guard lock(mu);
    if (bytes > size) {
        constexpr std::size_t kStep = std::size_t{1} << 20;  // grow in whole MiB
        std::size_t want = (bytes + kStep - 1) / kStep * kStep;
        if (ptr) {
            MT_CUDA_CHECK(cudaDeviceSynchronize());
            device_free(ptr, size, MemCategory::Workspace);
            ptr = nullptr;
            size = 0;
        }
        ptr = device_alloc(want, MemCategory::Workspace);
        size = want;
    }
    return ptr;
}

}  // namespace memtrain
