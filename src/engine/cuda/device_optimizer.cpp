// The CUDA engines' device optimizer (see device_optimizer.h).
#include "engine/cuda/device_optimizer.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/device_memory.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

template <typename T>
DeviceOptimizer<T>::DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                    std::size_t offset, std::size_t n, cudaStream_t stream,
                                    Wait wait)
    : adamw_(cfg.name == "adamw"), offset_(offset), n_(n), stream_(stream), wait_(std::move(wait)) {
    if constexpr (!std::is_same_v<T, float>)
        master_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    m_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    if (adamw_) v_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    const auto chunks = cuda::tensor_chunks(layout, offset, n);
    chunks_ = DeviceBuffer<cuda::TensorChunk>(chunks.size(), MemCategory::OptimizerState);
    copy_to_device(chunks_.data(), chunks.data(), chunks_.bytes());
}

template <typename T>
void DeviceOptimizer<T>::step(T* params, const T* grads, const cuda::StepScalars* scalars,
                              cudaStream_t stream) {
    const int nchunks = (int)chunks_.size();
    if (adamw_)
        cuda::adamw_step<T>(params, master(), m_.data(), v_.data(), grads, chunks_.data(), nchunks,
                            scalars, stream);
    else
        cuda::sgd_step<T>(params, master(), m_.data(), grads, chunks_.data(), nchunks, scalars,
                          stream);
}

template <typename T>
std::size_t DeviceOptimizer<T>::bytes_per_param() const {
    return device_optimizer_bytes_per_param((int)sizeof(T), adamw_);
}

template <typename T>
std::string DeviceOptimizer<T>::describe() const {
    return device_optimizer_states((int)sizeof(T), adamw_);
}

template <typename T>
DeviceBuffer<float>& DeviceOptimizer<T>::state(const std::string& name) {
    if (adamw_ && name == "exp_avg") return m_;
    if (adamw_ && name == "exp_avg_sq") return v_;
    if (!adamw_ && name == "momentum_buffer") return m_;
    fail("internal: the CUDA optimizer has no state tensor '{}'", name);
}

template <typename T>
std::vector<std::string> DeviceOptimizer<T>::state_names() {
    if (adamw_) return {"exp_avg", "exp_avg_sq"};
    return {"momentum_buffer"};
}

template <typename T>
void DeviceOptimizer<T>::read_state(const std::string& name, float* dst) {
    DeviceBuffer<float>& b = state(name);
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, b.data(), b.bytes(), cudaMemcpyDeviceToHost, stream_));
    wait_("queued device work");
}

template <typename T>
void DeviceOptimizer<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                     const float* src) {
    DeviceBuffer<float>& b = state(name);
    if (begin > b.size() || n > b.size() - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             b.size());
    MT_CUDA_CHECK(
        cudaMemcpyAsync(b.data() + begin, src, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    wait_("queued device work");
}

std::string device_in_use_line() {
    std::size_t free_b = 0, total_b = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return fmt::format(
        "{:<16} {:>8.1f} MiB  of {:.1f} MiB (the driver's count: the CUDA context, library code "
        "and handles, and page granularity beyond the tracked tensors)\n",
        "device in use", (total_b - free_b) / 1048576.0, total_b / 1048576.0);
}

void use_rank_device(const dist::Communicator& comm) {
    if (!cuda_available()) fail("train.device = \"cuda\", but no CUDA device answers");
    select_device(comm.local_rank());
}

template class DeviceOptimizer<float>;
template class DeviceOptimizer<__nv_bfloat16>;
template class DeviceOptimizer<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
