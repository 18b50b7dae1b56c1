// The parameter server over the CPU model (see ps_engine.h).
#include "engine/cpu/ps_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "engine/host_memory.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

// Point-to-point tags of the two messages (no other traffic uses them while a PS run trains).
constexpr int kTagPush = 31000, kTagPull = 31001;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string mib2(double bytes) {
    return fmt::format("{:.2f} MiB", bytes / 1048576.0);
}

}  // namespace

// Where this rank keeps each unit, for the weights view: a worker's replica, a server's units.
class PsEngine::Replica final : public dist::UnitSource {
  public:
    explicit Replica(PsEngine& e) : e_(e) {}
    float* unit(int u) override {
        if (e_.model_) return e_.model_->params() + e_.layout_.units.at(u).begin;
        return e_.store_->owns(u) ? e_.store_->acquire(u) : nullptr;
    }
    bool read_into_scratch() const override { return true; }

  private:
    PsEngine& e_;
};

PsEngine::PsEngine(const RunPlan& plan, dist::Communicator& comm)
    : plan_(plan),
      comm_(comm),
      rank_(comm.rank()),
      workers_(plan.mesh.dp),
      staleness_(plan.ps_staleness),
      layout_(make_param_layout(plan.cfg.model)) {
    if (workers_ < 1 || workers_ + plan.ps_servers != comm.size())
        fail("internal: {} parameter-server workers and {} servers on {} ranks", workers_,
             plan.ps_servers, comm.size());
    split_ = dist::split_servers(layout_, plan.ps_servers);
    std::vector<int> owner(layout_.units.size());
    for (int u = 0; u < (int)owner.size(); u++) owner[u] = server_rank(split_.server_of(u));
    if (is_server()) {
        const int s = rank_ - workers_;
        store_ = std::make_unique<pp::StageStore>(layout_, split_.first_unit[s],
                                                  split_.last_unit[s], false);
        opt_ = make_optimizer(plan_.cfg.optim, layout_, store_->begin(), store_->count());
        incoming_ = Buffer<float>(store_->count(), MemCategory::Communication);
        const int copies = staleness_ > 0 ? staleness_ + 1 : 1;
        version_sends_.assign(copies, std::vector<uint64_t>(workers_, 0));
        if (staleness_ > 0)
            for (int k = 0; k < copies; k++)
                versions_.emplace_back(store_->count(), MemCategory::Communication);
    } else {
        model_ = std::make_unique<GPT>(plan_.cfg.model);
        model_->zero_grads();  // allocates the gradients now, as the prediction counts them
        // No optimizer state: an empty range whose step count still advances, so a checkpoint
        // written by rank 0 (a worker) records the servers' step count.
        opt_ = make_optimizer(plan_.cfg.optim, layout_, 0, 0);
        pushes_.assign(split_.servers(), 0);
    }
    replica_ = std::make_unique<Replica>(*this);
    weights_ = std::make_unique<dist::OwnerWeights>(layout_, *replica_, std::move(owner), comm_);
}

PsEngine::~PsEngine() {
    // A worker k versions behind has k versions on their way to it; the servers' sends of them
    // complete only when it receives them. After an error this waits within the communicator's
    // timeout rather than free buffers MPI may still read or write.
    try {
        for (uint64_t id : pushes_) comm_.wait(id);
        if (!is_server()) pull_until(steps_);
        for (auto& sends : version_sends_)
            for (uint64_t id : sends) comm_.wait(id);
    } catch (...) {  // a destructor must not throw; the error that unwound us is the story
    }
}

std::string PsEngine::describe() const {
    const std::string role = is_server()
                                 ? fmt::format("server {} of {} (units {}..{})", rank_ - workers_,
                                               servers(), layout_.units[store_->first_unit()].name,
                                               layout_.units[store_->last_unit()].name)
                                 : fmt::format("worker {} of {}", rank_, workers_);
    return fmt::format("cpu ({}), parameter server: {}, {} servers, staleness {}",
                       cpu_compute_label(plan_.cfg.model), role, servers(), staleness_);
}

