// optim.step_in_backward under mpirun (2 and 4 ranks): at DDP and ZeRO 1, 2 and 3, with clipping
// (the norm pass) and with accumulation, every rank's weights after the run are bitwise those of
// the two-phase step at the same stage, each rank holds no gradient buffer with one micro-batch
// per step (its buckets' peak is the plan's row), and the plan's rows are the engine's.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "mpi/dist_runs.h"
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

}  // namespace
}  // namespace memtrain::dist
