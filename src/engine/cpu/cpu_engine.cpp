// The CPU engine: the techniques applied to the model in their order, and the step's calls (see
// cpu_engine.h; the step's end in cpu_engine_step.cpp, the reports in cpu_engine_report.cpp).
#include "engine/cpu/cpu_engine.h"

#include <cmath>

#include "core/error.h"
#include "io/lora_files.h"
#include "optim/state_format.h"
#include "parallel/ps/param_server.h"
#include "parallel/tensor/tp_views.h"

namespace memtrain {

CpuEngine::CpuEngine(const RunPlan& plan, dist::Communicator& comm)
    : plan_(plan), world_(comm), model_(plan.cfg.model) {
    if (plan_.gpu() || plan_.engine == EngineKind::ParameterServer)
        fail("internal: the CPU engine does not run a {} plan", engine_name(plan_.engine));
    // The mesh's groups: the pipeline, the stage's replicas, the stage's shards (a collective).
    if (plan_.engine == EngineKind::Mesh) groups_ = dist::split_mesh(comm, plan_.mesh);
    // The techniques, applied to the model in this order (torchtitan's parallelize): each cuts
    // what the one before left. The recompute plan comes last, from the Trainer (set_remat),
    // once the chunks' blocks and arena format are known.
    apply_tensor_parallel();
    apply_pipeline();
    apply_lora();
    apply_data_parallel();
    seed_dropout();
}

void CpuEngine::seed_dropout() {
    // model.dropout: every rank's and stage's masks from one seed, keyed by sequence.
    for (const auto& chunk : chunks_) chunk->set_dropout_seed(plan_.cfg.train.seed ^ 0xD80F0D7ull);
}

CpuEngine::~CpuEngine() {
    if (groups_.stages) groups_.stages->wait_all();  // sends still travelling read our buffers
}

void CpuEngine::apply_tensor_parallel() {
    // This rank's shard of every tensor (Megatron's cut, parallel/tensor/tp.h) and the group
    // holding the other shards: its stage's on the mesh; alone, every rank of the job.
    const int tp = plan_.mesh.tp;
    if (tp > 1) {
        dist::Communicator* group = groups_.tp.get();
        if (!group) {
            if (world_.size() != tp)
                fail("train.tp = {} needs exactly {} ranks, the run has {}: start mpirun -np {}",
                     tp, tp, world_.size(), tp);
            group = &world_;
        }
        if (plan_.virtual_stages > 1)
            fail("internal: tensor-parallel stages with {} chunks per rank", plan_.virtual_stages);
        tp_ = std::make_unique<dist::TpGroup>(*group);
        tpl_ = dist::make_tp_layout(plan_.cfg.model, tp, group->rank());
        model_ = dist::tp_shard_config(plan_.cfg.model, tp, plan_.sequence_parallel);
        layout_ = tpl_.local;  // (its tensors know their whole tensors' sizes)
        return;
    }
    layout_ = make_param_layout(model_);
}

void CpuEngine::apply_pipeline() {
    // Without stages the whole model (or the shard) is one stage that runs each micro-batch as
    // it comes (1F1B over one stage); it is built over the store data parallelism chooses.
    if (plan_.engine != EngineKind::Mesh) return;
    // This rank's chunks (virtual stages rank, rank + p, ...; one unless interleaved), each a run
    // of blocks of the whole model's split and a model over them; their units in one StageStore.
    dist::Communicator& stages = *groups_.stages;
    const int p = plan_.mesh.pp, v = plan_.virtual_stages, rank = stages.rank();
    if (stages.size() != p) fail("internal: a pipeline of {} stages on {} ranks", p, stages.size());
    pp::Executor::check_micro_batches(plan_.accum_steps, v);
    const ModelConfig& whole = plan_.cfg.model;
    split_ = pp::split_stages(whole, p * v, plan_.micro_batch, plan_.seq_len);
    std::vector<std::pair<int, int>> ranges;
    for (int c = 0; c < v; c++) {
        const int s = c * p + rank;
        const int b0 = split_.first_block[s], b1 = b0 + split_.blocks[s];
        const int first_unit = b0 == 0 ? ParamLayout::embedding_unit() : layout_.block_unit(b0);
        const int last_unit =
            b1 == whole.n_layer ? layout_.head_unit() : layout_.block_unit(b1 - 1);
        ranges.emplace_back(first_unit, last_unit);
    }
    stages_ =
        std::make_unique<pp::StageStore>(layout_, ranges, rank == p - 1 && whole.tied_embeddings);
    // Who owns each unit, for the weights view: the job rank of the stage its blocks belong to
    // (in pipeline 0, shard 0: every pipeline holds the same weights).
    std::vector<int> owner(layout_.units.size(), 0);
    for (int s = 0; s < p * v; s++)
        for (int l = split_.first_block[s]; l < split_.first_block[s] + split_.blocks[s]; l++)
            owner[layout_.block_unit(l)] = plan_.mesh.rank(0, s % p);
    owner[layout_.head_unit()] = plan_.mesh.rank(0, p - 1);
    if (tp_)
        window_ = std::make_unique<TpStageWeights>(tpl_, *stages_, *tp_, std::move(owner), world_);
    else
        window_ = std::make_unique<dist::OwnerWeights>(layout_, *stages_, std::move(owner), world_);
    std::vector<GPT*> models;
    for (int c = 0; c < v; c++) {
        const int b0 = split_.first_block[c * p + rank];
        chunks_.push_back(
            std::make_unique<GPT>(model_, stages_.get(), b0, b0 + split_.blocks[c * p + rank]));
        chunks_.back()->set_split_backward(plan_.schedule == pp::Kind::ZbH1);
        if (tp_) chunks_.back()->set_tp(tp_.get());
        models.push_back(chunks_.back().get());
    }
    timeline_ = std::make_unique<pp::Timeline>(stages);
    // The weight versions beside the weights, allocated up front (none for the synchronous
    // schedules).
    versions_ = pp::make_weight_versions(plan_.schedule, p, rank, v,
                                         {stages_->owned_params(), stages_->count(),
                                          stages_->mirror_params(), stages_->mirror_size()},
                                         [this] { return opt_->steps_taken(); });
    exec_ = std::make_unique<pp::Executor>(stages, plan_.schedule, std::move(models), *versions_,
                                           *timeline_);
    exec_->make_schedule(plan_.accum_steps);
}

void CpuEngine::apply_lora() {
    // What trains becomes the adapters; the base stays frozen, whole on every rank: fp32, or
    // packed (QLoRA) and written through its quantizing writer until weights_loaded().
    if (!plan_.lora) return;
    const RunConfig& cfg = plan_.cfg;
    lora_layout_ = make_lora_layout(cfg.model, cfg.lora);
    if (!plan_.lora_base) {
        full_ = std::make_unique<FullUnitStore>(layout_);
    } else {
        const quant::BaseQuant& q = *plan_.lora_base;
        q.check(cfg.model);
        quant_base_ = std::make_unique<quant::QuantizedParamStore>(cfg.model, q);
        quant_writer_ = std::make_unique<quant::QuantizedStoreWriter>(*quant_base_);
    }
}

void CpuEngine::apply_data_parallel() {
    const RunConfig& cfg = plan_.cfg;
    std::vector<std::unique_ptr<Optimizer>> parts;
    // Muon and Adafactor under tensor parallelism step each sliced tensor whole, gathered over
    // the tp group (every rank the same whole tensor, then its slice).
    const std::vector<char> whole_step = whole_step_tensors(cfg.optim, layout_);
    if (tp_ && std::find(whole_step.begin(), whole_step.end(), 1) != whole_step.end())
        tp_gather_ = std::make_unique<dist::TpTensorGather>(tpl_, tp_->comm());
    if (pipelined()) {
        // The pipelines side by side (mesh.dp) hold the same stage: its gradients are summed
        // across them, all-reduced or, where the placement shards the optimizer state (ZeRO-1),
        // reduce-scattered so this replica updates its piece of the range (one chunk per rank,
        // the config's checks).
        replicas_ = std::make_unique<dist::ReplicaSync>(
            groups_.data.get(), plan_.states, stages_->count(), stages_->ranges()[0].begin,
            (int64_t)shard_grain(cfg.optim));
        if (replicas_->sharded() && plan_.virtual_stages > 1)
            fail("internal: ZeRO-1 across pipelines with {} chunks per rank", plan_.virtual_stages);
        const dist::ShardRange own = replicas_->owned();
        for (const pp::StageStore::Range& r : stages_->ranges())
            parts.push_back(replicas_->sharded()
                                ? make_optimizer(cfg.optim, layout_,
                                                 r.begin + (std::size_t)own.offset,
                                                 (std::size_t)own.count)
                                : make_optimizer(cfg.optim, layout_, r.begin, r.count(),
                                                 MemCategory::OptimizerState, tp_gather_.get()));
        opt_ = std::make_unique<RangeOptimizers>(std::move(parts));
        if (tp_) {
            // Under ZeRO-1 the view gathers the replicas' pieces of the shard's range too, so a
            // checkpoint holds the whole model's state as one process's does.
            const pp::StageStore::Range& r = stages_->ranges()[0];
            opt_view_ = std::make_unique<TpRangeOptimizer>(
                tpl_, *opt_, *tp_, r.first_unit, r.last_unit,
                replicas_->sharded() ? groups_.data.get() : nullptr, own);
        }
        return;
    }
    if (tp_) {
        // Tensor parallelism alone: the group reads the same rows, so there is nothing to sum
        // across ranks; this rank updates its whole shard.
        if (cfg.optim.master == "none") {
            // bf16 weights: each element rounds with the draw of its index in the whole model,
            // as one process rounds it.
            dist::ZeroStore::Options zo;
            zo.bf16_params = true;
            zo.rounding_seed = bf16_rounding_seed(cfg.train.seed);
            zo.whole_tensors = whole_step;
            zo.global_index = dist::tp_index_runs(tpl_);
            shard16_ = std::make_unique<dist::ZeroStore>(layout_, shard_comm_, 0, zo);
        } else {
            full_ = std::make_unique<FullUnitStore>(layout_);
        }
        chunks_.push_back(std::make_unique<GPT>(model_, &shard_store()));
        chunks_.back()->set_tp(tp_.get());
        parts.push_back(make_optimizer(cfg.optim, layout_, 0, SIZE_MAX, MemCategory::OptimizerState,
                                       tp_gather_.get()));
        opt_ = std::make_unique<RangeOptimizers>(std::move(parts));
        window_ = std::make_unique<TpWholeWeights>(tpl_, shard_store(), *tp_);
        // The optimizer state of the whole layout: every unit's, gathered from the shards.
        opt_view_ = std::make_unique<TpRangeOptimizer>(
            tpl_, *opt_, *tp_, ParamLayout::embedding_unit(), tpl_.full.head_unit());
        return;
    }
    // A whole model's states, or LoRA's adapters', in a ZeroStore over the job's ranks: DDP and
    // ZeRO stages 0-3 (parallel/data/zero_store.h; a single process is a world of one).
    const ParamLayout& trained = plan_.lora ? lora_layout_.params : layout_;
    // optim.step_in_backward with one micro-batch per step keeps no gradient buffer at all.
    dist::ZeroStore::Options zo;
    zo.grain = (int64_t)shard_grain(cfg.optim);
    zo.hold_grads = !cfg.no_grad_buffer();
    // optim.master = "none": bf16 weights, rounded stochastically from the run's seed.
    zo.bf16_params = cfg.optim.master == "none";
    zo.rounding_seed = bf16_rounding_seed(cfg.train.seed);
    if (zo.bf16_params) zo.whole_tensors = whole_step_tensors(cfg.optim, trained);
    zero_ = std::make_unique<dist::ZeroStore>(trained, world_, plan_.zero_stage, zo);
    if (plan_.lora) {
        // Dropout masks differ per rank (each has its own rows), as torch's do under DDP.
        lora_ = std::make_unique<LoraAdapters>(cfg.lora, lora_layout_, *zero_,
                                               cfg.train.seed ^ (0xD20Full * (world_.rank() + 1)));
        init_lora_weights(*zero_, lora_layout_, cfg.train.seed);
    } else {
        chunks_.push_back(std::make_unique<GPT>(cfg.model, zero_.get()));
    }
    const dist::ShardRange owned = zero_->owned();
    // An optimizer that steps tensors whole (Muon) completes the ones a shard cuts by gathering.
    const std::vector<char> whole = whole_step_tensors(cfg.optim, trained);
    const bool any_whole = std::find(whole.begin(), whole.end(), 1) != whole.end();
    TensorGather* gather = nullptr;
    if (any_whole && plan_.zero_stage > 0 && world_.size() > 1) {
        gather_ = std::make_unique<dist::ShardTensorGather>(trained, world_, zero_->owned_by_rank(),
                                                            whole);
        gather = gather_.get();
    } else if (any_whole && world_.size() > 1 && cfg.optim.name == "muon") {
        // DDP: each matrix orthogonalized by one replica and broadcast.
        share_ = std::make_unique<dist::ReplicaMatrixShare>(trained, whole, world_);
        gather = share_.get();
    }
    parts.push_back(make_optimizer(cfg.optim, trained, owned.offset, owned.count,
                                   MemCategory::OptimizerState, gather));
    opt_ = std::make_unique<RangeOptimizers>(std::move(parts));
}

UnitStore& CpuEngine::shard_store() {
    if (shard16_) return *shard16_;
    if (!full_) fail("internal: {} keeps no tensor-parallel shard", describe());
    return *full_;
}

UnitStore& CpuEngine::base() {
    return quant_base_ ? static_cast<UnitStore&>(*quant_base_) : *full_;
}

GPT& CpuEngine::model(int c) {
    if (chunks_.empty()) fail("internal: the LoRA model is built by weights_loaded()");
    return *chunks_.at(c);
}

namespace {

// A piece the layout may lack: its object, or an internal error naming the engine and the piece.
template <class T>
T& piece(const std::unique_ptr<T>& p, const CpuEngine& e, const char* what) {
    if (!p) fail("internal: {} has no {}", e.describe(), what);
    return *p;
}

}  // namespace

dist::ZeroStore& CpuEngine::zero_store() {
    return piece(zero_, *this, "ZeroStore");
}

dist::TpGroup& CpuEngine::tp_group() {
    return piece(tp_, *this, "tensor-parallel group");
}

float* CpuEngine::local_params() {
    tp_group();  // (tensor parallelism alone keeps its shard whole in full_; bf16 in shard16_)
    return piece(full_, *this, "whole fp32 tensor-parallel shard").full_params();
}

float* CpuEngine::local_grads() {
    tp_group();
    return shard_store().full_grads();
}

int CpuEngine::stage() const {
    return exec_ ? exec_->stage() : 0;
}

pp::StageStore& CpuEngine::stage_store() {
    return piece(stages_, *this, "pipeline stage");
}

pp::Executor& CpuEngine::pipeline() {
    return piece(exec_, *this, "pipeline");
}

pp::WeightVersions& CpuEngine::weight_versions() {
    return piece(versions_, *this, "pipeline");
}

const pp::Timeline& CpuEngine::timeline() const {
    return piece(timeline_, *this, "pipeline");
}

int CpuEngine::slots() const {
    int k = 0;
    for (const auto& g : chunks_) k += g->slots();
    return k;
}

int CpuEngine::replica() const {
    return replicas_ ? replicas_->replica() : 0;
}

dist::ShardRange CpuEngine::update_range() const {
    if (replicas_) return replicas_->owned();
    if (zero_) return zero_->owned();
    return {0, (int64_t)layout_.total};
}

ModelWeights CpuEngine::weights() {
    const ModelConfig& whole = plan_.cfg.model;
    // Until weights_loaded(), a QLoRA base is written through its quantizing writer.
    if (quant_writer_) return ModelWeights{*quant_writer_, layout_, whole};
    if (plan_.lora) return ModelWeights{base(), layout_, whole};
    if (window_) return ModelWeights{*window_, tp_ ? tpl_.full : layout_, whole};
    return ModelWeights{*zero_, layout_, whole};
}

OptimizerState& CpuEngine::optimizer() {
    return opt_view_ ? *opt_view_ : static_cast<OptimizerState&>(*opt_);
}

void CpuEngine::weights_loaded() {
    if (versions_) versions_->weights_loaded();
    if (!plan_.lora) return;
    quant_writer_.reset();  // the base is complete (and frozen) from here on
    chunks_.clear();
    chunks_.push_back(std::make_unique<GPT>(plan_.cfg.model, &base()));
    chunks_.back()->set_lora(lora_.get());
    if (!remat_.empty()) chunks_.back()->set_remat(remat_);
    seed_dropout();
}

CheckpointModel CpuEngine::checkpoint_model() {
    if (!plan_.lora) return hf_checkpoint_model(weights());
    return {plan_.cfg.model, lora_layout_.params,
            [this](const std::string& dir, bool root) {
                save_lora_adapters(dir, plan_.cfg, lora_layout_, *zero_, root);
            },
            [this](const std::string& dir) {
                load_lora_adapters(dir, plan_.cfg.model, lora_layout_, *zero_);
            }};
}

void CpuEngine::set_remat(const RematPlan& plan) {
    remat_ = plan;
    // A pipeline's chunks each take their blocks' entries; a whole model the plan itself.
    const std::size_t L = (std::size_t)plan_.cfg.model.n_layer;
    if (pipelined() && !plan.empty() && plan.size() != L)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), L);
    for (auto& g : chunks_)
        g->set_remat(pipelined() && !plan.empty()
                         ? slice_plan(plan, g->first_block(), g->end_block())
                         : plan);
}

