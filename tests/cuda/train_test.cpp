// The CUDA engine end to end (on a GPU, or on cudasim where there is none): fp32 training
// tracks the CPU reference, bf16 tracks fp32, fp16's loss scaling skips an overflowing step and
// halves the scale, runs repeat bit for bit and resume exactly, checkpoints move between
// devices, every remat policy trains the same model, and the device memory is what the memory
// model predicts (2 + 2 + 12 bytes per parameter for mixed precision).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "cuda/device_fit_util.h"
#include "engine/cuda/cuda_engine.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "remat/policy.h"
#include "remat/solver.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train/validate.h"

#if MEMTRAIN_HAVE_CUDA

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

using test::quiet;

// The tiny run of tests/test_util.h on the GPU in `precision`.
RunConfig cuda_run(const std::string& dir, int steps, const std::string& precision) {
    RunConfig c = test::tiny_run(dir, steps);
    c.train.device = "cuda";
    c.train.precision = precision;
    return c;
}

// A model whose heads are 64 wide, so bf16/fp16 attention takes the tensor-core path.
RunConfig wide_heads(RunConfig c) {
    c.model.n_embd = 128;
    c.model.n_head = 2;
    c.model.block_size = 32;
    c.train.seq_len = 32;
    return c;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (std::size_t i = 0; i < a.size(); i++) m = std::max(m, (double)std::fabs(a[i] - b[i]));
    return m;
}

// How many of the parameters differ by more than `tol`.
std::size_t count_beyond(const std::vector<float>& a, const std::vector<float>& b, double tol) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < a.size(); i++) n += std::fabs(a[i] - b[i]) > tol;
    return n;
}

}  // namespace

TEST(CudaTrain, Fp32MatchesTheCpuReferenceFor20Steps) {
    REQUIRE_GPU();
    auto d1 = test::temp_dir("cuda_fp32_cpu"), d2 = test::temp_dir("cuda_fp32_gpu");
    Trainer cpu(test::tiny_run(d1, 20), quiet());
    Trainer gpu(cuda_run(d2, 20, "fp32"), quiet());
    auto a = cpu.run(), b = gpu.run();
    ASSERT_EQ(a.losses.size(), 20u);
    ASSERT_EQ(b.losses.size(), 20u);
    // Same data, init and arithmetic up to summation order and libm: the curves agree to about
    // 1e-5 relative, growing slowly with the steps as AdamW amplifies rounding differences.
    for (int i = 0; i < 20; i++)
        EXPECT_NEAR(b.losses[i], a.losses[i], 2e-4 * std::fabs(a.losses[i]) + 1e-5) << "step " << i;
    ASSERT_EQ(a.val_losses.size(), b.val_losses.size());
    for (std::size_t i = 0; i < a.val_losses.size(); i++)
        EXPECT_NEAR(b.val_losses[i].second, a.val_losses[i].second, 1e-3);
    EXPECT_LT(max_abs_diff(cpu.params(), gpu.params()), 1e-4);
}

TEST(CudaTrain, Bf16AndFp16TrackFp32) {
    REQUIRE_GPU();
    auto d32 = test::temp_dir("cuda_mp_fp32");
    const int steps = 20;
    Trainer ref(wide_heads(cuda_run(d32, steps, "fp32")), quiet());
    auto r = ref.run();
    for (const char* p : {"bf16", "fp16"}) {
        SCOPED_TRACE(p);
        auto d = test::temp_dir(std::string("cuda_mp_") + p);
        Trainer t(wide_heads(cuda_run(d, steps, p)), quiet());
        auto s = t.run();
        ASSERT_EQ(s.losses.size(), (std::size_t)steps);
        EXPECT_EQ(s.steps_skipped, 0);
        // Mixed precision stores activations, weights and gradients with 8 (bf16) or 11 (fp16)
        // significant bits and keeps fp32 master weights: the loss curve stays within a few
        // hundredths of fp32's on this model (its losses fall from ~3.9 to ~2.5).
        for (int i = 0; i < steps; i++) EXPECT_NEAR(s.losses[i], r.losses[i], 0.05) << "step " << i;
        EXPECT_LT(s.losses.back(), s.losses.front() - 0.5) << "it learns";
    }
}

// The CPU engine's bf16 (bf16 GEMM operands, fp32 storage) against the CUDA engine's bf16 (bf16
// storage of weights, activations and gradients, fp32 master): the same rules in two designs.
// Stated tolerance: the first step's loss within 0.5% (one forward on the same weights), every
// step's within 0.05 (as bf16 tracks fp32 above), and the weights after 10 steps within 1% in
// relative L2 (one element may differ by a few AdamW steps of lr: a near-zero gradient's sign).
TEST(CudaTrain, CpuBf16TracksTheCudaBf16Step) {
    REQUIRE_GPU();
    const int steps = 10;
    auto d1 = test::temp_dir("cuda_bf16_cpu"), d2 = test::temp_dir("cuda_bf16_gpu");
    RunConfig c = wide_heads(test::tiny_run(d1, steps));
    c.train.precision = "bf16";
    Trainer cpu(c, quiet());
    Trainer gpu(wide_heads(cuda_run(d2, steps, "bf16")), quiet());
    auto a = cpu.run(), b = gpu.run();
    ASSERT_EQ(a.losses.size(), (std::size_t)steps);
    ASSERT_EQ(b.losses.size(), (std::size_t)steps);
    EXPECT_NEAR(b.losses[0], a.losses[0], 5e-3 * a.losses[0]);
    for (int i = 0; i < steps; i++) EXPECT_NEAR(b.losses[i], a.losses[i], 0.05) << "step " << i;
    const std::vector<float> pc = cpu.params(), pg = gpu.params();
    double num = 0, den = 0;
    for (std::size_t i = 0; i < pc.size(); i++) {
        num += ((double)pg[i] - pc[i]) * ((double)pg[i] - pc[i]);
        den += (double)pc[i] * pc[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-2);
}

// The first amp line of a run (train.diagnostics = amp): its total and its histogram.
struct AmpLine {
    int64_t values = 0;
    std::map<int, int64_t> bins;  // log2 exponent -> count
};
AmpLine first_amp_line(const std::string& out_dir) {
    std::ifstream in(out_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j.value("event", "") != "amp") continue;
        AmpLine a;
        a.values = j["values"].get<int64_t>();
        int e = j["log2_lo"].get<int>();
        for (const auto& n : j["log2_counts"]) a.bins[e++] = n.get<int64_t>();
        return a;
    }
    ADD_FAILURE() << "no amp line in " << out_dir;
    return {};
}

