// The CUDA engine split into pipeline stages (train.pp with train.device = "cuda"): one GPU per
// rank, rank s holding stage s of the schedule's action lists (parallel/pipeline/schedule.h), the
// same lists, split (parallel/pipeline/stage_split.h) and tags as the CPU's MeshEngine
// (engine/cpu/mesh_engine.h), over CudaGPT<T> stages in fp32, bf16 or fp16 with fp32 master
// weights.
//
// What crosses a stage boundary goes GPU to GPU over NCCL (ncclSend / ncclRecv). The executor
// queues everything and the host waits once per step, as the single-GPU engine does:
//   F(i): (not the first stage) receive micro-batch i's input into a free slot, on the compute
//         stream; run the stage's blocks; (not the last) send the output on, from a stream of
//         sends of its own that waits for the forward (an event).
//   B(i): (not the last stage) receive d(output); the backward (the last stage's loss first);
//         (not the first) send d(input) back, from a second stream of sends.
// A send on NCCL waits on its stream for the matching receive, so sends never go on the compute
// stream: as on the CPU, where sends are nonblocking, a stage passing an activation on while its
// neighbour sends a gradient back never waits on it. The compute stream waits for a slot's send
// before a new forward rewrites that slot, and for the last gradient send before the next
// backward rewrites the gradient buffer. Each NCCL communicator is used by one stream per rank
// (NCCL orders a communicator's operations by their launch): activations cross boundary b
// (ranks b, b + 1) on communicator A[b % 2], gradients on G[b % 2], so rank b sends on A[b % 2]
// from its forward-send stream and receives on A[(b - 1) % 2] on its compute stream. One more
// communicator carries the step's reductions on the compute stream.
//
// After the last micro-batch: the tied embedding's gradient goes from the last stage (its mirror
// of wte) to the first and is added there; the global gradient norm is the sum of the stages'
// sums of squares (an all-reduce), so every stage clips, skips an fp16 overflow and moves its
// loss scale alike; every stage updates its own range; the first stage sends the updated
// embedding back to the last. The loss is the last stage's, broadcast. The step's arithmetic
// (scalars, norm, skip, loss scale) is the CUDA engines' shared DeviceStep (device_step.h); this
// engine supplies those collectives.
//
// Pipelines side by side (mpirun -np pp x dp, parallel/mesh.h): each pipeline is fed its rows of
// the global micro-batch by the Trainer and runs the schedule on its own communicators; each
// stage's gradients are all-reduced over its replicas (NCCL across the data group) before the
// norm, so every replica updates its stage alike.
//
// Built for the synchronous schedules without a split backward (naive, gpipe, 1f1b) and ZeRO
// stage 0 across pipelines: RunConfig refuses the rest on the GPU, by name.
#include "engine/cuda/cuda_engine.h"

#include "core/error.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "core/cuda_streams.h"
#include "core/device.h"
#include "engine/cuda/device_optimizer.h"
#include "engine/cuda/device_step.h"
#include "engine/device_memory.h"
#include "kernels/cuda/host_convert.h"
#include "kernels/cuda/ops.h"
#include "model/cuda_gpt.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_split.h"
#include "parallel/ps/param_server.h"

namespace memtrain {

namespace {

using cuda::precision_name;
using dist::device_type;

// The stage's units [first_unit, last_unit] in one device range of parameters and one of
// gradients (T), laid out as in the model's flat buffer, and on the last stage of a tied model
// a mirror of the embedding unit for the classifier. Nothing is gathered, so prefetching is a
// no-op.
template <typename T>
class StageUnits final : public DeviceUnitStore<T> {
  public:
    StageUnits(const ParamLayout& layout, int first_unit, int last_unit, bool mirror)
        : layout_(layout),
          first_(first_unit),
          last_(last_unit),
          begin_(layout.units.at(first_unit).begin),
          end_(layout.units.at(last_unit).end),
          params_(end_ - begin_, MemCategory::Parameters),
          grads_(end_ - begin_, MemCategory::Gradients) {
        if (mirror) {
            const std::size_t n = layout.units[ParamLayout::embedding_unit()].size();
            mirror_params_ = DeviceBuffer<T>(n, MemCategory::Parameters);
            mirror_grads_ = DeviceBuffer<T>(n, MemCategory::Gradients);
        }
    }
    T* acquire_params(int u) override { return find(u, params_, mirror_params_); }
    void release_params(int) override {}
    void prefetch_params(int) override {}
    T* acquire_grads(int u) override { return find(u, grads_, mirror_grads_); }
    void grads_done(int) override {}

