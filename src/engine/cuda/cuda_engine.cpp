// The single-model CUDA engine (see cuda_engine.h): CudaGPT<T> and the model states the run plan
// chooses (model_states.h: the whole model under DDP, ZeRO or ZeRO-Offload, or LoRA's adapters
// over a frozen or QLoRA-packed base), stepped by the CUDA engines' shared end of step
// (device_step.h: gradient norm and clipping on the device, fp16 loss scaling, the step's one
// wait). One compute stream, owned here; every part queues on it.
#include "engine/cuda/cuda_engine.h"

#include "core/error.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/cuda_streams.h"
#include "core/device.h"
#include "engine/cuda/adapter_states.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/cuda/device_step.h"
#include "engine/cuda/model_states.h"
#include "engine/cuda/whole_model_states.h"
#include "kernels/cuda/host_convert.h"
#include "model/cuda_gpt.h"

namespace memtrain {

namespace {

using cuda::precision_name;

template <typename T>
class CudaEngine final : public Engine {
  public:
    CudaEngine(const RunPlan& plan, dist::Communicator& comm)
        : plan_(plan),
          step_(plan.cfg.optim, plan.precision, plan.cfg.accum_steps(),
                plan.lora ? 0 : (int)make_param_layout(plan.cfg.model).units.size(), stream_.get()),
          states_(make_states(plan_, comm, stream_.get())) {}

    std::string describe() const override {
        return fmt::format("cuda: {} ({}){}", cuda_device_name(), precision_name<T>(),
                           states_->describe());
    }
    ModelWeights weights() override { return states_->weights(); }
    OptimizerState& optimizer() override { return states_->optimizer(); }
    void weights_loaded() override { states_->weights_loaded(remat_); }
    CheckpointModel checkpoint_model() override { return states_->checkpoint_model(); }
    ActFormat arena_format() const override {
        return CudaGPT<T>::arena_format(plan_.cfg.model, plan_.cfg.micro_batch(),
                                        plan_.cfg.train.seq_len);
    }
    void set_remat(const RematPlan& plan) override {
        if (CudaGPT<T>* m = states_->model()) m->set_remat(plan);
        remat_ = plan;  // (a QLoRA model built later takes it then)
    }
    const RematPlan& remat_plan() const override { return remat_; }

