// The pipeline x data mesh (mesh.h).
#include "parallel/mesh.h"

#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::dist {

std::vector<int> MeshLayout::stage_group(int d, int t) const {
    std::vector<int> ranks;
    for (int s = 0; s < pp; s++) ranks.push_back(rank(d, s, t));
    return ranks;
}

std::vector<int> MeshLayout::data_group(int s, int t) const {
    std::vector<int> ranks;
    for (int d = 0; d < dp; d++) ranks.push_back(rank(d, s, t));
    return ranks;
}

std::vector<int> MeshLayout::tp_group(int d, int s) const {
    std::vector<int> ranks;
    for (int t = 0; t < tp; t++) ranks.push_back(rank(d, s, t));
    return ranks;
}

MeshGroups split_mesh(Communicator& world, const MeshLayout& mesh) {
    if (mesh.pp < 1 || mesh.dp < 1 || mesh.tp < 1 || world.size() != mesh.size())
        fail("internal: a mesh of {} stages x {} pipelines x {} shards on {} ranks", mesh.pp,
             mesh.dp, mesh.tp, world.size());
    const int r = world.rank(), d = mesh.replica_of(r), s = mesh.stage_of(r), t = mesh.shard_of(r);
    // Names as the lines of a timeout print them; the shard only where there are several.
    const std::string shard = mesh.tp > 1 ? fmt::format(" (shard {})", t) : std::string();
    MeshGroups g;
    g.stages = world.split(d * mesh.tp + t, s, fmt::format("pipeline {}{}", d, shard));
    g.data = world.split(s * mesh.tp + t, d, fmt::format("data group of stage {}{}", s, shard));
    g.tp = world.split(d * mesh.pp + s, t,
                       fmt::format("tensor-parallel group of stage {} of pipeline {}", s, d));
    if (g.stages->rank() != s || g.data->rank() != d || g.tp->rank() != t)
        fail("internal: rank {} is stage {} of pipeline {} shard {}, its groups say {}, {}, {}", r,
             s, d, t, g.stages->rank(), g.data->rank(), g.tp->rank());
    return g;
}

}  // namespace memtrain::dist
