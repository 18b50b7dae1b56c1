// Stream orders the other CUDA data-parallel tests do not reach: ZeRO-3 with more blocks than its
// ring of gathered units (kSlots: two slots for blocks), so a slot is gathered into while the
// compute stream may still read the unit it held. On cudasim (memtrain_sim_dist_tests) the
// streams interleave as a GPU's may (tests/cudasim/queue.h), so a missing event wait there reads
// the wrong unit and the losses part from one process's (tests/cudasim/drop_wait_test.py).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "mpi/dist_runs.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

#define REQUIRE_GPU_RANKS()                                                                 \
    do {                                                                                    \
        if (!::memtrain::test::on_cudasim() && (!cuda_available() || !MEMTRAIN_HAVE_NCCL || \
                                                cuda_device_count() < comm().local_size())) \
            GTEST_SKIP() << "needs one CUDA device per rank and NCCL";                      \
    } while (0)

TEST(CudaDp, Zero3RotatesUnitsThroughItsSlots) {
    REQUIRE_GPU_RANKS();
    const int N = comm().size(), b = 2, steps = 4;
    RunConfig c = shared_tiny_run_config("cuda_dp_zero3_slots", steps);
    c.train.device = "cuda";
    c.train.precision = "fp32";
    c.io.save_final = false;
    c.model.n_layer = 5;  // five blocks through two slots: every forward reuses each slot
    c.train.batch_size = N * b;
    RunConfig ref_cfg = c;
    ref_cfg.train.micro_batch_size = N * b;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
    TrainOptions quiet;
    quiet.quiet = true;
    Trainer ref(ref_cfg, quiet);
    const TrainSummary ref_sum = ref.run();
    c.train.micro_batch_size = b;
    c.train.zero_stage = 3;
    Trainer t(c, quiet, &comm());
    const TrainSummary sum = t.run();
    ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
    for (std::size_t i = 0; i < sum.losses.size(); i++)
        EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 2e-5 * std::abs(ref_sum.losses[i]))
            << "step " << i + 1;
    const std::vector<float> params = t.params(), ref_params = ref.params();
    ASSERT_EQ(params.size(), ref_params.size());
    double worst = 0;
    for (std::size_t i = 0; i < params.size(); i++)
        worst = std::max(worst, (double)std::abs(params[i] - ref_params[i]));
    EXPECT_LT(worst, 1e-4);
}

}  // namespace
}  // namespace memtrain::dist