// train.diagnostics = amp on one GPU: the step's gradients brought down and counted. In fp32
// the first step's histogram is the CPU engine's but for values on a power-of-two edge; in fp16
// the gradients carry the loss scale and are counted unscaled, so their histogram is fp32's but
// for fp16's rounding.
TEST(CudaTrain, AmpDiagnosticsCountTheGpuGradients) {
    REQUIRE_GPU();
    auto dc = test::temp_dir("cuda_amp_cpu"), d32 = test::temp_dir("cuda_amp_fp32"),
         d16 = test::temp_dir("cuda_amp_fp16");
    auto with_amp = [](RunConfig c) {
        c.train.diagnostics = "amp";
        c.train.diagnostics_every = 100;
        return c;
    };
    const RunConfig rc = with_amp(wide_heads(test::tiny_run(dc, 1))),
                    r32 = with_amp(wide_heads(cuda_run(d32, 1, "fp32"))),
                    r16 = with_amp(wide_heads(cuda_run(d16, 1, "fp16")));
    Trainer cpu(rc, quiet());
    const int64_t params = (int64_t)cpu.params().size();
    cpu.run();
    Trainer(r32, quiet()).run();
    Trainer(r16, quiet()).run();
    const AmpLine c = first_amp_line(rc.io.out_dir), g32 = first_amp_line(r32.io.out_dir),
                  g16 = first_amp_line(r16.io.out_dir);
    EXPECT_EQ(c.values, params);
    EXPECT_EQ(g32.values, params);
    EXPECT_EQ(g16.values, params);
    auto moved = [](const AmpLine& a, const AmpLine& b) {  // values in another bin, counted twice
        int64_t d = 0;
        std::map<int, int64_t> all = a.bins;
        for (const auto& [e, n] : b.bins) all[e] += 0;
        for (const auto& [e, n] : all) {
            const auto ia = a.bins.find(e), ib = b.bins.find(e);
            d += std::llabs((ia == a.bins.end() ? 0 : ia->second) -
                            (ib == b.bins.end() ? 0 : ib->second));
        }
        return d;
    };
    EXPECT_LT(moved(c, g32), params / 100) << "fp32 GPU against the CPU";
    EXPECT_LT(moved(g32, g16), params / 20) << "fp16 (unscaled) against fp32";
    // Unscaled: fp16's gradients sit where fp32's do, not 2^16 higher.
    EXPECT_EQ(g16.bins.rbegin()->first, g32.bins.rbegin()->first);
}

// In fp32 (no loss scaler) a non-finite gradient is the divergence guard's: the engine skips the
// update, the guard goes back to its snapshot from the start and reads past the batch, and the
// run completes (without the guard it would end: DeviceStep's "no loss scale to lower").
TEST(CudaTrain, TheGuardUndoesANonFiniteFp32Step) {
    REQUIRE_GPU();
    RunConfig c = cuda_run(test::temp_dir("cuda_guard_fp32"), 4, "fp32");
    c.train.eval_every = 0;
    TrainOptions o = quiet();
    bool done = false;
    o.before_step = [&](int64_t step, Engine& e) {
        if (step != 3 || done) return;
        done = true;
        inject_overflow_for_test(e);  // a gradient becomes inf
    };
    const TrainSummary s = Trainer(c, o).run();
    ASSERT_EQ(s.guard_actions.size(), 1u);
    EXPECT_EQ(s.guard_actions[0].step, 3);
    EXPECT_EQ(s.guard_actions[0].to_step, 0);
    EXPECT_NE(s.guard_actions[0].reason.find("not both finite"), std::string::npos)
        << s.guard_actions[0].reason;
    EXPECT_EQ(s.steps_done, 4);
    ASSERT_EQ(s.losses.size(), 4u);
    for (float l : s.losses) EXPECT_TRUE(std::isfinite(l));

    c.guard.enabled = false;  // the same fault without the guard ends the run, naming it
    c.io.out_dir += "_off";
    done = false;
    Trainer off(c, o);
    EXPECT_NE(test::error_of([&] { off.run(); }).find("no loss scale to lower"), std::string::npos);
}

TEST(CudaTrain, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
    REQUIRE_GPU();
    auto d = test::temp_dir("cuda_fp16_overflow");
    RunConfig c = cuda_run(d, 3, "fp16");
    c.optim.loss_scale = 1024;
    std::vector<float> before_2, after_2;
    double scale_after_2 = 0;
    TrainOptions o = quiet();
    o.before_step = [&](int64_t step, Engine& e) {
        if (step == 2) {
            before_2 = gather_params(e.weights());
            inject_overflow_for_test(e);  // a gradient becomes inf, as an fp16 overflow would
        }
        if (step == 3) {
            after_2 = gather_params(e.weights());
            scale_after_2 = e.loss_scaler_state().first;
        }
    };
    Trainer t(c, o);
    auto s = t.run();
    EXPECT_EQ(s.steps_skipped, 1);
    ASSERT_FALSE(before_2.empty());
    EXPECT_EQ(before_2, after_2) << "the skipped step changed parameters";
    EXPECT_EQ(scale_after_2, 512.0) << "the scale halves on overflow";
    EXPECT_NE(after_2, t.params()) << "step 3 updates again";
    // The metrics file records the scale each step carried and the skip.
    std::ifstream m(c.io.out_dir + "/metrics.jsonl");
    std::string all((std::istreambuf_iterator<char>(m)), std::istreambuf_iterator<char>());
    EXPECT_NE(all.find("\"step\": 2, \"loss\""), std::string::npos) << all;
    EXPECT_NE(all.find("\"loss_scale\": 1024, \"skipped\": true"), std::string::npos) << all;
    // ... and where: the injected inf sits in wte.weight, and only there.
    EXPECT_NE(all.find("\"overflow\": \"non-finite gradients in 1 of "), std::string::npos) << all;
    EXPECT_NE(all.find("first in backward order: wte.weight\""), std::string::npos) << all;
    EXPECT_NE(all.find("\"loss_scale\": 512, \"skipped\": false"), std::string::npos) << all;
}

// Weights beyond fp16's range (as a bf16-trained checkpoint may hold) are refused before an fp16
// run starts, naming the tensor; bf16 takes them.
TEST(CudaTrain, Fp16RefusesWeightsBeyondItsRange) {
    REQUIRE_GPU();
    RunConfig src = test::tiny_run(test::temp_dir("cuda_fp16_range_src"), 1);
    TrainOptions o = quiet();
    o.before_step = [](int64_t, Engine& e) {
        ModelWeights w = e.weights();
        const int u = w.layout.block_unit(1);
        float* p = w.store.acquire(u, true);
        p[w.layout.get("h.1.mlp.c_fc.weight").offset - w.layout.units[u].begin] = 1e5f;
        w.store.release(u);
    };
    Trainer t(src, o);
    const std::string ckpt = t.run().last_checkpoint + "/model.safetensors";
    RunConfig c = cuda_run(test::temp_dir("cuda_fp16_range"), 1, "fp16");
    c.model.init_from = ckpt;
    try {
        Trainer bad(c, quiet());
        FAIL() << "fp16 accepted a weight of 1e5";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("h.1.mlp.c_fc.weight holds a weight of magnitude"),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
    }
    c.train.precision = "bf16";
    EXPECT_NO_THROW(Trainer(c, quiet()));
}

