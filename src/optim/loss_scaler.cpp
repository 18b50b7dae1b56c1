// Dynamic loss scaling (see loss_scaler.h).
#include "optim/loss_scaler.h"

#include <algorithm>

#include "core/error.h"

namespace memtrain {

LossScaler::LossScaler(double initial, int window) : scale_(initial), window_(window) {
    if (!(initial >= kMinScale && initial <= kMaxScale))
        fail("optim.loss_scale = {} must be in [{}, {}]", initial, kMinScale, kMaxScale);
    if (window < 1) fail("optim.loss_scale_window = {} must be >= 1", window);
}

void LossScaler::update(bool overflowed, int64_t step) {
    if (!overflowed) {
        if (++clean_ >= window_) {
            scale_ = std::min(scale_ * 2.0, kMaxScale);
            clean_ = 0;
        }
        return;
    }
    overflows_++;
    clean_ = 0;
    if (scale_ <= kMinScale)
        fail(
            "fp16 gradients overflow at step {} even with the loss scale at its minimum ({}): "
            "the model's values exceed fp16's range (65504); train with train.precision = "
            "\"bf16\" (same range as fp32) or lower optim.lr",
            step, kMinScale);
    scale_ = std::max(scale_ * 0.5, kMinScale);
}

void LossScaler::restore(double scale, int64_t clean_steps) {
    if (!(scale >= kMinScale && scale <= kMaxScale))
        fail("checkpoint loss scale {} is outside [{}, {}]", scale, kMinScale, kMaxScale);
    scale_ = scale;
    clean_ = clean_steps;
}

}  // namespace memtrain
