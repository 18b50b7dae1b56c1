// Pipeline x data parallelism under mpirun: pipelines of 2 stages, as many side by side as the job
// has room for (np 4: pp 2 x dp 2; np 2: one pipeline). Each pipeline takes its rows of the global
// micro-batch; a stage's gradients are all-reduced across its data group, or under ZeRO-1
// reduce-scattered and its optimizer range sharded. Losses and parameters over several steps
// equal one process accumulating the same global batch to the data-parallel tolerance (the rows
// are summed in another order), the replicas of a stage stay bitwise equal, each rank holds its
// optimizer shard, and checkpoints move between the 2D layout, one pipeline and one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "mpi/dist_runs.h"
#include "parallel/mesh.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

constexpr int kStages = 2;

int pipelines() {
    return comm().size() / kStages;
}

// The untied Llama-style tiny model (or the tied GPT-2 one) on pp 2 x dp (world / 2), 2 rows per
// pipeline per micro-batch and 3 micro-batches per step (more than the stages).
RunConfig ppdp_run(const std::string& name, int steps, const std::string& schedule, int zero,
                   bool llama = true) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.model.n_layer = 4;
    if (llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
    }
    c.io.save_final = false;
    c.train.eval_every = 5;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * pipelines() * 3;
    c.train.pp = kStages;
    c.train.pp_schedule = schedule;
    c.train.zero_stage = zero;
    return c;
}

// The same global batch in one process: micro-batches of every pipeline's rows together.
RunConfig pipelines_as_one_process(const RunConfig& c, const std::string& suffix) {
    RunConfig one = c;
    one.train.pp = 1;
    one.train.pp_virtual = 1;
    one.train.pp_schedule = "1f1b";
    one.train.zero_stage = 0;
    one.train.micro_batch_size = c.train.micro_batch_size * pipelines();
    one.io.out_dir = c.io.out_dir + "_" + suffix + std::to_string(comm().rank());
    return one;
}

CpuEngine& pipeline_engine(Trainer& t) {
    auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
    if (!pe) fail("internal: the trainer does not run the pipeline engine");
    return *pe;
}

// The whole optimizer state (each name's Ψ floats, in state_names order), assembled on every
// rank by a sum where exactly one rank contributes each range: pipeline 0's stages when every
// pipeline holds its stage whole, every rank's shard under ZeRO-1.
std::vector<std::vector<float>> gather_optimizer(Trainer& t, bool sharded) {
    OptimizerState& opt = t.engine().optimizer();
    const std::size_t total = t.engine().weights().layout.total;
    const bool contributes = sharded || comm().rank() / kStages == 0;
    std::vector<std::vector<float>> out;
    for (const std::string& name : opt.state_names()) {
        std::vector<float> full(total, 0.0f), mine(opt.count());
        opt.read_state(name, mine.data());
        if (contributes) std::copy(mine.begin(), mine.end(), full.begin() + opt.offset());
        comm().all_reduce_sum(full.data(), (int64_t)total);
        out.push_back(std::move(full));
    }
    return out;
}

// Whether this rank's optimizer range equals `full` there, bitwise, for every state.
std::size_t optimizer_diff(OptimizerState& opt, const std::vector<std::vector<float>>& full) {
    const std::vector<std::string> names = opt.state_names();
    std::size_t diff = 0;
    for (std::size_t i = 0; i < names.size(); i++) {
        std::vector<float> mine(opt.count());
        opt.read_state(names[i], mine.data());
        diff += std::memcmp(mine.data(), full[i].data() + opt.offset(), mine.size() * 4) != 0;
    }
    return diff;
}

void expect_near_run(const TrainSummary& s, const std::vector<float>& params,
                     const TrainSummary& ref, const std::vector<float>& ref_params, int skip,
                     const std::string& what) {
    ASSERT_EQ(s.losses.size() + skip, ref.losses.size()) << what;
    for (std::size_t i = 0; i < s.losses.size(); i++)
        EXPECT_NEAR(s.losses[i], ref.losses[i + skip], 1e-5 * std::abs(ref.losses[i + skip]))
            << what << " step " << i + skip + 1;
    ASSERT_EQ(params.size(), ref_params.size());
    double worst = 0;
    for (std::size_t j = 0; j < params.size(); j++)
        worst = std::max(worst, (double)std::abs(params[j] - ref_params[j]));
    EXPECT_LT(worst, 2e-5) << what << ": largest parameter difference";
}

