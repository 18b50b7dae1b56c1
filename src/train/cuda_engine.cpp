// The CUDA engine (see cuda_engine.h): CudaGPT<T> for the model, a multi-tensor AdamW (or SGD)
// over fp32 master weights, the gradient norm and clipping on the device, fp16 loss scaling, and
// the device memory report. One stream; the host waits once per step, for the step's loss,
// gradient norm and overflow flag.
#include "train/cuda_engine.h"

#include "core/error.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/device.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer_types.h"
#include "model/cuda_gpt.h"
#include "optim/loss_scaler.h"

namespace memtrain {

namespace {

template <typename T>
constexpr const char* type_name() {
    if constexpr (std::is_same_v<T, float>)
        return "fp32";
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return "bf16";
    else
        return "fp16";
}

// fp32 <-> storage type on the host (round to nearest even), for the offloaded optimizer.
template <typename T>
T to_storage(float x) {
    if constexpr (std::is_same_v<T, float>)
        return x;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16_rn(x);
    else
        return __float2half_rn(x);
}
template <typename T>
float to_fp32(T x) {
    if constexpr (std::is_same_v<T, float>)
        return x;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(x);
    else
        return __half2float(x);
}

std::string mib(std::size_t bytes) {
    return fmt::format("{:.1f} MiB", bytes / 1048576.0);
}

// The engine's ParamStore for weight I/O: a unit's fp32 master weights copied to a host buffer
// and, when written, back to the master and (cast) to the compute copy.
template <typename T>
class CudaEngine;

template <typename T>
class WeightsStore final : public ParamStore {
  public:
    explicit WeightsStore(CudaEngine<T>& e) : e_(e) {}
    float* full_params() override { return nullptr; }
    float* full_grads() override { return nullptr; }
    float* acquire(int u, bool for_write) override;
    void release(int u) override;
    float* unit_grads(int) override {
        fail("internal: the CUDA engine's weight store has no gradients");
    }
    void grads_done(int) override {}
    void zero_grads() override {}

  private:
    CudaEngine<T>& e_;
    int held_ = -1, holds_ = 0;
    bool written_ = false;
    std::vector<float> host_;
};

template <typename T>
class CudaEngine final : public Engine, public OptimizerState {
  public:
    explicit CudaEngine(const RunConfig& cfg);
    ~CudaEngine() override;

    // Engine
    std::string describe() const override {
        return fmt::format("cuda: {} ({})", cuda_device_name(), type_name<T>());
    }
    ModelWeights weights() override { return ModelWeights{store_, model_->layout(), cfg_.model}; }
    OptimizerState& optimizer() override {
        return offload_ ? static_cast<OptimizerState&>(*host_opt_) : *this;
    }
    ActFormat arena_format() const override {
        return CudaGPT<T>::arena_format(cfg_.model, cfg_.micro_batch(), cfg_.train.seq_len);
    }
    void set_remat(const RematPlan& plan) override { model_->set_remat(plan); }
    const RematPlan& remat_plan() const override { return model_->remat_plan(); }
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override;
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) override;
    void forward_logits(const int32_t* inputs, int B, int T_, float* out) override {
        model_->forward_logits(inputs, B, T_, out);
    }
    MemoryTracker& memory() override { return device_memory(); }
    std::string memory_title() const override {
        return fmt::format("device: {}, {}", cuda_device_name(), type_name<T>());
    }
    std::vector<MemoryPrediction> predicted_memory(int B, int T_) const override;
    std::string memory_footer() const override;
    std::pair<double, int64_t> loss_scaler_state() const override {
        return scaler_ ? std::pair<double, int64_t>{scaler_->scale(), scaler_->clean_steps()}
                       : std::pair<double, int64_t>{0.0, 0};
    }
    void restore_loss_scaler(double scale, int64_t clean) override {
        if (scaler_ && scale > 0) scaler_->restore(scale, clean);
    }

    // OptimizerState: the moments (and the step count) live on the device.
    std::size_t offset() const override { return 0; }
    std::size_t count() const override { return model_->layout().total; }
    int64_t steps_taken() const override { return t_; }
    void set_steps_taken(int64_t t) override { t_ = t; }
    std::vector<std::string> state_names() override;
    const float* host_state(const std::string&) override { return nullptr; }
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;

