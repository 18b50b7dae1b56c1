// The parameter server's unit split and weights view (param_server.h).
#include "parallel/ps/param_server.h"

#include <cmath>

#include "core/error.h"

namespace memtrain::dist {

int ServerSplit::server_of(int u) const {
    for (int s = 0; s < servers(); s++)
        if (u >= first_unit[s] && u <= last_unit[s]) return s;
    fail("internal: unit {} is on no parameter server", u);
}

ServerSplit split_servers(const ParamLayout& layout, int servers) {
    const int U = (int)layout.units.size();
    if (servers < 1 || servers > U)
        fail("internal: {} parameter servers for a model of {} units", servers, U);
    ServerSplit sp;
    int first = 0;
    for (int s = 0; s < servers; s++) {
        int last = U - 1;
        if (s + 1 < servers) {
            // The unit after which the running size is nearest (s + 1) Ψ / servers, keeping at
            // least one unit for this server and for each later one.
            const double target = (double)layout.total * (s + 1) / servers;
            last = first;
            for (int u = first + 1; u <= U - (servers - s); u++) {
                const double here = (double)layout.units[u].end;
                if (std::abs(here - target) < std::abs((double)layout.units[last].end - target))
                    last = u;
            }
        }
        sp.first_unit.push_back(first);
        sp.last_unit.push_back(last);
        sp.begin.push_back(layout.units[first].begin);
        sp.end.push_back(layout.units[last].end);
        first = last + 1;
    }
    return sp;
}

OwnerWeights::OwnerWeights(const ParamLayout& layout, UnitSource& source,
                           std::vector<int> owner_rank, Communicator& comm)
    : layout_(&layout), source_(&source), owner_(std::move(owner_rank)), comm_(&comm) {
    if (owner_.size() != layout.units.size())
        fail("internal: {} unit owners for {} units", owner_.size(), layout.units.size());
}

float* OwnerWeights::acquire(int u, bool for_write) {
    Held& h = held_[u];
    if (h.count++ > 0) {
        h.written = h.written || for_write;
        return h.data;
    }
    const std::size_t n = layout_->units.at(u).size();
    const bool mine = comm_->rank() == owner_.at(u);
    h.data = source_->unit(u);
    if (!h.data || (!for_write && !mine && source_->read_into_scratch())) {
        h.scratch = Buffer<float>(n, MemCategory::Communication);
        h.data = h.scratch.data();
    }
    h.written = for_write;
    // The server's values, also under a write: a writer may leave some floats as they were.
    comm_->broadcast(h.data, (int64_t)(n * sizeof(float)), owner_[u]);
    return h.data;
}

void OwnerWeights::release(int u) {
    auto it = held_.find(u);
    if (it == held_.end() || it->second.count == 0)
        fail("internal: unit {} released more often than acquired", u);
    Held& h = it->second;
    if (--h.count > 0) return;
    // Every rank wrote (the same calls everywhere); the server's result is the one that counts.
    if (h.written)
        comm_->broadcast(h.data, (int64_t)(layout_->units[u].size() * sizeof(float)), owner_[u]);
    held_.erase(it);
}

}  // namespace memtrain::dist