void CpuEngine::prepare_update(double lr, double max_norm) {
    update_lr_ = lr;
    update_max_norm_ = max_norm;
    update_prepared_ = true;
}

void CpuEngine::last_backward_with_update(const int32_t* inputs, const int32_t* targets, int B,
                                          int T, float grad_scale) {
    // Clipping scales every gradient by the global norm, known only once the last unit is
    // reduced: a norm pass (the same forward and backward, measuring only) comes first, and the
    // update pass clips each unit with it. Both passes see the same bits, which the update pass
    // checks. With step_in_backward_clip = "previous-norm" the update pass clips with the last
    // step's norm instead, when there is a finite one.
    if (!update_prepared_)
        fail("internal: optim.step_in_backward's last backward without prepare_update");
    const double max_norm = update_max_norm_;
    const bool lagged = plan_.cfg.optim.step_in_backward_clip == "previous-norm" &&
                        previous_norm_ > 0 && std::isfinite(previous_norm_);
    if (max_norm > 0 && !lagged) {
        zero_->arm_norm();
        model().forward_backward(inputs, targets, B, T, grad_scale);
        update_norm_ = zero_->disarm();
    }
    Optimizer& opt = opt_->part(0);
    const double lr = update_lr_, norm = lagged ? previous_norm_ : update_norm_;
    zero_->arm_update(
        [&opt, lr, norm, max_norm](float* p, float* g, std::size_t at, std::size_t n) {
            clip_to_norm(g, n, norm, max_norm);
            opt.step_part(p, g, lr, at, n);
        },
        opt.steps_taken() + 1);
    loss_sum_ += model().forward_backward(inputs, targets, B, T, grad_scale);
    const double seen = zero_->disarm();
    if (max_norm > 0 && !lagged && std::isfinite(seen) && std::isfinite(update_norm_) &&
        seen != update_norm_)
        fail(
            "internal: optim.step_in_backward's norm pass measured gradient norm {} and its "
            "update pass {}: the backward is not deterministic",
            update_norm_, seen);
    update_norm_ = seen;
    previous_norm_ = seen;
}

