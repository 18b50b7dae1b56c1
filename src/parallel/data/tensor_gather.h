// The TensorGather of a sharded optimizer (optim/optimizer.h): Muon under ZeRO 1-3, where a
// shard boundary can fall inside a matrix it orthogonalizes whole. At most world - 1 matrices
// are cut (one per boundary at most); each gets a group of the ranks that hold part of it, and
// gather() is an all-gather in that group, the pieces in rank order, which is the tensor's own
// order because shards are contiguous and increasing.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/param_layout.h"
#include "optim/optimizer.h"

namespace memtrain::dist {

// A tensor the shards cut (the optimizer steps it whole): its index in the layout and every
// rank's piece of it (offsets into the tensor, counts; 0 where a rank holds none of it).
struct TensorCut {
    std::size_t tensor = 0;
    std::vector<int64_t> offsets, counts;
    bool holds(int rank) const { return counts.at((std::size_t)rank) > 0; }
};
// The tensors among `whole` (per tensor of the layout) that two or more of `shards` hold part
// of, in layout order.
std::vector<TensorCut> cut_tensors(const ParamLayout& layout, const std::vector<ShardRange>& shards,
                                   const std::vector<char>& whole);

class ShardTensorGather final : public TensorGather {
  public:
    // `shards`: every rank's range of the flat buffer (the optimizer's); `whole`: per tensor of
    // the layout, whether the optimizer steps it whole (whole_step_tensors). A collective of
    // `world` (one split per cut tensor).
    ShardTensorGather(const ParamLayout& layout, Communicator& world,
                      const std::vector<ShardRange>& shards, const std::vector<char>& whole);
    void gather(std::size_t tensor, const float* piece, float* whole) override;
    // How many tensors the shards cut (each costs one all-gather of the tensor per step).
    std::size_t cut_tensors() const { return cut_; }

  private:
    struct Cut {
        std::unique_ptr<Communicator> group;  // the holders, in rank order
        std::vector<int64_t> counts;          // each holder's piece
    };
    std::map<std::size_t, Cut> mine_;  // the cut tensors this rank holds part of
    std::size_t cut_ = 0;
};

// Muon under DDP (ZeRO stage 0): every replica steps the whole model from the same reduced
// gradients, so each would orthogonalize every block matrix. Instead each matrix has one owner,
// which runs its Newton-Schulz and broadcasts the result: the step's orthogonalizations are split
// over the ranks rather than repeated on each. Owners are assigned greedily by cost (the matrix's
// Newton-Schulz flops, r^2 c + r^3 for r = min(rows, cols)), largest first, each to the least
// loaded rank (the lowest on a tie), the same on every rank. Every rank's weights stay bitwise
// what one process computes: the owner runs the same code on the same input.
class ReplicaMatrixShare final : public TensorGather {
  public:
    // `whole`: per tensor of the layout, whether the optimizer orthogonalizes it (muon_matrices).
    ReplicaMatrixShare(const ParamLayout& layout, const std::vector<char>& whole,
                       Communicator& world);
    void gather(std::size_t tensor, const float*, float*) override;
    int owner(std::size_t tensor) const override { return owner_.at(tensor); }
    bool is_me(int rank) const override { return rank == world_.rank(); }
    // A broadcast of the tensor's numel floats from its owner (a collective of the world).
    void share(std::size_t tensor, float* x, int owner) override;
    // The Newton-Schulz flops each rank runs per step under this assignment.
    const std::vector<double>& load() const { return load_; }

  private:
    ParamLayout layout_;
    Communicator& world_;
    std::vector<int> owner_;  // per tensor of the layout, -1 where not shared
    std::vector<double> load_;
};

}  // namespace memtrain::dist
