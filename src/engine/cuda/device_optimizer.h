// The optimizer of the CUDA engines on the device: fp32 master weights (when the storage type is
// not float, unless optim.master = "none": then the bf16 parameters are the only weights and each
// update rounds into them stochastically), AdamW's m and v or SGD's momentum (in any
// optim.state_format: the CPU MomentBuffer's stores byte for byte, cuda::moment_layout), the
// multi-tensor chunk table and the step count, over one range of a parameter layout (the whole
// model, a ZeRO-1 shard, a pipeline stage, or LoRA's adapters). It updates the T parameters from
// the T gradients with the kernels of kernels/cuda/optimizer.h, and is the engine's OptimizerState:
// checkpoints read and write its tensors and its step count through it.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.h"
#include "config/run_config.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "kernels/cuda/optimizer.h"
#include "model/param_layout.h"
#include "optim/device_update.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"

namespace memtrain {

template <typename T>
class DeviceOptimizer final : public OptimizerState {
  public:
    // Waits for the engine's compute stream (naming what for: with NCCL, a dead peer fails fast).
    using Wait = std::function<void(const char* what)>;
    // Floats [offset, offset + n) of `layout`, every tensor zero; checkpoint reads and writes are
    // queued on `stream` and waited for with `wait`. `train_seed` seeds the stochastic rounding of
    // optim.master = "none" (T must be bf16 then).
    DeviceOptimizer(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset,
                    std::size_t n, cudaStream_t stream, Wait wait, uint64_t train_seed = 0);
    DeviceOptimizer(const DeviceOptimizer&) = delete;
    DeviceOptimizer& operator=(const DeviceOptimizer&) = delete;
    // The fp32 master weights of the range, or null when T is float (the parameters are the
    // master) or under optim.master = "none" (the bf16 parameters are the weights).
    float* master() { return master_.size() ? master_.data() : nullptr; }
    // The fp32 weights of the range whose parameters are `params`: the master, else the
    // parameters themselves when T is float, else null (optim.master = "none": the bf16
    // parameters are the weights).
    float* master_or_params(T* params) {
        if (float* m = master()) return m;
        if constexpr (std::is_same_v<T, float>)
            return params;
        else
            return nullptr;
    }
    // One update of the range: params (T) from grads (T) scaled by the device scalars'
    // grad_scale; nothing when they say skip.
    void step(T* params, const T* grads, const cuda::StepScalars* scalars, cudaStream_t stream);
    std::string describe() const;  // "fp32 master, Adam m, v"

    // OptimizerState: the range, the step count (of updates taken: a skipped fp16 step is not
    // one), whole-tensor reads and ranged writes of the moments.
    std::size_t offset() const override { return offset_; }
    std::size_t count() const override { return n_; }
    int64_t steps_taken() const override { return t_; }
    void set_steps_taken(int64_t t) override { t_ = t; }
    std::vector<std::string> state_names() override;
    const float* host_state(const std::string&) override { return nullptr; }
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;

  private:
    // A moment's device stores (MomentBuffer's: fp32, bf16, codes, scales; empty where the format
    // has none) and whether its codes are signed.
    struct Stores {
        DeviceBuffer<float>* f32;
        DeviceBuffer<__nv_bfloat16>* b16;
        DeviceBuffer<uint8_t>* codes;
        DeviceBuffer<float>* scales;
        bool is_signed;
    };
    Stores stores(const std::string& name);
    cuda::MomentStores moment_stores();
    // The moment on the host as the CPU's MomentBuffer (its codec), from the device's bytes; and
    // its bytes back to the device.
    MomentBuffer to_host(const Stores& st);
    void to_device(const MomentBuffer& b, const Stores& st);
    bool adamw_ = true;
    cuda::ParamRounding round_;  // optim.master = "none": stochastic
    StateFormat format_ = StateFormat::Fp32;
    ParamLayout layout_;
    std::size_t offset_ = 0, n_ = 0;
    int64_t t_ = 0;
    cudaStream_t stream_ = nullptr;
    Wait wait_;
    DeviceBuffer<float> master_;             // absent when T is float or optim.master = "none"
    DeviceBuffer<float> m_, v_;              // AdamW moments, or m_ = SGD momentum (the fp32 store)
    DeviceBuffer<__nv_bfloat16> m16_, v16_;  // their bf16 store
    DeviceBuffer<uint8_t> mq_, vq_;          // int8 / int4 codes
    DeviceBuffer<float> ms_, vs_;            // and the blocks' scales
    DeviceBuffer<float> tables_;  // int8 / int4: m's decode table, then v's (256 floats each)
    DeviceBuffer<cuda::TensorChunk> chunks_;
    DeviceBuffer<cuda::StateChunk> at_;   // where each chunk's moments are (not fp32)
    DeviceBuffer<cuda::ChunkGrid> grid_;  // int8 / int4: each chunk's CUDA blocks
    int64_t blocks_ = 0;                  // and the step's grid
};

// Weight I/O of parameters that are their own weights (optim.master = "none", or fp32): n values
// of T on the device at `src` decoded into the host floats `dst`, and n host floats rounded to
// nearest into the device's `dst`; both queue on `stream` and wait with `wait` (the host buffers
// are reused).
template <typename T>
void download_decoded(float* dst, const T* src, std::size_t n, cudaStream_t stream,
                      const std::function<void(const char*)>& wait);
template <typename T>
void upload_rounded(T* dst, const float* src, std::size_t n, cudaStream_t stream,
                    const std::function<void(const char*)>& wait);

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
