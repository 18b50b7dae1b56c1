// optim.step_in_backward on the GPU (docs/training.md, "The optimizer step inside the
// backward"): with one micro-batch per step each unit is updated as soon as its gradient is
// complete and no gradient buffer exists (two unit buckets instead); the losses, the skipped
// steps and the weights are bitwise the two-phase step's for every optimizer and state format,
// with and without clipping (the norm pass), in fp32, bf16 (with and without the fp32 master) and
// fp16 (whose overflow skip takes the norm pass); the gradient and optimizer rows are what the
// plan predicts; with accumulation the step runs after the backward, as bitwise; clipping by the
// previous step's norm skips the norm pass, tracks the CPU engine and resumes bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "test_util.h"
#include "train/trainer.h"

#if MEMTRAIN_HAVE_CUDA

using namespace memtrain;

namespace step_in_backward_test {

using test::quiet;

// A model whose block matrices are 64 x 256 (moments in the state format) and one micro-batch
// per step.
RunConfig wide_run(const std::string& name, int steps, const std::string& precision) {
    RunConfig c = test::tiny_run(test::temp_dir("cuda_sib_" + name), steps);
    c.train.device = "cuda";
    c.train.precision = precision;
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.train.micro_batch_size = c.train.batch_size;
    return c;
}

struct RunResult {
    TrainSummary summary;
    std::vector<float> params;
    std::size_t grads = 0, states = 0;  // device bytes the run's engine allocated
};

// Trains `c`, checking that the gradient and optimizer rows are what the engine predicted.
RunResult train(const RunConfig& c) {
    RunResult r;
    const MemoryStats before = device_memory().snapshot();
    Trainer t(c, quiet());
    r.summary = t.run();
    const MemoryStats after = device_memory().snapshot();
    r.grads = after[MemCategory::Gradients] - before[MemCategory::Gradients];
    r.states = after[MemCategory::OptimizerState] - before[MemCategory::OptimizerState];
    for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
        if (row.category == MemCategory::Gradients) {
            EXPECT_EQ(r.grads, row.bytes) << row.formula;
        }
        if (row.category == MemCategory::OptimizerState) {
            EXPECT_EQ(r.states, row.bytes) << row.formula;
        }
    }
    r.params = t.params();
    return r;
}

// `c` with and without the step inside the backward: bitwise the same run, the gradients down
// to two unit buckets (one micro-batch per step) and the optimizer state the same size.
RunResult equals_the_two_phase_step(const RunConfig& c, const std::string& what) {
    SCOPED_TRACE(what);
    const RunResult two_phase = train(c);
    RunConfig s = c;
    s.optim.step_in_backward = true;
    s.io.out_dir += "_sib";
    const RunResult in_backward = train(s);
    EXPECT_EQ(in_backward.summary.losses.size(), two_phase.summary.losses.size());
    EXPECT_EQ(in_backward.summary.losses, two_phase.summary.losses);
    EXPECT_EQ(in_backward.summary.val_losses, two_phase.summary.val_losses);
    EXPECT_EQ(in_backward.summary.steps_skipped, two_phase.summary.steps_skipped);
    EXPECT_EQ(in_backward.params, two_phase.params);
    EXPECT_EQ(in_backward.states, two_phase.states);
    if (c.accum_steps() == 1) {
        const ParamLayout layout = make_param_layout(c.model);
        const std::size_t e = c.train.precision == "fp32" ? 4 : 2;
        EXPECT_EQ(in_backward.grads,
                  e * step_in_backward_grad_floats(layout, c.model.tied_embeddings));
        EXPECT_LT(in_backward.grads, two_phase.grads);
    } else {
        EXPECT_EQ(in_backward.grads, two_phase.grads);
    }
    return two_phase;
}

}  // namespace step_in_backward_test

using namespace step_in_backward_test;

