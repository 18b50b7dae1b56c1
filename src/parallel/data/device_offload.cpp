// ZeRO-Offload for the CUDA engine (see device_offload.h): the pinned buffer, the download stream
// and the host update.
#include "parallel/data/device_offload.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/device.h"
#include "kernels/cuda/host_convert.h"

namespace memtrain {

using cuda::to_fp32;
using cuda::to_storage;

template <typename T>
DeviceOffload<T>::DeviceOffload(const OptimConfig& optim, const ParamLayout& layout,
                                std::size_t first, std::size_t count, cudaStream_t compute,
                                bool stream_grads)
    : layout_(layout),
      first_(first),
      count_(count),
      compute_(compute),
      state_bytes_(optimizer_state_bytes(optim, layout, first, count)),
      state_name_(describe_optimizer_state(optim)) {
    opt_ = make_optimizer(optim, layout_, first_, count_);
    master_ = Buffer<float>(count_, MemCategory::OptimizerState);
    grads_ = Buffer<float>(count_, MemCategory::Gradients);
    MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_), pinned_bytes()));
    // Pinned host memory both ways: gradients down, updated parameters up.
    host_memory().on_alloc(MemCategory::Communication, pinned_bytes(), pinned_bytes());
    if (stream_grads) down_ = std::make_unique<UnitGradStream>(compute_, layout_.units.size());
}

template <typename T>
DeviceOffload<T>::~DeviceOffload() {
    cudaStreamSynchronize(compute_);
    down_.reset();
    cudaFreeHost(pinned_);
    host_memory().on_free(MemCategory::Communication, pinned_bytes(), pinned_bytes());
}

template <typename T>
void DeviceOffload<T>::attach(CudaGPT<T>& model) {
    model_ = &model;
    if (down_) model.set_grads_done_hook([this](int u) { start_unit_download(u); });
}

template <typename T>
void DeviceOffload<T>::start_unit_download(int u) {
    if (!down_->follow(u)) return;
    const ParamUnit& unit = layout_.units[u];
    MT_CUDA_CHECK(cudaMemcpyAsync(pinned_ + unit.begin, model_->grads() + unit.begin,
                                  unit.size() * sizeof(T), cudaMemcpyDeviceToHost, down_->get()));
}

template <typename T>
void DeviceOffload<T>::download(const T* grads) {
    // Streamed unit by unit during the backward, or now, with the step's results (several ranks:
    // the reduced shard; CUDA graphs, whose capture would take the side stream in).
    if (!down_)
        MT_CUDA_CHECK(
            cudaMemcpyAsync(pinned_, grads, pinned_bytes(), cudaMemcpyDeviceToHost, compute_));
}

template <typename T>
void DeviceOffload<T>::update(double lr, float grad_scale, T* params) {
    float* g = grads_.data();
    float* master = master_.data();
    T* pin = pinned_;
    // Unit by unit (the part of each unit inside this rank's range), so each unit's new
    // parameters go up to the GPU while the host updates the next (step_part gives the bits of
    // one whole step). The next step's gradients come down after these copies in stream order,
    // and the host writes the pinned buffer again only after that step's wait.
    const std::size_t first = first_, last = first_ + count_;
    for (const ParamUnit& unit : layout_.units) {
        const std::size_t lo = std::max(unit.begin, first), hi = std::min(unit.end, last);
        if (lo >= hi) continue;
        const int64_t b = (int64_t)(lo - first), e = (int64_t)(hi - first);
#pragma omp parallel for schedule(static)
        for (int64_t i = b; i < e; i++) g[i] = to_fp32(pin[i]) * grad_scale;
        opt_->step_part(master + b, g + b, lr, (std::size_t)b, (std::size_t)(e - b));
#pragma omp parallel for schedule(static)
        for (int64_t i = b; i < e; i++) pin[i] = to_storage<T>(master[i]);
        MT_CUDA_CHECK(cudaMemcpyAsync(params + b, pin + b, (e - b) * sizeof(T),
                                      cudaMemcpyHostToDevice, compute_));
    }
    opt_->advance();
}

template <typename T>
std::string DeviceOffload<T>::memory_line() const {
    // This rank's range: the moments in their format.
    const double moments = count_ ? (double)state_bytes_ / (double)count_ : 0.0;
    return fmt::format(
        "{:<16} {:>12}  (train.offload_optimizer, bytes per parameter in host memory: fp32 "
        "master 4 + moments {:.3g} + fp32 gradients 4 + pinned transfer buffer {}; the moments: "
        "{})\n",
        "optimizer (host)",
        fmt::format("{:.1f} MiB",
                    (master_.bytes() + state_bytes_ + grads_.bytes() + pinned_bytes()) / 1048576.0),
        moments, sizeof(T), state_name_);
}

template class DeviceOffload<float>;
template class DeviceOffload<__nv_bfloat16>;
template class DeviceOffload<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
