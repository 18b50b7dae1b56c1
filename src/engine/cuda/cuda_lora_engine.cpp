// LoRA and QLoRA on the GPU (see cuda_engine.h, make_cuda_lora_engine): CudaGPT<T> over a frozen
// base, whole as T or packed (QuantizedDeviceBase), the adapters (CudaLora) trained with the
// CUDA engine's multi-tensor AdamW over fp32 master weights, the gradient norm and clipping on
// the device, and fp16 loss scaling. Checkpoints hold the adapters in PEFT's files and their
// optimizer state, the same files the CPU's LoraEngine writes, so a run moves between devices.
#include "engine/cuda/cuda_engine.h"

#include "core/error.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "core/device.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/host_memory.h"
#include "io/lora_files.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "model/cuda_gpt.h"
#include "model/cuda_lora.h"
#include "optim/device_update.h"
#include "optim/loss_scaler.h"
#include "quant/device_base.h"
#include "quant/quantized_store.h"

namespace memtrain {

namespace {

using cuda::precision_name;
using cuda::to_fp32;
using cuda::to_storage;

// A UnitStore over device values, one unit at a time through a host fp32 buffer: `read` copies
// unit u's floats down, `write` puts them back after a writing acquire.
class HostWindow final : public WeightWindow {
  public:
    using Read = std::function<void(int u, float* dst)>;
    using Write = std::function<void(int u, const float* src)>;
    HostWindow(const ParamLayout& layout, Read read, Write write)
        : layout_(&layout), read_(std::move(read)), write_(std::move(write)) {}
    float* acquire(int u, bool for_write) override {
        if (held_ >= 0 && held_ != u) fail("internal: HostWindow holds one unit at a time");
        if (holds_++ == 0) {
            held_ = u;
            host_.resize(layout_->units.at((std::size_t)u).size());
            read_(u, host_.data());
        }
        written_ = written_ || for_write;
        return host_.data();
    }
    void release(int u) override {
        if (held_ != u || holds_ <= 0) fail("internal: HostWindow::release({}) without acquire", u);
        if (--holds_ > 0) return;
        if (written_) write_(u, host_.data());
        held_ = -1;
        written_ = false;
    }

  private:
    const ParamLayout* layout_;
    Read read_;
    Write write_;
    std::vector<float> host_;
    int held_ = -1, holds_ = 0;
    bool written_ = false;
};

template <typename T>
class CudaLoraEngine final : public Engine, public OptimizerState {
  public:
    CudaLoraEngine(const RunPlan& plan, dist::Communicator& comm);
    ~CudaLoraEngine() override;