TEST(CudaTrain, SameSeedTwiceGivesSameBitsAndResumeIsExact) {
    REQUIRE_GPU();
    for (const char* p : {"fp32", "bf16"}) {
        SCOPED_TRACE(p);
        auto d1 = test::temp_dir(std::string("cuda_det1_") + p);
        auto d2 = test::temp_dir(std::string("cuda_det2_") + p);
        auto d3 = test::temp_dir(std::string("cuda_det3_") + p);
        Trainer a(cuda_run(d1, 12, p), quiet()), b(cuda_run(d2, 12, p), quiet());
        auto sa = a.run(), sb = b.run();
        EXPECT_EQ(sa.losses, sb.losses);
        EXPECT_EQ(a.params(), b.params());
        // 12 steps = 6 + resume + 6: no atomics anywhere, so the bits repeat on the same GPU.
        TrainSummary resumed;
        auto second = test::train_stop_and_resume(cuda_run(d3, 12, p), 6, resumed);
        ASSERT_EQ(resumed.losses.size(), 6u);
        for (int i = 0; i < 6; i++) EXPECT_EQ(resumed.losses[i], sa.losses[6 + i]) << i;
        EXPECT_EQ(second->params(), a.params());
    }
}

TEST(CudaTrain, CudaGraphsReplayTheSameSteps) {
    REQUIRE_GPU();
    for (const char* p : {"fp32", "fp16"}) {
        SCOPED_TRACE(p);
        auto d1 = test::temp_dir(std::string("cuda_graph_off_") + p);
        auto d2 = test::temp_dir(std::string("cuda_graph_on_") + p);
        RunConfig c = cuda_run(d1, 8, p);
        c.train.remat = "selective";  // recompute is captured too
        Trainer eager(c, quiet());
        RunConfig g = cuda_run(d2, 8, p);
        g.train.remat = "selective";
        g.train.cuda_graphs = true;
        Trainer graphed(g, quiet());
        auto a = eager.run(), b = graphed.run();
        // The same kernels on the same buffers in the same order: the same bits, every step
        // (each step has two micro-batches: the first runs eagerly, the rest replay a capture).
        EXPECT_EQ(a.losses, b.losses);
        EXPECT_EQ(a.val_losses, b.val_losses);
        EXPECT_EQ(eager.params(), graphed.params());
        EXPECT_EQ(cuda_graph_replays_for_test(eager.engine()), 0);
        // 8 steps x 2 micro-batches, the first one eager; the fp16 loss scale stays put.
        EXPECT_EQ(cuda_graph_replays_for_test(graphed.engine()), 15);
    }
}

TEST(CudaTrain, OffloadedOptimizerTrainsTheSameModel) {
    REQUIRE_GPU();
    for (const char* p : {"fp32", "bf16"}) {
        SCOPED_TRACE(p);
        auto d1 = test::temp_dir(std::string("cuda_opt_dev_") + p);
        auto d2 = test::temp_dir(std::string("cuda_opt_host_") + p);
        Trainer dev(cuda_run(d1, 10, p), quiet());
        RunConfig h = cuda_run(d2, 10, p);
        h.train.offload_optimizer = true;
        const MemoryStats before = device_memory().snapshot();
        const MemoryStats host_before = host_memory().snapshot();
        Trainer host(h, quiet());
        const MemoryStats after = device_memory().snapshot();
        const MemoryStats host_after = host_memory().snapshot();
        auto a = dev.run(), b = host.run();
        // The same AdamW arithmetic on the same gradients, on the CPU instead of the GPU. The
        // kernels spell out the multiply-adds the optimised CPU build fuses, so there the curves
        // are bitwise equal on cudasim; an unoptimised build (the sanitizer suite) fuses none,
        // and bf16 then rounds a few parameters the other way, which the steps carry on.
        const bool fp32 = std::string(p) == "fp32";
        for (int i = 0; i < 10; i++)
            EXPECT_NEAR(b.losses[i], a.losses[i], (fp32 ? 1e-5 : 1e-3) * std::fabs(a.losses[i]))
                << "step " << i;
        if (fp32) {
            EXPECT_LT(max_abs_diff(dev.params(), host.params()), 5e-5);
        } else {
            // A bf16 weight rounded the other way changes the gradients a little, and Adam
            // moves a parameter whose gradient is noise by about lr per step whatever its
            // size, so a few parameters may drift apart by a few lr (21 of 7872 in the sanitizer
            // build); the rest agree to 1e-3. A wrong update would move nearly all of them.
            const std::vector<float> pd = dev.params(), ph = host.params();
            EXPECT_LE(count_beyond(pd, ph, 1e-3), pd.size() / 100) << "of " << pd.size();
            EXPECT_LT(max_abs_diff(pd, ph), 2 * 10 * h.optim.lr);
        }
        // Nothing of the optimizer on the device.
        EXPECT_EQ(after[MemCategory::OptimizerState], before[MemCategory::OptimizerState]);
        // The gradients stream to the host unit by unit during the last backward, and the
        // parameters go up unit by unit; under CUDA graphs they come down in one copy after the
        // backward. Both give the same bits.
        RunConfig hg = cuda_run(test::temp_dir(std::string("cuda_opt_graph_") + p), 10, p);
        hg.train.offload_optimizer = hg.train.cuda_graphs = true;
        Trainer graphed(hg, quiet());
        EXPECT_EQ(graphed.run().losses, b.losses);
        EXPECT_EQ(graphed.params(), host.params());
        for (const auto& row : host.engine().predicted_memory(h.micro_batch(), h.train.seq_len)) {
            if (row.category == MemCategory::OptimizerState) {
                EXPECT_EQ(row.bytes, 0u);
            }
        }
        // The planner (`memtrain estimate --offload optimizer`) predicts both sides: parameters
        // and gradients on the device, and on the host the fp32 master, Adam's moments, the fp32
        // gradients and the pinned transfer buffer.
        plan::RunSpec r;
        r.precision = fp32 ? Precision::fp32 : Precision::bf16;
        r.offload = plan::Offload::optimizer;
        r.micro_batch = h.micro_batch();
        r.seq = h.train.seq_len;
        const auto est = plan::estimate_memory(plan::model_from_config(h.model), r);
        auto grew = [](const MemoryStats& a, const MemoryStats& b, MemCategory k) {
            return (double)(b[k] - a[k]);
        };
        EXPECT_EQ(est.bytes("optimizer states"), 0);
        EXPECT_NEAR((double)est.bytes("parameters"), grew(before, after, MemCategory::Parameters),
                    0);
        EXPECT_NEAR((double)est.bytes("gradients"), grew(before, after, MemCategory::Gradients), 0);
        const double host_states = grew(host_before, host_after, MemCategory::OptimizerState) +
                                   grew(host_before, host_after, MemCategory::Gradients) +
                                   grew(host_before, host_after, MemCategory::Communication);
        EXPECT_GT(host_states, 0);
        // (The host optimizer's small per-tensor tables are not in the formula.)
        EXPECT_NEAR((double)est.cpu_bytes, host_states, 4096) << p;
    }
    // Resume with the optimizer on the host: 8 = 4 + resume + 4, bit for bit.
    auto d3 = test::temp_dir("cuda_opt_host_full"), d4 = test::temp_dir("cuda_opt_host_split");
    RunConfig full = cuda_run(d3, 8, "bf16"), split = cuda_run(d4, 8, "bf16");
    full.train.offload_optimizer = split.train.offload_optimizer = true;
    Trainer f(full, quiet());
    auto sf = f.run();
    TrainSummary resumed;
    auto second = test::train_stop_and_resume(split, 4, resumed);
    for (int i = 0; i < 4; i++) EXPECT_EQ(resumed.losses[i], sf.losses[4 + i]) << i;
    EXPECT_EQ(second->params(), f.params());
}

