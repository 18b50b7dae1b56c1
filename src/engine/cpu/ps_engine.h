// PsEngine: data parallelism through a parameter server (train.dp_mode = "ps"), the baseline the
// seed lecture sets beside ring all-reduce. Of N ranks the last S = train.ps_servers are servers
// and the first W = N - S are workers (so rank 0, which prints and writes, is a worker):
//
//   worker w: a whole replica of the parameters and its gradients, no optimizer state; takes rows
//             [w B, (w + 1) B) of every global micro-batch, as a DDP rank does.
//   server s: a contiguous run of units (parallel/ps/param_server.h), their gradient sum and their
//             optimizer state; takes no data.
//
// One step: each worker accumulates its micro-batches' gradients, then pushes to each server that
// server's range (Ψ floats in all). Each server receives the pushes in worker order and adds them
// to a zeroed sum, worker 0 first; the global norm is each unit's sum of squares where it lives,
// added in unit order on every rank (as one process and a pipeline add it); each server clips and
// updates its range and publishes the new version, which every worker pulls (Ψ floats).
//
// Bits: a worker with one micro-batch per step pushes exactly that micro-batch's gradient, so a
// server's sum ((0 + g_0) + g_1) + ... is the sum one process makes accumulating the same micro-
// batches in worker order: losses, gradients and parameters are bitwise those of one process
// with W micro-batches per step (tests/mpi/ps_test.cpp). With K > 1 micro-batches per
// worker the server adds per-worker sums, so the result matches to rounding.
//
// Staleness (train.ps_staleness = k > 0): a worker computes step t on version max(0, t - k) of
// the parameters (version v: after v updates) instead of t, so the servers' update and the pull
// travel while the workers compute the next k steps (stale-synchronous parallel, Ho et al. 2013).
// The version read is always the oldest the bound allows, not "whatever has arrived", so a run is
// reproducible and a test can check the versions; the servers keep k + 1 published versions in
// flight. The per-step loss and norm every rank reports keep workers within a step of each other.
// Evaluation and the final sample run on a worker's replica (k versions behind); checkpoints hold
// the servers' parameters, which have every update. A resumed run starts with every worker on the
// checkpoint's version.
//
// Bytes per step (fp32): each worker sends Ψ and receives Ψ; server s receives and sends W Ψ_s;
// all links together carry 2 W Ψ x 4 bytes, where a ring all-reduce over the W workers carries
// 2 Ψ (W - 1) x 4 (each rank 2 Ψ (W - 1) / W). The servers' links carry W times a ring rank's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/run_plan.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/ps/param_server.h"

namespace memtrain {

// What moved and how long ranks waited for it, over every step of this run.
struct PsStats {
    int64_t steps = 0;
    // Per rank (gathered every step): bytes sent and received, seconds blocked on pushes and
    // pulls (a worker waiting for the servers, a server waiting for the workers' pushes).
    std::vector<int64_t> sent, received;
    std::vector<double> wait_s;
};

class PsEngine final : public Engine {
  public:
    PsEngine(const RunPlan& plan, dist::Communicator& comm);
    // Workers pull the versions still on their way (staleness > 0), servers complete their sends.
    ~PsEngine() override;

    std::string describe() const override;
    ModelWeights weights() override { return ModelWeights{*weights_, layout_, plan_.cfg.model}; }
    OptimizerState& optimizer() override { return *opt_; }
    ActFormat arena_format() const override { return cpu_arena_format(plan_.cfg.model); }
    void set_remat(const RematPlan& plan) override;
    const RematPlan& remat_plan() const override { return remat_; }
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override;
    // The mean of the workers' losses on their rows, on every rank.
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override;
    // Workers only (rank 0 samples).
    void forward_logits(const int32_t* inputs, int B, int T, float* out) override;
    MemoryTracker& memory() override { return host_memory(); }
    std::string memory_title() const override;
    std::vector<MemoryPrediction> predicted_memory(int B, int T) const override;
    std::string memory_footer() const override;

    bool is_server() const { return rank_ >= workers_; }
    int workers() const { return workers_; }
    int servers() const { return split_.servers(); }
    const dist::ServerSplit& split() const { return split_; }
    // Workers: the replica (null on servers). Servers: their units' parameters and gradients.
    GPT* model() { return model_.get(); }
    pp::StageStore* server_store() { return store_.get(); }
    // Workers: the parameter version each step of this run computed on (step t: max(0, t - k)).
    const std::vector<int64_t>& versions_used() const { return versions_used_; }
    const PsStats& stats() const { return stats_; }

  private:
    class Replica;  // the dist::UnitSource of this rank
    int server_rank(int s) const { return workers_ + s; }
    // The global gradient norm (a collective): per-unit sums of squares, added in unit order.
    double grad_norm();
    // Server: sends version steps_ + 1 of its range to every worker.
    void publish();
    // Worker: receives versions until it holds `version`.
    void pull_until(int64_t version);
    // The mean over workers of one value per rank, and every rank's traffic (a collective).
    double exchange(double mine);

    RunPlan plan_;
    dist::Communicator& comm_;
    int rank_ = 0, workers_ = 1, staleness_ = 0;
    ParamLayout layout_;
    dist::ServerSplit split_;
    std::unique_ptr<GPT> model_;             // workers
    std::unique_ptr<pp::StageStore> store_;  // servers
    std::unique_ptr<Replica> replica_;
    std::unique_ptr<dist::OwnerWeights> weights_;
    std::unique_ptr<Optimizer> opt_;  // servers: their range; workers: empty (counts steps)
    RematPlan remat_;

    int64_t steps_ = 0;  // optimizer steps of this run: the servers' newest version
    int64_t have_ = 0;   // worker: the version its replica holds
    std::vector<int64_t> versions_used_;
    std::vector<uint64_t> pushes_;  // worker: sends of this step's gradients, one per server
    Buffer<float> incoming_;        // server: one worker's push
    // Server: published versions still travelling (staleness k: k + 1 copies; 0: the parameters
    // themselves), and their sends, one per worker.
    std::vector<Buffer<float>> versions_;
    std::vector<std::vector<uint64_t>> version_sends_;
    double loss_sum_ = 0;
    int micro_batches_ = 0;
    int64_t sent_ = 0, received_ = 0;
    double wait_s_ = 0;
    PsStats stats_;
};

}  // namespace memtrain
