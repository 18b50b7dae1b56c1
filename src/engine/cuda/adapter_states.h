// LoRA and QLoRA states for the CUDA engine (model_states.h): CudaGPT<T> over a frozen base, whole
// as T or packed (quant/device_base.h: decoded block by block on the device), the adapters
// (model/cuda_lora.h) trained with the device optimizer over fp32 master weights, their gradients
// all-reduced over NCCL once per step (DDP). Checkpoints hold the adapters in PEFT's files and
// their optimizer state, the same files the CPU's LoraEngine writes, so a run moves between
// devices.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "core/device.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/cuda/model_states.h"
#include "engine/run_plan.h"
#include "model/cuda_lora.h"
#include "model/lora.h"
#include "model/weight_window.h"
#include "quant/device_base.h"
#include "quant/quantized_store.h"

namespace memtrain {

// A UnitStore over device values, one unit at a time through a host fp32 buffer: `read` copies
// unit u's floats down, `write` puts them back after a writing acquire.
class HostWindow final : public WeightWindow {
  public:
    using Read = std::function<void(int u, float* dst)>;
    using Write = std::function<void(int u, const float* src)>;
    HostWindow(const ParamLayout& layout, Read read, Write write)
        : layout_(&layout), read_(std::move(read)), write_(std::move(write)) {}
    float* acquire(int u, bool for_write) override;
    void release(int u) override;

  private:
    const ParamLayout* layout_;
    Read read_;
    Write write_;
    std::vector<float> host_;
    int held_ = -1, holds_ = 0;
    bool written_ = false;
};

template <typename T>
class AdapterStates final : public ModelStates<T> {
  public:
    AdapterStates(const RunPlan& plan, dist::Communicator& comm, cudaStream_t stream);
    ~AdapterStates() override;

    CudaGPT<T>* model() override { return model_.get(); }
    ModelWeights weights() override {
        if (quant_writer_) return quant_writer_->weights();
        return ModelWeights{*base_window_, layout_, cfg().model};
    }
    void weights_loaded(const RematPlan& remat) override;
    CheckpointModel checkpoint_model() override;

    void begin_step() override;
    // Dropout masks as the CPU engine draws them: keyed by the run's micro-batch index.
    void before_backward(bool, int64_t index) override {
        lora_->set_training(true);
        lora_->set_micro_batch((uint64_t)index);
    }
    void after_backward() override {}
    void before_eval() override { lora_->set_training(false); }

    // StepCollectives. DDP: every rank's adapter gradients summed (the loss gradient already
    // carries 1 / the global token count), so every rank takes the same update.
    T* gradients() override { return grads_.data(); }
    void reduce(double* sum_sq, double* unit_sq) override;
    void update(const cuda::StepScalars* scalars) override {
        opt_->step(params_.data(), grads_.data(), scalars, stream_);
    }
    // The adapters' moments on the device.
    OptimizerState& optimizer() override { return *opt_; }
    std::string overflow() override { return "non-finite adapter gradients"; }
    // With several ranks through the device communicator, which fails fast on a dead peer.
    void wait(const char* what) override;

    std::vector<MemoryPrediction> predicted_memory(const RematPlan& remat, int B,
                                                   int T_) const override;
    std::string memory_footer() const override;
    std::string describe() const override;
    std::string title() const override { return quantized() ? ", QLoRA" : ", LoRA"; }

  private:
    const RunConfig& cfg() const { return plan_.cfg; }
    bool quantized() const { return plan_.lora_base.has_value(); }
    // The adapters' fp32 master weights (the parameters themselves in fp32); null under
    // optim.master = "none", where the bf16 adapters are the weights.
    float* master() { return opt_->master_or_params(params_.data()); }

    RunPlan plan_;
    cudaStream_t stream_;
    // Data parallelism (DDP): the adapters' gradients all-reduced over NCCL once per step.
    std::unique_ptr<dist::DeviceCommunicator> dcomm_;
    ParamLayout layout_;      // the base's
    LoraLayout lora_layout_;  // the adapters'
    std::size_t n_ = 0;       // adapter parameters
    // The base: whole as T in the model's own buffer (no lora_base), or packed: written through
    // quant_writer_ into host_quant_ (one unit of fp32 at a time), then copied to the device by
    // weights_loaded() and the host copy dropped.
    std::unique_ptr<quant::QuantizedParamStore> host_quant_;
    std::unique_ptr<quant::QuantizedStoreWriter> quant_writer_;
    std::unique_ptr<QuantizedDeviceBase<T>> quant_base_;
    std::unique_ptr<HostWindow> base_window_, adapter_window_;
    // The adapters: T parameters and gradients; their optimizer (fp32 master when T is not float,
    // moments).
    DeviceBuffer<T> params_, grads_;
    std::unique_ptr<DeviceOptimizer<T>> opt_;
    std::unique_ptr<CudaLora<T>> lora_;
    std::unique_ptr<CudaGPT<T>> model_;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