// optim.state_format with the optimizer offloaded to the host (ZeRO-Offload): the host's CPU
// optimizer keeps the moments in the format (the same codec and bits as the device's kernels), so
// the run tracks the same format on the device; the host bytes are the fp32 master, the moments in
// their format, the fp32 gradients and the pinned buffer, as the planner prices them; a resume
// through a checkpoint is bitwise. With optim.master = "none" the host keeps no master: it steps
// the device's bf16 weights a chunk at a time and rounds them with the device optimizer's draws.
TEST(CudaTrain, OffloadedOptimizerKeepsTheMomentsInTheirFormat) {
    REQUIRE_GPU();
    struct Case {
        const char* format;
        bool master;  // false: optim.master = "none", no host master
    };
    for (const Case k : {Case{"bf16", true}, Case{"int8", true}, Case{"int8", false}}) {
        const char* format = k.format;
        const std::string name = std::string(format) + (k.master ? "" : "_bw");
        SCOPED_TRACE(name);
        RunConfig dev_cfg = cuda_run(test::temp_dir("cuda_ofmt_dev_" + name), 8, "bf16");
        dev_cfg.model.n_embd = 64;  // block matrices of 64 x 256: moments in the format
        dev_cfg.model.n_head = 4;
        dev_cfg.optim.state_format = format;
        if (!k.master) dev_cfg.optim.master = "none";
        RunConfig h = dev_cfg;
        h.io.out_dir = test::temp_dir("cuda_ofmt_host_" + name);
        h.train.offload_optimizer = true;
        Trainer dev(dev_cfg, quiet());
        const TrainSummary a = dev.run();
        const MemoryStats host_before = host_memory().snapshot();
        Trainer host(h, quiet());
        const MemoryStats host_after = host_memory().snapshot();
        const TrainSummary b = host.run();
        ASSERT_EQ(b.losses.size(), a.losses.size());
        // The same arithmetic and the same codes on the host (as fp32 moments do above), and
        // without the master the same stochastic rounding's draws.
        for (std::size_t i = 0; i < a.losses.size(); i++)
            EXPECT_NEAR(b.losses[i], a.losses[i], 1e-3 * std::fabs(a.losses[i])) << "step " << i;
        const ParamLayout layout = host.engine().weights().layout;
        const std::size_t psi = layout.total;
        const std::size_t moments = optimizer_state_bytes(h.optim, layout, 0, psi);
        EXPECT_LT(moments, 8 * psi) << "smaller than fp32 moments";
        // The fp32 master, or without it a chunk of scratch.
        const std::size_t master = k.master ? 4 * psi : 4 * std::min<std::size_t>(psi, 1 << 18);
        EXPECT_EQ(
            host_after[MemCategory::OptimizerState] - host_before[MemCategory::OptimizerState],
            master + moments);
        plan::RunSpec r;
        r.precision = Precision::bf16;
        r.fp32_master = k.master;
        r.offload = plan::Offload::optimizer;
        r.state_format = parse_state_format(format);
        r.micro_batch = h.micro_batch();
        r.seq = h.train.seq_len;
        const auto est = plan::estimate_memory(plan::model_from_config(h.model), r);
        double host_states = 0;
        for (MemCategory k :
             {MemCategory::OptimizerState, MemCategory::Gradients, MemCategory::Communication})
            host_states += (double)(host_after[k] - host_before[k]);
        // (The planner prices the fp32 rule's small tensors at the format's bytes, and the host
        // optimizer's per-tensor tables are not in the formula.)
        EXPECT_NEAR((double)est.cpu_bytes, host_states, 0.02 * host_states) << name;
        EXPECT_NE(host.engine().memory_footer().find(describe_optimizer_state(h.optim)),
                  std::string::npos)
            << host.engine().memory_footer();
        RunConfig split = h;
        split.io.out_dir = test::temp_dir("cuda_ofmt_split_" + name);
        TrainSummary resumed;
        auto second = test::train_stop_and_resume(split, 4, resumed);
        ASSERT_EQ(resumed.losses.size(), 4u);
        for (int i = 0; i < 4; i++) EXPECT_EQ(resumed.losses[i], b.losses[4 + i]) << i;
        EXPECT_EQ(second->params(), host.params());
    }
}

TEST(CudaTrain, CheckpointsMoveBetweenCpuAndGpu) {
    REQUIRE_GPU();
    auto d = test::temp_dir("cuda_ckpt_move");
    RunConfig gpu = cuda_run(d, 6, "bf16");
    Trainer(gpu, quiet("", 3)).run();
    // Resume the bf16 GPU checkpoint on the CPU: the fp32 master weights and moments load as is.
    RunConfig cpu = gpu;
    cpu.train.device = "cpu";
    cpu.train.precision = "fp32";
    Trainer t(cpu, quiet(gpu.io.out_dir));
    auto s = t.run();
    ASSERT_EQ(s.losses.size(), 3u);
    EXPECT_TRUE(std::isfinite(s.losses.back()));
    // And back: the CPU's final checkpoint resumes on the GPU.
    RunConfig more = gpu;
    more.train.max_steps = 8;
    Trainer g(more, quiet(gpu.io.out_dir));
    auto s2 = g.run();
    EXPECT_EQ(s2.losses.size(), 2u);
}

