// The pipeline x data mesh (mesh.h).
#include "dist/mesh.h"

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::dist {

std::vector<int> MeshLayout::stage_group(int d) const {
    std::vector<int> ranks;
    for (int s = 0; s < pp; s++) ranks.push_back(rank(d, s));
    return ranks;
}

std::vector<int> MeshLayout::data_group(int s) const {
    std::vector<int> ranks;
    for (int d = 0; d < dp; d++) ranks.push_back(rank(d, s));
    return ranks;
}

MeshGroups split_mesh(Communicator& world, const MeshLayout& mesh) {
    if (mesh.pp < 1 || mesh.dp < 1 || world.size() != mesh.size())
        fail("internal: a mesh of {} stages x {} pipelines on {} ranks", mesh.pp, mesh.dp,
             world.size());
    const int r = world.rank(), d = mesh.replica_of(r), s = mesh.stage_of(r);
    MeshGroups g;
    g.stages = world.split(d, s, fmt::format("pipeline {}", d));
    g.data = world.split(s, d, fmt::format("data group of stage {}", s));
    if (g.stages->rank() != s || g.data->rank() != d)
        fail("internal: rank {} is stage {} of pipeline {}, its groups say {} and {}", r, s, d,
             g.stages->rank(), g.data->rank());
    return g;
}

}  // namespace memtrain::dist
