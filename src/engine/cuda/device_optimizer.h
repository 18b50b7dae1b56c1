// The optimizer of the CUDA engines (engine/cuda/cuda_engine.cpp, engine/cuda/cuda_lora_engine.cpp)
// on the device: fp32 master weights (when the storage type is not float), AdamW's m and v or SGD's
// momentum, and the multi-tensor chunk table, over one range of a parameter layout (the whole
// model, a ZeRO-1 shard, or LoRA's adapters). It updates the T parameters from the T gradients
// with the kernels of kernels/cuda/optimizer.h, and reads and writes its tensors as the
// checkpoint's optimizer state. Part of splitting the CUDA engine along its plan (issue 15).
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/param_layout.h"
#include "optim/device_update.h"
#include "optim/optim_config.h"

namespace memtrain {

template <typename T>
class DeviceOptimizer {
  public:
    DeviceOptimizer() = default;
    // Floats [offset, offset + n) of `layout`, every tensor zero.
    DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset,
                    std::size_t n);
    // The fp32 master weights of the range, or null when T is float (the parameters are the
    // master).
    float* master() { return master_.size() ? master_.data() : nullptr; }
    // One update of the range: params (T) from grads (T) scaled by the device scalars'
    // grad_scale; nothing when they say skip.
    void step(T* params, const T* grads, const cuda::StepScalars* scalars, cudaStream_t stream);
    // Bytes per parameter of the range (master 4 when mixed, + 8 AdamW or 4 SGD) and of the
    // chunk table.
    std::size_t bytes_per_param() const;
    std::size_t table_bytes() const { return chunks_.bytes(); }
    std::string describe() const;  // "fp32 master, Adam m, v"

    // The checkpoint's view (OptimizerState): names and whole-tensor reads, ranged writes.
    // `wait` waits for `stream` (the engine's fail-fast wait).
    std::vector<std::string> state_names() const;
    void read_state(const std::string& name, float* dst, cudaStream_t stream,
                    const std::function<void()>& wait);
    void write_state(const std::string& name, std::size_t begin, std::size_t n, const float* src,
                     cudaStream_t stream, const std::function<void()>& wait);

  private:
    DeviceBuffer<float>& state(const std::string& name);
    bool adamw_ = true;
    DeviceBuffer<float> master_;  // absent when T is float
    DeviceBuffer<float> m_, v_;   // AdamW moments, or m_ = SGD momentum
    DeviceBuffer<cuda::TensorChunk> chunks_;
};

// The footer line with the driver's count of device memory in use against the device's size.
std::string device_in_use_line();

// Makes this rank's GPU the current device (one GPU per process: the node's ranks take the
// node's devices in turn); fails when no CUDA device answers.
void use_rank_device(const dist::Communicator& comm);

// E<float>, E<__nv_bfloat16> or E<__half> (an engine of the storage type) by the plan's
// precision, on this rank's GPU.
template <template <typename> class E>
std::unique_ptr<Engine> make_for_precision(const RunPlan& plan, dist::Communicator& comm) {
    use_rank_device(comm);
    switch (plan.precision) {
        case Precision::fp32:
            return std::make_unique<E<float>>(plan, comm);
        case Precision::bf16:
            return std::make_unique<E<__nv_bfloat16>>(plan, comm);
        case Precision::fp16:
            return std::make_unique<E<__half>>(plan, comm);
    }
    fail("internal: no storage type for the plan's precision");
}

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