// A budget:BYTES+offload policy for `c` whose plan mixes offloaded inputs with blocks that keep
// everything: the all-offload peak plus one block's kept bytes and one stream.
std::string mixed_offload_policy(const RunConfig& c, int elem_bytes) {
    const int B = c.micro_batch(), T = c.train.seq_len, L = c.model.n_layer;
    const ActFormat fmt = cuda_arena_format(c.model, elem_bytes, B, T);
    const remat::Chain ch = remat::make_chain(c.model, B, T, fmt);
    const std::size_t budget = remat::peak_bytes(ch, RematPlan(L, BlockKeep::Offload)) +
                               ch.blocks[0][0].kept_bytes + ch.resid_bytes;
    const std::string policy = "budget:" + std::to_string(budget) + "+offload";
    const RematPlan plan =
        remat::solve_policy(remat::parse_policy(policy), c.model, B, T, nullptr, fmt).plan;
    const auto offloaded = std::count(plan.begin(), plan.end(), BlockKeep::Offload);
    EXPECT_GT(offloaded, kOffloadSlots) << policy << ": some input leaves the device";
    EXPECT_LT(offloaded, L) << policy << ": some block keeps more";
    return policy;
}

TEST(CudaTrain, EveryRematPolicyTrainsTheSameModel) {
    REQUIRE_GPU();
    auto d0 = test::temp_dir("cuda_remat_none");
    RunConfig base = cuda_run(d0, 4, "fp32");
    base.model.n_layer = 5;  // offload: two block inputs leave the ring of three
    Trainer ref(base, quiet());
    auto r = ref.run();
    const std::string mixed = mixed_offload_policy(base, 4);
    int i = 0;
    for (const std::string& policy :
         {std::string("selective"), std::string("full"), std::string("every:2"),
          std::string("sqrt"), std::string("budget:40KiB"), std::string("offload"), mixed,
          std::string("OOOIO")}) {
        SCOPED_TRACE(policy);
        auto d = test::temp_dir("cuda_remat_" + std::to_string(i++));
        RunConfig c = base;
        c.data.train = d0 + "/train.bin";
        c.data.val = d0 + "/val.bin";
        c.io.out_dir = d + "/out";
        const bool letters = policy == "OOOIO";
        c.train.remat = letters ? "offload" : policy;
        Trainer t(c, quiet());
        if (letters) {
            // Block 4 shares block 0's ring slot, so block 0's input is prefetched into it while
            // block 3 (Input) recomputes: that recompute must not write its output there.
            using K = BlockKeep;
            t.engine().set_remat({K::Offload, K::Offload, K::Offload, K::Input, K::Offload});
        }
        auto s = t.run();
        // Recompute runs the forward's own kernels on the same inputs: fp32 results agree to
        // rounding (the fused GEMM+GELU epilogue and the GELU kernel may differ in the last bit).
        for (int i = 0; i < 4; i++) EXPECT_NEAR(s.losses[i], r.losses[i], 1e-5) << i;
        EXPECT_LT(max_abs_diff(t.params(), ref.params()), 1e-5);
    }
}

// The plans that drop block inputs and rebuild them in the backward (memory-poor, chen:K,
// revolve:S, and a budget below every plan that keeps the inputs) on the GPU: each block's
// rebuilt input is the forward's (the same kernels on the same inputs), so the run is the
// no-remat run's to the recompute's rounding; the activation row is the plan's and measured
// equal, and memory-poor's is below full's. With the step inside the backward, the rebuilds
// re-run blocks whose units are not updated yet: bitwise the two-phase step.
TEST(CudaTrain, RebuiltBlockInputsTrainTheSameModelInTheirPredictedBytes) {
    REQUIRE_GPU();
    auto d0 = test::temp_dir("cuda_rebuild_none");
    RunConfig base = cuda_run(d0, 4, "fp32");
    base.model.n_layer = 6;
    Trainer ref(base, quiet());
    const TrainSummary r = ref.run();
    const int B = base.micro_batch(), T = base.train.seq_len;
    const ActFormat fmt = cuda_arena_format(base.model, 4, B, T);
    const remat::Chain ch = remat::make_chain(base.model, B, T, fmt);
    // Below the least peak that keeps every input: only a rebuilding plan fits.
    const std::size_t keeping = remat::min_feasible_bytes(ch);
    const std::size_t floor = remat::rebuild_floor(ch);
    ASSERT_LT(floor, keeping);
    const std::string below = "budget:" + std::to_string((floor + keeping) / 2);
    auto activations = [&](const RunConfig& c, TrainSummary* out, std::vector<float>* params) {
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, quiet());
        *out = t.run();
        const std::size_t grew =
            device_memory().snapshot()[MemCategory::Activations] - before[MemCategory::Activations];
        for (const auto& row : t.engine().predicted_memory(B, T))
            if (row.category == MemCategory::Activations) {
                EXPECT_EQ(grew, row.bytes) << row.formula;
            }
        *params = t.params();
        return grew;
    };
    std::size_t full_bytes = 0, poor_bytes = 0;
    int i = 0;
    for (const std::string& policy :
         {std::string("full"), std::string("memory-poor"), std::string("chen:2"),
          std::string("chen:3"), std::string("revolve:2"), below}) {
        SCOPED_TRACE(policy);
        RunConfig c = base;
        c.train.remat = policy;
        c.io.out_dir = test::temp_dir("cuda_rebuild_" + std::to_string(i++)) + "/out";
        TrainSummary s;
        std::vector<float> params;
        const std::size_t bytes = activations(c, &s, &params);
        if (policy == "full") full_bytes = bytes;
        if (policy == "memory-poor") poor_bytes = bytes;
        ASSERT_EQ(s.losses.size(), r.losses.size());
        for (std::size_t k = 0; k < r.losses.size(); k++)
            EXPECT_NEAR(s.losses[k], r.losses[k], 1e-5) << k;
        EXPECT_LT(max_abs_diff(params, ref.params()), 1e-5);
    }
    EXPECT_LT(poor_bytes, full_bytes);
    // bf16 with the step inside the backward: bitwise the two-phase step under memory-poor.
    RunConfig b = cuda_run(test::temp_dir("cuda_rebuild_sib"), 4, "bf16");
    b.model.n_layer = 6;
    b.train.remat = "memory-poor";
    b.train.micro_batch_size = b.train.batch_size;
    Trainer two(b, quiet());
    const TrainSummary two_s = two.run();
    RunConfig sib = b;
    sib.optim.step_in_backward = true;
    sib.io.out_dir += "_sib";
    Trainer in_backward(sib, quiet());
    EXPECT_EQ(in_backward.run().losses, two_s.losses);
    EXPECT_EQ(in_backward.params(), two.params());
}

