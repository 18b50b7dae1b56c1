// PipeDream (weight stashing) and PipeDream-2BW (double-buffered weights) on 2 and 4 ranks, one
// stage each, against one process that does the same arithmetic with explicit version
// bookkeeping:
// - PipeDream: micro-batch by micro-batch, F and B of each (stage, micro-batch) ran on the same
//   weights (the same version and the same bits), that version is pp::pipedream_version(p, s, i)
//   plus m per earlier step, a stage never holds more than p - s versions (and does hold p - s
//   once m >= 2 (p - 1)), the stash's bytes are the prediction, and after every step the stage's
//   weights are bitwise those of the reference: for each micro-batch in order, the whole model's
//   gradient at the versions its stages used, then one optimizer step of the newest weights.
// - 2BW: every step's forwards and backwards ran on W(t - 1), two versions, and the weights
//   after every step are bitwise those of a one-process step that accumulates the gradient at
//   W(t - 1) and applies it (clipped by the global norm) to W(t).
// Bitwise because each stage runs the same kernels on the same inputs as the one process (the
// pipeline tests show the gradients equal), and the optimizers are elementwise, so a stage's
// range update is the whole model's update restricted to it. A tied embedding (2BW only) sums
// its two gradient parts in another order: to rounding.
#include <gtest/gtest.h>

#include <memory>

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "mpi/dist_runs.h"
#include "parallel/pipeline/schedule.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

RunConfig pipedream_run(const std::string& name, const std::string& schedule, bool tied, int m) {
    RunConfig c = shared_tiny_run_config(name, 1);
    c.model.n_layer = 4;  // one block per stage at 4 ranks
    c.io.save_final = false;
    c.train.micro_batch_size = 2;
    c.train.batch_size = 2 * m;
    c.train.pp_schedule = schedule;
    if (!tied) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
    }
    return c;
}

// The micro-batch (step, i)'s tokens and targets: the same on every rank.
void tokens(int step, int i, int n, int vocab, std::vector<int32_t>& x, std::vector<int32_t>& y) {
    x.resize((std::size_t)n);
    y.resize((std::size_t)n);
    uint32_t h = 2654435761u * (uint32_t)(step * 97 + i + 1);
    for (int k = 0; k < n; k++) {
        h = h * 1664525u + 1013904223u;
        x[k] = (int32_t)((h >> 8) % (uint32_t)vocab);
        h = h * 1664525u + 1013904223u;
        y[k] = (int32_t)((h >> 8) % (uint32_t)vocab);
    }
}

// A pipeline run of `c` over comm() (train.pp = P) and its one-process reference (the rows of
// one pipeline's m micro-batches of 2, no ZeRO), built before either trains.
struct PipelineAndReference {
    std::unique_ptr<Trainer> ref, run;
    CpuEngine* pe = nullptr;
    PipelineAndReference(RunConfig c, int P, int m) {
        TrainOptions quiet;
        quiet.quiet = true;
        RunConfig rc = c;
        rc.io.out_dir += "_ref" + std::to_string(comm().rank());
        rc.train.batch_size = 2 * m;
        rc.train.zero_stage = 0;
        ref = std::make_unique<Trainer>(rc, quiet);
        c.train.pp = P;
        run = std::make_unique<Trainer>(c, quiet, &comm());
        pe = dynamic_cast<CpuEngine*>(&run->engine());
    }
};

double lr_of(int step) {
    return 1e-3 * (1.0 + 0.5 * step);  // a different learning rate every step
}

// Every stage's floats [begin, end) of the flat parameter buffer (each rank owns one range).
std::vector<std::array<uint64_t, 2>> stage_ranges(CpuEngine& pe) {
    const pp::StageStore::Range& r = pe.stage_store().ranges().at(0);
    std::array<uint64_t, 2> mine = {r.begin, r.end};
    std::vector<std::array<uint64_t, 2>> all((std::size_t)comm().size());
    comm().all_gather_bytes(mine.data(), all.data(), sizeof(mine));
    return all;
}

