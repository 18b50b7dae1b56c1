// Data parallelism across replicas that each hold the same range of the model (pipelines side by
// side, each stage's replicas; tensor-parallel shards side by side): after the step's backwards,
// the range's gradients are summed across the replicas' data group, and where the placement
// table (parallel/placement.h) shards the optimizer state (ZeRO-1) each replica updates only its
// piece of the range, whose parameters then travel to every replica.
//
//   optimizer state  gradients                           after the update
//   Replicated       all-reduced, whole on every replica  nothing (every replica updated all)
//   Sharded          reduce-scattered into the piece      all-gather of the updated pieces
//
// The pieces are dist::grain_shard_ranges of the range, as a ZeroStore's shards of a whole model
// are.
// Gradients and parameters stay whole on every replica (ZeRO-2 and 3 across pipelines are not
// built). The reduce-scattered piece lives in a buffer of its own (Gradients).
#pragma once

#include <cstddef>
#include <string>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "parallel/placement.h"

namespace memtrain::dist {

class ReplicaSync {
  public:
    // `data`: the replicas of the range (its rank: this replica), or null for one replica;
    // `spec`: where the model states live; `count`: floats of the range, which starts at float
    // `begin` of the flat buffer; pieces are cut on multiples of `grain` of the flat buffer
    // (grain_shard_ranges).
    ReplicaSync(Communicator* data, const ShardSpec& spec, std::size_t count, std::size_t begin = 0,
                int64_t grain = 1);

    int replicas() const { return data_ ? data_->size() : 1; }
    int replica() const { return data_ ? data_->rank() : 0; }
    // Whether each replica updates only its piece (the optimizer state sharded over several).
    bool sharded() const { return sharded_; }
    // The floats of the range this replica's optimizer updates, counted from the range's begin:
    // all of it, or its piece.
    ShardRange owned() const { return owned_; }
    // Floats of the buffer the reduce-scatter fills (0 unless sharded).
    std::size_t buffer_floats() const { return sharded_ ? (std::size_t)owned_.count : 0; }

    // Sums `grads` (the whole range) across the replicas; returns the gradients of owned():
    // `grads` itself, all-reduced in place, or the reduce-scattered piece.
    float* reduce(float* grads);
    // After the update of owned() inside `params` (the whole range): every replica's piece to
    // every replica (a no-op unless sharded).
    void gather(float* params);
    // The mean of one value per replica, added in replica order (the same bits everywhere).
    double mean(double x);
    // "all-reduced" or "reduce-scattered", for the report.
    const char* reduction() const { return sharded_ ? "reduce-scattered" : "all-reduced"; }

  private:
    Communicator* data_;
    std::size_t count_;
    bool sharded_ = false;
    ShardRange owned_;
    std::vector<int64_t> counts_;  // every replica's piece
    Buffer<float> piece_;
};

}  // namespace memtrain::dist
