// Pipeline stages on the GPU (train.pp with train.device = "cuda";
// engine/cuda/cuda_pipeline_engine.cpp) under mpirun, one GPU per rank with NCCL between the stages
// (or, where no GPU answers, cudasim's NCCL over MPI: the memtrain_sim_dist_tests binary). The
// job's ranks are the stages (pp = world; at one rank the pipeline code path runs a single stage).
// Each stage runs the same kernels on the same inputs as one process and accumulates its
// micro-batches in the same order, so with an untied head and no clipping a pipeline trains the
// very bits of the single-GPU engine, in fp32, bf16 and fp16 (loss scaling agreed across the
// stages); a tied embedding and clipping agree to rounding. Each stage's device memory is the
// engine's prediction, and checkpoints move between a pipeline and one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "cuda/device_fit_util.h"
#include "engine/cuda/cuda_engine.h"
#include "mpi/dist_runs.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

#define REQUIRE_GPU_PP()                                                                    \
    do {                                                                                    \
        if (!::memtrain::test::on_cudasim() && (!cuda_available() || !MEMTRAIN_HAVE_NCCL || \
                                                cuda_device_count() < comm().local_size())) \
            GTEST_SKIP() << "needs one CUDA device per rank and NCCL";                      \
    } while (0)

// Four blocks (so three ranks are three stages), an untied head, no clipping: the pipeline's
// bits are the single process's.
RunConfig pp_run(const std::string& name, const std::string& precision,
                 const std::string& schedule) {
    RunConfig c = shared_tiny_run_config(name, 8);
    c.model.n_layer = 4;
    c.model.tied_embeddings = false;
    c.optim.grad_clip = 0;
    c.train.device = "cuda";
    c.train.precision = precision;
    c.train.batch_size = 8;  // 4 micro-batches of 2
    c.train.pp = comm().size();
    c.train.pp_schedule = schedule;
    c.io.save_final = false;
    return c;
}

// The pipeline over comm(), its engine built by make_cuda_pipeline_engine also at one stage.
TrainOptions pipeline_options() {
    TrainOptions o = test::quiet();
    o.engine = [](const RunPlan& p, Communicator& m) { return make_cuda_pipeline_engine(p, m); };
    return o;
}

struct OneRun {
    TrainSummary summary;
    std::vector<float> params;
};

OneRun train_one_process(RunConfig c) {
    c.train.pp = 1;
    c.io.out_dir += "_one" + std::to_string(comm().rank());
    Trainer t(c, test::quiet());
    return {t.run(), t.params()};
}

// The pipeline against every rank's single process: losses and parameters bitwise (`exact`), or
// within `tol` relative (the validation losses within 1e-6, or tol / 10 where that is larger);
// each stage's device memory is the engine's prediction.
void check_pipeline(const RunConfig& c, bool exact, double tol = 0) {
    const OneRun ref = train_one_process(c);
    const MemoryStats before = device_memory().snapshot();
    Trainer t(c, pipeline_options(), &comm());
    EXPECT_NE(t.engine().describe().find(
                  fmt::format("pipeline stage {} of {}", comm().rank(), comm().size())),
              std::string::npos)
        << t.engine().describe();
    const TrainSummary s = t.run();
    ASSERT_EQ(s.losses.size(), ref.summary.losses.size());
    for (std::size_t i = 0; i < s.losses.size(); i++) {
        if (exact)
            EXPECT_EQ(s.losses[i], ref.summary.losses[i]) << "step " << i + 1;
        else
            EXPECT_NEAR(s.losses[i], ref.summary.losses[i], tol * std::abs(ref.summary.losses[i]))
                << "step " << i + 1;
    }
    ASSERT_EQ(s.val_losses.size(), ref.summary.val_losses.size());
    for (std::size_t i = 0; i < s.val_losses.size(); i++)
        EXPECT_NEAR(s.val_losses[i].second, ref.summary.val_losses[i].second,
                    std::max(1e-6, tol / 10) * std::abs(ref.summary.val_losses[i].second));
    const std::vector<float> params = t.params();
    ASSERT_EQ(params.size(), ref.params.size());
    std::size_t diff = 0;
    double worst = 0;
    for (std::size_t j = 0; j < params.size(); j++) {
        diff += params[j] != ref.params[j];
        worst = std::max(worst, (double)std::abs(params[j] - ref.params[j]));
    }
    if (exact)
        EXPECT_EQ(diff, 0u) << "largest difference " << worst;
    else
        EXPECT_LT(worst, 100 * tol);
    // This stage's tensors are the engine's prediction to the byte (the process-wide kernel
    // scratch may have grown in an earlier run of this process: the rest of the workspace is
    // exact).
    const MemoryStats after = device_memory().snapshot();
    for (const MemoryPrediction& p :
         t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
        SCOPED_TRACE(std::string(category_name(p.category)) + ": " + p.formula);
        if (p.category == MemCategory::Workspace)
            EXPECT_LE(after[p.category] - before[p.category], p.bytes);
        else
            EXPECT_EQ(after[p.category] - before[p.category], p.bytes);
    }
}

