// Optimizers over the flat parameter buffer: AdamW (decoupled weight decay, bias correction,
// exactly torch.optim.AdamW's arithmetic) and SGD with momentum (torch.optim.SGD's), plus
// global-norm gradient clipping. Weight decay applies to the tensors the layout marks `decay`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/param_layout.h"
#include "optim/optim_config.h"

namespace memtrain {

class Optimizer {
  public:
    virtual ~Optimizer() = default;
    // One update with learning rate lr; advances the internal step count.
    virtual void step(float* params, const float* grads, double lr) = 0;
    // Named state buffers, each laid out like the parameters (for checkpoints).
    virtual std::vector<std::pair<std::string, Buffer<float>*>> state() = 0;
    int64_t steps_taken() const { return t_; }
    void set_steps_taken(int64_t t) { t_ = t; }

  protected:
    int64_t t_ = 0;
};

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout);

// Scales grads so their global L2 norm is at most max_norm (torch.nn.utils.clip_grad_norm_:
// coefficient max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before
// clipping. max_norm <= 0 only measures.
double clip_grad_norm(float* grads, std::size_t n, double max_norm);

}  // namespace memtrain