void check_pipelines_match_one_process(const std::string& schedule, int zero, bool llama = true,
                                       int chunks = 1) {
    if (comm().size() % kStages != 0) GTEST_SKIP() << "needs an even number of ranks";
    const int steps = 6, D = pipelines(), r = comm().rank();
    const std::string name = "ppdp_" + schedule + "_zero" + std::to_string(zero) +
                             (llama ? "" : "_tied") + "_v" + std::to_string(chunks);
    RunConfig c = ppdp_run(name, steps, schedule, zero, llama);
    const int m = chunks > 1 ? 4 : 3;  // interleaved: a multiple of the stages
    c.train.pp_virtual = chunks;
    c.train.batch_size = 2 * D * m;
    TrainOptions quiet;
    quiet.quiet = true;
    TrainSummary ref;
    std::vector<float> ref_params;
    {
        Trainer t(pipelines_as_one_process(c, "ref"), quiet);
        ref = t.run();
        ref_params = t.params();
    }

    Trainer t(c, quiet, &comm());
    const TrainSummary sum = t.run();
    CpuEngine& pe = pipeline_engine(t);
    EXPECT_EQ(pe.stage(), r % kStages);
    EXPECT_EQ(pe.replica(), r / kStages);
    EXPECT_EQ(pe.replicas(), D);
    EXPECT_EQ(t.config().accum_steps(), m);
    expect_near_run(sum, t.params(), ref, ref_params, 0, name);
    ASSERT_EQ(sum.val_losses.size(), ref.val_losses.size());
    for (std::size_t i = 0; i < sum.val_losses.size(); i++)
        EXPECT_NEAR(sum.val_losses[i].second, ref.val_losses[i].second, 1e-5) << name;

    // The replicas of each stage hold the same bits: every rank's stage parameters against
    // pipeline 0's (job rank s for stage s), broadcast over the job.
    pp::StageStore& st = pe.stage_store();
    for (int s = 0; s < kStages; s++) {
        int64_t n = (int64_t)st.count();
        comm().broadcast(&n, sizeof(n), s);
        std::vector<float> theirs((std::size_t)n);
        if (r == s) std::memcpy(theirs.data(), st.owned_params(), n * 4);
        comm().broadcast(theirs.data(), n * 4, s);
        if (r % kStages == s) {
            EXPECT_EQ(std::memcmp(theirs.data(), st.owned_params(), n * 4), 0)
                << name << ": stage " << s << " of pipeline " << r / kStages
                << " differs from pipeline 0's";
        }
    }

    // The optimizer: the stage's range, or under ZeRO-1 this replica's 1/D of it (the balanced
    // shard layout); measured bytes equal the prediction: AdamW's m and v, 8 bytes per parameter
    // of that range.
    const ShardRange want = zero == 1 && D > 1 ? shard_ranges((int64_t)st.count(), D)[r / kStages]
                                               : ShardRange{0, (int64_t)st.count()};
    EXPECT_EQ(pe.update_range().offset, want.offset);
    EXPECT_EQ(pe.update_range().count, want.count);
    EXPECT_EQ(t.engine().optimizer().offset(), st.begin() + (std::size_t)want.offset);
    EXPECT_EQ(t.engine().optimizer().count(), (std::size_t)want.count);
    const MemoryStats ms = host_memory().snapshot();
    EXPECT_EQ(ms[MemCategory::OptimizerState], 8 * (std::size_t)want.count) << name;
    const int B = t.config().micro_batch(), T = t.config().train.seq_len;
    for (const MemoryPrediction& p : pe.predicted_memory(B, T)) {
        if (p.category != MemCategory::Workspace) {
            EXPECT_EQ(ms[p.category], p.bytes) << category_name(p.category) << " rank " << r;
        }
    }
}

