// Whole matrices from GPU ZeRO shards (Muon under train.zero_stage 1-3 on train.device = "cuda"):
// NCCL's equal shards cut at most world - 1 of the block matrices Muon orthogonalizes whole. For
// each such matrix every holder writes the Nesterov direction of its piece at the piece's place in
// a scratch matrix, then one grouped broadcast of the pieces from their holders
// (DeviceCommunicator::broadcast_pieces, a collective of every rank) completes the matrix on
// every rank; each holder runs the same Newton-Schulz on it (the same bits on each) and updates
// its piece. The ranks that hold none of it take part and discard what they receive: the cost
// per step is the cut matrices' floats received by every rank, at most world - 1 matrices.
//
// The same rule as the CPU's dist::ShardTensorGather (parallel/data/tensor_gather.h), whose
// pieces travel in a group of the holders only.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "model/param_layout.h"

namespace memtrain::dist {

class DeviceShardGather {
  public:
    // A matrix the shards cut: its index in the layout, every rank's piece (offsets into the
    // matrix, counts; 0 where a rank holds none of it), and whether this rank holds a piece.
    struct Cut {
        std::size_t tensor = 0;
        std::vector<int64_t> offsets, counts;
        bool mine = false;
    };
    // `shards`: every rank's range of the flat buffer (DeviceDataParallel's); `whole`: per
    // tensor of the layout, whether the optimizer steps it whole (muon_matrices).
    DeviceShardGather(const ParamLayout& layout, const std::vector<ShardRange>& shards,
                      const std::vector<char>& whole, DeviceCommunicator& comm);
    // The cut matrices in layout order (the order every rank gathers them in).
    const std::vector<Cut>& cuts() const { return cuts_; }
    // The cut matrices whose floats start in [begin, end) of the flat buffer.
    std::vector<const Cut*> cuts_in(std::size_t begin, std::size_t end) const;
    // The cut of `tensor` (fails if the shards do not cut it).
    const Cut& cut_of(std::size_t tensor) const;
    // `whole` (the matrix's floats, fp32): this rank's piece is at its place already; on return
    // (queued on `stream`) every rank's is. A collective of every rank, in cuts() order.
    void gather(const Cut& c, float* whole, cudaStream_t stream);

  private:
    std::vector<Cut> cuts_;
    std::vector<std::size_t> starts_;  // each cut matrix's first float in the flat buffer
    DeviceCommunicator& comm_;
};

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
