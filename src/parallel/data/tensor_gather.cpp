// ShardTensorGather: whole tensors from ZeRO shards' pieces (see tensor_gather.h).
#include "parallel/data/tensor_gather.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::dist {

std::vector<TensorCut> cut_tensors(const ParamLayout& layout, const std::vector<ShardRange>& shards,
                                   const std::vector<char>& whole) {
    std::vector<TensorCut> out;
    for (std::size_t i = 0; i < whole.size() && i < layout.tensors.size(); i++) {
        if (!whole[i]) continue;
        const ParamSpec& t = layout.tensors[i];
        UnitPieces p = unit_pieces(shards, (int64_t)t.offset, (int64_t)(t.offset + t.numel));
        if (std::count_if(p.counts.begin(), p.counts.end(), [](int64_t c) { return c > 0; }) < 2)
            continue;
        out.push_back({i, std::move(p.offsets), std::move(p.counts)});
    }
    return out;
}

ShardTensorGather::ShardTensorGather(const ParamLayout& layout, Communicator& world,
                                     const std::vector<ShardRange>& shards,
                                     const std::vector<char>& whole) {
    const int r = world.rank();
    for (const TensorCut& c : dist::cut_tensors(layout, shards, whole)) {
        std::vector<int64_t> counts;
        for (int64_t k : c.counts)
            if (k > 0) counts.push_back(k);
        // Every rank splits (a collective); the holders form one group, the others one each.
        cut_++;
        const bool holds = c.holds(r);
        std::unique_ptr<Communicator> group = world.split(
            holds ? 0 : 1 + r, r, fmt::format("holders of {}", layout.tensors[c.tensor].name));
        if (holds) mine_[c.tensor] = Cut{std::move(group), std::move(counts)};
    }
}

void ShardTensorGather::gather(std::size_t tensor, const float* piece, float* whole) {
    const auto it = mine_.find(tensor);
    if (it == mine_.end()) fail("internal: gathering tensor {}, which no shard cuts here", tensor);
    it->second.group->all_gather(piece, whole, it->second.counts);
}

ReplicaMatrixShare::ReplicaMatrixShare(const ParamLayout& layout, const std::vector<char>& whole,
                                       Communicator& world)
    : layout_(layout), world_(world), owner_(layout.tensors.size(), -1), load_(world.size(), 0.0) {
    std::vector<std::size_t> order;
    std::vector<double> cost(layout.tensors.size(), 0.0);
    for (std::size_t i = 0; i < whole.size() && i < layout.tensors.size(); i++) {
        const ParamSpec& t = layout.tensors[i];
        if (!whole[i] || t.global_shape().size() != 2) continue;
        const double a = (double)t.global_shape()[0], b = (double)t.global_shape()[1];
        const double r = std::min(a, b), c = std::max(a, b);
        cost[i] = r * r * c + r * r * r;
        order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t x, std::size_t y) { return cost[x] > cost[y]; });
    for (std::size_t i : order) {
        const int k = (int)(std::min_element(load_.begin(), load_.end()) - load_.begin());
        owner_[i] = k;
        load_[(std::size_t)k] += cost[i];
    }
}

void ReplicaMatrixShare::gather(std::size_t tensor, const float*, float*) {
    fail("internal: {} is whole on every replica, nothing to gather",
         layout_.tensors.at(tensor).name);
}

void ReplicaMatrixShare::share(std::size_t tensor, float* x, int owner) {
    if (owner < 0 || owner != owner_.at(tensor))
        fail("internal: {} shared from rank {}, its owner is {}", layout_.tensors[tensor].name,
             owner, owner_[tensor]);
    world_.broadcast(x, (int64_t)(layout_.tensors[tensor].global_numel() * sizeof(float)), owner);
}

}  // namespace memtrain::dist
