// The whole model's states for the CUDA engine (model_states.h): CudaGPT<T> over data
// parallelism (parallel/data/device_data_parallel.h: NCCL, the shard ranges and the collectives
// of each dist::ShardSpec placement), the optimizer of this rank's range on the device
// (engine/cuda/device_optimizer.h) or on the host (parallel/data/device_offload.h:
// ZeRO-Offload), weight I/O through whichever holds the fp32 master weights, and the overflow's
// location after a skipped fp16 step.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/cuda/in_backward_grads.h"
#include "engine/cuda/model_states.h"
#include "engine/run_plan.h"
#include "parallel/data/device_data_parallel.h"
#include "parallel/data/device_offload.h"
#include "parallel/data/device_shard_gather.h"

namespace memtrain {

template <typename T>
class WholeModelStates;

// The UnitStore for weight I/O: a unit's fp32 master weights copied to a host buffer and, when
// written, back to the master and (rounded) to the compute copy (under optim.master = "none" the
// bf16 parameters decoded, and rounded to nearest back into them). It asks the states where the
// master weights live (the device or, under ZeRO-Offload, the host) and which piece of them this
// rank holds (all of each unit, or its shard's piece: then reading a unit gathers it from every
// rank, a collective).
template <typename T>
class WeightsStore final : public WeightWindow {
  public:
    explicit WeightsStore(WholeModelStates<T>& s) : s_(s) {}
    float* acquire(int u, bool for_write) override;
    void release(int u) override;

  private:
    // The new values of unit `unit` (at `src`) into this rank's master weights and its compute
    // copy of the parameters.
    void write_back(const ParamUnit& unit, const float* src);

    WholeModelStates<T>& s_;
    int held_ = -1, holds_ = 0;
    bool written_ = false;
    bool lent_ = false;  // acquire returned the master weights themselves (host memory, whole)
    std::vector<float> host_, piece_;
};

template <typename T>
class WholeModelStates final : public ModelStates<T> {
  public:
    WholeModelStates(const RunPlan& plan, dist::Communicator& comm, cudaStream_t stream);
    ~WholeModelStates() override;

    CudaGPT<T>* model() override { return model_.get(); }
    ModelWeights weights() override { return ModelWeights{store_, layout(), plan_.cfg.model}; }

    void begin_step() override {
        model_->zero_grads();
        dp_.begin_step();
    }
    // DDP reduces once per step, during the last micro-batch's backward, unit by unit;
    // ZeRO-Offload in one process likewise streams the gradients down then. Everything after
    // the backward (the optimizer) waits for the last unit's all-reduce or copy. The step
    // inside the backward reduces each unit itself, on the compute stream (unit_done).
    void before_backward(bool last, int64_t) override {
        dp_.before_backward(last && !steps_in_backward_);
        if (offload_) offload_->before_backward(last);
    }
    void after_backward() override {
        dp_.after_backward();
        if (offload_) offload_->after_backward();
    }

    // StepCollectives: the gradients summed over the ranks into this rank's range, the update on
    // the device (then shared: a skipped step shares the old values) or on the host after the
    // step's wait (the range's gradients brought down first, unless they streamed down).
    T* gradients() override { return steps_in_backward_ ? nullptr : dp_.step_grads(); }
    void reduce(double* sum_sq, double* unit_sq) override;
    void update(const cuda::StepScalars* scalars) override {
        if (steps_in_backward_) {  // done piece by piece inside the backward: only shared now
            dp_.share_updated_params();
            return;
        }
        if (offload_) {
            offload_->download(dp_.grad_shard());
        } else {
            opt_->step(dp_.param_shard(), dp_.grad_shard(), scalars, stream_);
            dp_.share_updated_params();
        }
    }
    void updated(double lr, float grad_scale) override {
        if (!offload_) return;
        offload_->update(lr, grad_scale, dp_.param_shard());
        dp_.share_updated_params();
    }
    // The moments (and the step count) of this rank's range, on the device or the host.
    OptimizerState& optimizer() override {
        return offload_ ? offload_->optimizer() : static_cast<OptimizerState&>(*opt_);
    }
    std::string overflow() override;
    void wait(const char* what) override { dp_.wait(what); }

    std::vector<MemoryPrediction> predicted_memory(const RematPlan& remat, int B,
                                                   int T_) const override;
    std::string memory_footer() const override;
    std::pair<int64_t, int64_t> zero_gathers() const override { return dp_.zero_gathers(); }

    bool steps_in_backward() const override { return steps_in_backward_; }
    void arm(double* unit_sq, const cuda::StepScalars* update) override {
        armed_ = true;
        unit_sq_ = unit_sq;
        update_ = update;
    }
    void disarm() override {
        if (armed_ && unit_sq_) dp_.combine_unit_sums(unit_sq_);
        armed_ = false;
        update_ = nullptr;
    }

  private:
    // The step inside the backward: this rank's piece [lo, lo + n) of unit u's gradient of the
    // step's backward is complete at `grads` (a bucket: the whole unit, all-reduced here under
    // DDP; or ZeRO-2/3's reduced piece): measured and (armed with an update) updated.
    void unit_done(int u, T* grads, std::size_t lo, std::size_t n);
    // ZeRO-2/3's hook for it (null unless the plan steps inside the backward with sharded
    // gradients).
    typename dist::DeviceZeroUnits<T>::PieceDone in_backward_pieces(const RunPlan& plan);
    friend class WeightsStore<T>;
    const ParamLayout& layout() const { return model_->layout(); }
    // This rank's fp32 master weights, its range [dp_.first(), + dp_.count()): in host memory
    // under ZeRO-Offload, else on the device (the parameters themselves in fp32). Null under
    // optim.master = "none": the bf16 parameters (dp_.param_shard()) are the weights.
    struct MasterWeights {
        float* data;
        bool on_host;
    };
    MasterWeights master_weights() {
        if (offload_) {
            if (float* m = offload_->master()) return {m, true};
            return {nullptr, false};  // optim.master = "none": the device's bf16 parameters
        }
        return {opt_->master_or_params(dp_.param_shard()), false};
    }

    RunPlan plan_;
    cudaStream_t stream_;
    // Data parallelism: the shard ranges, NCCL and ZeRO-2/3's unit store (one process: the
    // trivial case, everything replicated).
    DeviceDataParallel<T> dp_;
    // optim.step_in_backward with one micro-batch per step: the gradient buckets of one GPU and
    // DDP (no whole buffer; ZeRO-2/3 keep theirs and no shard), and what the armed backward does
    // with each unit's gradient.
    bool steps_in_backward_ = false;
    std::unique_ptr<InBackwardGrads<T>> in_backward_;
    bool armed_ = false;
    double* unit_sq_ = nullptr;
    const cuda::StepScalars* update_ = nullptr;
    std::unique_ptr<CudaGPT<T>> model_;
    WeightsStore<T> store_;
    // Muon and Adafactor under ZeRO 1-3 over several GPUs: the tensors they step whole that the
    // shards cut, gathered whole.
    std::unique_ptr<dist::DeviceShardGather> shard_gather_;
    // The optimizer of this rank's range: on the device (fp32 master weights, absent when T is
    // float, moments and the update), or on the host under ZeRO-Offload.
    std::unique_ptr<DeviceOptimizer<T>> opt_;
    std::unique_ptr<DeviceOffload<T>> offload_;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
