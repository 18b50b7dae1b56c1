// The CUDA engines' device optimizer (see device_optimizer.h).
#include "engine/cuda/device_optimizer.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/device_memory.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

template <typename T>
DeviceOptimizer<T>::DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                    std::size_t offset, std::size_t n, cudaStream_t stream,
                                    Wait wait, uint64_t train_seed)
    : adamw_(cfg.name == "adamw"),
      format_(parse_state_format(cfg.state_format)),
      layout_(layout),
      offset_(offset),
      n_(n),
      stream_(stream),
      wait_(std::move(wait)) {
    if (cfg.master == "none") {
        if (!std::is_same_v<T, __nv_bfloat16>)
            fail("internal: optim.master = \"none\" on the GPU stores bf16 parameters only");
        round_ = {1, bf16_rounding_seed(train_seed), (int64_t)offset};
    } else if constexpr (!std::is_same_v<T, float>) {
        master_ = DeviceBuffer<float>(n, MemCategory::OptimizerState);
    }
    const cuda::MomentLayout lay = cuda::moment_layout(layout, offset, n, format_);
    const MomentBuffer::Plan& p = lay.plan;
    auto alloc = [&](auto& first, auto& second, std::size_t count) {
        using B = std::decay_t<decltype(first)>;
        if (!count) return;
        first = B(count, MemCategory::OptimizerState);
        if (adamw_) second = B(count, MemCategory::OptimizerState);
    };
    alloc(m_, v_, p.fp32);
    alloc(m16_, v16_, p.bf16);
    alloc(mq_, vq_, p.code_bytes);
    alloc(ms_, vs_, p.scales);
    if (p.code_bytes) {
        // Zero codes with zero scales: every moment starts at zero, as in fp32.
        for (DeviceBuffer<uint8_t>* b : {&mq_, &vq_})
            if (b->size()) MT_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, b->bytes(), stream_));
        for (DeviceBuffer<float>* b : {&ms_, &vs_})
            if (b->size()) MT_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, b->bytes(), stream_));
        const std::vector<float> t = cuda::decode_tables(format_);
        tables_ = DeviceBuffer<float>(t.size(), MemCategory::OptimizerState);
        copy_to_device(tables_.data(), t.data(), tables_.bytes());
    }
    chunks_ = DeviceBuffer<cuda::TensorChunk>(lay.chunks.size(), MemCategory::OptimizerState);
    copy_to_device(chunks_.data(), lay.chunks.data(), chunks_.bytes());
    if (!lay.at.empty()) {
        at_ = DeviceBuffer<cuda::StateChunk>(lay.at.size(), MemCategory::OptimizerState);
        copy_to_device(at_.data(), lay.at.data(), at_.bytes());
    }
    if (!lay.grid.empty()) {
        grid_ = DeviceBuffer<cuda::ChunkGrid>(lay.grid.size(), MemCategory::OptimizerState);
        copy_to_device(grid_.data(), lay.grid.data(), grid_.bytes());
    }
    blocks_ = lay.blocks;
    wait_("the optimizer's state");
}

template <typename T>
cuda::MomentStores DeviceOptimizer<T>::moment_stores() {
    cuda::MomentStores st;
    st.m32 = m_.size() ? m_.data() : nullptr;
    st.v32 = v_.size() ? v_.data() : nullptr;
    st.m16 = m16_.size() ? m16_.data() : nullptr;
    st.v16 = v16_.size() ? v16_.data() : nullptr;
    st.at = at_.size() ? at_.data() : nullptr;
    if (tables_.size()) {
        st.bits = format_ == StateFormat::Int8 ? 8 : 4;
        st.mq = mq_.data();
        st.vq = vq_.size() ? vq_.data() : nullptr;
        st.ms = ms_.data();
        st.vs = vs_.size() ? vs_.data() : nullptr;
        st.table_m = tables_.data();
        st.table_v = tables_.data() + 256;
        st.qm = cuda::quant_map(format_, true);
        st.qv = cuda::quant_map(format_, false);
    }
    st.grid = grid_.size() ? grid_.data() : nullptr;
    st.blocks = blocks_;
    return st;
}

template <typename T>
void DeviceOptimizer<T>::step(T* params, const T* grads, const cuda::StepScalars* scalars,
                              cudaStream_t stream) {
    const int nchunks = (int)chunks_.size();
    if (adamw_)
        cuda::adamw_step<T>(params, master(), moment_stores(), grads, chunks_.data(), nchunks,
                            scalars, stream, round_);
    else
        cuda::sgd_step<T>(params, master(), moment_stores(), grads, chunks_.data(), nchunks,
                          scalars, stream, round_);
}

template <typename T>
std::string DeviceOptimizer<T>::describe() const {
    std::string d = device_optimizer_states(master_.size() > 0, adamw_);
    if (format_ != StateFormat::Fp32) d += fmt::format(" in {}", state_format_name(format_));
    return d;
}

