// The GPU optimizer: tensor_chunks (plain C++, runs everywhere), finish_grad_norm and the
// multi-tensor AdamW / SGD kernels against the CPU optimizer (make_optimizer + clip_grad_norm) on a
// tiny model's parameter layout, for fp32 parameters and bf16 / fp16 parameters with fp32 master
// weights, with the moments in every optim.state_format (fp32, bf16, int8, int4: the CPU's
// MomentBuffer stores, the small tensors keeping fp32).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
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
#include "kernels/cuda/ops.h"
#endif

using namespace memtrain;

namespace {

// 4208 floats in 17 tensors, decayed matrices and embeddings next to undecayed biases and norms;
// with n_embd 32 (wide_layout) the block matrices (32 x 128 = 4096 elements) store their moments in
// the optim.state_format while the rest keep fp32.
ParamLayout tiny_layout(int n_embd = 16) {
    ModelConfig c;
    c.n_layer = 1;
    c.n_head = 2;
    c.n_embd = n_embd;
    c.block_size = 8;
    c.vocab_size = 40;
    c.vocab_pad = 16;
    return make_param_layout(c);
}

ParamLayout wide_layout() {
    return tiny_layout(32);
}

}  // namespace

TEST(CudaOptimizer, TensorChunksTileTheRange) {
    const ParamLayout layout = tiny_layout();
    struct Case {
        std::size_t offset, count;
        int max_n;
    };
    for (Case c : {Case{0, layout.total, 1 << 16}, Case{0, layout.total, 300},
                   Case{100, layout.total - 250, 257}, Case{900, 1, 7}, Case{5, 0, 64},
                   Case{0, layout.total, 1}}) {
        SCOPED_TRACE(testing::Message()
                     << "offset " << c.offset << " count " << c.count << " max_n " << c.max_n);
        auto chunks = cuda::tensor_chunks(layout, c.offset, c.count, c.max_n);
        // In order, back to back, each inside one tensor, none longer than max_n, with that
        // tensor's decay flag; together exactly the range.
        std::size_t at = 0;
        for (const auto& ch : chunks) {
            ASSERT_EQ((std::size_t)ch.begin, at);
            ASSERT_GE(ch.n, 1);
            ASSERT_LE(ch.n, c.max_n);
            const std::size_t first = c.offset + at, last = first + ch.n - 1;
            const ParamSpec* owner = nullptr;
            for (const auto& t : layout.tensors)
                if (t.offset <= first && first < t.offset + t.numel) owner = &t;
            ASSERT_NE(owner, nullptr);
            ASSERT_LT(last, owner->offset + owner->numel) << "piece crosses " << owner->name;
            ASSERT_EQ(ch.decay, owner->decay ? 1 : 0) << owner->name;
            // A piece shorter than max_n ends at its tensor's end or the range's.
            if (ch.n < c.max_n) {
                ASSERT_TRUE(last + 1 == owner->offset + owner->numel ||
                            last + 1 == c.offset + c.count);
            }
            at += ch.n;
        }
        EXPECT_EQ(at, c.count);
    }
    EXPECT_THROW(cuda::tensor_chunks(layout, layout.total + 1, 0), Error);
    EXPECT_THROW(cuda::tensor_chunks(layout, 10, layout.total), Error);
    EXPECT_THROW(cuda::tensor_chunks(layout, 0, 10, 0), Error);
}

TEST(CudaOptimizer, StepScalarsFollowTheCpuConstants) {
    OptimConfig cfg;
    const auto s = cuda::make_step_scalars(cfg, 6e-4, 3, 1024.0f);
    EXPECT_EQ(s.step_size, (float)(6e-4 / (1.0 - std::pow(cfg.beta1, 3.0))));
    EXPECT_EQ(s.bc2_sqrt, (float)std::sqrt(1.0 - std::pow(cfg.beta2, 3.0)));
    EXPECT_EQ(s.decay_factor, (float)(1.0 - 6e-4 * cfg.weight_decay));
    EXPECT_EQ(s.first_step, 0);
    EXPECT_EQ(s.loss_scale, 1024.0f);
    EXPECT_EQ(s.max_norm, 1.0f);
    EXPECT_EQ(cuda::make_step_scalars(cfg, 1e-3, 1).first_step, 1);
    EXPECT_THROW(cuda::make_step_scalars(cfg, 1e-3, 0), Error);
}

#if MEMTRAIN_HAVE_CUDA

