// Optimizer, reductions and casts against the CPU reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/token_buckets.h"
#include "model/param_layout.h"
#include "optim/optimizer.h"

#if MEMTRAIN_HAVE_CUDA
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;
using namespace memtrain::test;

#if MEMTRAIN_HAVE_CUDA

// ---- optimizer
// ------------------------------------------------------------------------------------

TEST(CudaOps, AdamWMatchesCpuOptimizer) {
    REQUIRE_GPU();
    // Two tensors: a decayed matrix and a bias without decay, as the model's layout marks them.
    ParamLayout layout;
    ParamSpec a, b;
    a.name = "w";
    a.shape = {37, 29};
    a.numel = 37 * 29;
    a.decay = true;
    b.name = "b";
    b.shape = {29};
    b.offset = a.numel;
    b.numel = 29;
    layout.tensors = {a, b};
    layout.total = a.numel + b.numel;
    const std::size_t n = layout.total;
    OptimConfig cfg;  // adamw, betas (0.9, 0.95), eps 1e-8, weight decay 0.1
    auto opt = make_optimizer(cfg, layout);

    auto params = randn(n, 81);
    std::vector<uint8_t> decay(n, 0);
    for (std::size_t i = 0; i < a.numel; i++) decay[i] = 1;
    auto d_params = upload(params);
    auto d_decay = upload(decay);
    DeviceBuffer<float> d_m(n, MemCategory::OptimizerState), d_v(n, MemCategory::OptimizerState);
    const double lrs[] = {1e-3, 6e-4, 3e-4};
    for (int step = 1; step <= 3; step++) {
        auto grads = randn(n, 90 + step, 0.1f);
        auto d_grads = upload(grads);
        opt->step(params.data(), grads.data(), lrs[step - 1]);
        cuda::adamw_step(d_params.data(), d_m.data(), d_v.data(), d_grads.data(), d_decay.data(),
                         (int64_t)n, lrs[step - 1], cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                         step);
    }
    auto state = opt->state();
    std::vector<float> m(state[0].second->data(), state[0].second->data() + n);
    std::vector<float> v(state[1].second->data(), state[1].second->data() + n);
    expect_close("params", download(d_params), params, 1e-7, 1e-6);
    expect_close("exp_avg", download(d_m), m, 1e-9, 1e-5);
    expect_close("exp_avg_sq", download(d_v), v, 1e-12, 1e-5);
}

// ---- helpers and casts
// ------------------------------------------------------------------------------

TEST(CudaOps, SumSquaresScaleAddMatchCpu) {
    REQUIRE_GPU();
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{200003}}) {
        SCOPED_TRACE(testing::Message() << "n " << n);
        auto a = randn(n, 101), b = randn(n, 102);
        auto d_a = upload(a), d_b = upload(b);
        double want = cpu::sum_squares(a.data(), n);
        double got = cuda::sum_squares(d_a.data(), n);
        EXPECT_NEAR(got, want, 1e-10 * want);              // float accumulation would be ~1e-7
        EXPECT_EQ(cuda::sum_squares(d_a.data(), n), got);  // fixed order: same bits again

        cpu::add_inplace(a.data(), b.data(), n);
        cpu::scale_inplace(a.data(), 0.37f, n);
        cuda::add_inplace(d_a.data(), d_b.data(), n);
        cuda::scale_inplace(d_a.data(), 0.37f, n);
        expect_bitwise("a", download(d_a), a);
    }
    EXPECT_EQ(cuda::sum_squares(nullptr, 0), 0.0);
}

TEST(CudaOps, CastsRoundToNearestEven) {
    REQUIRE_GPU();
    const int64_t n = 3001;
    auto x = randn(n, 111, 10.0f);
    x[0] = 1.0f + 1.0f / 256;  // a tie: rounds to even (1.0)
    x[1] = 1.0f + 3.0f / 256;  // a tie: rounds to even (1 + 1/64)
    x[2] = 0.0f;
    x[3] = -2.5f;
    auto d_x = upload(x);
    DeviceBuffer<uint16_t> d_b(n, MemCategory::Other), d_h(n, MemCategory::Other);
    DeviceBuffer<float> d_back(n, MemCategory::Other);

    cuda::cast_f32_to_bf16(bf(d_b), d_x.data(), n);
    auto bits = download(d_b);
    EXPECT_EQ(bits, to_bf16(x));
    EXPECT_EQ(bf16_value(bits[0]), 1.0f);
    cuda::cast_bf16_to_f32(d_back.data(), bf(d_b), n);
    expect_bitwise("bf16 -> f32", download(d_back), from_bf16(bits));

    __half* h = reinterpret_cast<__half*>(d_h.data());
    cuda::cast_f32_to_f16(h, d_x.data(), n);
    cuda::cast_f16_to_f32(d_back.data(), h, n);
    // fp16 keeps 11 significant bits: relative error at most 2^-11 in the normal range.
    expect_close("f16 round trip", download(d_back), x, 1e-7, 1.0 / 2000);
    auto back = download(d_back);
    EXPECT_EQ(back[2], 0.0f);
    EXPECT_EQ(back[3], -2.5f);
}

#endif  // MEMTRAIN_HAVE_CUDA
