// Optimizers over the flat parameter buffer: AdamW (decoupled weight decay, bias correction,
// exactly torch.optim.AdamW's arithmetic) and SGD with momentum (torch.optim.SGD's), plus
// global-norm gradient clipping. Weight decay applies to the tensors the layout marks `decay`.
// The moments are stored in optim.state_format (optim/state_format.h); every format computes the
// update in fp32 with the same arithmetic, and differs only in what the moments round to between
// steps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"
#include "optim/state_format.h"

namespace memtrain {

class Optimizer;

// Whole tensors from pieces for an optimizer whose range cuts a tensor it steps whole (Muon's
// matrices under ZeRO 1-3, where a shard boundary falls inside a matrix). gather(tensor, piece,
// whole) is a collective of the ranks that hold part of layout tensor `tensor`: `piece` is this
// rank's elements of it (in order), `whole` receives the tensor's numel floats, every holder's
// piece at its place.
// Under tensor parallelism a layout tensor may itself be a slice of a whole tensor
// (ParamSpec::sliced(): its elements not contiguous in the whole); gather then assembles the
// whole from every rank's slice, and pick takes this rank's slice back out of it.
class TensorGather {
  public:
    virtual ~TensorGather() = default;
    virtual void gather(std::size_t tensor, const float* piece, float* whole) = 0;
    // This rank's elements of a sliced tensor, in its layout's order, from the whole tensor.
    virtual void pick(std::size_t tensor, const float* whole, float* piece);
    // Replicas that step the same whole matrices from the same gradients (Muon under DDP) can
    // share the work: owner(tensor) is the rank that orthogonalizes it for all of them, or -1
    // where every rank computes its own (the default); share(tensor, x) then hands the owner's
    // result (the tensor's numel floats at x on the owner) to every rank, in place. Every rank
    // calls share for each owned tensor of an update, in the layout's order.
    virtual int owner(std::size_t /*tensor*/) const { return -1; }
    virtual bool is_me(int rank) const { return rank < 0; }
    virtual void share(std::size_t tensor, float* x, int owner);
};

// What a checkpoint needs of an optimizer, wherever its state lives (host memory here, device
// memory in the CUDA engine): the range of the flat parameter buffer it covers, its step count,
// and its named state tensors of count floats each, laid out like the range.
class OptimizerState {
  public:
    // [offset, offset + count) of the flat parameter buffer.
    struct Range {
        std::size_t offset, count;
    };
    virtual ~OptimizerState() = default;
    virtual std::size_t offset() const = 0;
    virtual std::size_t count() const = 0;
    // The ranges of the parameter buffer the state covers, in increasing order; its tensors
    // (count() floats) are their concatenation. One range, [offset, offset + count), except on a
    // pipeline rank holding several chunks of the model (RangeOptimizers).
    virtual std::vector<Range> ranges() const { return {{offset(), count()}}; }
    virtual int64_t steps_taken() const = 0;
    virtual void set_steps_taken(int64_t t) = 0;
    virtual std::vector<std::string> state_names() = 0;
    // The tensor in host memory, or null where it lives elsewhere (then read_state copies it).
    virtual const float* host_state(const std::string& name) = 0;
    virtual void read_state(const std::string& name, float* dst /*(count)*/) = 0;
    // Whether read_state is a collective that every rank of the run must call (tensor
    // parallelism gathers the whole state from the ranks' shards); checkpoints then have every
    // rank read while one writes.
    virtual bool collective_read() const { return false; }
    // Writes floats [begin, begin + n) of the tensor.
    virtual void write_state(const std::string& name, std::size_t begin, std::size_t n,
                             const float* src) = 0;
    // After the last write_state of a load: a state stored in blocks (optim.state_format int8,
    // int4, bf16) is encoded from the written floats here, since a load may write a block in
    // pieces from several files.
    virtual void finish_writes() {}
    // The host optimizer of range k of ranges(), whose state a checkpoint can keep in its stored
    // form (Optimizer::save_stored); null where the state lives elsewhere or in views (the CUDA
    // engine's, tensor parallelism's): checkpoints then hold floats.
    virtual Optimizer* stored_part(std::size_t /*k*/) { return nullptr; }
};

// An optimizer updates the floats [offset, offset + count) of the flat parameter buffer: all
// of it in a single process, one rank's shard under ZeRO (each tensor's settings, such as weight
// decay, still apply to the part of it inside the range).
class Optimizer : public OptimizerState {
  public:
    // One update with learning rate lr; advances the internal step count. `params` and `grads`
    // point at the range's first float (count floats each).
    void step(float* params, const float* grads, double lr) {
        step_part(params, grads, lr, 0, count_);
        advance();
    }
    // The same update of floats [begin, begin + n) of the range only (the same bits as step()
    // gives them), so that an update can go piece by piece (ZeRO-Offload streams each unit to
    // the GPU as soon as it is updated; optim.step_in_backward updates each unit as its gradient
    // arrives); advance() once after the parts cover the range. `params` and `grads` point at
    // float `begin` of the range (n floats each).
    virtual void step_part(float* params, const float* grads, double lr, std::size_t begin,
                           std::size_t n) = 0;
    void advance() { t_++; }
    // Named moments over the range, in their storage format (for checkpoints).
    virtual std::vector<std::pair<std::string, MomentBuffer*>> moments() = 0;
    // The state's bytes in all (the moments', or Adafactor's factored rows and columns).
    virtual std::size_t state_bytes();
    int64_t steps_taken() const override { return t_; }
    void set_steps_taken(int64_t t) override { t_ = t; }
    std::size_t offset() const override { return offset_; }
    std::size_t count() const override { return count_; }

