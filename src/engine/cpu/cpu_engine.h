// CpuEngine: the CPU model for every layout a RunPlan describes on the CPU but the parameter
// server (engine/cpu/ps_engine.h): one process, data parallelism and ZeRO 0-3, LoRA and QLoRA,
// tensor and sequence parallelism, pipelines of every schedule (PipeDream and 2BW included),
// pipelines side by side with gradients all-reduced or ZeRO-1 across them, and the tp x pp x dp
// mesh. A whole model is a pipeline of one stage; the techniques are applied to it in one
// written order (as torchtitan's parallelize does), each cutting what the one before left:
//
//   1. tensor parallelism (parallel/tensor): this rank's shard of every tensor and its group;
//   2. pipeline (parallel/pipeline): with several stages or meshes (EngineKind::Mesh), this
//      rank's chunks of blocks in a StageStore, run by the executor (pp::Executor) over the
//      plan's schedule, with the schedule's weight versions (pp::WeightVersions) and the measured
//      timeline (pp::Timeline); otherwise one stage holding the whole model (or the shard), run
//      micro-batch by micro-batch;
//   3. LoRA (model/lora.h): what trains becomes the adapters, over a frozen fp32 or packed
//      (QLoRA) base;
//   4. data parallelism (parallel/data): a whole model's (or the adapters') states in a
//      ZeroStore (DDP, ZeRO 1-3), or a stage's gradients summed across its replicas
//      (dist::ReplicaSync: all-reduced, or ZeRO-1 by the placement table); then the optimizer
//      over what this rank updates;
//   5. remat: the plan's per-block keeps, sliced per chunk (set_remat, from the Trainer).
//
// Every layout decision comes from the RunPlan's fields (engine/run_plan.h); from its config the
// engine reads the model, the optimizer, LoRA's adapters and the seed. Whatever the layout, each
// block runs the same kernels on the same inputs as one process, so the bitwise tests of every
// layout hold (tests/mpi/*_test.cpp, tests/train/*).
//
// Pipelines (docs/parallelism.md): one optimizer step queues the step's micro-batches and runs
// the schedule at the last (PipeDream in finish_step, which knows the learning rate). Then the
// tied embedding's gradient goes from the last stage to the first, sequence parallelism sums the
// norm weights' gradients over the tensor-parallel group, the replicas sum the stage's gradients,
// the global norm is the sum of per-unit (per shard, per replica piece) sums of squares in a fixed
// order (as one process sums it), every stage clips and updates its own range (or piece), and the
// first stage sends the updated embedding back to the last.
//
// To the Trainer the engine shows the whole model: weights() and optimizer() of a stage or shard
// gather what other ranks hold when read and keep this rank's pieces of what is written (every
// rank makes those calls: they are collectives), so initialisation, import and checkpoints are one
// process's whatever the layout, and a checkpoint of any layout resumes at any other.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/engine.h"
#include "engine/run_plan.h"
#include "model/gpt.h"
#include "model/lora.h"
#include "optim/optimizer.h"
#include "parallel/data/replica_sync.h"
#include "parallel/data/tensor_gather.h"
#include "parallel/data/zero_store.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/executor.h"
#include "parallel/pipeline/stage_split.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/pipeline/timeline.h"
#include "parallel/pipeline/weight_versions.h"
#include "parallel/tensor/tp.h"
#include "quant/quantized_store.h"

namespace memtrain {

// What the CPU model computes in, for the start-up line: "fp32", or under
// ModelConfig::cpu_bf16 the path of its bf16 GEMMs (kernels/cpu/gemm.h).
std::string cpu_compute_label(const ModelConfig& m);

class CpuEngine final : public Engine {
  public:
    CpuEngine(const RunPlan& plan, dist::Communicator& comm);
    ~CpuEngine() override;

