// LoRA's adapters on the GPU (see cuda_lora.h).
#include "model/cuda_lora.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "kernels/dropout_mask.h"

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
    return dropout_mask::site_key(seed_, micro_batch_, (uint64_t)(&s - layout_->sites.data()));
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

template class CudaLora<float>;
template class CudaLora<__nv_bfloat16>;
template class CudaLora<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
