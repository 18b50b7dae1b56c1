// Parameter-server data parallelism under mpirun (2 ranks: 1 server + 1 worker; 4 ranks: 1 server
// + 3 workers and 2 servers + 2 workers). Synchronous: with one micro-batch per worker a run is
// bitwise one process accumulating the workers' micro-batches in worker order (losses, the
// servers' gradients, parameters); with more per worker, to rounding. Stale: every step computes
// on exactly the version the bound allows. Checkpoints move between a PS run and one process, and
// bad layouts are refused naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/cpu/ps_engine.h"
#include "mpi/dist_runs.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

// The tiny run with `workers` x `per_worker` micro-batches of 2 sequences per step.
RunConfig ps_run(const std::string& name, int servers, int per_worker, bool llama, int steps) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.model.n_layer = 3;  // 5 units: enough for 2 servers, with unequal sizes to balance
    c.io.save_final = false;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * per_worker * (comm().size() - servers);
    c.train.dp_mode = "ps";
    c.train.ps_servers = servers;
    if (llama) {  // untied: every gradient is one buffer's sum, in the same order
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
    }
    return c;
}

// The same run in one process (on every rank): the global batch as micro-batches in worker order.
RunConfig ps_as_one_process(const RunConfig& c, const std::string& tag) {
    RunConfig one = c;
    one.train.dp_mode = "allreduce";
    one.io.out_dir = c.io.out_dir + "_" + tag + std::to_string(comm().rank());
    return one;
}

// Every gradient but the embedding's is a matrix product or a row reduction that one process
// adds into the step's running sum once per micro-batch, as the server adds the pushes: those
// are bitwise. The embedding's gradient is a scatter-add, token row by token row, into that sum:
// one process adds micro-batch k's rows one at a time to the sum of micro-batches < k, the
// server adds worker k's whole row sums, so where a token occurs in two micro-batches the sums
// differ in the last bits (as a pipeline's tied embedding does, parallel/pipeline/executor.h). One
// step without clipping (whose coefficient reads the embedding's gradient) checks everything
// else bitwise; more steps follow the embedding to rounding. One worker is bitwise throughout.
void check_ps_matches_one_process(const std::string& name, int servers, int per_worker, bool llama,
                                  int steps = 6, bool clip = true,
                                  const std::string& remat = "none") {
    if (comm().size() < servers + 1) GTEST_SKIP() << "needs " << servers + 1 << " ranks";
    RunConfig c = ps_run(name, servers, per_worker, llama, steps);
    if (!clip) c.optim.grad_clip = 0;
    c.train.remat = remat;
    const int W = comm().size() - servers;
    const bool all_exact = W == 1 && per_worker == 1;
    const bool exact = all_exact || (per_worker == 1 && steps == 1 && !clip);
    TrainOptions quiet;
    quiet.quiet = true;
    TrainSummary ref_sum;
    std::vector<float> ref_params, ref_grads;
    {
        Trainer ref(ps_as_one_process(c, "ref"), quiet);
        ref_sum = ref.run();
        ref_params = ref.params();
        ref_grads.assign(ref.model().grads(), ref.model().grads() + ref.model().num_params());
    }
    Trainer t(c, quiet, &comm());
    const TrainSummary sum = t.run();
    auto* pe = dynamic_cast<PsEngine*>(&t.engine());
    ASSERT_NE(pe, nullptr);
    EXPECT_EQ(pe->workers(), W);
    EXPECT_EQ(pe->is_server(), comm().rank() >= W);
    const ParamLayout layout = make_param_layout(c.model);
    // The floats that must match bitwise: all with one worker, else all but the embedding unit.
    const std::size_t emb_end = all_exact ? 0 : layout.units[ParamLayout::embedding_unit()].end;

    ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
    for (std::size_t i = 0; i < sum.losses.size(); i++) {
        if (all_exact || i == 0)
            EXPECT_EQ(sum.losses[i], ref_sum.losses[i]) << name << " step " << i + 1;
        else
            EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 1e-4 * std::abs(ref_sum.losses[i]))
                << name << " step " << i + 1;
    }
    // A server's gradients of the last step (clipped as one process clipped them).
    if (pp::StageStore* st = pe->server_store()) {
        std::size_t diff = 0;
        double worst = 0;
        for (std::size_t j = st->begin(); j < st->end(); j++) {
            const float g = st->owned_grads()[j - st->begin()];
            if (exact && j >= emb_end) diff += g != ref_grads[j];
            worst = std::max(worst, (double)std::abs(g - ref_grads[j]));
        }
        EXPECT_EQ(diff, 0u) << name << " rank " << comm().rank();
        EXPECT_LT(worst, 1e-5) << name;
    }
    // Parameters, as the servers hold them (every rank).
    const std::vector<float> params = t.params();
    ASSERT_EQ(params.size(), ref_params.size());
    std::size_t diff = 0;
    double worst = 0;
    for (std::size_t j = 0; j < params.size(); j++) {
        if (exact && j >= emb_end) diff += params[j] != ref_params[j];
        worst = std::max(worst, (double)std::abs(params[j] - ref_params[j]));
    }
    EXPECT_EQ(diff, 0u) << name;
    EXPECT_LT(worst, 1e-4) << name;
    // Synchronous: every worker computed step t on version t, and its replica is the servers'.
    if (GPT* m = pe->model()) {
        for (std::size_t i = 0; i < pe->versions_used().size(); i++)
            EXPECT_EQ(pe->versions_used()[i], (int64_t)i);
        std::size_t stale = 0;
        for (std::size_t j = 0; j < params.size(); j++) stale += m->params()[j] != params[j];
        EXPECT_EQ(stale, 0u);
    }
    // Bytes: a worker pushes and pulls Ψ floats per step; a server W times its range each way.
    const PsStats& s = pe->stats();
    const int64_t psi4 = 4 * (int64_t)ref_params.size();
    ASSERT_EQ(s.sent.size(), (std::size_t)comm().size());
    for (int w = 0; w < W; w++) {
        EXPECT_EQ(s.sent[w], steps * psi4);
        EXPECT_EQ(s.received[w], steps * psi4);
    }
    int64_t server_bytes = 0;
    for (int k = 0; k < servers; k++) {
        const int r = W + k;
        EXPECT_EQ(s.sent[r], s.received[r]);
        EXPECT_EQ(s.sent[r], steps * W * 4 * (int64_t)pe->split().count(k));
        server_bytes += s.sent[r];
    }
    EXPECT_EQ(server_bytes, steps * W * psi4);
}

