// ZeRO-Offload for the CUDA engine (see device_offload.h): the pinned buffer, the download stream
// and the host update.
#include "parallel/data/device_offload.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include <fmt/format.h>

#include "core/device.h"
#include "kernels/cuda/host_convert.h"
#include "optim/state_format.h"

namespace memtrain {

using cuda::to_fp32;
using cuda::to_storage;

template <typename T>
DeviceOffload<T>::DeviceOffload(const OptimConfig& optim, const ParamLayout& layout,
                                std::size_t first, std::size_t count, cudaStream_t compute,
                                bool stream_grads, uint64_t train_seed)
    : layout_(layout),
      first_(first),
      count_(count),
      compute_(compute),
      state_bytes_(optimizer_state_bytes(optim, layout, first, count)),
      state_name_(describe_optimizer_state(optim)) {
    opt_ = make_optimizer(optim, layout_, first_, count_);
    bf16_weights_ = optim.master == "none";
    if (bf16_weights_) {
        if (!std::is_same_v<T, __nv_bfloat16>)
            fail("internal: optim.master = \"none\" offloads bf16 parameters only");
        round_ = Buffer<float>(std::min(kRoundChunk, count_), MemCategory::OptimizerState);
        rounding_seed_ = bf16_rounding_seed(train_seed);
    } else {
        master_ = Buffer<float>(count_, MemCategory::OptimizerState);
    }
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
    T* pin = pinned_;
    const std::size_t first = first_, last = first_ + count_;
    if (bf16_weights_) {
        // No host master: every gradient into fp32 first, then the device's bf16 weights down
        // through the pinned buffer, each unit stepped a chunk at a time in fp32 and rounded
        // stochastically (the draws of the global index, as the device optimizer's), and up.
        const int64_t n = (int64_t)count_;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) g[i] = to_fp32(pin[i]) * grad_scale;
        MT_CUDA_CHECK(
            cudaMemcpyAsync(pin, params, pinned_bytes(), cudaMemcpyDeviceToHost, compute_));
        MT_CUDA_CHECK(cudaStreamSynchronize(compute_));
        const uint64_t seed = rounding_seed_, step = (uint64_t)opt_->steps_taken() + 1;
        float* w = round_.data();
        for (const ParamUnit& unit : layout_.units) {
            const std::size_t lo = std::max(unit.begin, first), hi = std::min(unit.end, last);
            if (lo >= hi) continue;
            // Chunks cut at multiples of kRoundChunk of the flat buffer, so that no chunk cuts an
            // int8 / int4 state block (the grid's cells lie on multiples of 256).
            for (std::size_t x = lo; x < hi;) {
                const std::size_t y = std::min(hi, (x / kRoundChunk + 1) * kRoundChunk);
                const std::size_t a = x - first, b = y - first;
                x = y;
                const int64_t m = (int64_t)(b - a);
#pragma omp parallel for simd schedule(static)
                for (int64_t i = 0; i < m; i++) w[i] = to_fp32(pin[a + i]);
                opt_->step_part(w, g + a, lr, a, b - a);
#pragma omp parallel for schedule(static)
                for (int64_t i = 0; i < m; i++) {
                    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
                        __nv_bfloat16_raw raw;
                        raw.x = f32_to_bf16_stochastic(w[i], seed, step, first + a + i);
                        pin[a + i] = __nv_bfloat16(raw);
                    }
                }
            }
            MT_CUDA_CHECK(cudaMemcpyAsync(params + (lo - first), pin + (lo - first),
                                          (hi - lo) * sizeof(T), cudaMemcpyHostToDevice, compute_));
        }
        opt_->advance();
        return;
    }
    float* master = master_.data();
    // Unit by unit (the part of each unit inside this rank's range), so each unit's new
    // parameters go up to the GPU while the host updates the next (step_part gives the bits of
    // one whole step). The next step's gradients come down after these copies in stream order,
    // and the host writes the pinned buffer again only after that step's wait.
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
    const std::string master =
        bf16_weights_ ? fmt::format("no master (optim.master = none: a {:.1f} MiB update scratch)",
                                    round_.bytes() / 1048576.0)
                      : std::string("fp32 master 4");
    return fmt::format(
        "{:<16} {:>12}  (train.offload_optimizer, bytes per parameter in host memory: {} + "
        "moments {:.3g} + fp32 gradients 4 + pinned transfer buffer {}; the moments: {})\n",
        "optimizer (host)",
        fmt::format("{:.1f} MiB", (master_.bytes() + round_.bytes() + state_bytes_ +
                                   grads_.bytes() + pinned_bytes()) /
                                      1048576.0),
        master, moments, sizeof(T), state_name_);
}

template class DeviceOffload<float>;
template class DeviceOffload<__nv_bfloat16>;
template class DeviceOffload<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
