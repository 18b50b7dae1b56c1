// ZeRO-Offload for the CUDA engine (train.offload_optimizer; engine/cuda/cuda_engine.cpp): the fp32
// master weights, the moments (in any optim.state_format) and the update of this rank's range on
// the host (the CPU optimizer of optim/optimizer.h, multi-threaded), the gradients coming down and
// the rounded parameters going up through one pinned buffer of the range's values of T. In one
// process the gradients stream down unit by unit as the last backward finishes them; with several
// ranks (or CUDA graphs) this rank's reduced shard comes down after the backward. Part of splitting
// the CUDA engine along its plan (issue 15).
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "core/allocator.h"
#include "core/cuda_streams.h"
#include "model/cuda_gpt.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"

namespace memtrain {

template <typename T>
class DeviceOffload {
  public:
    // Floats [first, first + count) of `layout` (everything in one process, this rank's shard
    // under ZeRO), the update queued on the compute stream `compute`. `stream_grads`: the
    // gradients come down unit by unit during the last backward (attach installs the hook).
    // optim.master = "none" (T bf16): no host master; each update reads the device's bf16
    // weights, steps them in fp32 a chunk at a time and rounds them stochastically with the
    // draws of (bf16_rounding_seed(train_seed), the step, the global index), as the device
    // optimizer does.
    DeviceOffload(const OptimConfig& optim, const ParamLayout& layout, std::size_t first,
                  std::size_t count, cudaStream_t compute, bool stream_grads,
                  uint64_t train_seed = 0);
    ~DeviceOffload();
    DeviceOffload(const DeviceOffload&) = delete;
    DeviceOffload& operator=(const DeviceOffload&) = delete;

    // The checkpoint's view of the host optimizer's state.
    OptimizerState& optimizer() { return *opt_; }
    // The range's fp32 master weights, in host memory (null under optim.master = "none": the
    // device's bf16 parameters are the weights).
    float* master() { return master_.size() ? master_.data() : nullptr; }
    // Streams unit by unit: the model's grads-done hook.
    void attach(CudaGPT<T>& model);

    // The step, in order: before and after each backward (the last one's gradients stream down
    // and the compute stream waits for them); then, unless they streamed, the range's gradients
    // `grads` down after the norm; then, after the host's wait for a step that was not skipped,
    // the update.
    void before_backward(bool last) {
        if (down_) down_->arm(last);
    }
    void after_backward() {
        if (down_) down_->join();
    }
    void download(const T* grads);
    // The pinned gradients (scaled by grad_scale) into fp32, the host optimizer over the fp32
    // master, the rounded parameters up into `params` (the range's, on the device).
    void update(double lr, float grad_scale, T* params);

    // The memory report's footer line: the host's share of the optimizer.
    std::string memory_line() const;

  private:
    // Copies unit u's gradients to the pinned buffer on the download stream (the hook).
    void start_unit_download(int u);
    std::size_t pinned_bytes() const { return count_ * sizeof(T); }

    const ParamLayout layout_;
    std::size_t first_, count_;
    cudaStream_t compute_;
    std::size_t state_bytes_;  // the host optimizer's moments (optimizer_state_bytes)
    std::string state_name_;   // and what they are ("Adam m, v in int8 (...)")
    std::unique_ptr<Optimizer> opt_;
    Buffer<float> master_, grads_;
    // optim.master = "none": the update's fp32 scratch (a chunk of at most kRoundChunk floats)
    // and the rounding's seed.
    static constexpr std::size_t kRoundChunk = std::size_t(1) << 18;
    Buffer<float> round_;
    bool bf16_weights_ = false;
    uint64_t rounding_seed_ = 0;
    T* pinned_ = nullptr;
    std::unique_ptr<UnitGradStream> down_;  // the gradients' copies to the host
    CudaGPT<T>* model_ = nullptr;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
