// The CUDA engine (see cuda_engine.h): CudaGPT<T> for the model, composed with its parts along the
// run's plan: data parallelism (parallel/data/device_data_parallel.h: NCCL, the shard ranges and
// the collectives of each dist::ShardSpec placement), the optimizer of this rank's range on the
// device (engine/cuda/device_optimizer.h) or on the host (parallel/data/device_offload.h:
// ZeRO-Offload). Here: the step as a sequence of the parts' steps, the gradient norm and clipping
// on the device, fp16 loss scaling and the overflow's location, weight I/O, and the device memory
// report. One compute stream; the host waits once per step, for the step's loss, gradient norm and
// overflow flag.
#include "engine/cuda/cuda_engine.h"

#include "core/error.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/cuda_streams.h"
#include "core/device.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/device_memory.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "model/cuda_gpt.h"
#include "optim/device_update.h"
#include "optim/loss_scaler.h"
#include "parallel/data/device_data_parallel.h"
#include "parallel/data/device_offload.h"

namespace memtrain {

namespace {

using cuda::precision_name;
using cuda::to_storage;

// The engine's UnitStore for weight I/O: a unit's fp32 master weights copied to a host buffer
// and, when written, back to the master and (rounded) to the compute copy. It asks the engine's
// parts where the master weights live (the device or, under ZeRO-Offload, the host) and which
// piece of them this rank holds (all of each unit, or its shard's piece: then reading a unit
// gathers it from every rank, a collective).
template <typename T>
class CudaEngine;

template <typename T>
class WeightsStore final : public WeightWindow {
  public:
    explicit WeightsStore(CudaEngine<T>& e) : e_(e) {}
    float* acquire(int u, bool for_write) override;
    void release(int u) override;

  private:
    // The new values of unit `unit` (at `src`) into this rank's master weights and its compute
    // copy of the parameters.
    void write_back(const ParamUnit& unit, const float* src);

    CudaEngine<T>& e_;
    int held_ = -1, holds_ = 0;
    bool written_ = false;
    bool lent_ = false;  // acquire returned the master weights themselves (host memory, whole)
    std::vector<float> host_, piece_;
};

template <typename T>
class CudaEngine final : public Engine, public OptimizerState {
  public:
    CudaEngine(const RunPlan& plan, dist::Communicator& comm);
    ~CudaEngine() override;