    bool owns(int u) const { return u >= first_ && u <= last_; }
    bool mirrors(int u) const {
        return mirror_params_.size() > 0 && u == ParamLayout::embedding_unit();
    }
    std::size_t begin() const { return begin_; }
    std::size_t count() const { return end_ - begin_; }
    T* params() { return params_.data(); }
    T* grads() { return grads_.data(); }
    T* mirror_params() { return mirror_params_.data(); }
    T* mirror_grads() { return mirror_grads_.data(); }
    std::size_t mirror_size() const { return mirror_params_.size(); }
    void zero_grads(cudaStream_t stream) {
        MT_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream));
        if (mirror_grads_.size())
            MT_CUDA_CHECK(cudaMemsetAsync(mirror_grads_.data(), 0, mirror_grads_.bytes(), stream));
    }

  private:
    T* find(int u, DeviceBuffer<T>& owned, DeviceBuffer<T>& mirror) {
        if (owns(u)) return owned.data() + (layout_.units[u].begin - begin_);
        if (mirrors(u)) return mirror.data();
        fail("internal: pipeline stage of units {}..{} asked for unit {}", first_, last_, u);
    }
    const ParamLayout& layout_;
    int first_, last_;
    std::size_t begin_, end_;
    DeviceBuffer<T> params_, grads_, mirror_params_, mirror_grads_;
};

template <typename T>
class CudaPipelineEngine;

// The weights as every rank sees them (initialisation, import, checkpoints): dist::OwnerWeights
// over host copies of this stage's units, each made when a unit is acquired (the fp32 master
// weights, or the parameters in fp32) and, when written, put back (master and rounded
// parameters, or the mirror) at its release.
template <typename T>
class StageWeights final : public WeightWindow, public dist::UnitSource {
  public:
    StageWeights(CudaPipelineEngine<T>& e, const ParamLayout& layout, std::vector<int> owner,
                 dist::Communicator& comm)
        : e_(e), layout_(layout), owner_(layout, *this, std::move(owner), comm) {}
    float* acquire(int u, bool for_write) override {
        Held& h = held_[u];
        h.count++;
        h.written = h.written || for_write;
        return owner_.acquire(u, for_write);
    }
    void release(int u) override;
    // dist::UnitSource: this stage's copy of unit u (downloaded now), or null.
    float* unit(int u) override;
    bool read_into_scratch() const override { return false; }

  private:
    struct Held {
        int count = 0;
        bool written = false;
        std::vector<float> host;
    };
    CudaPipelineEngine<T>& e_;
    const ParamLayout& layout_;
    dist::OwnerWeights owner_;
    std::map<int, Held> held_;
};

template <typename T>
class CudaPipelineEngine final : public Engine, private StepCollectives<T> {
  public:
    CudaPipelineEngine(const RunPlan& plan, dist::Communicator& comm);
    ~CudaPipelineEngine() override;