    void prepare_update(double lr, double max_norm) override {
        update_lr_ = lr;
        update_max_norm_ = max_norm;
        update_prepared_ = true;
    }
    void begin_step() override {
        states_->begin_step();
        step_.begin();
    }
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                          float grad_scale, bool last) override {
        // The run's index of this micro-batch (LoRA's dropout masks are drawn by it).
        const int64_t index =
            states_->optimizer().steps_taken() * plan_.cfg.accum_steps() + step_.micro_batches();
        double* loss_sum = step_.next_micro(B, T_);
        states_->before_backward(last, index);
        // fp16: the loss gradient carries the loss scale, so small gradients stay representable.
        const float scale = grad_scale * step_.loss_scale();
        if (states_->steps_in_backward())
            backward_with_update(inputs, targets, B, T_, scale, loss_sum);
        else
            model().forward_backward(inputs, targets, B, T_, scale, loss_sum);
        states_->after_backward();
    }
    StepResult finish_step(double lr, double max_norm) override {
        // optim.step_in_backward_clip = "previous-norm": the last finite norm clips this step
        // (with accumulation too, where the step runs after the backward).
        const double clip_norm = lagged_clip() ? previous_norm_ : 0.0;
        const StepResult r = step_.finish(lr, max_norm, *states_, clip_norm);
        update_prepared_ = false;
        if (plan_.cfg.optim.step_in_backward) previous_norm_ = r.grad_norm;
        return r;
    }
    double clip_norm_state() const override { return previous_norm_; }
    void restore_clip_norm(double norm) override { previous_norm_ = norm; }
    void set_guarded(bool guarded) override { step_.set_guarded(guarded); }
    // train.diagnostics = amp on one GPU (no NCCL ranks, no offload, not LoRA), where the step's
    // whole gradient is one buffer: brought down once, unscaled by fp16's loss scale (a power of
    // two: exact), counted per tensor on the host.
    bool has_gradient_histograms() const override {
        return !plan_.lora && !plan_.collective && !plan_.cfg.train.offload_optimizer;
    }
    std::vector<TensorHistogram> gradient_histograms() override {
        if (!has_gradient_histograms())
            fail("internal: gradient histograms asked of {}", describe());
        const ParamLayout& layout = model().layout();
        std::vector<T> host(layout.total);
        MT_CUDA_CHECK(cudaMemcpyAsync(host.data(), states_->gradients(), sizeof(T) * host.size(),
                                      cudaMemcpyDeviceToHost, stream_.get()));
        MT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
        const float unscale = 1.0f / step_.loss_scale();
        std::vector<TensorHistogram> out;
        std::vector<float> f;
        for (const ParamSpec& t : layout.tensors) {
            f.resize(t.numel);
            for (std::size_t i = 0; i < t.numel; i++)
                f[i] = cuda::to_fp32(host[t.offset + i]) * unscale;
            out.push_back({t.name, {}});
            out.back().hist.add(f.data(), f.size());
        }
        return out;
    }
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) override {
        states_->before_eval();
        model().forward_loss(inputs, targets, B, T_, step_.eval_sum());
        return step_.eval_loss((int64_t)B * T_, *states_);
    }
    void forward_logits(const int32_t* inputs, int B, int T_, float* out) override {
        states_->before_eval();
        model().forward_logits(inputs, B, T_, out);
    }

    MemoryTracker& memory() override { return device_memory(); }
    std::string memory_title() const override {
        return fmt::format("device: {}, {}{}", cuda_device_name(), precision_name<T>(),
                           states_->title());
    }
    std::vector<MemoryPrediction> predicted_memory(int B, int T_) const override {
        return states_->predicted_memory(remat_, B, T_);
    }
    std::string memory_footer() const override { return states_->memory_footer(); }
    std::pair<double, int64_t> loss_scaler_state() const override { return step_.scaler_state(); }
    void restore_loss_scaler(double scale, int64_t clean) override {
        step_.restore_scaler(scale, clean);
    }

    // Test hooks (cuda_engine.h).
    void inject_overflow() { step_.inject_overflow(); }
    int64_t graph_replays() { return model().graph_replays(); }
    std::pair<int64_t, int64_t> zero_gathers() const { return states_->zero_gathers(); }

  private:
    // optim.step_in_backward_clip = "previous-norm" with a finite norm from the step before.
    bool lagged_clip() const {
        return plan_.cfg.optim.step_in_backward_clip == "previous-norm" && previous_norm_ > 0 &&
               std::isfinite(previous_norm_);
    }
    // optim.step_in_backward with one micro-batch per step (docs/training.md): each unit is
    // updated as soon as its gradient is complete. Clipping (and fp16's overflow skip) needs the
    // step's norm before the first update: a norm pass (the same forward and backward,
    // measuring only) comes first, and the update pass clips with it; finish checks that both
    // passes saw the same gradient. Clipping by the previous step's norm needs no pass.
    void backward_with_update(const int32_t* inputs, const int32_t* targets, int B, int T_,
                              float scale, double* loss_sum) {
        if (!update_prepared_)
            fail("internal: optim.step_in_backward's backward without prepare_update");
        const bool lagged = lagged_clip();
        step_.begin_update(update_lr_, update_max_norm_, lagged ? previous_norm_ : 0.0,
                           states_->optimizer().steps_taken() + 1);
        if ((update_max_norm_ > 0 && !lagged) || plan_.precision == Precision::fp16) {
            states_->arm(step_.unit_sums(), nullptr);
            model().forward_backward(inputs, targets, B, T_, scale, loss_sum);
            states_->disarm();
            step_.finish_norm_pass();
        } else {
            step_.scale_before_norm();
        }
        states_->arm(step_.unit_sums(), step_.device_scalars());
        model().forward_backward(inputs, targets, B, T_, scale, loss_sum);
        states_->disarm();
    }