    // Engine
    std::string describe() const override {
        return fmt::format("cuda: {} ({})", cuda_device_name(), precision_name<T>());
    }
    ModelWeights weights() override { return ModelWeights{store_, model_->layout(), cfg_.model}; }
    OptimizerState& optimizer() override {
        return offload_ ? offload_->optimizer() : static_cast<OptimizerState&>(*this);
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
        return fmt::format("device: {}, {}", cuda_device_name(), precision_name<T>());
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

    // OptimizerState: the moments (and the step count) live on the device; where the optimizer
    // state is sharded, this rank's shard of them.
    std::size_t offset() const override { return dp_.first(); }
    std::size_t count() const override { return dp_.count(); }
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
    std::pair<int64_t, int64_t> zero_gathers() const { return dp_.zero_gathers(); }

  private:
    friend class WeightsStore<T>;
    // This rank's fp32 master weights, its range [dp_.first(), + dp_.count()): in host memory
    // under ZeRO-Offload, else on the device (the parameters themselves in fp32).
    struct MasterWeights {
        float* data;
        bool on_host;
    };
    MasterWeights master_weights() {
        if (offload_) return {offload_->master(), true};
        float* m = dev_opt_.master();
        return {m ? m : reinterpret_cast<float*>(dp_.param_shard()), false};
    }
    cudaStream_t stream() const { return stream_.get(); }
    void wait(const char* what) { dp_.wait(what); }
    // After a skipped step: which tensors' gradients are not finite (StepResult::overflow).
    std::string locate_overflow();
    std::size_t stats_doubles() const { return 2 + (std::size_t)cfg_.accum_steps(); }

    RunConfig cfg_;
    CudaStream stream_;  // the compute stream; every part queues on it, so it goes last
    // Data parallelism: the shard ranges, NCCL and ZeRO-2/3's unit store (one process: the
    // trivial case, everything replicated).
    DeviceDataParallel<T> dp_;
    std::unique_ptr<CudaGPT<T>> model_;
    WeightsStore<T> store_;
    // The optimizer of this rank's range: on the device (fp32 master weights, absent when T is
    // float, moments and the update), or on the host under ZeRO-Offload.
    DeviceOptimizer<T> dev_opt_;
    std::unique_ptr<DeviceOffload<T>> offload_;
    // Device: StepScalars, then doubles [sum of squares | eval loss | micro-batch loss sums].
    DeviceBuffer<unsigned char> stats_;
    cuda::StepScalars* scalars_host_ = nullptr;  // pinned
    double* stats_host_ = nullptr;               // pinned
    std::unique_ptr<LossScaler> scaler_;
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
    const auto master = e_.master_weights();
    const std::size_t first = e_.dp_.first();
    const bool sharded = e_.dp_.master_sharded();
    written_ = written_ || for_write;
    if (holds_++ > 0) return lent_ ? master.data + (unit.begin - first) : host_.data();
    held_ = u;
    // The whole unit's master weights in host memory already (ZeRO-Offload, one range): lent.
    lent_ = master.on_host && !sharded;
    if (lent_) return master.data + (unit.begin - first);
    // This rank's piece of the unit (all of it unless the master weights are sharded), then
    // every rank's piece gathered over the host communicator.
    const auto [lo, n] = e_.dp_.piece(unit);
    host_.resize(unit.size());
    if (sharded) piece_.resize(n);
    float* mine = sharded ? piece_.data() : host_.data();
    if (master.on_host)
        std::copy_n(master.data + (lo - first), n, mine);
    else if (n > 0)
        MT_CUDA_CHECK(cudaMemcpyAsync(mine, master.data + (lo - first), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, e_.stream()));
    e_.wait("a weight transfer");
    if (sharded) e_.dp_.gather_unit(unit, piece_.data(), host_.data());
    return host_.data();
}

template <typename T>
void WeightsStore<T>::release(int u) {
    if (held_ != u || holds_ <= 0) fail("internal: WeightsStore::release({}) without acquire", u);
    if (--holds_ > 0) return;
    if (written_) {
        const ParamUnit& unit = e_.model_->layout().units[u];
        write_back(unit,
                   lent_ ? e_.master_weights().data + (unit.begin - e_.dp_.first()) : host_.data());
    }
    held_ = -1;
    written_ = false;
    lent_ = false;
}

template <typename T>
void WeightsStore<T>::write_back(const ParamUnit& unit, const float* src) {
    const auto master = e_.master_weights();
    const std::size_t first = e_.dp_.first();
    const auto [lo, n] = e_.dp_.piece(unit);
    // This rank's piece of the master weights (a lent unit was written in place).
    if (!lent_) {
        if (master.on_host)
            std::copy_n(src + (lo - unit.begin), n, master.data + (lo - first));
        else if (n > 0)
            MT_CUDA_CHECK(cudaMemcpyAsync(master.data + (lo - first), src + (lo - unit.begin),
                                          n * sizeof(float), cudaMemcpyHostToDevice, e_.stream()));
    }
    // The compute copy: cast on the device where the device holds the whole unit's master
    // weights (nothing to do in fp32, where they are the parameters); else rounded on the host
    // and copied up, the whole unit where every rank holds the parameters whole, or this rank's
    // piece (ZeRO-3).
    if (!master.on_host && !e_.dp_.master_sharded()) {
        if constexpr (!std::is_same_v<T, float>)
            cuda::cast<T, float>(e_.dp_.whole_params() + unit.begin,
                                 master.data + (unit.begin - first), (int64_t)unit.size(),
                                 e_.stream());
    } else {
        std::vector<T> stage(unit.size());
        for (std::size_t i = 0; i < unit.size(); i++) stage[i] = to_storage<T>(src[i]);
        if (T* whole = e_.dp_.whole_params()) {
            MT_CUDA_CHECK(cudaMemcpyAsync(whole + unit.begin, stage.data(), unit.size() * sizeof(T),
                                          cudaMemcpyHostToDevice, e_.stream()));
        } else if (n > 0) {
            MT_CUDA_CHECK(cudaMemcpyAsync(e_.dp_.param_shard() + (lo - first),
                                          stage.data() + (lo - unit.begin), n * sizeof(T),
                                          cudaMemcpyHostToDevice, e_.stream()));
        }
    }
    e_.dp_.params_changed();
    e_.wait("a weight transfer");  // the host buffers are reused
}

template <typename T>
CudaEngine<T>::CudaEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg),
      dp_(plan.collective, plan.states, make_param_layout(cfg_.model), comm, stream_.get()),
      store_(*this) {
    model_ =
        std::make_unique<CudaGPT<T>>(cfg_.model, stream(), dp_.padded_total(), dp_.unit_store());
    dp_.attach(*model_);
    model_->set_cuda_graphs(cfg_.train.cuda_graphs);
    const ParamLayout& layout = model_->layout();
    if (dist::offloaded(dp_.spec().optimizer)) {
        // Offload streams each unit's gradients to the host as the last backward finishes it
        // (not under CUDA graphs, whose capture would take the side stream in; with several
        // ranks the reduced shard comes down after the backward).
        const bool stream_grads = !cfg_.train.cuda_graphs && !dp_.collective();
        offload_ = std::make_unique<DeviceOffload<T>>(cfg_, layout, dp_.first(), dp_.count(),
                                                      stream(), stream_grads);
        offload_->attach(*model_);
    } else {
        dev_opt_ = DeviceOptimizer<T>(cfg_.optim, layout, dp_.first(), dp_.count());
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
    // Nothing queued may outlive what it reads: the streams drain before the parts go (the
    // offload part, the model, then data parallelism's store and streams, then the compute
    // stream, in reverse order of the members).
    cudaStreamSynchronize(stream());
    dp_.synchronize();
    if (scalars_host_) cudaFreeHost(scalars_host_);
    if (stats_host_) cudaFreeHost(stats_host_);
}

template <typename T>
void CudaEngine<T>::begin_step() {
    model_->zero_grads();
    dp_.begin_step();
    micro_ = 0;
    tokens_in_step_ = 0;
}

template <typename T>
void CudaEngine<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                                     float grad_scale, bool last) {
    if (micro_ >= cfg_.accum_steps())
        fail("internal: more micro-batches ({}) than train accumulation steps ({})", micro_ + 1,
             cfg_.accum_steps());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    // fp16: the loss gradient carries the loss scale, so small gradients stay representable.
    const float scale = scaler_ ? (float)scaler_->scale() : 1.0f;
    // DDP reduces once per step, during the last micro-batch's backward, unit by unit;
    // ZeRO-Offload in one process likewise streams the gradients down then. Everything after the
    // backward (the optimizer) waits for the last unit's all-reduce or copy.
    dp_.before_backward(last);
    if (offload_) offload_->before_backward(last);
    model_->forward_backward(inputs, targets, B, T_, grad_scale * scale, sums + 2 + micro_);
    dp_.after_backward();
    if (offload_) offload_->after_backward();
    micro_++;
    tokens_in_step_ += (int64_t)B * T_;
}

template <typename T>
StepResult CudaEngine<T>::finish_step(double lr, double max_norm) {
    const int64_t t = t_ + 1;
    cuda::StepScalars& s = *scalars_host_;
    // The CPU optimizer's constants, computed the same way (optim/optimizer.cpp).
    s = cuda::make_step_scalars(cfg_.optim, lr, t, scaler_ ? (float)scaler_->scale() : 1.0f);
    s.max_norm = (float)max_norm;
    auto* dev_scalars = reinterpret_cast<cuda::StepScalars*>(stats_.data());
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    MT_CUDA_CHECK(cudaMemcpyAsync(dev_scalars, &s, sizeof(s), cudaMemcpyHostToDevice, stream()));
    T* grads = dp_.step_grads();
    if (inject_overflow_) {
        // Test hook: one gradient becomes +inf, as an fp16 overflow in backward would make it.
        const T inf = (T)INFINITY;
        MT_CUDA_CHECK(cudaMemcpyAsync(grads, &inf, sizeof(T), cudaMemcpyHostToDevice, stream()));
        wait("queued device work");
        inject_overflow_ = false;
    }
    // The gradients summed over the ranks into this rank's range, and their norm.
    dp_.reduce_gradients(sums);
    cuda::finish_grad_norm(dev_scalars, sums, stream());
    if (offload_) {
        // The update runs on the host, after the wait: the range's gradients go down first
        // (unless they streamed down during the backward).
        offload_->download(dp_.grad_shard());
    } else {
        dev_opt_.step(dp_.param_shard(), dp_.grad_shard(), dev_scalars, stream());
        // A skipped step shares the old values.
        dp_.share_updated_params();
    }
    // The step's results: norm and overflow flag, and the micro-batches' loss sums.
    MT_CUDA_CHECK(
        cudaMemcpyAsync(scalars_host_, dev_scalars, sizeof(s), cudaMemcpyDeviceToHost, stream()));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(stats_host_, sums, 8 * stats_doubles(), cudaMemcpyDeviceToHost, stream()));
    wait("the step's gradient collectives");
    StepResult r;
    double loss = 0;
    for (int k = 0; k < micro_; k++) loss += stats_host_[2 + k];
    r.loss = tokens_in_step_ ? loss / (double)tokens_in_step_ : 0.0;
    r.grad_norm = scalars_host_->grad_norm;
    r.skipped = scalars_host_->skip != 0;
    r.loss_scale = s.loss_scale;
    if (!r.skipped) {
        t_++;
        if (offload_) {
            offload_->update(lr, scalars_host_->grad_scale, dp_.param_shard());
            dp_.share_updated_params();
        }
    } else {
        r.overflow = locate_overflow();
    }
    if (scaler_) {
        try {
            scaler_->update(r.skipped, t);
        } catch (const Error& e) {  // the scale collapsed: say where the overflow is
            fail("{} ({})", e.what(), r.overflow);
        }
    } else if (r.skipped) {
        fail(
            "the gradient norm is not finite at step {} ({} training has no loss scale to "
            "lower; {}): lower optim.lr or check the data",
            t, precision_name<T>(), r.overflow);
    }
    return r;
}

template <typename T>
std::string CudaEngine<T>::locate_overflow() {
    // Only after a skipped step: a sum of squares per tensor of this rank's gradient range, the
    // non-finite ones marked, the marks combined over the ranks.
    const ParamLayout& layout = model_->layout();
    const std::size_t first = dp_.first(), last = dp_.first() + dp_.count();
    const std::size_t n = layout.tensors.size();
    DeviceBuffer<double> sums(n, MemCategory::Workspace);
    MT_CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, sums.bytes(), stream()));
    for (std::size_t i = 0; i < n; i++) {
        const ParamSpec& t = layout.tensors[i];
        const std::size_t lo = std::max(t.offset, first), hi = std::min(t.offset + t.numel, last);
        if (lo < hi)
            cuda::sum_squares<T>(sums.data() + i, dp_.grad_shard() + (lo - first),
                                 (int64_t)(hi - lo), stream());
    }
    std::vector<double> host(n);
    MT_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), sums.data(), sums.bytes(), cudaMemcpyDeviceToHost, stream()));
    wait("the overflow check");
    std::vector<int64_t> bad(n);
    for (std::size_t i = 0; i < n; i++) bad[i] = std::isfinite(host[i]) ? 0 : 1;
    dp_.combine_flags(bad);
    // Backward order: the head, the blocks from the last, the embedding; within a unit, the
    // later tensors first (a block's backward starts at its MLP output projection).
    auto rank_of = [&](std::size_t i) {
        const std::size_t off = layout.tensors[i].offset;
        int u = 0;
        while (off >= layout.units[u].end) u++;
        return std::pair<int, int64_t>{u == 0 ? INT32_MAX : -u, -(int64_t)i};
    };
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < n; i++)
        if (bad[i]) order.push_back(i);
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return rank_of(a) < rank_of(b); });
    std::string names;
    for (std::size_t k = 0; k < order.size() && k < 3; k++)
        names += (k ? ", " : "") + layout.tensors[order[k]].name;
    if (order.size() > 3) names += ", ...";
    return fmt::format("non-finite gradients in {} of {} tensors, first in backward order: {}",
                       order.size(), n, order.empty() ? "none found" : names);
}

