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

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/device.h"
#include "dist/communicator.h"
#include "dist/device_communicator.h"
#include "dist/device_zero.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer_types.h"
#include "model/cuda_gpt.h"
#include "optim/loss_scaler.h"
#include "train/cuda_optimizer.h"
#include "train/device_memory_plan.h"

namespace memtrain {

namespace {

using cuda::precision_name;
using cuda::to_fp32;
using cuda::to_storage;

using dist::device_type;

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
    std::vector<float> host_, piece_;
};

template <typename T>
class CudaEngine final : public Engine, public OptimizerState {
  public:
    CudaEngine(const RunConfig& cfg, dist::Communicator& comm);
    ~CudaEngine() override;

    // Engine
    std::string describe() const override {
        return fmt::format("cuda: {} ({})", cuda_device_name(), precision_name<T>());
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

    // OptimizerState: the moments (and the step count) live on the device; under ZeRO-1 this
    // rank's shard of them.
    std::size_t offset() const override { return shard_begin_; }
    std::size_t count() const override { return shard_count_; }
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
    std::pair<int64_t, int64_t> zero_gathers() const {
        return zero_ ? std::pair<int64_t, int64_t>{zero_->gathers(), zero_->demand_gathers()}
                     : std::pair<int64_t, int64_t>{0, 0};
    }

  private:
    friend class WeightsStore<T>;
    // This rank's parameters [shard_begin_, + shard_) (all of them without ZeRO), its gradients
    // (under ZeRO-1 after the reduce-scatter), and the whole parameters (null under ZeRO-3).
    T* param_shard() { return zero_ ? zero_->param_shard() : model_->params() + shard_begin_; }
    T* grad_shard() { return zero_ ? zero_->grad_shard() : model_->grads() + shard_begin_; }
    T* whole_params() { return zero_ ? zero_->whole_params() : model_->params(); }
    // The fp32 master weights of this rank's range [shard_begin_, + shard_count_) (all of them
    // without ZeRO); in fp32 the parameters themselves.
    float* master() {
        return dev_opt_.master() ? dev_opt_.master() : reinterpret_cast<float*>(param_shard());
    }
    bool sharded_master() const { return stage_ >= 1; }
    // How many floats of unit `unit` each rank's shard holds (in rank order).
    std::vector<int64_t> unit_counts(const ParamUnit& unit) const {
        return dist::unit_pieces(shards_, (int64_t)unit.begin, (int64_t)unit.end).counts;
    }
    // Waits for the compute stream; with several ranks through the device communicator, which
    // fails fast (naming `what`) where a dead peer would leave a collective waiting forever.
    void wait(const char* what) {
        if (dcomm_)
            dcomm_->wait(stream_, what);
        else
            MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    // DDP: all-reduces unit u's gradients on the communication stream (the grads-done hook).
    void start_unit_all_reduce(int u);
    // ZeRO-Offload: copies unit u's gradients to the pinned buffer on the download stream.
    void start_unit_download(int u);
    // Work queued on `side` from now on waits for the backward's writes of unit u's gradients.
    void after_unit_grads(int u, cudaStream_t side);
    // ZeRO-Offload's update: the pinned gradients (scaled by grad_scale) into fp32, the host
    // optimizer over the fp32 master, the rounded parameters up to the device.
    void host_update(double lr, float grad_scale);
    // ZeRO-1/2: all-gathers the updated shards; ZeRO-3: marks gathered units stale.
    void share_updated_params();
    // After a skipped step: which tensors' gradients are not finite (StepResult::overflow).
    std::string locate_overflow();
    std::size_t stats_doubles() const { return 2 + (std::size_t)cfg_.accum_steps(); }

    RunConfig cfg_;
    bool adamw_;
    cudaStream_t stream_ = nullptr;
    // Data parallelism (world > 1): the host communicator (MPI), NCCL on the device, a stream
    // for DDP's overlapped all-reduces with an event per unit, and this rank's shard of the
    // padded flat buffer (shard_ = ceil(total / world) elements; ZeRO-1 updates only it).
    dist::Communicator& comm_;
    std::unique_ptr<dist::DeviceCommunicator> dcomm_;
    int world_ = 1, rank_ = 0, stage_ = 0;
    std::size_t shard_ = 0, shard_begin_ = 0, shard_count_ = 0;
    std::vector<dist::ShardRange> shards_;  // every rank's [rank S, (rank + 1) S), clipped to Ψ
    cudaStream_t comm_stream_ = nullptr;
    std::vector<cudaEvent_t> unit_ready_;
    cudaEvent_t reduced_ = nullptr;
    bool reduce_now_ = false;
    // ZeRO-2/3: the model's gradients (and stage 3's parameters) sharded, units in buckets and
    // gathered slots (dist/device_zero.h).
    std::unique_ptr<dist::DeviceZeroUnits<T>> zero_;
    std::unique_ptr<CudaGPT<T>> model_;
    WeightsStore<T> store_;
    // fp32 master weights (absent when T is float), moments and the update of this rank's range
    // (not under ZeRO-Offload, whose optimizer is host_opt_).
    DeviceOptimizer<T> dev_opt_;
    // Device: StepScalars, then doubles [sum of squares | eval loss | micro-batch loss sums].
    DeviceBuffer<unsigned char> stats_;
    cuda::StepScalars* scalars_host_ = nullptr;  // pinned
    double* stats_host_ = nullptr;               // pinned
    std::unique_ptr<LossScaler> scaler_;
    // ZeRO-Offload (train.offload_optimizer): the fp32 master weights, the moments and the update
    // on the host (the CPU optimizer of optim/optimizer.h, multi-threaded), the gradients coming
    // down and the rounded parameters going up through one pinned buffer of Ψ values of T.
    bool offload_ = false, stream_down_ = false;
    cudaStream_t down_stream_ = nullptr;  // the gradients' copies to the host
    std::unique_ptr<Optimizer> host_opt_;
    Buffer<float> host_master_, host_grads_;
    T* pinned_ = nullptr;
    std::size_t pinned_bytes() const { return shard_count_ * sizeof(T); }
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
    if (e_.offload_ && !e_.sharded_master()) {  // the master weights are in host memory already
        if (holds_++ == 0) held_ = u;
        written_ = written_ || for_write;
        return e_.host_master_.data() + unit.begin;
    }
    if (holds_++ == 0) {
        held_ = u;
        host_.resize(unit.size());
        if (e_.sharded_master()) {
            // ZeRO-1: each rank holds the master weights of its shard; the unit is gathered
            // over the host communicator from every rank's piece of it (a collective).
            const auto counts = e_.unit_counts(unit);
            const std::size_t lo = std::max(unit.begin, e_.shard_begin_);
            piece_.resize(counts[e_.rank_]);
            if (e_.offload_)  // ZeRO-Offload: the shard's master weights are in host memory
                std::copy_n(e_.host_master_.data() + (lo - e_.shard_begin_), piece_.size(),
                            piece_.data());
            else if (!piece_.empty())
                MT_CUDA_CHECK(cudaMemcpyAsync(piece_.data(), e_.master() + (lo - e_.shard_begin_),
                                              piece_.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                              e_.stream_));
            e_.wait("a weight transfer");
            e_.comm_.all_gather(piece_.data(), host_.data(), counts);
        } else {
            MT_CUDA_CHECK(cudaMemcpyAsync(host_.data(), e_.master() + unit.begin - e_.shard_begin_,
                                          unit.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                          e_.stream_));
            e_.wait("a weight transfer");
        }
    }
    written_ = written_ || for_write;
    return host_.data();
}

template <typename T>
void WeightsStore<T>::release(int u) {
    if (held_ != u || holds_ <= 0) fail("internal: WeightsStore::release({}) without acquire", u);
    if (--holds_ > 0) return;
    if (written_ && e_.offload_ && !e_.sharded_master()) {
        // Round the unit's new master weights into the pinned buffer and up to the device copy.
        const ParamUnit& unit = e_.model_->layout().units[u];
        const float* src = e_.host_master_.data() + unit.begin;
        T* stage = e_.pinned_ + unit.begin;
        for (std::size_t i = 0; i < unit.size(); i++) stage[i] = to_storage<T>(src[i]);
        MT_CUDA_CHECK(cudaMemcpyAsync(e_.model_->params() + unit.begin, stage,
                                      unit.size() * sizeof(T), cudaMemcpyHostToDevice, e_.stream_));
        e_.wait("a weight transfer");
    } else if (written_ && e_.sharded_master()) {
        // Every rank keeps its piece of the unit's master weights, and the whole unit rounded
        // into its parameters (every rank holds them whole under ZeRO-1).
        const ParamUnit& unit = e_.model_->layout().units[u];
        const std::size_t lo = std::max(unit.begin, e_.shard_begin_);
        const std::size_t n = e_.unit_counts(unit)[e_.rank_];
        if (e_.offload_)
            std::copy_n(host_.data() + (lo - unit.begin), n,
                        e_.host_master_.data() + (lo - e_.shard_begin_));
        else if (n > 0)
            MT_CUDA_CHECK(cudaMemcpyAsync(e_.master() + (lo - e_.shard_begin_),
                                          host_.data() + (lo - unit.begin), n * sizeof(float),
                                          cudaMemcpyHostToDevice, e_.stream_));
        std::vector<T> stage(unit.size());
        for (std::size_t i = 0; i < unit.size(); i++) stage[i] = to_storage<T>(host_[i]);
        if (T* whole = e_.whole_params()) {
            MT_CUDA_CHECK(cudaMemcpyAsync(whole + unit.begin, stage.data(), unit.size() * sizeof(T),
                                          cudaMemcpyHostToDevice, e_.stream_));
        } else if (n > 0) {  // ZeRO-3: only this rank's piece of the parameters too
            MT_CUDA_CHECK(cudaMemcpyAsync(e_.param_shard() + (lo - e_.shard_begin_),
                                          stage.data() + (lo - unit.begin), n * sizeof(T),
                                          cudaMemcpyHostToDevice, e_.stream_));
        }
        if (e_.zero_) e_.zero_->params_changed();
        e_.wait("a weight transfer");
    } else if (written_) {
        const ParamUnit& unit = e_.model_->layout().units[u];
        float* dst = e_.master() + unit.begin - e_.shard_begin_;
        MT_CUDA_CHECK(cudaMemcpyAsync(dst, host_.data(), unit.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, e_.stream_));
        if constexpr (!std::is_same_v<T, float>)
            cuda::cast<T, float>(e_.whole_params() + unit.begin, dst, (int64_t)unit.size(),
                                 e_.stream_);
        e_.wait("a weight transfer");  // host_ is reused
    }
    held_ = -1;
    written_ = false;
}

template <typename T>
CudaEngine<T>::CudaEngine(const RunConfig& cfg, dist::Communicator& comm)
    : cfg_(cfg), adamw_(cfg.optim.name == "adamw"), comm_(comm), store_(*this) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    world_ = comm.size();
    // Launched by mpirun (an MPI communicator, even of one rank): the data-parallel path with
    // NCCL, so `mpirun -np 1` runs it at world size 1 against the plain single process.
    // (CUDA graphs run one process, the plain path.)
    const bool launched = cuda_data_parallel(cfg_, comm);
    rank_ = comm.rank();
    stage_ = launched ? cfg_.train.zero_stage : 0;
    const std::size_t psi = make_param_layout(cfg_.model).total;
    // NCCL shards are equal: the flat buffer is padded to world x ceil(psi / world).
    shard_ = (psi + world_ - 1) / world_;
    shards_ = dist::padded_shard_ranges((int64_t)psi, world_);
    shard_begin_ = stage_ >= 1 ? (std::size_t)shards_[rank_].offset : 0;
    shard_count_ = stage_ >= 1 ? (std::size_t)shards_[rank_].count : psi;
    if (launched) {
        dcomm_ = dist::make_nccl_communicator(dist::HostLink{
            rank_, world_, [&comm](void* d, int64_t b) { comm.broadcast(d, b, 0); }});
        MT_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&reduced_, cudaEventDisableTiming));
        if (stage_ >= 2)
            zero_ = std::make_unique<dist::DeviceZeroUnits<T>>(
                make_param_layout(cfg_.model), stage_, *dcomm_, shard_, stream_, comm_stream_);
    }
    model_ = std::make_unique<CudaGPT<T>>(cfg_.model, stream_, shard_ * world_, zero_.get());
    if (dcomm_) model_->set_waiter([this](const char* what) { wait(what); });
    model_->set_cuda_graphs(cfg_.train.cuda_graphs);
    offload_ = cfg_.train.offload_optimizer;
    // Offload streams each unit's gradients to the host as the last backward finishes it (not
    // under CUDA graphs, whose capture would take the side stream in; with several ranks the
    // reduced shard comes down after the backward).
    stream_down_ = offload_ && !cfg_.train.cuda_graphs && !launched;
    if (launched || stream_down_) {
        unit_ready_.resize(model_->layout().units.size());
        for (auto& e : unit_ready_)
            MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    if (launched && stage_ == 0)
        model_->set_grads_done_hook([this](int u) { start_unit_all_reduce(u); });
    const ParamLayout& layout = model_->layout();
    if (offload_) {
        // This rank's range on the host (everything in one process; its shard under ZeRO).
        host_opt_ = make_optimizer(cfg_.optim, layout, shard_begin_, shard_count_);
        host_master_ = Buffer<float>(shard_count_, MemCategory::OptimizerState);
        host_grads_ = Buffer<float>(shard_count_, MemCategory::Gradients);
        MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_), shard_count_ * sizeof(T)));
        // Pinned host memory both ways: gradients down, updated parameters up.
        host_memory().on_alloc(MemCategory::Communication, pinned_bytes(), pinned_bytes());
        if (stream_down_) {
            MT_CUDA_CHECK(cudaStreamCreateWithFlags(&down_stream_, cudaStreamNonBlocking));
            MT_CUDA_CHECK(cudaEventCreateWithFlags(&reduced_, cudaEventDisableTiming));
            model_->set_grads_done_hook([this](int u) { start_unit_download(u); });
        }
    } else {
        // This rank's range: everything, or its ZeRO-1 shard.
        dev_opt_ = DeviceOptimizer<T>(cfg_.optim, layout, shard_begin_, shard_count_);
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
    if (comm_stream_) cudaStreamSynchronize(comm_stream_);
    if (down_stream_) cudaStreamSynchronize(down_stream_);
    model_.reset();
    zero_.reset();
    for (auto& e : unit_ready_) cudaEventDestroy(e);
    if (reduced_) cudaEventDestroy(reduced_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    if (down_stream_) cudaStreamDestroy(down_stream_);
    if (scalars_host_) cudaFreeHost(scalars_host_);
    if (stats_host_) cudaFreeHost(stats_host_);
    if (pinned_) {
        cudaFreeHost(pinned_);
        host_memory().on_free(MemCategory::Communication, pinned_bytes(), pinned_bytes());
    }
    if (stream_) cudaStreamDestroy(stream_);
}

template <typename T>
void CudaEngine<T>::begin_step() {
    model_->zero_grads();
    if (zero_) zero_->zero_grads();
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
    // DDP reduces once per step: during the last micro-batch's backward, unit by unit.
    // ZeRO-Offload likewise streams the gradients down during the last backward.
    reduce_now_ = ((dcomm_ && stage_ == 0) || stream_down_) && last;
    model_->forward_backward(inputs, targets, B, T_, grad_scale * scale, sums + 2 + micro_);
    if (reduce_now_) {
        // Everything after this (the optimizer) waits for the last unit's all-reduce or copy.
        MT_CUDA_CHECK(cudaEventRecord(reduced_, stream_down_ ? down_stream_ : comm_stream_));
        MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, reduced_, 0));
        reduce_now_ = false;
    }
    micro_++;
    tokens_in_step_ += (int64_t)B * T_;
}

