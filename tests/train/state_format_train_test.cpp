// Training with compressed optimizer states (optim.state_format): each format tracks the fp32
// run, holds exactly the bytes the plan predicts (and fewer than fp32), resumes bitwise, loads a
// checkpoint of another format, and the layouts not built yet are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/lora.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

// tiny_run widened to 64, so its matrices and embedding are stored compressed.
RunConfig wide_tiny_run(const std::string& dir, int steps, const std::string& format) {
    RunConfig c = test::tiny_run(dir, steps);
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.optim.state_format = format;
    c.io.save_final = false;
    return c;
}

struct FormatRun {
    TrainSummary summary;
    std::size_t state_bytes = 0, predicted = 0;
};

FormatRun train_with(const std::string& name, const std::string& format, int steps) {
    RunConfig c = wide_tiny_run(test::temp_dir(name), steps, format);
    Trainer t(c, test::quiet());
    FormatRun r;
    r.summary = t.run();
    r.state_bytes = host_memory().snapshot()[MemCategory::OptimizerState];
    for (const MemoryPrediction& p : t.plan().memory)
        if (p.category == MemCategory::OptimizerState) r.predicted = p.bytes;
    return r;
}

}  // namespace

TEST(StateFormatTrain, EachFormatTracksFp32InItsPredictedBytes) {
    const int steps = 40;
    const FormatRun fp32 = train_with("sft_fp32", "fp32", steps);
    EXPECT_EQ(fp32.state_bytes, fp32.predicted);
    // Stated tolerances on the final training loss and the last validation loss, relative to
    // fp32 AdamW's: 1% for bf16 and int8, 3% for int4.
    for (const auto& [format, tol] : std::vector<std::pair<std::string, double>>{
             {"bf16", 0.01}, {"int8", 0.01}, {"int4", 0.03}}) {
        const FormatRun r = train_with("sft_" + format, format, steps);
        EXPECT_EQ(r.state_bytes, r.predicted) << format;
        EXPECT_LT(r.state_bytes, fp32.state_bytes) << format;
        ASSERT_EQ(r.summary.losses.size(), fp32.summary.losses.size());
        const double a = r.summary.losses.back(), b = fp32.summary.losses.back();
        EXPECT_NEAR(a, b, tol * b) << format << " final training loss";
        ASSERT_FALSE(r.summary.val_losses.empty());
        const double va = r.summary.val_losses.back().second;
        const double vb = fp32.summary.val_losses.back().second;
        EXPECT_NEAR(va, vb, tol * vb) << format << " validation loss";
        // And it learned: the loss fell well below its start.
        EXPECT_LT(a, r.summary.losses.front() - 0.5) << format;
    }
    // int8 moments cost about a quarter of fp32's over the quantized tensors, int4 an eighth.
    EXPECT_LT(train_with("sft_int8b", "int8", 1).state_bytes, fp32.state_bytes / 2);
}

TEST(StateFormatTrain, ResumeIsBitwiseForEveryFormat) {
    for (const char* format : {"bf16", "int8", "int4"}) {
        const std::string tag = std::string("sft_resume_") + format;
        RunConfig whole = wide_tiny_run(test::temp_dir(tag + "_whole"), 12, format);
        Trainer a(whole, test::quiet());
        const TrainSummary sa = a.run();
        RunConfig split = wide_tiny_run(test::temp_dir(tag + "_split"), 12, format);
        TrainSummary sb;
        auto b = test::train_stop_and_resume(split, 6, sb);
        ASSERT_EQ(sb.losses.size(), 6u) << format;
        for (int i = 0; i < 6; i++) EXPECT_EQ(sb.losses[i], sa.losses[6 + i]) << format << i;
        EXPECT_EQ(0, std::memcmp(a.model().params(), b->model().params(),
                                 a.model().num_params() * sizeof(float)))
            << format << ": parameters after 6 + resume + 6 steps";
    }
}

TEST(StateFormatTrain, ACheckpointOfOneFormatLoadsIntoAnother) {
    // fp32 moments saved, resumed as int8: the loaded state is the fp32 one rounded to int8.
    RunConfig c = wide_tiny_run(test::temp_dir("sft_convert"), 8, "fp32");
    TrainOptions o = test::quiet();
    o.stop_after = 4;
    Trainer first(c, o);
    first.run();
    std::vector<std::vector<float>> saved;
    for (const std::string& n : first.engine().optimizer().state_names()) {
        saved.emplace_back(first.engine().optimizer().count());
        first.engine().optimizer().read_state(n, saved.back().data());
    }
    RunConfig as_int8 = c;
    as_int8.optim.state_format = "int8";
    Trainer second(as_int8, test::quiet(c.io.out_dir));
    OptimizerState& opt = second.engine().optimizer();
    const ParamLayout layout = make_param_layout(c.model);
    const std::vector<std::string> names = opt.state_names();
    ASSERT_EQ(names.size(), saved.size());
    for (std::size_t i = 0; i < names.size(); i++) {
        std::vector<float> got(opt.count());
        opt.read_state(names[i], got.data());
        MomentBuffer want(StateFormat::Int8, i == 0, layout, 0, layout.total);
        want.write(saved[i].data());
        std::vector<float> rounded(layout.total);
        want.read(rounded.data());
        EXPECT_EQ(0, std::memcmp(got.data(), rounded.data(), got.size() * sizeof(float)))
            << names[i];
    }
    EXPECT_EQ(second.run().steps_done, 8);
}

