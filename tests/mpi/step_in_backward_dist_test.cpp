// optim.step_in_backward under mpirun (2 and 4 ranks): at DDP and ZeRO 1, 2 and 3, with clipping
// (the norm pass) and with accumulation, every rank's weights after the run are bitwise those of
// the two-phase step at the same stage, each rank holds no gradient buffer with one micro-batch
// per step (its buckets' peak is the plan's row), and the plan's rows are the engine's. Bf16
// weights (optim.master = "none") under ZeRO-1 and -2 are DDP's bitwise and resume bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/dtype.h"
#include "model/param_layout.h"
#include "mpi/dist_runs.h"
#include "optim/optimizer.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

struct DistOutcome {
    std::vector<float> losses, params;
    std::size_t grad_peak = 0;
};

DistOutcome run_stage(RunConfig c, bool in_backward) {
    c.optim.step_in_backward = in_backward;
    c.io.out_dir += in_backward ? "_sib" : "_two";
    host_memory().reset_peak();
    TrainOptions quiet;
    quiet.quiet = true;
    Trainer t(c, quiet, &comm());
    DistOutcome o;
    o.losses = t.run().losses;
    o.params = t.params();
    o.grad_peak = host_memory().snapshot().peak(MemCategory::Gradients);
    if (in_backward) expect_planned_rows_are_the_engines(t, c.io.out_dir);
    return o;
}

TEST(StepInBackwardDist, EveryZeroStageIsBitwiseItsTwoPhaseStep) {
    const int N = comm().size();
    for (int stage : {0, 1, 2, 3}) {
        for (int accum : {1, 2}) {
            const std::string what =
                "zero" + std::to_string(stage) + " accum " + std::to_string(accum);
            RunConfig c = shared_tiny_run_config(
                "sibd_" + std::to_string(stage) + "_" + std::to_string(accum), 6);
            c.model.n_embd = 64;
            c.model.n_head = 4;
            c.io.save_final = false;
            c.train.zero_stage = stage;
            c.train.micro_batch_size = 2;
            c.train.batch_size = 2 * N * accum;
            c.optim.grad_clip = 0.05;  // every step clips
            c.optim.state_format = stage == 2 ? "int8" : "fp32";
            const DistOutcome two = run_stage(c, false), sib = run_stage(c, true);
            ASSERT_EQ(two.losses.size(), sib.losses.size()) << what;
            for (std::size_t i = 0; i < two.losses.size(); i++)
                EXPECT_EQ(two.losses[i], sib.losses[i]) << what << " step " << i + 1;
            ASSERT_EQ(two.params.size(), sib.params.size()) << what;
            EXPECT_EQ(0, std::memcmp(two.params.data(), sib.params.data(),
                                     two.params.size() * sizeof(float)))
                << what << ": the weights differ";
            if (accum == 1) {
                // Stages 0-1: the buckets are the gradients; stages 2-3 fill the same
                // communication buckets as the two-phase step, and hold no shard.
                const ParamLayout layout = make_param_layout(c.model);
                EXPECT_EQ(sib.grad_peak, stage >= 2 ? 0
                                                    : 4 * step_in_backward_grad_floats(
                                                              layout, c.model.tied_embeddings))
                    << what;
                EXPECT_LT(sib.grad_peak, two.grad_peak) << what;
            }
            comm().barrier();
        }
    }
}

// optim.master = "none" under ZeRO 1-3: each rank updates and rounds its shard of the bf16
// weights, drawing by each element's global index, and broadcasts it (stages 1-2) or keeps it
// (stage 3, where the units are gathered from the shards). So the weights after every step are
// bitwise those of DDP (stage 0, every rank rounding everything), whose reduction sums the same
// gradients; both phases of the step and the step in the backward alike; every rank's rows
// measured as planned (the optimizer state the shard's, the bf16 weights whole or, at stage 3,
// the shard). Muon and Adafactor too: the update hands the optimizer the shard's piece of each
// tensor it steps whole as one piece, and the optimizer completes the tensor from its holders
// (dist::ShardTensorGather), so the shards' edges may cut them.
TEST(StepInBackwardDist, Bf16WeightsUnderZeroAreDdpsBitwise) {
    const int N = comm().size();
    if (N < 2) GTEST_SKIP() << "needs ranks to shard over";
    {
        // The shards' edges cut block matrices (else the gather would go untested).
        RunConfig c = shared_tiny_run_config("sibd_bf16z_cuts", 1);
        c.model.n_embd = 64;
        c.model.n_head = 4;
        const ParamLayout layout = make_param_layout(c.model);
        const std::vector<char> matrix = muon_matrices(layout);
        const auto shards = grain_shard_ranges(0, (int64_t)layout.total, N, 1);  // fp32 state
        int cut = 0;
        for (std::size_t i = 0; i < matrix.size(); i++) {
            const ParamSpec& t = layout.tensors[i];
            const auto counts =
                unit_pieces(shards, (int64_t)t.offset, (int64_t)(t.offset + t.numel)).counts;
            cut += matrix[i] &&
                   std::count_if(counts.begin(), counts.end(), [](int64_t k) { return k > 0; }) > 1;
        }
        EXPECT_GT(cut, 0);
    }
    for (const char* opt : {"adamw", "muon", "adafactor"})
        for (bool in_backward : {false, true}) {
            std::vector<float> ddp;
            for (int stage : {0, 1, 2, 3}) {
                const std::string what = std::string(opt) + " zero" + std::to_string(stage) +
                                         (in_backward ? " in backward" : " two-phase");
                RunConfig c =
                    shared_tiny_run_config("sibd_bf16z" + std::string(opt) + std::to_string(stage) +
                                               (in_backward ? "_sib" : ""),
                                           6);
                c.model.n_embd = 64;
                c.model.n_head = 4;
                c.io.save_final = false;
                c.train.zero_stage = stage;
                c.train.micro_batch_size = 2;
                c.train.batch_size = 2 * N;
                c.optim.master = "none";
                c.optim.name = opt;
                c.optim.grad_clip = 0.05;  // every step clips
                const DistOutcome o = run_stage(c, in_backward);
                if (!in_backward) {
                    // The parameters row measured: the bf16 weights (whole, or the stage-3 shard)
                    // and the decoded units and update scratch.
                    host_memory().reset_peak();
                    Trainer t(c, test::quiet(), &comm());
                    t.run();
                    for (const MemoryPrediction& row : expect_planned_rows_are_the_engines(t, what))
                        if (row.category == MemCategory::Parameters) {
                            EXPECT_EQ(host_memory().snapshot().peak(MemCategory::Parameters),
                                      row.bytes)
                                << what << ": " << row.formula;
                        }
                }
                if (stage == 0) {
                    ddp = o.params;
                    continue;
                }
                ASSERT_EQ(o.params.size(), ddp.size()) << what;
                EXPECT_EQ(0, std::memcmp(o.params.data(), ddp.data(), ddp.size() * sizeof(float)))
                    << what << ": the weights differ from DDP's";
                for (float w : o.params) ASSERT_EQ(bf16_to_f32(f32_to_bf16(w)), w) << what;
                comm().barrier();
            }
        }
}

