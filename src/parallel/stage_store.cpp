// A pipeline stage's parameters and gradients, and the view checkpoints use (stage_store.h).
#include "parallel/stage_store.h"

#include <cstring>

#include "core/error.h"

namespace memtrain::pp {

StageStore::StageStore(const ParamLayout& layout, int first_unit, int last_unit,
                       bool mirror_embedding)
    : layout_(&layout), first_(first_unit), last_(last_unit) {
    if (first_unit < 0 || last_unit >= (int)layout.units.size() || first_unit > last_unit)
        fail("internal: stage units [{}, {}] of {}", first_unit, last_unit, layout.units.size());
    begin_ = layout.units[first_unit].begin;
    end_ = layout.units[last_unit].end;
    params_ = Buffer<float>(count(), MemCategory::Parameters);
    grads_ = Buffer<float>(count(), MemCategory::Gradients);
    if (mirror_embedding && !owns(ParamLayout::embedding_unit())) {
        const std::size_t n = layout.units[ParamLayout::embedding_unit()].size();
        mirror_params_ = Buffer<float>(n, MemCategory::Parameters);
        mirror_grads_ = Buffer<float>(n, MemCategory::Gradients);
    }
    zero_grads();
}

float* StageStore::full_params() {
    return begin_ == 0 && end_ == layout_->total ? params_.data() : nullptr;
}

float* StageStore::full_grads() {
    return begin_ == 0 && end_ == layout_->total ? grads_.data() : nullptr;
}

float* StageStore::find(int u, Buffer<float>& owned, Buffer<float>& mirror) {
    if (owns(u)) return owned.data() + (layout_->units.at(u).begin - begin_);
    if (u == ParamLayout::embedding_unit() && mirror.size() > 0) return mirror.data();
    fail("internal: unit {} is not on this pipeline stage (units {}..{})", u, first_, last_);
}

float* StageStore::acquire(int u, bool) {
    return find(u, params_, mirror_params_);
}

float* StageStore::unit_grads(int u) {
    return find(u, grads_, mirror_grads_);
}

void StageStore::zero_grads() {
    if (grads_.size()) std::memset(grads_.data(), 0, grads_.bytes());
    if (mirror_grads_.size()) std::memset(mirror_grads_.data(), 0, mirror_grads_.bytes());
}

StageWeights::StageWeights(const ParamLayout& layout, StageStore& stage, std::vector<int> owner,
                           dist::Communicator& comm)
    : layout_(&layout), stage_(&stage), owner_(std::move(owner)), comm_(&comm) {
    if (owner_.size() != layout.units.size())
        fail("internal: {} unit owners for {} units", owner_.size(), layout.units.size());
}

float* StageWeights::acquire(int u, bool for_write) {
    Held& h = held_[u];
    if (h.count++ > 0) return h.data;
    const bool here =
        stage_->owns(u) || (u == ParamLayout::embedding_unit() && stage_->mirrors_embedding());
    const std::size_t n = layout_->units.at(u).size();
    if (here) {
        h.data = stage_->acquire(u);
    } else {
        h.scratch = Buffer<float>(n, MemCategory::Communication);
        h.data = h.scratch.data();
    }
    // A read: every rank gets the owner's values (a collective, in the same order everywhere).
    if (!for_write) comm_->broadcast(h.data, (int64_t)(n * sizeof(float)), owner_.at(u));
    return h.data;
}

void StageWeights::release(int u) {
    auto it = held_.find(u);
    if (it == held_.end() || it->second.count == 0)
        fail("internal: unit {} released more often than acquired", u);
    if (--it->second.count == 0) held_.erase(it);
}

float* StageWeights::unit_grads(int u) {
    fail("internal: gradients of unit {} asked of a pipeline's weight view", u);
}

}  // namespace memtrain::pp
