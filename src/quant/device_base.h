// QLoRA's frozen base on the device: the CUDA side of quant/quantized_store.h, a DeviceUnitStore
// that holds the block matrices packed and decodes each unit when the model acquires it.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "model/cuda_gpt.h"
#include "quant/quantized_store.h"

namespace memtrain {

// QLoRA's frozen base on the device: the block matrices packed as the host store packs them
// (codes, fp16 scales, NF4 absmax codes and scales), every other tensor as T, each block decoded
// into one of two unit-sized slots when the model acquires it (least recently used first). The
// embedding and head units are kept whole as T. No gradients.
template <typename T>
class QuantizedDeviceBase final : public DeviceUnitStore<T> {
  public:
    static constexpr int kSlots = quant::kDeviceBaseSlots;
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
