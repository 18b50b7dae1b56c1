// Compressed optimizer states (optim.state_format bf16, int8, int4) under mpirun (2 and 4 ranks):
// ZeRO 1, 2 and 3 train as one process does, each rank holds exactly the state bytes its shard
// (cut on the 256 grain) prices, the plan's memory rows are the engine's, a checkpoint resumes
// bitwise at the same world size and in one process, and pipelines side by side with ZeRO-1
// across them keep the same promises.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "mpi/dist_runs.h"
#include "optim/optimizer.h"
#include "parallel/data/tensor_gather.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

// The shared tiny run widened to 64 so its matrices and embedding (>= 4096 elements) are
// stored compressed, while gains, biases and the position embedding keep fp32.
RunConfig wide_run(const std::string& name, int steps, const std::string& format) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.model.n_embd = 64;
    c.model.n_head = 4;
    c.io.save_final = false;
    c.train.eval_every = 5;
    c.optim.state_format = format;
    return c;
}

// `c` as every rank runs it on its own, in its own out_dir: one process with micro-batches of
// `micro` rows (the job's global batch), no pipeline and no ZeRO.
RunConfig as_one_process(RunConfig c, int micro) {
    c.train.pp = 1;
    c.train.zero_stage = 0;
    c.train.micro_batch_size = micro;
    c.io.out_dir += "_one" + std::to_string(comm().rank());
    return c;
}

std::vector<float> run_losses(const RunConfig& c, Communicator* on, int stop_after = -1,
                              const std::string& resume = "") {
    TrainOptions o;
    o.quiet = true;
    o.stop_after = stop_after;
    o.resume = resume;
    Trainer t(c, o, on);
    return t.run().losses;
}

TEST(StateFormatDist, ZeroStagesTrainAsOneProcessWithTheirShardsBytes) {
    const int N = comm().size(), b = 2, steps = 8;
    for (const char* format : {"bf16", "int8", "int4"}) {
        for (int stage : {1, 2, 3}) {
            const std::string what = std::string(format) + " zero" + std::to_string(stage);
            RunConfig c =
                wide_run(std::string("sfd_") + format + std::to_string(stage), steps, format);
            c.train.batch_size = N * b;
            const std::vector<float> ref = run_losses(as_one_process(c, N * b), nullptr);

            c.train.micro_batch_size = b;
            c.train.zero_stage = stage;
            TrainOptions quiet;
            quiet.quiet = true;
            Trainer t(c, quiet, &comm());
            const std::vector<float> losses = t.run().losses;
            ASSERT_EQ(losses.size(), ref.size()) << what;
            // The tolerance the fp32 state meets (zero_test): the sums' order differs, and a
            // moment that lands on a code boundary may round the other way. With int4's 16 codes
            // such a flip moves its update by a whole code step: 5e-5 there (the sanitizer
            // build's code generation measured 1.1e-5 relative at step 7).
            const double tol = std::string(format) == "int4" ? 5e-5 : 1e-5;
            for (std::size_t i = 0; i < ref.size(); i++)
                EXPECT_NEAR(losses[i], ref[i], tol * std::abs(ref[i])) << what << " step " << i;

            // This rank's optimizer state, in bytes, is its grain-cut shard's price.
            const ParamLayout& layout = t.model().layout();
            const StateFormat f = parse_state_format(format);
            const ShardRange mine = grain_shard_ranges(0, (int64_t)layout.total, N,
                                                       (int64_t)shard_grain(f))[comm().rank()];
            if (f != StateFormat::Bf16) {
                EXPECT_EQ(mine.offset % 256, 0) << what;
            }
            const MemoryStats m = host_memory().snapshot();
            EXPECT_EQ(m[MemCategory::OptimizerState],
                      optimizer_state_bytes(c.optim, layout, (std::size_t)mine.offset,
                                            (std::size_t)mine.count))
                << what;
            EXPECT_LT(m[MemCategory::OptimizerState], 8 * (std::size_t)mine.count) << what;
            expect_planned_rows_are_the_engines(t, what);
        }
    }
}