    std::string describe() const override {
        return fmt::format("cuda: {} ({}), pipeline stage {} of {} (blocks {}..{}, {} schedule){}",
                           cuda_device_name(), precision_name<T>(), rank_, p_,
                           model_->first_block(), model_->end_block() - 1,
                           pp::kind_name(plan_.schedule), replicas());
    }
    ModelWeights weights() override { return ModelWeights{*weights_, layout_, cfg().model}; }
    OptimizerState& optimizer() override { return *opt_; }
    ActFormat arena_format() const override {
        return CudaGPT<T>::arena_format(cfg().model, cfg().micro_batch(), cfg().train.seq_len);
    }
    void set_remat(const RematPlan& plan) override { model_->set_remat(plan); }
    const RematPlan& remat_plan() const override { return model_->remat_plan(); }
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override {
        return step_->finish(lr, max_norm, *this);
    }
    void set_guarded(bool guarded) override { step_->set_guarded(guarded); }
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_) override;
    void forward_logits(const int32_t* inputs, int B, int T_, float* out) override;
    MemoryTracker& memory() override { return device_memory(); }
    std::string memory_title() const override {
        return fmt::format("device: {}, {}, pipeline stage {} of {}{}", cuda_device_name(),
                           precision_name<T>(), rank_, p_, replicas());
    }
    std::vector<MemoryPrediction> predicted_memory(int B, int T_) const override {
        return predict_cuda_stage_memory(plan_, model_->remat_plan(), B, T_);
    }
    std::string memory_footer() const override {
        return device_in_use_line() +
               fmt::format("{:<16} {:>12}  (host: code, libraries, loaders)\n", "process peak RSS",
                           fmt::format("{:.1f} MiB", process_peak_rss() / 1048576.0));
    }
    std::pair<double, int64_t> loss_scaler_state() const override { return step_->scaler_state(); }
    void restore_loss_scaler(double scale, int64_t clean) override {
        step_->restore_scaler(scale, clean);
    }

  private:
    friend class StageWeights<T>;
    struct Micro {
        std::vector<int32_t> x, y;
    };

    // StepCollectives: the stage's own collectives around the shared step. The tied embedding's
    // gradient (last stage's mirror) joins the first stage's before the norm; each stage's
    // gradients are summed over its replicas (pipelines side by side), its sum of squares over
    // the pipeline; every stage updates its own range and the first sends the updated embedding
    // back to the last stage's mirror. The loss is the last stage's, broadcast.
    T* gradients() override;
    void reduce(double* sum_sq, double* unit_sq) override;
    void update(const cuda::StepScalars* scalars) override;
    std::string overflow() override {
        return "a non-finite gradient norm over the pipeline's stages";
    }
    double job_loss(double mean) override {
        comm_.broadcast(&mean, sizeof(mean), p_ - 1);
        return mean_over_pipelines(mean);
    }
    void wait(const char* what) override { dcomm_->wait(stream_.get(), what); }

    const RunConfig& cfg() const { return plan_.cfg; }
    // ", pipeline d of D (gradients all-reduced across them)" with pipelines side by side.
    std::string replicas() const {
        return mesh_.dp > 1 ? fmt::format(", pipeline {} of {} (gradients all-reduced across them)",
                                          data_->rank(), mesh_.dp)
                            : std::string();
    }
    bool first() const { return rank_ == 0; }
    bool last() const { return rank_ == p_ - 1; }
    bool tied_across() const { return p_ > 1 && cfg().model.tied_embeddings; }
    // The stage's fp32 master weights (its parameters when T is float); null under optim.master
    // = "none", where the bf16 parameters are the weights.
    float* master() { return opt_->master_or_params(units_->params()); }
    void run_schedule();
    // A micro-batch through this stage's forward into `slot`: the input received, the output
    // sent on.
    void forward_into(int slot, const Micro& mb);
    // The compute stream waits for every send queued so far, so the host's next wait covers
    // them (before an arena can be re-carved under a send, or the engine goes).
    void join_sends() {
        for (cudaEvent_t e : out_sent_) MT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), e, 0));
        MT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), grad_sent_, 0));
    }
    // The mean of the pipelines' losses, summed in pipeline order (the same bits everywhere).
    double mean_over_pipelines(double loss) {
        if (mesh_.dp == 1) return loss;
        std::vector<double> all((std::size_t)mesh_.dp);
        data_->all_gather_bytes(&loss, all.data(), sizeof(double));
        double sum = 0;
        for (double v : all) sum += v;
        return sum / mesh_.dp;
    }
    // The communicators across boundary b (ranks b, b + 1).
    dist::DeviceCommunicator& act_comm(int b) { return *act_[b % 2]; }
    dist::DeviceCommunicator& grad_comm(int b) { return *grad_[b % 2]; }

    RunPlan plan_;
    dist::Communicator& world_;
    dist::MeshLayout mesh_;
    dist::MeshGroups groups_;
    dist::Communicator& comm_;  // the pipeline: rank = stage
    dist::Communicator* data_;  // the stage's replicas: rank = pipeline
    int rank_ = 0, p_ = 1;
    ParamLayout layout_;
    pp::StageSplit split_;
    // The compute stream and the two streams of sends (see the top of the file).
    CudaStream stream_, fsend_, bsend_;
    // The step's reductions and the tied embedding (compute stream), activations and gradients
    // across even and odd boundaries (see the top of the file).
    std::unique_ptr<dist::DeviceCommunicator> dcomm_;
    std::unique_ptr<dist::DeviceCommunicator> act_[2], grad_[2];
    std::unique_ptr<dist::DeviceCommunicator> ddata_;  // the stage's replicas (pipelines > 1)
    std::unique_ptr<StageUnits<T>> units_;
    std::unique_ptr<StageWeights<T>> weights_;
    std::unique_ptr<CudaGPT<T>> model_;
    std::unique_ptr<DeviceOptimizer<T>> opt_;
    std::unique_ptr<DeviceStep<T>> step_;
    pp::Schedule sched_;
    // Per slot: its output is ready to send / has been sent; the gradient likewise.
    std::vector<cudaEvent_t> out_ready_, out_sent_;
    cudaEvent_t grad_ready_ = nullptr, grad_sent_ = nullptr;
    DeviceBuffer<T> tied_in_;  // first stage of a tied model: the classifier's wte gradient
    std::vector<Micro> mbs_;
    int B_ = 0, T_ = 0;
    float grad_scale_ = 0;
};

