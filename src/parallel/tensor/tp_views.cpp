// Whole-model views over a tensor-parallel stage's shards (tp_views.h).
#include "parallel/tensor/tp_views.h"

#include "core/error.h"

namespace memtrain {

namespace {

// Unit u whole in `whole`, from every rank's shard of it (an all-gather of the group).
void assemble_unit(const dist::TpLayout& l, int u, const float* local, dist::TpGroup& group,
                   Buffer<float>& whole) {
    const ParamUnit &fu = l.full.units[u], &lu = l.local.units[u];
    whole = Buffer<float>(fu.size(), MemCategory::Communication);
    Buffer<float> pieces(lu.size() * group.size(), MemCategory::Communication);
    group.all_gather(TpSite::Gather, local, pieces.data(), (int64_t)lu.size());
    for (std::size_t i = fu.first_tensor; i < fu.last_tensor; i++)
        dist::tp_assemble(l, i, pieces.data() + (l.local.tensors[i].offset - lu.begin), lu.size(),
                          whole.data() + (l.full.tensors[i].offset - fu.begin));
}

// This rank's pieces of unit u's whole tensors into its shard of the unit.
void slice_unit(const dist::TpLayout& l, int u, const float* whole, float* local) {
    const ParamUnit &fu = l.full.units[u], &lu = l.local.units[u];
    for (std::size_t i = fu.first_tensor; i < fu.last_tensor; i++)
        dist::tp_slice(l, i, whole + (l.full.tensors[i].offset - fu.begin),
                       local + (l.local.tensors[i].offset - lu.begin));
}

}  // namespace

float* TpWholeWeights::acquire(int u, bool for_write) {
    TpHeldUnit& h = held_[u];
    h.written = h.written || for_write;
    if (h.count++ > 0) return h.whole.data();
    assemble_unit(*l_, u, local_->acquire(u, false), *group_, h.whole);
    local_->release(u);
    return h.whole.data();
}

void TpWholeWeights::release(int u) {
    auto it = held_.find(u);
    if (it == held_.end()) fail("internal: release of unit {} that is not acquired", u);
    if (--it->second.count > 0) return;
    if (it->second.written) {
        slice_unit(*l_, u, it->second.whole.data(), local_->acquire(u, true));
        local_->release(u);
    }
    held_.erase(it);
}

TpStageWeights::TpStageWeights(const dist::TpLayout& l, dist::UnitSource& shards,
                               dist::TpGroup& group, std::vector<int> owner,
                               dist::Communicator& world)
    : l_(&l), shards_(&shards), group_(&group), owner_(l.full, *this, std::move(owner), world) {}

float* TpStageWeights::acquire(int u, bool for_write) {
    TpHeldUnit& h = held_[u];
    h.count++;
    h.written = h.written || for_write;
    return owner_.acquire(u, for_write);
}

float* TpStageWeights::unit(int u) {
    const float* local = shards_->unit(u);
    if (!local) return nullptr;
    TpHeldUnit& h = held_[u];
    assemble_unit(*l_, u, local, *group_, h.whole);
    return h.whole.data();
}

void TpStageWeights::release(int u) {
    owner_.release(u);  // a written unit: every copy now holds the owner's values
    auto it = held_.find(u);
    if (it == held_.end() || it->second.count <= 0)
        fail("internal: unit {} released more often than acquired", u);
    if (--it->second.count > 0) return;
    if (it->second.written)
        if (float* local = shards_->unit(u)) slice_unit(*l_, u, it->second.whole.data(), local);
    held_.erase(it);
}

TpRangeOptimizer::TpRangeOptimizer(const dist::TpLayout& l, OptimizerState& local,
                                   dist::TpGroup& group, int first_unit, int last_unit,
                                   dist::Communicator* data, dist::ShardRange piece)
    : l_(&l),
      local_(&local),
      group_(&group),
      data_(data),
      piece_(piece),
      first_tensor_(l.full.units.at(first_unit).first_tensor),
      last_tensor_(l.full.units.at(last_unit).last_tensor),
      begin_(l.full.units[first_unit].begin),
      end_(l.full.units[last_unit].end),
      local_begin_(l.local.units.at(first_unit).begin),
      local_end_(l.local.units.at(last_unit).end) {
    const std::size_t n = local_end_ - local_begin_;
    if (!data_) piece_ = dist::ShardRange{0, (int64_t)n};
    if (local.count() != (std::size_t)piece_.count || piece_.offset < 0 ||
        (std::size_t)(piece_.offset + piece_.count) > n)
        fail("internal: an optimizer of {} floats for the piece [{}, {}) of a shard range of {}",
             local.count(), piece_.offset, piece_.offset + piece_.count, n);
}

void TpRangeOptimizer::read_state(const std::string& name, float* dst) {
    const std::size_t n = local_end_ - local_begin_;
    Buffer<float> mine(n, MemCategory::Communication);
    if (data_) {  // ZeRO-1: the replicas' pieces of this shard's range, in replica order
        Buffer<float> piece((std::size_t)piece_.count, MemCategory::Communication);
        local_->read_state(name, piece.data());
        data_->all_gather(piece.data(), mine.data(), dist::shard_counts((int64_t)n, data_->size()));
    } else {
        local_->read_state(name, mine.data());
    }
    Buffer<float> pieces(n * group_->size(), MemCategory::Communication);
    group_->all_gather(TpSite::Gather, mine.data(), pieces.data(), (int64_t)n);
    for (std::size_t i = first_tensor_; i < last_tensor_; i++)
        dist::tp_assemble(*l_, i, pieces.data() + (l_->local.tensors[i].offset - local_begin_), n,
                          dst + (l_->full.tensors[i].offset - begin_));
}

void TpRangeOptimizer::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                   const float* src) {
    // Runs of consecutive local elements, written as one piece each.
    std::size_t run_at = 0;
    std::vector<float> run;
    auto flush = [&] {
        if (!run.empty()) local_->write_state(name, run_at, run.size(), run.data());
        run.clear();
    };
    const auto& ts = l_->full.tensors;
    std::size_t i = first_tensor_;
    for (std::size_t k = 0; k < n; k++) {
        const std::size_t j = begin_ + begin + k;  // in l.full
        while (j >= ts[i].offset + ts[i].numel) i++;
        const int64_t li = l_->local_index(i, (int64_t)(j - ts[i].offset));
        if (li < 0) continue;
        std::size_t at = l_->local.tensors[i].offset + (std::size_t)li - local_begin_;
        // ZeRO-1: another replica's piece holds it.
        if (at < (std::size_t)piece_.offset || at >= (std::size_t)(piece_.offset + piece_.count))
            continue;
        at -= (std::size_t)piece_.offset;
        if (run.empty() || at != run_at + run.size()) {
            flush();
            run_at = at;
        }
        run.push_back(src[k]);
    }
    flush();
}

}  // namespace memtrain
