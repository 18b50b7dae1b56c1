// The CUDA engines' shared end of step and evaluation loss (see device_step.h).
#include "engine/cuda/device_step.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "core/error.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"

namespace memtrain {

template <typename T>
DeviceStep<T>::DeviceStep(const OptimConfig& optim, Precision precision, int accum_steps, int units,
                          cudaStream_t stream)
    : optim_(optim), accum_(accum_steps), units_(units), stream_(stream) {
    stats_ = DeviceBuffer<unsigned char>(sizeof(cuda::StepScalars) + 8 * doubles(),
                                         MemCategory::Workspace);
    MT_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&scalars_host_), sizeof(cuda::StepScalars)));
    MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stats_host_), 8 * doubles()));
    // fp16 has too little range for small gradients: the loss gradient carries a dynamic scale.
    if (precision == Precision::fp16)
        scaler_ = std::make_unique<LossScaler>(optim.loss_scale, optim.loss_scale_window);
}

template <typename T>
DeviceStep<T>::~DeviceStep() {
    if (scalars_host_) cudaFreeHost(scalars_host_);
    if (stats_host_) cudaFreeHost(stats_host_);
}

template <typename T>
std::pair<double, int64_t> DeviceStep<T>::scaler_state() const {
    return scaler_ ? std::pair<double, int64_t>{scaler_->scale(), scaler_->clean_steps()}
                   : std::pair<double, int64_t>{0.0, 0};
}

template <typename T>
void DeviceStep<T>::restore_scaler(double scale, int64_t clean_steps) {
    if (scaler_ && scale > 0) scaler_->restore(scale, clean_steps);
}

template <typename T>
void DeviceStep<T>::begin() {
    micro_ = 0;
    tokens_ = 0;
}

template <typename T>
double* DeviceStep<T>::next_micro(int B, int T_) {
    if (micro_ >= accum_)
        fail("internal: more micro-batches ({}) than train accumulation steps ({})", micro_ + 1,
             accum_);
    tokens_ += (int64_t)B * T_;
    return loss_sum(micro_++);
}

template <typename T>
void DeviceStep<T>::begin_update(double lr, double max_norm, double clip_norm, int64_t t) {
    cuda::StepScalars& s = *scalars_host_;
    s = cuda::make_step_scalars(optim_, lr, t, loss_scale());
    s.max_norm = (float)max_norm;
    s.clip_norm = clip_norm;
    MT_CUDA_CHECK(cudaMemcpyAsync(scalars(), &s, sizeof(s), cudaMemcpyHostToDevice, stream_));
    update_queued_ = true;
}

template <typename T>
void DeviceStep<T>::finish_norm_pass() {
    if (!units_) fail("internal: a norm pass without unit sums");
    cuda::sum_doubles_to_device(sums(), unit_sums(), units_, stream_);
    cuda::finish_grad_norm(scalars(), sums(), stream_);
    MT_CUDA_CHECK(cudaMemcpyAsync(sums() + norm_pass_slot(), sums(), sizeof(double),
                                  cudaMemcpyDeviceToDevice, stream_));
    norm_pass_ = true;
}

template <typename T>
void DeviceStep<T>::scale_before_norm() {
    cuda::scale_before_norm(scalars(), stream_);
}

template <typename T>
StepResult DeviceStep<T>::finish(double lr, double max_norm, StepCollectives<T>& parts,
                                 double clip_norm) {
    OptimizerState& opt = parts.optimizer();
    const int64_t t = opt.steps_taken() + 1;
    cuda::StepScalars& s = *scalars_host_;
    if (!update_queued_) {
        // The CPU optimizer's constants, computed the same way (optim/optimizer.cpp).
        s = cuda::make_step_scalars(optim_, lr, t, loss_scale());
        s.max_norm = (float)max_norm;
        s.clip_norm = clip_norm;
        MT_CUDA_CHECK(cudaMemcpyAsync(scalars(), &s, sizeof(s), cudaMemcpyHostToDevice, stream_));
    }
    const float scale = s.loss_scale;
    T* grads = parts.gradients();
    if (inject_overflow_) {
        if (!grads)
            fail(
                "internal: inject_overflow needs a gradient buffer (not the step inside the "
                "backward)");
        // Test hook: one gradient becomes +inf, as an fp16 overflow in backward would make it.
        const T inf = (T)INFINITY;
        MT_CUDA_CHECK(cudaMemcpyAsync(grads, &inf, sizeof(T), cudaMemcpyHostToDevice, stream_));
        parts.wait("queued device work");
        inject_overflow_ = false;
    }
    parts.reduce(sums(), unit_sums());
    cuda::finish_grad_norm(scalars(), sums(), stream_);
    parts.update(scalars());  // (nothing after an update inside the backward)
    // The step's results: norm and overflow flag, and the micro-batches' loss sums.
    MT_CUDA_CHECK(
        cudaMemcpyAsync(scalars_host_, scalars(), sizeof(s), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(stats_host_, sums(), 8 * doubles(), cudaMemcpyDeviceToHost, stream_));
    parts.wait("the step's collectives");
    update_queued_ = false;
    if (norm_pass_) {
        // The update pass saw the gradient the norm pass measured, bit for bit.
        norm_pass_ = false;
        const double seen = stats_host_[0], measured = stats_host_[norm_pass_slot()];
        if (std::isfinite(seen) && std::isfinite(measured) && seen != measured)
            fail(
                "internal: optim.step_in_backward's norm pass measured a sum of squares {} and "
                "its update pass {}: the backward is not deterministic",
                measured, seen);
    }
    StepResult r;
    double loss = 0;
    for (int k = 0; k < micro_; k++) loss += stats_host_[2 + k];
    r.loss = parts.job_loss(tokens_ ? loss / (double)tokens_ : 0.0);
    r.grad_norm = scalars_host_->grad_norm;
    r.skipped = scalars_host_->skip != 0;
    r.loss_scale = scale;
    if (!r.skipped) {
        parts.updated(lr, scalars_host_->grad_scale);
        opt.set_steps_taken(t);
    } else {
        r.overflow = parts.overflow();
    }
    if (scaler_) {
        try {
            scaler_->update(r.skipped, t);
        } catch (const Error& e) {  // the scale collapsed: say where the overflow is
            fail("{} ({})", e.what(), r.overflow);
        }
    } else if (r.skipped && !guarded_) {
        fail(
            "the gradient norm is not finite at step {} ({} training has no loss scale to "
            "lower; {}): lower optim.lr or check the data",
            t, cuda::precision_name<T>(), r.overflow);
    }
    return r;
}

template <typename T>
double DeviceStep<T>::eval_loss(int64_t tokens, StepCollectives<T>& parts, bool here) {
    if (here)
        MT_CUDA_CHECK(cudaMemcpyAsync(&stats_host_[1], eval_sum(), sizeof(double),
                                      cudaMemcpyDeviceToHost, stream_));
    parts.wait("the validation loss");
    return here ? stats_host_[1] / (double)tokens : 0.0;
}

template class DeviceStep<float>;
template class DeviceStep<__nv_bfloat16>;
template class DeviceStep<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