template <typename T>
float* StageWeights<T>::unit(int u) {
    StageUnits<T>& su = *e_.units_;
    if (!su.owns(u) && !su.mirrors(u)) return nullptr;
    Held& h = held_[u];
    const ParamUnit& unit = layout_.units[u];
    h.host.assign(unit.size(), 0.0f);
    // The mirror is never the owner's copy: its values arrive from the first stage.
    const auto wait = [this](const char* what) { e_.wait(what); };
    if (su.owns(u) && !e_.master()) {  // optim.master = "none": the bf16 parameters, decoded
        download_decoded(h.host.data(), su.params() + (unit.begin - su.begin()), unit.size(),
                         e_.stream_.get(), wait);
    } else if (su.owns(u)) {
        MT_CUDA_CHECK(cudaMemcpyAsync(h.host.data(), e_.master() + (unit.begin - su.begin()),
                                      unit.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      e_.stream_.get()));
        e_.wait("a weight transfer");
    }
    return h.host.data();
}

template <typename T>
void StageWeights<T>::release(int u) {
    owner_.release(u);  // a written unit: every copy now holds the owner's values
    Held& h = held_.at(u);
    if (--h.count > 0) return;
    StageUnits<T>& su = *e_.units_;
    const ParamUnit& unit = layout_.units[u];
    const auto wait = [this](const char* what) { e_.wait(what); };
    if (h.written && su.owns(u) && !e_.master()) {
        upload_rounded(su.params() + (unit.begin - su.begin()), h.host.data(), unit.size(),
                       e_.stream_.get(), wait);
    } else if (h.written && su.owns(u)) {
        float* dst = e_.master() + (unit.begin - su.begin());
        MT_CUDA_CHECK(cudaMemcpyAsync(dst, h.host.data(), unit.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, e_.stream_.get()));
        if constexpr (!std::is_same_v<T, float>)
            cuda::cast<T, float>(su.params() + (unit.begin - su.begin()), dst, (int64_t)unit.size(),
                                 e_.stream_.get());
        e_.wait("a weight transfer");
    } else if (h.written && su.mirrors(u)) {
        upload_rounded(su.mirror_params(), h.host.data(), unit.size(), e_.stream_.get(), wait);
    }
    held_.erase(u);
}

