// Megatron tensor parallelism on the CPU engine (train.tp = T, `mpirun -np T`): every rank holds
// one shard of the model (parallel/tensor/tp.h: heads, MLP columns/rows, vocabulary rows), reads
// the same micro-batches, and runs the forward and backward with the group's all-reduces.
//
// To the Trainer the engine shows the whole model: weights() and optimizer() gather the shards
// of a unit (or of the optimizer state) from every rank when read, and keep this rank's pieces
// of what is written. So initialisation, Hugging Face import and checkpoints are those of one
// process, per tensor with Hugging Face names and whole tensors, and a checkpoint of any T
// resumes at any other (tp = 1 included). Every rank makes those calls (they are collectives).
//
// With train.sequence_parallel the shard runs Megatron's sequence parallelism
// (parallel/tensor/tp.h) and finish_step first all-reduces the norm weights' gradients, which each
// rank computed from its token rows only.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_engine.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "parallel/tensor/tp.h"

namespace memtrain {

class TpEngine final : public Engine {
  public:
    TpEngine(const RunPlan& plan, dist::Communicator& comm);
    ~TpEngine() override;
    std::string describe() const override;
    ModelWeights weights() override;
    OptimizerState& optimizer() override;
    ActFormat arena_format() const override { return GPT::arena_format(); }
    void set_remat(const RematPlan& plan) override { model_->set_remat(plan); }
    const RematPlan& remat_plan() const override { return model_->remat_plan(); }
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

    // The shard (its config has tp = T), its layout beside the whole model's, and the group with
    // its collective counters (tests).
    GPT& model() { return *model_; }
    const dist::TpLayout& tp_layout() const { return tpl_; }
    dist::TpGroup& group() { return group_; }
    // The group's collectives during the last step (begin_step to finish_step).
    const dist::TpGroup::Counts& last_step_counts() const { return step_counts_; }
    // This rank's shard of the parameters and gradients, in tp_layout().local order.
    float* local_params() { return store_.full_params(); }
    float* local_grads() { return store_.full_grads(); }

  private:
    class WholeStore;
    // Sequence parallelism: all-reduces the gradients of the tensors in sp_partial_ (counted at
    // TpSite::SpNormGrads).
    void reduce_sequence_partial_grads();

    RunConfig cfg_;
    dist::TpGroup group_;
    dist::TpLayout tpl_;
    FullUnitStore store_;  // this rank's shard, in tpl_.local
    std::unique_ptr<GPT> model_;
    std::unique_ptr<Optimizer> opt_;
    std::unique_ptr<WholeStore> whole_;
    std::unique_ptr<OptimizerState> whole_opt_;  // TpRangeOptimizer over the whole layout
    double loss_sum_ = 0;
    int micro_batches_ = 0;
    int64_t steps_ = 0;
    dist::TpGroup::Counts step_counts_;    // the collectives of the last step
    std::vector<std::size_t> sp_partial_;  // sequence parallelism: dist::sp_partial_grad tensors
};

}  // namespace memtrain
