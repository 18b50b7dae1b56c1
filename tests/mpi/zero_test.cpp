// Data-parallel training under mpirun (1, 2 and 4 ranks): for each ZeRO stage, N ranks with
// micro-batch b train the same model as one process with micro-batch N*b (losses and final
// parameters), each rank holds exactly the model-state bytes its stage promises, a checkpoint
// saved at world size 4 continues at world size 2, and configs that differ between ranks fail on
// every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "mpi/dist_runs.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

namespace fs = std::filesystem;

// The shared tiny run, saving nothing at the end and evaluating every 5 steps.
RunConfig shared_tiny_run(const std::string& name, int steps) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.io.save_final = false;
    c.train.eval_every = 5;
    return c;
}

struct Case {
    int stage;
    std::string remat;
    bool llama;  // untied lm_head (a head unit with its own output embedding), rmsnorm, rope
    double dropout = 0;  // model.dropout: masks keyed by sequence, the same at every world size
};

std::string name(const Case& k) {
    return "zero" + std::to_string(k.stage) + "_" + k.remat.substr(0, k.remat.find(':')) +
           (k.llama ? "_llama" : "") + (k.dropout > 0 ? "_dropout" : "");
}

// N ranks x micro-batch 2 x 2 accumulation steps against one process with micro-batch 2N.
void check_matches_single_process(const Case& k) {
    const int N = comm().size(), b = 2, K = 2, steps = 10;
    RunConfig c = shared_tiny_run(name(k), steps);
    c.train.remat = k.remat;
    c.model.dropout = k.dropout;
    if (k.llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
    }
    c.train.batch_size = N * b * K;
    TrainOptions quiet;
    quiet.quiet = true;

    // The reference, run by every rank on its own (a world of one, in its own out_dir).
    RunConfig ref_cfg = c;
    ref_cfg.train.micro_batch_size = N * b;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
    TrainSummary ref_sum;
    std::vector<float> ref_params;
    {
        Trainer ref(ref_cfg, quiet);
        ref_sum = ref.run();
        ref_params.assign(ref.model().params(), ref.model().params() + ref.model().num_params());
    }

    c.train.micro_batch_size = b;
    c.train.zero_stage = k.stage;
    Trainer t(c, quiet, &comm());
    TrainSummary sum = t.run();

    // Stage 3 prefetches: only the first unit of each forward pass (the embedding) is gathered
    // on the spot; every block, the head and (tied) the embedding again were announced and
    // gathered while the previous unit computed. Taken before the parameter check below, whose
    // acquires are cold.
    // (memory-poor's rebuilds acquire the blocks below again, unannounced: misses by design.)
    if (k.stage == 3 && k.remat != "memory-poor") {
        const PrefetchStats ps = t.store().prefetch_stats();
        EXPECT_GT(ps.misses, 0) << name(k);
        EXPECT_GE(ps.hits, 3 * ps.misses) << name(k);
        EXPECT_EQ(ps.dropped, 0) << name(k);
    }
    // Stages 1-3 reduce-scatter nonblocking with a bounded number in flight.
    if (k.stage >= 1) {
        const ReduceStats rs = t.store().reduce_stats();
        EXPECT_GT(rs.started, 0) << name(k);
        EXPECT_LE(rs.arrived, rs.started) << name(k);
        EXPECT_GE(rs.max_in_flight, 1u) << name(k);
        EXPECT_LE(rs.max_in_flight, ZeroStore::kMaxReducing) << name(k);
    }

    ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
    for (std::size_t i = 0; i < sum.losses.size(); i++)
        EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 1e-5 * std::abs(ref_sum.losses[i]))
            << name(k) << " step " << i + 1;
    ASSERT_EQ(sum.val_losses.size(), ref_sum.val_losses.size());
    for (std::size_t i = 0; i < sum.val_losses.size(); i++)
        EXPECT_NEAR(sum.val_losses[i].second, ref_sum.val_losses[i].second, 1e-5);

    // Final parameters, unit by unit (gathered under ZeRO-3). Summation order differs from the
    // single process (rows split across ranks, then a rank sum), so values agree to rounding
    // amplified by Adam on near-zero gradients.
    const ParamLayout& layout = t.model().layout();
    double worst = 0;
    for (int u = 0; u < (int)layout.units.size(); u++) {
        const float* p = t.store().acquire(u);
        for (std::size_t i = 0; i < layout.units[u].size(); i++)
            worst = std::max(worst, (double)std::abs(p[i] - ref_params[layout.units[u].begin + i]));
        t.store().release(u);
    }
    EXPECT_LT(worst, 2e-5) << name(k) << ": largest parameter difference";

    // Model-state bytes on this rank, from the allocator's accounting: Ψ per state, or this
    // rank's shard of the balanced layout (Ψ/N rounded) where the stage shards it.
    const std::size_t psi = layout.total;
    const std::size_t shard = (std::size_t)shard_ranges((int64_t)psi, N)[comm().rank()].count;
    EXPECT_LE(shard, psi / N + 1);
    EXPECT_GE(shard, psi / N);
    const MemoryStats m = host_memory().snapshot();
    EXPECT_EQ(m[MemCategory::Parameters], 4 * (k.stage >= 3 ? shard : psi)) << name(k);
    EXPECT_EQ(m[MemCategory::Gradients], 4 * (k.stage >= 2 ? shard : psi)) << name(k);
    EXPECT_EQ(m[MemCategory::OptimizerState], 8 * (k.stage >= 1 ? shard : psi)) << name(k);
    // Peaks over the run: the same (the unit buffers are counted as communication).
    EXPECT_EQ(m.peak(MemCategory::Parameters), m[MemCategory::Parameters]) << name(k);
    EXPECT_EQ(m.peak(MemCategory::Gradients), m[MemCategory::Gradients]) << name(k);
    // The planner (memtrain estimate) predicts the same per-rank model states for this layout,
    // up to the rounding of Ψ/N (a float per state).
    plan::RunSpec r;
    r.precision = Precision::fp32;
    r.optimizer = plan::Optimizer::adamw;
    r.dp = N;
    r.zero = k.stage;
    r.micro_batch = b;
    r.seq = c.train.seq_len;
    auto est = plan::estimate_memory(plan::model_from_config(c.model), r);
    EXPECT_NEAR((double)est.bytes("parameters"), (double)m[MemCategory::Parameters], 4.0);
    EXPECT_NEAR((double)est.bytes("gradients"), (double)m[MemCategory::Gradients], 4.0);
    EXPECT_NEAR((double)est.bytes("optimizer states"), (double)m[MemCategory::OptimizerState], 8.0);
    // Unit buffers, at most (docs/distributed.md): under ZeRO-3 the units held (two at the
    // classifier: the head and the tied embedding) and one prefetched; at stages 2 and 3 the
    // gradient buckets backward fills (two: a block's and the tied embedding's) and up to
    // kMaxReducing more in flight, each with its reduce-scatter piece. How many are in flight at
    // a moment depends on timing, so this is a bound, not an equality.
    if (k.stage >= 2 && N > 1) {
        const std::size_t largest = layout.largest_unit(), R = ZeroStore::kMaxReducing;
        const std::size_t units = (k.stage == 3 ? 3 : 0) + 2 + R;
        EXPECT_LE(m.peak(MemCategory::Communication), 4 * (units * largest + R * (largest / N + 1)))
            << name(k);
    }
}

