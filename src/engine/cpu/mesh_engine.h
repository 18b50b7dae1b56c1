// MeshEngine: the CPU model split into stages over the ranks of a pipeline (train.pp), run by
// one executor over a schedule's action lists (parallel/pipeline/schedule.h). Rank r holds stage r:
// a contiguous run of blocks (parallel/pipeline/stage_split.h), with the embedding on the first
// stage and ln_f, the classifier and the loss on the last; its parameters, gradients and optimizer
// state cover only its own units (parallel/pipeline/stage_store.h).
//
// One optimizer step: the Trainer hands over the step's micro-batches one by one; at the last the
// executor walks this rank's list. F(i): receive micro-batch i's input from the previous stage
// (the first stage embeds the tokens), run the stage's blocks into a free activation slot, send
// the output on. B(i): receive d(output) from the next stage (the last stage computes the loss),
// run the backward, send d(input) back. Sends are nonblocking, so a stage that passes an
// activation on while its neighbour sends a gradient back never waits on it; receives block.
// Every stage accumulates its micro-batches' gradients in micro-batch order, which is the order a
// single process accumulates them in, and each block runs the same kernels on the same inputs:
// losses and gradients are bitwise those of one process (tests/mpi/pipeline_test.cpp). The
// one exception is the tied embedding, whose gradient is the sum of the classifier's part
// (last stage) and the embedding's part (first stage), added once per step rather than micro-
// batch by micro-batch; Megatron-LM reduces it the same way.
//
// Interleaved (Megatron's virtual stages, train.pp_virtual = V): the model is split into P x V
// stages and rank r holds virtual stages r, r + P, ..., (V - 1) P + r, one chunk of blocks each,
// with its own activation slots (as many as the schedule keeps in flight on that chunk). An
// action names its virtual stage: the executor runs it on that chunk, receives from and sends to
// the rank of the neighbouring virtual stage (rank P - 1's chunk c passes on to rank 0's chunk
// c + 1), with message tags that name the chunk and the micro-batch. Each chunk still runs its
// micro-batches' backwards in micro-batch order, so the bits are those of one process too.
//
// After the last micro-batch: the tied embedding's gradient goes from the last stage to the
// first, the global gradient norm is the sum of per-unit sums of squares in unit order (as a
// single process sums it), every stage clips and updates its own range, and the first stage sends
// the updated embedding back to the last.
//
// Pipeline x data parallelism (world = pp x dp, parallel/mesh.h): dp pipelines side by side, each
// fed its rows of the global micro-batch by the Trainer. The schedule and the tied embedding's
// exchange run inside each pipeline; then each stage's gradients are summed across its data group
// (the dp ranks holding that stage): all-reduced (train.zero_stage = 0, every replica updates its
// whole stage), or reduce-scattered so each replica updates 1/dp of the stage's range with 1/dp
// of its optimizer state, the updated parameters all-gathered (ZeRO-1). The norm adds every
// unit's (and shard's) sum of squares in a fixed order, so every rank clips alike. With tensor
// parallelism (train.tp, one chunk per rank) the stage's range is this tp rank's shard of its
// units, and ZeRO-1 shards that range over the data group alike; the optimizer view
// (TpRangeOptimizer) gathers it over both groups for checkpoints.
//
// PipeDream (train.pp_schedule = "pipedream", weight stashing; Narayanan et al. SOSP'19): the
// 1F1B lists with p - 1 - s warm-up forwards, but every B(i) ends with an optimizer update of the
// stage's weights by micro-batch i's gradient alone, scaled as a step of one micro-batch would be
// (the mean over its tokens). Each micro-batch is thus its own optimizer step (AdamW's step count
// advances m per trainer step), every one with the trainer step's learning rate, so
// optim.lr is per update, as in the paper. F(i) runs on the newest weights and notes their
// version (updates applied to the stage so far, the optimizer's step count); when an update
// would overwrite a version an in-flight micro-batch used, the stage first copies it into a stash
// buffer; B(i) swaps its version into the parameters for the backward and back after it. Stage s
// keeps at most p - s versions (the weights and p - s - 1 stash buffers, allocated up front as
// part of Parameters). The lists are per trainer step, so the pipeline drains at the step's end:
// no stash is alive between steps, and a checkpoint (the weights, the optimizer state and its step
// count) resumes exactly. Each stage's gradient is the one of its own stashed version, but the
// stages of one micro-batch see different versions: pipedream_version(p, s, i) + m x steps.
// With pipelines side by side, each B(i)'s gradient is summed (or, ZeRO-1, reduce-scattered)
// across the stage's replicas before the update; they run the same list, so they meet there.
//
// PipeDream-2BW (train.pp_schedule = "pipedream-2bw"; Narayanan et al. ICML'21): gradients
// accumulate over the step's micro-batches as in 1F1B, but every forward and backward of step t
// runs on a shadow copy W(t - 1) of the weights, and the step's update goes to the newest ones:
// W(t + 1) = W(t) - lr grad f(W(t - 1)), W(-1) = W(0). Two versions per stage (the weights and
// the shadow, the tied embedding's mirror included). The shadow is not in checkpoints: a resumed
// run starts it from the loaded weights (its first step is then not stale). Evaluation and
// sampling read the newest weights.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_engine.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_split.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/tensor/tp.h"

