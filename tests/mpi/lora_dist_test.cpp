// LoRA under data parallelism (mpirun, 1, 2 and 4 ranks): for each ZeRO stage the adapters
// train as one process with the whole micro-batch does (losses and adapters to rounding), the
// frozen base is identical on every rank, each rank holds the adapter states its stage promises
// and no base gradient, and a checkpoint the job writes resumes in one process.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/cpu/cpu_engine.h"
#include "mpi/dist_runs.h"

namespace memtrain::dist {
namespace {

void check_lora_matches_single_process(int stage) {
    const int N = comm().size(), b = 2, K = 2, steps = 6;
    const std::string name = "lora_zero" + std::to_string(stage);
    RunConfig c = shared_tiny_run_config(name, steps);
    c.lora.rank = 4;
    c.lora.alpha = 8;
    c.lora.targets = "all";
    c.optim.lr = 1e-2;
    c.train.batch_size = N * b * K;
    TrainOptions quiet;
    quiet.quiet = true;

    RunConfig ref_cfg = c;
    ref_cfg.train.micro_batch_size = N * b;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
    TrainSummary ref_sum;
    std::vector<float> ref_adapters, base;
    {
        Trainer ref(ref_cfg, quiet);
        ref_sum = ref.run();
        auto& e = dynamic_cast<CpuEngine&>(ref.engine());
        const float* p = e.zero_store().full_params();
        ref_adapters.assign(p, p + e.lora_layout().params.total);
        base = ref.params();
    }

    c.train.micro_batch_size = b;
    c.train.zero_stage = stage;
    const MemoryStats before = host_memory().snapshot();
    Trainer t(c, quiet, &comm());
    TrainSummary sum = t.run();
    ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
    for (std::size_t i = 0; i < sum.losses.size(); i++)
        EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 1e-5 * std::abs(ref_sum.losses[i]))
            << name << " step " << i + 1;
    EXPECT_EQ(t.params(), base) << name << ": the frozen base changed";

    auto& e = dynamic_cast<CpuEngine&>(t.engine());
    const ParamLayout& lay = e.lora_layout().params;
    double worst = 0;
    for (int u = 0; u < (int)lay.units.size(); u++) {
        const float* p = e.zero_store().acquire(u);
        for (std::size_t i = 0; i < lay.units[u].size(); i++)
            worst = std::max(worst, (double)std::abs(p[i] - ref_adapters[lay.units[u].begin + i]));
        e.zero_store().release(u);
    }
    EXPECT_LT(worst, 2e-5) << name << ": largest adapter difference";

    // Adapter states per rank: Ψa or this rank's shard; the base is fp32 and whole everywhere;
    // no base gradient exists.
    const std::size_t psi = lay.total, shard = (std::size_t)e.zero_store().owned().count;
    const MemoryStats m = host_memory().snapshot();
    auto grew = [&](MemCategory k) { return m[k] - before[k]; };
    EXPECT_EQ(grew(MemCategory::Parameters),
              4 * t.engine().weights().layout.total + 4 * (stage >= 3 ? shard : psi))
        << name;
    EXPECT_EQ(grew(MemCategory::Gradients), 4 * (stage >= 2 ? shard : psi)) << name;
    EXPECT_EQ(grew(MemCategory::OptimizerState), 8 * (stage >= 1 ? shard : psi)) << name;
}

}  // namespace

TEST(LoraDist, Stage0MatchesSingleProcess) {
    check_lora_matches_single_process(0);
}
TEST(LoraDist, Stage2MatchesSingleProcess) {
    check_lora_matches_single_process(2);
}
TEST(LoraDist, Stage3MatchesSingleProcess) {
    check_lora_matches_single_process(3);
}

// The job's checkpoint (adapters at ZeRO-3 shards) continues in one process as the job does.
TEST(LoraDist, CheckpointOfTheJobResumesInOneProcess) {
    const int N = comm().size(), steps = 6, cut = 3;
    RunConfig c = shared_tiny_run_config("lora_resume", steps);
    c.lora.rank = 4;
    c.lora.targets = "all";
    c.train.batch_size = 2 * N;
    c.train.micro_batch_size = 2;
    c.train.zero_stage = 3;
    TrainOptions o;
    o.quiet = true;
    TrainSummary whole;
    {
        Trainer t(c, o, &comm());
        whole = t.run();
    }
    c.io.out_dir += "_cut";
    o.stop_after = cut;
    { Trainer(c, o, &comm()).run(); }
    comm().barrier();
    if (comm().rank() == 0) {
        RunConfig one = c;
        one.train.micro_batch_size = 2 * N;
        one.train.zero_stage = 0;
        one.io.out_dir += "_one";
        TrainOptions r;
        r.quiet = true;
        r.resume = c.io.out_dir;
        Trainer t(one, r);
        TrainSummary s = t.run();
        ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut));
        for (int i = 0; i < steps - cut; i++)
            EXPECT_NEAR(s.losses[i], whole.losses[cut + i], 1e-5 * whole.losses[cut + i]) << i;
    }
    comm().barrier();
}

}  // namespace memtrain::dist