TEST(PipelineDp, GpipeMatchesOneProcess) {
    check_pipelines_match_one_process("gpipe", 0);
}
TEST(PipelineDp, OneFOneBMatchesOneProcess) {
    check_pipelines_match_one_process("1f1b", 0);
}
TEST(PipelineDp, ZeroBubbleH1MatchesOneProcess) {
    check_pipelines_match_one_process("zb-h1", 0);
}
TEST(PipelineDp, OneFOneBWithZero1MatchesOneProcess) {
    check_pipelines_match_one_process("1f1b", 1);
}
TEST(PipelineDp, GpipeWithZero1MatchesOneProcess) {
    check_pipelines_match_one_process("gpipe", 1);
}
// Interleaved (2 chunks per rank, 4 virtual stages) with pipelines side by side: every chunk's
// range is all-reduced across the data group.
TEST(PipelineDp, InterleavedMatchesOneProcess) {
    check_pipelines_match_one_process("interleaved", 0, true, 2);
}
// The tied embedding: its classifier gradient joins the first stage's inside each pipeline,
// then the data group sums it with the rest of stage 0's range.
TEST(PipelineDp, TiedGpt2WithZero1MatchesOneProcess) {
    check_pipelines_match_one_process("1f1b", 1, false);
}

// A checkpoint of pp 2 x dp D (all-reduced or ZeRO-1) resumes: in the same layout, continuing
// bitwise as the uninterrupted run; in one process and on one pipeline (pp 2 x dp 1, the job's
// first two ranks and its last two, each a job of its own), with the weights and every optimizer
// value read back bitwise as they were saved, continuing to the data-parallel tolerance.
void check_checkpoint_moves(int zero) {
    if (comm().size() % kStages != 0) GTEST_SKIP() << "needs an even number of ranks";
    const int steps = 6, cut = 3, r = comm().rank();
    const std::string name = "ppdp_ckpt_zero" + std::to_string(zero);
    const RunConfig c = ppdp_run(name, steps, "1f1b", zero);
    TrainOptions quiet;
    quiet.quiet = true;
    TrainSummary full;
    std::vector<float> full_params;
    {
        Trainer t(c, quiet, &comm());
        full = t.run();
        full_params = t.params();
    }
    RunConfig saving = c;
    saving.io.out_dir = c.io.out_dir + "_saved";
    std::vector<float> saved_params;
    std::vector<std::vector<float>> saved_opt;
    {
        TrainOptions o = quiet;
        o.stop_after = cut;
        Trainer t(saving, o, &comm());
        t.run();
        saved_params = t.params();
        saved_opt = gather_optimizer(t, zero == 1 && pipelines() > 1);
    }
    {  // the same layout: bitwise
        RunConfig rest = c;
        rest.io.out_dir = c.io.out_dir + "_same";
        TrainOptions o = quiet;
        o.resume = saving.io.out_dir;
        Trainer t(rest, o, &comm());
        EXPECT_EQ(optimizer_diff(t.engine().optimizer(), saved_opt), 0u) << name;
        const TrainSummary s = t.run();
        ASSERT_EQ(s.losses.size(), (std::size_t)(steps - cut));
        for (int i = 0; i < steps - cut; i++)
            EXPECT_EQ(s.losses[i], full.losses[cut + i]) << name << " step " << cut + i + 1;
        const std::vector<float> p = t.params();
        ASSERT_EQ(p.size(), full_params.size());
        EXPECT_EQ(std::memcmp(p.data(), full_params.data(), p.size() * 4), 0) << name;
    }
    {  // one process, on every rank
        TrainOptions o = quiet;
        o.resume = saving.io.out_dir;
        Trainer t(pipelines_as_one_process(c, "one"), o);
        const std::vector<float> p = t.params();
        ASSERT_EQ(p.size(), saved_params.size());
        EXPECT_EQ(std::memcmp(p.data(), saved_params.data(), p.size() * 4), 0) << name;
        EXPECT_EQ(optimizer_diff(t.engine().optimizer(), saved_opt), 0u) << name;
        const TrainSummary s = t.run();  // before the parameters are read
        expect_near_run(s, t.params(), full, full_params, cut, name + " in one process");
    }
    if (pipelines() < 2) return;
    // One pipeline: the job cut into jobs of two ranks, each resuming on its own.
    const std::unique_ptr<Communicator> half = comm().split(r / kStages, r, "half of the job");
    RunConfig one_pipe = c;
    one_pipe.train.micro_batch_size = c.train.micro_batch_size * pipelines();
    one_pipe.io.out_dir = c.io.out_dir + "_pipe" + std::to_string(r / kStages);
    TrainOptions o = quiet;
    o.resume = saving.io.out_dir;
    Trainer t(one_pipe, o, half.get());
    EXPECT_EQ(pipeline_engine(t).replicas(), 1);
    const std::vector<float> p = t.params();
    ASSERT_EQ(p.size(), saved_params.size());
    EXPECT_EQ(std::memcmp(p.data(), saved_params.data(), p.size() * 4), 0) << name;
    EXPECT_EQ(optimizer_diff(t.engine().optimizer(), saved_opt), 0u) << name;
    const TrainSummary s = t.run();  // before the parameters are read
    expect_near_run(s, t.params(), full, full_params, cut, name + " on one pipeline");
}

