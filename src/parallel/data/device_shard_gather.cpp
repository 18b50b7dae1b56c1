// DeviceShardGather: whole tensors (Muon's matrices, Adafactor's tensors) from GPU ZeRO shards (see
// device_shard_gather.h).
#include "parallel/data/device_shard_gather.h"

#if MEMTRAIN_HAVE_CUDA

#include <algorithm>

#include "core/error.h"

namespace memtrain::dist {

DeviceShardGather::DeviceShardGather(const ParamLayout& layout,
                                     const std::vector<ShardRange>& shards,
                                     const std::vector<char>& whole, DeviceCommunicator& comm)
    : comm_(comm) {
    if ((int)shards.size() != comm.size())
        fail("internal: {} shard ranges for {} ranks", shards.size(), comm.size());
    for (TensorCut& c : cut_tensors(layout, shards, whole)) {
        const ParamSpec& t = layout.tensors[c.tensor];
        Cut k;
        static_cast<TensorCut&>(k) = std::move(c);
        k.mine = k.holds(comm.rank());
        cuts_.push_back(std::move(k));
        starts_.push_back(t.offset);
        largest_ = std::max(largest_, t.numel);
    }
}

std::vector<const DeviceShardGather::Cut*> DeviceShardGather::cuts_in(std::size_t begin,
                                                                      std::size_t end) const {
    std::vector<const Cut*> out;
    for (std::size_t k = 0; k < cuts_.size(); k++)
        if (starts_[k] >= begin && starts_[k] < end) out.push_back(&cuts_[k]);
    return out;
}

const DeviceShardGather::Cut& DeviceShardGather::cut_of(std::size_t tensor) const {
    for (const Cut& c : cuts_)
        if (c.tensor == tensor) return c;
    fail("internal: tensor {} is not cut by the ZeRO shards", tensor);
}

void DeviceShardGather::gather(const Cut& c, const void* mine, void* whole, DeviceType t,
                               cudaStream_t stream) {
    comm_.broadcast_pieces(mine, whole, c.offsets, c.counts, t, stream);
}

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
