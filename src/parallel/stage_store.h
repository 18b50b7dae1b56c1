// Where a pipeline stage keeps its parameters and gradients: only the units it runs, in one
// contiguous range [begin, end) of the model's flat buffer (the embedding and the first blocks on
// stage 0, ..., the last blocks and the head on the last stage), so the optimizer of a stage is
// an ordinary optimizer over a range, as a ZeRO shard's is, and checkpoints keep their per-range
// optimizer files. The last stage of a tied model also holds a mirror of the embedding unit
// (the classifier reads wte): its gradient goes to stage 0, which owns wte, and stage 0 sends the
// updated wte back after each step (parallel/pipeline_engine.h).
//
// Checkpoints, import and initialisation see it through dist::OwnerWeights (dist/param_server.h),
// with the StageStore as this rank's dist::UnitSource: a unit read is broadcast from the stage
// that owns it.
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "core/allocator.h"
#include "dist/param_server.h"
#include "model/param_layout.h"
#include "model/param_store.h"

namespace memtrain::pp {

class StageStore final : public ParamStore, public dist::UnitSource {
  public:
    // Units [first_unit, last_unit] of `layout`; with mirror_embedding, unit 0 as well (a copy).
    StageStore(const ParamLayout& layout, int first_unit, int last_unit, bool mirror_embedding);

    std::size_t begin() const { return begin_; }
    std::size_t end() const { return end_; }
    std::size_t count() const { return end_ - begin_; }
    int first_unit() const { return first_; }
    int last_unit() const { return last_; }
    bool owns(int u) const { return u >= first_ && u <= last_; }
    bool mirrors_embedding() const { return mirror_params_.size() > 0; }
    // The owned range's parameters and gradients (count() floats each).
    float* owned_params() { return params_.data(); }
    float* owned_grads() { return grads_.data(); }
    // The mirrored embedding unit (null without one).
    float* mirror_params() { return mirror_params_.data(); }
    float* mirror_grads() { return mirror_grads_.data(); }
    std::size_t mirror_size() const { return mirror_params_.size(); }

    // ParamStore: only the units this stage has; anything else is an internal error.
    float* full_params() override;
    float* full_grads() override;
    float* acquire(int u, bool for_write = false) override;
    void release(int) override {}
    float* unit_grads(int u) override;
    void grads_done(int) override {}
    void zero_grads() override;

    // dist::UnitSource: the unit where this stage has it (owned or the mirror), else null.
    float* unit(int u) override;
    bool read_into_scratch() const override { return false; }

  private:
    float* find(int u, Buffer<float>& owned, Buffer<float>& mirror);
    const ParamLayout* layout_;
    int first_, last_;
    std::size_t begin_, end_;
    Buffer<float> params_, grads_;
    Buffer<float> mirror_params_, mirror_grads_;
};

}  // namespace memtrain::pp
