// A pipeline stage's parameters and gradients (stage_store.h).
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

float* StageStore::unit(int u) {
    const bool here = owns(u) || (u == ParamLayout::embedding_unit() && mirrors_embedding());
    return here ? acquire(u) : nullptr;
}

}  // namespace memtrain::pp
