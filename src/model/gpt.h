// The GPT model on the CPU: parameters in one flat buffer, an explicit forward and backward per
// block, and a `BlockSaved` struct per block holding what backward needs. No tape: the forward
// fills the structs, the backward reads them, and what exists is placed by `plan_arena`
// (model/activation_layout.h), the one function that both sizes the allocation and reports its
// bytes. Activation
// checkpointing is a per-block `BlockKeep` plan (chosen in remat/) that this file obeys.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/log2_histogram.h"
#include "core/rng.h"
#include "kernels/cpu/gemm.h"
#include "kernels/dropout_mask.h"
#include "model/activation_layout.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/param_layout.h"
#include "model/unit_store.h"
#include "model/unit_walk.h"
#include "model/weights.h"

namespace memtrain {

class TpComm;

// What one block's forward keeps for its backward. Shapes for a micro-batch of B x T, with
// QKV = ModelConfig::qkv_dim(), F = fc_dim(), H = mlp_hidden() (GPT-2: 3C, 4C, 4C).
// Fields a config does not need are null and take no bytes (rmsnorm keeps no mean).
struct BlockSaved {
    float* ln1;        // (B,T,C)   ln_1 output
    float* ln1_mean;   // (B,T)     layernorm only
    float* ln1_rstd;   // (B,T)
    float* qkv;        // (B,T,QKV) q and k after rope when positions = "rope"
    float* att;        // (B,NH,T,T) softmax probabilities
    float* atty;       // (B,T,C)   attention output before c_proj
    float* resid_mid;  // (B,T,C)   x + attn(ln_1(x))
    float* ln2;        // (B,T,C)
    float* ln2_mean;   // (B,T)     layernorm only
    float* ln2_rstd;   // (B,T)
    float* fch;        // (B,T,F)   c_fc output (pre-activation; [gate | up] for swiglu)
    float* fch_act;    // (B,T,H)   GELU(fch), or silu(gate) * up
};

// train.diagnostics = amp: a training step's activations, counted by power of two per block
// while a GPT holds a pointer to it: each block's output (the residual stream it hands on) and
// the gradient of each block's input (what its backward hands down).
struct ActivationHistograms {
    std::vector<Log2Histogram> outputs, input_grads;  // one per block of the model
};

class GPT {
  public:
    // Parameters and gradients live in a UnitStore: by default one of the model's own that keeps
    // them whole (FullUnitStore); a data-parallel run passes its sharding store, which must
    // outlive the model.
    explicit GPT(const ModelConfig& cfg, UnitStore* store = nullptr);
    // A pipeline stage: only blocks [first_block, end_block) of the model, with the embedding
    // when first_block is 0 and the head (ln_f, classifier, loss) when end_block is n_layer. The
    // store must back the units the stage uses (parallel/pipeline/stage_store.h); unit numbers stay
    // the whole model's.
    GPT(const ModelConfig& cfg, UnitStore* store, int first_block, int end_block);
    GPT(const GPT&) = delete;
    GPT& operator=(const GPT&) = delete;

    const ModelConfig& config() const { return cfg_; }
    const ParamLayout& layout() const { return layout_; }
    std::size_t num_params() const { return layout_.total; }
    UnitStore& store() { return *store_; }
    // The whole flat buffers; an Error if the store shards them (ZeRO-3 parameters, ZeRO-2/3
    // gradients), where callers go unit by unit through store() instead.
    float* params();
    const float* params() const;
    float* grads();

    // The weights through the model's store (initialisation, import, checkpoints).
    ModelWeights weights() { return ModelWeights{*store_, layout_, cfg_}; }
    // init_gpt2_weights (weights.h) on this model.
    void init_weights(uint64_t seed);
    void zero_grads() { store_->zero_grads(); }