TEST(Ps, OneServerMatchesOneProcessBitwise) {
    check_ps_matches_one_process("ps_llama_1s", 1, 1, true, 1, false);
    check_ps_matches_one_process("ps_llama_1s", 1, 1, true);
}
TEST(Ps, TwoServersMatchOneProcessBitwise) {
    check_ps_matches_one_process("ps_llama_2s", 2, 1, true, 1, false);
    check_ps_matches_one_process("ps_llama_2s", 2, 1, true);
}
// One worker per server layout: the whole run bitwise (np 4: three servers, one worker).
TEST(Ps, OneWorkerIsOneProcessBitwise) {
    check_ps_matches_one_process("ps_llama_1w", comm().size() - 1, 1, true);
}
TEST(Ps, TiedGpt2MatchesOneProcessToRounding) {
    check_ps_matches_one_process("ps_gpt2_1s", 1, 1, false);
}
TEST(Ps, SeveralMicroBatchesPerWorkerMatchToRounding) {
    check_ps_matches_one_process("ps_llama_k3", 1, 3, true);
}

TEST(Ps, ServersSplitUnitsByBalancedContiguousRanges) {
    RunConfig c = ps_run("ps_split", 1, 1, true, 1);
    c.model.n_layer = 6;
    const ParamLayout layout = make_param_layout(c.model);
    for (int S = 1; S <= (int)layout.units.size(); S++) {
        const ServerSplit sp = split_servers(layout, S);
        ASSERT_EQ(sp.servers(), S);
        EXPECT_EQ(sp.begin[0], 0u);
        EXPECT_EQ(sp.end[S - 1], layout.total);
        for (int s = 0; s < S; s++) {
            EXPECT_LE(sp.first_unit[s], sp.last_unit[s]);
            if (s > 0) {
                EXPECT_EQ(sp.first_unit[s], sp.last_unit[s - 1] + 1);
            }
        }
    }
    // Two servers: the cut nearest half of Ψ (the embedding and the head are the big units).
    const ServerSplit two = split_servers(layout, 2);
    std::size_t best = layout.total;
    for (int u = 0; u + 1 < (int)layout.units.size(); u++) {
        const double d = std::abs((double)layout.units[u].end - layout.total / 2.0);
        best = std::min(best, (std::size_t)d);
    }
    EXPECT_EQ((std::size_t)std::abs((double)two.end[0] - layout.total / 2.0), best);
}

