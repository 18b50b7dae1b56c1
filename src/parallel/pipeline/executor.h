// The pipeline executor: walks this rank's list of a schedule (parallel/pipeline/schedule.h) over
// the model chunks it holds, passing activations and gradients to the neighbouring stages.
//
// One optimizer step: the step's micro-batches are queued one by one; then run() walks the list.
// F(i): receive micro-batch i's input from the previous stage (the first stage embeds the
// tokens), run the chunk's blocks into a free activation slot, send the output on. B(i): receive
// d(output) from the next stage (the last stage computes the loss), run the backward, send
// d(input) back. Zero bubble splits B into I (which sends d(input)) and W, whenever the list
// finds room for it. Sends are nonblocking, so a stage that passes an activation on while its
// neighbour sends a gradient back never waits on it; receives block. Every chunk accumulates its
// micro-batches' gradients in micro-batch order, the order one process accumulates them in, and
// each block runs the same kernels on the same inputs: losses and gradients are bitwise those of
// one process (tests/mpi/pipeline_test.cpp).
//
// Interleaved (Megatron's virtual stages, v chunks per rank): rank r holds virtual stages r,
// r + p, ..., each with its own activation slots (as many as the schedule keeps in flight on that
// chunk). An action names its virtual stage: the executor runs it on that chunk, receives from
// and sends to the rank of the neighbouring virtual stage (rank p - 1's chunk c passes on to rank
// 0's chunk c + 1), with message tags that name the chunk and the micro-batch.
//
// Which weights each micro-batch computes on is the WeightVersions' business (PipeDream's
// stash, 2BW's shadow); what each action took, the Timeline's. The tied embedding's two
// gradients (the first stage's wte, the last stage's mirror beside the head) and the updated
// wte travel on tags of their own once per step.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/pipeline/timeline.h"
#include "parallel/pipeline/weight_versions.h"

namespace memtrain::pp {

class Executor {
  public:
    // `stages`: the pipeline (its rank is this stage); chunks[c]: the model of virtual stage
    // c * p + rank, p = stages.size(). The chunks, versions and timeline must outlive it.
    Executor(dist::Communicator& stages, Kind kind, std::vector<GPT*> chunks,
             WeightVersions& versions, Timeline& timeline);
    // Sends still travelling read the chunks' buffers.
    ~Executor();
    Executor(const Executor&) = delete;
    Executor& operator=(const Executor&) = delete;

    int stage() const { return rank_; }
    int stages() const { return p_; }
    int chunks() const { return (int)chunks_.size(); }
    int num_stages() const { return p_ * chunks(); }
    bool first() const { return rank_ == 0; }
    bool last() const { return rank_ == p_ - 1; }

    // Fails when a step of m micro-batches on `chunks` chunks per rank has more messages than the
    // tags can name (before anything is allocated).
    static void check_micro_batches(int m, int chunks);
    // The schedule for m micro-batches, and each chunk's slots from its simulated peak (the
    // simulator runs each rank's list in order, so its count of what a stage holds between
    // forward and backward is the executor's, whatever the stages cost).
    void make_schedule(int m);
    // The schedule of the last step (or of make_schedule before one ran).
    const Schedule& schedule() const { return sched_; }

    // A step: its micro-batches queued (copied) as the Trainer hands them over, then run.
    void begin_step();
    // `dropout_rows`: the ordinal of the micro-batch's first sequence (model.dropout's masks).
    void push(const int32_t* inputs, const int32_t* targets, int B, int T, float grad_scale,
              uint64_t dropout_rows = 0);
    int queued() const { return (int)mbs_.size(); }
    // Walks this rank's list over the queued micro-batches. When the weight versions update per
    // micro-batch (PipeDream), `update` runs after each backward has sent d(input) on, its time
    // counted in the backward's.
    void run(const std::function<void()>& update = {});
    // The step's mean loss over its micro-batches, from the last stage (a collective of the
    // pipeline).
    double step_loss();

    // The tied embedding: the classifier's gradient (the last stage's mirror) joins the
    // embedding's (first stage); after the update the first stage sends wte back to the mirror.
    // No-ops unless the model ties them across stages.
    void join_tied_grads(StageStore& store);
    void share_tied_weights(StageStore& store);

    // Evaluation, through every stage on slot 0: the last stage's mean loss, or its logits
    // (B, T, V), on every rank of the pipeline.
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T);
    void forward_logits(const int32_t* inputs, int B, int T, float* out);

  private:
    struct Micro {
        std::vector<int32_t> x, y;
        uint64_t dropout_rows = 0;
    };
    int rank_of(int stage) const { return stage % p_; }
    bool tied() const;
    // Floats of a stage's input and output: the residual stream, or under sequence parallelism
    // this shard's token rows of it.
    int64_t boundary_floats(int B, int T) const;
    void forward_only(const int32_t* inputs, int B, int T);

    dist::Communicator* comm_;
    Kind kind_;
    int rank_ = 0, p_ = 1;
    std::vector<GPT*> chunks_;
    WeightVersions* versions_;
    Timeline* timeline_;
    Schedule sched_;
    std::vector<Micro> mbs_;
    int B_ = 0, T_ = 0;
    float grad_scale_ = 0;
    double loss_sum_ = 0;
};

}  // namespace memtrain::pp