    // Test hooks: the next finish_step finds a non-finite gradient (an fp16 overflow); how many
    // micro-batches replayed a CUDA graph.
    void inject_overflow() { inject_overflow_ = true; }
    int64_t graph_replays() const { return model_->graph_replays(); }

  private:
    friend class WeightsStore<T>;
    float* master() {
        return master_.size() ? master_.data() : reinterpret_cast<float*>(model_->params());
    }
    DeviceBuffer<float>& state_buffer(const std::string& name);
    // ZeRO-Offload's update: the pinned gradients (scaled by grad_scale) into fp32, the host
    // optimizer over the fp32 master, the rounded parameters up to the device.
    void host_update(double lr, float grad_scale);
    std::size_t stats_doubles() const { return 2 + (std::size_t)cfg_.accum_steps(); }

    RunConfig cfg_;
    bool adamw_;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<CudaGPT<T>> model_;
    WeightsStore<T> store_;
    DeviceBuffer<float> master_;  // fp32 master weights (absent when T is float)
    DeviceBuffer<float> m_, v_;   // AdamW moments, or m_ = SGD momentum
    DeviceBuffer<cuda::TensorChunk> chunks_;
    int nchunks_ = 0;
    // Device: StepScalars, then doubles [sum of squares | eval loss | micro-batch loss sums].
    DeviceBuffer<unsigned char> stats_;
    cuda::StepScalars* scalars_host_ = nullptr;  // pinned
    double* stats_host_ = nullptr;               // pinned
    std::unique_ptr<LossScaler> scaler_;
    // ZeRO-Offload (train.offload_optimizer): the fp32 master weights, the moments and the update
    // on the host (the CPU optimizer of optim/optimizer.h, multi-threaded), the gradients coming
    // down and the rounded parameters going up through one pinned buffer of Ψ values of T.
    bool offload_ = false;
    std::unique_ptr<Optimizer> host_opt_;
    Buffer<float> host_master_, host_grads_;
    T* pinned_ = nullptr;
    int64_t t_ = 0;
    int micro_ = 0;
    int64_t tokens_in_step_ = 0;
    bool inject_overflow_ = false;
};

template <typename T>
float* WeightsStore<T>::acquire(int u, bool for_write) {
    if (held_ >= 0 && held_ != u)
        fail("internal: the CUDA engine's weight store holds one unit at a time");
    const ParamUnit& unit = e_.model_->layout().units.at(u);
    if (e_.offload_) {  // the master weights are in host memory already
        if (holds_++ == 0) held_ = u;
        written_ = written_ || for_write;
        return e_.host_master_.data() + unit.begin;
    }
    if (holds_++ == 0) {
        held_ = u;
        host_.resize(unit.size());
        MT_CUDA_CHECK(cudaMemcpyAsync(host_.data(), e_.master() + unit.begin,
                                      unit.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      e_.stream_));
        MT_CUDA_CHECK(cudaStreamSynchronize(e_.stream_));
    }
    written_ = written_ || for_write;
    return host_.data();
}

template <typename T>
void WeightsStore<T>::release(int u) {
    if (held_ != u || holds_ <= 0) fail("internal: WeightsStore::release({}) without acquire", u);
    if (--holds_ > 0) return;
    if (written_ && e_.offload_) {
        // Round the unit's new master weights into the pinned buffer and up to the device copy.
        const ParamUnit& unit = e_.model_->layout().units[u];
        const float* src = e_.host_master_.data() + unit.begin;
        T* stage = e_.pinned_ + unit.begin;
        for (std::size_t i = 0; i < unit.size(); i++) stage[i] = to_storage<T>(src[i]);
        MT_CUDA_CHECK(cudaMemcpyAsync(e_.model_->params() + unit.begin, stage,
                                      unit.size() * sizeof(T), cudaMemcpyHostToDevice, e_.stream_));
        MT_CUDA_CHECK(cudaStreamSynchronize(e_.stream_));
    } else if (written_) {
        const ParamUnit& unit = e_.model_->layout().units[u];
        float* dst = e_.master() + unit.begin;
        MT_CUDA_CHECK(cudaMemcpyAsync(dst, host_.data(), unit.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, e_.stream_));
        if constexpr (!std::is_same_v<T, float>)
            cuda::cast<T, float>(e_.model_->params() + unit.begin, dst, (int64_t)unit.size(),
                                 e_.stream_);
        MT_CUDA_CHECK(cudaStreamSynchronize(e_.stream_));  // host_ is reused
    }
    held_ = -1;
    written_ = false;
}

template <typename T>
CudaEngine<T>::CudaEngine(const RunConfig& cfg)
    : cfg_(cfg), adamw_(cfg.optim.name == "adamw"), store_(*this) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    model_ = std::make_unique<CudaGPT<T>>(cfg_.model, stream_);
    model_->set_cuda_graphs(cfg_.train.cuda_graphs);
    const ParamLayout& layout = model_->layout();
    const std::size_t psi = layout.total;
    offload_ = cfg_.train.offload_optimizer;
    if (offload_) {
        host_opt_ = make_optimizer(cfg_.optim, layout);
        host_master_ = Buffer<float>(psi, MemCategory::OptimizerState);
        host_grads_ = Buffer<float>(psi, MemCategory::Gradients);
        MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_), psi * sizeof(T)));
    } else {
        if constexpr (!std::is_same_v<T, float>)
            master_ = DeviceBuffer<float>(psi, MemCategory::OptimizerState);
        m_ = DeviceBuffer<float>(psi, MemCategory::OptimizerState);
        if (adamw_) v_ = DeviceBuffer<float>(psi, MemCategory::OptimizerState);
        const auto chunks = cuda::tensor_chunks(layout, 0, psi);
        nchunks_ = (int)chunks.size();
        chunks_ = DeviceBuffer<cuda::TensorChunk>(chunks.size(), MemCategory::OptimizerState);
        copy_to_device(chunks_.data(), chunks.data(), chunks_.bytes());
    }
    stats_ = DeviceBuffer<unsigned char>(sizeof(cuda::StepScalars) + 8 * stats_doubles(),
                                         MemCategory::Workspace);
    MT_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&scalars_host_), sizeof(cuda::StepScalars)));
    MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stats_host_), 8 * stats_doubles()));
    if (cfg_.train.precision == "fp16")
        scaler_ = std::make_unique<LossScaler>(cfg_.optim.loss_scale, cfg_.optim.loss_scale_window);
}

