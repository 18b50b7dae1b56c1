// The tensor-parallel CPU engine (see tp_engine.h).
#include "engine/cpu/tp_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/error.h"
#include "engine/host_memory.h"
#include "kernels/cpu/ops.h"
#include "parallel/tensor/tp_views.h"

namespace memtrain {

// The whole model's layout over this rank's shard: acquiring a unit all-gathers the unit from
// every rank and assembles its whole tensors; releasing one acquired for writing keeps this
// rank's pieces. A collective per acquire, which every rank makes in the same order
// (initialisation, import, checkpoints). Gradients are not seen through it.
class TpEngine::WholeStore final : public WeightWindow {
  public:
    WholeStore(const dist::TpLayout& l, FullUnitStore& local, dist::TpGroup& group)
        : l_(&l), local_(&local), group_(&group) {}
    float* acquire(int u, bool for_write) override {
        Held& h = held_[u];
        h.write = h.write || for_write;
        if (h.count++ > 0) return h.whole.data();
        const ParamUnit &fu = l_->full.units[u], &lu = l_->local.units[u];
        h.whole = Buffer<float>(fu.size(), MemCategory::Communication);
        Buffer<float> pieces(lu.size() * group_->size(), MemCategory::Communication);
        group_->all_gather(TpSite::Gather, local_->full_params() + lu.begin, pieces.data(),
                           (int64_t)lu.size());
        for (std::size_t i = fu.first_tensor; i < fu.last_tensor; i++)
            dist::tp_assemble(*l_, i, pieces.data() + (l_->local.tensors[i].offset - lu.begin),
                              lu.size(), h.whole.data() + (l_->full.tensors[i].offset - fu.begin));
        return h.whole.data();
    }
    void release(int u) override {
        auto it = held_.find(u);
        if (it == held_.end()) fail("internal: release of unit {} that is not acquired", u);
        if (--it->second.count > 0) return;
        if (it->second.write) {
            const ParamUnit& fu = l_->full.units[u];
            for (std::size_t i = fu.first_tensor; i < fu.last_tensor; i++)
                dist::tp_slice(*l_, i,
                               it->second.whole.data() + (l_->full.tensors[i].offset - fu.begin),
                               local_->full_params() + l_->local.tensors[i].offset);
        }
        held_.erase(it);
    }

  private:
    struct Held {
        int count = 0;
        bool write = false;
        Buffer<float> whole;
    };
    const dist::TpLayout* l_;
    FullUnitStore* local_;
    dist::TpGroup* group_;
    std::map<int, Held> held_;
};

TpEngine::TpEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg),
      group_(comm),
      tpl_(dist::make_tp_layout(plan.cfg.model, plan.cfg.train.tp, comm.rank())),
      store_(tpl_.local) {
    if (comm.size() != cfg_.train.tp)
        fail("train.tp = {} needs exactly {} ranks, the run has {}: start mpirun -np {}",
             cfg_.train.tp, cfg_.train.tp, comm.size(), cfg_.train.tp);
    model_ = std::make_unique<GPT>(
        dist::tp_shard_config(cfg_.model, cfg_.train.tp, cfg_.train.sequence_parallel), &store_);
    if (cfg_.train.sequence_parallel)
        for (std::size_t i = 0; i < tpl_.local.tensors.size(); i++)
            if (dist::sp_partial_grad(tpl_.local.tensors[i].name)) sp_partial_.push_back(i);
    model_->set_tp(&group_);
    opt_ = make_optimizer(cfg_.optim, tpl_.local);
    whole_ = std::make_unique<WholeStore>(tpl_, store_, group_);
    // The optimizer state of the whole layout: every unit's, gathered from the shards.
    whole_opt_ = std::make_unique<TpRangeOptimizer>(
        tpl_, *opt_, group_, ParamLayout::embedding_unit(), tpl_.full.head_unit());
}

TpEngine::~TpEngine() = default;

std::string TpEngine::describe() const {
    return fmt::format("cpu (fp32), tensor-parallel rank {} of {}{}", group_.rank(), group_.size(),
                       cfg_.train.sequence_parallel ? ", sequence-parallel" : "");
}

ModelWeights TpEngine::weights() {
    return ModelWeights{*whole_, tpl_.full, cfg_.model};
}

OptimizerState& TpEngine::optimizer() {
    return *whole_opt_;
}

