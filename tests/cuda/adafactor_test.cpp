// Adafactor on the GPU (kernels/cuda/adafactor.cu through the engines' DeviceOptimizer) against
// the CPU optimizer (make_optimizer with optim.name = "adafactor") on the same gradients: fp32
// parameters, bf16 / fp16 ones with fp32 master weights (fp16's gradients loss-scaled), bf16
// weights without a master (stochastic rounding with the CPU engine's draws), ranges from a
// tensor boundary, matrices of more rows than a column piece and more columns than a tile. The
// state reads and writes as the CPU's does (so checkpoints move between devices), a skipped step
// changes nothing, and a range that cuts a tensor is refused naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "cuda/optimizer_cases.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "optim/device_update.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"

#if MEMTRAIN_HAVE_CUDA

#include "engine/cuda/device_optimizer.h"
#include "kernels/cuda/ops.h"

using namespace memtrain;
using namespace memtrain::test;

namespace adafactor_cases {

// Matrices of 600 rows (three 256-row column pieces) and of 320 columns (two tiles) beside
// biases and norms that keep their whole second moment; or (wide = false) the 16-wide tiny model.
ParamLayout layout_of(bool wide) {
    ModelConfig c;
    c.n_layer = 1;
    c.n_head = 2;
    c.n_embd = wide ? 80 : 16;
    c.block_size = 8;
    c.vocab_size = wide ? 600 : 40;
    c.vocab_pad = 8;
    return make_param_layout(c);
}

OptimConfig adafactor_config(double grad_clip) {
    OptimConfig cfg;
    cfg.name = "adafactor";
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.1;
    cfg.grad_clip = grad_clip;
    return cfg;
}

struct Case {
    bool wide;
    double grad_clip;
    float loss_scale;
    std::size_t first_tensor;  // the range starts at this tensor (a pipeline stage's range)
    bool bf16_weights = false;
};

template <typename T>
void adafactor_case(const Case& c) {
    constexpr bool kFp32 = std::is_same_v<T, float>;
    SCOPED_TRACE(testing::Message() << type_name<T>() << " wide " << c.wide << " clip "
                                    << c.grad_clip << " loss scale " << c.loss_scale << " from "
                                    << c.first_tensor << " bf16 weights " << c.bf16_weights);
    const ParamLayout layout = layout_of(c.wide);
    const std::size_t offset = layout.tensors.at(c.first_tensor).offset;
    const std::size_t n = layout.total - offset;
    OptimConfig cfg = adafactor_config(c.grad_clip);
    if (c.bf16_weights) cfg.master = "none";
    auto cpu = make_optimizer(cfg, layout, offset, n);
    DeviceOptimizer<T> gpu(cfg, layout, offset, n, nullptr, wait_all, 1337);
    const uint64_t seed = bf16_rounding_seed(1337);

    auto cpu_params = randn(n, 801, 0.5f);
    if (!kFp32) cpu_params = rounded<T>(cpu_params);
    auto d_params = upload_as<T>(cpu_params);
    float* master = gpu.master();
    ASSERT_EQ(master != nullptr, !kFp32 && !c.bf16_weights);
    if (master) copy_to_device(master, cpu_params.data(), n * sizeof(float));
    step_side_by_side<T>(*cpu, gpu, cfg, cpu_params, d_params, {1e-2, 5e-3, 2e-2, 1e-3}, 810,
                         c.loss_scale, c.bf16_weights, seed, offset);
    std::vector<float> cpu_state(n), gpu_state(n);
    cpu->read_state("variance", cpu_state.data());
    gpu.read_state("variance", gpu_state.data());
    expect_match("variance", gpu_state, cpu_state, false);
    const std::vector<float> got = download_float(d_params);
    if (kFp32) {
        expect_match("params", got, cpu_params, false);
    } else if (c.bf16_weights) {
        // The same draws: an fp32 result an ulp apart crosses the draw's threshold rarely, and
        // then by one bf16 ulp.
        std::size_t off = 0;
        for (std::size_t i = 0; i < n; i++) {
            off += got[i] != cpu_params[i];
            EXPECT_NEAR(got[i], cpu_params[i], std::fabs(cpu_params[i]) / 64 + 1e-30) << i;
        }
        EXPECT_LE(off, 4 + n / 10000);
    } else {
        std::vector<float> m(n);
        copy_to_host(m.data(), master, n * sizeof(float));
        expect_match("master", m, cpu_params, false);
        expect_bitwise("params = T(master)", got, rounded<T>(m));
    }
}

TEST(CudaAdafactor, MatchesTheCpuStepInEveryStorage) {
    REQUIRE_GPU();
    adafactor_case<float>({false, 0.0, 1.0f, 0});
    adafactor_case<float>({true, 1.0, 1.0f, 0});
    adafactor_case<float>({true, 0.0, 1.0f, 3});
    adafactor_case<__nv_bfloat16>({true, 1.0, 1.0f, 0});
    adafactor_case<__half>({false, 1.0, 1024.0f, 0});
    adafactor_case<__nv_bfloat16>({true, 1.0, 1.0f, 0, true});
    adafactor_case<__nv_bfloat16>({false, 0.0, 1.0f, 2, true});
}

// The state as checkpoints see it (each tensor's factors from its start, then zeros) written
// into a fresh optimizer reads back the same, and steps on as the CPU's does from the same
// state; a step whose gradient norm is not finite changes neither the weights nor the state.
TEST(CudaAdafactor, StateMovesBetweenDevicesAndASkippedStepChangesNothing) {
    REQUIRE_GPU();
    const ParamLayout layout = layout_of(true);
    const std::size_t n = layout.total;
    const OptimConfig cfg = adafactor_config(1.0);
    auto cpu = make_optimizer(cfg, layout);
    auto params = randn(n, 901, 0.5f);
    for (int step = 1; step <= 2; step++) {
        auto g = randn(n, 910 + step, 0.1f);
        cpu->step(params.data(), g.data(), 1e-2);
    }
    std::vector<float> state(n);
    cpu->read_state("variance", state.data());
    DeviceOptimizer<float> gpu(cfg, layout, 0, n, nullptr, wait_all);
    // Written in two pieces, as a checkpoint's files may cut the range.
    gpu.write_state("variance", 0, n / 3, state.data());
    gpu.write_state("variance", n / 3, n - n / 3, state.data() + n / 3);
    gpu.set_steps_taken(cpu->steps_taken());
    std::vector<float> back(n);
    gpu.read_state("variance", back.data());
    expect_bitwise("variance read back", back, state);

    auto d_params = upload(params);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    auto queue = [&](const std::vector<float>& g, int step) {
        auto d_g = upload(g);
        cuda::sum_squares<float>(d_sumsq.data(), d_g.data(), (int64_t)n);
        const cuda::StepScalars s = cuda::make_step_scalars(cfg, 1e-2, step);
        copy_to_device(d_s.data(), &s, sizeof s);
        cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
        gpu.step(d_params.data(), d_g.data(), d_s.data(), nullptr);
        device_synchronize();
    };
    auto bad = randn(n, 920, 0.1f);
    bad[n / 2] = std::numeric_limits<float>::infinity();
    queue(bad, 3);
    expect_bitwise("params after a skipped step", download(d_params), params);
    gpu.read_state("variance", back.data());
    expect_bitwise("variance after a skipped step", back, state);

    auto g = randn(n, 930, 0.1f);
    queue(g, 3);
    clip_grad_norm(g.data(), n, cfg.grad_clip);
    cpu->step(params.data(), g.data(), 1e-2);
    expect_match("params", download(d_params), params, false);
    cpu->read_state("variance", state.data());
    gpu.read_state("variance", back.data());
    expect_match("variance", back, state, false);
}

TEST(CudaAdafactor, ARangeThatCutsATensorIsRefusedNamingIt) {
    const ParamLayout layout = layout_of(false);
    const ParamSpec& t = layout.tensors.at(1);
    try {
        cuda::adafactor_layout(layout, t.offset + 1, layout.total - t.offset - 1);
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(t.name), std::string::npos) << e.what();
    }
    // Whole tensors: the rows, pieces and tiles the kernels' grids take.
    const cuda::AdafactorLayout a =
        cuda::adafactor_layout(layout_of(true), 0, layout_of(true).total);
    int64_t rows = 0, state = 0;
    for (const ParamSpec& s : layout_of(true).tensors) {
        rows += adafactor_factors(s) ? s.shape[0] : 1;
        state += (int64_t)adafactor_floats(s);
    }
    EXPECT_EQ(a.rows, rows);
    EXPECT_EQ(a.state, state);
    EXPECT_GT(a.items, a.tiles);  // the 600-row embedding takes three pieces per tile
}

}  // namespace adafactor_cases

#endif  // MEMTRAIN_HAVE_CUDA
