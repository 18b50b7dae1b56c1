// The CUDA device seen from plain C++: whether one answers, its name, a second memory tracker for
// device bytes, and DeviceBuffer<T>, the device twin of Buffer<T>. Callers need no #ifdef: where
// no CUDA backend is there (no GPU driver, a build without CUDA) cuda_available() is false. The
// questions (cuda_available ... device_memory_info) and device_memory() work in every program;
// allocation, copies, the scratch area and the error helpers are the backend's
// (core/cuda_device.cpp), linked only into code that runs on the device (core/cuda_backend.h).
//
// Example:
//     if (cuda_available()) {
//         DeviceBuffer<float> acts(n, MemCategory::Activations);  // counted in device_memory()
//         copy_to_device(acts.data(), host.data(), acts.bytes());
//         device_memory().snapshot()[MemCategory::Activations];    // == 4 * n bytes
//     }
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "core/allocator.h"

namespace memtrain {

// True when built with CUDA and at least one device answers (cudaGetDeviceCount succeeds and
// reports one or more). Never throws; the answer is computed once.
bool cuda_available();
// Number of devices (0 without CUDA, without a driver, or without a GPU).
int cuda_device_count();
// Name of the current device ("NVIDIA H100 80GB HBM3"), or "none".
std::string cuda_device_name();
// Blocks until all work queued on the current device has finished (no-op without CUDA).
void device_synchronize();
// Makes device local_rank % cuda_device_count() this process's (one GPU per rank of a node).
void select_device(int local_rank);
// The current device's free and total bytes (cudaMemGetInfo); {0, 0} without a device.
std::pair<std::size_t, std::size_t> device_memory_info();

// The process-wide tracker for device memory (same type and categories as host_memory()).
MemoryTracker& device_memory();

// cudaMalloc'ed memory registered with device_memory(): `used` is the bytes asked for, `reserved`
// rounds up to cudaMalloc's 256-byte granularity (the driver may hold more: it maps memory in
// pages of 2 MiB). The memory is zeroed, as Buffer<T>'s is. Fails (memtrain::Error) naming the
// category and the bytes in use when the device is out of memory or absent.
void* device_alloc(std::size_t bytes, MemCategory c);
void device_free(void* p, std::size_t bytes, MemCategory c);

// Synchronous copies between host and device memory (cudaMemcpy).
void copy_to_device(void* dst_device, const void* src_host, std::size_t bytes);
void copy_to_host(void* dst_host, const void* src_device, std::size_t bytes);

// A process-wide scratch area on the device for kernels that need temporary room (partial sums,
// index buckets), counted under Workspace. It only grows; growing synchronises the device first,
// so memory a queued kernel still reads is never freed under it. Valid until the next call: one
// stream's kernels may use it in turn, two streams at once may not.
void* device_scratch(std::size_t bytes);

// Reports a failed CUDA runtime / cuBLASLt call as a memtrain::Error "file:line: expr: reason".
[[noreturn]] void cuda_fail(int code, const char* expr, const char* file, int line);
[[noreturn]] void cublas_fail(int status, const char* expr, const char* file, int line);

// An owning, move-only, zero-initialised array of T in device memory, in one category.
template <typename T>
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    DeviceBuffer(std::size_t n, MemCategory c) : n_(n), cat_(c) {
        data_ = static_cast<T*>(device_alloc(array_bytes(n, sizeof(T)), c));
    }
    ~DeviceBuffer() { reset(); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        if (this != &o) {
            reset();
            data_ = std::exchange(o.data_, nullptr);
            n_ = std::exchange(o.n_, 0);
            cat_ = o.cat_;
        }
        return *this;
    }
    void reset() {
        if (data_) device_free(data_, n_ * sizeof(T), cat_);
        data_ = nullptr;
        n_ = 0;
    }
    T* data() { return data_; }
    const T* data() const { return data_; }
    std::size_t size() const { return n_; }
    std::size_t bytes() const { return n_ * sizeof(T); }
    MemCategory category() const { return cat_; }

  private:
    T* data_ = nullptr;
    std::size_t n_ = 0;
    MemCategory cat_ = MemCategory::Other;
};

}  // namespace memtrain

// Checks a CUDA runtime call (cudaError_t) or a cuBLASLt call (cublasStatus_t); on failure throws
// memtrain::Error with the file, line, the call's text and the library's description.
#define MT_CUDA_CHECK(call)                                                                   \
    do {                                                                                      \
        auto mt_cuda_err_ = (call);                                                           \
        if (static_cast<int>(mt_cuda_err_) != 0)                                              \
            ::memtrain::cuda_fail(static_cast<int>(mt_cuda_err_), #call, __FILE__, __LINE__); \
    } while (0)
#define MT_CUBLAS_CHECK(call)                                                                    \
    do {                                                                                         \
        auto mt_cublas_st_ = (call);                                                             \
        if (static_cast<int>(mt_cublas_st_) != 0)                                                \
            ::memtrain::cublas_fail(static_cast<int>(mt_cublas_st_), #call, __FILE__, __LINE__); \
    } while (0)