// Staleness k: step t computes on version max(0, t - k), never older; the run still learns and
// stays close to the synchronous one. k = 0 is the synchronous run itself.
TEST(Ps, StalenessBoundHoldsAndTrainingConverges) {
    if (comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
    const int steps = 12;
    TrainOptions quiet;
    quiet.quiet = true;
    std::vector<float> sync_losses;
    for (int k : {0, 1, 3}) {
        RunConfig c = ps_run("ps_stale" + std::to_string(k), 1, 1, true, steps);
        c.train.ps_staleness = k;
        Trainer t(c, quiet, &comm());
        const TrainSummary sum = t.run();
        auto* pe = dynamic_cast<PsEngine*>(&t.engine());
        ASSERT_NE(pe, nullptr);
        if (pe->model()) {
            ASSERT_EQ(pe->versions_used().size(), (std::size_t)steps);
            for (int i = 0; i < steps; i++) {
                EXPECT_EQ(pe->versions_used()[i], std::max(0, i - k)) << "k " << k << " step " << i;
                EXPECT_LE(i - pe->versions_used()[i], k);
            }
        }
        ASSERT_EQ(sum.losses.size(), (std::size_t)steps);
        for (float l : sum.losses) EXPECT_TRUE(std::isfinite(l));
        EXPECT_LT(sum.losses.back(), sum.losses.front()) << "k " << k;
        if (k == 0) {
            sync_losses = sum.losses;
            continue;
        }
        // The first k + 1 steps see the same versions as the synchronous run's first step and
        // then fall behind: step 0 is identical, the rest differ, but not by much.
        EXPECT_EQ(sum.losses[0], sync_losses[0]);
        EXPECT_NE(sum.losses.back(), sync_losses.back());
        EXPECT_NEAR(sum.losses.back(), sync_losses.back(), 0.5);
    }
}

// A PS checkpoint (servers' parameters, their optimizer slices, the worker's empty one) resumes in
// one process, and one process's in a PS run, continuing bitwise as the uninterrupted process.
TEST(Ps, CheckpointsMoveBetweenPsAndOneProcess) {
    if (comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
    const int steps = 6, cut = 3;
    // One worker (so the run is bitwise one process's; see above) and every other rank a server.
    const int servers = comm().size() - 1;
    const RunConfig c = ps_run("ps_ckpt", servers, 1, true, steps);
    RunConfig ps = c;
    ps.io.out_dir = c.io.out_dir + "_ps";
    check_checkpoint_round_trip(ps_as_one_process(c, "one"), ps, steps, cut, "PS");
}

// Every rank's memory is priced before anything is allocated (a worker's replica and arenas, a
// server's units with their optimizer state, push buffer and published versions): the plan's
// rows are what the built engine reports, and a run that does not fit the host is refused before
// allocating, naming the categories.
// A worker is a whole model: remat that rebuilds block inputs runs there as in one process (the
// reference runs the same policy, which is bitwise no remat's), its rows planned as allocated.
TEST(Ps, RebuiltBlockInputsMatchOneProcess) {
    check_ps_matches_one_process("ps_llama_mp", 1, 1, true, 1, false, "memory-poor");
    check_ps_matches_one_process("ps_llama_chen", 1, 1, true, 6, true, "chen:2");
    if (comm().size() < 2) return;
    RunConfig c = ps_run("ps_memory_mp", 1, 1, true, 1);
    c.train.remat = "revolve:1";
    Trainer t(c, test::quiet(), &comm());
    expect_planned_rows_are_the_engines(t, "ps revolve:1");
    t.run();
}

TEST(Ps, MemoryIsPlannedAndARunThatCannotFitIsRefusedBeforeAllocating) {
    if (comm().size() < 2) GTEST_SKIP() << "needs a worker and a server";
    RunConfig c = ps_run("ps_memory", 1, 1, true, 1);
    c.train.ps_staleness = 1;
    {
        Trainer t(c, test::quiet(), &comm());
        const auto built = expect_planned_rows_are_the_engines(t, "ps");
        EXPECT_EQ(built.size(), comm().rank() < comm().size() - 1 ? 5u : 4u);
    }
    expect_refused_before_allocating(c, "of host memory per rank");
}

TEST(Ps, BadLayoutsAreRefusedNamingTheKey) {
    const RunConfig c = ps_run("ps_bad", 1, 1, true, 1);
    const auto refused = &expect_refused;
    RunConfig all_servers = c;
    all_servers.train.ps_servers = comm().size();
    all_servers.train.batch_size = 2;
    refused(all_servers, "train.ps_servers");
    RunConfig zero = c;
    zero.train.zero_stage = 1;
    refused(zero, "train.zero_stage = 1");
    RunConfig piped = c;
    piped.train.pp = 2;
    refused(piped, "train.pp = 2");
    RunConfig stale = c;
    stale.train.ps_staleness = -1;
    refused(stale, "train.ps_staleness = -1");
    RunConfig mode = c;
    mode.train.dp_mode = "ring";
    refused(mode, "train.dp_mode = \"ring\"");
}

}  // namespace
}  // namespace memtrain::dist