void CpuEngine::begin_step() {
    if (pipelined()) {
        stages_->zero_grads();
        exec_->begin_step();
        return;
    }
    if (zero_)
        zero_->zero_grads();  // the trained states: the model's, or LoRA's adapters'
    else
        shard_store().zero_grads();
    if (tp_) tp_->reset_counts();
    loss_sum_ = 0;
    micro_batches_ = 0;
}

void CpuEngine::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                                 float grad_scale, bool last) {
    if (pipelined()) {
        exec_->push(inputs, targets, B, T, grad_scale, dropout_rows_);
        // PipeDream updates inside the schedule, with the step's learning rate: finish_step
        // runs it.
        if (last && !versions_->update_per_micro_batch()) exec_->run();
        return;
    }
    if (zero_) zero_->set_reduce(last);  // stages 0-1 reduce once per step
    if (lora_) {
        lora_->set_training(true);
        lora_->set_micro_batch(
            (uint64_t)(opt_->steps_taken() * plan_.accum_steps + micro_batches_));
    }
    model().set_dropout_rows(dropout_rows_);
    if (last && in_backward())
        last_backward_with_update(inputs, targets, B, T, grad_scale);
    else
        loss_sum_ += model().forward_backward(inputs, targets, B, T, grad_scale);
    micro_batches_++;
}

double CpuEngine::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    if (pipelined()) return replicas_->mean(exec_->forward_loss(inputs, targets, B, T));
    if (lora_) lora_->set_training(false);
    return model().forward_loss(inputs, targets, B, T);
}

void CpuEngine::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    if (pipelined()) return exec_->forward_logits(inputs, B, T, out);
    if (lora_) lora_->set_training(false);
    model().forward_logits(inputs, B, T, out);
}

}  // namespace memtrain