TEST(CudaTrain, DeviceMemoryIsWhatTheModelPredicts) {
    REQUIRE_GPU();
    for (const char* p : {"bf16", "fp32", "offload", "mixed"}) {
        SCOPED_TRACE(p);
        auto d = test::temp_dir(std::string("cuda_mem_") + p);
        const bool offload = std::string(p) == "offload", mixed = std::string(p) == "mixed";
        RunConfig c = cuda_run(d, 2, offload || mixed ? "bf16" : p);
        c.train.remat = offload ? "offload" : "selective";
        if (offload) c.model.n_layer = 5;  // two block inputs leave the ring of three
        if (mixed) {  // budget:BYTES+offload: offloaded inputs beside kept blocks
            c.model.n_layer = 6;
            c.train.remat = mixed_offload_policy(c, 2);
        }
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, quiet());
        t.run();
        const MemoryStats after = device_memory().snapshot();
        const std::size_t psi = t.engine().weights().layout.total;
        const std::size_t e = std::string(p) == "fp32" ? 4 : 2;
        auto grew = [&](MemCategory cat) { return after[cat] - before[cat]; };
        EXPECT_EQ(grew(MemCategory::Parameters), e * psi);
        EXPECT_EQ(grew(MemCategory::Gradients), e * psi);
        for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
            SCOPED_TRACE(category_name(row.category));
            if (row.category == MemCategory::Workspace) {
                // The process-wide pieces (kernel scratch, cuBLASLt's workspace) may have been
                // allocated by an earlier test of this process: the arena part is exact.
                EXPECT_LE(grew(row.category), row.bytes);
            } else {
                EXPECT_EQ(grew(row.category), row.bytes);
            }
        }
        // Model states: 2 + 2 + 12 bytes per parameter in bf16 (4 + 4 + 8 in fp32), plus the
        // optimizer's table of tensor chunks.
        const std::size_t states = grew(MemCategory::Parameters) + grew(MemCategory::Gradients) +
                                   grew(MemCategory::OptimizerState);
        EXPECT_GE(states, 16 * psi);
        EXPECT_LT(states, 16 * psi + 64 * 1024);
    }
}

// optim.state_format on the GPU: the moments of the tensors of 4096 elements or more are stored
// in bf16, int8 or int4 (the CPU format's rule, codes and scales), the optimizer row is what the
// plan predicts and shrinks with the format, the run tracks the CPU engine with the same format,
// and a resume through a checkpoint (the moments written out decoded, read back and encoded
// again) is exact.
TEST(CudaTrain, StateFormatsTrackTheCpuInTheirPredictedBytes) {
    REQUIRE_GPU();
    auto wide = [](RunConfig c) {
        c.model.n_embd = 64;  // block matrices of 64 x 256: bf16 moments
        c.model.n_head = 4;
        c.optim.state_format = "bf16";
        return c;
    };
    for (const char* p : {"fp32", "bf16"}) {
        SCOPED_TRACE(p);
        std::size_t smaller_than = 0;
        for (const char* format : {"fp32", "bf16", "int8", "int4"}) {
            SCOPED_TRACE(format);
            RunConfig c =
                wide(cuda_run(test::temp_dir(std::string("cuda_sf_") + p + format), 6, p));
            c.optim.state_format = format;
            const MemoryStats before = device_memory().snapshot();
            Trainer t(c, quiet());
            const TrainSummary s = t.run();
            const MemoryStats after = device_memory().snapshot();
            const std::size_t grew =
                after[MemCategory::OptimizerState] - before[MemCategory::OptimizerState];
            for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
                if (row.category == MemCategory::OptimizerState) {
                    EXPECT_EQ(grew, row.bytes) << format << ": " << row.formula;
                }
            }
            // Each format's state is smaller than the one before it.
            if (smaller_than) {
                EXPECT_LT(grew, smaller_than);
            }
            smaller_than = grew;
            if (std::string(format) == "fp32") continue;
            // The same format on the CPU engine: the curves agree as fp32's do.
            if (std::string(p) == "fp32") {
                RunConfig cpu = c;
                cpu.train.device = "cpu";
                cpu.io.out_dir += "_cpu";
                const TrainSummary r = Trainer(cpu, quiet()).run();
                ASSERT_EQ(r.losses.size(), s.losses.size());
                for (std::size_t i = 0; i < s.losses.size(); i++)
                    EXPECT_NEAR(s.losses[i], r.losses[i], 2e-4 * std::fabs(r.losses[i]) + 1e-5)
                        << "step " << i;
            }
            TrainSummary resumed;
            RunConfig split = c;
            split.io.out_dir += "_split";
            auto second = test::train_stop_and_resume(split, 3, resumed);
            ASSERT_EQ(resumed.losses.size(), 3u);
            for (int i = 0; i < 3; i++) EXPECT_EQ(resumed.losses[i], s.losses[3 + i]) << i;
            EXPECT_EQ(second->params(), t.params());
        }
    }
}