template <typename T>
void CudaEngine<T>::after_unit_grads(int u, cudaStream_t side) {
    MT_CUDA_CHECK(cudaEventRecord(unit_ready_[u], stream_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(side, unit_ready_[u], 0));
}

template <typename T>
void CudaEngine<T>::start_unit_all_reduce(int u) {
    if (!reduce_now_) return;
    const ParamUnit& unit = model_->layout().units[u];
    after_unit_grads(u, comm_stream_);
    dcomm_->all_reduce_sum(model_->grads() + unit.begin, (int64_t)unit.size(), device_type<T>(),
                           comm_stream_);
}

template <typename T>
void CudaEngine<T>::start_unit_download(int u) {
    if (!reduce_now_) return;
    const ParamUnit& unit = model_->layout().units[u];
    after_unit_grads(u, down_stream_);
    MT_CUDA_CHECK(cudaMemcpyAsync(pinned_ + unit.begin, model_->grads() + unit.begin,
                                  unit.size() * sizeof(T), cudaMemcpyDeviceToHost, down_stream_));
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
    // ZeRO-2/3: the reductions of the last micro-batch's units are done before the shard is read.
    if (zero_) zero_->join();
    T* grads = stage_ >= 2 ? grad_shard() : model_->grads();
    if (inject_overflow_) {
        // Test hook: one gradient becomes +inf, as an fp16 overflow in backward would make it.
        const T inf = (T)INFINITY;
        MT_CUDA_CHECK(cudaMemcpyAsync(grads, &inf, sizeof(T), cudaMemcpyHostToDevice, stream_));
        wait("queued device work");
        inject_overflow_ = false;
    }
    if (stage_ >= 1) {
        // ZeRO-1: every rank gets its shard of the summed gradients (ZeRO-2/3 have it already),
        // the norm is the sum of the shards' squares, and each rank updates its shard.
        if (stage_ == 1)
            dcomm_->reduce_scatter_sum(grads, grads + shard_begin_, (int64_t)shard_,
                                       device_type<T>(), stream_);
        cuda::sum_squares<T>(sums, grad_shard(), (int64_t)shard_count_, stream_);
        dcomm_->all_reduce_sum(sums, 1, dist::DeviceType::F64, stream_);
    } else {
        cuda::sum_squares<T>(sums, grads, (int64_t)psi, stream_);
    }
    cuda::finish_grad_norm(dev_scalars, sums, stream_);
    T* params = param_shard();
    grads = grad_shard();
    if (offload_) {
        // The gradients came down unit by unit during the backward (or come now, with the
        // step's results, under CUDA graphs); the update runs on the host.
        if (!stream_down_)
            MT_CUDA_CHECK(cudaMemcpyAsync(pinned_, grads, shard_count_ * sizeof(T),
                                          cudaMemcpyDeviceToHost, stream_));
    } else {
        dev_opt_.step(params, grads, dev_scalars, stream_);
    }
    // ZeRO-1/2: every rank's updated shard to every rank (a skipped step sends the old values);
    // ZeRO-3 gathers units as the next forward needs them. (Offload: after the host update.)
    if (!offload_) share_updated_params();
    // The step's results: norm and overflow flag, and the micro-batches' loss sums.
    MT_CUDA_CHECK(
        cudaMemcpyAsync(scalars_host_, dev_scalars, sizeof(s), cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(
        cudaMemcpyAsync(stats_host_, sums, 8 * stats_doubles(), cudaMemcpyDeviceToHost, stream_));
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
        if (offload_) host_update(lr, scalars_host_->grad_scale);
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
    const std::size_t first = shard_begin_, last = shard_begin_ + shard_count_;
    const std::size_t n = layout.tensors.size();
    DeviceBuffer<double> sums(n, MemCategory::Workspace);
    MT_CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, sums.bytes(), stream_));
    for (std::size_t i = 0; i < n; i++) {
        const ParamSpec& t = layout.tensors[i];
        const std::size_t lo = std::max(t.offset, first), hi = std::min(t.offset + t.numel, last);
        if (lo < hi)
            cuda::sum_squares<T>(sums.data() + i, grad_shard() + (lo - first), (int64_t)(hi - lo),
                                 stream_);
    }
    std::vector<double> host(n);
    MT_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), sums.data(), sums.bytes(), cudaMemcpyDeviceToHost, stream_));
    wait("the overflow check");
    std::vector<int64_t> bad(n);
    for (std::size_t i = 0; i < n; i++) bad[i] = std::isfinite(host[i]) ? 0 : 1;
    comm_.all_reduce_max(bad.data(), (int64_t)n);
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
void CudaEngine<T>::share_updated_params() {
    if (stage_ == 1 || stage_ == 2) {
        dcomm_->all_gather(param_shard(), whole_params(), (int64_t)shard_, device_type<T>(),
                           stream_);
    } else if (stage_ == 3) {
        zero_->params_changed();
        zero_->prefetch_params(ParamLayout::embedding_unit());  // the next forward's first unit
    }
}

