// Streams of the CUDA engine's parts (engine/cuda/cuda_engine.cpp): an owned stream that outlives
// what is queued on it, and a side stream that follows the last micro-batch's backward unit by unit
// (DDP's all-reduces in parallel/data/device_data_parallel.h, ZeRO-Offload's gradient copies in
// parallel/data/device_offload.h), so the transfer of a unit overlaps the backward of the units
// before it.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <vector>

#include "core/device.h"

namespace memtrain {

// A non-blocking stream, synchronized and destroyed with its owner.
class CudaStream {
  public:
    CudaStream() { MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
    ~CudaStream() {
        cudaStreamSynchronize(s_);
        cudaStreamDestroy(s_);
    }
    CudaStream(const CudaStream&) = delete;
    CudaStream& operator=(const CudaStream&) = delete;
    cudaStream_t get() const { return s_; }

  private:
    cudaStream_t s_ = nullptr;
};

// A side stream beside the compute stream that takes each unit's gradients as the backward
// finishes them: armed for one backward, work queued after follow(u) waits for the backward's
// writes of unit u's gradients, and join() makes everything queued on the compute stream after
// the backward wait for the side stream's work.
class UnitGradStream {
  public:
    UnitGradStream(cudaStream_t compute, std::size_t units) : compute_(compute), ready_(units) {
        for (auto& e : ready_) MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    ~UnitGradStream() {
        cudaStreamSynchronize(side_.get());
        for (auto& e : ready_) cudaEventDestroy(e);
        cudaEventDestroy(done_);
    }
    UnitGradStream(const UnitGradStream&) = delete;
    UnitGradStream& operator=(const UnitGradStream&) = delete;

    cudaStream_t get() const { return side_.get(); }
    // Whether the coming backward's units are taken (the last micro-batch's, for a reduction
    // once per step).
    void arm(bool on) { armed_ = on; }
    // False when not armed; else work queued on the side stream from now on waits for the
    // backward's writes of unit u's gradients.
    bool follow(int u) {
        if (!armed_) return false;
        MT_CUDA_CHECK(cudaEventRecord(ready_[u], compute_));
        MT_CUDA_CHECK(cudaStreamWaitEvent(side_.get(), ready_[u], 0));
        return true;
    }
    // After the backward: the compute stream (the optimizer after it) waits for the last unit's
    // work; disarms.
    void join() {
        if (!armed_) return;
        MT_CUDA_CHECK(cudaEventRecord(done_, side_.get()));
        MT_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_, 0));
        armed_ = false;
    }

  private:
    cudaStream_t compute_;
    CudaStream side_;
    std::vector<cudaEvent_t> ready_;
    cudaEvent_t done_ = nullptr;
    bool armed_ = false;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
