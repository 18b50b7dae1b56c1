// Whole tensors from GPU ZeRO shards (Muon and Adafactor under train.zero_stage 1-3 on
// train.device = "cuda"): NCCL's equal shards cut at most world - 1 of the tensors the optimizer
// steps whole. For each, one grouped broadcast of the pieces from their holders
// (DeviceCommunicator::broadcast_pieces, a collective of every rank) completes it on every rank:
// Muon's Nesterov direction of a matrix, Adafactor's gradient and weights of a tensor; each
// holder then steps the same whole tensor (the same bits on each) and keeps its piece. The ranks
// that hold none of it take part and discard what they receive: the cost per step is the cut
// tensors' elements received by every rank, at most world - 1 tensors.
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
#include "parallel/data/tensor_gather.h"

namespace memtrain::dist {

class DeviceShardGather {
  public:
    // A tensor the shards cut (tensor_gather.h), and whether this rank holds a piece of it.
    struct Cut : TensorCut {
        bool mine = false;
    };
    // `shards`: every rank's range of the flat buffer (DeviceDataParallel's); `whole`: per
    // tensor of the layout, whether the optimizer steps it whole (muon_matrices, or every
    // tensor for Adafactor).
    DeviceShardGather(const ParamLayout& layout, const std::vector<ShardRange>& shards,
                      const std::vector<char>& whole, DeviceCommunicator& comm);
    // The cut tensors in layout order (the order every rank gathers them in).
    const std::vector<Cut>& cuts() const { return cuts_; }
    // The cut tensors whose floats start in [begin, end) of the flat buffer.
    std::vector<const Cut*> cuts_in(std::size_t begin, std::size_t end) const;
    // The cut of `tensor` (fails if the shards do not cut it).
    const Cut& cut_of(std::size_t tensor) const;
    // `whole` (the tensor's elements of type t) on every rank from the holders' pieces, this
    // rank's read from `mine` (which may be its place in `whole`); queued on `stream`. A
    // collective of every rank, in cuts() order (a tensor may be gathered more than once, each
    // time by every rank).
    void gather(const Cut& c, const void* mine, void* whole, DeviceType t, cudaStream_t stream);
    // The same for fp32 values whose piece is at its place in `whole` already.
    void gather(const Cut& c, float* whole, cudaStream_t stream) {
        gather(c, whole + c.offsets.at((std::size_t)comm_.rank()), whole, DeviceType::F32, stream);
    }
    int rank() const { return comm_.rank(); }
    // The largest cut tensor's elements (0: none): the scratch every rank receives into.
    std::size_t largest() const { return largest_; }

  private:
    std::vector<Cut> cuts_;
    std::vector<std::size_t> starts_;  // each cut tensor's first float in the flat buffer
    std::size_t largest_ = 0;
    DeviceCommunicator& comm_;
};

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
