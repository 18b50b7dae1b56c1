// Learning-rate schedules (see schedule.h) and validation of the [optim] section.
#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "optim/state_format.h"

namespace memtrain {

void OptimConfig::validate() const {
    if (name != "adamw" && name != "sgd" && name != "muon" && name != "adafactor")
        fail("optim.name = \"{}\": expected \"adamw\", \"sgd\", \"muon\" or \"adafactor\"", name);
    if (!(adafactor_beta2_decay >= -1 && adafactor_beta2_decay <= 0))
        fail("optim.adafactor_beta2_decay must be in [-1, 0] (1 - beta2_t = t^decay), got {}",
             adafactor_beta2_decay);
    if (!(adafactor_clip > 0))
        fail("optim.adafactor_clip must be positive, got {}", adafactor_clip);
    if (name == "adafactor" && state_format != "fp32")
        fail(
            "optim.name = \"adafactor\" with optim.state_format = \"{}\": Adafactor's factored "
            "second moment is already rows + cols floats per matrix (set optim.state_format = "
            "\"fp32\")",
            state_format);
    if (step_in_backward_clip != "norm-pass" && step_in_backward_clip != "previous-norm")
        fail("optim.step_in_backward_clip = \"{}\": expected \"norm-pass\" or \"previous-norm\"",
             step_in_backward_clip);
    if (step_in_backward_clip == "previous-norm" && !step_in_backward)
        fail(
            "optim.step_in_backward_clip = \"previous-norm\" is the clipping of "
            "optim.step_in_backward, which is false (set optim.step_in_backward = true, or drop "
            "the key)");
    if (!(muon_lr > 0)) fail("optim.muon_lr must be positive, got {}", muon_lr);
    if (muon_momentum < 0 || muon_momentum >= 1)
        fail("optim.muon_momentum must be in [0, 1), got {}", muon_momentum);
    if (!(lr > 0)) fail("optim.lr must be positive, got {}", lr);
    if (min_lr_ratio < 0 || min_lr_ratio > 1)
        fail("optim.min_lr_ratio must be in [0, 1], got {}", min_lr_ratio);
    if (weight_decay < 0) fail("optim.weight_decay must be >= 0, got {}", weight_decay);
    if (beta1 < 0 || beta1 >= 1) fail("optim.beta1 must be in [0, 1), got {}", beta1);
    if (beta2 < 0 || beta2 >= 1) fail("optim.beta2 must be in [0, 1), got {}", beta2);
    if (!(eps > 0)) fail("optim.eps must be positive, got {}", eps);
    if (momentum < 0 || momentum >= 1) fail("optim.momentum must be in [0, 1), got {}", momentum);
    if (grad_clip < 0) fail("optim.grad_clip must be >= 0 (0 disables), got {}", grad_clip);
    if (schedule != "constant" && schedule != "cosine" && schedule != "linear" && schedule != "wsd")
        fail("optim.schedule = \"{}\": expected \"constant\", \"cosine\", \"linear\" or \"wsd\"",
             schedule);
    if (warmup_steps < 0) fail("optim.warmup_steps must be >= 0, got {}", warmup_steps);
    if (decay_fraction < 0 || decay_fraction > 1)
        fail("optim.decay_fraction must be in [0, 1], got {}", decay_fraction);
    if (cooldown != "linear" && cooldown != "1-sqrt")
        fail("optim.cooldown = \"{}\": expected \"linear\" or \"1-sqrt\"", cooldown);
    if (lr_scaling != "none" && lr_scaling != "linear" && lr_scaling != "sqrt")
        fail("optim.lr_scaling = \"{}\": expected \"none\", \"linear\" or \"sqrt\"", lr_scaling);
    if (master != "fp32" && master != "none")
        fail("optim.master = \"{}\": expected \"fp32\" or \"none\"", master);
    if (parse_state_format(state_format) == StateFormat::Int4 && name == "sgd")
        fail(
            "optim.state_format = \"int4\" with optim.name = \"sgd\": SGD's momentum is its "
            "whole update, and 4-bit codes would move it by up to a sixth of its block's largest "
            "value each step (use \"int8\" or \"bf16\", or optim.name = \"adamw\")");
    if (lr_scaling != "none" && lr_reference_batch <= 0)
        fail(
            "optim.lr_scaling = \"{}\" needs optim.lr_reference_batch (tokens per step the lr "
            "was tuned for) > 0",
            lr_scaling);
}

double scaled_peak_lr(const OptimConfig& cfg, int64_t batch_tokens) {
    if (cfg.lr_scaling == "none") return cfg.lr;
    double ratio = (double)batch_tokens / (double)cfg.lr_reference_batch;
    return cfg.lr_scaling == "linear" ? cfg.lr * ratio : cfg.lr * std::sqrt(ratio);
}

double lr_at(const OptimConfig& cfg, double peak, int64_t step, int64_t total) {
    if (step < cfg.warmup_steps) return peak * (double)(step + 1) / (double)cfg.warmup_steps;
    const double min_lr = cfg.min_lr_ratio * peak;
    if (cfg.schedule == "constant") return peak;
    if (cfg.schedule == "cosine" || cfg.schedule == "linear") {
        int64_t span = std::max<int64_t>(1, total - cfg.warmup_steps);
        double progress = std::min(1.0, (double)(step - cfg.warmup_steps) / (double)span);
        if (cfg.schedule == "linear")  // Hugging Face's "linear" (to 0 with min_lr_ratio = 0)
            return min_lr + (peak - min_lr) * (1.0 - progress);
        return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(M_PI * progress));
    }
    // warmup-stable-decay
    int64_t decay_steps = (int64_t)std::llround(cfg.decay_fraction * (double)total);
    int64_t decay_start = total - decay_steps;
    if (step < decay_start || decay_steps == 0) return peak;
    double p = std::min(1.0, (double)(step - decay_start + 1) / (double)decay_steps);
    double f = cfg.cooldown == "linear" ? 1.0 - p : 1.0 - std::sqrt(p);
    return min_lr + (peak - min_lr) * f;
}

}  // namespace memtrain
