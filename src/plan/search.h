// The strategy search: enumerate DP x TP x PP, ZeRO stage, offload, recompute policy and
// micro-batch size for a global batch; keep what fits, rank by predicted tokens/s, and explain
// in one line per strategy family why nothing in it fits.
#pragma once

#include <string>
#include <vector>

#include "plan/hardware.h"
#include "plan/memory_model.h"
#include "plan/model_spec.h"
#include "plan/run_spec.h"
#include "plan/time_model.h"

namespace memtrain::plan {

struct SearchSpec {
    int global_batch = 0;  // sequences per optimizer step; 0 = 1024
    int seq = 0;           // 0 = model.block_size
    Precision precision = Precision::mixed_bf16;
    Optimizer optimizer = Optimizer::adamw;
    bool flash_attention = true;
    bool allow_offload = true;
    int max_micro_batch = 64;
    double fragmentation = 0.05;
    int64_t reserve_bytes = 1'000'000'000;  // CUDA context + workspaces per GPU
};

struct Plan {
    RunSpec run;
    MemoryEstimate memory;
    TimeEstimate time;
};

struct Rejection {
    std::string family;      // e.g. "pure DP, ZeRO-0"
    std::string reason;      // one line with numbers
    int64_t best_bytes = 0;  // least memory any member needs (0 for structural reasons)
};

struct SearchResult {
    std::vector<Plan> plans;  // fitting plans, fastest first
    std::vector<Rejection> rejected;
    int evaluated = 0;
};

// Fails (memtrain::Error) on impossible input: zero GPUs, a GPU count the node size does not
// allow, a global batch below the GPU count. An empty `plans` means nothing fits; `rejected`
// then says why for every family.
SearchResult search_plans(const ModelSpec& model, const ClusterSpec& cluster,
                          const SearchSpec& spec);

// GPUs of one node whose offloaded states share its host memory: min(gpus, gpus_per_node).
int gpus_sharing_a_host(const ClusterSpec& cluster);
// Whether the host memory of a node holds the offloaded states of its GPUs (always, when the
// cluster's host_memory_bytes is 0: not given).
bool host_fits(const MemoryEstimate& est, const ClusterSpec& cluster);

// "tp=8 pp=4 dp=32 ZeRO-1 mb=1x48 selective" — the one-line name of a layout.
std::string describe(const RunSpec& run);

}  // namespace memtrain::plan
