// What the Trainer drives: a model with its parameters, gradients and optimizer state on one
// device, stepped one micro-batch at a time. CpuEngine (here) is the CPU model over a ZeroStore
// (a single process is a world of one); CudaEngine (cuda_engine.h) keeps everything on the GPU
// in fp32, bf16 or fp16 with fp32 master weights. The Trainer owns the data, the schedule, the
// logs and the checkpoints, and never sees which one it runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "core/log2_histogram.h"
#include "io/checkpoint.h"
#include "model/activation_layout.h"
#include "model/weights.h"
#include "optim/optimizer.h"

namespace memtrain {

// One optimizer step's outcome.
struct StepResult {
    double loss = 0;        // mean training loss of this rank's micro-batches
    double grad_norm = 0;   // of the true (unscaled) gradients, before clipping
    bool skipped = false;   // fp16: a gradient overflowed, the update was skipped
    double loss_scale = 1;  // fp16: the scale the gradients of this step carried
    // A skipped step: which gradients were not finite ("non-finite gradients in 2 of 28
    // tensors, first in backward order: h.1.mlp.c_proj.weight, ..."), the same on every rank.
    std::string overflow;
};

class Engine {
  public:
    virtual ~Engine() = default;

    // "cpu (fp32)", "cuda: NVIDIA H100 80GB HBM3 (bf16)".
    virtual std::string describe() const = 0;
    // Parameters (fp32, unit by unit) for initialisation, import and checkpoints.
    virtual ModelWeights weights() = 0;
    virtual OptimizerState& optimizer() = 0;
    // Called once the weights are initialised or imported through weights(), before any step or
    // checkpoint load (LoRA: a QLoRA base is quantized here and the model built over it).
    virtual void weights_loaded() {}
    // What checkpoints hold: the whole model in Hugging Face files; under LoRA the adapters.
    virtual CheckpointModel checkpoint_model() { return hf_checkpoint_model(weights()); }
    // How the model lays out its activations (for the remat solver and the memory report).
    virtual ActFormat arena_format() const = 0;
    virtual void set_remat(const RematPlan& plan) = 0;
    virtual const RematPlan& remat_plan() const = 0;

    // One optimizer step: begin_step, forward_backward for each micro-batch (the last one with
    // last = true: data parallelism reduces the gradients once), finish_step.
    // The step's update, announced before its micro-batches (the Trainer calls it before
    // begin_step): an engine that updates inside the last backward (optim.step_in_backward) needs
    // the learning rate and the clipping threshold then; finish_step gets the same values.
    virtual void prepare_update(double /*lr*/, double /*max_norm*/) {}
    virtual void begin_step() = 0;
    // Every token's loss gradient is grad_scale (1 / tokens in the global batch).
    virtual void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                  float grad_scale, bool last) = 0;
    // model.dropout: the ordinal in the run of the next forward_backward's first sequence (the
    // Trainer's count: step, micro-batch, data-parallel rank), which keys the masks
    // (kernels/dropout_mask.h). An engine without dropout ignores it (the config refuses
    // model.dropout there).
    virtual void set_dropout_rows(uint64_t /*first*/) {}
    // Clips to max_norm (<= 0: no clipping), updates with learning rate lr.
    virtual StepResult finish_step(double lr, double max_norm) = 0;

    // Mean loss of one micro-batch (evaluation) and logits (B,T,V) for sampling.
    virtual double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) = 0;
    virtual void forward_logits(const int32_t* inputs, int B, int T, float* out) = 0;

    // The memory this engine's tensors live in, and the report's predicted rows.
    virtual MemoryTracker& memory() = 0;
    virtual std::string memory_title() const = 0;
    virtual std::vector<MemoryPrediction> predicted_memory(int B, int T) const = 0;
    // Lines under the table: what the OS or the driver charged beyond the tracked tensors.
    virtual std::string memory_footer() const = 0;

    // At the end of a run, on the printing rank: files the engine adds to the output directory
    // (the pipeline's measured timeline); returns a line for the console, or "".
    virtual std::string write_run_files(const std::string& /*out_dir*/) { return ""; }

    // train.diagnostics = amp: log2|g| histograms of every parameter tensor's gradient, the
    // step's reduced gradient before clipping (as the optimizer would see it, loss scale
    // included), counted over every rank; called between the last forward_backward and
    // finish_step. An engine that cannot says so at start-up: has_gradient_histograms() false.
    struct TensorHistogram {
        std::string name;
        Log2Histogram hist;
    };
    virtual bool has_gradient_histograms() const { return false; }
    virtual std::vector<TensorHistogram> gradient_histograms() { return {}; }
    // The same engines count a step's activations while asked to: record_activation_histograms
    // before the step's first forward_backward, activation_histograms after its last (which
    // stops counting): each block's output and the gradient of each block's input, every rank's
    // micro-batches added up (a collective).
    virtual void record_activation_histograms() {}
    virtual std::vector<TensorHistogram> activation_histograms() { return {}; }

    // The divergence guard (train/guard.h) answers a step whose gradient is not finite: an
    // engine that would stop the run for one (the CUDA engines in fp32 and bf16, which have no
    // loss scale to lower) skips the update and reports the step as skipped instead.
    virtual void set_guarded(bool /*guarded*/) {}

    // fp16: the loss scaler's scale and clean-step count, for checkpoints ({0, 0}: none).
    virtual std::pair<double, int64_t> loss_scaler_state() const { return {0.0, 0}; }
    virtual void restore_loss_scaler(double /*scale*/, int64_t /*clean_steps*/) {}
    // optim.step_in_backward_clip = "previous-norm": the global norm the next step clips with
    // (TrainState::clip_norm), carried by checkpoints so a resume is bitwise.
    virtual double clip_norm_state() const { return 0; }
    virtual void restore_clip_norm(double /*norm*/) {}
};

}  // namespace memtrain