template <typename T>
void CudaEngine<T>::host_update(double lr, float grad_scale) {
    float* g = host_grads_.data();
    float* master = host_master_.data();
    T* pin = pinned_;
    // Unit by unit (the part of each unit inside this rank's range), so each unit's new
    // parameters go up to the GPU while the host updates the next (step_part gives the bits of
    // one whole step). The next step's gradients come down after these copies in stream order,
    // and the host writes the pinned buffer again only after that step's wait.
    const std::size_t first = shard_begin_, last = shard_begin_ + shard_count_;
    for (const ParamUnit& unit : model_->layout().units) {
        const std::size_t lo = std::max(unit.begin, first), hi = std::min(unit.end, last);
        if (lo >= hi) continue;
        const int64_t b = (int64_t)(lo - first), e = (int64_t)(hi - first);
#pragma omp parallel for schedule(static)
        for (int64_t i = b; i < e; i++) g[i] = to_fp32(pin[i]) * grad_scale;
        host_opt_->step_part(master, g, lr, (std::size_t)b, (std::size_t)(e - b));
#pragma omp parallel for schedule(static)
        for (int64_t i = b; i < e; i++) pin[i] = to_storage<T>(master[i]);
        MT_CUDA_CHECK(cudaMemcpyAsync(param_shard() + b, pin + b, (e - b) * sizeof(T),
                                      cudaMemcpyHostToDevice, stream_));
    }
    host_opt_->advance();
    share_updated_params();
}

