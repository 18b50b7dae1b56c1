// The plan step: the checked config and the job's communicator in, the RunPlan out
// (engine/run_plan.h), with this rank's memory checked against the host or the device before
// anything is allocated.
#pragma once

#include "comm/communicator.h"
#include "config/run_config.h"
#include "engine/run_plan.h"
#include "remat/cost.h"

namespace memtrain {

// The plan's layout decisions for this rank of `comm` (`measured`: profiled block costs, or null
// for the analytic ones): every field but the memory rows, nothing checked against the machine.
RunPlan plan_layout(const RunConfig& cfg, const dist::Communicator& comm,
                    const remat::BlockFlops* measured = nullptr);

// The same from a rank and a world size, no communicator (`collective`: a GPU job's data-parallel
// ranks reach each other over NCCL).
RunPlan plan_layout(const RunConfig& cfg, int rank, int world, bool collective,
                    const remat::BlockFlops* measured = nullptr);

// Rank `rank` of a CPU job of cfg.world ranks with its predicted memory rows, without launching
// the job or checking this machine: `memtrain estimate --device cpu` prices every rank this way.
RunPlan plan_host_rank(const RunConfig& cfg, int rank);

// train.micro_batch_size = "auto" (the CPU engines): the largest micro-batch dividing each
// rank's share of the global batch whose run, every rank's predicted rows (plan_host_rank) times
// the ranks on this node, fits rank 0's available host memory; the same on every rank. Sets it
// in `cfg` and returns the line that says what was chosen and why ("" when cfg is not auto);
// fails naming the smallest micro-batch's need when none fits.
std::string resolve_micro_batch(RunConfig& cfg, dist::Communicator& comm);

// Every rank's predicted host bytes of a CPU run (plan_host_rank): the most loaded rank's and
// the sum over the cfg.world ranks.
struct HostNeed {
    std::size_t most = 0, sum = 0;
};
HostNeed host_need(const RunConfig& cfg);

// The plan of `cfg` on `comm`, with its memory checked: fails before anything is allocated,
// naming what would fit, when this rank's predicted bytes exceed the host's or the device's free
// memory. Under train.remat_costs = "measured" rank 0 profiles one block first and every rank
// solves with its numbers (a collective over `comm`).
RunPlan plan_run(const RunConfig& cfg, dist::Communicator& comm);

}  // namespace memtrain