    // OptimizerState over moments(): fp32 states are read and written in place; the others are
    // decoded on read and staged as floats until finish_writes() encodes them.
    std::vector<std::string> state_names() override;
    const float* host_state(const std::string& name) override;
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;
    void finish_writes() override;
    Optimizer* stored_part(std::size_t k) override { return k == 0 ? this : nullptr; }

    // The stored form of a state tensor, as checkpoints keep it: its own bytes over the range
    // (compressed moments' codes and scales, Adafactor's factors, a masked moment's covered
    // floats), read and set whole. compact(): whether that is less than count floats a tensor.
    StateFormat state_format() const { return format_; }
    virtual std::size_t stored_bytes(const std::string& name);
    virtual void save_stored(const std::string& name, uint8_t* dst);
    virtual void load_stored(const std::string& name, const uint8_t* src);
    bool compact();

  protected:
    // (`category` is the subclass's to give its state: make_optimizer's.)
    Optimizer(const ParamLayout& layout, std::size_t offset, std::size_t count, StateFormat format);
    MomentBuffer& moment(const std::string& name);
    ParamLayout layout_;
    std::size_t offset_, count_;
    StateFormat format_;
    int64_t t_ = 0;
    // write_state's floats of a state stored in blocks, until finish_writes().
    std::vector<std::pair<std::string, std::vector<float>>> staged_;
};

// Bytes of the optimizer state make_optimizer allocates over [offset, offset + count) of the
// layout (every moment in cfg.state_format), and what they are, for the memory table:
// "Adam m, v", "Adam m, v in int8 (blocks of 256, fp32 scales; tensors < 4096 in fp32)".
std::size_t optimizer_state_bytes(const OptimConfig& cfg, const ParamLayout& layout,
                                  std::size_t offset, std::size_t count);
std::string describe_optimizer_state(const OptimConfig& cfg);

// The tensors optim.name = "muon" orthogonalizes: the blocks' 2-D matrices ("h.*" with two
// dimensions), per tensor of the layout; the others take AdamW's step.
std::vector<char> muon_matrices(const ParamLayout& layout);
// The tensors cfg.name's step reads whole (an element's update depends on the whole tensor):
// Muon's matrices, every tensor for Adafactor (its RMS and factors), none for AdamW and SGD.
// optim.master = "none" decodes and updates each of them as one piece
// (dist::ZeroStore::Options::whole_tensors).
std::vector<char> whole_step_tensors(const OptimConfig& cfg, const ParamLayout& layout);
// Five quintic Newton-Schulz steps (coefficients 3.4445, -4.7750, 2.0315) on the rows x cols
// row-major matrix x, in place: x / ||x||_F moved toward the nearest semi-orthogonal matrix
// (Muon's orthogonalization, in fp32). The tall orientation is orthogonalized as its transpose.
void newton_schulz5(float* x, int rows, int cols);

// Adafactor (optim.name = "adafactor"; Shazeer and Stern 2018, step for step as
// torch.optim.Adafactor computes it): no first moment; the second moment of a matrix (a 2-D
// tensor of at least 2 x 2) factored into its row and column means of g^2, of any other tensor
// kept whole. At step t, with 1 - beta2_t = t^optim.adafactor_beta2_decay:
//   R = lerp(R, mean_j g^2, 1 - beta2_t); C = lerp(C, mean_i g^2, 1 - beta2_t);
//   V = R C^T / max(mean(R), eps1)            (whole tensors: V = lerp(V, g^2, 1 - beta2_t))
//   U = G / sqrt(max(V, eps1^2));  U /= max(1, RMS(U) / optim.adafactor_clip)
//   W = W (1 - lr wd) - max(eps2, RMS(W_before)) min(lr, 1 / sqrt(t)) U
// with eps1 = FLT_EPSILON, eps2 = 1e-3 and lr the schedule's (a relative step: lr scales the
// weights' RMS, so it wants a larger optim.lr than AdamW, PyTorch's default being 1e-2). Its
// state: rows + cols floats per matrix, numel per other tensor. Every tensor is stepped whole.
// Whether Adafactor factors tensor t's second moment (a matrix of at least 2 x 2), and the floats
// of its state: rows + cols when factored, else numel.
bool adafactor_factors(const ParamSpec& t);
std::size_t adafactor_floats(const ParamSpec& t);
// The floats of the state over [offset, offset + count) of `layout` (a tensor the range cuts, at
// a ZeRO shard's edge, counts whole: each of its holders keeps its whole state).
std::size_t adafactor_state_floats(const ParamLayout& layout, std::size_t offset,
                                   std::size_t count);

// count = SIZE_MAX: to the end of the buffer. `category`: what the memory table counts its state
// under (a checkpoint's scratch decoder of another range or format: MemCategory::Other).
// `gather`: how Muon completes a matrix the range cuts (it must outlive the optimizer); without
// one, stepping such a matrix fails naming it (a decoder that never steps needs none).
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                          std::size_t offset = 0, std::size_t count = SIZE_MAX,
                                          MemCategory category = MemCategory::OptimizerState,
                                          TensorGather* gather = nullptr);

