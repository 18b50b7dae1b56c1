// optim.step_in_backward: the last backward updates each unit as soon as its gradient is
// reduced. Without clipping and with it (the norm pass), with and without accumulation, for every
// optimizer and state format and under LoRA, the run is bitwise the two-phase step's; with one
// micro-batch per step no gradient buffer exists (measured = predicted), and the layouts it does
// not run with are refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "model/param_layout.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

constexpr int kGrads = static_cast<int>(MemCategory::Gradients);

test::MeasuredRun train_sib(RunConfig c, bool in_backward) {
    c.optim.step_in_backward = in_backward;
    c.io.out_dir += in_backward ? "_sib" : "_two";
    return test::measured_run(c);
}

void expect_same_run(const test::MeasuredRun& a, const test::MeasuredRun& b,
                     const std::string& what) {
    ASSERT_EQ(a.summary.losses.size(), b.summary.losses.size()) << what;
    for (std::size_t i = 0; i < a.summary.losses.size(); i++)
        EXPECT_EQ(a.summary.losses[i], b.summary.losses[i]) << what << " step " << i + 1;
    ASSERT_EQ(a.params.size(), b.params.size()) << what;
    EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)))
        << what << ": the weights differ";
}

}  // namespace

TEST(StepInBackward, BitwiseTheTwoPhaseStepWithAndWithoutClipping) {
    struct Case {
        const char* what;
        const char* optim;
        const char* format;
        double clip;
        int micro;  // of the global batch of 4 rows: 4 is one micro-batch per step
    };
    const Case cases[] = {
        {"adamw, no clip, 1 micro-batch", "adamw", "fp32", 0.0, 4},
        // A threshold every step's norm exceeds, so every step clips.
        {"adamw, clip, 1 micro-batch", "adamw", "fp32", 0.05, 4},
        {"adamw, clip, 2 micro-batches", "adamw", "fp32", 0.05, 2},
        {"adamw int8, clip, 1 micro-batch", "adamw", "int8", 0.05, 4},
        {"sgd, clip, 2 micro-batches", "sgd", "fp32", 0.05, 2},
        {"muon, clip, 1 micro-batch", "muon", "fp32", 0.05, 4},
        {"adafactor, clip, 2 micro-batches", "adafactor", "fp32", 0.05, 2},
    };
    for (const Case& k : cases) {
        RunConfig c = test::wide_tiny_run(std::string("sib_") + k.optim + k.format, 8);
        c.optim.name = k.optim;
        c.optim.state_format = k.format;
        c.optim.grad_clip = k.clip;
        c.train.micro_batch_size = k.micro;
        if (std::string(k.optim) == "adafactor") c.optim.lr = 0.1;  // (a relative step)
        const test::MeasuredRun two = train_sib(c, false), sib = train_sib(c, true);
        expect_same_run(two, sib, k.what);
        if (std::string(k.optim) != "sgd") {  // (SGD at this lr barely moves in 8 steps)
            EXPECT_LT(sib.summary.losses.back(), sib.summary.losses.front()) << k.what;
        }
        EXPECT_EQ(sib.peak[kGrads], sib.predicted[kGrads]) << k.what;
    }
}

TEST(StepInBackward, OneMicroBatchKeepsNoGradientBuffer) {
    for (bool tied : {true, false}) {
        RunConfig c = test::wide_tiny_run(tied ? "sib_mem_tied" : "sib_mem_untied", 3);
        c.model.tied_embeddings = tied;
        c.model.n_layer = 4;
        c.train.micro_batch_size = 4;
        const test::MeasuredRun two = train_sib(c, false), sib = train_sib(c, true);
        const ParamLayout layout = make_param_layout(c.model);
        // Two-phase: every gradient at once. In the backward: the buckets, at most the
        // embedding's and one more unit's (tied), or the largest unit's.
        EXPECT_EQ(two.peak[kGrads], 4 * layout.total);
        EXPECT_EQ(sib.peak[kGrads], sib.predicted[kGrads]);
        EXPECT_EQ(sib.peak[kGrads], 4 * step_in_backward_grad_floats(layout, tied));
        EXPECT_LT(sib.peak[kGrads], two.peak[kGrads] / 2) << (tied ? "tied" : "untied");
        expect_same_run(two, sib, tied ? "tied" : "untied");
    }
    // With accumulation the earlier micro-batches' sum needs the buffer: the same bytes as the
    // two-phase step.
    RunConfig c = test::wide_tiny_run("sib_mem_accum", 2);
    const test::MeasuredRun sib = train_sib(c, true);
    EXPECT_EQ(sib.peak[kGrads], 4 * make_param_layout(c.model).total);
    EXPECT_EQ(sib.peak[kGrads], sib.predicted[kGrads]);
}

TEST(StepInBackward, LoraAdaptersUpdateInTheBackward) {
    RunConfig c = test::wide_tiny_run("sib_lora", 6);
    c.model.n_embd = 128;
    c.lora.rank = 8;
    c.lora.alpha = 16;
    c.lora.dropout = 0.1;  // the norm pass draws the update pass's masks
    c.lora.targets = "all";
    c.optim.lr = 1e-2;
    c.optim.grad_clip = 0.05;
    c.train.micro_batch_size = 4;
    const test::MeasuredRun two = train_sib(c, false), sib = train_sib(c, true);
    expect_same_run(two, sib, "lora");
    EXPECT_EQ(sib.peak[kGrads], sib.predicted[kGrads]);
    EXPECT_LT(sib.peak[kGrads], two.peak[kGrads]);
}

