// The divergence guard's judgement (see guard.h).
#include "train/guard.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain {

namespace {

double median(std::vector<double> v) {
    const std::size_t n = v.size(), h = n / 2;
    std::nth_element(v.begin(), v.begin() + (std::ptrdiff_t)h, v.end());
    const double hi = v[h];
    if (n % 2) return hi;
    return 0.5 * (hi + *std::max_element(v.begin(), v.begin() + (std::ptrdiff_t)h));
}

}  // namespace

std::string DivergenceGuard::judge(double loss, double grad_norm) const {
    if (!std::isfinite(loss) || !std::isfinite(grad_norm))
        return fmt::format("loss {} and gradient norm {} are not both finite", loss, grad_norm);
    if ((int)recent_.size() < cfg_.min_history) return "";
    std::vector<double> losses, norms;
    for (const Entry& e : recent_) {
        losses.push_back(e.loss);
        norms.push_back(e.norm);
    }
    const double med = median(losses);
    std::vector<double> dev;
    for (double l : losses) dev.push_back(std::fabs(l - med));
    // The median absolute deviation, as a standard deviation's estimate (x 1.4826 for normal
    // noise); at least 1% of the median, so a window of near-equal losses does not call every
    // ripple a spike.
    const double spread = std::max(1.4826 * median(dev), 0.01 * std::fabs(med));
    const double z = spread > 0 ? (loss - med) / spread : 0.0;
    if (z > cfg_.spike_z)
        return fmt::format(
            "loss {:.4f} is {:.1f} robust deviations above the median {:.4f} of the last {} clean "
            "steps (guard.spike_z = {:g})",
            loss, z, med, recent_.size(), cfg_.spike_z);
    const double norm_med = median(norms);
    if (norm_med > 0 && grad_norm > cfg_.norm_factor * norm_med)
        return fmt::format(
            "gradient norm {:.4g} is {:.1f}x the median {:.4g} of the last {} clean steps "
            "(guard.norm_factor = {:g})",
            grad_norm, grad_norm / norm_med, norm_med, recent_.size(), cfg_.norm_factor);
    return "";
}

void DivergenceGuard::accept(int64_t step, double loss, double grad_norm) {
    recent_.push_back({step, loss, grad_norm});
    while ((int)recent_.size() > cfg_.window) recent_.pop_front();
}

DivergenceGuard::Action DivergenceGuard::on_anomaly(int64_t step, int64_t to,
                                                    const std::string& reason) {
    if (rollbacks_ >= cfg_.max_rollbacks)
        fail(
            "training diverged at step {}: {}. The guard has rolled back {} times "
            "(guard.max_rollbacks = {}) and gives up. The last state it trusts is the one after "
            "step {}: resume from a checkpoint at or before that step (a later one may hold the "
            "damage), with a lower optim.lr, or check the data",
            step, reason, rollbacks_, cfg_.max_rollbacks, to);
    Action a;
    a.rollback = ++rollbacks_;
    a.lower_lr = last_anomaly_ >= 0 && step - last_anomaly_ <= cfg_.window;
    last_anomaly_ = step;
    if (a.lower_lr) {
        // A cool-down still running compounds; one that has ended starts again from 1.
        lr_scale_ = (step <= lr_until_ ? lr_scale_ : 1.0) * cfg_.lr_factor;
        lr_until_ = step + cfg_.cooldown;
    }
    a.lr_scale = lr_scale(step);
    a.lr_until = lr_until_;
    while (!recent_.empty() && recent_.back().step > to) recent_.pop_back();
    return a;
}

}  // namespace memtrain