using namespace memtrain::test;

namespace {

struct OptCase {
    const char* name;  // "adamw" | "sgd"
    int steps;
    double grad_clip;
    bool nesterov;
    float loss_scale;
    std::size_t offset, count;  // count 0: to the end
    int max_n;
    const char* format = "fp32";  // optim.state_format (other than fp32: on wide_layout())
    // optim.master = "none": bf16 parameters without a master copy, rounded stochastically
    // (T = bf16; the CPU reference rounds its fp32 result with f32_to_bf16_stochastic).
    bool bf16_weights = false;
};

// One moment's device stores, laid out as the CPU's MomentBuffer (cuda::moment_layout).
struct DeviceMoment {
    DeviceBuffer<float> f32, scales;
    DeviceBuffer<__nv_bfloat16> b16;
    DeviceBuffer<uint8_t> codes;
    explicit DeviceMoment(const MomentBuffer::Plan& p)
        : f32(p.fp32, MemCategory::OptimizerState),
          scales(p.scales, MemCategory::OptimizerState),
          b16(p.bf16, MemCategory::OptimizerState),
          codes(p.code_bytes, MemCategory::OptimizerState) {
        // Zero codes and scales: a zero moment, as fp32's zeroed floats.
        zero(codes);
        zero(scales);
        zero(f32);
        zero(b16);
    }
    template <typename B>
    static void zero(B& b) {
        if (!b.size()) return;
        const std::vector<uint8_t> z(b.bytes(), 0);
        copy_to_device(b.data(), z.data(), b.bytes());
    }
    // Decoded by the CPU's codec: the stores' bytes into a MomentBuffer of the same layout.
    std::vector<float> decode(StateFormat f, bool is_signed, const ParamLayout& layout,
                              std::size_t offset, std::size_t n) {
        MomentBuffer m(f, is_signed, layout, offset, n, {}, MemCategory::Other);
        std::vector<uint8_t> bytes(m.bytes());
        uint8_t* at = bytes.data();
        device_synchronize();
        for (auto [src, size] : {std::pair{(const void*)f32.data(), f32.bytes()},
                                 std::pair{(const void*)b16.data(), b16.bytes()},
                                 std::pair{(const void*)codes.data(), codes.bytes()},
                                 std::pair{(const void*)scales.data(), scales.bytes()}}) {
            if (size) copy_to_host(at, src, size);
            at += size;
        }
        EXPECT_EQ(at, bytes.data() + bytes.size());
        m.load_stored(bytes.data());
        std::vector<float> out(n);
        m.read(out.data());
        return out;
    }
};

// Runs the CPU optimizer and the GPU one side by side for c.steps steps, the GPU on gradients
// stored in T (times the loss scale), the CPU on their true values.
template <typename T>
void optimizer_case(const OptCase& c, bool cpu_fuses) {
    constexpr bool kFp32 = std::is_same_v<T, float>;
    SCOPED_TRACE(testing::Message()
                 << type_name<T>() << " " << c.name << " clip " << c.grad_clip << " nesterov "
                 << c.nesterov << " loss_scale " << c.loss_scale << " offset " << c.offset
                 << " state " << c.format << " bf16 weights " << c.bf16_weights);
    const StateFormat format = parse_state_format(c.format);
    const bool fp32_state = format == StateFormat::Fp32;
    const ParamLayout layout = fp32_state ? tiny_layout() : wide_layout();
    const std::size_t n = c.count ? c.count : layout.total - c.offset;
    OptimConfig cfg;
    cfg.name = c.name;
    cfg.grad_clip = c.grad_clip;
    cfg.nesterov = c.nesterov;
    cfg.weight_decay = 0.1;
    cfg.state_format = c.format;
    auto opt = make_optimizer(cfg, layout, c.offset, n);
    const cuda::MomentLayout ml = cuda::moment_layout(layout, c.offset, n, format, c.max_n);
    const auto& chunks = ml.chunks;
    if (!fp32_state) {
        // What makes the case bite: some moments are stored in the format, some keep fp32.
        EXPECT_GT(ml.plan.bf16 + ml.plan.code_bytes, 0u);
        EXPECT_GT(ml.plan.fp32, 0u);
    }

    auto cpu_params = randn(n, 401, 0.5f);
    if (!kFp32) cpu_params = rounded<T>(cpu_params);  // T params start as T(master)
    auto d_params = upload_as<T>(cpu_params);
    const bool has_master = !kFp32 && !c.bf16_weights;
    DeviceBuffer<float> d_master;
    if (has_master) d_master = upload(cpu_params);
    float* master = has_master ? d_master.data() : nullptr;
    cuda::ParamRounding round;
    const uint64_t seed = bf16_rounding_seed(1337);
    if (c.bf16_weights) round = {1, seed, (int64_t)c.offset};
    DeviceMoment dm(ml.plan), dv(ml.plan);
    DeviceBuffer<float> d_m = std::move(dm.f32), d_v = std::move(dv.f32);  // the fp32 kernels'
    DeviceBuffer<cuda::StateChunk> d_at;
    if (!ml.at.empty()) d_at = upload(ml.at);
    DeviceBuffer<cuda::ChunkGrid> d_grid;
    if (!ml.grid.empty()) d_grid = upload(ml.grid);
    const int bits = format == StateFormat::Int8 ? 8 : 4;
    DeviceBuffer<float> d_tables;
    if (ml.plan.code_bytes) d_tables = upload(cuda::decode_tables(format));
    cuda::MomentStores st;
    st.m32 = d_m.size() ? d_m.data() : nullptr;
    st.v32 = d_v.size() ? d_v.data() : nullptr;
    st.m16 = dm.b16.size() ? dm.b16.data() : nullptr;
    st.v16 = dv.b16.size() ? dv.b16.data() : nullptr;
    st.at = ml.at.empty() ? nullptr : d_at.data();
    if (ml.plan.code_bytes) {
        st.bits = bits;
        st.mq = dm.codes.data();
        st.vq = dv.codes.data();
        st.ms = dm.scales.data();
        st.vs = dv.scales.data();
        st.table_m = d_tables.data();
        st.table_v = d_tables.data() + 256;
        st.qm = cuda::quant_map(format, true);
        st.qv = cuda::quant_map(format, false);
        // Each quantized segment one chunk over a CUDA block per quantization block.
        st.grid = d_grid.data();
        st.blocks = ml.blocks;
        EXPECT_LT(chunks.size(), (std::size_t)ml.blocks);
    }
    auto d_chunks = upload(chunks);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);