std::size_t count_diffs(const float* a, const float* b, std::size_t n) {
    std::size_t d = 0;
    for (std::size_t j = 0; j < n; j++) d += a[j] != b[j];
    return d;
}

// dp pipelines side by side (train.zero_stage = zero across them) are fed the same micro-batches
// with 1/dp of the gradient scale: each replica's gradient is exactly half the one process's
// (scaling by a power of two commutes with rounding), so their sum is exactly it, and the run is
// still bitwise the reference.
void check_pipedream(const std::string& remat, int steps, int dp = 1, int zero = 0) {
    const int P = comm().size() / dp, m = 2 * P;
    RunConfig c =
        pipedream_run(fmt::format("pipedream_{}_dp{}_z{}", remat, dp, zero), "pipedream", false, m);
    c.optim.grad_clip = 0;  // refused with PipeDream
    c.train.remat = remat;
    c.train.batch_size *= dp;
    c.train.zero_stage = zero;
    PipelineAndReference runs(c, P, m);
    Trainer &ref = *runs.ref, &t = *runs.run;
    CpuEngine* pe = runs.pe;
    ASSERT_NE(pe, nullptr);
    ASSERT_EQ(pe->replicas(), dp);
    const int r = pe->stage();
    pe->weight_versions().hash_weights(true);
    const std::vector<float> init = t.params();
    GPT& rm = ref.model();
    Engine& re = ref.engine();
    const std::size_t N = rm.num_params();
    ASSERT_EQ(init.size(), N);
    ASSERT_EQ(count_diffs(init.data(), rm.params(), N), 0u) << "the same initial weights";
    const auto ranges = stage_ranges(*pe);
    const std::size_t own = pe->stage_store().count();
    ASSERT_EQ(own, ranges[r][1] - ranges[r][0]);

    const int B = c.micro_batch(), T = c.train.seq_len, V = c.model.vocab_size;
    const float scale = 1.0f / (float)(B * T * m * dp);  // as the Trainer passes it
    const float ref_scale = 1.0f / (float)(B * T * m);
    // hist[k]: the whole model after k updates (each stage applies one per micro-batch).
    std::vector<std::vector<float>> hist = {init};
    std::vector<int32_t> x, y;
    for (int step = 0; step < steps; step++) {
        pe->begin_step();
        for (int i = 0; i < m; i++) {
            tokens(step, i, B * T, V, x, y);
            pe->forward_backward(x.data(), y.data(), B, T, scale, i == m - 1);
        }
        const StepResult res = pe->finish_step(lr_of(step), 0);
        EXPECT_TRUE(std::isfinite(res.loss));
        // The reference: micro-batch i's gradient at each stage's stashed version, applied to the
        // newest weights as one step of one micro-batch.
        for (int i = 0; i < m; i++) {
            for (int s = 0; s < P; s++) {
                const std::vector<float>& w =
                    hist[(std::size_t)step * m + pp::pipedream_version(P, s, i)];
                std::copy(w.begin() + (long)ranges[s][0], w.begin() + (long)ranges[s][1],
                          rm.params() + ranges[s][0]);
            }
            tokens(step, i, B * T, V, x, y);
            re.begin_step();
            re.forward_backward(x.data(), y.data(), B, T, ref_scale * (float)m, true);
            std::copy(hist.back().begin(), hist.back().end(), rm.params());
            re.finish_step(lr_of(step), 0);
            hist.emplace_back(rm.params(), rm.params() + N);
        }
        // Micro-batch by micro-batch: F and B on the same version and bits, the predicted one.
        const auto& used = pe->weight_versions().used();
        ASSERT_EQ((int)used.size(), m);
        for (int i = 0; i < m; i++) {
            const int64_t want = (int64_t)step * m + pp::pipedream_version(P, r, i);
            EXPECT_EQ(used[i].forward, want) << "stage " << r << " step " << step << " mb " << i;
            EXPECT_EQ(used[i].backward, used[i].forward) << "stage " << r << " mb " << i;
            EXPECT_EQ(used[i].backward_hash, used[i].forward_hash) << "stage " << r << " mb " << i;
        }
        // The hashes tell versions apart: the step's first and last forward ran on different
        // versions (m = 2p) and weights.
        EXPECT_NE(used[0].forward, used[m - 1].forward);
        EXPECT_NE(used[0].forward_hash, used[m - 1].forward_hash);
        EXPECT_EQ(pe->weight_versions().version(), (int64_t)(step + 1) * m);
        // The stage's weights after the step: bitwise the reference's.
        const std::vector<float>& want = hist.back();
        EXPECT_EQ(count_diffs(pe->stage_store().owned_params(), want.data() + ranges[r][0], own),
                  0u)
            << "stage " << r << " after step " << step + 1 << " (remat " << remat << ")";
    }
    // The stages of one micro-batch ran on different versions (stage 0's last micro-batch on
    // m - p, stage p - 1's on m - 1): the reference is not synchronous training.
    if (P > 1) {
        EXPECT_NE(pp::pipedream_version(P, 0, m - 1), pp::pipedream_version(P, P - 1, m - 1));
    }
    // Versions alive: at most p - s, and p - s is reached (m >= 2 (p - 1)); their bytes.
    EXPECT_EQ(pe->weight_versions().peak_live(), pp::pipedream_versions(P, r));
    EXPECT_EQ(pe->weight_versions().bytes(), pe->weight_versions().predicted_bytes());
    EXPECT_EQ(pe->weight_versions().bytes(), 4 * own * (std::size_t)(P - r - 1));
    bool row = false;
    for (const MemoryPrediction& p : pe->predicted_memory(B, T))
        if (p.category == MemCategory::Parameters) {
            row = true;
            EXPECT_EQ(p.bytes, 4 * own + pe->weight_versions().predicted_bytes());
            EXPECT_NE(p.formula.find("stashed weight version"), std::string::npos) << p.formula;
        }
    EXPECT_TRUE(row);
}

