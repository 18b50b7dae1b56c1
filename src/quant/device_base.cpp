// QuantizedDeviceBase (quant/device_base.h): the packed base copied to the device and decoded
// unit by unit by the dequantization kernels.
#include "quant/device_base.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "quant/quant.h"

namespace memtrain {

namespace {

std::size_t round4(std::size_t n) {
    return (n + 3) / 4 * 4;
}

}  // namespace

template <typename T>
typename QuantizedDeviceBase<T>::Bytes QuantizedDeviceBase<T>::predicted_bytes(
    const ModelConfig& cfg, const quant::BaseQuant& q) {
    const quant::DeviceBaseBytes b = quant::device_base_bytes(cfg, q, (int)sizeof(T), kSlots);
    return Bytes{b.params, b.slots};
}

template <typename T>
QuantizedDeviceBase<T>::QuantizedDeviceBase(const quant::QuantizedParamStore& host,
                                            cudaStream_t stream)
    : q_(host.quant()), layout_(host.layout()), stream_(stream) {
    // Lay everything out on the host first, then copy it up in two transfers.
    std::vector<T> plain;
    std::vector<unsigned char> packed;
    auto put = [&packed](const void* src, std::size_t bytes) {
        const std::size_t at = packed.size();
        packed.resize(at + round4(bytes));
        if (bytes) std::memcpy(packed.data() + at, src, bytes);
        return at;
    };
    std::size_t block = 0;
    units_.resize(layout_.units.size());
    for (std::size_t u = 0; u < layout_.units.size(); u++) {
        const quant::QuantizedParamStore::UnitView v = host.unit_view((int)u);
        Unit& un = units_[u];
        for (const auto& p : v.plain) {
            un.runs.push_back({p.offset, p.count, plain.size()});
            for (std::size_t i = 0; i < p.count; i++)
                plain.push_back(cuda::to_storage<T>(p.values[i]));
        }
        for (const auto& m : v.packed) {
            Matrix d;
            d.offset = m.offset;
            d.rows = m.rows;
            d.cols = m.cols;
            d.codes = put(m.codes.data(), m.codes.size_bytes());
            d.scales = put(m.scales.data(), m.scales.size_bytes());
            d.absmax_q = put(m.absmax_q.data(), m.absmax_q.size_bytes());
            d.absmax_scale = put(m.absmax_scale.data(), m.absmax_scale.size_bytes());
            un.matrices.push_back(d);
        }
        if (!un.matrices.empty()) block = std::max(block, layout_.units[u].size());
    }
    plain_ = DeviceBuffer<T>(plain.size(), MemCategory::Parameters);
    copy_to_device(plain_.data(), plain.data(), plain_.bytes());
    if (!packed.empty()) {
        packed_ = DeviceBuffer<unsigned char>(packed.size(), MemCategory::Parameters);
        copy_to_device(packed_.data(), packed.data(), packed_.bytes());
    }
    if (block > 0)
        for (auto& s : slots_) s = DeviceBuffer<T>(block, MemCategory::Workspace);
}

template <typename T>
T* QuantizedDeviceBase<T>::acquire_params(int u) {
    if (u < 0 || u >= (int)units_.size())
        fail("internal: QuantizedDeviceBase::acquire_params({}) of {} units", u, units_.size());
    Unit& un = units_[(std::size_t)u];
    if (un.matrices.empty()) {  // embedding, head: whole as T
        un.held++;
        return plain_.data() + un.runs.at(0).at;
    }
    if (un.slot < 0) {
        int best = -1;
        for (int s = 0; s < kSlots; s++) {
            if (slot_unit_[s] >= 0 && units_[(std::size_t)slot_unit_[s]].held > 0) continue;
            if (best < 0 || slot_use_[s] < slot_use_[best]) best = s;
        }
        if (best < 0) fail("internal: both decode slots of the quantized base hold acquired units");
        if (slot_unit_[best] >= 0) units_[(std::size_t)slot_unit_[best]].slot = -1;
        T* out = slots_[best].data();
        for (const Run& r : un.runs)
            MT_CUDA_CHECK(cudaMemcpyAsync(out + r.offset, plain_.data() + r.at, r.count * sizeof(T),
                                          cudaMemcpyDeviceToDevice, stream_));
        const unsigned char* p = packed_.data();
        for (const Matrix& m : un.matrices) {
            const auto* codes = p + m.codes;
            const auto* scales = reinterpret_cast<const uint16_t*>(p + m.scales);
            switch (q_.format) {
                case quant::BaseFormat::Int8:
                    cuda::dequant_int8<T>(out + m.offset, codes, scales, m.rows, m.cols, stream_);
                    break;
                case quant::BaseFormat::Int4:
                    cuda::dequant_int4<T>(out + m.offset, codes, scales, m.rows, m.cols, q_.group,
                                          stream_);
                    break;
                case quant::BaseFormat::Nf4: {
                    cuda::Nf4Levels levels;
                    std::copy_n(quant::kNf4Levels, 16, levels.v);
                    cuda::dequant_nf4<T>(
                        out + m.offset, codes, p + m.absmax_q,
                        reinterpret_cast<const float*>(p + m.absmax_scale), m.rows, m.cols,
                        q_.group, quant::QuantizedParamStore::nf4_dq_block(), levels, stream_);
                    break;
                }
            }
        }
        decodes_++;
        slot_unit_[best] = u;
        un.slot = best;
    }
    slot_use_[un.slot] = ++clock_;
    un.held++;
    return slots_[un.slot].data();
}

template <typename T>
void QuantizedDeviceBase<T>::release_params(int u) {
    Unit& un = units_.at((std::size_t)u);
    if (un.held <= 0) fail("internal: QuantizedDeviceBase::release_params({}) without acquire", u);
    un.held--;
}

template <typename T>
T* QuantizedDeviceBase<T>::acquire_grads(int u) {
    fail("internal: the quantized base is frozen: no gradients for unit {}", u);
}

template class QuantizedDeviceBase<float>;
template class QuantizedDeviceBase<__nv_bfloat16>;
template class QuantizedDeviceBase<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