    std::string describe() const override;
    ModelWeights weights() override;
    OptimizerState& optimizer() override { return *this; }
    ActFormat arena_format() const override {
        return CudaGPT<T>::arena_format(cfg_.model, cfg_.micro_batch(), cfg_.train.seq_len);
    }
    void set_remat(const RematPlan& plan) override {
        plan_ = plan;
        if (model_) model_->set_remat(plan);
    }
    const RematPlan& remat_plan() const override { return plan_; }
    void weights_loaded() override;
    CheckpointModel checkpoint_model() override;
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override;
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) override;
    void forward_logits(const int32_t* inputs, int B, int T_, float* out) override {
        lora_->set_training(false);
        model().forward_logits(inputs, B, T_, out);
    }
    MemoryTracker& memory() override { return device_memory(); }
    std::string memory_title() const override {
        return fmt::format("device: {}, {}, {}", cuda_device_name(), precision_name<T>(),
                           quantized() ? "QLoRA" : "LoRA");
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

    // OptimizerState: the adapters' moments on the device.
    std::size_t offset() const override { return 0; }
    std::size_t count() const override { return n_; }
    int64_t steps_taken() const override { return t_; }
    void set_steps_taken(int64_t t) override { t_ = t; }
    std::vector<std::string> state_names() override { return opt_.state_names(); }
    const float* host_state(const std::string&) override { return nullptr; }
    void read_state(const std::string& name, float* dst) override {
        opt_.read_state(name, dst, stream_, [this] { wait("queued device work"); });
    }
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override {
        opt_.write_state(name, begin, n, src, stream_, [this] { wait("queued device work"); });
    }

  private:
    bool quantized() const { return cfg_.lora.base != "fp32"; }
    CudaGPT<T>& model() {
        if (!model_) fail("internal: the CUDA LoRA model is built by weights_loaded()");
        return *model_;
    }
    // The adapters' fp32 master weights (the parameters themselves in fp32).
    float* master() {
        return opt_.master() ? opt_.master() : reinterpret_cast<float*>(params_.data());
    }
    // With several ranks through the device communicator, which fails fast on a dead peer.
    void wait(const char* what) {
        if (dcomm_)
            dcomm_->wait(stream_, what);
        else
            MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    std::size_t stats_doubles() const { return 2 + (std::size_t)cfg_.accum_steps(); }

    RunConfig cfg_;
    cudaStream_t stream_ = nullptr;
    // Data parallelism (DDP): the adapters' gradients all-reduced over NCCL once per step.
    std::unique_ptr<dist::DeviceCommunicator> dcomm_;
    ParamLayout layout_;      // the base's
    LoraLayout lora_layout_;  // the adapters'
    std::size_t n_ = 0;       // adapter parameters
    RematPlan plan_;
    // The base: whole as T in the model's own buffer (lora.base = fp32), or packed: written
    // through quant_writer_ into host_quant_ (one unit of fp32 at a time), then copied to the
    // device by weights_loaded() and the host copy dropped.
    std::unique_ptr<quant::QuantizedParamStore> host_quant_;
    std::unique_ptr<quant::QuantizedStoreWriter> quant_writer_;
    std::unique_ptr<QuantizedDeviceBase<T>> quant_base_;
    std::unique_ptr<HostWindow> base_window_, adapter_window_;
    // The adapters: T parameters and gradients; their optimizer (fp32 master when T is not float,
    // moments).
    DeviceBuffer<T> params_, grads_;
    DeviceOptimizer<T> opt_;
    std::unique_ptr<CudaLora<T>> lora_;
    std::unique_ptr<CudaGPT<T>> model_;
    DeviceBuffer<unsigned char> stats_;  // StepScalars, then doubles [sumsq | eval | losses]
    cuda::StepScalars* scalars_host_ = nullptr;
    double* stats_host_ = nullptr;
    std::unique_ptr<LossScaler> scaler_;
    int64_t t_ = 0;
    int micro_ = 0;
    int64_t tokens_in_step_ = 0;
};

template <typename T>
CudaLoraEngine<T>::CudaLoraEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg),
      layout_(make_param_layout(plan.cfg.model)),
      lora_layout_(make_lora_layout(plan.cfg.model, plan.cfg.lora)) {
    if (comm.size() > 1 && cfg_.train.zero_stage > 0)
        fail(
            "LoRA on the CUDA engine runs data parallelism as DDP (train.zero_stage = 0), not ZeRO "
            "stage {}: the adapters' states are small; ZeRO over adapters runs on the CPU engine",
            cfg_.train.zero_stage);
    if (cfg_.train.offload_optimizer)
        fail(
            "train.offload_optimizer does not apply to LoRA: its optimizer state is the adapters'");
    if (cfg_.train.cuda_graphs)
        fail(
            "train.cuda_graphs does not run LoRA yet (the dropout mask changes every micro-batch)");
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    // Launched by mpirun: NCCL between the ranks' GPUs (as CudaEngine: even at world size 1).
    if (dynamic_cast<dist::LocalCommunicator*>(&comm) == nullptr)
        dcomm_ = dist::make_nccl_communicator(dist::HostLink{
            comm.rank(), comm.size(), [&comm](void* d, int64_t b) { comm.broadcast(d, b, 0); }});
    n_ = lora_layout_.params.total;
    params_ = DeviceBuffer<T>(n_, MemCategory::Parameters);
    grads_ = DeviceBuffer<T>(n_, MemCategory::Gradients);
    opt_ = DeviceOptimizer<T>(cfg_.optim, lora_layout_.params, 0, n_);

    // The adapters seen unit by unit in fp32: their master weights (read), written back to the
    // master and rounded into the parameters.
    adapter_window_ = std::make_unique<HostWindow>(
        lora_layout_.params,
        [this](int u, float* dst) {
            const ParamUnit& unit = lora_layout_.params.units[(std::size_t)u];
            MT_CUDA_CHECK(cudaMemcpyAsync(dst, master() + unit.begin, unit.size() * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream_));
            wait("an adapter transfer");
        },
        [this](int u, const float* src) {
            const ParamUnit& unit = lora_layout_.params.units[(std::size_t)u];
            MT_CUDA_CHECK(cudaMemcpyAsync(master() + unit.begin, src, unit.size() * sizeof(float),
                                          cudaMemcpyHostToDevice, stream_));
            if constexpr (!std::is_same_v<T, float>)
                cuda::cast<T, float>(params_.data() + unit.begin, master() + unit.begin,
                                     (int64_t)unit.size(), stream_);
            wait("an adapter transfer");
        });
    // Dropout masks as the CPU engine draws them (engine/cpu/lora_engine.cpp): one per rank.
    lora_ =
        std::make_unique<CudaLora<T>>(cfg_.lora, lora_layout_, params_.data(), grads_.data(),
                                      cfg_.train.seed ^ (0xD20Full * (comm.rank() + 1)), stream_);
    init_lora_weights(*adapter_window_, lora_layout_, cfg_.train.seed);

    if (quantized()) {
        const quant::BaseQuant q = quant::lora_base_quant(cfg_.lora);
        q.check(cfg_.model);
        host_quant_ = std::make_unique<quant::QuantizedParamStore>(cfg_.model, q);
        quant_writer_ = std::make_unique<quant::QuantizedStoreWriter>(*host_quant_);
        // Once on the device, the packed base's layout is still there to see, not its values.
        auto sealed = [](int u, const float*) {
            fail(
                "the QLoRA base is on the device, packed: its fp32 weights (unit {}) cannot be "
                "read or written",
                u);
        };
        base_window_ = std::make_unique<HostWindow>(
            layout_, [sealed](int u, float*) { sealed(u, nullptr); }, sealed);
    } else {
        model_ = std::make_unique<CudaGPT<T>>(cfg_.model, stream_, 0, nullptr, lora_.get());
        // The base written unit by unit in fp32 and rounded into the model's parameters.
        base_window_ = std::make_unique<HostWindow>(
            layout_,
            [this](int u, float* dst) {
                const ParamUnit& unit = layout_.units[(std::size_t)u];
                std::vector<T> tmp(unit.size());
                MT_CUDA_CHECK(cudaMemcpyAsync(tmp.data(), model_->params() + unit.begin,
                                              unit.size() * sizeof(T), cudaMemcpyDeviceToHost,
                                              stream_));
                wait("a weight transfer");
                for (std::size_t i = 0; i < tmp.size(); i++) dst[i] = to_fp32(tmp[i]);
            },
            [this](int u, const float* src) {
                const ParamUnit& unit = layout_.units[(std::size_t)u];
                std::vector<T> tmp(unit.size());
                for (std::size_t i = 0; i < tmp.size(); i++) tmp[i] = to_storage<T>(src[i]);
                MT_CUDA_CHECK(cudaMemcpyAsync(model_->params() + unit.begin, tmp.data(),
                                              unit.size() * sizeof(T), cudaMemcpyHostToDevice,
                                              stream_));
                wait("a weight transfer");
            });
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
CudaLoraEngine<T>::~CudaLoraEngine() {
    if (stream_) cudaStreamSynchronize(stream_);
    model_.reset();
    if (scalars_host_) cudaFreeHost(scalars_host_);
    if (stats_host_) cudaFreeHost(stats_host_);
    if (stream_) cudaStreamDestroy(stream_);
}

template <typename T>
std::string CudaLoraEngine<T>::describe() const {
    std::string names;
    for (const auto& n : lora_layout_.names) names += (names.empty() ? "" : ", ") + n;
    return fmt::format(
        "cuda: {} ({}), {} r={} alpha={} on {} ({} trainable), base {} frozen", cuda_device_name(),
        precision_name<T>(), quantized() ? "QLoRA" : "LoRA", cfg_.lora.rank, cfg_.lora.alpha, names,
        n_,
        quantized() ? quant::lora_base_quant(cfg_.lora).name() : std::string(precision_name<T>()));
}

template <typename T>
ModelWeights CudaLoraEngine<T>::weights() {
    if (quant_writer_) return quant_writer_->weights();
    return ModelWeights{*base_window_, layout_, cfg_.model};
}

template <typename T>
void CudaLoraEngine<T>::weights_loaded() {
    if (!quantized()) return;
    if (!quant_writer_) return;  // already on the device
    quant_writer_.reset();
    quant_base_ = std::make_unique<QuantizedDeviceBase<T>>(*host_quant_, stream_);
    host_quant_.reset();  // the device holds the only copy from here on
    model_ = std::make_unique<CudaGPT<T>>(cfg_.model, stream_, 0, quant_base_.get(), lora_.get());
    if (!plan_.empty()) model_->set_remat(plan_);
}

template <typename T>
CheckpointModel CudaLoraEngine<T>::checkpoint_model() {
    return {cfg_.model, lora_layout_.params,
            [this](const std::string& dir, bool root) {
                save_lora_adapters(dir, cfg_, lora_layout_, *adapter_window_, root);
            },
            [this](const std::string& dir) {
                load_lora_adapters(dir, cfg_.model, lora_layout_, *adapter_window_);
            }};
}

template <typename T>
void CudaLoraEngine<T>::begin_step() {
    MT_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
    micro_ = 0;
    tokens_in_step_ = 0;
}

template <typename T>
void CudaLoraEngine<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B,
                                         int T_, float grad_scale, bool /*last*/) {
    if (micro_ >= cfg_.accum_steps())
        fail("internal: more micro-batches ({}) than train accumulation steps ({})", micro_ + 1,
             cfg_.accum_steps());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    const float scale = scaler_ ? (float)scaler_->scale() : 1.0f;
    lora_->set_training(true);
    lora_->set_micro_batch((uint64_t)(t_ * cfg_.accum_steps() + micro_));
    model().forward_backward(inputs, targets, B, T_, grad_scale * scale, sums + 2 + micro_);
    micro_++;
    tokens_in_step_ += (int64_t)B * T_;
}

template <typename T>
StepResult CudaLoraEngine<T>::finish_step(double lr, double max_norm) {
    const int64_t t = t_ + 1;
    cuda::StepScalars& s = *scalars_host_;
    s = cuda::make_step_scalars(cfg_.optim, lr, t, scaler_ ? (float)scaler_->scale() : 1.0f);
    s.max_norm = (float)max_norm;
    auto* dev_scalars = reinterpret_cast<cuda::StepScalars*>(stats_.data());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    MT_CUDA_CHECK(cudaMemcpyAsync(dev_scalars, &s, sizeof(s), cudaMemcpyHostToDevice, stream_));
    // DDP: every rank's adapter gradients summed (the loss gradient already carries 1 / the
    // global token count), so every rank takes the same update.
    if (dcomm_) dcomm_->all_reduce_sum(grads_.data(), (int64_t)n_, dist::device_type<T>(), stream_);
    cuda::sum_squares<T>(sums, grads_.data(), (int64_t)n_, stream_);  // overwrites sums[0]
    cuda::finish_grad_norm(dev_scalars, sums, stream_);
    opt_.step(params_.data(), grads_.data(), dev_scalars, stream_);
    MT_CUDA_CHECK(
        cudaMemcpyAsync(scalars_host_, dev_scalars, sizeof(s), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(stats_host_, sums, 8 * stats_doubles(), cudaMemcpyDeviceToHost, stream_));
    wait("the step's results");
    StepResult r;
    double loss = 0;
    for (int k = 0; k < micro_; k++) loss += stats_host_[2 + k];
    r.loss = tokens_in_step_ ? loss / (double)tokens_in_step_ : 0.0;
    r.grad_norm = scalars_host_->grad_norm;
    r.skipped = scalars_host_->skip != 0;
    r.loss_scale = s.loss_scale;
    if (!r.skipped) t_++;
    if (r.skipped) r.overflow = "non-finite adapter gradients";
    if (scaler_) {
        scaler_->update(r.skipped, t);
    } else if (r.skipped) {
        fail(
            "the adapters' gradient norm is not finite at step {} ({} training has no loss scale "
            "to lower): lower optim.lr or check the data",
            t, precision_name<T>());
    }
    return r;
}

template <typename T>
double CudaLoraEngine<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B,
                                       int T_) {
    lora_->set_training(false);
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    model().forward_loss(inputs, targets, B, T_, sums + 1);
    MT_CUDA_CHECK(cudaMemcpyAsync(&stats_host_[1], sums + 1, sizeof(double), cudaMemcpyDeviceToHost,
                                  stream_));
    wait("the validation loss");
    return stats_host_[1] / ((double)B * T_);
}

template <typename T>
std::vector<MemoryPrediction> CudaLoraEngine<T>::predicted_memory(int B, int T_) const {
    const std::size_t e = sizeof(T);
    const char* tn = precision_name<T>();
    const std::size_t k = opt_.bytes_per_param(), table = opt_.table_bytes();
    auto lay =
        activation_layout(cfg_.model, B, T_, plan_, CudaGPT<T>::arena_format(cfg_.model, B, T_));
    std::size_t base = e * layout_.total, slots = 0;
    std::string base_text = fmt::format("frozen base {} x {} ({})", e, layout_.total, tn);
    if (quantized()) {
        const quant::BaseQuant q = quant::lora_base_quant(cfg_.lora);
        const auto b = QuantizedDeviceBase<T>::predicted_bytes(cfg_.model, q);
        base = b.params;
        slots = b.slots;
        base_text = fmt::format("frozen base packed {} + the rest {}", q.name(), tn);
    }
    const std::size_t extra = CudaGPT<T>::token_bytes(B, T_) + CudaGPT<T>::kGraphBytes +
                              stats_.bytes() +
                              CudaLora<T>::workspace_bytes(cfg_.lora, lora_layout_, B * T_) + slots;
    return {
        {MemCategory::Parameters, fmt::format("{} + adapters {} x {}", base_text, e, n_),
         base + e * n_},
        {MemCategory::Gradients, fmt::format("adapters only: {} x {} ({})", e, n_, tn), e * n_},
        {MemCategory::OptimizerState,
         fmt::format("{} x adapters ({}) + chunk table {} B", k, opt_.describe(), table),
         k * n_ + table},
        {MemCategory::Activations,
         fmt::format("activation_layout(B, T, remat={}, {})", cfg_.train.remat, tn),
         arena_bytes(lay, MemCategory::Activations)},
        {MemCategory::Workspace,
         std::string("activation_layout(B, T) + token ids + step statistics + adapter GEMMs") +
             (quantized() ? " + 2 decode slots" : ""),
         arena_bytes(lay, MemCategory::Workspace) + extra},
    };
}

template <typename T>
std::string CudaLoraEngine<T>::memory_footer() const {
    std::string out = device_in_use_line();
    out += fmt::format("LoRA: {} adapters, {} trainable parameters = {:.3f}% of the base's {}\n",
                       lora_layout_.sites.size(), n_, 100.0 * (double)n_ / (double)layout_.total,
                       layout_.total);
    if (quant_base_)
        out += fmt::format("QLoRA base: {} on the device, {} block decodes\n",
                           quant::lora_base_quant(cfg_.lora).name(), quant_base_->decodes());
    out += host_rss_line();
    return out;
}

}  // namespace

std::unique_ptr<Engine> make_cuda_lora_engine(const RunPlan& plan, dist::Communicator& comm) {
    return make_for_precision<CudaLoraEngine>(plan, comm);
}

}  // namespace memtrain

#else  // built without CUDA

namespace memtrain {

std::unique_ptr<Engine> make_cuda_lora_engine(const RunPlan&, dist::Communicator&) {
    fail(
        "train.device = \"cuda\", but this memtrain was built without CUDA (no nvcc at build "
        "time)");
}

}  // namespace memtrain

#endif