// A ZeRO-1 or ZeRO-3 run with bf16 weights stopped after 3 of 6 steps resumes bitwise: the
// checkpoint holds the weights decoded (exact in fp32) and each shard's moments (AdamW) or
// factors (Adafactor, whose cut tensors' factors every holder gets back whole).
TEST(StepInBackwardDist, Bf16WeightsUnderZeroResumeBitwise) {
    const int N = comm().size();
    if (N < 2) GTEST_SKIP() << "needs ranks to shard over";
    RunConfig c = shared_tiny_run_config("sibd_bf16z_resume", 6);
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.io.save_final = false;
    c.train.zero_stage = 1;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * N;
    c.optim.master = "none";
    for (const char* opt : {"adamw", "adafactor"})
        for (int stage : {1, 3}) {
            SCOPED_TRACE(std::string(opt) + " zero stage " + std::to_string(stage));
            c.optim.name = opt;
            c.train.zero_stage = stage;
            c.io.out_dir = shared_tiny_run_config(
                               "sibd_bf16z_resume" + std::string(opt) + std::to_string(stage), 6)
                               .io.out_dir;
            TrainOptions o;
            o.quiet = true;
            std::vector<float> whole_params;
            std::vector<float> whole;
            {
                Trainer t(c, o, &comm());
                whole = t.run().losses;
                whole_params = t.params();
            }
            RunConfig first = c;
            first.io.out_dir += "_first";
            {
                TrainOptions stop = o;
                stop.stop_after = 3;
                Trainer t(first, stop, &comm());
                t.run();
            }
            TrainOptions resume = o;
            resume.resume = first.io.out_dir;
            RunConfig second = c;
            second.io.out_dir += "_second";
            Trainer t(second, resume, &comm());
            const std::vector<float> rest = t.run().losses;
            ASSERT_EQ(rest.size(), 3u);
            for (std::size_t i = 0; i < rest.size(); i++)
                EXPECT_EQ(rest[i], whole[3 + i]) << "step " << 4 + i;
            EXPECT_EQ(t.params(), whole_params);
            comm().barrier();
        }
}

// optim.master = "none" under DDP: every rank rounds every element with the same draw, so the
// replicas' bf16 weights stay bitwise equal, and the run tracks one process over the global batch
// (the gradient sums' order differs, so the rounding may go the other way somewhere).
TEST(StepInBackwardDist, Bf16WeightsStayEqualOnEveryRank) {
    const int N = comm().size();
    RunConfig c = shared_tiny_run_config("sibd_bf16", 6);
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.io.save_final = false;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * N;
    c.optim.master = "none";
    c.optim.step_in_backward = true;
    const DistOutcome dist = run_stage(c, true);
    // Every rank's weights, bitwise those of rank 0.
    std::vector<float> all(dist.params.size() * (std::size_t)N);
    comm().all_gather_bytes(dist.params.data(), all.data(), dist.params.size() * sizeof(float));
    for (int r = 1; r < N; r++)
        EXPECT_EQ(0, std::memcmp(all.data(), all.data() + r * dist.params.size(),
                                 dist.params.size() * sizeof(float)))
            << "rank " << r << "'s bf16 weights differ from rank 0's";
    RunConfig one = c;
    one.train.micro_batch_size = 2 * N;
    one.io.out_dir += "_one" + std::to_string(comm().rank());
    TrainOptions quiet;
    quiet.quiet = true;
    Trainer t(one, quiet);
    const std::vector<float> ref = t.run().losses;
    ASSERT_EQ(ref.size(), dist.losses.size());
    for (std::size_t i = 0; i < ref.size(); i++)
        EXPECT_NEAR(dist.losses[i], ref[i], 2e-3 * std::abs(ref[i])) << "step " << i + 1;
    comm().barrier();
}

}  // namespace
}  // namespace memtrain::dist