void TpEngine::begin_step() {
    model_->zero_grads();
    loss_sum_ = 0;
    micro_batches_ = 0;
    group_.reset_counts();
}

void TpEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                float grad_scale, bool /*last*/) {
    loss_sum_ += model_->forward_backward(inputs, targets, B, T, grad_scale);
    micro_batches_++;
}

void TpEngine::reduce_sequence_partial_grads() {
    if (sp_partial_.empty()) return;
    float* g = store_.full_grads();
    std::size_t n = 0;
    for (std::size_t i : sp_partial_) n += tpl_.local.tensors[i].numel;
    Buffer<float> packed(n, MemCategory::Communication);
    std::size_t at = 0;
    for (std::size_t i : sp_partial_) {
        const ParamSpec& t = tpl_.local.tensors[i];
        std::memcpy(packed.data() + at, g + t.offset, sizeof(float) * t.numel);
        at += t.numel;
    }
    group_.all_reduce(TpSite::SpNormGrads, packed.data(), (int64_t)n);
    at = 0;
    for (std::size_t i : sp_partial_) {
        const ParamSpec& t = tpl_.local.tensors[i];
        std::memcpy(g + t.offset, packed.data() + at, sizeof(float) * t.numel);
        at += t.numel;
    }
}

StepResult TpEngine::finish_step(double lr, double max_norm) {
    StepResult r;
    r.loss = micro_batches_ ? loss_sum_ / micro_batches_ : 0.0;
    // Sequence parallelism: each rank's norm gradients cover its token rows only; summed here,
    // once per step, they are the whole tensors' and the same bits on every rank.
    reduce_sequence_partial_grads();
    // The global norm: the whole tensors' squares once (every rank has the same), the cut ones'
    // summed over the ranks in rank order (the same bits everywhere).
    float* g = store_.full_grads();
    double whole = 0, cut = 0;
    for (std::size_t i = 0; i < tpl_.local.tensors.size(); i++) {
        const ParamSpec& t = tpl_.local.tensors[i];
        (tpl_.shards[i].split() ? cut : whole) += cpu::sum_squares(g + t.offset, (int64_t)t.numel);
    }
    std::vector<double> all((std::size_t)group_.size());
    group_.comm().all_gather_bytes(&cut, all.data(), sizeof(double));
    double sq = whole;
    for (double x : all) sq += x;
    r.grad_norm = std::sqrt(sq);
    if (max_norm > 0) {
        const double coef = max_norm / (r.grad_norm + 1e-6);
        if (coef < 1.0) cpu::scale_inplace(g, (float)coef, (int64_t)tpl_.local.total);
    }
    opt_->step(store_.full_params(), g, lr);
    step_counts_ = group_.counts();
    steps_++;
    return r;
}

double TpEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    return model_->forward_loss(inputs, targets, B, T);
}

void TpEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    model_->forward_logits(inputs, B, T, out);
}

std::string TpEngine::memory_title() const {
    return fmt::format("host, fp32, tensor-parallel rank {} of {}{}", group_.rank(), group_.size(),
                       cfg_.train.sequence_parallel ? ", sequence-parallel" : "");
}

std::vector<MemoryPrediction> TpEngine::predicted_memory(int B, int T) const {
    return predict_cpu_memory(cfg_, model_->remat_plan(), group_.rank(), B, T);
}

std::string TpEngine::memory_footer() const {
    std::string out = host_rss_line();
    const std::size_t whole = tpl_.replicated_floats(), cut = tpl_.full.total - whole;
    out += fmt::format(
        "tensor parallel: parameters per rank {} whole + {} / {} cut = {} floats (one process: "
        "{})\n",
        whole, cut, group_.size(), tpl_.local.total, tpl_.full.total);
    if (steps_ > 0) {
        const dist::TpGroup::Counts& c = step_counts_;
        std::string sites;
        for (int s = 0; s < kTpSites; s++)
            if (c.calls[s] > 0)
                sites += fmt::format("{}{} x{} ({} elements)", sites.empty() ? "" : ", ",
                                     tp_site_name((TpSite)s), c.calls[s], c.elements[s]);
        out += fmt::format(
            "tensor parallel, last step's collectives: {}; {:.3f} MiB in all ({:.3f} MiB sent per "
            "rank by a ring), {:.1f} ms inside them\n",
            sites, c.bytes() / 1048576.0, c.ring_bytes(group_.size()) / 1048576.0, 1e3 * c.seconds);
    }
    return out;
}

}  // namespace memtrain