namespace memtrain {

// What the executor measured over the steps so far (all but the first, which pays start-up).
// Every step's schedule starts at a barrier; the step's makespan runs from the earliest rank's
// start to the latest rank's end on the wall clock the ranks share, and the bubble is the
// simulator's definition, 1 - mean over ranks of busy / makespan.
struct PipelineStats {
    int steps = 0;
    double makespan_s = 0;   // summed over steps
    double bubble = 0;       // summed over steps
    int64_t bytes_sent = 0;  // activations and gradients sent by this rank
    // Per virtual stage: one micro-batch's forward and backward time, summed over steps (for
    // the simulator's prediction from measured stage times).
    std::vector<double> stage_forward_s, stage_backward_s, stage_input_s, stage_weight_s;
};

class MeshEngine final : public Engine {
  public:
    MeshEngine(const RunPlan& plan, dist::Communicator& comm);
    ~MeshEngine() override;

    std::string describe() const override;
    // The whole model (with tensor parallelism, assembled from the shards:
    // parallel/tensor/tp_views.h).
    ModelWeights weights() override {
        return ModelWeights{*weights_, tpg_ ? tpl_.full : layout_, cfg_.model};
    }
    OptimizerState& optimizer() override { return tpg_ ? *opt_view_ : *opt_; }
    ActFormat arena_format() const override { return GPT::arena_format(); }
    // New weights (initialised, imported or resumed): 2BW's shadow starts again from them.
    void weights_loaded() override { shadow_valid_ = false; }
    void set_remat(const RematPlan& plan) override;
    const RematPlan& remat_plan() const override { return plan_; }
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override;
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override;
    void forward_logits(const int32_t* inputs, int B, int T, float* out) override;
    MemoryTracker& memory() override { return host_memory(); }
    std::string memory_title() const override;
    std::vector<MemoryPrediction> predicted_memory(int B, int T) const override;
    std::string memory_footer() const override;
    // Writes pipeline_timeline.svg: the last step as it ran, one row per rank.
    std::string write_run_files(const std::string& out_dir) override;

    int stage() const { return rank_; }
    int stages() const { return p_; }
    // Which pipeline this rank belongs to, and how many run side by side.
    int replica() const { return data_->rank(); }
    int replicas() const { return mesh_.dp; }
    // The floats of the stage's range this rank's optimizer updates: the whole range, or under
    // ZeRO-1 its shard [offset, offset + count) counted from the range's begin.
    dist::ShardRange update_range() const { return shard_; }
    // Chunks of the model on this rank (train.pp_virtual; 1 unless interleaved): chunk c is
    // virtual stage c * stages() + stage().
    int chunks() const { return v_; }
    const pp::StageSplit& split() const { return split_; }  // per virtual stage
    // Activation slots this rank allocates: the micro-batches it holds at once under the
    // schedule (GPipe m, 1F1B min(p - s, m)); interleaved, the sum over its chunks of each
    // chunk's most micro-batches in flight (chunk_slots), which peak at different times.
    int slots() const;
    int chunk_slots(int c) const { return chunks_.at(c)->slots(); }
    // The model of chunk c (its blocks, and the embedding or head where it has them).
    GPT& model(int c = 0) { return *chunks_.at(c); }
    pp::StageStore& store() { return *store_; }
    const PipelineStats& stats() const { return stats_; }
    // The last step as it ran: every rank's actions with their measured start and end (seconds
    // from the step's common start), in the simulator's form.
    const pp::SimResult& measured_timeline() const { return timeline_; }
    // The schedule of the last step (empty before one ran).
    const pp::Schedule& schedule() const { return sched_; }

    // PipeDream and PipeDream-2BW: the weight version (updates applied to this stage before)
    // that the parameters held while each micro-batch's forward and backward of the last step
    // ran on this stage, in micro-batch order (empty for the synchronous schedules).
    // With each, once hash_weight_versions(true) (tests; it reads the stage's weights twice per
    // micro-batch), a hash of the parameters' bits at that moment: equal hashes show the
    // backward ran on the very weights its forward did.
    struct VersionUse {
        int64_t forward = -1, backward = -1;
        uint64_t forward_hash = 0, backward_hash = 0;
    };
    const std::vector<VersionUse>& versions_used() const { return versions_used_; }
    void hash_weight_versions(bool on) { hash_versions_ = on; }
    // Updates applied to this stage's weights so far (the optimizer's step count).
    int64_t weight_version() const;
    // The most weight versions alive at once on this stage so far (the weights and the stashed
    // or shadow copies holding a version some micro-batch still needs); 1 when synchronous.
    int peak_live_versions() const { return peak_live_; }
    // The bytes of the copies beside the weights: measured (allocated) and predicted (PipeDream
    // 4 x (p - s - 1) x stage params, 2BW 4 x stage params with the mirror).
    std::size_t version_bytes() const;
    std::size_t predicted_version_bytes() const;