template <typename T>
double CudaEngine<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) {
    double* sums = reinterpret_cast<double*>(stats_.data() + sizeof(cuda::StepScalars));
    model_->forward_loss(inputs, targets, B, T_, sums + 1);
    double sum = 0;
    MT_CUDA_CHECK(cudaMemcpyAsync(&stats_host_[1], sums + 1, sizeof(double), cudaMemcpyDeviceToHost,
                                  stream_));
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
    dev_opt_.read_state(name, dst, stream_, [this] { wait("queued device work"); });
}

template <typename T>
void CudaEngine<T>::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                const float* src) {
    dev_opt_.write_state(name, begin, n, src, stream_, [this] { wait("queued device work"); });
}

template <typename T>
std::vector<MemoryPrediction> CudaEngine<T>::predicted_memory(int B, int T_) const {
    // The rows the Trainer checked against the device before this engine allocated
    // (train/device_memory_plan.h), and the ZeRO-2/3 buckets this engine sized.
    std::vector<MemoryPrediction> out = predict_cuda_memory(
        cfg_, model_->remat_plan(), DevicePlacement{world_, rank_, dcomm_ != nullptr}, B, T_);
    if (zero_)
        out.push_back({MemCategory::Communication,
                       stage_ >= 3
                           ? "gradient buckets and gathered units: embedding, head, 2 blocks"
                           : "gradient buckets: embedding, head, 2 blocks",
                       zero_->communication_bytes()});
    return out;
}

template <typename T>
std::string CudaEngine<T>::memory_footer() const {
    std::string out = device_in_use_line();
    if (offload_) {
        const std::size_t n = shard_count_;  // this rank's range
        out += fmt::format(
            "{:<16} {:>12}  (train.offload_optimizer: fp32 master 4 + {} + fp32 gradients 4 + "
            "pinned transfer buffer {} bytes per parameter, in host memory)\n",
            "optimizer (host)",
            mib(host_master_.bytes() + (adamw_ ? 8 : 4) * n + host_grads_.bytes() + pinned_bytes()),
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

std::unique_ptr<Engine> make_cuda_engine(const RunConfig& cfg, dist::Communicator& comm) {
    return make_for_precision<CudaEngine>(cfg, comm);
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

std::unique_ptr<Engine> make_cuda_engine(const RunConfig&, dist::Communicator&) {
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