template <typename T>
CudaPipelineEngine<T>::CudaPipelineEngine(const RunPlan& plan, dist::Communicator& comm)
    : plan_(plan),
      world_(comm),
      mesh_{plan.mesh.pp, plan.mesh.dp},
      groups_(dist::split_mesh(comm, mesh_)),
      comm_(*groups_.stages),
      data_(groups_.data.get()),
      rank_(comm_.rank()),
      p_(comm_.size()),
      layout_(make_param_layout(plan.cfg.model)) {
    if (p_ != mesh_.pp || mesh_.size() != comm.size())
        fail("internal: GPU pipelines of {} stages on {} ranks", mesh_.pp, comm.size());
    // Every rank makes each communicator at the same time (its pipeline's, then its stage's
    // replicas'), each over the host group that carries NCCL's id.
    auto nccl = [](dist::Communicator& g) {
        return dist::make_nccl_communicator(
            dist::HostLink{g.rank(), g.size(), [&g](void* d, int64_t b) { g.broadcast(d, b, 0); }});
    };
    dcomm_ = nccl(comm_);
    if (p_ > 1)
        for (int k = 0; k < 2; k++) {
            act_[k] = nccl(comm_);
            grad_[k] = nccl(comm_);
        }
    if (mesh_.dp > 1) ddata_ = nccl(*data_);
    const int B = cfg().micro_batch(), Tn = cfg().train.seq_len;
    split_ = pp::split_stages(cfg().model, p_, B, Tn);
    const int b0 = split_.first_block[rank_], b1 = b0 + split_.blocks[rank_];
    const int first_unit = b0 == 0 ? ParamLayout::embedding_unit() : layout_.block_unit(b0);
    const int last_unit =
        b1 == cfg().model.n_layer ? layout_.head_unit() : layout_.block_unit(b1 - 1);
    units_ =
        std::make_unique<StageUnits<T>>(layout_, first_unit, last_unit, last() && tied_across());
    // Who owns each unit, for the weights view: the stage its blocks belong to (every pipeline
    // holds the same weights: pipeline 0's stage s, job rank s, speaks for them).
    std::vector<int> owner(layout_.units.size(), 0);
    for (int s = 0; s < p_; s++)
        for (int l = split_.first_block[s]; l < split_.first_block[s] + split_.blocks[s]; l++)
            owner[layout_.block_unit(l)] = s;
    owner[layout_.head_unit()] = p_ - 1;
    weights_ = std::make_unique<StageWeights<T>>(*this, layout_, std::move(owner), world_);
    model_ = std::make_unique<CudaGPT<T>>(cfg().model, stream_.get(), 0, units_.get());
    model_->set_waiter([this](const char* what) { wait(what); });
    opt_ = std::make_unique<DeviceOptimizer<T>>(
        cfg().optim, layout_, units_->begin(), units_->count(), stream_.get(),
        [this](const char* what) { wait(what); }, cfg().train.seed);
    if (first() && tied_across())
        tied_in_ = DeviceBuffer<T>(layout_.units[ParamLayout::embedding_unit()].size(),
                                   MemCategory::Workspace);
    step_ = std::make_unique<DeviceStep<T>>(cfg().optim, plan_.precision, cfg().accum_steps(), 0,
                                            stream_.get());
    // The schedule, and the slots: the most micro-batches this stage holds at once under it
    // (engine/device_memory.h prices the same count).
    sched_ = pp::make_schedule(plan_.schedule, p_, cfg().accum_steps());
    pp::validate(sched_);
    model_->set_stage(b0, b1, pipeline_stage_slots(sched_, rank_));
    for (auto* v : {&out_ready_, &out_sent_}) {
        v->resize((std::size_t)model_->slots());
        for (auto& e : *v) MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    for (auto* e : {&grad_ready_, &grad_sent_})
        MT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    // Nothing is in flight yet: the "sent" events stand recorded.
    for (auto& e : out_sent_) MT_CUDA_CHECK(cudaEventRecord(e, fsend_.get()));
    MT_CUDA_CHECK(cudaEventRecord(grad_sent_, bsend_.get()));
}

template <typename T>
CudaPipelineEngine<T>::~CudaPipelineEngine() {
    for (const CudaStream* s : {&stream_, &fsend_, &bsend_}) cudaStreamSynchronize(s->get());
    model_.reset();
    for (auto* v : {&out_ready_, &out_sent_})
        for (auto& e : *v) cudaEventDestroy(e);
    for (cudaEvent_t e : {grad_ready_, grad_sent_})
        if (e) cudaEventDestroy(e);
}

template <typename T>
void CudaPipelineEngine<T>::begin_step() {
    units_->zero_grads(stream_.get());
    mbs_.clear();
    step_->begin();
}

template <typename T>
void CudaPipelineEngine<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B,
                                             int T_n, float grad_scale, bool last_mb) {
    step_->next_micro(B, T_n);  // (its loss sum is written by the schedule's B action)
    const std::size_t n = (std::size_t)B * T_n;
    mbs_.push_back(Micro{std::vector<int32_t>(inputs, inputs + n),
                         std::vector<int32_t>(targets, targets + n)});
    B_ = B;
    T_ = T_n;
    grad_scale_ = grad_scale;
    if (last_mb) run_schedule();
}