    const double lrs[] = {1e-3, 6e-4, 3e-4, 2e-3, 1e-4};
    for (int step = 1; step <= c.steps; step++) {
        const double lr = lrs[step - 1];
        // Gradient norm about 0.1 sqrt(4208) = 6.5: clipped at grad_clip = 1.
        auto g = randn(n, 410 + step, 0.1f);
        std::vector<float> stored(n), cpu_g(n);
        for (std::size_t i = 0; i < n; i++) stored[i] = from_type(to_type<T>(g[i] * c.loss_scale));
        // A power-of-two loss scale divides out exactly.
        for (std::size_t i = 0; i < n; i++) cpu_g[i] = stored[i] / c.loss_scale;
        const double want_norm = clip_grad_norm(cpu_g.data(), n, cfg.grad_clip);
        opt->step(cpu_params.data(), cpu_g.data(), lr);
        if (c.bf16_weights)  // what the CPU engine's ZeroStore stores: the draws by global index
            for (std::size_t i = 0; i < n; i++)
                cpu_params[i] = bf16_to_f32(
                    f32_to_bf16_stochastic(cpu_params[i], seed, (uint64_t)step, c.offset + i));

        auto d_g = upload_as<T>(stored);
        cuda::sum_squares<T>(d_sumsq.data(), d_g.data(), (int64_t)n);
        cuda::StepScalars s = cuda::make_step_scalars(cfg, lr, step, c.loss_scale);
        copy_to_device(d_s.data(), &s, sizeof s);
        cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
        if (cfg.name == "sgd" && fp32_state && !c.bf16_weights) {
            cuda::sgd_step<T>(d_params.data(), master, d_m.data(), d_g.data(), d_chunks.data(),
                              (int)chunks.size(), d_s.data());
        } else if (cfg.name == "sgd") {
            cuda::sgd_step<T>(d_params.data(), master, st, d_g.data(), d_chunks.data(),
                              (int)chunks.size(), d_s.data(), 0, round);
        } else if (fp32_state && !c.bf16_weights) {
            cuda::adamw_step<T>(d_params.data(), master, d_m.data(), d_v.data(), d_g.data(),
                                d_chunks.data(), (int)chunks.size(), d_s.data());
        } else {
            cuda::adamw_step<T>(d_params.data(), master, st, d_g.data(), d_chunks.data(),
                                (int)chunks.size(), d_s.data(), 0, round);
        }
        cuda::StepScalars back{};
        device_synchronize();
        copy_to_host(&back, d_s.data(), sizeof back);
        EXPECT_EQ(back.skip, 0);
        EXPECT_NEAR(back.grad_norm, want_norm, 1e-6 * want_norm);
    }