    // Forward, loss and backward of one micro-batch. Gradients accumulate; the loss gradient of
    // every token is `grad_scale` (1 / tokens in the whole batch). Returns the mean loss.
    float forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                           float grad_scale);
    // Mean loss only (evaluation).
    float forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T);
    // Logits over the real vocabulary: out (B,T,V).
    void forward_logits(const int32_t* inputs, int B, int T, float* out);

    // model.dropout (config().dropout > 0) in forward_backward and a pipeline's training
    // forwards (train_next_forward) only, never in forward_loss, forward_logits or evaluation. The
    // masks are hashes (kernels/dropout_mask.h) of the seed, each sequence's ordinal in the run and
    // the site (the embedding output, and per block the attention probabilities and the two
    // residual branches), so nothing is stored and a recompute or a second pass draws the same.
    // set_dropout_rows gives the ordinal of the next forward_backward's first sequence (its row b
    // is that + b).
    void set_dropout_seed(uint64_t seed) { drop_seed_ = seed; }
    void set_dropout_rows(uint64_t first) { drop_first_ = first; }
    // A pipeline stage's training forward (parallel/pipeline/executor.cpp): the next
    // stage_forward drops, keyed by `first`, and its slot keeps that for the backward.
    void train_next_forward(uint64_t first) {
        set_dropout_rows(first);
        train_pass_ = true;
    }

    // Activation checkpointing: what each block keeps (size n_layer, or empty = keep all).
    // Takes effect at the next forward; the arena is re-sized to activation_layout(plan).
    void set_remat(const RematPlan& plan);
    const RematPlan& remat_plan() const { return plan_; }

    // LoRA (model/lora.h): adapters beside the block linears, from their own store, and the
    // base frozen: backward then computes the input gradients and the adapters' gradients only,
    // never asking the base store for gradients. Null turns it off. Not with a split backward.
    void set_lora(LoraAdapters* lora);
    bool frozen_base() const { return lora_ != nullptr; }

    // Tensor parallelism (parallel/tensor/tp.h): this model is one shard of config().tp ranks
    // (built from dist::tp_shard_config) and `tp` their group (model/tp_comm.h), which must
    // outlive the model. The forward
    // and backward then run the group's all-reduces (2 per block each way, the
    // vocabulary-parallel embedding and loss); every rank calls the same entry points with the
    // same tokens. A whole model or a pipeline stage, without LoRA or split backward.
    // With config().sequence_parallel the residual stream and norms hold this rank's
    // config().sp_rows(B*T) token rows and the all-reduces become all-gathers and
    // reduce-scatters (parallel/tensor/tp.h); the norm weights' gradients are then this rank's
    // rows' part, which the engine sums over the group once per step.
    void set_tp(TpComm* tp);

    // Pipeline stages (parallel/pipeline/executor.h). A stage holds up to slots() micro-batches
    // between their forward and their backward, each in an activation arena of its own (the
    // workspace is shared). One micro-batch through a stage:
    //   stage_input(slot)   (not the first stage) receive the previous stage's output here
    //   stage_forward(slot)
    //   stage_output(slot)  (not the last stage) send this on
    //   stage_grad()        (not the last stage) receive d(output) here
    //   stage_backward(slot)
    //   stage_grad()        (not the first stage) now d(input): send it back
    // A whole model is the stage [0, n_layer) with one slot: forward_backward is exactly
    // stage_forward then stage_backward, so both run the same kernels on the same inputs.
    int first_block() const { return b0_; }
    int end_block() const { return b1_; }
    bool has_embedding() const { return b0_ == 0; }
    bool has_head() const { return b1_ == cfg_.n_layer; }
    void set_slots(int k);
    int slots() const { return nslots_; }
    // Sizes the arenas for micro-batches of B x T (a no-op when they already are).
    void prepare(int B, int T) { ensure_arena(B, T); }
    float* stage_input(int slot) { return slots_.at(slot).resid.front(); }
    const float* stage_output(int slot) const { return slots_.at(slot).resid.back(); }
    float* stage_grad() { return dres_; }
    // Forward of the stage's blocks (the embedding of `inputs` first on the first stage; ln_f
    // last on the last, which then holds the head unit acquired until stage_backward or
    // stage_loss releases it).
    void stage_forward(int slot, const int32_t* inputs, int B, int T);
    // Backward of the micro-batch in `slot`; on the last stage the loss of `targets` first
    // (returns the mean loss; 0 on other stages).
    float stage_backward(int slot, const int32_t* inputs, const int32_t* targets, int B, int T,
                         float grad_scale);
    // Zero-bubble schedules split a stage's backward in two: stage_backward_input (I) does
    // everything stage_backward does except the blocks' weight-gradient GEMMs and bias sums,
    // keeping their output gradients in the slot, and stage_backward_weight (W) runs them later;
    // together they give stage_backward's bits. Needs set_split_backward(true), and no remat
    // (a recomputed field would be gone by W).
    void set_split_backward(bool on);
    bool split_backward() const { return split_; }
    float stage_backward_input(int slot, const int32_t* inputs, const int32_t* targets, int B,
                               int T, float grad_scale);
    void stage_backward_weight(int slot, int B, int T);
    // Floats one block keeps for its pending weight gradients, and bytes per slot (0 without the
    // split).
    std::size_t wgrad_floats(int B, int T) const;
    // Counts the training passes' block outputs and input gradients into `h` (sized here) until
    // set again to null; evaluation passes are not counted.
    void set_activation_histograms(ActivationHistograms* h);
    std::size_t split_backward_bytes(int B, int T) const;
    // The last stage, after stage_forward, without backward: the mean loss, or the logits.
    float stage_loss(int slot, const int32_t* targets, int B, int T);
    void stage_logits(int slot, int B, int T, float* out);
    // Bytes of one slot's activation arena and of the shared workspace for B x T.
    ArenaPlan stage_arena(int B, int T) const;

    static constexpr int kLossChunk = 256;  // rows of logits alive at once
    // How this model lays out its arenas (fp32, the attention probabilities or their
    // log-sum-exp, kLossChunk).
    ActFormat arena_format() const { return cpu_arena_format(cfg_); }

  private:
    // What one in-flight micro-batch keeps: its residual streams (the stage's blocks + 1),
    // saved fields and ln_f output, in an arena of its own.
    struct Slot {
        Buffer<float> acts;         // MemCategory::Activations
        Buffer<float> wgrad;        // split backward: each block's d(mlp c_proj out), d(c_fc out),
                                    // d(attn c_proj out), d(qkv) until W (Activations)
        std::vector<float*> resid;  // blocks() + 1 residual streams (B,T,C)
        std::vector<float*> held;   // hold slots of rebuilt Segment inputs (ArenaPlan::held)
        std::vector<BlockSaved> saved;  // dropped fields point into the recompute scratch
        // ModelConfig::cpu_bf16: every block's BlockSaved points into the fp32 working block
        // (statistics it keeps excepted), and its kept activations wait here in bf16 (null:
        // dropped) between its forward (stored as round_saved rounds them) and its backward
        // (unstash).
        std::vector<std::array<void*, kSavedFields>> stored;
        float *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr;
        // The micro-batch's dropout (p = 0: none), its site left to each use (dropout_at).
        DropoutMask drop;
    };
    // The slot's mask at `site`: 0 the embedding, 1 + 3l + k block l's attention probabilities
    // (k = 0), attention branch (1) and MLP branch (2). Null when the slot drops nothing.
    static const DropoutMask* dropout_at(const Slot& sl, DropoutMask& m, uint64_t site) {
        if (!sl.drop.on()) return nullptr;
        m = sl.drop;
        m.site = site;
        return &m;
    }
    int blocks() const { return b1_ - b0_; }
    void ensure_arena(int B, int T);
    // ln_f's output for the classifier: the slot's, or under sequence parallelism every rank's
    // rows all-gathered into sp_.
    const float* head_input(const Slot& sl, int N);
    void require_whole(const char* what) const;
    // The output embedding's weights (lm_head, or wte when tied), acquired; and its release.
    const float* acquire_output_embedding(const HeadParams& head);
    void release_output_embedding();
    // `l` is the block's number in the model; `adapter` its LoRA unit (null without LoRA); `sl`
    // the slot whose block this is (its saved fields and its dropout).
    // With mlp = false under ModelConfig::mlp_tile the MLP is skipped (and `out` not written): a
    // recompute before the block's backward, which makes the MLP's tiles itself.
    void block_forward(const BlockParams& p, int l, const float* adapter, const float* x,
                       float* out, Slot& sl, int B, int T, bool mlp = true);
    // With `defer` (room for the block's four output gradients, split backward), the
    // weight-gradient halves are skipped and their inputs copied there for block_weight_grads.
    void block_backward(const BlockParams& p, BlockParams& g, int l, const float* adapter,
                        float* adapter_grads, float* dres, const float* x, const Slot& sl, int B,
                        int T, float* defer = nullptr);
    // The adapters of block l on `linear`: y += their output; dx += their input gradient (and
    // their own gradients into `grads`).
    // (row0: the first of the N rows in the micro-batch, which LoRA's dropout masks index.)
    void lora_forward(int l, BlockLinear linear, const float* adapter, const float* x, float* y,
                      int N, int64_t row0 = 0);
    void lora_backward(int l, BlockLinear linear, const float* adapter, float* grads,
                       const float* x, const float* dy, float* dx, int N, int64_t row0 = 0);
    void block_weight_grads(BlockParams& g, const BlockSaved& s, const float* deferred, int B,
                            int T);
    // The backward along walk_.backward, and its parts: the loss and ln_f (returns the loss
    // sum), one block, the embedding.
    float backward_pass(int slot, const int32_t* inputs, const int32_t* targets, int B, int T,
                        float grad_scale, bool split);
    double head_backward(const UnitVisit& v, Slot& sl, const int32_t* targets, int B, int T,
                         float grad_scale);
    void block_backward_part(const UnitVisit& v, Slot& sl, int B, int T, bool split);
    void embedding_backward(const UnitVisit& v, const Slot& sl, const int32_t* inputs, int B,
                            int T);
    // What block v.block re-runs before its backward (v.redo), into its saved fields, from its
    // input x.
    void redo(const UnitVisit& v, const BlockParams& p, const float* adapter, const float* x,
              Slot& sl, int B, int T);
    // Block l's input for its backward: its kept stream, or (Segment, Dropped) the one
    // rebuild_ says, re-running the forward of the blocks below it first where needed.
    const float* block_input(int l, Slot& sl, int B, int T);
    // UnitStore::prefetch of the walk's next unit (-1: none).
    void announce(int u) {
        if (u >= 0) store_->prefetch(u);
    }
    void recompute_selective(const BlockParams& p, const float* x, BlockSaved& s, int B, int T);
    // ModelConfig::mlp_tile: block l's ln_2 and MLP over row tiles, in the forward (ln_2, c_fc,
    // the activation, mlp.c_proj and the residual into `out`, then the branch's dropout) and the
    // backward (each tile's ln_2 output, c_fc output and activation read where the block keeps
    // them, else recomputed into the tile-sized scratch from the residual stream; d(ln_2) into
    // dln_, the weight gradients summed tile by tile). The same tiles in every pass, so every
    // remat policy gives the same bits.
    void mlp_forward_tiled(const BlockParams& p, int l, const float* adapter, BlockSaved& s,
                           float* out, Slot& sl, int B, int T);
    // Rows [r0, r0 + rows)'s ln_2 output, c_fc output and activation: in block l's fields where
    // it keeps them, else in the tile-sized scratch. The forward makes all three, the backward
    // (forward = false) the ones the block does not keep: one function, so the calls and the
    // bits agree.
    struct MlpTile {
        float *ln2, *fch, *act;
    };
    MlpTile mlp_tile(const BlockParams& p, int l, const float* adapter, const Slot& sl, int r0,
                     int rows, bool forward);
    // Rows [r0, r0 + rows) of block l's ln_1 output (x: the block's input), as mlp_tile's
    // fields: c_attn reads it a tile at a time in the forward and in its weight gradient.
    const float* ln1_tile(const BlockParams& p, int l, const Slot& sl, const float* x, int r0,
                          int rows, bool forward) const;
    // One tiled field's rows: made by make(tile) (and rounded as the saved fields are) in the
    // forward or where block l does not keep the field, else read from the field (or its
    // compressed store); a kept field's rows are stored as the forward makes them.
    template <class Make>
    float* tile_field(const Slot& sl, int l, SavedField f, float* field, int width, int r0,
                      int rows, bool forward, Make make) const;
    void mlp_backward_tiled(const BlockParams& p, BlockParams& g, int l, const float* adapter,
                            float* adapter_grads, const Slot& sl, const float* dout, int N);
    // ModelConfig::cpu_bf16: a saved field rounded to bf16 in place where it is made, so the
    // forward's own later reads, the backward and any recompute see the same values (no-op in
    // fp32); block i's kept activations stored as bf16 or int8 as they are rounded and decoded
    // into the working block before its backward (unstash).
    // With `stored` (the block's stores, in the forward), a kept field is stored as it is rounded.
    void round_saved(const BlockSaved& s, SavedField f, void* const* stored = nullptr) const;
    void unstash(Slot& sl, int i) const;
    // n values rounded as the store format rounds them; values [begin, begin + n) of field f
    // into its store and back (a whole field, or a tile of a tiled one); both at once.
    void round_part(float* x, std::size_t n) const;
    void round_store_part(float* x, void* store, SavedField f, std::size_t begin,
                          std::size_t n) const;
    void load_part(float* x, const void* src, SavedField f, std::size_t begin, std::size_t n) const;
    // LayerNorm or RMSNorm per the config (mean and bias unused by RMSNorm).
    void norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                      const float* b, int N) const;
    void norm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                       const float* w, const float* mean, const float* rstd, int N) const;
    void act_forward(float* out, const float* inp, int N) const;
    // TP: the first vocabulary row this rank holds (0 without TP).
    int vocab_begin() const;
    // out (N,C) = resid + (out + bias), after a row-parallel GEMM's all-reduce (bias may be null).
    void add_residual_bias(float* out, const float* resid, const float* bias, int N) const;
    // Block l of the model (l in [b0_, b1_)).
    BlockKeep keep(int l) const { return plan_.empty() ? BlockKeep::All : plan_[l - b0_]; }

    ModelConfig cfg_;
    ParamLayout layout_;
    std::unique_ptr<FullUnitStore> own_store_;  // when no store was passed in
    UnitStore* store_;

    int b0_ = 0, b1_ = 0;  // the blocks this model runs
    int nslots_ = 1;
    bool split_ = false;
    int arena_B_ = 0, arena_T_ = 0;
    std::vector<Slot> slots_;
    Buffer<float> work_;    // MemCategory::Workspace, shared by the slots
    RematPlan plan_;        // one entry per block of the stage
    InputRebuild rebuild_;  // how the backward rebuilds the inputs plan_ drops
    UnitWalk walk_;         // the step's schedule over the units (model/unit_walk.h)
    LoraAdapters* lora_ = nullptr;
    TpComm* tp_ = nullptr;
    uint64_t drop_seed_ = 0, drop_first_ = 0;
    bool train_pass_ = false;  // inside forward_backward: its slot drops (model.dropout)
    ActivationHistograms* act_hist_ = nullptr;
    float *dres_, *dln_, *dbig_, *dact_, *logits_;
    // ModelConfig::cpu_bf16: where the GEMMs round their operands (in the workspace arena).
    cpu::Bf16Gemm gemm_{};
    const cpu::Bf16Gemm* bf16() const { return cfg_.cpu_bf16 ? &gemm_ : nullptr; }
    float* sp_ = nullptr;  // sequence parallelism: all N token rows (ArenaPlan::sp_gather)
    // Elements of each saved field at the arena's B x T (cpu_bf16's rounding, the stores, unstash).
    std::array<std::size_t, kSavedFields> field_elems_{};
    // Sequence parallelism on a micro-batch of N rows (ModelConfig::sp_rows < N).
    bool sp(int N) const { return tp_ && cfg_.sp_rows(N) != N; }
};

}  // namespace memtrain
