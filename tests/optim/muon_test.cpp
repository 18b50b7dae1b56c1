// optim.name = "muon": Newton-Schulz orthogonalizes, the step matches a PyTorch reference written
// from Muon's definition (tests/optim/muon_reference.py), only the blocks' matrices take it, its
// state is one buffer for them, a run learns, resumes bitwise, and the layouts that cut matrices
// with no gather for them are refused (ZeRO 1-3 gather: tests/mpi/state_format_dist_test.cpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "optim/optimizer.h"
#include "optim/reference_files.h"
#include "test_util.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

TEST(Muon, NewtonSchulzMovesSingularValuesTowardOne) {
    for (auto [rows, cols] : {std::pair{24, 40}, std::pair{40, 24}, std::pair{32, 32}}) {
        std::vector<float> x = test::gaussian((int64_t)rows * cols, 3);
        for (int i = 0; i < rows; i++)  // rows scaled over 10x: singular values spread out
            for (int j = 0; j < cols; j++)
                x[(std::size_t)i * cols + j] *= std::pow(10.f, -1.f * i / rows);
        newton_schulz5(x.data(), rows, cols);
        // The Gram matrix of the short side, G = X X^T (or X^T X): its eigenvalues are the squared
        // singular values, which the quintic leaves within about [0.5, 1.3]; check its trace and
        // diagonal.
        const int r = std::min(rows, cols);
        double trace = 0, worst = 0;
        for (int a = 0; a < r; a++) {
            double d = 0;
            for (int k = 0; k < std::max(rows, cols); k++) {
                const float v =
                    rows <= cols ? x[(std::size_t)a * cols + k] : x[(std::size_t)k * cols + a];
                d += (double)v * v;
            }
            trace += d;
            worst = std::max(worst, std::abs(d - 1));
        }
        EXPECT_NEAR(trace / r, 1.0, 0.35) << rows << "x" << cols;
        EXPECT_LT(worst, 0.75) << rows << "x" << cols;
    }
    // The tall case is the transpose of the wide one.
    std::vector<float> wide = test::gaussian(6 * 10, 5), tall(60);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 10; j++) tall[(std::size_t)j * 6 + i] = wide[(std::size_t)i * 10 + j];
    newton_schulz5(wide.data(), 6, 10);
    newton_schulz5(tall.data(), 10, 6);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 10; j++)
            EXPECT_EQ(tall[(std::size_t)j * 6 + i], wide[(std::size_t)i * 10 + j]);
}

TEST(Muon, StepsMatchPyTorchReference) {
    const std::string dir = test::temp_dir("muon_parity");
    for (auto [rows, cols] : {std::pair{32, 96}, std::pair{96, 32}}) {
        const ParamLayout l = test::matrix_and_gain(rows, cols);
        const int steps = 3;
        OptimConfig cfg;
        cfg.name = "muon";
        cfg.lr = 1e-3;
        cfg.muon_lr = 0.02;
        cfg.muon_momentum = 0.95;
        cfg.weight_decay = 0.1;
        std::vector<float> p = test::gaussian((int64_t)l.total, 7, 0.05f);
        for (int i = 0; i < rows; i++) p[(std::size_t)rows * cols + i] = 1.0f + 0.01f * i;
        test::write_f32(dir + "/w.f32", std::vector<float>(p.begin(), p.begin() + rows * cols));
        test::write_f32(dir + "/gain.f32", std::vector<float>(p.begin() + rows * cols, p.end()));
        auto opt = make_optimizer(cfg, l);
        for (int k = 1; k <= steps; k++) {
            const std::vector<float> g = test::gaussian((int64_t)l.total, 100 + k, 0.01f);
            test::write_f32(dir + "/g" + std::to_string(k) + ".f32", g);
            opt->step(p.data(), g.data(), cfg.lr);
        }
        const std::string cmd = "/usr/bin/python3 " + std::string(MT_SOURCE_DIR) +
                                "/tests/optim/muon_reference.py " + dir + " " +
                                std::to_string(rows) + " " + std::to_string(cols) + " 3 0.001 " +
                                "0.02 0.95 0.1 > " + dir + "/ref.log 2>&1";
        ASSERT_EQ(std::system(cmd.c_str()), 0)
            << cmd << " failed; install python3-torch (scripts/deps.sh does)";
        const std::vector<float> ref = test::read_f32(dir + "/out.f32", l.total);
        double worst = 0, scale = 0;
        for (std::size_t i = 0; i < l.total; i++) {
            worst = std::max(worst, (double)std::abs(p[i] - ref[i]));
            scale = std::max(scale, (double)std::abs(ref[i]));
        }
        // fp32 GEMMs summed in another order: agreement to a few units in the 6th digit.
        EXPECT_LT(worst, 2e-6 * std::max(1.0, scale)) << rows << "x" << cols;
    }
}