void PsEngine::set_remat(const RematPlan& plan) {
    remat_ = plan;
    if (model_) model_->set_remat(plan);
}

void PsEngine::begin_step() {
    loss_sum_ = 0;
    micro_batches_ = 0;
    if (is_server()) {
        store_->zero_grads();
        return;
    }
    versions_used_.push_back(have_);
    for (uint64_t& id : pushes_) comm_.wait(id);  // the gradients are about to be zeroed
    model_->zero_grads();
}

void PsEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                float grad_scale, bool) {
    if (is_server()) return;  // servers take no data
    loss_sum_ += model_->forward_backward(inputs, targets, B, T, grad_scale);
    micro_batches_++;
}

double PsEngine::grad_norm() {
    std::vector<double> sq(layout_.units.size(), 0.0);
    if (is_server())
        for (int u = store_->first_unit(); u <= store_->last_unit(); u++)
            sq[u] = cpu::sum_squares(store_->unit_grads(u), (int64_t)layout_.units[u].size());
    comm_.all_reduce_max(sq.data(), (int64_t)sq.size());  // one server has each, the rest 0
    double total = 0;
    for (double s : sq) total += s;
    return std::sqrt(total);
}

void PsEngine::publish() {
    const int64_t n = (int64_t)store_->count();
    const int k = staleness_ > 0 ? (int)(steps_ % (staleness_ + 1)) : 0;
    const float* src = store_->owned_params();
    if (staleness_ > 0) {
        // This copy held version steps_ + 1 - (k + 1), which every worker has pulled by now (it
        // pulled it before pushing the step whose sum this server just received).
        for (uint64_t& id : version_sends_[k]) comm_.wait(id);
        std::memcpy(versions_[k].data(), src, n * sizeof(float));
        src = versions_[k].data();
    }
    for (int w = 0; w < workers_; w++) {
        version_sends_[k][w] = comm_.start_send(src, n, w, kTagPull);
        sent_ += n * (int64_t)sizeof(float);
    }
}

void PsEngine::pull_until(int64_t version) {
    float* params = model_->params();
    while (have_ < version) {
        for (int s = 0; s < servers(); s++) {
            const int64_t n = (int64_t)split_.count(s);
            comm_.recv(params + split_.begin[s], n, server_rank(s), kTagPull);
            received_ += n * (int64_t)sizeof(float);
        }
        have_++;
    }
}

double PsEngine::exchange(double mine) {
    struct Record {
        double value, sent, received, wait_s;
    };
    const Record rec{mine, (double)sent_, (double)received_, wait_s_};
    std::vector<Record> all((std::size_t)comm_.size());
    comm_.all_gather_bytes(&rec, all.data(), sizeof(Record));
    stats_.sent.resize(all.size());
    stats_.received.resize(all.size());
    stats_.wait_s.resize(all.size());
    for (std::size_t r = 0; r < all.size(); r++) {
        stats_.sent[r] = (int64_t)all[r].sent;
        stats_.received[r] = (int64_t)all[r].received;
        stats_.wait_s[r] = all[r].wait_s;
    }
    // Summed in worker order from zero, as one process sums its micro-batches' losses.
    double sum = 0;
    for (int w = 0; w < workers_; w++) sum += all[w].value;
    return sum / workers_;
}