    const std::vector<std::string> names = opt->state_names();
    auto cpu_state = [&](int i) {
        std::vector<float> s(n);
        opt->read_state(names[i], s.data());
        return s;
    };
    if (kFp32) {
        expect_match("params", download_float(d_params), cpu_params, cpu_fuses);
    } else if (c.bf16_weights) {
        // The same fp32 update rounded with the same draws: bitwise where the CPU fuses as the
        // kernels do. Elsewhere an fp32 result an ulp apart crosses the draw's threshold about
        // once in 2^16 elements, a bf16 ulp away.
        const std::vector<float> got = download_float(d_params);
        if (cpu_fuses) {
            expect_bitwise("bf16 params", got, cpu_params);
        } else {
            std::size_t off = 0;
            for (std::size_t i = 0; i < n; i++) {
                off += got[i] != cpu_params[i];
                EXPECT_NEAR(got[i], cpu_params[i], std::fabs(cpu_params[i]) / 64 + 1e-30) << i;
            }
            EXPECT_LE(off, 4u);
        }
    } else {
        // The master weights see the same fp32 arithmetic as the CPU's parameters; only the clip
        // coefficient can differ, its norm being summed in another order (in practice the bits
        // agree). Within 1e-5 relative plus 1e-6 of the rms; the T parameters are the master
        // rounded to nearest even, exactly.
        auto master = download(d_master);
        expect_match("master", master, cpu_params, false);
        expect_bitwise("params = T(master)", download_float(d_params), rounded<T>(master));
    }
    auto device_state = [&](DeviceBuffer<float>& f32, DeviceMoment& d, bool is_signed) {
        d.f32 = std::move(f32);
        return d.decode(format, is_signed, layout, c.offset, n);
    };
    const bool bitwise = kFp32 && cpu_fuses;
    if (cfg.name == "sgd") {
        expect_state_match("momentum_buffer", device_state(d_m, dm, true), cpu_state(0), bitwise,
                           format, cpu_fuses);
    } else {
        expect_state_match("exp_avg", device_state(d_m, dm, true), cpu_state(0), bitwise, format,
                           cpu_fuses);
        expect_state_match("exp_avg_sq", device_state(d_v, dv, false), cpu_state(1), bitwise,
                           format, cpu_fuses);
    }
}

}  // namespace

TEST(CudaOptimizer, AdamWMatchesCpu) {
    REQUIRE_GPU();
    const bool fuses = cpu_optimizer_fuses();
    if (!fuses)
        std::cout << "[ note ] this build's CPU optimizer does not fuse multiply-adds: "
                     "fp32 compared within a tolerance, not bitwise\n";
    const ParamLayout layout = tiny_layout();
    // 5 steps, with and without clipping, the whole buffer and a shard cutting tensors.
    optimizer_case<float>({"adamw", 5, 0.0, false, 1.0f, 0, 0, 1 << 16}, fuses);
    optimizer_case<float>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300}, fuses);
    optimizer_case<float>({"adamw", 5, 1.0, false, 1.0f, 100, layout.total - 250, 257}, fuses);
    optimizer_case<__nv_bfloat16>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300}, fuses);
    optimizer_case<__nv_bfloat16>({"adamw", 5, 0.0, false, 1.0f, 37, 0, 1 << 16}, fuses);
    // fp16 gradients stored at 1024 x their value.
    optimizer_case<__half>({"adamw", 5, 1.0, false, 1024.0f, 0, 0, 300}, fuses);
    optimizer_case<__half>({"adamw", 5, 0.0, false, 1024.0f, 0, 0, 300}, fuses);
    // bf16 moments (optim.state_format): the same fp32 arithmetic, each moment rounded to
    // nearest even where its tensor does not keep fp32, as the CPU's MomentBuffer does.
    const std::size_t wide = wide_layout().total;
    optimizer_case<float>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, "bf16"}, fuses);
    optimizer_case<float>({"adamw", 5, 0.0, false, 1.0f, 100, wide - 250, 257, "bf16"}, fuses);
    optimizer_case<__nv_bfloat16>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, "bf16"}, fuses);
    // int8 and int4 moments: each quantization block decoded, updated in fp32 and encoded with
    // its new largest magnitude, the CPU's codes and scales (and a range from the second cell of
    // the 256 grid, as a pipeline stage or a grain-cut shard starts).
    for (const char* q : {"int8", "int4"}) {
        optimizer_case<float>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, q}, fuses);
        optimizer_case<float>({"adamw", 5, 0.0, false, 1.0f, 256, 0, 257, q}, fuses);
        optimizer_case<__nv_bfloat16>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, q}, fuses);
    }
}

