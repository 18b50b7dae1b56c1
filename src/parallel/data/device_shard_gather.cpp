// DeviceShardGather: whole Muon matrices from GPU ZeRO shards (see device_shard_gather.h).
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
    for (std::size_t i = 0; i < whole.size() && i < layout.tensors.size(); i++) {
        if (!whole[i]) continue;
        const ParamSpec& t = layout.tensors[i];
        UnitPieces p = unit_pieces(shards, (int64_t)t.offset, (int64_t)(t.offset + t.numel));
        const auto holders =
            std::count_if(p.counts.begin(), p.counts.end(), [](int64_t c) { return c > 0; });
        if (holders < 2) continue;
        const bool mine = p.counts.at((std::size_t)comm.rank()) > 0;
        cuts_.push_back({i, std::move(p.offsets), std::move(p.counts), mine});
        starts_.push_back(t.offset);
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

void DeviceShardGather::gather(const Cut& c, float* whole, cudaStream_t stream) {
    const std::size_t r = (std::size_t)comm_.rank();
    comm_.broadcast_pieces(whole + c.offsets.at(r), whole, c.offsets, c.counts, DeviceType::F32,
                           stream);
}

}  // namespace memtrain::dist

#endif  // MEMTRAIN_HAVE_CUDA
