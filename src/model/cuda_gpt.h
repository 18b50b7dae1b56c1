// The GPT model on the GPU, op for op the CPU model (gpt.h) over the kernels of kernels/cuda,
// with activations, parameters and gradients stored as T (float, __nv_bfloat16 or __half; the
// fp32 master weights belong to the optimizer, cuda_engine.cpp). The arenas come from the same
// plan_arena as the CPU's (format ActFormat::cuda_model: T-sized activations, the attention
// log-sum-exp instead of its probabilities), so the remat policies, the solver and the memory
// report work unchanged. Everything of a step is queued on one stream; nothing waits for the GPU
// until the engine reads the step's results.
#pragma once

#if MEMTRAIN_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "model/activation_layout.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/param_layout.h"
#include "model/unit_walk.h"

namespace memtrain {

// Where the model's parameter units and their gradients live on the device: the device side of
// model/unit_store.h (units: the embedding, each block, the head). Without one, the model keeps
// both whole in flat buffers of its own; ZeRO-2/3 (parallel/data/device_zero.h) shards them and
// hands out gathered units and gradient buckets. Pointers are for work queued on the model's
// stream.
template <typename T>
class DeviceGradStore {
  public:
    virtual ~DeviceGradStore() = default;
    // Where this micro-batch's backward accumulates unit u's gradients, until grads_done(u);
    // acquiring a unit again before then gives the same place.
    virtual T* acquire_grads(int u) = 0;
    virtual void grads_done(int u) = 0;
};

template <typename T>
class DeviceUnitStore : public DeviceGradStore<T> {
  public:
    // Unit u's parameters, complete for the work queued from now until release_params(u).
    // Acquires of one unit nest.
    virtual T* acquire_params(int u) = 0;
    virtual void release_params(int u) = 0;
    // Unit u is the next to be acquired: start bringing it (nothing if it is there already).
    virtual void prefetch_params(int u) = 0;
};

template <typename T>
class CudaLora;  // model/cuda_lora.h

template <typename T>
class CudaGPT {
  public:
    // One block's parameters or gradients (model/param_layout.h), inside its unit.
    using Block = BasicBlockParams<T>;

    // Parameters and gradients are allocated for padded_total >= the layout's total elements
    // (data parallelism pads the flat buffer to equal shards); the padding stays zero. With
    // `units`, the model allocates neither and reaches both through the store (ZeRO-2/3, or a
    // QLoRA base); params() and grads() are then null. With `lora`, the base is frozen (no
    // gradients are allocated or computed: backward gives input gradients only) and the
    // adapters run beside the block linears, their gradients accumulating in `lora`'s buffer.
    // With `grads` (optim.step_in_backward) the parameters are whole but the gradients go
    // through that store unit by unit (grads() is null).
    CudaGPT(const ModelConfig& cfg, cudaStream_t stream, std::size_t padded_total = 0,
            DeviceUnitStore<T>* units = nullptr, CudaLora<T>* lora = nullptr,
            DeviceGradStore<T>* grads = nullptr);
    CudaGPT(const CudaGPT&) = delete;
    CudaGPT& operator=(const CudaGPT&) = delete;
    ~CudaGPT();

    const ModelConfig& config() const { return cfg_; }
    const ParamLayout& layout() const { return layout_; }
    T* params() { return params_.data(); }
    T* grads() { return grads_.data(); }
    static ActFormat arena_format(const ModelConfig& cfg, int B, int T_);

    void set_remat(const RematPlan& plan);
    const RematPlan& remat_plan() const { return plan_; }
    void zero_grads();