// optim.master = "none" on the GPU: the bf16 parameters are the only weights and each update
// rounds into them stochastically (the CPU engine's draws, tests/cuda/optimizer_test.cpp). The
// optimizer row loses exactly the 4-byte master per parameter and is what the plan predicts
// (Adam in bf16 moments: 2 + 2 + 4 bytes per parameter in all, int8: about 2 + 2 + 2); the loss
// curve tracks the fp32 master's; the weights stay bf16 values; a CUDA graph replays the same
// steps (the step's draw is read on the device); a resume is bitwise.
TEST(CudaTrain, Bf16WeightsWithoutAMasterTrackTheMasterInTheirPredictedBytes) {
    REQUIRE_GPU();
    auto wide = [](RunConfig c) {
        c.model.n_embd = 64;  // block matrices of 64 x 256: moments in the state format
        c.model.n_head = 4;
        return c;
    };
    const int steps = 12;
    for (const char* format : {"fp32", "bf16", "int8"}) {
        SCOPED_TRACE(format);
        RunConfig c =
            wide(cuda_run(test::temp_dir(std::string("cuda_bw_m_") + format), steps, "bf16"));
        c.optim.state_format = format;
        auto optimizer_bytes = [&](const RunConfig& cfg, TrainSummary* out,
                                   std::vector<float>* params) {
            const MemoryStats before = device_memory().snapshot();
            Trainer t(cfg, quiet());
            *out = t.run();
            const std::size_t grew = device_memory().snapshot()[MemCategory::OptimizerState] -
                                     before[MemCategory::OptimizerState];
            for (const auto& row :
                 t.engine().predicted_memory(cfg.micro_batch(), cfg.train.seq_len))
                if (row.category == MemCategory::OptimizerState) {
                    EXPECT_EQ(grew, row.bytes) << row.formula;
                }
            *params = t.params();
            return grew;
        };
        TrainSummary with_master, without;
        std::vector<float> p_master, p_none;
        const std::size_t b_master = optimizer_bytes(c, &with_master, &p_master);
        RunConfig n = c;
        n.io.out_dir = test::temp_dir(std::string("cuda_bw_n_") + format);
        n.optim.master = "none";
        const std::size_t b_none = optimizer_bytes(n, &without, &p_none);
        EXPECT_EQ(b_master - b_none, 4 * p_none.size()) << "exactly the fp32 master";
        ASSERT_EQ(without.losses.size(), (std::size_t)steps);
        for (int i = 0; i < steps; i++)
            EXPECT_NEAR(without.losses[i], with_master.losses[i], 0.02 * with_master.losses[i])
                << "step " << i;
        EXPECT_LT(without.losses.back(), without.losses.front() - 0.5) << "it learns";
        std::size_t not_bf16 = 0;
        for (float x : p_none) not_bf16 += bf16_to_f32(f32_to_bf16(x)) != x;
        EXPECT_EQ(not_bf16, 0u);
        EXPECT_NE(p_none, p_master);
        // The same steps replayed from a CUDA graph, and resumed halfway through a checkpoint.
        RunConfig g = n;
        g.io.out_dir = test::temp_dir(std::string("cuda_bw_g_") + format);
        g.train.cuda_graphs = true;
        Trainer tg(g, quiet());
        EXPECT_EQ(tg.run().losses, without.losses);
        EXPECT_EQ(tg.params(), p_none);
        RunConfig r = n;
        r.io.out_dir = test::temp_dir(std::string("cuda_bw_r_") + format);
        TrainSummary resumed;
        auto second = test::train_stop_and_resume(r, steps / 2, resumed);
        ASSERT_EQ(resumed.losses.size(), (std::size_t)steps / 2);
        for (int i = 0; i < steps / 2; i++)
            EXPECT_EQ(resumed.losses[i], without.losses[steps / 2 + i]) << i;
        EXPECT_EQ(second->params(), p_none);
    }
    // What the GPU's bf16 weights do not run with, refused by name before training.
    RunConfig c = cuda_run(test::temp_dir("cuda_bw_refused"), 1, "bf16");
    c.optim.master = "none";
    for (const auto& [key, set] : std::vector<std::pair<std::string, void (*)(RunConfig&)>>{
             {"train.precision = \"fp32\"", [](RunConfig& x) { x.train.precision = "fp32"; }},
             {"train.precision = \"fp16\"", [](RunConfig& x) { x.train.precision = "fp16"; }}}) {
        RunConfig bad = c;
        set(bad);
        try {
            validate_config(bad);
            ADD_FAILURE() << key << " was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("optim.master"), std::string::npos) << e.what();
        }
    }
}

// optim.name = "adafactor" and "muon" on the GPU (kernels/cuda/adafactor.cu, muon.cu): fp32
// tracks the CPU engine's run of the same optimizer as fp32 AdamW tracks the CPU's; the optimizer
// row is what the plan predicts (the factors, or Muon's momentum and Adam's m and v of the rest
// with the Newton-Schulz scratch, plus the master in bf16 and the tables) and below AdamW's; bf16
// with and without a master trains; a CUDA graph replays the same steps; a resume is bitwise; a
// checkpoint written on the CPU resumes on the GPU and ends where the CPU ends.
namespace {
void whole_tensor_optimizer_tracks_the_cpu(const std::string& name, double lr) {
    SCOPED_TRACE(name);
    const int steps = 12;
    auto with_optimizer = [&](RunConfig c) {
        c.optim.name = name;
        c.optim.lr = lr;
        return c;
    };
    auto optimizer_bytes = [](const RunConfig& cfg, TrainSummary* out, std::vector<float>* params) {
        const MemoryStats before = device_memory().snapshot();
        Trainer t(cfg, quiet());
        *out = t.run();
        const std::size_t grew = device_memory().snapshot()[MemCategory::OptimizerState] -
                                 before[MemCategory::OptimizerState];
        for (const auto& row : t.engine().predicted_memory(cfg.micro_batch(), cfg.train.seq_len))
            if (row.category == MemCategory::OptimizerState) {
                EXPECT_EQ(grew, row.bytes) << row.formula;
            }
        *params = t.params();
        return grew;
    };
    RunConfig c = with_optimizer(cuda_run(test::temp_dir("cuda_wt_" + name), steps, "fp32"));
    TrainSummary gpu, adam;
    std::vector<float> p_gpu, p_adam;
    const std::size_t bytes = optimizer_bytes(c, &gpu, &p_gpu);
    RunConfig a = c;
    a.optim.name = "adamw";
    a.optim.lr = 1e-3;
    a.io.out_dir = test::temp_dir("cuda_wt_adam" + name);
    const std::size_t adam_bytes = optimizer_bytes(a, &adam, &p_adam);
    EXPECT_LT((name == "adafactor" ? 4 : 1) * bytes, adam_bytes) << "below m and v";
    RunConfig cpu = c;
    cpu.train.device = "cpu";
    cpu.io.out_dir = test::temp_dir("cuda_wt_cpu" + name);
    Trainer tc(cpu, quiet());
    const TrainSummary on_cpu = tc.run();
    ASSERT_EQ(gpu.losses.size(), (std::size_t)steps);
    for (int i = 0; i < steps; i++)
        EXPECT_NEAR(gpu.losses[i], on_cpu.losses[i], 2e-4 * std::fabs(on_cpu.losses[i]) + 1e-5)
            << "step " << i;
    EXPECT_LT(gpu.losses.back(), gpu.losses.front() - 0.2) << "it learns";
    EXPECT_LT(max_abs_diff(p_gpu, tc.params()), 1e-3);
    // A resume is bitwise; the CPU's checkpoint at half way resumes on the GPU and ends near the
    // CPU's own end.
    RunConfig r = c;
    r.io.out_dir = test::temp_dir("cuda_wt_resume" + name);
    TrainSummary resumed;
    auto second = test::train_stop_and_resume(r, steps / 2, resumed);
    ASSERT_EQ(resumed.losses.size(), (std::size_t)steps / 2);
    for (int i = 0; i < steps / 2; i++) EXPECT_EQ(resumed.losses[i], gpu.losses[steps / 2 + i]);
    EXPECT_EQ(second->params(), p_gpu);
    RunConfig from_cpu = cpu;
    from_cpu.io.out_dir = test::temp_dir("cuda_wt_from_cpu" + name);
    Trainer(from_cpu, quiet("", steps / 2)).run();
    RunConfig onto = from_cpu;
    onto.train.device = "cuda";
    Trainer onto_gpu(onto, quiet(from_cpu.io.out_dir));
    const TrainSummary moved = onto_gpu.run();
    ASSERT_EQ(moved.losses.size(), (std::size_t)steps / 2);
    for (int i = 0; i < steps / 2; i++)
        EXPECT_NEAR(moved.losses[i], on_cpu.losses[steps / 2 + i],
                    2e-4 * std::fabs(on_cpu.losses[steps / 2 + i]) + 1e-5)
            << "step " << i;
    EXPECT_LT(max_abs_diff(onto_gpu.params(), tc.params()), 1e-3);
    // bf16 with a master, and without (4 bytes per parameter less), both learning; the latter
    // replayed from a CUDA graph.
    RunConfig b = with_optimizer(cuda_run(test::temp_dir("cuda_wt_bf16" + name), steps, "bf16"));
    TrainSummary with_master, without;
    std::vector<float> p_master, p_none;
    const std::size_t b_master = optimizer_bytes(b, &with_master, &p_master);
    RunConfig n = b;
    n.optim.master = "none";
    n.io.out_dir = test::temp_dir("cuda_wt_none" + name);
    const std::size_t b_none = optimizer_bytes(n, &without, &p_none);
    EXPECT_EQ(b_master - b_none, 4 * p_none.size());
    // ZeRO-Offload on one GPU: the host's optimizer steps unit by unit, the same curve.
    RunConfig o = b;
    o.train.offload_optimizer = true;
    o.io.out_dir = test::temp_dir("cuda_wt_offload" + name);
    const TrainSummary offloaded = Trainer(o, quiet()).run();
    ASSERT_EQ(offloaded.losses.size(), (std::size_t)steps);
    for (int i = 0; i < steps; i++)
        EXPECT_NEAR(offloaded.losses[i], with_master.losses[i], 1e-3 * with_master.losses[i]) << i;
    for (int i = 0; i < steps; i++)
        EXPECT_NEAR(without.losses[i], with_master.losses[i], 0.02 * with_master.losses[i]) << i;
    EXPECT_LT(without.losses.back(), without.losses.front() - 0.2);
    RunConfig g = n;
    g.io.out_dir = test::temp_dir("cuda_wt_graph" + name);
    g.train.cuda_graphs = true;
    Trainer tg(g, quiet());
    EXPECT_EQ(tg.run().losses, without.losses);
    EXPECT_EQ(tg.params(), p_none);
}

}  // namespace

