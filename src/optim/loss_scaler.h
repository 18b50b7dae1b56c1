// Dynamic loss scaling for fp16 training (Micikevicius et al., Mixed Precision Training): the
// loss gradient is multiplied by `scale` so that small gradients survive fp16's narrow range;
// the optimizer divides it out. A step whose gradients overflowed (a non-finite norm) is skipped
// and the scale halves; after `window` clean steps in a row it doubles. A scale that has
// collapsed to its minimum and still overflows is an error that says why, instead of a run that
// silently stops learning (the fp16 failure users of DeepSpeed report: PEERS.md #14, #15).
//
//     LossScaler s(65536, 2000);
//     backward with grad_scale = s.scale() / tokens ...
//     s.update(overflowed);   // after the step
#pragma once

#include <cstdint>

namespace memtrain {

class LossScaler {
  public:
    static constexpr double kMinScale = 1.0;
    static constexpr double kMaxScale = 16777216.0;  // 2^24

    LossScaler(double initial, int window);
    double scale() const { return scale_; }
    // Records a step's outcome. Fails (memtrain::Error) when a step overflows at the minimum
    // scale: the values themselves exceed fp16's range, and bf16 is the remedy.
    void update(bool overflowed, int64_t step);
    int64_t clean_steps() const { return clean_; }
    int64_t overflows() const { return overflows_; }
    // For checkpoints: the scale and the count of clean steps since the last change.
    void restore(double scale, int64_t clean_steps);

  private:
    double scale_;
    int window_;
    int64_t clean_ = 0;
    int64_t overflows_ = 0;
};

}  // namespace memtrain