TEST(CudaPp, StagesTrainTheSameBitsAsOneProcess) {
    REQUIRE_GPU_PP();
    // Every schedule in fp32; bf16 on 1F1B (the schedules run the same kernels in every type).
    for (const char* schedule : {"1f1b", "gpipe", "naive"})
        for (const char* precision : {"fp32", "bf16"}) {
            if (std::string(precision) == "bf16" && std::string(schedule) != "1f1b") continue;
            SCOPED_TRACE(std::string(schedule) + " " + precision);
            check_pipeline(
                pp_run(std::string("cuda_pp_") + schedule + "_" + precision, precision, schedule),
                true);
        }
}

// fp16: the loss scale grows and falls alike on every stage (one global norm decides a skip).
TEST(CudaPp, Fp16LossScalingAgreesAcrossStages) {
    REQUIRE_GPU_PP();
    RunConfig c = pp_run("cuda_pp_fp16", "fp16", "1f1b");
    c.optim.loss_scale_window = 2;  // the scale doubles every two clean steps
    check_pipeline(c, true);
}

// A tied embedding (its two gradients summed once per step) and clipping on a Llama-style
// model with selective recompute: the same model to rounding.
TEST(CudaPp, TiedLlamaWithClippingAndRemat) {
    REQUIRE_GPU_PP();
    RunConfig c = pp_run("cuda_pp_tied", "fp32", "1f1b");
    c.model.tied_embeddings = true;
    c.model.norm = "rmsnorm";
    c.model.activation = "swiglu";
    c.model.positions = "rope";
    c.model.n_kv_head = 1;
    c.optim.grad_clip = 1.0;
    c.train.remat = "selective";
    check_pipeline(c, false, 2e-5);
}

// Policies that drop block inputs (memory-poor, chen:2) on GPU stages: each stage rebuilds
// within its own blocks from the input the stage before sent (train/plan.cpp solves them per
// stage), with the forward's kernels, in every micro-batch's own arena slot. The pipeline trains
// the one-GPU model to the recompute's rounding (the fused GEMM + GELU epilogue against the
// kernel the rebuild's blocks rewrite with, as for the whole model), each stage's rows are its
// prediction, its plan drops inputs, and with four blocks a stage or more memory-poor's
// activations are fewer than `full`'s (its first input, the last output and two temporaries
// against every input).
TEST(CudaPp, StagesRebuildDroppedBlockInputsWithinThemselves) {
    REQUIRE_GPU_PP();
    for (const char* policy : {"memory-poor", "chen:2"}) {
        SCOPED_TRACE(policy);
        RunConfig c = pp_run(std::string("cuda_pp_rebuild_") + policy[0], "fp32", "1f1b");
        c.model.n_layer = 8;  // 8, 4 or 2-3 blocks a stage at 1, 2 or 3 ranks
        c.train.remat = policy;
        check_pipeline(c, false, 2e-5);
        auto activations = [&](const std::string& remat, bool* drops) {
            RunConfig r = c;
            r.train.remat = remat;
            r.io.out_dir += "_" + remat.substr(0, 4);
            const RunPlan plan = test::plan_of(r, comm());
            const RematPlan& p = plan.remat.plan;
            *drops = std::any_of(p.begin(), p.end(), rebuilds_input);
            for (const MemoryPrediction& m : plan.memory)
                if (m.category == MemCategory::Activations) return m.bytes;
            ADD_FAILURE() << "no activation row";
            return std::size_t{0};
        };
        bool drops = false, full_drops = false;
        const std::size_t dropped = activations(policy, &drops),
                          full = activations("full", &full_drops);
        EXPECT_TRUE(drops) << "the stages' plan drops no input";
        EXPECT_FALSE(full_drops);
        if (comm().size() <= 2 && std::string(policy) == "memory-poor") {
            EXPECT_LT(dropped, full);
        }
    }
}