TEST(Zero, Stage0DdpMatchesSingleProcess) {
    check_matches_single_process({0, "none", false});
}
TEST(Zero, Stage2WithDropoutMatchesSingleProcess) {
    check_matches_single_process({2, "selective", false, 0.1});
}
TEST(Zero, Stage3WithMemoryPoorRematMatchesSingleProcess) {
    check_matches_single_process({3, "memory-poor", false});
}
TEST(Zero, Stage1WithChenSegmentsMatchesSingleProcess) {
    check_matches_single_process({1, "chen:2", true, 0.1});
}
TEST(Zero, Stage1MatchesSingleProcess) {
    check_matches_single_process({1, "none", false});
}
TEST(Zero, Stage2WithSelectiveRecomputeMatchesSingleProcess) {
    check_matches_single_process({2, "selective", false});
}
TEST(Zero, Stage3MatchesSingleProcess) {
    check_matches_single_process({3, "none", false});
}
TEST(Zero, Stage3WithFullRecomputeMatchesSingleProcess) {
    check_matches_single_process({3, "full", false});
}
TEST(Zero, Stage3LlamaStyleUntiedHeadMatchesSingleProcess) {
    check_matches_single_process({3, "none", true});
}

// The prefetch itself, call by call: one training micro-batch and one evaluation pass over a
// ZeRO-3 store must gather only the embedding at the start of each forward on the spot, whatever
// the recomputation (which re-acquires nothing more) and with tied or untied embeddings (tied:
// the classifier acquires the embedding again). Fails if the model or the store stops
// prefetching.
TEST(Zero, Stage3PrefetchesEveryUnitButTheFirst) {
    for (const bool tied : {true, false}) {
        for (const BlockKeep keep : {BlockKeep::All, BlockKeep::Input}) {
            ModelConfig cfg = test::tiny_run_config("unused").model;
            cfg.tied_embeddings = tied;
            const int L = cfg.n_layer, B = 2, T = 8;
            const ParamLayout layout = make_param_layout(cfg);
            ZeroStore store(layout, comm(), 3);
            GPT model(cfg, &store);
            model.set_remat(RematPlan((std::size_t)L, keep));
            model.init_weights(7);
            std::vector<int32_t> x(B * T), y(B * T);
            for (int i = 0; i < B * T; i++) {
                x[i] = (i * 7) % cfg.vocab_size;
                y[i] = (i * 7 + 3) % cfg.vocab_size;
            }
            const std::string what =
                std::string(tied ? "tied" : "untied") + ", remat " + keep_name(keep);
            const PrefetchStats init = store.prefetch_stats();  // init_weights: cold acquires
            model.zero_grads();
            model.forward_backward(x.data(), y.data(), B, T, 1.0f);
            PrefetchStats ps = store.prefetch_stats();
            // Forward: blocks, head (+ embedding); backward: blocks.
            EXPECT_EQ(ps.hits - init.hits, 2 * L + 1 + (tied ? 1 : 0)) << what;
            EXPECT_EQ(ps.misses - init.misses, 1) << what;
            EXPECT_EQ(ps.dropped, 0) << what;
            model.forward_loss(x.data(), y.data(), B, T);
            const PrefetchStats ev = store.prefetch_stats();
            EXPECT_EQ(ev.hits - ps.hits, L + 1 + (tied ? 1 : 0)) << what;
            EXPECT_EQ(ev.misses - ps.misses, 1) << what;
            // A hint not followed: the prefetch is dropped before the optimizer may write the
            // shard, and the unit is gathered afresh.
            store.prefetch(layout.block_unit(0));
            store.owned_params();
            EXPECT_EQ(store.prefetch_stats().dropped, 1) << what;
            store.acquire(layout.block_unit(0));
            store.release(layout.block_unit(0));
            EXPECT_EQ(store.prefetch_stats().misses, ev.misses + 1) << what;
            store.owned_grads();  // completes the reductions before the store goes
        }
    }
}