// Several optimizers over disjoint increasing ranges of the same layout, seen by checkpoints as
// one state: the concatenation of the parts' (an interleaved pipeline rank holds a chunk of the
// model per virtual stage, parallel/pipeline/stage_store.h). offset() is the first part's, count()
// the sum; each part updates its own range with exactly the arithmetic of one optimizer over it.
class RangeOptimizers final : public OptimizerState {
  public:
    explicit RangeOptimizers(std::vector<std::unique_ptr<Optimizer>> parts);
    int parts() const { return (int)parts_.size(); }
    Optimizer& part(int k) { return *parts_.at(k); }

    std::size_t offset() const override { return parts_.front()->offset(); }
    std::size_t count() const override { return count_; }
    std::vector<Range> ranges() const override;
    int64_t steps_taken() const override { return parts_.front()->steps_taken(); }
    void set_steps_taken(int64_t t) override;
    std::vector<std::string> state_names() override { return parts_.front()->state_names(); }
    // Null with several parts (their tensors are apart): read_state concatenates them.
    const float* host_state(const std::string& name) override;
    void read_state(const std::string& name, float* dst) override;
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override;
    void finish_writes() override;
    Optimizer* stored_part(std::size_t k) override {
        return k < parts_.size() ? parts_[k].get() : nullptr;
    }

  private:
    std::vector<std::unique_ptr<Optimizer>> parts_;
    std::size_t count_ = 0;
};

// Scales grads so their global L2 norm is at most max_norm (torch.nn.utils.clip_grad_norm_:
// coefficient max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before
// clipping. max_norm <= 0 only measures.
double clip_grad_norm(float* grads, std::size_t n, double max_norm);
// Its scaling once the global norm is known (a sharded or staged run sums it across ranks first):
// grads *= max_norm / (norm + 1e-6) when max_norm > 0 and that is below 1.
void clip_to_norm(float* grads, std::size_t n, double norm, double max_norm);

}  // namespace memtrain
