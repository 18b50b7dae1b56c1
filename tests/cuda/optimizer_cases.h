// What the GPU optimizer tests share (tests/cuda/optimizer_test.cpp, adafactor_test.cpp,
// muon_test.cpp): the comparisons against the CPU optimizer's results, and a run of a CPU
// optimizer and the engines' DeviceOptimizer side by side on the same gradients.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"

#if MEMTRAIN_HAVE_CUDA

#include "engine/cuda/device_optimizer.h"
#include "kernels/cuda/ops.h"
#include "optim/device_update.h"

namespace memtrain::test {

// Whether this build's CPU optimizer fuses multiply-adds (GCC does at -O2 and above with its
// default -ffp-contract=fast; not at -O0, the sanitizer build). One SGD step on one float where
// the two differ: wd * p = 1 + 2^-11 + 2^-24 is a tie that rounds to 1 + 2^-11, which g cancels
// exactly unless wd * p + g is one fused operation (then 2^-24 remains, and lr = 2 moves p by
// 2^-23).
inline bool cpu_optimizer_fuses() {
    ParamLayout layout;
    ParamSpec t;
    t.name = "p";
    t.shape = {1};
    t.numel = 1;
    t.decay = true;
    layout.tensors = {t};
    layout.total = 1;
    OptimConfig cfg;
    cfg.name = "sgd";
    cfg.momentum = 0.0;
    cfg.weight_decay = 1.0 + 1.0 / 4096;
    auto opt = make_optimizer(cfg, layout);
    const float p0 = 1.0f + 1.0f / 4096;
    float p = p0, g = -(1.0f + 1.0f / 2048);
    opt->step(&p, &g, 2.0);
    return p != p0;
}

// The kernels spell out the CPU's (fused) operations, so where the CPU build fuses, fp32 results
// must be the same bits. Where it does not, each operation may differ by an ulp: 1e-5 relative
// plus 1e-6 of the values' rms is still far below what a wrong decay flag, step size or clip
// coefficient moves (>= 1e-4 relative here).
inline void expect_match(const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& want, bool bitwise) {
    if (bitwise) return expect_bitwise(what, got, want);
    double s = 0.0;
    for (float x : want) s += (double)x * x;
    expect_close(what, got, want, 1e-6 * std::sqrt(s / (double)want.size()), 1e-5);
}

// A moment stored in `format` against the CPU's. Where the CPU build does not fuse (the sanitizer
// build), an fp32 result an ulp apart now and then rounds to the neighbouring stored value (a bf16
// ulp, an int8 or int4 code): a few elements (at most 2 + 0.1%) may then differ by up to half
// their value, far more than the rest's 1e-5; a wrong update moves nearly all of them.
inline void expect_state_match(const std::string& what, const std::vector<float>& got,
                               const std::vector<float>& want, bool bitwise, StateFormat format,
                               bool cpu_fuses) {
    if (bitwise || format == StateFormat::Fp32 || cpu_fuses)
        return expect_match(what, got, want, bitwise);
    ASSERT_EQ(got.size(), want.size()) << what;
    double s = 0.0;
    for (float x : want) s += (double)x * x;
    const double atol = 1e-6 * std::sqrt(s / (double)want.size());
    std::size_t flipped = 0;
    for (std::size_t i = 0; i < got.size(); i++) {
        const double d = std::fabs((double)got[i] - want[i]), w = std::fabs((double)want[i]);
        if (d <= atol + 1e-5 * w) continue;
        flipped++;
        EXPECT_LE(d, 0.5 * w + atol) << what << " [" << i << "]";
    }
    EXPECT_LE(flipped, 2 + got.size() / 1000) << what << ": elements off by more than rounding";
}

// What the tests hand a DeviceOptimizer to wait for its stream.
inline void wait_all(const char*) {
    device_synchronize();
}

// One step per learning rate of `cpu` and `gpu` (both over the floats from `offset` of the same
// layout, the GPU's parameters at d_params, its master already set) on the same gradients: the
// GPU's stored in T at loss_scale x their value (seeds grad_seed + step), the CPU's their true
// values clipped by cfg.grad_clip. With bf16_weights the CPU's parameters are then rounded with
// the draws the GPU makes (f32_to_bf16_stochastic of round_seed, the step, the global index).
template <typename T>
void step_side_by_side(Optimizer& cpu, DeviceOptimizer<T>& gpu, const OptimConfig& cfg,
                       std::vector<float>& cpu_params, DeviceBuffer<T>& d_params,
                       const std::vector<double>& lrs, uint64_t grad_seed, float loss_scale,
                       bool bf16_weights, uint64_t round_seed, std::size_t offset) {
    const std::size_t n = cpu_params.size();
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    for (int step = 1; step <= (int)lrs.size(); step++) {
        const double lr = lrs[(std::size_t)step - 1];
        auto g = randn(n, grad_seed + (uint64_t)step, 0.1f);
        std::vector<float> stored(n), cpu_g(n);
        for (std::size_t i = 0; i < n; i++) stored[i] = from_type(to_type<T>(g[i] * loss_scale));
        for (std::size_t i = 0; i < n; i++) cpu_g[i] = stored[i] / loss_scale;
        clip_grad_norm(cpu_g.data(), n, cfg.grad_clip);
        cpu.step(cpu_params.data(), cpu_g.data(), lr);
        if (bf16_weights)
            for (std::size_t i = 0; i < n; i++)
                cpu_params[i] = bf16_to_f32(
                    f32_to_bf16_stochastic(cpu_params[i], round_seed, (uint64_t)step, offset + i));
        auto d_g = upload_as<T>(stored);
        cuda::sum_squares<T>(d_sumsq.data(), d_g.data(), (int64_t)n);
        const cuda::StepScalars s = cuda::make_step_scalars(cfg, lr, step, loss_scale);
        copy_to_device(d_s.data(), &s, sizeof s);
        cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
        gpu.step(d_params.data(), d_g.data(), d_s.data(), nullptr);
    }
    device_synchronize();
}

}  // namespace memtrain::test

#endif  // MEMTRAIN_HAVE_CUDA
