// optim.name = "adafactor": the step matches a PyTorch reference written from
// torch.optim.Adafactor's algorithm (tests/optim/adafactor_reference.py), with and without its
// update clipping; the state is rows + cols floats per matrix, as planned; the bits do not depend
// on the thread count; a run learns and resumes bitwise through a checkpoint; the layouts that cut
// tensors with no gather for them (tensor parallelism, ZeRO-1 across pipeline stages), and the
// formats and engines it does not run with, are refused by name; checkpoints hold the factors
// themselves. (ZeRO 1-3: tests/mpi/state_format_dist_test.cpp.)
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "optim/optimizer.h"
#include "optim/reference_files.h"
#include "planner/run_layout.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

OptimConfig adafactor(double lr = 1e-2) {
    OptimConfig cfg;
    cfg.name = "adafactor";
    cfg.lr = lr;
    cfg.weight_decay = 0.1;
    return cfg;
}

}  // namespace

TEST(Adafactor, StepsMatchPyTorchReference) {
    const std::string dir = test::temp_dir("adafactor_parity");
    // clip 1.0 (PyTorch's default) and 0.25, which scales every update down.
    for (auto [rows, cols, clip] : {std::tuple{48, 80, 1.0}, std::tuple{80, 48, 0.25}}) {
        const ParamLayout l = test::matrix_and_gain(rows, cols);
        const int steps = 4;
        OptimConfig cfg = adafactor();
        cfg.adafactor_clip = clip;
        std::vector<float> p = test::gaussian((int64_t)l.total, 11, 0.05f);
        for (int i = 0; i < rows; i++) p[(std::size_t)rows * cols + i] = 1.0f + 0.01f * i;
        test::write_f32(dir + "/w.f32", std::vector<float>(p.begin(), p.begin() + rows * cols));
        test::write_f32(dir + "/gain.f32", std::vector<float>(p.begin() + rows * cols, p.end()));
        auto opt = make_optimizer(cfg, l);
        for (int k = 1; k <= steps; k++) {
            // Gradients whose scale differs by row and column, so the factors matter.
            std::vector<float> g = test::gaussian((int64_t)l.total, 200 + k, 0.01f);
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < cols; j++)
                    g[(std::size_t)i * cols + j] *= (1.0f + 3.0f * i / rows) * (1.0f + j % 5);
            test::write_f32(dir + "/g" + std::to_string(k) + ".f32", g);
            opt->step(p.data(), g.data(), cfg.lr);
        }
        const std::string cmd = "/usr/bin/python3 " + std::string(MT_SOURCE_DIR) +
                                "/tests/optim/adafactor_reference.py " + dir + " " +
                                std::to_string(rows) + " " + std::to_string(cols) + " " +
                                std::to_string(steps) + " 0.01 0.1 -0.8 " + std::to_string(clip) +
                                " > " + dir + "/ref.log 2>&1";
        ASSERT_EQ(std::system(cmd.c_str()), 0)
            << cmd << " failed; install python3-torch (scripts/deps.sh does)";
        const std::vector<float> ref = test::read_f32(dir + "/out.f32", l.total);
        const std::vector<float> start = test::gaussian((int64_t)l.total, 11, 0.05f);
        double worst = 0, moved = 0;
        for (std::size_t i = 0; i < (std::size_t)rows * cols; i++) {
            worst = std::max(worst, (double)std::abs(p[i] - ref[i]));
            moved = std::max(moved, (double)std::abs(ref[i] - start[i]));
        }
        for (std::size_t i = (std::size_t)rows * cols; i < l.total; i++)
            worst = std::max(worst, (double)std::abs(p[i] - ref[i]));
        // The steps moved the weights by ~1e-3; the two agree to fp32 rounding of the sums.
        EXPECT_GT(moved, 1e-4) << rows << "x" << cols;
        EXPECT_LT(worst, 2e-7) << rows << "x" << cols << " clip " << clip;
    }
}

TEST(Adafactor, StateIsRowsPlusColumnsPerMatrixAsPlanned) {
    ModelConfig mc = test::tiny_model();
    const ParamLayout l = make_param_layout(mc);
    std::size_t floats = 0;
    for (const ParamSpec& t : l.tensors)
        floats += t.shape.size() == 2 ? (std::size_t)(t.shape[0] + t.shape[1]) : t.numel;
    const OptimConfig cfg = adafactor();
    auto opt = make_optimizer(cfg, l);
    EXPECT_EQ(opt->state_bytes(), 4 * floats);
    EXPECT_EQ(optimizer_state_bytes(cfg, l, 0, l.total), 4 * floats);
    EXPECT_LT(opt->state_bytes() * 10, l.total * 8) << "Adam's moments are 8 bytes a parameter";
    // The planner's bytes per parameter are the same count.
    plan::ModelSpec spec = plan::model_from_config(mc);
    EXPECT_NEAR(plan::adafactor_bytes_per_param(spec) * (double)l.total, 4.0 * (double)floats,
                1e-6 * (double)floats);
    // A checkpoint sees the state laid out like the parameters: it reads back what it wrote.
    std::vector<float> p = test::gaussian((int64_t)l.total, 3, 0.02f);
    const std::vector<float> g = test::gaussian((int64_t)l.total, 4, 0.01f);
    opt->step(p.data(), g.data(), cfg.lr);
    std::vector<float> state(l.total), again(l.total);
    opt->read_state("variance", state.data());
    auto other = make_optimizer(cfg, l);
    other->write_state("variance", 0, l.total / 2, state.data());
    other->write_state("variance", l.total / 2, l.total - l.total / 2, state.data() + l.total / 2);
    other->finish_writes();
    other->read_state("variance", again.data());
    EXPECT_EQ(0, std::memcmp(state.data(), again.data(), l.total * sizeof(float)));
}

