// LoRA fine-tuning on the CPU: the base model frozen (fp32, or quantized for QLoRA), adapters
// trained (model/lora.h). The adapters live in a ZeroStore of their own layout, so data
// parallelism and ZeRO stages 0-3 shard their gradients and optimizer state exactly as they do a
// whole model's; every rank keeps the frozen base whole. Checkpoints hold the adapters in PEFT's
// files plus their optimizer state; the base is reloaded from model.init_from (or its seed).
#pragma once

#include <memory>

#include "engine/cpu/cpu_engine.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "quant/quantized_store.h"

namespace memtrain {

class LoraEngine final : public Engine {
  public:
    LoraEngine(const RunPlan& plan, dist::Communicator& comm);
    ~LoraEngine() override;
    std::string describe() const override;
    // The frozen base (initialisation and import write it before weights_loaded()).
    ModelWeights weights() override;
    OptimizerState& optimizer() override { return *opt_; }
    ActFormat arena_format() const override { return GPT::arena_format(); }
    void set_remat(const RematPlan& plan) override;
    const RematPlan& remat_plan() const override { return plan_; }
    void weights_loaded() override;
    CheckpointModel checkpoint_model() override;
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

    GPT& model();
    const LoraLayout& lora_layout() const { return lora_layout_; }
    dist::ZeroStore& adapter_store() { return *adapters_; }

  private:
    RunConfig cfg_;
    dist::Communicator& comm_;
    ParamLayout layout_;                        // the base model's
    LoraLayout lora_layout_;                    // the adapters'
    std::unique_ptr<FullUnitStore> fp32_base_;  // lora.base = fp32
    // QLoRA: the packed base, written through quant_writer_ (one unit of fp32 at a time) until
    // weights_loaded().
    std::unique_ptr<quant::QuantizedParamStore> quant_base_;
    std::unique_ptr<quant::QuantizedStoreWriter> quant_writer_;
    std::unique_ptr<dist::ZeroStore> adapters_;
    std::unique_ptr<LoraAdapters> lora_;
    std::unique_ptr<GPT> model_;
    std::unique_ptr<Optimizer> opt_;
    RematPlan plan_;  // the model's (it is built after set_remat, in weights_loaded)
    double loss_sum_ = 0;
    int micro_batches_ = 0;
    UnitStore& base();
};

}  // namespace memtrain