// optim.master = "none": bf16 parameters updated in fp32 and rounded stochastically with the
// CPU engine's draws, by each element's index in the whole buffer (a range starting at 37 or
// 256 draws as the CPU's global index says), with the moments in every format.
TEST(CudaOptimizer, Bf16WeightsRoundStochasticallyAsTheCpu) {
    REQUIRE_GPU();
    const bool fuses = cpu_optimizer_fuses();
    const std::size_t wide = wide_layout().total;
    using B = __nv_bfloat16;
    optimizer_case<B>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, "fp32", true}, fuses);
    optimizer_case<B>({"adamw", 5, 0.0, false, 1.0f, 37, 0, 1 << 16, "fp32", true}, fuses);
    optimizer_case<B>({"adamw", 5, 1.0, false, 1.0f, 100, wide - 250, 257, "bf16", true}, fuses);
    optimizer_case<B>({"adamw", 5, 1.0, false, 1.0f, 256, 0, 257, "int8", true}, fuses);
    optimizer_case<B>({"adamw", 5, 1.0, false, 1.0f, 0, 0, 300, "int4", true}, fuses);
    optimizer_case<B>({"sgd", 3, 1.0, true, 1.0f, 0, 0, 300, "fp32", true}, fuses);
    optimizer_case<B>({"sgd", 3, 1.0, false, 1.0f, 0, 0, 300, "int8", true}, fuses);
    // Without the stochastic flag a null master is refused, and with it a master or another type.
    const ParamLayout layout = tiny_layout();
    DeviceBuffer<B> p(16, MemCategory::Other);
    DeviceBuffer<float> f(16, MemCategory::Other);
    DeviceBuffer<cuda::StepScalars> s(1, MemCategory::Other);
    const auto ch = upload(cuda::tensor_chunks(layout, 0, 16));
    cuda::MomentStores st;
    st.m32 = f.data();
    st.v32 = f.data();
    const cuda::ParamRounding sr{1, 7, 0};
    EXPECT_THROW(cuda::adamw_step<B>(p.data(), nullptr, st, p.data(), ch.data(), 1, s.data()),
                 Error);
    EXPECT_THROW(
        cuda::adamw_step<B>(p.data(), f.data(), st, p.data(), ch.data(), 1, s.data(), 0, sr),
        Error);
    EXPECT_THROW(
        cuda::adamw_step<float>(f.data(), nullptr, st, f.data(), ch.data(), 1, s.data(), 0, sr),
        Error);
}

TEST(CudaOptimizer, SgdMatchesCpu) {
    REQUIRE_GPU();
    const bool fuses = cpu_optimizer_fuses();
    const ParamLayout layout = tiny_layout();
    optimizer_case<float>({"sgd", 3, 0.0, false, 1.0f, 0, 0, 1 << 16}, fuses);
    optimizer_case<float>({"sgd", 3, 1.0, false, 1.0f, 0, 0, 300}, fuses);
    optimizer_case<float>({"sgd", 3, 1.0, true, 1.0f, 100, layout.total - 250, 257}, fuses);
    optimizer_case<__nv_bfloat16>({"sgd", 3, 1.0, true, 1.0f, 0, 0, 300}, fuses);
    optimizer_case<__half>({"sgd", 3, 1.0, false, 1024.0f, 0, 0, 300}, fuses);
    optimizer_case<float>({"sgd", 3, 1.0, true, 1.0f, 0, 0, 300, "bf16"}, fuses);
    optimizer_case<float>({"sgd", 3, 1.0, true, 1.0f, 0, 0, 300, "int8"}, fuses);
}