TEST(StateFormatDist, ACheckpointResumesBitwiseAndInOneProcess) {
    const int N = comm().size(), steps = 10, cut = 5;
    RunConfig c = wide_run("sfd_resume", steps, "int8");
    c.train.batch_size = 2 * N;
    c.train.micro_batch_size = 2;
    c.train.zero_stage = 2;
    const std::string base = c.io.out_dir;
    c.io.out_dir = base + "_whole";
    const std::vector<float> whole = run_losses(c, &comm());
    c.io.out_dir = base + "_split";
    run_losses(c, &comm(), cut);
    const std::vector<float> rest = run_losses(c, &comm(), -1, c.io.out_dir);
    ASSERT_EQ(rest.size(), (std::size_t)(steps - cut));
    for (int i = 0; i < steps - cut; i++)
        EXPECT_EQ(rest[i], whole[cut + i]) << "resumed at world " << N << ", step " << cut + i + 1;

    // One process picks up the same checkpoint (the shards' files, read as one range).
    const std::vector<float> single =
        run_losses(as_one_process(c, 2 * N), nullptr, -1, c.io.out_dir + "/ckpt_000005");
    ASSERT_EQ(single.size(), (std::size_t)(steps - cut));
    for (int i = 0; i < steps - cut; i++)
        EXPECT_NEAR(single[i], whole[cut + i], 1e-5 * std::abs(whole[cut + i]))
            << "one process from the world-" << N << " checkpoint, step " << cut + i + 1;
    comm().barrier();
}

TEST(StateFormatDist, PipelinesSideBySideShardTheirStagesOnTheGrain) {
    const int N = comm().size();
    if (N % 2 != 0) GTEST_SKIP() << "two pipeline stages need an even world";
    RunConfig c = wide_run("sfd_pipe", 6, "int8");
    c.model.n_layer = 4;
    c.train.pp = 2;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * (N / 2) * 3;
    c.train.zero_stage = N / 2 > 1 ? 1 : 0;
    TrainOptions quiet;
    quiet.quiet = true;
    Trainer t(c, quiet, &comm());
    const std::vector<float> losses = t.run().losses;
    expect_planned_rows_are_the_engines(t, "int8 pp 2");

    const std::vector<float> ref = run_losses(as_one_process(c, 2 * (N / 2)), nullptr);
    ASSERT_EQ(losses.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); i++)
        EXPECT_NEAR(losses[i], ref[i], 1e-5 * std::abs(ref[i])) << "int8 pp 2, step " << i + 1;
}

// An optimizer that steps whole tensors (Muon's Newton-Schulz, Adafactor's factors and RMS) under
// DDP: every rank steps all of them on the all-reduced gradients and trains the one-process
// model (under ZeRO: the tests below).
void expect_whole_tensor_optimizer_under_ddp(const std::string& name, const std::string& format,
                                             double lr = 0) {
    const int N = comm().size(), b = 2;
    RunConfig c = wide_run("sfd_" + name, 6, format);
    c.optim.name = name;
    if (lr > 0) c.optim.lr = lr;  // (Adafactor's relative step wants a larger one)
    c.train.batch_size = N * b;
    const std::vector<float> ref = run_losses(as_one_process(c, N * b), nullptr);
    c.train.micro_batch_size = b;
    const std::vector<float> losses = run_losses(c, &comm());
    ASSERT_EQ(losses.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); i++)
        EXPECT_NEAR(losses[i], ref[i], 1e-5 * std::abs(ref[i])) << name << " ddp, step " << i + 1;
    EXPECT_LT(losses.back(), losses.front()) << name;
}

TEST(StateFormatDist, MuonUnderDdpTrainsAsOneProcess) {
    expect_whole_tensor_optimizer_under_ddp("muon", "int8");
}

TEST(StateFormatDist, AdafactorUnderDdpTrainsAsOneProcess) {
    expect_whole_tensor_optimizer_under_ddp("adafactor", "fp32", 0.1);
}

}  // namespace
}  // namespace memtrain::dist