TEST(PipeDream, WeightStashingMatchesDelayedUpdateReference) {
    check_pipedream("none", 3);
}

TEST(PipeDream, WeightStashingWithFullRecomputeMatchesReference) {
    check_pipedream("full", 2);
}

// A rebuilt block input (each stage keeps its first; at 2 ranks the second block's is rebuilt)
// re-runs the blocks below with the micro-batch's stashed weights, as a recompute does.
TEST(PipeDream, WeightStashingWithRebuiltInputsMatchesReference) {
    check_pipedream("memory-poor", 2);
}

void check_two_bw(bool tied, double clip, int steps, int dp = 1, int zero = 0,
                  const std::string& remat = "none") {
    const int P = comm().size() / dp, m = P + 1;
    RunConfig c = pipedream_run(fmt::format("pipedream2bw_{}_dp{}_z{}_{}", tied, dp, zero, remat),
                                "pipedream-2bw", tied, m);
    c.optim.grad_clip = clip;
    c.train.remat = remat;
    c.train.batch_size *= dp;
    c.train.zero_stage = zero;
    PipelineAndReference runs(c, P, m);
    Trainer &ref = *runs.ref, &t = *runs.run;
    CpuEngine* pe = runs.pe;
    ASSERT_NE(pe, nullptr);
    ASSERT_EQ(pe->replicas(), dp);
    const int r = pe->stage();
    pe->weight_versions().hash_weights(true);
    GPT& rm = ref.model();
    Engine& re = ref.engine();
    const std::size_t N = rm.num_params();
    const std::vector<float> init = t.params();
    ASSERT_EQ(count_diffs(init.data(), rm.params(), N), 0u) << "the same initial weights";
    const auto ranges = stage_ranges(*pe);
    const std::size_t own = pe->stage_store().count();
    const int B = c.micro_batch(), T = c.train.seq_len, V = c.model.vocab_size;
    const float scale = 1.0f / (float)(B * T * m * dp), ref_scale = 1.0f / (float)(B * T * m);
    std::vector<float> prev = init;  // W(t - 1), W(-1) = W(0)
    std::vector<int32_t> x, y;
    uint64_t last_hash = 0;  // of the shadow the previous step ran on
    for (int step = 0; step < steps; step++) {
        pe->begin_step();
        for (int i = 0; i < m; i++) {
            tokens(step, i, B * T, V, x, y);
            pe->forward_backward(x.data(), y.data(), B, T, scale, i == m - 1);
        }
        const StepResult res = pe->finish_step(lr_of(step), clip);
        // The reference: the gradient at W(t - 1), clipped, applied to W(t).
        std::vector<float> cur(rm.params(), rm.params() + N);
        std::copy(prev.begin(), prev.end(), rm.params());
        re.begin_step();
        for (int i = 0; i < m; i++) {
            tokens(step, i, B * T, V, x, y);
            re.forward_backward(x.data(), y.data(), B, T, ref_scale, i == m - 1);
        }
        std::copy(cur.begin(), cur.end(), rm.params());
        const StepResult rres = re.finish_step(lr_of(step), clip);
        prev = cur;
        if (tied) {
            EXPECT_NEAR(res.loss, rres.loss, 1e-5 * std::abs(rres.loss));
        } else {
            EXPECT_EQ(res.loss, rres.loss) << "step " << step + 1;
            if (zero == 0) {
                EXPECT_EQ(res.grad_norm, rres.grad_norm) << "step " << step + 1;
            } else {  // ZeRO-1 adds the norm's squares shard by shard
                EXPECT_NEAR(res.grad_norm, rres.grad_norm, 1e-6 * rres.grad_norm);
            }
        }
        const auto& used = pe->weight_versions().used();
        ASSERT_EQ((int)used.size(), m);
        for (int i = 0; i < m; i++) {
            EXPECT_EQ(used[i].forward, std::max(0, step - 1)) << "stage " << r << " mb " << i;
            EXPECT_EQ(used[i].backward, used[i].forward);
            EXPECT_EQ(used[i].backward_hash, used[i].forward_hash);
        }
        if (step >= 2) {  // a new shadow every step once W(1) exists
            EXPECT_NE(used[0].forward_hash, last_hash) << "step " << step + 1;
        }
        last_hash = used[0].forward_hash;
        EXPECT_EQ(pe->weight_versions().version(), step + 1);
        const float* got = pe->stage_store().owned_params();
        const float* want = rm.params() + ranges[r][0];
        if (!tied) {
            EXPECT_EQ(count_diffs(got, want, own), 0u) << "stage " << r << " step " << step + 1;
        } else {
            double worst = 0;
            for (std::size_t j = 0; j < own; j++)
                worst = std::max(worst, (double)std::abs(got[j] - want[j]));
            EXPECT_LT(worst, 1e-6) << "stage " << r << " step " << step + 1;
        }
    }
    EXPECT_EQ(pe->weight_versions().peak_live(), 2);
    EXPECT_EQ(pe->weight_versions().bytes(), pe->weight_versions().predicted_bytes());
    EXPECT_EQ(pe->weight_versions().bytes(), 4 * (own + pe->stage_store().mirror_size()));
}