TEST(Zero, ConfigsThatDifferFailOnEveryRank) {
    RunConfig c = shared_tiny_run("mismatch", 2);
    c.train.micro_batch_size = 0;
    c.train.seed = 1 + comm().rank() % 2;  // ranks 0 and 1 disagree
    TrainOptions quiet;
    quiet.quiet = true;
    try {
        Trainer t(c, quiet, &comm());
        ADD_FAILURE() << "rank " << comm().rank() << " accepted a config other ranks differ from";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("config differs across ranks"), std::string::npos)
            << e.what();
    }
}

// Resharding, in two launches (a CTest fixture): 4 ranks under ZeRO-3 train 5 of 10 steps and
// checkpoint; 2 ranks under ZeRO-1 resume and must continue the curve of an uninterrupted single
// process. Run only by name (--gtest_filter), at the world size each needs.
RunConfig resume_run(int stage) {
    RunConfig c =
        test::tiny_run_config((fs::path(MT_BINARY_DIR) / "test_tmp" / "zero_resume").string(), 10);
    c.train.batch_size = 8;
    c.train.micro_batch_size = 0;  // batch_size / ranks
    c.train.zero_stage = stage;
    return c;
}

TEST(ZeroResumeFixture, SaveAtWorld4) {
    ASSERT_EQ(comm().size(), 4) << "run with mpirun -np 4";
    const std::string dir = (fs::path(MT_BINARY_DIR) / "test_tmp" / "zero_resume").string();
    if (comm().rank() == 0) {
        fs::remove_all(dir);
        fs::create_directories(dir);
        test::tiny_run(dir, 10);  // writes the shards
    }
    comm().barrier();
    TrainOptions o;
    o.quiet = true;
    o.stop_after = 5;
    Trainer t(resume_run(3), o, &comm());
    TrainSummary s = t.run();
    EXPECT_EQ(s.steps_done, 5);
    // One optimizer file per rank.
    for (int r = 0; r < 4; r++)
        EXPECT_TRUE(fs::exists(fs::path(s.last_checkpoint) /
                               ("optimizer.0000" + std::to_string(r) + "-of-00004.safetensors")));
}