    // The model states the plan chose: what trains, where it lives, its collectives.
    static std::unique_ptr<ModelStates<T>> make_states(const RunPlan& plan,
                                                       dist::Communicator& comm,
                                                       cudaStream_t stream) {
        if (plan.lora) return std::make_unique<AdapterStates<T>>(plan, comm, stream);
        return std::make_unique<WholeModelStates<T>>(plan, comm, stream);
    }
    CudaGPT<T>& model() {
        CudaGPT<T>* m = states_->model();
        if (!m) fail("internal: the CUDA LoRA model is built by weights_loaded()");
        return *m;
    }

    RunPlan plan_;
    CudaStream stream_;  // the compute stream; every part queues on it, so it goes last
    DeviceStep<T> step_;
    std::unique_ptr<ModelStates<T>> states_;
    RematPlan remat_;
    // optim.step_in_backward: the step's learning rate and clipping (prepare_update), and the
    // last step's gradient norm (step_in_backward_clip = "previous-norm"; checkpoints carry it).
    double update_lr_ = 0, update_max_norm_ = 0;
    bool update_prepared_ = false;
    double previous_norm_ = 0;
};

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const RunPlan& plan, dist::Communicator& comm) {
    return make_for_precision<CudaEngine>(plan, comm);
}

void inject_overflow_for_test(Engine& engine) {
    if (auto* e = dynamic_cast<CudaEngine<__half>*>(&engine)) return e->inject_overflow();
    if (auto* e = dynamic_cast<CudaEngine<__nv_bfloat16>*>(&engine)) return e->inject_overflow();
    if (auto* e = dynamic_cast<CudaEngine<float>*>(&engine)) return e->inject_overflow();
    fail("internal: inject_overflow_for_test needs a CUDA engine");
}

int64_t cuda_graph_replays_for_test(Engine& engine) {
    if (auto* e = dynamic_cast<CudaEngine<__half>*>(&engine)) return e->graph_replays();
    if (auto* e = dynamic_cast<CudaEngine<__nv_bfloat16>*>(&engine)) return e->graph_replays();
    if (auto* e = dynamic_cast<CudaEngine<float>*>(&engine)) return e->graph_replays();
    fail("internal: cuda_graph_replays_for_test needs a CUDA engine");
}

std::pair<int64_t, int64_t> zero_gathers_for_test(Engine& engine) {
    if (auto* e = dynamic_cast<CudaEngine<__half>*>(&engine)) return e->zero_gathers();
    if (auto* e = dynamic_cast<CudaEngine<__nv_bfloat16>*>(&engine)) return e->zero_gathers();
    if (auto* e = dynamic_cast<CudaEngine<float>*>(&engine)) return e->zero_gathers();
    fail("internal: zero_gathers_for_test needs a CUDA engine");
}

}  // namespace memtrain

#else  // built without CUDA

namespace memtrain {

std::unique_ptr<Engine> make_cuda_engine(const RunPlan&, dist::Communicator&) {
    fail(
        "train.device = \"cuda\", but this memtrain was built without CUDA (no nvcc at build "
        "time)");
}

void inject_overflow_for_test(Engine&) {
    fail("internal: inject_overflow_for_test needs a CUDA build");
}

int64_t cuda_graph_replays_for_test(Engine&) {
    fail("internal: cuda_graph_replays_for_test needs a CUDA build");
}

std::pair<int64_t, int64_t> zero_gathers_for_test(Engine&) {
    fail("internal: zero_gathers_for_test needs a CUDA build");
}

}  // namespace memtrain

#endif