namespace memtrain::dist {
namespace {

// Muon and Adafactor under ZeRO: a rank's shard holds the tensors inside it whole and pieces of
// the (at most two) tensors its edges cut; those are gathered whole among their holders, stepped
// on each, and each keeps its piece. From the same gradients, every rank's parameters and state
// are bitwise one process's (Muon in fp32 and int8 state); a state loaded as floats laid out like
// the parameters (a checkpoint of another layout) is whole again on every holder.
void expect_shards_step_as_one_process(const std::string& name, const std::string& format) {
    SCOPED_TRACE(name + " " + format);
    const int N = comm().size(), r = comm().rank();
    ModelConfig mc = test::tiny_model();
    mc.n_embd = 64;
    mc.n_head = 4;
    const ParamLayout l = make_param_layout(mc);
    OptimConfig cfg;
    cfg.name = name;
    cfg.state_format = format;
    const std::vector<ShardRange> shards =
        grain_shard_ranges(0, (int64_t)l.total, N, (int64_t)shard_grain(cfg));
    ShardTensorGather gather(l, comm(), shards, whole_step_tensors(cfg, l));
    // What makes this bite: some shard edge falls inside a tensor stepped whole.
    ASSERT_GT(gather.cut_tensors(), 0u);
    const std::size_t off = (std::size_t)shards[r].offset, n = (std::size_t)shards[r].count;
    auto one = make_optimizer(cfg, l);
    auto mine = make_optimizer(cfg, l, off, n, MemCategory::OptimizerState, &gather);
    std::vector<float> p(l.total), g(l.total);
    for (std::size_t i = 0; i < l.total; i++) p[i] = 0.02f * std::sin(0.37f * (float)i);
    std::vector<float> q(p.begin() + off, p.begin() + off + n);
    for (int step = 1; step <= 3; step++) {
        for (std::size_t i = 0; i < l.total; i++)
            g[i] = 0.01f * std::cos(0.11f * (float)i * (float)step + (float)step);
        one->step(p.data(), g.data(), 1e-3);
        mine->step(q.data(), g.data() + off, 1e-3);
    }
    EXPECT_EQ(0, std::memcmp(q.data(), p.data() + off, n * sizeof(float)));
    auto fresh = make_optimizer(cfg, l, off, n, MemCategory::OptimizerState, &gather);
    for (const std::string& s : one->state_names()) {
        std::vector<float> all(l.total), part(n);
        one->read_state(s, all.data());
        mine->read_state(s, part.data());
        EXPECT_EQ(0, std::memcmp(part.data(), all.data() + off, n * sizeof(float))) << s;
        fresh->write_state(s, 0, n, all.data() + off);
    }
    fresh->finish_writes();
    for (const std::string& s : one->state_names()) {
        std::vector<uint8_t> a(mine->stored_bytes(s)), b(fresh->stored_bytes(s));
        mine->save_stored(s, a.data());
        fresh->save_stored(s, b.data());
        EXPECT_EQ(a, b) << s << ": the state loaded as floats is not the stepped one";
    }
}

TEST(WholeTensorZero, ShardsStepBitwiseAsOneProcessFromTheSameGradients) {
    expect_shards_step_as_one_process("muon", "fp32");
    expect_shards_step_as_one_process("muon", "int8");
    expect_shards_step_as_one_process("adafactor", "fp32");
}

// Muon under DDP: each block matrix is orthogonalized by its owner and broadcast
// (dist::ReplicaMatrixShare). From the same gradients every replica's weights and state are
// bitwise one process's (the owner runs the same code on the same input), stepped whole or unit
// by unit (optim.step_in_backward's parts) and in int8 moments; the owners split the
// Newton-Schulz flops to within the largest matrix's.
TEST(WholeTensorZero, MuonUnderDdpSharesTheOrthogonalizations) {
    const int N = comm().size();
    ModelConfig mc = test::tiny_model();
    mc.n_embd = 64;
    mc.n_head = 4;
    const ParamLayout l = make_param_layout(mc);
    for (const char* format : {"fp32", "int8"}) {
        SCOPED_TRACE(format);
        OptimConfig cfg;
        cfg.name = "muon";
        cfg.state_format = format;
        const std::vector<char> matrices = muon_matrices(l);
        ReplicaMatrixShare share(l, matrices, comm());
        auto one = make_optimizer(cfg, l);
        auto mine = make_optimizer(cfg, l, 0, SIZE_MAX, MemCategory::OptimizerState, &share);
        std::vector<float> p(l.total), g(l.total);
        for (std::size_t i = 0; i < l.total; i++) p[i] = 0.02f * std::sin(0.37f * (float)i);
        std::vector<float> q = p;
        for (int step = 1; step <= 3; step++) {
            for (std::size_t i = 0; i < l.total; i++)
                g[i] = 0.01f * std::cos(0.11f * (float)i * (float)step + (float)step);
            one->step(p.data(), g.data(), 1e-3);
            if (step != 2) {
                mine->step(q.data(), g.data(), 1e-3);
                continue;
            }
            for (const ParamUnit& u : l.units)  // unit by unit, as the backward hands them over
                mine->step_part(q.data() + u.begin, g.data() + u.begin, 1e-3, u.begin, u.size());
            mine->advance();
        }
        EXPECT_EQ(0, std::memcmp(q.data(), p.data(), l.total * sizeof(float)));
        for (const std::string& s : one->state_names()) {
            std::vector<float> a(l.total), b(l.total);
            one->read_state(s, a.data());
            mine->read_state(s, b.data());
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), l.total * sizeof(float))) << s;
        }
        double largest = 0, total = 0;
        int owned = 0, count = 0;
        for (std::size_t i = 0; i < matrices.size(); i++) {
            if (!matrices[i]) continue;
            const double r = (double)std::min(l.tensors[i].shape[0], l.tensors[i].shape[1]);
            const double c = (double)std::max(l.tensors[i].shape[0], l.tensors[i].shape[1]);
            largest = std::max(largest, r * r * c + r * r * r);
            total += r * r * c + r * r * r;
            count++;
            owned += share.owner(i) == comm().rank();
            EXPECT_GE(share.owner(i), 0);
            EXPECT_LT(share.owner(i), N);
        }
        const auto& load = share.load();
        EXPECT_NEAR(std::accumulate(load.begin(), load.end(), 0.0), total, 1e-6 * total);
        EXPECT_LE(*std::max_element(load.begin(), load.end()) -
                      *std::min_element(load.begin(), load.end()),
                  largest);
        if (N > 1) {
            EXPECT_LT(owned, count) << "some matrix is another rank's";
        }
    }
}