  private:
    struct Micro {
        std::vector<int32_t> x, y;
    };
    // The constructor's steps, in their order: this rank's tensor-parallel shard and group; its
    // pipeline chunks (blocks, StageStore, models, weight versions, schedule); the data group's
    // share of the stage (all-reduce, or ZeRO-1's piece) and the optimizers over it.
    void apply_tensor_parallel();
    void apply_pipeline();
    void apply_data_parallel();
    void run_schedule(double lr = 0);
    // One optimizer update of the owned range by g (all of it, or its ZeRO-1 shard), and the
    // all-gather of the updated shards.
    void update(float* g, double lr);
    // 2BW: exchanges the parameters (and the mirror) with the shadow copy; copies them into it,
    // the shadow then being the current version.
    void swap_shadow();
    void save_shadow();
    bool pipedream() const { return kind_ == pp::Kind::PipeDream; }
    bool two_bw() const { return kind_ == pp::Kind::PipeDream2BW; }
    // The schedule for m micro-batches, and each chunk's slots from its simulated peak.
    void make_schedule(int m);
    void forward_only(const int32_t* inputs, int B, int T);
    bool first() const { return rank_ == 0; }
    bool last() const { return rank_ == p_ - 1; }
    int num_stages() const { return p_ * v_; }
    int rank_of(int stage) const { return stage % p_; }
    std::string chunk_blocks() const;  // "0..1" or, interleaved, "0..1, 4..5"

    // Sequence parallelism: sums the norm weights' gradients over the tensor-parallel group.
    void reduce_sequence_partial_grads();
    // Sums this stage's gradients across its data group (after the tied exchange); returns the
    // gradient this rank's optimizer steps with (the stage's, or its ZeRO-1 shard).
    float* reduce_across_pipelines();
    // Averages a pipeline's loss over the pipelines (a collective of the data group).
    double mean_over_pipelines(double loss);

    RunConfig cfg_;
    dist::Communicator& world_;
    dist::MeshLayout mesh_;
    dist::MeshGroups groups_;
    dist::Communicator& comm_;  // the pipeline: rank = stage
    dist::Communicator* data_;  // the stage's replicas: rank = pipeline
    int rank_ = 0, p_ = 1, v_ = 1;
    pp::Kind kind_;
    // The model this rank runs: cfg.model, or with train.tp its tensor-parallel shard
    // (parallel/tensor/tp.h), whose layout the stage's store, optimizer and norm use.
    ModelConfig model_;
    ParamLayout layout_;
    std::unique_ptr<dist::TpGroup> tpg_;        // train.tp > 1: the stage's shards
    dist::TpLayout tpl_;                        // the whole model's tensors and this shard's
    std::unique_ptr<OptimizerState> opt_view_;  // tp: the optimizer over the whole layout
    pp::StageSplit split_;
    std::unique_ptr<pp::StageStore> store_;     // every chunk's units, one range per chunk
    std::unique_ptr<WeightWindow> weights_;     // dist::OwnerWeights, or TpStageWeights
    std::vector<std::unique_ptr<GPT>> chunks_;  // chunk c: virtual stage c * p + rank
    std::unique_ptr<RangeOptimizers> opt_;      // one optimizer per chunk's range
    dist::ShardRange shard_;                    // of the owned range (one chunk under ZeRO-1)
    bool zero1_ = false;                        // train.zero_stage = 1: shard_ is 1/dp of the range
    Buffer<float> shard_grads_;                 // ZeRO-1: the reduce-scattered gradient of shard_
    RematPlan plan_;
    pp::Schedule sched_;
    std::vector<Micro> mbs_;
    int B_ = 0, T_ = 0;
    float grad_scale_ = 0;
    double loss_sum_ = 0;
    PipelineStats stats_;
    pp::SimResult timeline_;
    double epoch_ = 0;  // wall-clock seconds of rank 0 at start-up: the timeline's zero
    // Weight versions (PipeDream: the stash buffers and the version each holds, -1 free; 2BW:
    // one shadow of the owned range followed by the mirror, valid once filled).
    std::vector<Buffer<float>> stash_;
    std::vector<int64_t> stash_version_;
    bool shadow_valid_ = false;
    bool hash_versions_ = false;
    int64_t shadow_version_ = 0;
    std::vector<VersionUse> versions_used_;
    int peak_live_ = 1;
    bool pending_ = false;  // PipeDream: the step's micro-batches wait for finish_step's lr
    int steps_run_ = 0;
};

}  // namespace memtrain