TEST(PipeDream, TwoBWMatchesOneStepStaleReference) {
    check_two_bw(false, 1.0, 4);
}

TEST(PipeDream, TwoBWWithSelectiveRecomputeMatchesOneStepStaleReference) {
    check_two_bw(false, 1.0, 3, 1, 0, "selective");
}
TEST(PipeDream, TwoBWWithRebuiltInputsMatchesOneStepStaleReference) {
    check_two_bw(false, 1.0, 3, 1, 0, "chen:2");
}

TEST(PipeDream, TwoBWTiedGpt2MatchesOneStepStaleReferenceToRounding) {
    check_two_bw(true, 1.0, 3);
}

// Two pipelines of P / 2 stages (at 4 ranks): gradients all-reduced across them, or ZeRO-1.
TEST(PipeDream, SideBySideWeightStashingMatchesReference) {
    if (comm().size() < 4) GTEST_SKIP() << "needs 2 pipelines of at least 2 stages";
    check_pipedream("none", 2, 2, 0);
    check_pipedream("none", 2, 2, 1);
}

TEST(PipeDream, SideBySideTwoBWMatchesReference) {
    if (comm().size() < 4) GTEST_SKIP() << "needs 2 pipelines of at least 2 stages";
    check_two_bw(false, 1.0, 3, 2, 0);
    check_two_bw(false, 0, 3, 2, 1);  // ZeRO-1's norm adds shards in another order: no clipping
}

