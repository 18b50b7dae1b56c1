// ShardTensorGather: whole tensors from ZeRO shards' pieces (see tensor_gather.h).
#include "parallel/data/tensor_gather.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::dist {

ShardTensorGather::ShardTensorGather(const ParamLayout& layout, Communicator& world,
                                     const std::vector<ShardRange>& shards,
                                     const std::vector<char>& whole) {
    const int r = world.rank();
    for (std::size_t i = 0; i < whole.size(); i++) {
        if (!whole[i]) continue;
        const ParamSpec& t = layout.tensors.at(i);
        const UnitPieces p = unit_pieces(shards, (int64_t)t.offset, (int64_t)(t.offset + t.numel));
        std::vector<int64_t> counts;
        for (int64_t c : p.counts)
            if (c > 0) counts.push_back(c);
        if (counts.size() < 2) continue;
        // Every rank splits (a collective); the holders form one group, the others one each.
        cut_++;
        const bool holds = p.counts[(std::size_t)r] > 0;
        std::unique_ptr<Communicator> group =
            world.split(holds ? 0 : 1 + r, r, fmt::format("holders of {}", t.name));
        if (holds) mine_[i] = Cut{std::move(group), std::move(counts)};
    }
}

void ShardTensorGather::gather(std::size_t tensor, const float* piece, float* whole) {
    const auto it = mine_.find(tensor);
    if (it == mine_.end()) fail("internal: gathering tensor {}, which no shard cuts here", tensor);
    it->second.group->all_gather(piece, whole, it->second.counts);
}

}  // namespace memtrain::dist
