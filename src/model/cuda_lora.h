// LoRA on the GPU: the adapters of model/lora.h beside CudaGPT's block linears (QLoRA's packed
// base on the device is quant/device_base.h). The arithmetic is LoraAdapters' (the same GEMMs in
// the same order, the same dropout mask), on T storage with fp32 accumulation.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "model/cuda_gpt.h"
#include "model/lora.h"

namespace memtrain {

// The adapters' parameters and gradients (T, the adapter layout's flat buffers, owned by the
// engine) and the workspace of their GEMMs. CudaGPT calls forward and backward around each
// adapted linear (cuda_gpt.h set by its constructor's `lora`).
template <typename T>
class CudaLora {
  public:
    CudaLora(const LoraConfig& cfg, const LoraLayout& layout, T* params, T* grads,
             uint64_t dropout_seed, cudaStream_t stream);
    const LoraConfig& config() const { return cfg_; }
    const LoraLayout& layout() const { return *layout_; }
    // Dropout applies in training only; each micro-batch draws a new mask, as on the CPU.
    void set_training(bool on) { training_ = on; }
    void set_micro_batch(uint64_t i) { micro_batch_ = i; }  // as LoraAdapters
    // Bytes of the workspace for N rows: lora_workspace_bytes with T elements.
    static std::size_t workspace_bytes(const LoraConfig& cfg, const LoraLayout& layout, int N);
    void prepare(int N);
    bool adapts(int block, BlockLinear linear) const {
        return !layout_->sites_of(block, linear).empty();
    }
    // y (N rows of the linear's outputs) += scale drop(x) A^T B^T for each adapter of
    // (block, linear).
    void forward(int block, BlockLinear linear, const T* x, T* y, int N);
    // dA, dB accumulate; dx (N, in) += the adapters' share of the input gradient.
    void backward(int block, BlockLinear linear, const T* x, const T* dy, T* dx, int N);

  private:
    const T* dropped(const LoraSite& s, const T* x, int N);
    uint64_t key(const LoraSite& s) const;

    LoraConfig cfg_;
    const LoraLayout* layout_;
    T *params_, *grads_;
    uint64_t seed_;
    uint64_t micro_batch_ = 0;
    bool training_ = false;
    cudaStream_t stream_;
    int rows_ = 0;
    DeviceBuffer<T> h_, dh_, xd_, tmp_;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