// optim.master = "none": each stage keeps its bf16 parameters only and rounds its updates with
// the draws of their global indices, so the pipeline ends on one GPU's weights bitwise (the
// untied model), and a tied embedding's mirror receives the first stage's rounded weights; each
// stage's optimizer row is its moments only, as predicted.
TEST(CudaPp, Bf16WeightsWithoutAMasterAreOneProcesss) {
    REQUIRE_GPU_PP();
    RunConfig c = pp_run("cuda_pp_bw", "bf16", "1f1b");
    c.optim.master = "none";
    check_pipeline(c, true);
    RunConfig tied = pp_run("cuda_pp_bw_tied", "bf16", "1f1b");
    tied.optim.master = "none";
    tied.model.tied_embeddings = true;
    check_pipeline(tied, false, 2e-3);
}

// optim.name = "adafactor" and "muon": each stage steps the tensors of its blocks whole with the
// kernels one GPU runs on them, so the pipeline trains one GPU's bits (the untied model).
TEST(CudaPp, AdafactorAndMuonStagesAreOneProcesss) {
    REQUIRE_GPU_PP();
    for (const auto& [name, lr] : {std::pair{"adafactor", 0.2}, std::pair{"muon", 1e-2}})
        for (const char* precision : {"fp32", "bf16"}) {
            SCOPED_TRACE(std::string(name) + " " + precision);
            RunConfig c = pp_run(std::string("cuda_pp_wt_") + name + precision, precision, "1f1b");
            c.optim.name = name;
            c.optim.lr = lr;
            check_pipeline(c, true);
        }
}

// A pipeline's checkpoint resumes in one process, and one process's in the pipeline, bitwise.
TEST(CudaPp, CheckpointsMoveBetweenPipelineAndOneProcess) {
    REQUIRE_GPU_PP();
    RunConfig dist = pp_run("cuda_pp_ckpt", "bf16", "1f1b");
    dist.io.save_final = true;
    RunConfig one = dist;
    one.train.pp = 1;
    one.io.out_dir += "_one" + std::to_string(comm().rank());
    if (comm().size() == 1) return;  // the round trip needs mpirun's pipeline (pp > 1)
    check_checkpoint_round_trip(one, dist, 8, 4, "GPU pipeline");
}

// The pipeline matches the CPU engine's run of the same model (fp32, to the GPU's rounding).
TEST(CudaPp, MatchesTheCpuRun) {
    REQUIRE_GPU_PP();
    RunConfig c = pp_run("cuda_pp_cpu", "fp32", "1f1b");
    RunConfig cpu = c;
    cpu.train.device = "cpu";
    cpu.train.pp = 1;
    cpu.io.out_dir += "_cpu" + std::to_string(comm().rank());
    const TrainSummary ref = Trainer(cpu, test::quiet()).run();
    const TrainSummary s = Trainer(c, pipeline_options(), &comm()).run();
    ASSERT_EQ(s.losses.size(), ref.losses.size());
    for (std::size_t i = 0; i < s.losses.size(); i++)
        EXPECT_NEAR(s.losses[i], ref.losses[i], 2e-4 * std::abs(ref.losses[i])) << "step " << i + 1;
}

// Sampling's logits come from the last stage to every rank: the single GPU's, bitwise.
TEST(CudaPp, LogitsAreTheSingleGpusOnEveryStage) {
    REQUIRE_GPU_PP();
    const RunConfig c = pp_run("cuda_pp_logits", "bf16", "1f1b");
    RunConfig one = c;
    one.train.pp = 1;
    one.io.out_dir += "_one" + std::to_string(comm().rank());
    const int B = 2, T = c.train.seq_len, V = c.model.vocab_size;
    std::vector<int32_t> tokens(B * T);
    for (int i = 0; i < B * T; i++) tokens[i] = (7 * i + 3) % V;
    std::vector<float> ref(B * T * V), got(B * T * V);
    Trainer(one, test::quiet()).engine().forward_logits(tokens.data(), B, T, ref.data());
    Trainer t(c, pipeline_options(), &comm());
    t.engine().forward_logits(tokens.data(), B, T, got.data());
    EXPECT_EQ(got, ref);
}