template <typename T>
void CudaPipelineEngine<T>::forward_into(int slot, const Micro& mb) {
    const int64_t n = (int64_t)B_ * T_ * cfg().model.n_embd;
    cudaStream_t stream = stream_.get();
    // The slot's last output must be on its way before anything rewrites the slot.
    MT_CUDA_CHECK(cudaStreamWaitEvent(stream, out_sent_[slot], 0));
    if (!first())
        act_comm(rank_ - 1).recv(model_->stage_input(slot), n, device_type<T>(), rank_ - 1, stream);
    model_->stage_forward(slot, mb.x.data(), mb.y.data(), B_, T_);
    if (!last()) {
        MT_CUDA_CHECK(cudaEventRecord(out_ready_[slot], stream));
        MT_CUDA_CHECK(cudaStreamWaitEvent(fsend_.get(), out_ready_[slot], 0));
        act_comm(rank_).send(model_->stage_output(slot), n, device_type<T>(), rank_ + 1,
                             fsend_.get());
        MT_CUDA_CHECK(cudaEventRecord(out_sent_[slot], fsend_.get()));
    }
}

template <typename T>
void CudaPipelineEngine<T>::run_schedule() {
    const int m = (int)mbs_.size();
    if (m != sched_.m) fail("internal: {} micro-batches for a schedule of {}", m, sched_.m);
    const int64_t n = (int64_t)B_ * T_ * cfg().model.n_embd;
    cudaStream_t stream = stream_.get();
    model_->prepare(B_, T_);
    // fp16: the loss gradient carries the loss scale.
    const float scale = step_->loss_scale();
    std::vector<int> free_slots, slot_of((std::size_t)m, -1);
    for (int k = model_->slots() - 1; k >= 0; k--) free_slots.push_back(k);
    for (const pp::Action& a : sched_.ranks[rank_]) {
        const int i = a.mb;
        if (a.op == pp::Op::F) {
            if (free_slots.empty()) fail("internal: pipeline stage {} ran out of slots", rank_);
            const int slot = free_slots.back();
            free_slots.pop_back();
            slot_of[i] = slot;
            forward_into(slot, mbs_[i]);
        } else if (a.op == pp::Op::B) {
            const int slot = slot_of[i];
            // The gradient buffer's last send must be out before it is rewritten.
            MT_CUDA_CHECK(cudaStreamWaitEvent(stream, grad_sent_, 0));
            if (!last())
                grad_comm(rank_).recv(model_->stage_grad(), n, device_type<T>(), rank_ + 1, stream);
            model_->stage_backward(slot, B_, T_, grad_scale_ * scale, step_->loss_sum(i));
            if (!first()) {
                MT_CUDA_CHECK(cudaEventRecord(grad_ready_, stream));
                MT_CUDA_CHECK(cudaStreamWaitEvent(bsend_.get(), grad_ready_, 0));
                grad_comm(rank_ - 1).send(model_->stage_grad(), n, device_type<T>(), rank_ - 1,
                                          bsend_.get());
                MT_CUDA_CHECK(cudaEventRecord(grad_sent_, bsend_.get()));
            }
            free_slots.push_back(slot);
        } else {
            fail("internal: the GPU pipeline runs no {} actions", pp::action_text(a));
        }
    }
    join_sends();
}