template <typename T>
typename DeviceOptimizer<T>::Stores DeviceOptimizer<T>::stores(const std::string& name) {
    if (adamw_ && name == "exp_avg") return {&m_, &m16_, &mq_, &ms_, true};
    if (adamw_ && name == "exp_avg_sq") return {&v_, &v16_, &vq_, &vs_, false};
    if (!adamw_ && name == "momentum_buffer") return {&m_, &m16_, &mq_, &ms_, true};
    fail("internal: the CUDA optimizer has no state tensor '{}'", name);
}

template <typename T>
std::vector<std::string> DeviceOptimizer<T>::state_names() {
    if (adamw_) return {"exp_avg", "exp_avg_sq"};
    return {"momentum_buffer"};
}

template <typename T>
MomentBuffer DeviceOptimizer<T>::to_host(const Stores& st) {
    MomentBuffer b(format_, st.is_signed, layout_, offset_, n_, {}, MemCategory::Other);
    std::vector<uint8_t> bytes(b.bytes());
    uint8_t* at = bytes.data();
    for (auto [src, size] : {std::pair{(const void*)st.f32->data(), st.f32->bytes()},
                             std::pair{(const void*)st.b16->data(), st.b16->bytes()},
                             std::pair{(const void*)st.codes->data(), st.codes->bytes()},
                             std::pair{(const void*)st.scales->data(), st.scales->bytes()}}) {
        if (at + size > bytes.data() + bytes.size())
            fail("internal: the device optimizer's stores exceed the host layout's {} B",
                 bytes.size());
        if (size) MT_CUDA_CHECK(cudaMemcpyAsync(at, src, size, cudaMemcpyDeviceToHost, stream_));
        at += size;
    }
    if (at != bytes.data() + bytes.size())
        fail("internal: the device optimizer's stores ({} B) are not the host layout's ({} B)",
             at - bytes.data(), bytes.size());
    wait_("queued device work");
    b.load_stored(bytes.data());
    return b;
}

template <typename T>
void DeviceOptimizer<T>::to_device(const MomentBuffer& b, const Stores& st) {
    std::vector<uint8_t> bytes(b.bytes());
    b.save_stored(bytes.data());
    const uint8_t* at = bytes.data();
    for (auto [dst, size] : {std::pair{(void*)st.f32->data(), st.f32->bytes()},
                             std::pair{(void*)st.b16->data(), st.b16->bytes()},
                             std::pair{(void*)st.codes->data(), st.codes->bytes()},
                             std::pair{(void*)st.scales->data(), st.scales->bytes()}}) {
        if (size) MT_CUDA_CHECK(cudaMemcpyAsync(dst, at, size, cudaMemcpyHostToDevice, stream_));
        at += size;
    }
    wait_("queued device work");
}

template <typename T>
void DeviceOptimizer<T>::read_state(const std::string& name, float* dst) {
    const Stores st = stores(name);
    if (format_ == StateFormat::Fp32) {
        MT_CUDA_CHECK(
            cudaMemcpyAsync(dst, st.f32->data(), st.f32->bytes(), cudaMemcpyDeviceToHost, stream_));
        wait_("queued device work");
        return;
    }
    to_host(st).read(dst);  // decoded by the CPU's codec
}

template <typename T>
void DeviceOptimizer<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                     const float* src) {
    const Stores st = stores(name);
    if (begin > n_ || n > n_ - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             n_);
    if (format_ == StateFormat::Fp32) {
        MT_CUDA_CHECK(cudaMemcpyAsync(st.f32->data() + begin, src, n * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_));
        wait_("queued device work");
        return;
    }
    // The whole range as floats, the write over it, encoded again by the CPU's codec (a block
    // the write does not touch decodes and encodes to the same bytes).
    MomentBuffer b = to_host(st);
    std::vector<float> all(n_);
    b.read(all.data());
    std::copy(src, src + n, all.data() + begin);
    b.write(all.data());
    to_device(b, st);
}

template <typename T>
void download_decoded(float* dst, const T* src, std::size_t n, cudaStream_t stream,
                      const std::function<void(const char*)>& wait) {
    std::vector<T> stored(n);
    if (n)
        MT_CUDA_CHECK(
            cudaMemcpyAsync(stored.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    wait("a weight transfer");
    for (std::size_t i = 0; i < n; i++) dst[i] = cuda::to_fp32(stored[i]);
}

template <typename T>
void upload_rounded(T* dst, const float* src, std::size_t n, cudaStream_t stream,
                    const std::function<void(const char*)>& wait) {
    std::vector<T> rounded(n);
    for (std::size_t i = 0; i < n; i++) rounded[i] = cuda::to_storage<T>(src[i]);
    if (n)
        MT_CUDA_CHECK(
            cudaMemcpyAsync(dst, rounded.data(), n * sizeof(T), cudaMemcpyHostToDevice, stream));
    wait("a weight transfer");
}

#define MT_INSTANTIATE(T)                                                          \
    template void download_decoded<T>(float*, const T*, std::size_t, cudaStream_t, \
                                      const std::function<void(const char*)>&);    \
    template void upload_rounded<T>(T*, const float*, std::size_t, cudaStream_t,   \
                                    const std::function<void(const char*)>&);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

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
