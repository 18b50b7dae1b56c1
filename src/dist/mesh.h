// The ranks of a run laid out as a grid of parallel dimensions, and the groups each rank talks
// to along them. Pipelines are train.pp consecutive ranks and there are dp of them side by side:
// job rank = d x pp + s for pipeline (data-parallel replica) d and stage s, as RunConfig::dp()
// says. A rank's stage group is the pp ranks of its pipeline (activations and gradients pass
// along it); its data group is the dp ranks that hold the same stage in every pipeline
// (gradients are all-reduced, or reduce-scattered under ZeRO-1, across it). Tensor parallelism
// will add a dimension inside the stage (rank = (d x pp + s) x tp + t, Megatron's order).
#pragma once

#include <memory>
#include <vector>

#include "dist/communicator.h"

namespace memtrain::dist {

struct MeshLayout {
    int pp = 1;  // stages per pipeline
    int dp = 1;  // pipelines

    int size() const { return pp * dp; }
    int rank(int d, int s) const { return d * pp + s; }
    int stage_of(int rank) const { return rank % pp; }
    int replica_of(int rank) const { return rank / pp; }
    // The job ranks of pipeline d, in stage order.
    std::vector<int> stage_group(int d) const;
    // The job ranks holding stage s, in pipeline order.
    std::vector<int> data_group(int s) const;
};

// This rank's two groups, split from the job's communicator. Both are collectives over every
// rank of the job; the groups name themselves ("pipeline d", "data group of stage s") in the
// lines a timeout prints.
struct MeshGroups {
    std::unique_ptr<Communicator> stages;  // the pipeline: its rank is the stage
    std::unique_ptr<Communicator> data;    // the stage's replicas: its rank is the pipeline
};
MeshGroups split_mesh(Communicator& world, const MeshLayout& mesh);

}  // namespace memtrain::dist
