// The ZeRO / offload table (parallel/placement.h), and the planner against the CPU engines' own
// prediction (predict_cpu_memory, what CpuEngine reports over a whole model or a tensor-parallel
// group and check_host_fit prices) for tensor-parallel and data-parallel layouts at every rank: the
// same bytes, because both count with make_param_layout, dist::shard_ranges, the shard table and
// plan_arena.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>

#include "core/error.h"
#include "engine/host_memory.h"
#include "parallel/placement.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "remat/policy.h"
#include "train/validate.h"

using namespace memtrain;
using dist::Placement;

TEST(PlanShardSpec, ZeroStagesAndOffloadAreRowsOfOneTable) {
    using P = Placement;
    const dist::ShardSpec want[] = {
        {P::Replicated, P::Replicated, P::Replicated},
        {P::Replicated, P::Replicated, P::Sharded},
        {P::Replicated, P::Sharded, P::Sharded},
        {P::Sharded, P::Sharded, P::Sharded},
    };
    for (int z = 0; z < 4; z++) {
        const dist::ShardSpec s = dist::shard_spec(z);
        EXPECT_EQ(s.params, want[z].params) << z;
        EXPECT_EQ(s.grads, want[z].grads) << z;
        EXPECT_EQ(s.optimizer, want[z].optimizer) << z;
    }
    EXPECT_EQ(dist::shard_spec(0, true).optimizer, P::Offloaded);
    EXPECT_EQ(dist::shard_spec(1, true).optimizer, P::OffloadedShard);
    EXPECT_EQ(dist::shard_spec(1, true).params, P::Replicated);
    EXPECT_EQ(dist::shard_spec(3, true, true).params, P::OffloadedShard);
    EXPECT_EQ(dist::shard_spec(2, true, true).params, P::Offloaded);
    EXPECT_EQ(dist::held(P::Sharded, 10, 3), 3);
    EXPECT_EQ(dist::held(P::Offloaded, 10, 3), 10);
    EXPECT_EQ(dist::held(P::OffloadedShard, 10, 3), 3);
    EXPECT_THROW(dist::shard_spec(4), Error);
    EXPECT_EQ(dist::describe(dist::shard_spec(2)),
              "parameters replicated, gradients sharded, optimizer state sharded");
}

// Every rank of tp = 2 (with and without sequence parallelism) and of dp = 3 under ZeRO 0-3,
// remat none / selective / full: the planner's parameters, gradients, optimizer states and
// activations are the engine's rows.
TEST(PlanShardSpec, PlannerEqualsTheCpuEnginesPredictionPerRank) {
    RunConfig c;
    c.model.n_layer = 3;
    c.model.n_head = 4;
    c.model.n_embd = 32;
    c.model.block_size = 32;
    c.model.vocab_size = 50;
    c.model.vocab_pad = 16;
    c.train.seq_len = 16;
    c.train.micro_batch_size = 2;
    c.train.device = "cpu";
    c.train.precision = "fp32";
    struct Layout {
        int tp, dp, zero;
        bool sp = false;  // train.sequence_parallel
    };
    for (const Layout l : {Layout{2, 1, 0}, Layout{2, 1, 0, true}, Layout{1, 3, 0}, Layout{1, 3, 1},
                           Layout{1, 3, 2}, Layout{1, 3, 3}, Layout{1, 1, 3}})
        for (const char* remat : {"none", "selective", "full"}) {
            c.train.tp = l.tp;
            c.train.sequence_parallel = l.sp;
            c.world = l.tp * l.dp;
            c.train.zero_stage = l.zero;
            c.train.batch_size = 2 * l.dp;
            c.train.remat = remat;
            validate_config(c);
            const RematPlan rp = remat::solve_policy(remat::parse_policy(remat), c.model, 2, 16,
                                                     nullptr, ActFormat::cpu())
                                     .plan;
            for (int rank = 0; rank < c.world; rank++) {
                int compared = 0;
                const std::string what = fmt::format("tp {}{} dp {} zero {} remat {} rank {}", l.tp,
                                                     l.sp ? " sp" : "", l.dp, l.zero, remat, rank);
                const plan::MemoryEstimate est = plan::estimate_rank_memory(
                    plan::model_from_config(c.model), planner_run_spec(c, ActFormat::cpu()),
                    planner_rank(c, rank));
                EXPECT_TRUE(est.engine_layout) << what;
                for (const MemoryPrediction& p : predict_cpu_memory(c, rp, rank, 2, 16)) {
                    const char* line = p.category == MemCategory::Parameters  ? "parameters"
                                       : p.category == MemCategory::Gradients ? "gradients"
                                       : p.category == MemCategory::OptimizerState
                                           ? "optimizer states"
                                       : p.category == MemCategory::Activations ? "activations"
                                                                                : nullptr;
                    if (line) {
                        EXPECT_EQ(est.bytes(line), (int64_t)p.bytes) << what << ": " << line;
                        compared++;
                    }
                }
                EXPECT_EQ(compared, 4) << what;
            }
        }
}