// ZeRO 1-3 train as one process does (the fp32 state's tolerance: the gradient sums' order
// differs), the step inside the backward is bitwise the two-phase step at the same stage, a
// checkpoint resumes bitwise at the same world size and, read as floats, in one process.
void expect_zero_stages_train_as_one_process(const std::string& name, const std::string& format,
                                             double lr) {
    const int N = comm().size(), b = 2, steps = 6, cut = 3;
    RunConfig c = wide_run(name + "_zero", steps, format);
    c.optim.name = name;
    if (lr > 0) c.optim.lr = lr;
    c.train.batch_size = N * b;
    const std::vector<float> ref = run_losses(as_one_process(c, N * b), nullptr);
    c.train.micro_batch_size = b;
    for (int stage : {1, 2, 3}) {
        const std::string what = name + " zero" + std::to_string(stage);
        RunConfig z = c;
        z.train.zero_stage = stage;
        z.io.out_dir += std::to_string(stage);
        const std::vector<float> losses = run_losses(z, &comm());
        ASSERT_EQ(losses.size(), ref.size()) << what;
        for (std::size_t i = 0; i < ref.size(); i++)
            EXPECT_NEAR(losses[i], ref[i], 1e-5 * std::abs(ref[i])) << what << " step " << i;
        EXPECT_LT(losses.back(), losses.front()) << what;
        if (stage != 3) continue;
        RunConfig sib = z;
        sib.optim.step_in_backward = true;
        sib.io.out_dir += "_sib";
        EXPECT_EQ(run_losses(sib, &comm()), losses) << what << " step in backward";
        RunConfig split = z;
        split.io.out_dir += "_split";
        run_losses(split, &comm(), cut);
        const std::vector<float> rest = run_losses(split, &comm(), -1, split.io.out_dir);
        ASSERT_EQ(rest.size(), (std::size_t)(steps - cut));
        for (int i = 0; i < steps - cut; i++)
            EXPECT_EQ(rest[i], losses[cut + i]) << what << " resumed, step " << cut + i + 1;
        const std::vector<float> single =
            run_losses(as_one_process(split, N * b), nullptr, -1,
                       split.io.out_dir + "/ckpt_00000" + std::to_string(cut));
        ASSERT_EQ(single.size(), (std::size_t)(steps - cut));
        for (int i = 0; i < steps - cut; i++)
            EXPECT_NEAR(single[i], losses[cut + i], 1e-5 * std::abs(losses[cut + i]))
                << what << " in one process from the world-" << N << " checkpoint";
    }
    comm().barrier();
}

TEST(WholeTensorZero, MuonStagesTrainAsOneProcessAndResume) {
    expect_zero_stages_train_as_one_process("muon", "int8", 0);
}

TEST(WholeTensorZero, AdafactorStagesTrainAsOneProcessAndResume) {
    expect_zero_stages_train_as_one_process("adafactor", "fp32", 0.1);
}

}  // namespace
}  // namespace memtrain::dist
