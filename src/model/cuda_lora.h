// LoRA on the GPU: the adapters of model/lora.h beside CudaGPT's block linears, and the frozen
// base of a QLoRA run held packed on the device and decoded unit by unit (the CUDA side of
// quant/quantized_store.h). The arithmetic is LoraAdapters' (the same GEMMs in the same order,
// the same dropout mask), on T storage with fp32 accumulation.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "model/cuda_gpt.h"
#include "model/lora.h"
#include "quant/quantized_store.h"

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

// QLoRA's frozen base on the device: the block matrices packed as the host store packs them
// (codes, fp16 scales, NF4 absmax codes and scales), every other tensor as T, each block decoded
// into one of two unit-sized slots when the model acquires it (least recently used first). The
// embedding and head units are kept whole as T. No gradients.
template <typename T>
class QuantizedDeviceBase final : public DeviceUnitStore<T> {
  public:
    static constexpr int kSlots = 2;
    // Copies `host` (complete) to the device.
    QuantizedDeviceBase(const quant::QuantizedParamStore& host, cudaStream_t stream);
    // The bytes this store allocates for cfg under q: parameters (packed + T runs) and the slots.
    struct Bytes {
        std::size_t params = 0, slots = 0;
    };
    static Bytes predicted_bytes(const ModelConfig& cfg, const quant::BaseQuant& q);
    int64_t decodes() const { return decodes_; }

    T* acquire_params(int u) override;
    void release_params(int u) override;
    void prefetch_params(int) override {}
    T* acquire_grads(int u) override;
    void grads_done(int) override {}

  private:
    struct Matrix {
        std::size_t offset = 0;
        int64_t rows = 0, cols = 0;
        std::size_t codes = 0, scales = 0, absmax_q = 0, absmax_scale = 0;  // byte offsets
    };
    struct Run {
        std::size_t offset = 0, count = 0, at = 0;  // `count` T at `at` in plain_
    };
    struct Unit {
        std::vector<Run> runs;
        std::vector<Matrix> matrices;
        int held = 0, slot = -1;
    };
    quant::BaseQuant q_;
    ParamLayout layout_;
    cudaStream_t stream_;
    DeviceBuffer<T> plain_;               // every run of every unit, T
    DeviceBuffer<unsigned char> packed_;  // every matrix's parts, 16-byte aligned each
    std::vector<Unit> units_;
    DeviceBuffer<T> slots_[kSlots];
    int slot_unit_[kSlots] = {-1, -1};
    uint64_t slot_use_[kSlots] = {0, 0};
    uint64_t clock_ = 0;
    int64_t decodes_ = 0;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
