// The [optim] section: optimizer, learning-rate schedule, batch-size LR scaling and clipping.
#pragma once

#include <cstdint>
#include <string>

namespace memtrain {

struct OptimConfig {
    // "adamw" | "sgd" | "muon" (Muon on block matrices, AdamW else) | "adafactor" (factored
    // second moment, relative step: optim/optimizer.h)
    std::string name = "adamw";
    double lr = 6e-4;           // peak learning rate (before batch-size scaling)
    double min_lr_ratio = 0.1;  // floor of the decay, as a fraction of the peak
    double weight_decay = 0.1;  // AdamW: decoupled; SGD: L2 added to the gradient
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double momentum = 0.9;                // SGD
    bool nesterov = false;                // SGD
    double muon_lr = 0.02;                // Muon: peak lr of the block matrices (scheduled as lr)
    double muon_momentum = 0.95;          // Muon: its momentum (Nesterov)
    double adafactor_beta2_decay = -0.8;  // Adafactor: 1 - beta2_t = t^decay
    double adafactor_clip = 1.0;          // Adafactor: the update's RMS threshold d
    double grad_clip = 1.0;               // global-norm clipping; 0 disables
    std::string schedule = "cosine";      // "constant" | "cosine" | "wsd"
    int warmup_steps = 100;
    double decay_fraction = 0.2;      // wsd: the last fraction of steps that cools down
    std::string cooldown = "linear";  // wsd: "linear" | "1-sqrt"
    std::string lr_scaling = "none";  // "none" | "linear" | "sqrt" (relative to the reference)
    int64_t lr_reference_batch = 0;   // tokens per step the peak lr was tuned for
    // fp16 (train.precision): the dynamic loss scale starts here, halves (and the step is
    // skipped) when a gradient overflows, doubles after loss_scale_window clean steps.
    double loss_scale = 65536.0;
    int loss_scale_window = 2000;
    // How the moments are stored (optim/state_format.h): "fp32" | "bf16" | "int8" | "int4"
    // (block-quantized with one fp32 scale per block; int4 for AdamW only).
    std::string state_format = "fp32";
    // The step's last backward updates each unit as soon as its gradient is reduced, so no whole
    // gradient buffer lives (docs/training.md: clipping adds a norm-only pass).
    bool step_in_backward = false;
    // Its clipping: "norm-pass" (exact: a forward and backward measuring only, then the update
    // pass) or "previous-norm" (no pass: each unit is clipped with the previous step's global
    // norm; the first step, and a step after a non-finite norm, take the norm pass).
    std::string step_in_backward_clip = "norm-pass";
    // "fp32": fp32 weights (the CPU engine's compute weights, the GPU's master copy); "none": the
    // weights are stored in bf16 only and updated by seeded stochastic rounding (docs/training.md).
    std::string master = "fp32";

    void validate() const;
};

}  // namespace memtrain