// Through the Trainer (PipeDream runs its schedule in finish_step, with the step's lr): losses
// finite, every stage at m versions per step, and the measured-bubble footer.
TEST(PipeDream, TrainerRunsBothSchedules) {
    const int P = comm().size();
    for (const char* name : {"pipedream", "pipedream-2bw"}) {
        const std::string sched = name;
        RunConfig c = pipedream_run("pipedream_trainer_" + sched, sched, false, 2 * P);
        c.train.max_steps = 3;
        c.train.eval_every = 0;
        c.optim.grad_clip = sched == "pipedream" ? 0 : 1;
        c.train.pp = P;
        TrainOptions quiet;
        quiet.quiet = true;
        Trainer t(c, quiet, &comm());
        const TrainSummary sum = t.run();
        ASSERT_EQ(sum.losses.size(), 3u);
        for (double l : sum.losses) EXPECT_TRUE(std::isfinite(l)) << sched;
        auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
        ASSERT_NE(pe, nullptr);
        EXPECT_EQ(pe->weight_versions().version(), sched == "pipedream" ? 3 * 2 * P : 3) << sched;
        EXPECT_NE(pe->memory_footer().find("pipeline bubble: measured"), std::string::npos)
            << sched;
        // Measured = predicted, the weight versions included (the only trainer alive here).
        const MemoryStats ms = host_memory().snapshot();
        for (const MemoryPrediction& p : pe->predicted_memory(c.micro_batch(), c.train.seq_len))
            if (p.category != MemCategory::Workspace) {
                EXPECT_EQ(ms[p.category], p.bytes) << category_name(p.category) << " " << sched;
            }
        if (sched == "pipedream-2bw" || pe->stage() < P - 1) {  // PipeDream's last stage: none
            EXPECT_GT(pe->weight_versions().bytes(), 0u) << sched;
        }
    }
}

