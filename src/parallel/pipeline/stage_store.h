// Where a pipeline stage keeps its parameters and gradients: only the units it runs, in one
// contiguous range [begin, end) of the model's flat buffer (the embedding and the first blocks on
// stage 0, ..., the last blocks and the head on the last stage), so the optimizer of a stage is
// an ordinary optimizer over a range, as a ZeRO shard's is, and checkpoints keep their per-range
// optimizer files. An interleaved rank holds one range per chunk (virtual stages r, r + p, ...),
// with an optimizer per range (RangeOptimizers, optim/optimizer.h). The last stage of a tied model
// also holds a mirror of the embedding unit (the classifier reads wte): its gradient goes to stage
// 0, which owns wte, and stage 0 sends the updated wte back after each step
// (parallel/pipeline/executor.h).
//
// Checkpoints, import and initialisation see it through dist::OwnerWeights
// (parallel/ps/param_server.h), with the StageStore as this rank's dist::UnitSource: a unit read is
// broadcast from the stage that owns it.
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "core/allocator.h"
#include "model/param_layout.h"
#include "model/unit_store.h"
#include "parallel/ps/param_server.h"

namespace memtrain::pp {

class StageStore final : public UnitStore, public dist::UnitSource {
  public:
    // Units [first, last] of the layout, kept in the parameter buffer's order.
    struct Range {
        int first_unit, last_unit;
        std::size_t begin, end;  // floats [begin, end) of the model's flat buffer
        std::size_t at;          // where they start in owned_params() / owned_grads()
        std::size_t count() const { return end - begin; }
    };
    // Units [first_unit, last_unit] of `layout`; with mirror_embedding, unit 0 as well (a copy).
    StageStore(const ParamLayout& layout, int first_unit, int last_unit, bool mirror_embedding);
    // Several disjoint runs of units (first, last), in increasing order: an interleaved pipeline
    // rank's chunks. They are kept one after another in owned_params() / owned_grads().
    StageStore(const ParamLayout& layout, const std::vector<std::pair<int, int>>& unit_ranges,
               bool mirror_embedding);

    const std::vector<Range>& ranges() const { return ranges_; }
    // With one range: its floats and units. With several, begin() and first_unit() are the
    // first range's, end() and last_unit() the last's, and count() is the sum of their sizes.
    std::size_t begin() const { return ranges_.front().begin; }
    std::size_t end() const { return ranges_.back().end; }
    std::size_t count() const { return params_.size(); }
    int first_unit() const { return ranges_.front().first_unit; }
    int last_unit() const { return ranges_.back().last_unit; }
    bool owns(int u) const { return range_of(u) != nullptr; }
    bool mirrors_embedding() const { return mirror_params_.size() > 0; }
    // The owned ranges' parameters and gradients (count() floats each, range after range).
    float* owned_params() { return params_.data(); }
    float* owned_grads() { return grads_.data(); }
    // The mirrored embedding unit (null without one).
    float* mirror_params() { return mirror_params_.data(); }
    float* mirror_grads() { return mirror_grads_.data(); }
    std::size_t mirror_size() const { return mirror_params_.size(); }

    // UnitStore: only the units this stage has; anything else is an internal error.
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
    const Range* range_of(int u) const;
    float* find(int u, Buffer<float>& owned, Buffer<float>& mirror);
    const ParamLayout* layout_;
    std::vector<Range> ranges_;
    Buffer<float> params_, grads_;
    Buffer<float> mirror_params_, mirror_grads_;
};

}  // namespace memtrain::pp
