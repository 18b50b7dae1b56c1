// The divergence guard's judgement (docs/training.md, "The divergence guard"): which steps are
// anomalies, and what to do about one. The Trainer does the rest: it snapshots the run every
// guard.snapshot_every steps, and on an anomaly rolls back to a snapshot taken before the damage
// could have been done, skips the batch that showed it, and goes on at the scale of learning
// rate this class gives. Every rank sees the same losses and norms (means over ranks, global
// norms), so every rank decides the same without talking.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "config/run_config.h"

namespace memtrain {

class DivergenceGuard {
  public:
    explicit DivergenceGuard(const GuardConfig& cfg) : cfg_(cfg) {}

    // A step's loss (the mean over ranks) and global gradient norm against the recent clean
    // steps: "" when the step is clean, else why it is not, in words ("loss 9.81 is 41.2 robust
    // deviations above the median 2.93 of the last 50 clean steps").
    std::string judge(double loss, double grad_norm) const;
    // A clean step joins the window (the oldest leaves it beyond guard.window).
    void accept(int64_t step, double loss, double grad_norm);

    struct Action {
        bool lower_lr = false;  // a repeat within guard.window steps of the last anomaly
        int rollback = 0;       // this is the run's n-th rollback
        double lr_scale = 1;    // the learning rate's factor from here ...
        int64_t lr_until = 0;   // ... up to this step
    };
    // An anomaly at `step`, answered by going back to the state after step `to`: the window
    // forgets the steps after `to`. Throws an Error (the run gives up) beyond max_rollbacks.
    Action on_anomaly(int64_t step, int64_t to, const std::string& reason);
    // The factor on the schedule's learning rate at `step` (1 outside a cool-down).
    double lr_scale(int64_t step) const { return step <= lr_until_ ? lr_scale_ : 1.0; }
    int rollbacks() const { return rollbacks_; }

  private:
    struct Entry {
        int64_t step;
        double loss, norm;
    };
    GuardConfig cfg_;
    std::deque<Entry> recent_;
    int rollbacks_ = 0;
    int64_t last_anomaly_ = -1;
    double lr_scale_ = 1;
    int64_t lr_until_ = 0;
};

}  // namespace memtrain
