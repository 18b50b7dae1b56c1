// The CPU LoRA engine (see lora_engine.h).
#include "engine/cpu/lora_engine.h"

#include <fmt/format.h>

#include "core/error.h"
#include "engine/host_memory.h"
#include "io/lora_files.h"

namespace memtrain {

LoraEngine::LoraEngine(const RunPlan& plan, dist::Communicator& comm)
    : cfg_(plan.cfg),
      comm_(comm),
      layout_(make_param_layout(plan.cfg.model)),
      lora_layout_(make_lora_layout(plan.cfg.model, plan.cfg.lora)) {
    if (cfg_.lora.base == "fp32") {
        fp32_base_ = std::make_unique<FullUnitStore>(layout_);
    } else {
        const quant::BaseQuant q = quant::lora_base_quant(cfg_.lora);
        q.check(cfg_.model);
        quant_base_ = std::make_unique<quant::QuantizedParamStore>(cfg_.model, q);
        quant_writer_ = std::make_unique<quant::QuantizedStoreWriter>(*quant_base_);
    }
    adapters_ =
        std::make_unique<dist::ZeroStore>(lora_layout_.params, comm_, cfg_.train.zero_stage);
    // Dropout masks differ per rank (each has its own rows), as torch's do under DDP.
    lora_ = std::make_unique<LoraAdapters>(cfg_.lora, lora_layout_, *adapters_,
                                           cfg_.train.seed ^ (0xD20Full * (comm_.rank() + 1)));
    init_lora_weights(*adapters_, lora_layout_, cfg_.train.seed);
    const dist::ShardRange owned = adapters_->owned();
    opt_ = make_optimizer(cfg_.optim, lora_layout_.params, owned.offset, owned.count);
}

LoraEngine::~LoraEngine() = default;

UnitStore& LoraEngine::base() {
    return quant_base_ ? static_cast<UnitStore&>(*quant_base_) : *fp32_base_;
}

GPT& LoraEngine::model() {
    if (!model_) fail("internal: the LoRA model is built by weights_loaded()");
    return *model_;
}

std::string LoraEngine::describe() const {
    std::string names;
    for (const auto& n : lora_layout_.names) names += (names.empty() ? "" : ", ") + n;
    return fmt::format("cpu (fp32), {} r={} alpha={} on {} ({} trainable), base {} frozen",
                       quant_base_ ? "QLoRA" : "LoRA", cfg_.lora.rank, cfg_.lora.alpha, names,
                       lora_layout_.params.total,
                       quant_base_ ? quant_base_->quant().name() : std::string("fp32"));
}

ModelWeights LoraEngine::weights() {
    // Until weights_loaded(), a QLoRA base is written through its quantizing writer.
    if (quant_writer_) return ModelWeights{*quant_writer_, layout_, cfg_.model};
    return ModelWeights{base(), layout_, cfg_.model};
}

void LoraEngine::weights_loaded() {
    quant_writer_.reset();  // the base is complete (and frozen) from here on
    model_ = std::make_unique<GPT>(cfg_.model, &base());
    model_->set_lora(lora_.get());
    if (!plan_.empty()) model_->set_remat(plan_);
}

void LoraEngine::set_remat(const RematPlan& plan) {
    plan_ = plan;
    if (model_) model_->set_remat(plan);
}

CheckpointModel LoraEngine::checkpoint_model() {
    return {cfg_.model, lora_layout_.params,
            [this](const std::string& dir, bool root) {
                save_lora_adapters(dir, cfg_, lora_layout_, *adapters_, root);
            },
            [this](const std::string& dir) {
                load_lora_adapters(dir, cfg_.model, lora_layout_, *adapters_);
            }};
}

void LoraEngine::begin_step() {
    adapters_->zero_grads();
    loss_sum_ = 0;
    micro_batches_ = 0;
}

void LoraEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                  float grad_scale, bool last) {
    adapters_->set_reduce(last);
    lora_->set_training(true);
    lora_->set_micro_batch((uint64_t)(opt_->steps_taken() * cfg_.accum_steps() + micro_batches_));
    loss_sum_ += model().forward_backward(inputs, targets, B, T, grad_scale);
    micro_batches_++;
}

StepResult LoraEngine::finish_step(double lr, double max_norm) {
    return finish_zero_step(*adapters_, *opt_, loss_sum_, micro_batches_, lr, max_norm);
}

double LoraEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    lora_->set_training(false);
    return model().forward_loss(inputs, targets, B, T);
}

void LoraEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    lora_->set_training(false);
    model().forward_logits(inputs, B, T, out);
}

std::string LoraEngine::memory_title() const {
    const int N = comm_.size();
    return fmt::format(
        "host, fp32, LoRA{}",
        N > 1 ? fmt::format(", rank 0 of {}, adapters at ZeRO stage {}", N, cfg_.train.zero_stage)
              : std::string());
}

std::vector<MemoryPrediction> LoraEngine::predicted_memory(int B, int T) const {
    return predict_cpu_memory(cfg_, plan_, comm_.rank(), B, T);
}

std::string LoraEngine::memory_footer() const {
    return host_rss_line() +
           fmt::format("LoRA: {} adapters, {} trainable parameters = {:.3f}% of the base's {}\n",
                       lora_layout_.sites.size(), lora_layout_.params.total,
                       100.0 * (double)lora_layout_.params.total / (double)layout_.total,
                       layout_.total) +
           (quant_base_ ? "QLoRA base: " + quant_base_->summary() + "\n" : std::string());
}

}  // namespace memtrain