template <typename T>
CudaEngine<T>::~CudaEngine() {
    if (stream_) cudaStreamSynchronize(stream_);
    if (scalars_host_) cudaFreeHost(scalars_host_);
    if (stats_host_) cudaFreeHost(stats_host_);
    if (pinned_) cudaFreeHost(pinned_);
    model_.reset();
    if (stream_) cudaStreamDestroy(stream_);
}

template <typename T>
void CudaEngine<T>::begin_step() {
    model_->zero_grads();
    micro_ = 0;
    tokens_in_step_ = 0;
}

template <typename T>
void CudaEngine<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                                     float grad_scale, bool) {
    if (micro_ >= cfg_.accum_steps())
        fail("internal: more micro-batches ({}) than train accumulation steps ({})", micro_ + 1,
             cfg_.accum_steps());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    // fp16: the loss gradient carries the loss scale, so small gradients stay representable.
    const float scale = scaler_ ? (float)scaler_->scale() : 1.0f;
    model_->forward_backward(inputs, targets, B, T_, grad_scale * scale, sums + 2 + micro_);
    micro_++;
    tokens_in_step_ += (int64_t)B * T_;
}

template <typename T>
StepResult CudaEngine<T>::finish_step(double lr, double max_norm) {
    const std::size_t psi = model_->layout().total;
    const int64_t t = t_ + 1;
    cuda::StepScalars& s = *scalars_host_;
    // The CPU optimizer's constants, computed the same way (optim/optimizer.cpp).
    s = cuda::make_step_scalars(cfg_.optim, lr, t, scaler_ ? (float)scaler_->scale() : 1.0f);
    s.max_norm = (float)max_norm;
    auto* dev_scalars = reinterpret_cast<cuda::StepScalars*>(stats_.data());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    MT_CUDA_CHECK(cudaMemcpyAsync(dev_scalars, &s, sizeof(s), cudaMemcpyHostToDevice, stream_));
    T* grads = model_->grads();
    if (inject_overflow_) {
        // Test hook: one gradient becomes +inf, as an fp16 overflow in backward would make it.
        const T inf = (T)INFINITY;
        MT_CUDA_CHECK(cudaMemcpyAsync(grads, &inf, sizeof(T), cudaMemcpyHostToDevice, stream_));
        MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
        inject_overflow_ = false;
    }
    cuda::sum_squares<T>(sums, grads, (int64_t)psi, stream_);
    cuda::finish_grad_norm(dev_scalars, sums, stream_);
    if (offload_) {
        // The gradients come down with the step's results; the update runs on the host.
        MT_CUDA_CHECK(
            cudaMemcpyAsync(pinned_, grads, psi * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    } else if (adamw_)
        cuda::adamw_step<T>(model_->params(), master_.size() ? master_.data() : nullptr, m_.data(),
                            v_.data(), grads, chunks_.data(), nchunks_, dev_scalars, stream_);
    else
        cuda::sgd_step<T>(model_->params(), master_.size() ? master_.data() : nullptr, m_.data(),
                          grads, chunks_.data(), nchunks_, dev_scalars, stream_);
    // The step's results: norm and overflow flag, and the micro-batches' loss sums.
    MT_CUDA_CHECK(
        cudaMemcpyAsync(scalars_host_, dev_scalars, sizeof(s), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(stats_host_, sums, 8 * stats_doubles(), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    StepResult r;
    double loss = 0;
    for (int k = 0; k < micro_; k++) loss += stats_host_[2 + k];
    r.loss = tokens_in_step_ ? loss / (double)tokens_in_step_ : 0.0;
    r.grad_norm = scalars_host_->grad_norm;
    r.skipped = scalars_host_->skip != 0;
    r.loss_scale = s.loss_scale;
    if (!r.skipped) {
        t_++;
        if (offload_) host_update(lr, scalars_host_->grad_scale);
    }
    if (scaler_) {
        scaler_->update(r.skipped, t);
    } else if (r.skipped) {
        fail(
            "the gradient norm is not finite at step {} ({} training has no loss scale to "
            "lower): lower optim.lr or check the data",
            t, type_name<T>());
    }
    return r;
}

template <typename T>
void CudaEngine<T>::host_update(double lr, float grad_scale) {
    const int64_t psi = (int64_t)model_->layout().total;
    float* g = host_grads_.data();
    float* master = host_master_.data();
    T* pin = pinned_;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < psi; i++) g[i] = to_fp32(pin[i]) * grad_scale;
    host_opt_->step(master, g, lr);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < psi; i++) pin[i] = to_storage<T>(master[i]);
    // The next step's gradients come down after this copy in stream order, and the host writes
    // the pinned buffer again only after that step's wait.
    MT_CUDA_CHECK(
        cudaMemcpyAsync(model_->params(), pin, psi * sizeof(T), cudaMemcpyHostToDevice, stream_));
}

template <typename T>
double CudaEngine<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) {
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    model_->forward_loss(inputs, targets, B, T_, sums + 1);
    double sum = 0;
    MT_CUDA_CHECK(cudaMemcpyAsync(&stats_host_[1], sums + 1, sizeof(double), cudaMemcpyDeviceToHost,
                                  stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    sum = stats_host_[1];
    return sum / ((double)B * T_);
}

template <typename T>
DeviceBuffer<float>& CudaEngine<T>::state_buffer(const std::string& name) {
    if (adamw_ && name == "exp_avg") return m_;
    if (adamw_ && name == "exp_avg_sq") return v_;
    if (!adamw_ && name == "momentum_buffer") return m_;
    fail("internal: the CUDA optimizer has no state tensor '{}'", name);
}

template <typename T>
std::vector<std::string> CudaEngine<T>::state_names() {
    if (adamw_) return {"exp_avg", "exp_avg_sq"};
    return {"momentum_buffer"};
}

template <typename T>
void CudaEngine<T>::read_state(const std::string& name, float* dst) {
    DeviceBuffer<float>& b = state_buffer(name);
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, b.data(), b.bytes(), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
void CudaEngine<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                const float* src) {
    DeviceBuffer<float>& b = state_buffer(name);
    if (begin > b.size() || n > b.size() - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             b.size());
    MT_CUDA_CHECK(
        cudaMemcpyAsync(b.data() + begin, src, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
std::vector<MemoryPrediction> CudaEngine<T>::predicted_memory(int B, int T_) const {
    const std::size_t psi = model_->layout().total, e = sizeof(T);
    const char* tn = type_name<T>();
    const bool mixed = !std::is_same_v<T, float>;
    const std::size_t k = offload_ ? 0 : (mixed ? 4 : 0) + (adamw_ ? 8 : 4);
    const std::string states =
        fmt::format("{}{}", mixed ? "fp32 master, " : "", adamw_ ? "Adam m, v" : "momentum");
    const std::size_t table = (std::size_t)nchunks_ * sizeof(cuda::TensorChunk);
    auto lay = activation_layout(cfg_.model, B, T_, model_->remat_plan(),
                                 CudaGPT<T>::arena_format(cfg_.model, B, T_));
    const std::size_t extra =
        CudaGPT<T>::token_bytes(B, T_) + CudaGPT<T>::kGraphBytes + stats_.bytes();
    return {
        {MemCategory::Parameters, fmt::format("{} x params ({})", e, tn), e * psi},
        {MemCategory::Gradients, fmt::format("{} x params ({})", e, tn), e * psi},
        {MemCategory::OptimizerState,
         offload_ ? std::string("none on the device (train.offload_optimizer: see below)")
                  : fmt::format("{} x params ({}) + chunk table {} B", k, states, table),
         k * psi + table},
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={}, {})", cfg_.train.remat, tn),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace, "activation_layout(B, T) + token ids + step statistics",
         arena_bytes(lay, MemCategory::Workspace) + extra},
    };
}

template <typename T>
std::string CudaEngine<T>::memory_footer() const {
    std::size_t free_b = 0, total_b = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    std::string out = fmt::format(
        "{:<16} {:>12}  of {} (the driver's count: the CUDA context, library code and handles, "
        "and page granularity beyond the tracked tensors)\n",
        "device in use", mib(total_b - free_b), mib(total_b));
    if (offload_) {
        const std::size_t psi = model_->layout().total;
        out += fmt::format(
            "{:<16} {:>12}  (train.offload_optimizer: fp32 master 4 + {} + fp32 gradients 4 + "
            "pinned transfer buffer {} bytes per parameter, in host memory)\n",
            "optimizer (host)",
            mib(host_master_.bytes() + (adamw_ ? 8 : 4) * psi + host_grads_.bytes() +
                psi * sizeof(T)),
            adamw_ ? "Adam m, v 8" : "momentum 4", sizeof(T));
    }
    if (model_->offloaded_bytes() > 0)
        out += fmt::format(
            "{:<16} {:>12}  (train.remat = offload: block inputs in pinned host "
            "memory, copied out in the forward and prefetched in the backward)\n",
            "offloaded", mib(model_->offloaded_bytes()));
    out += fmt::format("{:<16} {:>12}  (host: code, libraries, loaders, pinned staging)\n",
                       "process peak RSS", mib(process_peak_rss()));
    return out;
}

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const RunConfig& cfg) {
    if (!cuda_available()) fail("train.device = \"cuda\", but no CUDA device answers");
    if (cfg.train.precision == "fp32") return std::make_unique<CudaEngine<float>>(cfg);
    if (cfg.train.precision == "bf16") return std::make_unique<CudaEngine<__nv_bfloat16>>(cfg);
    if (cfg.train.precision == "fp16") return std::make_unique<CudaEngine<__half>>(cfg);
    fail("internal: train.precision '{}' was not resolved", cfg.train.precision);
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

}  // namespace memtrain

#else  // built without CUDA

namespace memtrain {

std::unique_ptr<Engine> make_cuda_engine(const RunConfig&) {
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

}  // namespace memtrain

#endif