// A non-finite gradient norm sets skip, and then the step changes nothing at all.
template <typename T>
void skip_case(const char* name) {
    SCOPED_TRACE(testing::Message() << type_name<T>() << " " << name);
    constexpr bool kFp32 = std::is_same_v<T, float>;
    const ParamLayout layout = tiny_layout();
    const std::size_t n = layout.total;
    const auto chunks = cuda::tensor_chunks(layout, 0, n, 500);
    OptimConfig cfg;
    cfg.name = name;
    auto params = rounded<T>(randn(n, 501, 0.5f));
    auto d_params = upload_as<T>(params);
    DeviceBuffer<float> d_master;
    if (!kFp32) d_master = upload(params);
    auto d_m = upload(randn(n, 502, 0.01f)), d_v = upload(randn(n, 503, 0.01f));
    for (auto* d : {&d_m, &d_v}) {  // v >= 0, as a second moment is
        auto h = download(*d);
        for (auto& x : h) x = std::fabs(x);
        *d = upload(h);
    }
    const auto m0 = download(d_m), v0 = download(d_v);
    auto g = randn(n, 504, 0.1f);
    // Overflowed fp16 gradients: a value beyond 65504 at a loss scale of 1024.
    const float loss_scale = std::is_same_v<T, __half> ? 1024.0f : 1.0f;
    for (auto& x : g) x *= loss_scale;
    g[1234] = std::is_same_v<T, __half> ? 1e6f : std::numeric_limits<float>::infinity();
    auto d_g = upload_as<T>(g);
    auto d_chunks = upload(chunks);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    cuda::sum_squares<T>(d_sumsq.data(), d_g.data(), (int64_t)n);
    auto s = cuda::make_step_scalars(cfg, 1e-3, 2, loss_scale);
    copy_to_device(d_s.data(), &s, sizeof s);
    cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
    if (std::string(name) == "sgd")
        cuda::sgd_step<T>(d_params.data(), kFp32 ? nullptr : d_master.data(), d_m.data(),
                          d_g.data(), d_chunks.data(), (int)chunks.size(), d_s.data());
    else
        cuda::adamw_step<T>(d_params.data(), kFp32 ? nullptr : d_master.data(), d_m.data(),
                            d_v.data(), d_g.data(), d_chunks.data(), (int)chunks.size(),
                            d_s.data());
    cuda::StepScalars back{};
    device_synchronize();
    copy_to_host(&back, d_s.data(), sizeof back);
    EXPECT_EQ(back.skip, 1);
    EXPECT_FALSE(std::isfinite(back.grad_norm));
    expect_bitwise("params", download_float(d_params), params);
    if (!kFp32) expect_bitwise("master", download(d_master), params);
    expect_bitwise("m", download(d_m), m0);
    expect_bitwise("v", download(d_v), v0);
}

TEST(CudaOptimizer, NonFiniteNormSkipsTheStep) {
    REQUIRE_GPU();
    skip_case<float>("adamw");
    skip_case<float>("sgd");
    skip_case<__nv_bfloat16>("adamw");
    skip_case<__half>("adamw");
    skip_case<__half>("sgd");
}

// Weight decay follows each tensor's flag: with zero gradients and zero moments, AdamW multiplies
// the decayed tensors by 1 - lr * wd and leaves the others alone.
TEST(CudaOptimizer, DecayFlagsPerTensor) {
    REQUIRE_GPU();
    const ParamLayout layout = tiny_layout();
    const std::size_t n = layout.total;
    const auto chunks = cuda::tensor_chunks(layout, 0, n, 200);
    OptimConfig cfg;
    cfg.weight_decay = 0.25;
    auto params = randn(n, 601);
    auto d_params = upload(params);
    auto d_chunks = upload(chunks);
    DeviceBuffer<float> d_m(n, MemCategory::Other), d_v(n, MemCategory::Other),
        d_g(n, MemCategory::Other);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    cuda::sum_squares<float>(d_sumsq.data(), d_g.data(), (int64_t)n);
    auto s = cuda::make_step_scalars(cfg, 0.01, 1);
    copy_to_device(d_s.data(), &s, sizeof s);
    cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
    cuda::adamw_step<float>(d_params.data(), nullptr, d_m.data(), d_v.data(), d_g.data(),
                            d_chunks.data(), (int)chunks.size(), d_s.data());
    std::vector<float> want = params;
    int decayed = 0, kept = 0;
    for (const auto& t : layout.tensors) {
        (t.decay ? decayed : kept)++;
        if (!t.decay) continue;
        for (std::size_t i = t.offset; i < t.offset + t.numel; i++) want[i] *= s.decay_factor;
    }
    ASSERT_GT(decayed, 0);
    ASSERT_GT(kept, 0);
    expect_bitwise("params", download(d_params), want);
}