TEST(StepInBackward, ResumesBitwise) {
    RunConfig c = test::wide_tiny_run("sib_resume_whole", 8);
    c.optim.step_in_backward = true;
    c.optim.state_format = "int8";
    c.train.micro_batch_size = 4;
    Trainer a(c, test::quiet());
    const TrainSummary sa = a.run();
    RunConfig s = test::wide_tiny_run("sib_resume_split", 8);
    s.optim = c.optim;
    s.train.micro_batch_size = 4;
    TrainSummary sb;
    auto b = test::train_stop_and_resume(s, 4, sb);
    ASSERT_EQ(sb.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(sb.losses[i], sa.losses[4 + i]) << i;
    EXPECT_EQ(0, std::memcmp(a.model().params(), b->model().params(),
                             a.model().num_params() * sizeof(float)));
}

TEST(StepInBackward, RefusesTheLayoutsItDoesNotRunWithByName) {
    RunConfig base = test::tiny_run_config("/nonexistent/sib", 2);
    base.optim.step_in_backward = true;
    auto refused = [&](auto edit, const std::string& key) {
        RunConfig c = base;
        edit(c);
        test::expect_refused_naming(validate_optimizer_layout, c, "optim.step_in_backward", key);
    };
    // The GPU runs it on one GPU, under DDP and ZeRO-2/3 (tests/cuda/step_in_backward_test.cpp,
    // tests/mpi/cuda_dp_test.cpp).
    refused(
        [](RunConfig& c) {
            c.train.device = "cuda";
            c.train.zero_stage = 1;
        },
        "train.zero_stage = 1");
    refused(
        [](RunConfig& c) {
            c.train.device = "cuda";
            c.train.cuda_graphs = true;
        },
        "train.cuda_graphs");
    refused(
        [](RunConfig& c) {
            c.train.device = "cuda";
            c.train.offload_optimizer = true;
        },
        "train.offload_optimizer");
    refused([](RunConfig& c) { c.train.tp = 2; }, "train.tp = 2");
    refused([](RunConfig& c) { c.train.pp = 2; }, "train.pp = 2");
    refused([](RunConfig& c) { c.train.diagnostics = "amp"; }, "train.diagnostics");
    refused([](RunConfig& c) { c.train.dp_mode = "ps"; }, "train.dp_mode");
    // And the whole check names it too, where the layout is otherwise valid.
    RunConfig amp = base;
    amp.train.diagnostics = "amp";
    EXPECT_THROW(validate_config(amp), Error);
}

// optim.step_in_backward_clip = "previous-norm": no norm pass; each step clips with the last
// step's norm. Where no step clips it is bitwise the two-phase run; where every step clips, the
// first step (which has no previous norm and takes the norm pass) is bitwise the exact one and
// the run stays close to it; it resumes bitwise (the norm rides in the checkpoint); it is
// refused with fp16 and without the step in the backward.
TEST(StepInBackward, PreviousNormClippingSkipsTheNormPass) {
    RunConfig c = test::wide_tiny_run("sib_prev", 8);
    c.train.micro_batch_size = 4;
    c.optim.grad_clip = 1e6;  // never clips
    const test::MeasuredRun two = train_sib(c, false);
    RunConfig lag = c;
    lag.io.out_dir += "_lag";
    lag.optim.step_in_backward_clip = "previous-norm";
    expect_same_run(two, train_sib(lag, true), "previous-norm, no clipping");

    c.optim.grad_clip = 0.05;  // every step clips
    lag.optim.grad_clip = 0.05;
    const test::MeasuredRun exact = train_sib(c, true), lagged = train_sib(lag, true);
    const auto& le = exact.summary.losses;
    const auto& ll = lagged.summary.losses;
    ASSERT_EQ(le.size(), ll.size());
    EXPECT_EQ(le[0], ll[0]);
    EXPECT_EQ(le[1], ll[1]) << "the first update took the norm pass";
    EXPECT_NE(le.back(), ll.back()) << "later steps clip with the previous norm";
    EXPECT_NEAR(ll.back(), le.back(), 0.02 * le.back());
    EXPECT_LT(ll.back(), ll.front());

    RunConfig s = test::wide_tiny_run("sib_prev_split", 8);
    s.optim = lag.optim;
    s.optim.step_in_backward = true;
    s.train.micro_batch_size = 4;
    TrainSummary sb;
    auto b = test::train_stop_and_resume(s, 4, sb);
    ASSERT_EQ(sb.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(sb.losses[i], ll[4 + i]) << i;
    EXPECT_EQ(0, std::memcmp(lagged.params.data(), b->model().params(),
                             lagged.params.size() * sizeof(float)));

    RunConfig fp16 = test::tiny_run_config("/nonexistent/sib_prev", 2);
    fp16.optim.step_in_backward = true;
    fp16.optim.step_in_backward_clip = "previous-norm";
    fp16.train.precision = "fp16";
    test::expect_refused_naming(validate_optimizer_layout, fp16, "optim.step_in_backward_clip",
                                "train.precision");
    RunConfig without = lag;  // (train_sib set step_in_backward on its own copy)
    const std::string why = test::error_of([&] { without.optim.validate(); });
    EXPECT_NE(why.find("optim.step_in_backward_clip"), std::string::npos) << why;
    EXPECT_NE(why.find("optim.step_in_backward = true"), std::string::npos) << why;
}
