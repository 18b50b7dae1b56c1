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

}  // namespace memtrain::dist