TEST(CudaTrain, AdafactorAndMuonTrackTheCpuInTheirPredictedBytes) {
    REQUIRE_GPU();
    whole_tensor_optimizer_tracks_the_cpu("adafactor", 0.2);  // a relative step
    whole_tensor_optimizer_tracks_the_cpu("muon", 1e-2);
}

// A model whose parameters alone exceed the device is refused by the plan before the engine
// allocates anything, naming the categories and what would fit (the command line's version:
// tests/cuda/cli_sim_test.cpp, with the simulated device made small).
TEST(CudaTrain, ARunTooLargeForTheDeviceIsRefusedBeforeAllocating) {
    REQUIRE_GPU();
    RunConfig c = cuda_run(test::temp_dir("cuda_too_large"), 1, "bf16");
    const std::string m = test::refused_before_allocating(test::too_large_for_device(c), quiet());
    EXPECT_NE(m.find("the model states need"), std::string::npos) << m;
}

TEST(CudaTrain, LlamaStyleFp32MatchesTheCpu) {
    REQUIRE_GPU();
    // RMSNorm, SwiGLU, rope, grouped-query attention and an untied head: every Llama-style
    // kernel of the GPU engine in one run, against the CPU engine; with the linear biases of the
    // older Llama-style configs and without them, as Llama has (model.bias = false).
    auto llama = [](RunConfig c, bool bias) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.n_embd = 32;
        c.model.tied_embeddings = false;
        c.model.bias = bias;
        return c;
    };
    TrainSummary a;
    for (bool bias : {true, false}) {
        auto d1 = test::temp_dir("cuda_llama_cpu"), d2 = test::temp_dir("cuda_llama_gpu");
        Trainer cpu(llama(test::tiny_run(d1, 8), bias), quiet());
        Trainer gpu(llama(cuda_run(d2, 8, "fp32"), bias), quiet());
        a = cpu.run();
        auto b = gpu.run();
        for (int i = 0; i < 8; i++)
            EXPECT_NEAR(b.losses[i], a.losses[i], 2e-4 * std::fabs(a.losses[i]) + 1e-5)
                << "step " << i << " bias " << bias;
        EXPECT_LT(max_abs_diff(cpu.params(), gpu.params()), 1e-4);
    }
    // And in bf16, where it still learns.
    auto d3 = test::temp_dir("cuda_llama_bf16");
    Trainer bf(llama(cuda_run(d3, 8, "bf16"), false), quiet());
    auto c = bf.run();
    for (int i = 0; i < 8; i++) EXPECT_NEAR(c.losses[i], a.losses[i], 0.05) << "step " << i;
}

TEST(CudaTrain, ConfigErrorsNameTheKey) {
    RunConfig c = test::tiny_run(test::temp_dir("cuda_cfg_errors"), 1);
    c.train.device = "cpu";
    c.train.precision = "fp16";
    try {
        Trainer t(c, quiet());
        FAIL() << "fp16 on the CPU was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.precision"), std::string::npos) << e.what();
    }
    c.train.device = "tpu";
    EXPECT_THROW(Trainer(c, quiet()), Error);
    if (!cuda_available()) return;
    // The CPU engine's activation storage is not the GPU's to choose.
    RunConfig a = test::tiny_run(test::temp_dir("cuda_cfg_cpu_act"), 1);
    a.train.device = "cuda";
    a.train.cpu_activations = "bf16";
    try {
        validate_config(a);
        FAIL() << "train.cpu_activations on cuda was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.cpu_activations = \"bf16\""), std::string::npos)
            << e.what();
    }
    // ZeRO-Offload over several ranks needs a sharded optimizer (stage >= 1).
    RunConfig o = test::tiny_run(test::temp_dir("cuda_cfg_offload"), 1);
    o.world = 2;
    o.train.device = "cuda";
    o.train.offload_optimizer = true;
    o.train.batch_size = 4;
    try {
        validate_config(o);
        FAIL() << "offload at stage 0 on 2 ranks was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("train.zero_stage >= 1"), std::string::npos)
            << e.what();
    }
    o.train.zero_stage = 2;
    EXPECT_NO_THROW(validate_config(o));
}

#endif  // MEMTRAIN_HAVE_CUDA