StepResult PsEngine::finish_step(double lr, double max_norm) {
    StepResult r;
    if (is_server()) {
        // The workers' pushes, in worker order, added to zero.
        const int64_t n = (int64_t)store_->count();
        float* g = store_->owned_grads();
        const auto t0 = Clock::now();
        for (int w = 0; w < workers_; w++) {
            comm_.recv(incoming_.data(), n, w, kTagPush);
            received_ += n * (int64_t)sizeof(float);
            cpu::add_inplace(g, incoming_.data(), n);
        }
        wait_s_ += seconds_since(t0);
        r.grad_norm = grad_norm();
        clip_to_norm(g, (std::size_t)n, r.grad_norm, max_norm);
        // Staleness 0 sends the parameters themselves: the last version's sends must be done
        // before the update rewrites them (they are: every worker pulled it before pushing).
        if (staleness_ == 0)
            for (uint64_t& id : version_sends_[0]) comm_.wait(id);
        opt_->step(store_->owned_params(), g, lr);
        publish();
        steps_++;
        r.loss = exchange(0.0);
    } else {
        const double loss = micro_batches_ ? loss_sum_ / micro_batches_ : 0.0;
        const float* g = model_->grads();
        for (int s = 0; s < servers(); s++) {
            const int64_t n = (int64_t)split_.count(s);
            pushes_[s] = comm_.start_send(g + split_.begin[s], n, server_rank(s), kTagPush);
            sent_ += n * (int64_t)sizeof(float);
        }
        const auto t0 = Clock::now();
        r.grad_norm = grad_norm();
        opt_->advance();
        steps_++;
        for (uint64_t& id : pushes_) comm_.wait(id);
        pull_until(std::max<int64_t>(0, steps_ - staleness_));
        wait_s_ += seconds_since(t0);
        r.loss = exchange(loss);
    }
    stats_.steps++;
    return r;
}

double PsEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    return exchange(model_ ? model_->forward_loss(inputs, targets, B, T) : 0.0);
}

void PsEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    if (!model_) fail("internal: a parameter server (rank {}) has no replica to sample", rank_);
    model_->forward_logits(inputs, B, T, out);
}

std::string PsEngine::memory_title() const {
    return fmt::format(
        "host, fp32, parameter-server {} (rank {} of {})",
        is_server() ? fmt::format("server {}", rank_ - workers_) : fmt::format("worker {}", rank_),
        rank_, comm_.size());
}

std::vector<MemoryPrediction> PsEngine::predicted_memory(int B, int T) const {
    return ps_memory_rows(plan_, remat_, is_server(), is_server() ? store_->count() : 0, B, T);
}

std::string PsEngine::memory_footer() const {
    std::string out = host_rss_line();
    out += fmt::format("parameter server: {} workers, {} server{} (", workers_, servers(),
                       servers() == 1 ? "" : "s");
    for (int s = 0; s < servers(); s++)
        out += fmt::format("{}server {} units {}..{}, {} params", s ? "; " : "", s,
                           layout_.units[split_.first_unit[s]].name,
                           layout_.units[split_.last_unit[s]].name, split_.count(s));
    out += fmt::format("), staleness {}\n", staleness_);
    if (stats_.steps == 0 || stats_.sent.empty()) return out;
    const double steps = (double)stats_.steps;
    double total = 0, worker_wait = 0;
    for (std::size_t r = 0; r < stats_.sent.size(); r++) total += stats_.sent[r];
    for (int w = 0; w < workers_; w++) worker_wait += stats_.wait_s[w];
    const double psi4 = 4.0 * layout_.total, W = workers_;
    out += fmt::format(
        "ps traffic per step: worker 0 sent {} received {} | server 0 sent {} received {} | all "
        "links {} (2 W Ψ x 4 B = {}; a ring all-reduce over {} ranks: 2 Ψ (W-1) x 4 B = {}) | "
        "workers waited {:.1f} ms per step on pushes and pulls\n",
        mib2(stats_.sent[0] / steps), mib2(stats_.received[0] / steps),
        mib2(stats_.sent[workers_] / steps), mib2(stats_.received[workers_] / steps),
        mib2(total / steps), mib2(2 * W * psi4), workers_, mib2(2 * (W - 1) * psi4),
        1e3 * worker_wait / W / steps);
    return out;
}

}  // namespace memtrain