// Checkpoints. PipeDream drains every step, so its checkpoint (weights, optimizer state and step
// count) resumes exactly: the run cut after 2 of 5 steps and resumed ends bitwise where the
// uninterrupted run does, at the same weight version. 2BW's shadow is not saved, so the resumed
// run restarts it from the loaded weights: it equals an uninterrupted run whose shadow is
// restarted at the same step (and differs from one whose shadow is not).
TEST(PipeDream, CheckpointsResume) {
    const int P = comm().size(), steps = 5, cut = 2;
    for (const char* name : {"pipedream", "pipedream-2bw"}) {
        const std::string sched = name;
        const bool pd = sched == "pipedream";
        RunConfig c = pipedream_run("pipedream_ckpt_" + sched, sched, false, 2 * P);
        c.train.max_steps = steps;
        c.train.eval_every = 0;
        c.optim.grad_clip = pd ? 0 : 1;
        c.train.pp = P;
        const std::string base = c.io.out_dir;
        TrainOptions quiet;
        quiet.quiet = true;
        auto run = [&](const std::string& dir, TrainOptions o) {
            RunConfig k = c;
            k.io.out_dir = base + dir;
            Trainer t(k, o, &comm());
            const TrainSummary sum = t.run();
            auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
            return std::make_tuple(sum, t.params(), pe ? pe->weight_versions().version() : -1);
        };
        TrainOptions restart = quiet;  // 2BW: the shadow restarted where the resume restarts it
        if (!pd)
            restart.before_step = [&](int64_t step, Engine& e) {
                if (step == cut + 1) e.weights_loaded();
            };
        const auto [all, all_params, all_version] = run("_all", restart);
        EXPECT_EQ(all_version, pd ? (int64_t)steps * 2 * P : steps) << sched;
        TrainOptions first = quiet;
        first.stop_after = cut;
        run("_cut", first);
        TrainOptions rest = quiet;
        rest.resume = base + "_cut";
        const auto [resumed, resumed_params, resumed_version] = run("_rest", rest);
        EXPECT_EQ(resumed_version, all_version) << sched;
        ASSERT_EQ(resumed.losses.size(), (std::size_t)(steps - cut));
        for (int i = 0; i < steps - cut; i++)
            EXPECT_EQ(resumed.losses[i], all.losses[cut + i]) << sched << " step " << cut + i + 1;
        EXPECT_EQ(count_diffs(resumed_params.data(), all_params.data(), all_params.size()), 0u)
            << sched;
        if (!pd) {  // without the restart the runs part: the resume is not exact for 2BW
            const auto [plain, plain_params, plain_version] = run("_plain", quiet);
            EXPECT_GT(count_diffs(plain_params.data(), all_params.data(), all_params.size()), 0u);
        }
    }
}

// PipeDream's stashes and 2BW's shadow are priced before anything is allocated: the plan's rows
// are what the built engine reports (the weight versions among the parameters), and a stage
// that cannot fit the host is refused before allocating, naming its stage.
TEST(PipeDream, WeightVersionsArePlannedAndAStageThatCannotFitIsRefused) {
    const int P = comm().size();
    for (const char* name : {"pipedream", "pipedream-2bw"}) {
        const std::string sched = name;
        RunConfig c = pipedream_run("pipedream_memory_" + sched, sched, false, 2 * P);
        c.optim.grad_clip = sched == "pipedream" ? 0 : 1;
        c.train.pp = P;
        {
            Trainer t(c, test::quiet(), &comm());
            const auto planned = expect_planned_rows_are_the_engines(t, sched);
            auto* pe = dynamic_cast<CpuEngine*>(&t.engine());
            ASSERT_NE(pe, nullptr);
            EXPECT_EQ(planned.at(0).bytes,
                      4 * (pe->stage_store().count() + pe->stage_store().mirror_size()) +
                          pe->weight_versions().predicted_bytes())
                << sched;
        }
        expect_refused_before_allocating(
            c, fmt::format("of host memory per rank on pipeline stage {}", comm().rank()));
    }
}

TEST(PipeDream, BadCombinationsAreRefused) {
    const int P = comm().size();
    const auto refused = &expect_refused;
    RunConfig c = pipedream_run("pipedream_refused", "pipedream", true, 2 * P);
    c.train.pp = P;
    c.optim.grad_clip = 0;
    refused(c, "set model.tied_embeddings = false");
    c = pipedream_run("pipedream_refused", "pipedream", false, 2 * P);
    c.train.pp = P;
    c.optim.grad_clip = 1;
    refused(c, "set optim.grad_clip = 0");
    c.optim.grad_clip = 0;
    c.train.pp_virtual = 2;
    refused(c, "train.pp_virtual = 2 needs train.pp_schedule = \"interleaved\"");
    if (P >= 4) {
        RunConfig few = c;  // 2BW at p = 4 with 2 micro-batches
        few.train.pp_virtual = 1;
        few.train.pp_schedule = "pipedream-2bw";
        few.train.batch_size = 2 * 2;
        refused(few, "needs at least train.pp - 1 = 3 micro-batches");
    }
}

}  // namespace
}  // namespace memtrain::dist