template <typename T>
double CudaEngine<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) {
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    model_->forward_loss(inputs, targets, B, T_, sums + 1);
    double sum = 0;
    MT_CUDA_CHECK(cudaMemcpyAsync(&stats_host_[1], sums + 1, sizeof(double), cudaMemcpyDeviceToHost,
                                  stream()));
    wait("the validation loss");
    sum = stats_host_[1];
    return sum / ((double)B * T_);
}

template <typename T>
std::vector<std::string> CudaEngine<T>::state_names() {
    return dev_opt_.state_names();
}

template <typename T>
void CudaEngine<T>::read_state(const std::string& name, float* dst) {
    dev_opt_.read_state(name, dst, stream(), [this] { wait("queued device work"); });
}

template <typename T>
void CudaEngine<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                const float* src) {
    dev_opt_.write_state(name, begin, n, src, stream(), [this] { wait("queued device work"); });
}

template <typename T>
std::vector<MemoryPrediction> CudaEngine<T>::predicted_memory(int B, int T_) const {
    // The rows the Trainer checked against the device before this engine allocated
    // (engine/device_memory.h), and the ZeRO-2/3 buckets this engine sized.
    std::vector<MemoryPrediction> out =
        predict_cuda_memory(cfg_, model_->remat_plan(),
                            DevicePlacement{dp_.world(), dp_.rank(), dp_.collective()}, B, T_);
    if (auto row = dp_.communication_row()) out.push_back(*row);
    return out;
}

template <typename T>
std::string CudaEngine<T>::memory_footer() const {
    std::string out = device_in_use_line();
    if (offload_) out += offload_->memory_line();
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
