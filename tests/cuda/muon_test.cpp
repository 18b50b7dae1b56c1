// Muon on the GPU (kernels/cuda/muon.cu and optimizer.cu's muon_momentum through the engines'
// DeviceOptimizer) against the CPU optimizer (make_optimizer with optim.name = "muon") on the same
// gradients: the momentum of the block matrices and Adam's m and v of the rest in every
// optim.state_format, the orthogonalized update of wide and tall matrices (fp32 GEMMs in another
// order than OpenBLAS's, so the updates agree to rounding), fp32 parameters, bf16 / fp16 ones with
// a master, bf16 weights without one. The state reads and writes as the CPU's does, a skipped
// step changes nothing, and a range that cuts a matrix is refused naming it.
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

namespace muon_cases {

// Block matrices of n_embd x 3 n_embd (wide) and 4 n_embd x n_embd (tall, mlp.c_proj); at n_embd
// 64 they hold 4096 elements or more, so their momentum and the embeddings' m and v take the
// optim.state_format while the biases and norms keep fp32.
ParamLayout layout_of(int n_embd) {
    ModelConfig c;
    c.n_layer = 2;
    c.n_head = 2;
    c.n_embd = n_embd;
    c.block_size = 8;
    c.vocab_size = 70;
    c.vocab_pad = 8;
    return make_param_layout(c);
}

OptimConfig muon_config(double grad_clip, const char* format) {
    OptimConfig cfg;
    cfg.name = "muon";
    cfg.weight_decay = 0.1;
    cfg.grad_clip = grad_clip;
    cfg.state_format = format;
    return cfg;
}

double rms(const std::vector<float>& v) {
    double s = 0.0;
    for (float x : v) s += (double)x * x;
    return std::sqrt(s / (double)v.size());
}

struct Case {
    int n_embd;
    const char* format;
    double grad_clip;
    float loss_scale;
    std::size_t first_tensor;
    bool bf16_weights = false;
};

template <typename T>
void muon_case(const Case& c) {
    constexpr bool kFp32 = std::is_same_v<T, float>;
    SCOPED_TRACE(testing::Message()
                 << type_name<T>() << " n_embd " << c.n_embd << " state " << c.format << " clip "
                 << c.grad_clip << " loss scale " << c.loss_scale << " from " << c.first_tensor
                 << " bf16 weights " << c.bf16_weights);
    const ParamLayout layout = layout_of(c.n_embd);
    const std::size_t offset = layout.tensors.at(c.first_tensor).offset;
    const std::size_t n = layout.total - offset;
    OptimConfig cfg = muon_config(c.grad_clip, c.format);
    if (c.bf16_weights) cfg.master = "none";
    auto cpu = make_optimizer(cfg, layout, offset, n);
    DeviceOptimizer<T> gpu(cfg, layout, offset, n, nullptr, wait_all, 1337);
    const uint64_t seed = bf16_rounding_seed(1337);

    auto p0 = randn(n, 1001, 0.5f);
    if (!kFp32) p0 = rounded<T>(p0);
    std::vector<float> cpu_params = p0;
    auto d_params = upload_as<T>(p0);
    float* master = gpu.master();
    ASSERT_EQ(master != nullptr, !kFp32 && !c.bf16_weights);
    if (master) copy_to_device(master, p0.data(), n * sizeof(float));
    step_side_by_side<T>(*cpu, gpu, cfg, cpu_params, d_params, {1e-3, 6e-4, 2e-3}, 1010,
                         c.loss_scale, c.bf16_weights, seed, offset);
    ASSERT_EQ(gpu.state_names(), cpu->state_names());
    // Where the CPU build fuses multiply-adds as the kernels do (the optimised build), the
    // states agree to rounding, a value an ulp apart now and then rounding to the neighbouring
    // stored one (int8 / int4 / bf16). Where it does not (the sanitizer build), such flips are
    // ten times as common and carry into the next steps (a bf16 ulp of the old moment on a new
    // value that cancels to near zero): at most 1% of the elements, each within a tenth of the
    // state's rms (half for int4); a wrong index or store moves nearly all of them.
    const bool fuses = cpu_optimizer_fuses();
    for (const std::string& name : cpu->state_names()) {
        std::vector<float> want(n), got(n);
        cpu->read_state(name, want.data());
        gpu.read_state(name, got.data());
        if (fuses) {
            expect_state_match(name, got, want, false, StateFormat::Int8, false);
            continue;
        }
        // (int4's codes are 8 levels a side: a flipped one is a larger step.)
        const double r = rms(want), step = std::string(c.format) == "int4" ? 0.5 : 0.1;
        std::size_t off = 0;
        for (std::size_t i = 0; i < n; i++) {
            const double d = std::fabs((double)got[i] - want[i]);
            if (d <= 1e-6 * r + 1e-5 * std::fabs(want[i])) continue;
            off++;
            EXPECT_LE(d, 0.5 * std::fabs(want[i]) + step * r) << name << " [" << i << "]";
        }
        EXPECT_LE(off, 2 + n / 100) << name;
    }
    // The updates (weights minus where they started): the orthogonalized directions agree to
    // the rounding of fp32 GEMMs summed in another order, within 1e-3 of the update's rms; a
    // wrong Newton-Schulz step, scale, decay or momentum moves them by far more.
    std::vector<float> got = download_float(d_params);
    if (master) {
        std::vector<float> m(n);
        copy_to_host(m.data(), master, n * sizeof(float));
        expect_bitwise("params = T(master)", got, rounded<T>(m));
        got = m;
    }
    std::vector<float> d_got(n), d_want(n);
    for (std::size_t i = 0; i < n; i++) {
        d_got[i] = got[i] - p0[i];
        d_want[i] = cpu_params[i] - p0[i];
    }
    if (c.bf16_weights) {
        // Rounded stochastically with the same draws: where the fp32 values differ by rounding,
        // a draw's threshold sits between them now and then, a bf16 ulp apart.
        // (Without fused multiply-adds on the CPU, the moments' carried flips above move a few
        // weights by more: within a tenth of the weights' rms, at most 1% of them.)
        const double tol = fuses ? 0.0 : 0.1 * rms(p0);
        std::size_t off = 0;
        for (std::size_t i = 0; i < n; i++) {
            off += got[i] != cpu_params[i];
            EXPECT_NEAR(got[i], cpu_params[i], std::fabs(cpu_params[i]) / 64 + tol + 1e-30) << i;
        }
        EXPECT_LE(off, (fuses ? 8 + n / 1000 : 2 + n / 100));
        return;
    }
    expect_close("update", d_got, d_want, 1e-3 * rms(d_want), 1e-3);
}

TEST(CudaMuon, MatchesTheCpuStepInEveryStorage) {
    REQUIRE_GPU();
    muon_case<float>({16, "fp32", 0.0, 1.0f, 0});
    muon_case<float>({16, "fp32", 1.0, 1.0f, 3});  // a range from the first block's tensors
    muon_case<__nv_bfloat16>({16, "fp32", 1.0, 1.0f, 0});
    muon_case<__half>({16, "fp32", 1.0, 1024.0f, 0});
    muon_case<__nv_bfloat16>({16, "fp32", 1.0, 1.0f, 0, true});
    for (const char* format : {"bf16", "int8", "int4"}) {
        muon_case<float>({64, format, 1.0, 1.0f, 0});
        muon_case<__nv_bfloat16>({64, format, 0.0, 1.0f, 0, true});
    }
}

// The states as checkpoints see them, written into a fresh optimizer in pieces, read back as
// written (through the CPU's codec for int8); a step whose gradient norm is not finite changes
// neither the weights nor any state; a range that cuts a matrix is refused naming it.
TEST(CudaMuon, StateMovesBetweenDevicesAndASkippedStepChangesNothing) {
    REQUIRE_GPU();
    const ParamLayout layout = layout_of(64);
    const std::size_t n = layout.total;
    const OptimConfig cfg = muon_config(1.0, "int8");
    auto cpu = make_optimizer(cfg, layout);
    auto params = randn(n, 1101, 0.5f);
    for (int step = 1; step <= 2; step++) {
        auto g = randn(n, 1110 + step, 0.1f);
        cpu->step(params.data(), g.data(), 1e-3);
    }
    DeviceOptimizer<float> gpu(cfg, layout, 0, n, nullptr, wait_all);
    std::vector<std::vector<float>> states;
    for (const std::string& name : cpu->state_names()) {
        std::vector<float> s(n), back(n);
        cpu->read_state(name, s.data());
        gpu.write_state(name, 0, n / 3, s.data());
        gpu.write_state(name, n / 3, n - n / 3, s.data() + n / 3);
        gpu.read_state(name, back.data());
        expect_bitwise(name + " read back", back, s);
        states.push_back(s);
    }
    auto d_params = upload(params);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    auto bad = randn(n, 1120, 0.1f);
    bad[n / 2] = std::numeric_limits<float>::quiet_NaN();
    auto d_g = upload(bad);
    cuda::sum_squares<float>(d_sumsq.data(), d_g.data(), (int64_t)n);
    const cuda::StepScalars s = cuda::make_step_scalars(cfg, 1e-3, 3);
    copy_to_device(d_s.data(), &s, sizeof s);
    cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
    gpu.step(d_params.data(), d_g.data(), d_s.data(), nullptr);
    device_synchronize();
    expect_bitwise("params after a skipped step", download(d_params), params);
    std::size_t k = 0;
    for (const std::string& name : cpu->state_names()) {
        std::vector<float> back(n);
        gpu.read_state(name, back.data());
        expect_bitwise(name + " after a skipped step", back, states[k++]);
    }
    const ParamSpec* matrix = nullptr;
    for (const ParamSpec& t : layout.tensors)
        if (t.name.find("mlp.c_fc.weight") != std::string::npos) matrix = &t;
    ASSERT_NE(matrix, nullptr);
    try {
        cuda::muon_layout(layout, 0, matrix->offset + 5, StateFormat::Fp32);
        ADD_FAILURE() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(matrix->name), std::string::npos) << e.what();
    }
}

}  // namespace muon_cases

#endif  // MEMTRAIN_HAVE_CUDA
