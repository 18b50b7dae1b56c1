// The end of a step and the evaluation loss, shared by the CUDA engines (cuda_engine.cpp,
// cuda_pipeline_engine.cpp): the step's scalars uploaded, the gradient norm and clip coefficient
// finished on the device, the one wait, the mean loss, a skipped fp16 step and its overflow, the
// loss scaler's update. Each engine supplies only its own collectives (StepCollectives).
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "core/device.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "optim/device_update.h"
#include "optim/loss_scaler.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"

namespace memtrain {

// What one engine does inside DeviceStep::finish, in the order the step calls it: where its
// gradients are, how they are summed over its ranks, the update, and its waits.
template <typename T>
class StepCollectives {
  public:
    virtual ~StepCollectives() = default;
    // The step's gradients, complete on the compute stream (the backward's own reductions
    // joined); the overflow test hook writes an inf into the first.
    virtual T* gradients() = 0;
    // The gradients summed where the optimizer reads them, and into *sum_sq (device) the sum of
    // the squares of the job's whole gradient; `unit_sq` (device, a double per parameter unit, or
    // null) is where the whole model's engine sums each unit's first (DeviceStep's unit sums).
    virtual void reduce(double* sum_sq, double* unit_sq) = 0;
    // The update queued on the compute stream (a step the scalars mark skipped changes nothing),
    // or what the host's update needs brought down (ZeRO-Offload).
    virtual void update(const cuda::StepScalars* scalars) = 0;
    // After the host's wait, for a step that was not skipped: the host's part of the update.
    virtual void updated(double /*lr*/, float /*grad_scale*/) {}
    // The state checkpoints hold; its step count is the step's.
    virtual OptimizerState& optimizer() = 0;
    // A skipped step: which gradients were not finite (StepResult::overflow).
    virtual std::string overflow() = 0;
    // The job's loss from this rank's mean (a pipeline: the last stage's, broadcast).
    virtual double job_loss(double mean) { return mean; }
    // Waits for the compute stream; with NCCL, a dead peer fails fast naming `what`.
    virtual void wait(const char* what) = 0;
};

template <typename T>
class DeviceStep {
  public:
    // On the compute stream `stream`: the optimizer's constants, fp16's loss scale (the plan's
    // precision), room for `accum_steps` micro-batches' loss sums and for `units` parameter units'
    // sums of squares (the whole model's engine: its norm is summed per unit, in order).
    DeviceStep(const OptimConfig& optim, Precision precision, int accum_steps, int units,
               cudaStream_t stream);
    ~DeviceStep();
    DeviceStep(const DeviceStep&) = delete;
    DeviceStep& operator=(const DeviceStep&) = delete;

    // Device bytes of the step's scalars and loss sums (engine/device_memory.h prices them).
    std::size_t device_bytes() const { return stats_.bytes(); }

    // fp16: the scale the loss gradient carries (1 without loss scaling), and its checkpoint.
    float loss_scale() const { return scaler_ ? (float)scaler_->scale() : 1.0f; }
    std::pair<double, int64_t> scaler_state() const;
    void restore_scaler(double scale, int64_t clean_steps);

    void begin();
    // The step's next micro-batch of B x T_: where its token-loss sum goes (device). Fails past
    // the accumulation steps.
    double* next_micro(int B, int T_);
    int micro_batches() const { return micro_; }
    // Micro-batch k's token-loss sum (device).
    double* loss_sum(int k) { return sums() + 2 + k; }
    // Clips to max_norm (<= 0: none), updates with learning rate lr through `parts`, waits once.
    // clip_norm > 0: the coefficient comes from that norm instead of this step's
    // (optim.step_in_backward_clip = "previous-norm").
    StepResult finish(double lr, double max_norm, StepCollectives<T>& parts, double clip_norm = 0);

    // optim.step_in_backward (one micro-batch per step): the update of step t goes inside the
    // backward, so its scalars are on the device before it (finish then only reads the results).
    // Then either a norm pass fills unit_sums() and finish_norm_pass turns them into the clip
    // coefficient and the skip flag, or scale_before_norm sets them without this step's norm.
    void begin_update(double lr, double max_norm, double clip_norm, int64_t t);
    void finish_norm_pass();
    void scale_before_norm();
    const cuda::StepScalars* device_scalars() { return scalars(); }
    double* unit_sums() { return units_ ? sums() + 3 + accum_ : nullptr; }

    // Evaluation: the model writes its token-loss sum to eval_sum(); eval_loss waits for it and
    // returns the mean over `tokens` (with `here` false, a rank that computed none: 0).
    double* eval_sum() { return sums() + 1; }
    double eval_loss(int64_t tokens, StepCollectives<T>& parts, bool here = true);

    // Test hook: the next finish finds a non-finite gradient, as an fp16 overflow would leave it.
    void inject_overflow() { inject_overflow_ = true; }
    // Engine::set_guarded: a non-finite gradient without a loss scaler skips the step and
    // reports it (the guard rolls back) instead of ending the run.
    void set_guarded(bool guarded) { guarded_ = guarded; }

  private:
    cuda::StepScalars* scalars() { return reinterpret_cast<cuda::StepScalars*>(stats_.data()); }
    // Doubles [sum of squares | eval loss | micro-batch loss sums | the norm pass's sum of
    // squares | unit sums] (device_step_bytes).
    double* sums() { return reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars)); }
    std::size_t doubles() const { return 3 + (std::size_t)accum_ + (std::size_t)units_; }
    std::size_t norm_pass_slot() const { return 2 + (std::size_t)accum_; }

    OptimConfig optim_;
    int accum_, units_;
    bool update_queued_ = false;  // begin_update: the scalars are on the device
    bool norm_pass_ = false;      // finish_norm_pass: its sum waits in its slot for the check
    cudaStream_t stream_;
    DeviceBuffer<unsigned char> stats_;          // StepScalars, then the doubles
    cuda::StepScalars* scalars_host_ = nullptr;  // pinned
    double* stats_host_ = nullptr;               // pinned
    std::unique_ptr<LossScaler> scaler_;
    int micro_ = 0;
    int64_t tokens_ = 0;
    bool inject_overflow_ = false;
    bool guarded_ = false;
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
