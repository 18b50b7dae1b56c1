// LoRA and QLoRA states for the CUDA engine (see adapter_states.h).
#include "engine/cuda/adapter_states.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <functional>

#include <fmt/format.h>

#include "comm/device_communicator.h"
#include "core/error.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/device_memory.h"
#include "engine/host_memory.h"
#include "io/lora_files.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "model/cuda_lora.h"
#include "quant/device_base.h"
#include "quant/quantized_store.h"

namespace memtrain {

using cuda::precision_name;
using cuda::to_fp32;
using cuda::to_storage;

float* HostWindow::acquire(int u, bool for_write) {
    if (held_ >= 0 && held_ != u) fail("internal: HostWindow holds one unit at a time");
    if (holds_++ == 0) {
        held_ = u;
        host_.resize(layout_->units.at((std::size_t)u).size());
        read_(u, host_.data());
    }
    written_ = written_ || for_write;
    return host_.data();
}

void HostWindow::release(int u) {
    if (held_ != u || holds_ <= 0) fail("internal: HostWindow::release({}) without acquire", u);
    if (--holds_ > 0) return;
    if (written_) write_(u, host_.data());
    held_ = -1;
    written_ = false;
}

template <typename T>
AdapterStates<T>::AdapterStates(const RunPlan& plan, dist::Communicator& comm, cudaStream_t stream)
    : plan_(plan),
      stream_(stream),
      layout_(make_param_layout(plan.cfg.model)),
      lora_layout_(make_lora_layout(plan.cfg.model, plan.cfg.lora)) {
    if (comm.size() > 1 && plan_.zero_stage > 0)
        fail(
            "LoRA on the CUDA engine runs data parallelism as DDP (train.zero_stage = 0), not ZeRO "
            "stage {}: the adapters' states are small; ZeRO over adapters runs on the CPU engine",
            plan_.zero_stage);
    if (dist::offloaded(plan_.states.optimizer))
        fail(
            "train.offload_optimizer does not apply to LoRA: its optimizer state is the adapters'");
    if (plan_.cuda_graphs)
        fail(
            "train.cuda_graphs does not run LoRA yet (the dropout mask changes every micro-batch)");
    // Launched by mpirun: NCCL between the ranks' GPUs (as the whole model: even at world size 1).
    if (plan_.collective)
        dcomm_ = dist::make_nccl_communicator(dist::HostLink{
            comm.rank(), comm.size(), [&comm](void* d, int64_t b) { comm.broadcast(d, b, 0); }});
    n_ = lora_layout_.params.total;
    params_ = DeviceBuffer<T>(n_, MemCategory::Parameters);
    grads_ = DeviceBuffer<T>(n_, MemCategory::Gradients);
    opt_ = std::make_unique<DeviceOptimizer<T>>(
        cfg().optim, lora_layout_.params, 0, n_, stream_, [this](const char* what) { wait(what); },
        cfg().train.seed);

    // The adapters seen unit by unit in fp32: their master weights (read), written back to the
    // master and rounded into the parameters; under optim.master = "none" the bf16 adapters
    // themselves, decoded, and rounded to nearest back into them.
    adapter_window_ = std::make_unique<HostWindow>(
        lora_layout_.params,
        [this](int u, float* dst) {
            const ParamUnit& unit = lora_layout_.params.units[(std::size_t)u];
            if (!master())
                return download_decoded(dst, params_.data() + unit.begin, unit.size(), stream_,
                                        [this](const char* what) { wait(what); });
            MT_CUDA_CHECK(cudaMemcpyAsync(dst, master() + unit.begin, unit.size() * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream_));
            wait("an adapter transfer");
        },
        [this](int u, const float* src) {
            const ParamUnit& unit = lora_layout_.params.units[(std::size_t)u];
            if (!master())
                return upload_rounded(params_.data() + unit.begin, src, unit.size(), stream_,
                                      [this](const char* what) { wait(what); });
            MT_CUDA_CHECK(cudaMemcpyAsync(master() + unit.begin, src, unit.size() * sizeof(float),
                                          cudaMemcpyHostToDevice, stream_));
            if constexpr (!std::is_same_v<T, float>)
                cuda::cast<T, float>(params_.data() + unit.begin, master() + unit.begin,
                                     (int64_t)unit.size(), stream_);
            wait("an adapter transfer");
        });
    // Dropout masks as the CPU engine draws them (engine/cpu/lora_engine.cpp): one per rank.
    lora_ =
        std::make_unique<CudaLora<T>>(cfg().lora, lora_layout_, params_.data(), grads_.data(),
                                      cfg().train.seed ^ (0xD20Full * (comm.rank() + 1)), stream_);
    init_lora_weights(*adapter_window_, lora_layout_, cfg().train.seed);

    if (quantized()) {
        const quant::BaseQuant& q = *plan_.lora_base;
        q.check(cfg().model);
        host_quant_ = std::make_unique<quant::QuantizedParamStore>(cfg().model, q);
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
        model_ = std::make_unique<CudaGPT<T>>(cfg().model, stream_, 0, nullptr, lora_.get());
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
}

template <typename T>
AdapterStates<T>::~AdapterStates() {
    cudaStreamSynchronize(stream_);
    model_.reset();  // before the base and the adapters it reads
}

template <typename T>
void AdapterStates<T>::begin_step() {
    MT_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
}

template <typename T>
void AdapterStates<T>::reduce(double* sum_sq, double*) {
    if (dcomm_) dcomm_->all_reduce_sum(grads_.data(), (int64_t)n_, dist::device_type<T>(), stream_);
    cuda::sum_squares<T>(sum_sq, grads_.data(), (int64_t)n_, stream_);
}

template <typename T>
void AdapterStates<T>::wait(const char* what) {
    if (dcomm_)
        dcomm_->wait(stream_, what);
    else
        MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
std::vector<MemoryPrediction> AdapterStates<T>::predicted_memory(const RematPlan& remat, int B,
                                                                 int T_) const {
    return predict_cuda_lora_memory(plan_, remat, B, T_);
}

template <typename T>
void AdapterStates<T>::weights_loaded(const RematPlan& remat) {
    if (!quant_writer_) return;  // a whole base, or already on the device
    quant_writer_.reset();
    quant_base_ = std::make_unique<QuantizedDeviceBase<T>>(*host_quant_, stream_);
    host_quant_.reset();  // the device holds the only copy from here on
    model_ = std::make_unique<CudaGPT<T>>(cfg().model, stream_, 0, quant_base_.get(), lora_.get());
    if (!remat.empty()) model_->set_remat(remat);
}

template <typename T>
CheckpointModel AdapterStates<T>::checkpoint_model() {
    return {cfg().model, lora_layout_.params,
            [this](const std::string& dir, bool root) {
                save_lora_adapters(dir, cfg(), lora_layout_, *adapter_window_, root);
            },
            [this](const std::string& dir) {
                load_lora_adapters(dir, cfg().model, lora_layout_, *adapter_window_);
            }};
}

template <typename T>
std::string AdapterStates<T>::describe() const {
    std::string names;
    for (const auto& n : lora_layout_.names) names += (names.empty() ? "" : ", ") + n;
    return fmt::format(", {} r={} alpha={} on {} ({} trainable), base {} frozen",
                       quantized() ? "QLoRA" : "LoRA", cfg().lora.rank, cfg().lora.alpha, names, n_,
                       quantized() ? plan_.lora_base->name() : std::string(precision_name<T>()));
}

template <typename T>
std::string AdapterStates<T>::memory_footer() const {
    std::string out = device_in_use_line();
    out += fmt::format("LoRA: {} adapters, {} trainable parameters = {:.3f}% of the base's {}\n",
                       lora_layout_.sites.size(), n_, 100.0 * (double)n_ / (double)layout_.total,
                       layout_.total);
    if (quant_base_)
        out += fmt::format("QLoRA base: {} on the device, {} block decodes\n",
                           plan_.lora_base->name(), quant_base_->decodes());
    out += host_rss_line();
    return out;
}

template class AdapterStates<float>;
template class AdapterStates<__nv_bfloat16>;
template class AdapterStates<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
