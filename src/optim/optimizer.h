// Optimizers over the flat parameter buffer: AdamW (decoupled weight decay, bias correction,
// exactly torch.optim.AdamW's arithmetic) and SGD with momentum (torch.optim.SGD's), plus
// global-norm gradient clipping. Weight decay applies to the tensors the layout marks `decay`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"

namespace memtrain {

// An optimizer updates the floats [offset, offset + count) of the flat parameter buffer: all
// of it in a single process, one rank's shard under ZeRO (each tensor's settings, such as weight
// decay, still apply to the part of it inside the range).
class Optimizer {
  public:
    virtual ~Optimizer() = default;
    // One update with learning rate lr; advances the internal step count. `params` and `grads`
    // point at the range's first float (count floats each).
    virtual void step(float* params, const float* grads, double lr) = 0;
    // Named state buffers of count floats, laid out like the range (for checkpoints).
    virtual std::vector<std::pair<std::string, Buffer<float>*>> state() = 0;
    int64_t steps_taken() const { return t_; }
    void set_steps_taken(int64_t t) { t_ = t; }
    std::size_t offset() const { return offset_; }
    std::size_t count() const { return count_; }

  protected:
    Optimizer(const ParamLayout& layout, std::size_t offset, std::size_t count);
    // Calls f(tensor, begin, n) for each piece of a tensor inside the range: `begin` indexes the
    // range (params[begin] is the piece's first float), n its length.
    template <typename F>
    void for_each_piece(F&& f) const {
        for (const auto& t : layout_.tensors) {
            const std::size_t lo = std::max(t.offset, offset_);
            const std::size_t hi = std::min(t.offset + t.numel, offset_ + count_);
            if (lo < hi) f(t, lo - offset_, (int64_t)(hi - lo));
        }
    }

    ParamLayout layout_;
    std::size_t offset_, count_;
    int64_t t_ = 0;
};

// count = SIZE_MAX: to the end of the buffer.
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                          std::size_t offset = 0, std::size_t count = SIZE_MAX);

// Scales grads so their global L2 norm is at most max_norm (torch.nn.utils.clip_grad_norm_:
// coefficient max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before
// clipping. max_norm <= 0 only measures.
double clip_grad_norm(float* grads, std::size_t n, double max_norm);

}  // namespace memtrain