TEST(StateFormatTrain, LayoutsNotBuiltYetAreRefusedByName) {
    auto refused = [](const RunConfig& c, const std::string& key) {
        test::expect_refused_naming(validate_config, c, "optim.state_format", key);
    };
    RunConfig c = test::tiny_run_config(test::temp_dir("sft_refuse"), 2);
    c.optim.state_format = "int8";
    // Under tp int8 runs where every block falls whole in one rank's slice (tests/mpi/tp_test.cpp):
    // a 64-wide model's c_fc slices are 128 columns, half a block.
    RunConfig tp = c;
    tp.world = 2;
    tp.train.tp = 2;
    tp.model.n_embd = 64;
    refused(tp, "train.tp = 2");
    RunConfig ps = c;
    ps.world = 2;
    ps.train.dp_mode = "ps";
    refused(ps, "train.dp_mode");
    RunConfig sgd = c;
    sgd.optim.name = "sgd";
    sgd.optim.state_format = "int4";
    refused(sgd, "optim.name");
    // On the GPU every format runs, on one GPU, under NCCL's ZeRO and with the offloaded
    // optimizer (validate_config names a missing GPU first: the layout check alone).
    RunConfig gpu = c;
    gpu.train.device = "cuda";
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
    RunConfig zero = gpu;
    zero.world = 2;
    zero.train.zero_stage = 3;
    EXPECT_NO_THROW(validate_optimizer_layout(zero));
    gpu.train.offload_optimizer = true;
    EXPECT_NO_THROW(validate_optimizer_layout(gpu));
}

// LoRA's adapters under compressed moments: rank 16 over a 256-wide model makes each adapter
// 4096 elements or more, so they are stored in int8; the rows are the plan's, and a resume is
// bitwise.
TEST(StateFormatTrain, LoraAdaptersInInt8ResumeBitwise) {
    auto lora_cfg = [](const std::string& name) {
        RunConfig c = test::tiny_run(test::temp_dir(name), 10);
        c.model.n_embd = 256;
        c.model.n_head = 4;
        c.lora.rank = 16;
        c.lora.alpha = 32;
        c.lora.targets = "all";
        c.optim.lr = 1e-2;
        c.optim.state_format = "int8";
        c.io.save_final = false;
        return c;
    };
    RunConfig c = lora_cfg("sft_lora_whole");
    Trainer a(c, test::quiet());
    const TrainSummary sa = a.run();
    std::size_t predicted = 0;
    for (const MemoryPrediction& p : a.plan().memory)
        if (p.category == MemCategory::OptimizerState) predicted = p.bytes;
    EXPECT_EQ(host_memory().snapshot()[MemCategory::OptimizerState], predicted);
    RunConfig fp32 = c;
    fp32.optim.state_format = "fp32";
    const ParamLayout adapters = make_lora_layout(c.model, c.lora).params;
    EXPECT_LT(predicted, optimizer_state_bytes(fp32.optim, adapters, 0, adapters.total) / 3);
    TrainSummary sb;
    auto b = test::train_stop_and_resume(lora_cfg("sft_lora_split"), 5, sb);
    ASSERT_EQ(sb.losses.size(), 5u);
    for (int i = 0; i < 5; i++) EXPECT_EQ(sb.losses[i], sa.losses[5 + i]) << i;
}

TEST(StateFormatTrain, CheckpointsKeepEachStateInItsStoredForm) {
    // An int8 run's checkpoint holds its moments as their codes and scales (U8), a quarter of
    // the floats; they load back bitwise into int8, and decoded into fp32 and into int4.
    RunConfig c = wide_tiny_run(test::temp_dir("sft_stored"), 8, "int8");
    TrainOptions o = test::quiet();
    o.stop_after = 4;
    Trainer first(c, o);
    first.run();
    Optimizer* opt = first.engine().optimizer().stored_part(0);
    ASSERT_NE(opt, nullptr);
    const std::string file =
        resolve_checkpoint_dir(c.io.out_dir) + "/optimizer.00000-of-00001.safetensors";
    const io::SafetensorsFile f = io::SafetensorsFile::open(file);
    EXPECT_EQ(f.metadata().at("state_form"), "stored");
    EXPECT_EQ(f.metadata().at("state_format"), "int8");
    std::vector<std::vector<float>> saved;
    for (const std::string& n : opt->state_names()) {
        const io::TensorInfo& t = f.get(n);
        EXPECT_EQ(t.dtype, DType::U8) << n;
        EXPECT_EQ((std::size_t)t.numel, opt->stored_bytes(n)) << n;
        EXPECT_LT((std::size_t)t.numel, opt->count() * sizeof(float) / 3) << n;
        saved.emplace_back(opt->count());
        opt->read_state(n, saved.back().data());
    }
    for (const char* format : {"int8", "fp32", "int4"}) {
        RunConfig again = c;
        again.optim.state_format = format;
        Trainer second(again, test::quiet(c.io.out_dir));
        OptimizerState& st = second.engine().optimizer();
        const ParamLayout layout = make_param_layout(c.model);
        const std::vector<std::string> names = st.state_names();
        for (std::size_t i = 0; i < names.size(); i++) {
            std::vector<float> got(st.count()), want = saved[i];
            st.read_state(names[i], got.data());
            if (std::string(format) == "int4") {  // the int8 state, rounded to int4
                MomentBuffer m(StateFormat::Int4, i == 0, layout, 0, layout.total);
                m.write(saved[i].data());
                m.read(want.data());
            }
            EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
                << format << " " << names[i];
        }
    }
}