    // One micro-batch on host token ids: the ids (and the embedding backward's token order) are
    // copied to the device, forward, loss and backward are queued. Gradients accumulate; every
    // token's loss gradient is grad_scale. The sum of this micro-batch's token losses goes to
    // *loss_sum (device double).
    void forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                          float grad_scale, double* loss_sum);
    // Forward and loss only; the sum of the token losses to *loss_sum (device).
    void forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_,
                      double* loss_sum);
    // Logits over the real vocabulary into host memory: out (B,T,V). Waits for the stream.
    void forward_logits(const int32_t* inputs, int B, int T_, float* out);

    // A pipeline stage (engine/cuda/cuda_pipeline_engine.cpp): only blocks [first_block,
    // end_block), with the embedding when first_block is 0 and ln_f, the classifier and the loss
    // when end_block is n_layer, holding up to `slots` micro-batches between their forward and
    // backward, each in an activation arena of its own (plan_stage_arena; the workspace is
    // shared). The units it uses come from `units` (the stage's store). Set before the first
    // forward; not with offload remat or CUDA graphs. One micro-batch through a stage:
    //   stage_input(slot)   (not the first stage) the previous stage's output goes here
    //   stage_forward(slot)
    //   stage_output(slot)  (not the last stage) send this on
    //   stage_grad()        (not the last stage) d(output) goes here
    //   stage_backward(slot)
    //   stage_grad()        (not the first stage) now d(input): send it back
    // The whole model is the stage [0, n_layer) with one slot: forward_backward runs the same
    // kernels in the same order as stage_forward then stage_backward.
    void set_stage(int first_block, int end_block, int slots);
    int first_block() const { return b0_; }
    int end_block() const { return b1_; }
    int slots() const { return (int)slots_.size(); }
    bool has_embedding() const { return b0_ == 0; }
    bool has_head() const { return b1_ == cfg_.n_layer; }
    // Sizes the arenas for micro-batches of B x T (a no-op when they already are).
    void prepare(int B, int T_) { ensure_arena(B, T_); }
    T* stage_input(int slot) { return slots_.at(slot).resid[b0_]; }
    const T* stage_output(int slot) const { return slots_.at(slot).resid[b1_]; }
    T* stage_grad() { return dres_; }
    // The stage's forward of one micro-batch into `slot` (host token ids: the first stage embeds
    // the inputs; the last keeps the targets for its loss).
    void stage_forward(int slot, const int32_t* inputs, const int32_t* targets, int B, int T_);
    // Its backward (the last stage's loss first: the sum of its token losses to *loss_sum), the
    // gradients accumulating in the store's units.
    void stage_backward(int slot, int B, int T_, float grad_scale, double* loss_sum);
    // The last stage after stage_forward, without backward: the loss sum, or the logits (host).
    void stage_loss(int slot, int B, int T_, double* loss_sum);
    void stage_logits(int slot, int B, int T_, float* out);
    // Bytes of one slot's activation arena and of the shared workspace for B x T.
    ArenaPlan stage_arena(int B, int T_) const;

    // Bytes of the device buffers for host token ids (inputs, targets, embedding plan), and of
    // the CUDA graph's loss slot.
    static std::size_t token_bytes(int B, int T_);
    static constexpr std::size_t kGraphBytes = sizeof(double);
    // train.remat = offload: bytes of block inputs waiting in pinned host memory (0 otherwise).
    std::size_t offloaded_bytes() const { return offload_bytes_; }

    // Replays each micro-batch's forward and backward as one captured CUDA graph (train.
    // cuda_graphs): the launch overhead of a few hundred kernels becomes one launch. A new
    // capture is made when the shape, the remat plan or the gradient scale changes.
    void set_cuda_graphs(bool on);
    int64_t graph_replays() const { return graph_replays_; }

    // Called (on the host, in stream order) as soon as backward has queued the last write to a
    // parameter unit's gradients (ParamLayout units: the head after ln_f, each block, the
    // embedding last): data parallelism starts that unit's all-reduce there, overlapping the
    // backward of the units below. Null: nothing is called.
    void set_grads_done_hook(std::function<void(int unit)> hook) { grads_done_ = std::move(hook); }
    // How the host waits for the stream (default cudaStreamSynchronize): data parallelism waits
    // through its communicator, which fails fast on a dead peer instead of hanging.
    void set_waiter(std::function<void(const char* what)> waiter) { waiter_ = std::move(waiter); }

  private:
    struct Saved {  // one block's saved fields (see activation_layout.h), T or fp32
        T* ln1;
        float *ln1_mean, *ln1_rstd;
        T* qkv;
        float* lse;
        T *atty, *resid_mid, *ln2;
        float *ln2_mean, *ln2_rstd;
        T *fch, *fch_act;
    };
    // One micro-batch in flight: its activation arena, carved into the residual streams and
    // saved fields of blocks [b0_, b1_] (indexed by model block) and ln_f's output, and its
    // token ids on the device with the embedding backward's plan.
    struct Slot {
        DeviceBuffer<unsigned char> acts;
        std::vector<T*> resid;
        std::vector<T*> held;  // the hold slots of rebuilt inputs (memory-poor, chen:K)
        std::vector<Saved> saved;
        T* lnf = nullptr;
        float *lnf_mean = nullptr, *lnf_rstd = nullptr;
        DeviceBuffer<int32_t> tokens;
        int unique = 0;
    };
    // Points the working views (resid_, saved_, lnf_, tok_, unique_) at slot k.
    void use_slot(int k);
    // The backward along walk_.backward (the embedding's part only with `embedding`: a CUDA
    // graph captures the rest), and its parts: the head's loss and ln_f backward (dres_ then
    // holds d(last block's output)), one block, the embedding.
    void backward(int B, int T_, float grad_scale, double* loss_sum, bool embedding);
    void head_backward(const UnitVisit& v, int B, int T_, float grad_scale, double* loss_sum);
    void block_backward_part(const UnitVisit& v, int B, int T_);
    // Block l's input for its backward: its stream, or (a plan that rebuilds inputs) a hold slot
    // or the output of re-running the blocks below from the last input kept or held, with the
    // step forward's kernels and inputs, so the same bits (the CPU's GPT::block_input).
    const T* block_input(int l, int B, int T_);
    void embedding_backward(int B, int T_);
    // The walk of blocks [b0_, b1_) under plan_ (model/unit_walk.h).
    void make_walk();
    // plan_'s entries for blocks [b0_, b1_) (empty: every block keeps All).
    RematPlan stage_plan() const {
        return plan_.empty() ? RematPlan{} : slice_plan(plan_, b0_, b1_);
    }
    void loss_only(int B, int T_, double* loss_sum);
    void logits_out(int B, int T_, float* out);

    void ensure_arena(int B, int T_);
    // Forward, loss and backward down to (not including) the embedding backward, on the tokens
    // already on the device: what a CUDA graph captures.
    void step_body(int B, int T_, float grad_scale, double* loss_sum);
    void drop_graph();
    void upload_tokens(const int32_t* inputs, const int32_t* targets, int B, int T_);
    // Embedding, blocks and ln_f on the uploaded inputs. With offload_inputs (train.remat =
    // offload, before a backward) the block inputs that leave the residual ring are copied to
    // pinned host memory on the side stream.
    void forward(int B, int T_, bool offload_inputs = false);
    // Unit u's parameters and gradients: through the store, or in the whole buffers.
    T* unit_params(int u) {
        return units_ ? units_->acquire_params(u) : params_.data() + layout_.units[u].begin;
    }
    void unit_params_done(int u) {
        if (units_) units_->release_params(u);
    }
    void prefetch(int u) {  // -1: the walk announces nothing
        if (units_ && u >= 0) units_->prefetch_params(u);
    }
    T* unit_grads(int u) {
        return grad_units_ ? grad_units_->acquire_grads(u) : grads_.data() + layout_.units[u].begin;
    }
    void unit_grads_done(int u);
    Block block_params(int l) {
        return block_at(block_off_[l], unit_params(layout_.block_unit(l)));
    }
    static T* tensor_at(T* unit_base, std::size_t offset) {
        return offset == SIZE_MAX ? nullptr : unit_base + offset;
    }
    bool frozen() const { return lora_ != nullptr; }
    void block_forward(const Block& p, int l, const T* x, T* out, const Saved& s, int B, int T_);
    void recompute_selective(const Block& p, const T* x, const Saved& s, int B, int T_);
    void block_backward(const Block& p, const Block& g, int l, const T* x, const Saved& s, int B,
                        int T_);
    void lora_forward(int l, BlockLinear k, const T* x, T* y, int N);
    void lora_backward(int l, BlockLinear k, const T* x, const T* dy, T* dx, int N);
    bool adapted(int l, BlockLinear k) const;
    void norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* w, const T* b,
                      int N);
    void norm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                       const float* mean, const float* rstd, int N);
    BlockKeep keep(int l) const { return plan_.empty() ? BlockKeep::All : plan_[l]; }

    ModelConfig cfg_;
    ParamLayout layout_;
    cudaStream_t stream_;
    DeviceUnitStore<T>* units_ = nullptr;
    DeviceGradStore<T>* grad_units_ = nullptr;  // units_, or the gradients' own store
    CudaLora<T>* lora_ = nullptr;
    DeviceBuffer<T> params_, grads_;  // whole, without a store (no grads_ when frozen)
    // Tensor offsets inside their units: each block's, wte and wpe in the embedding, ln_f in the
    // head, and the output embedding in lm_unit_ (the head's lm_head, or wte when tied).
    std::vector<BlockOffsets> block_off_;
    std::size_t off_wte_ = 0, off_wpe_ = 0, off_lnf_w_ = 0, off_lnf_b_ = 0, off_lm_ = 0;
    int lm_unit_ = 0;

    RematPlan plan_;
    UnitWalk walk_;        // the step's schedule over the units (model/unit_walk.h)
    int b0_ = 0, b1_ = 0;  // the blocks this model runs: all of them unless a pipeline stage
    bool staged_ = false;  // set_stage was called
    int arena_B_ = 0, arena_T_ = 0, chunk_ = 0;
    std::vector<Slot> slots_;  // one, unless a pipeline stage holds several micro-batches
    DeviceBuffer<unsigned char> work_;
    std::vector<T*> resid_;     // the current slot's, by model block
    InputRebuild rebuild_;      // the plan's rebuilds of dropped block inputs
    std::vector<Saved> saved_;  // the current slot's, by model block
    T *lnf_ = nullptr, *dres_ = nullptr, *dln_ = nullptr, *dbig_ = nullptr, *dact_ = nullptr,
      *logits_ = nullptr;
    float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr, *row_loss_ = nullptr, *att_delta_ = nullptr;

    // Token ids on the device (the current slot's): [inputs (N) | targets (N) | embedding plan
    // (N + 2U + 1)], copied from one of two pinned host buffers (the other may still be read by
    // a queued copy).
    int32_t* tok_ = nullptr;
    int32_t* pinned_[2] = {nullptr, nullptr};
    cudaEvent_t copied_[2] = {nullptr, nullptr};
    std::size_t pinned_ints_ = 0;
    int next_pinned_ = 0;
    int unique_ = 0;
    int cur_ = 0;  // the slot the views point at
    std::vector<int32_t> plan_host_;

    // Offload blocks (train.remat = offload, or chosen by budget:BYTES+offload): their inputs
    // share a device ring of ring_ slots; those that leave it wait in host memory. A side stream
    // copies them, and per-block events order the copies against the compute stream.
    int ring_ = 0;
    std::vector<int> offloaded_;  // the Offload blocks, in order
    std::vector<int> off_index_;  // per block: its index in offloaded_, or -1
    std::size_t offload_bytes_ = 0;
    unsigned char* host_resid_ = nullptr;  // pinned: the inputs that leave the ring, B x T x C each
    bool offloads() const { return !offloaded_.empty(); }
    // Whether block l's input leaves the device (an Offload block all but the last ring_ of).
    bool leaves_device(int l) const {
        return off_index_[l] >= 0 && off_index_[l] < (int)offloaded_.size() - ring_;
    }
    // The Offload block whose input had block l's ring slot before it (-1 if none).
    int slot_before(int l) const {
        const int i = off_index_[l];
        return i >= ring_ ? offloaded_[i - ring_] : -1;
    }
    cudaStream_t copy_stream_ = nullptr;
    std::vector<cudaEvent_t> produced_, to_host_, consumed_, to_device_;

    std::function<void(int unit)> grads_done_;
    std::function<void(const char* what)> waiter_;
    void wait(const char* what) {
        if (waiter_)
            waiter_(what);
        else
            MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }

    bool graphs_ = false, warmed_up_ = false;
    cudaGraphExec_t graph_exec_ = nullptr;
    int graph_B_ = 0, graph_T_ = 0;
    float graph_scale_ = 0;
    int64_t graph_replays_ = 0;
    DeviceBuffer<double> graph_loss_buf_;
    double* graph_loss_ = nullptr;  // the captured step's loss sum, copied out after each replay
};

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
