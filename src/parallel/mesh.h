// The ranks of a run laid out as a grid of parallel dimensions, and the groups each rank talks
// to along them, in Megatron's order: job rank = (d x pp + s) x tp + t for data-parallel replica
// (pipeline) d, stage s and tensor-parallel rank t, as RunConfig::dp() says. A stage's tp ranks
// are consecutive (their all-reduces run every block), then a pipeline's stages, then the
// pipelines side by side. A rank's tensor-parallel group is the tp ranks holding the shards of
// its stage (parallel/tensor/tp.h); its stage group the pp ranks of its pipeline with its t
// (activations and gradients pass along it); its data group the dp ranks with its stage and t in
// every pipeline (gradients are all-reduced, or reduce-scattered under ZeRO-1, across it).
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace memtrain::dist {

struct MeshLayout {
    int pp = 1;  // stages per pipeline
    int dp = 1;  // pipelines
    int tp = 1;  // tensor-parallel shards per stage

    int size() const { return pp * dp * tp; }
    int rank(int d, int s, int t = 0) const { return (d * pp + s) * tp + t; }
    int stage_of(int rank) const { return rank / tp % pp; }
    int replica_of(int rank) const { return rank / (tp * pp); }
    int shard_of(int rank) const { return rank % tp; }
    // The job ranks of pipeline d with shard t, in stage order.
    std::vector<int> stage_group(int d, int t = 0) const;
    // The job ranks holding shard t of stage s, in pipeline order.
    std::vector<int> data_group(int s, int t = 0) const;
    // The job ranks holding stage s of pipeline d, in shard order.
    std::vector<int> tp_group(int d, int s) const;
};

// This rank's two groups, split from the job's communicator. Both are collectives over every
// rank of the job; the groups name themselves ("pipeline d", "data group of stage s") in the
// lines a timeout prints.
struct MeshGroups {
    std::unique_ptr<Communicator> stages;  // the pipeline: its rank is the stage
    std::unique_ptr<Communicator> data;    // the stage's replicas: its rank is the pipeline
    std::unique_ptr<Communicator> tp;      // the stage's shards: its rank is the shard
};
MeshGroups split_mesh(Communicator& world, const MeshLayout& mesh);

}  // namespace memtrain::dist
