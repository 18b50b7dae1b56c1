// The whole model seen through the tensor-parallel shards (engine/cpu/cpu_engine.h): what
// initialisation, import and checkpoints read and write, per whole tensor with Hugging Face
// names, while each rank keeps its shard (parallel/tensor/tp.h).
//
//   TpWholeWeights  weights() of tensor parallelism alone (every rank of the group holds a shard
//                   of every unit): acquiring a unit all-gathers it from the group and assembles
//                   its whole tensors; releasing one acquired for writing keeps this rank's
//                   pieces. Gradients are not seen through it.
//   TpStageWeights  weights() of a pipeline stage (train.tp with train.pp or several pipelines):
//   dist::OwnerWeights over whole units. A unit is assembled by the
//                   tensor-parallel group of every stage holding it (an all-gather of its
//                   shards) when acquired, and the owner's values are broadcast to every rank;
//                   a unit written is sliced back into each holder's shard at its release.
//   TpRangeOptimizer optimizer(): the stage's optimizer state over its range of the whole
//                   layout, read by gathering the group's shards (a collective of the group)
//                   and written element by element into this rank's shard. Under ZeRO-1 across
//                   the data group each replica's optimizer covers its piece of the shard's
//                   range: a read first gathers the pieces over the data group (a collective of
//                   it too), a write keeps the elements of this replica's piece.
// Every rank makes the same calls in the same order (they are collectives), as with ZeRO-3.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/unit_store.h"
#include "optim/optimizer.h"
#include "parallel/ps/param_server.h"
#include "parallel/tensor/tp.h"

namespace memtrain {

// A whole unit assembled from the shards while it is acquired (nested acquires count), and
// whether one acquire may write it.
struct TpHeldUnit {
    int count = 0;
    bool written = false;
    Buffer<float> whole;
};

class TpWholeWeights final : public WeightWindow {
  public:
    // `local`: this rank's shard, in l.local.
    TpWholeWeights(const dist::TpLayout& l, UnitStore& local, dist::TpGroup& group)
        : l_(&l), local_(&local), group_(&group) {}
    float* acquire(int u, bool for_write) override;
    void release(int u) override;

  private:
    const dist::TpLayout* l_;
    UnitStore* local_;
    dist::TpGroup* group_;
    std::map<int, TpHeldUnit> held_;
};

class TpStageWeights final : public WeightWindow, public dist::UnitSource {
  public:
    // `shards`: this rank's units in l.local (its stage's, and a mirror), null where it keeps
    // none; `owner`: per unit, the job rank whose values count.
    TpStageWeights(const dist::TpLayout& l, dist::UnitSource& shards, dist::TpGroup& group,
                   std::vector<int> owner, dist::Communicator& world);
    float* acquire(int u, bool for_write) override;
    void release(int u) override;
    // dist::UnitSource: unit u assembled from the group's shards, where this rank has a shard.
    float* unit(int u) override;
    bool read_into_scratch() const override { return false; }

  private:
    const dist::TpLayout* l_;
    dist::UnitSource* shards_;
    dist::TpGroup* group_;
    dist::OwnerWeights owner_;
    std::map<int, TpHeldUnit> held_;
};

class TpRangeOptimizer final : public OptimizerState {
  public:
    // `local`: this rank's optimizer over units [first_unit, last_unit] of l.local; or, with
    // `data` (ZeRO-1), over `piece` of them (counted from the range's begin), the piece
    // dist::shard_ranges gives this replica of `data`'s.
    TpRangeOptimizer(const dist::TpLayout& l, OptimizerState& local, dist::TpGroup& group,
                     int first_unit, int last_unit, dist::Communicator* data = nullptr,
                     dist::ShardRange piece = {});
    std::size_t offset() const override { return begin_; }
    std::size_t count() const override { return end_ - begin_; }
    int64_t steps_taken() const override { return local_->steps_taken(); }
    void set_steps_taken(int64_t t) override { local_->set_steps_taken(t); }
    std::vector<std::string> state_names() override { return local_->state_names(); }
    const float* host_state(const std::string&) override { return nullptr; }
    bool collective_read() const override { return true; }
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;
    void finish_writes() override { local_->finish_writes(); }

  private:
    const dist::TpLayout* l_;
    OptimizerState* local_;
    dist::TpGroup* group_;
    dist::Communicator* data_;  // ZeRO-1: the replicas holding the other pieces; null without
    dist::ShardRange piece_;    // ZeRO-1: this replica's piece of [local_begin_, local_end_)
    std::size_t first_tensor_, last_tensor_;  // the range's tensors [first, last)
    std::size_t begin_, end_;                 // the range in l.full
    std::size_t local_begin_, local_end_;     // and in l.local
};

}  // namespace memtrain
