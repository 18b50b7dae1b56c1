// A pipeline stage's parameters and gradients (stage_store.h).
#include "parallel/pipeline/stage_store.h"

#include <cstring>

#include "core/error.h"

namespace memtrain::pp {

StageStore::StageStore(const ParamLayout& layout, int first_unit, int last_unit,
                       bool mirror_embedding)
    : StageStore(layout, std::vector<std::pair<int, int>>{{first_unit, last_unit}},
                 mirror_embedding) {}

StageStore::StageStore(const ParamLayout& layout,
                       const std::vector<std::pair<int, int>>& unit_ranges, bool mirror_embedding)
    : layout_(&layout) {
    if (unit_ranges.empty()) fail("internal: a pipeline stage without units");
    std::size_t at = 0;
    for (const auto& [first, last] : unit_ranges) {
        const int prev = ranges_.empty() ? -1 : ranges_.back().last_unit;
        if (first <= prev || last >= (int)layout.units.size() || first > last)
            fail("internal: stage units [{}, {}] of {} (after unit {})", first, last,
                 layout.units.size(), prev);
        const Range r{first, last, layout.units[first].begin, layout.units[last].end, at};
        at += r.count();
        ranges_.push_back(r);
    }
    params_ = Buffer<float>(at, MemCategory::Parameters);
    grads_ = Buffer<float>(at, MemCategory::Gradients);
    if (mirror_embedding && !owns(ParamLayout::embedding_unit())) {
        const std::size_t n = layout.units[ParamLayout::embedding_unit()].size();
        mirror_params_ = Buffer<float>(n, MemCategory::Parameters);
        mirror_grads_ = Buffer<float>(n, MemCategory::Gradients);
    }
    zero_grads();
}

const StageStore::Range* StageStore::range_of(int u) const {
    for (const Range& r : ranges_)
        if (u >= r.first_unit && u <= r.last_unit) return &r;
    return nullptr;
}

float* StageStore::full_params() {
    return count() == layout_->total ? params_.data() : nullptr;
}

float* StageStore::full_grads() {
    return count() == layout_->total ? grads_.data() : nullptr;
}

float* StageStore::find(int u, Buffer<float>& owned, Buffer<float>& mirror) {
    if (const Range* r = range_of(u))
        return owned.data() + r->at + (layout_->units[u].begin - r->begin);
    if (u == ParamLayout::embedding_unit() && mirror.size() > 0) return mirror.data();
    fail("internal: unit {} is not on this pipeline stage (units {}..{})", u, first_unit(),
         last_unit());
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

float* StageStore::unit(int u) {
    const bool here = owns(u) || (u == ParamLayout::embedding_unit() && mirrors_embedding());
    return here ? acquire(u) : nullptr;
}

}  // namespace memtrain::pp