    std::string describe() const override;
    // The whole model (a stage's or a shard's view gathers the rest; under LoRA the frozen base,
    // written before weights_loaded()).
    ModelWeights weights() override;
    OptimizerState& optimizer() override;
    ActFormat arena_format() const override { return cpu_arena_format(model_); }
    // LoRA: a QLoRA base is complete, the model is built over it. 2BW: the shadow starts again
    // from the new weights.
    void weights_loaded() override;
    CheckpointModel checkpoint_model() override;
    void set_remat(const RematPlan& plan) override;
    const RematPlan& remat_plan() const override { return remat_; }
    void prepare_update(double lr, double max_norm) override;
    void begin_step() override;
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                          float grad_scale, bool last) override;
    StepResult finish_step(double lr, double max_norm) override;
    void set_dropout_rows(uint64_t first) override { dropout_rows_ = first; }
    // Over the ZeroStore (one process, DDP, ZeRO 1-3): each rank counts its owned range.
    bool has_gradient_histograms() const override {
        return zero_ && !pipelined() && !tp_ && !in_backward();
    }
    std::vector<TensorHistogram> gradient_histograms() override;
    void record_activation_histograms() override;
    std::vector<TensorHistogram> activation_histograms() override;
    double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) override;
    void forward_logits(const int32_t* inputs, int B, int T, float* out) override;
    MemoryTracker& memory() override { return host_memory(); }
    std::string memory_title() const override;
    std::vector<MemoryPrediction> predicted_memory(int B, int T) const override;
    std::string memory_footer() const override;
    // Pipelines: pipeline_timeline.svg, the last step as it ran, one row per rank.
    std::string write_run_files(const std::string& out_dir) override;

    // What the techniques made of the model (tests, reports).
    // Chunk c's model: the whole model, this rank's tensor-parallel shard, or a pipeline rank's
    // chunk c (virtual stage c * stages() + stage()). Under LoRA, built by weights_loaded().
    GPT& model(int c = 0);
    int chunks() const { return (int)chunks_.size(); }
    // Data parallelism over a whole model (or LoRA's adapters); fails on the other layouts.
    dist::ZeroStore& zero_store();
    // LoRA's adapters.
    const LoraLayout& lora_layout() const { return lora_layout_; }
    // Tensor parallelism: the layouts of the whole model and of this shard, the group with its
    // collective counters, and its collectives during the last step (begin_step to finish_step).
    const dist::TpLayout& tp_layout() const { return tpl_; }
    dist::TpGroup& tp_group();
    const dist::TpGroup::Counts& last_step_counts() const { return step_counts_; }
    // Tensor parallelism alone: this rank's shard of the parameters and gradients, in
    // tp_layout().local order.
    float* local_params();
    float* local_grads();

    // Pipelines (and tensor-parallel groups side by side, a pipeline of one stage): this rank's
    // stage and the pipeline's, the stage's store, the executor, the weight versions, the
    // timeline. Each fails on a layout without them.
    int stage() const;
    int stages() const { return plan_.mesh.pp; }
    const pp::StageSplit& split() const { return split_; }  // per virtual stage
    pp::StageStore& stage_store();
    pp::Executor& pipeline();
    pp::WeightVersions& weight_versions();
    const pp::Timeline& timeline() const;
    // Activation slots this rank allocates: the micro-batches it holds at once under the
    // schedule (GPipe m, 1F1B min(p - s, m)); interleaved, the sum over its chunks of each
    // chunk's most micro-batches in flight (chunk_slots), which peak at different times.
    int slots() const;
    int chunk_slots(int c) const { return chunks_.at(c)->slots(); }
    // Which pipeline this rank belongs to, and how many run side by side.
    int replica() const;
    int replicas() const { return plan_.mesh.dp; }
    // The floats of the stage's range this rank's optimizer updates: the whole range, or under
    // ZeRO-1 its piece [offset, offset + count) counted from the range's begin.
    dist::ShardRange update_range() const;

  private:
    // The construction, in the order the techniques apply (see the file's comment).
    void apply_tensor_parallel();
    void apply_pipeline();
    void apply_lora();
    void apply_data_parallel();
    // Gives every chunk model.dropout's seed (once the chunks exist, and again when LoRA
    // rebuilds them).
    void seed_dropout();
    // The ends of a step: over a ZeroStore (DDP, ZeRO, LoRA's adapters); over one
    // tensor-parallel shard; over pipeline stages (PipeDream: its update per micro-batch).
    StepResult finish_zero_step(double lr, double max_norm);
    StepResult finish_shard_step(double lr, double max_norm);
    StepResult finish_stage_step(double lr, double max_norm);
    // The global norm of a stage's gradients g (the range's, or its ZeRO-1 piece): each unit's
    // sum of squares where it lives (per replica piece, per tensor-parallel shard), added in a
    // fixed order on every rank (a collective of the job).
    double stage_grad_norm(const float* g);
    // One update of the stage's owned range by g, and the replicas' all-gather of its pieces.
    void update_stage(float* g, double lr);
    // Sequence parallelism: the norm weights' gradients summed over the tensor-parallel group.
    void sum_sequence_partial_grads();
    bool pipelined() const { return exec_ != nullptr; }
    // optim.step_in_backward: the last micro-batch's backward updates the ZeroStore's units
    // (after a norm pass when clipping), and finish_step reports what it did.
    bool in_backward() const { return plan_.cfg.optim.step_in_backward; }
    double clip_norm_state() const override { return previous_norm_; }
    void restore_clip_norm(double norm) override { previous_norm_ = norm; }
    void last_backward_with_update(const int32_t* inputs, const int32_t* targets, int B, int T,
                                   float grad_scale);
    // LoRA's frozen base: fp32, or the packed QLoRA store.
    UnitStore& base();
    // The stage's memory rows (pipelines), from what it allocated.
    std::vector<MemoryPrediction> stage_memory(int B, int T) const;
    std::string chunk_blocks() const;  // "0..1" or, interleaved, "0..1, 4..5"

    RunPlan plan_;
    dist::Communicator& world_;
    // The mesh's groups (pipelines, the stages' replicas, the stages' shards); empty unless the
    // plan runs the mesh.
    dist::MeshGroups groups_;
    // Tensor parallelism: this rank's shard (model_ is then the shard's config) and its group.
    std::unique_ptr<dist::TpGroup> tp_;
    dist::TpLayout tpl_;
    ModelConfig model_;
    ParamLayout layout_;  // model_'s: the whole model's, or the shard's
    // Pipelines: the split of the whole model, this rank's units, the schedule's pieces.
    pp::StageSplit split_;
    std::unique_ptr<pp::StageStore> stages_;
    std::unique_ptr<pp::Timeline> timeline_;
    std::unique_ptr<pp::WeightVersions> versions_;
    std::unique_ptr<pp::Executor> exec_;
    // LoRA: the adapters' layout and the QLoRA base (written through quant_writer_, one unit of
    // fp32 at a time, until weights_loaded()).
    LoraLayout lora_layout_;
    std::unique_ptr<quant::QuantizedParamStore> quant_base_;
    std::unique_ptr<quant::QuantizedStoreWriter> quant_writer_;
    // Where a whole model's units live: the trainable states in a ZeroStore (data parallelism),
    // or whole in full_ (a tensor-parallel shard; LoRA's fp32 base).
    std::unique_ptr<dist::ZeroStore> zero_;
    std::unique_ptr<FullUnitStore> full_;
    // Tensor parallelism alone under optim.master = "none": the shard's bf16 weights in a
    // ZeroStore of its own (a world of one, stage 0), rounding with the whole model's indices.
    dist::LocalCommunicator shard_comm_;
    std::unique_ptr<dist::ZeroStore> shard16_;
    // Tensor parallelism alone: where the shard lives (full_, or shard16_).
    UnitStore& shard_store();
    // LoRA: the adapters' dropout and arithmetic, over their ZeroStore.
    std::unique_ptr<LoraAdapters> lora_;
    // Pipelines: the stage's gradients across its replicas.
    std::unique_ptr<dist::ReplicaSync> replicas_;
    std::vector<std::unique_ptr<GPT>> chunks_;
    uint64_t dropout_rows_ = 0;  // set_dropout_rows, for the next forward_backward
    // The optimizer over what this rank updates (one part per pipeline chunk), and the views of
    // the whole model a stage or shard shows (null where the model's own store is the view).
    // Muon under ZeRO 1-3: the matrices the shards cut, gathered whole (before opt_, which
    // holds it).
    std::unique_ptr<dist::ShardTensorGather> gather_;
    std::unique_ptr<dist::ReplicaMatrixShare> share_;  // Muon under DDP
    // Muon and Adafactor under tensor parallelism: the sliced tensors, gathered whole.
    std::unique_ptr<dist::TpTensorGather> tp_gather_;
    std::unique_ptr<RangeOptimizers> opt_;
    std::unique_ptr<OptimizerState> opt_view_;
    std::unique_ptr<WeightWindow> window_;
    RematPlan remat_;
    // optim.step_in_backward: the step's update (prepare_update) and the norm it measured.
    double update_lr_ = 0, update_max_norm_ = 0, update_norm_ = 0;
    double previous_norm_ = 0;  // the last step's global gradient norm (previous-norm clipping)
    bool update_prepared_ = false;
    double loss_sum_ = 0;
    int micro_batches_ = 0;
    int64_t steps_ = 0;
    ActivationHistograms act_hist_;  // train.diagnostics = amp, while recording
    dist::TpGroup::Counts step_counts_;
};

}  // namespace memtrain