TEST(Muon, OnlyBlockMatricesTakeItAndTheirStateIsOneBuffer) {
    ModelConfig mc = test::tiny_model();
    mc.n_embd = 64;
    mc.n_head = 4;
    const ParamLayout l = make_param_layout(mc);
    const std::vector<char> m = muon_matrices(l);
    std::size_t matrices = 0, rest = 0;
    for (std::size_t i = 0; i < m.size(); i++) {
        const ParamSpec& t = l.tensors[i];
        const bool block_matrix = t.name.rfind("h.", 0) == 0 && t.shape.size() == 2;
        EXPECT_EQ((bool)m[i], block_matrix) << t.name;
        (m[i] ? matrices : rest) += t.numel;
    }
    EXPECT_EQ(l.get("wte.weight").numel > 0 && !m[0], true);  // embeddings take AdamW
    OptimConfig cfg;
    cfg.name = "muon";
    auto opt = make_optimizer(cfg, l);
    EXPECT_EQ(opt->state_bytes(), 4 * matrices + 8 * rest);
    EXPECT_EQ(opt->state_bytes(), optimizer_state_bytes(cfg, l, 0, l.total));
    cfg.state_format = "int8";
    auto q = make_optimizer(cfg, l);
    EXPECT_EQ(q->state_bytes(), optimizer_state_bytes(cfg, l, 0, l.total));
    EXPECT_LT(q->state_bytes(), opt->state_bytes() / 2);
    // A range that cuts a matrix (a ZeRO shard's edge) steps it only through a TensorGather
    // (tests/mpi/state_format_dist_test.cpp): without one the step fails, naming it.
    const ParamSpec& fc = l.get("h.0.mlp.c_fc.weight");
    cfg.state_format = "fp32";
    auto cut = make_optimizer(cfg, l, fc.offset + 10, l.total - fc.offset - 10);
    std::vector<float> p(cut->count(), 0.5f), g(cut->count(), 0.01f);
    try {
        cut->step(p.data(), g.data(), 1e-3);
        FAIL() << "stepped part of " << fc.name;
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fc.name), std::string::npos) << e.what();
    }
}

TEST(Muon, TrainsResumesBitwiseAndRefusesLayoutsThatCutMatricesUngathered) {
    auto run_cfg = [](const std::string& name, int steps) {
        RunConfig c = test::tiny_run(test::temp_dir(name), steps);
        c.model.n_embd = 64;
        c.model.n_head = 4;
        c.optim.name = "muon";
        c.optim.muon_lr = 0.02;
        c.io.save_final = false;
        return c;
    };
    RunConfig whole = run_cfg("muon_whole", 12);
    Trainer a(whole, test::quiet());
    const TrainSummary sa = a.run();
    EXPECT_LT(sa.losses.back(), sa.losses.front() - 0.5);
    TrainSummary sb;
    auto b = test::train_stop_and_resume(run_cfg("muon_split", 12), 6, sb);
    ASSERT_EQ(sb.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(sb.losses[i], sa.losses[6 + i]) << i;
    EXPECT_EQ(0, std::memcmp(a.model().params(), b->model().params(),
                             a.model().num_params() * sizeof(float)));
    // Layouts whose ranks hold parts of a matrix without gathering it are refused before training:
    // tensor parallelism, and ZeRO-1 across pipeline stages (ZeRO 1-3 over a whole model gather
    // the matrices their shards cut).
    RunConfig zero = whole;
    zero.world = 2;
    zero.train.zero_stage = 1;
    EXPECT_NO_THROW(validate_config(zero));
    zero.world = 4;
    zero.train.pp = 2;
    zero.train.batch_size = 4;
    zero.train.micro_batch_size = 1;
    test::expect_refused_naming(validate_config, zero, "muon",
                                "train.zero_stage = 1 with train.pp = 2");
    // Tensor parallelism gathers each sliced matrix over the tp group (tests/mpi/tp_test.cpp),
    // but not with a ZeRO shard of the slices beside it.
    RunConfig tp = whole;
    tp.world = 2;
    tp.train.tp = 2;
    EXPECT_NO_THROW(validate_config(tp));
    tp.world = 4;
    tp.train.zero_stage = 1;
    tp.train.batch_size = 4;
    tp.train.micro_batch_size = 1;
    test::expect_refused_naming(validate_config, tp, "muon",
                                "train.tp = 2 with train.zero_stage = 1");
    // On the GPU each rank orthogonalizes the matrices of its range whole (tests/cuda/
    // muon_test.cpp), and ZeRO's shards over several GPUs gather the tensors they cut, for
    // Adafactor too (tests/mpi/cuda_dp_test.cpp); ZeRO-Offload's host shards do not. (The layout
    // check alone: without a GPU validate_config names the missing device first.)
    RunConfig gpu = whole;
    gpu.train.device = "cuda";
    gpu.world = 2;
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    gpu.train.zero_stage = 2;
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    gpu.optim.master = "none";
    gpu.train.precision = "bf16";
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    gpu.optim.master = "fp32";
    gpu.train.offload_optimizer = true;
    test::expect_refused_naming(validate_optimizer_layout, gpu, "muon",
                                "train.offload_optimizer = true over 2 data-parallel ranks");
    gpu.train.offload_optimizer = false;
    gpu.optim.name = "adafactor";
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    gpu.train.offload_optimizer = true;
    test::expect_refused_naming(validate_optimizer_layout, gpu, "adafactor",
                                "train.offload_optimizer = true over 2 data-parallel ranks");
}