TEST(Adafactor, SameBitsAtAnyThreadCount) {
    const ParamLayout l = test::matrix_and_gain(300, 700);
    const OptimConfig cfg = adafactor();
    std::vector<std::vector<float>> out;
    const int saved = omp_get_max_threads();
    for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        std::vector<float> p = test::gaussian((int64_t)l.total, 5, 0.05f);
        auto opt = make_optimizer(cfg, l);
        for (int k = 0; k < 3; k++) {
            const std::vector<float> g = test::gaussian((int64_t)l.total, 50 + k, 0.01f);
            opt->step(p.data(), g.data(), cfg.lr);
        }
        out.push_back(p);
    }
    omp_set_num_threads(saved);
    for (std::size_t k = 1; k < out.size(); k++)
        EXPECT_EQ(0, std::memcmp(out[0].data(), out[k].data(), l.total * sizeof(float))) << k;
}

TEST(Adafactor, TrainsResumesBitwiseAndRefusesWhatItDoesNotRun) {
    // A relative step min(lr, 1 / sqrt(t)) of the weights' RMS (0.02 here): 12 steps of the tiny
    // model move it at lr = 0.2, where PyTorch's default 1e-2 barely does.
    const double LR = 0.2;
    auto run_cfg = [&](const std::string& name, int steps) {
        RunConfig c = test::tiny_run(test::temp_dir(name), steps);
        c.optim.name = "adafactor";
        c.optim.lr = LR;
        c.io.save_final = false;
        return c;
    };
    RunConfig whole = run_cfg("adafactor_whole", 12);
    Trainer a(whole, test::quiet());
    const TrainSummary sa = a.run();
    EXPECT_LT(sa.losses.back(), sa.losses.front() - 0.3);
    TrainSummary sb;
    const RunConfig split = run_cfg("adafactor_split", 12);
    auto b = test::train_stop_and_resume(split, 6, sb);
    ASSERT_EQ(sb.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(sb.losses[i], sa.losses[6 + i]) << i;
    EXPECT_EQ(0, std::memcmp(a.model().params(), b->model().params(),
                             a.model().num_params() * sizeof(float)));
    // The checkpoint holds the factors themselves (rows + cols floats a matrix), not floats laid
    // out like the parameters.
    const io::SafetensorsFile f = io::SafetensorsFile::open(
        resolve_checkpoint_dir(split.io.out_dir) + "/optimizer.00000-of-00001.safetensors");
    EXPECT_EQ(f.get("variance").dtype, DType::U8);
    EXPECT_EQ((std::size_t)f.get("variance").numel,
              b->engine().optimizer().stored_part(0)->stored_bytes("variance"));
    EXPECT_EQ((std::size_t)f.get("variance").numel,
              optimizer_state_bytes(split.optim, make_param_layout(split.model), 0,
                                    make_param_layout(split.model).total));
    // Refused before training, each naming its keys.
    auto refused = [&](RunConfig c, const std::string& key) {
        try {
            validate_config(c);
            ADD_FAILURE() << "accepted " << key;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("adafactor"), std::string::npos) << e.what();
        }
    };
    RunConfig zero = whole;
    zero.world = 2;
    zero.train.zero_stage = 1;
    EXPECT_NO_THROW(validate_config(zero));
    zero.world = 4;
    zero.train.pp = 2;
    zero.train.batch_size = 4;
    zero.train.micro_batch_size = 1;
    refused(zero, "train.zero_stage = 1 with train.pp = 2");
    // Tensor parallelism gathers each sliced tensor over the tp group (tests/mpi/tp_test.cpp),
    // but not with a ZeRO shard of the slices beside it.
    RunConfig tp = whole;
    tp.world = 2;
    tp.train.tp = 2;
    EXPECT_NO_THROW(validate_config(tp));
    tp.world = 4;
    tp.train.zero_stage = 1;
    tp.train.batch_size = 4;
    tp.train.micro_batch_size = 1;
    refused(tp, "train.tp = 2 with train.zero_stage = 1");
    RunConfig int8 = whole;
    int8.optim.state_format = "int8";
    refused(int8, "optim.state_format");
    // On the GPU each rank steps the tensors of its range whole (tests/cuda/adafactor_test.cpp):
    // one GPU and DDP, and ZeRO's shards, which gather the tensors they cut
    // (tests/mpi/cuda_dp_test.cpp); not an offloaded shard over several ranks, nor the
    // offloaded bf16 update's pieces. (Without a GPU, validate_config names the missing device
    // first: the layout check alone.)
    RunConfig gpu = whole;
    gpu.train.device = "cuda";
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    gpu.world = 2;
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    auto gpu_refused = [](const RunConfig& c, const std::string& key) {
        const std::string why = test::error_of([&] { validate_optimizer_layout(c); });
        EXPECT_NE(why.find(key), std::string::npos) << why;
        EXPECT_NE(why.find("adafactor"), std::string::npos) << why;
    };
    RunConfig sharded = gpu;
    sharded.train.zero_stage = 1;
    EXPECT_NO_THROW(validate_optimizer_layout(sharded));
    RunConfig offload = gpu;
    offload.train.offload_optimizer = true;
    gpu_refused(offload, "train.offload_optimizer = true over 2 data-parallel ranks");
    offload.world = 1;
    EXPECT_NO_THROW(validate_optimizer_layout(offload));
    offload.optim.master = "none";
    gpu_refused(offload, "train.offload_optimizer = true and optim.master = \"none\"");
}
