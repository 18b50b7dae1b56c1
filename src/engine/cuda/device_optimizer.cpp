// The CUDA engines' device optimizer (see device_optimizer.h).
#include "engine/cuda/device_optimizer.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/device_memory.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

template <typename T>
DeviceOptimizer<T>::DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                    std::size_t offset, std::size_t n, cudaStream_t stream,
                                    Wait wait)
    : adamw_(cfg.name == "adamw"),
      format_(parse_state_format(cfg.state_format)),
      offset_(offset),
      n_(n),
      stream_(stream),
      wait_(std::move(wait)) {
    if constexpr (!std::is_same_v<T, float>)
        master_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    host_chunks_ = cuda::tensor_chunks(layout, offset, n);
    std::size_t n32 = 0, n16 = 0;
    host_at_ = cuda::state_chunks(layout, offset, n, host_chunks_, format_, &n32, &n16);
    m_ = DeviceBuffer<float>(n32, MemCategory::OptimizerState);
    if (adamw_) v_ = DeviceBuffer<float>(n32, MemCategory::OptimizerState);
    if (n16) {
        m16_ = DeviceBuffer<__nv_bfloat16>(n16, MemCategory::OptimizerState);
        if (adamw_) v16_ = DeviceBuffer<__nv_bfloat16>(n16, MemCategory::OptimizerState);
    }
    chunks_ = DeviceBuffer<cuda::TensorChunk>(host_chunks_.size(), MemCategory::OptimizerState);
    copy_to_device(chunks_.data(), host_chunks_.data(), chunks_.bytes());
    if (!host_at_.empty()) {
        at_ = DeviceBuffer<cuda::StateChunk>(host_at_.size(), MemCategory::OptimizerState);
        copy_to_device(at_.data(), host_at_.data(), at_.bytes());
    }
}

template <typename T>
cuda::MomentStores DeviceOptimizer<T>::moment_stores() {
    cuda::MomentStores st;
    st.m32 = m_.size() ? m_.data() : nullptr;
    st.v32 = v_.size() ? v_.data() : nullptr;
    st.m16 = m16_.size() ? m16_.data() : nullptr;
    st.v16 = v16_.size() ? v16_.data() : nullptr;
    st.at = at_.size() ? at_.data() : nullptr;
    return st;
}

template <typename T>
void DeviceOptimizer<T>::step(T* params, const T* grads, const cuda::StepScalars* scalars,
                              cudaStream_t stream) {
    const int nchunks = (int)chunks_.size();
    if (adamw_)
        cuda::adamw_step<T>(params, master(), moment_stores(), grads, chunks_.data(), nchunks,
                            scalars, stream);
    else
        cuda::sgd_step<T>(params, master(), moment_stores(), grads, chunks_.data(), nchunks,
                          scalars, stream);
}

template <typename T>
std::string DeviceOptimizer<T>::describe() const {
    std::string d = device_optimizer_states((int)sizeof(T), adamw_);
    if (format_ != StateFormat::Fp32) d += fmt::format(" in {}", state_format_name(format_));
    return d;
}

template <typename T>
std::pair<DeviceBuffer<float>*, DeviceBuffer<__nv_bfloat16>*> DeviceOptimizer<T>::stores(
    const std::string& name) {
    if (adamw_ && name == "exp_avg") return {&m_, &m16_};
    if (adamw_ && name == "exp_avg_sq") return {&v_, &v16_};
    if (!adamw_ && name == "momentum_buffer") return {&m_, &m16_};
    fail("internal: the CUDA optimizer has no state tensor '{}'", name);
}

template <typename T>
std::vector<std::string> DeviceOptimizer<T>::state_names() {
    if (adamw_) return {"exp_avg", "exp_avg_sq"};
    return {"momentum_buffer"};
}

template <typename T>
void DeviceOptimizer<T>::read_state(const std::string& name, float* dst) {
    auto [f32, b16] = stores(name);
    if (format_ == StateFormat::Fp32) {
        MT_CUDA_CHECK(
            cudaMemcpyAsync(dst, f32->data(), f32->bytes(), cudaMemcpyDeviceToHost, stream_));
        wait_("queued device work");
        return;
    }
    // Both stores to the host, then each chunk's floats to its place in the range.
    std::vector<float> h32(f32->size());
    std::vector<uint16_t> h16(b16->size());
    if (f32->size())
        MT_CUDA_CHECK(cudaMemcpyAsync(h32.data(), f32->data(), f32->bytes(), cudaMemcpyDeviceToHost,
                                      stream_));
    if (b16->size())
        MT_CUDA_CHECK(cudaMemcpyAsync(h16.data(), b16->data(), b16->bytes(), cudaMemcpyDeviceToHost,
                                      stream_));
    wait_("queued device work");
    std::fill(dst, dst + n_, 0.0f);
    for (std::size_t k = 0; k < host_chunks_.size(); k++) {
        const cuda::TensorChunk& c = host_chunks_[k];
        const cuda::StateChunk& a = host_at_[k];
        for (int32_t i = 0; i < c.n; i++)
            dst[c.begin + i] = a.fp32 ? h32[a.at + i] : bf16_to_f32(h16[a.at + i]);
    }
}

template <typename T>
void DeviceOptimizer<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                     const float* src) {
    auto [f32, b16] = stores(name);
    if (begin > n_ || n > n_ - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             n_);
    if (format_ == StateFormat::Fp32) {
        MT_CUDA_CHECK(cudaMemcpyAsync(f32->data() + begin, src, n * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_));
        wait_("queued device work");
        return;
    }
    // The whole range as floats, the write over it, every chunk stored again (bf16 to nearest
    // even, as the CPU's MomentBuffer stores a written bf16 state).
    std::vector<float> all(n_);
    read_state(name, all.data());
    std::copy(src, src + n, all.data() + begin);
    std::vector<float> h32(f32->size());
    std::vector<uint16_t> h16(b16->size());
    for (std::size_t k = 0; k < host_chunks_.size(); k++) {
        const cuda::TensorChunk& c = host_chunks_[k];
        const cuda::StateChunk& a = host_at_[k];
        for (int32_t i = 0; i < c.n; i++) {
            const float x = all[c.begin + i];
            if (a.fp32)
                h32[a.at + i] = x;
            else
                h16[a.at + i] = f32_to_bf16(x);
        }
    }
    if (f32->size())
        MT_CUDA_CHECK(cudaMemcpyAsync(f32->data(), h32.data(), f32->bytes(), cudaMemcpyHostToDevice,
                                      stream_));
    if (b16->size())
        MT_CUDA_CHECK(cudaMemcpyAsync(b16->data(), h16.data(), b16->bytes(), cudaMemcpyHostToDevice,
                                      stream_));
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