template <typename T>
T* CudaPipelineEngine<T>::gradients() {
    // The tied embedding: the classifier's gradient (last stage) joins the embedding's (first).
    if (tied_across()) {
        const int E = ParamLayout::embedding_unit();
        const int64_t ne = (int64_t)layout_.units[E].size();
        if (last()) dcomm_->send(units_->mirror_grads(), ne, device_type<T>(), 0, stream_.get());
        if (first()) {
            dcomm_->recv(tied_in_.data(), ne, device_type<T>(), p_ - 1, stream_.get());
            cuda::add_inplace<T>(units_->acquire_grads(E), tied_in_.data(), ne, stream_.get());
        }
    }
    return units_->grads();
}

template <typename T>
void CudaPipelineEngine<T>::reduce(double* sum_sq, double*) {
    // Pipelines side by side: each stage's gradients summed over its replicas (the loss gradient
    // is 1 / the global batch's tokens, so the sum is the whole batch's).
    if (ddata_)
        ddata_->all_reduce_sum(units_->grads(), (int64_t)units_->count(), device_type<T>(),
                               stream_.get());
    // The global norm: the stages' sums of squares summed over the pipeline.
    cuda::sum_squares<T>(sum_sq, units_->grads(), (int64_t)units_->count(), stream_.get());
    dcomm_->all_reduce_sum(sum_sq, 1, dist::DeviceType::F64, stream_.get());
}

template <typename T>
void CudaPipelineEngine<T>::update(const cuda::StepScalars* scalars) {
    opt_->step(units_->params(), units_->grads(), scalars, stream_.get());
    // The updated embedding back to the last stage's mirror (the old one after a skipped step).
    if (tied_across()) {
        const int E = ParamLayout::embedding_unit();
        const int64_t ne = (int64_t)layout_.units[E].size();
        if (first())
            dcomm_->send(units_->acquire_params(E), ne, device_type<T>(), p_ - 1, stream_.get());
        if (last()) dcomm_->recv(units_->mirror_params(), ne, device_type<T>(), 0, stream_.get());
    }
}

template <typename T>
double CudaPipelineEngine<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B,
                                           int T_n) {
    B_ = B;
    T_ = T_n;
    model_->prepare(B, T_n);
    const std::size_t n = (std::size_t)B * T_n;
    const Micro mb{std::vector<int32_t>(inputs, inputs + n),
                   std::vector<int32_t>(targets, targets + n)};
    forward_into(0, mb);
    join_sends();
    if (last()) model_->stage_loss(0, B, T_n, step_->eval_sum());
    // The last stage's loss, on every stage of every pipeline.
    return job_loss(step_->eval_loss((int64_t)n, *this, last()));
}

template <typename T>
void CudaPipelineEngine<T>::forward_logits(const int32_t* inputs, int B, int T_n, float* out) {
    B_ = B;
    T_ = T_n;
    model_->prepare(B, T_n);
    const std::size_t n = (std::size_t)B * T_n;
    const Micro mb{std::vector<int32_t>(inputs, inputs + n), {}};
    forward_into(0, mb);
    join_sends();
    if (last()) model_->stage_logits(0, B, T_n, out);
    wait("the logits");
    comm_.broadcast(out, (int64_t)(n * cfg().model.vocab_size * sizeof(float)), p_ - 1);
}

}  // namespace

std::unique_ptr<Engine> make_cuda_pipeline_engine(const RunPlan& plan, dist::Communicator& comm) {
    return make_for_precision<CudaPipelineEngine>(plan, comm);
}

}  // namespace memtrain

#else  // built without CUDA

namespace memtrain {

std::unique_ptr<Engine> make_cuda_pipeline_engine(const RunPlan&, dist::Communicator&) {
    fail(
        "train.device = \"cuda\", but this memtrain was built without CUDA (no nvcc at build "
        "time)");
}

}  // namespace memtrain

#endif