TEST(ZeroResumeFixture, ContinueAtWorld2) {
    ASSERT_EQ(comm().size(), 2) << "run with mpirun -np 2 after SaveAtWorld4";
    TrainOptions o;
    o.quiet = true;
    RunConfig ref_cfg = resume_run(0);
    ref_cfg.io.out_dir += "_ref" + std::to_string(comm().rank());
    ref_cfg.io.save_final = false;
    TrainSummary ref = Trainer(ref_cfg, o).run();

    o.resume = resume_run(1).io.out_dir;
    RunConfig c = resume_run(1);
    c.io.save_final = false;
    Trainer t(c, o, &comm());
    TrainSummary s = t.run();
    ASSERT_EQ(s.losses.size(), 5u);
    for (int i = 0; i < 5; i++)
        EXPECT_NEAR(s.losses[i], ref.losses[5 + i], 1e-5 * std::abs(ref.losses[5 + i]))
            << "step " << 6 + i;
}

}  // namespace
}  // namespace memtrain::dist

namespace memtrain::dist {

// Every rank trains 2 steps, then rank 1 dies (no MPI_Finalize, as a crash would) while the
// others start the next run: they must not hang in its collectives. Depending on timing,
// mpirun notices the exit first, MPI reports the lost peer as an error in the collective (which
// aborts the job), or the communicator's timeout fires; each names what happened.
int run_rank1_dies_in_training(Communicator& c) {
    RunConfig cfg = shared_tiny_run("rank_dies", 2);
    cfg.train.micro_batch_size = 0;
    TrainOptions o;
    o.quiet = true;
    try {
        Trainer(cfg, o, &c).run();
        if (c.rank() == 1) std::_Exit(0);
        cfg.train.max_steps = 6;
        Trainer(cfg, o, &c).run();
    } catch (const Error& e) {
        // What `memtrain train` does with an error under mpirun: end every rank now.
        c.abort(e.what());
    }
    std::fprintf(stderr, "rank %d: finished training without rank 1\n", c.rank());
    return 1;
}

}  // namespace memtrain::dist