// A step captured into a CUDA graph (norm, clip decision, update) replays with the scalars the
// host writes before each launch: the entries only queue work, and read every per-step value on
// the device.
TEST(CudaOptimizer, CapturedStepReplaysWithNewScalars) {
    REQUIRE_GPU();
    using T = __nv_bfloat16;
    const ParamLayout layout = tiny_layout();
    const std::size_t n = layout.total;
    const auto chunks = cuda::tensor_chunks(layout, 0, n, 300);
    OptimConfig cfg;
    auto params = rounded<T>(randn(n, 701, 0.5f));
    struct State {
        DeviceBuffer<T> p;
        DeviceBuffer<float> master, m, v;
    };
    auto fresh = [&] {
        return State{upload_as<T>(params), upload(params),
                     DeviceBuffer<float>(n, MemCategory::Other),
                     DeviceBuffer<float>(n, MemCategory::Other)};
    };
    State direct = fresh(), graphed = fresh();
    auto d_chunks = upload(chunks);
    DeviceBuffer<T> d_g(n, MemCategory::Other);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    cudaStream_t stream;
    MT_CUDA_CHECK(cudaStreamCreate(&stream));
    auto queue_step = [&](State& st, cudaStream_t s) {
        cuda::sum_squares<T>(d_sumsq.data(), d_g.data(), (int64_t)n, s);
        cuda::finish_grad_norm(d_s.data(), d_sumsq.data(), s);
        cuda::adamw_step<T>(st.p.data(), st.master.data(), st.m.data(), st.v.data(), d_g.data(),
                            d_chunks.data(), (int)chunks.size(), d_s.data(), s);
    };
    auto set_step = [&](int step) {
        auto g = randn(n, 710 + step, 0.1f);
        if (step == 2) g[77] = std::numeric_limits<float>::infinity();  // a skipped step
        auto h = rounded<T>(g);
        std::vector<T> raw(n);
        for (std::size_t i = 0; i < n; i++) raw[i] = to_type<T>(h[i]);
        copy_to_device(d_g.data(), raw.data(), raw.size() * sizeof(T));
        const double lrs[] = {1e-3, 5e-4, 2e-4};
        auto sc = cuda::make_step_scalars(cfg, lrs[step - 1], step);
        copy_to_device(d_s.data(), &sc, sizeof sc);
    };
    for (int step = 1; step <= 3; step++) {
        set_step(step);
        queue_step(direct, stream);
        MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    MT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    queue_step(graphed, stream);
    cudaGraph_t graph;
    MT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    MT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int step = 1; step <= 3; step++) {
        set_step(step);
        MT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    expect_bitwise("params", download_float(graphed.p), download_float(direct.p));
    expect_bitwise("master", download(graphed.master), download(direct.master));
    expect_bitwise("m", download(graphed.m), download(direct.m));
    expect_bitwise("v", download(graphed.v), download(direct.v));
    MT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MT_CUDA_CHECK(cudaGraphDestroy(graph));
    MT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaOptimizer, BadArgumentsNameTheOp) {
    REQUIRE_GPU();
    DeviceBuffer<__nv_bfloat16> p(8, MemCategory::Other);
    DeviceBuffer<float> f(8, MemCategory::Other);
    DeviceBuffer<cuda::TensorChunk> ch(1, MemCategory::Other);
    DeviceBuffer<cuda::StepScalars> s(1, MemCategory::Other);
    try {
        cuda::adamw_step<__nv_bfloat16>(p.data(), nullptr, f.data(), f.data(), p.data(), ch.data(),
                                        1, s.data());
        ADD_FAILURE() << "bf16 without master weights: no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("cuda::adamw_step"), std::string::npos) << e.what();
    }
    try {
        cuda::sgd_step<float>(f.data(), nullptr, f.data(), f.data(), ch.data(), -1, s.data());
        ADD_FAILURE() << "negative nchunks: no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("cuda::sgd_step"), std::string::npos) << e.what();
    }
    // No chunks: nothing to do.
    cuda::adamw_step<float>(f.data(), nullptr, f.data(), f.data(), f.data(), ch.data(), 0,
                            s.data());
}

#endif  // MEMTRAIN_HAVE_CUDA