TEST(CudaStepInBackward, EqualsTheTwoPhaseStepBitwiseInItsPredictedBytes) {
    REQUIRE_GPU();
    const int steps = 6;
    for (const char* p : {"fp32", "bf16"}) {
        for (double clip : {1.0, 0.0}) {
            RunConfig c = wide_run(std::string("adamw_") + p, steps, p);
            c.optim.grad_clip = clip;
            equals_the_two_phase_step(c, std::string(p) + (clip > 0 ? " clipped" : " unclipped"));
        }
    }
    // A clip that binds on every step: the norm pass's coefficient scales every unit.
    RunConfig tight = wide_run("tight", steps, "bf16");
    tight.optim.grad_clip = 0.05;
    equals_the_two_phase_step(tight, "every step clipped");
    for (const char* format : {"bf16", "int8", "int4"}) {
        RunConfig c = wide_run(std::string("format_") + format, steps, "bf16");
        c.optim.state_format = format;
        equals_the_two_phase_step(c, std::string("AdamW in ") + format);
    }
    RunConfig none = wide_run("master_none", steps, "bf16");
    none.optim.master = "none";
    none.optim.state_format = "int8";
    equals_the_two_phase_step(none, "bf16 weights without a master, int8 moments");
    for (const char* name : {"sgd", "adafactor", "muon"}) {
        RunConfig c = wide_run(std::string("opt_") + name, steps, "bf16");
        c.optim.name = name;
        c.optim.lr = std::string(name) == "adafactor" ? 0.2 : 1e-2;
        if (std::string(name) == "adafactor") c.optim.master = "none";
        equals_the_two_phase_step(c, name);
    }
    RunConfig untied = wide_run("untied", steps, "bf16");
    untied.model.tied_embeddings = false;
    equals_the_two_phase_step(untied, "untied embeddings: one bucket");
    // fp16: the overflow skip reads the norm pass (the first steps overflow at an initial scale
    // of 2^24 and are skipped alike, the scale halving each time).
    RunConfig half = wide_run("fp16", 10, "fp16");
    half.optim.grad_clip = 0.0;
    half.optim.loss_scale = 16777216.0;
    EXPECT_GT(equals_the_two_phase_step(half, "fp16 without clipping").summary.steps_skipped, 0)
        << "the first steps overflow at the initial loss scale";
    // With accumulation the gradient buffer exists anyway: the step runs after the backward.
    RunConfig accum = wide_run("accum", steps, "bf16");
    accum.train.micro_batch_size = accum.train.batch_size / 2;
    equals_the_two_phase_step(accum, "two micro-batches");
}

TEST(CudaStepInBackward, PreviousNormClippingTracksTheCpuAndResumesBitwise) {
    REQUIRE_GPU();
    const int steps = 8;
    for (int micro : {4, 2}) {  // one micro-batch per step (no norm pass), and two
        SCOPED_TRACE(micro);
        RunConfig c = wide_run("prev_" + std::to_string(micro), steps, "fp32");
        c.train.micro_batch_size = micro;
        c.optim.step_in_backward = true;
        c.optim.step_in_backward_clip = "previous-norm";
        c.optim.grad_clip = 0.2;  // binds: the previous norm changes the update
        const RunResult gpu = train(c);
        RunConfig cpu = c;
        cpu.train.device = "cpu";
        cpu.io.out_dir += "_cpu";
        const TrainSummary on_cpu = Trainer(cpu, quiet()).run();
        ASSERT_EQ(gpu.summary.losses.size(), (std::size_t)steps);
        for (int i = 0; i < steps; i++)
            EXPECT_NEAR(gpu.summary.losses[i], on_cpu.losses[i],
                        2e-4 * std::fabs(on_cpu.losses[i]) + 1e-5)
                << "step " << i;
        // Not the exact clipping's run: the previous norm clipped it.
        RunConfig exact = c;
        exact.optim.step_in_backward_clip = "norm-pass";
        exact.io.out_dir += "_exact";
        EXPECT_NE(train(exact).summary.losses, gpu.summary.losses);
        // The checkpoint carries the norm: a resume is bitwise.
        RunConfig r = c;
        r.io.out_dir += "_resume";
        TrainSummary resumed;
        auto second = test::train_stop_and_resume(r, steps / 2, resumed);
        ASSERT_EQ(resumed.losses.size(), (std::size_t)steps / 2);
        for (int i = 0; i < steps / 2; i++)
            EXPECT_EQ(resumed.losses[i], gpu.summary.losses[steps / 2 + i]) << i;
        EXPECT_EQ(second->params(), gpu.params);
    }
}

TEST(CudaStepInBackward, WhatItCannotRunIsRefusedByName) {
    REQUIRE_GPU();
    RunConfig c = wide_run("refused", 2, "bf16");
    c.optim.step_in_backward = true;
    auto refused = [&](RunConfig bad, const std::string& key) {
        try {
            Trainer t(bad, quiet());
            ADD_FAILURE() << "accepted: " << key;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("optim.step_in_backward"), std::string::npos);
        }
    };
    RunConfig g = c;
    g.train.cuda_graphs = true;
    refused(g, "train.cuda_graphs");
    RunConfig o = c;
    o.train.offload_optimizer = true;
    refused(o, "train.offload_optimizer");
}

#endif  // MEMTRAIN_HAVE_CUDA