// Pipelines side by side (pp x dp ranks: 2 x 2 at four ranks, else single-stage pipelines on
// every rank): each stage's gradients are all-reduced over its replicas, and the job trains the
// model of one GPU fed the whole global micro-batch, to the rounding of the reduction.
TEST(CudaPp, PipelinesSideBySideTrainTheOneGpuModel) {
    REQUIRE_GPU_PP();
    const int N = comm().size(), P = N % 2 == 0 && N >= 4 ? 2 : 1, D = N / P, b = 2, K = 4;
    if (N % 2 != 0) return;  // replicas of single-stage pipelines at 2 ranks, 2 x 2 at 4
    RunConfig c = pp_run("cuda_pp_dp", "fp32", "1f1b");
    c.train.pp = P;
    c.train.batch_size = D * b * K;
    c.train.micro_batch_size = b;
    c.model.tied_embeddings = true;
    c.optim.grad_clip = 1.0;
    RunConfig one = c;
    one.train.micro_batch_size = D * b;
    const OneRun ref = train_one_process(one);
    Trainer t(c, pipeline_options(), &comm());
    if (D > 1) {
        EXPECT_NE(
            t.engine().describe().find(fmt::format("pipeline {} of {}", comm().rank() / P, D)),
            std::string::npos)
            << t.engine().describe();
    }
    const TrainSummary s = t.run();
    ASSERT_EQ(s.losses.size(), ref.summary.losses.size());
    for (std::size_t i = 0; i < s.losses.size(); i++)
        EXPECT_NEAR(s.losses[i], ref.summary.losses[i], 2e-5 * std::abs(ref.summary.losses[i]))
            << "step " << i + 1;
    const std::vector<float> params = t.params();
    ASSERT_EQ(params.size(), ref.params.size());
    double worst = 0;
    for (std::size_t j = 0; j < params.size(); j++)
        worst = std::max(worst, (double)std::abs(params[j] - ref.params[j]));
    EXPECT_LT(worst, 1e-4);
    if (D > 1) {  // ZeRO across GPU pipelines is refused by name
        RunConfig z = c;
        z.train.zero_stage = 1;
        if (P > 1) expect_refused(z, "train.zero_stage = 1 across 2 GPU pipelines");
    }
}

// The plan prices each stage before the engine exists (engine/device_memory.h): built from the
// plan alone (make_engine; the Trainer checks the engine's rows are its plan's), every stage
// allocates exactly its plan's rows; and a model whose stages cannot fit their devices is
// refused on every stage before anything is allocated, naming the stage.
TEST(CudaPp, ThePlanPredictsEachStageAndRefusesWhatDoesNotFit) {
    REQUIRE_GPU_PP();
    if (comm().size() < 2) return;  // train.pp > 1
    for (const bool tied : {false, true}) {
        SCOPED_TRACE(tied ? "tied" : "untied");
        RunConfig c = pp_run(tied ? "cuda_pp_plan_tied" : "cuda_pp_plan", "bf16", "1f1b");
        c.model.tied_embeddings = tied;
        c.train.remat = "selective";
        const RunPlan plan = test::plan_of(c, comm());
        ASSERT_EQ(plan.engine, EngineKind::CudaPipeline);
        ASSERT_EQ(plan.memory.size(), 5u);
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, test::quiet(), &comm());
        t.run();
        const MemoryStats after = device_memory().snapshot();
        for (const MemoryPrediction& p : plan.memory) {
            SCOPED_TRACE(std::string(category_name(p.category)) + ": " + p.formula);
            if (p.category == MemCategory::Workspace)
                EXPECT_LE(after[p.category] - before[p.category], p.bytes);
            else
                EXPECT_EQ(after[p.category] - before[p.category], p.bytes);
        }
    }
    const RunConfig big =
        test::too_large_for_device(pp_run("cuda_pp_too_large", "bf16", "1f1b"), comm().size());
    const std::string m = test::refused_before_allocating(big, test::quiet(), &comm());
    EXPECT_NE(m.find(fmt::format("on pipeline stage {} of {}", comm().rank(), comm().size())),
              std::string::npos)
        << m;
}

// What the GPU pipeline is not built for is refused before training, by name.
TEST(CudaPp, RefusesWhatItDoesNotRun) {
    REQUIRE_GPU_PP();
    if (comm().size() < 2) return;  // train.pp > 1
    RunConfig c = pp_run("cuda_pp_refused", "fp32", "1f1b");
    RunConfig z = c;
    z.train.pp_schedule = "zb-h1";
    expect_refused(z, "train.pp_schedule = \"zb-h1\" runs on the CPU engine only");
    RunConfig g = c;
    g.train.cuda_graphs = true;
    expect_refused(g, "train.cuda_graphs is not built for pipeline stages");
    RunConfig o = c;
    o.train.remat = "offload";
    expect_refused(o, "train.remat = \"offload\"");
}

}  // namespace
}  // namespace memtrain::dist