TEST(PipelineDp, CheckpointsMoveBetweenLayouts) {
    check_checkpoint_moves(0);
}
TEST(PipelineDp, Zero1CheckpointsMoveBetweenLayouts) {
    check_checkpoint_moves(1);
}

// The mesh's groups: a sum inside each, and a message along a pipeline, with the ranks the
// layout names.
TEST(PipelineDp, MeshGroupsAreTheLayoutsRanks) {
    if (comm().size() % kStages != 0) GTEST_SKIP() << "needs an even number of ranks";
    const MeshLayout mesh{kStages, pipelines()};
    const int r = comm().rank();
    MeshGroups g = split_mesh(comm(), mesh);
    EXPECT_EQ(g.stages->size(), kStages);
    EXPECT_EQ(g.data->size(), mesh.dp);
    EXPECT_EQ(mesh.stage_group(mesh.replica_of(r)).at(g.stages->rank()), r);
    EXPECT_EQ(mesh.data_group(mesh.stage_of(r)).at(g.data->rank()), r);
    float x = (float)(r + 1);
    g.stages->all_reduce_sum(&x, 1);
    float want = 0;
    for (int q : mesh.stage_group(mesh.replica_of(r))) want += (float)(q + 1);
    EXPECT_EQ(x, want);
    float y = (float)(r + 1);
    g.data->all_reduce_sum(&y, 1);
    want = 0;
    for (int q : mesh.data_group(mesh.stage_of(r))) want += (float)(q + 1);
    EXPECT_EQ(y, want);
    float msg = (float)r;
    if (g.stages->rank() == 0) g.stages->send(&msg, 1, 1, 7);
    if (g.stages->rank() == 1) {
        g.stages->recv(&msg, 1, 0, 7);
        EXPECT_EQ(msg, (float)(r - 1));
    }
}

TEST(PipelineDp, BadLayoutsAreRefused) {
    if (comm().size() % kStages != 0) GTEST_SKIP() << "needs an even number of ranks";
    const RunConfig c = ppdp_run("ppdp_bad", 1, "1f1b", 0);
    const auto refused = &expect_refused;
    for (int z : {2, 3}) {
        RunConfig zero = c;
        zero.train.zero_stage = z;
        refused(zero, "only ZeRO-1 is built");
    }
    RunConfig uneven = c;
    uneven.train.batch_size = 2 * pipelines() * 3 + 2;  // not a multiple of 2 rows x D pipelines
    if (pipelines() > 1) refused(uneven, "must be a multiple of train.micro_batch_size");
    RunConfig zero1_chunks = c;
    zero1_chunks.train.zero_stage = 1;
    zero1_chunks.train.pp_schedule = "interleaved";
    zero1_chunks.train.pp_virtual = 2;
    zero1_chunks.train.batch_size = 2 * pipelines() * 4;
    refused(zero1_chunks, "ZeRO-1 across pipelines shards one chunk per rank");
    RunConfig odd = c;
    odd.train.pp = comm().size() + 1;
    odd.model.n_layer = 8;
    refused(odd, "does not divide");
}

}  // namespace
}  // namespace memtrain::dist
