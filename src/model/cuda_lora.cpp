// LoRA's adapters and QLoRA's packed base on the GPU (see cuda_lora.h).
#include "model/cuda_lora.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "model/lora_mask.h"
#include "quant/quant.h"

namespace memtrain {

// ---- adapters ---------------------------------------------------------------------------------

template <typename T>
CudaLora<T>::CudaLora(const LoraConfig& cfg, const LoraLayout& layout, T* params, T* grads,
                      uint64_t dropout_seed, cudaStream_t stream)
    : cfg_(cfg),
      layout_(&layout),
      params_(params),
      grads_(grads),
      seed_(dropout_seed),
      stream_(stream) {}

template <typename T>
std::size_t CudaLora<T>::workspace_bytes(const LoraConfig& cfg, const LoraLayout& layout, int N) {
    return lora_workspace_bytes(cfg, layout, N) / sizeof(float) * sizeof(T);
}

template <typename T>
void CudaLora<T>::prepare(int N) {
    if (N == rows_) return;
    const std::size_t r = (std::size_t)layout_->rank, n = (std::size_t)N;
    for (auto* b : {&h_, &dh_, &xd_, &tmp_}) b->reset();
    h_ = DeviceBuffer<T>(n * r, MemCategory::Workspace);
    dh_ = DeviceBuffer<T>(n * r, MemCategory::Workspace);
    if (cfg_.dropout > 0) {
        xd_ = DeviceBuffer<T>(n * (std::size_t)layout_->max_in, MemCategory::Workspace);
        tmp_ = DeviceBuffer<T>(n * (std::size_t)layout_->max_in, MemCategory::Workspace);
    }
    rows_ = N;
}

template <typename T>
uint64_t CudaLora<T>::key(const LoraSite& s) const {
    return lora_mask::site_key(seed_, micro_batch_, (uint64_t)(&s - layout_->sites.data()));
}

template <typename T>
const T* CudaLora<T>::dropped(const LoraSite& s, const T* x, int N) {
    if (!(training_ && cfg_.dropout > 0)) return x;
    cuda::lora_dropout<T>(xd_.data(), x, (int64_t)N * s.in, key(s), cfg_.dropout, stream_);
    return xd_.data();
}

// The GEMMs of LoraAdapters::forward and backward (model/lora.cpp), in the same order.
template <typename T>
void CudaLora<T>::forward(int block, BlockLinear linear, const T* x, T* y, int N) {
    prepare(N);
    const int r = layout_->rank;
    const std::size_t base = layout_->params.units[(std::size_t)block].begin;
    for (const LoraSite& s : layout_->sites_of(block, linear)) {
        const int in = (int)s.in, out = (int)s.out;
        const T* A = params_ + base + s.a;
        const T* B = params_ + base + s.b;
        const T* xd = dropped(s, x, N);
        // h (N, r) = drop(x) A^T; y[:, col0 : col0 + out] += scale h B^T.
        cuda::gemm_rows<T>(false, true, N, r, in, 1.0f, xd, in, A, in, 0.0f, h_.data(), r, stream_);
        cuda::gemm_rows<T>(false, true, N, out, r, cfg_.scale(), h_.data(), r, B, r, 1.0f,
                           y + s.col0, s.linear_out, stream_);
    }
}

template <typename T>
void CudaLora<T>::backward(int block, BlockLinear linear, const T* x, const T* dy, T* dx, int N) {
    prepare(N);
    const int r = layout_->rank;
    const float scale = cfg_.scale();
    const std::size_t base = layout_->params.units[(std::size_t)block].begin;
    for (const LoraSite& s : layout_->sites_of(block, linear)) {
        const int in = (int)s.in, out = (int)s.out;
        const int64_t ld = s.linear_out;
        const T* A = params_ + base + s.a;
        const T* B = params_ + base + s.b;
        T* dA = grads_ + base + s.a;
        T* dB = grads_ + base + s.b;
        const T* dys = dy + s.col0;
        const T* xd = dropped(s, x, N);
        cuda::gemm_rows<T>(false, true, N, r, in, 1.0f, xd, in, A, in, 0.0f, h_.data(), r, stream_);
        // dB (out, r) += scale dy^T h;  dh (N, r) = scale dy B;  dA (r, in) += dh^T drop(x).
        cuda::gemm_rows<T>(true, false, out, r, N, scale, dys, ld, h_.data(), r, 1.0f, dB, r,
                           stream_);
        cuda::gemm_rows<T>(false, false, N, r, out, scale, dys, ld, B, r, 0.0f, dh_.data(), r,
                           stream_);
        cuda::gemm_rows<T>(true, false, r, in, N, 1.0f, dh_.data(), r, xd, in, 1.0f, dA, in,
                           stream_);
        // dx += (dh A) * mask / (1 - p).
        if (!(training_ && cfg_.dropout > 0)) {
            cuda::gemm_rows<T>(false, false, N, in, r, 1.0f, dh_.data(), r, A, in, 1.0f, dx, in,
                               stream_);
            continue;
        }
        cuda::gemm_rows<T>(false, false, N, in, r, 1.0f, dh_.data(), r, A, in, 0.0f, tmp_.data(),
                           in, stream_);
        cuda::lora_masked_add<T>(dx, tmp_.data(), (int64_t)N * in, key(s), cfg_.dropout, stream_);
    }
}

// ---- the packed base --------------------------------------------------------------------------

namespace {

std::size_t round4(std::size_t n) {
    return (n + 3) / 4 * 4;
}

// A matrix's device bytes: each part starts 4-byte aligned.
std::size_t device_matrix_bytes(const quant::PackedSizes& s) {
    return round4(s.codes) + round4(2 * s.scales) + round4(s.absmax_q) + 4 * s.absmax_scale;
}

}  // namespace

template <typename T>
typename QuantizedDeviceBase<T>::Bytes QuantizedDeviceBase<T>::predicted_bytes(
    const ModelConfig& cfg, const quant::BaseQuant& q) {
    q.check(cfg);
    const ParamLayout layout = make_param_layout(cfg);
    Bytes b;
    std::size_t plain = 0, block = 0;
    for (const ParamUnit& u : layout.units) {
        bool packed = false;
        for (std::size_t i = u.first_tensor; i < u.last_tensor; i++) {
            const ParamSpec& t = layout.tensors[i];
            if (quant::is_packed_matrix(t)) {
                b.params += device_matrix_bytes(quant::packed_sizes(q, t.shape[1], t.shape[0]));
                packed = true;
            } else {
                plain += t.numel;
            }
        }
        if (packed) block = std::max(block, u.size());
    }
    b.params += plain * sizeof(T);
    b.slots = kSlots * block * sizeof(T);
    return b;
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

template class CudaLora<float>;
template class CudaLora<__nv_bfloat16>;
template class CudaLora<__half>;
template class QuantizedDeviceBase<float>;
template class QuantizedDeviceBase<__nv_bfloat16>;
template class QuantizedDeviceBase<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
