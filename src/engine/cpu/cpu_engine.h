// The CPU engine of one process or of data parallelism: the CPU model over a ZeroStore (DDP and
// ZeRO stages 0-3, parallel/data/zero_store.h; a single process is a world of one), and the
// pieces the other CPU engines share with it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/gpt.h"
#include "optim/optimizer.h"
#include "parallel/data/zero_store.h"

namespace memtrain {

// The end of a step over a ZeroStore (the CPU engine's and LoRA's): the mean loss of the
// micro-batches, the global norm clipped, the optimizer over the rank's range, the stage's
// all-gather.
StepResult finish_zero_step(dist::ZeroStore& store, Optimizer& opt, double loss_sum,
                            int micro_batches, double lr, double max_norm);
// The CPU model over a ZeroStore on `comm`: DDP and ZeRO stages 0-3 (parallel/data/zero_store.h).
class CpuEngine final : public Engine {
  public:
    CpuEngine(const RunPlan& plan, dist::Communicator& comm);
    std::string describe() const override { return "cpu (fp32)"; }
    ModelWeights weights() override { return model_->weights(); }
    OptimizerState& optimizer() override { return *opt_; }
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

    GPT& model() { return *model_; }
    dist::ZeroStore& store() { return *store_; }

  private:
    RunConfig cfg_;
    dist::Communicator& comm_;
    ParamLayout layout_;
    std::unique_ptr<dist::ZeroStore> store_;
    std::unique_ptr<GPT> model_;
    std::unique_ptr<Optimizer> opt_;
    double loss_sum_ = 0;
    int micro_batches_ = 0;
};

}  // namespace memtrain
